//! Devices: what the block layer drives.
//!
//! Every device is named by a spec string, used the same way by the API, the CLI and
//! the tests:
//! - `null[,opts]` — completes at once (like null_blk), see [`null`].
//! - `sim:ssd[,opts]`, `sim:hdd[,opts]` — memory-backed with a timing model, a volatile
//!   write cache and fault injection, see [`sim`].
//! - `file:PATH[,opts]` — a file or block device through O_DIRECT and io_uring, see
//!   [`uring`].

pub mod null;
pub mod sim;
pub mod spec;
pub mod store;
pub mod timer;
pub mod uring;

use crate::block::bio::{BlkResult, Request};
use crate::clock::ClockRef;
use std::any::Any;
use std::sync::Arc;

pub use spec::{parse_duration, parse_size, spec_kind, DeviceSpec, SpecError};

/// The device's geometry and queue properties (the kernel's queue limits).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Capacity in bytes (a multiple of `logical_block_size`).
    pub size_bytes: u64,
    /// Smallest addressable unit; every IO is aligned to it.
    pub logical_block_size: u32,
    /// Largest request the device accepts, in 512-byte sectors.
    pub max_hw_sectors: u32,
    /// Largest number of physical segments in one request.
    pub max_segments: u32,
    /// Largest physical segment in bytes.
    pub max_segment_size: u32,
    pub rotational: bool,
    /// The device has a volatile write cache: writes need FLUSH/FUA to be durable.
    pub write_cache: bool,
    pub nr_hw_queues: u16,
    /// Tags per hardware queue.
    pub queue_depth: u32,
}

impl Geometry {
    pub fn nr_sectors(&self) -> u64 {
        self.size_bytes >> 9
    }
}

/// Receives completed requests. Implemented by the block layer.
pub trait RqComplete: Send + Sync {
    fn complete(&self, rq: Request, status: BlkResult);
}

pub type Completer = Arc<dyn RqComplete>;

/// A block device driver.
///
/// The block layer calls `queue_rq` with a request that already holds a tag; the device
/// executes it and calls `done.complete(rq, status)` exactly once, from any thread,
/// possibly before `queue_rq` returns. Requests arrive validated: aligned to the logical
/// block size, inside the device, within `max_hw_sectors` and `max_segments`.
pub trait Device: Send + Sync + 'static {
    fn geometry(&self) -> &Geometry;

    /// The spec string this device was opened with.
    fn spec(&self) -> &str;

    fn queue_rq(&self, rq: Request, done: &Completer);

    /// End of a batch of `queue_rq` calls on `hctx`: a device that batches submissions
    /// (io_uring) submits them now.
    fn commit_rqs(&self, _hctx: u16) {}

    /// Reap completions in the calling thread, waiting up to `timeout_ns` for one
    /// (polled IO, as with the kernel's io polling). Returns the requests completed by
    /// this call; a device that cannot poll returns 0 and completes on its own.
    /// A thread that polls the file device gets its own ring: its later requests then
    /// complete only while it polls (or waits in the block layer, which polls for it).
    fn poll(&self, _hctx: u16, _timeout_ns: u64) -> usize {
        0
    }

    /// Whether `poll` can reap anything (else callers wait for completions instead).
    fn can_poll(&self) -> bool {
        false
    }

    /// Whether a block's first write costs more than later ones: a sparse file, whose
    /// host filesystem allocates at the first write into a hole (and a write with FUA
    /// then waits for the host's journal too). mkfs writes the journal once on such a
    /// device, so commits overwrite, as mke2fs zeroes its journal where discard does
    /// not, and PostgreSQL zero-fills new WAL segments (wal_init_zero).
    fn first_write_allocates(&self) -> bool {
        false
    }

    /// For downcasting to a concrete device (fault injection, power cut).
    fn as_any(&self) -> &dyn Any;
}

pub type DeviceRef = Arc<dyn Device>;

