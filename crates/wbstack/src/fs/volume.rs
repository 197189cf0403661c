//! The mounted filesystem: `Volume` (namespace operations, statfs, sync, unmount), with
//! `File` handles (`file.rs`) and the page cache's filesystem side (`aops.rs`), on top
//! of the page cache (data), the writeback engine (one `Bdi` per volume) and the
//! journal (metadata).
//!
//! Concurrency: all metadata lives in one `State` under one mutex, held only for
//! in-memory work, never across IO (a device may complete inline, and completions take
//! the same mutex). Lock order (ARCHITECTURE.md has it whole): a mapping's `i_rwsem`
//! → `tree` → `st` → `icache` → a mapping's own lock → the journal's `jn`; nothing
//! takes them in the other direction.

use super::error::{FsError, FsResult};
use super::format::{InodeKind, Record, Records, Superblock, BLOCK_SIZE};
use super::inodes::DirMiss;
use super::meta::{valid_name, ApplyMode, Inode, Meta, NAME_MAX, ROOT_INO, TARGET_MAX};
use super::namei::{components, Resolved, MAX_SYMLINKS};
use crate::block::{BlkError, BlkResult, RequestQueue};
use crate::clock::ClockRef;
use crate::mm::{AddressSpaceOps, CacheConfig, ErrSeq, Mapping, PageCache, WriteDone};
use crate::writeback::{Bdi, WbConfig};
use parking_lot::{Condvar, Mutex};
use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

mod aops;
mod file;
pub(super) use aops::Aops;
pub use file::File;

const PAGE: u64 = BLOCK_SIZE as u64;
const SECTORS_PER_BLOCK: u64 = PAGE / 512;

/// `MountOptions::logbufs` unless set, and its largest value (XFS's default and bound).
/// Eight: a commit without a cache flush leaves with half the syncing threads while
/// others are in flight (`fs::commit::group_to_wait_for`; one that flushes keeps at
/// most two in flight), and 8 threads' small journaled fsyncs on sim:ssd ran 11.7k to
/// 12.4k files/s against 9.9k to 10.4k with 2 and one group of all of them.
pub const DEFAULT_LOGBUFS: usize = 8;
pub const MAX_LOGBUFS: usize = 8;
/// Journaled data's default threshold: a small fsync (a 4 KiB file) is one device
/// write, not a data write, a flush and a commit; a larger one (fs_mark's 50 KiB
/// files on 8 threads, bandwidth-bound when written twice) stays ordered.
pub const DEFAULT_JOURNAL_DATA_KB: u64 = 32;
/// Wait slots of fsync's waiters: twice the transactions that can be closed and not
/// yet durable, so the waiters of two of them rarely share one.
pub const TID_WAIT_SLOTS: usize = 2 * MAX_LOGBUFS;

/// Options of `mount` (the kernel's mount options and sysctls that apply to a volume).
#[derive(Clone, Debug)]
pub struct MountOptions {
    pub cache: CacheConfig,
    pub wb: WbConfig,
    /// Journal commit interval (jbd2's `commit=`): metadata changes reach the disk at
    /// most this long after they were made, fsync or not.
    pub commit_interval_ms: u64,
    /// Bounds of the window a sync commit waits for other fsyncs to join it (ext4's
    /// min_batch_time / max_batch_time, in µs).
    pub min_batch_us: u64,
    pub max_batch_us: u64,
    /// ext4's auto_da_alloc: write a file back at close after a truncation to zero and
    /// at a rename over another file, ordering the journal after its data (see
    /// `fs::flush` for exactly what that guarantees).
    pub flush_on_close: bool,
    /// Writeback throttling target of the volume's device queue (the queue's
    /// `wbt_lat_usec`; 0 turns wbt off); None leaves the queue's setting.
    pub wbt_lat_usec: Option<u64>,
    /// wbt grows its depth only after windows in which the limit held writes back
    /// (the default), or, set to false, after every window whose reads met the target
    /// as the kernel does; None leaves the queue's setting.
    pub wbt_scale_up_when_limited: Option<bool>,
    /// How wbt judges a window's reads (`min`: the fastest, as the kernel's wbt;
    /// `tail`: one in ten late, blk-iolatency's rule); None leaves the queue's setting.
    pub wbt_judge: Option<crate::block::wbt::WbtJudge>,
    /// Journaled data (`fs::jdata`): an fsync finding at most this many KiB of dirty
    /// data in its inode carries the data in the commit (one device write) instead of
    /// writing it first (ordered data). 0 turns it off. The default,
    /// `DEFAULT_JOURNAL_DATA_KB`, is ZFS's zfs_immediate_write_sz: the size up to
    /// which its intent log carries a synchronous write's data itself.
    pub journal_data_kb: u64,
    /// `commit_flush=always`: every commit write carries PREFLUSH (jbd2's barrier
    /// commit). `needed` (the default): a commit carries it only when a write
    /// completed without FUA since the committer's last flush (`RequestQueue::
    /// volatile_writes`) or an fsync waits for a data barrier; otherwise the FUA
    /// write alone is durable after everything before it, and a small fsync whose
    /// data is journaled costs one device write.
    pub commit_flush_always: bool,
    /// Journal writes in flight at once (XFS's `logbufs`, 1 to 8). With more than one,
    /// the committer closes and writes the next transaction while the one before is
    /// still being written, so the fsyncs arriving meanwhile need not wait for it to
    /// land first; commits still finish, and release their waiters, in order. 1: each
    /// commit is written and waited for before the next closes (jbd2's one committing
    /// transaction).
    pub logbufs: usize,
    /// Mappings of unused files kept cached (`fs::icache`); past it, unused ones at
    /// rest are evicted, least recently used first.
    pub inode_cache: usize,
    /// Bytes of metadata tree nodes kept in memory beyond the dirty ones (the tree
    /// formats' buffer cache: `fs::btree::store`).
    pub node_cache: usize,
    /// The format a tool's fresh volume is made with (`MkfsOptions::format`: 3, or 4
    /// for the metadata tree); a mount of an existing image ignores it.
    pub format: Option<u32>,
    /// A directory of more groups of names (names sharing a hash: almost always one)
    /// than this is read back from the tree unlisted (`fs::dir`): a lookup reads its
    /// own name's group, where a listed one reads every hash first. 0: every one.
    pub dir_listed_max: usize,
}

impl Default for MountOptions {
    fn default() -> Self {
        MountOptions {
            cache: CacheConfig::default(),
            wb: WbConfig::default(),
            commit_interval_ms: 5000,
            min_batch_us: 0,
            max_batch_us: 15_000,
            flush_on_close: true,
            wbt_lat_usec: None,
            wbt_scale_up_when_limited: None,
            wbt_judge: None,
            journal_data_kb: DEFAULT_JOURNAL_DATA_KB,
            commit_flush_always: false,
            logbufs: DEFAULT_LOGBUFS,
            inode_cache: super::icache::DEFAULT_INODE_CACHE,
            node_cache: super::checkpoint::NODE_CACHE_BYTES,
            format: None,
            dir_listed_max: super::metatree::LISTED_MAX,
        }
    }
}

impl MountOptions {
    /// Every option `set` knows, for messages.
    pub const KEYS: &'static str = "cache_size, writeback_plug, expire_first, \
        dirty_ratio, dirty_background_ratio, dirty_bytes, dirty_background_bytes, \
        dirty_expire_centisecs, dirty_writeback_centisecs, commit, min_batch_time, \
        max_batch_time, read_ahead_kb, flush_on_close, wbt_lat_usec, \
        wbt_scale_up_when_limited, wbt_judge, journal_data_kb, commit_flush, logbufs, \
        inode_cache, node_cache, dir_listed_max, format";

    /// Set one option by its name (the kernel's sysctl, mount-option or sysfs name);
    /// `commit` is in seconds, batch times in µs, sizes take k/M/G suffixes.
    pub fn set(&mut self, key: &str, value: &str) -> FsResult<()> {
        use crate::dev::parse_size;
        let bad = |why: String| FsError::Invalid(format!("{key}={value}: {why}"));
        let num = || value.trim().parse::<u64>().map_err(|e| bad(e.to_string()));
        let flag = || match value.trim() {
            "1" | "on" | "true" | "yes" => Ok(true),
            "0" | "off" | "false" | "no" => Ok(false),
            _ => Err(bad("expected 0 or 1".into())),
        };
        let size = || parse_size(value).map_err(bad);
        let pct = || {
            num().and_then(|v| {
                if v <= 100 {
                    Ok(v as u32)
                } else {
                    Err(bad("a percentage is at most 100".into()))
                }
            })
        };
        match key {
            "cache_size" => self.cache.cache_size = size()?,
            // KiB, as the queue's sysfs file; a suffixed size is bytes. 0 reads only the
            // page asked for, as the kernel does.
            "read_ahead_kb" => {
                let bytes = match value.trim().parse::<u64>() {
                    Ok(kib) => kib.saturating_mul(1024),
                    Err(_) => size()?,
                };
                self.cache.ra_max_pages = bytes / 4096;
            }
            "writeback_plug" => self.wb.writeback_plug = flag()?,
            "expire_first" => self.wb.expire_first = flag()?,
            "dirty_ratio" => self.wb.dirty.dirty_ratio = pct()?,
            "dirty_background_ratio" => self.wb.dirty.dirty_background_ratio = pct()?,
            "dirty_bytes" => self.wb.dirty.dirty_bytes = size()?,
            "dirty_background_bytes" => self.wb.dirty.dirty_background_bytes = size()?,
            "dirty_expire_centisecs" => self.wb.dirty_expire_centisecs = num()?,
            "dirty_writeback_centisecs" => self.wb.dirty_writeback_centisecs = num()?,
            "commit" => {
                let s = num()?;
                if s == 0 {
                    return Err(bad("the commit interval must be at least 1 s".into()));
                }
                self.commit_interval_ms = s * 1000;
            }
            "min_batch_time" => self.min_batch_us = num()?,
            "flush_on_close" | "auto_da_alloc" => self.flush_on_close = flag()?,
            "wbt_lat_usec" => self.wbt_lat_usec = Some(num()?),
            "wbt_scale_up_when_limited" => self.wbt_scale_up_when_limited = Some(flag()?),
            "wbt_judge" => {
                self.wbt_judge = Some(
                    crate::block::wbt::WbtJudge::parse(value)
                        .ok_or_else(|| bad("expected min or tail".into()))?,
                )
            }
            "max_batch_time" => self.max_batch_us = num()?,
            // KiB; a suffixed size is bytes.
            "journal_data_kb" => {
                self.journal_data_kb = match value.trim().parse::<u64>() {
                    Ok(kib) => kib,
                    Err(_) => size()?.div_ceil(1024),
                }
            }
            "commit_flush" => {
                self.commit_flush_always = match value.trim() {
                    "always" => true,
                    "needed" => false,
                    _ => return Err(bad("expected always or needed".into())),
                }
            }
            "logbufs" => {
                let n = num()?;
                if !(1..=MAX_LOGBUFS as u64).contains(&n) {
                    return Err(bad(format!(
                        "journal writes in flight are from 1 to {MAX_LOGBUFS}"
                    )));
                }
                self.logbufs = n as usize;
            }
            "format" => {
                let v = u32::try_from(num()?).map_err(|e| bad(e.to_string()))?;
                use super::format::{LAZY_VERSION, RING_VERSION, WHOLE_VERSION};
                if ![WHOLE_VERSION, LAZY_VERSION, RING_VERSION].contains(&v) {
                    return Err(bad(format!(
                        "a new volume is format {WHOLE_VERSION} (the whole-metadata image), \
                         {LAZY_VERSION} or {RING_VERSION} (the metadata tree; 5 becomes 6 at \
                         its first mount)"
                    )));
                }
                self.format = Some(v);
            }
            "inode_cache" => {
                self.inode_cache = usize::try_from(num()?).map_err(|e| bad(e.to_string()))?
            }
            "node_cache" => {
                self.node_cache = usize::try_from(size()?).map_err(|e| bad(e.to_string()))?
            }
            "dir_listed_max" => {
                self.dir_listed_max = usize::try_from(num()?).map_err(|e| bad(e.to_string()))?
            }
            _ => {
                return Err(FsError::Invalid(format!(
                    "unknown option '{key}' (known: {})",
                    Self::KEYS
                )))
            }
        }
        Ok(())
    }

