//! One device's writeback (the kernel's bdi_writeback): its dirty inodes, the flusher
//! thread serving a queue of works (sync, background, kupdate), the pass over b_io with
//! one block plug (seed 000), and the glue to IO-less dirty throttling.
//!
//! Which inodes a pass takes is decided in `policy.rs`; how long a dirtier pauses in
//! `mm/throttle.rs`; this file only moves data and calls them.

use super::policy::{self, Outcome, WbLists, WbPolicyConfig, Work, WorkKind};
use crate::block::{BlkError, BlkResult, Plug, RequestQueue};
use crate::clock::{ClockRef, Waiter, NSEC_PER_MSEC, NSEC_PER_SEC};
use crate::mm::cache::PageCache;
use crate::mm::throttle::{self, DirtyConfig, TaskState, WbState};
use crate::trace;
use parking_lot::{Condvar, Mutex};
use rustc_hash::FxHashMap;
use serde_json::json;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

/// Writeback knobs (vm.* sysctls and wbstack's own switches). Settable at run time.
#[derive(Clone, Debug)]
pub struct WbConfig {
    /// Seed 000: one block plug spans the whole pass over b_io (off: a plug per inode).
    pub writeback_plug: bool,
    /// Seed 001: background writeback takes expired inodes first and refills b_io only
    /// when it is empty (off: every inode, refilled at every pass).
    pub expire_first: bool,
    pub dirty_expire_centisecs: u64,
    /// kupdate period; 0 disables periodic writeback.
    pub dirty_writeback_centisecs: u64,
    pub dirty: DirtyConfig,
}

impl Default for WbConfig {
    fn default() -> Self {
        WbConfig {
            writeback_plug: true,
            expire_first: true,
            dirty_expire_centisecs: 3000,
            dirty_writeback_centisecs: 500,
            dirty: DirtyConfig::default(),
        }
    }
}

impl WbConfig {
    fn expire_ns(&self) -> u64 {
        self.dirty_expire_centisecs * 10 * NSEC_PER_MSEC
    }
    fn interval_ns(&self) -> u64 {
        self.dirty_writeback_centisecs * 10 * NSEC_PER_MSEC
    }
}

/// writeback_control: what one writepages call may do.
#[derive(Clone, Debug, Default)]
pub struct Wbc {
    /// WB_SYNC_ALL: integrity writeback, waits on pages already under writeback.
    pub sync_all: bool,
    /// Tag pages first and write only those (livelock avoidance).
    pub tagged: bool,
    pub nr_to_write: i64,
    /// Pages written by this call.
    pub written: i64,
    /// Pages the call had to pass over (busy under writeback).
    pub pages_skipped: u64,
    /// Page index range (inclusive); None = whole file.
    pub range: Option<(u64, u64)>,
    /// Continue from the mapping's cursor and wrap.
    pub range_cyclic: bool,
    pub for_background: bool,
    pub for_kupdate: bool,
}

impl Wbc {
    pub fn sync_range(lo: u64, hi: u64) -> Wbc {
        Wbc {
            sync_all: true,
            tagged: true,
            nr_to_write: i64::MAX,
            range: Some((lo, hi)),
            ..Default::default()
        }
    }
}

/// What the flusher needs of an inode: implemented by the page cache's Mapping.
pub trait WbInode: Send + Sync {
    fn ino(&self) -> u64;
    fn writepages(&self, wbc: &mut Wbc) -> BlkResult;
    fn has_dirty_pages(&self) -> bool;
    fn write_inode(&self, _sync: bool) -> BlkResult {
        Ok(())
    }
    /// Wait for every page of the inode under writeback.
    fn wait_writeback_all(&self) {}
    /// Whether any page of the inode is under writeback.
    fn under_writeback(&self) -> bool {
        false
    }
    /// filemap_check_errors: the error a write of the inode met since the last check,
    /// cleared as it is returned.
    fn check_errors(&self) -> BlkResult {
        Ok(())
    }
}

/// A job for the flusher thread (see [`Bdi::queue_job`]).
pub type Job = Box<dyn FnOnce() + Send>;

/// Told of a panic the flusher contained (see [`Bdi::contain`]), with what panicked
/// and its message: the filesystem above fails itself, as its state may be half
/// changed by the code that panicked.
pub type PanicHook = Arc<dyn Fn(&str) + Send + Sync>;

