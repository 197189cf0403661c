//! Dirty throttling driven by a small deterministic simulation in simulated time
//! (reference §2.12): a device completing pages at a fixed rate, a flusher that moves
//! dirty pages to writeback while over the background threshold, and writers that
//! dirty pages as fast as allowed and "sleep" each returned pause by advancing time.

use wbstack::mm::throttle::*;

const US: u64 = 1_000;
const MS: u64 = 1_000_000;
const SEC: u64 = 1_000_000_000;
/// MB/s to pages/s.
const fn mbps(mb: u64) -> u64 {
    mb * 1024 * 1024 / PAGE_SIZE
}

struct Writer {
    task: TaskState,
    ready_at: u64,
    recheck: bool,
    dirtied: u64,
}

#[derive(Clone, Copy, Debug)]
struct Sample {
    t: u64,
    total: u64,
    dirty_ratelimit: u64,
    dirtied: u64,
    written: u64,
}

struct Sim {
    now: u64,
    wb: WbState,
    cfg: DirtyConfig,
    dirtyable: u64,
    /// NR_FILE_DIRTY / NR_WRITEBACK.
    dirty: u64,
    writeback: u64,
    dirtied_total: u64,
    written_total: u64,
    /// Device speed, pages/s, and completion credit in page·ns.
    rate: u64,
    credit: u128,
    /// Pages the flusher keeps queued at the device.
    window: u64,
    /// CPU time to copy one page into the cache (1 GB/s).
    page_cost: u64,
    next_tick: u64,
    writers: Vec<Writer>,
    // Observations.
    max_total: u64,
    max_pause: u64,
    pauses: u64,
    hard_limit_pauses: u64,
    samples: Vec<Sample>,
    /// (limit before, limit after, dirty, thresh) of every bandwidth update.
    limit_updates: Vec<(u64, u64, u64, u64)>,
    /// Decisions of writer 0 once `record_from` is passed.
    record_from: u64,
    decisions: Vec<Decision>,
}

impl Sim {
    fn new(dirtyable: u64, rate: u64, writers: usize) -> Sim {
        Sim {
            now: 0,
            wb: WbState::new(0),
            cfg: DirtyConfig::default(),
            dirtyable,
            dirty: 0,
            writeback: 0,
            dirtied_total: 0,
            written_total: 0,
            rate,
            credit: 0,
            window: 1024,
            page_cost: 4 * US,
            next_tick: 0,
            writers: (0..writers)
                .map(|_| Writer {
                    task: TaskState::new(),
                    ready_at: 0,
                    recheck: false,
                    dirtied: 0,
                })
                .collect(),
            max_total: 0,
            max_pause: 0,
            pauses: 0,
            hard_limit_pauses: 0,
            samples: Vec::new(),
            limit_updates: Vec::new(),
            record_from: u64::MAX,
            decisions: Vec::new(),
        }
    }

    fn thresholds(&self) -> (u64, u64) {
        self.cfg.thresholds(self.dirtyable)
    }

    fn total(&self) -> u64 {
        self.dirty + self.writeback
    }

    /// The device completes writeback pages at `rate` up to `to`.
    fn advance_device(&mut self, to: u64) {
        let dt = to - self.now;
        self.now = to;
        if self.writeback == 0 {
            self.credit = 0;
            return;
        }
        self.credit += u128::from(self.rate) * u128::from(dt);
        let n = ((self.credit / u128::from(SEC)) as u64).min(self.writeback);
        self.credit -= u128::from(n) * u128::from(SEC);
        self.writeback -= n;
        self.written_total += n;
        if self.writeback == 0 {
            self.credit = 0;
        }
    }

    /// Every ms: the flusher tops up the device queue while over the background
    /// threshold; record a sample every 100 ms.
    fn tick(&mut self) {
        let (_, bg) = self.thresholds();
        if wb_over_bg_thresh(self.dirty, bg) {
            let n = self.dirty.min(self.window.saturating_sub(self.writeback));
            self.dirty -= n;
            self.writeback += n;
        }
        if self.now.is_multiple_of(100 * MS) {
            self.samples.push(Sample {
                t: self.now,
                total: self.total(),
                dirty_ratelimit: self.wb.dirty_ratelimit,
                dirtied: self.dirtied_total,
                written: self.written_total,
            });
        }
        self.next_tick += MS;
    }

