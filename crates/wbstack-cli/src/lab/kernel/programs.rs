//! Running the external programs of the kernel arms (fs_mark, fio, tar, dd, mkfs...):
//! installing them when missing, quoting their command lines for the report, and
//! parsing what they print.

use std::path::Path;
use std::process::{Command, Output, Stdio};

/// Whether `prog` is on PATH (or an executable path).
pub fn have(prog: &str) -> bool {
    if prog.contains('/') {
        return Path::new(prog).is_file();
    }
    std::env::var_os("PATH").is_some_and(|paths| {
        std::env::split_paths(&paths).any(|d| {
            let p = d.join(prog);
            p.is_file()
        })
    })
    // sbin is not on every PATH a test harness passes down.
    || ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
        .iter()
        .any(|d| Path::new(d).join(prog).is_file())
}

/// Make sure `prog` exists, installing the Debian package `pkg` with apt-get if not.
/// Says on stderr what it installs, since it changes the machine.
pub fn ensure(prog: &str, pkg: &str) -> Result<(), String> {
    if have(prog) {
        return Ok(());
    }
    if !have("apt-get") {
        return Err(format!(
            "{prog} missing and there is no apt-get to install {pkg}"
        ));
    }
    eprintln!("lab --kernel: {prog} missing: installing {pkg} with apt-get");
    let update = Command::new("apt-get")
        .args(["update", "-qq"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("apt-get update: {e}"))?;
    if !update.status.success() {
        // A stale index can still hold the package: go on and let install decide.
        eprintln!(
            "lab --kernel: apt-get update failed ({}); trying the install anyway",
            tail(&update.stderr)
        );
    }
    let out = Command::new("apt-get")
        .args(["install", "-y", "-qq", pkg])
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("apt-get install {pkg}: {e}"))?;
    if !out.status.success() || !have(prog) {
        return Err(format!(
            "{prog} missing and apt-get install {pkg} failed: {}",
            tail(&out.stderr)
        ));
    }
    eprintln!("lab --kernel: installed {pkg}");
    Ok(())
}

/// The last lines of a program's stderr, for an error message.
pub fn tail(bytes: &[u8]) -> String {
    let s = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
    let n = lines.len().saturating_sub(3);
    lines[n..].join(" / ")
}

/// A word as a shell would take it: quoted only when it needs to be.
fn shell_word(w: &str) -> String {
    let plain = !w.is_empty()
        && w.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
    if plain {
        w.to_string()
    } else {
        format!("'{}'", w.replace('\'', r"'\''"))
    }
}

/// `prog args...` as one shell command line.
pub fn command_line(prog: &str, args: &[String]) -> String {
    std::iter::once(prog.to_string())
        .chain(args.iter().cloned())
        .map(|w| shell_word(&w))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Run a program to completion in `cwd`; Err with its stderr unless it succeeds.
pub fn run(prog: &str, args: &[String], cwd: &Path) -> Result<Output, String> {
    let out = Command::new(prog)
        .args(args)
        .current_dir(cwd)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{}: {e}", command_line(prog, args)))?;
    if !out.status.success() {
        return Err(format!(
            "{} exited with {}: {}",
            command_line(prog, args),
            out.status,
            tail(if out.stderr.is_empty() {
                &out.stdout
            } else {
                &out.stderr
            })
        ));
    }
    Ok(out)
}

/// Whether this fs_mark takes -A (asynchronous fsync), from its usage text: Debian's
/// 3.3 does not; a patched one (seed 004's) may.
pub fn fs_mark_has_async() -> Result<bool, String> {
    // fs_mark -h prints its usage and exits non-zero: the status says nothing.
    let out = Command::new("fs_mark")
        .arg("-h")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("fs_mark -h: {e}"))?;
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    Ok(usage_has_flag(&text, 'A'))
}

