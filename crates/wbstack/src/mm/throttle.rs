//! Dirty throttling: the IO-less `balance_dirty_pages` of mm/page-writeback.c.
//!
//! A pure policy: no threads, no sleeping, no clock reads. Every entry point takes the
//! current time as nanoseconds (`now_ns`, from the caller's [`crate::clock::Clock`])
//! and the page counters as plain numbers, updates the small per-device
//! ([`WbState`]) and per-writer ([`TaskState`]) state, and returns what the caller
//! should do. The caller sleeps the returned pause itself; a throttled writer never
//! writes pages back (that is the flusher's job, "IO-less" throttling).
//!
//! Units follow the kernel so its arithmetic and rounding can be reproduced:
//! page counts are 4 KiB pages, rates are pages/s, and all internal times are
//! jiffies at `HZ = 1000` (1 jiffy = 1 ms; `now_ns` is floored to whole jiffies).
//! Fixed-point ratios use `RATELIMIT_CALC_SHIFT` (1.0 == 1024).
//!
//! # How the page cache drives it
//!
//! For every writer thread keep a [`TaskState`]; for the device keep a [`WbState`]
//! (behind the same lock as the page counters). After a writer dirtied `n` *new*
//! pages (re-dirtying a dirty page does not count, as in `folio_account_dirtied`):
//!
//! ```text
//! counters: nr_dirty += n; dirtied_total += n
//! wb.update_bandwidth(now, dirtied_total, written_total, nr_dirty + nr_writeback, thresh, bg)
//! d = balance_dirty_pages(&mut wb, &mut task, now, n, nr_dirty, nr_writeback, thresh, bg)
//! if d.wake_background { wake the flusher (a no-op if it already runs) }
//! drop the lock; sleep d.pause_ns
//! while d.must_recheck { re-read counters; d = balance_dirty_pages(.., 0, ..); sleep d.pause_ns }
//! ```
//!
//! `update_bandwidth` is rate limited internally (one estimate per
//! `BANDWIDTH_INTERVAL` = 200 ms), so calling it on every dirtying is cheap; the
//! flusher / IO completion path may call it as well.
//!
//! # Differences from the kernel (single device, userspace)
//!
//! * The global `wb_domain` (its `dirty_limit` follow-down state) lives in
//!   [`WbState`]: there is one device. No memcg domains, no `PF_LOCAL_THROTTLE`, no
//!   laptop mode, no real-time boost, no `BDP_ASYNC` (a caller that must not sleep can
//!   ignore `pause_ns`).
//! * The per-CPU `bdp_ratelimits` / `dirty_throttle_leaks` counters are one counter
//!   per [`WbState`] shared by all writers, so `ratelimit_pages` is computed as for one
//!   CPU (`max(16, thresh/32)`); that keeps the kernel's total overshoot bound of
//!   about thresh/32. `wb_stat_error()` is 8 (one CPU: counters are exact here).
//! * `balance_dirty_pages` does not estimate bandwidth itself (it lacks the
//!   `WB_DIRTIED`/`WB_WRITTEN` totals); the caller calls [`WbState::update_bandwidth`]
//!   with the same snapshot just before. Outside freerun that is the kernel's step 9
//!   (`__wb_update_bandwidth(.., update_ratelimit = true)`); inside freerun it is the
//!   write-bandwidth-only update of the writeback path (`wb_update_bandwidth` from
//!   `do_writepages`), and the idle guard of `wb_bandwidth_estimate_start` is
//!   approximated as "no page completed since the last stamp → re-stamp, do not count
//!   the idle time".
//! * The hard-limit loop of `balance_dirty_pages` (task_ratelimit == 0) is unrolled
//!   into the caller: [`Decision::must_recheck`] asks it to sleep and call again; the
//!   task remembers the original `pages_dirtied` for the next iteration.
//! * Without per-device shares a single device owns the whole threshold
//!   (`wb_thresh = thresh`, `wb_dirty = dirty`); [`DirtyCtl`] lets a caller pass real
//!   shares (and `strictlimit`, FUSE-like) through the `_ctl` variants.

use serde::{Deserialize, Serialize};

use crate::clock::NSEC_PER_SEC;

/// Ticks per second of the modelled jiffies clock.
pub const HZ: u64 = 1000;
/// One jiffy in nanoseconds.
pub const NSEC_PER_JIFFY: u64 = NSEC_PER_SEC / HZ;
/// Page size the counters are expressed in.
pub const PAGE_SIZE: u64 = 4096;
/// Longest single sleep in `balance_dirty_pages` (`MAX_PAUSE = max(HZ/5, 1)`), jiffies.
pub const MAX_PAUSE: u64 = if HZ / 5 > 1 { HZ / 5 } else { 1 };
/// Bandwidth / ratelimit estimation interval (`BANDWIDTH_INTERVAL`), jiffies.
pub const BANDWIDTH_INTERVAL: u64 = if HZ / 5 > 1 { HZ / 5 } else { 1 };
/// Minimum pages between `balance_dirty_pages` calls worth aiming for (128 KiB).
pub const DIRTY_POLL_THRESH: u64 = 128 * 1024 / PAGE_SIZE;
/// Fixed-point shift of `pos_ratio` (1.0 == 1 << 10).
pub const RATELIMIT_CALC_SHIFT: u32 = 10;
/// Initial write bandwidth / ratelimit: 100 MB/s in pages/s (`INIT_BW`, wb_init).
pub const INIT_BW: u64 = 100 * 1024 * 1024 / PAGE_SIZE;
/// Averaging period of the write bandwidth estimate: `roundup_pow_of_two(3 * HZ)`.
pub const BW_AVG_PERIOD: u64 = (3 * HZ).next_power_of_two();
/// A wb idle for longer than this does not count the idle time (`WB_BANDWIDTH_IDLE_JIF`).
pub const WB_BANDWIDTH_IDLE_JIF: u64 = HZ;
/// Per-task ratelimit while the device is over its limit (32 KiB in pages).
pub const DIRTY_EXCEEDED_RATELIMIT: u64 = 32 * 1024 / PAGE_SIZE;
/// A new task's `nr_dirtied_pause` (128 KiB, kernel/fork.c).
pub const INIT_NR_DIRTIED_PAUSE: u64 = 128 * 1024 / PAGE_SIZE;
/// `wb_stat_error()` for exact counters on one "CPU": `1 * 8 * (1 + ilog2(1))`.
pub const WB_STAT_ERROR: u64 = 8;

const ONE: u64 = 1 << RATELIMIT_CALC_SHIFT;
/// `roundup_pow_of_two(1 + HZ/8)`, the divisor in `wb_max_pause`.
const MAX_PAUSE_BW_DIV: u64 = (1 + HZ / 8).next_power_of_two();
/// `roundup_pow_of_two(HZ)`, the divisor in `wb_min_pause`.
const HZ_POW2: u64 = HZ.next_power_of_two();

/// Nanoseconds to (floored) jiffies.
#[inline]
pub fn ns_to_jiffies(ns: u64) -> u64 {
    ns / NSEC_PER_JIFFY
}

/// Jiffies to nanoseconds (saturating).
#[inline]
pub fn jiffies_to_ns(j: u64) -> u64 {
    j.saturating_mul(NSEC_PER_JIFFY)
}

#[inline]
fn ilog2(x: u64) -> u64 {
    if x == 0 {
        0
    } else {
        u64::from(63 - x.leading_zeros())
    }
}

/// Clamp a wide intermediate back to u64.
#[inline]
fn sat(x: u128) -> u64 {
    u64::try_from(x).unwrap_or(u64::MAX)
}

#[inline]
fn mid(a: u64, b: u64) -> u64 {
    sat((u128::from(a) + u128::from(b)) / 2)
}

/// Jiffies to ms (the tracepoints' `* 1000 / HZ`), signed and saturating.
#[inline]
fn j_to_ms(j: i64) -> i64 {
    j.saturating_mul(1000) / HZ as i64
}

/// Pages to KB/s units of the kernel tracepoints (`KBps` / `PG2KB`).
#[inline]
fn kbps(pages: u64) -> u64 {
    pages.saturating_mul(PAGE_SIZE / 1024)
}

// ---------------------------------------------------------------------------------
// Thresholds
// ---------------------------------------------------------------------------------

/// The `vm.dirty_*` tunables (§2.1). Writing a ratio zeroes its bytes twin in the
/// kernel; here a non-zero `_bytes` simply wins over the ratio.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirtyConfig {
    /// Start background writeback at this % of dirtyable memory (default 10).
    pub dirty_background_ratio: u32,
    /// Absolute background threshold in bytes; 0 = use the ratio.
    pub dirty_background_bytes: u64,
    /// Throttle dirtiers around this % of dirtyable memory (default 20).
    pub dirty_ratio: u32,
    /// Absolute throttling threshold in bytes; 0 = use the ratio.
    pub dirty_bytes: u64,
}