    /// Writer `i` dirties one page (or re-checks the hard limit) and obeys the policy.
    fn step_writer(&mut self, i: usize) {
        let (thresh, bg) = self.thresholds();
        let recheck = self.writers[i].recheck;
        let pages = if recheck {
            0
        } else {
            self.dirty += 1;
            self.dirtied_total += 1;
            self.writers[i].dirtied += 1;
            1
        };
        self.max_total = self.max_total.max(self.total());
        let before = self.wb.dirty_limit;
        if let Some(u) = self.wb.update_bandwidth(
            self.now,
            self.dirtied_total,
            self.written_total,
            self.total(),
            thresh,
            bg,
        ) {
            if u.ratelimit_updated {
                self.limit_updates
                    .push((before, self.wb.dirty_limit, self.total(), thresh));
            }
        }
        let w = &mut self.writers[i];
        let d = balance_dirty_pages(
            &mut self.wb,
            &mut w.task,
            self.now,
            pages,
            self.dirty,
            self.writeback,
            thresh,
            bg,
        );
        assert!(d.pause_ns <= 200 * MS, "{d:?}");
        if d.pause_ns > 0 {
            self.pauses += 1;
            self.max_pause = self.max_pause.max(d.pause_ns);
        }
        if d.outcome == Outcome::HardLimit {
            self.hard_limit_pauses += 1;
        }
        if i == 0 && self.now >= self.record_from && d.outcome != Outcome::Ratelimited {
            self.decisions.push(d);
        }
        w.recheck = d.must_recheck;
        w.ready_at = self.now + d.pause_ns + if pages > 0 { self.page_cost } else { 0 };
    }

    fn run_until(&mut self, end: u64) {
        loop {
            let (wi, wt) = self
                .writers
                .iter()
                .enumerate()
                .map(|(i, w)| (i, w.ready_at))
                .min_by_key(|&(i, t)| (t, i))
                .unwrap_or((usize::MAX, u64::MAX));
            let next = self.next_tick.min(wt);
            if next > end {
                self.advance_device(end);
                return;
            }
            self.advance_device(next);
            if next == self.next_tick {
                self.tick();
            } else {
                self.step_writer(wi);
            }
        }
    }

    fn samples_between(&self, from: u64, to: u64) -> impl Iterator<Item = &Sample> {
        self.samples
            .iter()
            .filter(move |s| s.t >= from && s.t <= to)
    }

    fn sample_at(&self, t: u64) -> Sample {
        *self.samples.iter().find(|s| s.t >= t).expect("sample")
    }
}

fn mean(xs: impl Iterator<Item = u64>) -> f64 {
    let (n, s) = xs.fold((0u64, 0f64), |(n, s), x| (n + 1, s + x as f64));
    s / n as f64
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b
}

/// 1 GiB of dirtyable page cache: thresh 52,416 / bg 26,176 pages, freerun 39,296,
/// setpoint 45,856.
const DIRTYABLE: u64 = 262_144;

#[test]
fn throttle_freerun_writer_is_never_paused() {
    // (1) A writer that stays under (thresh + bg) / 2 never sleeps.
    let mut sim = Sim::new(DIRTYABLE, mbps(100), 1);
    let (thresh, bg) = sim.thresholds();
    let freerun = dirty_freerun_ceiling(thresh, bg);
    // Stop before the writer could cross freerun (at 4 µs/page).
    let pages_ok = freerun - 2 * 256;
    sim.run_until(pages_ok * 4 * US);
    assert!(sim.total() <= freerun);
    assert!(sim.dirtied_total > freerun / 2);
    assert_eq!(sim.pauses, 0);
    // nr_dirtied_pause = 2^(floor(log2(headroom)) / 2).
    let mut wb = WbState::new(0);
    let mut task = TaskState::new();
    let (thresh, bg) = (400_000, 200_000);
    let d = balance_dirty_pages(&mut wb, &mut task, MS, 32, 300_000, 0, thresh, bg);
    assert_eq!(d.outcome, Outcome::Freerun);
    assert_eq!(d.pause_ns, 0);
    assert_eq!(task.nr_dirtied_pause, 256);
}

