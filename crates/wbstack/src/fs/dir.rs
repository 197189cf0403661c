//! A directory's entries, in the order readdir returns them: by a seeded 64-bit hash
//! of the name (`metatree::name_hash`, the order of the metadata tree's keys), then by
//! name. The hash is the readdir cookie, as ext4's htree hash is: resuming "after
//! cookie c" is a range lookup, so a walk of a directory of any size costs O(log n)
//! per resume and holds nothing between calls, and an entry that exists for the whole
//! walk is returned exactly once however many entries are created or removed
//! meanwhile (POSIX leaves only those to chance).
//!
//! Names whose hashes collide share a cookie; a page of entries never ends inside such
//! a group (`Dir::page`), so a resume never skips part of one.
//!
//! On a volume whose inodes are a cache over the metadata tree (`fs::inodes`), a
//! directory is partial: a group of names sharing a hash is either resident (its
//! names and inodes here) or cold (only its hash here: 8 bytes, not ~100, and its
//! names in the tree's last durable root). A lookup, a create's check that the name is
//! free, and a page of readdir that meet a cold group fail with the range of hashes
//! to read back (`Cold`), which the operation's entry point reads without `st` and
//! installs (`install_group`) before it runs again, as it does for inodes. A create
//! whose hash no group has needs no read: the hash alone says the name is free. A
//! group goes cold (`shrink`) once every change to it is in a durable checkpoint: its
//! stamp, the checkpoint generation its last change went out with, is durable. So a
//! directory's memory is its hashes plus the groups changed since the last durable
//! checkpoint or read back since the last shrink, not every name it holds.
//!
//! A large directory read back from the tree is not listed (`Dir::unlisted`): listing
//! its hashes costs a read of every entry (a million-entry directory's first lookup
//! took a second). Its groups are then known one by one: a hash neither resident nor
//! known absent is read back alone (`Cold` of that one hash: O(log n) in the tree),
//! and what the read found stays (`install_read`); a removal that empties a group
//! leaves it known absent until the removal is durable, since the tree's durable root
//! still holds the name until then. A page of readdir reads its own groups, at most
//! as many as it returns, from its cookie on (`Cold::max_groups`), and the range that
//! read covers is known whole until the next shrink (a lookup in it needs no read).
//! rmdir's question, whether it has an entry, is a page of one. What needs every
//! entry (a count, a walk) asks for the whole range, and that read lists the
//! directory: counts, not names.

use super::format::InodeKind;
use super::inodes::{DirentRead, GroupRead};
use rustc_hash::FxHashSet;
use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::ops::Bound;

pub use super::metatree::name_hash;

/// Cookies below this are the walk's own: 0 the start, 1 after `.`, 2 after `..`.
/// Every name's hash is at least this.
pub const FIRST_COOKIE: u64 = 3;

/// A name and the kind of the inode it names, in one allocation: the name's bytes,
/// then the kind's byte (0: not known yet, an entry of an image that did not record
/// it, until its load resolves it). readdir reports kinds without reading inodes.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Name(Box<[u8]>);

impl Name {
    fn new(name: &[u8], kind: Option<InodeKind>) -> Name {
        let mut v = Vec::with_capacity(name.len() + 1);
        v.extend_from_slice(name);
        v.push(kind.map_or(0, |k| k as u8));
        Name(v.into_boxed_slice())
    }

    fn bytes(&self) -> &[u8] {
        &self.0[..self.0.len() - 1]
    }

    fn kind(&self) -> Option<InodeKind> {
        InodeKind::from_u8(self.0[self.0.len() - 1]).ok()
    }

    fn set_kind(&mut self, kind: Option<InodeKind>) {
        let last = self.0.len() - 1;
        self.0[last] = kind.map_or(0, |k| k as u8);
    }
}

/// The names that share one hash: almost always one.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Names {
    One((Name, u64)),
    /// Two or more, sorted by name.
    Many(Vec<(Name, u64)>),
}

/// A resident group: its names, and the checkpoint generation its last change goes
/// out with (0: none since it came into memory, or a volume that stamps nothing). It
/// may go cold once that generation is durable.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Slot {
    names: Names,
    gen: u64,
}

impl Slot {
    fn one(name: &[u8], kind: Option<InodeKind>, ino: u64, gen: u64) -> Slot {
        Slot {
            names: Names::One((Name::new(name, kind), ino)),
            gen,
        }
    }

    fn entries(&self) -> &[(Name, u64)] {
        match &self.names {
            Names::One(e) => std::slice::from_ref(e),
            Names::Many(v) => v.as_slice(),
        }
    }

    fn entries_mut(&mut self) -> &mut [(Name, u64)] {
        match &mut self.names {
            Names::One(e) => std::slice::from_mut(e),
            Names::Many(v) => v.as_mut_slice(),
        }
    }
}

/// One entry of a page of readdir.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirPageEntry {
    pub name: Vec<u8>,
    pub ino: u64,
    pub kind: InodeKind,
    /// Resume after this to continue past this entry.
    pub cookie: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Dir {
    /// The resident groups.
    by_hash: BTreeMap<u64, Slot>,
    /// Every entry, resident or cold.
    len: usize,
    /// None: every entry is resident and nothing is stamped (a volume that holds all
    /// its metadata in memory, or a directory never changed nor read back lazily).
    partial: Option<Box<Partial>>,
}

/// What a partial directory keeps beside its resident groups.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Partial {
    /// The hashes of the cold groups (a group of names sharing a hash goes cold and
    /// comes back whole: the tree's range of one hash is exactly one group).
    cold: ColdSet,
    /// Entries in cold groups, and of them those naming directories.
    cold_entries: usize,
    cold_subdirs: u32,
    /// Some: the groups are not listed (`Dir::unlisted`); `cold` is empty, and the
    /// counts are of resident entries only.
    unlisted: Option<Box<Unlisted>>,
}

/// What an unlisted directory knows beside its resident groups.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Unlisted {
    /// Hashes known to have no group, with the checkpoint generation that may forget
    /// it: 0 for one read back and found empty (the tree says so), a removal's
    /// generation for a group it emptied (the durable root holds the names until that
    /// generation is durable).
    /// Ordered, so that a page can count those in a range (`Dir::unlisted_page`).
    absent: BTreeMap<u64, u64>,
    /// Hash ranges (inclusive) read whole since the last shrink: each group in them is
    /// resident or known absent, so a page of readdir inside one needs no read. The
    /// most recent last.
    known: Vec<(u64, u64)>,
}

impl Unlisted {
    /// The end of the range known whole that holds `h`, if any.
    fn known_through(&self, h: u64) -> Option<u64> {
        self.known
            .iter()
            .find(|&&(from, to)| (from..=to).contains(&h))
            .map(|&(_, to)| to)
    }

    /// `from..=to` was read whole: it joins the ranges it touches or overlaps.
    fn know(&mut self, mut from: u64, mut to: u64) {
        debug_assert!(from <= to, "an empty range known");
        self.known.retain(|&(f, t)| {
            let apart = t.checked_add(1).is_some_and(|after| after < from)
                || to.checked_add(1).is_some_and(|after| after < f);
            if !apart {
                (from, to) = (from.min(f), to.max(t));
            }
            apart
        });
        self.known.push((from, to));
        if self.known.len() > KNOWN_MAX {
            self.known.remove(0);
        }
    }
}

