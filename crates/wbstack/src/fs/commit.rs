//! The committer: the thread that closes the running transaction and makes it durable
//! (group commit keyed to arrivals, periodic commit, checkpoints when the journal or
//! the changed inodes fill), and the waits of fsync and asynchronous flushes on it.
//! The journal's format, mkfs, mount and replay are `fs::journal`'s.

use super::checkpoint::alloc_nodes;
use super::checkpoint::root_record;
use super::error::{FsError, FsResult};
use super::format::{Checkpoint, Txn, BLOCK_SIZE, RING_VERSION, TREE_VERSION};
use super::metatree;
use super::volume::{JState, Vol, TID_WAIT_SLOTS};
use crate::block::{Bio, BioEndIo, BioFlags, BioWait, BlkResult};
use crate::buf::IoBuf;
use crate::clock::{NSEC_PER_MSEC, NSEC_PER_USEC};
use crate::trace;
use parking_lot::Condvar;
use serde_json::json;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

const PAGE: u64 = BLOCK_SIZE as u64;

fn sector(block: u64) -> u64 {
    block * (PAGE / 512)
}

pub(super) fn committer(weak: Weak<Vol>) {
    loop {
        let Some(vol) = weak.upgrade() else { return };
        if vol.guarded("commit", || vol.committer_step()) != Some(true) {
            return;
        }
    }
}

/// Inodes restated in one hold of `st` ahead of a transaction's close
/// (`Vol::restate_ahead`): about 2 ms of it.
const RESTATE_BATCH: usize = 4096;

/// What decides how many syncs a commit waits for (`group_to_wait_for`).
pub(super) struct GroupInputs {
    /// The commit will flush the cache first (PREFLUSH).
    pub flushes: bool,
    pub in_flight: usize,
    pub logbufs: usize,
    /// How many syncs the last batched commit carried.
    pub last_group: usize,
    /// How many threads wait on the journal as one more starts to (moving average,
    /// times 16: `JState::syncers_x16`).
    pub syncers_x16: u64,
}

/// How many syncs a commit that several threads wait for gathers before it leaves.
/// One that will flush the cache (PREFLUSH, the costly part, one per commit), or that
/// has no free log buffer (it waits anyway), waits for as many as the last group: the
/// fewer flushes the better. One without a flush is one FUA write, and the device
/// serves the writes in flight side by side: it leaves with half the threads that
/// sync, so two groups alternate, each gathering while the other's write is in
/// flight, instead of one group of all of them whose arrivals the device idles
/// through. Half, not one: every commit is a device IO, and a group of half keeps
/// the fsyncs per IO at half the threads.
pub(super) fn group_to_wait_for(g: &GroupInputs) -> usize {
    if g.flushes || g.in_flight >= writes_in_flight(g) {
        return g.last_group;
    }
    (g.syncers_x16.div_ceil(32) as usize).max(1)
}

/// How many journal writes may be in flight once this commit's is: `logbufs`, but at
/// most two for a commit that flushes the cache. Flushes are served one after the
/// other, so a third commit in flight adds no overlap, only splits the syncs into
/// more groups, each with its flush (8 threads of small ordered fsyncs on sim:ssd:
/// 17,727 commits with eight against 12,889 with two, and 15% fewer files/s).
pub(super) fn writes_in_flight(g: &GroupInputs) -> usize {
    if g.flushes {
        g.logbufs.min(2)
    } else {
        g.logbufs
    }
}

/// A background checkpoint for the checkpoint thread (`Vol::background_checkpoint`).
pub(super) struct CheckpointJob {
    capture: Option<metatree::Captured>,
    tid: u64,
    journal_pos: u64,
    t0_ns: u64,
}

/// The checkpoint thread: one per volume, started with the committer, so a checkpoint
/// costs no thread of its own. It ends when the volume drops its sender.
pub(super) fn checkpointer(weak: Weak<Vol>, jobs: std::sync::mpsc::Receiver<CheckpointJob>) {
    for job in jobs {
        let Some(vol) = weak.upgrade() else { return };
        let step = || vol.background_checkpoint(job.capture, job.tid, job.journal_pos, job.t0_ns);
        if vol.guarded("checkpoint", step).is_none() {
            return;
        }
    }
}

/// Join the thread in `slot`, unless it is the calling one (a volume may be stopped
/// from its own committer or checkpoint thread). Err if it panicked.
pub(super) fn join_thread(
    slot: &parking_lot::Mutex<Option<std::thread::JoinHandle<()>>>,
) -> std::thread::Result<()> {
    let Some(h) = slot.lock().take() else {
        return Ok(());
    };
    if h.thread().id() == std::thread::current().id() {
        return Ok(());
    }
    h.join()
}

/// A journal write in flight (`MountOptions::logbufs`): what finishing it records.
pub(super) struct CommitInFlight {
    what: Durable,
    write: Arc<CommitWrite>,
}

/// What a commit made durable, for the bookkeeping of `Vol::durable`.
struct Durable {
    tid: u64,
    /// The barrier generation of its PREFLUSH, if it carried one.
    gen: Option<u64>,
    bytes: u64,
    nrec: usize,
    t0_ns: u64,
}

/// The end of a journal write: collected as any waited-for bio's (`BioWait`), and
/// the committer woken to finish it.
struct CommitWrite {
    done: BioWait,
    committer: Arc<crate::clock::Waiter>,
}

impl BioEndIo for CommitWrite {
    fn end_io(&self, bio: Bio, status: BlkResult) {
        self.done.end_io(bio, status);
        self.committer.kick();
    }
}

impl JState {
    /// Threads blocked in fsync for a transaction not closed yet: the group the next
    /// commit carries.
    fn waiting_for_running(&self) -> usize {
        self.sync_waiting
            .range(self.closed + 1..)
            .map(|(_, n)| n)
            .sum()
    }
}

enum Payload {
    Txn(Txn),
    Checkpoint(CheckpointPayload),
}

enum CheckpointPayload {
    /// The whole metadata image (formats before the tree).
    Image(Vec<u8>),
    /// The changed keys' values, taken under `st` (or None: being taken copy-on-write,
    /// `fs::cowcapture`); their tree operations are built without it.
    Tree(Option<metatree::Captured>),
}

