//! The dentry cache for path walks without the volume's lock (the kernel's dcache and
//! its RCU path walk, `fs/namei.c`, in a small form).
//!
//! Every path an operation names is walked through its directories before the
//! operation can begin: `d0/s17/f123` is two lookups before the create. Under `st` that
//! walk was a sixth of a create's hold of the lock every namespace operation waits for,
//! and fs_mark asks `mkdir -p` of the file's directory before every file, one more hold
//! for a walk alone. This cache lets a walk through directories that are in it run
//! without `st`: an operation walks its path's directories here first, then takes `st`
//! only for what it changes.
//!
//! What it holds: entries that name directories, `(parent, name) -> directory`. Files
//! are always the last component of a path, looked up under `st` by the operation that
//! uses them; symlinks are followed under `st`. So the cache stays as small as the
//! directory tree (bounded by `CAPACITY` besides), and an unlinked file changes nothing
//! here.
//!
//! Why a walk here is right: every change of a directory entry is applied under `st`
//! (`State::log`), which keeps this cache in step: a new directory's entry is added, a
//! removed one (rmdir, rename) is dropped, and a removal bumps `seq` to odd before and
//! back to even after. A walk reads `seq` before and after its lookups; an odd or moved
//! `seq` means a directory entry went away meanwhile, and the walk is given up for the
//! one under `st`. A walk that saw no removal found entries that all existed at once
//! when it read `seq` the second time, as a walk under `st` would have. An operation
//! that goes on to take `st` compares `seq` again under it (`Walked::still_valid`): equal,
//! no directory entry has gone since, and the directory the walk found is the one a walk
//! under `st` would find now. Entries dropped only to keep to `CAPACITY` need no bump:
//! a walk that misses one falls back, and a removal bumps `seq` whether or not its entry
//! was cached.

use crossbeam_utils::CachePadded;
use parking_lot::Mutex;
use rustc_hash::{FxHashMap, FxHasher};
use std::hash::Hasher;
use std::sync::atomic::{AtomicU64, Ordering};

/// Shards, each under its own lock: two threads walking different paths rarely meet.
const SHARDS: usize = 16;

/// Entries held at most (directories, so a tree of 64k directories walks entirely
/// here; a name of a few bytes makes an entry about 60 bytes, 4 MiB at most).
pub const CAPACITY: usize = 1 << 16;

/// One cached entry: `name` in the parent names directory `ino`.
struct Dentry {
    name: Box<[u8]>,
    ino: u64,
}

/// Hits and misses of walks, for `InodeCacheStats`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DcacheStats {
    pub entries: u64,
    /// Walks served here without `st`.
    pub hits: u64,
    /// Walks given up for a walk under `st` (an entry missing or a removal meanwhile).
    pub misses: u64,
}

/// One shard: its entries, and the walks that found their last component here.
#[derive(Default)]
struct ShardMap {
    map: FxHashMap<(u64, u64), Dentry>,
    /// Counted under the shard's lock, which the walk holds anyway: a counter shared
    /// by every walk would be one more cache line the walking threads pass between
    /// them on every create.
    found: u64,
}

/// On a cache line of its own: walks on two cores take different shards without
/// passing lines between them.
type Shard = CachePadded<Mutex<ShardMap>>;

pub struct Dcache {
    /// By `(parent, hash of name)`: two names of one directory with the same hash keep
    /// the later one, and a lookup compares the name.
    shards: Box<[Shard]>,
    /// Odd while a directory entry is being removed; moved by every removal. Read by
    /// every walk and written only by removals: alone on its line.
    seq: CachePadded<AtomicU64>,
    /// Walks of no component (found at once), walks given up because an entry was
    /// missing, and walks that found every entry but saw a removal meanwhile (counted
    /// in `ShardMap::found` too). Rare, or at least not every walk's.
    found_empty: CachePadded<AtomicU64>,
    missing: AtomicU64,
    invalidated: AtomicU64,
}

/// A walk made here, to be confirmed under `st` (`still_valid`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Walked {
    /// The directory the walk ended in.
    pub dir: u64,
    seq: u64,
}

fn hash_name(parent: u64, name: &[u8]) -> (u64, u64) {
    let mut h = FxHasher::default();
    h.write(name);
    (parent, h.finish())
}

impl Default for Dcache {
    fn default() -> Self {
        Dcache {
            shards: (0..SHARDS).map(|_| CachePadded::default()).collect(),
            seq: CachePadded::new(AtomicU64::new(0)),
            found_empty: CachePadded::new(AtomicU64::new(0)),
            missing: AtomicU64::new(0),
            invalidated: AtomicU64::new(0),
        }
    }
}

impl Dcache {
    fn shard(&self, key: (u64, u64)) -> &Shard {
        let mix = key.0.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ key.1;
        &self.shards[(mix >> 32) as usize % SHARDS]
    }

    /// `name` in `parent`, if cached; `last`: the walk's last component, counted found.
    fn lookup(&self, parent: u64, name: &[u8], last: bool) -> Option<u64> {
        let key = hash_name(parent, name);
        let mut shard = self.shard(key).lock();
        let ino = shard
            .map
            .get(&key)
            .filter(|d| *d.name == *name)
            .map(|d| d.ino);
        shard.found += u64::from(last && ino.is_some());
        ino
    }

