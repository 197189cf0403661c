//! The inodes `Meta` holds: every inode (formats up to 3, and fsck), or a cache over the
//! metadata tree (format 4 on a mounted volume), where an inode not in memory is read
//! back from the tree's durable root on its first use and an unused clean one can be
//! dropped (the kernel's iget and inode reclaim; `fs::icache` decides when).
//!
//! Reading one back is IO, and IO is never issued under `st` (a device may complete
//! inline, or reap completions in the waiting thread, and a data write's completion
//! takes `st`): a read of an inode not in memory fails instead, noting the miss
//! (`fetch`), and the operation's entry point (`Vol::faulting`) reads the missed inodes
//! back without `st` (`InodeSource`), installs them (`install`) and runs the operation
//! again. Every operation reads its inodes before it changes anything, so a rerun
//! repeats nothing. Misses are noted through `&Meta` (a lookup, a stat, the checks of
//! `Meta::apply` all read through it), per thread (`MISSES`).
//!
//! What may be dropped: an inode whose every change is in a durable checkpoint. A change
//! is stamped with the checkpoint generation it goes out with (`changed`); a checkpoint
//! closes a generation when it captures its changes (`close_gen`) and makes it durable
//! when its root record is (`durable`). A deleted inode keeps its stamp too, so it is not
//! read back from a tree that still holds it. A directory comes back with its entries,
//! its parent and its subdirectory count (format 5 records them in its inode record);
//! only the root stays.

use super::cowcapture::PendingCapture;
use super::dir::Cold;
use super::error::FsError;
use super::format::InodeKind;
use super::meta::{Changes, Inode, MetaError, ROOT_INO};
use rustc_hash::{FxHashMap, FxHashSet};
use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::Arc;

/// Where inodes not in memory are read from: the metadata tree's durable root. Called
/// without `st`; each read says which durable generation it read (`Read::gen`), and
/// is installed only if that is still the durable one (the blocks of an older root's
/// nodes may have been given back and reused meanwhile).
pub trait InodeSource: Send + Sync {
    /// These inodes as the last durable checkpoint holds them (absent: not there).
    fn read_inodes(&self, inos: &[u64]) -> Read;

    /// Every inode the last durable checkpoint holds.
    fn read_all(&self) -> Read;

    /// The entries of each directory with hashes in each range asked, as the last
    /// durable checkpoint holds them (`fs::dir`'s cold groups): each ask's in turn,
    /// each in key order. An ask of every hash (`dir::ALL`, an unlisted directory's)
    /// is a listing: each group whose kinds are all recorded is counted in `groups`,
    /// its names not read; the others' names come in `entries`.
    fn read_dirents(&self, asked: &[DirMiss]) -> DirentsRead;
}

/// A directory's cold groups an operation met: hashes `cold.from..=cold.to` of `dir`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DirMiss {
    pub dir: u64,
    pub cold: Cold,
}

/// One directory entry read back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirentRead {
    pub dir: u64,
    pub hash: u64,
    pub name: Vec<u8>,
    pub ino: u64,
    pub kind: Option<InodeKind>,
}

/// A group of names sharing a hash, counted and not read: how a listing
/// (`InodeSource::read_dirents` asked `dir::ALL`) returns each group whose every kind
/// is recorded (listing a cold directory of a million entries read a million names
/// only to drop them, about 100 MB at its peak).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupRead {
    pub dir: u64,
    pub hash: u64,
    pub names: u32,
    pub subdirs: u32,
}

/// What `InodeSource::read_dirents` found: each ask's part in turn, each in key order.
#[derive(Debug, Default)]
pub struct DirentsFound {
    pub entries: Vec<DirentRead>,
    /// Groups counted, of the asks that were listings.
    pub groups: Vec<GroupRead>,
    /// How many of each are each ask's, one per ask in order: asks of one directory
    /// may overlap (a listing covers every hash), so the hashes do not say whose an
    /// entry is.
    pub parts: Vec<AskPart>,
}

/// One ask's share of a `DirentsFound`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AskPart {
    pub entries: usize,
    pub groups: usize,
}

/// What `InodeSource::read_dirents` read, from the root of durable generation `gen`.
pub struct DirentsRead {
    pub gen: u64,
    pub found: Result<DirentsFound, FsError>,
}

