//! The pages of one mapping by index (the kernel's `i_pages`).
//!
//! A cache full of small files holds one page per mapping: a B-tree for it would be a
//! leaf node of eleven slots (512 bytes here) around a 32-byte page, more than the
//! mapping itself. The first page is kept inline; the tree is made for a second one,
//! and given back when the mapping is down to one page again (as the xarray keeps a
//! lone entry at index 0 in its root without a node).

use std::collections::btree_map::{self, BTreeMap};
use std::ops::{Bound, RangeBounds};

#[derive(Debug, Default)]
pub(super) enum PageMap<P> {
    #[default]
    Empty,
    One(u64, P),
    Many(BTreeMap<u64, P>),
}

/// Entries of a `PageMap` in index order.
pub(super) enum Iter<'a, P> {
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

/// Entries of a `PageMap` in index order, mutable.
pub(super) enum IterMut<'a, P> {
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

impl<P> PageMap<P> {
    pub fn len(&self) -> usize {
        match self {
            PageMap::Empty => 0,
            PageMap::One(..) => 1,
            PageMap::Many(m) => m.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        matches!(self, PageMap::Empty)
    }

    pub fn get(&self, index: &u64) -> Option<&P> {
        match self {
            PageMap::One(k, p) if k == index => Some(p),
            PageMap::Many(m) => m.get(index),
            _ => None,
        }
    }

    pub fn get_mut(&mut self, index: &u64) -> Option<&mut P> {
        match self {
            PageMap::One(k, p) if k == index => Some(p),
            PageMap::Many(m) => m.get_mut(index),
            _ => None,
        }
    }

    /// Insert `page` at `index`, returning the page it replaced.
    pub fn insert(&mut self, index: u64, page: P) -> Option<P> {
        match std::mem::take(self) {
            PageMap::Empty => {
                *self = PageMap::One(index, page);
                None
            }
            PageMap::One(k, old) if k == index => {
                *self = PageMap::One(k, page);
                Some(old)
            }
            PageMap::One(k, other) => {
                *self = PageMap::Many(BTreeMap::from([(k, other), (index, page)]));
                None
            }
            PageMap::Many(mut m) => {
                let old = m.insert(index, page);
                *self = PageMap::Many(m);
                old
            }
        }
    }

    pub fn remove(&mut self, index: &u64) -> Option<P> {
        match std::mem::take(self) {
            PageMap::One(k, p) if k == *index => Some(p),
            PageMap::Many(mut m) => {
                let gone = m.remove(index);
                *self = match m.len() {
                    0 => PageMap::Empty,
                    1 => {
                        let (k, p) = m.pop_first().expect("a map of one entry");
                        PageMap::One(k, p)
                    }
                    _ => PageMap::Many(m),
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
            PageMap::Empty => Iter::One(None),
            PageMap::One(k, p) => Iter::One(r.contains(k).then_some((k, p))),
            PageMap::Many(m) => Iter::Many(m.range(bounds(&r))),
        }
    }

    pub fn range_mut(&mut self, r: impl RangeBounds<u64>) -> IterMut<'_, P> {
        match self {
            PageMap::Empty => IterMut::One(None),
            PageMap::One(k, p) => IterMut::One(r.contains(k).then_some((&*k, p))),
            PageMap::Many(m) => IterMut::Many(m.range_mut(bounds(&r))),
        }
    }

    pub fn iter(&self) -> Iter<'_, P> {
        self.range(..)
    }
}

impl<P> std::ops::Index<&u64> for PageMap<P> {
    type Output = P;
    fn index(&self, index: &u64) -> &P {
        self.get(index).expect("no page at this index")
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
        fn a_page_map_holds_what_a_btreemap_holds(ops in proptest::collection::vec(op(), 0..60)) {
            let mut map = PageMap::default();
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
                prop_assert_eq!(matches!(map, PageMap::Many(_)), model.len() > 1);
                let all: Vec<_> = map.iter().map(|(k, v)| (*k, *v)).collect();
                let want: Vec<_> = model.iter().map(|(k, v)| (*k, *v)).collect();
                prop_assert_eq!(all, want);
                for k in 0..6 {
                    prop_assert_eq!(map.get(&k), model.get(&k));
                    let from: Vec<_> = map.range(k..).map(|(k, _)| *k).collect();
                    let want: Vec<_> = model.range(k..).map(|(k, _)| *k).collect();
                    prop_assert_eq!(from, want);
                }
            }
        }
    }
}
