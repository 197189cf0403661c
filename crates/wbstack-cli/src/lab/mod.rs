//! `wbstack lab`: the seed experiments, each arm run in one process, printed beside the
//! figures of the LKML thread it reproduces. One file per experiment.

pub mod expire;
pub mod fsync;
pub mod inflight;
pub mod kernel;
pub mod plots;
pub mod plug;
pub mod timeline;
pub mod wbt;

use serde::Serialize;
use std::time::Duration;

/// Every experiment that exists so far.
pub const EXPERIMENTS: &[&str] = &["plug", "expire", "inflight", "wbt", "fsync"];

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