    /// Apply a comma-separated `name=value` list (what `-o` takes).
    pub fn parse(&mut self, list: &str) -> FsResult<()> {
        for kv in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = kv.split_once('=').ok_or_else(|| {
                FsError::Invalid(format!("option '{kv}' is not of the form name=value"))
            })?;
            self.set(k.trim(), v)?;
        }
        Ok(())
    }
}

/// What `stat` reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stat {
    pub ino: u64,
    pub kind: InodeKind,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u32,
    pub size: u64,
    /// 512-byte units allocated or reserved (st_blocks).
    pub blocks: u64,
    pub atime_ns: u64,
    pub mtime_ns: u64,
    pub ctime_ns: u64,
    /// Device nodes: the device number.
    pub rdev: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirEntry {
    pub name: String,
    pub ino: u64,
    pub kind: InodeKind,
}

/// statfs: sizes in blocks of `block_size` bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatFs {
    pub block_size: u64,
    pub blocks: u64,
    pub free: u64,
    /// Free and not reserved by delayed-allocation writes.
    pub available: u64,
    pub files: u64,
}

/// Attributes `set_attr` may change (None = leave as is).
#[derive(Clone, Debug, Default)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub atime_ns: Option<u64>,
    pub mtime_ns: Option<u64>,
}

/// How to open a file (the flags of open(2) that matter here).
#[derive(Clone, Debug)]
pub struct OpenOptions {
    pub read: bool,
    pub write: bool,
    pub create: bool,
    pub truncate: bool,
    pub exclusive: bool,
    pub append: bool,
    pub mode: u32,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            read: true,
            write: false,
            create: false,
            truncate: false,
            exclusive: false,
            append: false,
            mode: 0o644,
        }
    }
}

impl OpenOptions {
    pub fn read() -> Self {
        Self::default()
    }
    /// O_RDWR|O_CREAT|O_TRUNC, what `creat` and most writers use.
    pub fn create() -> Self {
        OpenOptions {
            write: true,
            create: true,
            truncate: true,
            ..Self::default()
        }
    }
    pub fn read_write() -> Self {
        OpenOptions {
            write: true,
            ..Self::default()
        }
    }
}

/// Counters of the journal, for tools and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct JournalStats {
    /// Transactions written to the journal.
    pub commits: u64,
    /// Checkpoints written (each also commits the running transaction).
    pub checkpoints: u64,
    /// Of those, the ones written in the background while commits went on.
    pub checkpoints_background: u64,
    /// Times the committer waited for a background checkpoint (the journal three
    /// quarters full, or a checkpoint asked for while one was in flight).
    pub checkpoint_waits: u64,
    /// Transactions written at the journal's start because they did not fit before
    /// its end (`fs::jspace`).
    pub journal_wraps: u64,
    /// Time the commits that wrote checkpoints took, from the close of their
    /// transaction to durable (the committer's time a checkpoint costs).
    pub checkpoint_ns: u64,
    /// Time `st` was held to close the checkpoints' transactions (restating their
    /// inodes and capturing the changed keys), in all and at most: every namespace
    /// operation waits that long.
    pub checkpoint_close_ns: u64,
    pub checkpoint_close_max_ns: u64,
    /// The longest hold of `st` to close any transaction, a checkpoint's or not.
    pub commit_close_max_ns: u64,
    /// Cache flushes issued without a commit (fsync of data whose metadata was durable).
    pub flushes: u64,
    /// Commits written with FUA alone, no PREFLUSH: no write had completed since the
    /// last flush and no fsync waited for a data barrier (`commit_flush=needed`).
    pub commits_without_flush: u64,
    /// Commits whose journal write was submitted while an earlier one was still in
    /// flight (`logbufs` > 1).
    pub commits_overlapped: u64,
    /// Bytes written to the journal and checkpoint areas.
    pub bytes: u64,
    /// The transaction every change up to which is durable.
    pub committed_tid: u64,
    /// Commits requested by fsync (each waiter counts once).
    pub sync_waits: u64,
    /// fsync waiters woken by a finished commit or cache flush: each once, when
    /// wakeups go by transaction (a woken waiter whose transaction is still in flight
    /// would sleep again).
    pub sync_woken: u64,
    /// fsyncs whose data went into the journal (`journal_data_kb`), and the blocks.
    pub data_fsyncs: u64,
    pub data_blocks: u64,
}

/// Times an operation runs again after reading back the inodes it missed, at most: a
/// rerun finds those in memory (they are pinned) and may miss others further on, as
/// an operation that walks many inodes meets them one at a time.
const FAULT_RETRIES: usize = 4096;

/// Times one range of a directory's cold groups is read back for one operation, at
/// most (`Vol::faulting`).
const GROUP_REREADS: u32 = 8;

/// What the inode cache holds (`Volume::inode_cache_stats`), and the metadata tree's
/// node cache beside it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InodeCacheStats {
    /// File mappings cached, in use or not.
    pub cached: u64,
    /// Inodes with per-inode state in memory beyond the durable metadata.
    pub live: u64,
    /// The `inode_cache` limit on unused ones.
    pub limit: u64,
    /// Mappings evicted since mount.
    pub evicted: u64,
    /// Inodes prunes looked at (evicted or passed over) since mount: the cost of
    /// keeping the limit.
    pub examined: u64,
    /// Inodes in memory (format 4: in use, changed since the durable checkpoint, or
    /// clean ones up to the limit; before: all of them).
    pub inodes_resident: u64,
    /// Inodes read back from the metadata tree since mount.
    pub inodes_read_back: u64,
    /// Clean inodes dropped from memory since mount.
    pub inodes_dropped: u64,
    /// Directory entries whose names are in memory, groups of them read back from the
    /// tree since mount (with the hashes of an unlisted directory read and found
    /// empty), and entries whose names left memory since mount (`fs::dir`: a
    /// directory keeps only the hashes of entries unchanged since the durable
    /// checkpoint).
    pub dirents_resident: u64,
    pub dirent_groups_read_back: u64,
    pub dirents_dropped: u64,
    /// Bytes of tree nodes cached (limit: `node_cache`), and the node lookups it
    /// answered and missed since mount (0 on format 3: no tree).
    pub node_cache_bytes: u64,
    pub node_cache_hits: u64,
    pub node_cache_misses: u64,
    /// Directory entries in the dentry cache (`fs::dcache`), and the path walks it
    /// served without `st` and gave up to a walk under `st`, since mount.
    pub dentries: u64,
    pub dentry_walk_hits: u64,
    pub dentry_walk_misses: u64,
}

/// The fewest changed inodes that make a checkpoint due whatever `inode_cache` says:
/// a checkpoint writes its root record and the path to every change, and below this
/// (about half a MiB of inodes) that costs more than the memory it frees; a tiny cache
/// (tests run with 0 or 8) would otherwise checkpoint at every operation.
pub(super) const META_FULL_MIN: usize = 1024;

/// Per-inode state that is not on disk: reservations, writes in flight, opens, and
/// which transaction last changed the inode (what fsync must wait for).
#[derive(Default)]
pub(super) struct Live {
    /// Pages reserved by write() and not allocated yet.
    pub delalloc: crate::smallmap::SmallSet,
    /// file block -> (device block, len): allocated at writeback, write in flight.
    pub pending: crate::smallmap::SmallMap<(u64, u64)>,
    pub open: u32,
    /// Last transaction changing anything of the inode (fsync waits for it).
    pub sync_tid: u64,
    /// Last transaction changing more than timestamps (fdatasync waits for it).
    pub datasync_tid: u64,
    /// The barrier generation current when data of this inode last finished writing:
    /// fsync needs a cache flush started after it.
    pub data_gen: Option<u64>,
    /// A truncation to zero not journaled yet: the old extents stay on disk (and are
    /// ignored), new data goes to new blocks listed in `deferred_maps` (see fs::flush).
    pub trunc_pending: bool,
    /// file block -> (device block, len) written since the deferred truncation.
    pub deferred_maps: crate::smallmap::SmallMap<(u64, u64)>,
    /// On-disk size the file will have when the deferred truncation is journaled.
    pub deferred_size: u64,
    /// Truncated to zero while open: write it back at close (EXT4_STATE_DA_ALLOC_CLOSE).
    pub da_alloc_close: bool,
}

impl Live {
    /// A write of the inode ended when barrier `gen` was current. Completions sample
    /// the generation before they take `st`, so two may arrive out of order: the
    /// newest stays, or fsync would accept a flush started before the later write
    /// ended.
    fn note_data_gen(&mut self, gen: u64) {
        self.data_gen = Some(self.data_gen.map_or(gen, |g| g.max(gen)));
    }

    /// Nothing pending, nothing a later fsync must wait for: the inode cache may forget
    /// this state (`fs::icache`), and a fresh `Live::default()` means the same.
    fn at_rest(&self, committed: u64, barrier_done: u64) -> bool {
        self.open == 0
            && self.delalloc.is_empty()
            && self.pending.is_empty()
            && !self.trunc_pending
            && self.deferred_maps.is_empty()
            && !self.da_alloc_close
            && self.sync_tid <= committed
            && self.datasync_tid <= committed
            && self.data_gen.is_none_or(|g| barrier_done > g)
    }

    /// The block holding page `p` among writes in flight and writes done since a
    /// deferred truncation: (device block, blocks left in that run).
    fn unjournaled_block(&self, p: u64) -> Option<(u64, u64)> {
        [&self.pending, &self.deferred_maps]
            .into_iter()
            .find_map(|m| {
                m.range(..=p)
                    .next_back()
                    .and_then(|(&f, &(s, len))| (p < f + len).then(|| (s + p - f, f + len - p)))
            })
    }
}

/// Data a commit must wait for: the pages `ino` had dirty or in flight when it was
/// renamed over another file (flush-on-close ordering).
pub(super) struct Ordered {
    pub ino: u64,
    pub pages: BTreeSet<u64>,
    pub inflight: Vec<u64>,
    pub tid: u64,
}

impl Ordered {
    pub(super) fn satisfied(&self, st: &State) -> bool {
        let Some(l) = st.live.get(&self.ino) else {
            return true;
        };
        // A page is done once it is neither reserved (not yet allocated) nor in a
        // write still in flight (allocated at writeback, not yet completed).
        let in_flight = |p: &u64| {
            l.pending
                .range(..=*p)
                .next_back()
                .is_some_and(|(&f, &(_, len))| *p < f + len)
        };
        // A truncation between its cut of the page cache and its decision of what to
        // journal may just have dropped these pages: the transaction waits for that
        // decision, which lands in it (see `truncate`).
        // An inode with pages is in memory (`fs::inodes`): not there, it is deleted.
        st.meta.resident(self.ino).is_none()
            || (!st.truncating.contains_key(&self.ino)
                && !self
                    .pages
                    .iter()
                    .any(|p| l.delalloc.contains(p) || in_flight(p))
                && !self.inflight.iter().any(|b| st.inflight.contains_key(b)))
    }
}

/// Blocks allocated for a data write in flight, by their first device block.
pub(super) struct Inflight {
    pub ino: u64,
    pub fblock: u64,
    pub len: u64,
    /// File blocks from here on were truncated away (or the inode deleted) while the
    /// write was in flight: free them when it ends instead of mapping them.
    pub dead_from: Option<u64>,
}

/// The parts of `State` that say what an inode still owes (`State::at_rest`), borrowed
/// apart from the metadata so a prune of it can ask.
struct Owed<'a> {
    live: &'a FxHashMap<u64, Box<Live>>,
    txn_inodes: &'a FxHashSet<u64>,
    truncating: &'a FxHashMap<u64, u32>,
    ordered: &'a [Ordered],
}

impl Owed<'_> {
    fn of(st: &State) -> Owed<'_> {
        Owed {
            live: &st.live,
            txn_inodes: &st.txn_inodes,
            truncating: &st.truncating,
            ordered: &st.ordered,
        }
    }

    fn at_rest(&self, ino: u64, committed: u64, barrier_done: u64) -> bool {
        self.live
            .get(&ino)
            .is_none_or(|l| l.at_rest(committed, barrier_done))
            && !self.txn_inodes.contains(&ino)
            && !self.truncating.contains_key(&ino)
            && !self.ordered.iter().any(|o| o.ino == ino)
    }
}

