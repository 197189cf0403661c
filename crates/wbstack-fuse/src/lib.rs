//! wbstack through FUSE: a Volume mounted on a directory, so ordinary programs (tar,
//! cp, dd, fio, fs_mark, test suites) run on it. `server.rs` serves the requests,
//! `ctl.rs` the control directory, `counters.rs` counts what crossed.
//!
//! A request's path: the kernel's FUSE module → a ring entry of the caller's CPU
//! (FUSE over io_uring, `uring/`, when the kernel allows it) or /dev/fuse (one
//! cloned fd per request thread, `Config::clone_fd`, through fuser's event loop) → a
//! `WbFs` handler (`reply.rs`: what a handler needs of either transport) → the
//! Volume's inode API (`wbstack::fs::ops`, permission checks in `fs::perm`) → page
//! cache / journal → writeback → block layer → device.

pub mod counters;
pub mod ctl;
pub mod reply;
pub mod server;
pub mod uring;

use fuser::{Config, MountOption, SessionACL};
use std::path::{Path, PathBuf};
use wbstack::fs::{FsError, FsResult, Volume};

pub use server::{Served, UnmountResult, WbFs, MAX_PAYLOAD};
use std::os::fd::AsFd;
use std::sync::Arc;

/// How to mount.
#[derive(Clone, Debug)]
pub struct MountConfig {
    /// Request threads, each with its own /dev/fuse fd (`default_threads`).
    pub threads: usize,
    /// Let other users in (FUSE's allow_other). The kernel then also checks
    /// permissions itself (default_permissions): without it a path cached by one
    /// user would be walked by another without the search checks this daemon makes
    /// at LOOKUP.
    pub allow_other: bool,
    /// Ask the kernel to check permissions from the attributes (it does so anyway
    /// with allow_other); the daemon checks too.
    pub default_permissions: bool,
    pub read_only: bool,
    /// Source name shown in /proc/mounts.
    pub fsname: String,
    /// FUSE over io_uring (`uring/`): Auto uses it when the kernel allows it.
    pub uring: UringMode,
    /// Ring threads per CPU's queue, each with one ring entry: how many requests of
    /// one CPU may be in progress at once (fsyncs waiting for a commit among them).
    pub ring_threads: usize,
}

/// Whether to serve requests through io_uring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UringMode {
    /// When the fuse module's `enable_uring` is on; /dev/fuse otherwise.
    Auto,
    /// Required: the mount fails when the kernel refuses.
    On,
    Off,
}

impl Default for MountConfig {
    fn default() -> Self {
        MountConfig {
            threads: default_threads(),
            allow_other: false,
            default_permissions: false,
            read_only: false,
            fsname: "wbstack".into(),
            uring: UringMode::Auto,
            ring_threads: 8,
        }
    }
}

/// One request thread per CPU (at least 2). More threads than CPUs cost more than they
/// give: every request then wakes a thread on another CPU (fs_mark -S0 through the
/// mount on 2 CPUs: 20k files/s with 2 threads, 11-14k with 3 to 8). No request
/// thread waits for the disk (fsync goes to the waiter pool), so 2 serve many
/// programs; a writer paused by dirty throttling does hold one (`threads=N`).
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .max(2)
}

impl MountConfig {
    /// Take the FUSE options of a `-o` list (`allow_other`, `default_permissions`,
    /// `ro`, `rw`, `threads=N`, `fsname=S`, `uring=auto|on|off`, `ring_threads=N`);
    /// the rest is returned for the Volume.
    pub fn take_options(&mut self, list: &str) -> FsResult<String> {
        let mut rest = Vec::new();
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match item.split_once('=') {
                None if item == "allow_other" => self.allow_other = true,
                None if item == "default_permissions" => self.default_permissions = true,
                None if item == "ro" => self.read_only = true,
                None if item == "rw" => self.read_only = false,
                Some(("threads", n)) => {
                    self.threads = n
                        .parse()
                        .ok()
                        .filter(|n| (1..=256).contains(n))
                        .ok_or_else(|| {
                            FsError::Invalid(format!("threads={n}: expected 1 to 256"))
                        })?
                }
                Some(("fsname", n)) => self.fsname = n.to_string(),
                Some(("uring", m)) => {
                    self.uring = match m {
                        "auto" => UringMode::Auto,
                        "on" => UringMode::On,
                        "off" => UringMode::Off,
                        _ => {
                            return Err(FsError::Invalid(format!(
                                "uring={m}: expected auto, on or off"
                            )))
                        }
                    }
                }
                Some(("ring_threads", n)) => {
                    self.ring_threads =
                        n.parse()
                            .ok()
                            .filter(|n| (1..=64).contains(n))
                            .ok_or_else(|| {
                                FsError::Invalid(format!("ring_threads={n}: expected 1 to 64"))
                            })?
                }
                _ => rest.push(item),
            }
        }
        Ok(rest.join(","))
    }
}

/// Everything wrong with DIR as a mount point, as one line.
pub fn check_mountpoint(dir: &Path) -> Result<PathBuf, String> {
    let abs = std::fs::canonicalize(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let md = std::fs::metadata(&abs).map_err(|e| format!("{}: {e}", abs.display()))?;
    if !md.is_dir() {
        return Err(format!("{}: not a directory", abs.display()));
    }
    if is_mountpoint(&abs) {
        return Err(format!(
            "{}: already a mount point (busy); unmount it first",
            abs.display()
        ));
    }
    if !Path::new("/dev/fuse").exists() {
        return Err("/dev/fuse is missing: the fuse kernel module is not loaded".into());
    }
    if which("fusermount3").is_none() {
        return Err("fusermount3 not found: install fuse3 (apt-get install -y fuse3)".into());
    }
    Ok(abs)
}

/// Whether `dir` is the mount point of some mount (/proc/self/mountinfo's 5th field).
pub fn is_mountpoint(dir: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = dir.to_string_lossy();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|mp| unescape_mountinfo(mp) == want)
}