/// A queued work and its completion.
pub struct WorkItem {
    work: Mutex<Work>,
    done: Mutex<Option<BlkResult>>,
    cv: Condvar,
    /// Inodes written by an integrity work, whose writeback it then waits for.
    visited: Mutex<Vec<Arc<dyn WbInode>>>,
    /// Page range of an fsync work (inclusive).
    range: Option<(u64, u64)>,
}

/// A caller's handle on a queued work.
#[derive(Clone)]
pub struct WorkHandle(Arc<WorkItem>);

impl WorkHandle {
    /// Wait until the work is done (flushing this thread's plug first).
    pub fn wait(&self) -> BlkResult {
        crate::block::flush_plug();
        let mut d = self.0.done.lock();
        while d.is_none() {
            self.0.cv.wait(&mut d);
        }
        d.clone().unwrap()
    }
    pub fn is_done(&self) -> bool {
        self.0.done.lock().is_some()
    }
}

/// Where dirty memory stands against balance_dirty_pages' levels, in pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct DirtyLevels {
    pub nr_dirty: u64,
    pub nr_writeback: u64,
    /// Background writeback starts above this.
    pub bg_thresh: u64,
    pub thresh: u64,
    /// `(freerun + limit) / 2`, where the controller steers dirty pages.
    pub setpoint: u64,
    /// The hard limit the controller steers against (`hard_dirty_limit`).
    pub limit: u64,
}

/// Counters for tools and tests.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct WbStats {
    pub passes: u64,
    pub inodes_written: u64,
    pub pages_written: u64,
    pub pauses: u64,
    pub pause_ns_total: u64,
    pub pause_ns_max: u64,
    pub write_bandwidth: u64,
    pub avg_write_bandwidth: u64,
    pub dirty_ratelimit: u64,
    /// Pauses by length: bucket i counts pauses shorter than `PAUSE_BUCKETS_MS[i]`
    /// (and at least the previous edge); the last counts the rest.
    pub pause_hist: [u64; PAUSE_BUCKETS_MS.len() + 1],
}

/// Upper edges (ms) of the pause-length buckets of [`WbStats::pause_hist`].
pub const PAUSE_BUCKETS_MS: [u64; 9] = [1, 2, 5, 10, 20, 50, 100, 150, 200];

thread_local! {
    static TASK: RefCell<TaskState> = RefCell::new(TaskState::default());
}

/// One device's writeback state.
pub struct Bdi {
    q: Arc<RequestQueue>,
    cache: Arc<PageCache>,
    clock: ClockRef,
    cfg: Mutex<WbConfig>,
    lists: Mutex<WbLists>,
    inodes: Mutex<FxHashMap<u64, Arc<dyn WbInode>>>,
    /// Inodes with pages under writeback (the kernel's s_inodes_wb): sync waits for
    /// all of them, not only for those its own pass wrote, so writeback started before
    /// it by anyone (the flusher, an earlier WB_SYNC_NONE work) is durable too.
    wb_inodes: Mutex<FxHashMap<u64, Weak<dyn WbInode>>>,
    works: Mutex<VecDeque<Arc<WorkItem>>>,
    /// Work of the filesystem above run by the flusher between works (an async flush
    /// batch, a flush-on-close kick), so it shares the flusher's place in the IO order
    /// and needs no thread of its own.
    jobs: Mutex<VecDeque<Job>>,
    /// The flusher has stopped: a job queued now runs on the queueing thread (set
    /// under `jobs`' lock, so none is left queued with no thread to run it, and its
    /// waiter, say an async flush's, waiting for good).
    jobs_closed: AtomicBool,
    waiter: Arc<Waiter>,
    stop: AtomicBool,
    nr_dirty: AtomicU64,
    nr_writeback: AtomicU64,
    dirtied_total: AtomicU64,
    written_total: AtomicU64,
    write_errors: AtomicU64,
    last_old_flush: AtomicU64,
    /// Nanoseconds of the last balance_dirty_pages sleep (wbt reads it).
    pub last_dirty_sleep: AtomicU64,
    throttle: Mutex<WbState>,
    stats: Mutex<WbStats>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    thread_id: Mutex<Option<std::thread::ThreadId>>,
    panic_hook: Mutex<Option<PanicHook>>,
    /// Panics contained (`contain`).
    panics: AtomicU64,
}

