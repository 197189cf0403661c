//! The tree's nodes on the volume's device: read through the block layer (so metadata
//! reads count in diskstats and wbt sees them, as the kernel's buffer cache reads do),
//! with a bounded cache of node bytes in front, so a checkpoint touching a path again
//! reads it from memory. Written nodes enter the cache as they are written; a node
//! block given back to the allocator leaves it. A read from the device fills the cache
//! only if the block was neither written nor given back since the read was issued:
//! readers of an older root run without the tree's lock, and a slow read of a block
//! freed and written again meanwhile would otherwise put the old bytes over the new.

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
    /// Device reads in flight, by block: the ticket of the one that may fill the cache.
    /// A write or a forget of the block takes it away (what the read brings back may
    /// be older than either); a later read of the block takes it over (the earlier
    /// one's bytes then go uncached, never wrong).
    reading: FxHashMap<u64, u64>,
    next_ticket: u64,
}

struct Slot {
    bytes: Arc<Vec<u8>>,
    referenced: bool,
    gen: u64,
}

impl NodeCache {
    fn new(limit_bytes: usize) -> NodeCache {
        NodeCache {
            map: FxHashMap::default(),
            queue: LazyLru::new(),
            bytes: 0,
            limit_bytes,
            stats: StoreStats::default(),
            reading: FxHashMap::default(),
            next_ticket: 0,
        }
    }

    /// A read of `block` from the device is about to be issued: the ticket its `fill`
    /// must show.
    fn start_read(&mut self, block: u64) -> u64 {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.reading.insert(block, ticket);
        ticket
    }

    /// The read of `block` issued under `ticket` ended with `bytes` (None: it failed).
    /// They are cached only if nothing wrote or forgot the block since.
    fn fill(&mut self, block: u64, ticket: u64, bytes: Option<Arc<Vec<u8>>>) {
        if self.reading.get(&block) != Some(&ticket) {
            return;
        }
        self.reading.remove(&block);
        if let Some(bytes) = bytes {
            self.insert(block, bytes);
        }
    }

    /// `bytes` were just written to `block`: they are its bytes now, whatever a read
    /// in flight brings back.
    fn insert_written(&mut self, block: u64, bytes: Arc<Vec<u8>>) {
        self.reading.remove(&block);
        self.insert(block, bytes);
    }