/// What an `InodeSource` read, from the root of durable generation `gen`.
pub struct Read {
    pub gen: u64,
    /// The inodes found, or why not: EIO when the device failed a read, a corruption
    /// when a node or record is wrong.
    pub inodes: Result<Vec<(u64, Inode)>, FsError>,
}

/// What the cache did (the control directory's `inode_cache_*` counters).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MetaCacheStats {
    /// Inodes read back from the tree.
    pub faults: u64,
    /// Clean inodes dropped from memory.
    pub evictions: u64,
    /// Inodes in memory now.
    pub resident: u64,
    /// Of them, changed since the last durable checkpoint (never dropped).
    pub changed: u64,
    /// Groups of directory entries read back from the tree (`fs::dir`: cold groups).
    pub dirent_faults: u64,
    /// Directory entries whose names left memory (their groups went cold).
    pub dirents_shrunk: u64,
    /// Directory entries whose names are in memory now, of every directory in memory.
    pub dirents_resident: u64,
}

thread_local! {
    /// The inodes this thread asked for and found not in memory since its last
    /// `take_misses`: per thread, as each operation reads back its own (another's
    /// failing operation must not take them).
    static MISSES: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
    /// The cold directory groups this thread met, as `MISSES` its inodes.
    static DIR_MISSES: RefCell<Vec<DirMiss>> = const { RefCell::new(Vec::new()) };
}

/// Note that this thread's operation met cold groups of a directory; the error to
/// return (the operation's entry point reads them back and runs it again).
pub fn note_dir_miss(dir: u64, cold: Cold) -> MetaError {
    DIR_MISSES.with(|m| m.borrow_mut().push(DirMiss { dir, cold }));
    MetaError(format!("directory {dir}: entries not in memory"))
}

/// Groups read back (`Inodes::install_dirents`) before another shrink pass is due
/// without a checkpoint: a walk of cold directories (readdir, lookups) keeps about
/// this many groups' names in memory (~2 MiB) however long it runs.
const SHRINK_AFTER_GROUPS: usize = 16384;

/// Directories a call of `shrink_dirs` shrinks at most, and the entries past which it
/// stops (sending 40,000 entries of one directory cold took 10 ms; fs_mark's few
/// directories of tens of thousands, four to a batch of directories, 30-38 ms).
const SHRINK_BATCH: usize = 256;
const SHRINK_ENTRIES: usize = 8192;

/// Numbers of inodes found gone remembered, at most.
const ABSENT_MAX: usize = 65536;

/// Inodes an eviction pass looks at, at most: a pass runs under `st` (at opens, closes
/// and commits), so it is bounded.
pub const PASS_BUDGET: usize = 16384;

/// Inodes that come in after a pass stopped short before another is tried while no
/// checkpoint has become durable (nothing changed became clean): as many as a pass
/// looks at, so that passes cost one look per inode added, not sixteen.
const REST_SLACK: usize = PASS_BUDGET;

pub struct Inodes {
    map: FxHashMap<u64, Box<Inode>>,
    /// None: every inode is in memory, and nothing is dropped.
    source: Option<Arc<dyn InodeSource>>,
    /// Inodes that came into memory (created or read back), oldest first: the order
    /// clean ones are dropped in. May name inodes gone since; eviction skips them.
    order: VecDeque<u64>,
    /// Inodes read back for an operation that runs again (`Vol::faulting`), kept in
    /// memory until it has (counts: operations nest). Else prunes elsewhere could drop
    /// them again before the rerun, every time.
    pins: FxHashMap<u64, u32>,
    /// Inodes read back and not found (deleted, or never made): numbers are never
    /// used twice, so they stay gone. Forgotten past `ABSENT_MAX`, to be read again.
    absent: FxHashSet<u64>,
    /// Inodes changed (or deleted) since the last durable checkpoint: the generation
    /// their last change goes out with.
    changed: FxHashMap<u64, u64>,
    /// The generation changes are stamped with now.
    gen: u64,
    /// Inodes stamped with `gen`: what the next checkpoint must write before any of
    /// them may leave memory.
    open_changed: usize,
    /// Every generation up to this one is in a durable checkpoint.
    durable_gen: u64,
    faults: u64,
    evictions: u64,
    /// Where the last eviction that stopped short left off: (durable generation,
    /// inodes in memory). Until a checkpoint makes more clean or a batch more came in,
    /// another pass would meet the same inodes it kept.
    rest: (u64, usize),
    /// The durable generation of the last pass that sent clean directory groups cold
    /// (`shrink_dirs`), and the groups read back since.
    shrunk_at: u64,
    groups_in: usize,
    /// Directory entries sent cold, and groups read back.
    entries_shrunk: u64,
    dirent_faults: u64,
    /// Holders keeping every group resident (`hold_dirs`).
    dirs_held: u32,
    /// Directories whose groups stay resident, with their holders (`hold_dir`): an
    /// operation between reading a directory's groups back and running again.
    dir_holds: FxHashMap<u64, u32>,
    /// Held directories a shrink passed over: shrunk as their last holder lets go,
    /// or the pass, done for everyone else, would leave them whole until the next.
    shrink_deferred: Vec<u64>,
    /// The directories the pass in progress has yet to shrink (`shrink_dirs`, a batch
    /// per call); the pass began at generation `shrunk_at`.
    shrink_queue: Vec<u64>,
    /// The closed generation a checkpoint is copying out (`fs::cowcapture`): its
    /// inodes are copied before their first change.
    pending: Option<Box<PendingCapture>>,
}