impl Bdi {
    pub fn new(q: Arc<RequestQueue>, cache: Arc<PageCache>, cfg: WbConfig) -> Arc<Bdi> {
        let clock = q.clock().clone();
        let waiter = Waiter::new();
        clock.register_waiter(&waiter);
        let now = clock.now_ns();
        let bdi = Arc::new(Bdi {
            q,
            cache,
            clock,
            cfg: Mutex::new(cfg),
            lists: Mutex::new(WbLists::new()),
            inodes: Mutex::new(FxHashMap::default()),
            wb_inodes: Mutex::new(FxHashMap::default()),
            works: Mutex::new(VecDeque::new()),
            jobs: Mutex::new(VecDeque::new()),
            jobs_closed: AtomicBool::new(false),
            waiter,
            stop: AtomicBool::new(false),
            nr_dirty: AtomicU64::new(0),
            nr_writeback: AtomicU64::new(0),
            dirtied_total: AtomicU64::new(0),
            written_total: AtomicU64::new(0),
            write_errors: AtomicU64::new(0),
            last_old_flush: AtomicU64::new(now),
            last_dirty_sleep: AtomicU64::new(0),
            throttle: Mutex::new(WbState::new(now)),
            stats: Mutex::new(WbStats::default()),
            thread: Mutex::new(None),
            thread_id: Mutex::new(None),
            panic_hook: Mutex::new(None),
            panics: AtomicU64::new(0),
        });
        // wbt gives every write full depth while a dirtier slept in the last second
        // (wb_recent_wait): tell it when ours did. Weak: the Bdi holds the queue.
        let w = Arc::downgrade(&bdi);
        bdi.q.wbt().set_dirty_sleep_fn(Some(Arc::new(move || {
            let t = w.upgrade()?.last_dirty_sleep.load(Ordering::Relaxed);
            (t != 0).then_some(t)
        })));
        let weak = Arc::downgrade(&bdi);
        let waiter = bdi.waiter.clone();
        let h = std::thread::Builder::new()
            .name("wb-flusher".into())
            .spawn(move || flusher(weak, waiter))
            .expect("spawn flusher thread");
        *bdi.thread_id.lock() = Some(h.thread().id());
        *bdi.thread.lock() = Some(h);
        bdi
    }

    pub fn queue(&self) -> &Arc<RequestQueue> {
        &self.q
    }
    pub fn cache(&self) -> &PageCache {
        &self.cache
    }
    pub fn clock(&self) -> &ClockRef {
        &self.clock
    }
    pub fn config(&self) -> WbConfig {
        self.cfg.lock().clone()
    }
    pub fn set_config(&self, cfg: WbConfig) {
        *self.cfg.lock() = cfg;
        self.waiter.kick();
    }
    pub fn nr_dirty(&self) -> u64 {
        self.nr_dirty.load(Ordering::Relaxed)
    }
    pub fn nr_writeback(&self) -> u64 {
        self.nr_writeback.load(Ordering::Relaxed)
    }
    /// Who hears of a panic the flusher contained (the filesystem above).
    pub fn set_panic_hook(&self, hook: PanicHook) {
        *self.panic_hook.lock() = Some(hook);
    }

    /// Panics the flusher contained so far.
    pub fn panics(&self) -> u64 {
        self.panics.load(Ordering::Relaxed)
    }