    /// `block` is no node any more: nothing cached, and nothing a read in flight
    /// brings back.
    fn forget(&mut self, block: u64) {
        self.reading.remove(&block);
        if let Some(s) = self.map.remove(&block) {
            self.bytes -= s.bytes.len();
        }
    }

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
            cache: Mutex::new(NodeCache::new(cache_bytes)),
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
            c.insert_written(b, Arc::new(bytes));
        }
        Ok(())
    }

    /// A node block went back to the allocator: its bytes are no node any more.
    pub fn forget(&self, block: u64) {
        self.cache.lock().forget(block);
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
        let want: Vec<(u64, u64)> = {
            let mut c = self.cache.lock();
            let mut want: Vec<u64> = blocks
                .iter()
                .copied()
                .filter(|b| self.area.contains(b) && !c.map.contains_key(b))
                .collect();
            // In block order, in one plug: neighbours merge into larger reads. No more
            // than half the cache holds, or the first would be gone before they are
            // read.
            want.sort_unstable();
            want.dedup();
            want.truncate(c.limit_bytes / self.node_size / 2);
            want.into_iter().map(|b| (b, c.start_read(b))).collect()
        };
        if want.is_empty() {
            return;
        }
        let w = crate::block::BioWait::new();
        let mut sent = 0;
        {
            let _plug = crate::block::Plug::start();
            for &(b, _) in &want {
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
        let mut done: FxHashMap<u64, Arc<Vec<u8>>> = FxHashMap::default();
        for (bio, status) in w.wait_n(sent) {
            // A failed read is left for `read`, which reports it with the block.
            if let (Ok(_), Some(buf)) = (status, bio.buf) {
                done.insert(self.block_of(bio.sector), Arc::new(buf.as_slice().to_vec()));
            }
        }
        let mut c = self.cache.lock();
        // Each a node read from the device, as a miss of `read` is.
        c.stats.misses += sent as u64;
        // Every ticket ends here, the reads not sent or failed with no bytes.
        for (b, ticket) in want {
            let bytes = done.remove(&b);
            c.fill(b, ticket, bytes);
        }
    }

    fn read(&self, block: u64) -> TreeResult<Vec<u8>> {
        let ticket = {
            let mut c = self.cache.lock();
            if let Some(s) = c.map.get_mut(&block) {
                s.referenced = true;
                let bytes = s.bytes.to_vec();
                c.stats.hits += 1;
                return Ok(bytes);
            }
            c.stats.misses += 1;
            self.area.contains(&block).then(|| c.start_read(block))
        };
        let Some(ticket) = ticket else {
            return Err(TreeError::BadPointer {
                block,
                why: format!("outside the area {:?} nodes live in", self.area),
            });
        };
        let read = self
            .q
            .read_sync(self.sector(block), self.node_size)
            .map(|buf| buf.as_slice().to_vec());
        // The reader keeps its bytes whatever the cache does with them: a reader of an
        // older root checks them against its own pointer.
        self.cache.lock().fill(
            block,
            ticket,
            read.as_ref().ok().map(|b| Arc::new(b.clone())),
        );
        read.map_err(|e| TreeError::Io {
            block,
            why: e.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(byte: u8) -> Arc<Vec<u8>> {
        Arc::new(vec![byte; 4096])
    }

    /// The first byte of what the cache holds for `block`.
    fn cached(c: &NodeCache, block: u64) -> Option<u8> {
        c.map.get(&block).map(|s| s.bytes[0])
    }

    /// The reviewer's sequence: a reader of root k-1 (no tree lock) issues its read of
    /// block 7, which brings back the old node late; meanwhile checkpoint k becomes
    /// durable and frees 7, and checkpoint k+1 writes a new node there. The old bytes
    /// must not replace the new: a later read of 7 would fail its parent's checksum
    /// with a clean disk.
    #[test]
    fn a_read_issued_before_its_block_was_freed_and_written_again_leaves_the_new_bytes() {
        let mut c = NodeCache::new(1 << 20);
        let old_read = c.start_read(7);
        c.forget(7);
        c.insert_written(7, node(2));
        c.fill(7, old_read, Some(node(1)));
        assert_eq!(cached(&c, 7), Some(2));
        assert_eq!(c.bytes, 4096);
        assert!(c.reading.is_empty(), "every read's ticket ended");
    }

    #[test]
    fn a_read_fills_the_cache_only_if_its_block_was_not_written_or_forgotten_since() {
        let mut c = NodeCache::new(1 << 20);
        // Forgotten while the read was in flight: the block is no node any more.
        let read = c.start_read(7);
        c.forget(7);
        c.fill(7, read, Some(node(1)));
        assert_eq!(cached(&c, 7), None);
        // Written while the read was in flight: the read may have seen either.
        let read = c.start_read(8);
        c.insert_written(8, node(2));
        c.fill(8, read, Some(node(1)));
        assert_eq!(cached(&c, 8), Some(2));
        // Nothing meanwhile: cached, as before.
        let read = c.start_read(9);
        c.fill(9, read, Some(node(3)));
        assert_eq!(cached(&c, 9), Some(3));
        // A read after a write sees the write.
        let read = c.start_read(8);
        c.fill(8, read, Some(node(2)));
        assert_eq!(cached(&c, 8), Some(2));
        // Two reads of one block: the later fills, the earlier's bytes go uncached.
        let first = c.start_read(11);
        let second = c.start_read(11);
        c.fill(11, first, Some(node(4)));
        assert_eq!(cached(&c, 11), None);
        c.fill(11, second, Some(node(4)));
        assert_eq!(cached(&c, 11), Some(4));
        // A failed read ends its ticket too.
        let read = c.start_read(12);
        c.fill(12, read, None);
        assert_eq!(cached(&c, 12), None);
        assert!(c.reading.is_empty(), "every read's ticket ended");
        assert_eq!(c.bytes, 3 * 4096, "blocks 8, 9 and 11");
    }
}
