//! A leaf's entries in memory, packed: every key and value in one buffer and a small
//! slot per entry, sorted by key. A tree checkpoint decodes, changes and re-encodes
//! thousands of leaves; an entry as two heap vectors cost two allocations and about
//! 100 bytes beyond its own, and every insert re-summed the leaf's size to decide on a
//! split. Here a decode is one copy, an insert moves 8-byte slots, and the size is
//! kept as entries come and go.

/// Where one entry's key and value lie in the buffer (the value follows the key).
#[derive(Clone, Copy, Debug)]
struct Slot {
    off: u32,
    klen: u16,
    vlen: u16,
}

impl Slot {
    fn len(&self) -> usize {
        usize::from(self.klen) + usize::from(self.vlen)
    }
}

#[derive(Clone, Debug, Default)]
pub struct Leaf {
    buf: Vec<u8>,
    slots: Vec<Slot>,
    /// Bytes of keys and values the slots refer to (the rest of `buf` is dead: left by
    /// removed or replaced entries, dropped when it outgrows the live bytes).
    live: usize,
}

impl Leaf {
    pub fn new() -> Leaf {
        Leaf::default()
    }

    /// A leaf of these entries, which must be in strictly increasing key order.
    pub fn from_sorted<'a>(entries: impl IntoIterator<Item = (&'a [u8], &'a [u8])>) -> Leaf {
        let mut l = Leaf::new();
        for (k, v) in entries {
            debug_assert!(
                l.slots.is_empty() || l.key(l.len() - 1) < k,
                "leaf entries out of order"
            );
            l.push(k, v);
        }
        l
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Bytes of the keys and values (what the entries encode to, less their headers).
    pub fn payload_bytes(&self) -> usize {
        self.live
    }

    pub fn key(&self, i: usize) -> &[u8] {
        self.key_of(self.slots[i])
    }

    fn key_of(&self, s: Slot) -> &[u8] {
        &self.buf[s.off as usize..s.off as usize + usize::from(s.klen)]
    }