impl Vol {
    /// One decision of the committer; false when it must exit.
    fn committer_step(&self) -> bool {
        #[cfg(test)]
        if self.panic_next_commit.swap(false, Ordering::SeqCst) {
            panic!("a bug in the commit thread (test)");
        }
        // Journal writes that completed are finished first, oldest first: their
        // waiters are released before anything new is decided.
        self.finish_commits(usize::MAX);
        self.release_held();
        let now = self.now();
        let interval = self.opts.commit_interval_ms * NSEC_PER_MSEC;
        let (need_commit, need_barrier, force, stop, multi, avg, bg_busy) = {
            let j = self.jn.lock();
            if j.error.is_some() {
                return false;
            }
            (
                j.want_tid > j.closed,
                j.barrier_want > j.barrier_started,
                j.force_checkpoint,
                j.stop,
                j.multi_sync,
                j.avg_commit_ns,
                j.bg_ckpt_running,
            )
        };
        if stop {
            return false;
        }
        let (pending, first, full) = {
            let st = self.st.lock();
            (
                !st.txn.is_empty() || !st.txn_inodes.is_empty(),
                st.txn_first_ns,
                // Changed inodes past the limit call for a checkpoint: not another
                // while one is written (its end wakes this thread).
                st.txn_full() || (st.meta_full() && !bg_busy),
            )
        };
        let periodic = pending && (full || first.is_some_and(|t| now >= t + interval));
        if !(need_commit || need_barrier || force || periodic) {
            // Idle: journaled data held back for a batch goes home after a while.
            let home_due = {
                let mut st = self.st.lock();
                match st.jhome_first_ns {
                    Some(t) if now >= t + super::jdata::HOME_DELAY_NS => {
                        Some(self.take_home(&mut st))
                    }
                    Some(t) => {
                        drop(st);
                        let deadline = first.map_or(now + interval, |f| f + interval);
                        self.clock.wait_until(
                            &self.jwaiter,
                            deadline.min(t + super::jdata::HOME_DELAY_NS),
                        );
                        return true;
                    }
                    None => None,
                }
            };
            if let Some(home) = home_due {
                self.submit_home(home);
                return true;
            }
            let deadline = first.map_or(now + interval, |t| t + interval);
            self.clock.wait_until(&self.jwaiter, deadline);
            return true;
        }
        let group = self.group_inputs();
        if need_commit && multi && !force {
            // Batching (jbd2's purpose, keyed to arrivals): when several threads sync,
            // wait for a group (`group_to_wait_for`), at most the average commit
            // time (bounded by min/max_batch_time). Threads the last commit released
            // are still on their way (close, create, write its data) when a commit
            // could leave at once; waiting for them halves the commits.
            let group = group_to_wait_for(&group);
            let c = avg.clamp(
                self.opts.min_batch_us * NSEC_PER_USEC,
                self.opts.max_batch_us * NSEC_PER_USEC,
            );
            let deadline = self.now() + c;
            loop {
                {
                    let j = self.jn.lock();
                    if j.stop || j.waiting_for_running() >= group {
                        break;
                    }
                }
                if self.now() >= deadline {
                    break;
                }
                self.clock.wait_until(&self.jwaiter, deadline);
                // A write in flight that completed meanwhile releases its waiters now.
                self.finish_commits(usize::MAX);
            }
            let mut j = self.jn.lock();
            j.last_group = j.waiting_for_running().max(1);
        }
        if !need_commit && !force && !periodic {
            // Only a cache flush is wanted (fsync of data whose metadata is durable,
            // fdatasync after a timestamp change): issue it, leave the transaction open.
            // Barrier generations complete in order: the writes in flight finish first.
            self.finish_commits(0);
            self.barrier_only();
            return true;
        }
        // A free log buffer: at most `logbufs` journal writes in flight (two for one
        // that flushes the cache: `writes_in_flight`).
        self.finish_commits(writes_in_flight(&group) - 1);
        self.commit(force);
        true
    }

    /// Whether a journal write now must flush the cache first (PREFLUSH): asked for
    /// always (`commit_flush`), a write completed without FUA since the last flush was
    /// issued (`written`: `RequestQueue::volatile_writes`), or an fsync waits for a
    /// data barrier.
    fn flush_needed(&self, j: &JState, written: u64) -> bool {
        self.commit_flush_always.load(Ordering::Relaxed)
            || written != j.flushed_writes
            || j.barrier_want > j.barrier_started
    }

    /// What `group_to_wait_for` and `writes_in_flight` decide on, as of now.
    fn group_inputs(&self) -> GroupInputs {
        let j = self.jn.lock();
        GroupInputs {
            flushes: self.flush_needed(&j, self.q.volatile_writes()),
            in_flight: j.in_flight.len(),
            logbufs: self.logbufs.load(Ordering::Relaxed).max(1),
            last_group: j.last_group,
            syncers_x16: j.syncers_x16,
        }
    }

    /// Finish the journal writes in flight in order, waiting for the oldest while more
    /// than `keep` are in flight; stops at the first one still in flight after that.
    /// Finishing one makes its transaction committed and releases its waiters, so a
    /// transaction is never reported durable before every one before it is: replay
    /// stops at the first torn one, and a later one that landed first is not replayed.
    fn finish_commits(&self, keep: usize) {
        loop {
            let (write, in_flight) = {
                let j = self.jn.lock();
                match j.in_flight.front() {
                    Some(c) => (c.write.clone(), j.in_flight.len()),
                    None => return,
                }
            };
            if write.done.completed() == 0 && in_flight <= keep {
                return;
            }
            let (_, status) = write.done.wait_one();
            let c = self
                .jn
                .lock()
                .in_flight
                .pop_front()
                .expect("only the committer takes writes in flight");
            if let Err(e) = status {
                self.abort(format!("a journal write failed ({e})"));
                return;
            }
            self.durable(c.what, None);
        }
    }

    /// Transaction `d.tid` is durable (its journal write, or the checkpoint `ckpt`
    /// holding it, completed, and every one before it): release the blocks it freed
    /// once its home writes completed, make it committed, wake its waiters.
    fn durable(&self, d: Durable, ckpt: Option<(usize, u64)>) {
        // A home write must never land in a block another file got meanwhile: the
        // blocks this transaction freed are released once its home writes completed.
        self.wait_home(d.tid);
        let released = {
            let mut st = self.st.lock();
            // Not past a background checkpoint's transaction while it is written: its
            // nodes are allocated meanwhile, and must lie in blocks free in the state
            // it describes (`root_image` takes them from that state's free space).
            // `release_held` lets the rest go once it ends.
            let release_to = {
                let j = self.jn.lock();
                match j.bg_ckpt_running {
                    true => d.tid.min(j.bg_ckpt_tid),
                    false => d.tid,
                }
            };
            let r = st.meta.alloc.commit(release_to).map(|_| ());
            st.allocator_broken("releasing the blocks a commit freed", r);
            release_to
        };
        let took = self.now().saturating_sub(d.t0_ns);
        let mut j = self.jn.lock();
        let before = j.committed;
        debug_assert!(
            d.tid > j.committed && d.tid <= j.closed,
            "commit {} finished out of order (committed {}, closed {})",
            d.tid,
            j.committed,
            j.closed
        );
        j.committed = d.tid;
        if let Some((t, pos)) = j.tail_after_commit {
            if d.tid >= t {
                j.ring.checkpointed(pos);
                j.tail_after_commit = None;
            }
        }
        j.released = j.released.max(released);
        if let Some(g) = d.gen {
            debug_assert!(g > j.barrier_done, "barrier {g} finished out of order");
            j.barrier_done = g;
        }
        j.stats.bytes += d.bytes;
        match ckpt {
            Some((slot, seq)) => {
                debug_assert!(j.in_flight.is_empty(), "a checkpoint beside journal writes");
                debug_assert!(!j.bg_ckpt_running, "two checkpoints at once");
                j.ring.reset();
                j.tail_after_commit = None;
                j.sync_ckpts += 1;
                j.ckpt_slot = slot;
                j.ckpt_seq = seq;
                j.force_checkpoint = false;
                j.stats.checkpoints += 1;
                j.stats.checkpoint_ns += took;
            }
            None => j.stats.commits += 1,
        }
        j.avg_commit_ns = (took + 3 * j.avg_commit_ns) / 4;
        j.last_commit_ns = self.now();
        drop(j);
        self.wake_journal(Some(before + 1..=d.tid), d.gen.is_some());
        self.settle_async();
        let (tid, nrec, bytes, checkpoint) = (d.tid, d.nrec, d.bytes, ckpt.is_some());
        trace::emit(
            "jbd2_commit",
            || json!({"tid": tid, "records": nrec, "bytes": bytes, "checkpoint": checkpoint, "ns": took}),
        );
    }

