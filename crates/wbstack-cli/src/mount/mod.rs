//! `wbstack mount`, `umount`, `ctl` and `iostat`: the FUSE front end as a person uses
//! it. The server itself is the `wbstack-fuse` crate; this is its command line.

pub mod ctl;
pub mod iostat;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use wbstack::block::{QueueConfig, RequestQueue};
use wbstack::fs::{MkfsOptions, MountOptions, Volume};
use wbstack_fuse::MountConfig;

/// Set in the daemon a background mount starts: it reports on stdout instead of
/// printing for a person.
const DAEMON_ENV: &str = "WBSTACK_MOUNT_DAEMON";

pub struct MountArgs {
    pub source: String,
    pub dir: PathBuf,
    pub options: Vec<String>,
    pub foreground: bool,
    pub log: Option<PathBuf>,
}

/// Everything checked before anything is started: options, source, mount point.
struct Plan {
    spec: String,
    fresh: bool,
    dir: PathBuf,
    cfg: MountConfig,
    opts: MountOptions,
}

fn plan(a: &MountArgs) -> Result<Plan, String> {
    let mut cfg = MountConfig::default();
    let mut opts = MountOptions::default();
    for list in &a.options {
        let rest = cfg.take_options(list).map_err(|e| e.to_string())?;
        opts.parse(&rest).map_err(|e| e.to_string())?;
    }
    let spec = crate::admin::spec_of(&a.source);
    // A simulated or null device starts empty: it gets a fresh filesystem.
    let fresh = matches!(wbstack::dev::spec_kind(&spec), Some("sim" | "null"));
    if let Some(path) = spec.strip_prefix("file:") {
        let path = path.split(',').next().unwrap_or(path);
        if !Path::new(path).exists() {
            return Err(format!(
                "{path}: no such image (make one with `wbstack mkfs {path} --size 16G`)"
            ));
        }
    }
    let dir = wbstack_fuse::check_mountpoint(&a.dir)?;
    Ok(Plan {
        spec,
        fresh,
        dir,
        cfg,
        opts,
    })
}

/// `wbstack mount`: in the background by default (a daemon that returns once the
/// mount answers), or attached with `--foreground`.
pub fn mount(a: &MountArgs) -> Result<(), String> {
    let p = plan(a)?;
    if a.foreground || std::env::var_os(DAEMON_ENV).is_some() {
        return serve(p, std::env::var_os(DAEMON_ENV).is_some());
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find myself: {e}"))?;
    let mut args: Vec<String> = vec!["mount".into(), a.source.clone()];
    args.push(p.dir.to_string_lossy().into_owned());
    for o in &a.options {
        args.push("-o".into());
        args.push(o.clone());
    }
    let log = match &a.log {
        Some(path) => Stdio::from(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| format!("{}: {e}", path.display()))?,
        ),
        None => Stdio::null(),
    };
    use std::os::unix::process::CommandExt;
    let mut child = Command::new(exe)
        .args(&args)
        .env(DAEMON_ENV, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        // Its own process group: the terminal's ^C is not for it.
        .process_group(0)
        .spawn()
        .map_err(|e| format!("cannot start the mount daemon: {e}"))?;
    let out = child.stdout.take().expect("piped above");
    let mut line = String::new();
    let n = BufReader::new(out)
        .read_line(&mut line)
        .map_err(|e| format!("reading from the mount daemon: {e}"))?;
    match line.trim_end().split_once(' ') {
        Some(("READY", pid)) => {
            println!(
                "wbstack: {} mounted on {} (daemon pid {pid}; `wbstack umount {}` unmounts)",
                a.source,
                p.dir.display(),
                p.dir.display()
            );
            Ok(())
        }
        _ => {
            let status = child.wait().ok();
            let msg = line
                .trim_end()
                .strip_prefix("ERROR ")
                .unwrap_or(line.trim_end());
            Err(if n == 0 {
                format!("the mount daemon exited ({status:?}) without mounting")
            } else {
                msg.to_string()
            })
        }
    }
}

fn serve(p: Plan, daemon: bool) -> Result<(), String> {
    let report = |msg: &str| {
        if daemon {
            let mut o = std::io::stdout();
            // The parent reads one line; if it is gone there is no one to tell.
            if writeln!(o, "{msg}").and_then(|_| o.flush()).is_err() {
                eprintln!("wbstack mount: {msg}");
            }
        }
    };
    let signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ])
    .map_err(|e| format!("cannot handle signals: {e}"))?;
    let vol = match open_volume(&p) {
        Ok(v) => v,
        Err(e) => {
            report(&format!("ERROR {e}"));
            return Err(e);
        }
    };
    let dir = p.dir.clone();
    let r = wbstack_fuse::serve(vol, &dir, &p.cfg, |mut unmounter| {
        report(&format!("READY {}", std::process::id()));
        if !daemon {
            eprintln!(
                "wbstack: mounted on {} (^C or `wbstack umount {}` unmounts)",
                dir.display(),
                dir.display()
            );
        }
        let mut signals = signals;
        std::thread::spawn(move || {
            if let Some(sig) = signals.forever().next() {
                eprintln!("wbstack mount: signal {sig}: unmounting");
                if let Err(e) = unmounter.unmount() {
                    eprintln!("wbstack mount: unmount: {e}");
                }
            }
        });
    });
    if let Err(e) = &r {
        report(&format!("ERROR {e}"));
    }
    r.map_err(|e| e.to_string())?;
    if !daemon {
        eprintln!("wbstack: {} unmounted cleanly", p.dir.display());
    }
    Ok(())
}

