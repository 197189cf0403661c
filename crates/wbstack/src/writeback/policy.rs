//! Writeback queueing policy: which dirty inode the flusher writes next, how much of it,
//! and when a writeback work stops (fs/fs-writeback.c: `queue_io`,
//! `move_expired_inodes`, `writeback_sb_inodes`, `requeue_inode`, `redirty_tail`,
//! `writeback_chunk_size`, the `wb_writeback` loop).
//!
//! This is a pure state machine: no threads, no IO, no clock reads. Every operation that
//! depends on time takes `now` in nanoseconds; the flusher thread drives it. Keeping all
//! queueing decisions here follows the review of seed 001 ("keep all the policy
//! decisions in one place"): the flusher only asks [`WbLists::begin_pass`] (or
//! [`WbLists::needs_queue_io`] + [`WbLists::queue_io`]), takes inodes with
//! [`WbLists::next_inode`], writes them, reports with [`WbLists::requeue`], and asks
//! [`WbLists::should_continue`] / [`slice_expired`] whether to go on.
//!
//! # Lists (one [`WbLists`] per device, the kernel's `bdi_writeback`)
//! * `b_dirty`: dirty inodes waiting to expire, sorted by `dirtied_when`, newest at the
//!   head. Only a clean→dirty transition stamps `dirtied_when`.
//! * `b_io`: the inodes selected for the current round; served from the tail.
//! * `b_more_io`: inodes that used their write chunk and want another turn; spliced
//!   into `b_io` at the next refill, ahead of newly expired inodes.
//!
//! Lists are keyed by a monotonically increasing insertion key: the smallest key is the
//! tail (served / oldest first), the largest the head. Every insertion is at the head,
//! as in the kernel (`list_move` to the list head).
//!
//! # Invariants (reference §1.12), checked by [`WbLists::check_invariants`]
//! * I1 an inode is on at most one list; `sync_queued` (I_SYNC_QUEUED) ⇔ it is on
//!   `b_io` or `b_more_io` (only the flusher moves it then).
//! * I2 `b_dirty` is sorted by `dirtied_when`, newest at the head.
//! * I3 `dirtied_when` is the last clean→dirty time, moved forward only by the
//!   redirty/requeue rules: first-dirty time ≤ `dirtied_when` ≤ now.
//! * I4 (structural form) `b_io` is in refill order (entry rounds never decrease towards
//!   the head), and when the last refill found `b_io` empty ("refill iff empty"), every
//!   inode in `b_io` belongs to that refill's fixed work set.
//! * I5 `has_dirty_io` ⇔ `b_dirty ∪ b_io ∪ b_more_io ≠ ∅`.
//!
//! # Not modelled
//! Lazytime (`b_dirty_time`), superblock regrouping in `move_expired_inodes` (one
//! filesystem per device here), cgroup writeback, `I_NEW`/`I_FREEING` (an evicted inode
//! is simply [`WbLists::remove`]d).

use crate::clock::{NSEC_PER_MSEC, NSEC_PER_SEC};
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::collections::BTreeMap;

/// An inode number, unique within one device's [`WbLists`].
pub type InodeId = u64;

/// `dirty_expire_centisecs` default: 30 s.
pub const DEFAULT_DIRTY_EXPIRE_NS: u64 = 30 * NSEC_PER_SEC;
/// Time slice of one writeback pass once it made progress (`writeback_sb_inodes`: HZ/10).
pub const WRITEBACK_SLICE_NS: u64 = 100 * NSEC_PER_MSEC;
/// `MIN_WRITEBACK_PAGES`: 4 MiB; the write chunk is a multiple of it and at least it.
pub const MIN_WRITEBACK_PAGES: u64 = 1024;
/// `DIRTY_SCOPE`: a chunk is at most 1/8 of the global dirty limit.
pub const DIRTY_SCOPE: u64 = 8;

/// Policy knobs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct WbPolicyConfig {
    /// Seed 001 ("writeback: sync expired inodes first in background writeback" and
    /// "refill b_io iff empty"). On: background works queue expired inodes first and
    /// `b_io` is refilled only when empty (a fixed work set per round). Off: the
    /// 2.6.39 behaviour before the series (background queues every dirty inode, and
    /// every non-kupdate pass refills; the pass stops at an inode dirtied after the
    /// work started). See [`WbLists::queue_io`], [`WbLists::needs_queue_io`] and
    /// [`WbLists::begin_pass`] for exactly what each arm does.
    ///
    /// Both arms share what the seed did not touch: the current `requeue_inode`
    /// (including the sync re-stamp, which came later), the kupdate cut-off recomputed
    /// at every refill (patch 2 of the same series), and the start-time cut-off for
    /// sync works at queueing time. Note that current mainline keeps only the
    /// refill-iff-empty half: its background refill takes every dirty inode (cut-off
    /// `now`), which is neither arm exactly.
    pub expire_first: bool,
    /// `dirty_expire_centisecs` in ns: an inode is expired when it has been dirty this
    /// long.
    pub dirty_expire_ns: u64,
}

impl Default for WbPolicyConfig {
    fn default() -> Self {
        WbPolicyConfig {
            expire_first: true,
            dirty_expire_ns: DEFAULT_DIRTY_EXPIRE_NS,
        }
    }
}

/// The kind of a writeback work (`struct wb_writeback_work` flags, reference §1.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum WorkKind {
    /// Periodic (`for_kupdate`): write inodes dirty for longer than the expire interval.
    Kupdate,
    /// `for_background`: runs while the device is over the background threshold.
    Background,
    /// Integrity sync (`WB_SYNC_ALL`, `sync_inodes_sb`): unlimited chunk, waits on busy
    /// inodes, only inodes dirtied before the work started.
    Sync,
    /// Best-effort flush-everything (`wakeup_flusher_threads`, `writeback_inodes_sb`),
    /// treated as `tagged_writepages`: unlimited chunk, only inodes dirtied before the
    /// work started.
    SyncNone,
    /// fsync of one inode. It never goes through `b_io`: it is served by the
    /// single-inode path ([`WbLists::try_begin_sync`] / [`WbLists::finish_single_inode`],
    /// the kernel's `writeback_single_inode`), so [`WbLists::queue_io`] leaves the
    /// lists alone for it.
    Fsync(InodeId),
}

impl WorkKind {
    /// `WB_SYNC_ALL || tagged_writepages`: unlimited write chunk, and still-dirty inodes
    /// are re-stamped after their visit (requeue rule 1, livelock guard).
    pub fn sync_all_or_tagged(self) -> bool {
        matches!(
            self,
            WorkKind::Sync | WorkKind::SyncNone | WorkKind::Fsync(_)
        )
    }

    /// `WB_SYNC_ALL`: the flusher waits on an inode someone else is writing instead of
    /// skipping it.
    pub fn waits_on_busy(self) -> bool {
        matches!(self, WorkKind::Sync | WorkKind::Fsync(_))
    }
}

/// One writeback work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Work {
    pub kind: WorkKind,
    /// Pages still to write; the driver decrements it by what each visit wrote.
    pub nr_pages: i64,
    /// When `wb_writeback` started this work. For sync/other works it is the queueing
    /// cut-off (livelock guard, §1.9); with `expire_first` off it is also the pre-seed
    /// visit guard (`wbc->wb_start`). Must be set by the driver.
    pub start_ns: u64,
}

impl Work {
    pub fn new(kind: WorkKind, nr_pages: i64, start_ns: u64) -> Self {
        Work {
            kind,
            nr_pages,
            start_ns,
        }
    }
}

/// Which `b_dirty` inodes a refill may take (`dirtied_before` / `older_than_this`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Cutoff {
    /// Every dirty inode.
    Everything,
    /// Inodes whose `dirtied_when` is at or before this time.
    DirtiedAtOrBefore(u64),
    /// None: the expiry cut-off lies before time 0 (`now < dirty_expire`).
    Nothing,
}

impl Cutoff {
    /// Inodes dirty for at least `expire` ns at `now`.
    pub fn expired(now: u64, expire: u64) -> Cutoff {
        match now.checked_sub(expire) {
            Some(t) => Cutoff::DirtiedAtOrBefore(t),
            None => Cutoff::Nothing,
        }
    }

    /// Whether an inode dirtied at `dirtied_when` passes.
    pub fn admits(self, dirtied_when: u64) -> bool {
        match self {
            Cutoff::Everything => true,
            Cutoff::DirtiedAtOrBefore(t) => dirtied_when <= t,
            Cutoff::Nothing => false,
        }
    }
}

