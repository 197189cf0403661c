//! The tree's nodes on the volume's device: read through the block layer (so metadata
//! reads count in diskstats and wbt sees them, as the kernel's buffer cache reads do),
//! with a bounded cache of node bytes in front, so a checkpoint touching a path again
//! reads it from memory. Written nodes enter the cache as they are written; a node
//! block given back to the allocator leaves it. A read from the device fills the cache
//! only if the block was neither written nor given back since the read was issued:
//! readers of an older root run without the tree's lock, and a slow read of a block
//! freed and written again meanwhile would otherwise put the old bytes over the new.
//! A block is read once however many want it meanwhile: a reader of a block already
//! being read (ahead, or by another reader) waits for that read, and a read-ahead
//! leaves such a block out.

use super::{NodeStore, TreeError, TreeResult};
use crate::block::{BioFlags, RequestQueue};
use crate::buf::IoBuf;
use crate::fs::lazylru::LazyLru;
use parking_lot::{Condvar, Mutex};
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
    /// Nodes read from the device (by `read`, or ahead).
    pub misses: u64,
    /// Reads of a block another's device read had in flight, which waited for it
    /// instead of reading the block again.
    pub shared: u64,
    pub cached_bytes: u64,
}

struct NodeCache {
    map: FxHashMap<u64, Slot>,
    /// Second-chance order, oldest first; stale entries are skipped.
    queue: LazyLru,
    bytes: usize,
    limit_bytes: usize,
    stats: StoreStats,
    /// Device reads in flight, by block: the ticket of the one that may fill the cache,
    /// and its bytes for the readers that wait for it instead of reading the block
    /// again. A write or a forget of the block takes it away (what the read brings back
    /// may be older than either: a reader from then on reads anew); a later read of
    /// the block takes it over (the earlier one's bytes then go uncached, never wrong).
    reading: FxHashMap<u64, (u64, Arc<InFlight>)>,
    next_ticket: u64,
}

/// A device read of a node's block, for the readers that wait for it.
#[derive(Default)]
struct InFlight {
    /// None until the read ends; then its bytes, or None if it failed or was never
    /// sent (a reader waiting for it then reads the block itself, and so reports the
    /// error with its block, as a read-ahead leaves its errors to `read`).
    done: Mutex<Option<Option<Arc<Vec<u8>>>>>,
    cv: Condvar,
}

impl InFlight {
    /// The read ended; the first end counts.
    fn finish(&self, bytes: Option<Arc<Vec<u8>>>) {
        let mut d = self.done.lock();
        if d.is_none() {
            *d = Some(bytes);
            self.cv.notify_all();
        }
    }

    /// Its bytes, once the read ended (None: it failed). A waiting thread reaps its
    /// own requests meanwhile, as the block layer's waits do: the read waited for
    /// may be queued behind them.
    fn wait(&self) -> Option<Arc<Vec<u8>>> {
        crate::block::flush_plug();
        let mut d = self.done.lock();
        while d.is_none() {
            drop(d);
            let polled =
                crate::dev::uring::poll_own_rings(crate::block::queue::OWN_POLL_NS).is_some();
            d = self.done.lock();
            if !polled && d.is_none() {
                self.cv.wait(&mut d);
            }
        }
        d.clone().expect("ended above")
    }
}