impl Clone for Inodes {
    fn clone(&self) -> Self {
        Inodes {
            map: self.map.clone(),
            source: self.source.clone(),
            order: self.order.clone(),
            absent: self.absent.clone(),
            pins: self.pins.clone(),
            changed: self.changed.clone(),
            gen: self.gen,
            open_changed: self.open_changed,
            durable_gen: self.durable_gen,
            faults: self.faults,
            evictions: self.evictions,
            rest: self.rest,
            shrunk_at: self.shrunk_at,
            groups_in: self.groups_in,
            entries_shrunk: self.entries_shrunk,
            dirent_faults: self.dirent_faults,
            dirs_held: self.dirs_held,
            dir_holds: self.dir_holds.clone(),
            shrink_deferred: self.shrink_deferred.clone(),
            shrink_queue: self.shrink_queue.clone(),
            // A copy is no checkpoint's source.
            pending: None,
        }
    }
}

impl std::fmt::Debug for Inodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inodes")
            .field("resident", &self.map.len())
            .field("lazy", &self.source.is_some())
            .field("changed", &self.changed.len())
            .finish()
    }
}

impl Inodes {
    /// All of these inodes, in memory for good.
    pub fn new(map: FxHashMap<u64, Box<Inode>>) -> Inodes {
        Inodes {
            map,
            source: None,
            order: VecDeque::new(),
            absent: FxHashSet::default(),
            pins: FxHashMap::default(),
            changed: FxHashMap::default(),
            gen: 1,
            open_changed: 0,
            durable_gen: 0,
            faults: 0,
            evictions: 0,
            rest: (0, 0),
            shrunk_at: 0,
            groups_in: 0,
            entries_shrunk: 0,
            dirent_faults: 0,
            dirs_held: 0,
            dir_holds: FxHashMap::default(),
            shrink_deferred: Vec::new(),
            shrink_queue: Vec::new(),
            pending: None,
        }
    }

    /// From now on inodes may be dropped and are read back from `source`, which holds
    /// every inode but those changed since the last durable checkpoint.
    pub fn set_source(&mut self, source: Arc<dyn InodeSource>) {
        self.order.clear();
        self.order.extend(self.map.keys().copied());
        self.source = Some(source);
    }

    pub fn is_lazy(&self) -> bool {
        self.source.is_some()
    }

    pub fn is_changed(&self, ino: u64) -> bool {
        self.changed.contains_key(&ino)
    }

    /// Inode `ino` if it is in memory (no IO).
    pub fn resident(&self, ino: u64) -> Option<&Inode> {
        self.map.get(&ino).map(|b| &**b)
    }