/// Whether a getopt-style usage text lists `-F` (as "-F ..." or "[-F ...").
fn usage_has_flag(usage: &str, flag: char) -> bool {
    let want = format!("-{flag}");
    usage.lines().any(|l| {
        let l = l.trim_start().trim_start_matches('[');
        l.starts_with(&want)
            && l[want.len()..]
                .chars()
                .next()
                .is_none_or(|c| !c.is_ascii_alphanumeric())
    })
}

/// One row of fs_mark's table.
#[derive(Clone, Debug, PartialEq)]
pub struct FsmarkRow {
    pub fsuse_pct: u32,
    /// Files written so far, all loops.
    pub count: u64,
    pub size: u64,
    pub files_per_sec: f64,
    pub app_overhead_us: u64,
}

/// fs_mark's loop table (rows of FSUse% Count Size Files/sec App Overhead); comment
/// lines and error lines are skipped. Err if it has no row.
pub fn parse_fsmark(text: &str) -> Result<Vec<FsmarkRow>, String> {
    let mut rows = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() != 5 || line.trim_start().starts_with('#') {
            continue;
        }
        let row = (|| {
            Some(FsmarkRow {
                fsuse_pct: f[0].parse().ok()?,
                count: f[1].parse().ok()?,
                size: f[2].parse().ok()?,
                files_per_sec: f[3].parse().ok()?,
                app_overhead_us: f[4].parse().ok()?,
            })
        })();
        if let Some(r) = row {
            rows.push(r);
        }
    }
    if rows.is_empty() {
        return Err(format!(
            "fs_mark printed no result rows: {}",
            tail(text.as_bytes())
        ));
    }
    Ok(rows)
}

/// fs_mark's "Average Files/sec": the mean of the loops' figures (Debian's 3.3 prints
/// no average line, so it is computed here the way fs_mark computes it).
pub fn fsmark_average(rows: &[FsmarkRow]) -> f64 {
    if rows.is_empty() {
        return 0.0;
    }
    rows.iter().map(|r| r.files_per_sec).sum::<f64>() / rows.len() as f64
}

/// What one fio job group reported (--output-format=json, --group_reporting).
#[derive(Clone, Debug, PartialEq)]
pub struct FioResult {
    pub read_iops: f64,
    pub write_iops: f64,
    pub usr_cpu_pct: f64,
    pub sys_cpu_pct: f64,
    pub read_clat_p50_us: f64,
    pub read_clat_p99_us: f64,
}

