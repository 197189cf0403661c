// Shared by the block-layer tests: a device wrapper that records every request it is
// handed, so tests can check what the block layer built.
#![allow(dead_code)]

use parking_lot::Mutex;
use std::any::Any;
use std::sync::Arc;
use wbstack::block::{BioFlags, Op, Request};
use wbstack::dev::{Completer, Device, DeviceRef, Geometry};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RqInfo {
    pub op: Op,
    pub flags: BioFlags,
    pub sector: u64,
    pub nr_sectors: u32,
    pub nr_bios: usize,
    pub nr_segments: u32,
    /// Each bio's (sector, nr_sectors) in request order.
    pub bios: Vec<(u64, u32)>,
}

pub struct Recorder {
    pub inner: DeviceRef,
    pub log: Mutex<Vec<RqInfo>>,
    spec: String,
}

impl Recorder {
    pub fn new(inner: DeviceRef) -> Arc<Recorder> {
        let spec = format!("recorder({})", inner.spec());
        Arc::new(Recorder {
            inner,
            log: Mutex::new(Vec::new()),
            spec,
        })
    }
    pub fn take(&self) -> Vec<RqInfo> {
        std::mem::take(&mut *self.log.lock())
    }
}

impl Device for Recorder {
    fn geometry(&self) -> &Geometry {
        self.inner.geometry()
    }
    fn spec(&self) -> &str {
        &self.spec
    }
    fn queue_rq(&self, rq: Request, done: &Completer) {
        self.log.lock().push(RqInfo {
            op: rq.op,
            flags: rq.flags,
            sector: rq.sector,
            nr_sectors: rq.nr_sectors,
            nr_bios: rq.bios.len(),
            nr_segments: rq.nr_segments,
            bios: rq.bios.iter().map(|b| (b.sector, b.nr_sectors)).collect(),
        });
        self.inner.queue_rq(rq, done)
    }
    fn commit_rqs(&self, h: u16) {
        self.inner.commit_rqs(h)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