    /// Inode `ino`, or none if it does not exist; an error if it is not in memory (the
    /// miss is noted for `take_misses`).
    pub fn fetch(&self, ino: u64) -> Result<Option<&Inode>, MetaError> {
        if let Some(i) = self.map.get(&ino) {
            return Ok(Some(&**i));
        }
        // Not lazy: all are here. Changed since the durable checkpoint and not in
        // memory: deleted (a changed inode is never dropped), though the durable tree
        // may still hold it.
        if self.source.is_none() || self.changed.contains_key(&ino) || self.absent.contains(&ino) {
            return Ok(None);
        }
        MISSES.with(|m| m.borrow_mut().push(ino));
        Err(MetaError(format!("inode {ino} is not in memory")))
    }

    /// `fetch` for a change: the inode is stamped changed.
    pub fn fetch_mut(&mut self, ino: u64) -> Result<Option<&mut Inode>, MetaError> {
        if self.fetch(ino)?.is_none() {
            return Ok(None);
        }
        self.note_changed(ino);
        Ok(self.map.get_mut(&ino).map(|b| &mut **b))
    }

    /// Keep `inos` in memory until `unpin`.
    pub fn pin(&mut self, inos: &[u64]) {
        for &ino in inos {
            *self.pins.entry(ino).or_default() += 1;
        }
    }

    pub fn unpin(&mut self, inos: &[u64]) {
        for ino in inos {
            let Some(n) = self.pins.get_mut(ino) else {
                debug_assert!(false, "inode {ino} unpinned but not pinned");
                continue;
            };
            *n -= 1;
            if *n == 0 {
                self.pins.remove(ino);
            }
        }
    }

    /// The inodes missed since the last call, once each.
    pub fn take_misses(&mut self) -> Vec<u64> {
        let mut m = MISSES.with(|m| std::mem::take(&mut *m.borrow_mut()));
        m.sort_unstable();
        m.dedup();
        m
    }

    /// The cold directory groups missed since the last call, once each.
    pub fn take_dir_misses(&mut self) -> Vec<DirMiss> {
        let mut m = DIR_MISSES.with(|m| std::mem::take(&mut *m.borrow_mut()));
        m.sort_unstable();
        m.dedup();
        m
    }

    /// Forget the misses noted so far (a caller about to ask whether it met any).
    pub fn clear_misses(&self) {
        MISSES.with(|m| m.borrow_mut().clear());
        DIR_MISSES.with(|m| m.borrow_mut().clear());
    }

    pub fn has_misses(&self) -> bool {
        MISSES.with(|m| !m.borrow().is_empty()) || DIR_MISSES.with(|m| !m.borrow().is_empty())
    }

    /// The generation a change made now is stamped with; none where nothing is
    /// dropped (a directory's groups then never go cold).
    pub fn stamp(&self) -> Option<u64> {
        self.source.is_some().then_some(self.gen)
    }

    /// Install the directory groups `read` read back for `asked`, unless the durable
    /// generation moved on since (then false: read again). A group no longer cold
    /// (read back by another, or changed since) is left as memory has it, and so is a
    /// directory no longer in memory (its next use reads it back).
    pub fn install_dirents(
        &mut self,
        read: DirentsRead,
        asked: &[DirMiss],
    ) -> Result<bool, FsError> {
        if read.gen != self.durable_gen {
            return Ok(false);
        }
        let found = read.found?;
        if self.groups_in >= SHRINK_AFTER_GROUPS {
            // Before, not after: what this installs stays for the rerun it is for.
            self.shrink_dirs();
        }
        // `found` holds each ask's entries and groups in turn, in key order.
        let whole = found.parts.len() == asked.len()
            && found.parts.iter().map(|p| p.entries).sum::<usize>() == found.entries.len()
            && found.parts.iter().map(|p| p.groups).sum::<usize>() == found.groups.len();
        if !whole {
            return Err(FsError::Corrupt(format!(
                "a read back of directory entries answered {} asks of {}",
                found.parts.len(),
                asked.len()
            )));
        }
        let (mut at, mut at_groups) = (0, 0);
        for (m, p) in asked.iter().zip(&found.parts) {
            let part = &found.entries[at..at + p.entries];
            let counted = &found.groups[at_groups..at_groups + p.groups];
            (at, at_groups) = (at + p.entries, at_groups + p.groups);
            let ours =
                |(dir, hash): (u64, u64)| dir == m.dir && (m.cold.from..=m.cold.to).contains(&hash);
            debug_assert!(
                (part.iter().map(|e| (e.dir, e.hash)))
                    .chain(counted.iter().map(|g| (g.dir, g.hash)))
                    .all(ours),
                "entries read back outside their ask {m:?}"
            );
            if let Some(d) = self.map.get_mut(&m.dir) {
                let groups = d.entries.install_read(m.cold, part, counted).map_err(|h| {
                    FsError::Corrupt(format!(
                        "directory {}: the entries of hash {h:#x} are missing from the metadata tree",
                        m.dir
                    ))
                })?;
                self.groups_in += groups;
                self.dirent_faults += groups as u64;
            }
        }
        Ok(true)
    }