/// The hashes of a directory's cold groups: a sorted array (8 bytes a group, and a
/// shrink's run of new cold hashes, sorted already, merges in one sequential pass: a
/// `BTreeSet` cost about 14 bytes a hash and a cache miss per level for every insert,
/// ~1 µs each under `st`), less the groups read back since (`revived`, folded into
/// the array once they are a quarter of it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct ColdSet {
    sorted: Vec<u64>,
    /// Every `FENCE`th hash of `sorted`: a lookup searches this (small enough to stay
    /// in cache: 1/64 of the array), then one block of 512 bytes, where a search of
    /// the whole array missed the cache at each of its last dozen steps.
    fence: Vec<u64>,
    revived: FxHashSet<u64>,
}

/// Hashes of `ColdSet::sorted` per fence entry.
const FENCE: usize = 64;

impl ColdSet {
    fn contains(&self, h: u64) -> bool {
        debug_assert_eq!(self.fence.len(), self.sorted.len().div_ceil(FENCE));
        let block = self.fence.partition_point(|&f| f <= h);
        if block == 0 {
            return false;
        }
        let start = (block - 1) * FENCE;
        let end = (start + FENCE).min(self.sorted.len());
        self.sorted[start..end].binary_search(&h).is_ok() && !self.revived.contains(&h)
    }

    fn rebuild_fence(&mut self) {
        self.fence.clear();
        self.fence
            .extend(self.sorted.iter().step_by(FENCE).copied());
    }

    fn is_empty(&self) -> bool {
        self.sorted.len() == self.revived.len()
    }

    /// The cold hashes in `from..=to`, in order.
    fn range(&self, from: u64, to: u64) -> impl Iterator<Item = u64> + '_ {
        let start = self.sorted.partition_point(|&x| x < from);
        self.sorted[start..]
            .iter()
            .copied()
            .take_while(move |&x| x <= to)
            .filter(|x| !self.revived.contains(x))
    }

    fn first(&self) -> Option<u64> {
        self.range(0, u64::MAX).next()
    }

    fn last(&self) -> Option<u64> {
        self.sorted
            .iter()
            .rev()
            .copied()
            .find(|x| !self.revived.contains(x))
    }

    /// The group of `h` is no longer cold; false if it was not.
    fn remove(&mut self, h: u64) -> bool {
        if !self.contains(h) {
            return false;
        }
        self.revived.insert(h);
        if self.revived.len() > self.sorted.len() / 4 + 1024 {
            let revived = std::mem::take(&mut self.revived);
            self.sorted.retain(|x| !revived.contains(x));
            self.rebuild_fence();
        }
        true
    }

    /// Add hashes not cold now, in increasing order.
    fn extend_sorted(&mut self, run: &[u64]) {
        debug_assert!(run.is_sorted(), "a run of cold hashes out of order");
        // A hash read back and cold again is still in `sorted`.
        let fresh: Vec<u64> = run
            .iter()
            .copied()
            .filter(|h| !self.revived.remove(h))
            .collect();
        debug_assert!(
            fresh.iter().all(|h| self.sorted.binary_search(h).is_err()),
            "a hash made cold twice"
        );
        if fresh.is_empty() {
            return;
        }
        if self.sorted.last().is_none_or(|&l| l < fresh[0]) {
            // Appended (a load adds a directory's groups in order, one at a time): the
            // fence grows by the new blocks only.
            self.sorted.extend_from_slice(&fresh);
            let next = self.fence.len() * FENCE;
            let new_blocks = self.sorted.get(next..).unwrap_or_default();
            self.fence.extend(new_blocks.iter().step_by(FENCE).copied());
            return;
        }
        let old = std::mem::take(&mut self.sorted);
        self.sorted.reserve_exact(old.len() + fresh.len());
        let (mut a, mut b) = (old.iter().peekable(), fresh.iter().peekable());
        while let (Some(&&x), Some(&&y)) = (a.peek(), b.peek()) {
            if x < y {
                self.sorted.push(x);
                a.next();
            } else {
                self.sorted.push(y);
                b.next();
            }
        }
        self.sorted.extend(a);
        self.sorted.extend(b);
        self.rebuild_fence();
    }
}

/// Hashes from `from` to `to` (inclusive) hold cold groups: read them back
/// (`InodeSource::read_dirents`) and run again. With `max_groups`, only the first
/// that many groups of the range are asked for (a page of an unlisted directory's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cold {
    pub from: u64,
    pub to: u64,
    pub max_groups: Option<NonZeroU32>,
}

impl Cold {
    /// Every group in `from..=to`.
    pub const fn range(from: u64, to: u64) -> Cold {
        Cold {
            from,
            to,
            max_groups: None,
        }
    }
}

/// Every hash a directory's names may have: what a caller that needs every entry of
/// an unlisted directory asks to read back.
pub const ALL: Cold = Cold::range(FIRST_COOKIE, u64::MAX);

/// Ranges of hashes an unlisted directory knows whole (`Unlisted::known`), at most:
/// as many readdir walks in progress at once as keep their pages from reading again.
const KNOWN_MAX: usize = 8;

impl Dir {
    pub fn new() -> Dir {
        Dir::default()
    }

    /// A directory read back without its listing: nothing is known of its groups.
    pub fn unlisted() -> Dir {
        Dir {
            partial: Some(Box::new(Partial {
                unlisted: Some(Box::default()),
                ..Partial::default()
            })),
            ..Dir::default()
        }
    }

    fn unlisted_part(&self) -> Option<&Unlisted> {
        self.partial.as_deref()?.unlisted.as_deref()
    }

    fn unlisted_mut(&mut self) -> Option<&mut Unlisted> {
        self.partial.as_deref_mut()?.unlisted.as_deref_mut()
    }

    /// Err(`ALL`) if the directory is unlisted: for a caller about to count its
    /// entries (`len`, `is_empty`, `subdirs`), which an unlisted one does not know.
    pub fn listed(&self) -> Result<(), Cold> {
        match self.unlisted_part() {
            Some(_) => Err(ALL),
            None => Ok(()),
        }
    }

    /// Its entries, of a listed directory (`listed`).
    pub fn len(&self) -> usize {
        debug_assert!(self.listed().is_ok(), "the count of an unlisted directory");
        self.len
    }

    pub fn is_empty(&self) -> bool {
        debug_assert!(self.listed().is_ok(), "the count of an unlisted directory");
        self.len == 0
    }

    /// Whether it holds any entry (rmdir, a rename over a directory, a Delete): a
    /// listed directory's count; an unlisted one's resident groups, else its first
    /// page of one entry, which reads O(log n) groups where a count read every key
    /// (the last rmdir of an `rm -rf` of a large directory listed it first).
    pub fn has_entries(&self) -> Result<bool, Cold> {
        match self.unlisted_part() {
            None => Ok(self.len != 0),
            // A resident group holds a name (an emptied one leaves `by_hash`).
            Some(_) if !self.by_hash.is_empty() => Ok(true),
            Some(u) => {
                let first = self.unlisted_page(u, 0, 1, |_| InodeKind::File)?;
                Ok(!first.is_empty())
            }
        }
    }