impl Default for DirtyConfig {
    fn default() -> Self {
        DirtyConfig {
            dirty_background_ratio: 10,
            dirty_background_bytes: 0,
            dirty_ratio: 20,
            dirty_bytes: 0,
        }
    }
}

impl DirtyConfig {
    /// `(thresh, bg_thresh)` in pages for `dirtyable_pages` of dirtyable memory
    /// (`domain_dirty_limits`): ratios are applied at 1/PAGE_SIZE precision, bytes
    /// knobs round up to pages, and a background threshold at or above the throttling
    /// threshold is cut to half of it.
    pub fn thresholds(&self, dirtyable_pages: u64) -> (u64, u64) {
        let avail = u128::from(dirtyable_pages);
        let per_page = |ratio: u32| u128::from(u64::from(ratio.min(100)) * PAGE_SIZE / 100);
        let thresh = if self.dirty_bytes != 0 {
            self.dirty_bytes.div_ceil(PAGE_SIZE)
        } else {
            sat(per_page(self.dirty_ratio) * avail / u128::from(PAGE_SIZE))
        };
        let mut bg_thresh = if self.dirty_background_bytes != 0 {
            self.dirty_background_bytes.div_ceil(PAGE_SIZE)
        } else {
            sat(per_page(self.dirty_background_ratio) * avail / u128::from(PAGE_SIZE))
        };
        if bg_thresh >= thresh {
            bg_thresh = thresh / 2;
        }
        (thresh, bg_thresh)
    }
}

/// `dirty_freerun_ceiling`: below `(thresh + bg_thresh) / 2` dirtiers are not
/// throttled at all.
#[inline]
pub fn dirty_freerun_ceiling(thresh: u64, bg_thresh: u64) -> u64 {
    mid(thresh, bg_thresh)
}

/// `dirty_poll_interval`: pages a task may dirty before looking again while in
/// freerun, `2^(floor(log2(thresh - dirty)) / 2)` ≈ √headroom, 1 without headroom.
#[inline]
pub fn dirty_poll_interval(dirty: u64, thresh: u64) -> u64 {
    if thresh > dirty {
        1 << (ilog2(thresh - dirty) >> 1)
    } else {
        1
    }
}

/// `ratelimit_pages` (`writeback_set_ratelimit`) for one shared counter:
/// `max(16, thresh / 32)` pages dirtied by all writers together force a check.
#[inline]
pub fn ratelimit_pages(thresh: u64) -> u64 {
    (thresh / 32).max(16)
}

/// `wb_over_bg_thresh` for one device: background writeback continues while the
/// dirty (not yet under writeback) pages exceed the background threshold. Pages under
/// writeback are deliberately not counted: they are already on their way out.
#[inline]
pub fn wb_over_bg_thresh(dirty: u64, bg_thresh: u64) -> bool {
    dirty > bg_thresh
}

/// `pos_ratio_polynom`: `1 + ((setpoint - dirty) / (limit - setpoint))^3` in fixed
/// point, clamped to [0, 2.0]. f(freerun) = 2, f(setpoint) = 1, f(limit) = 0; flat
/// near the setpoint (small oscillation), steep far from it (fast correction).
pub fn pos_ratio_polynom(setpoint: u64, dirty: u64, limit: u64) -> u64 {
    let one = i128::from(ONE);
    let denom = i128::from(limit.saturating_sub(setpoint) | 1);
    // div64_s64 truncates toward zero, as Rust's `/` does.
    let x = ((i128::from(setpoint) - i128::from(dirty)) << RATELIMIT_CALC_SHIFT) / denom;
    // |x| >= 1.0 already saturates the result; clamping keeps the cube in range
    // without changing any clamped outcome.
    let x = x.clamp(-2 * one, 2 * one);
    let mut pos = x;
    pos = (pos * x) >> RATELIMIT_CALC_SHIFT;
    pos = (pos * x) >> RATELIMIT_CALC_SHIFT;
    pos += one;
    pos.clamp(0, 2 * one) as u64
}

// ---------------------------------------------------------------------------------
// Control inputs
// ---------------------------------------------------------------------------------

/// One snapshot of the counters and limits `balance_dirty_pages` works on (the
/// kernel's `dirty_throttle_control`). All values in pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DirtyCtl {
    /// `NR_FILE_DIRTY`: dirty pages not yet under writeback.
    pub nr_reclaimable: u64,
    /// Global dirty + writeback pages: the controlled quantity.
    pub dirty: u64,
    /// Throttling threshold.
    pub thresh: u64,
    /// Background writeback threshold.
    pub bg_thresh: u64,
    /// This device's dirty + writeback pages.
    pub wb_dirty: u64,
    /// This device's share of `thresh` (`__wb_calc_thresh`).
    pub wb_thresh: u64,
    /// This device's share of `bg_thresh`.
    pub wb_bg_thresh: u64,
}

impl DirtyCtl {
    /// A single device owning all dirty memory: the wb view equals the global view.
    pub fn single(dirty_pages: u64, writeback_pages: u64, thresh: u64, bg_thresh: u64) -> Self {
        let dirty = dirty_pages.saturating_add(writeback_pages);
        DirtyCtl {
            nr_reclaimable: dirty_pages,
            dirty,
            thresh,
            bg_thresh,
            wb_dirty: dirty,
            wb_thresh: thresh,
            wb_bg_thresh: bg_thresh,
        }
    }
}

// ---------------------------------------------------------------------------------
// Per-device state
// ---------------------------------------------------------------------------------

/// Throttling and bandwidth state of one device (the `bdi_writeback` fields used by
/// mm/page-writeback.c, plus the global `wb_domain` limit state). Times in jiffies.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WbState {
    /// Latest write bandwidth estimate, pages/s (`write_bandwidth`).
    pub write_bandwidth: u64,
    /// Spike-filtered bandwidth used by the controller, pages/s, ≥ 1.
    pub avg_write_bandwidth: u64,
    /// Base throttle rate of every dirtier, pages/s, ≥ 1 (`dirty_ratelimit`).
    pub dirty_ratelimit: u64,
    /// Last raw balanced rate estimate, pages/s.
    pub balanced_dirty_ratelimit: u64,
    /// Jiffy of the last write bandwidth estimate.
    pub bw_time_stamp: u64,
    /// `WB_WRITTEN` at the last write bandwidth estimate.
    pub written_stamp: u64,
    /// Jiffy of the last `dirty_ratelimit` estimate (start of the dirty-rate window).
    pub ratelimit_time_stamp: u64,
    /// `WB_DIRTIED` at the last `dirty_ratelimit` estimate.
    pub dirtied_stamp: u64,
    /// The domain's hard limit (`dom->dirty_limit`): follows `thresh` up at once and
    /// down slowly, and never below the dirty pages, so a sudden drop of `thresh`
    /// does not block every dirtier. 0 until the first update (then `thresh` is used).
    pub dirty_limit: u64,
    /// Jiffy of the last `dirty_limit` update.
    pub dirty_limit_tstamp: u64,
    /// The device is over its share while globally over `thresh`: every dirtier
    /// checks in after at most 8 pages.
    pub dirty_exceeded: bool,
    /// Jiffy a dirtier last went to sleep here (`wb->dirty_sleep`), if any.
    pub dirty_sleep: Option<u64>,
    /// `BDI_CAP_STRICTLIMIT`: throttle on the device's own share even in global freerun.
    pub strictlimit: bool,
    /// Pages dirtied by all writers since one last reached its ratelimit
    /// (the per-CPU `bdp_ratelimits`).
    pub bdp_ratelimits: u64,
    /// Pages dirtied by exited writers and not yet throttled (`dirty_throttle_leaks`).
    pub dirty_throttle_leaks: u64,
}

impl Default for WbState {
    fn default() -> Self {
        WbState::new(0)
    }
}

/// What one bandwidth estimate saw and decided: the fields of the kernel's
/// `bdi_dirty_ratelimit` tracepoint (rates in KB/s, as there) plus context.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct BwTrace {
    pub write_bw: u64,
    pub avg_write_bw: u64,
    /// Pages dirtied per second over the interval (0 if the ratelimit was not updated).
    pub dirty_rate: u64,
    pub dirty_ratelimit: u64,
    pub task_ratelimit: u64,
    pub balanced_dirty_ratelimit: u64,
    /// Domain hard limit after the update, pages.
    pub dirty_limit: u64,
    /// Length of the estimation interval, ms.
    pub elapsed: u64,
    /// Whether the dirty ratelimit (and limit) were re-estimated, i.e. the estimate
    /// ran outside freerun as from `balance_dirty_pages`.
    pub ratelimit_updated: bool,
}

