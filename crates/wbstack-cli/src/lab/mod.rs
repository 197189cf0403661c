//! `wbstack lab`: the seed experiments, each arm run in one process, printed beside the
//! figures of the LKML thread it reproduces. One file per experiment.

pub mod dirty;
pub mod expire;
pub mod fsync;
pub mod inflight;
pub mod kernel;
pub mod plots;
pub mod plug;
pub mod report;
pub mod run;
pub mod timeline;
pub mod wbt;

use crate::bench::meter::Meter;
use crate::bench::volfs::VolumeFs;
use crate::progress::Step;
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;

/// `writeln!` into a String, which cannot fail: the tables are built as text so the
/// terminal and the report print the same thing.
macro_rules! outln {
    ($o:expr) => {
        $o.push('\n')
    };
    ($o:expr, $($t:tt)*) => {{
        $o.push_str(&format!($($t)*));
        $o.push('\n');
    }};
}
pub(crate) use outln;

/// Every experiment that exists so far.
pub const EXPERIMENTS: &[&str] = &["plug", "expire", "inflight", "wbt", "fsync", "dirty"];

#[derive(Clone, Debug)]
pub struct LabOpts {
    /// Small sizes (CI, the lab on its default run).
    pub quick: bool,
    /// Near the seed's own scale (`--full`); overrides `quick`.
    pub full: bool,
    pub json: bool,
    /// Repetitions of each arm (interleaved; the median is reported).
    pub rounds: Option<usize>,
    pub runtime: Option<Duration>,
    /// Where progress goes.
    pub sink: crate::progress::Sink,
}

#[derive(Serialize)]
pub struct Experiment<A: Serialize> {
    pub experiment: &'static str,
    pub arms: Vec<A>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// The report's plots; not in `--json` (the report writes each to `DIR/ID.json`).
    #[serde(skip)]
    pub plots: Vec<plots::Plot>,
    /// A command per arm that runs it alone (`wbstack bench ...`).
    #[serde(skip)]
    pub commands: Vec<String>,
}

/// One arm's instruments: the meter its tool bumps, its progress step, and the sampler
/// that turns both and the volume's state into a timeline.
pub struct ArmRun {
    pub meter: Arc<Meter>,
    sampler: timeline::Sampler,
}

impl ArmRun {
    /// `len`: the units `progress(meter)` counts to (files, bytes), if known.
    pub fn start(
        o: &LabOpts,
        label: &str,
        len: Option<u64>,
        unit: &'static str,
        vol: Option<Arc<VolumeFs>>,
        progress: fn(&Meter) -> u64,
    ) -> ArmRun {
        let meter = Arc::new(Meter::default());
        let step = Arc::new(Step::start(o.sink, label, len, unit));
        let sampler = timeline::start_arm(
            timeline::period(o.quick && !o.full),
            vol,
            meter.clone(),
            step,
            progress,
        );
        ArmRun { meter, sampler }
    }

    pub fn finish(self) -> timeline::Timeline {
        self.sampler.finish()
    }
}

/// The flag that picks a run's sizes again: " --full", " --quick" or nothing.
pub fn scale_flag(quick: bool, full: bool) -> &'static str {
    if full {
        " --full"
    } else if quick {
        " --quick"
    } else {
        ""
    }
}

/// Relative change, as the seeds print it: +36.7%.
pub fn pct(new: f64, old: f64) -> String {
    if old == 0.0 {
        return "-".into();
    }
    format!("{:+.1}%", (new / old - 1.0) * 100.0)
}

/// 24000 → "24,000".
pub fn fmt_int(v: f64) -> String {
    let s = format!("{:.0}", v);
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 && c != '-' {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The x labels of the sim device's write-size buckets: "4K" .. "2M", ">2M".
pub fn write_size_labels() -> Vec<String> {
    use wbstack::dev::sim::WRITE_SIZE_BUCKETS;
    (0..WRITE_SIZE_BUCKETS)
        .map(|i| {
            if i + 1 == WRITE_SIZE_BUCKETS {
                ">2M".to_string()
            } else if i >= 8 {
                format!("{}M", (4u64 << i) >> 10)
            } else {
                format!("{}K", 4u64 << i)
            }
        })
        .collect()
}