    /// The inode `name` names, under the volume's hash seed `seed`; `Cold` if its
    /// group must be read back first.
    pub fn get(&self, seed: u64, name: &[u8]) -> Result<Option<u64>, Cold> {
        let h = name_hash(seed, name);
        Ok(self.lookup_at(h, name)?.map(|e| e.0))
    }

    /// `get` with the name's hash known, of a directory whose every entry is resident.
    #[cfg(test)]
    pub(super) fn get_at(&self, h: u64, name: &[u8]) -> Option<u64> {
        self.entry_at(h, name).map(|e| e.0)
    }

    /// The inode `name` (whose hash is `h`) names, and its kind if known; `Cold` if its
    /// group is not resident.
    pub(super) fn lookup_at(
        &self,
        h: u64,
        name: &[u8],
    ) -> Result<Option<(u64, Option<InodeKind>)>, Cold> {
        self.check_resident(h)?;
        Ok(self.entry_at(h, name))
    }

    /// Err if the group of hash `h` is cold, or may be (an unlisted directory's hash
    /// neither resident nor known absent, alone or in a range read whole).
    fn check_resident(&self, h: u64) -> Result<(), Cold> {
        let Some(p) = &self.partial else {
            return Ok(());
        };
        let unknown = |u: &Unlisted| {
            !u.absent.contains_key(&h)
                && !self.by_hash.contains_key(&h)
                && u.known_through(h).is_none()
        };
        if p.cold.contains(h) || p.unlisted.as_deref().is_some_and(unknown) {
            return Err(Cold::range(h, h));
        }
        Ok(())
    }

    /// The inode `name` (whose hash is `h`) names among the resident groups, and its
    /// kind if known: for a caller that knows the group is resident (changed since the
    /// last durable checkpoint, so not shrunk).
    pub(super) fn entry_at(&self, h: u64, name: &[u8]) -> Option<(u64, Option<InodeKind>)> {
        self.by_hash
            .get(&h)?
            .entries()
            .iter()
            .find(|(n, _)| n.bytes() == name)
            .map(|(n, ino)| (*ino, n.kind()))
    }

    /// Add or replace `name`, the kind of its inode not known (it is resolved by the
    /// load: `resolve_kinds`); the inode it named before, if any.
    pub fn insert(&mut self, seed: u64, name: &[u8], ino: u64) -> Option<u64> {
        self.insert_at(name_hash(seed, name), name, ino, None)
    }

    /// `insert` with the name's hash and the inode's kind known.
    pub(super) fn insert_at(
        &mut self,
        h: u64,
        name: &[u8],
        ino: u64,
        kind: Option<InodeKind>,
    ) -> Option<u64> {
        debug_assert!(
            h >= FIRST_COOKIE,
            "a name's hash {h} below the first cookie"
        );
        let Some(slot) = self.by_hash.get_mut(&h) else {
            self.by_hash.insert(h, Slot::one(name, kind, ino, 0));
            self.len += 1;
            self.forget_absent(h);
            return None;
        };
        let v = match &mut slot.names {
            Names::One((n, old)) if n.bytes() == name => {
                n.set_kind(kind);
                return Some(std::mem::replace(old, ino));
            }
            Names::One((n, old)) => {
                let first = (std::mem::replace(n, Name::new(&[], None)), *old);
                slot.names = Names::Many(vec![first]);
                let Names::Many(v) = &mut slot.names else {
                    unreachable!()
                };
                v
            }
            Names::Many(v) => v,
        };
        match v.binary_search_by(|(n, _)| n.bytes().cmp(name)) {
            Ok(i) => {
                v[i].0.set_kind(kind);
                Some(std::mem::replace(&mut v[i].1, ino))
            }
            Err(i) => {
                v.insert(i, (Name::new(name, kind), ino));
                self.len += 1;
                None
            }
        }
    }

    /// Add `name` (whose hash is `h`) if absent, in one walk of the directory; false,
    /// with nothing changed, if it is there already; `Cold`, with nothing changed, if
    /// its group must be read back to tell. `stamp`: the checkpoint generation the
    /// change goes out with (a lazy volume's), which keeps the group resident until it
    /// is durable.
    pub(super) fn insert_new_at(
        &mut self,
        h: u64,
        name: &[u8],
        ino: u64,
        kind: Option<InodeKind>,
        stamp: Option<u64>,
    ) -> Result<bool, Cold> {
        debug_assert!(
            h >= FIRST_COOKIE,
            "a name's hash {h} below the first cookie"
        );
        self.check_resident(h)?;
        let slot = match self.by_hash.entry(h) {
            std::collections::btree_map::Entry::Vacant(v) => {
                v.insert(Slot::one(name, kind, ino, stamp.unwrap_or(0)));
                self.len += 1;
                self.forget_absent(h);
                return Ok(true);
            }
            std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
        };
        if slot.entries().iter().any(|(n, _)| n.bytes() == name) {
            return Ok(false);
        }
        // A collision: the shared slot takes it, as `insert_at` places it.
        let replaced = self.insert_at(h, name, ino, kind);
        debug_assert!(replaced.is_none(), "{name:?} was absent from its slot");
        self.stamp(h, stamp);
        Ok(true)
    }

    /// A group of hash `h` is resident now: an unlisted directory's note that it had
    /// none goes (the group's own stamp keeps it until it is durable).
    fn forget_absent(&mut self, h: u64) {
        if let Some(u) = self.unlisted_mut() {
            u.absent.remove(&h);
        }
    }

    /// The resident group of hash `h` changed in generation `gen` (none: nothing is
    /// stamped).
    fn stamp(&mut self, h: u64, gen: Option<u64>) {
        if let (Some(g), Some(slot)) = (gen, self.by_hash.get_mut(&h)) {
            debug_assert!(slot.gen <= g, "group {h} stamped {g} after {}", slot.gen);
            slot.gen = g;
        }
    }

    /// Remove `name` from a directory whose every entry is resident (one never made
    /// partial); the inode it named, if any.
    pub fn remove(&mut self, seed: u64, name: &[u8]) -> Option<u64> {
        self.remove_at(name_hash(seed, name), name, None)
    }

    /// `remove` with the name's hash known, its group resident (looked up first:
    /// `lookup_at`); `stamp` as for `insert_new_at`.
    pub(super) fn remove_at(&mut self, h: u64, name: &[u8], stamp: Option<u64>) -> Option<u64> {
        debug_assert!(
            self.check_resident(h).is_ok(),
            "a removal from cold group {h}"
        );
        let ino = self.remove_resident(h, name)?;
        // A group left with other names keeps them resident until this is durable.
        self.stamp(h, stamp);
        if !self.by_hash.contains_key(&h) {
            if let Some(u) = self.unlisted_mut() {
                // Until the removal is durable, the durable root still holds the name:
                // a read back of the hash would bring it back.
                debug_assert!(
                    stamp.is_some(),
                    "an unstamped removal from an unlisted directory"
                );
                u.absent.insert(h, stamp.unwrap_or(u64::MAX));
            }
        }
        Some(ino)
    }

    fn remove_resident(&mut self, h: u64, name: &[u8]) -> Option<u64> {
        let slot = self.by_hash.get_mut(&h)?;
        let ino = match &mut slot.names {
            Names::One((n, ino)) => {
                if n.bytes() != name {
                    return None;
                }
                let ino = *ino;
                self.by_hash.remove(&h);
                ino
            }
            Names::Many(v) => {
                let i = v.iter().position(|(n, _)| n.bytes() == name)?;
                let (_, ino) = v.remove(i);
                debug_assert!(!v.is_empty(), "a shared slot of one name");
                if v.len() == 1 {
                    let last = v.pop().expect("one left");
                    slot.names = Names::One(last);
                }
                ino
            }
        };
        self.len -= 1;
        Some(ino)
    }

