//! Writeback throttling (the kernel's blk-wbt): keep the device queue shallow for
//! buffered writes while reads see latency, CoDel-like.
//!
//! Two layers:
//! - [`RqWb`], the controller: classification, admission limits, the wake rule and the
//!   window evaluation. No threads and no clock: every method that needs the time takes
//!   it, so tests drive it window by window.
//! - [`Wbt`], the rq_qos policy around it: blocks tracked writes in FIFO wait queues,
//!   feeds the controller service latencies and inflight counts, and runs the window
//!   timer on its own thread on the queue's clock.
//!
//! Every request queue carries one `Wbt` (see `RequestQueue::wbt`); it is on by default
//! with a target of 2 ms (non-rotational) or 75 ms (rotational) and is switched with
//! `RequestQueue::set_wbt_lat_usec` (0 = off).
//!
//! Differences from the kernel: there is no swap or REQ_PRIO here, so two wait queues
//! (background writes, discards) instead of three; reads dispatched while the window
//! timer is not armed are not taken as the "sync issue" read (the timer only looks at
//! it while armed, and stamping every read with the fine clock would cost more than the
//! whole rest of wbt on the read path); a disabled wbt's timer stops at its next expiry
//! instead of evaluating windows against a target of 0; the last dirtier sleep is
//! looked up at most once per clock tick. And by default depth grows only after a
//! window in which the limit held a request back (`scale_up_when_limited`): the kernel
//! grows it after every window whose reads met the target, even when writes never
//! reached the limit, so a quiet spell (or the write-only tail of an earlier job) leaves
//! a deep limit for the next burst of writeback to fill before the first slow reads can
//! bring it down. `set_scale_up_when_limited(false)` restores the kernel's rule.

use crate::block::bio::{Bio, BioFlags, Op, Request};
use crate::block::qos::{LatBucket, LatencyWindow, RqQos};
use crate::clock::{ClockRef, Waiter, NSEC_PER_MSEC, NSEC_PER_SEC, NSEC_PER_USEC};
use crate::trace;
use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use serde_json::json;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::thread::{JoinHandle, Thread};

/// Depth at scale_step 0 (RWB_DEF_DEPTH), bounded by the queue depth.
pub const RWB_DEF_DEPTH: u32 = 16;
/// Window length at scale_step ≤ 0 (RWB_WINDOW_NSEC).
pub const RWB_WINDOW_NSEC: u64 = 100 * NSEC_PER_MSEC;
/// A window needs this many write samples (and one read) to judge reads by.
pub const RWB_MIN_WRITE_SAMPLES: u64 = 3;
/// Windows without enough information before the step moves one toward 0.
pub const RWB_UNKNOWN_BUMP: u32 = 5;
/// A balance_dirty_pages sleep this recent means writeback must go at full depth.
pub const RECENT_WAIT_NSEC: u64 = NSEC_PER_SEC;
/// A read issued or completed this recently makes buffered writes background.
pub const CLOSE_IO_NSEC: u64 = 100 * NSEC_PER_MSEC;
pub const DEFAULT_LAT_USEC_NONROT: u64 = 2_000;
pub const DEFAULT_LAT_USEC_ROT: u64 = 75_000;

/// The per-request wbt state, kept in `Request::wbt_flags` (the kernel's wbt_flags).
pub mod flags {
    /// A write or discard counted in a wait queue's inflight.
    pub const TRACKED: u8 = 1;
    pub const READ: u8 = 2;
    /// Counted in the discard queue rather than the writeback one.
    pub const DISCARD: u8 = 8;
    /// Dispatched while the window was armed, so `io_start_ns` is a service-latency
    /// stamp (the kernel's RQF_STATS).
    pub const STAT: u8 = 16;
}

/// The wait queues (rq_wait): buffered writes and discards.
pub const RWQ_BG: usize = 0;
pub const RWQ_DISCARD: usize = 1;
const NR_RWQ: usize = 2;

const NEVER: u64 = u64::MAX;

#[inline]
fn rwq_index(wb_acct: u8) -> usize {
    if wb_acct & flags::DISCARD != 0 {
        RWQ_DISCARD
    } else {
        RWQ_BG
    }
}

/// How wbt came to be on or off. A manual setting (`wbt_lat_usec` written) pins it:
/// only another manual setting changes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EnableState {
    OnDefault = 1,
    OnManual = 2,
    OffDefault = 3,
    OffManual = 4,
}

impl EnableState {
    fn from_u8(v: u8) -> EnableState {
        match v {
            1 => EnableState::OnDefault,
            2 => EnableState::OnManual,
            3 => EnableState::OffDefault,
            _ => EnableState::OffManual,
        }
    }
    pub fn is_on(self) -> bool {
        matches!(self, EnableState::OnDefault | EnableState::OnManual)
    }
}

/// The verdict on one window (latency_exceeded).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LatStatus {
    /// Reads met the target with writes going on: allow more depth.
    Ok,
    /// Not enough samples and nothing written: drift back toward step 0.
    Unknown,
    /// Not enough reads to judge, but writes going on: allow more depth.
    UnknownWrites,
    /// Reads were too slow: cut depth.
    Exceeded,
}

/// How a window's reads are judged against the target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WbtJudge {
    /// The kernel's wbt: exceeded when even the fastest read of the window missed the
    /// target. Blind to writes that come in bursts with idle gaps between them: a read
    /// that lands in a gap is fast, whatever the reads behind a burst waited.
    Min = 0,
    /// blk-iolatency's rule: exceeded when at least one read in ten missed the target
    /// (on a rotational device, when the mean read did), so the tail is what counts.
    Tail = 1,
}

impl WbtJudge {
    pub fn parse(s: &str) -> Option<WbtJudge> {
        match s.trim() {
            "min" => Some(WbtJudge::Min),
            "tail" => Some(WbtJudge::Tail),
            _ => None,
        }
    }
}

/// Depth scaling (struct rq_depth).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct RqDepth {
    pub scale_step: i32,
    /// Scaling up hit the cap: further scale-ups are refused.
    pub scaled_max: bool,
    pub queue_depth: u32,
    pub default_depth: u32,
    pub max_depth: u32,
}

impl RqDepth {
    pub fn new(queue_depth: u32) -> RqDepth {
        let mut d = RqDepth {
            scale_step: 0,
            scaled_max: false,
            queue_depth: queue_depth.max(1),
            default_depth: RWB_DEF_DEPTH,
            max_depth: 0,
        };
        d.calc_max_depth();
        d
    }

    /// Set max_depth from scale_step; true when depth cannot grow further
    /// (rq_depth_calc_max_depth).
    pub fn calc_max_depth(&mut self) -> bool {
        // A QD 1 device gets depth 2 so one request is ready when the other completes;
        // scaled down it keeps 1.
        if self.queue_depth == 1 {
            if self.scale_step > 0 {
                self.max_depth = 1;
                return false;
            }
            self.max_depth = 2;
            return true;
        }
        let base = self.default_depth.min(self.queue_depth).max(1);
        let mut capped = false;
        let depth = match self.scale_step {
            s if s > 0 => 1 + ((base - 1) >> s.min(31)),
            0 => base,
            s => {
                let maxd = (3 * self.queue_depth as u64 / 4) as u32;
                let shift = s.unsigned_abs().min(63);
                let d =
                    1u64.saturating_add(((base - 1) as u64).checked_shl(shift).unwrap_or(u64::MAX));
                if d > maxd as u64 {
                    capped = true;
                    maxd.max(1)
                } else {
                    d as u32
                }
            }
        };
        self.max_depth = depth;
        capped
    }

    /// One step deeper; false when already at the cap (rq_depth_scale_up).
    pub fn scale_up(&mut self) -> bool {
        if self.scaled_max {
            return false;
        }
        self.scale_step -= 1;
        self.scaled_max = self.calc_max_depth();
        true
    }

    /// One step shallower, or straight to 0 from a negative step on a violation; false
    /// at depth 1 (rq_depth_scale_down).
    pub fn scale_down(&mut self, hard_throttle: bool) -> bool {
        if self.max_depth == 1 {
            return false;
        }
        if self.scale_step < 0 && hard_throttle {
            self.scale_step = 0;
        } else {
            self.scale_step += 1;
        }
        self.scaled_max = false;
        self.calc_max_depth();
        true
    }
}

/// Integer square root (the kernel's int_sqrt).
fn isqrt(x: u64) -> u64 {
    // The float root is within one of the answer; squares in u128 cannot overflow.
    let x128 = x as u128;
    let mut r = (x as f64).sqrt() as u128;
    while r * r > x128 {
        r -= 1;
    }
    while (r + 1) * (r + 1) <= x128 {
        r += 1;
    }
    r as u64
}

/// Window length at `step`: win·16/isqrt(256·(step+1)) ≈ win/√(step+1) when scaled
/// down, so a struggling device is re-judged sooner; `win` otherwise.
pub fn window_nsec(win_nsec: u64, step: i32) -> u64 {
    if step > 0 {
        let root = isqrt(((step as u64) + 1) << 8).max(1);
        (win_nsec << 4) / root
    } else {
        win_nsec
    }
}

/// A change of depth, for the `wbt_step` trace event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct StepChange {
    pub reason: &'static str,
    pub scale_step: i32,
    pub max_depth: u32,
    pub wb_normal: u32,
    pub wb_background: u32,
    /// The window the next evaluation uses.
    pub window_nsec: u64,
}

