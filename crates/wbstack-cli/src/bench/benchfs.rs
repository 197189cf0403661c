//! The small filesystem interface the file-level workloads (fsmark, tardd, readlat) are
//! written against, so the same workload runs on a plain directory of a kernel
//! filesystem (`DirFs`) and on wbstack's own volume.
//!
//! Paths are relative to the filesystem's root and '/'-separated.

use parking_lot::Mutex;
use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Component, Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use wbstack::block::DiskStats;

/// A filesystem to run a workload on.
pub trait BenchFs: Send + Sync {
    /// What it is, for reports: e.g. "dir:/mnt/x (ext4 on loop0)".
    fn name(&self) -> String;
    fn mkdir_all(&self, path: &str) -> io::Result<()>;
    /// Open for writing, creating or truncating it (O_CREAT|O_TRUNC|O_WRONLY).
    fn create(&self, path: &str) -> io::Result<Box<dyn BenchFile>>;
    fn open(&self, path: &str, write: bool) -> io::Result<Box<dyn BenchFile>>;
    fn rename(&self, from: &str, to: &str) -> io::Result<()>;
    fn unlink(&self, path: &str) -> io::Result<()>;
    fn symlink(&self, target: &str, path: &str) -> io::Result<()>;
    /// Make everything durable (syncfs).
    fn sync(&self) -> io::Result<()>;
    /// (total bytes, used bytes), with fs_mark's meaning of used (total - available).
    fn usage(&self) -> io::Result<(u64, u64)>;
    /// The statistics of the device under the filesystem, if it is known.
    fn disk_stats(&self) -> Option<DiskStats>;
    /// Write `path` back and drop its pages from the cache, so the next read of it comes
    /// from the device. Ok(false): this filesystem cannot do that.
    fn drop_cache(&self, _path: &str) -> io::Result<bool> {
        Ok(false)
    }
    /// Wait, boundedly, until the device is idle and its IO policies are back in their
    /// resting state after set-up IO (wbstack: nothing in flight and wbt back at step 0,
    /// which idle windows bring about), so a measurement starts as on a quiet system
    /// rather than inside the set-up's writeback. Ok(false): it did not settle in time.
    /// A kernel filesystem's wbt state is not visible from here: nothing to wait for.
    fn settle(&self) -> io::Result<bool> {
        Ok(true)
    }
    /// Journal commits since mount, if the filesystem counts them where a tool can read
    /// them (wbstack's volume), so a tool counts them over its own window.
    fn journal_commits(&self) -> Option<u64> {
        None
    }
    /// Whatever else the filesystem measures (wbstack: writeback fairness).
    fn extra_stats(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
}

/// An open file.
pub trait BenchFile: Send {
    /// Write all of `buf` at `off`.
    fn write_at(&mut self, off: u64, buf: &[u8]) -> io::Result<()>;
    /// One read at `off`; a short count only at end of file.
    fn read_at(&mut self, off: u64, buf: &mut [u8]) -> io::Result<usize>;
    /// The file's size in bytes.
    fn size(&mut self) -> io::Result<u64>;
    /// ftruncate.
    fn set_len(&mut self, size: u64) -> io::Result<()>;
    fn fsync(&mut self) -> io::Result<()>;
    /// Start a flush of the file (data and metadata, as fsync) without waiting for it:
    /// fs_mark -A's aio_fsync. The file may be closed before the flush is waited on.
    fn start_flush(&mut self) -> io::Result<Box<dyn FlushWait>>;
    fn close(self: Box<Self>) -> io::Result<()>;
}

/// An asynchronous flush in progress.
pub trait FlushWait: Send {
    fn wait(self: Box<Self>) -> io::Result<()>;
}

/// wbstack's own filesystem: a fresh `Volume` on the device `spec` (see `volfs`), with
/// default mount options.
pub fn open_device(spec: &str) -> Result<Arc<dyn BenchFs>, String> {
    crate::bench::volfs::open(spec, "")
}

/// The targets of one invocation: `--device SPEC` (wbstack) and/or `--dir-path PATH`
/// (a kernel filesystem), in that order. Both given = the same workload on both.
pub fn open_targets(
    device: Option<&str>,
    dir_path: Option<&Path>,
) -> Result<Vec<Arc<dyn BenchFs>>, String> {
    open_targets_with(device, "", dir_path)
}

/// [`open_targets`] with mount options (name=value,...) for the wbstack filesystem.
pub fn open_targets_with(
    device: Option<&str>,
    mount_opts: &str,
    dir_path: Option<&Path>,
) -> Result<Vec<Arc<dyn BenchFs>>, String> {
    let mut v = Vec::new();
    if device.is_none() && dir_path.is_none() {
        return Err(
            "no target: give --dir-path PATH (a directory on a kernel filesystem) \
             and/or --device SPEC (wbstack's filesystem)"
                .into(),
        );
    }
    if let Some(spec) = device {
        v.push(crate::bench::volfs::open(spec, mount_opts)?);
    }
    if let Some(p) = dir_path {
        v.push(Arc::new(DirFs::new(p)?) as Arc<dyn BenchFs>);
    }
    Ok(v)
}

/// A directory of a kernel filesystem, through std::fs and a few system calls.
pub struct DirFs {
    root: PathBuf,
    fstype: String,
    /// /sys/dev/block/MAJ:MIN/stat of the device holding `root`, and its name.
    stat_path: Option<(PathBuf, String)>,
}

impl DirFs {
    /// `root` is created if missing.
    pub fn new(root: &Path) -> Result<DirFs, String> {
        std::fs::create_dir_all(root).map_err(|e| format!("{}: {e}", root.display()))?;
        let root = root
            .canonicalize()
            .map_err(|e| format!("{}: {e}", root.display()))?;
        let md = std::fs::metadata(&root).map_err(|e| format!("{}: {e}", root.display()))?;
        let dev = md.dev();
        let (maj, min) = (libc::major(dev), libc::minor(dev));
        // Major 0 is an anonymous device (tmpfs, overlay, btrfs subvolumes): no disk.
        let stat_path = if maj == 0 {
            None
        } else {
            let node = PathBuf::from(format!("/sys/dev/block/{maj}:{min}"));
            let name = std::fs::read_link(&node)
                .ok()
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| format!("{maj}:{min}"));
            let own = node.join("stat");
            // A partition has its own statistics; only if it has none use the disk's.
            if own.exists() {
                Some((own, name))
            } else {
                let parent = node.join("..").join("stat");
                parent.exists().then_some((parent, name))
            }
        };
        let fstype = mount_fstype(&root).unwrap_or_else(|| "?".into());
        Ok(DirFs {
            root,
            fstype,
            stat_path,
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The name of the block device under the directory, if any.
    pub fn device_name(&self) -> Option<&str> {
        self.stat_path.as_ref().map(|(_, n)| n.as_str())
    }

    fn path(&self, rel: &str) -> io::Result<PathBuf> {
        let rel = rel.trim_start_matches('/');
        let p = Path::new(rel);
        // A workload (an archive, say) must not reach outside the target directory.
        if p.components()
            .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("path '{rel}' leaves the target directory"),
            ));
        }
        Ok(self.root.join(p))
    }