fn open_volume(p: &Plan) -> Result<Volume, String> {
    let q = RequestQueue::open(&p.spec, QueueConfig::default())?;
    if p.fresh {
        Volume::mkfs(&q, &MkfsOptions::for_mount(&p.opts)).map_err(|e| format!("mkfs: {e}"))?;
    }
    Volume::mount(q, p.opts.clone()).map_err(|e| format!("{}: {e}", p.spec))
}

/// `wbstack umount DIR`: unmount, then wait for the daemon's final writeback and
/// checkpoint, so that the image is clean when this returns.
pub fn umount(dir: &Path) -> Result<(), String> {
    let dir = std::fs::canonicalize(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let pid: Option<u32> = std::fs::read_to_string(dir.join(".wbstack/pid"))
        .ok()
        .and_then(|s| s.trim().parse().ok());
    if pid.is_none() && !wbstack_fuse::is_mountpoint(&dir) {
        return Err(format!("{}: not mounted", dir.display()));
    }
    let out = Command::new("fusermount3")
        .arg("-u")
        .arg(&dir)
        .output()
        .map_err(|e| format!("fusermount3: {e} (install fuse3)"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        if pid.is_some() {
            return Err(format!("fusermount3 -u {}: {}", dir.display(), err.trim()));
        }
        // The daemon is gone (killed): detach what is left of the mount.
        let lazy = Command::new("fusermount3")
            .arg("-uz")
            .arg(&dir)
            .status()
            .map_err(|e| format!("fusermount3: {e}"))?;
        if !lazy.success() {
            return Err(format!("fusermount3 -uz {}: {}", dir.display(), err.trim()));
        }
        eprintln!(
            "wbstack: {} had no daemon (killed?); detached. The next mount replays its journal.",
            dir.display()
        );
        return Ok(());
    }
    if let Some(pid) = pid {
        let start = Instant::now();
        let mut said = false;
        while Path::new(&format!("/proc/{pid}")).exists() && !is_zombie(pid) {
            if start.elapsed() > Duration::from_secs(2) && !said {
                eprintln!(
                    "wbstack: waiting for the daemon (pid {pid}) to write back and checkpoint..."
                );
                said = true;
            }
            if start.elapsed() > Duration::from_secs(1800) {
                return Err(format!(
                    "the daemon (pid {pid}) is still writing back after 30 minutes"
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Ok(())
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with('Z'))
        })
        .unwrap_or(true)
}
