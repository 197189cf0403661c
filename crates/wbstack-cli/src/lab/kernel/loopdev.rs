//! A kernel filesystem on a loop device over a sparse image on this machine's disk
//! (scripts/kernel-loop.sh in Rust), torn down when dropped, also after an error.

use super::programs::{self, command_line};
use super::KernelFs;
use std::path::{Path, PathBuf};
use wbstack::block::DiskStats;

/// Size of the sparse image: room for the largest arm (`--full` fs_mark writes 800,000
/// 4 KiB files, ~3.3 GiB with metadata; expire's dd up to 3 GiB).
pub const IMAGE_SIZE: &str = "16G";

pub struct LoopFs {
    pub fs: KernelFs,
    pub image: PathBuf,
    /// /dev/loopN
    pub dev: String,
    pub mnt: PathBuf,
    /// What was run to set it up, for the arms' `setup`.
    pub commands: Vec<String>,
    mounted: bool,
    attached: bool,
}

impl LoopFs {
    /// Image, loop device, mkfs (defaults), mount, under `work`. On any failure what was
    /// set up so far is torn down (by Drop) before the error returns.
    pub fn make(fs: KernelFs, work: &Path) -> Result<LoopFs, String> {
        let mkfs = format!("mkfs.{}", fs.name());
        programs::ensure("losetup", "mount")?;
        match fs {
            KernelFs::Ext4 => programs::ensure(&mkfs, "e2fsprogs")?,
            KernelFs::Xfs => programs::ensure(&mkfs, "xfsprogs")?,
        }
        std::fs::create_dir_all(work).map_err(|e| format!("{}: {e}", work.display()))?;
        let image = work.join(format!("{}.img", fs.name()));
        let mnt = work.join(format!("{}.mnt", fs.name()));
        let mut l = LoopFs {
            fs,
            image: image.clone(),
            dev: String::new(),
            mnt: mnt.clone(),
            commands: Vec::new(),
            mounted: false,
            attached: false,
        };
        // A leftover of a killed run: our own mount point still mounted.
        if is_mountpoint(&mnt) {
            let out = programs::run("umount", &[s(&mnt)], work);
            out.map_err(|e| format!("{} is mounted from an earlier run: {e}", mnt.display()))?;
        }
        std::fs::create_dir_all(&mnt).map_err(|e| format!("{}: {e}", mnt.display()))?;
        // Removing a file still attached to a loop device leaves the device's file
        // alive; a fresh file is what mkfs expects anyway.
        if image.exists() {
            std::fs::remove_file(&image).map_err(|e| format!("{}: {e}", image.display()))?;
        }
        let truncate = vec!["-s".into(), IMAGE_SIZE.into(), s(&image)];
        programs::run("truncate", &truncate, work)?;
        l.commands.push(command_line("truncate", &truncate));
        let losetup = vec!["-f".into(), "--show".into(), s(&image)];
        let out = programs::run("losetup", &losetup, work)?;
        l.commands.push(command_line("losetup", &losetup));
        l.dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !l.dev.starts_with("/dev/loop") {
            return Err(format!("losetup printed '{}', not a loop device", l.dev));
        }
        l.attached = true;
        let mkfs_args = match fs {
            KernelFs::Ext4 => vec!["-q".into(), "-F".into(), l.dev.clone()],
            KernelFs::Xfs => vec!["-q".into(), "-f".into(), l.dev.clone()],
        };
        programs::run(&mkfs, &mkfs_args, work)?;
        l.commands.push(command_line(&mkfs, &mkfs_args));
        let mount = vec![l.dev.clone(), s(&mnt)];
        programs::run("mount", &mount, work)?;
        l.commands.push(command_line("mount", &mount));
        l.mounted = true;
        Ok(l)
    }

    /// loopN
    pub fn name(&self) -> &str {
        self.dev.trim_start_matches("/dev/")
    }

    pub fn queue_path(&self, knob: &str) -> PathBuf {
        PathBuf::from(format!("/sys/block/{}/queue/{knob}", self.name()))
    }