#[test]
fn throttle_single_writer_settles_at_the_setpoint() {
    // (2) One dd on a 100 MB/s device.
    let mut sim = Sim::new(DIRTYABLE, mbps(100), 1);
    sim.run_until(30 * SEC);
    let (thresh, bg) = sim.thresholds();
    let setpoint = sim.wb.setpoint(thresh, bg) as f64;
    let limit = sim.wb.hard_dirty_limit(thresh);

    // Converged: dirty pages stay near the setpoint.
    let avg = mean(sim.samples_between(10 * SEC, 30 * SEC).map(|s| s.total));
    assert!(
        rel(avg, setpoint) < 0.05,
        "mean dirty {avg} vs setpoint {setpoint}"
    );
    for s in sim.samples_between(10 * SEC, 30 * SEC) {
        assert!(
            rel(s.total as f64, setpoint) < 0.15,
            "dirty {} at {} ms vs setpoint {setpoint}",
            s.total,
            s.t / MS
        );
    }
    // Never over the limit (a lone writer stays far from it).
    assert!(
        sim.max_total <= limit + ratelimit_pages(thresh),
        "{}",
        sim.max_total
    );
    assert!(sim.max_pause <= 200 * MS);
    assert!(sim.pauses > 1000, "throttled: {}", sim.pauses);
    assert_eq!(sim.hard_limit_pauses, 0);

    // Long-run dirty rate = write rate = the device's.
    let (a, b) = (sim.sample_at(10 * SEC), sim.sample_at(30 * SEC));
    let dirty_rate = (b.dirtied - a.dirtied) as f64 / 20.0;
    let write_rate = (b.written - a.written) as f64 / 20.0;
    assert!(
        rel(dirty_rate, write_rate) < 0.03,
        "{dirty_rate} vs {write_rate}"
    );
    assert!(rel(write_rate, mbps(100) as f64) < 0.01, "{write_rate}");

    // The estimates: bandwidth and base ratelimit ≈ the device.
    let bw = sim.wb.avg_write_bandwidth as f64;
    assert!(rel(bw, mbps(100) as f64) < 0.05, "avg bw {bw}");
    let rl = mean(
        sim.samples_between(10 * SEC, 30 * SEC)
            .map(|s| s.dirty_ratelimit),
    );
    assert!(rel(rl, bw) < 0.15, "dirty_ratelimit {rl} vs write_bw {bw}");
}

#[test]
fn throttle_four_writers_share_the_device() {
    // (3) 4 dd: dirty_ratelimit → write_bw / 4, each writer gets a quarter.
    let mut sim = Sim::new(DIRTYABLE, mbps(100), 4);
    sim.record_from = 20 * SEC;
    sim.run_until(30 * SEC);
    let (thresh, bg) = sim.thresholds();
    let setpoint = sim.wb.setpoint(thresh, bg) as f64;
    let bw = sim.wb.avg_write_bandwidth as f64;
    assert!(rel(bw, mbps(100) as f64) < 0.05, "avg bw {bw}");
    let rl = mean(
        sim.samples_between(15 * SEC, 30 * SEC)
            .map(|s| s.dirty_ratelimit),
    );
    assert!(
        rel(rl, bw / 4.0) < 0.15,
        "dirty_ratelimit {rl} vs write_bw/4 {}",
        bw / 4.0
    );
    let avg = mean(sim.samples_between(15 * SEC, 30 * SEC).map(|s| s.total));
    assert!(
        rel(avg, setpoint) < 0.10,
        "mean dirty {avg} vs setpoint {setpoint}"
    );
    assert!(sim.max_pause <= 200 * MS);
    let total: u64 = sim.writers.iter().map(|w| w.dirtied).sum();
    for w in &sim.writers {
        let share = w.dirtied as f64 / total as f64;
        assert!((share - 0.25).abs() < 0.05, "share {share}");
    }
    // Longer pauses for more dirtiers: target ≈ 10 + 2·9.8 ms, min_pause ≈ half.
    let paused: Vec<u64> = sim
        .decisions
        .iter()
        .filter(|d| d.outcome == Outcome::Paused)
        .map(|d| d.pause_ns / MS)
        .collect();
    let p = mean(paused.iter().copied());
    assert!((14.0..=40.0).contains(&p), "mean pause {p} ms");
}