/// What one window evaluation decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WindowOutcome {
    /// None when wbt is off (nothing evaluated).
    pub status: Option<LatStatus>,
    /// Tracked requests in flight when the window closed.
    pub inflight: u32,
    pub step: Option<StepChange>,
    /// The latency that made the window EXCEEDED (`wbt_lat`).
    pub lat_nsec: Option<u64>,
    /// The window's stats, when the kernel would trace them (`wbt_stat`).
    pub stat: Option<[LatBucket; 2]>,
    /// Depth grew: every waiter should retry.
    pub wake_all: bool,
    /// Keep the timer running (step ≠ 0 or tracked IO in flight).
    pub rearm: bool,
}

/// The controller's state, for tools and tests.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WbtState {
    pub enable_state: EnableState,
    pub enabled: bool,
    pub min_lat_nsec: u64,
    pub scale_step: i32,
    pub scaled_max: bool,
    pub queue_depth: u32,
    pub max_depth: u32,
    pub wb_normal: u32,
    pub wb_background: u32,
    pub win_nsec: u64,
    pub cur_win_nsec: u64,
    pub unknown_cnt: u32,
    pub wc: bool,
    /// Depth grows only after windows in which the limit held a request back.
    pub scale_up_when_limited: bool,
    pub judge: WbtJudge,
    /// Tracked requests in flight [background writes, discards].
    pub inflight: [u32; 2],
    /// Windows evaluated so far.
    pub windows: u64,
    pub last_status: Option<LatStatus>,
    /// Set by the policy: the window timer is armed (stats are being collected).
    pub armed: bool,
    /// Set by the policy: bios asleep now [background, discard].
    pub waiting: [u32; 2],
    /// Set by the policy: bios that ever had to sleep [background, discard].
    pub waits: [u64; 2],
}

/// What only the window evaluation and the setters change.
struct Ctl {
    depth: RqDepth,
    unknown_cnt: u32,
    win_nsec: u64,
    cur_win_nsec: u64,
    windows: u64,
    last_status: Option<LatStatus>,
}

/// The wbt controller (struct rq_wb). Fields read on the IO path are atomics read
/// racily, as the kernel reads them; the depth state changes only under `ctl`.
pub struct RqWb {
    enable_state: AtomicU8,
    wb_background: AtomicU32,
    wb_normal: AtomicU32,
    max_depth: AtomicU32,
    min_lat_nsec: AtomicU64,
    wc: AtomicBool,
    rotational: bool,
    /// Last read submission / completion (ns, coarse is enough), NEVER if none.
    last_issue: AtomicU64,
    last_comp: AtomicU64,
    /// Dispatch time and identity of the oldest outstanding read (0 = none).
    sync_issue: AtomicU64,
    sync_cookie: AtomicU64,
    inflight: [AtomicU32; NR_RWQ],
    /// A tracked request found its limit reached since the last window closed.
    limited: AtomicBool,
    /// Grow depth only after a window in which the limit held a request back.
    scale_up_when_limited: AtomicBool,
    /// A `WbtJudge`.
    judge: AtomicU8,
    ctl: Mutex<Ctl>,
}

impl RqWb {
    /// A controller for a queue of `queue_depth` tags. `lat_usec`: None = the default for
    /// the device kind (on by default), Some(0) = off, Some(v) = a manual target.
    pub fn new(queue_depth: u32, rotational: bool, wc: bool, lat_usec: Option<u64>) -> RqWb {
        let rwb = RqWb {
            enable_state: AtomicU8::new(EnableState::OnDefault as u8),
            wb_background: AtomicU32::new(0),
            wb_normal: AtomicU32::new(0),
            max_depth: AtomicU32::new(0),
            min_lat_nsec: AtomicU64::new(Self::default_lat_usec(rotational) * NSEC_PER_USEC),
            wc: AtomicBool::new(wc),
            rotational,
            last_issue: AtomicU64::new(NEVER),
            last_comp: AtomicU64::new(NEVER),
            sync_issue: AtomicU64::new(0),
            sync_cookie: AtomicU64::new(0),
            inflight: Default::default(),
            limited: AtomicBool::new(false),
            scale_up_when_limited: AtomicBool::new(true),
            judge: AtomicU8::new(WbtJudge::Tail as u8),
            ctl: Mutex::new(Ctl {
                depth: RqDepth::new(queue_depth),
                unknown_cnt: 0,
                win_nsec: RWB_WINDOW_NSEC,
                cur_win_nsec: RWB_WINDOW_NSEC,
                windows: 0,
                last_status: None,
            }),
        };
        match lat_usec {
            None => rwb.update_limits(),
            Some(v) => rwb.set_min_lat(v.saturating_mul(NSEC_PER_USEC)),
        }
        rwb
    }

    pub fn default_lat_usec(rotational: bool) -> u64 {
        if rotational {
            DEFAULT_LAT_USEC_ROT
        } else {
            DEFAULT_LAT_USEC_NONROT
        }
    }

    #[inline]
    pub fn enabled(&self) -> bool {
        // OnDefault = 1, OnManual = 2.
        self.enable_state.load(Ordering::Relaxed) <= EnableState::OnManual as u8
    }

    pub fn enable_state(&self) -> EnableState {
        EnableState::from_u8(self.enable_state.load(Ordering::Relaxed))
    }

    pub fn min_lat_nsec(&self) -> u64 {
        self.min_lat_nsec.load(Ordering::Relaxed)
    }

    /// Set the target by hand (sysfs wbt_lat_usec): 0 turns wbt off. Depth goes back to
    /// step 0 at once; the new target judges the window in progress. The caller must
    /// wake every waiter (limits may have grown, or wbt is off).
    pub fn set_min_lat(&self, nsec: u64) {
        self.min_lat_nsec.store(nsec, Ordering::Relaxed);
        let st = if nsec > 0 {
            EnableState::OnManual
        } else {
            EnableState::OffManual
        };
        self.enable_state.store(st as u8, Ordering::Relaxed);
        self.update_limits();
    }

    /// Back to the default target for the device kind, unless pinned by hand
    /// (wbt_enable_default).
    pub fn enable_default(&self) {
        if self.enable_state() == EnableState::OffDefault {
            self.min_lat_nsec.store(
                Self::default_lat_usec(self.rotational) * NSEC_PER_USEC,
                Ordering::Relaxed,
            );
            self.enable_state
                .store(EnableState::OnDefault as u8, Ordering::Relaxed);
            self.update_limits();
        }
    }

    /// Off, unless pinned on by hand (wbt_disable_default, as for an elevator that does
    /// its own throttling). The caller must wake every waiter.
    pub fn disable_default(&self) {
        if self.enable_state() == EnableState::OnDefault {
            self.enable_state
                .store(EnableState::OffDefault as u8, Ordering::Relaxed);
            self.update_limits();
        }
    }

    pub fn set_wc(&self, wc: bool) {
        self.wc.store(wc, Ordering::Relaxed);
    }

    /// true (the default): depth grows after a window only if the limit held a request
    /// back in it. false: the kernel's rule, growth after every window whose reads met
    /// the target or that saw writes alone.
    pub fn set_scale_up_when_limited(&self, on: bool) {
        self.scale_up_when_limited.store(on, Ordering::Relaxed);
    }

    pub fn scale_up_when_limited(&self) -> bool {
        self.scale_up_when_limited.load(Ordering::Relaxed)
    }

    pub fn set_judge(&self, j: WbtJudge) {
        self.judge.store(j as u8, Ordering::Relaxed);
    }

    pub fn judge(&self) -> WbtJudge {
        if self.judge.load(Ordering::Relaxed) == WbtJudge::Min as u8 {
            WbtJudge::Min
        } else {
            WbtJudge::Tail
        }
    }

    /// The queue depth changed (wbt_queue_depth_changed). The caller wakes waiters.
    pub fn set_queue_depth(&self, qd: u32) {
        self.ctl.lock().depth.queue_depth = qd.max(1);
        self.update_limits();
    }

    /// Step 0 and limits from scratch (wbt_update_limits).
    fn update_limits(&self) {
        let mut ctl = self.ctl.lock();
        ctl.depth.scale_step = 0;
        ctl.depth.scaled_max = false;
        ctl.depth.calc_max_depth();
        self.calc_wb_limits(&ctl.depth);
    }

    /// Publish the class limits for `d` (calc_wb_limits).
    fn calc_wb_limits(&self, d: &RqDepth) {
        let (normal, bg) = if self.min_lat_nsec() == 0 {
            (0, 0)
        } else if d.max_depth <= 2 {
            (d.max_depth, 1)
        } else {
            (d.max_depth.div_ceil(2), d.max_depth.div_ceil(4))
        };
        self.max_depth.store(d.max_depth, Ordering::Relaxed);
        self.wb_normal.store(normal, Ordering::Relaxed);
        self.wb_background.store(bg, Ordering::Relaxed);
    }

    /// (max_depth, wb_normal, wb_background).
    pub fn limits(&self) -> (u32, u32, u32) {
        (
            self.max_depth.load(Ordering::Relaxed),
            self.wb_normal.load(Ordering::Relaxed),
            self.wb_background.load(Ordering::Relaxed),
        )
    }