    fn open_opts(&self, path: &str, o: &OpenOptions) -> io::Result<Box<dyn BenchFile>> {
        let p = self.path(path)?;
        let f = o
            .open(&p)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", p.display())))?;
        Ok(Box::new(DirFile { file: Arc::new(f) }))
    }
}

/// The filesystem type of the mount holding `p`, from /proc/self/mountinfo (longest
/// mount point that is a prefix of the canonical path).
fn mount_fstype(p: &Path) -> Option<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mut best: Option<(usize, String)> = None;
    for line in info.lines() {
        let mut parts = line.split(" - ");
        let left: Vec<&str> = parts.next()?.split_whitespace().collect();
        let right: Vec<&str> = parts.next()?.split_whitespace().collect();
        let (Some(mp), Some(fs)) = (left.get(4), right.first()) else {
            continue;
        };
        let mp = mp.replace("\\040", " ");
        if p.starts_with(&mp) && best.as_ref().is_none_or(|(l, _)| mp.len() >= *l) {
            best = Some((mp.len(), fs.to_string()));
        }
    }
    best.map(|(_, f)| f)
}

fn ctx(e: io::Error, what: &str, p: &Path) -> io::Error {
    io::Error::new(e.kind(), format!("{what} {}: {e}", p.display()))
}

