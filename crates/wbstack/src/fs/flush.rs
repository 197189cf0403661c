//! Asynchronous flush (seed 004's `fs_mark -A`) and flush-on-close (ext4's
//! auto_da_alloc), both driven by one mechanism: a batch of inodes the flusher thread
//! writes with data-integrity writeback under one plug, waits for, and hands to the
//! committer. Each asynchronous flush then completes with the commit that covers it, so
//! many flushes share one journal commit and one cache flush.
//!
//! What flush-on-close guarantees (`flush_on_close`, on by default):
//! * `rename(new, existing)`: the commit that makes the rename durable also makes
//!   durable the pages of `new` that had no block yet (delayed allocation) or a write
//!   in flight when it was renamed: the committer waits for that data before writing
//!   the transaction. After a crash the name holds the old file, or the new one with
//!   that data; never an empty or partial new file (the replace-by-rename pattern:
//!   a file written afresh, then renamed over the old one). Pages rewritten in place
//!   over blocks already on disk are written back at the rename but not waited for, as
//!   ext4's data=ordered orders only newly allocated blocks: after a crash such a page
//!   may hold an earlier version (never zeros). Writes to `new` after the rename are
//!   not covered (fsync them). crashtest checks this promise (`renamed_bytes_lost`):
//!   once the rename is durable, each block's first write made before it, in a file
//!   created during the run and never truncated, must be there; later writes over a
//!   block are rewrites in place, and optional.
//! * truncate to zero of a file with data on disk (`O_TRUNC`, `ftruncate(0)`), then a
//!   rewrite: the truncation is not journaled when it happens. The old blocks stay where
//!   they are and the rewrite goes to new blocks; at close the file is written back and
//!   then the truncation and the new extents are journaled together, in one transaction.
//!   After a crash the file has its old content or its content at close, never empty
//!   and never a mix. fsync, syncfs and unmount do the same at once.
//! * Not guaranteed: a file that is never closed, fsynced or synced after such a
//!   truncation keeps its old content on disk (the new content is not durable); an
//!   overwrite in place without truncation may be a mix of old and new blocks after a
//!   crash; a new file without fsync may be absent or shorter. Truncation to a size
//!   other than zero is journaled at once, as ext4 does.

use super::error::{FsError, FsResult};
use super::format::Record;
use super::volume::{errno_result, State, Vol};
use crate::block::{BlkError, Plug};
use crate::mm::Mapping;
use crate::writeback::Wbc;
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// The result of an asynchronous flush, set once.
#[derive(Default)]
pub struct FlushState {
    result: Mutex<Option<FsResult<()>>>,
    cv: Condvar,
}

impl FlushState {
    pub(super) fn complete(&self, r: FsResult<()>) {
        let mut g = self.result.lock();
        if g.is_none() {
            *g = Some(r);
            self.cv.notify_all();
        }
    }
}

/// A flush in progress: `File::flush_async`'s handle. It does not keep the file open;
/// the file may be closed before the flush completes.
#[derive(Clone)]
pub struct FlushHandle(pub(super) Arc<FlushState>);

impl FlushHandle {
    /// Wait for the flush: Ok when the file's data and metadata are durable, or the
    /// error fsync would have returned (reported through the file's errseq cursor).
    pub fn wait(&self) -> FsResult<()> {
        crate::block::flush_plug();
        let mut g = self.0.result.lock();
        while g.is_none() {
            self.0.cv.wait(&mut g);
        }
        g.clone().expect("set")
    }

    /// The result, if the flush has completed.
    pub fn poll(&self) -> Option<FsResult<()>> {
        self.0.result.lock().clone()
    }

    pub fn is_done(&self) -> bool {
        self.0.result.lock().is_some()
    }
}

/// What a sync of an inode waits for: the transaction holding its changes and, for
/// data written without FUA, the generation of a cache flush after it.
#[derive(Clone, Copy, Debug)]
pub(super) struct SyncPoint {
    pub tid: u64,
    pub gen: Option<u64>,
}

pub(super) fn sync_point_of(st: &State, ino: u64, datasync: bool) -> SyncPoint {
    st.live
        .get(&ino)
        .map_or(SyncPoint { tid: 0, gen: None }, |l| SyncPoint {
            tid: if datasync { l.datasync_tid } else { l.sync_tid },
            gen: l.data_gen,
        })
}

/// One inode to flush in the next batch.
pub(super) struct FlushReq {
    pub ino: u64,
    pub mapping: Arc<Mapping>,
    /// The file's errseq cursor, for an asynchronous flush (None: a flush-on-close or
    /// rename kick, which reports nothing).
    pub since: Option<Arc<Mutex<u32>>>,
    pub state: Option<Arc<FlushState>>,
    /// Journal a deferred truncation once the data is written (see the module doc).
    pub resolve: bool,
}

#[derive(Default)]
pub(super) struct FlushQueue {
    pub pending: Vec<FlushReq>,
    /// A batch job is queued on the flusher and has not taken `pending` yet.
    pub queued: bool,
}

/// A commit waiter that does not block a thread: completed by the committer.
pub(super) struct AsyncWaiter {
    pub tid: u64,
    pub gen: Option<u64>,
    pub state: Arc<FlushState>,
}

/// The asynchronous flushes of a batch being written: if the batch panics (the
/// flusher contains it, and the volume fails), each not settled yet fails with EIO on
/// the unwind instead of leaving its waiter waiting forever.
struct Unsettled(Vec<Arc<FlushState>>);

impl Drop for Unsettled {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for state in &self.0 {
                state.complete(Err(FsError::Io));
            }
        }
    }
}

