//! The tree's nodes on the volume's device: read through the block layer (so metadata
//! reads count in diskstats and wbt sees them, as the kernel's buffer cache reads do),
//! with a bounded cache of node bytes in front, so a checkpoint touching a path again
//! reads it from memory. Written nodes enter the cache as they are written; a node
//! block given back to the allocator leaves it.

use super::{NodeStore, TreeError, TreeResult};
use crate::block::{BioFlags, RequestQueue};
use crate::buf::IoBuf;
use crate::fs::lazylru::LazyLru;
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::ops::Range;
use std::sync::Arc;

const SECTOR: u64 = 512;

pub struct DeviceStore {
    q: Arc<RequestQueue>,
    node_size: usize,
    /// Blocks a node may live in (the data area): a pointer elsewhere is corruption.
    area: Range<u64>,
    cache: Mutex<NodeCache>,
}

/// Cache counters (`DeviceStore::stats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    pub hits: u64,
    pub misses: u64,
    pub cached_bytes: u64,
}

struct NodeCache {
    map: FxHashMap<u64, Slot>,
    /// Second-chance order, oldest first; stale entries are skipped.
    queue: LazyLru,
    bytes: usize,
    limit_bytes: usize,
    stats: StoreStats,
}

struct Slot {
    bytes: Arc<Vec<u8>>,
    referenced: bool,
    gen: u64,
}

impl NodeCache {
    fn insert(&mut self, block: u64, bytes: Arc<Vec<u8>>) {
        let gen = self.queue.push(block);
        self.bytes += bytes.len();
        if let Some(old) = self.map.insert(
            block,
            Slot {
                bytes,
                referenced: false,
                gen,
            },
        ) {
            self.bytes -= old.bytes.len();
        }
        self.shrink();
    }

    /// Drop nodes, oldest unreferenced first, until the cache is within its limit.
    fn shrink(&mut self) {
        while self.bytes > self.limit_bytes {
            let Some((b, g)) = self.queue.pop_oldest() else {
                break;
            };
            let Some(s) = self.map.get_mut(&b).filter(|s| s.gen == g) else {
                continue;
            };
            if std::mem::take(&mut s.referenced) {
                self.queue.requeue(b, g);
                continue;
            }
            let s = self.map.remove(&b).expect("found above");
            self.bytes -= s.bytes.len();
        }
        let map = &self.map;
        self.queue
            .compact(map.len(), |b, g| map.get(&b).is_some_and(|s| s.gen == g));
    }
}

impl DeviceStore {
    pub fn new(
        q: Arc<RequestQueue>,
        node_size: usize,
        area: Range<u64>,
        cache_bytes: usize,
    ) -> DeviceStore {
        debug_assert!(node_size.is_multiple_of(4096), "nodes are whole blocks");
        DeviceStore {
            q,
            node_size,
            area,
            cache: Mutex::new(NodeCache {
                map: FxHashMap::default(),
                queue: LazyLru::new(),
                bytes: 0,
                limit_bytes: cache_bytes,
                stats: StoreStats::default(),
            }),
        }
    }

    fn sector(&self, block: u64) -> u64 {
        block * (self.node_size as u64 / SECTOR)
    }

    fn block_of(&self, sector: u64) -> u64 {
        sector / (self.node_size as u64 / SECTOR)
    }