pub(super) struct State {
    pub meta: Meta,
    pub running_tid: u64,
    /// The running transaction's records, applied already.
    pub txn: Records,
    /// Inodes whose attributes or size changed in the running transaction: restated as
    /// SetAttr/SetSize records when it commits (one each, however many writes). A hash
    /// set, sorted once at the commit: every create and write inserts here under `st`,
    /// and a B-tree's insert was a tenth of a write's hold of it.
    pub txn_inodes: FxHashSet<u64>,
    pub txn_first_ns: Option<u64>,
    /// Encoded bytes of the records logged in the running transaction, and the size at
    /// which it commits without waiting for its interval (jbd2's
    /// j_max_transaction_buffers, a quarter of the journal): the records held in memory
    /// and the replay after a crash stay bounded however fast operations arrive.
    pub txn_bytes: usize,
    pub txn_limit_bytes: usize,
    /// Inodes changed since the last checkpoint past which one is taken (`inode_cache`):
    /// they cannot leave memory before a checkpoint holding them is durable, so the
    /// memory of a create-heavy run follows the knob, not the journal's size.
    pub meta_limit: usize,
    /// Woken when the running transaction reaches `txn_limit_bytes` (the committer's).
    pub txn_full_waiter: Arc<crate::clock::Waiter>,
    /// Boxed: every inode an operation touches gets an entry, and each growth of the
    /// map moves its slots under `st` (a `Live` is about 150 bytes, a box 8: creates
    /// spent 5% of their time rehashing this map unboxed).
    pub live: FxHashMap<u64, Box<Live>>,
    pub inflight: FxHashMap<u64, Inflight>,
    /// Set when the journal failed: no more changes.
    pub aborted: Option<String>,
    /// Data the next commits must wait for (rename over an existing file).
    pub ordered: Vec<Ordered>,
    /// Truncations in progress, by inode (how many). A truncation cuts the page cache
    /// before it decides, under this lock, what it journals (a truncation to zero is
    /// deferred); a write completing in between is already cut away. So fsync and
    /// syncfs wait for these to finish before resolving and committing, or they would
    /// commit neither the write nor the truncation.
    pub truncating: FxHashMap<u64, u32>,
    /// Journaled blocks waiting for their home write (`fs::jdata`), in log order.
    pub jhome: Vec<super::jdata::JHome>,
    /// Blocks journaled since the last checkpoint (the ones replay may write), with
    /// the transaction of their newest copy: an ordered write to one must revoke it.
    pub jblocks: FxHashMap<u64, u64>,
    /// Pages of data journaled in the running transaction.
    pub txn_jdata_pages: u64,
    /// When the oldest entry of `jhome` was journaled (the committer sends them home
    /// once idle this long after it).
    pub jhome_first_ns: Option<u64>,
    /// Inodes a journaled fsync is claiming pages of, between its look under `st` and
    /// its log (one fsync at a time per inode), and whether a thread came to wait for
    /// those pages meanwhile: it found nothing to send (`kick_home`) and sleeps, so
    /// their home write must go as soon as they are logged, not `HOME_DELAY_NS` later.
    pub jclaiming: FxHashMap<u64, bool>,
    /// Added to the volume clock's time to give an inode timestamp: wall-clock time
    /// on a real clock, 0 on a manual one (tests stay deterministic). Scheduling (commit
    /// intervals) keeps the clock's own time.
    pub wall_offset_ns: u64,
    /// The dentry cache (`fs::dcache`), kept in step with every change of a directory
    /// entry by `log`.
    pub dcache: Arc<super::dcache::Dcache>,
    /// The next checkpoint may need most of the free space (`refresh_meta_pending`):
    /// operations take one before changing more (`Vol::faulting`), as writers wait
    /// for writeback past the dirty limit. Read without `st`.
    pub meta_tight: Arc<AtomicBool>,
}

impl State {
    /// An allocator call that cannot fail did (a double free, releasing more than was
    /// reserved): the in-memory metadata is wrong. Reported, never absorbed: the volume
    /// turns read-only with the reason (ext4's errors=remount-ro), the next commit
    /// fails the journal with it (so every fsync and syncfs waiting hears EIO), and a
    /// debug build stops here.
    pub(super) fn allocator_broken(&mut self, what: &str, r: Result<(), super::alloc::AllocError>) {
        if let Err(e) = r {
            debug_assert!(false, "{what}: {e}");
            if self.aborted.is_none() {
                self.aborted = Some(format!("allocator: {what}: {e}"));
            }
        }
    }

    /// A thread panicked holding `st` (a bug): what it was changing may be half
    /// changed. The volume fails as when the allocator breaks: read-only, the next
    /// commit fails the journal so every waiter hears EIO, and a checkpoint copying out
    /// its changes is not written. Run under `st`, as the panic unwinds
    /// (`SpinMutex::with_on_panic`).
    pub(super) fn panicked_holding(st: &mut State) {
        st.aborted.get_or_insert_with(|| {
            "a thread panicked holding the volume's state (a bug; its message is on \
             stderr): what it was changing may be half changed"
                .into()
        });
        drop(st.meta.take_capture());
    }

    pub(super) fn check_writable(&self) -> FsResult<()> {
        match &self.aborted {
            Some(why) => Err(FsError::ReadOnly(why.clone())),
            None => Ok(()),
        }
    }

    /// Log a record into the running transaction, applying it now. `touched` inodes
    /// must wait for this transaction in fsync (and fdatasync, unless `time_only`).
    pub fn log(&mut self, rec: Record, touched: &[u64], now_ns: u64) -> FsResult<()> {
        self.check_writable()?;
        let tid = self.running_tid;
        // Before the change: applying it may be what makes a checkpoint due.
        let was_full = self.txn_full() || self.meta_full();
        self.meta.apply(&rec, ApplyMode::Live { tid })?;
        self.dentries_changed(&rec);
        // Consecutive extents of one inode merge into one record: a streaming writer
        // logs one record per commit, not one per bio.
        if let (
            Record::MapExtent {
                ino,
                file_block,
                start,
                len,
            },
            Some(Record::MapExtent {
                ino: pi,
                file_block: pf,
                start: ps,
                len: pl,
            }),
        ) = (&rec, self.txn.last_mut())
        {
            if *pi == *ino && *pf + *pl == *file_block && *ps + *pl == *start {
                *pl += len;
                self.touch(touched, false, now_ns);
                self.kick_if_full(was_full);
                return Ok(());
            }
        }
        self.txn_bytes += rec.encoded_len();
        self.txn.push(rec);
        self.touch(touched, false, now_ns);
        self.kick_if_full(was_full);
        Ok(())
    }

    /// Keep the dentry cache in step with an applied record: a new entry naming a
    /// directory goes in; the removal of one (or of an entry whose inode is not in
    /// memory to tell) invalidates the walks made before it.
    fn dentries_changed(&mut self, rec: &Record) {
        match rec {
            Record::Link { parent, name, ino }
                if self.meta.resident(*ino).is_some_and(Inode::is_dir) =>
            {
                self.dcache.insert(*parent, name, *ino);
            }
            Record::Unlink { parent, name, ino }
                if self.meta.resident(*ino).is_none_or(Inode::is_dir) =>
            {
                self.dcache.remove(*parent, name);
            }
            _ => {}
        }
    }

    /// Wake the committer when the running transaction, or the inodes changed since
    /// the last checkpoint, just passed their limit.
    fn kick_if_full(&self, was_full: bool) {
        if !was_full && (self.txn_full() || self.meta_full()) {
            self.txn_full_waiter.kick();
        }
    }

    /// The running transaction is big enough to commit now.
    pub fn txn_full(&self) -> bool {
        self.txn_bytes >= self.txn_limit_bytes
    }

    /// More inodes changed since the last checkpoint than `meta_limit` (and than
    /// `META_FULL_MIN`): the next commit is a checkpoint, and it is due now.
    pub fn meta_full(&self) -> bool {
        self.meta.open_changed() > self.meta_limit.max(META_FULL_MIN) || self.checkpoint_room().due
    }

    /// `checkpoint::checkpoint_room` of this state.
    fn checkpoint_room(&self) -> super::checkpoint::CheckpointRoom {
        super::checkpoint::checkpoint_room(
            self.meta.open_changed(),
            self.meta.checkpoint_need_blocks(),
            self.meta.alloc.meta_headroom(),
        )
    }

    /// Keep from writes the blocks the next checkpoint may need (`meta_full` makes it
    /// due before they pass half of what is free): on a volume writes have filled,
    /// metadata changes alone would otherwise outgrow the fixed reserve, and the
    /// checkpoint, then the mount's after a crash, would fail for space.
    pub fn refresh_meta_pending(&mut self) {
        let need = self.meta.checkpoint_need_blocks();
        self.meta.alloc.set_meta_pending(need);
        let tight = self.checkpoint_room().tight;
        if self.meta_tight.load(Ordering::Relaxed) != tight {
            self.meta_tight.store(tight, Ordering::Relaxed);
        }
    }

    /// Whether inode `ino` owes nothing: no open, no pages pending, no change a commit
    /// or a flush must still make durable (its `Live` state may go).
    pub(super) fn at_rest(&self, ino: u64, committed: u64, barrier_done: u64) -> bool {
        Owed::of(self).at_rest(ino, committed, barrier_done)
    }

    /// A directory `moved` may not go into its own subtree: walk up from `into`.
    pub(super) fn check_not_into_itself(&self, moved: u64, into: u64) -> FsResult<()> {
        let mut d = into;
        while d != 0 {
            if d == moved {
                return Err(FsError::Invalid(
                    "cannot move a directory into itself".into(),
                ));
            }
            if d == ROOT_INO {
                break;
            }
            d = self.inode(d)?.parent;
        }
        Ok(())
    }

    /// Log a new directory entry `name` in `dir` for `ino`.
    pub(super) fn log_link(&mut self, dir: u64, name: &[u8], ino: u64, now: u64) -> FsResult<()> {
        let rec = Record::Link {
            parent: dir,
            name: name.to_vec(),
            ino,
        };
        self.log(rec, &[dir, ino], now)
    }

    /// Log the removal of entry `name` (naming `ino`) from `dir`.
    pub(super) fn log_unlink(&mut self, dir: u64, name: &[u8], ino: u64, now: u64) -> FsResult<()> {
        let rec = Record::Unlink {
            parent: dir,
            name: name.to_vec(),
            ino,
        };
        self.log(rec, &[dir, ino], now)
    }

    /// Mark inodes changed in the running transaction.
    pub fn touch(&mut self, inos: &[u64], time_only: bool, now_ns: u64) {
        let tid = self.running_tid;
        for &ino in inos {
            let l = self.live.entry(ino).or_default();
            l.sync_tid = tid;
            if !time_only {
                l.datasync_tid = tid;
            }
        }
        self.txn_first_ns.get_or_insert(now_ns);
        // Every change touches what it changed, whether logged or restated later.
        self.refresh_meta_pending();
    }

    /// Set mtime and ctime to now (a directory's after an entry changed, a file's
    /// after a write); journaled when the transaction commits.
    pub(super) fn stamp(&mut self, ino: u64, now_ns: u64, mtime: bool) {
        // Stamped right after the operation that used it: in memory.
        if let Some(i) = self.meta.resident_mut(ino) {
            let t = now_ns + self.wall_offset_ns;
            if mtime {
                i.mtime_ns = t;
            }
            i.ctime_ns = t;
            self.txn_inodes.insert(ino);
            self.touch(&[ino], true, now_ns);
        }
    }

    /// Bytes `restate` would add to the running transaction, at most (a directory
    /// gets no size record): known before restating, so the committer can decide
    /// whether the transaction becomes a checkpoint first.
    pub fn restate_max_bytes(&self) -> usize {
        let attr = Record::SetAttr {
            ino: 0,
            mode: 0,
            uid: 0,
            gid: 0,
            atime_ns: 0,
            mtime_ns: 0,
            ctime_ns: 0,
        };
        let size = Record::SetSize { ino: 0, size: 0 };
        self.txn_inodes.len() * (attr.encoded_len() + size.encoded_len())
    }

    /// Records restating the current attributes and size of every inode changed in the
    /// running transaction (what the commit appends), with `records`. Without, for a
    /// transaction a checkpoint holds: the checkpoint writes the inodes themselves and
    /// the transaction's records are never written, so only the tree learns of the
    /// changes in place (a checkpoint's transaction restates every inode changed since
    /// the last one, 131,072 and more, and pushing two records each under `st` cost as
    /// long again).
    pub fn restate(&mut self, records: bool) {
        // Drained, not taken: the set keeps its room for the next transaction, which
        // would otherwise grow it again by rehashing under `st`.
        let inos: Vec<u64> = self.txn_inodes.drain().collect();
        self.restate_inos(inos, records);
    }