    /// Err if any group is cold: for a caller about to walk every entry (`iter`), the
    /// range to read back first.
    pub fn all_resident(&self) -> Result<(), Cold> {
        self.listed()?;
        match self.partial.as_deref() {
            Some(p) if !p.cold.is_empty() => Err(Cold::range(
                p.cold.first().expect("not empty"),
                p.cold.last().expect("not empty"),
            )),
            _ => Ok(()),
        }
    }

    /// The first cold group's hash in `range`, if any.
    pub fn cold_in(&self, range: Cold) -> Option<u64> {
        let p = self.partial.as_deref()?;
        p.cold.range(range.from, range.to).next()
    }

    /// Entries whose names are in memory.
    pub fn resident_len(&self) -> usize {
        self.len - self.partial.as_deref().map_or(0, |p| p.cold_entries)
    }

    /// How many entries name directories, if every kind is known and the directory is
    /// listed.
    pub fn subdirs(&self) -> Option<u32> {
        self.listed().ok()?;
        let cold = self.partial.as_deref().map_or(0, |p| p.cold_subdirs);
        self.iter_kinds().try_fold(cold, |n, (_, _, k)| {
            Some(n + u32::from(k? == InodeKind::Dir))
        })
    }

    /// A group read back lazily goes in cold: its hash, how many names it has and how
    /// many of them name directories (a directory's read back, `metatree::load_inode`).
    pub(super) fn add_cold(&mut self, h: u64, names: usize, subdirs: u32) {
        debug_assert!(
            !self.by_hash.contains_key(&h),
            "group {h} both resident and cold"
        );
        let p = self.partial.get_or_insert_with(Box::default);
        debug_assert!(!p.cold.contains(h), "cold group {h} added twice");
        p.cold.extend_sorted(&[h]);
        p.cold_entries += names;
        p.cold_subdirs += subdirs;
        self.len += names;
    }

    /// Install a cold group read back (its names as the durable tree holds them, which
    /// a cold group's are: it has not changed since); false if it is not cold (another
    /// reader installed it, or it changed since: memory is newer).
    pub(super) fn install_group(&mut self, h: u64, names: &[DirentRead]) -> bool {
        let Some(p) = self.partial.as_deref_mut() else {
            return false;
        };
        if let Some(u) = p.unlisted.as_deref() {
            // Known already (resident, or absent): memory is as new as the read.
            if self.by_hash.contains_key(&h) || u.absent.contains_key(&h) || names.is_empty() {
                return false;
            }
        } else {
            if !p.cold.remove(h) {
                return false;
            }
            let subdirs = names
                .iter()
                .filter(|e| e.kind == Some(InodeKind::Dir))
                .count() as u32;
            debug_assert!(
                p.cold_entries >= names.len() && p.cold_subdirs >= subdirs,
                "group {h} read back with more names than went cold"
            );
            p.cold_entries -= names.len();
            p.cold_subdirs -= subdirs;
            self.len -= names.len();
        }
        for e in names {
            debug_assert_eq!(e.hash, h, "a name of another group");
            let before = self.insert_at(h, &e.name, e.ino, e.kind);
            debug_assert!(before.is_none(), "a name twice in group {h}");
        }
        true
    }

    /// Install what a read back of the range `asked` found (`found`: the durable
    /// tree's entries of this directory in that range, in key order; `counted`: the
    /// groups a listing counted without their names, which only an ask of `ALL`
    /// has); how many groups came into memory or became known absent (what a shrink
    /// is due after). An unlisted directory learns what the read says: a single hash
    /// with no group is known absent, a capped read (`Cold::max_groups`, a page's)
    /// makes the range it covered known whole, and a listing lists it.
    /// Err: the hash of a group listed cold in the range that the read did not find
    /// (the tree lost entries the directory counts: `add_cold` took them from the same
    /// root).
    pub(super) fn install_read(
        &mut self,
        asked: Cold,
        found: &[DirentRead],
        counted: &[GroupRead],
    ) -> Result<usize, u64> {
        if asked == ALL {
            // Listed already (another reader's listing came first, or a load listed
            // it): a listing has nothing to add, its groups being cold or newer.
            return Ok(self.install_listing(found, counted));
        }
        debug_assert!(counted.is_empty(), "a range asked for, answered by counts");
        let mut installed = 0;
        let mut groups = 0;
        for group in found.chunk_by(|a, b| a.hash == b.hash) {
            installed += usize::from(self.install_group(group[0].hash, group));
            groups += 1;
        }
        // A capped read that found its most groups covers the range up to its last
        // group's hash only; the rest is unknown still.
        let mut asked = asked;
        if let (Some(cap), Some(last)) = (asked.max_groups, found.last()) {
            debug_assert!(groups <= cap.get() as usize, "more groups than asked for");
            if groups >= cap.get() as usize {
                asked.to = last.hash;
            }
        }
        if asked.max_groups.is_some() {
            if let Some(u) = self.unlisted_mut() {
                u.know(asked.from, asked.to);
            }
        }
        if asked.from == asked.to && found.is_empty() {
            let h = asked.from;
            let resident = self.by_hash.contains_key(&h);
            if let Some(u) = self.unlisted_mut() {
                if !resident && !u.absent.contains_key(&h) {
                    u.absent.insert(h, 0);
                    installed += 1;
                }
            }
        }
        match self.cold_in(asked) {
            Some(h) => Err(h),
            None => Ok(installed),
        }
    }

    /// An unlisted directory's listing, as the durable tree holds it, lists it: the
    /// groups not resident nor known absent (memory is newer for those) go cold, as a
    /// load lists them, and those with a kind not recorded (`found`: their names)
    /// come into memory. Returns how many groups did (what a shrink is due after).
    fn install_listing(&mut self, found: &[DirentRead], counted: &[GroupRead]) -> usize {
        let Some(u) = self.partial.as_deref_mut().and_then(|p| p.unlisted.take()) else {
            return 0;
        };
        let known = |d: &Dir, h: u64| d.by_hash.contains_key(&h) || u.absent.contains_key(&h);
        // In hash order, so that each group appends to the cold set.
        for g in counted {
            if !known(self, g.hash) {
                self.add_cold(g.hash, g.names as usize, g.subdirs);
            }
        }
        let mut resident = 0;
        for group in found.chunk_by(|a, b| a.hash == b.hash) {
            let h = group[0].hash;
            debug_assert!(group.iter().any(|e| e.kind.is_none()), "a group read whole");
            if !known(self, h) {
                for e in group {
                    let before = self.insert_at(h, &e.name, e.ino, e.kind);
                    debug_assert!(before.is_none(), "a name twice in group {h}");
                }
                resident += 1;
            }
        }
        resident
    }