/// The kernel's cut-off for a work (`dirtied_before`, reference §1.5): kupdate takes
/// inodes dirtied at or before `now − expire`; background every inode (`now`); every
/// other work only inodes dirtied at or before its start (livelock guard).
///
/// With `expire_first` on, background first uses the kupdate cut-off; that is decided
/// in [`WbLists::queue_io`], not here.
pub fn dirtied_before(work: &Work, now: u64, expire_interval_ns: u64) -> Cutoff {
    match work.kind {
        WorkKind::Kupdate => Cutoff::expired(now, expire_interval_ns),
        WorkKind::Background => Cutoff::DirtiedAtOrBefore(now),
        WorkKind::Sync | WorkKind::SyncNone | WorkKind::Fsync(_) => {
            Cutoff::DirtiedAtOrBefore(work.start_ns)
        }
    }
}

/// `writeback_chunk_size` (§1.7): how many pages one visit may write.
///
/// Integrity and tagged works write every tagged page in one visit (`i64::MAX`), so the
/// whole sync is one pass. Otherwise the chunk is about half a second of device
/// bandwidth, at most an eighth of the dirty limit and at most what the work still
/// wants, rounded to 4 MiB multiples with a 4 MiB floor:
/// `round_down(min(bw/2, limit/8, nr_pages) + 1024, 1024)`. Big chunks keep streaming
/// files sequential; the floor keeps per-visit overhead bounded.
pub fn write_chunk(
    sync_all_or_tagged: bool,
    avg_write_bw_pages: u64,
    dirty_limit_pages: u64,
    work_nr_pages: i64,
) -> i64 {
    if sync_all_or_tagged {
        return i64::MAX;
    }
    let nr = work_nr_pages.max(0) as u64;
    let p = (avg_write_bw_pages / 2)
        .min(dirty_limit_pages / DIRTY_SCOPE)
        .min(nr);
    let chunk = (p + MIN_WRITEBACK_PAGES) / MIN_WRITEBACK_PAGES * MIN_WRITEBACK_PAGES;
    chunk.min(i64::MAX as u64) as i64
}

/// The 100 ms slice of one pass (`writeback_sb_inodes` step 8): once the pass made
/// progress, return to the loop's termination checks after 100 ms, so a background
/// work notices it fell below the threshold and queued works are not starved (I6).
/// Without progress the pass goes on (it cannot be spinning on writes).
pub fn slice_expired(start_ns: u64, now: u64, progress: u64) -> bool {
    progress > 0 && now > start_ns.saturating_add(WRITEBACK_SLICE_NS)
}

/// Which list an inode is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum ListId {
    Dirty,
    Io,
    MoreIo,
}

impl ListId {
    fn idx(self) -> usize {
        match self {
            ListId::Dirty => 0,
            ListId::Io => 1,
            ListId::MoreIo => 2,
        }
    }
}

/// What a visit found, for [`WbLists::requeue`] (the state `requeue_inode` looks at).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Outcome {
    /// The mapping is still tagged DIRTY after writepages.
    pub still_dirty_pages: bool,
    /// Inode metadata is dirty (I_DIRTY_SYNC/DATASYNC), e.g. re-dirtied by delayed
    /// allocation or an i_size update at IO completion.
    pub metadata_dirty: bool,
    /// The chunk's `nr_to_write` left after writepages; ≤ 0 means the slice was used up.
    pub nr_to_write_left: i64,
    /// Pages the filesystem declined (locked buffers...): the inode cannot progress now.
    pub pages_skipped: u64,
    /// The visit was `WB_SYNC_ALL` or `tagged_writepages`.
    pub sync_all_or_tagged: bool,
}

/// Where [`WbLists::requeue`] put the inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum RequeueAction {
    /// `requeue_io`: to `b_more_io`, another turn next round.
    MoreIo,
    /// `redirty_tail`: to the `b_dirty` head, possibly re-stamped.
    RedirtyTail,
    /// Clean: off the lists.
    Clean,
    /// Unknown inode (evicted meanwhile): nothing done.
    Ignored,
}

impl RequeueAction {
    /// The inode left the lists (the caller may drop its own per-inode state).
    pub fn is_clean(self) -> bool {
        self == RequeueAction::Clean
    }
}

/// What [`WbLists::next_inode_for`] found at the tail of `b_io`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum NextInode {
    /// Write this inode (now marked syncing), then call [`WbLists::requeue`].
    Inode(InodeId),
    /// `WB_SYNC_ALL` only: the tail inode is being written by someone else (fsync).
    /// Wait until it is no longer syncing, then ask again.
    Busy(InodeId),
    /// The pass is over (`b_io` empty, or the pre-seed visit guard hit a young inode).
    Done,
}

/// Result of one refill, for tracing (`writeback_queue_io`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct QueueIoResult {
    /// Round number of this refill (refills so far, including this one).
    pub round: u64,
    /// Inodes spliced from `b_more_io`.
    pub spliced: usize,
    /// Inodes moved from `b_dirty`.
    pub moved: usize,
    /// The cut-off used first.
    pub cutoff: Cutoff,
    /// Background with `expire_first`: nothing expired and `b_more_io` was empty, so
    /// the refill took every dirty inode (seed 001's switch).
    pub switched_to_all: bool,
}

/// Why the `wb_writeback` loop should stop (§1.8).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum StopReason {
    /// `work.nr_pages ≤ 0`.
    NrPagesDone,
    /// Background/kupdate yield to an explicitly queued work (they are regenerated).
    YieldToQueuedWork,
    /// Background and no longer over the background threshold.
    BelowBackgroundThresh,
    /// The last pass wrote nothing and `b_more_io` is empty: nothing can progress.
    NoProgress,
}

/// The decision at the top of each `wb_writeback` iteration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum RoundDecision {
    Continue,
    /// No progress, but the oldest `b_more_io` inode is being written by someone else:
    /// wait until it is no longer syncing, then ask again with `last_pass_progress`
    /// `None` (`inode_sleep_on_writeback`).
    WaitFor(InodeId),
    Stop(StopReason),
}

/// Fairness figures over all visits so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FairnessStats {
    /// Refills (`queue_io` calls) so far.
    pub rounds: u64,
    /// Visits (`next_inode` hand-outs) so far.
    pub visits: u64,
    /// Largest `visit round − queued round` (see [`VisitRecord::rounds_waited`]).
    pub max_rounds_waited: u64,
    /// Largest time from an inode's clean→dirty transition to its first visit.
    pub max_first_write_delay_ns: u64,
}

/// One visit, recorded when history is enabled ([`WbLists::enable_history`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct VisitRecord {
    pub ino: InodeId,
    /// Refill round during which the visit happened.
    pub round: u64,
    /// Round in which the inode was queued for this visit: the refill that moved it
    /// from `b_dirty`, or the round of the visit after which it went to `b_more_io`.
    pub queued_round: u64,
    /// `round − queued_round`.
    pub rounds_waited: u64,
    /// Visit time (the latest time the policy was given).
    pub at_ns: u64,
    /// `dirtied_when` at the visit.
    pub dirtied_when: u64,
    /// For the first visit of a dirty episode: time since the clean→dirty transition.
    pub first_write_delay_ns: Option<u64>,
}

#[derive(Clone, Debug)]
struct InodeState {
    dirtied_when: u64,
    /// Time of the clean→dirty transition of this dirty episode (never re-stamped).
    dirty_since: u64,
    pos: Option<(ListId, u64)>,
    /// I_SYNC_QUEUED.
    sync_queued: bool,
    /// I_SYNC.
    syncing: bool,
    queued_round: Option<u64>,
    /// Round in which it last entered `b_io`.
    io_round: u64,
    /// Visited at least once in this dirty episode.
    visited: bool,
    /// When it was last handed out for writing.
    last_visit: u64,
}

impl InodeState {
    /// A newly tracked inode, dirtied (or taken for sync) at `now`.
    fn new(now: u64, syncing: bool) -> InodeState {
        InodeState {
            dirtied_when: now,
            dirty_since: now,
            pos: None,
            sync_queued: false,
            syncing,
            queued_round: None,
            io_round: 0,
            visited: false,
            last_visit: 0,
        }
    }
}

/// One device's dirty inode lists and queueing policy (the kernel's `bdi_writeback`
/// minus the thread).
#[derive(Clone, Debug)]
pub struct WbLists {
    cfg: WbPolicyConfig,
    inodes: FxHashMap<InodeId, InodeState>,
    lists: [BTreeMap<u64, InodeId>; 3],
    next_key: u64,
    /// Latest time seen; every operation uses max(this, its `now`) so out-of-order
    /// times cannot unsort `b_dirty`.
    now: u64,
    /// WB_has_dirty_io.
    has_dirty_io: bool,
    round: u64,
    /// The last refill found `b_io` empty.
    b_io_fixed: bool,
    /// Pre-seed visit guard (`wbc->wb_start`), set by `begin_pass` with the arm off.
    visit_guard: Option<u64>,
    /// `dirtied_before` of the current pass (`writeback_sb_inodes`), used by requeue
    /// rule 3; set by `begin_pass`.
    pass_cutoff: Option<Cutoff>,
    stats: FairnessStats,
    history: Option<Vec<VisitRecord>>,
    /// The sync work being served (its start time) and when its first pass began:
    /// inodes it visited itself are not swept up again (livelock guard).
    sync_pass: Option<(u64, u64)>,
}