    /// Release the blocks freed by transactions committed while a background checkpoint
    /// was written (`durable` held them back), once it has ended.
    fn release_held(&self) {
        let held = |j: &JState| !j.bg_ckpt_running && j.released < j.committed;
        // Asked at every turn of the committer: `st` only when there is work.
        if !held(&self.jn.lock()) {
            return;
        }
        let mut st = self.st.lock();
        let committed = {
            let j = self.jn.lock();
            if !held(&j) {
                return;
            }
            j.committed
        };
        let r = st.meta.alloc.commit(committed).map(|_| ());
        st.allocator_broken("releasing the blocks a commit freed", r);
        drop(st);
        self.jn.lock().released = committed;
        self.jcv.notify_all();
    }

    /// A bare cache flush for the data barrier waiters.
    fn barrier_only(&self) {
        let gen = {
            let mut j = self.jn.lock();
            j.barrier_started += 1;
            self.barrier_started
                .store(j.barrier_started, Ordering::Release);
            j.flushed_writes = self.q.volatile_writes();
            j.barrier_started
        };
        if let Err(e) = self.q.flush_sync() {
            self.abort(format!("a cache flush failed ({e})"));
            return;
        }
        let mut j = self.jn.lock();
        j.barrier_done = gen;
        j.stats.flushes += 1;
        drop(j);
        self.wake_journal(None, true);
        self.settle_async();
    }

    /// Restate the running transaction's changed inodes in batches of `RESTATE_BATCH`,
    /// each its own hold of `st`, until a batch's worth is left for the close: at
    /// -S0 a transaction changes 100,000 inodes and more, and restating them all in the
    /// close's one hold stopped every namespace operation for 30-70 ms. Bounded: the
    /// operations let in between keep adding changed inodes, at far less than a batch
    /// per batch.
    fn restate_ahead(&self) {
        let mut batches = None;
        loop {
            let mut st = self.st.lock();
            let left = st.txn_inodes.len();
            if left <= RESTATE_BATCH || st.aborted.is_some() {
                return;
            }
            let n = batches.get_or_insert(left / RESTATE_BATCH + 2);
            if *n == 0 {
                return;
            }
            *n -= 1;
            st.restate_some(RESTATE_BATCH);
        }
    }