    /// A queue attribute (the scheduler's active one without brackets); None if the
    /// device has no such file.
    pub fn queue(&self, knob: &str) -> Option<String> {
        let v = std::fs::read_to_string(self.queue_path(knob)).ok()?;
        let v = v.trim();
        Some(match (v.find('['), v.find(']')) {
            (Some(a), Some(b)) if a < b => v[a + 1..b].to_string(),
            _ => v.to_string(),
        })
    }

    pub fn set_queue(&self, knob: &str, value: &str) -> Result<(), String> {
        let p = self.queue_path(knob);
        std::fs::write(&p, value).map_err(|e| format!("echo {value} > {}: {e}", p.display()))
    }

    /// "ext4 on /dev/loop0 (16G sparse /var/tmp/.../ext4.img), mkfs defaults;
    /// queue: scheduler=none wbt_lat_usec=2000 ...".
    pub fn setup(&self) -> String {
        let q: Vec<String> = [
            "scheduler",
            "wbt_lat_usec",
            "iostats",
            "max_sectors_kb",
            "nr_requests",
            "read_ahead_kb",
        ]
        .iter()
        .filter_map(|k| self.queue(k).map(|v| format!("{k}={v}")))
        .collect();
        format!(
            "{} on {} ({IMAGE_SIZE} sparse {}), mkfs defaults, mounted on {}; queue: {}",
            self.fs.name(),
            self.dev,
            self.image.display(),
            self.mnt.display(),
            q.join(" ")
        )
    }

    pub fn stat_path(&self) -> PathBuf {
        PathBuf::from(format!("/sys/block/{}/stat", self.name()))
    }

    pub fn disk_stats(&self) -> Result<DiskStats, String> {
        read_stats(&self.stat_path())
    }

    /// Tear down now and say whether everything went (Drop can only print it).
    pub fn finish(mut self) -> Result<(), String> {
        let r = self.teardown();
        // Whatever failed stays failed: Drop must not try, and print, again.
        self.mounted = false;
        self.attached = false;
        self.image = PathBuf::new();
        r
    }

    fn teardown(&mut self) -> Result<(), String> {
        let mut errs = Vec::new();
        if self.mounted {
            match programs::run("umount", &[s(&self.mnt)], Path::new("/")) {
                Ok(_) => self.mounted = false,
                Err(e) => errs.push(e),
            }
        }
        // Detaching a device whose filesystem is still mounted would fail anyway.
        if self.attached && !self.mounted {
            match programs::run("losetup", &["-d".into(), self.dev.clone()], Path::new("/")) {
                Ok(_) => self.attached = false,
                Err(e) => errs.push(e),
            }
        }
        if !self.attached {
            if let Err(e) = std::fs::remove_file(&self.image) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    errs.push(format!("rm {}: {e}", self.image.display()));
                }
            }
            if let Err(e) = std::fs::remove_dir(&self.mnt) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    errs.push(format!("rmdir {}: {e}", self.mnt.display()));
                }
            }
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(errs.join("; "))
        }
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        if self.image.as_os_str().is_empty() {
            return;
        }
        // Drop cannot return the error: the person must hear of a leftover device.
        if let Err(e) = self.teardown() {
            eprintln!("lab --kernel: teardown of {}: {e}", self.image.display());
        }
    }
}

pub fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// A /sys/block/*/stat file or a wbstack mount's .wbstack/diskstats.
pub fn read_stats(p: &Path) -> Result<DiskStats, String> {
    let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
    DiskStats::parse(&text).map_err(|e| format!("{}: {e}", p.display()))
}

/// Whether `p` is a mount point, from /proc/self/mountinfo.
pub fn is_mountpoint(p: &Path) -> bool {
    let Ok(canon) = p.canonicalize() else {
        return false;
    };
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = canon.to_string_lossy();
    info.lines().any(|l| {
        l.split_whitespace()
            .nth(4)
            .is_some_and(|m| m.replace("\\040", " ") == want)
    })
}

/// Write dirty data back and drop the clean page cache, dentries and inodes, so a read
/// that follows comes from the device.
pub fn drop_caches() -> Result<(), String> {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3")
        .map_err(|e| format!("echo 3 > /proc/sys/vm/drop_caches: {e}"))
}