    pub fn value(&self, i: usize) -> &[u8] {
        let s = self.slots[i];
        let at = s.off as usize + usize::from(s.klen);
        &self.buf[at..at + usize::from(s.vlen)]
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&[u8], &[u8])> + '_ {
        (0..self.len()).map(|i| (self.key(i), self.value(i)))
    }

    /// Where `key` is (Ok) or would go (Err), as `slice::binary_search`.
    pub fn search(&self, key: &[u8]) -> Result<usize, usize> {
        self.slots.binary_search_by(|&s| self.key_of(s).cmp(key))
    }

    /// The bytes of a key and value, appended; the slot that refers to them.
    fn append_bytes(&mut self, key: &[u8], value: &[u8]) -> Slot {
        // An entry is at most a node's size (the tree checks against `max_entry`), and
        // a leaf's buffer at most about twice its live bytes, so offsets fit in u32.
        let off = u32::try_from(self.buf.len()).expect("a leaf buffer past 4 GiB");
        self.buf.extend_from_slice(key);
        self.buf.extend_from_slice(value);
        self.live += key.len() + value.len();
        Slot {
            off,
            klen: u16::try_from(key.len()).expect("a key past 64 KiB"),
            vlen: u16::try_from(value.len()).expect("a value past 64 KiB"),
        }
    }

    fn push(&mut self, key: &[u8], value: &[u8]) {
        let s = self.append_bytes(key, value);
        self.slots.push(s);
    }

    /// Add an entry at the end if its key is above every key here (a decoder's step);
    /// false, and nothing added, if not.
    pub fn push_above(&mut self, key: &[u8], value: &[u8]) -> bool {
        if !self.is_empty() && self.key(self.len() - 1) >= key {
            return false;
        }
        self.push(key, value);
        true
    }

    /// An empty leaf with room for `entries` entries of `bytes` key and value bytes.
    pub fn with_capacity(entries: usize, bytes: usize) -> Leaf {
        Leaf {
            buf: Vec::with_capacity(bytes),
            slots: Vec::with_capacity(entries),
            live: 0,
        }
    }

    /// Insert at `i` (from `search`'s Err).
    pub fn insert(&mut self, i: usize, key: &[u8], value: &[u8]) {
        debug_assert!(self.search(key) == Err(i), "a leaf insert out of place");
        let s = self.append_bytes(key, value);
        self.slots.insert(i, s);
    }

    /// Replace entry `i`'s value; the old one.
    pub fn set_value(&mut self, i: usize, value: &[u8]) -> Vec<u8> {
        let old = self.value(i).to_vec();
        let s = self.slots[i];
        if usize::from(s.vlen) == value.len() {
            let at = s.off as usize + usize::from(s.klen);
            self.buf[at..at + value.len()].copy_from_slice(value);
        } else {
            let key = self.key(i).to_vec();
            self.live -= s.len();
            self.slots[i] = self.append_bytes(&key, value);
            self.compact_if_sparse();
        }
        old
    }

    /// Remove entry `i`; its value.
    pub fn remove(&mut self, i: usize) -> Vec<u8> {
        let old = self.value(i).to_vec();
        let s = self.slots.remove(i);
        self.live -= s.len();
        self.compact_if_sparse();
        old
    }

    /// Entries `at..` as a leaf of their own.
    pub fn split_off(&mut self, at: usize) -> Leaf {
        let right = Leaf::from_sorted((at..self.len()).map(|i| (self.key(i), self.value(i))));
        self.slots.truncate(at);
        self.live -= right.live;
        self.compact_if_sparse();
        right
    }

    /// Move every entry of `other` (all above this leaf's keys) to the end.
    pub fn append(&mut self, other: &mut Leaf) {
        debug_assert!(
            self.is_empty() || other.is_empty() || self.key(self.len() - 1) < other.key(0),
            "appending a leaf whose keys are not above"
        );
        for (k, v) in other.iter() {
            self.push(k, v);
        }
        *other = Leaf::new();
    }

    /// Drop dead bytes once they outweigh the live ones (so the buffer stays within
    /// about twice what the entries hold).
    fn compact_if_sparse(&mut self) {
        let dead = self.buf.len() - self.live;
        if dead <= self.live.max(256) {
            return;
        }
        let mut buf = Vec::with_capacity(self.live);
        for s in &mut self.slots {
            let at = s.off as usize;
            let off = u32::try_from(buf.len()).expect("within the old buffer");
            buf.extend_from_slice(&self.buf[at..at + s.len()]);
            s.off = off;
        }
        self.buf = buf;
        debug_assert_eq!(self.buf.len(), self.live);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Against a map, through inserts, replaces of every size, removes, splits and
    /// appends, with compaction along the way.
    #[test]
    fn a_leaf_is_a_sorted_map() {
        let mut l = Leaf::new();
        let mut m: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
        let mut x: u64 = 7;
        for step in 0..5000u64 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let k = format!("k{:03}", (x >> 33) % 300).into_bytes();
            let v = vec![step as u8; ((x >> 20) % 40) as usize];
            match (x >> 60) % 4 {
                0 | 1 => match l.search(&k) {
                    Ok(i) => assert_eq!(Some(l.set_value(i, &v)), m.insert(k, v)),
                    Err(i) => {
                        l.insert(i, &k, &v);
                        assert_eq!(m.insert(k, v), None);
                    }
                },
                2 => match l.search(&k) {
                    Ok(i) => assert_eq!(Some(l.remove(i)), m.remove(&k)),
                    Err(_) => assert_eq!(m.remove(&k), None),
                },
                _ if l.len() > 2 => {
                    let at = l.len() / 2;
                    let mut r = l.split_off(at);
                    assert_eq!(l.len() + r.len(), m.len());
                    l.append(&mut r);
                    assert!(r.is_empty());
                }
                _ => {}
            }
            let got: Vec<(Vec<u8>, Vec<u8>)> =
                l.iter().map(|(k, v)| (k.to_vec(), v.to_vec())).collect();
            let want: Vec<(Vec<u8>, Vec<u8>)> = m.clone().into_iter().collect();
            assert_eq!(got, want, "step {step}");
            assert_eq!(
                l.payload_bytes(),
                want.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>()
            );
            assert!(l.buf.len() <= 2 * l.live.max(256) + 80, "a sparse buffer");
        }
    }
}