impl Default for WbLists {
    fn default() -> Self {
        Self::new()
    }
}

impl WbLists {
    /// Empty lists with the default config (expire_first on, 30 s expiry).
    pub fn new() -> Self {
        Self::with_config(WbPolicyConfig::default())
    }

    pub fn with_config(cfg: WbPolicyConfig) -> Self {
        WbLists {
            cfg,
            inodes: FxHashMap::default(),
            lists: [BTreeMap::new(), BTreeMap::new(), BTreeMap::new()],
            next_key: 1,
            now: 0,
            has_dirty_io: false,
            round: 0,
            b_io_fixed: true,
            visit_guard: None,
            pass_cutoff: None,
            stats: FairnessStats::default(),
            history: None,
            sync_pass: None,
        }
    }

    pub fn config(&self) -> WbPolicyConfig {
        self.cfg
    }

    /// Change the knobs at run time. A switch to `expire_first` takes effect at the
    /// next refill; a `b_io` filled by the other arm is drained first.
    pub fn set_config(&mut self, cfg: WbPolicyConfig) {
        self.cfg = cfg;
    }

    /// Record every visit (for tests and the lab; costs memory per visit).
    pub fn enable_history(&mut self) {
        if self.history.is_none() {
            self.history = Some(Vec::new());
        }
    }

    // ---- queries -------------------------------------------------------------------

    /// WB_has_dirty_io: some inode is on `b_dirty`, `b_io` or `b_more_io`.
    pub fn has_dirty_io(&self) -> bool {
        self.has_dirty_io
    }

    /// Refills so far.
    pub fn round(&self) -> u64 {
        self.round
    }

    /// Latest time the policy was given.
    pub fn now(&self) -> u64 {
        self.now
    }

    pub fn len(&self, list: ListId) -> usize {
        self.lists[list.idx()].len()
    }

    /// True when no inode is dirty or being written.
    pub fn is_empty(&self) -> bool {
        self.inodes.is_empty()
    }

    /// The inodes of a list in service order (tail first: the next to be served, or for
    /// `b_dirty` the oldest first).
    pub fn list(&self, list: ListId) -> Vec<InodeId> {
        self.lists[list.idx()].values().copied().collect()
    }

    pub fn list_of(&self, ino: InodeId) -> Option<ListId> {
        self.inodes.get(&ino).and_then(|s| s.pos.map(|p| p.0))
    }

    pub fn dirtied_when(&self, ino: InodeId) -> Option<u64> {
        self.inodes.get(&ino).map(|s| s.dirtied_when)
    }

    pub fn is_dirty(&self, ino: InodeId) -> bool {
        self.list_of(ino).is_some()
    }

    /// I_SYNC_QUEUED.
    pub fn is_sync_queued(&self, ino: InodeId) -> bool {
        self.inodes.get(&ino).is_some_and(|s| s.sync_queued)
    }

    /// I_SYNC: being written (by the flusher's current visit or the single-inode path).
    pub fn is_syncing(&self, ino: InodeId) -> bool {
        self.inodes.get(&ino).is_some_and(|s| s.syncing)
    }

    pub fn more_io_empty(&self) -> bool {
        self.lists[ListId::MoreIo.idx()].is_empty()
    }

    /// The oldest `b_more_io` inode (the one `wb_writeback` waits on without progress).
    pub fn more_io_tail(&self) -> Option<InodeId> {
        self.tail(ListId::MoreIo)
    }

    pub fn fairness(&self) -> FairnessStats {
        FairnessStats {
            rounds: self.round,
            ..self.stats
        }
    }

    /// All recorded visits in order (empty unless [`Self::enable_history`]).
    pub fn visit_log(&self) -> &[VisitRecord] {
        self.history.as_deref().unwrap_or(&[])
    }

    /// The recorded visits of one inode.
    pub fn history(&self, ino: InodeId) -> Vec<VisitRecord> {
        self.visit_log()
            .iter()
            .filter(|v| v.ino == ino)
            .copied()
            .collect()
    }

    // ---- list plumbing -------------------------------------------------------------

    fn tick(&mut self, now: u64) -> u64 {
        self.now = self.now.max(now);
        self.now
    }

    fn tail(&self, list: ListId) -> Option<InodeId> {
        self.lists[list.idx()].first_key_value().map(|(_, &i)| i)
    }

    fn head(&self, list: ListId) -> Option<InodeId> {
        self.lists[list.idx()].last_key_value().map(|(_, &i)| i)
    }

    fn unlink(&mut self, ino: InodeId) {
        if let Some(st) = self.inodes.get_mut(&ino) {
            if let Some((list, key)) = st.pos.take() {
                self.lists[list.idx()].remove(&key);
            }
        }
    }

    /// Move to the head of `list` (`inode_io_list_move_locked`).
    fn push_head(&mut self, ino: InodeId, list: ListId) {
        self.unlink(ino);
        let key = self.next_key;
        self.next_key += 1;
        if let Some(st) = self.inodes.get_mut(&ino) {
            st.pos = Some((list, key));
            self.lists[list.idx()].insert(key, ino);
            self.has_dirty_io = true;
        }
    }

    /// `wb_io_lists_depopulated`.
    fn update_depopulated(&mut self) {
        if self.lists.iter().all(|l| l.is_empty()) {
            self.has_dirty_io = false;
        }
    }

    /// Off the lists (`inode_cgwb_move_to_attached`); the state is forgotten unless
    /// someone is still writing the inode.
    fn make_clean(&mut self, ino: InodeId) {
        self.unlink(ino);
        if let Some(st) = self.inodes.get_mut(&ino) {
            st.sync_queued = false;
            st.queued_round = None;
            if !st.syncing {
                self.inodes.remove(&ino);
            }
        }
        self.update_depopulated();
    }

    fn redirty_tail_inner(&mut self, ino: InodeId) {
        self.unlink(ino);
        let head_dw = self
            .head(ListId::Dirty)
            .and_then(|h| self.inodes.get(&h))
            .map(|h| h.dirtied_when);
        let now = self.now;
        let Some(st) = self.inodes.get_mut(&ino) else {
            return;
        };
        st.sync_queued = false;
        st.queued_round = None;
        if let Some(hdw) = head_dw {
            if st.dirtied_when < hdw {
                st.dirtied_when = now;
            }
        }
        self.push_head(ino, ListId::Dirty);
    }

    fn requeue_io_inner(&mut self, ino: InodeId) {
        if let Some(st) = self.inodes.get_mut(&ino) {
            st.sync_queued = true;
            self.push_head(ino, ListId::MoreIo);
        }
    }

    // ---- entering the lists ----------------------------------------------------------

    /// `__mark_inode_dirty` (§1.2). Only a clean→dirty transition stamps
    /// `dirtied_when = now` and moves the inode to the `b_dirty` head; re-dirtying a
    /// dirty inode changes nothing (its age is not refreshed, so a file appended to
    /// forever is still written 30 s after it first became dirty), and an inode queued
    /// for the flusher (`sync_queued`) is left where it is (the flusher places it).
    ///
    /// Returns true when the device went from no dirty io to having dirty io: the
    /// caller then schedules a delayed flusher wakeup (`wb_wakeup_delayed`).
    pub fn mark_dirty(&mut self, ino: InodeId, now: u64) -> bool {
        let now = self.tick(now);
        let had = self.has_dirty_io;
        match self.inodes.get_mut(&ino) {
            Some(st) if st.pos.is_some() || st.sync_queued => return false,
            Some(st) => {
                // Clean but being written by someone (I_SYNC): it becomes dirty again.
                st.dirtied_when = now;
                st.dirty_since = now;
                st.visited = false;
                st.queued_round = None;
            }
            None => {
                self.inodes.insert(ino, InodeState::new(now, false));
            }
        }
        self.push_head(ino, ListId::Dirty);
        !had
    }

    // ---- building a round ----------------------------------------------------------

    /// Whether the driver should call [`Self::queue_io`] before this pass. This is
    /// the other half of seed 001, kept here so the loop asks the policy:
    /// * `expire_first` on ("refill b_io iff empty", the seed's
    ///   `if (list_empty(&wb->b_io)) queue_io(...)`): only when `b_io` is empty, for
    ///   every work. A round is then a fixed work set, each member visited once before
    ///   anything queued later (I4), so nothing can be starved by later arrivals.
    /// * off (2.6.39 `writeback_inodes_wb`:
    ///   `if (!wbc->for_kupdate || list_empty(&wb->b_io)) queue_io(...)`): kupdate
    ///   refills only when `b_io` is empty, every other work refills at every pass,
    ///   splicing `b_more_io` and newly dirtied inodes in behind what is left of `b_io`.
    /// * `Fsync` never refills: it does not use `b_io`.
    pub fn needs_queue_io(&self, work: &Work) -> bool {
        let b_io_empty = self.lists[ListId::Io.idx()].is_empty();
        match work.kind {
            WorkKind::Fsync(_) => false,
            _ if self.cfg.expire_first => b_io_empty,
            WorkKind::Kupdate => b_io_empty,
            WorkKind::Background | WorkKind::Sync | WorkKind::SyncNone => true,
        }
    }