    /// Close the running transaction and make it durable (a journal write, a
    /// checkpoint, or for an empty one a cache flush if someone needs one).
    fn commit(&self, force_ckpt: bool) {
        let t0 = self.now();
        // A background checkpoint in flight is waited for when the journal fills up to
        // it, and before a checkpoint of this commit's own (the slot is its).
        let wait_bg = {
            let j = self.jn.lock();
            j.bg_ckpt_running && (force_ckpt || j.ring.must_wait())
        };
        if wait_bg {
            self.jn.lock().stats.checkpoint_waits += 1;
            self.wait_background_checkpoint();
        }
        self.restate_ahead();
        let (tid, payload, nrec, home, covered, bg_capture) = loop {
            let (ring, bg_busy, jblocks) = {
                let j = self.jn.lock();
                (j.ring, j.bg_ckpt_running, self.sb.journal_blocks)
            };
            let mut st = self.st.lock();
            // Ordered data (rename over an existing file): the transaction holding the
            // rename waits for the renamed file's data, so it cannot reach the disk
            // first. Writeback of that data was started at the rename.
            let mut kicked = std::collections::HashSet::new();
            loop {
                let running = st.running_tid;
                let ordered = std::mem::take(&mut st.ordered);
                let mut keep = Vec::with_capacity(ordered.len());
                for o in ordered {
                    if o.tid > running || !o.satisfied(&st) {
                        keep.push(o);
                        continue;
                    }
                    // Its data is written; a truncation to zero deferred at its open
                    // (new data in `deferred_maps`, the old extents still the file's)
                    // lands here, in the rename's transaction, not when the flusher
                    // gets to it: else the rename could commit over the file's
                    // pre-truncation content.
                    if let Err(e) = self.resolve_trunc(&mut st, o.ino) {
                        if st.aborted.is_none() {
                            st.aborted = Some(format!("a renamed file's truncation: {e}"));
                        }
                    }
                }
                st.ordered = keep;
                if !st.ordered.iter().any(|o| o.tid <= running) || st.aborted.is_some() {
                    break;
                }
                if self.jn.lock().stop {
                    break;
                }
                // Before waiting: journaled data held back goes home. A thread that
                // found none held back an instant before it was (claimed, not yet
                // logged) sleeps on those pages, and may be what this wait needs (a
                // sync pass of the flusher writing the ordered data).
                if !st.jhome.is_empty() {
                    let home = self.take_home(&mut st);
                    crate::spin::SpinGuard::unlocked(&mut st, || self.submit_home(home));
                    continue;
                }
                // And the journal writes in flight finish: what the ordered data's
                // writeback may wait for (blocks those commits free) does not wait
                // behind this wait.
                if !self.jn.lock().in_flight.is_empty() {
                    crate::spin::SpinGuard::unlocked(&mut st, || self.finish_commits(0));
                    continue;
                }
                let timed_out = crate::spin::SpinGuard::wait_for(
                    &mut st,
                    &self.ordered_cv,
                    std::time::Duration::from_millis(100),
                )
                .timed_out();
                if timed_out {
                    // As jbd2 submits an ordered inode's data itself: data the rename
                    // started writing may have been redirtied, truncated and rewritten
                    // since, with nothing left to write it before kupdate expires it.
                    let running = st.running_tid;
                    let waiting: Vec<u64> = st
                        .ordered
                        .iter()
                        .filter(|o| o.tid <= running && !o.satisfied(&st))
                        .map(|o| o.ino)
                        .filter(|ino| kicked.insert(*ino))
                        .collect();
                    let maps: Vec<_> = waiting
                        .into_iter()
                        .filter_map(|ino| self.icache.lock().get(&ino).cloned())
                        .collect();
                    // Without `st`: a job queued once the flusher stopped runs on the
                    // queueing thread, and writing pages takes `st`.
                    crate::spin::SpinGuard::unlocked(&mut st, || {
                        for m in maps {
                            self.bdi.queue_job(Box::new(move || {
                                // Errors reach fsync through the mapping's errseq.
                                let _reported_later = m.write_and_wait_keep_errors(0, u64::MAX);
                            }));
                        }
                    });
                }
            }
            if let Some(why) = st.aborted.clone() {
                drop(st);
                // Stopped under `st` alone (`State::allocator_broken`, which cannot
                // take the journal's lock there): the journal fails now, so every
                // waiter hears of it instead of waiting for a commit that never comes.
                if self.jn.lock().error.is_none() {
                    self.abort(why);
                }
                return;
            }
            let close_t0 = self.now();
            // Decided before restating: a checkpoint's transaction needs no restated
            // records, and the bound covers the ones a journal write carries.
            let restated_max = Txn::len_of_body(st.txn_bytes + st.restate_max_bytes());
            let max_blocks = (restated_max as u64).div_ceil(PAGE);
            // Background checkpoints need a journal a version 5 binary would not misread.
            let tree = self.sb.version >= RING_VERSION;
            // In place of a commit (the committer waits for it): asked for, no room in
            // the journal, or a format without background checkpoints. In the
            // background (`fs::jspace`): the journal half full or the changed inodes
            // at their limit, and none in flight.
            let ckpt = force_ckpt
                || ring.place(max_blocks).is_none()
                || (!tree && (ring.used() + max_blocks > jblocks * 3 / 4 || st.meta_full()));
            if ckpt && bg_busy {
                // Known only once the transaction's size is: the next turn finds no
                // checkpoint in flight (only this thread starts one).
                drop(st);
                self.jn.lock().stats.checkpoint_waits += 1;
                self.wait_background_checkpoint();
                continue;
            }
            let bg =
                !ckpt && tree && !bg_busy && (ring.background_due(max_blocks) || st.meta_full());
            st.restate(!ckpt);
            self.prune_meta(&mut st);
            let records = std::mem::take(&mut st.txn);
            st.txn_bytes = 0;
            let tid = st.running_tid;
            st.txn_jdata_pages = 0;
            st.running_tid += 1;
            st.txn_first_ns = None;
            let nrec = records.len();
            // Written even when empty: closing a transaction consumes its tid, and
            // replay needs every tid in sequence (a gap would end the journal there).
            // Encoded (and its records freed) after `st` is dropped: a transaction
            // is up to a quarter of the journal, and every namespace operation waits
            // while `st` is held.
            let txn = Txn {
                fs_id: self.sb.fs_id,
                tid,
                records,
            };
            debug_assert!(
                ckpt || txn.encoded_len() <= restated_max,
                "transaction {tid} outgrew its bound ({} > {restated_max} bytes)",
                txn.encoded_len()
            );
            // Journaled data waiting for its home write goes now when the journal is
            // about to start over, when this transaction frees blocks (released below
            // once every home write up to it completed), or when enough has gathered
            // (`jdata::HOME_BATCH`); else it waits for later commits, to go home in
            // fewer, larger writes.
            let home = if ckpt
                || bg
                || st.meta.alloc.deferred_blocks() > 0
                || st.jhome.len() >= super::jdata::HOME_BATCH
            {
                self.take_home(&mut st)
            } else {
                super::jdata::TakenHome::default()
            };
            let (payload, covered, bg_capture) = if ckpt {
                // The journal is about to start over: no copy in it is replayed again.
                debug_assert!(st.jhome.is_empty());
                st.jblocks.clear();
                // The checkpoint holds the transaction's state; its records are not
                // written (and are freed once `st` is dropped).
                let covered = Some(txn);
                if self.sb.version >= TREE_VERSION {
                    let changes = st.meta.take_checkpoint_changes();
                    st.refresh_meta_pending();
                    (
                        Payload::Checkpoint(CheckpointPayload::Tree(
                            st.meta.begin_capture(changes),
                        )),
                        covered,
                        None,
                    )
                } else {
                    (
                        Payload::Checkpoint(CheckpointPayload::Image(st.meta.encode_image())),
                        covered,
                        None,
                    )
                }
            } else if bg {
                // The state as of this transaction, which is journaled as any other:
                // until the checkpoint is durable, replay goes through it.
                let changes = st.meta.take_checkpoint_changes();
                st.refresh_meta_pending();
                (
                    Payload::Txn(txn),
                    None,
                    Some(st.meta.begin_capture(changes)),
                )
            } else {
                (Payload::Txn(txn), None, None)
            };
            {
                let held_ns = self.now().saturating_sub(close_t0);
                let mut j = self.jn.lock();
                j.stats.commit_close_max_ns = j.stats.commit_close_max_ns.max(held_ns);
                if ckpt || bg {
                    j.stats.checkpoint_close_ns += held_ns;
                    j.stats.checkpoint_close_max_ns = j.stats.checkpoint_close_max_ns.max(held_ns);
                }
            }
            break (tid, payload, nrec, home, covered, bg_capture);
        };
        drop(covered);
        self.submit_home(home);
        // A commit write carries PREFLUSH, and is then a cache-flush barrier too,
        // unless nothing needs one: no write completed without FUA since the last
        // flush was issued (read after the transaction closed, so every write whose
        // completion it records is counted), no fsync waits for a data barrier, and it
        // is no checkpoint. Its FUA write is then durable after everything before it.
        let gen = {
            let mut j = self.jn.lock();
            debug_assert!(tid > j.closed, "transaction {tid} closed twice");
            j.closed = tid;
            let written = self.q.volatile_writes();
            let needed = !matches!(payload, Payload::Txn(_)) || self.flush_needed(&j, written);
            if needed {
                j.barrier_started += 1;
                self.barrier_started
                    .store(j.barrier_started, Ordering::Release);
                j.flushed_writes = written;
                Some(j.barrier_started)
            } else {
                j.stats.commits_without_flush += 1;
                None
            }
        };
        let flags = match gen {
            Some(_) => BioFlags::PREFLUSH | BioFlags::FUA | BioFlags::META,
            None => BioFlags::FUA | BioFlags::META,
        };
        let checkpoint = match payload {
            Payload::Txn(txn) => {
                // Written without waiting: the committer may close and write the next
                // transaction while this one is in flight (`finish_commits`).
                let e = txn.encode();
                drop(txn);
                let bytes = e.len() as u64;
                let len = bytes / PAGE;
                // Only this thread moves the head, and the tail only moves up: what
                // was placed at the close still fits.
                let Some(pos) = self.jn.lock().ring.place(len) else {
                    self.abort(format!(
                        "transaction {tid} ({len} blocks) has no room in the journal"
                    ));
                    return;
                };
                let write = Arc::new(CommitWrite {
                    done: BioWait::default(),
                    committer: self.jwaiter.clone(),
                });
                let bio = Bio::write(sector(self.sb.journal_start + pos), IoBuf::from_slice(&e))
                    .with_flags(flags)
                    .with_end_io(write.clone());
                if let Err(e) = self.q.submit_bio(bio) {
                    // Refused before it was queued (it never completes).
                    self.abort(format!("a journal write was refused ({e})"));
                    return;
                }
                // Recorded after the submission: only this thread finishes writes in
                // flight, and a completion meanwhile waits in `write.done`.
                let mut j = self.jn.lock();
                if pos < j.ring.head {
                    j.stats.journal_wraps += 1;
                }
                j.ring.advance(pos, len);
                if !j.in_flight.is_empty() {
                    j.stats.commits_overlapped += 1;
                }
                j.in_flight.push_back(CommitInFlight {
                    what: Durable {
                        tid,
                        gen,
                        bytes,
                        nrec,
                        t0_ns: t0,
                    },
                    write,
                });
                if let Some(capture) = bg_capture {
                    // Replay of the checkpoint starts where the next transaction goes.
                    let journal_pos = j.ring.head;
                    j.bg_ckpt_running = true;
                    j.bg_ckpt_tid = tid;
                    drop(j);
                    self.start_background_checkpoint(capture, tid, journal_pos, t0);
                }
                return;
            }
            Payload::Checkpoint(c) => c,
        };
        // A checkpoint forgets the journal: every write in it completes first, and
        // the transactions they carry are committed before this one.
        self.finish_commits(0);
        // A journal error came with `abort` or `stop_threads`, which gave up any capture.
        if self.jn.lock().error.is_some() {
            return;
        }
        let (res, bytes, new_slot) = match checkpoint {
            CheckpointPayload::Image(image) => {
                // The checkpoint forgets the journal, and with it the only durable copy
                // of journaled data not yet home: its home writes complete first (the
                // checkpoint's PREFLUSH makes them durable before the checkpoint is).
                self.wait_home(tid);
                let (slot, seq) = {
                    let j = self.jn.lock();
                    (1 - j.ckpt_slot, j.ckpt_seq + 1)
                };
                let enc = Checkpoint {
                    fs_id: self.sb.fs_id,
                    seq,
                    tid,
                    journal_pos: 0,
                    image,
                }
                .encode();
                let n = enc.len() as u64;
                let r = if n > self.sb.checkpoint[slot].1 * PAGE {
                    Err(FsError::NoSpace)
                } else {
                    self.q
                        .write_sync(
                            sector(self.sb.checkpoint[slot].0),
                            IoBuf::from_slice(&enc),
                            flags,
                        )
                        .map_err(FsError::from)
                };
                (r, n, (slot, seq))
            }
            CheckpointPayload::Tree(captured) => {
                // As above: journaled data home first.
                self.wait_home(tid);
                let (slot, seq) = {
                    let j = self.jn.lock();
                    (1 - j.ckpt_slot, j.ckpt_seq + 1)
                };
                match self.write_checkpoint(captured, tid, slot, seq, flags, 0) {
                    Ok(n) => (Ok(()), n, (slot, seq)),
                    Err(e) => (Err(e), 0, (slot, seq)),
                }
            }
        };
        if let Err(e) = res {
            self.abort(format!("a checkpoint write failed ({e})"));
            return;
        }
        self.durable(
            Durable {
                tid,
                gen,
                bytes,
                nrec,
                t0_ns: t0,
            },
            Some(new_slot),
        );
    }