#[test]
fn throttle_stalled_device_holds_writers_at_the_limit() {
    // (4) The device stops completing anything.
    let mut sim = Sim::new(DIRTYABLE, 0, 2);
    sim.run_until(12 * SEC);
    let (thresh, _) = sim.thresholds();
    let limit = sim.wb.hard_dirty_limit(thresh);
    assert_eq!(sim.written_total, 0);
    // Dirty climbed to the limit and never beyond the ratelimit overshoot.
    assert!(
        sim.max_total >= limit - limit / 100,
        "{} vs {limit}",
        sim.max_total
    );
    assert!(
        sim.max_total <= limit + ratelimit_pages(thresh),
        "{} vs {limit}",
        sim.max_total
    );
    // The writers are held: max_pause sleeps, told to check again.
    assert!(sim.hard_limit_pauses > 50);
    let held_from = sim.samples.iter().find(|s| s.total >= limit).map(|s| s.t);
    let held_from = held_from.expect("reached the limit");
    sim.record_from = sim.now;
    let before = sim.dirtied_total;
    sim.run_until(sim.now + 5 * SEC);
    assert!(held_from < 7 * SEC);
    assert!(sim.dirtied_total - before <= 2 * 8, "writers leaked pages");
    assert!(!sim.decisions.is_empty());
    for d in &sim.decisions {
        assert_eq!(d.outcome, Outcome::HardLimit);
        assert!(d.must_recheck);
        assert_eq!(d.pause_ns, 200 * MS);
    }
    assert!(sim.max_total <= limit + ratelimit_pages(thresh));
    // The bandwidth estimate decays while nothing completes.
    assert!(
        sim.wb.write_bandwidth < mbps(100) / 10,
        "{}",
        sim.wb.write_bandwidth
    );
}

/// Feed the estimator `rate(t)` pages/s, calling it every ms (freerun: the
/// write-bandwidth path), and return (t, write_bw, avg_bw) after every estimate.
fn drive_estimator(
    wb: &mut WbState,
    from: u64,
    to: u64,
    written: &mut u128,
    rate: impl Fn(u64) -> u64,
) -> Vec<(u64, u64, u64)> {
    let mut out = Vec::new();
    let mut t = from;
    while t < to {
        t += MS;
        *written += u128::from(rate(t)) * u128::from(MS);
        let w = (*written / u128::from(SEC)) as u64;
        if wb.update_bandwidth(t, 0, w, 0, 1000, 500).is_some() {
            out.push((t, wb.write_bandwidth, wb.avg_write_bandwidth));
        }
    }
    out
}

#[test]
fn throttle_estimator_tracks_a_drop_and_ignores_a_spike() {
    // (5) 100 MB/s for 20 s, then 50 MB/s.
    let mut wb = WbState::new(0);
    let mut written = 0u128;
    drive_estimator(&mut wb, 0, 20 * SEC, &mut written, |_| mbps(100));
    assert!(rel(wb.write_bandwidth as f64, mbps(100) as f64) < 0.01);
    assert!(rel(wb.avg_write_bandwidth as f64, mbps(100) as f64) < 0.01);
    let after = drive_estimator(&mut wb, 20 * SEC, 40 * SEC, &mut written, |_| mbps(50));
    let at = |t: u64| *after.iter().find(|x| x.0 >= t).unwrap();
    // A time-weighted mean over 4096 ms: by 5 s two thirds of the drop are seen
    // (e^-1.25 ≈ 29 % left), the spike-filtered average close behind.
    let (_, bw5, avg5) = at(25 * SEC);
    assert!(bw5 < mbps(100) - mbps(50) * 2 / 3, "{bw5}");
    assert!(avg5 < mbps(100) - mbps(50) / 2, "{avg5}");
    let mut prev = u64::MAX;
    for &(_, bw, _) in &after {
        assert!(bw <= prev, "monotonic");
        prev = bw;
    }
    let (_, bw15, avg15) = at(35 * SEC);
    assert!(rel(bw15 as f64, mbps(50) as f64) < 0.05, "{bw15}");
    assert!(rel(avg15 as f64, mbps(50) as f64) < 0.08, "{avg15}");

    // A single 200 ms spike at 2x moves write_bandwidth, not avg_write_bandwidth.
    let mut wb = WbState::new(0);
    let mut written = 0u128;
    let steady = drive_estimator(&mut wb, 0, 20 * SEC, &mut written, |_| mbps(100));
    let t0 = steady.last().unwrap().0;
    let avg_before = wb.avg_write_bandwidth;
    let bw_before = wb.write_bandwidth;
    let spike = drive_estimator(&mut wb, t0, t0 + 10 * SEC, &mut written, |t| {
        if t > t0 && t <= t0 + 200 * MS {
            mbps(200)
        } else {
            mbps(100)
        }
    });
    let peak = spike.iter().map(|x| x.1).max().unwrap();
    assert!(peak as f64 > bw_before as f64 * 1.03, "{peak}");
    for &(_, _, avg) in &spike {
        assert!(
            rel(avg as f64, avg_before as f64) < 0.005,
            "avg moved: {avg_before} -> {avg}"
        );
    }
}

