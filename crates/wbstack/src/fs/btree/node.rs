//! One node of the metadata B+tree as it is on disk, and its total decoder.
//!
//! Layout, little-endian, `node_size` bytes (one allocator block in the filesystem):
//! magic u32, crc32c u32 (of every byte after it), fs_id u64, seq u64 (the checkpoint
//! that wrote it), self_block u64, level u8 (0: a leaf), nkeys u16; then the entries:
//! a leaf's `klen u16, vlen u16, key, value`, an inner node's `klen u16, key, child`
//! (block u64, crc u32, seq u64); zeros to the end. An inner node's first key is empty:
//! its first child holds everything below the second key.
//!
//! The parent keeps each child's block, CRC and seq, so a lost, misdirected or stale
//! write of a node is caught when it is read, as btrfs's generation and checksum in a
//! block pointer catch it.

use super::leaf::Leaf;
use super::TreeError;
use crate::fs::format::{crc, FormatError};

pub const NODE_MAGIC: u32 = 0x444e_4257; // "WBND"
/// Bytes before the entries.
pub const HEADER: usize = 4 + 4 + 8 + 8 + 8 + 1 + 2;
/// A child pointer's bytes: block, crc, seq.
pub const CHILD_PTR: usize = 8 + 4 + 8;
const LEAF_SLOT: usize = 2 + 2;
const INNER_SLOT: usize = 2 + CHILD_PTR;
/// Levels above the leaves a tree may have: a bound on any descent, however the
/// pointers on disk are corrupted (levels strictly fall on the way down, so a cycle
/// cannot loop either).
pub const MAX_LEVEL: u8 = 16;

/// Where a node lives and what it must be when read back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChildPtr {
    pub block: u64,
    pub crc: u32,
    pub seq: u64,
}

/// A child of an inner node: on disk, or changed in memory since the tree was last
/// written (copy-on-write: a changed node is written to a new block).
#[derive(Debug)]
pub enum Link {
    Clean(ChildPtr),
    Dirty(Box<Node>),
}

#[derive(Debug)]
pub enum Entries {
    Leaf(Leaf),
    Inner(Vec<(Vec<u8>, Link)>),
}

#[derive(Debug)]
pub struct Node {
    pub level: u8,
    pub entries: Entries,
}

/// The largest key plus value one leaf entry may hold (and the largest key an inner
/// node holds): at least four fit a node, so a split always leaves two.
pub fn max_entry(node_size: usize) -> usize {
    (node_size - HEADER) / 4 - INNER_SLOT
}