impl Vol {
    /// Add a request to the next batch, queueing the batch job if none is pending. A
    /// batch job taken by the flusher leaves later requests to the next one, so
    /// requests arriving while a batch is written pile up and share the next batch.
    pub(super) fn queue_flush(self: &Arc<Self>, r: FlushReq) {
        let queue = {
            let mut fq = self.flushq.lock();
            fq.pending.push(r);
            !std::mem::replace(&mut fq.queued, true)
        };
        // Outside the queue's lock: with the flusher stopped, the job runs here.
        if queue {
            let w = Arc::downgrade(self);
            self.bdi.queue_job(Box::new(move || {
                if let Some(v) = w.upgrade() {
                    v.run_flush_batch();
                }
            }));
        }
    }

    /// The batch job (flusher thread): write every inode of the batch under one plug,
    /// wait for the IO, journal deferred truncations, and hand the asynchronous
    /// flushes to the committer.
    fn run_flush_batch(&self) {
        let batch = {
            let mut fq = self.flushq.lock();
            fq.queued = false;
            std::mem::take(&mut fq.pending)
        };
        if batch.is_empty() {
            return;
        }
        let _unsettled = Unsettled(batch.iter().filter_map(|r| r.state.clone()).collect());
        let mut seen = HashSet::new();
        let maps: Vec<(u64, Arc<Mapping>)> = batch
            .iter()
            .filter(|r| seen.insert(r.ino))
            .map(|r| (r.ino, r.mapping.clone()))
            .collect();
        let mut sub_err: HashMap<u64, BlkError> = HashMap::new();
        {
            // Seed 000 for integrity writeback: the batch's files are adjacent on disk
            // (delayed allocation at this pass), so their bios merge in the plug.
            let _plug = self.bdi.config().writeback_plug.then(Plug::start);
            for (ino, m) in &maps {
                let mut wbc = Wbc::sync_range(0, u64::MAX);
                if let Err(e) = m.writepages(&mut wbc) {
                    sub_err.insert(*ino, e);
                }
            }
        }
        for (ino, m) in &maps {
            m.wait_writeback(0, u64::MAX);
            if m.nr_dirty() == 0 {
                self.bdi.inode_maybe_clean(*ino);
            }
        }
        // A truncation that cannot be journaled (the volume failed) fails the flush
        // that asked for it: its promise was the truncated size.
        let mut resolve_err: HashMap<u64, FsError> = HashMap::new();
        // What each flush waits for, read in the same hold (one hold of `st` for the
        // batch, not one per file): after the writes and truncations it covers.
        let points: HashMap<u64, SyncPoint> = {
            let mut st = self.st.lock();
            for r in batch.iter().filter(|r| r.resolve || r.state.is_some()) {
                self.wait_truncations(&mut st, Some(r.ino));
            }
            for r in batch.iter().filter(|r| r.resolve) {
                if let Err(e) = self.resolve_trunc(&mut st, r.ino) {
                    resolve_err.insert(r.ino, e);
                }
            }
            batch
                .iter()
                .filter(|r| r.state.is_some())
                .map(|r| (r.ino, sync_point_of(&st, r.ino, false)))
                .collect()
        };
        let mut waiters = Vec::new();
        for r in batch {
            let (Some(state), Some(since)) = (r.state, r.since) else {
                continue;
            };
            let e = r.mapping.wb_err().check_and_advance(&mut since.lock());
            let res = match (sub_err.get(&r.ino), resolve_err.get(&r.ino)) {
                (Some(e), _) => Err(FsError::from(e.clone())),
                (None, Some(e)) => Err(e.clone()),
                (None, None) => errno_result(e),
            };
            if let Err(e) = res {
                state.complete(Err(e));
                continue;
            }
            let SyncPoint { tid, gen } = points[&r.ino];
            waiters.push(AsyncWaiter { tid, gen, state });
        }
        if !waiters.is_empty() {
            self.journal_wait_async(waiters);
        }
    }

    /// What an fsync of `ino` waits for: the transaction and the data barrier.
    pub(super) fn sync_point(&self, ino: u64, datasync: bool) -> SyncPoint {
        sync_point_of(&self.st.lock(), ino, datasync)
    }

    /// Journal a deferred truncation of `ino` with the extents written since (one
    /// transaction: old content or new, never in between).
    pub(super) fn resolve_trunc(&self, st: &mut State, ino: u64) -> FsResult<()> {
        let Some(l) = st.live.get_mut(&ino) else {
            return Ok(());
        };
        if !l.trunc_pending {
            return Ok(());
        }
        l.trunc_pending = false;
        let maps = std::mem::take(&mut l.deferred_maps);
        let size = std::mem::take(&mut l.deferred_size);
        let now = self.now();
        st.log(Record::Truncate { ino, size: 0 }, &[ino], now)?;
        for (fb, (start, len)) in maps {
            st.log(
                Record::MapExtent {
                    ino,
                    file_block: fb,
                    start,
                    len,
                },
                &[ino],
                now,
            )?;
        }
        if let Some(i) = st.meta.resident_mut(ino) {
            i.size = size;
        }
        st.txn_inodes.insert(ino);
        Ok(())
    }

    /// Resolve every deferred truncation (syncfs and unmount make everything durable).
    pub(super) fn resolve_all(&self) -> FsResult<()> {
        let mut st = self.st.lock();
        self.wait_truncations(&mut st, None);
        let inos: Vec<u64> = st
            .live
            .iter()
            .filter(|(_, l)| l.trunc_pending)
            .map(|(&i, _)| i)
            .collect();
        for ino in inos {
            self.resolve_trunc(&mut st, ino)?;
        }
        Ok(())
    }
}