    /// Write nodes (as `Tree::write_dirty` produced them) in one plug, adjacent ones
    /// merged, and wait; plain writes, made durable by the flush of the record that
    /// points at them.
    pub fn write(&self, nodes: Vec<(u64, Vec<u8>)>) -> TreeResult<()> {
        let w = crate::block::BioWait::new();
        {
            let _plug = crate::block::Plug::start();
            for (b, bytes) in &nodes {
                if !self.area.contains(b) {
                    return Err(TreeError::NoSpace(format!(
                        "block {b} is outside the area {:?}",
                        self.area
                    )));
                }
                let bio = crate::block::Bio::write(self.sector(*b), IoBuf::from_slice(bytes))
                    .with_flags(BioFlags::META)
                    .with_end_io(w.clone());
                self.q.submit_bio(bio).map_err(|e| TreeError::Io {
                    block: *b,
                    why: e.to_string(),
                })?;
            }
        }
        for _ in &nodes {
            let (bio, st) = w.wait_one();
            st.map_err(|e| TreeError::Io {
                block: self.block_of(bio.sector),
                why: e.to_string(),
            })?;
        }
        let mut c = self.cache.lock();
        for (b, bytes) in nodes {
            c.insert(b, Arc::new(bytes));
        }
        Ok(())
    }

    /// A node block went back to the allocator: its bytes are no node any more.
    pub fn forget(&self, block: u64) {
        let mut c = self.cache.lock();
        if let Some(s) = c.map.remove(&block) {
            c.bytes -= s.bytes.len();
        }
    }

    /// The bytes of nodes the cache keeps (`MountOptions::node_cache`); a lower limit
    /// drops nodes at once.
    pub fn cache_limit(&self) -> usize {
        self.cache.lock().limit_bytes
    }

    pub fn set_cache_limit(&self, bytes: usize) {
        let mut c = self.cache.lock();
        c.limit_bytes = bytes;
        c.shrink();
    }

    pub fn stats(&self) -> StoreStats {
        let c = self.cache.lock();
        StoreStats {
            cached_bytes: c.bytes as u64,
            ..c.stats
        }
    }
}

impl NodeStore for DeviceStore {
    fn prefetch(&self, blocks: &[u64]) {
        let (mut want, room): (Vec<u64>, usize) = {
            let c = self.cache.lock();
            let want = blocks
                .iter()
                .copied()
                .filter(|b| self.area.contains(b) && !c.map.contains_key(b))
                .collect();
            (want, c.limit_bytes / self.node_size / 2)
        };
        // In block order, in one plug: neighbours merge into larger reads. No more
        // than half the cache holds, or the first would be gone before they are read.
        want.sort_unstable();
        want.dedup();
        want.truncate(room);
        if want.is_empty() {
            return;
        }
        let w = crate::block::BioWait::new();
        let mut sent = 0;
        {
            let _plug = crate::block::Plug::start();
            for &b in &want {
                let bio = crate::block::Bio::read(self.sector(b), self.node_size)
                    .with_flags(BioFlags::META)
                    .with_end_io(w.clone());
                if self.q.submit_bio(bio).is_err() {
                    // The read of this node will meet the error and report it.
                    break;
                }
                sent += 1;
            }
        }
        let done = w.wait_n(sent);
        let mut c = self.cache.lock();
        // Each a node read from the device, as a miss of `read` is.
        c.stats.misses += sent as u64;
        for (bio, status) in done {
            // A failed read is left for `read`, which reports it with the block.
            if let (Ok(_), Some(buf)) = (status, bio.buf) {
                c.insert(self.block_of(bio.sector), Arc::new(buf.as_slice().to_vec()));
            }
        }
    }

    fn read(&self, block: u64) -> TreeResult<Vec<u8>> {
        {
            let mut c = self.cache.lock();
            if let Some(s) = c.map.get_mut(&block) {
                s.referenced = true;
                let bytes = s.bytes.to_vec();
                c.stats.hits += 1;
                return Ok(bytes);
            }
            c.stats.misses += 1;
        }
        if !self.area.contains(&block) {
            return Err(TreeError::BadPointer {
                block,
                why: format!("outside the area {:?} nodes live in", self.area),
            });
        }
        let buf = self
            .q
            .read_sync(self.sector(block), self.node_size)
            .map_err(|e| TreeError::Io {
                block,
                why: e.to_string(),
            })?;
        let bytes = buf.as_slice().to_vec();
        self.cache.lock().insert(block, Arc::new(bytes.clone()));
        Ok(bytes)
    }
}