    /// Send every clean group (its stamp no later than `durable_gen`) cold, keeping
    /// the groups changed since. Groups with a kind not known stay (an entry cold must
    /// say whether it names a directory). Returns how many entries went cold.
    pub(super) fn shrink(&mut self, durable_gen: u64) -> usize {
        if let Some(u) = self.unlisted_mut() {
            // Unlisted: a clean group is dropped, not listed cold (its read back asks
            // for its hash alone), and what was known absent is forgotten once the
            // tree's durable root says so too.
            u.absent.retain(|_, gen| *gen > durable_gen);
            // A group dropped leaves the ranges read whole: a page reads them again.
            u.known.clear();
            let mut moved = 0;
            self.by_hash.retain(|_, slot| {
                let keep = slot.gen > durable_gen
                    || slot.entries().iter().any(|(n, _)| n.kind().is_none());
                if !keep {
                    moved += slot.entries().len();
                }
                keep
            });
            self.len -= moved;
            return moved;
        }
        if self.by_hash.is_empty() {
            return 0;
        }
        let p = self.partial.get_or_insert_with(Box::default);
        let mut moved = 0;
        // In hash order, as `by_hash` is walked: one merge into the cold set.
        let mut run = Vec::new();
        self.by_hash.retain(|&h, slot| {
            if slot.gen > durable_gen {
                return true;
            }
            let mut subdirs = 0;
            for (n, _) in slot.entries() {
                match n.kind() {
                    Some(k) => subdirs += u32::from(k == InodeKind::Dir),
                    None => return true,
                }
            }
            let names = slot.entries().len();
            run.push(h);
            p.cold_entries += names;
            p.cold_subdirs += subdirs;
            moved += names;
            false
        });
        p.cold.extend_sorted(&run);
        moved
    }