    /// Start one pass (one `writeback_sb_inodes` / `__writeback_inodes_wb` call): refill
    /// `b_io` when [`Self::needs_queue_io`] says so (with the stored config), record
    /// the pass's `dirtied_before` for [`Self::requeue`] (`now`, or `now − expire` for
    /// kupdate, as `writeback_sb_inodes` computes it), and set the visit guard of the
    /// pre-seed arm. Returns the refill, if one happened.
    ///
    /// With `expire_first` off, the pass also stops at the first `b_io` inode dirtied
    /// after `work.start_ns` (2.6.39 `writeback_sb_inodes`: "Was this inode dirtied
    /// after sync_sb_inodes was called? This keeps sync from extra jobs and livelock").
    /// That guard is what kept the pre-seed background work (which queued every dirty
    /// inode at every pass) from re-visiting an inode it had just re-stamped. The
    /// current kernel (and the `expire_first` arm) has no visit guard: non-periodic
    /// works apply the start time when queueing instead.
    ///
    /// The driver keeps `queued |= begin_pass(..).is_some()` for
    /// [`Self::should_continue`].
    pub fn begin_pass(&mut self, work: &Work, now: u64) -> Option<QueueIoResult> {
        let now = self.tick(now);
        self.visit_guard = match work.kind {
            WorkKind::Fsync(_) => None,
            _ if self.cfg.expire_first => None,
            _ => Some(work.start_ns),
        };
        self.pass_cutoff = match work.kind {
            WorkKind::Fsync(_) => None,
            WorkKind::Kupdate => Some(Cutoff::expired(now, self.cfg.dirty_expire_ns)),
            _ => Some(Cutoff::DirtiedAtOrBefore(now)),
        };
        if self.needs_queue_io(work) {
            let cfg = self.cfg;
            Some(self.queue_io(work, now, &cfg))
        } else {
            None
        }
    }

    /// `queue_io` + `move_expired_inodes` (§1.5), one refill (a new round).
    ///
    /// 1. Splice all of `b_more_io` into `b_io` behind whatever `b_io` still holds (so
    ///    at a refill of an empty `b_io` they are served first, in their order).
    /// 2. Move inodes from the `b_dirty` tail (oldest first) while their `dirtied_when`
    ///    is at or before the cut-off; stop at the first younger one (b_dirty is sorted).
    ///    They are served after the spliced ones, oldest first, and become
    ///    `sync_queued`.
    ///
    /// Cut-off per work:
    /// * `Kupdate`: `now − dirty_expire` (both arms; recomputed at every refill, the
    ///   "moving target" of the same series).
    /// * `Background`, `expire_first` on (seed 001, "writeback: sync expired inodes
    ///   first in background writeback": "enqueue all newly expired inodes at each
    ///   queue_io() time; enqueue all dirty inodes if there are no more expired inodes
    ///   to sync"): first `now − dirty_expire`; if that reaches a non-expired inode
    ///   while nothing has been moved and `b_io` (after the splice, i.e. `b_more_io`)
    ///   is empty, switch to every dirty inode (the seed's
    ///   `list_empty(dispatch_queue) && list_empty(&tmp)` test in
    ///   `move_expired_inodes`). A background work that may run for ever thus writes
    ///   old inodes (and so old pages, nearer the end of the LRU) first, like kupdate.
    /// * `Background`, off (2.6.39, `older_than_this == NULL`): every dirty inode.
    /// * `Sync`, `SyncNone`: `work.start_ns` (inodes dirtied after the work started are
    ///   never queued: livelock guard). Both arms.
    /// * `Fsync`: nothing is moved and no round starts.
    ///
    /// `cfg` becomes the stored config (so [`Self::needs_queue_io`] and later passes
    /// agree with the refill it shaped). With `expire_first` on this must only be
    /// called when `b_io` is empty (use [`Self::begin_pass`] or
    /// [`Self::needs_queue_io`]).
    pub fn queue_io(&mut self, work: &Work, now: u64, cfg: &WbPolicyConfig) -> QueueIoResult {
        self.cfg = *cfg;
        let now = self.tick(now);
        let expire = self.cfg.dirty_expire_ns;
        // (first cut-off, may switch to every inode).
        let (mut cutoff, may_switch) = match work.kind {
            WorkKind::Kupdate => (Cutoff::expired(now, expire), false),
            WorkKind::Background if self.cfg.expire_first => (Cutoff::expired(now, expire), true),
            WorkKind::Background => (Cutoff::Everything, false),
            WorkKind::Sync | WorkKind::SyncNone => {
                (Cutoff::DirtiedAtOrBefore(work.start_ns.min(now)), false)
            }
            WorkKind::Fsync(_) => {
                return QueueIoResult {
                    round: self.round,
                    spliced: 0,
                    moved: 0,
                    cutoff: Cutoff::Nothing,
                    switched_to_all: false,
                }
            }
        };
        debug_assert!(
            !self.cfg.expire_first || self.lists[ListId::Io.idx()].is_empty(),
            "queue_io with a non-empty b_io under refill-iff-empty"
        );
        let fixed = self.lists[ListId::Io.idx()].is_empty();
        self.round += 1;
        let round = self.round;

        // 1. b_more_io → b_io, keeping its order.
        let more: Vec<InodeId> = self.list(ListId::MoreIo);
        let spliced = more.len();
        for ino in more {
            self.push_head(ino, ListId::Io);
            if let Some(st) = self.inodes.get_mut(&ino) {
                st.io_round = round;
            }
        }

        // 2. expired b_dirty → b_io.
        let first_cutoff = cutoff;
        let mut moved = 0usize;
        let mut switched = false;
        while let Some(ino) = self.tail(ListId::Dirty) {
            let Some(dw) = self.inodes.get(&ino).map(|s| s.dirtied_when) else {
                break;
            };
            if !cutoff.admits(dw) {
                // The switch needs a refill with nothing to write at all: b_io still
                // empty after the b_more_io splice (seed v1: `list_empty(dispatch_queue)
                // && list_empty(&tmp)`, queue_io having spliced b_more_io first; v2:
                // `older_than_this = NULL; goto retry` in wb_writeback, reached only
                // after a pass that wrote nothing, with b_io and b_more_io empty). A
                // streaming file that uses its chunk at every visit sits on b_more_io,
                // so unexpired inodes wait until they expire, it goes clean, or a sync:
                // faithful, and bounded by dirty_expire_interval (lab expire's plot).
                if may_switch && !switched && self.lists[ListId::Io.idx()].is_empty() {
                    cutoff = Cutoff::Everything;
                    switched = true;
                    continue;
                }
                break;
            }
            self.queue_into_round(ino, round);
            moved += 1;
        }
        if let WorkKind::Sync | WorkKind::SyncNone = work.kind {
            // A sync takes every inode dirty before it started. The walk above stops
            // at the first inode stamped after the cut-off, but requeueing re-stamps
            // inodes that stay dirty (redirty_tail): one dirty since long before the
            // sync may sit among younger ones. Sync is rare; look at them all, except
            // those this sync already wrote (a writer dirtying them again must not
            // livelock it: requeue re-stamped them for that).
            let start = work.start_ns.min(now);
            let first_pass = match self.sync_pass {
                Some((s, p)) if s == work.start_ns => p,
                _ => {
                    self.sync_pass = Some((work.start_ns, now));
                    now
                }
            };
            let late: Vec<InodeId> = self
                .list(ListId::Dirty)
                .into_iter()
                .filter(|i| {
                    self.inodes
                        .get(i)
                        .is_some_and(|s| s.dirty_since <= start && s.last_visit < first_pass)
                })
                .collect();
            for ino in late {
                self.queue_into_round(ino, round);
                moved += 1;
            }
        }
        self.b_io_fixed = fixed;
        QueueIoResult {
            round,
            spliced,
            moved,
            cutoff: first_cutoff,
            switched_to_all: switched,
        }
    }

    /// Move `ino` from `b_dirty` into `b_io` as a member of refill `round`.
    fn queue_into_round(&mut self, ino: InodeId, round: u64) {
        self.push_head(ino, ListId::Io);
        if let Some(st) = self.inodes.get_mut(&ino) {
            st.sync_queued = true;
            st.queued_round = Some(round);
            st.io_round = round;
        }
    }

    // ---- processing a round ----------------------------------------------------------

    /// The next inode to write, `WB_SYNC_NONE` style: the `b_io` tail, marked syncing.
    /// An inode someone else is writing is moved to `b_more_io` and skipped. `None`
    /// ends the pass. Uses the latest time the policy was given as the visit time.
    pub fn next_inode(&mut self) -> Option<InodeId> {
        match self.next_inode_for(self.now, false) {
            NextInode::Inode(i) => Some(i),
            NextInode::Busy(_) | NextInode::Done => None,
        }
    }