    /// Steps 2 to 4 of a checkpoint (`fs::checkpoint`) of the state as of `tid`,
    /// whose replay starts at journal block `journal_pos`; returns the bytes written.
    fn write_checkpoint(
        &self,
        changes: Option<metatree::Captured>,
        tid: u64,
        slot: usize,
        seq: u64,
        flags: BioFlags,
        journal_pos: u64,
    ) -> FsResult<u64> {
        // Lock order: the tree, then `st` (taken for a batch of the capture and for the
        // nodes' blocks).
        let mut guard = self.tree.lock();
        let mut changes = match changes {
            Some(c) => c,
            None => self.finish_capture()?,
        };
        let Some(mt) = guard.as_mut() else {
            return Err(FsError::Corrupt("a tree checkpoint without a tree".into()));
        };
        let gen = changes.gen;
        let space = changes.space.take();
        let w = mt.write(changes, seq, &mut |goal, n| {
            alloc_nodes(&mut self.st.lock().meta, goal, n)
        });
        {
            let mut st = self.st.lock();
            st.meta.checkpoint_nodes_taken(gen);
            st.refresh_meta_pending();
        }
        let w = w?;
        let data = self.sb.data_start..self.sb.nr_blocks;
        let enc = root_record(self.sb.fs_id, seq, tid, journal_pos, &w, space, data)?;
        // A failed or stopped volume writes no root: after a crash (`Volume::crash`)
        // the device holds what it held.
        if let Some(e) = self.jn.lock().error.clone() {
            return Err(FsError::ReadOnly(e));
        }
        self.q.write_sync(
            sector(self.sb.checkpoint[slot].0),
            IoBuf::from_slice(&enc),
            flags,
        )?;
        mt.release(&mut self.st.lock().meta, &w, gen)?;
        Ok(w.bytes + enc.len() as u64)
    }

    /// Hand the checkpoint of the state as of transaction `tid` (closed, its journal
    /// write submitted) to the checkpoint thread, while commits go on (`fs::jspace`).
    fn start_background_checkpoint(
        &self,
        capture: Option<metatree::Captured>,
        tid: u64,
        journal_pos: u64,
        t0: u64,
    ) {
        let job = CheckpointJob {
            capture,
            tid,
            journal_pos,
            t0_ns: t0,
        };
        let sent = match &*self.ckpt_tx.lock() {
            Some(tx) => tx.send(job).is_ok(),
            None => false,
        };
        if !sent {
            // Only a stopped volume has no checkpoint thread.
            self.jn.lock().bg_ckpt_running = false;
            self.abort("the checkpoint thread has stopped".into());
        }
    }