    /// Restate up to `max` of the inodes changed in the running transaction now, ahead
    /// of its close (`Vol::restate_ahead`), with records: the close then restates only
    /// what changed since. One changed again is restated again at the close, after,
    /// so replay ends with its last attributes either way.
    pub fn restate_some(&mut self, max: usize) {
        let inos: Vec<u64> = self.txn_inodes.iter().take(max).copied().collect();
        for ino in &inos {
            self.txn_inodes.remove(ino);
        }
        self.restate_inos(inos, true);
    }

    fn restate_inos(&mut self, mut inos: Vec<u64>, records: bool) {
        // In inode order, as replay and the tests see them, whatever the set's order.
        inos.sort_unstable();
        for ino in inos {
            // Changed in place, not through `Meta::apply`: the tree learns of it here.
            self.meta.note_inode(ino);
            if !records {
                continue;
            }
            // Changed in this transaction, so in memory (or deleted since).
            if let Some(i) = self.meta.resident(ino) {
                let attr = Record::SetAttr {
                    ino,
                    mode: i.mode,
                    uid: i.uid,
                    gid: i.gid,
                    atime_ns: i.atime_ns,
                    mtime_ns: i.mtime_ns,
                    ctime_ns: i.ctime_ns,
                };
                let size =
                    (i.kind == InodeKind::File).then_some(Record::SetSize { ino, size: i.size });
                // Counted as logged records are: a transaction restated ahead of its
                // close is bounded (`restate_max_bytes`) by what it holds plus the rest.
                self.txn_bytes += attr.encoded_len();
                self.txn.push(attr);
                if let Some(r) = size {
                    self.txn_bytes += r.encoded_len();
                    self.txn.push(r);
                }
            }
        }
    }

    pub(super) fn inode(&self, ino: u64) -> FsResult<&Inode> {
        self.meta
            .find(ino)?
            .ok_or_else(|| FsError::NotFound(format!("inode {ino}")))
    }

    /// The kind of inode `ino`, which a directory entry names (so it exists: fsck's
    /// invariant), for an entry whose kind was not recorded (entries record it from
    /// format 5 on, and a load resolves the rest). One not in memory is noted as missed (`fs::inodes`) and comes back
    /// as a file: a caller asking for many (a page of readdir) asks `missed` after, and
    /// its entry point reads them back in one go.
    pub(super) fn kind_of(&self, ino: u64) -> InodeKind {
        match self.meta.find(ino) {
            Ok(Some(i)) => i.kind,
            Ok(None) => {
                debug_assert!(false, "a directory entry names inode {ino}, which is gone");
                InodeKind::File
            }
            Err(_) => InodeKind::File,
        }
    }

    /// Failed if a read since `Meta::clear_misses` met an inode not in memory.
    pub(super) fn missed(&self) -> FsResult<()> {
        if self.meta.has_misses() {
            return Err(FsError::Io);
        }
        Ok(())
    }

    /// Directory `ino` (ENOTDIR if it is something else).
    pub(super) fn dir(&self, ino: u64) -> FsResult<&Inode> {
        let d = self.inode(ino)?;
        if !d.is_dir() {
            return Err(FsError::NotDir(format!("inode {ino}")));
        }
        Ok(d)
    }

    /// Look `name` up in directory `dir`.
    pub(super) fn lookup(&self, dir: u64, name: &[u8]) -> FsResult<u64> {
        self.find(dir, name)?
            .ok_or_else(|| FsError::NotFound(String::from_utf8_lossy(name).into_owned()))
    }

    /// `lookup` for a caller that expects the name may be missing (every create asks
    /// twice): None, not an error whose message is a copy of the name.
    pub(super) fn find(&self, dir: u64, name: &[u8]) -> FsResult<Option<u64>> {
        let d = self.dir(dir)?;
        Ok(match name {
            b"." => Some(dir),
            b".." => Some(d.parent.max(ROOT_INO)),
            _ => d
                .entries
                .get(self.meta.name_seed, name)
                .map_err(|cold| super::inodes::note_dir_miss(dir, cold))?,
        })
    }

    /// Forget what the inode had reserved or in flight (it is being deleted or
    /// truncated to `keep` blocks): reservations are released now, blocks in flight
    /// when their write ends.
    fn drop_live_blocks(&mut self, ino: u64, keep: u64) {
        let Some(l) = self.live.get_mut(&ino) else {
            return;
        };
        let gone: Vec<u64> = l.delalloc.range(keep..).collect();
        for p in &gone {
            l.delalloc.remove(p);
        }
        let mut dead = Vec::new();
        let pend: Vec<(u64, (u64, u64))> = l.pending.iter().map(|(&f, &e)| (f, e)).collect();
        for (f, (s, len)) in pend {
            if f + len <= keep {
                continue;
            }
            if f >= keep {
                l.pending.remove(&f);
            } else {
                l.pending.insert(f, (s, keep - f));
            }
            dead.push((s, f.max(keep)));
        }
        let r = self.meta.alloc.unreserve(gone.len() as u64);
        self.allocator_broken("releasing the reservations of cut pages", r);
        for (s, from) in dead {
            if let Some(inf) = self.inflight.get_mut(&s) {
                inf.dead_from = Some(inf.dead_from.map_or(from, |d| d.min(from)));
            }
        }
    }
}

/// Journal state, under its own lock (waiters sleep on `jcv`).
#[derive(Default)]
pub(super) struct JState {
    pub committed: u64,
    /// The last transaction closed: committed, or its journal write in flight.
    pub closed: u64,
    /// Journal writes in flight, oldest first (at most `logbufs`); each is finished,
    /// and its waiters released, only after every one before it.
    pub in_flight: std::collections::VecDeque<super::commit::CommitInFlight>,
    /// The last transaction whose freed blocks were released (after the home writes
    /// of the journaled data it carried; `committed` otherwise).
    pub released: u64,
    /// Highest transaction someone waits for.
    pub want_tid: u64,
    /// Cache-flush generations: started and completed (every commit is one too).
    pub barrier_started: u64,
    pub barrier_done: u64,
    pub barrier_want: u64,
    /// `RequestQueue::volatile_writes` read before the committer's last flush (a
    /// PREFLUSH commit or a bare flush) was issued: the writes that flush covers.
    pub flushed_writes: u64,
    /// The journal's head and tail (`fs::jspace`).
    pub ring: super::jspace::JournalRing,
    /// A checkpoint is being written in the background (`Vol::bg_ckpt`): its commit
    /// went to the journal, and the tail moves up once it is durable.
    pub bg_ckpt_running: bool,
    /// The transaction that checkpoint holds.
    pub bg_ckpt_tid: u64,
    /// A durable background checkpoint's (transaction, replay start) whose tail move
    /// waits for that transaction's own journal write, and every one before it, to
    /// complete: until then a write still in flight could land on blocks the head is
    /// given again.
    pub tail_after_commit: Option<(u64, u64)>,
    /// Checkpoints written in place of a commit (`Vol::checkpoint_now` waits for one).
    pub sync_ckpts: u64,
    pub ckpt_seq: u64,
    /// Slot holding the newest checkpoint.
    pub ckpt_slot: usize,
    pub force_checkpoint: bool,
    pub last_commit_ns: u64,
    pub avg_commit_ns: u64,
    /// The last thread that asked for a sync commit, and whether the one before was
    /// another (jbd2 batches only when several processes sync).
    pub last_sync_thread: Option<std::thread::ThreadId>,
    pub multi_sync: bool,
    /// Threads blocked in fsync waiting for a commit, by the transaction each waits
    /// for, and how many the last sync commit carried: the batching window waits for
    /// the group to re-form in the running transaction (threads waiting for one in
    /// flight are not part of it).
    pub sync_waiting: BTreeMap<u64, usize>,
    pub last_group: usize,
    /// How many threads wait on the journal as one more starts to, a moving average
    /// (1/8 per sync) times 16: the batching of a commit without a flush waits for
    /// half of them (`fs::commit::group_to_wait_for`).
    pub syncers_x16: u64,
    pub error: Option<String>,
    pub stop: bool,
    pub stats: JournalStats,
    /// Asynchronous flushes waiting for a commit (completed by the committer).
    pub async_waiters: Vec<super::flush::AsyncWaiter>,
}

/// The volume, shared by `Volume`, every `File` and the threads.
pub(super) struct Vol {
    pub q: Arc<RequestQueue>,
    pub cache: Arc<PageCache>,
    pub bdi: Arc<Bdi>,
    pub sb: Superblock,
    pub clock: ClockRef,
    pub opts: MountOptions,
    /// `opts.flush_on_close`, switchable at run time (`Volume::set_tunable`).
    pub flush_on_close: AtomicBool,
    /// `opts.journal_data_kb`, switchable at run time.
    pub journal_data_kb: AtomicU64,
    /// `opts.commit_flush_always`, switchable at run time.
    pub commit_flush_always: AtomicBool,
    /// `opts.logbufs`, switchable at run time.
    pub logbufs: std::sync::atomic::AtomicUsize,
    /// Home writes of journaled data in flight (`fs::jdata`).
    pub home: Arc<super::jdata::HomeWrites>,
    /// Taken spinning before sleeping (`crate::spin`): every namespace operation,
    /// write and close holds it for a few microseconds.
    pub st: crate::spin::SpinMutex<State>,
    /// Path walks through directories without `st` (`fs::dcache`); `State::log`
    /// changes it.
    pub dcache: Arc<super::dcache::Dcache>,
    /// `State::meta_tight`, read without `st`.
    pub meta_tight: Arc<AtomicBool>,
    pub icache: Mutex<super::icache::InodeCache>,
    /// `icache`'s size and limit without its lock.
    pub icache_gauge: Arc<super::icache::Gauge>,
    /// The metadata tree (`fs::checkpoint`); only checkpoints take it, before `st`.
    pub tree: Mutex<Option<super::checkpoint::MetaTree>>,
    /// The tree's node cache (its store), for its stats and its limit without the
    /// tree's lock, which a checkpoint holds for its whole write.
    pub nodes: Option<Arc<super::btree::store::DeviceStore>>,
    /// The tree's `dir_listed_max` (`DurableTree`), without the tree's lock.
    pub dir_listed_max: Option<Arc<std::sync::atomic::AtomicUsize>>,
    pub jn: Mutex<JState>,
    /// Waiters on the journal's state other than fsync's (releases, checkpoints).
    pub jcv: Condvar,
    /// fsync's waiters, by the transaction they wait for (`tid % TID_WAIT_SLOTS`): a
    /// finished journal write wakes the threads of its transaction, not those of the
    /// next one still in flight (`Vol::wake_journal`).
    pub tid_cv: [Condvar; TID_WAIT_SLOTS],
    /// fsync's waiters whose transaction is durable, waiting for a cache flush.
    pub barrier_cv: Condvar,
    pub jwaiter: Arc<crate::clock::Waiter>,
    pub aops: Arc<Aops>,
    pub committer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The thread writing background checkpoints (`JState::bg_ckpt_running`), and
    /// where the committer hands them to it.
    pub bg_ckpt: Mutex<Option<std::thread::JoinHandle<()>>>,
    pub ckpt_tx: Mutex<Option<std::sync::mpsc::Sender<super::commit::CheckpointJob>>>,
    pub unmounted: AtomicBool,
    /// Mirror of `jn.barrier_started`, read by completions without the journal lock.
    pub barrier_started: AtomicU64,
    /// The volume's writeback error sequence (`sb->s_wb_err`): any inode's write
    /// error, and a failed journal write; syncfs reports it once per caller.
    pub sb_err: ErrSeq,
    /// The cursor of `Volume::sync` (the mount's own "file").
    pub sync_since: Mutex<u32>,
    /// Inodes for the next asynchronous flush batch.
    pub flushq: Mutex<super::flush::FlushQueue>,
    /// Signalled (with `st`) when data in flight completes or reservations drop: the
    /// committer waits on it for ordered data.
    pub ordered_cv: Condvar,
    /// Signalled (with `st`) when a truncation ends (`State::truncating`).
    pub truncate_cv: Condvar,
    /// Tests: the commit thread's next step panics, as a bug in it would.
    #[cfg(test)]
    pub panic_next_commit: AtomicBool,
    /// Tests: the next `map_write` of writeback panics, as a bug in it would.
    #[cfg(test)]
    pub panic_next_map_write: AtomicBool,
}

/// A truncation of `ino` in progress, from its start to its end on every path.
struct Truncating<'a> {
    vol: &'a Vol,
    ino: u64,
}