    /// The next inode to write (`writeback_sb_inodes` steps 3–4). `wait_on_busy`
    /// (`WB_SYNC_ALL`): a busy tail inode is reported as [`NextInode::Busy`] and left in
    /// place; otherwise it goes to `b_more_io` (never wait in best-effort writeback).
    pub fn next_inode_for(&mut self, now: u64, wait_on_busy: bool) -> NextInode {
        let now = self.tick(now);
        loop {
            let Some(ino) = self.tail(ListId::Io) else {
                return NextInode::Done;
            };
            let Some(st) = self.inodes.get(&ino) else {
                // Cannot happen (lists and states are kept together); drop the entry.
                debug_assert!(false, "b_io entry without state");
                if let Some((&k, _)) = self.lists[ListId::Io.idx()].first_key_value() {
                    self.lists[ListId::Io.idx()].remove(&k);
                }
                continue;
            };
            if let Some(guard) = self.visit_guard {
                if st.dirtied_when > guard {
                    return NextInode::Done;
                }
            }
            if st.syncing {
                if wait_on_busy {
                    return NextInode::Busy(ino);
                }
                self.requeue_io_inner(ino);
                continue;
            }
            let round = self.round;
            let st = self.inodes.get_mut(&ino).expect("checked above");
            st.syncing = true;
            st.last_visit = now;
            let queued_round = st.queued_round.unwrap_or(round).min(round);
            let first = if st.visited {
                None
            } else {
                st.visited = true;
                Some(now.saturating_sub(st.dirty_since))
            };
            let rec = VisitRecord {
                ino,
                round,
                queued_round,
                rounds_waited: round - queued_round,
                at_ns: now,
                dirtied_when: st.dirtied_when,
                first_write_delay_ns: first,
            };
            self.stats.visits += 1;
            self.stats.max_rounds_waited = self.stats.max_rounds_waited.max(rec.rounds_waited);
            if let Some(d) = first {
                self.stats.max_first_write_delay_ns = self.stats.max_first_write_delay_ns.max(d);
            }
            if let Some(h) = self.history.as_mut() {
                h.push(rec);
            }
            return NextInode::Inode(ino);
        }
    }

    /// `requeue_inode` (§1.6), after a visit; clears syncing. Rules, in order:
    /// 1. still dirty and the visit was `WB_SYNC_ALL`/tagged → `dirtied_when = now`, so
    ///    the same sync (cut-off = its start) cannot queue it again (livelock guard).
    /// 2. `pages_skipped > 0` → `redirty_tail` (clean → off the lists): the fs cannot
    ///    make progress on it now.
    /// 3. dirty pages left: slice used up (`nr_to_write_left ≤ 0`) and not dirtied
    ///    after the pass's `dirtied_before` → `requeue_io` (`b_more_io`, next round);
    ///    otherwise `redirty_tail` — blocked by something else than the slice, so
    ///    avoid spinning on pages that cannot be written now; or re-stamped by rule 1
    ///    (a sync must not requeue what it just synced). The pass's `dirtied_before` is
    ///    the one [`Self::begin_pass`] recorded; without `begin_pass`, "dirtied after"
    ///    means "re-stamped by rule 1".
    /// 4. no dirty pages but metadata dirty (re-dirtied during writeback) →
    ///    `redirty_tail`.
    /// 5. clean → off the lists.
    ///
    /// Unknown inodes (evicted meanwhile) are ignored.
    pub fn requeue(&mut self, ino: InodeId, outcome: Outcome, now: u64) -> RequeueAction {
        let now = self.tick(now);
        let Some(st) = self.inodes.get_mut(&ino) else {
            return RequeueAction::Ignored;
        };
        st.syncing = false;
        let dirty = outcome.still_dirty_pages || outcome.metadata_dirty;
        let mut restamped = false;
        if dirty && outcome.sync_all_or_tagged {
            st.dirtied_when = now;
            restamped = true;
        }
        if outcome.pages_skipped > 0 {
            return if dirty {
                self.redirty_tail_inner(ino);
                RequeueAction::RedirtyTail
            } else {
                self.make_clean(ino);
                RequeueAction::Clean
            };
        }
        if outcome.still_dirty_pages {
            let dirtied_after = match self.pass_cutoff {
                Some(c) => self
                    .inodes
                    .get(&ino)
                    .is_some_and(|s| !c.admits(s.dirtied_when)),
                None => restamped,
            };
            if outcome.nr_to_write_left <= 0 && !dirtied_after {
                self.requeue_io_inner(ino);
                let round = self.round;
                if let Some(st) = self.inodes.get_mut(&ino) {
                    st.queued_round = Some(round);
                }
                RequeueAction::MoreIo
            } else {
                self.redirty_tail_inner(ino);
                RequeueAction::RedirtyTail
            }
        } else if outcome.metadata_dirty {
            self.redirty_tail_inner(ino);
            RequeueAction::RedirtyTail
        } else {
            self.make_clean(ino);
            RequeueAction::Clean
        }
    }

    /// `redirty_tail`: move a dirty inode to the `b_dirty` head, clearing
    /// `sync_queued`. If it is older than the newest `b_dirty` inode its `dirtied_when`
    /// becomes `now`, which keeps `b_dirty` sorted (I2); the inode thus re-ages: kupdate
    /// (and the expire-first background) will not take it for another expire interval.
    /// Unknown inodes are ignored.
    pub fn redirty_tail(&mut self, ino: InodeId, now: u64) {
        self.tick(now);
        if self.inodes.contains_key(&ino) {
            self.redirty_tail_inner(ino);
        }
    }

    /// `requeue_io`: move a dirty inode to the `b_more_io` head (another turn at the
    /// next refill). Unknown or clean inodes are ignored.
    pub fn requeue_io(&mut self, ino: InodeId) {
        let round = self.round;
        let Some(st) = self.inodes.get_mut(&ino) else {
            return;
        };
        match st.pos {
            None => return,
            // Entering the queue from b_dirty: it waits from this round on.
            Some((ListId::Dirty, _)) => st.queued_round = Some(round),
            Some(_) => {}
        }
        self.requeue_io_inner(ino);
    }

    /// The inode became clean outside the flusher (fully written by fsync, truncated
    /// to nothing): off the lists, even if queued (as `writeback_single_inode` does).
    /// Returns true when the policy no longer tracks it (false while someone is still
    /// writing it, or if it was unknown).
    pub fn inode_clean(&mut self, ino: InodeId) -> bool {
        if !self.inodes.contains_key(&ino) {
            return false;
        }
        self.make_clean(ino);
        !self.inodes.contains_key(&ino)
    }

    /// The inode is evicted or unlinked: forget it. A pending [`Self::requeue`] for it
    /// is then ignored (the kernel's `I_FREEING` rule 0).
    pub fn remove(&mut self, ino: InodeId) {
        self.unlink(ino);
        self.inodes.remove(&ino);
        self.update_depopulated();
    }

    // ---- the single-inode path (fsync, write_inode_now) -------------------------------

    /// Take I_SYNC for the single-inode path (`writeback_single_inode`). False when the
    /// inode is already being written: a `WB_SYNC_NONE` caller gives up, a
    /// `WB_SYNC_ALL` caller waits and retries. A clean inode is tracked while held.
    pub fn try_begin_sync(&mut self, ino: InodeId, now: u64) -> bool {
        let now = self.tick(now);
        match self.inodes.get_mut(&ino) {
            Some(st) if st.syncing => false,
            Some(st) => {
                st.syncing = true;
                true
            }
            None => {
                self.inodes.insert(ino, InodeState::new(now, true));
                true
            }
        }
    }

    /// Release I_SYNC after the single-inode path (end of `writeback_single_inode`):
    /// clean → off the lists (even if queued); still dirty and not `sync_queued` →
    /// `redirty_tail`; still dirty and queued → left to the flusher, which owns it.
    pub fn finish_single_inode(&mut self, ino: InodeId, still_dirty: bool, now: u64) {
        self.tick(now);
        let Some(st) = self.inodes.get_mut(&ino) else {
            return;
        };
        st.syncing = false;
        if !still_dirty {
            self.make_clean(ino);
        } else if !st.sync_queued {
            self.redirty_tail_inner(ino);
        }
    }

    // ---- loop termination ------------------------------------------------------------

