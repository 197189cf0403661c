//! Helpers shared by the filesystem tests: volumes on simulated devices.
#![allow(dead_code)]

use std::sync::Arc;
use wbstack::block::{QueueConfig, RequestQueue};
use wbstack::dev::sim::SimDevice;
use wbstack::fs::{MkfsOptions, MountOptions, Volume};

pub fn queue(spec: &str) -> Arc<RequestQueue> {
    RequestQueue::open(spec, QueueConfig::default()).unwrap()
}

pub fn sim(q: &Arc<RequestQueue>) -> &SimDevice {
    q.device().as_any().downcast_ref::<SimDevice>().unwrap()
}

/// Periodic writeback and commits far away: tests decide when things happen.
pub fn quiet() -> MountOptions {
    let mut o = MountOptions::default();
    o.wb.dirty_writeback_centisecs = 0;
    o.commit_interval_ms = 3_600_000;
    o
}

/// A freshly made and mounted volume on the device of `spec`.
pub fn fresh_with(spec: &str, o: MountOptions) -> (Arc<RequestQueue>, Volume) {
    let q = queue(spec);
    Volume::mkfs(&q, &MkfsOptions::default()).unwrap();
    let v = Volume::mount(q.clone(), o).unwrap();
    (q, v)
}

/// Hold the device and start writeback of everything dirty; return once a write is
/// inside the device (held there until `sim(q).hold(false)`).
pub fn writeback_held_in_device(
    q: &Arc<RequestQueue>,
    v: &Volume,
) -> wbstack::writeback::WorkHandle {
    sim(q).hold(true);
    let h = v.bdi().start_writeback();
    let t0 = std::time::Instant::now();
    while sim(q).pending() == 0 {
        assert!(
            t0.elapsed().as_secs() < 10,
            "writeback never reached the device"
        );
        std::thread::yield_now();
    }
    h
}

/// Tree nodes in memory, for the B+tree's tests: what was written, by block.
#[derive(Default)]
pub struct MemStore {
    pub blocks: std::cell::RefCell<std::collections::HashMap<u64, Vec<u8>>>,
    next: std::cell::RefCell<u64>,
}

impl wbstack::fs::btree::NodeStore for MemStore {
    fn read(&self, block: u64) -> wbstack::fs::btree::TreeResult<Vec<u8>> {
        self.blocks
            .borrow()
            .get(&block)
            .cloned()
            .ok_or(wbstack::fs::btree::TreeError::Io {
                block,
                why: "never written".into(),
            })
    }
}

impl MemStore {
    /// Write the tree's dirty nodes to fresh blocks (never reused).
    pub fn write(&self, tree: &mut wbstack::fs::btree::Tree, seq: u64) {
        tree.write_dirty(
            seq,
            &mut || {
                let mut n = self.next.borrow_mut();
                *n += 1;
                Ok(*n)
            },
            &mut |blk, bytes| {
                self.blocks.borrow_mut().insert(blk, bytes);
                Ok(())
            },
        )
        .unwrap();
    }
}