impl WbState {
    /// A fresh device at `now_ns`, with the kernel's initial 100 MB/s guesses.
    pub fn new(now_ns: u64) -> Self {
        let now = ns_to_jiffies(now_ns);
        WbState {
            write_bandwidth: INIT_BW,
            avg_write_bandwidth: INIT_BW,
            dirty_ratelimit: INIT_BW,
            balanced_dirty_ratelimit: INIT_BW,
            bw_time_stamp: now,
            ratelimit_time_stamp: now,
            dirtied_stamp: 0,
            written_stamp: 0,
            dirty_limit: 0,
            dirty_limit_tstamp: now,
            dirty_exceeded: false,
            dirty_sleep: None,
            strictlimit: false,
            bdp_ratelimits: 0,
            dirty_throttle_leaks: 0,
        }
    }

    /// `hard_dirty_limit`: the limit the controller steers against.
    #[inline]
    pub fn hard_dirty_limit(&self, thresh: u64) -> u64 {
        thresh.max(self.dirty_limit)
    }

    /// The global setpoint `(freerun + limit) / 2` the controller steers dirty to.
    #[inline]
    pub fn setpoint(&self, thresh: u64, bg_thresh: u64) -> u64 {
        mid(
            dirty_freerun_ceiling(thresh, bg_thresh),
            self.hard_dirty_limit(thresh),
        )
    }

    /// Snap the domain limit to `thresh`, as `writeback_set_ratelimit` does when the
    /// dirty sysctls change (only memory-driven threshold drops follow down slowly).
    pub fn reset_dirty_limit(&mut self, thresh: u64) {
        self.dirty_limit = thresh;
    }

    /// `wb_recent_wait`: a dirtier slept here during the last second (WBT uses it to
    /// stop scaling down while writers are already throttled).
    pub fn recent_wait(&self, now_ns: u64) -> bool {
        match self.dirty_sleep {
            Some(t) => ns_to_jiffies(now_ns) < t.saturating_add(HZ),
            None => false,
        }
    }

    /// Account the not-yet-throttled pages of an exiting writer, to be charged to the
    /// next writers (`dirty_throttle_leaks`): otherwise many short-lived writers could
    /// each dirty `nr_dirtied_pause - 1` pages and never be throttled.
    pub fn task_exit(&mut self, task: TaskState) {
        self.dirty_throttle_leaks = self.dirty_throttle_leaks.saturating_add(task.nr_dirtied);
    }

    /// The (dirty, thresh, bg_thresh) the freerun test uses: the device's own for
    /// strictlimit, else the global ones.
    fn freerun_view(&self, ctl: &DirtyCtl) -> (u64, u64, u64) {
        if self.strictlimit {
            (ctl.wb_dirty, ctl.wb_thresh, ctl.wb_bg_thresh)
        } else {
            (ctl.dirty, ctl.thresh, ctl.bg_thresh)
        }
    }

    /// Position ratio for a single device owning all dirty memory (`DirtyCtl::single`).
    /// `dirty` is dirty + writeback pages. Fixed point, 1.0 == 1024.
    pub fn pos_ratio(&self, dirty: u64, thresh: u64, bg_thresh: u64) -> u64 {
        self.pos_ratio_ctl(&DirtyCtl::single(dirty, 0, thresh, bg_thresh))
    }

    /// `wb_position_ratio`: how much faster (> 1024) or slower (< 1024) than
    /// `dirty_ratelimit` dirtiers may go, from where the dirty pages stand.
    ///
    /// Global part: [`pos_ratio_polynom`] around the setpoint, 0 at the hard limit.
    /// Device part (non-strict): a line through (wb_setpoint, 1.0) with slope
    /// `-1/(8·write_bw)` for a lone device (±write_bw/2 of noise ↔ ±12.5 %),
    /// floored at 1/4, plus a boost below half the device's share so it never idles.
    /// Strictlimit: the minimum of the global polynomial and a polynomial over the
    /// device's own (bg, thresh) range.
    pub fn pos_ratio_ctl(&self, ctl: &DirtyCtl) -> u64 {
        let write_bw = self.avg_write_bandwidth;
        let freerun = dirty_freerun_ceiling(ctl.thresh, ctl.bg_thresh);
        let limit = self.hard_dirty_limit(ctl.thresh);
        if ctl.dirty >= limit {
            return 0;
        }
        let setpoint = mid(freerun, limit);
        let pos = pos_ratio_polynom(setpoint, ctl.dirty, limit);

        if self.strictlimit {
            if ctl.wb_dirty < 8 {
                return (pos * 2).min(2 * ONE);
            }
            if ctl.wb_dirty >= ctl.wb_thresh {
                return 0;
            }
            let wb_setpoint = dirty_freerun_ceiling(ctl.wb_thresh, ctl.wb_bg_thresh);
            if wb_setpoint == 0 || wb_setpoint == ctl.wb_thresh {
                return 0;
            }
            let wb_pos = pos_ratio_polynom(wb_setpoint, ctl.wb_dirty, ctl.wb_thresh);
            return pos.min(wb_pos);
        }

        let mut pos = u128::from(pos);
        // A device idle for long has a tiny share; give it a usable one.
        let wb_thresh = ctl.wb_thresh.min(ctl.thresh).max((limit - ctl.dirty) / 8);
        // wb_setpoint = setpoint * wb_thresh / thresh, in 16.16 fixed point.
        let x = (u128::from(wb_thresh) << 16) / u128::from(ctl.thresh | 1);
        let wb_setpoint = u128::from(setpoint).saturating_mul(x) >> 16;
        // span = (thresh - wb_thresh + 8 * write_bw) * wb_thresh / thresh; the
        // kernel's unsigned wrap-around equals the signed value whenever it is sane.
        let span_base =
            (i128::from(ctl.thresh) - i128::from(wb_thresh) + 8 * i128::from(write_bw)).max(0);
        let span = (span_base as u128).saturating_mul(x) >> 16;
        let x_intercept = wb_setpoint.saturating_add(span);
        let wb_dirty = u128::from(ctl.wb_dirty);
        if wb_dirty < x_intercept - span / 4 {
            pos = pos.saturating_mul(x_intercept - wb_dirty) / ((x_intercept - wb_setpoint) | 1);
        } else {
            pos /= 4;
        }
        // Reserve area: keep enough dirty pages queued to keep the device busy.
        let reserve = u128::from(wb_thresh) / 2;
        if wb_dirty < reserve {
            if wb_dirty > reserve / 8 {
                pos = pos.saturating_mul(reserve) / wb_dirty;
            } else {
                pos = pos.saturating_mul(8);
            }
        }
        sat(pos)
    }

    /// Estimate bandwidth / ratelimit for one device owning all dirty memory.
    /// `dirty` is dirty + writeback pages; totals are the monotonic `WB_DIRTIED` and
    /// `WB_WRITTEN` page counters. See [`WbState::update_bandwidth_ctl`].
    pub fn update_bandwidth(
        &mut self,
        now_ns: u64,
        dirtied_total: u64,
        written_total: u64,
        dirty: u64,
        thresh: u64,
        bg_thresh: u64,
    ) -> Option<BwTrace> {
        let ctl = DirtyCtl::single(dirty, 0, thresh, bg_thresh);
        self.update_bandwidth_ctl(now_ns, dirtied_total, written_total, &ctl)
    }

