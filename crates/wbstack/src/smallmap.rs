//! A map by u64 index that holds a lone entry inline and makes a B-tree only for a
//! second one.
//!
//! The per-inode maps of a volume of small files hold one entry each: a mapping's
//! pages (the kernel's `i_pages`: one page), an inode's writes in flight (one extent).
//! A BTreeMap for one entry is a leaf node of eleven slots, 300-500 bytes around a
//! value of 16-32, more than the mapping itself; at a million small files these leaves
//! were a tenth of the heap. The tree is given back when the map is down to one entry
//! again (as the xarray keeps a lone entry at index 0 in its root without a node).

use std::collections::btree_map::{self, BTreeMap};
use std::ops::{Bound, RangeBounds};

#[derive(Debug, Default, Clone)]
pub enum SmallMap<P> {
    #[default]
    Empty,
    One(u64, P),
    Many(BTreeMap<u64, P>),
}

/// Entries of a `SmallMap` in index order.
pub enum Iter<'a, P> {
    One(Option<(&'a u64, &'a P)>),
    Many(btree_map::Range<'a, u64, P>),
}

impl<'a, P> Iterator for Iter<'a, P> {
    type Item = (&'a u64, &'a P);
    fn next(&mut self) -> Option<Self::Item> {
        match self {
            Iter::One(e) => e.take(),
            Iter::Many(r) => r.next(),
        }
    }
}

impl<P> DoubleEndedIterator for Iter<'_, P> {
    fn next_back(&mut self) -> Option<Self::Item> {
        match self {
            Iter::One(e) => e.take(),
            Iter::Many(r) => r.next_back(),
        }
    }
}

/// Entries of a `SmallMap` in index order, mutable.
pub enum IterMut<'a, P> {
    One(Option<(&'a u64, &'a mut P)>),
    Many(btree_map::RangeMut<'a, u64, P>),
}

impl<'a, P> Iterator for IterMut<'a, P> {
    type Item = (&'a u64, &'a mut P);
    fn next(&mut self) -> Option<Self::Item> {
        match self {
            IterMut::One(e) => e.take(),
            IterMut::Many(r) => r.next(),
        }
    }
}

/// `range` as owned bounds, so the same bounds can be tested and handed to the tree.
fn bounds(r: &impl RangeBounds<u64>) -> (Bound<u64>, Bound<u64>) {
    (r.start_bound().cloned(), r.end_bound().cloned())
}

impl<P> SmallMap<P> {
    pub fn len(&self) -> usize {
        match self {
            SmallMap::Empty => 0,
            SmallMap::One(..) => 1,
            SmallMap::Many(m) => m.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        matches!(self, SmallMap::Empty)
    }

    pub fn get(&self, index: &u64) -> Option<&P> {
        match self {
            SmallMap::One(k, p) if k == index => Some(p),
            SmallMap::Many(m) => m.get(index),
            _ => None,
        }
    }

    pub fn get_mut(&mut self, index: &u64) -> Option<&mut P> {
        match self {
            SmallMap::One(k, p) if k == index => Some(p),
            SmallMap::Many(m) => m.get_mut(index),
            _ => None,
        }
    }

    /// Insert `page` at `index`, returning the page it replaced.
    pub fn insert(&mut self, index: u64, value: P) -> Option<P> {
        match std::mem::take(self) {
            SmallMap::Empty => {
                *self = SmallMap::One(index, value);
                None
            }
            SmallMap::One(k, old) if k == index => {
                *self = SmallMap::One(k, value);
                Some(old)
            }
            SmallMap::One(k, other) => {
                *self = SmallMap::Many(BTreeMap::from([(k, other), (index, value)]));
                None
            }
            SmallMap::Many(mut m) => {
                let old = m.insert(index, value);
                *self = SmallMap::Many(m);
                old
            }
        }
    }

    pub fn remove(&mut self, index: &u64) -> Option<P> {
        match std::mem::take(self) {
            SmallMap::One(k, p) if k == *index => Some(p),
            SmallMap::Many(mut m) => {
                let gone = m.remove(index);
                *self = match m.len() {
                    0 => SmallMap::Empty,
                    1 => {
                        let (k, p) = m.pop_first().expect("a map of one entry");
                        SmallMap::One(k, p)
                    }
                    _ => SmallMap::Many(m),
                };
                gone
            }
            other => {
                *self = other;
                None
            }
        }
    }

    pub fn range(&self, r: impl RangeBounds<u64>) -> Iter<'_, P> {
        match self {
            SmallMap::Empty => Iter::One(None),
            SmallMap::One(k, p) => Iter::One(r.contains(k).then_some((k, p))),
            SmallMap::Many(m) => Iter::Many(m.range(bounds(&r))),
        }
    }

    pub fn range_mut(&mut self, r: impl RangeBounds<u64>) -> IterMut<'_, P> {
        match self {
            SmallMap::Empty => IterMut::One(None),
            SmallMap::One(k, p) => IterMut::One(r.contains(k).then_some((&*k, p))),
            SmallMap::Many(m) => IterMut::Many(m.range_mut(bounds(&r))),
        }
    }

    pub fn iter(&self) -> Iter<'_, P> {
        self.range(..)
    }

    pub fn values(&self) -> impl DoubleEndedIterator<Item = &P> {
        self.iter().map(|(_, v)| v)
    }
}

