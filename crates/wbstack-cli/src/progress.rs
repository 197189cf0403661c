//! Progress of long work: a bar on a terminal (indicatif), plain lines in a log, never
//! both. A step that ends within two seconds prints nothing on a terminal; in a log its
//! start line names what ran, so a log reads as the list of steps.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use parking_lot::Mutex;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// How often a log gets a line for a step that is still running.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// Where progress goes: a terminal (bars), a log (lines) or nowhere (`--json` on a
/// terminal keeps the bars on stderr; quiet is for tests and nested tools).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sink {
    Terminal,
    Log,
    Quiet,
}

impl Sink {
    /// Bars when stderr is a terminal, lines otherwise.
    pub fn detect() -> Sink {
        if std::io::stderr().is_terminal() {
            Sink::Terminal
        } else {
            Sink::Log
        }
    }
}

/// One step of long work, `len` units long (files, bytes, seconds) or of unknown length.
pub struct Step {
    label: String,
    len: Option<u64>,
    unit: &'static str,
    bar: Option<ProgressBar>,
    log: Option<Mutex<LogState>>,
}

struct LogState {
    started: Instant,
    last: Instant,
}

impl Step {
    pub fn start(sink: Sink, label: &str, len: Option<u64>, unit: &'static str) -> Step {
        let bar = (sink == Sink::Terminal).then(|| {
            let b = match len {
                Some(n) => ProgressBar::with_draw_target(Some(n), ProgressDrawTarget::stderr()),
                None => ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr()),
            };
            let template = if len.is_some() {
                "{prefix:.bold} [{elapsed_precise}] {wide_bar} {human_pos}/{human_len} {msg} (eta {eta})"
            } else {
                "{prefix:.bold} [{elapsed_precise}] {spinner} {human_pos} {msg}"
            };
            // The templates are constants: a failure here is a programming error.
            b.set_style(ProgressStyle::with_template(template).expect("progress template"));
            b.set_prefix(label.to_string());
            b.set_message(unit);
            b.enable_steady_tick(Duration::from_millis(200));
            b
        });
        let log = (sink == Sink::Log).then(|| {
            eprintln!("{label}");
            let now = Instant::now();
            Mutex::new(LogState {
                started: now,
                last: now,
            })
        });
        Step {
            label: label.to_string(),
            len,
            unit,
            bar,
            log,
        }
    }

    /// Units done so far.
    pub fn set(&self, pos: u64) {
        if let Some(b) = &self.bar {
            b.set_position(pos);
        }
        if let Some(l) = &self.log {
            let mut l = l.lock();
            if l.last.elapsed() >= LOG_EVERY {
                l.last = Instant::now();
                let of = self.len.map(|n| format!(" of {n}")).unwrap_or_default();
                eprintln!(
                    "{}: {pos}{of} {} after {:.0} s",
                    self.label,
                    self.unit,
                    l.started.elapsed().as_secs_f64()
                );
            }
        }
    }
}

impl Drop for Step {
    fn drop(&mut self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

/// The spinner on the terminal now, if any: lines printed while it runs go above it.
static ACTIVE: Mutex<Option<ProgressBar>> = Mutex::new(None);

/// println! that keeps a running spinner on its own line (stdout and stderr share the
/// terminal; without this a table row would be glued to the spinner's text).
pub fn println(line: &str) {
    match ACTIVE.lock().as_ref() {
        Some(b) => b.suspend(|| println!("{line}")),
        None => println!("{line}"),
    }
}

/// A tool's running status, `line()` as it changes: a spinner with the line on a
/// terminal, the line every `every` in a log; stops when dropped.
pub struct Progress {
    stop: Option<std::sync::mpsc::Sender<()>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Progress {
    pub fn start(
        enabled: bool,
        every: Duration,
        line: impl Fn() -> String + Send + 'static,
    ) -> Progress {
        if !enabled {
            return Progress {
                stop: None,
                handle: None,
            };
        }
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let bar = (Sink::detect() == Sink::Terminal).then(|| {
            let b = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
            // A constant template: a failure here is a programming error.
            b.set_style(
                ProgressStyle::with_template("[{elapsed_precise}] {spinner} {msg}")
                    .expect("progress template"),
            );
            *ACTIVE.lock() = Some(b.clone());
            b
        });
        let tick = if bar.is_some() {
            Duration::from_millis(200)
        } else {
            every
        };
        let handle = std::thread::spawn(move || {
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(tick) {
                match &bar {
                    Some(b) => {
                        b.set_message(line());
                        b.tick();
                    }
                    None => eprintln!("{}", line()),
                }
            }
            if let Some(b) = bar {
                *ACTIVE.lock() = None;
                b.finish_and_clear();
            }
        });
        Progress {
            stop: Some(tx),
            handle: Some(handle),
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(h) = self.handle.take() {
            // A panicked progress thread loses a status line, not the run.
            if h.join().is_err() {
                eprintln!("progress: the status thread panicked");
            }
        }
    }
}

/// "1 min 20 s", "45 s": a duration for a plan printed up front.
pub fn human_secs(s: f64) -> String {
    let s = s.round() as u64;
    match s {
        0..=59 => format!("{s} s"),
        60..=3599 => format!("{} min {} s", s / 60, s % 60),
        _ => format!("{} h {} min", s / 3600, s % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quiet_step_takes_positions_and_finishes() {
        let s = Step::start(Sink::Quiet, "x", Some(10), "files");
        s.set(5);
        assert!(s.bar.is_none() && s.log.is_none());
        drop(s);
    }

    #[test]
    fn plans_read_in_seconds_minutes_and_hours() {
        assert_eq!(human_secs(45.2), "45 s");
        assert_eq!(human_secs(80.0), "1 min 20 s");
        assert_eq!(human_secs(7260.0), "2 h 1 min");
    }
}