    /// The `wb_writeback` checks (§1.8), asked at the top of every iteration with the
    /// progress of the previous pass (`None` before the first pass or after a wait):
    /// * last pass wrote nothing and this work has refilled `b_io` at least once
    ///   (`queued`, the kernel's flag of that name: before its first refill the work
    ///   just goes on and refills): stop if
    ///   `b_more_io` is empty (nothing can progress; a blocked inode was parked on
    ///   `b_dirty` and is not retried in a spin), else wait for its oldest inode if
    ///   someone else is writing it, else go on;
    /// * `work.nr_pages ≤ 0` → stop;
    /// * background/kupdate with a queued work → stop (yield; they are regenerated);
    /// * background below the background threshold → stop.
    pub fn should_continue(
        &self,
        work: &Work,
        over_bg_thresh: bool,
        work_list_nonempty: bool,
        last_pass_progress: Option<u64>,
        queued: bool,
    ) -> RoundDecision {
        if last_pass_progress == Some(0) && queued {
            match self.tail(ListId::MoreIo) {
                None => return RoundDecision::Stop(StopReason::NoProgress),
                Some(ino) if self.is_syncing(ino) => return RoundDecision::WaitFor(ino),
                Some(_) => {}
            }
        }
        if work.nr_pages <= 0 {
            return RoundDecision::Stop(StopReason::NrPagesDone);
        }
        let periodic = matches!(work.kind, WorkKind::Background | WorkKind::Kupdate);
        if periodic && work_list_nonempty {
            return RoundDecision::Stop(StopReason::YieldToQueuedWork);
        }
        if work.kind == WorkKind::Background && !over_bg_thresh {
            return RoundDecision::Stop(StopReason::BelowBackgroundThresh);
        }
        RoundDecision::Continue
    }

    // ---- invariants ------------------------------------------------------------------

