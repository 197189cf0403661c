//! A run over time: a thread samples counters every period while an arm runs (device
//! IOs, dirty pages, wbt's step, the workload's files), so the report can show when
//! writeback started, when throttling bit and what wbt did, which a table hides.

use crate::bench::meter::Meter;
use crate::progress::Step;
use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use wbstack::fs::Volume;

/// The sampling period of the lab's timelines: quick arms last a second or two, so
/// they are sampled finer to give their plots enough points; longer runs are thinned
/// when drawn (`plots::MAX_POINTS`).
pub fn period(quick: bool) -> Duration {
    Duration::from_millis(if quick { 25 } else { 100 })
}

/// Samples of named columns at times `t_s` (seconds since the sampler started).
/// Cumulative counters (`files`, `dev_write_ios`) are stored as read; rates come from
/// [`Timeline::rate`].
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Timeline {
    pub period_ms: u64,
    pub t_s: Vec<f64>,
    pub columns: BTreeMap<String, Vec<f64>>,
}

impl Timeline {
    /// (t, value) of a column; empty when there is no such column.
    pub fn points(&self, col: &str) -> Vec<(f64, f64)> {
        match self.columns.get(col) {
            Some(v) => self.t_s.iter().copied().zip(v.iter().copied()).collect(),
            None => Vec::new(),
        }
    }

    /// Per-second rate of a cumulative column between consecutive samples, placed at
    /// the later sample's time.
    pub fn rate(&self, col: &str) -> Vec<(f64, f64)> {
        let p = self.points(col);
        p.windows(2)
            .filter(|w| w[1].0 > w[0].0)
            .map(|w| (w[1].0, (w[1].1 - w[0].1) / (w[1].0 - w[0].0)))
            .collect()
    }

    fn push(&mut self, t_s: f64, row: &[(&'static str, f64)]) {
        let n = self.t_s.len();
        for (name, v) in row {
            let col = self.columns.entry(name.to_string()).or_default();
            // A column that appears late is padded, so every column stays aligned with t_s.
            col.resize(n, f64::NAN);
            col.push(*v);
        }
        self.t_s.push(t_s);
        for col in self.columns.values_mut() {
            col.resize(n + 1, f64::NAN);
        }
        debug_assert!(self.columns.values().all(|c| c.len() == self.t_s.len()));
    }
}

type Probe = Box<dyn FnMut(&mut Vec<(&'static str, f64)>) + Send>;

/// A sampling thread; `finish` takes a last sample and returns the timeline.
pub struct Sampler {
    stop: Arc<(Mutex<bool>, Condvar)>,
    handle: Option<std::thread::JoinHandle<Timeline>>,
}

impl Sampler {
    pub fn start(period: Duration, mut probe: Probe) -> Sampler {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let s2 = stop.clone();
        let handle = std::thread::spawn(move || {
            let t0 = Instant::now();
            let mut tl = Timeline {
                period_ms: period.as_millis() as u64,
                ..Default::default()
            };
            let mut row = Vec::new();
            let mut next = t0;
            loop {
                row.clear();
                probe(&mut row);
                tl.push(t0.elapsed().as_secs_f64(), &row);
                next += period;
                let (m, cv) = &*s2;
                let mut stopped = m.lock();
                // Periodic sampling, not a wait for a condition: the stop flag ends it.
                while !*stopped && Instant::now() < next {
                    cv.wait_until(&mut stopped, next);
                }
                if *stopped {
                    row.clear();
                    probe(&mut row);
                    tl.push(t0.elapsed().as_secs_f64(), &row);
                    return tl;
                }
            }
        });
        Sampler {
            stop,
            handle: Some(handle),
        }
    }

    pub fn finish(mut self) -> Timeline {
        self.stop_thread().unwrap_or_default()
    }

    fn stop_thread(&mut self) -> Option<Timeline> {
        let (m, cv) = &*self.stop;
        *m.lock() = true;
        cv.notify_all();
        // A panicking probe loses the timeline, not the run: the arm's figures stand.
        self.handle.take().and_then(|h| h.join().ok())
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        if self.handle.is_some() {
            self.stop_thread();
        }
    }
}

/// The volume's side of a sample: device IOs (cumulative), what is in flight, wbt's
/// state and the dirty levels, in pages.
pub fn volume_row(vol: &Volume, row: &mut Vec<(&'static str, f64)>) {
    let q = vol.queue();
    let d = q.diskstats();
    row.push(("dev_read_ios", d.reads() as f64));
    row.push(("dev_write_ios", d.writes() as f64));
    row.push(("dev_write_sectors", d.sectors[1] as f64));
    row.push(("dev_flushes", d.flushes() as f64));
    let inflight = q.in_flight();
    row.push(("queue_depth", (inflight[0] + inflight[1]) as f64));
    let w = q.wbt_state();
    row.push(("wbt_step", w.scale_step as f64));
    row.push(("wbt_max_depth", w.max_depth as f64));
    row.push(("wbt_inflight", w.inflight[0] as f64));
    let l = vol.bdi().dirty_levels();
    row.push(("nr_dirty", l.nr_dirty as f64));
    row.push(("nr_writeback", l.nr_writeback as f64));
    row.push(("bg_thresh", l.bg_thresh as f64));
    row.push(("thresh", l.thresh as f64));
    row.push(("setpoint", l.setpoint as f64));
    row.push(("limit", l.limit as f64));
}

/// The workload's side: its meter (files or reads, bytes, late operations).
pub fn meter_row(m: &Meter, row: &mut Vec<(&'static str, f64)>) {
    row.push(("ops", m.ops() as f64));
    row.push(("bytes", m.bytes() as f64));
    row.push(("late", m.late() as f64));
}

/// The usual arm's sampler: the volume (if any) and the meter, feeding a progress step
/// with `progress(meter)` units.
pub fn start_arm(
    period: Duration,
    vol: Option<Arc<crate::bench::volfs::VolumeFs>>,
    meter: Arc<Meter>,
    step: Arc<Step>,
    progress: fn(&Meter) -> u64,
) -> Sampler {
    Sampler::start(
        period,
        Box::new(move |row| {
            if let Some(v) = &vol {
                volume_row(v.volume(), row);
            }
            meter_row(&meter, row);
            step.set(progress(&meter));
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn a_sampler_records_aligned_columns_and_a_last_sample() {
        let m = Arc::new(Meter::default());
        let m2 = m.clone();
        let s = Sampler::start(
            Duration::from_millis(1),
            Box::new(move |row| meter_row(&m2, row)),
        );
        for _ in 0..1000 {
            m.ops.fetch_add(1, Ordering::Relaxed);
        }
        let tl = s.finish();
        assert!(tl.t_s.len() >= 2, "a first and a last sample at least");
        assert!(tl.columns.values().all(|c| c.len() == tl.t_s.len()));
        // The last sample is taken after the work: it sees all of it.
        assert_eq!(tl.columns["ops"].last(), Some(&1000.0));
        assert!(tl.t_s.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn rates_difference_consecutive_samples_and_late_columns_are_padded() {
        let mut tl = Timeline::default();
        tl.push(0.0, &[("files", 0.0)]);
        tl.push(0.5, &[("files", 100.0)]);
        tl.push(1.0, &[("files", 400.0), ("late", 1.0)]);
        assert_eq!(tl.rate("files"), vec![(0.5, 200.0), (1.0, 600.0)]);
        assert_eq!(tl.columns["late"].len(), 3);
        assert!(tl.columns["late"][0].is_nan());
        assert!(tl.points("missing").is_empty());
    }
}