    /// While held (counts: holders nest), no group goes cold (`shrink_dirs`).
    pub fn hold_dirs(&mut self, hold: bool) {
        if hold {
            self.dirs_held += 1;
        } else {
            debug_assert!(self.dirs_held > 0, "directories released but not held");
            self.dirs_held -= 1;
        }
    }

    /// While `dir` is held (counts: holders nest), none of its groups goes cold and
    /// it keeps the ranges it knows whole (`shrink_dirs` passes it over, and it is
    /// shrunk when its last holder lets go). An operation
    /// holds the directories it read groups of until it has run again: a shrink in
    /// between (due after a read of `SHRINK_AFTER_GROUPS`, or a checkpoint, and run by
    /// any thread's open or close) would undo the read, and a read that large, a
    /// library page of more entries than that, would be undone each time it ran.
    pub fn hold_dir(&mut self, dir: u64, hold: bool) {
        if hold {
            *self.dir_holds.entry(dir).or_default() += 1;
            return;
        }
        match self.dir_holds.get_mut(&dir) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                self.dir_holds.remove(&dir);
                if let Some(at) = self.shrink_deferred.iter().position(|&d| d == dir) {
                    self.shrink_deferred.swap_remove(at);
                    let d = self.durable_gen;
                    if let Some(i) = self.map.get_mut(&dir).filter(|i| i.is_dir()) {
                        self.entries_shrunk += i.entries.shrink(d) as u64;
                    }
                }
            }
            None => debug_assert!(false, "directory {dir} released but not held"),
        }
    }

    /// Send the clean groups of every directory in memory cold (`Dir::shrink`), once
    /// a checkpoint made more changes durable since the last pass or enough groups
    /// were read back; none unless the cache is lazy. A pass goes a batch of
    /// directories per call (`SHRINK_BATCH`, `SHRINK_ENTRIES`; each open and close
    /// makes one): all at once, fs_mark's directories held `st` 30-38 ms, and every
    /// operation waited. Returns the entries sent cold.
    pub fn shrink_dirs(&mut self) -> usize {
        if self.source.is_none() || self.dirs_held > 0 {
            return 0;
        }
        if self.shrink_queue.is_empty() {
            if self.shrunk_at == self.durable_gen && self.groups_in < SHRINK_AFTER_GROUPS {
                return 0;
            }
            self.shrunk_at = self.durable_gen;
            self.groups_in = 0;
            let dirs = self
                .map
                .iter()
                .filter(|(_, i)| i.is_dir())
                .map(|(ino, _)| *ino);
            self.shrink_queue.extend(dirs);
        }
        // Durable now, as a pass all at once went by: groups changed since are stamped
        // later, so resident (as is every group a capture in progress reads).
        let d = self.durable_gen;
        let mut moved = 0;
        // No `note_changed`: the entries stay what they are, only where their names
        // are kept changes. A batch ends at `SHRINK_BATCH` directories or
        // `SHRINK_ENTRIES` entries sent cold, whichever comes first (a directory whole).
        for _ in 0..SHRINK_BATCH {
            if moved >= SHRINK_ENTRIES {
                break;
            }
            let Some(ino) = self.shrink_queue.pop() else {
                break;
            };
            if self.dir_holds.contains_key(&ino) {
                if !self.shrink_deferred.contains(&ino) {
                    self.shrink_deferred.push(ino);
                }
                continue;
            }
            // Gone since the pass began (deleted, or evicted: it comes back as it is
            // on disk), or no directory: nothing to send cold.
            if let Some(i) = self.map.get_mut(&ino).filter(|i| i.is_dir()) {
                moved += i.entries.shrink(d);
            }
        }
        self.entries_shrunk += moved as u64;
        moved
    }

    pub fn source(&self) -> Option<Arc<dyn InodeSource>> {
        self.source.clone()
    }

    /// Install what `read` read back of the inodes `asked` (none: all), unless the
    /// durable generation moved on since (then false: read again). Inodes in memory or
    /// changed since are kept as they are: memory is newer than the tree.
    /// `check` vets each inode installed (an image is untrusted input).
    pub fn install(
        &mut self,
        read: Read,
        asked: Option<&[u64]>,
        check: impl Fn(u64, &Inode) -> Result<(), FsError>,
    ) -> Result<bool, FsError> {
        if read.gen != self.durable_gen {
            return Ok(false);
        }
        let found = read.inodes?;
        if let Some(asked) = asked {
            if self.absent.len() > ABSENT_MAX {
                self.absent.clear();
            }
            let there: FxHashSet<u64> = found.iter().map(|(ino, _)| *ino).collect();
            self.absent.extend(
                asked
                    .iter()
                    .filter(|&&ino| !there.contains(&ino) && !self.map.contains_key(&ino)),
            );
        }
        for (ino, i) in found {
            if self.changed.contains_key(&ino) || self.map.contains_key(&ino) {
                continue;
            }
            check(ino, &i)?;
            self.faults += 1;
            self.order.push_back(ino);
            self.map.insert(ino, Box::new(i));
        }
        Ok(true)
    }

    /// A new inode (created, or every inode at load).
    pub fn insert(&mut self, ino: u64, i: Box<Inode>) {
        // Noted before, as every change is: a capture in progress copies what the
        // closed generation left at this number (replay may make a number again).
        self.note_changed(ino);
        let old = self.map.insert(ino, i);
        debug_assert!(old.is_none(), "inode {ino} inserted twice");
        if self.source.is_some() {
            self.order.push_back(ino);
        }
    }

    /// A deleted inode: gone from memory, and stamped so the tree's old copy is not
    /// read back before the deletion is durable.
    pub fn remove(&mut self, ino: u64) -> Option<Box<Inode>> {
        self.note_changed(ino);
        self.map.remove(&ino)
    }

    /// Stamp `ino` with the running generation (a tree-backed cache only: elsewhere
    /// nothing is dropped, and nothing needs to know).
    pub fn note_changed(&mut self, ino: u64) {
        if self.source.is_none() {
            return;
        }
        let before = self.changed.insert(ino, self.gen);
        if before != Some(self.gen) {
            self.open_changed += 1;
        }
        // Before the change is made (every `&mut` to an inode comes through here):
        // a checkpoint copying out the closed generation takes this inode as it is.
        if let Some(p) = self.pending.as_deref_mut() {
            if before == Some(p.gen()) {
                p.before_change(ino, self.map.get(&ino).map(|b| &**b));
            }
        }
    }

    /// A checkpoint copies out the generation just closed (`fs::cowcapture`).
    pub fn begin_capture(&mut self, p: PendingCapture) {
        debug_assert!(self.pending.is_none(), "two captures at once");
        debug_assert!(
            self.source.is_some(),
            "a copy-on-write capture without stamps"
        );
        debug_assert_eq!(
            p.gen() + 1,
            self.gen,
            "a capture of a generation still open"
        );
        self.pending = Some(Box::new(p));
    }

    /// Copy up to `max` more of the pending capture's inodes; true once all are.
    pub fn capture_step(&mut self, max: usize) -> bool {
        let Some(p) = self.pending.as_deref_mut() else {
            return true;
        };
        let (changed, map) = (&self.changed, &self.map);
        p.step(
            max,
            |ino| changed.get(&ino).copied(),
            |ino| map.get(&ino).map(|b| &**b),
        )
    }

    /// The pending capture's keys, while the list of their inodes is to be made
    /// (`PendingCapture::changes_to_list`), with its generation.
    pub fn capture_changes(&self) -> Option<(u64, Arc<Changes>)> {
        let p = self.pending.as_deref()?;
        p.changes_to_list().map(|c| (p.gen(), c))
    }

    /// Give the pending capture of generation `gen` the list of its inodes
    /// (`PendingCapture::set_inodes`); none if it was given up meanwhile.
    pub fn capture_set_inodes(&mut self, gen: u64, inodes: Vec<u64>) {
        if let Some(p) = self.pending.as_deref_mut().filter(|p| p.gen() == gen) {
            p.set_inodes(inodes);
        }
    }

    /// The pending capture, done or given up (a failed volume).
    pub fn take_capture(&mut self) -> Option<PendingCapture> {
        self.pending.take().map(|b| *b)
    }

    /// Inodes changed since the last checkpoint took its changes (none unless lazy):
    /// they stay in memory until a checkpoint holding them is durable, so this many
    /// past `inode_cache` asks for one (`State::meta_full`).
    pub fn open_changed(&self) -> usize {
        self.open_changed
    }

    /// A checkpoint captured the changes stamped so far: they go out as generation
    /// returned; later ones are stamped with the next.
    pub fn close_gen(&mut self) -> u64 {
        let g = self.gen;
        self.gen += 1;
        self.open_changed = 0;
        g
    }

    /// The checkpoint of generation `gen` is durable: what it holds may be dropped.
    pub fn durable(&mut self, gen: u64) {
        debug_assert!(gen < self.gen, "generation {gen} was never closed");
        debug_assert!(gen >= self.durable_gen, "durable generations went back");
        self.durable_gen = gen;
        let d = self.durable_gen;
        self.changed.retain(|_, g| *g > d);
    }

    /// Drop clean inodes, oldest first, until at most `keep` are in memory or
    /// `PASS_BUDGET` have been examined; `pinned` names inodes in use (open, with pages,
    /// mid-IO). Returns the ones dropped.
    pub fn evict(&mut self, keep: usize, pinned: &dyn Fn(u64) -> bool) -> Vec<u64> {
        let mut dropped = Vec::new();
        if !self.wants_evict(keep) {
            return dropped;
        }
        let order = &mut self.order;
        let map = &mut self.map;
        if order.len() > 2 * map.len() + 1024 {
            // Mostly inodes deleted since they came in (creates and deletes under the
            // limit never reach the loop below).
            order.retain(|ino| map.contains_key(ino));
        }
        let mut kept = Vec::new();
        let mut examined = 0;
        while map.len() > keep && examined < PASS_BUDGET {
            let Some(ino) = order.pop_front() else { break };
            examined += 1;
            if !map.contains_key(&ino) {
                continue; // deleted since it came in
            }
            if ino == ROOT_INO
                || self.changed.contains_key(&ino)
                || self.pins.contains_key(&ino)
                || pinned(ino)
            {
                kept.push(ino);
                continue;
            }
            map.remove(&ino);
            dropped.push(ino);
        }
        // Kept ones go to the back: a pass meets each of them once.
        order.extend(kept);
        self.rest = if map.len() > keep {
            (self.durable_gen, map.len())
        } else {
            (u64::MAX, 0)
        };
        self.evictions += dropped.len() as u64;
        dropped
    }

    /// Whether `evict` to `keep` has anything to try: the cache is lazy, over `keep`,
    /// and not at rest since a pass that stopped short (`rest`).
    pub fn wants_evict(&self, keep: usize) -> bool {
        self.source.is_some()
            && self.map.len() > keep
            && !(self.rest.0 == self.durable_gen && self.map.len() < self.rest.1 + REST_SLACK)
    }

    /// `fetch_mut` of an inode in memory, without IO (none if it is not).
    pub fn resident_mut(&mut self, ino: u64) -> Option<&mut Inode> {
        if !self.map.contains_key(&ino) {
            return None;
        }
        self.note_changed(ino);
        self.map.get_mut(&ino).map(|b| &mut **b)
    }

    /// Every inode in memory (all of them unless the cache is lazy).
    /// Read only: a change must come through `note_changed` first (`fs::cowcapture`).
    pub fn all_resident(&self) -> &FxHashMap<u64, Box<Inode>> {
        &self.map
    }

    pub fn stats(&self) -> MetaCacheStats {
        MetaCacheStats {
            faults: self.faults,
            evictions: self.evictions,
            resident: self.map.len() as u64,
            changed: self.changed.len() as u64,
            dirent_faults: self.dirent_faults,
            dirents_shrunk: self.entries_shrunk,
            dirents_resident: self
                .map
                .values()
                .map(|i| i.entries.resident_len() as u64)
                .sum(),
        }
    }
}