    /// Every resident entry (every entry unless `all_resident` says otherwise), in
    /// cookie order.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], u64)> + '_ {
        self.iter_after(0).map(|(_, n, i, _)| (n, i))
    }

    /// Every entry with its inode's kind if known, in cookie order.
    pub fn iter_kinds(&self) -> impl Iterator<Item = (&[u8], u64, Option<InodeKind>)> + '_ {
        self.iter_after(0).map(|(_, n, i, k)| (n, i, k))
    }

    /// The inodes the entries name, in cookie order.
    pub fn inodes(&self) -> impl Iterator<Item = u64> + '_ {
        self.iter().map(|(_, i)| i)
    }

    /// (cookie, name, inode, kind) of the entries after `cookie`, in cookie order.
    fn iter_after(
        &self,
        cookie: u64,
    ) -> impl Iterator<Item = (u64, &[u8], u64, Option<InodeKind>)> + '_ {
        self.by_hash
            .range((Bound::Excluded(cookie), Bound::Unbounded))
            .flat_map(|(&h, s)| {
                s.entries()
                    .iter()
                    .map(move |(n, i)| (h, n.bytes(), *i, n.kind()))
            })
    }

    /// Set the kinds not known yet, from `kind_of` (a load that read every inode).
    pub fn resolve_kinds(&mut self, kind_of: impl Fn(u64) -> Option<InodeKind>) {
        for s in self.by_hash.values_mut() {
            for (n, ino) in s.entries_mut() {
                if n.kind().is_none() {
                    n.set_kind(kind_of(*ino));
                }
            }
        }
    }

    /// Up to `max` entries after `cookie` (more only to finish a group of names sharing
    /// a cookie, which a resume could not split), each with its kind: as recorded, else
    /// from `kind_of`. `Cold`: the range of the page's cold groups, to read back first.
    pub fn page(
        &self,
        cookie: u64,
        max: usize,
        kind_of: impl Fn(u64) -> InodeKind,
    ) -> Result<Vec<DirPageEntry>, Cold> {
        if let Some(u) = self.unlisted_part() {
            return self.unlisted_page(u, cookie, max, kind_of);
        }
        if let Some(p) = self.partial.as_deref().filter(|p| !p.cold.is_empty()) {
            // The page's groups are its first `max` hashes, resident or cold (a group
            // holds at least one name); the cold ones among them come back first.
            let after = (Bound::Excluded(cookie), Bound::Unbounded);
            let mut res = self.by_hash.range(after).map(|(h, _)| *h).peekable();
            let mut cold = cookie
                .checked_add(1)
                .map(|from| p.cold.range(from, u64::MAX))
                .into_iter()
                .flatten()
                .peekable();
            let mut range: Option<Cold> = None;
            for _ in 0..max.max(1) {
                let next_cold = match (res.peek(), cold.peek()) {
                    (Some(r), Some(c)) => c < r,
                    (None, Some(_)) => true,
                    (_, None) => break,
                };
                if next_cold {
                    let c = cold.next().expect("peeked");
                    range = Some(Cold::range(range.map_or(c, |r| r.from), c));
                } else {
                    res.next();
                }
            }
            if let Some(r) = range {
                return Err(r);
            }
        }
        Ok(self.resident_page(cookie, max, u64::MAX, kind_of))
    }

    /// A page of an unlisted directory, without listing it: the page's groups are the
    /// first `max` after `cookie` of a range known whole, which a read of at most `max`
    /// groups from where the known range ends extends (a walk of a million-entry
    /// directory reads as it goes, where listing it first read every entry before the
    /// first page).
    fn unlisted_page(
        &self,
        u: &Unlisted,
        cookie: u64,
        max: usize,
        kind_of: impl Fn(u64) -> InodeKind,
    ) -> Result<Vec<DirPageEntry>, Cold> {
        let Some(from) = cookie.checked_add(1) else {
            return Ok(Vec::new());
        };
        let max = max.max(1);
        let cap = |n: usize| NonZeroU32::new(u32::try_from(n).unwrap_or(u32::MAX));
        let Some(through) = u.known_through(from) else {
            return Err(Cold {
                from,
                to: u64::MAX,
                max_groups: cap(max),
            });
        };
        let groups = self.by_hash.range(from..=through).take(max).count();
        if groups < max && through < u64::MAX {
            // The tree's groups read may be known absent (removals not durable yet:
            // an `rm -rf` in progress leaves a run of them in hash order), which fill
            // no page: the next read asks for twice as many as the range known holds,
            // so a run of k takes O(log k) reads, not k / max.
            let skipped = u.absent.range(from..=through).count();
            return Err(Cold {
                from: through + 1,
                to: u64::MAX,
                max_groups: cap((max - groups).max(2 * skipped)),
            });
        }
        Ok(self.resident_page(cookie, max, through, kind_of))
    }

    /// Up to `max` resident entries after `cookie` (finishing a group), none past the
    /// hash `through`.
    fn resident_page(
        &self,
        cookie: u64,
        max: usize,
        through: u64,
        kind_of: impl Fn(u64) -> InodeKind,
    ) -> Vec<DirPageEntry> {
        let mut out: Vec<DirPageEntry> = Vec::new();
        for (c, name, ino, kind) in self.iter_after(cookie) {
            if c > through || (out.len() >= max && out.last().is_none_or(|l| l.cookie != c)) {
                break;
            }
            out.push(DirPageEntry {
                name: name.to_vec(),
                ino,
                kind: kind.unwrap_or_else(|| kind_of(ino)),
                cookie: c,
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(p: &[DirPageEntry]) -> Vec<&[u8]> {
        p.iter().map(|e| &e.name[..]).collect()
    }

    /// Names forced onto one hash (a real collision of the 63-bit hash is too rare to
    /// find): they share a slot, sorted by name, and fall back to one slot as they go.
    #[test]
    fn names_sharing_a_hash_share_a_cookie_and_a_page() {
        let mut d = Dir::new();
        assert_eq!(d.insert_at(10, b"c", 3, None), None);
        assert_eq!(d.insert_at(10, b"a", 1, None), None);
        assert_eq!(d.insert_at(10, b"b", 2, None), None);
        assert_eq!(d.insert_at(5, b"x", 9, None), None);
        assert_eq!(d.insert_at(20, b"y", 8, None), None);
        assert_eq!(
            d.insert_at(10, b"b", 4, None),
            Some(2),
            "a replace, not a second b"
        );
        assert_eq!(d.len(), 5);
        assert_eq!((d.get_at(10, b"a"), d.get_at(10, b"b")), (Some(1), Some(4)));
        assert_eq!(d.get_at(10, b"z"), None);
        let file = |_| InodeKind::File;
        // A page of 2 ends after x and the first of the group: the group is finished.
        let p = d.page(0, 2, file).expect("resident");
        assert_eq!(names(&p), [&b"x"[..], b"a", b"b", b"c"]);
        assert_eq!(
            p.iter().map(|e| e.cookie).collect::<Vec<_>>(),
            [5, 10, 10, 10]
        );
        assert_eq!(names(&d.page(10, 2, file).expect("resident")), [&b"y"[..]]);
        assert_eq!(d.remove_at(10, b"a", None), Some(1));
        assert_eq!(d.remove_at(10, b"a", None), None);
        assert_eq!(d.remove_at(10, b"c", None), Some(3));
        assert_eq!(d.by_hash.get(&10), Some(&Slot::one(b"b", None, 4, 0)));
        assert_eq!(
            d.remove_at(10, b"q", None),
            None,
            "another name of the same hash"
        );
        assert_eq!(d.remove_at(10, b"b", None), Some(4));
        assert_eq!(d.len(), 2);
        assert_eq!(
            names(&d.page(0, 10, file).expect("resident")),
            [&b"x"[..], b"y"]
        );
    }

    /// An entry keeps its inode's kind beside the name: a page reports it without
    /// asking; an entry whose kind is not known asks, until a load resolves it.
    #[test]
    fn kinds_are_kept_beside_names() {
        let mut d = Dir::new();
        d.insert_at(7, b"dir", 1, Some(InodeKind::Dir));
        d.insert_at(8, b"link", 2, Some(InodeKind::Symlink));
        d.insert_at(9, b"old", 3, None);
        let asked = std::cell::Cell::new(0);
        let ask = |_| {
            asked.set(asked.get() + 1);
            InodeKind::Fifo
        };
        let kinds: Vec<InodeKind> = d
            .page(0, 10, ask)
            .expect("resident")
            .iter()
            .map(|e| e.kind)
            .collect();
        assert_eq!(kinds, [InodeKind::Dir, InodeKind::Symlink, InodeKind::Fifo]);
        assert_eq!(asked.get(), 1, "only the entry without a kind asked");
        assert_eq!(d.entry_at(8, b"link"), Some((2, Some(InodeKind::Symlink))));
        d.resolve_kinds(|ino| (ino == 3).then_some(InodeKind::Socket));
        assert_eq!(d.entry_at(9, b"old"), Some((3, Some(InodeKind::Socket))));
        // A replace takes the new kind; names sharing a hash keep theirs.
        d.insert_at(7, b"dir", 4, Some(InodeKind::File));
        d.insert_at(7, b"other", 5, Some(InodeKind::Dir));
        assert_eq!(d.entry_at(7, b"dir"), Some((4, Some(InodeKind::File))));
        assert_eq!(d.entry_at(7, b"other"), Some((5, Some(InodeKind::Dir))));
        d.page(0, 10, |_| panic!("every kind is known"))
            .expect("resident");
    }

    /// A link's insert: an absent name goes in (into a shared slot too), a present one
    /// is refused with the directory unchanged.
    #[test]
    fn insert_new_refuses_a_present_name_and_changes_nothing() {
        let mut d = Dir::new();
        assert_eq!(
            d.insert_new_at(10, b"a", 1, Some(InodeKind::File), None),
            Ok(true)
        );
        assert_eq!(
            d.insert_new_at(10, b"a", 2, Some(InodeKind::Dir), None),
            Ok(false)
        );
        assert_eq!(d.entry_at(10, b"a"), Some((1, Some(InodeKind::File))));
        assert!(
            d.insert_new_at(10, b"b", 3, None, None) == Ok(true),
            "a collision joins the slot"
        );
        assert_eq!(d.insert_new_at(10, b"b", 4, None, None), Ok(false));
        assert_eq!((d.get_at(10, b"a"), d.get_at(10, b"b")), (Some(1), Some(3)));
        assert_eq!(d.len(), 2);
    }

    /// The cold set against a `BTreeSet`: runs appended and merged, groups read back
    /// (folded in once they pass a quarter of the array) and made cold again.
    #[test]
    fn the_cold_set_is_a_sorted_set() {
        let mut c = ColdSet::default();
        let mut model = std::collections::BTreeSet::new();
        let all: Vec<u64> = (0..20_000u64).map(|i| i * 7 + 3).collect();
        let (even, odd): (Vec<u64>, Vec<u64>) = all.iter().partition(|&&h| h % 2 == 0);
        c.extend_sorted(&even[..even.len() / 2]);
        c.extend_sorted(&even[even.len() / 2..]);
        c.extend_sorted(&odd);
        model.extend(all.iter().copied());
        let check = |c: &ColdSet, model: &std::collections::BTreeSet<u64>| {
            assert_eq!(
                c.range(0, u64::MAX).collect::<Vec<_>>(),
                model.iter().copied().collect::<Vec<_>>()
            );
            assert_eq!(
                (c.first(), c.last()),
                (model.first().copied(), model.last().copied())
            );
            assert_eq!(c.is_empty(), model.is_empty());
            assert_eq!(
                c.range(1000, 2000).collect::<Vec<_>>(),
                model.range(1000..=2000).copied().collect::<Vec<_>>()
            );
        };
        check(&c, &model);
        for (i, &h) in all.iter().enumerate() {
            if i % 3 == 0 {
                assert!(c.remove(h));
                assert!(!c.remove(h), "removed twice");
                model.remove(&h);
            }
        }
        assert!(
            c.revived.len() < all.len() / 3,
            "revived hashes were folded in"
        );
        check(&c, &model);
        let back: Vec<u64> = all.iter().copied().step_by(6).collect();
        c.extend_sorted(&back);
        model.extend(back.iter().copied());
        check(&c, &model);
        for &h in &all {
            assert_eq!(c.contains(h), model.contains(&h));
            assert!(!c.contains(h + 1));
        }
        // A load adds a directory's groups one at a time, in order.
        let mut one = ColdSet::default();
        for &h in &all {
            one.extend_sorted(&[h]);
        }
        assert!(all.iter().all(|&h| one.contains(h) && !one.contains(h + 1)));
        assert!(!one.contains(0));
    }

    /// An unlisted directory: a name's lookup reads back its hash alone; a removal
    /// keeps the hash known absent until the removal is durable (the durable root
    /// holds the name until then), then the tree is asked again; a read that finds
    /// nothing is remembered; a read of every hash lists the directory, counts and all.
    #[test]
    fn an_unlisted_directory_reads_back_by_hash_and_keeps_removals_absent() {
        let kind = Some(InodeKind::File);
        let entry = |name: &[u8], ino, kind| DirentRead {
            dir: 1,
            hash: name_hash(7, name),
            name: name.to_vec(),
            ino,
            kind,
        };
        let (ha, hb) = (name_hash(7, b"a"), name_hash(7, b"b"));
        let one = |h| Cold::range(h, h);
        let mut d = Dir::unlisted();
        assert_eq!(d.lookup_at(ha, b"a"), Err(one(ha)));
        assert_eq!(d.install_read(one(ha), &[entry(b"a", 5, kind)], &[]), Ok(1));
        assert_eq!(d.lookup_at(ha, b"a"), Ok(Some((5, kind))));
        assert_eq!(d.remove_at(ha, b"a", Some(3)), Some(5));
        d.shrink(2);
        assert_eq!(d.lookup_at(ha, b"a"), Ok(None), "known absent, not read");
        d.shrink(3);
        assert_eq!(d.lookup_at(ha, b"a"), Err(one(ha)), "the tree says so now");
        assert_eq!(d.install_read(one(ha), &[], &[]), Ok(1));
        assert_eq!(d.lookup_at(ha, b"a"), Ok(None));
        assert_eq!(d.insert_new_at(ha, b"a", 6, kind, Some(4)), Ok(true));
        assert_eq!(
            (d.listed(), d.all_resident(), d.subdirs()),
            (Err(ALL), Err(ALL), None)
        );
        // The durable root holds b (a directory), counted by the listing, and c,
        // whose kind it does not record, read whole (a group cold must say whether
        // it names a directory).
        let hc = name_hash(7, b"c");
        let counted = [GroupRead {
            dir: 1,
            hash: hb,
            names: 1,
            subdirs: 1,
        }];
        let whole = [entry(b"c", 10, None)];
        assert_eq!(
            d.install_read(ALL, &whole, &counted),
            Ok(1),
            "c came into memory"
        );
        assert_eq!(d.listed(), Ok(()));
        assert_eq!((d.len(), d.resident_len(), d.subdirs()), (3, 2, None));
        assert_eq!(d.lookup_at(hb, b"b"), Err(one(hb)), "listed cold");
        assert_eq!(d.lookup_at(hc, b"c"), Ok(Some((10, None))), "resident");
        // Another reader's listing, installed after: nothing to add.
        assert_eq!(d.install_read(ALL, &whole, &counted), Ok(0));
        assert_eq!(d.len(), 3);
        assert_eq!(
            d.lookup_at(ha, b"a"),
            Ok(Some((6, kind))),
            "memory is newer"
        );
    }

    /// A page of an unlisted directory past a run of removals not durable yet (an
    /// `rm -rf` in progress, in hash order) finds its next entry in O(log n) reads: a
    /// read one page long at a time took one read per page of removed names, past
    /// the operation's bound on reruns (`FAULT_RETRIES`) for a large directory.
    #[test]
    fn an_unlisted_page_past_a_run_of_removals_reads_o_log_n_times() {
        let n = 10_000u64;
        let kind = Some(InodeKind::File);
        // The durable tree: one name per hash.
        let tree: Vec<DirentRead> = (0..n)
            .map(|i| DirentRead {
                dir: 1,
                hash: FIRST_COOKIE + 10 * i,
                name: format!("f{i}").into_bytes(),
                ino: 100 + i,
                kind,
            })
            .collect();
        let read = |c: Cold| -> Vec<DirentRead> {
            let cap = c.max_groups.map_or(usize::MAX, |m| m.get() as usize);
            (tree.iter())
                .filter(|e| (c.from..=c.to).contains(&e.hash))
                .take(cap)
                .cloned()
                .collect()
        };
        let mut d = Dir::unlisted();
        // Every name but the last 10 removed, in hash order, none durable yet.
        for e in &tree[..(n - 10) as usize] {
            let asked = d.lookup_at(e.hash, &e.name).unwrap_err();
            d.install_read(asked, &read(asked), &[]).unwrap();
            assert_eq!(d.remove_at(e.hash, &e.name, Some(7)), Some(e.ino));
        }
        d.shrink(6);
        let mut reads = 0;
        let page = loop {
            match d.page(0, 1, |_| unreachable!()) {
                Ok(p) => break p,
                Err(c) => {
                    reads += 1;
                    assert!(reads < 64, "{reads} reads and no page yet");
                    d.install_read(c, &read(c), &[]).unwrap();
                }
            }
        };
        assert_eq!(page.len(), 1);
        assert_eq!(page[0].name, format!("f{}", n - 10).into_bytes());
        assert!(reads <= 20, "{reads} reads for {n} groups");
    }

    /// What a partial directory's caller does (`Meta::apply`, `Vol::faulting`): an
    /// operation that meets a cold group reads it back from the "durable tree" (the
    /// model as of the last checkpoint) and runs again.
    mod partial {
        use super::*;
        use proptest::prelude::*;

        #[derive(Clone, Debug)]
        enum Op {
            Insert(u8, u64),
            Remove(u8),
            Lookup(u8),
            /// A checkpoint closes a generation: the changes so far go out with it.
            Close,
            /// The last closed generation is durable; a shrink follows.
            Durable,
            /// A page of at most so many entries after a cookie: 0, a name's hash, or any.
            Page(PageAfter, usize),
            /// The directory leaves memory, if every change to it is durable, and is
            /// read back unlisted.
            Forget,
            /// Whether it holds any entry (rmdir's question).
            HasEntries,
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                4 => (any::<u8>(), 1..1000u64).prop_map(|(n, i)| Op::Insert(n, i)),
                2 => any::<u8>().prop_map(Op::Remove),
                2 => any::<u8>().prop_map(Op::Lookup),
                1 => Just(Op::Close),
                1 => Just(Op::Durable),
                1 => (page_after(), 1..20usize).prop_map(|(c, m)| Op::Page(c, m)),
                1 => Just(Op::Forget),
                1 => Just(Op::HasEntries),
            ]
        }

        #[derive(Clone, Copy, Debug)]
        enum PageAfter {
            Start,
            Name(u8),
            Cookie(u64),
        }

        fn page_after() -> impl Strategy<Value = PageAfter> {
            prop_oneof![
                Just(PageAfter::Start),
                any::<u8>().prop_map(PageAfter::Name),
                any::<u64>().prop_map(PageAfter::Cookie),
            ]
        }

        fn name(n: u8) -> Vec<u8> {
            format!("name-{n}").into_bytes()
        }

        /// A few hashes for 256 names: groups of several names are common here.
        fn hash(n: &[u8], buckets: u64) -> u64 {
            FIRST_COOKIE + name_hash(7, n) % buckets
        }

        struct Harness {
            d: Dir,
            model: BTreeMap<Vec<u8>, u64>,
            durable: BTreeMap<Vec<u8>, u64>,
            closed: Option<(BTreeMap<Vec<u8>, u64>, u64)>,
            changed_since_close: usize,
            gen: u64,
            buckets: u64,
            reads: usize,
            /// The ranges read back since the last operation began.
            asked: Vec<Cold>,
        }

        impl Harness {
            /// Read back the cold groups in `c` from the durable copy, as the tree
            /// holds them: in key order.
            fn read(&mut self, c: Cold) {
                self.reads += 1;
                self.asked.push(c);
                let mut found: Vec<DirentRead> = self
                    .durable
                    .iter()
                    .map(|(n, &i)| DirentRead {
                        dir: 1,
                        hash: hash(n, self.buckets),
                        name: n.clone(),
                        ino: i,
                        kind: Some(kind(i)),
                    })
                    .filter(|e| (c.from..=c.to).contains(&e.hash))
                    .collect();
                found.sort_by(|a, b| (a.hash, &a.name).cmp(&(b.hash, &b.name)));
                if let Some(cap) = c.max_groups {
                    let keep: usize = (found.chunk_by(|a, b| a.hash == b.hash))
                        .take(cap.get() as usize)
                        .map(|g| g.len())
                        .sum();
                    found.truncate(keep);
                }
                // A listing counts its groups, every kind being recorded here.
                let mut counted = Vec::new();
                if c == ALL {
                    for g in std::mem::take(&mut found).chunk_by(|a, b| a.hash == b.hash) {
                        counted.push(GroupRead {
                            dir: 1,
                            hash: g[0].hash,
                            names: g.len() as u32,
                            subdirs: g.iter().filter(|e| e.kind == Some(InodeKind::Dir)).count()
                                as u32,
                        });
                    }
                }
                let r = self.d.install_read(c, &found, &counted);
                assert!(r.is_ok(), "a cold group the durable copy lacks: {r:?}");
            }

            /// Run `f` until it meets no cold group, reading back what it met.
            fn run<R>(&mut self, mut f: impl FnMut(&mut Dir) -> Result<R, Cold>) -> R {
                for _ in 0..3 {
                    match f(&mut self.d) {
                        Ok(r) => return r,
                        Err(c) => self.read(c),
                    }
                }
                panic!("an operation met cold groups after reading them back");
            }
        }

        /// Odd inodes name directories: cold groups count them.
        fn kind(ino: u64) -> InodeKind {
            if ino % 2 == 1 {
                InodeKind::Dir
            } else {
                InodeKind::File
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]

            /// Against a map, with checkpoints sending clean groups cold between the
            /// operations: every answer, the count and the subdirectory count are the
            /// map's; a page of readdir lists the map's entries in order; nothing is
            /// read back for a name whose hash no group has.
            #[test]
            fn a_partial_dir_behaves_as_the_map(
                ops in prop::collection::vec(op(), 0..400),
                buckets in prop_oneof![Just(16u64), Just(1u64 << 40)],
            ) {
                let mut h = Harness {
                    d: Dir::new(),
                    model: BTreeMap::new(),
                    durable: BTreeMap::new(),
                    closed: None,
                    changed_since_close: 0,
                    gen: 1,
                    buckets,
                    reads: 0,
                    asked: Vec::new(),
                };
                for o in ops {
                    let unlisted = h.d.listed().is_err();
                    let page = matches!(o, Op::Page(..) | Op::HasEntries);
                    h.asked.clear();
                    match o {
                        Op::Insert(n, i) => {
                            let nm = name(n);
                            let hs = hash(&nm, buckets);
                            let gen = h.gen;
                            let reads = h.reads;
                            let cold_before = h.d.cold_in(Cold::range(hs, hs)).is_some();
                            let known = h.d.unlisted_part().is_some_and(|u| u.known_through(hs).is_some());
                            let fresh = h.run(|d| d.insert_new_at(hs, &nm, i, Some(kind(i)), Some(gen)));
                            prop_assert_eq!(fresh, !h.model.contains_key(&nm));
                            if !unlisted {
                                prop_assert_eq!(h.reads > reads, cold_before, "read only for a cold group");
                            }
                            if known {
                                prop_assert_eq!(h.reads, reads, "a hash in a range read whole");
                            }
                            if fresh {
                                h.model.insert(nm, i);
                                h.changed_since_close += 1;
                            }
                        }
                        Op::Remove(n) => {
                            let nm = name(n);
                            let hs = hash(&nm, buckets);
                            let gen = h.gen;
                            let found = h.run(|d| d.lookup_at(hs, &nm));
                            prop_assert_eq!(found.map(|e| e.0), h.model.get(&nm).copied());
                            if found.is_some() {
                                h.changed_since_close += 1;
                                prop_assert_eq!(h.d.remove_at(hs, &nm, Some(gen)), h.model.remove(&nm));
                            }
                        }
                        Op::Lookup(n) => {
                            let nm = name(n);
                            let hs = hash(&nm, buckets);
                            let found = h.run(|d| d.lookup_at(hs, &nm));
                            prop_assert_eq!(
                                found,
                                h.model.get(&nm).map(|&i| (i, Some(kind(i))))
                            );
                        }
                        Op::Close => {
                            h.closed = Some((h.model.clone(), h.gen));
                            h.changed_since_close = 0;
                            h.gen += 1;
                        }
                        Op::Durable => {
                            if let Some((image, gen)) = h.closed.take() {
                                h.durable = image;
                                h.d.shrink(gen);
                                if h.changed_since_close == 0 {
                                    prop_assert_eq!(h.d.resident_len(), 0, "all was durable");
                                }
                            }
                        }
                        Op::Forget => {
                            if h.closed.is_none() && h.changed_since_close == 0 {
                                prop_assert_eq!(&h.model, &h.durable);
                                h.d = Dir::unlisted();
                            }
                        }
                        Op::HasEntries => {
                            let any = h.run(|d| d.has_entries());
                            prop_assert_eq!(any, !h.model.is_empty());
                        }
                        Op::Page(after, max) => {
                            let cookie = match after {
                                PageAfter::Start => 0,
                                PageAfter::Name(n) => hash(&name(n), buckets),
                                PageAfter::Cookie(c) => c,
                            };
                            let page = h.run(|d| d.page(cookie, max, |_| unreachable!()));
                            let mut want: Vec<(u64, Vec<u8>, u64)> = h.model
                                .iter()
                                .map(|(n, &i)| (hash(n, buckets), n.clone(), i))
                                .filter(|e| e.0 > cookie)
                                .collect();
                            want.sort();
                            let got: Vec<(u64, Vec<u8>, u64)> =
                                page.iter().map(|e| (e.cookie, e.name.clone(), e.ino)).collect();
                            prop_assert!(got.len() >= max.min(want.len()));
                            prop_assert_eq!(&got[..], &want[..got.len()]);
                        }
                    }
                    if unlisted && !page {
                        // One name's operation reads back its own hash, nothing else:
                        // O(log n) in the tree, however large the directory.
                        prop_assert!(h.asked.iter().all(|c| c.from == c.to), "{:?}", h.asked);
                    }
                    if unlisted && page {
                        // A page reads its own groups, at most, and lists nothing.
                        prop_assert!(h.asked.iter().all(|c| c.max_groups.is_some()), "{:?}", h.asked);
                        prop_assert!(h.d.listed().is_err());
                    }
                    if h.d.listed().is_ok() {
                        prop_assert_eq!(h.d.len(), h.model.len());
                        let subdirs = h.model.values().filter(|&&i| kind(i) == InodeKind::Dir).count();
                        prop_assert_eq!(h.d.subdirs(), Some(subdirs as u32));
                    } else {
                        prop_assert_eq!(h.d.subdirs(), None);
                    }
                }
            }
        }
    }
}