impl<'a> Truncating<'a> {
    fn start(vol: &'a Vol, st: &mut State, ino: u64) -> Truncating<'a> {
        *st.truncating.entry(ino).or_default() += 1;
        Truncating { vol, ino }
    }
}

impl Drop for Truncating<'_> {
    fn drop(&mut self) {
        let mut st = self.vol.st.lock();
        match st.truncating.get_mut(&self.ino) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                st.truncating.remove(&self.ino);
            }
            None => debug_assert!(false, "a truncation of {} ended twice", self.ino),
        }
        drop(st);
        self.vol.truncate_cv.notify_all();
        // A commit waiting for ordered data of this inode looks again.
        self.vol.ordered_cv.notify_all();
    }
}

impl Vol {
    /// Wait until no truncation of `ino` (None: of any inode) is in progress.
    pub(super) fn wait_truncations(
        &self,
        st: &mut crate::spin::SpinGuard<'_, State>,
        ino: Option<u64>,
    ) {
        while match ino {
            Some(i) => st.truncating.contains_key(&i),
            None => !st.truncating.is_empty(),
        } {
            crate::spin::SpinGuard::wait(st, &self.truncate_cv);
        }
    }
}

/// A mounted filesystem.
pub struct Volume {
    pub(super) vol: Arc<Vol>,
}

/// An errseq report as a result.
pub(super) fn errno_result(e: i32) -> FsResult<()> {
    match e {
        0 => Ok(()),
        libc::ENOSPC => Err(FsError::NoSpace),
        _ => Err(FsError::Io),
    }
}

/// What a new inode is (`Vol::create_node_as`): its kind, its owner and mode as
/// `(uid, gid, mode)` (`perm::new_inode_owner`), a symlink's target, a device's number.
#[derive(Clone, Copy)]
pub(super) struct NewNode<'a> {
    pub kind: InodeKind,
    pub owner: (u32, u32, u32),
    pub target: Option<&'a [u8]>,
    pub rdev: u32,
}

impl NewNode<'_> {
    pub fn file(owner: (u32, u32, u32)) -> Self {
        NewNode {
            kind: InodeKind::File,
            owner,
            target: None,
            rdev: 0,
        }
    }
}

pub(super) fn check_name(name: &[u8]) -> FsResult<()> {
    if name.len() > NAME_MAX {
        return Err(FsError::NameTooLong(
            String::from_utf8_lossy(&name[..32]).into_owned() + "...",
        ));
    }
    if !valid_name(name) {
        return Err(FsError::Invalid(format!(
            "{:?} is not a valid file name",
            String::from_utf8_lossy(name)
        )));
    }
    Ok(())
}

impl Vol {
    pub(super) fn now(&self) -> u64 {
        self.clock.now_ns()
    }

    /// The page-cache mapping of regular file `ino` (created on first use).
    pub(super) fn mapping(&self, st: &State, ino: u64) -> FsResult<Arc<Mapping>> {
        let i = st.inode(ino)?;
        if i.kind != InodeKind::File {
            return Err(FsError::IsDir(format!("inode {ino}")));
        }
        let mut ic = self.icache.lock();
        Ok(ic.get_or_insert(ino, || self.new_mapping(ino, i.size)))
    }

    /// A mapping for `ino` of `size` bytes, not cached yet.
    fn new_mapping(&self, ino: u64, size: u64) -> Arc<Mapping> {
        Mapping::new(ino, size, self.bdi.clone(), self.aops.clone() as Arc<_>)
    }

    /// Evict unused inodes at rest past the inode cache's limit (`fs::icache`), at most a
    /// batch per call: each open adds at most one, so batches keep up.
    pub(super) fn prune_icache(&self, st: &mut State) {
        self.prune_mappings(st);
        self.prune_meta(st);
    }

    /// Run `op`, which takes `st` itself; if it failed on inodes not in memory
    /// (`fs::inodes`), read them back without `st` and run it again.
    pub(super) fn faulting<R>(&self, mut op: impl FnMut() -> FsResult<R>) -> FsResult<R> {
        if self.meta_tight.load(Ordering::Relaxed) {
            // What the next checkpoint may need nears the free space (a volume writes
            // have filled): it is taken before this operation adds to it, or the
            // checkpoint, and the mount after a crash, would fail for space.
            self.checkpoint_now()?;
        }
        let mut tries = 0;
        // What was read back stays in memory until the operation ran again.
        let mut pinned: Vec<u64> = Vec::new();
        // Directory groups read back, and how often: the same miss again after its
        // read is no progress (its directory is held, below, so no shrink undid it); a
        // few repeats are tolerated, endless ones end the operation with its error.
        let mut groups_read: FxHashMap<DirMiss, u32> = FxHashMap::default();
        // Directories whose groups were read back: held resident until the operation
        // ran again (`Meta::hold_dirs_missed`), so a page needing several reads keeps each.
        let mut held: Vec<u64> = Vec::new();
        let r = loop {
            let r = op();
            if r.is_ok() {
                break r;
            }
            let (misses, dir_misses) = {
                let mut st = self.st.lock();
                let dir_misses = st.meta.take_dir_misses();
                st.meta.hold_dirs_missed(&dir_misses, &mut held);
                (st.meta.take_misses(), dir_misses)
            };
            // Each rerun that misses only inodes not read back yet made progress (an
            // operation may meet its inodes one at a time); one that misses an inode
            // read back and pinned already is not going to do better.
            let progress = misses.iter().any(|m| !pinned.contains(m))
                || dir_misses
                    .iter()
                    .any(|m| groups_read.get(m).is_none_or(|&n| n < GROUP_REREADS));
            if (misses.is_empty() && dir_misses.is_empty()) || !progress || tries == FAULT_RETRIES {
                break r;
            }
            tries += 1;
            if !misses.is_empty() {
                let read = self.read_back(Some(&misses), true);
                pinned.extend(misses);
                if let Err(e) = read {
                    break Err(e);
                }
            }
            if !dir_misses.is_empty() {
                if let Err(e) = self.read_back_dirents(&dir_misses) {
                    break Err(e);
                }
                for m in dir_misses {
                    *groups_read.entry(m).or_default() += 1;
                }
            }
        };
        if !pinned.is_empty() || !held.is_empty() {
            let mut st = self.st.lock();
            st.meta.unpin(&pinned);
            st.meta.release_dirs(&held);
        }
        r
    }

    /// Read directories' cold groups back into memory, without `st` (`fs::dir`).
    pub(super) fn read_back_dirents(&self, asked: &[DirMiss]) -> FsResult<()> {
        let Some(src) = self.st.lock().meta.source() else {
            return Ok(());
        };
        loop {
            let read = src.read_dirents(asked);
            if self.st.lock().meta.install_dirents(read, asked)? {
                return Ok(());
            }
            // A new root became durable during the read: read from it.
        }
    }

    /// Read inodes back into memory (every one for None), without `st`; with `pin`,
    /// kept there until `Meta::unpin`.
    pub(super) fn read_back(&self, inos: Option<&[u64]>, pin: bool) -> FsResult<()> {
        let src = {
            let mut st = self.st.lock();
            if let (true, Some(i)) = (pin, inos) {
                st.meta.pin(i);
            }
            st.meta.source()
        };
        let Some(src) = src else {
            return Ok(());
        };
        loop {
            let read = match inos {
                Some(i) => src.read_inodes(i),
                None => src.read_all(),
            };
            if self.st.lock().meta.install(read, inos)? {
                return Ok(());
            }
            // A checkpoint made a new root durable during the read, and the old one's
            // nodes may have been given back: read from the new one.
        }
    }

    /// Drop clean inodes from memory past the inode cache's limit (`fs::inodes`): those
    /// without a mapping or per-inode state, unchanged since the durable checkpoint.
    pub(super) fn prune_meta(&self, st: &mut State) {
        st.meta.shrink_dirs();
        // Every open, close and commit comes here: nothing more unless there is work.
        if !st.meta.wants_evict(self.icache_gauge.limit()) {
            return;
        }
        let ic = self.icache.lock();
        let (committed, barrier_done) = {
            let j = self.jn.lock();
            (j.committed, j.barrier_done)
        };
        let State {
            meta,
            live,
            txn_inodes,
            truncating,
            ordered,
            ..
        } = &mut *st;
        let owed = Owed {
            live,
            txn_inodes,
            truncating,
            ordered,
        };
        let dropped = meta.evict(ic.limit(), &|ino| {
            ic.get(&ino).is_some() || !owed.at_rest(ino, committed, barrier_done)
        });
        drop(ic);
        // What a fresh `Live::default()` means, as an icache eviction drops it.
        for ino in dropped {
            st.live.remove(&ino);
            self.bdi.forget_inode(ino);
        }
    }

    fn prune_mappings(&self, st: &mut State) {
        use super::icache::Verdict;
        if !self.icache_gauge.over_limit() {
            return;
        }
        let mut ic = self.icache.lock();
        if ic.len() <= ic.limit() {
            return;
        }
        let (committed, barrier_done) = {
            let j = self.jn.lock();
            (j.committed, j.barrier_done)
        };
        let epoch = super::icache::RestEpoch {
            committed,
            barrier_done,
        };
        let evicted = ic.prune(epoch, &mut |ino, m| {
            if st.live.get(&ino).is_some_and(|l| l.open > 0) {
                return Verdict::Off; // queued again at its last close
            }
            if !st.at_rest(ino, committed, barrier_done) {
                return Verdict::Later;
            }
            // At rest, the durable size is the size: the rebuilt mapping starts there.
            let durable = st.meta.resident(ino).map(|i| i.size);
            if durable != Some(m.size()) {
                debug_assert!(
                    false,
                    "inode {ino} at rest has size {} in its mapping and {durable:?} on disk",
                    m.size()
                );
                return Verdict::Off;
            }
            Verdict::Evict
        });
        drop(ic);
        for (ino, _) in evicted {
            st.live.remove(&ino);
            self.bdi.forget_inode(ino);
        }
    }

    pub(super) fn stat_of(&self, st: &State, ino: u64) -> FsResult<Stat> {
        let i = st.inode(ino)?;
        let size = match (i.kind, self.icache.lock().get(&ino)) {
            (InodeKind::File, Some(m)) => m.size(),
            (InodeKind::Symlink, _) => i.target.len() as u64,
            _ => i.size,
        };
        let reserved = st.live.get(&ino).map_or(0, |l| {
            l.delalloc.len() as u64 + l.pending.values().map(|e| e.1).sum::<u64>()
        });
        Ok(Stat {
            ino,
            kind: i.kind,
            mode: i.mode,
            uid: i.uid,
            gid: i.gid,
            nlink: i.nlink(),
            size,
            blocks: (i.blocks() + reserved) * SECTORS_PER_BLOCK,
            atime_ns: i.atime_ns,
            mtime_ns: i.mtime_ns,
            ctime_ns: i.ctime_ns,
            rdev: i.rdev,
        })
    }

    /// Refuse to grow the metadata past what a checkpoint slot can hold (else the
    /// journal could fill with no way to checkpoint it).
    pub(super) fn check_meta_room(&self, st: &State, extra: u64) -> FsResult<()> {
        if self.sb.version >= super::format::TREE_VERSION {
            // The slot holds only the tree's root record.
            return Ok(());
        }
        let slot = self.sb.checkpoint[0].1 * PAGE;
        if st.meta.image_bytes() + extra + 4096 > slot * 9 / 10 {
            return Err(FsError::NoSpace);
        }
        Ok(())
    }