    /// Walk `comps` (plain names: no `..`) from `start` through cached directories.
    /// None if one is missing, or a directory entry was removed meanwhile: the caller
    /// walks under `st` instead.
    pub fn walk(&self, start: u64, comps: &[&[u8]]) -> Option<Walked> {
        let seq = self.seq.load(Ordering::SeqCst);
        if !seq.is_multiple_of(2) {
            self.missing.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let found = comps.iter().enumerate().try_fold(start, |cur, (i, c)| {
            (*c != b"..")
                .then(|| self.lookup(cur, c, i + 1 == comps.len()))
                .flatten()
        });
        let Some(dir) = found else {
            self.missing.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        if comps.is_empty() {
            self.found_empty.fetch_add(1, Ordering::Relaxed);
        }
        if self.seq.load(Ordering::SeqCst) != seq {
            // Release: a reader of this count sees the `found` it takes back.
            self.invalidated.fetch_add(1, Ordering::Release);
            return None;
        }
        Some(Walked { dir, seq })
    }

    /// Under `st`: whether no directory entry was removed since `w` was walked, so its
    /// directory is the one a walk under `st` finds now.
    pub fn still_valid(&self, w: &Walked) -> bool {
        self.seq.load(Ordering::SeqCst) == w.seq
    }

    /// Under `st`: `name` in `parent` names directory `ino` (made, or found by a walk
    /// under `st`).
    pub fn insert(&self, parent: u64, name: &[u8], ino: u64) {
        debug_assert!(name != b"." && name != b"..", "a cached {name:?} entry");
        let key = hash_name(parent, name);
        let mut shard = self.shard(key).lock();
        let shard = &mut shard.map;
        if shard
            .get(&key)
            .is_some_and(|d| d.ino == ino && *d.name == *name)
        {
            // Walks under `st` pass the same directories again and again.
            return;
        }
        if shard.len() >= CAPACITY / SHARDS && !shard.contains_key(&key) {
            // Any entry will do: a walk that misses it falls back to `st`.
            if let Some(victim) = shard.keys().next().copied() {
                shard.remove(&victim);
            }
        }
        shard.insert(
            key,
            Dentry {
                name: name.into(),
                ino,
            },
        );
    }

    /// Under `st`, for every removal of an entry naming a directory (cached or not: a
    /// walk may have read it before it was dropped to keep to `CAPACITY`).
    pub fn remove(&self, parent: u64, name: &[u8]) {
        let before = self.seq.fetch_add(1, Ordering::SeqCst);
        debug_assert!(
            before.is_multiple_of(2),
            "two removals from the dcache at once"
        );
        let key = hash_name(parent, name);
        {
            let mut shard = self.shard(key).lock();
            if shard.map.get(&key).is_some_and(|d| *d.name == *name) {
                shard.map.remove(&key);
            }
        }
        self.seq.fetch_add(1, Ordering::SeqCst);
    }

    pub fn stats(&self) -> DcacheStats {
        // Invalidations first: each follows its walk's count in `found`, so every one
        // read here has its `found` read below (walks meanwhile count only as found).
        let invalidated = self.invalidated.load(Ordering::Acquire);
        let (mut entries, mut found) = (0, self.found_empty.load(Ordering::Relaxed));
        for s in self.shards.iter() {
            let s = s.lock();
            entries += s.map.len() as u64;
            found += s.found;
        }
        debug_assert!(
            found >= invalidated,
            "{invalidated} walks invalidated of {found}"
        );
        DcacheStats {
            entries,
            hits: found - invalidated,
            misses: self.missing.load(Ordering::Relaxed) + invalidated,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_walk_follows_cached_directories_and_misses_what_is_not_cached() {
        let d = Dcache::default();
        d.insert(1, b"a", 10);
        d.insert(10, b"b", 11);
        assert_eq!(d.walk(1, &[b"a", b"b"]).map(|w| w.dir), Some(11));
        assert_eq!(d.walk(1, &[]).map(|w| w.dir), Some(1));
        assert_eq!(d.walk(1, &[b"a", b"c"]), None);
        assert_eq!(d.walk(1, &[b"a", b".."]), None, "'..' is walked under st");
        let s = d.stats();
        assert_eq!((s.entries, s.hits, s.misses), (2, 2, 2));
    }

    #[test]
    fn a_removal_invalidates_walks_made_before_it() {
        let d = Dcache::default();
        d.insert(1, b"a", 10);
        let w = d.walk(1, &[b"a"]).expect("cached");
        assert!(d.still_valid(&w));
        // A removal of another entry, even one never cached, moves seq too.
        d.remove(1, b"elsewhere");
        assert!(!d.still_valid(&w));
        let w = d.walk(1, &[b"a"]).expect("still cached");
        d.remove(1, b"a");
        assert!(!d.still_valid(&w));
        assert_eq!(d.walk(1, &[b"a"]), None);
    }

    #[test]
    fn a_lookup_compares_the_name_not_only_its_hash() {
        let d = Dcache::default();
        d.insert(1, b"a", 10);
        // Same name in another directory, another name in the same one.
        assert_eq!(d.walk(2, &[b"a"]), None);
        assert_eq!(d.walk(1, &[b"b"]), None);
        d.insert(1, b"a", 12);
        assert_eq!(d.walk(1, &[b"a"]).map(|w| w.dir), Some(12));
        // Removing a name that is not the cached one leaves the cached one.
        d.remove(1, b"b");
        assert_eq!(d.walk(1, &[b"a"]).map(|w| w.dir), Some(12));
    }

    #[test]
    fn the_cache_keeps_to_its_capacity() {
        let d = Dcache::default();
        for i in 0..(CAPACITY as u64 * 2) {
            d.insert(1, format!("d{i}").as_bytes(), i + 2);
        }
        let s = d.stats();
        assert!(s.entries <= CAPACITY as u64, "{} entries", s.entries);
        assert!(s.entries >= CAPACITY as u64 / 2, "{} entries", s.entries);
        // The newest is always kept.
        let last = CAPACITY as u64 * 2 - 1;
        let w = d.walk(1, &[format!("d{last}").as_bytes()]);
        assert_eq!(w.map(|w| w.dir), Some(last + 2));
    }
}
