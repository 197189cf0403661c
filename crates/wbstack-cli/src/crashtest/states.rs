//! Every crash state of a write log (CrashMonkey's method), for short workloads that
//! reproduce the kernel's crash-consistency bug reports.
//!
//! A workload runs once, single-threaded, with no periodic writeback or commit, on a
//! memory device with a volatile cache under a log-writes layer
//! ([`wbstack::block::logwrites`]); its operations are logged as crashtest logs them,
//! with the write log's position at each acknowledgement. Then, for each window of the
//! write log (the durable prefix up to a flush, and the writes after it), the crash
//! states are: every subset of the window's writes when there are at most
//! `exhaustive_up_to` of them, else every subset of at most two, all of them, and
//! `samples` seeded random subsets; plus, for each write of more than one sector, torn
//! versions (a seeded subset of its sectors) alone and with every other write kept.
//! Each state is built on a memory device, recovered and checked by crashtest's checks
//! against the acknowledgements made before the state's cutoff
//! ([`WriteLog::ack_cutoff`]). A state is named by workload, window and subset, and a
//! failing one writes a replay file.

use super::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;
use wbstack::block::logwrites::{Kept, LogWrites, Window, WriteLog};
use wbstack::block::{QueueConfig, RequestQueue};
use wbstack::dev::null::NullDevice;
use wbstack::dev::store::SparseStore;
use wbstack::dev::DeviceSpec;
use wbstack::fs::{File, FsError, FsResult, MkfsOptions, MountOptions, OpenOptions, Volume};

/// The recording device: memory, a volatile write cache (so the volume flushes), 4 KiB
/// sectors as the sim's.
const DEVICE: &str = "null,memory_backed=1,wc=1,lbs=4096,size=64M,hw_queues=1";
const DEVICE_BYTES: u64 = 64 << 20;

#[derive(Clone, Debug)]
pub struct StatesOpts {
    /// Workload names (empty: all).
    pub workloads: Vec<String>,
    pub seed: u64,
    pub exhaustive_up_to: usize,
    pub samples: usize,
    /// Torn versions of each multi-sector write (alone, and with the rest kept).
    pub torn: usize,
    /// Seeds of the random workload (from `seed` on).
    pub random_seeds: u64,
    pub rule: FsyncRule,
    pub save_dir: Option<PathBuf>,
    pub progress: bool,
    /// Testing the tool: the volume's PREFLUSH is dropped before the write log sees it
    /// (a filesystem that forgot one ordering), so states must fail.
    pub drop_preflush: bool,
    /// The recorded volume's `journal_data_kb` (`-o journal_data_kb=N`): 0 records
    /// ordered data only, as the default mount; N > 0 puts fsyncs of up to N KiB
    /// through the journaled-data path (`fs::jdata`).
    pub journal_data_kb: u64,
}

impl Default for StatesOpts {
    fn default() -> Self {
        StatesOpts {
            workloads: Vec::new(),
            seed: 1,
            exhaustive_up_to: 8,
            samples: 32,
            torn: 2,
            random_seeds: 24,
            rule: FsyncRule::Inode,
            save_dir: None,
            progress: false,
            drop_preflush: false,
            journal_data_kb: 0,
        }
    }
}

/// Drops PREFLUSH from every request: the broken ordering of `drop_preflush`.
struct DropPreflush(wbstack::dev::DeviceRef);

impl wbstack::dev::Device for DropPreflush {
    wbstack::stacked_device!(0);
    fn queue_rq(&self, mut rq: wbstack::block::Request, done: &wbstack::dev::Completer) {
        use wbstack::block::BioFlags;
        rq.flags = BioFlags(rq.flags.0 & !BioFlags::PREFLUSH.0);
        self.0.queue_rq(rq, done)
    }
}

/// One workload's results.
#[derive(Clone, Debug, Default, Serialize)]
pub struct WorkloadStates {
    pub workload: String,
    /// What the workload reproduces.
    pub about: String,
    pub operations: usize,
    pub device_writes: usize,
    pub flushes: usize,
    pub windows: usize,
    pub states: u64,
    /// Subsets no crash can leave (a write kept that was sent after a FUA write that
    /// was not): skipped.
    pub impossible: u64,
    pub failures: u64,
    /// The first failures: the state's name, what failed, and its replay file.
    pub failed: Vec<String>,
    pub seconds: f64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct StatesSummary {
    pub seed: u64,
    pub workloads: Vec<WorkloadStates>,
    pub states: u64,
    pub failures: u64,
    pub seconds: f64,
}

/// A workload: a name, what kernel bug report it follows, and its script.
pub struct Workload {
    pub name: &'static str,
    pub about: &'static str,
    run: fn(&mut Script, &mut ChaCha8Rng) -> FsResult<()>,
}

/// A single-threaded script of operations against a volume, logged as crashtest logs
/// them, with the write log's position at every acknowledgement.
pub struct Script {
    vol: Volume,
    logw: Arc<LogWrites>,
    log: Log,
    ack_pos: HashMap<u64, usize>,
    root: u64,
    /// Path -> inode, for every name the script made.
    names: HashMap<String, u64>,
    dirs: HashMap<u64, bool>,
    open: HashMap<u64, Arc<File>>,
    next_ver: u64,
}

fn split(path: &str) -> (&str, &str) {
    match path.rfind('/') {
        Some(0) => ("/", &path[1..]),
        Some(i) => (&path[..i], &path[i + 1..]),
        None => ("/", path),
    }
}

impl Script {
    fn dir_ino(&self, path: &str) -> u64 {
        let (d, _) = split(path);
        if d == "/" {
            self.root
        } else {
            self.names[d]
        }
    }