/// A device read the cache let out (`NodeCache::start_read`): `fill` ends it. One
/// dropped unfilled (a panic on the way) ends with no bytes, so no reader waits for
/// it for good.
struct Ticket {
    n: u64,
    flight: Arc<InFlight>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.flight.finish(None);
    }
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
    fn start_read(&mut self, block: u64) -> Ticket {
        let n = self.next_ticket;
        self.next_ticket += 1;
        let flight = Arc::new(InFlight::default());
        self.reading.insert(block, (n, flight.clone()));
        Ticket { n, flight }
    }

    /// The device read of `block` in flight, if one is and nothing wrote or forgot the
    /// block since it was issued: its bytes are the block's as a read issued now would
    /// find them.
    fn in_flight(&self, block: u64) -> Option<Arc<InFlight>> {
        self.reading.get(&block).map(|(_, f)| f.clone())
    }

    /// The read of `block` issued under `ticket` ended with `bytes` (None: it failed).
    /// They are cached only if nothing wrote or forgot the block since; the readers
    /// waiting for the read get them either way (they came while it was current).
    fn fill(&mut self, block: u64, ticket: Ticket, bytes: Option<Arc<Vec<u8>>>) {
        if self
            .reading
            .get(&block)
            .is_some_and(|(n, _)| *n == ticket.n)
        {
            self.reading.remove(&block);
            if let Some(bytes) = &bytes {
                self.insert(block, bytes.clone());
            }
        }
        ticket.flight.finish(bytes);
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
        let mut want: Vec<(u64, Option<Ticket>)> = {
            let mut c = self.cache.lock();
            // Not a block cached, nor one being read (ahead, or by a reader): its
            // reader finds it cached or waits for that read.
            let mut want: Vec<u64> = blocks
                .iter()
                .copied()
                .filter(|b| {
                    self.area.contains(b) && !c.map.contains_key(b) && !c.reading.contains_key(b)
                })
                .collect();
            // In block order, in one plug: neighbours merge into larger reads. No more
            // than half the cache holds, or the first would be gone before they are
            // read.
            want.sort_unstable();
            want.dedup();
            want.truncate(c.limit_bytes / self.node_size / 2);
            want.into_iter()
                .map(|b| (b, Some(c.start_read(b))))
                .collect()
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
        // Each as it ends, so a reader waiting for one of them goes on at once.
        for _ in 0..sent {
            let (bio, status) = w.wait_one();
            let b = self.block_of(bio.sector);
            // A failed read is left for `read`, which reports it with the block.
            let bytes = match (status, bio.buf) {
                (Ok(_), Some(buf)) => Some(Arc::new(buf.as_slice().to_vec())),
                _ => None,
            };
            let ticket = want
                .binary_search_by_key(&b, |(b, _)| *b)
                .ok()
                .and_then(|i| want[i].1.take());
            let mut c = self.cache.lock();
            // Each a node read from the device, as a miss of `read` is.
            c.stats.misses += 1;
            if let Some(ticket) = ticket {
                c.fill(b, ticket, bytes);
            }
        }
        // The reads not sent end here, with no bytes.
        let mut c = self.cache.lock();
        for (b, ticket) in want {
            if let Some(ticket) = ticket {
                c.fill(b, ticket, None);
            }
        }
    }

    fn read(&self, block: u64) -> TreeResult<Vec<u8>> {
        let mut join = true;
        let ticket = loop {
            let flight = {
                let mut c = self.cache.lock();
                if let Some(s) = c.map.get_mut(&block) {
                    s.referenced = true;
                    let bytes = s.bytes.to_vec();
                    c.stats.hits += 1;
                    return Ok(bytes);
                }
                match c.in_flight(block).filter(|_| join) {
                    Some(f) => {
                        c.stats.shared += 1;
                        f
                    }
                    None => {
                        c.stats.misses += 1;
                        break self.area.contains(&block).then(|| c.start_read(block));
                    }
                }
            };
            // Another's read of the block is in flight: its bytes, not a second read.
            // If it failed, this reader reads the block itself (and reports the error),
            // not waiting for another's read again.
            if let Some(bytes) = flight.wait() {
                return Ok(bytes.to_vec());
            }
            join = false;
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

    use crate::block::{QueueConfig, RequestQueue};
    use crate::dev::sim::SimDevice;

    fn sim(q: &Arc<RequestQueue>) -> &SimDevice {
        q.device().as_any().downcast_ref::<SimDevice>().unwrap()
    }

    /// A simulated device with nodes in blocks 101..=104 (each node's bytes its block
    /// number), and a store over them whose cache holds none.
    fn cold_store() -> (Arc<RequestQueue>, DeviceStore) {
        let q = RequestQueue::open("sim:ssd,size=64M", QueueConfig::default()).unwrap();
        DeviceStore::new(q.clone(), 4096, 100..16384, 1 << 20)
            .write((101..105).map(|b| (b, vec![b as u8; 4096])).collect())
            .unwrap();
        let store = DeviceStore::new(q.clone(), 4096, 100..16384, 1 << 20);
        (q, store)
    }

    /// The device holds its requests until this is dropped, on a failed assertion too:
    /// the threads waiting for them then end, and the test fails instead of hanging.
    struct Held<'a>(&'a SimDevice);

    impl<'a> Held<'a> {
        fn new(q: &'a Arc<RequestQueue>) -> Held<'a> {
            sim(q).hold(true);
            Held(sim(q))
        }
    }

    impl Drop for Held<'_> {
        fn drop(&mut self) {
            self.0.hold(false);
        }
    }

    /// Node blocks the device has read.
    fn blocks_read(q: &RequestQueue) -> u64 {
        q.diskstats().sectors[0] / 8
    }

    /// Wait for `done`, which another thread makes true (no sleep: it yields).
    fn until(what: &str, done: impl Fn() -> bool) {
        let t0 = std::time::Instant::now();
        while !done() {
            assert!(t0.elapsed().as_secs() < 10, "never: {what}");
            std::thread::yield_now();
        }
    }

    /// A read of a block a read-ahead (or another reader) is reading waits for that
    /// read: the block comes from the device once. It was read twice, the second
    /// read taking the first's ticket over.
    #[test]
    fn a_read_of_a_block_already_being_read_waits_for_that_read() {
        let (q, store) = cold_store();
        let before = blocks_read(&q);
        std::thread::scope(|s| {
            let held = Held::new(&q);
            // Listed twice: one read.
            let ahead = s.spawn(|| store.prefetch(&[102, 102]));
            until("the read-ahead is in the device", || sim(&q).pending() == 1);
            let first = s.spawn(|| store.read(102));
            // Either the reader waits for the read in flight, or it sends its own.
            until("the reader waits or reads", || {
                store.stats().shared == 1 || sim(&q).pending() > 1
            });
            let second = s.spawn(|| store.read(102));
            until("the second reader waits or reads", || {
                store.stats().shared == 2 || sim(&q).pending() > 2
            });
            drop(held);
            ahead.join().unwrap();
            assert_eq!(first.join().unwrap().unwrap(), vec![102; 4096]);
            assert_eq!(second.join().unwrap().unwrap(), vec![102; 4096]);
        });
        assert_eq!(blocks_read(&q) - before, 1, "block 102 read more than once");
        let st = store.stats();
        assert_eq!((st.misses, st.shared, st.hits), (1, 2, 0), "{st:?}");
        assert_eq!(st.cached_bytes, 4096);
        assert!(
            store.cache.lock().reading.is_empty(),
            "every read's ticket ended"
        );
        // A demand read in flight: the read-ahead leaves its block out, and reads
        // the others once each however often they are listed.
        let before = blocks_read(&q);
        std::thread::scope(|s| {
            let held = Held::new(&q);
            let reader = s.spawn(|| store.read(101));
            until("the read is in the device", || sim(&q).pending() == 1);
            let ahead = s.spawn(|| store.prefetch(&[104, 101, 103, 104, 102, 101]));
            until("the read-ahead is in the device", || sim(&q).pending() > 1);
            drop(held);
            assert_eq!(reader.join().unwrap().unwrap(), vec![101; 4096]);
            ahead.join().unwrap();
        });
        assert_eq!(
            blocks_read(&q) - before,
            3,
            "101 by its reader, 103 and 104 ahead; 102 was cached"
        );
        let st = store.stats();
        assert_eq!((st.misses, st.cached_bytes), (4, 4 * 4096), "{st:?}");
        assert!(
            store.cache.lock().reading.is_empty(),
            "every read's ticket ended"
        );
    }

    /// Sharing reads keeps the tickets: a read issued before its block was forgotten
    /// (or written) is no read of the block any more, so a reader after that reads it
    /// anew, and only its bytes are cached.
    #[test]
    fn a_read_after_its_block_was_forgotten_does_not_wait_for_one_issued_before() {
        let (q, store) = cold_store();
        let before = blocks_read(&q);
        std::thread::scope(|s| {
            let held = Held::new(&q);
            let old = s.spawn(|| store.read(101));
            until("the read is in the device", || sim(&q).pending() == 1);
            store.forget(101);
            let new = s.spawn(|| store.read(101));
            until("the second reader waits or reads", || {
                store.stats().shared == 1 || sim(&q).pending() == 2
            });
            assert_eq!(
                store.stats().shared,
                0,
                "it waited for a read of a forgotten block"
            );
            drop(held);
            assert_eq!(old.join().unwrap().unwrap(), vec![101; 4096]);
            assert_eq!(new.join().unwrap().unwrap(), vec![101; 4096]);
        });
        assert_eq!(blocks_read(&q) - before, 2);
        assert_eq!(store.stats().cached_bytes, 4096, "the later read's bytes");
        assert!(
            store.cache.lock().reading.is_empty(),
            "every read's ticket ended"
        );
    }

    /// A reader waiting for another's read that fails reads the block itself, and
    /// reports the error with its block; nothing waits for good, nothing is cached.
    #[test]
    fn a_reader_waiting_for_a_read_that_fails_reads_the_block_itself() {
        let (q, store) = cold_store();
        sim(&q).inject_eio(101 * 8..102 * 8, true, false);
        std::thread::scope(|s| {
            let held = Held::new(&q);
            let first = s.spawn(|| store.read(101));
            until("the read is in the device", || sim(&q).pending() == 1);
            let second = s.spawn(|| store.read(101));
            until("the second reader waits", || store.stats().shared == 1);
            drop(held);
            for r in [first, second] {
                assert!(matches!(
                    r.join().unwrap(),
                    Err(TreeError::Io { block: 101, .. })
                ));
            }
        });
        let st = store.stats();
        assert_eq!((st.misses, st.shared, st.cached_bytes), (2, 1, 0), "{st:?}");
        assert!(
            store.cache.lock().reading.is_empty(),
            "every read's ticket ended"
        );
    }
}