impl BenchFs for DirFs {
    fn name(&self) -> String {
        match self.device_name() {
            Some(d) => format!("dir:{} ({} on {d})", self.root.display(), self.fstype),
            None => format!("dir:{} ({})", self.root.display(), self.fstype),
        }
    }

    fn mkdir_all(&self, path: &str) -> io::Result<()> {
        let p = self.path(path)?;
        // One mkdir(2) when the parent exists, as fs_mark does before every file: its
        // App Overhead counts that call, so a stat on top would inflate ours. Something
        // else than a directory in the way shows up at the next create inside.
        match std::fs::create_dir(&p) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
            Err(_) => std::fs::create_dir_all(&p).map_err(|e| ctx(e, "mkdir", &p)),
        }
    }

    fn create(&self, path: &str) -> io::Result<Box<dyn BenchFile>> {
        let mut o = OpenOptions::new();
        o.write(true).create(true).truncate(true);
        self.open_opts(path, &o)
    }

    fn open(&self, path: &str, write: bool) -> io::Result<Box<dyn BenchFile>> {
        let mut o = OpenOptions::new();
        o.read(true).write(write);
        self.open_opts(path, &o)
    }

    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let (a, b) = (self.path(from)?, self.path(to)?);
        std::fs::rename(&a, &b).map_err(|e| ctx(e, "rename", &a))
    }

    fn unlink(&self, path: &str) -> io::Result<()> {
        let p = self.path(path)?;
        std::fs::remove_file(&p).map_err(|e| ctx(e, "unlink", &p))
    }

    fn symlink(&self, target: &str, path: &str) -> io::Result<()> {
        let p = self.path(path)?;
        std::os::unix::fs::symlink(target, &p).map_err(|e| ctx(e, "symlink", &p))
    }

    fn sync(&self) -> io::Result<()> {
        let d = File::open(&self.root).map_err(|e| ctx(e, "open", &self.root))?;
        // SAFETY: syncfs takes a file descriptor we own and keep open for the call.
        let rc = unsafe { libc::syncfs(d.as_raw_fd()) };
        if rc != 0 {
            return Err(ctx(io::Error::last_os_error(), "syncfs", &self.root));
        }
        Ok(())
    }

    fn usage(&self) -> io::Result<(u64, u64)> {
        let c = std::ffi::CString::new(self.root.as_os_str().as_encoded_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: statvfs is plain integers, for which all-zero is a valid value.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: `c` is a NUL-terminated path and `st` a struct we own.
        let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
        if rc != 0 {
            return Err(ctx(io::Error::last_os_error(), "statvfs", &self.root));
        }
        let bs = st.f_frsize as u64;
        let total = st.f_blocks as u64 * bs;
        let used = (st.f_blocks as u64).saturating_sub(st.f_bavail as u64) * bs;
        Ok((total, used))
    }

    fn disk_stats(&self) -> Option<DiskStats> {
        let (p, _) = self.stat_path.as_ref()?;
        let s = std::fs::read_to_string(p).ok()?;
        DiskStats::parse(&s).ok()
    }

    fn drop_cache(&self, path: &str) -> io::Result<bool> {
        let p = self.path(path)?;
        let f = File::open(&p).map_err(|e| ctx(e, "open", &p))?;
        // Dirty pages are not dropped by DONTNEED: write them back first.
        f.sync_all().map_err(|e| ctx(e, "fsync", &p))?;
        // SAFETY: posix_fadvise takes a descriptor we own; offset 0, len 0 = whole file.
        let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            return Err(ctx(io::Error::from_raw_os_error(rc), "posix_fadvise", &p));
        }
        Ok(true)
    }
}

