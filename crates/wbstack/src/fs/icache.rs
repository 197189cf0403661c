//! The inode cache: the page-cache mapping of every regular file in use, and of unused
//! ones up to a limit (the kernel's inode LRU and its shrinker, `prune_icache_sb`).
//!
//! A file's mapping is made on its first use and lives while anything holds it (an open
//! `File`, a flush request, the writeback lists while it is dirty, a bio in flight).
//! As in the kernel, an inode goes on the LRU only when it is unused and has no pages:
//! at its last close if it has none, else when page reclaim or a truncation takes its
//! last page (`AddressSpaceOps::mapping_emptied`), so a scan never walks past inodes
//! whose pages page reclaim still keeps. Past `inode_cache` cached mappings, a
//! second-chance scan from the LRU's old end evicts them, with the inode's `Live` state,
//! once they are at rest:
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

use super::lazylru::LazyLru;
use crate::mm::cache::Mapping;
use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The limit the mount option `inode_cache` defaults to: the kernel's inode hash table
/// on a machine of a few GiB, about a hundred MiB of inodes here.
pub const DEFAULT_INODE_CACHE: usize = 131_072;

/// At most this many evictions per prune: the cost of one call stays bounded however
/// far over the limit the cache is.
const PRUNE_BATCH: usize = 32;

/// LRU entries one prune may pass over without evicting them (not yet at rest, or
/// referenced since the last scan): what a prune costs when nothing can go.
const PRUNE_SKIPS: usize = 8;

struct Slot {
    mapping: Arc<Mapping>,
    /// Used since the scan last passed it (the second chance).
    referenced: bool,
    /// The gen of its current LRU entry, if it is on the LRU: a removed and re-added
    /// inode leaves a stale entry behind, which the scan skips.
    lru_gen: Option<u64>,
}

/// What the volume says of an LRU entry the scan reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// At rest: evict it.
    Evict,
    /// Not yet (a commit or a flush to come): keep it on the LRU. Nothing changes
    /// that but a commit or a flush (`RestEpoch`).
    Later,
    /// Not yet, for a moment (a second chance used, a transient holder): keep it.
    Transient,
    /// Not a candidate until it is queued again (open, or it has pages again).
    Off,
}

/// What the journal had done when a prune ran: the committed transaction and the
/// last cache flush. An inode that must wait for a commit or a flush (`Later`) waits
/// until one of them moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct RestEpoch {
    pub committed: u64,
    pub barrier_done: u64,
}

/// The cache's size and limit, readable without its lock: every open and close asks
/// whether there is anything to prune, under `st`, and taking the cache's lock for
/// that made it a second lock the two sides of a create met on (a create's mapping is
/// made outside `st`, under this lock).
#[derive(Default)]
pub(super) struct Gauge {
    len: AtomicUsize,
    /// The limit itself (`inode_cache`): set under the cache's lock, read anywhere.
    limit: AtomicUsize,
}

impl Gauge {
    /// More mappings cached than the limit (as of the last change under the lock).
    pub fn over_limit(&self) -> bool {
        self.len.load(Ordering::Relaxed) > self.limit.load(Ordering::Relaxed)
    }

    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }
}

pub(super) struct InodeCache {
    map: FxHashMap<u64, Slot>,
    gauge: Arc<Gauge>,
    /// Unused inodes without pages, oldest first.
    lru: LazyLru,
    evicted: u64,
    examined: u64,
    /// The epoch at which a prune evicted nothing because the oldest inodes wait for
    /// a commit or a flush: until it moves, another pass would find the same (creates
    /// outrunning commits made every open and close pay for a fruitless pass, half
    /// the cost of an empty file's create).
    stalled_at: Option<RestEpoch>,
}