    pub fn depth(&self) -> RqDepth {
        self.ctl.lock().depth
    }

    /// The wbt flags of a bio (bio_to_wbt_flags): reads are only noted; writes are
    /// tracked unless both SYNC and IDLE (O_DIRECT) are set; discards are tracked in
    /// their own queue; flushes are not seen at all.
    #[inline]
    pub fn classify(&self, op: Op, bio_flags: BioFlags) -> u8 {
        if !self.enabled() {
            return 0;
        }
        match op {
            Op::Read => flags::READ,
            Op::Write => {
                if bio_flags.contains(BioFlags::SYNC | BioFlags::IDLE) {
                    0
                } else {
                    flags::TRACKED
                }
            }
            Op::Discard => flags::TRACKED | flags::DISCARD,
            Op::Flush => 0,
        }
    }

    /// A read or write was issued or completed within CLOSE_IO_NSEC.
    fn close_io(&self, now: u64) -> bool {
        let recent = |t: u64| t != NEVER && now < t.saturating_add(CLOSE_IO_NSEC);
        recent(self.last_issue.load(Ordering::Relaxed))
            || recent(self.last_comp.load(Ordering::Relaxed))
    }

    /// How many tracked requests of this kind may be in flight (get_limit): discards get
    /// wb_background; SYNC/META writes, or any write while a dirtier slept in the last
    /// second, get max_depth; BACKGROUND writes, or any write within 100 ms of read
    /// activity, wb_background; others wb_normal. Off: unlimited.
    pub fn get_limit(
        &self,
        op: Op,
        bio_flags: BioFlags,
        now: u64,
        recent_wait: impl FnOnce() -> bool,
    ) -> u32 {
        if !self.enabled() {
            return u32::MAX;
        }
        if op == Op::Discard {
            return self.wb_background.load(Ordering::Relaxed);
        }
        if bio_flags.intersects(BioFlags::SYNC | BioFlags::META) || recent_wait() {
            self.max_depth.load(Ordering::Relaxed)
        } else if bio_flags.contains(BioFlags::BACKGROUND) || self.close_io(now) {
            self.wb_background.load(Ordering::Relaxed)
        } else {
            self.wb_normal.load(Ordering::Relaxed)
        }
    }

    /// Take one slot of queue `rwq` if fewer than `limit` are in flight
    /// (rq_wait_inc_below).
    #[inline]
    pub fn inc_below(&self, rwq: usize, limit: u32) -> bool {
        let a = &self.inflight[rwq];
        // SeqCst loads, the failed exchange's too: a first sleeper stores `sleepers`
        // and then tries here again, while a completion drops `inflight` and then
        // looks at `sleepers` (store-buffer pattern). Only with all four in the single
        // SeqCst order must one side see the other's write; with a relaxed load here,
        // a weakly ordered CPU may let the sleeper see the old count while the
        // completion sees no sleeper, and nobody wakes it. On x86 the loads cost
        // nothing more.
        let mut cur = a.load(Ordering::SeqCst);
        loop {
            if cur >= limit {
                if !self.limited.load(Ordering::Relaxed) {
                    self.limited.store(true, Ordering::Relaxed);
                }
                return false;
            }
            match a.compare_exchange_weak(cur, cur + 1, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => return true,
                Err(c) => cur = c,
            }
        }
    }

    /// A tracked request completed (wbt_rqw_done): drop its slot and say whether the
    /// sleepers of its queue should be woken. With a volatile write cache and no dirtier
    /// waiting, writers wait until the queue has drained completely; otherwise they are
    /// woken in batches of at least wb_background/2.
    pub fn rqw_done(
        &self,
        wb_acct: u8,
        recent_wait: impl FnOnce() -> bool,
        has_sleeper: impl FnOnce() -> bool,
    ) -> bool {
        let rwq = rwq_index(wb_acct);
        // Only a request its throttle counted in carries TRACKED (switching wbt on
        // with requests in flight leaves theirs unmarked), so the count cannot be 0
        // here. Were it, a wrap would shut the class for good: debug builds stop on
        // the impossible completion, release builds leave the count at 0.
        let Ok(prev) = self.inflight[rwq]
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1))
        else {
            debug_assert!(
                false,
                "a tracked completion of class {rwq} with none in flight"
            );
            return false;
        };
        let inflight = prev - 1;
        let bg = self.wb_background.load(Ordering::Relaxed);
        let limit = if rwq == RWQ_DISCARD {
            bg
        } else if self.wc.load(Ordering::Relaxed) && !recent_wait() {
            0
        } else {
            self.wb_normal.load(Ordering::Relaxed)
        };
        if inflight != 0 && inflight >= limit {
            return false;
        }
        if !has_sleeper() {
            return false;
        }
        let diff = limit as i64 - inflight as i64;
        inflight == 0 || diff >= (bg / 2) as i64
    }

    pub fn inflight(&self, rwq: usize) -> u32 {
        self.inflight[rwq.min(NR_RWQ - 1)].load(Ordering::Relaxed)
    }

    pub fn inflight_total(&self) -> u32 {
        self.inflight
            .iter()
            .map(|a| a.load(Ordering::Relaxed))
            .sum()
    }

    /// Stamp `last_issue` (a read was submitted at `now`); written only when it changed,
    /// so a read-heavy load does not bounce the line.
    #[inline]
    pub fn read_submitted(&self, now: u64) {
        if self.last_issue.load(Ordering::Relaxed) != now {
            self.last_issue.store(now, Ordering::Relaxed);
        }
    }

    /// A read reached the device at `io_start`: it becomes the watched read if none is.
    /// `cookie` identifies the request among those in flight; 0 is not a valid cookie.
    #[inline]
    pub fn read_issued(&self, cookie: u64, io_start: u64) {
        if cookie != 0
            && self.sync_cookie.load(Ordering::Relaxed) == 0
            && self
                .sync_cookie
                .compare_exchange(0, cookie, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            self.sync_issue.store(io_start, Ordering::Release);
        }
    }

    /// A read completed at `now` (coarse is enough).
    #[inline]
    pub fn read_done(&self, cookie: u64, now: u64) {
        if cookie != 0 && self.sync_cookie.load(Ordering::Relaxed) == cookie {
            self.sync_issue.store(0, Ordering::Relaxed);
            self.sync_cookie.store(0, Ordering::Release);
        }
        if self.last_comp.load(Ordering::Relaxed) != now {
            self.last_comp.store(now, Ordering::Relaxed);
        }
    }

    /// How long the watched read has been at the device (rwb_sync_issue_lat).
    fn sync_issue_lat(&self, now: u64) -> u64 {
        if self.sync_cookie.load(Ordering::Acquire) == 0 {
            return 0;
        }
        // The cookie is published before the stamp and retired after it is cleared:
        // between the two there is no start to measure from, and measuring from 0
        // would judge the window by the whole clock.
        match self.sync_issue.load(Ordering::Acquire) {
            0 => 0,
            issue => now.saturating_sub(issue),
        }
    }

    /// Start a window: its length from the current step (rwb_arm_timer).
    pub fn arm_window(&self) -> u64 {
        let mut ctl = self.ctl.lock();
        ctl.cur_win_nsec = window_nsec(ctl.win_nsec, ctl.depth.scale_step);
        ctl.cur_win_nsec
    }

    fn latency_exceeded(
        &self,
        ctl: &Ctl,
        now: u64,
        stat: &[LatBucket; 2],
        recent_wait: bool,
        inflight: u32,
        out: &mut WindowOutcome,
    ) -> LatStatus {
        let min_lat = self.min_lat_nsec();
        let [read, write] = stat;
        // A read stuck at a flooded device may not complete for several windows:
        // judge it by how long it has been waiting.
        let thislat = self.sync_issue_lat(now);
        if thislat > ctl.cur_win_nsec || (thislat > min_lat && read.nr == 0) {
            out.lat_nsec = Some(thislat);
            return LatStatus::Exceeded;
        }
        // Reads alone may be a device waking from a low-power state: writes must be
        // there too before reads are blamed on them.
        if !(read.nr >= 1 && write.nr >= RWB_MIN_WRITE_SAMPLES) {
            if write.nr > 0 || recent_wait || inflight > 0 {
                return LatStatus::UnknownWrites;
            }
            return LatStatus::Unknown;
        }
        let late = match self.judge() {
            // The fastest read was too slow: that is queueing, not device noise.
            WbtJudge::Min => (read.min_ns > min_lat).then_some(read.min_ns),
            WbtJudge::Tail if self.rotational => {
                (read.mean_ns() > min_lat).then_some(read.mean_ns())
            }
            // A tenth of the reads late (at least one): reads queue behind writes often
            // enough to matter, whether or not some found the device idle.
            WbtJudge::Tail => (read.missed >= (read.nr / 10).max(1)).then_some(read.max_ns),
        };
        if let Some(lat) = late {
            out.lat_nsec = Some(lat);
            out.stat = Some(*stat);
            return LatStatus::Exceeded;
        }
        if ctl.depth.scale_step != 0 {
            out.stat = Some(*stat);
        }
        LatStatus::Ok
    }

    fn step_change(&self, ctl: &Ctl, reason: &'static str) -> StepChange {
        let (max_depth, wb_normal, wb_background) = self.limits();
        StepChange {
            reason,
            scale_step: ctl.depth.scale_step,
            max_depth,
            wb_normal,
            wb_background,
            window_nsec: window_nsec(ctl.win_nsec, ctl.depth.scale_step),
        }
    }

    fn scale_up(&self, ctl: &mut Ctl, out: &mut WindowOutcome) {
        if !ctl.depth.scale_up() {
            return;
        }
        self.calc_wb_limits(&ctl.depth);
        ctl.unknown_cnt = 0;
        out.wake_all = true;
        out.step = Some(self.step_change(ctl, "scale up"));
    }

    fn scale_down(&self, ctl: &mut Ctl, hard_throttle: bool, out: &mut WindowOutcome) {
        if !ctl.depth.scale_down(hard_throttle) {
            return;
        }
        self.calc_wb_limits(&ctl.depth);
        ctl.unknown_cnt = 0;
        out.step = Some(self.step_change(ctl, "scale down"));
    }

    /// The window ended at `now` with these [read, write] service-latency stats
    /// (wb_timer_fn). `recent_wait`: a dirtier slept within the last second.
    pub fn timer_fn(&self, now: u64, stat: &[LatBucket; 2], recent_wait: bool) -> WindowOutcome {
        let inflight = self.inflight_total();
        let mut out = WindowOutcome {
            status: None,
            inflight,
            step: None,
            lat_nsec: None,
            stat: None,
            wake_all: false,
            rearm: false,
        };
        let mut ctl = self.ctl.lock();
        ctl.windows += 1;
        if !self.enabled() {
            ctl.last_status = None;
            return out;
        }
        let status = self.latency_exceeded(&ctl, now, stat, recent_wait, inflight, &mut out);
        let limited = self.limited.swap(false, Ordering::Relaxed);
        match status {
            LatStatus::Exceeded => self.scale_down(&mut ctl, true, &mut out),
            // Writes without enough reads to judge may go deeper than the default. Only
            // a limit that held writes back needs raising: raised while unused, it would
            // let the next burst fill the queue unchecked until windows of slow reads
            // brought it down again (TCP's congestion window validation, RFC 7661).
            LatStatus::Ok | LatStatus::UnknownWrites => {
                if limited || !self.scale_up_when_limited() {
                    self.scale_up(&mut ctl, &mut out)
                }
            }
            LatStatus::Unknown => {
                ctl.unknown_cnt += 1;
                if ctl.unknown_cnt >= RWB_UNKNOWN_BUMP {
                    if ctl.depth.scale_step > 0 {
                        self.scale_up(&mut ctl, &mut out);
                    } else if ctl.depth.scale_step < 0 {
                        self.scale_down(&mut ctl, false, &mut out);
                    }
                }
            }
        }
        ctl.last_status = Some(status);
        out.status = Some(status);
        out.rearm = ctl.depth.scale_step != 0 || inflight > 0;
        out
    }

    /// Everything but the policy's fields (armed, waiting, waits).
    pub fn state(&self) -> WbtState {
        let ctl = self.ctl.lock();
        let (max_depth, wb_normal, wb_background) = self.limits();
        WbtState {
            enable_state: self.enable_state(),
            enabled: self.enabled(),
            min_lat_nsec: self.min_lat_nsec(),
            scale_step: ctl.depth.scale_step,
            scaled_max: ctl.depth.scaled_max,
            queue_depth: ctl.depth.queue_depth,
            max_depth,
            wb_normal,
            wb_background,
            win_nsec: ctl.win_nsec,
            cur_win_nsec: ctl.cur_win_nsec,
            unknown_cnt: ctl.unknown_cnt,
            wc: self.wc.load(Ordering::Relaxed),
            scale_up_when_limited: self.scale_up_when_limited(),
            judge: self.judge(),
            inflight: [self.inflight(RWQ_BG), self.inflight(RWQ_DISCARD)],
            windows: ctl.windows,
            last_status: ctl.last_status,
            armed: false,
            waiting: [0; 2],
            waits: [0; 2],
        }
    }
}