    /// The background checkpoint's thread: journaled data up to `tid` home, the tree
    /// and root written, then the tail moves up to `journal_pos`.
    fn background_checkpoint(
        &self,
        capture: Option<metatree::Captured>,
        tid: u64,
        journal_pos: u64,
        t0: u64,
    ) {
        // Replay will not see the journaled copies up to `tid` again: they are home
        // first (the root's PREFLUSH makes them durable before it).
        self.wait_home(tid);
        let (slot, seq) = {
            let j = self.jn.lock();
            (1 - j.ckpt_slot, j.ckpt_seq + 1)
        };
        let flags = BioFlags::PREFLUSH | BioFlags::FUA | BioFlags::META;
        let r = self.write_checkpoint(capture, tid, slot, seq, flags, journal_pos);
        match r {
            Ok(bytes) => {
                // Copies in transactions up to `tid` are never replayed again: a
                // write over their blocks needs no revoke.
                self.st.lock().jblocks.retain(|_, t| *t > tid);
                let took = self.now().saturating_sub(t0);
                let mut j = self.jn.lock();
                debug_assert!(j.bg_ckpt_running, "a background checkpoint not recorded");
                if j.committed >= tid {
                    j.ring.checkpointed(journal_pos);
                } else {
                    // Its own commit write may still be in flight (the checkpoint was
                    // taken at its close): `durable` moves the tail once it completed.
                    // A newer one waiting replaces an older: it covers more.
                    j.tail_after_commit = Some((tid, journal_pos));
                }
                j.ckpt_slot = slot;
                j.ckpt_seq = seq;
                j.bg_ckpt_running = false;
                j.stats.checkpoints += 1;
                j.stats.checkpoints_background += 1;
                j.stats.checkpoint_ns += took;
                j.stats.bytes += bytes;
            }
            Err(e) => {
                self.jn.lock().bg_ckpt_running = false;
                self.abort(format!("a checkpoint write failed ({e})"));
            }
        }
        self.jcv.notify_all();
        self.jwaiter.kick();
    }

    /// Wait for the background checkpoint in flight, if any, to end.
    pub(super) fn wait_background_checkpoint(&self) {
        let mut j = self.jn.lock();
        while j.bg_ckpt_running {
            // Bounded: a checkpoint thread that died mid-write never clears the flag.
            let timed_out = self
                .jcv
                .wait_for(&mut j, std::time::Duration::from_millis(100))
                .timed_out();
            let dead = || self.bg_ckpt.lock().as_ref().is_none_or(|h| h.is_finished());
            if timed_out && j.bg_ckpt_running && dead() {
                j.bg_ckpt_running = false;
                drop(j);
                self.abort("the checkpoint thread stopped in a checkpoint".into());
                return;
            }
        }
    }

    /// Copy out the rest of a checkpoint's capture (`fs::cowcapture`), a batch per
    /// hold of `st`, while operations go on.
    fn finish_capture(&self) -> FsResult<metatree::Captured> {
        // The list of the inodes to copy, made without `st`.
        let changes = self.st.lock().meta.capture_changes();
        if let Some((gen, changes)) = changes {
            let inodes = metatree::changed_inodes(&changes);
            drop(changes);
            self.st.lock().meta.capture_set_inodes(gen, inodes);
        }
        loop {
            let mut st = self.st.lock();
            if st.meta.capture_step(super::cowcapture::CAPTURE_BATCH) {
                return st.meta.take_capture().map(|p| p.finish()).ok_or_else(|| {
                    // Only a failed volume gives a capture up (`abort`, `stop_threads`).
                    FsError::ReadOnly(
                        st.aborted
                            .clone()
                            .unwrap_or_else(|| "a checkpoint's capture was given up".into()),
                    )
                });
            }
        }
    }