    /// `__wb_update_bandwidth`: at most once per `BANDWIDTH_INTERVAL` (strictly more
    /// than 200 jiffies since the last stamp, as `time_is_before_jiffies`), estimate
    /// the write bandwidth (§2.7) and, when the dirty pages are past freerun (where
    /// the kernel's `balance_dirty_pages` does it), follow the domain limit
    /// (`domain_update_dirty_limit`) and re-estimate `dirty_ratelimit` (§2.8).
    ///
    /// Inside freerun only the write bandwidth is estimated, as the writeback path's
    /// `wb_update_bandwidth` would; if nothing completed since the stamp the device is
    /// taken as idle and only re-stamped, so idle time never dilutes the estimate
    /// (`wb_bandwidth_estimate_start`).
    ///
    /// Unlike the kernel, the dirty-rate window has its own stamp. The kernel shares
    /// one stamp, and its writeback-path updates are rare (one per writeback chunk,
    /// ~0.5 s of IO), so `balance_dirty_pages` usually finds the interval due. Here the
    /// caller may call on every dirtying, and freerun updates would re-stamp a shared
    /// window every 200 ms: a writer hovering at the freerun ceiling (a device faster
    /// than `dirty_ratelimit`) would then never see a due interval while over it, and
    /// `dirty_ratelimit` would stay stuck. When throttling continuously both windows
    /// coincide with the kernel's. The dirty-rate window is restarted after a second
    /// in freerun, so it never spans a long unthrottled period.
    ///
    /// Returns what was estimated, or `None`.
    pub fn update_bandwidth_ctl(
        &mut self,
        now_ns: u64,
        dirtied_total: u64,
        written_total: u64,
        ctl: &DirtyCtl,
    ) -> Option<BwTrace> {
        let now = ns_to_jiffies(now_ns);
        let bw_due = now > self.bw_time_stamp.saturating_add(BANDWIDTH_INTERVAL);
        let rl_due = now > self.ratelimit_time_stamp.saturating_add(BANDWIDTH_INTERVAL);
        if !bw_due && !rl_due {
            return None;
        }
        let (dirty, thresh, bg_thresh) = self.freerun_view(ctl);
        let throttling = dirty > dirty_freerun_ceiling(thresh, bg_thresh);

        let mut trace = BwTrace::default();
        if throttling && rl_due {
            // As in balance_dirty_pages: pos_ratio is taken before the update, and
            // the ratelimit before the write bandwidth.
            let elapsed = (now - self.ratelimit_time_stamp).max(1);
            let pos_ratio = self.pos_ratio_ctl(ctl);
            self.domain_update_dirty_limit(ctl, now);
            self.update_dirty_ratelimit(ctl, pos_ratio, dirtied_total, elapsed, &mut trace);
            trace.ratelimit_updated = true;
            trace.elapsed = elapsed * 1000 / HZ;
            self.dirtied_stamp = dirtied_total;
            self.ratelimit_time_stamp = now;
        } else if !throttling && now - self.ratelimit_time_stamp > WB_BANDWIDTH_IDLE_JIF {
            self.dirtied_stamp = dirtied_total;
            self.ratelimit_time_stamp = now;
        }
        if bw_due {
            let elapsed = (now - self.bw_time_stamp).max(1);
            if !throttling && written_total <= self.written_stamp {
                // Idle: re-stamp only.
                self.written_stamp = written_total;
                self.bw_time_stamp = now;
                if !trace.ratelimit_updated {
                    return None;
                }
            } else {
                self.update_write_bandwidth(elapsed, written_total);
                self.written_stamp = written_total;
                self.bw_time_stamp = now;
                trace.elapsed = elapsed * 1000 / HZ;
            }
        } else if !trace.ratelimit_updated {
            return None;
        }

        trace.write_bw = kbps(self.write_bandwidth);
        trace.avg_write_bw = kbps(self.avg_write_bandwidth);
        trace.dirty_ratelimit = kbps(self.dirty_ratelimit);
        trace.balanced_dirty_ratelimit = kbps(self.balanced_dirty_ratelimit);
        trace.dirty_limit = self.hard_dirty_limit(ctl.thresh);
        Some(trace)
    }

    /// `wb_update_write_bandwidth`: a time-weighted running mean over
    /// `BW_AVG_PERIOD` (4096 jiffies): `bw = (written·HZ + bw_old·(P - elapsed)) / P`,
    /// or the plain rate after a gap longer than P. `avg_write_bandwidth` only moves,
    /// by 1/8 of the gap, when two successive estimates agree on the direction, which
    /// filters out single spikes.
    fn update_write_bandwidth(&mut self, elapsed: u64, written: u64) {
        let period = BW_AVG_PERIOD;
        let mut avg = self.avg_write_bandwidth;
        let old = self.write_bandwidth;
        // `written` may go backwards (redirtied pages are debited): no underflow.
        let mut bw = u128::from(written.saturating_sub(self.written_stamp)) * u128::from(HZ);
        let bw = if elapsed > period {
            let bw = sat(bw / u128::from(elapsed));
            avg = bw;
            bw
        } else {
            bw += u128::from(old) * u128::from(period - elapsed);
            let bw = sat(bw >> ilog2(period));
            if avg > old && old >= bw {
                avg -= (avg - old) >> 3;
            }
            if avg < old && old <= bw {
                avg += (old - avg) >> 3;
            }
            bw
        };
        self.write_bandwidth = bw;
        self.avg_write_bandwidth = avg.max(1);
    }

    /// `domain_update_dirty_limit` / `update_dirty_limit`: at most every 200 ms,
    /// follow `thresh` up in one step, or down by 1/32 of the gap towards
    /// `max(thresh, dirty)` — never below the dirty pages, so they never find
    /// themselves suddenly over the limit.
    fn domain_update_dirty_limit(&mut self, ctl: &DirtyCtl, now: u64) {
        if now < self.dirty_limit_tstamp.saturating_add(BANDWIDTH_INTERVAL) {
            return;
        }
        let limit = self.dirty_limit;
        if limit < ctl.thresh {
            self.dirty_limit = ctl.thresh;
        } else {
            let target = ctl.thresh.max(ctl.dirty);
            if limit > target {
                self.dirty_limit = limit - ((limit - target) >> 5);
            }
        }
        self.dirty_limit_tstamp = now;
    }

    /// `wb_update_dirty_ratelimit`: estimate the rate at which each of the (unknown
    /// number of) dirtiers should run so that together they match the device,
    /// `balanced = task_ratelimit · write_bw / dirty_rate` (→ write_bw / N), and move
    /// `dirty_ratelimit` towards it only when that also reduces the position error,
    /// by a step bounded by |task_ratelimit - dirty_ratelimit| and damped as it gets
    /// close (`shift`), so it settles instead of chasing the noisy 200 ms estimate.
    fn update_dirty_ratelimit(
        &mut self,
        ctl: &DirtyCtl,
        pos_ratio: u64,
        dirtied: u64,
        elapsed: u64,
        trace: &mut BwTrace,
    ) {
        let freerun = dirty_freerun_ceiling(ctl.thresh, ctl.bg_thresh);
        let limit = self.hard_dirty_limit(ctl.thresh);
        let mut setpoint = mid(freerun, limit);
        let mut dirty = ctl.dirty;
        let write_bw = self.avg_write_bandwidth;
        let mut dirty_ratelimit = self.dirty_ratelimit;

        // Redirtied pages are debited; never underflow.
        let dirty_rate = sat(u128::from(dirtied.saturating_sub(self.dirtied_stamp))
            * u128::from(HZ)
            / u128::from(elapsed.max(1)));

        // Each dirtier's rate over the past interval; +1 helps ramp up from tiny values.
        let task_ratelimit =
            sat((u128::from(dirty_ratelimit) * u128::from(pos_ratio)) >> RATELIMIT_CALC_SHIFT)
                .saturating_add(1);

        // The pos_ratio factor (inside task_ratelimit) keeps this from getting stuck
        // at pos_ratio != 1 (see the kernel's comment on rate_(i+1)).
        let balanced =
            sat(u128::from(task_ratelimit) * u128::from(write_bw) / u128::from(dirty_rate | 1))
                .min(write_bw);

        if self.strictlimit {
            dirty = ctl.wb_dirty;
            setpoint = if ctl.wb_dirty < 8 {
                ctl.wb_dirty + 1
            } else {
                dirty_freerun_ceiling(ctl.wb_thresh, ctl.wb_bg_thresh)
            };
        }

        let mut step = 0u64;
        if dirty < setpoint {
            let x = self
                .balanced_dirty_ratelimit
                .min(balanced)
                .min(task_ratelimit);
            if dirty_ratelimit < x {
                step = x - dirty_ratelimit;
            }
        } else {
            let x = self
                .balanced_dirty_ratelimit
                .max(balanced)
                .max(task_ratelimit);
            if dirty_ratelimit > x {
                step = dirty_ratelimit - x;
            }
        }

        // Don't pursue 100 % rate matching: slow down close to the target.
        let shift = dirty_ratelimit / step.saturating_mul(2).saturating_add(1);
        step = if shift < u64::from(u64::BITS) {
            (step >> shift).div_ceil(8)
        } else {
            0
        };

        if dirty_ratelimit < balanced {
            dirty_ratelimit = dirty_ratelimit.saturating_add(step);
        } else {
            dirty_ratelimit = dirty_ratelimit.saturating_sub(step);
        }
        self.dirty_ratelimit = dirty_ratelimit.max(1);
        self.balanced_dirty_ratelimit = balanced;

        trace.dirty_rate = kbps(dirty_rate);
        trace.task_ratelimit = kbps(task_ratelimit);
    }