/// Inside `impl Device for X` of a device stacked on another (the field `$inner`, a
/// `DeviceRef`): every method but `queue_rq` passed through, so a wrapper that logs,
/// probes or rewrites requests states only what it changes.
#[macro_export]
macro_rules! stacked_device {
    ($inner:tt) => {
        fn geometry(&self) -> &$crate::dev::Geometry {
            self.$inner.geometry()
        }
        fn spec(&self) -> &str {
            self.$inner.spec()
        }
        fn commit_rqs(&self, hctx: u16) {
            self.$inner.commit_rqs(hctx)
        }
        fn poll(&self, hctx: u16, timeout_ns: u64) -> usize {
            self.$inner.poll(hctx, timeout_ns)
        }
        fn can_poll(&self) -> bool {
            self.$inner.can_poll()
        }
        fn first_write_allocates(&self) -> bool {
            self.$inner.first_write_allocates()
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    };
}

/// Open a device from its spec string.
pub fn open(spec: &str, clock: ClockRef) -> Result<DeviceRef, SpecError> {
    let parsed = DeviceSpec::parse(spec)?;
    match parsed.kind.as_str() {
        "null" => Ok(Arc::new(null::NullDevice::from_spec(&parsed, clock)?)),
        "sim:ssd" | "sim:hdd" => Ok(Arc::new(sim::SimDevice::from_spec(&parsed, clock)?)),
        "file" => Ok(Arc::new(uring::UringDevice::from_spec(&parsed)?)),
        other => {
            // A bare image path is not a spec here; say how to write it as one.
            let hint = if other.contains(['/', '.']) {
                format!("; an image file is file:{other}")
            } else {
                String::new()
            };
            Err(SpecError::new(
                spec,
                format!("unknown device kind '{other}' (expected null, sim:ssd, sim:hdd or file:PATH{hint})"),
            ))
        }
    }
}

/// Read the geometry options common to every device kind (`size`, `lbs`, `hw_queues`,
/// `qd`, `max_hw_kb`, `wc`, `rotational`), starting from the kind's defaults, and check
/// them.
pub fn geometry_from_spec(spec: &DeviceSpec, d: Geometry) -> Result<Geometry, SpecError> {
    let lbs = spec.size("lbs", d.logical_block_size as u64)?;
    if !(512..=65536).contains(&lbs) || !lbs.is_power_of_two() {
        return Err(spec.err(format!(
            "lbs={lbs}: the logical block size must be a power of two from 512 to 65536"
        )));
    }
    let size = spec.size("size", d.size_bytes)?;
    if size == 0 {
        return Err(spec.err("size must be larger than zero"));
    }
    if size % lbs != 0 {
        return Err(spec.err(format!(
            "size={size} is not a multiple of the logical block size {lbs}"
        )));
    }
    let hw_queues = spec.u64("hw_queues", d.nr_hw_queues as u64)?;
    if !(1..=128).contains(&hw_queues) {
        return Err(spec.err(format!("hw_queues={hw_queues}: must be from 1 to 128")));
    }
    let qd = spec.u64("qd", d.queue_depth as u64)?;
    if !(1..=4096).contains(&qd) {
        return Err(spec.err(format!("qd={qd}: the queue depth must be from 1 to 4096")));
    }
    let max_hw_kb = spec.u64("max_hw_kb", (d.max_hw_sectors / 2) as u64)?;
    if max_hw_kb * 1024 < lbs || max_hw_kb > 1 << 20 {
        return Err(spec.err(format!(
            "max_hw_kb={max_hw_kb}: must hold one block and be at most 1 GiB"
        )));
    }
    Ok(Geometry {
        size_bytes: size,
        logical_block_size: lbs as u32,
        max_hw_sectors: (max_hw_kb * 2) as u32,
        max_segments: d.max_segments,
        max_segment_size: d.max_segment_size,
        rotational: spec.bool("rotational", d.rotational)?,
        write_cache: spec.bool("wc", d.write_cache)?,
        nr_hw_queues: hw_queues as u16,
        queue_depth: qd as u32,
    })
}

/// Number of CPUs, for per-CPU defaults (hardware queues, stat shards).
pub fn nr_cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

pub const GEOMETRY_KEYS: &str = "size, lbs, hw_queues, qd, max_hw_kb, wc, rotational";
