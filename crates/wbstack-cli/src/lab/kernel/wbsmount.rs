//! wbstack through FUSE: `wbstack mkfs` an image on this machine's disk and `wbstack
//! mount` it in the background (this very binary), so the kernel arms' programs run on
//! it unchanged; `wbstack umount` when dropped, checking that the daemon exits.

use super::loopdev::{is_mountpoint, s};
use super::programs::{self, command_line};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub struct WbsMount {
    exe: PathBuf,
    pub image: PathBuf,
    pub mnt: PathBuf,
    pub pid: Option<u32>,
    pub commands: Vec<String>,
    /// Threads serving FUSE over io_uring (0: requests come through /dev/fuse).
    pub ring_threads: u64,
    mounted: bool,
}

/// How long the daemon may take to exit after `wbstack umount` returned (it waits for
/// the daemon itself; this only catches a daemon that outlives it).
const EXIT_WAIT: Duration = Duration::from_secs(30);
impl WbsMount {
    pub fn make(work: &Path, opts: &str) -> Result<WbsMount, String> {
        programs::ensure("fusermount3", "fuse3")?;
        let exe = std::env::current_exe().map_err(|e| format!("cannot find myself: {e}"))?;
        let exe_s = s(&exe);
        std::fs::create_dir_all(work).map_err(|e| format!("{}: {e}", work.display()))?;
        let image = work.join("wbs-mount.img");
        let mnt = work.join("wbs.mnt");
        if is_mountpoint(&mnt) {
            programs::run(&exe_s, &["umount".into(), s(&mnt)], work)
                .map_err(|e| format!("{} is mounted from an earlier run: {e}", mnt.display()))?;
        }
        std::fs::create_dir_all(&mnt).map_err(|e| format!("{}: {e}", mnt.display()))?;
        if image.exists() {
            std::fs::remove_file(&image).map_err(|e| format!("{}: {e}", image.display()))?;
        }
        let mut m = WbsMount {
            exe,
            image: image.clone(),
            mnt: mnt.clone(),
            pid: None,
            commands: Vec::new(),
            ring_threads: 0,
            mounted: false,
        };
        let mkfs = vec![
            "mkfs".into(),
            s(&image),
            "--size".into(),
            super::loopdev::IMAGE_SIZE.into(),
        ];
        programs::run(&exe_s, &mkfs, work)?;
        m.commands.push(command_line("wbstack", &mkfs));
        let mut mount = vec!["mount".into(), s(&image), s(&mnt)];
        if !opts.is_empty() {
            mount.push("-o".into());
            mount.push(opts.into());
        }
        programs::run(&exe_s, &mount, work)?;
        m.commands.push(command_line("wbstack", &mount));
        m.mounted = true;
        // `wbstack mount` returns once the daemon answers, so the pid file is there.
        let pid_file = mnt.join(".wbstack/pid");
        let pid = std::fs::read_to_string(&pid_file)
            .map_err(|e| format!("{}: {e}", pid_file.display()))?;
        m.pid = Some(
            pid.trim()
                .parse()
                .map_err(|e| format!("{}: '{}': {e}", pid_file.display(), pid.trim()))?,
        );
        let stat_file = mnt.join(".wbstack/stat");
        let stat = std::fs::read_to_string(&stat_file)
            .map_err(|e| format!("{}: {e}", stat_file.display()))?;
        m.ring_threads = stat
            .lines()
            .find_map(|l| l.strip_prefix("fuse_ring_threads "))
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| format!("{}: no fuse_ring_threads line", stat_file.display()))?;
        Ok(m)
    }

    pub fn stat_path(&self) -> PathBuf {
        self.mnt.join(".wbstack/diskstats")
    }

    pub fn setup(&self) -> String {
        format!(
            "wbstack FUSE mount of {} ({} sparse, wbstack mkfs defaults) on {}, daemon pid {}, requests through {}; device figures from .wbstack/diskstats (flushes: empty flushes and the flush of each PREFLUSH write, as the kernel counts them)",
            self.image.display(),
            super::loopdev::IMAGE_SIZE,
            self.mnt.display(),
            self.pid.map_or("?".into(), |p| p.to_string()),
            if self.ring_threads > 0 {
                format!("FUSE over io_uring ({} ring threads)", self.ring_threads)
            } else {
                "/dev/fuse".to_string()
            }
        )
    }

    /// A run-time knob of the mount (`wbstack ctl DIR knob=value`).
    pub fn ctl(&self, knob: &str, value: &str) -> Result<String, String> {
        let arg = format!("{knob}={value}");
        crate::mount::ctl::ctl(&self.mnt, Some(&arg))?;
        Ok(command_line("wbstack", &["ctl".into(), s(&self.mnt), arg]))
    }

    /// What `sync` means on the mount: syncfs does not reach the daemon (the kernel
    /// sends FUSE_SYNCFS to virtiofs only), so after it the mount's own syncfs runs
    /// (`wbstack sync`: a write to `.wbstack/sync`, `Volume::sync` in the daemon).
    pub fn sync(&self) -> Result<(), String> {
        super::syncfs(&self.mnt)?;
        crate::mount::ctl::sync(&self.mnt)
    }

    fn teardown(&mut self) -> Result<(), String> {
        if self.mounted {
            programs::run(
                &s(&self.exe),
                &["umount".into(), s(&self.mnt)],
                Path::new("/"),
            )?;
            self.mounted = false;
            if let Some(pid) = self.pid {
                let deadline = Instant::now() + EXIT_WAIT;
                while alive(pid) {
                    if Instant::now() > deadline {
                        return Err(format!(
                            "the mount daemon (pid {pid}) is still running {}s after wbstack umount",
                            EXIT_WAIT.as_secs()
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
        std::fs::remove_file(&self.image)
            .map_err(|e| format!("rm {}: {e}", self.image.display()))?;
        std::fs::remove_dir(&self.mnt).map_err(|e| format!("rmdir {}: {e}", self.mnt.display()))
    }

    /// Unmount now and report whether the daemon exited cleanly.
    pub fn finish(mut self) -> Result<(), String> {
        let r = self.teardown();
        // Teardown is done (or failed for good): Drop must not try again.
        self.mounted = false;
        self.image = PathBuf::new();
        r
    }
}

/// A process that exists and is not a zombie (the daemon is `wbstack mount`'s child,
/// reparented to init once that returned, so it is reaped there).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|st| {
        st.rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z'))
    })
}

impl Drop for WbsMount {
    fn drop(&mut self) {
        if self.image.as_os_str().is_empty() {
            return;
        }
        if let Err(e) = self.teardown() {
            eprintln!(
                "lab --kernel: teardown of the wbstack mount {}: {e}",
                self.mnt.display()
            );
        }
    }
}