    /// `wb_max_pause`: at most 200 ms, and at most ~1/8 of the time the device needs
    /// to write `wb_dirty`, so a small dirty pool cannot drain (and the device idle)
    /// while its dirtiers sleep. Jiffies, ≥ 1.
    pub fn max_pause(&self, wb_dirty: u64) -> u64 {
        let bw = self.avg_write_bandwidth;
        let t = (wb_dirty / (1 + bw / MAX_PAUSE_BW_DIV)).saturating_add(1);
        t.min(MAX_PAUSE)
    }

    /// `wb_min_pause`: `(min_pause, nr_dirtied_pause)`. Aim for 10 ms pauses with one
    /// dirtier, +~10 ms per doubling of dirtiers (log2 write_bw - log2 ratelimit) to
    /// save CPU, never below 32 pages between checks if avoidable, and shrink the
    /// page count when the next pause would otherwise exceed `max_pause`.
    pub fn min_pause(
        &self,
        max_pause: u64,
        task_ratelimit: u64,
        dirty_ratelimit: u64,
    ) -> (u64, u64) {
        let max_pause = i128::from(max_pause);
        let hi = i128::from(ilog2(self.avg_write_bandwidth));
        let lo = i128::from(ilog2(self.dirty_ratelimit));
        let hz = i128::from(HZ);
        let hz_pow2 = i128::from(HZ_POW2);
        let poll = i128::from(DIRTY_POLL_THRESH);
        let dirty_ratelimit = i128::from(dirty_ratelimit.max(1));
        let task_ratelimit = i128::from(task_ratelimit);

        let mut t: i128 = (hz / 100).max(1);
        if hi > lo {
            t += (hi - lo) * (10 * hz) / 1024;
        }
        // Keep the target below max_pause/2 so normal task_ratelimit noise does not
        // trip the correction below and make nr_dirtied_pause dance.
        t = t.min(1 + max_pause / 2);
        let mut pages = dirty_ratelimit * t / hz_pow2;
        // Tiny nr_dirtied_pause hurts IO patterns: push towards 32 pages.
        if pages < poll {
            t = max_pause;
            pages = dirty_ratelimit * t / hz_pow2;
            if pages > poll {
                pages = poll;
                t = hz * poll / dirty_ratelimit;
            }
        }
        // The next pause is computed from task_ratelimit: keep it within max_pause.
        let pause = hz * pages / (task_ratelimit + 1);
        if pause > max_pause {
            t = max_pause;
            pages = task_ratelimit * t / hz_pow2;
        }
        let min_pause = if pages >= poll { 1 + t / 2 } else { t };
        (
            u64::try_from(min_pause.max(0)).unwrap_or(u64::MAX),
            u64::try_from(pages.max(0)).unwrap_or(u64::MAX),
        )
    }
}

// ---------------------------------------------------------------------------------
// Per-writer state and the decision
// ---------------------------------------------------------------------------------

/// Per writer thread (`task_struct` fields). Times in jiffies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct TaskState {
    /// Pages dirtied since the last throttling decision.
    pub nr_dirtied: u64,
    /// Pages to dirty before the next check (`nr_dirtied_pause`, initially 32).
    pub nr_dirtied_pause: u64,
    /// Virtual time the task has been paid up to (`dirty_paused_when`); 0 = never.
    /// Think time since then is credited against the next pause.
    pub dirty_paused_when: u64,
    /// `pages_dirtied` of a hard-limit loop in progress (see `must_recheck`).
    recheck_pages: Option<u64>,
    /// Jiffy the current `balance_dirty_pages` loop started (trace `paused`).
    bdp_start: u64,
}

impl Default for TaskState {
    fn default() -> Self {
        TaskState::new()
    }
}

impl TaskState {
    pub fn new() -> Self {
        TaskState {
            nr_dirtied: 0,
            nr_dirtied_pause: INIT_NR_DIRTIED_PAUSE,
            dirty_paused_when: 0,
            recheck_pages: None,
            bdp_start: 0,
        }
    }

    /// Whether the task is inside a hard-limit loop (the last decision asked for a
    /// recheck).
    pub fn in_hard_limit_loop(&self) -> bool {
        self.recheck_pages.is_some()
    }
}

/// The fields of the kernel's `balance_dirty_pages` tracepoint (units as there:
/// pages, KB/s for rates, ms for times) plus `thresh`, `bg_thresh`, `pos_ratio`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct BdpTrace {
    /// Domain hard limit, pages.
    pub limit: u64,
    /// Global setpoint `(limit + freerun) / 2`, pages.
    pub setpoint: u64,
    /// Dirty + writeback pages.
    pub dirty: u64,
    /// The device's setpoint `setpoint · wb_thresh / (thresh + 1)`.
    pub bdi_setpoint: u64,
    /// The device's dirty + writeback pages.
    pub bdi_dirty: u64,
    /// Base throttle rate, KB/s.
    pub dirty_ratelimit: u64,
    /// This task's rate (`dirty_ratelimit · pos_ratio`), KB/s.
    pub task_ratelimit: u64,
    /// Pages this decision paid for.
    pub dirtied: u64,
    /// `nr_dirtied_pause` before this decision.
    pub dirtied_pause: u64,
    /// Time since this (possibly looping) call started, ms.
    pub paused: u64,
    /// Sleep decided, ms (≤ 0: none; negative = time still credited).
    pub pause: i64,
    /// Time the pages are worth at task_ratelimit, ms.
    pub period: u64,
    /// Time since the task was last paid up (its think time), ms.
    pub think: i64,
    pub thresh: u64,
    pub bg_thresh: u64,
    /// Position ratio, 1.0 == 1024.
    pub pos_ratio: u64,
}

/// How a [`balance_dirty_pages`] call ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Outcome {
    /// The task has not yet dirtied its `nr_dirtied_pause` pages: nothing checked.
    Ratelimited,
    /// Below the freerun ceiling: no throttling, `nr_dirtied_pause` ≈ √headroom.
    Freerun,
    /// Throttled, but the pause is under `min_pause`: no sleep now, the time owed is
    /// carried in the task's virtual time (`dirty_paused_when`).
    Credited,
    /// Throttled: sleep `pause_ns`.
    Paused,
    /// At or over the hard limit (task_ratelimit 0): sleep `max_pause`; when
    /// `must_recheck`, call again after sleeping.
    HardLimit,
}

/// What the caller must do after dirtying pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Decision {
    /// Sleep this long (0 = continue at once). Always ≤ `MAX_PAUSE` (200 ms).
    pub pause_ns: u64,
    /// Start background writeback on the device (harmless if it already runs).
    pub wake_background: bool,
    /// Over the hard limit: after sleeping, call `balance_dirty_pages` again (with
    /// `pages_dirtied = 0`) and keep doing so while this is set.
    pub must_recheck: bool,
    pub outcome: Outcome,
    /// Filled when the kernel would emit the tracepoint (`Credited`, `Paused`,
    /// `HardLimit`); zero otherwise.
    pub trace: BdpTrace,
}

impl Decision {
    fn no_pause(outcome: Outcome, wake_background: bool) -> Self {
        Decision {
            pause_ns: 0,
            wake_background,
            must_recheck: false,
            outcome,
            trace: BdpTrace::default(),
        }
    }
}

/// `balance_dirty_pages_ratelimited` + one iteration of `balance_dirty_pages` for a
/// single device owning all dirty memory. `pages_dirtied` are the pages *newly*
/// dirtied by this task since its previous call, `dirty_pages` is `NR_FILE_DIRTY`
/// and `writeback_pages` `NR_WRITEBACK`. Call [`WbState::update_bandwidth`] with the
/// same snapshot first. See [`balance_dirty_pages_ctl`].
#[allow(clippy::too_many_arguments)]
pub fn balance_dirty_pages(
    wb: &mut WbState,
    task: &mut TaskState,
    now_ns: u64,
    pages_dirtied: u64,
    dirty_pages: u64,
    writeback_pages: u64,
    thresh: u64,
    bg_thresh: u64,
) -> Decision {
    let ctl = DirtyCtl::single(dirty_pages, writeback_pages, thresh, bg_thresh);
    balance_dirty_pages_ctl(wb, task, now_ns, pages_dirtied, &ctl)
}