impl InodeCache {
    pub fn new(limit: usize) -> InodeCache {
        let gauge = Arc::new(Gauge::default());
        gauge.limit.store(limit, Ordering::Relaxed);
        InodeCache {
            map: FxHashMap::default(),
            gauge,
            lru: LazyLru::new(),
            evicted: 0,
            examined: 0,
            stalled_at: None,
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn limit(&self) -> usize {
        self.gauge.limit()
    }

    pub fn set_limit(&mut self, limit: usize) {
        self.gauge.limit.store(limit, Ordering::Relaxed);
    }

    /// The cache's size and limit, for readers without its lock.
    pub fn gauge(&self) -> Arc<Gauge> {
        self.gauge.clone()
    }

    /// After every change of the map's size, under the lock.
    fn gauge_len(&self) {
        self.gauge.len.store(self.map.len(), Ordering::Relaxed);
    }

    /// Mappings evicted since mount.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    pub fn examined(&self) -> u64 {
        self.examined
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
        let mapping = make();
        self.map.insert(
            ino,
            Slot {
                mapping: mapping.clone(),
                referenced: false,
                lru_gen: None,
            },
        );
        self.gauge_len();
        mapping
    }

    /// Put `ino` on the LRU (it became unused without pages); a no-op if it is there
    /// already or not cached.
    pub fn queue(&mut self, ino: u64) {
        let Some(s) = self.map.get_mut(&ino) else {
            return;
        };
        if s.lru_gen.is_some() {
            return;
        }
        s.lru_gen = Some(self.lru.push(ino));
        self.compact();
    }

    pub fn remove(&mut self, ino: &u64) -> Option<Arc<Mapping>> {
        let s = self.map.remove(ino)?;
        self.gauge_len();
        self.compact();
        Some(s.mapping)
    }

    /// Empty the cache (unmount), returning every inode it held.
    pub fn drain(&mut self) -> Vec<u64> {
        self.lru.clear();
        let inos = self.map.drain().map(|(ino, _)| ino).collect();
        self.gauge_len();
        inos
    }

    /// Drop stale LRU entries once they outnumber the cache, so churn below the limit
    /// (create, delete, create...) cannot grow the LRU without bound.
    fn compact(&mut self) {
        let map = &self.map;
        self.lru.compact(map.len(), |ino, gen| {
            map.get(&ino).is_some_and(|s| s.lru_gen == Some(gen))
        });
    }

    /// Evict inodes from the LRU until at most `limit` are cached, a batch at most;
    /// returns the evicted ones, for the caller to forget the inode elsewhere. Call with
    /// the volume's state lock held, so a verdict of `at_rest` stays true.
    pub fn prune(
        &mut self,
        epoch: RestEpoch,
        at_rest: &mut dyn FnMut(u64, &Mapping) -> Verdict,
    ) -> Vec<(u64, Arc<Mapping>)> {
        if self.stalled_at == Some(epoch) {
            return Vec::new();
        }
        let excess = self.map.len().saturating_sub(self.limit()).min(PRUNE_BATCH);
        let mut out = Vec::new();
        let mut skips = 0;
        let mut waiting = false;
        while out.len() < excess && skips < PRUNE_SKIPS {
            let Some((ino, gen)) = self.lru.pop_oldest() else {
                break;
            };
            let Some(s) = self.map.get_mut(&ino).filter(|s| s.lru_gen == Some(gen)) else {
                continue;
            };
            self.examined += 1;
            let verdict = if std::mem::take(&mut s.referenced) {
                Verdict::Transient
            } else {
                verdict(ino, &s.mapping, at_rest)
            };
            match verdict {
                Verdict::Evict => {
                    let s = self.map.remove(&ino).expect("found above");
                    out.push((ino, s.mapping));
                }
                Verdict::Later | Verdict::Transient => {
                    waiting |= verdict == Verdict::Later;
                    skips += 1;
                    self.lru.requeue(ino, gen);
                }
                Verdict::Off => {
                    skips += 1;
                    s.lru_gen = None;
                }
            }
        }
        self.evicted += out.len() as u64;
        self.gauge_len();
        self.stalled_at = (out.is_empty() && waiting).then_some(epoch);
        out
    }
}

fn verdict(
    ino: u64,
    m: &Arc<Mapping>,
    at_rest: &mut dyn FnMut(u64, &Mapping) -> Verdict,
) -> Verdict {
    if m.nr_pages() > 0 || m.wb_err().raw() != 0 || m.error().is_some() {
        // Pages: queued again when the last one goes. An error: kept for the mount.
        return Verdict::Off;
    }
    if Arc::strong_count(m) > 1 {
        // Someone else holds it and could still write through it.
        return Verdict::Transient;
    }
    at_rest(ino, m)
}