    /// Create `name` in `dir`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn create_node(
        &self,
        st: &mut State,
        dir: u64,
        name: &[u8],
        kind: InodeKind,
        mode: u32,
        target: Option<&[u8]>,
    ) -> FsResult<u64> {
        let node = NewNode {
            kind,
            owner: (0, 0, mode),
            target,
            rdev: 0,
        };
        self.create_node_as(st, dir, name, &node)
    }

    /// Create `name` in `dir` as `node` describes.
    pub(super) fn create_node_as(
        &self,
        st: &mut State,
        dir: u64,
        name: &[u8],
        node: &NewNode,
    ) -> FsResult<u64> {
        st.check_writable()?;
        check_name(name)?;
        if st.find(dir, name)?.is_some() {
            return Err(FsError::Exists(String::from_utf8_lossy(name).into_owned()));
        }
        self.make_node(st, dir, name, node)
    }

    /// `create_node_as` of a name the caller found absent from `dir` in this hold of
    /// `st` (an open that creates looked it up already: a second lookup was a tenth of
    /// the create's hold).
    pub(super) fn create_absent(
        &self,
        st: &mut State,
        dir: u64,
        name: &[u8],
        node: &NewNode,
    ) -> FsResult<u64> {
        st.check_writable()?;
        check_name(name)?;
        debug_assert!(
            matches!(st.find(dir, name), Ok(None)),
            "a create of {name:?} in {dir}, which has it"
        );
        self.make_node(st, dir, name, node)
    }

    /// The create itself, once the volume is writable, `name` valid and absent.
    fn make_node(&self, st: &mut State, dir: u64, name: &[u8], node: &NewNode) -> FsResult<u64> {
        let NewNode {
            kind,
            owner: (uid, gid, mode),
            target,
            rdev,
        } = *node;
        if let Some(t) = target {
            if t.is_empty() || t.len() > TARGET_MAX {
                return Err(FsError::Invalid(format!(
                    "a symlink target of {} bytes",
                    t.len()
                )));
            }
        }
        self.check_meta_room(st, 256 + name.len() as u64)?;
        let now = self.now();
        let ino = st.meta.next_ino;
        st.log(
            Record::Create {
                ino,
                kind,
                mode: mode & 0o7777,
                uid,
                gid,
                time_ns: now + st.wall_offset_ns,
            },
            &[ino],
            now,
        )?;
        if rdev != 0 {
            st.log(Record::SetRdev { ino, rdev }, &[ino], now)?;
        }
        st.log_link(dir, name, ino, now)?;
        if let Some(t) = target {
            st.log(
                Record::SetTarget {
                    ino,
                    target: t.to_vec(),
                },
                &[ino],
                now,
            )?;
        }
        st.stamp(dir, now, true);
        Ok(ino)
    }

    /// The inode lost its last name: delete it now, or at last close if open.
    pub(super) fn drop_if_unlinked(&self, st: &mut State, ino: u64) -> FsResult<()> {
        let i = st.inode(ino)?;
        if i.links > 0 {
            return Ok(());
        }
        let now = self.now();
        if st.live.get(&ino).is_some_and(|l| l.open > 0) {
            st.log(Record::Orphan { ino }, &[ino], now)
        } else {
            self.delete_inode(st, ino)
        }
    }

    pub(super) fn delete_inode(&self, st: &mut State, ino: u64) -> FsResult<()> {
        if let Some(m) = self.icache.lock().remove(&ino) {
            // Its dirty pages die with it: nothing will ever read them.
            m.set_size(0);
        }
        self.bdi.forget_inode(ino);
        st.drop_live_blocks(ino, 0);
        if let Some(l) = st.live.get_mut(&ino) {
            // Written after a deferred truncation, never journaled: free at once.
            let maps = std::mem::take(&mut l.deferred_maps);
            for (_, (s, len)) in maps {
                let r = st.meta.alloc.free(s, len);
                st.allocator_broken("freeing the unjournaled blocks of a deleted inode", r);
            }
        }
        let now = self.now();
        st.log(Record::Delete { ino }, &[ino], now)?;
        st.live.remove(&ino);
        st.txn_inodes.remove(&ino);
        Ok(())
    }

    pub(super) fn unlink_at(&self, dir: u64, name: &[u8], rmdir: bool) -> FsResult<()> {
        self.unlink_in(&mut self.st.lock(), dir, name, rmdir)
    }

    /// `unlink_at` in a hold of `st` the caller took (to find `dir` in the same hold).
    pub(super) fn unlink_in(
        &self,
        st: &mut State,
        dir: u64,
        name: &[u8],
        rmdir: bool,
    ) -> FsResult<()> {
        st.check_writable()?;
        let ino = st.lookup(dir, name)?;
        if name == b"." || name == b".." {
            return Err(FsError::Invalid("cannot remove \".\" or \"..\"".into()));
        }
        let i = st.inode(ino)?;
        let nm = String::from_utf8_lossy(name).into_owned();
        // An unlisted directory reads back its first entry, if any.
        let has_entries = |i: &super::meta::Inode| {
            (i.entries.has_entries()).map_err(|cold| super::inodes::note_dir_miss(ino, cold))
        };
        match (rmdir, i.is_dir()) {
            (false, true) => return Err(FsError::IsDir(nm)),
            (true, false) => return Err(FsError::NotDir(nm)),
            (true, true) if has_entries(i)? => return Err(FsError::NotEmpty(nm)),
            _ => {}
        }
        let now = self.now();
        st.log_unlink(dir, name, ino, now)?;
        st.stamp(dir, now, true);
        st.stamp(ino, now, false);
        self.drop_if_unlinked(st, ino)
    }

    pub(super) fn rename_at(
        self: &Arc<Self>,
        od: u64,
        on: &[u8],
        nd: u64,
        nn: &[u8],
    ) -> FsResult<()> {
        self.rename_in(self.st.lock(), od, on, nd, nn)
    }

    /// `rename_at` in a hold of `st` the caller took (to find both directories in the
    /// same hold); it ends the hold.
    pub(super) fn rename_in(
        self: &Arc<Self>,
        mut st: crate::spin::SpinGuard<'_, State>,
        od: u64,
        on: &[u8],
        nd: u64,
        nn: &[u8],
    ) -> FsResult<()> {
        st.check_writable()?;
        check_name(nn)?;
        let ino = st.lookup(od, on)?;
        st.dir(nd)?;
        let src_dir = st.inode(ino)?.is_dir();
        if src_dir {
            st.check_not_into_itself(ino, nd)?;
        }
        let victim = st.find(nd, nn)?;
        let now = self.now();
        let mut kick = None;
        if let Some(v) = victim {
            if v == ino {
                return Ok(()); // same file: rename(2) does nothing
            }
            if self.flush_on_close.load(Ordering::Relaxed) && st.inode(ino)?.kind == InodeKind::File
            {
                // auto_da_alloc: the commit of this rename waits for the data `ino`
                // has now, and its writeback starts at once.
                let owes = st.live.get(&ino).is_some_and(|l| {
                    !l.delalloc.is_empty() || !l.pending.is_empty() || l.trunc_pending
                });
                let m = if owes {
                    Some(self.mapping(&st, ino)?)
                } else {
                    None
                };
                let l = st.live.entry(ino).or_default();
                // Only reservations a page holds: one a failed write left behind
                // (held back for a concurrent writer) is written by nobody, and
                // waiting for it would stop every commit.
                let pages: BTreeSet<u64> = match &m {
                    Some(m) => m
                        .pages_owing_write(l.delalloc.iter(), false)
                        .into_iter()
                        .collect(),
                    None => BTreeSet::new(),
                };
                let inflight: Vec<u64> = l.pending.values().map(|e| e.0).collect();
                if !pages.is_empty() || !inflight.is_empty() || l.trunc_pending {
                    let tid = st.running_tid;
                    st.ordered.push(Ordered {
                        ino,
                        pages,
                        inflight,
                        tid,
                    });
                    kick = m;
                }
            }
            let vi = st.inode(v)?;
            let nm = String::from_utf8_lossy(nn).into_owned();
            let has_entries = (src_dir && vi.is_dir())
                .then(|| vi.entries.has_entries())
                .transpose()
                .map_err(|cold| super::inodes::note_dir_miss(v, cold))?;
            match (src_dir, vi.is_dir()) {
                (true, false) => return Err(FsError::NotDir(nm)),
                (false, true) => return Err(FsError::IsDir(nm)),
                (true, true) if has_entries == Some(true) => return Err(FsError::NotEmpty(nm)),
                _ => {}
            }
            st.log_unlink(nd, nn, v, now)?;
            st.stamp(v, now, false);
            self.drop_if_unlinked(&mut st, v)?;
        }
        st.log_unlink(od, on, ino, now)?;
        st.log_link(nd, nn, ino, now)?;
        st.stamp(od, now, true);
        st.stamp(nd, now, true);
        st.stamp(ino, now, false);
        drop(st);
        if let Some(m) = kick {
            self.queue_flush(super::flush::FlushReq {
                ino,
                mapping: m,
                since: None,
                state: None,
                resolve: true,
            });
        }
        Ok(())
    }

    pub(super) fn open_ino(
        self: &Arc<Self>,
        ino: u64,
        o: &OpenOptions,
        created: bool,
    ) -> FsResult<File> {
        let mapping = self.open_locked(&mut self.st.lock(), ino, o)?;
        self.open_file(ino, mapping, o, created)
    }

    /// The half of an open done under `st`: the kind and access checks, the open
    /// count. A create opens its file in the same hold of `st` that made it, so no
    /// other operation comes in between and a create costs one hold, not two.
    pub(super) fn open_locked(
        &self,
        st: &mut State,
        ino: u64,
        o: &OpenOptions,
    ) -> FsResult<Arc<Mapping>> {
        self.open_checks(st, ino, o)?;
        let m = self.mapping(st, ino)?;
        self.open_count(st, ino);
        Ok(m)
    }

    /// `open_locked` of a file this hold of `st` just created: its mapping, empty, is
    /// made after `st` is dropped (`created_mapping`), which keeps an allocation and
    /// the inode cache's lock out of the hold every namespace operation waits for.
    /// Counted open, the inode can be neither evicted nor deleted meanwhile, and a
    /// `Vol::mapping` by another thread in between makes the same empty mapping,
    /// which the inode cache then hands out to both.
    pub(super) fn open_created(&self, st: &mut State, ino: u64, o: &OpenOptions) -> FsResult<()> {
        self.open_checks(st, ino, o)?;
        debug_assert_eq!(
            st.inode(ino)?.size,
            0,
            "inode {ino} is not a file this hold created"
        );
        self.open_count(st, ino);
        Ok(())
    }

    /// The mapping of a file `open_created` opened, made without `st`.
    pub(super) fn created_mapping(&self, ino: u64) -> Arc<Mapping> {
        let fresh = self.new_mapping(ino, 0);
        self.icache.lock().get_or_insert(ino, || fresh)
    }

    fn open_count(&self, st: &mut State, ino: u64) {
        st.live.entry(ino).or_default().open += 1;
        self.prune_icache(st);
    }

    /// The kind and access checks of an open.
    fn open_checks(&self, st: &State, ino: u64, o: &OpenOptions) -> FsResult<()> {
        let i = st.inode(ino)?;
        match i.kind {
            InodeKind::Dir => return Err(FsError::IsDir(format!("inode {ino}"))),
            InodeKind::Symlink => {
                return Err(FsError::Invalid(format!("inode {ino} is a symlink")))
            }
            InodeKind::File => {}
            // FIFOs, sockets and devices are opened by the kernel, never read here.
            _ => {
                return Err(FsError::NotSupported(format!(
                    "inode {ino} is a special file"
                )))
            }
        }
        if o.write || o.truncate {
            st.check_writable()?;
        }
        Ok(())
    }

    /// The rest of an open, without `st`: from here the open is counted, and dropping
    /// the `File` releases it.
    pub(super) fn open_file(
        self: &Arc<Self>,
        ino: u64,
        mapping: Arc<Mapping>,
        o: &OpenOptions,
        created: bool,
    ) -> FsResult<File> {
        let f = File {
            vol: self.clone(),
            ino,
            wb_since: Arc::new(Mutex::new(mapping.wb_err().sample())),
            sb_since: Arc::new(Mutex::new(self.sb_err.sample())),
            mapping,
            read: o.read,
            write: o.write,
            append: o.append,
            closed: AtomicBool::new(false),
        };
        // A file this open just created is empty: no truncation (and so no
        // flush-on-close), as the VFS skips it for FMODE_CREATED. O_TRUNC truncates
        // whatever the access mode, as Linux does (the caller checked write permission;
        // the kernel's FUSE client sets its size to 0 for O_RDONLY|O_TRUNC too).
        if o.truncate && !created {
            self.truncate(ino, &f.mapping, 0)?;
        }
        Ok(f)
    }

    fn release(self: &Arc<Self>, ino: u64, mapping: &Arc<Mapping>) -> FsResult<()> {
        // Read before `st` (pages come and go without it either way): an inode queued
        // with pages is only passed over by the prune (`icache::verdict`), and one
        // whose last page goes later is queued then (`mapping_emptied`).
        let no_pages = mapping.nr_pages() == 0;
        let mut st = self.st.lock();
        let Some(l) = st.live.get_mut(&ino) else {
            return Ok(());
        };
        let Some(open) = l.open.checked_sub(1) else {
            debug_assert!(false, "a close of inode {ino}, which is not open");
            return Err(FsError::Corrupt(format!(
                "a close of inode {ino}, which is not open"
            )));
        };
        l.open = open;
        let last = open == 0;
        // auto_da_alloc: closing a file truncated to zero starts its writeback now.
        let kick =
            std::mem::take(&mut l.da_alloc_close) && self.flush_on_close.load(Ordering::Relaxed);
        if last && st.meta.resident(ino).is_some_and(|i| i.links == 0) && st.aborted.is_none() {
            return self.delete_inode(&mut st, ino);
        }
        if last {
            // Unused without pages: on the inode LRU now (else when its last page goes).
            if no_pages {
                self.icache.lock().queue(ino);
            }
            self.prune_icache(&mut st);
        }
        drop(st);
        if kick {
            self.queue_flush(super::flush::FlushReq {
                ino,
                mapping: mapping.clone(),
                since: None,
                state: None,
                resolve: true,
            });
        }
        Ok(())
    }

    pub(super) fn truncate(
        self: &Arc<Self>,
        ino: u64,
        mapping: &Arc<Mapping>,
        size: u64,
    ) -> FsResult<()> {
        let _i_rwsem = mapping.lock_for_truncate();
        let _truncating = {
            let mut st = self.st.lock();
            st.check_writable()?;
            Truncating::start(self, &mut st, ino)
        };
        let old = mapping.size();
        // A partial last page keeps its head; its tail must read as zeros from now on,
        // on disk too, so the page is read, cut and written again.
        let mut head = None;
        if size < old && !size.is_multiple_of(PAGE) {
            let start = size / PAGE * PAGE;
            let mut buf = vec![0u8; (size - start) as usize];
            mapping.read_at(start, &mut buf)?;
            head = Some((start, buf));
        }
        // Before anything is logged, and without `st` (completions take it): a write of
        // a page past the new end, claimed before now but not mapped yet, would get a
        // block after the truncation, as if written after it, and be journaled inside
        // any later extension (stale data). Its writes done, the truncation below sees
        // the file as its data on disk left it (the partial last block included).
        mapping.truncate(size);
        {
            // flush_on_close may have been switched off since a truncation was
            // deferred: a pending one is resolved here either way.
            let foc = self.flush_on_close.load(Ordering::Relaxed);
            let mut st = self.st.lock();
            st.check_writable()?;
            let has_disk = !st.inode(ino)?.extents.is_empty();
            let l = st.live.entry(ino).or_default();
            if size == 0 && foc {
                l.da_alloc_close = true;
            }
            let pending = l.trunc_pending;
            // Not while a transaction waits for ordered data of this inode (a rename
            // over, the rewritten head of a partial last block): the truncation may
            // have dropped that data, and only journaling it now, in that very
            // transaction, keeps the transaction from committing without it.
            let ordered = st.ordered.iter().any(|o| o.ino == ino);
            if foc && size == 0 && (has_disk || pending) && !ordered {
                // Deferred: the old blocks stay until the rewrite is written back. Pages
                // written since the cut above belong before it, not to the rewrite.
                mapping.set_size(0);
                st.drop_live_blocks(ino, 0);
                let l = st.live.get_mut(&ino).expect("just made");
                let stale = std::mem::take(&mut l.deferred_maps);
                l.trunc_pending = true;
                l.deferred_size = 0;
                for (_, (s, len)) in stale {
                    // Written since the last deferred truncation, never journaled.
                    let r = st.meta.alloc.free(s, len);
                    st.allocator_broken("freeing blocks written before a new truncation", r);
                }
                st.stamp(ino, self.now(), true);
                return Ok(());
            }
            if pending {
                // Another truncation: journal the deferred one first, then this.
                self.resolve_trunc(&mut st, ino)?;
            }
        }
        let now = self.now();
        let cow = {
            let mut st = self.st.lock();
            st.check_writable()?;
            let disk = st.inode(ino)?.size;
            let keep = size.div_ceil(PAGE);
            st.drop_live_blocks(ino, keep);
            let fb = size / PAGE;
            // A head in a hole (no block, none to come) has no old tail anywhere but
            // the cache, which the cut zeroed: rewriting it would allocate a block for
            // zeros, and on a full volume its reservation's retry would wait for a
            // commit that waits for this truncation (an ordered rename of the file).
            let hole = head.is_some()
                && st.inode(ino)?.lookup_block(fb).is_none()
                && st
                    .live
                    .get(&ino)
                    .is_none_or(|l| !l.delalloc.contains(&fb) && l.unjournaled_block(fb).is_none());
            if hole {
                head = None;
            }
            // The size on disk follows data written, so a cut inside dirty data waits
            // for the head's rewrite to carry it; a cut in a hole has no rewrite, and
            // nothing up to it can show stale bytes (unwritten blocks are not mapped):
            // it is logged as it is.
            let new_disk = if size >= old || hole {
                size
            } else {
                size.min(disk)
            };
            // The block holding the new end is on disk: its tail must become zeros
            // without rewriting it in place (a crash before the truncation commits
            // would show zeros inside the old size). It is freed with the truncation
            // and its head rewritten to a new block, in the same transaction.
            let cow = head.is_some()
                && new_disk > fb * PAGE
                && st.inode(ino)?.lookup_block(fb).is_some()
                && st.meta.alloc.reserve(1).is_ok();
            if cow {
                st.log(
                    Record::Truncate {
                        ino,
                        size: fb * PAGE,
                    },
                    &[ino],
                    now,
                )?;
                st.log(
                    Record::SetSize {
                        ino,
                        size: new_disk,
                    },
                    &[ino],
                    now,
                )?;
                st.live.entry(ino).or_default().delalloc.insert(fb);
                let tid = st.running_tid;
                st.ordered.push(Ordered {
                    ino,
                    pages: BTreeSet::from([fb]),
                    inflight: Vec::new(),
                    tid,
                });
            } else {
                st.log(
                    Record::Truncate {
                        ino,
                        size: new_disk,
                    },
                    &[ino],
                    now,
                )?;
            }
            st.stamp(ino, now, true);
            cow
        };
        if let Some((start, buf)) = head {
            // Still a truncation in progress, which flush batches wait for: a throttled
            // sleep here would wait for the flusher waiting for it (the library soak
            // with a 4 MiB cache hung so: writers throttled, the flusher in
            // `wait_truncations`, this write in `balance_dirty_pages`).
            mapping.write_at_unthrottled(start, &buf)?;
        }
        if cow {
            self.queue_flush(super::flush::FlushReq {
                ino,
                mapping: mapping.clone(),
                since: None,
                state: None,
                resolve: false,
            });
        }
        Ok(())
    }
}