impl Node {
    pub fn len(&self) -> usize {
        match &self.entries {
            Entries::Leaf(e) => e.len(),
            Entries::Inner(e) => e.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes it encodes to, before padding.
    pub fn encoded_len(&self) -> usize {
        HEADER
            + match &self.entries {
                Entries::Leaf(e) => LEAF_SLOT * e.len() + e.payload_bytes(),
                Entries::Inner(e) => e.iter().map(|(k, _)| INNER_SLOT + k.len()).sum(),
            }
    }

    /// The node's bytes; every child must be clean (written first). A node over
    /// `node_size`, or with a child in memory, is the tree's own bug: an error, never
    /// bytes cut short (or missing an entry) under a checksum that covers them, which
    /// would make the durable tree undecodable.
    pub fn encode(
        &self,
        fs_id: u64,
        seq: u64,
        block: u64,
        node_size: usize,
    ) -> Result<Vec<u8>, TreeError> {
        let len_bytes = self.encoded_len();
        if len_bytes > node_size {
            debug_assert!(
                false,
                "a node of {len_bytes} bytes, over its size {node_size}"
            );
            return Err(TreeError::Invariant(format!(
                "a level {} node of {len_bytes} bytes, over the node size {node_size}",
                self.level
            )));
        }
        let mut b = Vec::with_capacity(node_size);
        b.extend_from_slice(&NODE_MAGIC.to_le_bytes());
        b.extend_from_slice(&[0; 4]);
        b.extend_from_slice(&fs_id.to_le_bytes());
        b.extend_from_slice(&seq.to_le_bytes());
        b.extend_from_slice(&block.to_le_bytes());
        b.push(self.level);
        b.extend_from_slice(&(self.len() as u16).to_le_bytes());
        match &self.entries {
            Entries::Leaf(e) => {
                for (k, v) in e.iter() {
                    b.extend_from_slice(&(k.len() as u16).to_le_bytes());
                    b.extend_from_slice(&(v.len() as u16).to_le_bytes());
                    b.extend_from_slice(k);
                    b.extend_from_slice(v);
                }
            }
            Entries::Inner(e) => {
                for (k, l) in e {
                    let Link::Clean(p) = l else {
                        debug_assert!(false, "encoding a node with a dirty child");
                        return Err(TreeError::Invariant(format!(
                            "a level {} node encoded before its child {k:02x?}",
                            self.level
                        )));
                    };
                    b.extend_from_slice(&(k.len() as u16).to_le_bytes());
                    b.extend_from_slice(k);
                    b.extend_from_slice(&p.block.to_le_bytes());
                    b.extend_from_slice(&p.crc.to_le_bytes());
                    b.extend_from_slice(&p.seq.to_le_bytes());
                }
            }
        }
        b.resize(node_size, 0);
        let c = crc(&b[8..]);
        b[4..8].copy_from_slice(&c.to_le_bytes());
        Ok(b)
    }

    /// The node `expect` points at, at `level`, from its `node_size` bytes. Total: any
    /// bytes give a node or an error naming what is wrong.
    pub fn decode(
        buf: &[u8],
        fs_id: u64,
        expect: &ChildPtr,
        level: u8,
    ) -> Result<Node, FormatError> {
        let bad =
            |m: String| FormatError::Corrupt(format!("tree node at block {}: {m}", expect.block));
        if buf.len() < HEADER {
            return Err(bad(format!("{} bytes, shorter than a header", buf.len())));
        }
        let mut r = Cursor { buf, pos: 0 };
        let magic = r.u32();
        if magic != NODE_MAGIC {
            return Err(bad(format!("magic {magic:#010x}, not a tree node")));
        }
        let stored = r.u32();
        let computed = crc(&buf[8..]);
        if stored != computed {
            return Err(FormatError::Checksum {
                what: "tree node",
                stored,
                computed,
            });
        }
        if stored != expect.crc {
            return Err(bad(format!(
                "checksum {stored:#010x}, its parent expects {:#010x} (a lost or stale write)",
                expect.crc
            )));
        }
        let id = r.u64();
        if id != fs_id {
            return Err(bad(format!("belongs to another filesystem ({id:#x})")));
        }
        let seq = r.u64();
        if seq != expect.seq {
            return Err(bad(format!(
                "written by checkpoint {seq}, its parent expects {}",
                expect.seq
            )));
        }
        let at = r.u64();
        if at != expect.block {
            return Err(bad(format!(
                "says it lives at block {at} (a misdirected write)"
            )));
        }
        let lvl = r.u8();
        if lvl != level {
            return Err(bad(format!("level {lvl}, its parent expects {level}")));
        }
        let n = r.u16() as usize;
        if n == 0 {
            return Err(bad("no entries".into()));
        }
        let entries = if level == 0 {
            let mut e = Leaf::with_capacity(n.min(buf.len() / LEAF_SLOT), buf.len() - HEADER);
            for i in 0..n {
                let (kl, vl) = match (r.try_u16(), r.try_u16()) {
                    (Some(k), Some(v)) => (k as usize, v as usize),
                    _ => return Err(bad(format!("entry {i} of {n} runs past the node"))),
                };
                let (Some(k), Some(v)) = (r.take(kl), r.take(vl)) else {
                    return Err(bad(format!("entry {i} of {n} runs past the node")));
                };
                if !e.push_above(k, v) {
                    return Err(bad(format!("key {i} is not above the one before it")));
                }
            }
            Entries::Leaf(e)
        } else {
            let mut e: Vec<(Vec<u8>, Link)> = Vec::with_capacity(n.min(buf.len() / INNER_SLOT));
            for i in 0..n {
                let Some(kl) = r.try_u16() else {
                    return Err(bad(format!("entry {i} of {n} runs past the node")));
                };
                let Some(k) = r.take(kl as usize) else {
                    return Err(bad(format!("entry {i} of {n} runs past the node")));
                };
                let Some(p) = r.take(CHILD_PTR) else {
                    return Err(bad(format!("entry {i} of {n} runs past the node")));
                };
                if i == 0 && !k.is_empty() {
                    return Err(bad("the first key of an inner node is not empty".into()));
                }
                if i > 0 && e.last().is_some_and(|(p, _)| i > 1 && p.as_slice() >= k) {
                    return Err(bad(format!("key {i} is not above the one before it")));
                }
                if i > 0 && k.is_empty() {
                    return Err(bad(format!("key {i} of an inner node is empty")));
                }
                let ptr = ChildPtr {
                    block: u64::from_le_bytes(p[0..8].try_into().expect("8 bytes")),
                    crc: u32::from_le_bytes(p[8..12].try_into().expect("4 bytes")),
                    seq: u64::from_le_bytes(p[12..20].try_into().expect("8 bytes")),
                };
                e.push((k.to_vec(), Link::Clean(ptr)));
            }
            Entries::Inner(e)
        };
        if buf[r.pos..].iter().any(|&b| b != 0) {
            return Err(bad("bytes after the last entry".into()));
        }
        Ok(Node { level, entries })
    }
}

/// Bounds-checked reads of the fixed header (checked by the caller) and the entries.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let s = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }
    fn try_u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.take(2)?.try_into().ok()?))
    }
    // The header's fields: the caller checked the buffer holds a header.
    fn u8(&mut self) -> u8 {
        self.take(1).map_or(0, |b| b[0])
    }
    fn u16(&mut self) -> u16 {
        self.try_u16().unwrap_or(0)
    }
    fn u32(&mut self) -> u32 {
        self.take(4)
            .and_then(|b| b.try_into().ok())
            .map_or(0, u32::from_le_bytes)
    }
    fn u64(&mut self) -> u64 {
        self.take(8)
            .and_then(|b| b.try_into().ok())
            .map_or(0, u64::from_le_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NODE_BYTES: usize = 512;

    // Debug builds stop at the assertion; release builds must see the error, never
    // bytes cut to the node size under a checksum that covers the cut.
    #[test]
    #[cfg_attr(debug_assertions, should_panic(expected = "over its size"))]
    fn a_node_over_its_size_is_an_error_never_bytes_cut_short() {
        let keys: Vec<[u8; 2]> = (0..40u8).map(|i| [b'k', i]).collect();
        let node = Node {
            level: 0,
            entries: Entries::Leaf(Leaf::from_sorted(
                keys.iter().map(|k| (&k[..], &[7; 8][..])),
            )),
        };
        assert!(node.encoded_len() > NODE_BYTES);
        let got = node.encode(1, 1, 9, NODE_BYTES);
        assert!(
            matches!(got, Err(TreeError::Invariant(_))),
            "{:?}",
            got.map(|b| format!("{} bytes encoded", b.len()))
        );
    }

    #[test]
    #[cfg_attr(debug_assertions, should_panic(expected = "dirty child"))]
    fn a_node_with_a_child_in_memory_is_an_error_never_a_node_missing_an_entry() {
        let clean = ChildPtr {
            block: 3,
            crc: 0,
            seq: 1,
        };
        let child = Node {
            level: 0,
            entries: Entries::Leaf(Leaf::from_sorted([(&b"b"[..], &b""[..])])),
        };
        let node = Node {
            level: 1,
            entries: Entries::Inner(vec![
                (Vec::new(), Link::Clean(clean)),
                (b"b".to_vec(), Link::Dirty(Box::new(child))),
            ]),
        };
        let got = node.encode(1, 1, 9, NODE_BYTES);
        assert!(
            matches!(got, Err(TreeError::Invariant(_))),
            "{:?}",
            got.map(|b| format!("{} bytes encoded", b.len()))
        );
    }
}