// ---- The policy ---------------------------------------------------------------------

/// Time (clock ns) of the last balance_dirty_pages sleep on the queue's device, None if
/// there never was one.
pub type DirtySleepFn = Arc<dyn Fn() -> Option<u64> + Send + Sync>;

/// How to build a [`Wbt`].
#[derive(Clone)]
pub struct WbtConfig {
    /// Tags the device can have in flight per hardware queue.
    pub queue_depth: u32,
    pub rotational: bool,
    /// The device has a volatile write cache.
    pub wc: bool,
    /// None = the default for the device kind; Some(0) = off; Some(v) = v µs, pinned.
    pub lat_usec: Option<u64>,
    pub clock: ClockRef,
    /// Names the queue in trace events.
    pub queue_id: u64,
}

struct WaitEntry {
    granted: AtomicBool,
    thread: Thread,
    op: Op,
    flags: BioFlags,
}

/// One exclusive FIFO wait queue (rq_wait's wait_queue_head).
#[derive(Default)]
struct RqWaitQ {
    list: Mutex<VecDeque<Arc<WaitEntry>>>,
    /// list.len(), readable without the lock (wq_has_sleeper).
    sleepers: AtomicU32,
}

#[derive(Default)]
struct TimerState {
    deadline: Option<u64>,
    /// A window is being evaluated: arming now would race it.
    running: bool,
    /// A tracked write arrived while the timer was evaluating.
    arm_requested: bool,
    stop: bool,
}

struct Shared {
    rwb: RqWb,
    rqw: [RqWaitQ; NR_RWQ],
    win: LatencyWindow,
    timer: Mutex<TimerState>,
    waiter: Arc<Waiter>,
    clock: ClockRef,
    dirty_sleep: RwLock<Option<DirtySleepFn>>,
    /// The hook's last answer (NEVER for none) and the time it was asked: the hook is
    /// asked at most once per clock tick, because a read-lock per tracked write cost a
    /// fifth of a null-device write, and the 1 s rule does not notice a tick.
    dirty_sleep_cache: AtomicU64,
    dirty_sleep_asked: AtomicU64,
    waits: [AtomicU64; NR_RWQ],
    /// Windows evaluated and followed through (timer re-armed or stopped).
    windows_done: AtomicU64,
    queue_id: u64,
}

/// The wbt rq_qos policy of one queue.
pub struct Wbt {
    sh: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// Identifies an in-flight request by its tag (the kernel compares request pointers).
#[inline]
pub fn rq_cookie(rq: &Request) -> u64 {
    (((rq.hctx as u64) << 32) | rq.tag as u64) + 1
}

impl Shared {
    fn recent_wait(&self, now: u64) -> bool {
        let last = if self.dirty_sleep_asked.load(Ordering::Relaxed) == now {
            self.dirty_sleep_cache.load(Ordering::Relaxed)
        } else {
            let last = match &*self.dirty_sleep.read() {
                Some(f) => f().unwrap_or(NEVER),
                None => NEVER,
            };
            self.dirty_sleep_cache.store(last, Ordering::Relaxed);
            self.dirty_sleep_asked.store(now, Ordering::Relaxed);
            last
        };
        last != NEVER && now < last.saturating_add(RECENT_WAIT_NSEC)
    }

    fn acquire(&self, rwq: usize, op: Op, bio_flags: BioFlags, now: u64) -> bool {
        let limit = self
            .rwb
            .get_limit(op, bio_flags, now, || self.recent_wait(now));
        self.rwb.inc_below(rwq, limit)
    }

    /// Hand slots to the sleepers of `rwq` in FIFO order until one does not fit
    /// (wake_up_all with rq_qos_wake_function).
    fn wake_all(&self, rwq: usize, now: u64) {
        let q = &self.rqw[rwq];
        if q.sleepers.load(Ordering::SeqCst) == 0 {
            return;
        }
        let mut recent: Option<bool> = None;
        let mut l = q.list.lock();
        while let Some(front) = l.front() {
            let limit = self.rwb.get_limit(front.op, front.flags, now, || {
                *recent.get_or_insert_with(|| self.recent_wait(now))
            });
            if !self.rwb.inc_below(rwq, limit) {
                break;
            }
            if let Some(e) = l.pop_front() {
                e.granted.store(true, Ordering::Release);
                e.thread.unpark();
            }
        }
        q.sleepers.store(l.len() as u32, Ordering::SeqCst);
    }

    fn wake_everyone(&self, now: u64) {
        for rwq in 0..NR_RWQ {
            self.wake_all(rwq, now);
        }
    }

    /// Give back a slot of a tracked request and wake whoever it lets in.
    fn put(&self, wb_acct: u8, now: u64) {
        let rwq = rwq_index(wb_acct);
        // SeqCst after rqw_done's SeqCst decrement, against a sleeper's store and
        // retry (see `RqWb::inc_below`).
        let wake = self.rwb.rqw_done(
            wb_acct,
            || self.recent_wait(now),
            || self.rqw[rwq].sleepers.load(Ordering::SeqCst) > 0,
        );
        if wake {
            self.wake_all(rwq, now);
        }
    }

    /// Start a window (blk_stat_activate_nsecs): clear the stats, collect from now on.
    fn arm_locked(&self, st: &mut TimerState, now: u64) {
        let len = self.rwb.arm_window();
        self.win.set_threshold(self.rwb.min_lat_nsec());
        self.win.take();
        st.deadline = Some(now.saturating_add(len));
        self.win.arm(true);
        self.waiter.kick();
    }