    /// One step `f` of the volume's `which` thread; None if it panicked (a bug). The
    /// volume then fails as on a journal error, read-only with the panic's message, so
    /// every fsync, sync and unmount waiting on that thread hears EIO instead of
    /// waiting forever for it, and the thread must end.
    pub(super) fn guarded<R>(&self, which: &str, f: impl FnOnce() -> R) -> Option<R> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
            .map_err(|p| {
                let msg = crate::panic_message(p.as_ref());
                self.abort(format!("the {which} thread panicked: {msg}"));
            })
            .ok()
    }

    /// A panic the flusher contained (in this filesystem's writepages or flush batch,
    /// say) fails the volume as a panic of its own threads does: the code that
    /// panicked may have left the volume's state half changed.
    pub(super) fn hear_flusher_panics(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        self.bdi.set_panic_hook(Arc::new(move |what: &str| {
            if let Some(vol) = weak.upgrade() {
                vol.abort(format!("the flusher thread: {what}"));
            }
        }));
    }

    pub(super) fn abort(&self, why: String) {
        self.sb_err.set(libc::EIO);
        // The first failure is the one to report: what fails after it (a checkpoint
        // whose capture it gave up, say) follows from it.
        {
            let mut st = self.st.lock();
            st.aborted.get_or_insert_with(|| why.clone());
            // A checkpoint copying out its changes will not be written.
            drop(st.meta.take_capture());
        }
        self.jn.lock().error.get_or_insert(why);
        self.wake_journal_all();
        self.settle_async();
        self.fail_home();
    }

    /// Register asynchronous flushes with the committer: each completes (Ok) with the
    /// commit and barrier that cover it, or with EIO if the journal fails first.
    pub(super) fn journal_wait_async(&self, waiters: Vec<super::flush::AsyncWaiter>) {
        let mut done = Vec::new();
        {
            let mut j = self.jn.lock();
            for w in waiters {
                if j.error.is_some() {
                    done.push((w, Err(FsError::Io)));
                    continue;
                }
                if j.committed >= w.tid && w.gen.is_none_or(|g| j.barrier_done > g) {
                    done.push((w, Ok(())));
                    continue;
                }
                if w.tid > j.committed {
                    j.want_tid = j.want_tid.max(w.tid);
                }
                if let Some(g) = w.gen {
                    if j.barrier_done <= g {
                        j.barrier_want = j.barrier_want.max(g + 1);
                    }
                }
                j.stats.sync_waits += 1;
                j.async_waiters.push(w);
            }
        }
        for (w, r) in done {
            w.state.complete(r);
        }
        self.jwaiter.kick();
    }

    /// Wake the journal's waiters after transactions `durable` became durable (None:
    /// none did) and, with `barrier`, a cache flush finished: fsync's waiters of those
    /// transactions, and those whose transaction was durable already but who wait for
    /// a flush. The waiters of the next transaction in flight sleep on.
    pub(super) fn wake_journal(
        &self,
        durable: Option<std::ops::RangeInclusive<u64>>,
        barrier: bool,
    ) {
        self.jcv.notify_all();
        let mut woken = 0;
        if barrier {
            woken += self.barrier_cv.notify_all();
        }
        match durable {
            Some(tids) if tids.end() - tids.start() >= TID_WAIT_SLOTS as u64 => {
                woken += self.wake_every_tid();
            }
            Some(tids) => {
                for tid in tids {
                    woken += self.tid_cv[tid as usize % TID_WAIT_SLOTS].notify_all();
                }
            }
            None => {}
        }
        if woken > 0 {
            self.jn.lock().stats.sync_woken += woken as u64;
        }
    }

    /// Wake every waiter on the journal (it failed, or stops).
    pub(super) fn wake_journal_all(&self) {
        self.jcv.notify_all();
        self.barrier_cv.notify_all();
        self.wake_every_tid();
    }

    /// Wake the fsync waiters of every transaction; how many were woken.
    fn wake_every_tid(&self) -> usize {
        self.tid_cv.iter().map(Condvar::notify_all).sum()
    }

    /// Complete the asynchronous flushes a commit (or a failure) has settled.
    pub(super) fn settle_async(&self) {
        let settled: Vec<(super::flush::AsyncWaiter, FsResult<()>)> = {
            let mut j = self.jn.lock();
            let failed = j.error.is_some();
            let (committed, done) = (j.committed, j.barrier_done);
            let all = std::mem::take(&mut j.async_waiters);
            let (ready, wait): (Vec<_>, Vec<_>) = all
                .into_iter()
                .partition(|w| failed || (committed >= w.tid && w.gen.is_none_or(|g| done > g)));
            j.async_waiters = wait;
            ready
                .into_iter()
                .map(|w| (w, if failed { Err(FsError::Io) } else { Ok(()) }))
                .collect()
        };
        for (w, r) in settled {
            w.state.complete(r);
        }
    }

    /// Wait until transaction `tid` is durable and, with `data_gen`, a cache flush that
    /// started after that generation completed (the data written before it is durable).
    pub(super) fn journal_wait(&self, tid: u64, data_gen: Option<u64>) -> FsResult<()> {
        let mut j = self.jn.lock();
        let me = std::thread::current().id();
        let mut asked = false;
        if tid > j.committed {
            j.want_tid = j.want_tid.max(tid);
            asked = true;
        }
        if let Some(g) = data_gen {
            if j.barrier_done <= g {
                j.barrier_want = j.barrier_want.max(g + 1);
                asked = true;
            }
        }
        if asked {
            j.multi_sync = j.last_sync_thread.is_some_and(|t| t != me);
            j.last_sync_thread = Some(me);
            // This one and those already waiting (`group_to_wait_for`).
            let syncers = j.sync_waiting.values().sum::<usize>() as u64 + 1;
            j.syncers_x16 = (j.syncers_x16 * 7 + syncers * 16) / 8;
            j.stats.sync_waits += 1;
            *j.sync_waiting.entry(tid).or_default() += 1;
            self.jwaiter.kick();
        }
        let r = loop {
            if j.error.is_some() {
                break Err(FsError::Io);
            }
            if j.committed >= tid && data_gen.is_none_or(|g| j.barrier_done > g) {
                break Ok(());
            }
            if j.committed >= tid {
                self.barrier_cv.wait(&mut j);
            } else {
                self.tid_cv[tid as usize % TID_WAIT_SLOTS].wait(&mut j);
            }
        };
        if asked {
            let n = j
                .sync_waiting
                .get_mut(&tid)
                .expect("a waiter counted when it asked");
            *n -= 1;
            if *n == 0 {
                j.sync_waiting.remove(&tid);
            }
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::{group_to_wait_for, writes_in_flight, GroupInputs};

    fn inputs(flushes: bool, in_flight: usize, syncers: u64) -> GroupInputs {
        GroupInputs {
            flushes,
            in_flight,
            logbufs: 8,
            last_group: 8,
            syncers_x16: syncers * 16,
        }
    }

    #[test]
    fn a_commit_without_a_flush_gathers_half_the_syncing_threads() {
        // Eight threads sync: a FUA-only commit with a free log buffer takes four.
        assert_eq!(group_to_wait_for(&inputs(false, 0, 8)), 4);
        assert_eq!(group_to_wait_for(&inputs(false, 7, 7)), 4);
        // Two or one: it leaves with the first.
        assert_eq!(group_to_wait_for(&inputs(false, 1, 2)), 1);
        assert_eq!(group_to_wait_for(&inputs(false, 0, 0)), 1);
        // It flushes the cache, or every log buffer is busy: the last group.
        assert_eq!(group_to_wait_for(&inputs(true, 0, 8)), 8);
        assert_eq!(group_to_wait_for(&inputs(false, 8, 8)), 8);
        assert_eq!(group_to_wait_for(&inputs(true, 2, 8)), 8);
    }

    #[test]
    fn a_commit_that_flushes_has_at_most_one_write_in_flight_beside_it() {
        assert_eq!(writes_in_flight(&inputs(false, 0, 8)), 8);
        assert_eq!(writes_in_flight(&inputs(true, 0, 8)), 2);
        let one = GroupInputs {
            logbufs: 1,
            ..inputs(true, 0, 8)
        };
        assert_eq!(writes_in_flight(&one), 1);
    }
}

#[cfg(test)]
mod abort_tests {
    use crate::fs::volume::test_volume;
    use crate::testfs::within_a_minute;

    /// The volume stopped under `st` alone (what `State::allocator_broken` leaves: it
    /// cannot take the journal's lock there): the next commit fails the journal, so a
    /// syncfs returns an error instead of waiting for a commit that never comes.
    #[test]
    fn a_volume_stopped_under_st_alone_fails_syncfs_instead_of_hanging_it() {
        let v = std::sync::Arc::new(test_volume(|_| {}));
        let f = v.create("/f").unwrap();
        f.write_at(0, b"data").unwrap();
        v.vol.st.lock().aborted = Some("allocator: a test's broken free".into());
        let v2 = v.clone();
        let r = within_a_minute("syncfs after the volume stopped", move || v2.sync());
        assert!(r.is_err(), "{r:?}");
        assert!(f.fsync().is_err());
        drop(f);
        assert!(std::sync::Arc::try_unwrap(v).is_ok_and(|v| v.unmount().is_err()));
    }

    /// A bug that panics the commit thread fails the volume (read-only, the panic's
    /// message as the reason): the fsync waiting for that thread hears EIO, the next
    /// change is refused, and unmount returns, instead of each waiting forever.
    #[test]
    fn a_panicking_commit_thread_fails_the_volume_instead_of_hanging_it() {
        let v = std::sync::Arc::new(test_volume(|_| {}));
        let f = std::sync::Arc::new(v.create("/f").unwrap());
        f.write_at(0, b"data").unwrap();
        v.vol
            .panic_next_commit
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let f2 = f.clone();
        let r = within_a_minute("fsync after the commit thread panicked", move || f2.fsync());
        assert_eq!(r, Err(crate::fs::FsError::Io));
        let why = v.vol.st.lock().aborted.clone();
        assert!(
            why.as_deref()
                .is_some_and(|w| w.contains("the commit thread panicked: a bug")),
            "{why:?}"
        );
        assert!(
            v.create("/g").is_err(),
            "a change accepted after the failure"
        );
        drop(f);
        assert!(std::sync::Arc::try_unwrap(v).is_ok_and(|v| v.unmount().is_err()));
    }

    /// A thread that panics holding `st` (a bug in the middle of a change) fails the
    /// volume: a create is refused, an fsync hears an error instead of a commit of a
    /// half-made change, and unmount returns an error, each without waiting forever.
    #[test]
    fn a_panic_holding_the_state_lock_fails_the_volume() {
        let v = std::sync::Arc::new(test_volume(|_| {}));
        let f = std::sync::Arc::new(v.create("/f").unwrap());
        f.write_at(0, b"data").unwrap();
        let v2 = v.clone();
        let r = std::thread::spawn(move || {
            let _st = v2.vol.st.lock();
            panic!("a bug under st (test)");
        })
        .join();
        assert!(r.is_err(), "the thread did not panic");
        let why = v.vol.st.lock().aborted.clone();
        assert!(
            why.as_deref()
                .is_some_and(|w| w.contains("panicked holding the volume's state")),
            "{why:?}"
        );
        assert!(v.create("/g").is_err(), "a change accepted after the panic");
        let f2 = f.clone();
        let r = within_a_minute("an fsync after a panic under st", move || f2.fsync());
        assert!(r.is_err(), "{r:?}");
        drop(f);
        assert!(std::sync::Arc::try_unwrap(v).is_ok_and(|v| v.unmount().is_err()));
    }

    /// A bug that panics writeback's map_write in the flusher thread (an asynchronous
    /// flush's batch) fails the volume as a panic of its own threads does: the flush
    /// hears EIO instead of waiting forever, the reason names the flusher and the
    /// panic, a change is refused, and unmount returns. The flusher itself goes on.
    #[test]
    fn a_panic_in_the_flushers_writeback_fails_the_volume_instead_of_hanging_it() {
        let v = std::sync::Arc::new(test_volume(|_| {}));
        let f = v.create("/f").unwrap();
        f.write_at(0, b"data").unwrap();
        v.vol
            .panic_next_map_write
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let flush = f.flush_async().unwrap();
        let r = within_a_minute("an async flush after writeback panicked", move || {
            flush.wait()
        });
        assert_eq!(r, Err(crate::fs::FsError::Io));
        // The flush failed in the unwind, before the flusher caught the panic and
        // failed the volume.
        let v2 = v.clone();
        let why = within_a_minute("the volume failed", move || loop {
            if let Some(why) = v2.vol.st.lock().aborted.clone() {
                return Some(why);
            }
            std::thread::yield_now();
        });
        assert_eq!(v.vol.bdi.panics(), 1);
        // The flush's batch job met the panic, or a periodic pass that wrote the
        // file first.
        assert!(
            why.as_deref()
                .is_some_and(|w| w.starts_with("the flusher thread: ")
                    && w.ends_with("panicked: a bug in map_write (test)")),
            "{why:?}"
        );
        assert!(
            v.create("/g").is_err(),
            "a change accepted after the failure"
        );
        assert_eq!(v.vol.bdi.nr_writeback(), 0);
        drop(f);
        assert!(std::sync::Arc::try_unwrap(v).is_ok_and(|v| v.unmount().is_err()));
    }
}

#[cfg(test)]
mod restate_tests {
    use super::RESTATE_BATCH;
    use crate::block::{QueueConfig, RequestQueue};
    use crate::fs::format::Record;
    use crate::fs::mkfs::MkfsOptions;
    use crate::fs::volume::SetAttr;
    use crate::fs::{MountOptions, Volume};

    fn quiet() -> MountOptions {
        let mut o = MountOptions::default();
        o.wb.dirty_writeback_centisecs = 0;
        o.commit_interval_ms = 3_600_000;
        o
    }

    /// A transaction restated ahead of its close, in batches (`restate_ahead`), leaves
    /// at most a batch to the close, and an inode changed again after its batch is
    /// restated again at the close: after a crash, replay of the journal alone (no
    /// checkpoint in between) gives every file the mode it had last. The modes are
    /// carried by restated records only (a chmod changes the inode in place).
    #[test]
    fn inodes_restated_ahead_of_the_close_and_changed_again_replay_their_last_attributes() {
        let q = RequestQueue::open("sim:ssd,size=1G", QueueConfig::default()).unwrap();
        Volume::mkfs(&q, &MkfsOptions::default()).unwrap();
        let v = Volume::mount(q.clone(), quiet()).unwrap();
        let n = 3 * RESTATE_BATCH + 100;
        let chmod = |v: &Volume, i: usize, mode: u32| {
            let a = SetAttr {
                mode: Some(mode),
                ..Default::default()
            };
            v.set_attr(&format!("/f{i}"), &a).unwrap();
        };
        // Created (a create's record carries its attributes), then changed in place:
        // each file is now one of the transaction's changed inodes, as the root is.
        for i in 0..n {
            drop(v.create(&format!("/f{i}")).unwrap());
            chmod(&v, i, 0o640);
        }
        let ckpts = v.journal_stats().checkpoints;
        let restated = |v: &Volume| {
            let st = v.vol.st.lock();
            st.txn
                .iter()
                .filter(|r| matches!(r, Record::SetAttr { .. }))
                .count()
        };
        assert_eq!(restated(&v), 0);
        v.vol.restate_ahead();
        let left = v.vol.st.lock().txn_inodes.len();
        assert!(left <= RESTATE_BATCH, "{left} inodes left to the close");
        assert_eq!(
            restated(&v) + left,
            n + 1,
            "every file and the root restated once, ahead or at the close"
        );
        // Changed again: every 7th file, some restated ahead and some not.
        let mode = |i: usize| if i.is_multiple_of(7) { 0o600 } else { 0o640 };
        for i in (0..n).step_by(7) {
            chmod(&v, i, 0o600);
        }
        v.sync().unwrap();
        assert_eq!(
            v.journal_stats().checkpoints,
            ckpts,
            "a checkpoint would hold the modes: the journal's replay is what is tested"
        );
        v.crash();
        let v = Volume::mount(q, quiet()).unwrap();
        for i in 0..n {
            let s = v.stat(&format!("/f{i}")).unwrap();
            assert_eq!(s.mode & 0o7777, mode(i), "/f{i} after replay");
        }
        assert!(v.check().is_empty(), "{:?}", v.check());
        v.unmount().unwrap();
    }
}