#[test]
fn throttle_limit_follows_thresh_down_while_writers_progress() {
    // (7) The dirtyable memory halves under a throttled writer.
    let mut sim = Sim::new(DIRTYABLE, mbps(100), 1);
    sim.run_until(10 * SEC);
    let (t1, _) = sim.thresholds();
    assert_eq!(sim.wb.dirty_limit, t1);
    sim.dirtyable /= 2;
    let (t2, _) = sim.thresholds();
    sim.limit_updates.clear();
    let dirtied_before = sim.dirtied_total;
    sim.run_until(20 * SEC);
    // Every update moved the limit 1/32 of the gap towards max(thresh, dirty).
    assert!(sim.limit_updates.len() > 30, "{}", sim.limit_updates.len());
    for &(before, after, dirty, thresh) in &sim.limit_updates {
        assert_eq!(thresh, t2);
        let target = thresh.max(dirty);
        if before > target {
            assert_eq!(after, before - ((before - target) >> 5));
        } else {
            assert_eq!(after, before);
        }
        assert!(after >= t2);
    }
    let first = sim.limit_updates[0];
    assert_eq!(first.0, t1);
    assert!(sim.wb.dirty_limit < t1);
    // The writers kept making progress throughout.
    let progress = sim.dirtied_total - dirtied_before;
    assert!(progress > mbps(100) * 5, "{progress}");
    assert_eq!(sim.hard_limit_pauses, 0);
    // Dirty follows the new, lower setpoint.
    let (t2, bg2) = sim.thresholds();
    let sp = sim.wb.setpoint(t2, bg2) as f64;
    let end = mean(sim.samples_between(17 * SEC, 20 * SEC).map(|s| s.total));
    assert!(rel(end, sp) < 0.20, "dirty {end} vs setpoint {sp}");
}

#[test]
fn throttle_slow_and_fast_devices_get_their_own_estimates() {
    // (7, second part) 20 MB/s vs 400 MB/s, one writer each. Both start from the
    // kernel's 100 MB/s guess; the estimate is a 4 s time-weighted mean.
    let mut slow = Sim::new(DIRTYABLE, mbps(20), 1);
    slow.run_until(30 * SEC);
    let mut fast = Sim::new(DIRTYABLE * 4, mbps(400), 1);
    fast.run_until(16 * SEC);
    let (s, f) = (slow.wb.avg_write_bandwidth, fast.wb.avg_write_bandwidth);
    assert!(s < f);
    assert!(rel(s as f64, mbps(20) as f64) < 0.05, "slow {s}");
    assert!(rel(f as f64, mbps(400) as f64) < 0.05, "fast {f}");
    // The slow device's writer was brought down to its speed: dirty_ratelimit
    // followed the bandwidth down from 100 MB/s, the dirty rate matches the device.
    let rl = mean(
        slow.samples_between(25 * SEC, 30 * SEC)
            .map(|x| x.dirty_ratelimit),
    );
    assert!(rel(rl, s as f64) < 0.20, "slow dirty_ratelimit {rl} vs {s}");
    let (a, b) = (slow.sample_at(20 * SEC), slow.sample_at(30 * SEC));
    let dirty_rate = (b.dirtied - a.dirtied) as f64 / 10.0;
    assert!(rel(dirty_rate, mbps(20) as f64) < 0.05, "{dirty_rate}");
    // The fast device's writer was let up past the initial 100 MB/s.
    assert!(
        fast.wb.dirty_ratelimit > mbps(200),
        "{}",
        fast.wb.dirty_ratelimit
    );
    let (a, b) = (fast.sample_at(10 * SEC), fast.sample_at(16 * SEC));
    let dirty_rate = (b.dirtied - a.dirtied) as f64 / 6.0;
    assert!(rel(dirty_rate, mbps(400) as f64) < 0.05, "{dirty_rate}");
    assert!(slow.max_pause <= 200 * MS && fast.max_pause <= 200 * MS);
    let (thresh, _) = slow.thresholds();
    assert!(slow.max_total <= slow.wb.hard_dirty_limit(thresh));
}
