//! The inode cache: the page-cache mapping of every regular file in use, and of unused
//! ones up to a limit (the kernel's inode LRU and its shrinker, `prune_icache_sb`).
//!
//! A file's mapping is made on its first use and lives while anything holds it (an open
//! `File`, a flush request, the writeback lists while it is dirty, a bio in flight).
//! Past `inode_cache` cached mappings, a second-chance scan from the least recently used
//! end evicts unused ones, with the inode's `Live` state, once they are at rest:
//! - nothing but the cache holds the mapping;
//! - it has no pages: as in the kernel since 5.15 (`mapping_shrinkable`), an inode with
//!   page cache stays off the LRU and page reclaim empties it first, so the limit never
//!   throws away cached data that page reclaim would keep;
//! - it never recorded a writeback error: the error lives in the mapping's errseq, and a
//!   later open of a rebuilt mapping would not see it (the kernel loses it here, the
//!   complaint behind PostgreSQL's fsync change; we keep such inodes for the mount);
//! - the volume has nothing pending for it (`Vol::at_rest`: no reservation, write in
//!   flight, truncation, deferred truncation or ordered wait, every transaction that
//!   changed it committed, and a cache flush done after its last data write).
//!
//! The next use builds a new mapping from the durable metadata, which at rest is all
//! there is to know of the inode.

use crate::mm::cache::Mapping;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// The limit the mount option `inode_cache` defaults to: the kernel's inode hash table
/// on a machine of a few GiB, about a hundred MiB of inodes here.
pub const DEFAULT_INODE_CACHE: usize = 131_072;

/// How many cached mappings one prune looks at for each one it must evict: a scan that
/// finds every inode busy stops instead of walking the whole cache.
const SCAN_PER_EVICTION: usize = 4;

/// At most this many evictions per prune: the cost of one call stays bounded however
/// far over the limit the cache is (mappings with pages do not count down).
const PRUNE_BATCH: usize = 32;

struct Slot {
    mapping: Arc<Mapping>,
    /// Used since the scan last passed it (the second chance).
    referenced: bool,
    /// Which of the ino's queue entries is current: a removed and re-added inode
    /// leaves a stale entry behind.
    gen: u64,
}

pub(super) struct InodeCache {
    map: HashMap<u64, Slot>,
    /// Scan order, least recently queued first; entries whose gen no longer matches
    /// are stale and skipped.
    queue: VecDeque<(u64, u64)>,
    next_gen: u64,
    limit: usize,
    evicted: u64,
}

/// What the volume says of an inode the scan would evict (see the module comment).
pub(super) type AtRest<'a> = dyn FnMut(u64, &Mapping) -> bool + 'a;

impl InodeCache {
    pub fn new(limit: usize) -> InodeCache {
        InodeCache {
            map: HashMap::new(),
            queue: VecDeque::new(),
            next_gen: 0,
            limit,
            evicted: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    pub fn set_limit(&mut self, limit: usize) {
        self.limit = limit;
    }

    /// Mappings evicted since mount.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    pub fn get(&self, ino: &u64) -> Option<&Arc<Mapping>> {
        self.map.get(ino).map(|s| &s.mapping)
    }

    /// The mapping of `ino`, made by `make` if it is not cached; marks it used.
    pub fn get_or_insert(&mut self, ino: u64, make: impl FnOnce() -> Arc<Mapping>) -> Arc<Mapping> {
        if let Some(s) = self.map.get_mut(&ino) {
            s.referenced = true;
            return s.mapping.clone();
        }
        let gen = self.next_gen;
        self.next_gen += 1;
        let mapping = make();
        self.map.insert(
            ino,
            Slot {
                mapping: mapping.clone(),
                referenced: false,
                gen,
            },
        );
        self.queue.push_back((ino, gen));
        self.compact();
        mapping
    }

    pub fn remove(&mut self, ino: &u64) -> Option<Arc<Mapping>> {
        let s = self.map.remove(ino)?;
        self.compact();
        Some(s.mapping)
    }

    /// Empty the cache (unmount), returning every inode it held.
    pub fn drain(&mut self) -> Vec<u64> {
        self.queue.clear();
        self.map.drain().map(|(ino, _)| ino).collect()
    }

    /// Drop stale queue entries once they are as many as the live ones, so churn below
    /// the limit (create, delete, create...) cannot grow the queue without bound.
    fn compact(&mut self) {
        if self.queue.len() > 2 * self.map.len() + 64 {
            let map = &self.map;
            self.queue
                .retain(|(ino, gen)| map.get(ino).is_some_and(|s| s.gen == *gen));
        }
    }

    /// Evict unused mappings at rest until at most `limit` are cached (or the scan's
    /// budget is spent); returns the evicted ones, for the caller to forget the inode
    /// elsewhere. Call with the volume's state lock held, so `at_rest` stays true.
    pub fn prune(&mut self, at_rest: &mut AtRest<'_>) -> Vec<(u64, Arc<Mapping>)> {
        let excess = self.map.len().saturating_sub(self.limit).min(PRUNE_BATCH);
        let mut out = Vec::new();
        let mut budget = excess * SCAN_PER_EVICTION;
        while out.len() < excess && budget > 0 {
            budget -= 1;
            let Some((ino, gen)) = self.queue.pop_front() else {
                break;
            };
            let Some(s) = self.map.get_mut(&ino).filter(|s| s.gen == gen) else {
                continue;
            };
            if std::mem::take(&mut s.referenced) || !evictable(ino, &s.mapping, at_rest) {
                self.queue.push_back((ino, gen));
                continue;
            }
            let s = self.map.remove(&ino).expect("found above");
            out.push((ino, s.mapping));
        }
        self.evicted += out.len() as u64;
        out
    }
}

fn evictable(ino: u64, m: &Arc<Mapping>, at_rest: &mut AtRest<'_>) -> bool {
    // The cache's own reference only: a holder could still write through it.
    Arc::strong_count(m) == 1
        && m.nr_pages() == 0
        && m.wb_err().raw() == 0
        && m.error().is_none()
        && at_rest(ino, m)
}