impl Volume {
    /// The device queue under the volume.
    pub fn queue(&self) -> &Arc<RequestQueue> {
        &self.vol.q
    }
    pub fn bdi(&self) -> &Arc<Bdi> {
        &self.vol.bdi
    }
    pub fn cache(&self) -> &Arc<PageCache> {
        &self.vol.cache
    }
    pub fn superblock(&self) -> &Superblock {
        &self.vol.sb
    }

    /// Look a path up (following symlinks) and return its inode number.
    pub fn lookup_path(&self, path: &str) -> FsResult<u64> {
        let path = &self.vol.path_walk(path);
        self.vol.faulting(|| {
            let st = self.vol.st.lock();
            self.vol.resolve(&st, path, true)
        })
    }

    /// `name` in directory `dir` (inode-level lookup, as FUSE asks).
    pub fn lookup(&self, dir: u64, name: &str) -> FsResult<u64> {
        self.vol
            .faulting(|| self.vol.st.lock().lookup(dir, name.as_bytes()))
    }

    pub fn stat(&self, path: &str) -> FsResult<Stat> {
        let path = &self.vol.path_walk(path);
        self.vol.faulting(|| {
            let st = self.vol.st.lock();
            let ino = self.vol.resolve(&st, path, true)?;
            self.vol.stat_of(&st, ino)
        })
    }

    /// stat without following a symlink in the last component.
    pub fn lstat(&self, path: &str) -> FsResult<Stat> {
        let path = &self.vol.path_walk(path);
        self.vol.faulting(|| {
            let st = self.vol.st.lock();
            let ino = self.vol.resolve(&st, path, false)?;
            self.vol.stat_of(&st, ino)
        })
    }

    pub fn stat_ino(&self, ino: u64) -> FsResult<Stat> {
        self.vol.faulting(|| {
            let st = self.vol.st.lock();
            self.vol.stat_of(&st, ino)
        })
    }

    pub fn mkdir(&self, path: &str, mode: u32) -> FsResult<u64> {
        let path = &self.vol.path_walk(path);
        self.vol.faulting(|| {
            let mut st = self.vol.st.lock();
            let (dir, name) = self.vol.resolve_parent(&st, path)?;
            self.vol
                .create_node(&mut st, dir, &name, InodeKind::Dir, mode, None)
        })
    }

    /// mkdir -p: every missing directory of `path`, in one walk.
    pub fn mkdir_all(&self, path: &str, mode: u32) -> FsResult<()> {
        let comps = components(path);
        // Every directory there and in the dentry cache: nothing to make, and no `st`
        // (fs_mark asks this before every file).
        if self.vol.dcache.walk(ROOT_INO, &comps).is_some() {
            return Ok(());
        }
        self.vol.faulting(|| {
            let mut st = self.vol.st.lock();
            let mut cur = ROOT_INO;
            let mut budget = MAX_SYMLINKS;
            for c in &comps {
                cur = match st.find(cur, c)? {
                    Some(ino) => {
                        let dir = self.vol.follow(&st, cur, ino, &mut budget, path)?;
                        if !st.inode(dir)?.is_dir() {
                            return Err(FsError::NotDir(path.to_string()));
                        }
                        self.vol.cache_dentry(&st, cur, c, ino);
                        dir
                    }
                    None => self
                        .vol
                        .create_node(&mut st, cur, c, InodeKind::Dir, mode, None)?,
                };
            }
            Ok(())
        })
    }

    pub fn symlink(&self, target: &str, path: &str) -> FsResult<u64> {
        let path = &self.vol.path_walk(path);
        self.vol.faulting(|| {
            let mut st = self.vol.st.lock();
            let (dir, name) = self.vol.resolve_parent(&st, path)?;
            self.vol.create_node(
                &mut st,
                dir,
                &name,
                InodeKind::Symlink,
                0o777,
                Some(target.as_bytes()),
            )
        })
    }

    pub fn readlink(&self, path: &str) -> FsResult<String> {
        let path = &self.vol.path_walk(path);
        self.vol.faulting(|| {
            let st = self.vol.st.lock();
            let ino = self.vol.resolve(&st, path, false)?;
            let i = st.inode(ino)?;
            if i.kind != InodeKind::Symlink {
                return Err(FsError::Invalid(format!("{path} is not a symlink")));
            }
            Ok(String::from_utf8_lossy(&i.target).into_owned())
        })
    }

    /// A hard link `new` to the file at `existing`.
    pub fn link(&self, existing: &str, new: &str) -> FsResult<()> {
        let existing = &self.vol.path_walk(existing);
        let new = &self.vol.path_walk(new);
        self.vol.faulting(|| {
            let mut st = self.vol.st.lock();
            st.check_writable()?;
            let ino = self.vol.resolve(&st, existing, false)?;
            if st.inode(ino)?.is_dir() {
                return Err(FsError::NotPermitted(format!(
                    "{existing}: hard links to directories are not allowed"
                )));
            }
            let (dir, name) = self.vol.resolve_parent(&st, new)?;
            if matches!(st.find(dir, &name), Ok(Some(_))) {
                return Err(FsError::Exists(new.to_string()));
            }
            self.vol.check_meta_room(&st, 64 + name.len() as u64)?;
            let now = self.vol.now();
            st.log_link(dir, &name, ino, now)?;
            st.stamp(dir, now, true);
            st.stamp(ino, now, false);
            Ok(())
        })
    }

    pub fn unlink(&self, path: &str) -> FsResult<()> {
        let path = &self.vol.path_walk(path);
        self.vol.faulting(|| self.vol.unlink_path(path, false))
    }

    pub fn rmdir(&self, path: &str) -> FsResult<()> {
        let path = &self.vol.path_walk(path);
        self.vol.faulting(|| self.vol.unlink_path(path, true))
    }

    /// rename(2), replacing an existing target atomically.
    pub fn rename(&self, from: &str, to: &str) -> FsResult<()> {
        let (from, to) = (&self.vol.path_walk(from), &self.vol.path_walk(to));
        self.vol.faulting(|| self.vol.rename_paths(from, to))
    }