/// Entries of a `SmallMap` in index order, by value.
pub enum IntoIter<P> {
    One(Option<(u64, P)>),
    Many(btree_map::IntoIter<u64, P>),
}

impl<P> Iterator for IntoIter<P> {
    type Item = (u64, P);
    fn next(&mut self) -> Option<Self::Item> {
        match self {
            IntoIter::One(e) => e.take(),
            IntoIter::Many(r) => r.next(),
        }
    }
}

impl<P> IntoIterator for SmallMap<P> {
    type Item = (u64, P);
    type IntoIter = IntoIter<P>;
    fn into_iter(self) -> IntoIter<P> {
        match self {
            SmallMap::Empty => IntoIter::One(None),
            SmallMap::One(k, p) => IntoIter::One(Some((k, p))),
            SmallMap::Many(m) => IntoIter::Many(m.into_iter()),
        }
    }
}

impl<P> std::ops::Index<&u64> for SmallMap<P> {
    type Output = P;
    fn index(&self, index: &u64) -> &P {
        self.get(index).expect("no page at this index")
    }
}

/// A set of u64 indexes on a `SmallMap`: a lone index inline. An inode's delayed-
/// allocation reservations are one page for a small file, and a BTreeSet's leaf for it
/// was a hundred bytes of heap per dirty file, and an allocation per create.
#[derive(Debug, Default, Clone)]
pub struct SmallSet(SmallMap<()>);

impl SmallSet {
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn contains(&self, index: &u64) -> bool {
        self.0.get(index).is_some()
    }

    /// True if `index` was not in the set.
    pub fn insert(&mut self, index: u64) -> bool {
        self.0.insert(index, ()).is_none()
    }

    /// True if `index` was in the set.
    pub fn remove(&mut self, index: &u64) -> bool {
        self.0.remove(index).is_some()
    }

    /// The indexes in `r`, in order.
    pub fn range(&self, r: impl RangeBounds<u64>) -> impl DoubleEndedIterator<Item = u64> + '_ {
        self.0.range(r).map(|(k, _)| *k)
    }

    pub fn iter(&self) -> impl DoubleEndedIterator<Item = u64> + '_ {
        self.range(..)
    }
}

impl Extend<u64> for SmallSet {
    fn extend<I: IntoIterator<Item = u64>>(&mut self, iter: I) {
        for i in iter {
            self.insert(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64, u32),
        Remove(u64),
        Bump(u64),
        BumpRange(u64, u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few indexes, so inserts meet existing entries and maps shrink back to one.
        prop_oneof![
            (0u64..6, any::<u32>()).prop_map(|(k, v)| Op::Insert(k, v)),
            (0u64..6).prop_map(Op::Remove),
            (0u64..6).prop_map(Op::Bump),
            (0u64..6, 0u64..6).prop_map(|(a, b)| Op::BumpRange(a.min(b), a.max(b))),
        ]
    }

    proptest! {
        #[test]
        fn a_small_map_holds_what_a_btreemap_holds(ops in proptest::collection::vec(op(), 0..60)) {
            let mut map = SmallMap::default();
            let mut model = BTreeMap::new();
            for o in ops {
                match o {
                    Op::Insert(k, v) => prop_assert_eq!(map.insert(k, v), model.insert(k, v)),
                    Op::Remove(k) => prop_assert_eq!(map.remove(&k), model.remove(&k)),
                    Op::Bump(k) => {
                        if let Some(v) = map.get_mut(&k) {
                            *v = v.wrapping_add(1);
                        }
                        if let Some(v) = model.get_mut(&k) {
                            *v = v.wrapping_add(1);
                        }
                    }
                    Op::BumpRange(a, b) => {
                        map.range_mut(a..=b).for_each(|(_, v)| *v = v.wrapping_add(7));
                        model.range_mut(a..=b).for_each(|(_, v)| *v = v.wrapping_add(7));
                    }
                }
                prop_assert_eq!(map.len(), model.len());
                prop_assert_eq!(map.is_empty(), model.is_empty());
                // One entry is held inline, never in a tree.
                prop_assert_eq!(matches!(map, SmallMap::Many(_)), model.len() > 1);
                let all: Vec<_> = map.iter().map(|(k, v)| (*k, *v)).collect();
                let want: Vec<_> = model.iter().map(|(k, v)| (*k, *v)).collect();
                prop_assert_eq!(all, want);
                let owned: Vec<_> = map.clone().into_iter().collect();
                let want: Vec<_> = model.clone().into_iter().collect();
                prop_assert_eq!(owned, want);
                for k in 0..6 {
                    prop_assert_eq!(map.get(&k), model.get(&k));
                    let from: Vec<_> = map.range(k..).map(|(k, _)| *k).collect();
                    let want: Vec<_> = model.range(k..).map(|(k, _)| *k).collect();
                    prop_assert_eq!(from, want);
                    prop_assert_eq!(map.range(..=k).next_back(), model.range(..=k).next_back());
                }
            }
        }
    }
}