    fn arm(&self, now: u64) {
        let mut st = self.timer.lock();
        if st.stop || st.deadline.is_some() {
            return;
        }
        if st.running {
            st.arm_requested = true;
            return;
        }
        self.arm_locked(&mut st, now);
    }

    /// Close the window at `now` and act on it; true to keep the timer running.
    fn window(&self, now: u64) -> bool {
        let stat = self.win.take();
        let recent = self.recent_wait(now);
        let out = self.rwb.timer_fn(now, &stat, recent);
        let id = self.queue_id;
        if let Some(lat) = out.lat_nsec {
            trace::emit("wbt_lat", || json!({ "dev": id, "lat_nsec": lat }));
        }
        if let Some([r, w]) = out.stat {
            trace::emit("wbt_stat", || {
                json!({
                    "dev": id,
                    "rmin": r.min_ns, "rmax": r.max_ns, "rmean": r.mean_ns(), "rnr": r.nr,
                    "wmin": w.min_ns, "wmax": w.max_ns, "wmean": w.mean_ns(), "wnr": w.nr,
                })
            });
        }
        if let Some(s) = out.status {
            let step = self.rwb.depth().scale_step;
            trace::emit(
                "wbt_timer",
                || json!({ "dev": id, "status": s, "step": step, "inflight": out.inflight }),
            );
        }
        if let Some(c) = out.step {
            trace::emit("wbt_step", || {
                json!({
                    "dev": id, "msg": c.reason, "step": c.scale_step,
                    "window_nsec": c.window_nsec, "bg": c.wb_background,
                    "normal": c.wb_normal, "max": c.max_depth,
                })
            });
        }
        if out.wake_all {
            self.wake_everyone(self.clock.coarse_ns());
        }
        out.rearm
    }
}

fn timer_thread(sh: Arc<Shared>) {
    loop {
        let mut st = sh.timer.lock();
        if st.stop {
            return;
        }
        let Some(deadline) = st.deadline else {
            drop(st);
            sh.waiter.wait();
            continue;
        };
        let now = sh.clock.now_ns();
        if now < deadline {
            drop(st);
            sh.clock.wait_until(&sh.waiter, deadline);
            continue;
        }
        st.deadline = None;
        st.running = true;
        st.arm_requested = false;
        // Completions during the evaluation are not samples of either window.
        sh.win.arm(false);
        drop(st);
        let rearm = sh.window(now);
        let mut st = sh.timer.lock();
        st.running = false;
        if (rearm || st.arm_requested) && !st.stop {
            st.arm_requested = false;
            sh.arm_locked(&mut st, sh.clock.now_ns());
        }
        sh.windows_done.fetch_add(1, Ordering::Release);
    }
}

impl Wbt {
    pub fn new(cfg: WbtConfig) -> Wbt {
        let waiter = Waiter::new();
        cfg.clock.register_waiter(&waiter);
        Wbt {
            sh: Arc::new(Shared {
                rwb: RqWb::new(cfg.queue_depth, cfg.rotational, cfg.wc, cfg.lat_usec),
                rqw: Default::default(),
                win: LatencyWindow::default(),
                timer: Mutex::new(TimerState::default()),
                waiter,
                clock: cfg.clock,
                dirty_sleep: RwLock::new(None),
                dirty_sleep_cache: AtomicU64::new(NEVER),
                dirty_sleep_asked: AtomicU64::new(NEVER),
                waits: Default::default(),
                windows_done: AtomicU64::new(0),
                queue_id: cfg.queue_id,
            }),
            thread: Mutex::new(None),
        }
    }

    /// The controller, for reading its state or driving it directly.
    pub fn rwb(&self) -> &RqWb {
        &self.sh.rwb
    }

    #[inline]
    pub fn enabled(&self) -> bool {
        self.sh.rwb.enabled()
    }

    /// The window timer is armed: service latencies are being collected.
    #[inline]
    pub fn is_armed(&self) -> bool {
        self.sh.win.is_armed()
    }

    /// The latency target in µs; 0 = off (sysfs wbt_lat_usec).
    pub fn lat_usec(&self) -> u64 {
        if self.enabled() {
            self.sh.rwb.min_lat_nsec() / NSEC_PER_USEC
        } else {
            0
        }
    }

    /// Set the latency target in µs, 0 = off. Pins the setting like a write to
    /// wbt_lat_usec. Takes effect at once for admission (step 0, waiters retried) and
    /// at the end of the current window for the latency verdict.
    pub fn set_lat_usec(&self, usec: u64) {
        self.sh.rwb.set_min_lat(usec.saturating_mul(NSEC_PER_USEC));
        // Reads completing from now on count as missed against the new target.
        self.sh.win.set_threshold(self.sh.rwb.min_lat_nsec());
        self.sh.wake_everyone(self.sh.clock.coarse_ns());
    }

    /// How windows' reads are judged: the fastest (the kernel) or the tail.
    pub fn set_judge(&self, j: WbtJudge) {
        self.sh.rwb.set_judge(j);
    }

    /// Grow depth only after windows in which the limit held a request back (true, the
    /// default), or after every window whose reads met the target (false, the kernel).
    pub fn set_scale_up_when_limited(&self, on: bool) {
        self.sh.rwb.set_scale_up_when_limited(on);
    }

    /// Back to the default target unless a manual setting pins it.
    pub fn enable_default(&self) {
        self.sh.rwb.enable_default();
        self.sh.wake_everyone(self.sh.clock.coarse_ns());
    }

    /// Off unless a manual setting pins it on.
    pub fn disable_default(&self) {
        self.sh.rwb.disable_default();
        self.sh.wake_everyone(self.sh.clock.coarse_ns());
    }

    /// Where wbt learns of dirtier sleeps in balance_dirty_pages (the kernel reads the
    /// bdi's last_bdp_sleep). Without it, no dirtier ever slept. It is asked at most
    /// once per tick of the queue's clock (coarse clock tick, or each manual change).
    /// The writeback side holds the queue, so the hook must hold it weakly (a `Weak`
    /// of the bdi), or neither is ever freed.
    pub fn set_dirty_sleep_fn(&self, f: Option<DirtySleepFn>) {
        *self.sh.dirty_sleep.write() = f;
        self.sh.dirty_sleep_asked.store(NEVER, Ordering::Relaxed);
    }

    pub fn set_wc(&self, wc: bool) {
        self.sh.rwb.set_wc(wc);
    }

    pub fn set_queue_depth(&self, qd: u32) {
        self.sh.rwb.set_queue_depth(qd);
        self.sh.wake_everyone(self.sh.clock.coarse_ns());
    }

    /// Controller state plus the policy's counters. `windows` counts windows whose
    /// evaluation is over, timer re-armed or stopped included.
    pub fn state(&self) -> WbtState {
        let mut s = self.sh.rwb.state();
        s.windows = self.sh.windows_done.load(Ordering::Acquire);
        s.armed = self.is_armed();
        for i in 0..NR_RWQ {
            s.waiting[i] = self.sh.rqw[i].sleepers.load(Ordering::Relaxed);
            s.waits[i] = self.sh.waits[i].load(Ordering::Relaxed);
        }
        s
    }

    /// Admission of a bio that will become a request (wbt_wait). Reads are only
    /// stamped; a tracked write or discard sleeps while its class is at its limit.
    /// `now` is the coarse time. Returns the request's wbt flags and whether it slept.
    #[inline]
    pub fn throttle(&self, bio: &Bio, now: u64) -> (u8, bool) {
        let f = self.sh.rwb.classify(bio.op, bio.flags);
        if f & flags::TRACKED == 0 {
            if f & flags::READ != 0 {
                self.sh.rwb.read_submitted(now);
            }
            return (f, false);
        }
        let slept = self.wait(f, bio.op, bio.flags, now);
        if !self.is_armed() {
            self.start_timer();
        }
        (f, slept)
    }

    /// rq_qos_wait: the fast path takes a slot when nobody is queued; otherwise join
    /// the FIFO and let completions hand a slot over.
    fn wait(&self, wb_acct: u8, op: Op, bio_flags: BioFlags, now: u64) -> bool {
        let rwq = rwq_index(wb_acct);
        let q = &self.sh.rqw[rwq];
        if q.sleepers.load(Ordering::SeqCst) == 0 && self.sh.acquire(rwq, op, bio_flags, now) {
            return false;
        }
        let me = Arc::new(WaitEntry {
            granted: AtomicBool::new(false),
            thread: std::thread::current(),
            op,
            flags: bio_flags,
        });
        let first = {
            let mut l = q.list.lock();
            let first = l.is_empty();
            l.push_back(me.clone());
            q.sleepers.store(l.len() as u32, Ordering::SeqCst);
            first
        };
        // With nobody in flight nobody would wake us: the first sleeper retries after
        // queueing itself, which a completion racing with us then also sees.
        if first
            && self
                .sh
                .acquire(rwq, op, bio_flags, self.sh.clock.coarse_ns())
        {
            let mut l = q.list.lock();
            if let Some(pos) = l.iter().position(|e| Arc::ptr_eq(e, &me)) {
                l.remove(pos);
            }
            q.sleepers.store(l.len() as u32, Ordering::SeqCst);
            drop(l);
            if me.granted.load(Ordering::Acquire) {
                // A waker handed us a slot too: give one back.
                self.sh.put(wb_acct, self.sh.clock.coarse_ns());
            }
            return false;
        }
        self.sh.waits[rwq].fetch_add(1, Ordering::Relaxed);
        // Our own plugged requests may hold the slots we wait for.
        crate::block::plug::flush_plug();
        while !me.granted.load(Ordering::Acquire) {
            // A thread that polls must reap its own requests, which may hold the slot.
            if crate::dev::uring::poll_own_rings(crate::block::queue::OWN_POLL_NS).is_none() {
                std::thread::park();
            }
        }
        true
    }