struct DirFile {
    /// Shared with asynchronous flushes still in flight, which keep the descriptor open.
    file: Arc<File>,
}

impl BenchFile for DirFile {
    fn write_at(&mut self, off: u64, buf: &[u8]) -> io::Result<()> {
        self.file.write_all_at(buf, off)
    }
    fn read_at(&mut self, off: u64, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.file.read_at(buf, off) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => return r,
            }
        }
    }
    fn size(&mut self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }
    fn set_len(&mut self, size: u64) -> io::Result<()> {
        self.file.set_len(size)
    }
    fn fsync(&mut self) -> io::Result<()> {
        self.file.sync_all()
    }
    fn start_flush(&mut self) -> io::Result<Box<dyn FlushWait>> {
        start_async_fsync(&self.file)
    }
    fn close(self: Box<Self>) -> io::Result<()> {
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Asynchronous fsync: IORING_OP_FSYNC on one io_uring per thread (the kernel runs the
// fsync in an io-wq worker, so the submitter goes on at once, like fs_mark -A's
// aio_fsync). Where io_uring is unavailable (seccomp), a thread per flush.

const RING_ENTRIES: u32 = 256;

struct Ring {
    ring: io_uring::IoUring,
    next_id: u64,
    /// Results reaped while waiting for another flush of the same ring.
    done: HashMap<u64, i32>,
}

thread_local! {
    static RING: RefCell<Option<Result<Arc<Mutex<Ring>>, String>>> = const { RefCell::new(None) };
}

/// `WBSTACK_ASYNC_FLUSH=threads` forces the fallback (to compare, or to test it).
fn thread_ring() -> Result<Arc<Mutex<Ring>>, String> {
    if std::env::var_os("WBSTACK_ASYNC_FLUSH").is_some_and(|v| v == "threads") {
        return Err("WBSTACK_ASYNC_FLUSH=threads".into());
    }
    RING.with(|r| {
        r.borrow_mut()
            .get_or_insert_with(|| {
                io_uring::IoUring::new(RING_ENTRIES)
                    .map(|ring| {
                        Arc::new(Mutex::new(Ring {
                            ring,
                            next_id: 0,
                            done: HashMap::new(),
                        }))
                    })
                    .map_err(|e| e.to_string())
            })
            .clone()
    })
}

/// How asynchronous flushes are done in this process: "io_uring" or "threads".
pub fn async_flush_mechanism() -> &'static str {
    if thread_ring().is_ok() {
        "io_uring"
    } else {
        "threads"
    }
}

fn start_async_fsync(file: &Arc<File>) -> io::Result<Box<dyn FlushWait>> {
    let ring = match thread_ring() {
        Ok(r) => r,
        Err(_) => return Ok(Box::new(ThreadFlush::start(file.clone()))),
    };
    let id = {
        let mut g = ring.lock();
        let id = g.next_id;
        g.next_id += 1;
        let sqe = io_uring::opcode::Fsync::new(io_uring::types::Fd(file.as_raw_fd()))
            .build()
            .user_data(id);
        loop {
            // SAFETY: an fsync SQE refers to no user memory, only to the descriptor; that
            // stays open until the completion is reaped, because the UringFlush returned
            // below owns a reference to the File and waits for the CQE (in `wait` or on
            // drop) before releasing it.
            let pushed = unsafe { g.ring.submission().push(&sqe) }.is_ok();
            if pushed {
                break;
            }
            // Submission queue full: hand what is queued to the kernel, then retry.
            g.ring.submit()?;
        }
        // Once pushed, the SQE cannot be taken back: if the submit fails it stays in the
        // ring and goes out with a later one. So the UringFlush is returned whatever
        // happens here, owning the file for that SQE; its wait submits it again
        // (submit_and_wait) and reports the error.
        let _ = g.ring.submit();
        id
    };
    Ok(Box::new(UringFlush {
        ring,
        id,
        file: Some(file.clone()),
    }))
}

struct UringFlush {
    ring: Arc<Mutex<Ring>>,
    id: u64,
    /// Keeps the descriptor open until the completion is reaped; None once it is.
    file: Option<Arc<File>>,
}

impl UringFlush {
    fn reap(&mut self) -> io::Result<()> {
        if self.file.is_none() {
            return Ok(());
        }
        let mut g = self.ring.lock();
        let res = loop {
            if let Some(res) = g.done.remove(&self.id) {
                break res;
            }
            // Ours is not reaped, so it is still in flight: at least one CQE will come.
            match g.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // Our fsync may still be queued or in flight: keep its descriptor
                    // open for good rather than close it under the SQE (a later
                    // submission would then fsync whatever file reused the number).
                    std::mem::forget(self.file.take());
                    return Err(e);
                }
            }
            let Ring { ring, done, .. } = &mut *g;
            for cqe in ring.completion() {
                done.insert(cqe.user_data(), cqe.result());
            }
        };
        drop(g);
        self.file = None;
        if res < 0 {
            return Err(io::Error::from_raw_os_error(-res));
        }
        Ok(())
    }
}