    fn ino(&self, path: &str) -> FsResult<u64> {
        self.names
            .get(path)
            .copied()
            .ok_or_else(|| FsError::Invalid(format!("script: {path} was never made")))
    }

    fn handle(&mut self, path: &str) -> FsResult<Arc<File>> {
        let ino = self.ino(path)?;
        if let Some(h) = self.open.get(&ino) {
            return Ok(h.clone());
        }
        let h = Arc::new(self.vol.open(path, &OpenOptions::read_write())?);
        self.open.insert(ino, h.clone());
        Ok(h)
    }

    pub fn create(&mut self, path: &str) -> FsResult<()> {
        let f = self.vol.create(path)?;
        let ino = f.ino();
        let dir = self.dir_ino(path);
        self.log.push(Entry::Create {
            dir,
            name: split(path).1.into(),
            ino,
            is_dir: false,
        });
        self.names.insert(path.into(), ino);
        self.dirs.insert(ino, false);
        self.open.insert(ino, Arc::new(f));
        Ok(())
    }

    pub fn mkdir(&mut self, path: &str) -> FsResult<()> {
        let ino = self.vol.mkdir(path, 0o755)?;
        let dir = self.dir_ino(path);
        self.log.push(Entry::Create {
            dir,
            name: split(path).1.into(),
            ino,
            is_dir: true,
        });
        self.names.insert(path.into(), ino);
        self.dirs.insert(ino, true);
        Ok(())
    }

    /// `sectors` self-describing sectors at `sector`.
    pub fn write(&mut self, path: &str, sector: u64, sectors: u64) -> FsResult<()> {
        let h = self.handle(path)?;
        let ino = h.ino();
        self.next_ver += 1;
        let ver = self.next_ver;
        let start = self.log.len();
        let r = h.write_all_at(sector * SECTOR, &write_payload(ino, sector, sectors, ver));
        self.log.push(Entry::Write {
            ino,
            sector,
            sectors,
            ver,
            start,
            ok: r.is_ok(),
            // One thread: the log's order is the order of events.
            done: 0,
        });
        r.map(|_| ())
    }

    /// fallocate(PUNCH_HOLE | KEEP_SIZE) of whole sectors.
    pub fn punch(&mut self, path: &str, sector: u64, sectors: u64) -> FsResult<()> {
        let h = self.handle(path)?;
        let r = h.fallocate(
            wbstack::fs::ops::FALLOC_FL_PUNCH_HOLE | wbstack::fs::ops::FALLOC_FL_KEEP_SIZE,
            sector * SECTOR,
            sectors * SECTOR,
        );
        let end = h.size().div_ceil(SECTOR);
        self.log.push(Entry::Zero {
            ino: h.ino(),
            sector,
            sectors: sectors.min(end.saturating_sub(sector)),
            ok: r.is_ok(),
        });
        r
    }

    /// fallocate(KEEP_SIZE): space past the end, the size unchanged.
    pub fn fallocate_keep_size(&mut self, path: &str, off: u64, len: u64) -> FsResult<()> {
        self.handle(path)?
            .fallocate(wbstack::fs::ops::FALLOC_FL_KEEP_SIZE, off, len)
    }

    pub fn truncate(&mut self, path: &str, size: u64) -> FsResult<()> {
        let h = self.handle(path)?;
        h.set_len(size)?;
        self.log.push(Entry::Truncate { ino: h.ino(), size });
        Ok(())
    }

    fn barrier(&mut self, kind: Barrier, f: impl FnOnce(&Self) -> FsResult<()>) -> FsResult<()> {
        let id = self.log.start_barrier(kind);
        f(self)?;
        // Everything the call waited for was logged before it returned.
        self.ack_pos.insert(id, self.logw.position());
        self.log.ack_barrier(id);
        Ok(())
    }

