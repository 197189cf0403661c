//! Small helpers shared by the tools: CPU accounting and number formatting.

use std::time::Duration;

/// User and system CPU time.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuTimes {
    pub user: Duration,
    pub sys: Duration,
}

fn tv(t: libc::timeval) -> Duration {
    Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
}

fn rusage(who: libc::c_int) -> CpuTimes {
    let mut ru: libc::rusage = zeroed_rusage();
    // SAFETY: getrusage writes into the rusage struct we own; `who` is a valid constant.
    let rc = unsafe { libc::getrusage(who, &mut ru) };
    if rc != 0 {
        return CpuTimes::default();
    }
    CpuTimes {
        user: tv(ru.ru_utime),
        sys: tv(ru.ru_stime),
    }
}

fn zeroed_rusage() -> libc::rusage {
    // SAFETY: rusage is a plain C struct of integers, for which all-zero is valid.
    unsafe { std::mem::zeroed() }
}

/// CPU time of the calling thread.
pub fn thread_cpu() -> CpuTimes {
    rusage(libc::RUSAGE_THREAD)
}

/// CPU time of the whole process.
pub fn process_cpu() -> CpuTimes {
    rusage(libc::RUSAGE_SELF)
}

impl std::ops::Sub for CpuTimes {
    type Output = CpuTimes;
    fn sub(self, o: CpuTimes) -> CpuTimes {
        CpuTimes {
            user: self.user.saturating_sub(o.user),
            sys: self.sys.saturating_sub(o.sys),
        }
    }
}

/// 2310000 → "2.31M".
pub fn si(v: f64) -> String {
    if v >= 1e9 {
        format!("{:.2}G", v / 1e9)
    } else if v >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if v >= 1e4 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

/// Parse a size for a CLI flag, with the library's rules.
pub fn size_arg(s: &str) -> Result<u64, String> {
    wbstack::dev::parse_size(s)
}

pub fn duration_arg(s: &str) -> Result<Duration, String> {
    // A bare number is seconds here, as in fio's --runtime.
    // Beyond what a Duration holds (1e20 s) is an error, not a panic.
    let too_long = |_| format!("{s:?} is longer than any run can be");
    if let Ok(secs) = s.parse::<f64>() {
        if secs >= 0.0 && secs.is_finite() {
            return Duration::try_from_secs_f64(secs).map_err(too_long);
        }
    }
    // Minutes and hours for long runs (soak): "10m", "2h".
    for (suffix, secs) in [("min", 60.0), ("m", 60.0), ("h", 3600.0)] {
        if let Some(n) = s.strip_suffix(suffix).and_then(|n| n.parse::<f64>().ok()) {
            if n >= 0.0 && n.is_finite() {
                return Duration::try_from_secs_f64(n * secs).map_err(too_long);
            }
        }
    }
    wbstack::dev::parse_duration(s).map(Duration::from_nanos)
}

/// Progress on stderr: rewritten in place on a terminal, one line per step otherwise
/// (so a log shows the steps without carriage-return clutter).
pub fn status(msg: &str) {
    use std::io::IsTerminal;
    if std::io::stderr().is_terminal() {
        eprint!("\r{msg:<70}");
    } else {
        eprintln!("{}", msg.trim());
    }
}

/// Erase the status line (terminals only).
pub fn status_done() {
    use std::io::IsTerminal;
    if std::io::stderr().is_terminal() {
        eprint!("\r{:70}\r", "");
    }
}

/// Every thread's stack of this process, from gdb attached to it for a moment: what a
/// hang report needs, since a thread stuck on a lock or a condition says nothing
/// itself. An error says why there are none (gdb missing, or it could not attach).
pub fn thread_stacks() -> Result<String, String> {
    let out = std::process::Command::new("gdb")
        .args(["-p", &std::process::id().to_string(), "-batch", "-nx"])
        .args(["-ex", "set pagination off", "-ex", "thread apply all bt 40"])
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("cannot run gdb: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if !text.contains("Thread ") {
        return Err(format!(
            "gdb printed no stacks ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::{duration_arg, thread_stacks};
    use std::sync::mpsc;
    use std::time::Duration;

    /// A thread parked in a function of a known name, for a stack dump to find.
    #[inline(never)]
    fn parked_for_the_stack_dump(rx: mpsc::Receiver<()>) {
        rx.recv().ok();
    }

    #[test]
    fn thread_stacks_show_where_another_thread_waits() {
        let (tx, rx) = mpsc::channel::<()>();
        let (up_tx, up_rx) = mpsc::channel::<()>();
        let t = std::thread::Builder::new()
            .name("parked-one".into())
            .spawn(move || {
                up_tx.send(()).unwrap();
                parked_for_the_stack_dump(rx)
            })
            .unwrap();
        up_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        let stacks = thread_stacks().expect("scripts/test installs gdb");
        tx.send(()).unwrap();
        t.join().unwrap();
        assert!(
            stacks.contains("parked_for_the_stack_dump"),
            "no stack of the parked thread in:\n{stacks}"
        );
    }

    #[test]
    fn durations_take_seconds_units_minutes_and_hours() {
        assert_eq!(duration_arg("2").unwrap(), Duration::from_secs(2));
        assert_eq!(duration_arg("150ms").unwrap(), Duration::from_millis(150));
        assert_eq!(duration_arg("10m").unwrap(), Duration::from_secs(600));
        assert_eq!(duration_arg("2h").unwrap(), Duration::from_secs(7200));
        assert!(duration_arg("10x").is_err());
        // Too long for a Duration: an error, not a panic.
        assert!(duration_arg("1e20").is_err());
        assert!(duration_arg("1e18m").is_err());
    }
}
