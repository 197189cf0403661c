//! An inode's extent map: file block → (device block, blocks), non-overlapping, adjacent
//! runs merged by the caller (`Meta::apply`).
//!
//! Most files hold one extent (a small file written in one go), and a `BTreeMap` spends a
//! 280-byte leaf node on its first entry: at a million small files that was a third of
//! the metadata's memory. So an empty map costs nothing, one extent is held inline, and
//! only a second one makes a tree. The API is the subset of `BTreeMap`'s the metadata
//! uses, with the same meaning.

use std::collections::btree_map;
use std::collections::BTreeMap;
use std::ops::RangeBounds;

/// One run of device blocks: where it starts and how many blocks it has.
pub type Run = (u64, u64);

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ExtentMap {
    #[default]
    Empty,
    One(u64, Run),
    /// Two or more extents (never fewer: removal demotes to `One`).
    Many(BTreeMap<u64, Run>),
}

impl ExtentMap {
    pub fn new() -> ExtentMap {
        ExtentMap::Empty
    }

    pub fn len(&self) -> usize {
        match self {
            ExtentMap::Empty => 0,
            ExtentMap::One(..) => 1,
            ExtentMap::Many(m) => m.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        matches!(self, ExtentMap::Empty)
    }

    pub fn get(&self, fb: &u64) -> Option<&Run> {
        match self {
            ExtentMap::Empty => None,
            ExtentMap::One(f, r) => (f == fb).then_some(r),
            ExtentMap::Many(m) => m.get(fb),
        }
    }

    /// Insert or replace the extent starting at file block `fb`; returns the old one.
    pub fn insert(&mut self, fb: u64, run: Run) -> Option<Run> {
        match self {
            ExtentMap::Empty => {
                *self = ExtentMap::One(fb, run);
                None
            }
            ExtentMap::One(f, r) if *f == fb => Some(std::mem::replace(r, run)),
            ExtentMap::One(f, r) => {
                let m = BTreeMap::from([(*f, *r), (fb, run)]);
                *self = ExtentMap::Many(m);
                None
            }
            ExtentMap::Many(m) => m.insert(fb, run),
        }
    }

    pub fn remove(&mut self, fb: &u64) -> Option<Run> {
        match self {
            ExtentMap::Empty => None,
            ExtentMap::One(f, r) if f == fb => {
                let r = *r;
                *self = ExtentMap::Empty;
                Some(r)
            }
            ExtentMap::One(..) => None,
            ExtentMap::Many(m) => {
                let r = m.remove(fb)?;
                if m.len() == 1 {
                    let (&f, &r) = m.iter().next().expect("one entry left");
                    *self = ExtentMap::One(f, r);
                }
                Some(r)
            }
        }
    }

    /// The extents starting in `range`, in file order.
    pub fn range<R: RangeBounds<u64>>(&self, range: R) -> Range<'_> {
        match self {
            ExtentMap::Empty => Range::One(None.into_iter()),
            ExtentMap::One(f, r) => Range::One(range.contains(f).then_some((f, r)).into_iter()),
            ExtentMap::Many(m) => Range::Many(m.range(range)),
        }
    }

    pub fn iter(&self) -> Range<'_> {
        self.range(..)
    }

    pub fn values(&self) -> impl DoubleEndedIterator<Item = &Run> {
        self.iter().map(|(_, r)| r)
    }
}

/// An iterator over some of an [`ExtentMap`]'s extents, in file order.
pub enum Range<'a> {
    One(std::option::IntoIter<(&'a u64, &'a Run)>),
    Many(btree_map::Range<'a, u64, Run>),
}

impl<'a> Iterator for Range<'a> {
    type Item = (&'a u64, &'a Run);
    fn next(&mut self) -> Option<Self::Item> {
        match self {
            Range::One(i) => i.next(),
            Range::Many(i) => i.next(),
        }
    }
}

impl DoubleEndedIterator for Range<'_> {
    fn next_back(&mut self) -> Option<Self::Item> {
        match self {
            Range::One(i) => i.next_back(),
            Range::Many(i) => i.next_back(),
        }
    }
}

impl<'a> IntoIterator for &'a ExtentMap {
    type Item = (&'a u64, &'a Run);
    type IntoIter = Range<'a>;
    fn into_iter(self) -> Range<'a> {
        self.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u64, Run),
        Remove(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u64..8, (0u64..100, 1u64..4)).prop_map(|(f, r)| Op::Insert(f, r)),
            (0u64..8).prop_map(Op::Remove),
        ]
    }

    proptest! {
        /// Every operation and query answers as a BTreeMap does, and the representation
        /// is always the smallest: no tree of fewer than two extents.
        #[test]
        fn behaves_as_a_btreemap(ops in proptest::collection::vec(op(), 0..60),
                                 lo in 0u64..8, hi in 0u64..9) {
            let mut m = ExtentMap::new();
            let mut model: BTreeMap<u64, Run> = BTreeMap::new();
            for o in ops {
                match o {
                    Op::Insert(f, r) => prop_assert_eq!(m.insert(f, r), model.insert(f, r)),
                    Op::Remove(f) => prop_assert_eq!(m.remove(&f), model.remove(&f)),
                }
                prop_assert_eq!(m.len(), model.len());
                prop_assert_eq!(m.is_empty(), model.is_empty());
                match &m {
                    ExtentMap::Empty => prop_assert!(model.is_empty()),
                    ExtentMap::One(..) => prop_assert_eq!(model.len(), 1),
                    ExtentMap::Many(t) => prop_assert!(t.len() >= 2),
                }
                for f in 0..8 {
                    prop_assert_eq!(m.get(&f), model.get(&f));
                }
                let (lo, hi) = (lo.min(hi), hi.max(lo));
                prop_assert!(m.range(lo..hi).eq(model.range(lo..hi)));
                prop_assert_eq!(m.range(..=lo).next_back(), model.range(..=lo).next_back());
                prop_assert!(m.iter().rev().eq(model.iter().rev()));
                prop_assert!(m.values().eq(model.values()));
            }
        }
    }
}
