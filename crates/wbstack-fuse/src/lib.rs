//! wbstack through FUSE: a Volume mounted on a directory, so ordinary programs (tar,
//! cp, dd, fio, fs_mark, test suites) run on it. `server.rs` serves the requests,
//! `ctl.rs` the control directory, `counters.rs` counts what crossed.
//!
//! A request's path: the kernel's FUSE module → /dev/fuse (one cloned fd per request
//! thread, `Config::clone_fd`) → fuser's event loop → a `WbFs` handler → the Volume's
//! inode API (`wbstack::fs::ops`, permission checks in `fs::perm`) → page cache /
//! journal → writeback → block layer → device.

pub mod counters;
pub mod ctl;
pub mod server;

use fuser::{Config, MountOption, SessionACL};
use std::path::{Path, PathBuf};
use wbstack::fs::{FsError, FsResult, Volume};

pub use server::{UnmountResult, WbFs};

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
}

impl Default for MountConfig {
    fn default() -> Self {
        MountConfig {
            threads: default_threads(),
            allow_other: false,
            default_permissions: false,
            read_only: false,
            fsname: "wbstack".into(),
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
    /// `ro`, `rw`, `threads=N`, `fsname=S`); the rest is returned for the Volume.
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
    let fs = WbFs::new(vol, owner, cfg.read_only, result.clone());
    let notifier = fs.notifier.clone();
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
    let session = fuser::Session::new(fs, dir, &config)
        .map_err(|e| FsError::Invalid(format!("mount {}: {e}", dir.display())))?;
    let mut session = session;
    if notifier.set(session.notifier()).is_err() {
        debug_assert!(false, "the notifier set twice");
    }
    ready(session.unmount_callable());
    session
        .run()
        .map_err(|e| FsError::Invalid(format!("serving {}: {e}", dir.display())))?;
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
