//! The rq_qos chain: policies that may hold a bio back before it becomes a request
//! (`throttle`), see it reach the device (`issue`) and complete (`done`). Writeback
//! throttling (wbt) is one such policy. Also the per-window latency statistics
//! (blk-stat) that wbt judges reads by.

use crate::block::bio::{Bio, Op, Request};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

pub trait RqQos: Send + Sync {
    fn name(&self) -> &'static str;

    /// Called for every bio that will become a new request (not for bios merged into a
    /// plugged request). May block; before blocking it must call
    /// [`crate::block::plug::flush_plug`] so the thread's own plugged IO can proceed.
    /// The returned byte is stored in `Request::qos_flags` for `done` to read.
    fn throttle(&self, _bio: &Bio) -> u8 {
        0
    }

    /// The request was handed to the device.
    fn issue(&self, _rq: &Request, _now_ns: u64) {}

    /// The request completed.
    fn done(&self, _rq: &Request, _now_ns: u64) {}
}

/// Latency of requests in one window: device service time (completion − dispatch).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct LatBucket {
    pub nr: u64,
    pub min_ns: u64,
    pub max_ns: u64,
    pub sum_ns: u64,
    /// Samples above the window's threshold (blk-iolatency's "missed").
    pub missed: u64,
}

impl LatBucket {
    fn add(&mut self, v: u64, threshold: u64) {
        self.missed += (v > threshold) as u64;
        if self.nr == 0 || v < self.min_ns {
            self.min_ns = v;
        }
        self.max_ns = self.max_ns.max(v);
        self.sum_ns += v;
        self.nr += 1;
    }
    pub fn mean_ns(&self) -> u64 {
        self.sum_ns.checked_div(self.nr).unwrap_or(0)
    }
}

/// Read and write latency buckets, collected only while armed (as blk-stat collects
/// only while a callback's timer is pending), so idle queues pay nothing.
pub struct LatencyWindow {
    armed: AtomicBool,
    buckets: Mutex<[LatBucket; 2]>,
    /// Samples above this count as missed.
    threshold_ns: AtomicU64,
}

impl Default for LatencyWindow {
    fn default() -> Self {
        LatencyWindow {
            armed: AtomicBool::new(false),
            buckets: Mutex::new(Default::default()),
            threshold_ns: AtomicU64::new(u64::MAX),
        }
    }
}

impl LatencyWindow {
    /// Count samples above `ns` as missed (u64::MAX: none).
    pub fn set_threshold(&self, ns: u64) {
        self.threshold_ns.store(ns, Ordering::Relaxed);
    }
    pub fn arm(&self, on: bool) {
        self.armed.store(on, Ordering::Release);
    }
    #[inline]
    pub fn is_armed(&self) -> bool {
        self.armed.load(Ordering::Relaxed)
    }
    /// Record one completion. Flushes are not latency samples (as in blk-stat).
    pub fn add(&self, op: Op, lat_ns: u64) {
        let b = match op {
            Op::Read => 0,
            Op::Write | Op::Discard => 1,
            Op::Flush => return,
        };
        let threshold = self.threshold_ns.load(Ordering::Relaxed);
        self.buckets.lock()[b].add(lat_ns, threshold);
    }
    /// Take the window's [read, write] buckets and start a new window.
    pub fn take(&self) -> [LatBucket; 2] {
        std::mem::take(&mut *self.buckets.lock())
    }
}