fn unescape_mountinfo(s: &str) -> String {
    s.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

fn which(bin: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(bin))
            .find(|c| c.is_file())
    })
}

/// Mount `vol` on `dir` and serve it until unmounted. `ready` runs once the kernel
/// has answered the mount (the FUSE handshake is done), with what unmounts it. Returns the final unmount's
/// result: writeback, checkpoint.
pub fn serve(
    vol: Volume,
    dir: &Path,
    cfg: &MountConfig,
    ready: impl FnOnce(fuser::SessionUnmounter),
) -> FsResult<()> {
    let owner = euid();
    let result: UnmountResult = Default::default();
    let want_uring = match cfg.uring {
        UringMode::Off => false,
        UringMode::Auto => {
            uring::kernel_allows()
                && uring::can_set_up()
                    .map_err(|e| {
                        eprintln!(
                            "wbstack mount: FUSE over io_uring: this process cannot set up io_uring ({e}); serving through /dev/fuse"
                        )
                    })
                    .is_ok()
        }
        UringMode::On => {
            if !uring::kernel_allows() {
                return Err(FsError::Invalid(format!(
                    "uring=on: the kernel does not allow FUSE over io_uring ({} is not Y; as root: echo 1 > {0})",
                    uring::ENABLE_PARAM
                )));
            }
            uring::can_set_up().map_err(|e| {
                FsError::Invalid(format!("uring=on: this process cannot set up io_uring: {e}"))
            })?;
            true
        }
    };
    let fs = Arc::new(WbFs::new(
        vol,
        owner,
        cfg.read_only,
        result.clone(),
        want_uring,
    ));
    let notifier = fs.notifier.clone();
    let rings: Arc<parking_lot::Mutex<Option<uring::Rings>>> = Arc::default();
    let served = Served {
        fs: fs.clone(),
        rings: rings.clone(),
    };
    let mut opts = vec![
        MountOption::FSName(cfg.fsname.clone()),
        MountOption::Subtype("wbstack".into()),
        MountOption::NoAtime,
        MountOption::Dev,
        MountOption::Suid,
    ];
    if cfg.read_only {
        opts.push(MountOption::RO);
    }
    if cfg.default_permissions || cfg.allow_other {
        opts.push(MountOption::DefaultPermissions);
    }
    let mut config = Config::default();
    config.mount_options = opts;
    config.acl = if cfg.allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    config.n_threads = Some(cfg.threads.max(1));
    config.clone_fd = true;
    let session = fuser::Session::new(served, dir, &config)
        .map_err(|e| FsError::Invalid(format!("mount {}: {e}", dir.display())))?;
    let mut session = session;
    if notifier.set(session.notifier()).is_err() {
        debug_assert!(false, "the notifier set twice");
    }
    // With uring=on, a refusal unmounts at once; the session still runs to its end
    // so that the volume unmounts cleanly, and the mount then fails.
    let mut refused = None;
    if fs.uring_granted() {
        let acl = uring::Acl {
            owner_only: (!cfg.allow_other).then_some(owner),
        };
        // (error, whether the kernel refused a REGISTER and so serves through /dev/fuse)
        let started = match session.as_fd().try_clone_to_owned() {
            Ok(dev) => uring::Rings::start(fs.clone(), dev, cfg.ring_threads, MAX_PAYLOAD, acl)
                .map_err(|f| {
                    // Joined at the session's end, before the volume unmounts.
                    *rings.lock() = Some(f.started);
                    (f.error, f.refused)
                }),
            Err(e) => Err((e, false)),
        };
        match started {
            Ok(r) => *rings.lock() = Some(r),
            // /dev/fuse serves every request: slower, not wrong.
            Err((e, true)) if cfg.uring == UringMode::Auto => {
                eprintln!(
                    "wbstack mount: FUSE over io_uring refused ({e}); serving through /dev/fuse"
                )
            }
            // Granted at INIT but never ready: the kernel would hold every request
            // until unmount, so the mount is undone rather than left hanging.
            Err((e, false)) => {
                refused = Some(format!("FUSE over io_uring: a ring could not start: {e}"))
            }
            Err((e, _)) => refused = Some(format!("uring=on: {e}")),
        }
    } else if cfg.uring == UringMode::On {
        refused = Some("uring=on: the kernel did not offer FUSE over io_uring at INIT".into());
    }
    if refused.is_some() {
        if let Err(e) = session.unmount_callable().unmount() {
            eprintln!("wbstack mount: unmounting after the refusal: {e}");
        }
    }
    drop(fs);
    if refused.is_none() {
        ready(session.unmount_callable());
    }
    let served = session
        .run()
        .map_err(|e| FsError::Invalid(format!("serving {}: {e}", dir.display())));
    if let Some(msg) = refused {
        return Err(FsError::Invalid(msg));
    }
    served?;
    let r = result.lock().take();
    r.unwrap_or(Ok(()))
}

fn euid() -> u32 {
    // /proc/self/status's Uid line: real, effective, saved, fs.
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|u| u.split_whitespace().nth(1).and_then(|x| x.parse().ok()))
        })
        .unwrap_or(0)
}
