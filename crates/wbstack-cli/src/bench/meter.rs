//! Counters a tool bumps as it works, for a sampler on another thread to read (the
//! lab's time series, progress bars): files made, bytes moved, late operations.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Default)]
pub struct Meter {
    /// Operations done: files created (fs_mark, tar), reads (readlat).
    pub ops: AtomicU64,
    /// Bytes moved: dd's bytes written (tardd), bytes read (readlat).
    pub bytes: AtomicU64,
    /// Operations over their latency target (readlat's `Over`).
    pub late: AtomicU64,
}

impl Meter {
    pub fn ops(&self) -> u64 {
        self.ops.load(Ordering::Relaxed)
    }
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
    pub fn late(&self) -> u64 {
        self.late.load(Ordering::Relaxed)
    }
}
