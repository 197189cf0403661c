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

use super::format::InodeKind;
use std::collections::BTreeMap;
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
enum Slot {
    One((Name, u64)),
    /// Two or more, sorted by name.
    Many(Vec<(Name, u64)>),
}

impl Slot {
    fn entries(&self) -> &[(Name, u64)] {
        match self {
            Slot::One(e) => std::slice::from_ref(e),
            Slot::Many(v) => v.as_slice(),
        }
    }

    fn entries_mut(&mut self) -> &mut [(Name, u64)] {
        match self {
            Slot::One(e) => std::slice::from_mut(e),
            Slot::Many(v) => v.as_mut_slice(),
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
    by_hash: BTreeMap<u64, Slot>,
    len: usize,
}

impl Dir {
    pub fn new() -> Dir {
        Dir::default()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The inode `name` names, under the volume's hash seed `seed`.
    pub fn get(&self, seed: u64, name: &[u8]) -> Option<u64> {
        self.get_at(name_hash(seed, name), name)
    }

    /// `get` with the name's hash known.
    pub(super) fn get_at(&self, h: u64, name: &[u8]) -> Option<u64> {
        self.entry_at(h, name).map(|e| e.0)
    }

    /// The inode `name` (whose hash is `h`) names, and its kind if known.
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
            self.by_hash
                .insert(h, Slot::One((Name::new(name, kind), ino)));
            self.len += 1;
            return None;
        };
        let v = match slot {
            Slot::One((n, old)) if n.bytes() == name => {
                n.set_kind(kind);
                return Some(std::mem::replace(old, ino));
            }
            Slot::One((n, old)) => {
                let first = (std::mem::replace(n, Name::new(&[], None)), *old);
                *slot = Slot::Many(vec![first]);
                let Slot::Many(v) = slot else { unreachable!() };
                v
            }
            Slot::Many(v) => v,
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
    /// with nothing changed, if it is there already.
    pub(super) fn insert_new_at(
        &mut self,
        h: u64,
        name: &[u8],
        ino: u64,
        kind: Option<InodeKind>,
    ) -> bool {
        debug_assert!(
            h >= FIRST_COOKIE,
            "a name's hash {h} below the first cookie"
        );
        let slot = match self.by_hash.entry(h) {
            std::collections::btree_map::Entry::Vacant(v) => {
                v.insert(Slot::One((Name::new(name, kind), ino)));
                self.len += 1;
                return true;
            }
            std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
        };
        if slot.entries().iter().any(|(n, _)| n.bytes() == name) {
            return false;
        }
        // A collision: the shared slot takes it, as `insert_at` places it.
        let replaced = self.insert_at(h, name, ino, kind);
        debug_assert!(replaced.is_none(), "{name:?} was absent from its slot");
        true
    }

    /// Remove `name`; the inode it named, if any.
    pub fn remove(&mut self, seed: u64, name: &[u8]) -> Option<u64> {
        self.remove_at(name_hash(seed, name), name)
    }

    /// `remove` with the name's hash known.
    pub(super) fn remove_at(&mut self, h: u64, name: &[u8]) -> Option<u64> {
        let slot = self.by_hash.get_mut(&h)?;
        let ino = match slot {
            Slot::One((n, ino)) => {
                if n.bytes() != name {
                    return None;
                }
                let ino = *ino;
                self.by_hash.remove(&h);
                ino
            }
            Slot::Many(v) => {
                let i = v.iter().position(|(n, _)| n.bytes() == name)?;
                let (_, ino) = v.remove(i);
                debug_assert!(!v.is_empty(), "a shared slot of one name");
                if v.len() == 1 {
                    let last = v.pop().expect("one left");
                    *slot = Slot::One(last);
                }
                ino
            }
        };
        self.len -= 1;
        Some(ino)
    }

    /// Every entry, in cookie order.
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
    /// from `kind_of`.
    pub fn page(
        &self,
        cookie: u64,
        max: usize,
        kind_of: impl Fn(u64) -> InodeKind,
    ) -> Vec<DirPageEntry> {
        let mut out: Vec<DirPageEntry> = Vec::new();
        for (c, name, ino, kind) in self.iter_after(cookie) {
            if out.len() >= max && out.last().is_none_or(|l| l.cookie != c) {
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
        let p = d.page(0, 2, file);
        assert_eq!(names(&p), [&b"x"[..], b"a", b"b", b"c"]);
        assert_eq!(
            p.iter().map(|e| e.cookie).collect::<Vec<_>>(),
            [5, 10, 10, 10]
        );
        assert_eq!(names(&d.page(10, 2, file)), [&b"y"[..]]);
        assert_eq!(d.remove_at(10, b"a"), Some(1));
        assert_eq!(d.remove_at(10, b"a"), None);
        assert_eq!(d.remove_at(10, b"c"), Some(3));
        assert_eq!(
            d.by_hash.get(&10),
            Some(&Slot::One((Name::new(b"b", None), 4)))
        );
        assert_eq!(d.remove_at(10, b"q"), None, "another name of the same hash");
        assert_eq!(d.remove_at(10, b"b"), Some(4));
        assert_eq!(d.len(), 2);
        assert_eq!(names(&d.page(0, 10, file)), [&b"x"[..], b"y"]);
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
        let kinds: Vec<InodeKind> = d.page(0, 10, ask).iter().map(|e| e.kind).collect();
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
        d.page(0, 10, |_| panic!("every kind is known"));
    }

    /// A link's insert: an absent name goes in (into a shared slot too), a present one
    /// is refused with the directory unchanged.
    #[test]
    fn insert_new_refuses_a_present_name_and_changes_nothing() {
        let mut d = Dir::new();
        assert!(d.insert_new_at(10, b"a", 1, Some(InodeKind::File)));
        assert!(!d.insert_new_at(10, b"a", 2, Some(InodeKind::Dir)));
        assert_eq!(d.entry_at(10, b"a"), Some((1, Some(InodeKind::File))));
        assert!(
            d.insert_new_at(10, b"b", 3, None),
            "a collision joins the slot"
        );
        assert!(!d.insert_new_at(10, b"b", 4, None));
        assert_eq!((d.get_at(10, b"a"), d.get_at(10, b"b")), (Some(1), Some(3)));
        assert_eq!(d.len(), 2);
    }
}
