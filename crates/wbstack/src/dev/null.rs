//! The null device, like the kernel's null_blk: no media, completes every request at
//! once (or `completion_nsec` later), optionally memory-backed so data reads back.
//!
//! Spec: `null[,size=250G][,lbs=512][,hw_queues=NCPU][,qd=64][,completion_nsec=0]
//! [,memory_backed=0][,wc=0]`.

use super::store::SparseStore;
use super::timer::CompletionTimer;
use super::{
    geometry_from_spec, nr_cpus, Completer, Device, DeviceSpec, Geometry, SpecError, GEOMETRY_KEYS,
};
use crate::block::bio::{BlkResult, Op, Request};
use crate::clock::ClockRef;
use parking_lot::Mutex;
use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub struct NullDevice {
    spec: String,
    geo: Geometry,
    clock: ClockRef,
    completion_nsec: u64,
    store: Option<Arc<Mutex<SparseStore>>>,
    /// Requests are parked in the device until released (tests of in-flight state).
    held: AtomicBool,
    timer: CompletionTimer,
}

fn move_data(store: &Mutex<SparseStore>, rq: &mut Request) -> BlkResult {
    let mut sector = rq.sector;
    match rq.op {
        Op::Read => {
            let s = store.lock();
            for b in rq.buffers_mut() {
                s.read(sector, b.as_mut_slice());
                sector += (b.len() / 512) as u64;
            }
        }
        Op::Write => {
            let mut s = store.lock();
            for b in rq.bios.iter().filter_map(|b| b.buf.as_ref()) {
                s.write(sector, b.as_slice());
                sector += (b.len() / 512) as u64;
            }
        }
        Op::Discard => store.lock().discard(rq.sector, rq.nr_sectors as u64),
        Op::Flush => {}
    }
    Ok(())
}

impl NullDevice {
    pub fn from_spec(spec: &DeviceSpec, clock: ClockRef) -> Result<NullDevice, SpecError> {
        let geo = geometry_from_spec(
            spec,
            Geometry {
                size_bytes: 250 << 30,
                logical_block_size: 512,
                max_hw_sectors: 65536,
                max_segments: 128,
                max_segment_size: 65536,
                rotational: false,
                write_cache: false,
                nr_hw_queues: nr_cpus() as u16,
                queue_depth: 64,
            },
        )?;
        let completion_nsec = spec.duration_ns("completion_nsec", 0)?;
        let memory_backed = spec.bool("memory_backed", false)?;
        spec.finish(&format!("{GEOMETRY_KEYS}, completion_nsec, memory_backed"))?;
        let store = memory_backed.then(|| Arc::new(Mutex::new(SparseStore::new())));
        let st2 = store.clone();
        let timer = CompletionTimer::new(
            "null",
            clock.clone(),
            Box::new(move |rq| match &st2 {
                Some(s) => move_data(s, rq),
                None => Ok(()),
            }),
        );
        Ok(NullDevice {
            spec: spec.raw.clone(),
            geo,
            clock,
            completion_nsec,
            store,
            held: AtomicBool::new(false),
            timer,
        })
    }

    /// Keep every request in the device until `hold(false)`.
    pub fn hold(&self, on: bool) {
        self.held.store(on, Ordering::SeqCst);
        self.timer.set_held(on);
    }

    /// Requests currently inside the device (held or waiting for completion_nsec).
    pub fn pending(&self) -> usize {
        self.timer.pending()
    }

    /// Replace the whole media by `image` (shared chunks, no data copy): how a crash
    /// state built from a write log becomes a device. Errors when the device keeps no
    /// data.
    pub fn set_image(&self, image: SparseStore) -> Result<(), String> {
        let Some(store) = &self.store else {
            return Err("the null device keeps no data (memory_backed=0)".into());
        };
        *store.lock() = image;
        Ok(())
    }

    /// Put `data` on the media at `sector` without a request: how an image from a file
    /// (a fuzzer's input, a crash state rebuilt from a write log) becomes a device.
    /// Errors when the device keeps no data (memory_backed=0), when `data` is not whole
    /// sectors, or when it does not fit.
    pub fn load(&self, sector: u64, data: &[u8]) -> Result<(), String> {
        let Some(store) = &self.store else {
            return Err("the null device keeps no data (memory_backed=0)".into());
        };
        if !data.len().is_multiple_of(512) {
            return Err(format!(
                "{} bytes is not a whole number of sectors",
                data.len()
            ));
        }
        let end = sector
            .checked_add(data.len() as u64 / 512)
            .filter(|&e| e <= self.geo.nr_sectors())
            .ok_or_else(|| {
                format!(
                    "{} bytes at sector {sector} do not fit a device of {} sectors",
                    data.len(),
                    self.geo.nr_sectors()
                )
            })?;
        debug_assert!(end >= sector);
        store.lock().write(sector, data);
        Ok(())
    }
}

impl Device for NullDevice {
    fn geometry(&self) -> &Geometry {
        &self.geo
    }
    fn spec(&self) -> &str {
        &self.spec
    }
    #[inline]
    fn queue_rq(&self, mut rq: Request, done: &Completer) {
        if self.completion_nsec == 0 && !self.held.load(Ordering::Relaxed) {
            let status = match &self.store {
                Some(s) => move_data(s, &mut rq),
                None => Ok(()),
            };
            done.complete(rq, status);
        } else {
            let due = self.clock.now_ns() + self.completion_nsec;
            self.timer.schedule(due, rq, done, None);
        }
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