    /// Run `f` (the filesystem's writepages, a job, a pass of the flusher's own) with
    /// a panic in it contained: counted, told to the panic hook, and returned as EIO.
    /// A panic let through ended the flusher thread, and every work queued then or
    /// later, and every page left under writeback, was waited for forever. The
    /// caller's bookkeeping after `f` (an inode requeued, a work completed) still runs.
    pub fn contain<R>(&self, what: &str, f: impl FnOnce() -> R) -> Result<R, BlkError> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
            self.panics.fetch_add(1, Ordering::Relaxed);
            let msg = format!("{what} panicked: {}", crate::panic_message(p.as_ref()));
            // Cloned out: the hook may take any lock, this one included.
            let hook = self.panic_hook.lock().clone();
            if let Some(hook) = hook {
                hook(&msg);
            }
            BlkError::Io
        })
    }

    /// `contain` of a call that returns a block result: its error, or EIO if it
    /// panicked.
    fn contain_io(&self, what: &str, f: impl FnOnce() -> BlkResult) -> BlkResult {
        self.contain(what, f).and_then(|r| r)
    }

    pub fn write_errors(&self) -> u64 {
        self.write_errors.load(Ordering::Relaxed)
    }
    pub fn stats(&self) -> WbStats {
        let mut s = self.stats.lock().clone();
        let t = self.throttle.lock();
        s.write_bandwidth = t.write_bandwidth;
        s.avg_write_bandwidth = t.avg_write_bandwidth;
        s.dirty_ratelimit = t.dirty_ratelimit;
        s
    }
    /// Fairness of the rounds so far (seed 001's figures).
    pub fn fairness(&self) -> policy::FairnessStats {
        self.lists.lock().fairness()
    }
    /// Record every flusher visit from now on (seed 001's per-inode figures); the log
    /// grows by one record per visit, so only experiments of bounded size turn it on.
    pub fn enable_history(&self) {
        self.lists.lock().enable_history();
    }
    /// The visits recorded since [`Self::enable_history`].
    pub fn visit_log(&self) -> Vec<policy::VisitRecord> {
        self.lists.lock().visit_log().to_vec()
    }
    /// Dirty and writeback pages now, against the throttle's levels.
    pub fn dirty_levels(&self) -> DirtyLevels {
        let (thresh, bg_thresh) = self.thresholds();
        let t = self.throttle.lock();
        DirtyLevels {
            nr_dirty: self.nr_dirty(),
            nr_writeback: self.nr_writeback(),
            bg_thresh,
            thresh,
            setpoint: t.setpoint(thresh, bg_thresh),
            limit: t.hard_dirty_limit(thresh),
        }
    }
    /// (thresh, bg_thresh) in pages, from the cache size (the dirtyable memory).
    pub fn thresholds(&self) -> (u64, u64) {
        self.cfg
            .lock()
            .dirty
            .thresholds(self.cache.capacity_pages())
    }

    // ---- accounting, called by the page cache ----------------------------------------

    pub fn account_dirtied(&self, n: u64) {
        self.nr_dirty.fetch_add(n, Ordering::Relaxed);
        self.dirtied_total.fetch_add(n, Ordering::Relaxed);
    }
    pub fn account_cleaned(&self, n: u64) {
        let prev = self.nr_dirty.fetch_sub(n, Ordering::Relaxed);
        debug_assert!(prev >= n, "{n} pages cleaned with {prev} dirty counted");
    }
    pub fn account_writeback_start(&self, n: u64) {
        self.nr_writeback.fetch_add(n, Ordering::Relaxed);
    }
    pub fn account_written(&self, n: u64, ok: bool) {
        let prev = self.nr_writeback.fetch_sub(n, Ordering::Relaxed);
        debug_assert!(prev >= n, "{n} pages written with {prev} under writeback");
        self.written_total.fetch_add(n, Ordering::Relaxed);
        if !ok {
            self.write_errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// __mark_inode_dirty for a clean→dirty transition of the inode's pages.
    pub fn mark_inode_dirty(&self, inode: Arc<dyn WbInode>) {
        let ino = inode.ino();
        // Under the lists lock, like every decision that an inode is clean: a dirtying
        // then either comes before that decision (which sees the dirty page) or after
        // the removal (and puts the inode back). Lock order: lists, then an inode's
        // page lock, then `inodes`; nobody takes the lists lock holding a page lock.
        let mut lists = self.lists.lock();
        self.inodes.lock().insert(ino, inode);
        let first = lists.mark_dirty(ino, self.clock.now_ns());
        drop(lists);
        if first {
            // The flusher recomputes its sleep: the next kupdate is due an interval
            // after the last one (wb_wakeup_delayed).
            self.waiter.kick();
        }
    }

    /// An inode was made clean outside the flusher (fsync): drop it from the lists if
    /// the flusher does not own it.
    pub fn inode_maybe_clean(&self, ino: u64) {
        let inode = self.inodes.lock().get(&ino).cloned();
        if let Some(i) = inode {
            // Checked and removed under one lists lock hold: a page dirtied between
            // "no dirty pages" and the removal would otherwise leave the inode dirty
            // on no list, never written back (its dirtying saw it still listed).
            let mut lists = self.lists.lock();
            if !i.has_dirty_pages() && lists.inode_clean(ino) {
                self.inodes.lock().remove(&ino);
            }
        }
    }

    /// Forget an inode (evicted or deleted).
    pub fn forget_inode(&self, ino: u64) {
        self.lists.lock().remove(ino);
        self.inodes.lock().remove(&ino);
        self.wb_inodes.lock().remove(&ino);
    }

    /// The inode's first page went under writeback (called after the count rose, with
    /// no lock of the inode held).
    pub fn inode_writeback_start(&self, inode: &Arc<dyn WbInode>) {
        self.wb_inodes
            .lock()
            .insert(inode.ino(), Arc::downgrade(inode));
    }

    /// The inode's last page left writeback. Checked again under the list's lock: a
    /// writer that started new writeback meanwhile has already registered, or will
    /// register after this removal.
    pub fn inode_writeback_end(&self, inode: &dyn WbInode) {
        let mut w = self.wb_inodes.lock();
        if !inode.under_writeback() {
            w.remove(&inode.ino());
        }
    }

    /// wait_sb_inodes: wait for every page that was under writeback when this was
    /// called.
    pub fn wait_writeback_started(&self) {
        let inodes: Vec<Arc<dyn WbInode>> = self
            .wb_inodes
            .lock()
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        for i in inodes {
            i.wait_writeback_all();
        }
    }

    fn over_bg_thresh(&self) -> bool {
        let (_, bg) = self.thresholds();
        throttle::wb_over_bg_thresh(self.cache.nr_dirty(), bg)
    }

    /// IO-less dirty throttling: pause the calling writer as the policy says. Never
    /// writes pages itself; wakes the flusher when over the background threshold.
    pub fn balance_dirty_pages(&self, pages_dirtied: u64) {
        let mut pages = pages_dirtied;
        loop {
            let (thresh, bg) = self.thresholds();
            let now = self.clock.now_ns();
            let dirty = self.cache.nr_dirty();
            let wb = self.cache.nr_writeback();
            let d = TASK.with(|t| {
                let mut t = t.borrow_mut();
                let mut st = self.throttle.lock();
                st.update_bandwidth(
                    now,
                    self.dirtied_total.load(Ordering::Relaxed),
                    self.written_total.load(Ordering::Relaxed),
                    dirty + wb,
                    thresh,
                    bg,
                );
                throttle::balance_dirty_pages(&mut st, &mut t, now, pages, dirty, wb, thresh, bg)
            });
            if d.wake_background {
                self.waiter.kick();
            }
            if d.pause_ns > 0 {
                trace::emit("balance_dirty_pages", || {
                    serde_json::to_value(d.trace).unwrap_or_default()
                });
                {
                    let mut s = self.stats.lock();
                    s.pauses += 1;
                    s.pause_ns_total += d.pause_ns;
                    s.pause_ns_max = s.pause_ns_max.max(d.pause_ns);
                    let ms = d.pause_ns / NSEC_PER_MSEC;
                    let b = PAUSE_BUCKETS_MS.partition_point(|&edge| edge <= ms);
                    s.pause_hist[b] += 1;
                }
                self.last_dirty_sleep.store(now, Ordering::Relaxed);
                crate::block::flush_plug();
                self.sleep_until(now + d.pause_ns);
            }
            if !d.must_recheck {
                return;
            }
            pages = 0;
        }
    }

    fn sleep_until(&self, deadline: u64) {
        let w = Waiter::new();
        self.clock.register_waiter(&w);
        while self.clock.now_ns() < deadline {
            self.clock.wait_until(&w, deadline);
        }
    }

    // ---- works -----------------------------------------------------------------------

    fn queue_work(&self, kind: WorkKind, nr_pages: i64) -> WorkHandle {
        self.queue_item(self.work_item(kind, nr_pages, None))
    }

    fn queue_item(&self, item: WorkItem) -> WorkHandle {
        let item = Arc::new(item);
        self.works.lock().push_back(item.clone());
        self.waiter.kick();
        WorkHandle(item)
    }

    /// Write back everything dirty now and wait for it (sync_inodes_sb: WB_SYNC_ALL).
    pub fn sync(&self) -> BlkResult {
        let r = self.queue_work(WorkKind::Sync, i64::MAX).wait();
        self.wait_writeback_started();
        r
    }

    /// Start writeback of everything dirty (WB_SYNC_NONE), returning a handle.
    pub fn start_writeback(&self) -> WorkHandle {
        self.queue_work(WorkKind::SyncNone, i64::MAX)
    }

    /// Queue integrity writeback of pages [lo, hi] of one inode (an fsync served by
    /// the flusher); the handle completes when they are written and waited on.
    pub fn fsync_range(&self, ino: u64, lo: u64, hi: u64) -> WorkHandle {
        self.queue_item(self.work_item(WorkKind::Fsync(ino), i64::MAX, Some((lo, hi))))
    }

    /// writeback_single_inode with WB_SYNC_ALL: wait for I_SYNC, write the range's pages
    /// tagged now, wait for them, and put the inode back where it belongs; then report
    /// a write error the inode met, as filemap_write_and_wait_range does.
    fn fsync_work(&self, ino: u64, range: Option<(u64, u64)>) -> BlkResult {
        let Some(inode) = self.inodes.lock().get(&ino).cloned() else {
            // Clean, but an inode leaves `inodes` once its pages are no longer dirty,
            // which is while they may still be under writeback (kupdate, background,
            // start_writeback wrote them without waiting): those writes are the
            // fsync's too.
            let inode = self.wb_inodes.lock().get(&ino).and_then(Weak::upgrade);
            return match inode {
                Some(inode) => {
                    inode.wait_writeback_all();
                    inode.check_errors()
                }
                None => Ok(()),
            };
        };
        while !self.lists.lock().try_begin_sync(ino, self.clock.now_ns()) {
            crate::block::flush_plug();
            self.sleep_until(self.clock.now_ns() + NSEC_PER_MSEC);
        }
        let (lo, hi) = range.unwrap_or((0, u64::MAX));
        let mut wbc = Wbc::sync_range(lo, hi);
        let r = self.contain_io("writepages", || inode.writepages(&mut wbc));
        inode.wait_writeback_all();
        {
            // Checked under the lists lock (see mark_inode_dirty).
            let mut lists = self.lists.lock();
            let still_dirty = inode.has_dirty_pages();
            lists.finish_single_inode(ino, still_dirty, self.clock.now_ns());
            if !still_dirty {
                self.inodes.lock().remove(&ino);
            }
        }
        trace::emit(
            "writeback_single_inode",
            || json!({"ino": ino, "wrote": wbc.written, "fsync": true}),
        );
        r.and(inode.check_errors())
    }

    fn wb_writeback(&self, item: &WorkItem) -> BlkResult {
        let cfg = self.config();
        let pcfg = WbPolicyConfig {
            expire_first: cfg.expire_first,
            dirty_expire_ns: cfg.expire_ns(),
        };
        let mut work = *item.work.lock();
        trace::emit(
            "writeback_start",
            || json!({"kind": format!("{:?}", work.kind), "nr_pages": work.nr_pages}),
        );
        // Seed 000: with the switch on, one plug spans the whole pass, so the bios of
        // consecutive inodes meet in it and merge; writepages' own per-inode plug
        // then nests as a no-op.
        let plug = cfg.writeback_plug.then(Plug::start);
        let mut result = Ok(());
        let mut written = 0i64;
        let mut queued = false;
        loop {
            if work.nr_pages <= 0 {
                break;
            }
            let periodic = matches!(work.kind, WorkKind::Kupdate | WorkKind::Background);
            if periodic && self.has_queued() {
                break;
            }
            if work.kind == WorkKind::Background && !self.over_bg_thresh() {
                break;
            }
            let now = self.clock.now_ns();
            {
                let mut l = self.lists.lock();
                l.set_config(pcfg);
                if let Some(r) = l.begin_pass(&work, now) {
                    queued = true;
                    trace::emit("writeback_queue_io", || {
                        serde_json::to_value(r).unwrap_or_default()
                    });
                }
            }
            let (progress, w, r) = self.writeback_inodes(&mut work, item);
            written += w;
            if r.is_err() && result.is_ok() {
                result = r;
            }
            if progress > 0 {
                continue;
            }
            if !queued {
                continue;
            }
            if self.lists.lock().more_io_empty() {
                break;
            }
            // Inodes wait on b_more_io but nothing moved: let IO complete first.
            crate::block::flush_plug();
            self.sleep_until(self.clock.now_ns() + NSEC_PER_MSEC);
        }
        drop(plug);
        self.stats.lock().passes += 1;
        trace::emit(
            "writeback_written",
            || json!({"kind": format!("{:?}", work.kind), "written": written}),
        );
        result
    }

    /// writeback_sb_inodes: visit b_io inodes until empty, out of pages, or 100 ms.
    fn writeback_inodes(&self, work: &mut Work, item: &WorkItem) -> (i64, i64, BlkResult) {
        let start = self.clock.now_ns();
        let (mut progress, mut written) = (0i64, 0i64);
        let mut result = Ok(());
        let integrity = matches!(work.kind, WorkKind::Sync);
        loop {
            let Some(ino) = self.lists.lock().next_inode() else {
                break;
            };
            let inode = self.inodes.lock().get(&ino).cloned();
            let Some(inode) = inode else {
                self.lists.lock().remove(ino);
                continue;
            };
            let chunk = {
                let t = self.throttle.lock();
                let (thresh, _) = self.thresholds();
                policy::write_chunk(
                    integrity || work.kind == WorkKind::SyncNone,
                    t.avg_write_bandwidth,
                    t.dirty_limit.max(thresh),
                    work.nr_pages,
                )
            };
            let mut wbc = Wbc {
                sync_all: integrity,
                tagged: integrity || work.kind == WorkKind::SyncNone,
                nr_to_write: chunk,
                range_cyclic: !integrity,
                for_background: work.kind == WorkKind::Background,
                for_kupdate: work.kind == WorkKind::Kupdate,
                ..Default::default()
            };
            let r = self.contain_io("writepages", || inode.writepages(&mut wbc));
            if r.is_err() && result.is_ok() {
                result = r;
            }
            if integrity {
                let _ = self.contain("write_inode", || inode.write_inode(true));
                item.visited.lock().push(inode.clone());
            }
            let still_dirty = inode.has_dirty_pages();
            trace::emit(
                "writeback_single_inode",
                || json!({"ino": ino, "wrote": wbc.written, "nr_to_write": wbc.nr_to_write, "still_dirty": still_dirty}),
            );
            work.nr_pages = work.nr_pages.saturating_sub(wbc.written);
            written += wbc.written;
            progress += (wbc.written - wbc.pages_skipped as i64).max(0) + i64::from(!still_dirty);
            {
                let mut s = self.stats.lock();
                s.inodes_written += 1;
                s.pages_written += wbc.written as u64;
            }
            let now = self.clock.now_ns();
            {
                // Dirtiness is read again under the lists lock: a page dirtied since
                // the look above must keep the inode listed (see mark_inode_dirty).
                let mut lists = self.lists.lock();
                let outcome = Outcome {
                    still_dirty_pages: inode.has_dirty_pages(),
                    metadata_dirty: false,
                    nr_to_write_left: wbc.nr_to_write,
                    pages_skipped: wbc.pages_skipped,
                    sync_all_or_tagged: wbc.sync_all || wbc.tagged,
                };
                if lists.requeue(ino, outcome, now).is_clean() {
                    self.inodes.lock().remove(&ino);
                }
            }
            if progress > 0
                && (policy::slice_expired(start, now, progress as u64) || work.nr_pages <= 0)
            {
                break;
            }
        }
        (progress, written, result)
    }

    /// Run `job` on the flusher thread, after the works queued before it; once the
    /// flusher has stopped, on this thread at once (so never while holding a lock
    /// the job takes).
    pub fn queue_job(&self, job: Job) {
        let mut jobs = self.jobs.lock();
        if self.jobs_closed.load(Ordering::SeqCst) {
            drop(jobs);
            job();
            return;
        }
        jobs.push_back(job);
        drop(jobs);
        self.waiter.kick();
    }

    /// The flusher is stopping: run the jobs left, and every later one where it is
    /// queued (their work meets the stopped volume and fails, telling its waiters).
    fn close_jobs(&self) {
        let left = {
            let mut jobs = self.jobs.lock();
            self.jobs_closed.store(true, Ordering::SeqCst);
            std::mem::take(&mut *jobs)
        };
        for job in left {
            job();
        }
    }

    fn has_queued(&self) -> bool {
        !self.works.lock().is_empty() || !self.jobs.lock().is_empty()
    }

    fn run_works(&self) {
        loop {
            let Some(item) = self.works.lock().pop_front() else {
                // Popped into a local: a guard in the match scrutinee would hold the
                // queue locked while the job runs, blocking everyone queueing jobs.
                let job = self.jobs.lock().pop_front();
                match job {
                    Some(job) => {
                        // A job's waiters are the filesystem's to fail (the hook).
                        let _ = self.contain("a flusher job", job);
                        continue;
                    }
                    None => return,
                }
            };
            let kind = item.work.lock().kind;
            let mut r = self.contain_io("a writeback work", || {
                let r = match kind {
                    WorkKind::Fsync(ino) => self.fsync_work(ino, item.range),
                    _ => self.wb_writeback(&item),
                };
                // Popped into a local (see above).
                let visited = std::mem::take(&mut *item.visited.lock());
                for inode in visited {
                    inode.wait_writeback_all();
                }
                r
            });
            if self.write_errors() > 0 && r.is_ok() && item.work.lock().kind == WorkKind::Sync {
                // Errors are reported per file by errseq (later); the work itself only
                // reports what its own submissions returned.
                r = Ok(());
            }
            *item.done.lock() = Some(r);
            item.cv.notify_all();
        }
    }

    fn update_bandwidth(&self) {
        let (thresh, bg) = self.thresholds();
        let now = self.clock.now_ns();
        self.throttle.lock().update_bandwidth(
            now,
            self.dirtied_total.load(Ordering::Relaxed),
            self.written_total.load(Ordering::Relaxed),
            self.cache.nr_dirty() + self.cache.nr_writeback(),
            thresh,
            bg,
        );
    }

    /// One run of the flusher (wb_do_writeback); returns when to wake next.
    fn do_writeback(&self) -> Option<u64> {
        self.run_works();
        let cfg = self.config();
        let now = self.clock.now_ns();
        let interval = cfg.interval_ns();
        if interval > 0 && now >= self.last_old_flush.load(Ordering::Relaxed) + interval {
            self.last_old_flush.store(now, Ordering::Relaxed);
            let nr = (self.nr_dirty() + self.inodes.lock().len() as u64) as i64;
            if nr > 0 {
                let item = self.work_item(WorkKind::Kupdate, nr, None);
                let _ = self.wb_writeback(&item);
            }
        }
        if self.over_bg_thresh() {
            let item = self.work_item(WorkKind::Background, i64::MAX, None);
            let _ = self.wb_writeback(&item);
        }
        self.update_bandwidth();
        if self.has_queued() {
            return Some(0);
        }
        if self.over_bg_thresh() {
            // Still over (pages under writeback will complete): look again soon.
            return Some(self.clock.now_ns() + 10 * NSEC_PER_MSEC);
        }
        let has_dirty = !self.inodes.lock().is_empty();
        (has_dirty && interval > 0).then(|| self.last_old_flush.load(Ordering::Relaxed) + interval)
    }

    fn work_item(&self, kind: WorkKind, nr_pages: i64, range: Option<(u64, u64)>) -> WorkItem {
        WorkItem {
            work: Mutex::new(Work {
                kind,
                nr_pages,
                start_ns: self.clock.now_ns(),
            }),
            done: Mutex::new(None),
            cv: Condvar::new(),
            visited: Mutex::new(Vec::new()),
            range,
        }
    }

    /// Stop the flusher thread (after a final sync by the caller if wanted).
    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::SeqCst);
        self.waiter.kick();
        let me = std::thread::current().id();
        if *self.thread_id.lock() == Some(me) {
            return;
        }
        if let Some(h) = self.thread.lock().take() {
            let _ = h.join();
        }
    }
}

impl Drop for Bdi {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn flusher(weak: Weak<Bdi>, waiter: Arc<Waiter>) {
    loop {
        let (next, clock) = {
            let Some(bdi) = weak.upgrade() else { return };
            if bdi.stop.load(Ordering::SeqCst) {
                bdi.close_jobs();
                return;
            }
            // Contained, a panic of the flusher's own code fails the work it was in
            // (`run_works`) or a periodic pass, and the thread goes on: a pass that
            // panicked is tried again a second later, or when kicked, not in a loop.
            let next = bdi
                .contain("the flusher", || bdi.do_writeback())
                .unwrap_or_else(|_| Some(bdi.clock.now_ns() + NSEC_PER_SEC));
            (next, bdi.clock.clone())
        };
        match next {
            Some(0) => continue,
            Some(t) => clock.wait_until(&waiter, t),
            // Nothing dirty: sleep until kicked; wake once a second anyway so a stop
            // without kick still ends the thread.
            None => clock.wait_until(&waiter, clock.now_ns() + NSEC_PER_SEC),
        }
    }
}