    fn start_timer(&self) {
        {
            let mut t = self.thread.lock();
            if t.is_none() {
                let sh = self.sh.clone();
                match std::thread::Builder::new()
                    .name(format!("wbt-timer-{}", self.sh.queue_id))
                    .spawn(move || timer_thread(sh))
                {
                    Ok(h) => *t = Some(h),
                    // Without a timer the depth stays where it is; IO still flows.
                    Err(_) => return,
                }
            }
        }
        self.sh.arm(self.sh.clock.now_ns());
    }

    /// The request reached the device at `io_start` (wbt_issue). Only a read
    /// dispatched while the window is armed (flags::STAT: `io_start` is a fine-clock
    /// stamp) can become the watched read.
    #[inline]
    pub fn issue(&self, rq: &Request, wbt_flags: u8, io_start: u64) {
        if wbt_flags & flags::READ != 0 && wbt_flags & flags::STAT != 0 {
            self.sh.rwb.read_issued(rq_cookie(rq), io_start);
        }
    }

    /// A service-latency sample for the current window.
    #[inline]
    pub fn add_sample(&self, op: Op, lat_ns: u64) {
        if self.sh.win.is_armed() {
            self.sh.win.add(op, lat_ns);
        }
    }

    /// The request completed at `now` (coarse is enough) (wbt_done).
    #[inline]
    pub fn done(&self, rq: &Request, wbt_flags: u8, now: u64) {
        if wbt_flags & flags::TRACKED != 0 {
            self.sh.put(wbt_flags, now);
        } else if wbt_flags & flags::READ != 0 {
            self.sh.rwb.read_done(rq_cookie(rq), now);
        }
    }
}

impl Drop for Wbt {
    fn drop(&mut self) {
        self.sh.timer.lock().stop = true;
        self.sh.waiter.kick();
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

/// For queues that chain wbt with other policies by hand: flags travel in
/// `Request::qos_flags`. Queues carry their own wbt already (`RequestQueue::wbt`).
impl RqQos for Wbt {
    fn name(&self) -> &'static str {
        "wbt"
    }
    fn throttle(&self, bio: &Bio) -> u8 {
        if !self.enabled() {
            return 0;
        }
        let f = Wbt::throttle(self, bio, self.sh.clock.coarse_ns()).0;
        // The chain stamps every request's io_start with the fine clock.
        f | flags::STAT
    }
    fn issue(&self, rq: &Request, now_ns: u64) {
        if self.is_armed() {
            Wbt::issue(self, rq, rq.qos_flags, now_ns);
        }
    }
    fn done(&self, rq: &Request, now_ns: u64) {
        if rq.qos_flags & flags::STAT != 0 {
            self.add_sample(rq.op, now_ns.saturating_sub(rq.io_start_ns));
        }
        Wbt::done(self, rq, rq.qos_flags, now_ns);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = NSEC_PER_MSEC;

    /// `nr` reads of `min_ns` each, judged against 2 ms.
    fn bucket(nr: u64, min_ns: u64) -> LatBucket {
        LatBucket {
            nr,
            min_ns,
            max_ns: min_ns,
            sum_ns: min_ns.saturating_mul(nr),
            missed: if min_ns > 2 * MS { nr } else { 0 },
        }
    }
    fn none() -> LatBucket {
        LatBucket::default()
    }
    fn lims(r: &RqWb) -> (i32, u32, u32, u32) {
        let (m, n, b) = r.limits();
        (r.depth().scale_step, m, n, b)
    }
    /// The kernel's scenarios run under the kernel's growth rule; the
    /// `scale_up_when_limited` tests cover ours.
    fn kernel(r: RqWb) -> RqWb {
        r.set_scale_up_when_limited(false);
        r.set_judge(WbtJudge::Min);
        r
    }

    fn nvme() -> RqWb {
        kernel(RqWb::new(1023, false, false, None))
    }

    /// One window of `stat` ending at `now`: the window evaluation plus the re-arm.
    fn window(r: &RqWb, now: u64, stat: [LatBucket; 2]) -> WindowOutcome {
        let out = r.timer_fn(now, &stat, false);
        if out.rearm {
            r.arm_window();
        }
        out
    }

    #[test]
    fn a_watched_read_without_its_start_stamp_is_not_judged() {
        // read_issued publishes the cookie before the stamp, and read_done clears the
        // stamp before the cookie: a window ending in between sees a cookie and no start.
        let r = nvme();
        r.sync_cookie.store(7, Ordering::Release);
        let out = r.timer_fn(1000 * NSEC_PER_SEC, &[none(), none()], false);
        assert_ne!(out.status, Some(LatStatus::Exceeded), "{out:?}");
        assert_eq!(out.lat_nsec, None);
        // Once stamped, a read at the device for longer than the window is.
        r.sync_issue.store(1000 * NSEC_PER_SEC, Ordering::Release);
        let out = r.timer_fn(1000 * NSEC_PER_SEC + 200 * MS, &[none(), none()], false);
        assert_eq!(out.status, Some(LatStatus::Exceeded), "{out:?}");
    }

    #[test]
    fn isqrt_is_exact() {
        for x in [
            0u64,
            1,
            2,
            3,
            4,
            255,
            256,
            511,
            512,
            768,
            1024,
            1280,
            u64::MAX,
        ] {
            let r = isqrt(x);
            let (r, x) = (r as u128, x as u128);
            assert!(r * r <= x && (r + 1) * (r + 1) > x, "{x}");
        }
    }

    // 4.9 scenario 1.
    #[test]
    fn defaults_by_device_kind() {
        let r = nvme();
        assert_eq!(r.min_lat_nsec(), 2 * MS);
        assert_eq!(r.enable_state(), EnableState::OnDefault);
        assert_eq!(r.limits(), (16, 8, 4));
        let hdd = RqWb::new(32, true, true, None);
        assert_eq!(hdd.min_lat_nsec(), 75 * MS);
        assert_eq!(hdd.limits(), (16, 8, 4));
        // The negative-step cap is 3/4 of the queue depth.
        for (qd, cap) in [(1023u32, 767u32), (32, 24)] {
            let mut d = RqDepth::new(qd);
            while d.scale_up() {}
            assert_eq!(d.max_depth, cap, "qd {qd}");
            assert!(d.scaled_max);
        }
    }

    #[test]
    fn depth_grows_only_after_windows_in_which_the_limit_held_writes_back() {
        let r = RqWb::new(1023, false, false, None);
        assert!(r.scale_up_when_limited(), "our rule is the default");
        let mut t = 0;
        let mut next = |r: &RqWb, stat| {
            t += 100 * MS;
            window(r, t, stat)
        };
        // Reads meet the target while writes flow below the limit: nothing to raise.
        for _ in 0..5 {
            let out = next(&r, [bucket(10, MS / 2), bucket(10, MS / 10)]);
            assert_eq!(out.status, Some(LatStatus::Ok));
            assert_eq!(out.step, None);
        }
        // Writes alone, below the limit: no growth either.
        let out = next(&r, [none(), bucket(500, MS / 10)]);
        assert_eq!(out.status, Some(LatStatus::UnknownWrites));
        assert_eq!(lims(&r), (0, 16, 8, 4));
        // A write turned away at the limit: the window's good verdict raises it.
        for _ in 0..16 {
            assert!(r.inc_below(RWQ_BG, 16));
        }
        assert!(!r.inc_below(RWQ_BG, 16));
        let out = next(&r, [bucket(10, MS / 2), bucket(10, MS / 10)]);
        assert_eq!(out.status, Some(LatStatus::Ok));
        assert_eq!(lims(&r), (-1, 31, 16, 8));
        // The mark covers one window only.
        let out = next(&r, [bucket(10, MS / 2), bucket(10, MS / 10)]);
        assert_eq!(out.step, None);
        assert_eq!(r.depth().scale_step, -1);
        // Slow reads cut depth whether or not the limit was reached.
        let out = next(&r, [bucket(10, 5 * MS), bucket(10, MS / 10)]);
        assert_eq!(out.status, Some(LatStatus::Exceeded));
        assert_eq!(lims(&r), (0, 16, 8, 4));
        let out = next(&r, [bucket(10, 5 * MS), bucket(10, MS / 10)]);
        assert_eq!(out.status, Some(LatStatus::Exceeded));
        assert_eq!(r.depth().scale_step, 1);
        // Scaled down, good windows raise depth only while writes are held back.
        let out = next(&r, [bucket(10, MS / 2), bucket(10, MS / 10)]);
        assert_eq!(out.step, None);
        assert!(!r.inc_below(RWQ_BG, 0));
        let out = next(&r, [bucket(10, MS / 2), bucket(10, MS / 10)]);
        assert_eq!(r.depth().scale_step, 0, "{out:?}");
        // The kernel's rule grows after every good window.
        r.set_scale_up_when_limited(false);
        next(&r, [bucket(10, MS / 2), bucket(10, MS / 10)]);
        assert_eq!(r.depth().scale_step, -1);
    }

    #[test]
    fn the_tail_judge_sees_reads_behind_bursts_that_the_fastest_read_hides() {
        // 20 reads: one found the device idle (0.5 ms), three waited behind a burst of
        // writes (12 ms), the rest were fine.
        let bursty = LatBucket {
            nr: 20,
            min_ns: MS / 2,
            max_ns: 12 * MS,
            sum_ns: 3 * 12 * MS + 17 * MS,
            missed: 3,
        };
        let writes = bucket(10, MS);
        let r = RqWb::new(1023, false, false, None);
        assert_eq!(r.judge(), WbtJudge::Tail, "the tail is the default");
        let out = window(&r, 100 * MS, [bursty, writes]);
        assert_eq!(out.status, Some(LatStatus::Exceeded));
        assert_eq!(
            out.lat_nsec,
            Some(12 * MS),
            "wbt_lat reports the slowest read"
        );
        assert_eq!(r.depth().scale_step, 1);
        // One late read in twenty is under a tenth: fine.
        let out = window(
            &r,
            200 * MS,
            [
                LatBucket {
                    missed: 1,
                    ..bursty
                },
                writes,
            ],
        );
        assert_eq!(out.status, Some(LatStatus::Ok));
        // The kernel's rule looks at the fastest read only.
        let k = kernel(RqWb::new(1023, false, false, None));
        let out = window(&k, 100 * MS, [bursty, writes]);
        assert_eq!(out.status, Some(LatStatus::Ok));
        // On a disk the tail rule judges the mean read (blk-iolatency's rotational rule).
        let hdd = RqWb::new(32, true, true, None);
        let slow = LatBucket {
            nr: 4,
            min_ns: 5 * MS,
            max_ns: 200 * MS,
            sum_ns: 400 * MS,
            missed: 0,
        };
        let out = window(&hdd, 100 * MS, [slow, writes]);
        assert_eq!(out.status, Some(LatStatus::Exceeded));
        assert_eq!(out.lat_nsec, Some(100 * MS));
    }

    // 4.9 scenario 2.
    #[test]
    fn write_only_streaming_scales_up_to_the_cap() {
        let r = nvme();
        let mut t = 0;
        let mut seen = vec![];
        for _ in 0..8 {
            t += 100 * MS;
            let out = window(&r, t, [none(), bucket(500, MS / 10)]);
            assert_eq!(out.status, Some(LatStatus::UnknownWrites));
            seen.push(lims(&r));
        }
        assert_eq!(
            seen,
            vec![
                (-1, 31, 16, 8),
                (-2, 61, 31, 16),
                (-3, 121, 61, 31),
                (-4, 241, 121, 61),
                (-5, 481, 241, 121),
                (-6, 767, 384, 192),
                (-6, 767, 384, 192),
                (-6, 767, 384, 192),
            ]
        );
        assert!(r.depth().scaled_max);
        // Negative steps do not lengthen the window.
        assert_eq!(r.arm_window(), 100 * MS);
    }

    // 4.9 scenario 3, and the window lengths of the table in 4.5.
    #[test]
    fn slow_reads_with_writes_scale_down_to_depth_one() {
        let r = nvme();
        let mut t = 0;
        let mut got = vec![];
        for _ in 0..6 {
            t += 100 * MS;
            let out = window(&r, t, [bucket(4, 5 * MS), bucket(3, MS)]);
            assert_eq!(out.status, Some(LatStatus::Exceeded));
            assert_eq!(out.lat_nsec, Some(5 * MS));
            assert!(out.rearm);
            got.push((lims(&r), r.arm_window()));
        }
        assert_eq!(
            got,
            vec![
                ((1, 8, 4, 2), 72_727_272),
                ((2, 4, 2, 1), 59_259_259),
                ((3, 2, 2, 1), 50_000_000),
                ((4, 1, 1, 1), 45_714_285),
                ((4, 1, 1, 1), 45_714_285),
                ((4, 1, 1, 1), 45_714_285),
            ]
        );
    }

    // 4.9 scenario 4.
    #[test]
    fn violation_at_negative_step_drops_straight_to_zero() {
        let r = nvme();
        for i in 1..=3 {
            window(&r, i * 100 * MS, [none(), bucket(10, MS)]);
        }
        assert_eq!(lims(&r), (-3, 121, 61, 31));
        let out = window(&r, 400 * MS, [bucket(2, 3 * MS), bucket(10, MS)]);
        assert_eq!(out.status, Some(LatStatus::Exceeded));
        assert_eq!(
            out.step.map(|s| (s.reason, s.scale_step)),
            Some(("scale down", 0))
        );
        assert_eq!(lims(&r), (0, 16, 8, 4));
    }

    // 4.9 scenario 5.
    #[test]
    fn silent_windows_drift_back_to_step_zero() {
        let r = nvme();
        let mut t = 0;
        for _ in 0..2 {
            t += 100 * MS;
            window(&r, t, [bucket(1, 9 * MS), bucket(3, MS)]);
        }
        assert_eq!(r.depth().scale_step, 2);
        let mut steps = vec![];
        for _ in 0..10 {
            t += r.arm_window();
            let out = window(&r, t, [none(), none()]);
            assert_eq!(out.status, Some(LatStatus::Unknown));
            steps.push(r.depth().scale_step);
            // Nothing in flight: only a non-zero step keeps the timer going.
            assert_eq!(out.rearm, r.depth().scale_step != 0);
        }
        assert_eq!(steps, vec![2, 2, 2, 2, 1, 1, 1, 1, 1, 0]);
        // A negative step drifts back the same way, one step per five windows.
        let r = nvme();
        window(&r, 100 * MS, [none(), bucket(5, MS)]);
        for i in 0..4 {
            window(&r, (2 + i) * 100 * MS, [none(), none()]);
            assert_eq!(r.depth().scale_step, -1);
        }
        window(&r, 600 * MS, [none(), none()]);
        assert_eq!(lims(&r), (0, 16, 8, 4));
    }

    // 4.9 scenario 6.
    #[test]
    fn stuck_read_exceeds_without_completions() {
        let r = nvme();
        let t0 = 1_000 * MS;
        r.read_issued(7, t0);
        // Past min_lat with no read completed this window.
        let out = window(&r, t0 + 3 * MS, [none(), bucket(5, MS)]);
        assert_eq!(out.status, Some(LatStatus::Exceeded));
        assert_eq!(out.lat_nsec, Some(3 * MS));
        assert_eq!(r.depth().scale_step, 1);
        // Past the whole window, even though other reads completed quickly.
        let out = window(&r, t0 + 80 * MS, [bucket(9, MS / 10), bucket(5, MS)]);
        assert_eq!(out.status, Some(LatStatus::Exceeded));
        assert_eq!(r.depth().scale_step, 2);
        // Once it completes it no longer counts.
        r.read_done(7, t0 + 81 * MS);
        let out = window(&r, t0 + 140 * MS, [bucket(9, MS / 10), bucket(5, MS)]);
        assert_eq!(out.status, Some(LatStatus::Ok));
        assert_eq!(r.depth().scale_step, 1);
        // Only the oldest read is watched; another read's completion does not clear it.
        r.read_issued(8, t0 + 200 * MS);
        r.read_issued(9, t0 + 201 * MS);
        r.read_done(9, t0 + 202 * MS);
        let out = window(&r, t0 + 300 * MS, [none(), none()]);
        assert_eq!(out.lat_nsec, Some(100 * MS));
    }

    // 4.9 scenario 7.
    #[test]
    fn class_limits() {
        let r = nvme();
        let now = 10_000 * MS;
        let no = || false;
        let bg = BioFlags::BACKGROUND;
        assert_eq!(r.get_limit(Op::Write, bg, now, no), 4, "kupdate/background");
        assert_eq!(
            r.get_limit(Op::Write, BioFlags::empty(), now, no),
            8,
            "start_all"
        );
        assert_eq!(r.get_limit(Op::Write, BioFlags::SYNC, now, no), 16, "fsync");
        assert_eq!(
            r.get_limit(Op::Write, BioFlags::META, now, no),
            16,
            "metadata"
        );
        assert_eq!(
            r.get_limit(Op::Discard, BioFlags::SYNC, now, no),
            4,
            "discard"
        );
        assert_eq!(
            r.classify(Op::Write, BioFlags::SYNC | BioFlags::IDLE),
            0,
            "O_DIRECT"
        );
        assert_eq!(r.classify(Op::Write, BioFlags::SYNC), flags::TRACKED);
        assert_eq!(r.classify(Op::Flush, BioFlags::PREFLUSH), 0);
        assert_eq!(r.classify(Op::Read, BioFlags::empty()), flags::READ);
        assert_eq!(
            r.classify(Op::Discard, BioFlags::empty()),
            flags::TRACKED | flags::DISCARD
        );
        // A read completed 50 ms ago makes ordinary writes background.
        r.read_done(0, now - 50 * MS);
        assert_eq!(r.get_limit(Op::Write, BioFlags::empty(), now, no), 4);
        assert_eq!(
            r.get_limit(Op::Write, BioFlags::empty(), now + 51 * MS, no),
            8
        );
        // So does one submitted within 100 ms.
        r.read_submitted(now + 60 * MS);
        assert_eq!(
            r.get_limit(Op::Write, BioFlags::empty(), now + 159 * MS, no),
            4
        );
        // A dirtier slept less than a second ago: full depth for every write.
        let yes = || true;
        assert_eq!(r.get_limit(Op::Write, bg, now, yes), 16);
        assert_eq!(r.get_limit(Op::Write, BioFlags::empty(), now, yes), 16);
        assert_eq!(r.get_limit(Op::Discard, bg, now, yes), 4);
    }

    // 4.9 scenario 8, and the batching of wakeups without a write cache.
    #[test]
    fn wake_rule() {
        let r = RqWb::new(1023, false, true, None);
        for _ in 0..4 {
            assert!(r.inc_below(RWQ_BG, 4));
        }
        assert!(!r.inc_below(RWQ_BG, 4));
        let wakes: Vec<bool> = (0..4)
            .map(|_| r.rqw_done(flags::TRACKED, || false, || true))
            .collect();
        assert_eq!(wakes, [false, false, false, true], "wc: only once drained");
        // With a dirtier sleeping, wc does not hold writers back: wake once normal − inflight
        // reaches bg/2.
        for _ in 0..8 {
            r.inc_below(RWQ_BG, 8);
        }
        let wakes: Vec<bool> = (0..8)
            .map(|_| r.rqw_done(flags::TRACKED, || true, || true))
            .collect();
        assert_eq!(wakes, [false, true, true, true, true, true, true, true]);
        // No sleepers, no wake.
        r.inc_below(RWQ_BG, 8);
        assert!(!r.rqw_done(flags::TRACKED, || true, || false));
        // Discards wake against wb_background.
        for _ in 0..4 {
            r.inc_below(RWQ_DISCARD, 4);
        }
        let d = flags::TRACKED | flags::DISCARD;
        let wakes: Vec<bool> = (0..4).map(|_| r.rqw_done(d, || false, || true)).collect();
        assert_eq!(wakes, [false, true, true, true]);
        assert_eq!(r.inflight(RWQ_DISCARD), 0);
    }

    /// A completion no throttle counted in is an impossible state, reported (debug
    /// builds stop here; release builds keep the count at 0, not wrapped).
    #[test]
    #[should_panic(expected = "a tracked completion of class")]
    fn a_completion_never_counted_in_is_reported() {
        let r = RqWb::new(1023, false, true, None);
        r.rqw_done(flags::TRACKED | flags::DISCARD, || false, || false);
    }

    #[test]
    fn limits_step_down_while_reads_exceed_and_recover_when_met() {
        let r = nvme();
        let mut t = 0;
        let slow = [bucket(5, 3 * MS), bucket(8, MS)];
        let fast = [bucket(5, MS), bucket(8, MS)];
        let mut trail = vec![];
        for s in [slow, slow, slow, fast, fast, fast, fast, slow] {
            t += r.arm_window();
            window(&r, t, s);
            trail.push(lims(&r));
        }
        assert_eq!(
            trail,
            vec![
                (1, 8, 4, 2),
                (2, 4, 2, 1),
                (3, 2, 2, 1),
                (2, 4, 2, 1),
                (1, 8, 4, 2),
                (0, 16, 8, 4),
                (-1, 31, 16, 8),
                (0, 16, 8, 4),
            ]
        );
    }

    #[test]
    fn write_only_load_does_not_stay_throttled() {
        let r = nvme();
        let mut t = 0;
        for _ in 0..3 {
            t += r.arm_window();
            window(&r, t, [bucket(2, 4 * MS), bucket(6, MS)]);
        }
        assert_eq!(r.depth().scale_step, 3);
        // The reader went away; writes continue, some windows with nothing completing
        // while writes are still in flight.
        r.inc_below(RWQ_BG, 1);
        for _ in 0..3 {
            t += r.arm_window();
            let out = window(&r, t, [none(), none()]);
            assert_eq!(out.status, Some(LatStatus::UnknownWrites));
        }
        assert_eq!(lims(&r), (0, 16, 8, 4));
        t += r.arm_window();
        window(&r, t, [none(), bucket(40, MS)]);
        assert!(r.depth().scale_step < 0);
        // A dirtier sleeping counts as writes too.
        r.rqw_done(flags::TRACKED, || false, || false);
        let out = r.timer_fn(t + 100 * MS, &[none(), none()], true);
        assert_eq!(out.status, Some(LatStatus::UnknownWrites));
    }

    #[test]
    fn too_few_samples_are_not_judged() {
        let r = nvme();
        // Slow reads but only two writes: not evidence against writes.
        let out = window(&r, 100 * MS, [bucket(3, 50 * MS), bucket(2, MS)]);
        assert_eq!(out.status, Some(LatStatus::UnknownWrites));
        // Reads alone (device waking up): unknown.
        let r = nvme();
        let out = window(&r, 100 * MS, [bucket(3, 50 * MS), none()]);
        assert_eq!(out.status, Some(LatStatus::Unknown));
        assert!(!out.rearm);
    }

    #[test]
    fn lat_zero_disables_throttling() {
        let r = nvme();
        r.set_min_lat(0);
        assert!(!r.enabled());
        assert_eq!(r.enable_state(), EnableState::OffManual);
        assert_eq!(r.classify(Op::Write, BioFlags::BACKGROUND), 0);
        assert_eq!(r.classify(Op::Read, BioFlags::empty()), 0);
        assert_eq!(
            r.get_limit(Op::Write, BioFlags::BACKGROUND, 0, || false),
            u32::MAX
        );
        assert_eq!(r.limits().1, 0);
        let out = r.timer_fn(100 * MS, &[bucket(3, 50 * MS), bucket(9, MS)], false);
        assert_eq!((out.status, out.rearm, out.step), (None, false, None));
        // Off by configuration too.
        let r = RqWb::new(64, false, false, Some(0));
        assert!(!r.enabled());
        // A manual target pins it: the default no longer applies.
        r.enable_default();
        assert!(!r.enabled());
        r.set_min_lat(5 * MS);
        assert_eq!(r.enable_state(), EnableState::OnManual);
        r.disable_default();
        assert!(r.enabled());
        // An unpinned default can be switched off and on again.
        let r = nvme();
        r.disable_default();
        assert_eq!(r.enable_state(), EnableState::OffDefault);
        r.enable_default();
        assert_eq!((r.enabled(), r.min_lat_nsec()), (true, 2 * MS));
    }

    #[test]
    fn setting_the_target_resets_the_step_and_judges_the_next_window() {
        let r = nvme();
        let slow = [bucket(5, 5 * MS), bucket(8, MS)];
        window(&r, 100 * MS, slow);
        window(&r, 200 * MS, slow);
        assert_eq!(r.depth().scale_step, 2);
        r.set_min_lat(10 * MS);
        assert_eq!(lims(&r), (0, 16, 8, 4));
        assert_eq!(r.enable_state(), EnableState::OnManual);
        let out = window(&r, 300 * MS, slow);
        assert_eq!(out.status, Some(LatStatus::Ok));
    }

    #[test]
    fn queue_depth_one_and_small_queues() {
        let mut d = RqDepth::new(1);
        assert_eq!(d.max_depth, 2);
        assert!(d.scale_up(), "the first scale-up is allowed");
        assert!((d.scale_step, d.max_depth, d.scaled_max) == (-1, 2, true));
        assert!(!d.scale_up());
        assert!(d.scale_down(true));
        assert!(d.scale_down(false));
        assert_eq!((d.scale_step, d.max_depth), (1, 1));
        assert!(!d.scale_down(true), "depth 1 is the floor");
        let r = RqWb::new(1, false, false, None);
        assert_eq!(r.limits(), (2, 2, 1));
        // A queue shallower than the default depth starts at its own depth.
        let r = RqWb::new(4, false, false, None);
        assert_eq!(r.limits(), (4, 2, 1));
        let mut d = RqDepth::new(4);
        assert!(d.scale_up());
        assert_eq!((d.max_depth, d.scaled_max), (3, true));
        for qd in [2u32, 3, 4096] {
            let mut d = RqDepth::new(qd);
            for _ in 0..100 {
                d.scale_up();
            }
            assert!(
                d.max_depth >= 1 && d.max_depth <= (3 * qd / 4).max(1),
                "qd {qd}"
            );
            for _ in 0..100 {
                d.scale_down(false);
            }
            assert_eq!(d.max_depth, 1);
        }
    }

    #[test]
    fn absurd_targets_do_not_overflow() {
        let r = RqWb::new(u32::MAX, true, false, Some(u64::MAX));
        assert_eq!(r.min_lat_nsec(), u64::MAX);
        let out = r.timer_fn(u64::MAX, &[bucket(3, u64::MAX), bucket(3, 1)], true);
        assert_eq!(out.status, Some(LatStatus::Ok));
        assert!(window_nsec(RWB_WINDOW_NSEC, i32::MAX) > 0);
    }
}