impl FlushWait for UringFlush {
    fn wait(mut self: Box<Self>) -> io::Result<()> {
        self.reap()
    }
}

impl Drop for UringFlush {
    fn drop(&mut self) {
        // The descriptor may not be closed under an fsync still in flight.
        let _ = self.reap();
    }
}

struct ThreadFlush {
    rx: mpsc::Receiver<io::Result<()>>,
}

impl ThreadFlush {
    fn start(file: Arc<File>) -> ThreadFlush {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(file.sync_all());
        });
        ThreadFlush { rx }
    }
}

impl FlushWait for ThreadFlush {
    fn wait(self: Box<Self>) -> io::Result<()> {
        self.rx
            .recv()
            .unwrap_or_else(|_| Err(io::Error::other("flush thread died")))
    }
}

// ---------------------------------------------------------------------------------------

/// The device figures of a workload, from a diskstats delta over `secs`.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct DeviceWrites {
    pub write_ios: u64,
    pub write_iops: f64,
    pub write_mib_s: f64,
    pub avg_write_kib: f64,
    pub write_merges: u64,
    pub flushes: u64,
    pub read_ios: u64,
}

impl DeviceWrites {
    pub fn from_delta(d: &DiskStats, secs: f64) -> DeviceWrites {
        let ios = d.writes();
        let secs = secs.max(1e-9);
        DeviceWrites {
            write_ios: ios,
            write_iops: ios as f64 / secs,
            write_mib_s: d.sectors[1] as f64 * 512.0 / secs / (1u64 << 20) as f64,
            avg_write_kib: if ios == 0 {
                0.0
            } else {
                d.sectors[1] as f64 / 2.0 / ios as f64
            },
            write_merges: d.merges[1],
            flushes: d.flushes(),
            read_ios: d.reads(),
        }
    }

    /// The delta between two optional snapshots: None if the device is unknown.
    pub fn between(
        before: &Option<DiskStats>,
        after: &Option<DiskStats>,
        secs: f64,
    ) -> Option<DeviceWrites> {
        match (before, after) {
            (Some(b), Some(a)) => Some(DeviceWrites::from_delta(&a.delta(b), secs)),
            _ => None,
        }
    }
}

/// Add the counters of `d` into `acc` (to sum the deltas of several windows).
pub fn add_stats(acc: &mut DiskStats, d: &DiskStats) {
    for g in 0..4 {
        acc.ios[g] += d.ios[g];
        acc.merges[g] += d.merges[g];
        acc.sectors[g] += d.sectors[g];
        acc.nsecs[g] += d.nsecs[g];
    }
    acc.io_ticks_ms += d.io_ticks_ms;
    acc.time_in_queue_ms += d.time_in_queue_ms;
}

/// "io_error: context" for the tools' String errors.
pub fn err(what: impl std::fmt::Display) -> impl FnOnce(io::Error) -> String {
    move |e| format!("{what}: {e}")
}