    pub fn fsync(&mut self, path: &str) -> FsResult<()> {
        let h = self.handle(path)?;
        self.barrier(Barrier::Fsync(h.ino()), |_| h.fsync())
    }

    pub fn fdatasync(&mut self, path: &str) -> FsResult<()> {
        let h = self.handle(path)?;
        self.barrier(Barrier::Fdatasync(h.ino()), |_| h.fdatasync())
    }

    /// fsync of a directory, as the mount serves it: the journal commits.
    pub fn fsync_dir(&mut self, path: &str) -> FsResult<()> {
        let ino = if path == "/" {
            self.root
        } else {
            self.ino(path)?
        };
        self.barrier(Barrier::Fsync(ino), |s| s.vol.commit_now())
    }

    pub fn sync(&mut self) -> FsResult<()> {
        self.barrier(Barrier::Sync, |s| s.vol.sync())
    }

    /// The last close of the script's handle (flush-on-close acts here).
    pub fn close(&mut self, path: &str) -> FsResult<()> {
        let ino = self.ino(path)?;
        if let Some(h) = self.open.remove(&ino) {
            match Arc::try_unwrap(h) {
                Ok(f) => {
                    // Every write logged so far returned before this close.
                    self.log.push(Entry::Close { ino });
                    f.close()?
                }
                Err(_) => return Err(FsError::Busy(format!("script: {path} is open twice"))),
            }
        }
        Ok(())
    }

    pub fn link(&mut self, from: &str, to: &str) -> FsResult<()> {
        self.vol.link(from, to)?;
        let ino = self.ino(from)?;
        self.log.push(Entry::Link {
            dir: self.dir_ino(to),
            name: split(to).1.into(),
            ino,
        });
        self.names.insert(to.into(), ino);
        Ok(())
    }

    pub fn unlink(&mut self, path: &str) -> FsResult<()> {
        let ino = self.ino(path)?;
        if self.dirs[&ino] {
            self.vol.rmdir(path)?;
        } else {
            self.vol.unlink(path)?;
        }
        self.log.push(Entry::Unlink {
            dir: self.dir_ino(path),
            name: split(path).1.into(),
            ino,
        });
        self.names.remove(path);
        Ok(())
    }