    /// Check I1–I5 (and the structural I4); `Err` describes the first violation.
    pub fn check_invariants(&self) -> Result<(), String> {
        // I1: lists and states agree; each inode on at most one list.
        let mut listed = 0usize;
        for list in [ListId::Dirty, ListId::Io, ListId::MoreIo] {
            for (&key, &ino) in &self.lists[list.idx()] {
                listed += 1;
                let st = self
                    .inodes
                    .get(&ino)
                    .ok_or_else(|| format!("I1: inode {ino} on {list:?} has no state"))?;
                if st.pos != Some((list, key)) {
                    return Err(format!(
                        "I1: inode {ino} on {list:?} but state says {:?}",
                        st.pos
                    ));
                }
            }
        }
        let with_pos = self.inodes.values().filter(|s| s.pos.is_some()).count();
        if with_pos != listed {
            return Err(format!(
                "I1: {with_pos} inodes claim a list, {listed} list entries"
            ));
        }
        for (&ino, st) in &self.inodes {
            let queued = matches!(st.pos, Some((ListId::Io | ListId::MoreIo, _)));
            if st.sync_queued != queued {
                return Err(format!(
                    "I1: inode {ino} sync_queued={} but on {:?}",
                    st.sync_queued, st.pos
                ));
            }
            if st.pos.is_none() && !st.syncing {
                return Err(format!("inode {ino} is clean, idle and still tracked"));
            }
            // I3
            if !(st.dirty_since <= st.dirtied_when && st.dirtied_when <= self.now) {
                return Err(format!(
                    "I3: inode {ino} dirty_since {} dirtied_when {} now {}",
                    st.dirty_since, st.dirtied_when, self.now
                ));
            }
        }
        // I2: b_dirty sorted, oldest at the tail.
        let mut prev = 0u64;
        for &ino in self.lists[ListId::Dirty.idx()].values() {
            let dw = self.inodes[&ino].dirtied_when;
            if dw < prev {
                return Err(format!(
                    "I2: b_dirty unsorted at inode {ino} ({dw} after {prev})"
                ));
            }
            prev = dw;
        }
        // I4 (structural).
        let mut prev_round = 0u64;
        for &ino in self.lists[ListId::Io.idx()].values() {
            let r = self.inodes[&ino].io_round;
            if r < prev_round {
                return Err(format!("I4: b_io out of refill order at inode {ino}"));
            }
            if self.b_io_fixed && r != self.round {
                return Err(format!(
                    "I4: inode {ino} of round {r} in the fixed work set of round {}",
                    self.round
                ));
            }
            prev_round = r;
        }
        // I5
        let any = self.lists.iter().any(|l| !l.is_empty());
        if any != self.has_dirty_io {
            return Err(format!(
                "I5: has_dirty_io {} but lists non-empty {}",
                self.has_dirty_io, any
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = NSEC_PER_SEC;

    fn bg(start: u64) -> Work {
        Work::new(WorkKind::Background, i64::MAX, start)
    }

    fn written_clean() -> Outcome {
        Outcome {
            nr_to_write_left: 1,
            ..Default::default()
        }
    }

    fn ok(wb: &WbLists) {
        wb.check_invariants().unwrap();
    }

    #[test]
    fn write_chunk_matches_kernel() {
        assert_eq!(write_chunk(false, 25600, u64::MAX, i64::MAX), 13312);
        assert_eq!(write_chunk(true, 25600, 1000, 5), i64::MAX);
        // Floor of 4 MiB, multiple of 4 MiB.
        assert_eq!(write_chunk(false, 100, 100, 100), 1024);
        assert_eq!(write_chunk(false, 25600, 80_000, i64::MAX), 10240);
        assert_eq!(write_chunk(false, 25600, u64::MAX, 3000), 3072);
        assert_eq!(write_chunk(false, 25600, u64::MAX, -5), 1024);
        let huge = write_chunk(false, u64::MAX, u64::MAX, i64::MAX);
        assert!(huge > 0 && huge % 1024 == 0);
    }

    #[test]
    fn dirtied_before_per_work() {
        let now = 100 * S;
        let e = 30 * S;
        let k = Work::new(WorkKind::Kupdate, 1, 0);
        assert_eq!(
            dirtied_before(&k, now, e),
            Cutoff::DirtiedAtOrBefore(70 * S)
        );
        assert_eq!(
            dirtied_before(&bg(5), now, e),
            Cutoff::DirtiedAtOrBefore(now)
        );
        let s = Work::new(WorkKind::Sync, 1, 42);
        assert_eq!(dirtied_before(&s, now, e), Cutoff::DirtiedAtOrBefore(42));
        // Before 30 s nothing can be expired, not even an inode dirtied at time 0.
        assert_eq!(dirtied_before(&k, 5, e), Cutoff::Nothing);
        assert!(!Cutoff::Nothing.admits(0));
        assert!(Cutoff::expired(30 * S, e).admits(0));
    }

    #[test]
    fn slice() {
        assert!(!slice_expired(0, 200 * NSEC_PER_MSEC, 0));
        assert!(!slice_expired(0, 100 * NSEC_PER_MSEC, 5));
        assert!(slice_expired(0, 100 * NSEC_PER_MSEC + 1, 5));
        assert!(!slice_expired(u64::MAX, u64::MAX, 5));
    }

    #[test]
    fn mark_dirty_only_clean_to_dirty_stamps() {
        let mut wb = WbLists::default();
        assert!(wb.mark_dirty(1, 10));
        assert!(!wb.mark_dirty(2, 20));
        assert!(!wb.mark_dirty(1, 30));
        assert_eq!(wb.dirtied_when(1), Some(10));
        // 1 stays the oldest (tail) despite the re-dirty.
        assert_eq!(wb.list(ListId::Dirty), vec![1, 2]);
        ok(&wb);
        // A queued inode is not moved by re-dirtying.
        wb.queue_io(&Work::new(WorkKind::Sync, 1, 25), 40, &wb.config());
        assert_eq!(wb.list(ListId::Io), vec![1, 2]);
        assert!(!wb.mark_dirty(1, 50));
        assert_eq!(wb.list_of(1), Some(ListId::Io));
        assert!(wb.is_sync_queued(1));
        ok(&wb);
    }

    #[test]
    fn mark_dirty_reports_first_dirty_io_again_after_clean() {
        let mut wb = WbLists::default();
        assert!(wb.mark_dirty(1, 0));
        wb.inode_clean(1);
        assert!(!wb.has_dirty_io());
        assert!(wb.is_empty());
        assert!(wb.mark_dirty(1, 5));
        assert_eq!(wb.dirtied_when(1), Some(5));
        ok(&wb);
    }

    #[test]
    fn out_of_order_times_cannot_unsort_b_dirty() {
        let mut wb = WbLists::default();
        wb.mark_dirty(1, 100);
        wb.mark_dirty(2, 50); // earlier time: treated as 100
        assert_eq!(wb.dirtied_when(2), Some(100));
        ok(&wb);
    }

    #[test]
    fn kupdate_takes_only_expired() {
        let mut wb = WbLists::default();
        wb.mark_dirty(1, 0);
        wb.mark_dirty(2, 10 * S);
        let k = Work::new(WorkKind::Kupdate, 100, 0);
        let r = wb.queue_io(&k, 29 * S, &wb.config());
        assert_eq!(r.moved, 0);
        assert_eq!(wb.next_inode(), None);
        let r = wb.queue_io(&k, 30 * S, &wb.config());
        assert_eq!((r.moved, r.cutoff), (1, Cutoff::DirtiedAtOrBefore(0)));
        assert_eq!(wb.list(ListId::Io), vec![1]);
        ok(&wb);
    }

    #[test]
    fn background_expire_first_then_all() {
        let mut wb = WbLists::default();
        wb.mark_dirty(1, 0);
        wb.mark_dirty(2, 20 * S);
        // At 35 s only inode 1 is expired: background takes it alone.
        let r = wb.queue_io(&bg(35 * S), 35 * S, &wb.config());
        assert_eq!((r.moved, r.switched_to_all), (1, false));
        let i = wb.next_inode().unwrap();
        assert_eq!(i, 1);
        wb.requeue(i, written_clean(), 35 * S);
        // Nothing expired, b_more_io empty: everything.
        let r = wb.queue_io(&bg(35 * S), 36 * S, &wb.config());
        assert_eq!((r.moved, r.switched_to_all), (1, true));
        ok(&wb);
    }

    #[test]
    fn background_expire_first_no_switch_with_more_io() {
        let mut wb = WbLists::default();
        wb.mark_dirty(1, 0);
        let w = bg(0);
        wb.queue_io(&w, 0, &wb.config()); // switch: takes 1
        let i = wb.next_inode().unwrap();
        wb.mark_dirty(2, 1);
        let slice_used = Outcome {
            still_dirty_pages: true,
            nr_to_write_left: 0,
            ..Default::default()
        };
        assert_eq!(wb.requeue(i, slice_used, 1), RequeueAction::MoreIo);
        // b_more_io non-empty: inode 2 (not expired) is not taken.
        let r = wb.queue_io(&w, 2, &wb.config());
        assert_eq!((r.spliced, r.moved, r.switched_to_all), (1, 0, false));
        assert_eq!(wb.list(ListId::Io), vec![1]);
        ok(&wb);
    }

    /// Lab expire (tar + dd) with explicit times: dd (inode 1) uses its chunk at every
    /// visit, so it is on b_more_io at every refill. A small file dirtied at 2 s is not
    /// written by background writeback until it expires (32 s) or dd goes clean, as
    /// with the seed's patch; the pre-seed arm writes it at the next pass.
    #[test]
    fn background_expire_first_streamer_defers_young_inodes() {
        const MS: u64 = NSEC_PER_MSEC;
        let used = Outcome {
            still_dirty_pages: true,
            nr_to_write_left: 0,
            ..Default::default()
        };
        // One background pass at `now`: begin_pass, then visit everything in b_io
        // (dd uses its chunk, others are written clean). Returns (refill, visited).
        let pass = |wb: &mut WbLists, w: &Work, now: u64| {
            let r = wb.begin_pass(w, now);
            let mut visited = Vec::new();
            while let Some(i) = wb.next_inode() {
                visited.push(i);
                let o = if i == 1 { used } else { written_clean() };
                wb.requeue(i, o, now);
            }
            ok(wb);
            (r, visited)
        };
        let start = |cfg: WbPolicyConfig| {
            let mut wb = WbLists::with_config(cfg);
            wb.enable_history();
            wb.mark_dirty(1, 0);
            wb
        };

        // expire_first on, dd streams on: 2 waits for its expiry.
        let mut wb = start(WbPolicyConfig::default());
        let w = bg(100 * MS);
        let (r, v) = pass(&mut wb, &w, 100 * MS);
        assert_eq!(r.map(|r| r.switched_to_all), Some(true));
        assert_eq!(v, vec![1]);
        wb.mark_dirty(2, 2 * S);
        let mut t = 2 * S + 100 * MS;
        while t < 32 * S {
            let (r, v) = pass(&mut wb, &w, t);
            let r = r.map(|r| (r.spliced, r.moved, r.switched_to_all));
            assert_eq!((r, v), (Some((1, 0, false)), vec![1]), "at {t}");
            t += 100 * MS;
        }
        assert_eq!(wb.list_of(2), Some(ListId::Dirty));
        // 32 s: 2 has been dirty for dirty_expire_interval; it is queued behind dd.
        let (r, v) = pass(&mut wb, &w, 32 * S);
        assert_eq!(r.map(|r| (r.spliced, r.moved)), Some((1, 1)));
        assert_eq!(v, vec![1, 2]);
        assert_eq!(wb.history(2)[0].first_write_delay_ns, Some(30 * S));

        // expire_first on, dd goes clean at 8 s: the next refill has nothing to write,
        // so it switches to every dirty inode and takes 2.
        let mut wb = start(WbPolicyConfig::default());
        pass(&mut wb, &w, 100 * MS);
        wb.mark_dirty(2, 2 * S);
        pass(&mut wb, &w, 2 * S + 100 * MS);
        assert_eq!(wb.next_inode(), None);
        wb.begin_pass(&w, 8 * S);
        assert_eq!(wb.next_inode(), Some(1));
        wb.requeue(1, written_clean(), 8 * S);
        let (r, v) = pass(&mut wb, &w, 8 * S + 100 * MS);
        assert_eq!(r.map(|r| (r.moved, r.switched_to_all)), Some((1, true)));
        assert_eq!(v, vec![2]);
        assert_eq!(
            wb.history(2)[0].first_write_delay_ns,
            Some(6 * S + 100 * MS)
        );

        // expire_first off (2.6.39): every background pass takes every dirty inode, so
        // a work started after 2 was dirtied writes it behind dd at once.
        let mut wb = start(WbPolicyConfig {
            expire_first: false,
            ..Default::default()
        });
        pass(&mut wb, &w, 100 * MS);
        wb.mark_dirty(2, 2 * S);
        let w2 = bg(2 * S + 100 * MS);
        let (_, v) = pass(&mut wb, &w2, 2 * S + 100 * MS);
        assert_eq!(v, vec![1, 2]);
        assert_eq!(wb.history(2)[0].first_write_delay_ns, Some(100 * MS));
    }

    #[test]
    fn background_off_takes_everything_every_pass() {
        let mut wb = WbLists::with_config(WbPolicyConfig {
            expire_first: false,
            ..Default::default()
        });
        wb.mark_dirty(1, 0);
        wb.mark_dirty(2, 1);
        let w = bg(10);
        assert!(wb.needs_queue_io(&w));
        let r = wb.begin_pass(&w, 10).unwrap();
        assert_eq!(r.moved, 2);
        assert_eq!(wb.next_inode(), Some(1));
        wb.requeue(1, written_clean(), 10);
        wb.mark_dirty(3, 11);
        // b_io still holds 2, yet the pre-seed background refills.
        assert!(wb.needs_queue_io(&w));
        let r = wb.begin_pass(&w, 12).unwrap();
        assert_eq!(r.moved, 1);
        assert_eq!(wb.list(ListId::Io), vec![2, 3]);
        // Kupdate keeps refill-iff-empty in both arms.
        assert!(!wb.needs_queue_io(&Work::new(WorkKind::Kupdate, 1, 0)));
        // Visit guard: 3 was dirtied after the work started: the pass ends at it.
        assert_eq!(wb.next_inode(), Some(2));
        wb.requeue(2, written_clean(), 12);
        assert_eq!(wb.next_inode(), None);
        // A later work takes it.
        wb.begin_pass(&bg(20), 20);
        assert_eq!(wb.next_inode(), Some(3));
        ok(&wb);
    }

    #[test]
    fn more_io_before_newly_expired() {
        let mut wb = WbLists::default();
        let k = Work::new(WorkKind::Kupdate, i64::MAX, 0);
        wb.mark_dirty(1, 0);
        wb.mark_dirty(2, S);
        wb.queue_io(&k, 30 * S, &wb.config());
        let i = wb.next_inode().unwrap();
        assert_eq!(wb.list(ListId::Dirty), vec![2]);
        let used = Outcome {
            still_dirty_pages: true,
            nr_to_write_left: 0,
            ..Default::default()
        };
        wb.requeue(i, used, 31 * S);
        let r = wb.queue_io(&k, 31 * S, &wb.config());
        assert_eq!((r.spliced, r.moved), (1, 1));
        assert_eq!(wb.list(ListId::Io), vec![1, 2]);
        ok(&wb);
    }

    #[test]
    fn requeue_rules() {
        let used = Outcome {
            still_dirty_pages: true,
            nr_to_write_left: 0,
            ..Default::default()
        };
        let setup = || {
            let mut wb = WbLists::default();
            wb.mark_dirty(1, 0);
            wb.mark_dirty(9, 5 * S); // a newer b_dirty inode
            wb.queue_io(&Work::new(WorkKind::Kupdate, 1, 0), 31 * S, &wb.config());
            assert_eq!(wb.next_inode(), Some(1));
            wb
        };
        // Slice used up → b_more_io, dirtied_when kept.
        let mut wb = setup();
        assert_eq!(wb.requeue(1, used, 40 * S), RequeueAction::MoreIo);
        assert_eq!(
            (wb.list_of(1), wb.dirtied_when(1)),
            (Some(ListId::MoreIo), Some(0))
        );
        assert!(wb.is_sync_queued(1) && !wb.is_syncing(1));
        ok(&wb);
        // Blocked by something else → b_dirty head, re-stamped (older than head).
        let mut wb = setup();
        let blocked = Outcome {
            nr_to_write_left: 10,
            ..used
        };
        assert_eq!(wb.requeue(1, blocked, 40 * S), RequeueAction::RedirtyTail);
        assert_eq!(wb.list(ListId::Dirty), vec![9, 1]);
        assert_eq!(wb.dirtied_when(1), Some(40 * S));
        assert!(!wb.is_sync_queued(1));
        ok(&wb);
        // pages_skipped wins over the slice rule.
        let mut wb = setup();
        let skipped = Outcome {
            pages_skipped: 3,
            ..used
        };
        assert_eq!(wb.requeue(1, skipped, 40 * S), RequeueAction::RedirtyTail);
        ok(&wb);
        // Skipped but clean → clean.
        let mut wb = setup();
        let skipped_clean = Outcome {
            pages_skipped: 3,
            ..Default::default()
        };
        assert_eq!(wb.requeue(1, skipped_clean, 40 * S), RequeueAction::Clean);
        assert!(!wb.is_dirty(1));
        ok(&wb);
        // Metadata re-dirtied → redirty_tail.
        let mut wb = setup();
        let meta = Outcome {
            metadata_dirty: true,
            nr_to_write_left: 5,
            ..Default::default()
        };
        assert_eq!(wb.requeue(1, meta, 40 * S), RequeueAction::RedirtyTail);
        ok(&wb);
        // Clean.
        let mut wb = setup();
        assert_eq!(wb.requeue(1, written_clean(), 40 * S), RequeueAction::Clean);
        assert_eq!(wb.list_of(1), None);
        ok(&wb);
        // Sync: still dirty → re-stamped now, even with the slice "used up".
        let mut wb = setup();
        let sync_used = Outcome {
            sync_all_or_tagged: true,
            ..used
        };
        assert_eq!(wb.requeue(1, sync_used, 40 * S), RequeueAction::RedirtyTail);
        assert_eq!(wb.dirtied_when(1), Some(40 * S));
        ok(&wb);
        // Unknown inode.
        let mut wb = setup();
        assert_eq!(wb.requeue(77, used, 40 * S), RequeueAction::Ignored);
        ok(&wb);
    }

    #[test]
    fn redirty_tail_keeps_newest_stamp() {
        let mut wb = WbLists::default();
        wb.mark_dirty(1, 0);
        wb.mark_dirty(2, 10);
        // 2 is the newest: moving it to the head keeps its stamp.
        wb.redirty_tail(2, 50);
        assert_eq!(wb.dirtied_when(2), Some(10));
        // 1 is older than the head: re-stamped.
        wb.redirty_tail(1, 60);
        assert_eq!(wb.dirtied_when(1), Some(60));
        assert_eq!(wb.list(ListId::Dirty), vec![2, 1]);
        // Alone on b_dirty: not re-stamped.
        let mut wb = WbLists::default();
        wb.mark_dirty(1, 0);
        wb.redirty_tail(1, 99);
        assert_eq!(wb.dirtied_when(1), Some(0));
        wb.redirty_tail(42, 100); // unknown: ignored
        wb.requeue_io(42);
        wb.inode_clean(42);
        wb.remove(42);
        ok(&wb);
    }

    #[test]
    fn busy_inode_skipped_or_waited() {
        let mut wb = WbLists::default();
        wb.mark_dirty(1, 0);
        wb.mark_dirty(2, 1);
        wb.queue_io(&Work::new(WorkKind::Sync, 1, 5), 5, &wb.config());
        assert!(wb.try_begin_sync(1, 5));
        assert!(!wb.try_begin_sync(1, 5));
        // WB_SYNC_ALL waits on it.
        assert_eq!(wb.next_inode_for(5, true), NextInode::Busy(1));
        // WB_SYNC_NONE skips it to b_more_io.
        assert_eq!(wb.next_inode(), Some(2));
        assert_eq!(wb.list(ListId::MoreIo), vec![1]);
        wb.requeue(2, written_clean(), 6);
        // No progress with a busy b_more_io inode: wait for it.
        let w = bg(0);
        assert_eq!(
            wb.should_continue(&w, true, false, Some(0), true),
            RoundDecision::WaitFor(1)
        );
        // fsync found it fully written; queued, so it just leaves the lists.
        wb.finish_single_inode(1, false, 7);
        assert!(wb.is_empty());
        assert_eq!(
            wb.should_continue(&w, true, false, Some(0), true),
            RoundDecision::Stop(StopReason::NoProgress)
        );
        ok(&wb);
    }

    #[test]
    fn single_inode_path_redirties_unqueued() {
        let mut wb = WbLists::default();
        wb.mark_dirty(1, 0);
        wb.mark_dirty(2, 10);
        assert!(wb.try_begin_sync(1, 20));
        wb.finish_single_inode(1, true, 20);
        assert_eq!(wb.list(ListId::Dirty), vec![2, 1]);
        assert_eq!(wb.dirtied_when(1), Some(20));
        // fsync of a clean inode that gets dirtied meanwhile.
        assert!(wb.try_begin_sync(5, 30));
        ok(&wb);
        assert!(!wb.mark_dirty(5, 31));
        assert_eq!(wb.dirtied_when(5), Some(31));
        wb.finish_single_inode(5, true, 32);
        assert_eq!(wb.list_of(5), Some(ListId::Dirty));
        ok(&wb);
    }

    #[test]
    fn should_continue_checks() {
        let wb = WbLists::default();
        let mut w = bg(0);
        assert_eq!(
            wb.should_continue(&w, true, false, None, true),
            RoundDecision::Continue
        );
        assert_eq!(
            wb.should_continue(&w, false, false, Some(3), true),
            RoundDecision::Stop(StopReason::BelowBackgroundThresh)
        );
        assert_eq!(
            wb.should_continue(&w, true, true, None, true),
            RoundDecision::Stop(StopReason::YieldToQueuedWork)
        );
        w.nr_pages = 0;
        assert_eq!(
            wb.should_continue(&w, true, false, None, true),
            RoundDecision::Stop(StopReason::NrPagesDone)
        );
        // No progress, but this work has not refilled yet: go on (it will refill).
        let w = bg(0);
        assert_eq!(
            wb.should_continue(&w, true, false, Some(0), false),
            RoundDecision::Continue
        );
        assert_eq!(
            wb.should_continue(&w, true, false, Some(0), true),
            RoundDecision::Stop(StopReason::NoProgress)
        );
        let s = Work::new(WorkKind::Sync, i64::MAX, 0);
        assert_eq!(
            wb.should_continue(&s, false, true, Some(1), true),
            RoundDecision::Continue
        );
    }

    #[test]
    fn fsync_work_does_not_touch_lists() {
        let mut wb = WbLists::default();
        wb.mark_dirty(1, 0);
        let f = Work::new(WorkKind::Fsync(1), i64::MAX, 10);
        assert!(!wb.needs_queue_io(&f));
        assert_eq!(wb.begin_pass(&f, 10), None);
        let r = wb.queue_io(&f, 10, &wb.config());
        assert_eq!((r.round, r.moved), (0, 0));
        assert_eq!(wb.list(ListId::Dirty), vec![1]);
        ok(&wb);
    }

    #[test]
    fn fairness_counts_rounds_and_first_write_delay() {
        let mut wb = WbLists::default();
        wb.enable_history();
        wb.mark_dirty(1, 0);
        let k = Work::new(WorkKind::Kupdate, i64::MAX, 0);
        wb.queue_io(&k, 31 * S, &wb.config());
        assert_eq!(wb.next_inode(), Some(1));
        let used = Outcome {
            still_dirty_pages: true,
            nr_to_write_left: 0,
            ..Default::default()
        };
        wb.requeue(1, used, 32 * S);
        wb.queue_io(&k, 32 * S, &wb.config());
        assert_eq!(wb.next_inode(), Some(1));
        let f = wb.fairness();
        assert_eq!((f.rounds, f.visits, f.max_rounds_waited), (2, 2, 1));
        assert_eq!(f.max_first_write_delay_ns, 31 * S);
        let h = wb.history(1);
        assert_eq!(h.len(), 2);
        assert_eq!(h[1].first_write_delay_ns, None);
        assert_eq!((h[1].round, h[1].queued_round), (2, 1));
    }

    #[test]
    fn removed_inode_during_visit_is_ignored() {
        let mut wb = WbLists::default();
        wb.mark_dirty(1, 0);
        wb.queue_io(&bg(0), 0, &wb.config());
        assert_eq!(wb.next_inode(), Some(1));
        wb.remove(1);
        assert!(!wb.has_dirty_io());
        assert_eq!(wb.requeue(1, written_clean(), 1), RequeueAction::Ignored);
        ok(&wb);
    }
}