/// fio's JSON output; fio may print notes before the JSON object, which are skipped.
pub fn parse_fio_json(text: &str) -> Result<FioResult, String> {
    let start = text
        .find('{')
        .ok_or_else(|| format!("fio printed no JSON: {}", tail(text.as_bytes())))?;
    let v: serde_json::Value = serde_json::from_str(&text[start..])
        .map_err(|e| format!("fio's JSON does not parse: {e}"))?;
    let job = v["jobs"].get(0).ok_or("fio's JSON has no jobs")?;
    if job["error"].as_i64().unwrap_or(0) != 0 {
        return Err(format!("fio job failed with error {}", job["error"]));
    }
    let num = |x: &serde_json::Value, what: &str| {
        x.as_f64()
            .ok_or_else(|| format!("fio's JSON has no number at {what}"))
    };
    let pct = |p: &str| {
        job["read"]["clat_ns"]["percentile"][p]
            .as_f64()
            .map_or(0.0, |ns| ns / 1000.0)
    };
    Ok(FioResult {
        read_iops: num(&job["read"]["iops"], "jobs[0].read.iops")?,
        write_iops: num(&job["write"]["iops"], "jobs[0].write.iops")?,
        usr_cpu_pct: num(&job["usr_cpu"], "jobs[0].usr_cpu")?,
        sys_cpu_pct: num(&job["sys_cpu"], "jobs[0].sys_cpu")?,
        read_clat_p50_us: pct("50.000000"),
        read_clat_p99_us: pct("99.000000"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Debian's fs_mark 3.3, captured on this machine (tmpfs would say the same).
    const FSMARK_OUT: &str = "
#  fs_mark  -d  a/0  -d  a/1  -D  100  -S0  -n  2000  -s  4096  -L  3 
#	Version 3.3, 2 thread(s) starting at Tue Nov 24 18:47:46 2026
#	Sync method: NO SYNC: Test does not issue sync() or fsync() calls.
#	Directories:  Time based hash between directories across 100 subdirectories with 180 seconds per subdirectory.
#	File names: 40 bytes long, (16 initial bytes of time stamp with 24 random bytes at end of name)
#	Files info: size 4096 bytes, written with an IO size of 16384 bytes per write
#	App overhead is time in microseconds spent in the test not doing file writing related system calls.

FSUse%        Count         Size    Files/sec     App Overhead
    79         4000         4096      46006.7             9546
    79         8000         4096      54089.5             9544
    79        12000         4096     109103.4             9409
";

    #[test]
    fn fsmark_rows_parse_and_average_as_fs_mark_does() {
        let rows = parse_fsmark(FSMARK_OUT).unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!(
            rows[0],
            FsmarkRow {
                fsuse_pct: 79,
                count: 4000,
                size: 4096,
                files_per_sec: 46006.7,
                app_overhead_us: 9546
            }
        );
        assert_eq!(rows[2].count, 12000);
        let avg = fsmark_average(&rows);
        assert!((avg - (46006.7 + 54089.5 + 109103.4) / 3.0).abs() < 1e-6);
    }

    #[test]
    fn fsmark_without_rows_is_an_error_naming_its_complaint() {
        let text = "FSUse%        Count         Size    Files/sec     App Overhead\n\
                    fill_dir:mkdir a/0 failed: No such file or directory\n";
        let e = parse_fsmark(text).unwrap_err();
        assert!(e.contains("mkdir a/0 failed"), "{e}");
    }

    #[test]
    fn fio_json_gives_iops_cpu_and_latency() {
        let r = parse_fio_json(FIO_OUT).unwrap();
        assert!(r.read_iops > 1000.0, "{r:?}");
        assert_eq!(r.write_iops, 0.0);
        assert!(r.usr_cpu_pct > 0.0 && r.sys_cpu_pct > 0.0, "{r:?}");
        assert!(r.read_clat_p50_us > 0.0 && r.read_clat_p99_us >= r.read_clat_p50_us);
    }

    #[test]
    fn fio_garbage_is_an_error() {
        assert!(parse_fio_json("fio: no such option --bogus").is_err());
        assert!(parse_fio_json("{\"jobs\": []}").is_err());
    }

    #[test]
    fn debians_usage_has_no_async_flag() {
        // Debian's fs_mark 3.3 usage, captured here (abridged to its flag lines).
        let usage = "Usage: fs_mark\n\t-h <print usage and exit>\n \t-k <keep files after each iteration>\n \t-F <run until FS full>\n \t-S Sync Method (0:No Sync, 1:fsyncBeforeClose, 2:sync/1_fsync, 3:PostReverseFsync, 4:syncPostReverseFsync, 5:PostFsync, 6:syncPostFsync)\n \t[-D number (of subdirectories)]\n \t[-N number (of files in each subdirectory in Round Robin mode)]\n \t[-L number (of iterations)]\n \t[-t number (of total threads)]\n";
        assert!(!usage_has_flag(usage, 'A'));
        assert!(usage_has_flag(usage, 'S'));
        assert!(usage_has_flag(usage, 't'));
        assert!(usage_has_flag(usage, 'k'));
        assert!(usage_has_flag("\t[-A (asynchronous fsync)]", 'A'));
    }

    #[test]
    fn command_lines_quote_only_what_needs_it() {
        let c = command_line("fs_mark", &["-d".into(), "/a b/0".into(), "-S0".into()]);
        assert_eq!(c, "fs_mark -d '/a b/0' -S0");
    }

    /// fio 3.33 (Debian), --output-format=json, 4 KiB randread, psync, O_DIRECT, 2 jobs,
    /// on a file of this machine's root filesystem (virtio disk), captured here.
    const FIO_OUT: &str = include_str!("testdata/fio-randread.json");
}