    pub fn readdir(&self, path: &str) -> FsResult<Vec<DirEntry>> {
        let path = &self.vol.path_walk(path);
        self.vol.faulting(|| {
            let st = self.vol.st.lock();
            let ino = self.vol.resolve(&st, path, true)?;
            let d = st.inode(ino)?;
            if !d.is_dir() {
                return Err(FsError::NotDir(path.to_string()));
            }
            d.entries
                .all_resident()
                .map_err(|cold| super::inodes::note_dir_miss(ino, cold))?;
            st.meta.clear_misses();
            let mut all: Vec<DirEntry> = d
                .entries
                .iter_kinds()
                .map(|(n, c, kind)| DirEntry {
                    name: String::from_utf8_lossy(n).into_owned(),
                    ino: c,
                    kind: kind.unwrap_or_else(|| st.kind_of(c)),
                })
                .collect();
            st.missed()?;
            // The whole listing in name order (readdir's own order, the cookies', is the
            // name hash's: see `Vol::readdir_page`).
            all.sort_unstable_by(|a, b| a.name.cmp(&b.name));
            Ok(all)
        })
    }

    /// chmod / chown / utimes.
    pub fn set_attr(&self, path: &str, a: &SetAttr) -> FsResult<Stat> {
        let path = &self.vol.path_walk(path);
        self.vol.faulting(|| {
            let ino = {
                let st = self.vol.st.lock();
                self.vol.resolve(&st, path, true)?
            };
            let at = |t: Option<u64>| t.map(super::ops::TimeSet::At);
            self.setattr_as(
                &super::perm::Cred::root(),
                ino,
                &super::ops::SetAttrIno {
                    mode: a.mode,
                    uid: a.uid,
                    gid: a.gid,
                    atime: at(a.atime_ns),
                    mtime: at(a.mtime_ns),
                    ..Default::default()
                },
            )
        })
    }

    pub fn open(&self, path: &str, o: &OpenOptions) -> FsResult<File> {
        let path = &self.vol.path_walk(path);
        self.vol.faulting(|| {
            let (ino, created, mapping) = {
                let mut st = self.vol.st.lock();
                let found = if o.create {
                    self.vol.resolve_for_create(&st, path)?
                } else {
                    Resolved::Found(self.vol.resolve(&st, path, true)?)
                };
                match found {
                    Resolved::Found(_) if o.create && o.exclusive => {
                        return Err(FsError::Exists(path.to_string()));
                    }
                    Resolved::Found(ino) => {
                        (ino, false, Some(self.vol.open_locked(&mut st, ino, o)?))
                    }
                    // The link's name is taken: what a create of it would say.
                    Resolved::Dangling { name, .. } => {
                        st.check_writable()?;
                        return Err(FsError::Exists(String::from_utf8_lossy(&name).into_owned()));
                    }
                    Resolved::Missing { dir, name } => {
                        let ino = self.vol.create_absent(
                            &mut st,
                            dir,
                            &name,
                            &NewNode::file((0, 0, o.mode)),
                        )?;
                        self.vol.open_created(&mut st, ino, o)?;
                        (ino, true, None)
                    }
                }
            };
            let mapping = mapping.unwrap_or_else(|| self.vol.created_mapping(ino));
            self.vol.open_file(ino, mapping, o, created)
        })
    }

    /// Create (or truncate) a file for writing: `open(path, O_CREAT|O_TRUNC|O_RDWR)`.
    pub fn create(&self, path: &str) -> FsResult<File> {
        self.open(path, &OpenOptions::create())
    }

    pub fn statfs(&self) -> StatFs {
        let st = self.vol.st.lock();
        let (total, free, avail) = st.meta.alloc.statfs();
        StatFs {
            block_size: PAGE,
            blocks: total,
            free,
            available: avail,
            files: st.meta.nr_inodes(),
        }
    }

    /// The inode cache's counts (`fs::icache`).
    pub fn inode_cache_stats(&self) -> InodeCacheStats {
        let st = self.vol.st.lock();
        let ic = self.vol.icache.lock();
        let m = st.meta.cache_stats();
        let nodes = (self.vol.nodes.as_ref()).map_or_else(Default::default, |s| s.stats());
        let dc = self.vol.dcache.stats();
        InodeCacheStats {
            cached: ic.len() as u64,
            live: st.live.len() as u64,
            limit: ic.limit() as u64,
            evicted: ic.evicted(),
            examined: ic.examined(),
            inodes_resident: m.resident,
            inodes_read_back: m.faults,
            inodes_dropped: m.evictions,
            dirents_resident: m.dirents_resident,
            dirent_groups_read_back: m.dirent_faults,
            dirents_dropped: m.dirents_shrunk,
            node_cache_bytes: nodes.cached_bytes,
            node_cache_hits: nodes.hits,
            node_cache_misses: nodes.misses,
            dentries: dc.entries,
            dentry_walk_hits: dc.hits,
            dentry_walk_misses: dc.misses,
        }
    }

    pub fn journal_stats(&self) -> JournalStats {
        let j = self.vol.jn.lock();
        let mut s = j.stats.clone();
        s.committed_tid = j.committed;
        s
    }

    /// syncfs: write back every dirty page, then commit the journal; returns once all
    /// of it is durable, with any writeback error of the volume since the last
    /// `Volume::sync` (reported once; each `File::syncfs` has its own cursor).
    /// Sync, then checkpoint: the metadata (format 4: its tree) holds everything, and
    /// the journal starts over.
    pub fn checkpoint(&self) -> FsResult<()> {
        self.sync()?;
        self.vol.checkpoint_now()
    }

    pub fn sync(&self) -> FsResult<()> {
        let r = self.vol.sync_all();
        let e = self
            .vol
            .sb_err
            .check_and_advance(&mut self.vol.sync_since.lock());
        r?;
        errno_result(e)
    }

    /// Write the file back and drop its pages from the cache (as `echo 1 >
    /// drop_caches` does for one file), so the next read comes from the device.
    /// Returns false, changing nothing, while the file is open.
    pub fn drop_cache(&self, path: &str) -> FsResult<bool> {
        let path = &self.vol.path_walk(path);
        self.vol.faulting(|| {
            let (ino, m) = {
                let st = self.vol.st.lock();
                let ino = self.vol.resolve(&st, path, true)?;
                if st.live.get(&ino).is_some_and(|l| l.open > 0) {
                    return Ok(false);
                }
                (ino, self.vol.mapping(&st, ino)?)
            };
            self.vol
                .fsync_ino(ino, &m, false, &Mutex::new(m.wb_err().sample()))?;
            // A journaled fsync leaves its pages under writeback until their home
            // write, which waiting sends: dropped before it, the next read would find
            // the block's old content (or a deleted file's), and a rewrite of part of
            // the page would put that on disk in place of data fsync made durable.
            m.wait_writeback(0, u64::MAX);
            let st = self.vol.st.lock();
            if st.live.get(&ino).is_some_and(|l| l.open > 0)
                || m.nr_dirty() > 0
                || m.nr_writeback() > 0
            {
                return Ok(false);
            }
            self.vol.icache.lock().remove(&ino);
            self.vol.bdi.forget_inode(ino);
            // Only the cache copy goes: the next use builds a new mapping from disk.
            m.set_size(0);
            Ok(true)
        })
    }

    /// The page-cache mapping of the file at `path` (for tests and tools that need
    /// the cache's own view, e.g. its legacy error bit).
    pub fn mapping_of(&self, path: &str) -> FsResult<Arc<Mapping>> {
        let path = &self.vol.path_walk(path);
        self.vol.faulting(|| {
            let st = self.vol.st.lock();
            let ino = self.vol.resolve(&st, path, true)?;
            self.vol.mapping(&st, ino)
        })
    }

    /// FIEMAP: the file's journaled extents as (file block, device block, blocks).
    /// Blocks still being written (or only reserved) are not listed.
    pub fn fiemap(&self, path: &str) -> FsResult<Vec<(u64, u64, u64)>> {
        let path = &self.vol.path_walk(path);
        self.vol.faulting(|| {
            let st = self.vol.st.lock();
            let ino = self.vol.resolve(&st, path, true)?;
            Ok(st
                .inode(ino)?
                .extents
                .iter()
                .map(|(&f, &(s, l))| (f, s, l))
                .collect())
        })
    }

    /// Check the in-memory metadata against every invariant fsck checks (for tests and
    /// `wbstack fsck` of a live volume); empty when consistent.
    pub fn check(&self) -> Vec<String> {
        // No checkpoint meanwhile (the tree's lock comes before `st`): the tree's nodes
        // and the durable root stay as they are.
        let tree = self.vol.tree.lock();
        let nodes = match tree.as_ref().map(|t| t.tree.check(&*t.store)) {
            Some(Ok(blocks)) => Some(blocks),
            Some(Err(e)) => return vec![format!("the metadata tree: {e}")],
            None => None,
        };
        // A walk of every inode and entry: those not in memory are read back first (a
        // prune may drop some again before `st` is taken: then once more). Groups of
        // entries stay resident meanwhile (`Meta::hold_dirs`).
        self.vol.st.lock().meta.hold_dirs(true);
        let r = (|| {
            for _ in 0..8 {
                if let Err(e) = self.vol.read_back(None, false) {
                    return vec![format!("reading the inodes back: {e}")];
                }
                let cold = self.vol.st.lock().meta.cold_dirs();
                if let Err(e) = self.vol.read_back_dirents(&cold) {
                    return vec![format!("reading directories back: {e}")];
                }
                let mut st = self.vol.st.lock();
                if st.meta.resident_inodes().len() as u64 == st.meta.nr_inodes()
                    && st.meta.cold_dirs().is_empty()
                {
                    return match &nodes {
                        Some(b) if !st.meta.tree_blocks_known => st.meta.check_with_nodes(b),
                        _ => st.meta.check(),
                    };
                }
            }
            vec!["inodes kept leaving memory while they were read back for the check".into()]
        })();
        self.vol.st.lock().meta.hold_dirs(false);
        r
    }
}

/// A fresh volume on a 64 MiB simulated SSD for the crate's own tests: no periodic
/// writeback or commit (the test decides when things happen), `tune` for the rest.
#[cfg(test)]
pub(super) fn test_volume(tune: impl FnOnce(&mut MountOptions)) -> Volume {
    let q = RequestQueue::open("sim:ssd,size=64M", crate::block::QueueConfig::default())
        .expect("a simulated device");
    Volume::mkfs(&q, &super::mkfs::MkfsOptions::default()).expect("mkfs");
    let mut o = MountOptions::default();
    o.wb.dirty_writeback_centisecs = 0;
    o.commit_interval_ms = 3_600_000;
    tune(&mut o);
    Volume::mount(q, o).expect("mount")
}

#[cfg(test)]
mod in_place_tests {
    use super::*;

    /// A block an overwrite in place is in flight to (mapped by writeback, not yet
    /// ended) is not reused when its file is deleted and the deletion commits: it
    /// becomes free only when that write ends, so a late write never lands in a block
    /// another file got.
    #[test]
    fn a_block_freed_while_an_overwrite_is_in_flight_is_free_only_when_it_ends() {
        let v = test_volume(|o| o.journal_data_kb = 0);
        let f = v.create("/f").unwrap();
        f.write_at(0, &[1u8; 4096]).unwrap();
        f.fsync().unwrap();
        f.close().unwrap();
        let ino = v.stat("/f").unwrap().ino;
        let b = v.fiemap("/f").unwrap()[0].1;
        let aops = v.vol.aops.clone();
        // Writeback maps a rewrite of the page in place, and is slow to send it.
        assert_eq!(
            aops.map_write(ino, 0, 1).unwrap(),
            vec![(b * SECTORS_PER_BLOCK, 1)]
        );
        v.unlink("/f").unwrap();
        v.sync().unwrap();
        {
            let st = v.vol.st.lock();
            assert_eq!(st.meta.alloc.held_blocks(), 1);
            assert!(
                !st.meta.alloc.space().is_free(b, 1),
                "block {b} free mid-write"
            );
        }
        aops.end_writes(&[WriteDone {
            ino,
            index: 0,
            pages: 1,
            sector: b * SECTORS_PER_BLOCK,
            i_size: 4096,
            status: &Ok(()),
        }]);
        {
            let st = v.vol.st.lock();
            assert_eq!(st.meta.alloc.held_blocks(), 0);
            assert!(st.meta.alloc.space().is_free(b, 1), "block {b} still held");
            assert!(st.aborted.is_none(), "{:?}", st.aborted);
        }
        assert!(v.check().is_empty(), "{:?}", v.check());
        v.unmount().unwrap();
    }
}