    pub fn rename(&mut self, from: &str, to: &str) -> FsResult<()> {
        let ino = self.ino(from)?;
        let victim = self.names.get(to).copied();
        self.vol.rename(from, to)?;
        self.log.push(Entry::Rename {
            from_dir: self.dir_ino(from),
            from: split(from).1.into(),
            to_dir: self.dir_ino(to),
            to: split(to).1.into(),
            ino,
            victim,
        });
        self.names.remove(from);
        self.names.insert(to.into(), ino);
        let prefix = format!("{from}/");
        let moved: Vec<(String, u64)> = self
            .names
            .iter()
            .filter(|(p, _)| p.starts_with(&prefix))
            .map(|(p, &i)| (p.clone(), i))
            .collect();
        for (p, i) in moved {
            self.names.remove(&p);
            self.names.insert(format!("{to}/{}", &p[prefix.len()..]), i);
        }
        Ok(())
    }
}

// The workloads. Sizes in sectors of 512 bytes; 8 sectors are one block.

fn rename_over(s: &mut Script, _: &mut ChaCha8Rng) -> FsResult<()> {
    // The replace-via-rename pattern (ext4's auto_da_alloc reports, btrfs's
    // "rename over a file loses both"): the new file is written, not fsynced, closed and
    // renamed over the old one; the old or the new content must survive, never neither.
    s.create("/a")?;
    s.write("/a", 0, 24)?;
    s.fsync("/a")?;
    s.create("/a.tmp")?;
    s.write("/a.tmp", 0, 40)?;
    s.close("/a.tmp")?;
    s.rename("/a.tmp", "/a")?;
    s.create("/b")?;
    s.write("/b", 0, 8)?;
    s.fsync("/b")?;
    s.create("/b.tmp")?;
    s.write("/b.tmp", 0, 16)?;
    s.fsync("/b.tmp")?;
    s.rename("/b.tmp", "/b")?;
    s.fsync_dir("/")
}

fn replace(s: &mut Script, _: &mut ChaCha8Rng) -> FsResult<()> {
    // The replace-by-rename pattern without fsync or a close before the rename (ext4's
    // auto_da_alloc reports): once the rename is durable the name holds the whole new
    // file. The second one is larger than journal_data_kb's 64 KiB and is written
    // again after the rename (not covered: fsync it).
    s.create("/a")?;
    s.write("/a", 0, 16)?;
    s.fsync("/a")?;
    s.create("/a.new")?;
    s.write("/a.new", 0, 40)?;
    s.rename("/a.new", "/a")?;
    s.close("/a")?;
    s.create("/a.new2")?;
    s.write("/a.new2", 0, 150)?;
    s.rename("/a.new2", "/a")?;
    s.write("/a", 150, 8)?;
    s.close("/a")?;
    s.fsync_dir("/")
}

fn link_unlink(s: &mut Script, _: &mut ChaCha8Rng) -> FsResult<()> {
    // Hard links and fsync (ext4/btrfs "fsync of a file with a new hard link loses the
    // link" and "unlink then fsync of the other name"): names added and removed
    // between fsyncs of the inode they name.
    s.mkdir("/d")?;
    s.create("/d/f")?;
    s.write("/d/f", 0, 16)?;
    s.fsync("/d/f")?;
    s.link("/d/f", "/g")?;
    s.fsync("/d/f")?;
    s.unlink("/d/f")?;
    s.write("/g", 16, 8)?;
    s.fsync("/g")?;
    s.create("/d/f")?;
    s.write("/d/f", 0, 4)?;
    s.link("/d/f", "/d/h")?;
    s.unlink("/g")?;
    s.fsync("/d/h")
}

fn truncate_write(s: &mut Script, _: &mut ChaCha8Rng) -> FsResult<()> {
    // Truncate then write (xfs's "truncate down then extend exposes stale data", ext4's
    // zeroing of the partial block at EOF): shrink inside a block, write past the new
    // end, shrink to zero, rewrite.
    s.create("/t")?;
    s.write("/t", 0, 64)?;
    s.fsync("/t")?;
    // Inside a block (the checker reads whole sectors, so on a sector boundary).
    s.truncate("/t", 5 * 512)?;
    s.write("/t", 20, 12)?;
    s.fsync("/t")?;
    s.truncate("/t", 0)?;
    s.write("/t", 0, 10)?;
    s.fdatasync("/t")?;
    s.truncate("/t", 40 * 512)?;
    s.fsync("/t")
}

fn fsync_dir(s: &mut Script, _: &mut ChaCha8Rng) -> FsResult<()> {
    // fsync of a directory makes the names in it durable (the "create, fsync the
    // parent, crash, file gone" reports).
    s.mkdir("/d")?;
    s.create("/d/x")?;
    s.write("/d/x", 0, 8)?;
    s.fsync("/d/x")?;
    s.create("/d/y")?;
    s.mkdir("/d/sub")?;
    s.fsync_dir("/d")?;
    s.rename("/d/y", "/d/sub/y")?;
    s.unlink("/d/x")?;
    s.fsync_dir("/d/sub")?;
    s.create("/d/sub/z")?;
    s.fsync_dir("/d")
}

fn fdatasync_extend(s: &mut Script, _: &mut ChaCha8Rng) -> FsResult<()> {
    // fdatasync after extending a file must make the new size durable (ext4's and xfs's
    // "fdatasync skipped the size update" reports).
    s.create("/e")?;
    s.write("/e", 0, 8)?;
    s.fsync("/e")?;
    s.write("/e", 8, 16)?;
    s.fdatasync("/e")?;
    s.write("/e", 24, 3)?;
    s.fdatasync("/e")?;
    s.write("/e", 4, 2)?;
    s.fdatasync("/e")?;
    s.write("/e", 40, 9)?;
    s.fdatasync("/e")
}

fn fallocate_keep_size(s: &mut Script, _: &mut ChaCha8Rng) -> FsResult<()> {
    // fallocate with KEEP_SIZE past the end must not change the size after a crash,
    // and the space it reserved must read as zeros once the file grows over it (ext4's
    // and btrfs's "size wrong after fallocate -k" reports).
    s.create("/k")?;
    s.write("/k", 0, 16)?;
    s.fsync("/k")?;
    s.fallocate_keep_size("/k", 16 * 512, 1 << 20)?;
    s.fsync("/k")?;
    s.write("/k", 24, 8)?;
    s.fsync("/k")?;
    s.truncate("/k", 64 * 512)?;
    s.fdatasync("/k")
}

fn punch_hole(s: &mut Script, _: &mut ChaCha8Rng) -> FsResult<()> {
    // Punching a hole must zero the range durably once fsynced and never bring back
    // the old data (the "punch hole, fsync, crash, old data back" reports).
    s.create("/p")?;
    s.write("/p", 0, 128)?;
    s.fsync("/p")?;
    s.punch("/p", 16, 32)?;
    s.fsync("/p")?;
    s.punch("/p", 61, 3)?;
    s.fdatasync("/p")?;
    s.write("/p", 20, 4)?;
    s.punch("/p", 0, 8)?;
    s.fsync("/p")
}

fn mount_ops(s: &mut Script, _: &mut ChaCha8Rng) -> FsResult<()> {
    // What programs do through the mount: write and close (flush-on-close), replace a
    // file, rename a directory, remove a tree, fsync the directory.
    s.mkdir("/src")?;
    s.create("/src/one")?;
    s.write("/src/one", 0, 24)?;
    s.close("/src/one")?;
    s.create("/src/two")?;
    s.write("/src/two", 0, 9)?;
    s.close("/src/two")?;
    s.rename("/src", "/dst")?;
    s.fsync_dir("/")?;
    s.create("/dst/one.new")?;
    s.write("/dst/one.new", 0, 16)?;
    s.close("/dst/one.new")?;
    s.rename("/dst/one.new", "/dst/one")?;
    s.truncate("/dst/two", 0)?;
    s.close("/dst/two")?;
    s.unlink("/dst/two")?;
    s.sync()?;
    s.unlink("/dst/one")?;
    s.unlink("/dst")?;
    s.fsync_dir("/")
}

/// A seeded mix of every operation above on a few files in two directories, with
/// fsyncs rarer than in the scripted workloads, so windows hold several writes.
fn random(s: &mut Script, rng: &mut ChaCha8Rng) -> FsResult<()> {
    s.mkdir("/d0")?;
    s.mkdir("/d1")?;
    let dirs = ["/", "/d0", "/d1"];
    let mut made = 0;
    let path = |d: &str, n: &str| {
        if d == "/" {
            format!("/{n}")
        } else {
            format!("{d}/{n}")
        }
    };
    for _ in 0..RANDOM_OPS {
        let mut files: Vec<String> = s
            .names
            .iter()
            .filter(|(_, i)| !s.dirs[*i])
            .map(|(p, _)| p.clone())
            .collect();
        files.sort();
        if files.is_empty() || (files.len() < 5 && rng.gen_ratio(1, 6)) {
            made += 1;
            let p = path(dirs[rng.gen_range(0..3)], &format!("f{made}"));
            s.create(&p)?;
            continue;
        }
        let f = files[rng.gen_range(0..files.len())].clone();
        let sectors = s.handle(&f)?.size().div_ceil(SECTOR);
        match rng.gen_range(0..100) {
            0..40 => {
                let n = rng.gen_range(1..=24);
                let at = if rng.gen_bool(0.6) {
                    sectors
                } else {
                    rng.gen_range(0..=sectors)
                };
                s.write(&f, at, n)?;
            }
            40..46 => s.truncate(&f, rng.gen_range(0..=sectors + 8) * SECTOR)?,
            46..50 if sectors > 0 => {
                let at = rng.gen_range(0..sectors);
                s.punch(&f, at, rng.gen_range(1..=sectors - at))?;
            }
            50..52 => s.fallocate_keep_size(&f, sectors * SECTOR, 1 << 16)?,
            52..57 => {
                made += 1;
                s.link(&f, &path(dirs[rng.gen_range(0..3)], &format!("l{made}")))?;
            }
            57..62 => {
                made += 1;
                s.rename(&f, &path(dirs[rng.gen_range(0..3)], &format!("r{made}")))?;
            }
            62..66 => {
                let g = files[rng.gen_range(0..files.len())].clone();
                if g != f && s.names[&g] != s.names[&f] {
                    s.close(&f)?;
                    s.rename(&f, &g)?;
                }
            }
            66..72 => {
                s.close(&f)?;
                s.unlink(&f)?;
            }
            72..76 => s.close(&f)?,
            76..80 => {
                // A replace: a new file written once, renamed over `f`, then closed.
                made += 1;
                let tmp = format!("{f}.new{made}");
                s.create(&tmp)?;
                s.write(&tmp, 0, rng.gen_range(1..=40))?;
                s.rename(&tmp, &f)?;
                s.close(&f)?;
            }
            80..88 => s.fsync(&f)?,
            88..93 => s.fdatasync(&f)?,
            93..97 => s.fsync_dir(dirs[rng.gen_range(0..3)])?,
            _ => s.sync()?,
        }
    }
    Ok(())
}

/// Operations of one random workload.
const RANDOM_OPS: usize = 60;

pub const WORKLOADS: &[Workload] = &[
    Workload {
        name: "rename-over",
        about: "replace a file by renaming a new one over it",
        run: rename_over,
    },
    Workload {
        name: "replace",
        about: "write a new file, rename it over an old one, close it (no fsync)",
        run: replace,
    },
    Workload {
        name: "link-unlink",
        about: "hard links added and removed between fsyncs",
        run: link_unlink,
    },
    Workload {
        name: "truncate-write",
        about: "truncate down, then write past the new end",
        run: truncate_write,
    },
    Workload {
        name: "fsync-dir",
        about: "fsync of a directory makes its names durable",
        run: fsync_dir,
    },
    Workload {
        name: "fdatasync-extend",
        about: "fdatasync after extending a file keeps the size",
        run: fdatasync_extend,
    },
    Workload {
        name: "fallocate-keep-size",
        about: "fallocate -k past the end keeps the size; the space reads zeros",
        run: fallocate_keep_size,
    },
    Workload {
        name: "punch-hole",
        about: "a punched hole stays zeros, old data never returns",
        run: punch_hole,
    },
    Workload {
        name: "mount-ops",
        about: "write+close, replace, rename a directory, remove a tree",
        run: mount_ops,
    },
    Workload {
        name: "random",
        about: "a seeded mix of all of the above (--random-seeds of them)",
        run: random,
    },
];

/// No periodic writeback or commit: only the script's calls make IO, so the write log
/// is the same on every run.
fn quiet() -> MountOptions {
    let mut o = MountOptions::default();
    o.wb.dirty_writeback_centisecs = 0;
    o.commit_interval_ms = 3_600_000;
    o
}

fn memory_device() -> Result<NullDevice, String> {
    NullDevice::from_spec(
        &DeviceSpec::parse(DEVICE).map_err(|e| e.to_string())?,
        QueueConfig::default().clock,
    )
    .map_err(|e| e.to_string())
}

/// A workload's recording: its operation log, acknowledgement positions, write log.
pub struct Recording {
    /// The image mkfs left (made durable: a crash inside mkfs is no state to check).
    pub base: SparseStore,
    pub log: Log,
    pub ack_pos: HashMap<u64, usize>,
    pub writes: WriteLog,
}

pub fn record(
    w: &Workload,
    seed: u64,
    drop_preflush: bool,
    journal_data_kb: u64,
) -> Result<Recording, String> {
    let logw = Arc::new(LogWrites::new(Arc::new(memory_device()?)));
    let top: wbstack::dev::DeviceRef = if drop_preflush {
        Arc::new(DropPreflush(logw.clone()))
    } else {
        logw.clone()
    };
    let q = RequestQueue::new(top, QueueConfig::default()).map_err(|e| e.to_string())?;
    Volume::mkfs(
        &q,
        &MkfsOptions {
            fs_id: Some(1),
            format: None,
        },
    )
    .map_err(|e| format!("mkfs: {e}"))?;
    let mkfs = logw.take_log();
    let mut base = SparseStore::new();
    mkfs.apply_prefix(&mut base, 0, mkfs.entries().len());
    let vol = Volume::mount(
        q,
        MountOptions {
            journal_data_kb,
            ..quiet()
        },
    )
    .map_err(|e| format!("mount: {e}"))?;
    let root = vol.stat("/").map_err(|e| e.to_string())?.ino;
    let deferred = quiet().flush_on_close;
    let mut s = Script {
        vol,
        logw: logw.clone(),
        log: Log::deferring_zero_truncates(deferred),
        ack_pos: HashMap::new(),
        root,
        names: HashMap::new(),
        dirs: HashMap::new(),
        open: HashMap::new(),
        next_ver: 0,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(mix(seed ^ 0x7261_6e64));
    (w.run)(&mut s, &mut rng).map_err(|e| format!("workload {} (seed {seed}): {e}", w.name))?;
    // The machine stops here: nothing more is written back or committed.
    s.open.clear();
    s.vol.crash();
    Ok(Recording {
        base,
        log: s.log,
        ack_pos: s.ack_pos,
        writes: logw.take_log(),
    })
}

/// The operation log as a state with this cutoff sees it: acknowledgements made after
/// the cutoff never happened.
fn log_before(r: &Recording, cutoff: usize) -> Log {
    let mut log = Log::deferring_zero_truncates(r.log.deferred_zero_truncates);
    // Index in the full log -> index in this one (a write's `start` is an index).
    let mut index = Vec::with_capacity(r.log.len() + 1);
    for e in &r.log.entries {
        index.push(log.len());
        if let Entry::BarrierAck { id } = e {
            if r.ack_pos.get(id).is_none_or(|&p| p > cutoff) {
                continue;
            }
        }
        let mut e = e.clone();
        if let Entry::Write { start, .. } = &mut e {
            *start = index[*start];
        }
        log.push(e);
    }
    log
}

/// The crash states of one window, by name: which pending entries each keeps.
fn states_of(
    w: &Window,
    writes: &WriteLog,
    o: &StatesOpts,
    rng: &mut ChaCha8Rng,
) -> Vec<(String, Vec<(usize, Kept)>)> {
    let n = w.pending.len();
    let whole = |set: &[usize]| set.iter().map(|&i| (i, Kept::Whole)).collect::<Vec<_>>();
    let mut out: Vec<(String, Vec<(usize, Kept)>)> = Vec::new();
    if n <= o.exhaustive_up_to {
        for mask in 0u64..(1 << n) {
            let set: Vec<usize> = (0..n)
                .filter(|b| mask >> b & 1 == 1)
                .map(|b| w.pending[b])
                .collect();
            out.push((format!("subset {mask:#x}"), whole(&set)));
        }
    } else {
        out.push(("none".into(), Vec::new()));
        out.push(("all".into(), whole(&w.pending)));
        for a in 0..n {
            out.push((format!("only {a}"), whole(&[w.pending[a]])));
            for b in a + 1..n {
                out.push((
                    format!("only {a},{b}"),
                    whole(&[w.pending[a], w.pending[b]]),
                ));
            }
        }
        for k in 0..o.samples {
            let set: Vec<usize> = w
                .pending
                .iter()
                .copied()
                .filter(|_| rng.gen_bool(0.5))
                .collect();
            out.push((format!("sample {k}"), whole(&set)));
        }
    }
    for (a, &i) in w.pending.iter().enumerate() {
        let sectors = writes.entries()[i].nr_sectors;
        if sectors < 2 {
            continue;
        }
        for t in 0..o.torn {
            let kept: Vec<u64> = (0..sectors).filter(|_| rng.gen_bool(0.5)).collect();
            let torn = (i, Kept::Sectors(kept));
            out.push((format!("torn {a}.{t}"), vec![torn.clone()]));
            let mut rest: Vec<(usize, Kept)> = whole(&w.pending)
                .into_iter()
                .filter(|(j, _)| *j != i)
                .collect();
            rest.push(torn);
            out.push((format!("torn {a}.{t}+rest"), rest));
        }
    }
    out
}

fn check_image(
    r: &Recording,
    img: SparseStore,
    cutoff: usize,
    rule: FsyncRule,
) -> Result<(CutReport, Log), String> {
    let dev = memory_device()?;
    dev.set_image(img)?;
    let q = RequestQueue::new(Arc::new(dev), QueueConfig::default()).map_err(|e| e.to_string())?;
    let log = log_before(r, cutoff);
    let mut rep = CutReport::default();
    check_recovery(&q, quiet(), &log, rule, &mut rep);
    Ok((rep, log))
}

/// Check every crash state of one workload (of each of its seeds: `random` runs
/// `random_seeds` of them, the scripted ones one).
pub fn run_workload(w: &Workload, o: &StatesOpts) -> Result<WorkloadStates, String> {
    let t0 = Instant::now();
    let mut out = WorkloadStates {
        workload: w.name.into(),
        about: w.about.into(),
        ..WorkloadStates::default()
    };
    let seeds = if w.name == "random" {
        o.random_seeds.max(1)
    } else {
        1
    };
    // Seeds wrap past u64::MAX, as the cut seeds do: an empty range would check no
    // state and pass.
    for i in 0..seeds {
        let seed = o.seed.wrapping_add(i);
        run_seed(w, seed, o, &mut out)?;
    }
    if o.progress {
        if std::io::stderr().is_terminal() {
            eprintln!();
        } else {
            eprintln!(
                "{}: {} windows, {} states, {} failed",
                w.name, out.windows, out.states, out.failures
            );
        }
    }
    out.seconds = t0.elapsed().as_secs_f64();
    Ok(out)
}

fn run_seed(
    w: &Workload,
    seed: u64,
    o: &StatesOpts,
    out: &mut WorkloadStates,
) -> Result<(), String> {
    let r = record(w, seed, o.drop_preflush, o.journal_data_kb)?;
    let windows = r.writes.windows();
    out.operations += r.log.len();
    out.device_writes += r
        .writes
        .entries()
        .iter()
        .filter(|e| e.kind != wbstack::block::logwrites::LogKind::Flush)
        .count();
    out.flushes += windows.len() - 1;
    out.windows += windows.len();
    let mut rng = ChaCha8Rng::seed_from_u64(mix(seed ^ mix(w.name.len() as u64 ^ 0x5747)));
    let mut prefix = r.base.clone();
    let mut prefix_end = 0;
    for (wi, win) in windows.iter().enumerate() {
        r.writes
            .apply_prefix(&mut prefix, prefix_end, win.prefix_end);
        prefix_end = win.prefix_end;
        for (name, kept) in states_of(win, &r.writes, o, &mut rng) {
            if !r.writes.possible(win, &kept) {
                out.impossible += 1;
                continue;
            }
            let img = r.writes.image(&prefix, &kept);
            let cutoff = r.writes.ack_cutoff(win, &kept);
            let (rep, log) = check_image(&r, img.clone(), cutoff, o.rule)?;
            out.states += 1;
            if rep.failed() {
                if std::env::var_os("CRASHTEST_DEBUG").is_some() {
                    eprintln!("failing state: seed {seed} window {wi} {name}, cutoff {cutoff}, prefix_end {}", win.prefix_end);
                    for (k, e) in r.writes.entries().iter().enumerate() {
                        let tag = if win.pending.contains(&k) {
                            match kept.iter().find(|(i, _)| *i == k) {
                                Some((_, Kept::Whole)) => "KEPT",
                                Some(_) => "TORN",
                                None => "lost",
                            }
                        } else if k < win.prefix_end {
                            "durable"
                        } else {
                            "later"
                        };
                        eprintln!(
                            "  wlog {k}: {:?} sector {} +{} fua {} [{tag}]",
                            e.kind, e.sector, e.nr_sectors, e.fua
                        );
                    }
                    for (id, p) in &r.ack_pos {
                        eprintln!("  ack {id} at {p}");
                    }
                }
                out.failures += 1;
                if out.failed.len() < 10 {
                    let state = format!("{} seed {seed} window {wi} {name}", w.name);
                    let mut line = format!("{state}: {}", rep.reasons());
                    if let Some(dir) = &o.save_dir {
                        let file = ReplayFile {
                            header: Header {
                                wbstack_version: env!("CARGO_PKG_VERSION").into(),
                                device_spec: DEVICE.into(),
                                device_bytes: DEVICE_BYTES,
                                mount_opts: "commit=3600,dirty_writeback_centisecs=0".into(),
                                commit_ms: 3_600_000,
                                rule: o.rule,
                                seed,
                                plan: None,
                                landing: Landing::default(),
                                failure: rep.reasons(),
                                deferred_zero_truncates: log.deferred_zero_truncates,
                                ops: log.entries.clone(),
                                write_log: Vec::new(),
                            },
                            image: img,
                        };
                        let path = dir.join(format!(
                            "states-{}-s{seed}-w{wi}-{}.replay",
                            w.name,
                            name.replace([' ', ',', '+', '.'], "_")
                        ));
                        match file.save(&path) {
                            Ok(()) => {
                                line.push_str(&format!(" (replay: --replay {})", path.display()))
                            }
                            Err(e) => line.push_str(&format!(" (no replay file: {e})")),
                        }
                    }
                    out.failed.push(line);
                }
            }
        }
        if o.progress && std::io::stderr().is_terminal() {
            eprint!(
                "\r{:<20} window {}/{}  {} states, {} failed",
                w.name,
                wi + 1,
                windows.len(),
                out.states,
                out.failures
            );
        }
    }
    Ok(())
}

pub fn run_states(o: &StatesOpts) -> Result<StatesSummary, String> {
    let chosen: Vec<&Workload> = if o.workloads.is_empty() {
        WORKLOADS.iter().collect()
    } else {
        o.workloads
            .iter()
            .map(|n| {
                WORKLOADS.iter().find(|w| w.name == n).ok_or_else(|| {
                    let all: Vec<&str> = WORKLOADS.iter().map(|w| w.name).collect();
                    format!("no workload '{n}' (there are: {})", all.join(", "))
                })
            })
            .collect::<Result<_, _>>()?
    };
    let t0 = Instant::now();
    let mut s = StatesSummary {
        seed: o.seed,
        ..StatesSummary::default()
    };
    for w in chosen {
        let r = run_workload(w, o)?;
        s.states += r.states;
        s.failures += r.failures;
        s.workloads.push(r);
    }
    s.seconds = t0.elapsed().as_secs_f64();
    Ok(s)
}

pub fn print_states(s: &StatesSummary) {
    println!(
        "crash states of each workload's write log (seed {})",
        s.seed
    );
    println!(
        "  {:<20} {:>4} {:>7} {:>8} {:>8} {:>8} {:>7}",
        "workload", "ops", "writes", "flushes", "states", "failed", "secs"
    );
    for w in &s.workloads {
        println!(
            "  {:<20} {:>4} {:>7} {:>8} {:>8} {:>8} {:>7.1}",
            w.workload, w.operations, w.device_writes, w.flushes, w.states, w.failures, w.seconds
        );
    }
    println!(
        "  {:<20} {:>4} {:>7} {:>8} {:>8} {:>8} {:>7.1}",
        "all", "", "", "", s.states, s.failures, s.seconds
    );
    for w in &s.workloads {
        for f in &w.failed {
            println!("FAILED {f}");
        }
    }
}

pub fn states_cli(o: &StatesOpts, json: bool) -> Result<u8, String> {
    let s = run_states(o)?;
    if json {
        println!("{}", serde_json::to_string(&s).map_err(|e| e.to_string())?);
    } else {
        print_states(&s);
    }
    Ok(if s.failures > 0 { 1 } else { 0 })
}