/// The throttling decision for a task that dirtied `pages_dirtied` new pages.
///
/// 1. Ratelimiting (`balance_dirty_pages_ratelimited_flags`): return
///    [`Outcome::Ratelimited`] until the task has dirtied `nr_dirtied_pause` pages
///    (8 while the device is `dirty_exceeded`), unless all writers together dirtied
///    `ratelimit_pages` since one was last checked.
/// 2. Freerun: at or below `(thresh + bg_thresh) / 2` no pause; the next check comes
///    after ≈ √(thresh - dirty) pages.
/// 3. Otherwise `task_ratelimit = dirty_ratelimit · pos_ratio`; the pages are worth
///    `period = HZ · pages / task_ratelimit`, minus the think time since the task was
///    last paid up. Pauses under `min_pause` are not slept but carried as debt in
///    virtual time (forgotten after more than 1 s of credit); pauses over
///    `max_pause` are cut to it, pushing up to one more `max_pause` of debt forward.
/// 4. `task_ratelimit == 0` (at the hard limit): sleep `max_pause`, then again while
///    `must_recheck` — the kernel's loop, except when the device holds too few pages
///    for that to be meaningful (≤ `wb_stat_error`).
pub fn balance_dirty_pages_ctl(
    wb: &mut WbState,
    task: &mut TaskState,
    now_ns: u64,
    pages_dirtied: u64,
    ctl: &DirtyCtl,
) -> Decision {
    let now = ns_to_jiffies(now_ns);
    task.nr_dirtied = task.nr_dirtied.saturating_add(pages_dirtied);
    wb.bdp_ratelimits = wb.bdp_ratelimits.saturating_add(pages_dirtied);

    let pages_dirtied = match task.recheck_pages {
        // Next iteration of a hard-limit loop: same pages, no ratelimit.
        Some(pages) => pages,
        None => {
            let mut ratelimit = task.nr_dirtied_pause;
            if wb.dirty_exceeded {
                ratelimit = ratelimit.min(DIRTY_EXCEEDED_RATELIMIT);
            }
            if task.nr_dirtied >= ratelimit {
                wb.bdp_ratelimits = 0;
            } else if wb.bdp_ratelimits >= ratelimit_pages(ctl.thresh) {
                // Many writers, each under its own ratelimit: force a check.
                wb.bdp_ratelimits = 0;
                ratelimit = 0;
            }
            if wb.dirty_throttle_leaks > 0 && task.nr_dirtied < ratelimit {
                let n = wb.dirty_throttle_leaks.min(ratelimit - task.nr_dirtied);
                wb.dirty_throttle_leaks -= n;
                task.nr_dirtied += n;
            }
            if task.nr_dirtied < ratelimit {
                return Decision::no_pause(Outcome::Ratelimited, false);
            }
            task.bdp_start = now;
            task.nr_dirtied
        }
    };

    let (dirty, thresh, bg_thresh) = wb.freerun_view(ctl);
    // Background writeback once the dirty (not writeback) pages pass bg_thresh.
    let wake_background = ctl.nr_reclaimable > ctl.bg_thresh;
    if dirty <= dirty_freerun_ceiling(thresh, bg_thresh) {
        task.dirty_paused_when = now;
        task.nr_dirtied = 0;
        task.nr_dirtied_pause = dirty_poll_interval(dirty, thresh);
        task.recheck_pages = None;
        return Decision::no_pause(Outcome::Freerun, wake_background);
    }
    // Throttling: make sure writeback runs (even in laptop mode).
    let wake_background = true;

    wb.dirty_exceeded = ctl.wb_dirty > ctl.wb_thresh && (ctl.dirty > ctl.thresh || wb.strictlimit);
    let pos_ratio = wb.pos_ratio_ctl(ctl);
    let dirty_ratelimit = wb.dirty_ratelimit;
    let task_ratelimit =
        sat((u128::from(dirty_ratelimit) * u128::from(pos_ratio)) >> RATELIMIT_CALC_SHIFT);
    let max_pause = wb.max_pause(ctl.wb_dirty);
    let (min_pause, nr_dirtied_pause) = wb.min_pause(max_pause, task_ratelimit, dirty_ratelimit);
    let (max_pause, min_pause) = (max_pause as i64, min_pause.min(i64::MAX as u64) as i64);

    let freerun = dirty_freerun_ceiling(ctl.thresh, ctl.bg_thresh);
    let limit = wb.hard_dirty_limit(ctl.thresh);
    let setpoint = mid(limit, freerun);
    let mut trace = BdpTrace {
        limit,
        setpoint,
        dirty: ctl.dirty,
        bdi_setpoint: sat(
            u128::from(setpoint) * u128::from(ctl.wb_thresh) / (u128::from(ctl.thresh) + 1)
        ),
        bdi_dirty: ctl.wb_dirty,
        dirty_ratelimit: kbps(dirty_ratelimit),
        task_ratelimit: kbps(task_ratelimit),
        dirtied: pages_dirtied,
        dirtied_pause: task.nr_dirtied_pause,
        paused: j_to_ms(now.saturating_sub(task.bdp_start) as i64) as u64,
        pause: 0,
        period: 0,
        think: if task.dirty_paused_when == 0 {
            0
        } else {
            j_to_ms((now as i64).wrapping_sub(task.dirty_paused_when as i64))
        },
        thresh: ctl.thresh,
        bg_thresh: ctl.bg_thresh,
        pos_ratio,
    };

    let mut sleep_at = now;
    let (period, pause) = if task_ratelimit == 0 {
        (max_pause, max_pause)
    } else {
        let period =
            i64::try_from(u128::from(HZ) * u128::from(pages_dirtied) / u128::from(task_ratelimit))
                .unwrap_or(i64::MAX);
        let mut pause = period;
        if task.dirty_paused_when != 0 {
            pause = pause.saturating_sub((now as i64).wrapping_sub(task.dirty_paused_when as i64));
        }
        if pause < min_pause {
            // Too short to sleep: carry it (up to 1 s of credit) in virtual time.
            trace.period = j_to_ms(period) as u64;
            trace.pause = j_to_ms(pause.min(0));
            if pause < -(HZ as i64) {
                task.dirty_paused_when = now;
                task.nr_dirtied = 0;
            } else if period != 0 {
                task.dirty_paused_when = task.dirty_paused_when.saturating_add(period as u64);
                task.nr_dirtied = 0;
            } else if task.nr_dirtied_pause <= pages_dirtied {
                task.nr_dirtied_pause = task.nr_dirtied_pause.saturating_add(pages_dirtied);
            }
            task.recheck_pages = None;
            return Decision {
                pause_ns: 0,
                wake_background,
                must_recheck: false,
                outcome: Outcome::Credited,
                trace,
            };
        }
        if pause > max_pause {
            // An occasional drop of task_ratelimit: sleep max_pause now and push up
            // to one more max_pause of the debt into the task's virtual time.
            sleep_at += (pause - max_pause).min(max_pause) as u64;
            pause = max_pause;
        }
        (period, pause)
    };

    trace.period = j_to_ms(period) as u64;
    trace.pause = j_to_ms(pause);
    wb.dirty_sleep = Some(sleep_at);
    task.dirty_paused_when = sleep_at + pause as u64;
    task.nr_dirtied = 0;
    task.nr_dirtied_pause = nr_dirtied_pause;

    // Normally exactly one sleep per call. At the hard limit the kernel loops, unless
    // the device holds so few pages that its counters cannot tell (let a trickle
    // through so a stuck device does not wedge everyone).
    let must_recheck = task_ratelimit == 0 && ctl.wb_dirty > WB_STAT_ERROR;
    task.recheck_pages = must_recheck.then_some(pages_dirtied);
    Decision {
        pause_ns: jiffies_to_ns(pause as u64),
        wake_background,
        must_recheck,
        outcome: if task_ratelimit == 0 {
            Outcome::HardLimit
        } else {
            Outcome::Paused
        },
        trace,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = NSEC_PER_JIFFY;

    #[test]
    fn thresholds_follow_ratios_and_bytes() {
        let cfg = DirtyConfig::default();
        // 1 GiB dirtyable: 20 % / 10 % at 1/4096 precision.
        assert_eq!(cfg.thresholds(262_144), (52_416, 26_176));
        let bytes = DirtyConfig {
            dirty_bytes: 100 * 4096 + 1,
            dirty_background_bytes: 4096,
            ..cfg
        };
        assert_eq!(bytes.thresholds(1_000_000), (101, 1));
        // bg >= thresh → thresh / 2.
        let inverted = DirtyConfig {
            dirty_background_ratio: 30,
            ..cfg
        };
        assert_eq!(inverted.thresholds(262_144).1, 52_416 / 2);
        assert_eq!(cfg.thresholds(0), (0, 0));
        assert_eq!(
            DirtyConfig {
                dirty_ratio: 500,
                ..cfg
            }
            .thresholds(u64::MAX)
            .0,
            u64::MAX
        );
    }

    #[test]
    fn polynomial_anchor_points() {
        let (freerun, limit) = (75_000u64, 100_000u64);
        let setpoint = (freerun + limit) / 2;
        assert_eq!(pos_ratio_polynom(setpoint, setpoint, limit), 1024);
        // (limit - setpoint) | 1 makes x a hair under 1.0 here, as in the kernel.
        assert_eq!(pos_ratio_polynom(setpoint, freerun, limit), 2045);
        assert!(pos_ratio_polynom(setpoint, limit, limit) <= 2);
        assert_eq!(pos_ratio_polynom(setpoint, 0, limit), 2048);
        assert_eq!(pos_ratio_polynom(setpoint, u64::MAX, limit), 0);
        // Flat near the setpoint, monotonically decreasing.
        let mut prev = u64::MAX;
        for d in (freerun..=limit).step_by(500) {
            let p = pos_ratio_polynom(setpoint, d, limit);
            assert!(p <= prev);
            prev = p;
        }
        let near = pos_ratio_polynom(setpoint, setpoint + 1250, limit);
        assert!((1000..1024).contains(&near), "{near}");
        // Degenerate inputs do not panic.
        pos_ratio_polynom(0, 0, 0);
        pos_ratio_polynom(u64::MAX, 0, 0);
        pos_ratio_polynom(10, 5, 3);
    }

    #[test]
    fn single_device_pos_ratio_line() {
        let wb = WbState::new(0);
        let (thresh, bg) = (1_000_000, 500_000);
        let setpoint = wb.setpoint(thresh, bg);
        assert_eq!(setpoint, 875_000);
        let at = wb.pos_ratio(setpoint, thresh, bg);
        assert!((1015..=1030).contains(&at), "{at}");
        // span = 8 · write_bw: write_bw/2 above the setpoint costs ~1/16 of the rate
        // through the line (plus the flat polynomial).
        let above = wb.pos_ratio(setpoint + INIT_BW / 2, thresh, bg);
        assert!(above < at && above > at * 85 / 100, "{above}");
        assert_eq!(wb.pos_ratio(thresh, thresh, bg), 0);
        assert_eq!(wb.pos_ratio(thresh + 5, thresh, bg), 0);
        assert!(wb.pos_ratio(760_000, thresh, bg) > 1900);
        // Odd inputs.
        wb.pos_ratio(0, 0, 0);
        wb.pos_ratio(5, 0, 0);
        wb.pos_ratio(u64::MAX, u64::MAX, u64::MAX);
        let mut zero = WbState::new(0);
        zero.avg_write_bandwidth = 0;
        zero.dirty_limit = 1_000_000;
        zero.pos_ratio(60_000, thresh, bg);
    }

    #[test]
    fn strictlimit_throttles_on_own_share() {
        // §2.12 (6): 16 GiB dirtyable, FUSE-like max_ratio 1 %.
        let cfg = DirtyConfig::default();
        let (thresh, bg) = cfg.thresholds(4 * 1024 * 1024);
        assert_eq!(thresh, 838_656);
        let wb_thresh = thresh / 100;
        let wb_bg = wb_thresh * bg / thresh;
        let mut wb = WbState::new(0);
        wb.strictlimit = true;
        let ctl = |wb_dirty: u64| DirtyCtl {
            nr_reclaimable: wb_dirty,
            dirty: wb_dirty,
            thresh,
            bg_thresh: bg,
            wb_dirty,
            wb_thresh,
            wb_bg_thresh: wb_bg,
        };
        let wb_setpoint = (wb_thresh + wb_bg) / 2;
        assert_eq!(pos_ratio_polynom(wb_setpoint, wb_setpoint, wb_thresh), 1024);
        assert_eq!(wb.pos_ratio_ctl(&ctl(wb_setpoint)), 1024);
        assert_eq!(wb.pos_ratio_ctl(&ctl(wb_thresh)), 0);
        assert_eq!(wb.pos_ratio_ctl(&ctl(4)), 2048);
        // Throttling starts at the device's own freerun ceiling (~6,290 pages) while
        // global dirty is far below the global one.
        let mut task = TaskState::new();
        task.nr_dirtied_pause = 1;
        let over = balance_dirty_pages_ctl(&mut wb, &mut task, MS, 1, &ctl(wb_setpoint + 100));
        assert_ne!(over.outcome, Outcome::Freerun);
        let mut task = TaskState::new();
        task.nr_dirtied_pause = 1;
        let free = balance_dirty_pages_ctl(&mut wb, &mut task, MS, 1, &ctl(wb_setpoint - 100));
        assert_eq!(free.outcome, Outcome::Freerun);
    }

    #[test]
    fn max_and_min_pause() {
        let wb = WbState::new(0);
        assert_eq!(wb.max_pause(1_000_000), 200);
        assert_eq!(wb.max_pause(0), 1);
        // 25600 pages/s: 1 + 25600/128 = 201 → 2010 pages ≈ 10 ms + 1.
        assert_eq!(wb.max_pause(2010), 11);
        // One dd: t = 10 ms, pages = 25600·10/1024 = 250, min_pause 1 + 5.
        assert_eq!(wb.min_pause(200, INIT_BW, INIT_BW), (6, 250));
        // 4 dd: dirty_ratelimit = write_bw/4 → t = 10 + 2·10000/1024 = 29 ms.
        let mut four = WbState::new(0);
        four.dirty_ratelimit = INIT_BW / 4;
        assert_eq!(four.min_pause(200, INIT_BW / 4, INIT_BW / 4), (15, 181));
        // Slow ratelimit: pages < 32 → target max_pause, capped at 32 pages.
        let mut slow = WbState::new(0);
        slow.dirty_ratelimit = 200;
        assert_eq!(slow.min_pause(200, 200, 200), (81, 32));
        // Task rate far below: shrink pages to fit max_pause.
        assert_eq!(wb.min_pause(200, 100, INIT_BW), (200, 19));
        // Degenerate.
        let mut z = WbState::new(0);
        z.dirty_ratelimit = 0;
        z.avg_write_bandwidth = 0;
        z.min_pause(0, 0, 0);
        z.max_pause(u64::MAX);
    }

    #[test]
    fn freerun_and_ratelimiting() {
        let mut wb = WbState::new(0);
        let mut task = TaskState::new();
        let (thresh, bg) = (200_000, 100_000);
        // 31 pages: still under the initial nr_dirtied_pause of 32.
        for i in 0..31 {
            let d = balance_dirty_pages(&mut wb, &mut task, i * MS, 1, 0, 0, thresh, bg);
            assert_eq!(d.outcome, Outcome::Ratelimited);
            assert_eq!(d.pause_ns, 0);
        }
        let d = balance_dirty_pages(&mut wb, &mut task, 40 * MS, 1, 100_000, 0, thresh, bg);
        assert_eq!(d.outcome, Outcome::Freerun);
        assert_eq!(d.pause_ns, 0);
        assert!(!d.wake_background);
        // Headroom 100,000 pages → 2^(16/2) = 256.
        assert_eq!(task.nr_dirtied_pause, 256);
        assert_eq!(task.nr_dirtied, 0);
        assert_eq!(task.dirty_paused_when, 40);
        // Over bg but under freerun: wake the flusher, no pause.
        let mut task = TaskState::new();
        let d = balance_dirty_pages(&mut wb, &mut task, 50 * MS, 32, 120_000, 0, thresh, bg);
        assert_eq!(d.outcome, Outcome::Freerun);
        assert!(d.wake_background);
        assert_eq!(dirty_poll_interval(5, 5), 1);
        assert_eq!(dirty_poll_interval(0, 1), 1);
    }

    #[test]
    fn shared_counter_forces_a_check() {
        let mut wb = WbState::new(0);
        let (thresh, bg) = (200_000, 100_000);
        let mut tasks: Vec<TaskState> = (0..400).map(|_| TaskState::new()).collect();
        let mut checked = 0;
        // 400 tasks × 20 pages each: no task reaches its 32, the shared counter does
        // at thresh/32 = 6250 pages.
        for t in &mut tasks {
            let d = balance_dirty_pages(&mut wb, t, MS, 20, 10, 0, thresh, bg);
            if d.outcome != Outcome::Ratelimited {
                checked += 1;
            }
        }
        assert_eq!(checked, 1);
    }

    #[test]
    fn leaked_pages_are_charged() {
        let mut wb = WbState::new(0);
        let mut gone = TaskState::new();
        gone.nr_dirtied = 31;
        wb.task_exit(gone);
        let mut t = TaskState::new();
        let d = balance_dirty_pages(&mut wb, &mut t, MS, 1, 10, 0, 1000, 500);
        assert_eq!(d.outcome, Outcome::Freerun);
        assert_eq!(wb.dirty_throttle_leaks, 0);
    }

    #[test]
    fn throttled_pause_and_think_credit() {
        let mut wb = WbState::new(0);
        let (thresh, bg) = (100_000, 50_000);
        let setpoint = wb.setpoint(thresh, bg);
        let mut task = TaskState::new();
        task.nr_dirtied_pause = 250;
        // At the setpoint task_ratelimit ≈ 25600: 250 pages are worth ~9-10 ms.
        let d = balance_dirty_pages(&mut wb, &mut task, 1000 * MS, 250, setpoint, 0, thresh, bg);
        assert_eq!(d.outcome, Outcome::Paused);
        assert!(d.wake_background);
        assert!((9..=10).contains(&(d.pause_ns / MS)), "{:?}", d);
        assert_eq!(task.nr_dirtied, 0);
        assert_eq!(task.dirty_paused_when, 1000 + d.pause_ns / MS);
        assert_eq!(wb.dirty_sleep, Some(1000));
        assert!(wb.recent_wait(1500 * MS) && !wb.recent_wait(2000 * MS));
        let after = 1000 + d.pause_ns / MS;
        // The next 250 pages took 6 ms of think time: pause only the rest.
        let d2 = balance_dirty_pages(
            &mut wb,
            &mut task,
            (after + 6) * MS,
            250,
            setpoint,
            0,
            thresh,
            bg,
        );
        assert_eq!(d2.outcome, Outcome::Credited, "{:?}", d2);
        assert_eq!(d2.pause_ns, 0);
        assert!(d2.trace.think == 6 && d2.trace.pause <= 0);
        // Debt carried: dirty_paused_when advanced by the period.
        assert_eq!(task.dirty_paused_when, after + d2.trace.period);
        // A long think (> 1 s) resets.
        let d3 = balance_dirty_pages(
            &mut wb,
            &mut task,
            10_000 * MS,
            250,
            setpoint,
            0,
            thresh,
            bg,
        );
        assert_eq!(d3.outcome, Outcome::Credited);
        assert_eq!(task.dirty_paused_when, 10_000);
        serde_json::to_string(&d3).unwrap();
    }

    #[test]
    fn hard_limit_loops_until_under() {
        let mut wb = WbState::new(0);
        let (thresh, bg) = (100_000, 50_000);
        let mut task = TaskState::new();
        let d = balance_dirty_pages(&mut wb, &mut task, MS, 32, 90_000, 20_000, thresh, bg);
        assert_eq!(d.outcome, Outcome::HardLimit);
        assert!(d.must_recheck);
        assert_eq!(d.pause_ns, 200 * MS);
        assert!(wb.dirty_exceeded);
        assert!(task.in_hard_limit_loop());
        // Still over: loop again even with no new pages.
        let d = balance_dirty_pages(&mut wb, &mut task, 201 * MS, 0, 90_000, 15_000, thresh, bg);
        assert_eq!(d.outcome, Outcome::HardLimit);
        assert_eq!(d.trace.dirtied, 32);
        assert_eq!(d.trace.paused, 200);
        // Back under the limit: the same 32 pages are paid for at task_ratelimit
        // (under 1 ms: credited), and the loop ends.
        let d = balance_dirty_pages(&mut wb, &mut task, 401 * MS, 0, 70_000, 10_000, thresh, bg);
        assert_eq!(d.outcome, Outcome::Credited);
        assert_eq!(d.trace.dirtied, 32);
        assert!(!d.must_recheck && !task.in_hard_limit_loop());
        // dirty_exceeded cut the ratelimit to 8 pages.
        assert!(!wb.dirty_exceeded);
        wb.dirty_exceeded = true;
        let mut t2 = TaskState::new();
        let d = balance_dirty_pages(&mut wb, &mut t2, 500 * MS, 8, 60_000, 10_000, thresh, bg);
        assert_ne!(d.outcome, Outcome::Ratelimited);
        // A nearly empty stuck device lets a trickle through.
        let mut t3 = TaskState::new();
        let mut tiny = WbState::new(0);
        let d = balance_dirty_pages(&mut tiny, &mut t3, MS, 32, 5, 3, 0, 0);
        assert_eq!(d.outcome, Outcome::HardLimit);
        assert!(!d.must_recheck);
    }

    #[test]
    fn odd_inputs_do_not_panic() {
        let mut wb = WbState::new(u64::MAX);
        let mut task = TaskState::new();
        for &(d, w, t, b) in &[
            (0u64, 0u64, 0u64, 0u64),
            (u64::MAX, u64::MAX, u64::MAX, u64::MAX),
            (10, 0, 5, 10),
            (u64::MAX, 0, 1, 0),
            (1_000, 1_000, 1_500, 0),
        ] {
            for now in [0, 1, u64::MAX / 2, u64::MAX] {
                wb.update_bandwidth(now, d, w, d, t, b);
                balance_dirty_pages(&mut wb, &mut task, now, d, d, w, t, b);
                balance_dirty_pages(&mut wb, &mut task, now, 0, d, w, t, b);
            }
        }
        let mut z = WbState::new(0);
        z.avg_write_bandwidth = 0;
        z.write_bandwidth = 0;
        z.dirty_ratelimit = 0;
        z.balanced_dirty_ratelimit = 0;
        let mut t = TaskState::new();
        t.nr_dirtied_pause = 0;
        z.update_bandwidth(500 * MS, 10, 0, 90, 100, 50);
        balance_dirty_pages(&mut z, &mut t, 600 * MS, 1, 90, 0, 100, 50);
        assert!(z.dirty_ratelimit >= 1 && z.avg_write_bandwidth >= 1);
    }

    #[test]
    fn limit_follows_up_at_once_and_down_by_a_32nd() {
        let mut wb = WbState::new(0);
        let (t1, b1) = (100_000, 50_000);
        let u = wb.update_bandwidth(201 * MS, 0, 0, 80_000, t1, b1).unwrap();
        assert!(u.ratelimit_updated);
        assert_eq!(wb.dirty_limit, t1);
        let (t2, b2) = (t1 / 2, b1 / 2);
        let dirty = 45_000; // over the new freerun, under the new thresh
        let mut now = 201;
        let mut updates = 0;
        let mut written = 0;
        while updates < 22 {
            now += 1;
            written += 25;
            let before = wb.dirty_limit;
            if wb
                .update_bandwidth(now * MS, 0, written, dirty, t2, b2)
                .is_some()
            {
                updates += 1;
                assert_eq!(wb.dirty_limit, before - ((before - t2) >> 5));
                assert!(wb.dirty_limit >= t2);
            } else {
                assert_eq!(wb.dirty_limit, before);
            }
        }
        // Half-life ≈ 22 updates.
        let gap = wb.dirty_limit - t2;
        assert!((24_000..=26_500).contains(&gap), "{gap}");
        // Never below the dirty pages.
        let mut wb2 = WbState::new(0);
        wb2.dirty_limit = 100_000;
        wb2.update_bandwidth(201 * MS, 0, 0, 99_000, t2, b2);
        assert_eq!(wb2.dirty_limit, 100_000 - (1_000 >> 5));
    }

    #[test]
    fn bandwidth_is_rate_limited_and_idle_time_not_counted() {
        let mut wb = WbState::new(0);
        assert!(wb
            .update_bandwidth(200 * MS, 0, 5_000, 0, 1000, 500)
            .is_none());
        assert!(wb
            .update_bandwidth(201 * MS, 0, 5_146, 0, 1000, 500)
            .is_some());
        let bw = wb.write_bandwidth;
        // Nothing completes for 10 s in freerun: only re-stamped.
        for s in 1..=50u64 {
            assert!(wb
                .update_bandwidth((201 + s * 201) * MS, 0, 5_146, 0, 1000, 500)
                .is_none());
        }
        assert_eq!(wb.write_bandwidth, bw);
        assert_eq!(wb.bw_time_stamp, 201 + 50 * 201);
        // A gap longer than the averaging period takes the plain rate.
        let mut wb = WbState::new(0);
        wb.update_bandwidth(5_000 * MS, 0, 5_000 * 10, 0, 1000, 500);
        assert_eq!(wb.write_bandwidth, 10_000);
        assert_eq!(wb.avg_write_bandwidth, 10_000);
    }
}
