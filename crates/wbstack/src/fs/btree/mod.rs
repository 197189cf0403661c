//! A copy-on-write B+tree of byte-string keys and values on the device: the on-disk
//! home the metadata moves to (issue 16), so a checkpoint writes only what changed.
//!
//! Why this shape (the decision, against the alternatives):
//! - The journal logs logical records, so the durable tree must always be a whole
//!   snapshot at some transaction, with replay applying records on top: copy-on-write
//!   (btrfs's model, our journal in the role of its log tree). XFS writes btree blocks
//!   in place and so logs them physically, a second journal format and twice the
//!   writes; an LSM reads several levels per lookup and needs compaction and a harder
//!   fsck.
//! - Not redb through its `StorageBackend`: it may panic on corrupt input (its own
//!   fuzzing finds it; its maintainer advises a full integrity walk), and every decoder
//!   here must be total, mount and fsck of any bytes ending in an error. It would also
//!   keep a second allocator in a linear region and cache our pages a second time.
//!
//! A change makes the path from the root to its leaf dirty (each clean node on it is
//! read, decoded and its old block noted as freed); `write_dirty` writes every dirty
//! node to a new block, children first, and returns the new root. Nothing here does IO
//! but through `NodeStore::read`, and nothing frees a block: the caller frees the old
//! blocks once the new root is durable.

pub mod leaf;
pub mod node;
pub mod store;

pub use leaf::Leaf;
pub use node::{max_entry, ChildPtr, Entries, Link, Node, MAX_LEVEL};

use crate::fs::format::FormatError;
use std::ops::Bound;

/// Reads a node's bytes (exactly the tree's node size) from where it was written.
pub trait NodeStore {
    fn read(&self, block: u64) -> Result<Vec<u8>, TreeError>;

    /// The caller is about to read these blocks: a store on a device reads them all
    /// at once (a walk's reads are otherwise one synchronous IO per node). A hint:
    /// errors are the later `read`'s to report.
    fn prefetch(&self, _blocks: &[u64]) {}
}

/// The clean children of inner entries `e` from index `first` while `more` holds for
/// their keys: what a walk of them will read.
fn prefetch_children(cx: &Cx, e: &[(Vec<u8>, Link)], first: usize, more: impl Fn(&[u8]) -> bool) {
    let blocks: Vec<u64> = e
        .iter()
        .enumerate()
        .skip(first)
        .take_while(|(i, (k, _))| *i == first || more(k))
        .filter_map(|(_, (_, l))| match l {
            Link::Clean(p) => Some(p.block),
            Link::Dirty(_) => None,
        })
        .collect();
    if blocks.len() > 1 {
        cx.store.prefetch(&blocks);
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    #[error("{0}")]
    Format(#[from] FormatError),
    #[error("an entry of {len} bytes is larger than a tree entry may be ({max} bytes)")]
    TooBig { len: usize, max: usize },
    #[error("reading tree block {block}: {why}")]
    Io { block: u64, why: String },
    /// A pointer no node can be at: damage, never a device failure.
    #[error("a tree pointer to block {block}: {why}")]
    BadPointer { block: u64, why: String },
    #[error("no block for a tree node: {0}")]
    NoSpace(String),
    #[error("an empty key (keys are at least one byte)")]
    EmptyKey,
    /// A state the tree's own code must never reach (a bug), reported instead of
    /// written.
    #[error("the tree broke its own invariant: {0}")]
    Invariant(String),
}

pub type TreeResult<T> = Result<T, TreeError>;

/// The durable root: what a checkpoint records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Root {
    pub ptr: ChildPtr,
    pub level: u8,
}

/// What `write_dirty` did: how many nodes it handed out to write, the new root, and
/// the blocks of nodes replaced since the last write (free once the root is durable).
#[derive(Debug, Default)]
pub struct Written {
    pub nodes: usize,
    pub root: Option<Root>,
    pub freed: Vec<u64>,
}

pub struct Tree {
    root: Option<Link>,
    level: u8,
    fs_id: u64,
    node_size: usize,
    freed: Vec<u64>,
}

struct Cx<'a> {
    store: &'a dyn NodeStore,
    fs_id: u64,
    node_size: usize,
}

impl Cx<'_> {
    fn load(&self, p: &ChildPtr, level: u8) -> TreeResult<Node> {
        let buf = self.store.read(p.block)?;
        if buf.len() != self.node_size {
            return Err(TreeError::Io {
                block: p.block,
                why: format!("read {} bytes of a {}-byte node", buf.len(), self.node_size),
            });
        }
        Ok(Node::decode(&buf, self.fs_id, p, level)?)
    }
}

/// Index of the child of inner entries `e` whose range holds `key`.
fn child_index(e: &[(Vec<u8>, Link)], key: &[u8]) -> usize {
    e[1..].partition_point(|(k, _)| k.as_slice() <= key)
}

impl Tree {
    /// An empty tree of `node_size`-byte nodes.
    pub fn new(fs_id: u64, node_size: usize) -> Tree {
        Tree {
            root: None,
            level: 0,
            fs_id,
            node_size,
            freed: Vec::new(),
        }
    }

    /// The tree whose durable root is `root` (as a checkpoint recorded it).
    pub fn open(fs_id: u64, node_size: usize, root: Option<Root>) -> TreeResult<Tree> {
        let mut t = Tree::new(fs_id, node_size);
        if let Some(r) = root {
            if r.level > MAX_LEVEL {
                return Err(FormatError::Corrupt(format!(
                    "a tree root of level {}, above the most a tree has ({MAX_LEVEL})",
                    r.level
                ))
                .into());
            }
            t.root = Some(Link::Clean(r.ptr));
            t.level = r.level;
        }
        Ok(t)
    }

    pub fn node_size(&self) -> usize {
        self.node_size
    }

    fn cx<'a>(&self, store: &'a dyn NodeStore) -> Cx<'a> {
        Cx {
            store,
            fs_id: self.fs_id,
            node_size: self.node_size,
        }
    }

    /// Nodes `write_dirty` would write now (so a caller can take their blocks at once).
    pub fn dirty_nodes(&self) -> usize {
        self.root.as_ref().map_or(0, count_dirty)
    }

    /// The bytes the largest node in memory encodes to, which must never pass the node
    /// size: the tests check it after every change, before any write would refuse it.
    pub fn largest_dirty_node_bytes(&self) -> usize {
        self.root.as_ref().map_or(0, largest_dirty)
    }

    /// Whether anything changed since the last `write_dirty`.
    pub fn is_dirty(&self) -> bool {
        matches!(self.root, Some(Link::Dirty(_))) || !self.freed.is_empty()
    }

    pub fn get(&self, store: &dyn NodeStore, key: &[u8]) -> TreeResult<Option<Vec<u8>>> {
        match &self.root {
            None => Ok(None),
            Some(l) => get_in(&self.cx(store), l, self.level, key),
        }
    }

    /// Read ahead the leaves that hold (or would hold) `keys`, which are sorted: one
    /// walk of the inner nodes over them all, then the leaves on disk in one batch
    /// (`NodeStore::prefetch`). A batch of changes then finds its leaves in memory
    /// instead of reading each on its way down, one IO at a time.
    pub fn prefetch_leaves(&self, store: &dyn NodeStore, keys: &[&[u8]]) -> TreeResult<()> {
        debug_assert!(keys.windows(2).all(|w| w[0] <= w[1]), "unsorted keys");
        let Some(root) = &self.root else {
            return Ok(());
        };
        let mut blocks = Vec::new();
        collect_leaves(&self.cx(store), root, self.level, keys, &mut blocks)?;
        if !blocks.is_empty() {
            store.prefetch(&blocks);
        }
        Ok(())
    }

    /// Call `f` with each entry whose key lies in (`from`, `to`), in key order, until it
    /// returns false.
    pub fn for_each(
        &self,
        store: &dyn NodeStore,
        from: Bound<&[u8]>,
        to: Bound<&[u8]>,
        f: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> TreeResult<()> {
        if let Some(l) = &self.root {
            range_in(&self.cx(store), l, self.level, from, to, f)?;
        }
        Ok(())
    }

    /// Every entry in (`from`, `to`), in key order.
    pub fn range(
        &self,
        store: &dyn NodeStore,
        from: Bound<&[u8]>,
        to: Bound<&[u8]>,
    ) -> TreeResult<Vec<(Vec<u8>, Vec<u8>)>> {
        let mut out = Vec::new();
        self.for_each(store, from, to, &mut |k, v| {
            out.push((k.to_vec(), v.to_vec()));
            true
        })?;
        Ok(out)
    }

    /// Whether an entry may go in: a key, and small enough for a node.
    fn check_entry(&self, key: &[u8], value: &[u8]) -> TreeResult<()> {
        let max = max_entry(self.node_size);
        if key.is_empty() {
            return Err(TreeError::EmptyKey);
        }
        if key.len() + value.len() > max {
            return Err(TreeError::TooBig {
                len: key.len() + value.len(),
                max,
            });
        }
        Ok(())
    }

    /// Set `key` to `value`; returns the value it replaced.
    pub fn insert(
        &mut self,
        store: &dyn NodeStore,
        key: &[u8],
        value: &[u8],
    ) -> TreeResult<Option<Vec<u8>>> {
        self.check_entry(key, value)?;
        let cx = self.cx(store);
        let Some(root) = self.root.as_mut() else {
            self.root = Some(Link::Dirty(Box::new(Node {
                level: 0,
                entries: Entries::Leaf(Leaf::from_sorted([(key, value)])),
            })));
            self.level = 0;
            return Ok(None);
        };
        let (old, split) = insert_in(&cx, &mut self.freed, root, self.level, key, value)?;
        if let Some((sep, right)) = split {
            if self.level >= MAX_LEVEL {
                return Err(
                    FormatError::Corrupt("the tree grew past its most levels".into()).into(),
                );
            }
            let left = self.root.take().expect("the root just split");
            self.level += 1;
            self.root = Some(Link::Dirty(Box::new(Node {
                level: self.level,
                entries: Entries::Inner(vec![
                    (Vec::new(), left),
                    (sep, Link::Dirty(Box::new(right))),
                ]),
            })));
        }
        Ok(old)
    }

    /// Set each key to its value; `kvs` sorted by key. One descent per node the keys
    /// land under, not one per key: a checkpoint's puts come sorted, hundreds to a
    /// leaf, and their descents from the root were most of its CPU.
    pub fn insert_sorted(
        &mut self,
        store: &dyn NodeStore,
        kvs: &[(&[u8], &[u8])],
    ) -> TreeResult<()> {
        debug_assert!(kvs.windows(2).all(|w| w[0].0 <= w[1].0), "unsorted puts");
        for (key, value) in kvs {
            self.check_entry(key, value)?;
        }
        if kvs.is_empty() {
            return Ok(());
        }
        let cx = self.cx(store);
        let root = self.root.get_or_insert_with(|| {
            Link::Dirty(Box::new(Node {
                level: 0,
                entries: Entries::Leaf(Leaf::new()),
            }))
        });
        let parts = insert_sorted_in(&cx, &mut self.freed, root, self.level, kvs)?;
        self.grow_root(parts)
    }

    /// The root split into itself and `parts` (several, maybe): a level above, itself
    /// split until it fits.
    fn grow_root(&mut self, mut parts: Vec<SplitOff>) -> TreeResult<()> {
        while !parts.is_empty() {
            if self.level >= MAX_LEVEL {
                return Err(
                    FormatError::Corrupt("the tree grew past its most levels".into()).into(),
                );
            }
            let left = self.root.take().expect("the root just split");
            self.level += 1;
            let mut e = vec![(Vec::new(), left)];
            e.extend(parts.into_iter().map(SplitOff::into_child));
            let mut root = Node {
                level: self.level,
                entries: Entries::Inner(e),
            };
            parts = split_to_fit(&mut root, self.node_size);
            self.root = Some(Link::Dirty(Box::new(root)));
        }
        Ok(())
    }

    /// Remove `key`; returns its value. A key that is not there changes nothing (no node
    /// is made dirty). One descent: each node on the way is read once, and becomes a
    /// dirty copy only once the key was found below it.
    pub fn remove(&mut self, store: &dyn NodeStore, key: &[u8]) -> TreeResult<Option<Vec<u8>>> {
        let cx = self.cx(store);
        let Some(root) = self.root.as_mut() else {
            return Ok(None);
        };
        let Some((old, parts)) = remove_in(&cx, &mut self.freed, root, self.level, key)? else {
            return Ok(None);
        };
        self.grow_root(parts)?;
        // A root left with one child hands the tree to it; an empty leaf root goes.
        while let Some(Link::Dirty(n)) = &mut self.root {
            match &mut n.entries {
                Entries::Inner(e) if e.len() == 1 => {
                    let (_, child) = e.pop().expect("one child");
                    self.root = Some(child);
                    self.level -= 1;
                }
                Entries::Leaf(e) if e.is_empty() => {
                    self.root = None;
                    self.level = 0;
                }
                _ => break,
            }
        }
        Ok(Some(old))
    }

    /// Write every dirty node to a block from `alloc`, children before parents, by
    /// handing its bytes to `write` (block, bytes) as soon as it is encoded, so the
    /// caller can send them in batches instead of holding them all; all nodes are
    /// clean after. `seq` is stamped in each node and its pointer, so a node left
    /// from an older checkpoint at the same block is told apart.
    pub fn write_dirty(
        &mut self,
        seq: u64,
        alloc: &mut dyn FnMut() -> TreeResult<u64>,
        write: &mut dyn FnMut(u64, Vec<u8>) -> TreeResult<()>,
    ) -> TreeResult<Written> {
        let mut out = Written::default();
        if let Some(root) = self.root.as_mut() {
            let mut sink = |b: u64, bytes: Vec<u8>| {
                out.nodes += 1;
                write(b, bytes)
            };
            write_in(self.fs_id, self.node_size, root, seq, alloc, &mut sink)?;
        }
        out.root = match &self.root {
            Some(Link::Clean(p)) => Some(Root {
                ptr: *p,
                level: self.level,
            }),
            Some(Link::Dirty(_)) => unreachable!("written above"),
            None => None,
        };
        out.freed = std::mem::take(&mut self.freed);
        Ok(out)
    }

    /// Dirty nodes in subtrees wholly below `bound` (every key they may hold sorts
    /// before it): what `write_dirty_below` would write now.
    pub fn dirty_nodes_below(&self, bound: &[u8]) -> usize {
        let mut n = 0;
        if let Some(root) = &self.root {
            below_in(root, None, bound, &mut |l| n += count_dirty(l));
        }
        n
    }

    /// Write the dirty subtrees wholly below `bound` as `write_dirty` does, leaving the
    /// rest dirty; returns the nodes written. A checkpoint applies its changes in key
    /// order, so what lies below the next change is final for it: written early, its
    /// nodes leave memory instead of waiting for the whole checkpoint. The blocks of
    /// the nodes replaced stay with the tree for `write_dirty` to hand over.
    pub fn write_dirty_below(
        &mut self,
        bound: &[u8],
        seq: u64,
        alloc: &mut dyn FnMut() -> TreeResult<u64>,
        write: &mut dyn FnMut(u64, Vec<u8>) -> TreeResult<()>,
    ) -> TreeResult<usize> {
        let (fs_id, node_size) = (self.fs_id, self.node_size);
        let mut nodes = 0;
        let mut sink = |b: u64, bytes: Vec<u8>| {
            nodes += 1;
            write(b, bytes)
        };
        if let Some(root) = self.root.as_mut() {
            below_in_mut(root, None, bound, &mut |l| {
                write_in(fs_id, node_size, l, seq, alloc, &mut sink)
            })?;
        }
        Ok(nodes)
    }

    /// Walk the whole tree checking what lookups assume: every node decodes at its
    /// level, every key lies inside the range its parent gives it, no block is used
    /// twice. Returns the blocks of the durable nodes (for a free-space check).
    pub fn check(&self, store: &dyn NodeStore) -> TreeResult<Vec<u64>> {
        let mut blocks = Vec::new();
        if let Some(l) = &self.root {
            check_in(&self.cx(store), l, self.level, None, None, &mut blocks)?;
        }
        let mut sorted = blocks.clone();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(FormatError::Corrupt(format!("tree block {} is used twice", w[0])).into());
        }
        Ok(blocks)
    }
}

/// The node `link` refers to: in memory, or read into `slot`.
fn node_of<'a>(
    cx: &Cx,
    link: &'a Link,
    level: u8,
    slot: &'a mut Option<Node>,
) -> TreeResult<&'a Node> {
    match link {
        Link::Dirty(n) => Ok(n),
        Link::Clean(p) => Ok(slot.insert(cx.load(p, level)?)),
    }
}

/// Make `link` a node in memory (copy-on-write: its old block is freed once the new
/// root is durable) and return it.
fn dirty<'a>(
    cx: &Cx,
    freed: &mut Vec<u64>,
    link: &'a mut Link,
    level: u8,
) -> TreeResult<&'a mut Node> {
    if let Link::Clean(p) = link {
        let n = cx.load(p, level)?;
        freed.push(p.block);
        *link = Link::Dirty(Box::new(n));
    }
    match link {
        Link::Dirty(n) => Ok(n),
        Link::Clean(_) => unreachable!("made dirty above"),
    }
}

fn get_in(cx: &Cx, link: &Link, level: u8, key: &[u8]) -> TreeResult<Option<Vec<u8>>> {
    let mut slot = None;
    let node = node_of(cx, link, level, &mut slot)?;
    match &node.entries {
        Entries::Leaf(e) => Ok(e.search(key).ok().map(|i| e.value(i).to_vec())),
        Entries::Inner(e) => get_in(cx, &e[child_index(e, key)].1, level - 1, key),
    }
}

fn below(to: Bound<&[u8]>, k: &[u8]) -> bool {
    match to {
        Bound::Included(t) => k <= t,
        Bound::Excluded(t) => k < t,
        Bound::Unbounded => true,
    }
}

fn above(from: Bound<&[u8]>, k: &[u8]) -> bool {
    match from {
        Bound::Included(f) => k >= f,
        Bound::Excluded(f) => k > f,
        Bound::Unbounded => true,
    }
}

/// The blocks of the clean leaves under `link` that hold `keys` (sorted), each inner
/// node read once for them all.
fn collect_leaves(
    cx: &Cx,
    link: &Link,
    level: u8,
    keys: &[&[u8]],
    out: &mut Vec<u64>,
) -> TreeResult<()> {
    if keys.is_empty() {
        return Ok(());
    }
    if level == 0 {
        if let Link::Clean(p) = link {
            out.push(p.block);
        }
        return Ok(());
    }
    let mut slot = None;
    let node = node_of(cx, link, level, &mut slot)?;
    let Entries::Inner(e) = &node.entries else {
        return Err(FormatError::Corrupt(format!("a leaf at level {level}")).into());
    };
    let mut at = 0;
    while at < keys.len() {
        let c = child_index(e, keys[at]);
        // The keys below the next child's first key go to this child.
        let end = match e.get(c + 1) {
            Some((next, _)) => at + keys[at..].partition_point(|k| *k < next.as_slice()),
            None => keys.len(),
        };
        collect_leaves(cx, &e[c].1, level - 1, &keys[at..end], out)?;
        at = end;
    }
    Ok(())
}

/// Returns false once `f` asked to stop.
fn range_in(
    cx: &Cx,
    link: &Link,
    level: u8,
    from: Bound<&[u8]>,
    to: Bound<&[u8]>,
    f: &mut dyn FnMut(&[u8], &[u8]) -> bool,
) -> TreeResult<bool> {
    let mut slot = None;
    let node = node_of(cx, link, level, &mut slot)?;
    match &node.entries {
        Entries::Leaf(e) => {
            // Straight to the first key in range.
            let first = match from {
                Bound::Included(k) | Bound::Excluded(k) => e.search(k).unwrap_or_else(|i| i),
                Bound::Unbounded => 0,
            };
            for (k, v) in e.iter().skip(first) {
                if !above(from, k) {
                    continue;
                }
                if !below(to, k) || !f(k, v) {
                    return Ok(false);
                }
            }
        }
        Entries::Inner(e) => {
            let first = match from {
                Bound::Included(k) | Bound::Excluded(k) => child_index(e, k),
                Bound::Unbounded => 0,
            };
            prefetch_children(cx, e, first, |k| below(to, k));
            for (i, (k, child)) in e.iter().enumerate().skip(first) {
                if i > first && !below(to, k) {
                    return Ok(false);
                }
                if !range_in(cx, child, level - 1, from, to, f)? {
                    return Ok(false);
                }
            }
        }
    }
    Ok(true)
}

/// Insert into the subtree at `link`; returns the old value and, if the node split, the
/// new right sibling with its first key.
#[allow(clippy::type_complexity)]
fn insert_in(
    cx: &Cx,
    freed: &mut Vec<u64>,
    link: &mut Link,
    level: u8,
    key: &[u8],
    value: &[u8],
) -> TreeResult<(Option<Vec<u8>>, Option<(Vec<u8>, Node)>)> {
    let node = dirty(cx, freed, link, level)?;
    let old = match &mut node.entries {
        Entries::Leaf(e) => match e.search(key) {
            Ok(i) => Some(e.set_value(i, value)),
            Err(i) => {
                e.insert(i, key, value);
                None
            }
        },
        Entries::Inner(e) => {
            let i = child_index(e, key);
            let (old, split) = insert_in(cx, freed, &mut e[i].1, level - 1, key, value)?;
            let Some((sep, right)) = split else {
                // An inner node grows only by a child's split.
                return Ok((old, None));
            };
            e.insert(i + 1, (sep, Link::Dirty(Box::new(right))));
            old
        }
    };
    let split = (node.encoded_len() > cx.node_size).then(|| split_node(node));
    Ok((old, split))
}

/// A node split off after another, with its first key (its separator in the parent).
struct SplitOff {
    first_key: Vec<u8>,
    node: Node,
}

impl SplitOff {
    fn into_child(self) -> (Vec<u8>, Link) {
        (self.first_key, Link::Dirty(Box::new(self.node)))
    }
}

/// `insert_sorted` below `link`: the node takes its keys (each child those from its
/// separator on), then splits until it fits; returns the nodes split off after it,
/// in order.
fn insert_sorted_in(
    cx: &Cx,
    freed: &mut Vec<u64>,
    link: &mut Link,
    level: u8,
    kvs: &[(&[u8], &[u8])],
) -> TreeResult<Vec<SplitOff>> {
    let node = dirty(cx, freed, link, level)?;
    match &mut node.entries {
        Entries::Leaf(e) => {
            for &(key, value) in kvs {
                match e.search(key) {
                    Ok(i) => drop(e.set_value(i, value)),
                    Err(i) => e.insert(i, key, value),
                }
            }
        }
        Entries::Inner(e) => {
            // Child i holds the keys from its separator (none for the first) to the
            // next one's, as `child_index` finds them.
            let mut grown: Vec<(usize, Vec<SplitOff>)> = Vec::new();
            // By the keys, not the children: a node of hundreds of children is often
            // visited for a few keys.
            let mut from = 0;
            while from < kvs.len() {
                let i = child_index(e, kvs[from].0);
                let to = match e.get(i + 1) {
                    Some((sep, _)) => {
                        from + kvs[from..].partition_point(|kv| kv.0 < sep.as_slice())
                    }
                    None => kvs.len(),
                };
                debug_assert!(to > from, "a key's child does not take it");
                let parts = insert_sorted_in(cx, freed, &mut e[i].1, level - 1, &kvs[from..to])?;
                if !parts.is_empty() {
                    grown.push((i, parts));
                }
                from = to;
            }
            // An inner node grows only by its children's splits (and its size is a sum
            // over its children, not worth taking otherwise).
            if grown.is_empty() {
                return Ok(Vec::new());
            }
            // From the back, so the places of the children before stay put.
            for (i, parts) in grown.into_iter().rev() {
                e.splice(i + 1..i + 1, parts.into_iter().map(SplitOff::into_child));
            }
        }
    }
    Ok(split_to_fit(node, cx.node_size))
}

/// Split `node` until every part fits in a node: `node` keeps the first part, the
/// others come back in key order.
fn split_to_fit(node: &mut Node, node_size: usize) -> Vec<SplitOff> {
    if node.encoded_len() <= node_size {
        return Vec::new();
    }
    let (first_key, mut right) = split_node(node);
    let mut out = split_to_fit(node, node_size);
    let rest = split_to_fit(&mut right, node_size);
    out.push(SplitOff {
        first_key,
        node: right,
    });
    out.extend(rest);
    out
}

/// Split `node` in two of about equal bytes; returns the right half and its first key.
fn split_node(node: &mut Node) -> (Vec<u8>, Node) {
    let half = (node.encoded_len() - node::HEADER) / 2;
    match &mut node.entries {
        Entries::Leaf(e) => {
            let at = split_point(e.iter().map(|(k, v)| 4 + k.len() + v.len()), half);
            let right = e.split_off(at);
            let sep = right.key(0).to_vec();
            (
                sep,
                Node {
                    level: node.level,
                    entries: Entries::Leaf(right),
                },
            )
        }
        Entries::Inner(e) => {
            let at = split_point(e.iter().map(|(k, _)| 22 + k.len()), half);
            let mut right = e.split_off(at);
            let sep = std::mem::take(&mut right[0].0);
            (
                sep,
                Node {
                    level: node.level,
                    entries: Entries::Inner(right),
                },
            )
        }
    }
}

/// The first index whose entries before it pass `half` bytes, keeping one entry at
/// least on each side.
fn split_point(sizes: impl ExactSizeIterator<Item = usize>, half: usize) -> usize {
    let n = sizes.len();
    let mut sum = 0;
    for (i, s) in sizes.enumerate() {
        sum += s;
        if sum >= half {
            return (i + 1).clamp(1, n - 1);
        }
    }
    n - 1
}

/// What a removal below a node hands back up: the old value and the nodes split off
/// after the node, in order, if it no longer fits. None: the key is not there, and
/// nothing changed.
type Removed = Option<(Vec<u8>, Vec<SplitOff>)>;

/// Remove `key` from the subtree at `link`, rebalancing a child that became too small
/// with a sibling. A clean node on the way is read once, into a copy that replaces it
/// (its block freed) only if the key was found below it: a key that is not there
/// leaves the subtree as it was, with no second descent to find that out first. On an
/// error below a clean node its copy goes, and so do the blocks its subtree noted as
/// freed: the tree still points at them.
fn remove_in(
    cx: &Cx,
    freed: &mut Vec<u64>,
    link: &mut Link,
    level: u8,
    key: &[u8],
) -> TreeResult<Removed> {
    let p = match link {
        Link::Dirty(node) => return remove_from(cx, freed, node, level, key),
        Link::Clean(p) => *p,
    };
    let mut node = cx.load(&p, level)?;
    // Its block goes before those of the nodes below it, where `dirty` puts it.
    let mark = freed.len();
    match remove_from(cx, freed, &mut node, level, key) {
        Ok(Some(r)) => {
            freed.insert(mark, p.block);
            *link = Link::Dirty(Box::new(node));
            Ok(Some(r))
        }
        Ok(None) => {
            debug_assert_eq!(freed.len(), mark, "a removal of nothing freed a node");
            Ok(None)
        }
        Err(e) => {
            freed.truncate(mark);
            Err(e)
        }
    }
}

/// `remove_in` in `node`, in memory.
fn remove_from(
    cx: &Cx,
    freed: &mut Vec<u64>,
    node: &mut Node,
    level: u8,
    key: &[u8],
) -> TreeResult<Removed> {
    let old = match &mut node.entries {
        Entries::Leaf(e) => return Ok(e.search(key).ok().map(|i| (e.remove(i), Vec::new()))),
        Entries::Inner(e) => {
            let i = child_index(e, key);
            let Some((old, parts)) = remove_in(cx, freed, &mut e[i].1, level - 1, key)? else {
                return Ok(None);
            };
            let mut grown = !parts.is_empty();
            e.splice(i + 1..i + 1, parts.into_iter().map(SplitOff::into_child));
            let small = match &e[i].1 {
                Link::Dirty(c) => c.is_empty() || c.encoded_len() < cx.node_size / 4,
                Link::Clean(_) => false,
            };
            if small && e.len() > 1 {
                rebalance(cx, freed, e, i, level - 1)?;
                grown = true;
            }
            // A rebalance below may put a separator here in place of a shorter one
            // (dirent keys run from 10 to 273 bytes), and a child's split adds one: a
            // node near full then passes its size, and splits as an insert's would.
            // Untouched, it only shrank, and its size is not worth summing.
            if !grown {
                return Ok(Some((old, Vec::new())));
            }
            old
        }
    };
    Ok(Some((old, split_to_fit(node, cx.node_size))))
}

/// Merge child `i` of `e` with a sibling, or share their entries out evenly when both do
/// not fit one node. `e` may then be larger than before (the new separator longer than
/// the one removed): the caller splits it.
fn rebalance(
    cx: &Cx,
    freed: &mut Vec<u64>,
    e: &mut Vec<(Vec<u8>, Link)>,
    i: usize,
    level: u8,
) -> TreeResult<()> {
    let (l, r) = if i + 1 < e.len() {
        (i, i + 1)
    } else {
        (i - 1, i)
    };
    dirty(cx, freed, &mut e[l].1, level)?;
    dirty(cx, freed, &mut e[r].1, level)?;
    let (sep, right) = e.remove(r);
    let Link::Dirty(mut right) = right else {
        unreachable!("made dirty above")
    };
    let Link::Dirty(left) = &mut e[l].1 else {
        unreachable!("made dirty above")
    };
    match (&mut left.entries, &mut right.entries) {
        (Entries::Leaf(a), Entries::Leaf(b)) => a.append(b),
        (Entries::Inner(a), Entries::Inner(b)) => {
            // The right node's first child now starts at the separator.
            b[0].0 = sep;
            a.append(b);
        }
        _ => {
            return Err(
                FormatError::Corrupt("siblings of different kinds in the tree".into()).into(),
            )
        }
    }
    let parts = split_to_fit(left, cx.node_size);
    e.splice(l + 1..l + 1, parts.into_iter().map(SplitOff::into_child));
    Ok(())
}

fn largest_dirty(l: &Link) -> usize {
    match l {
        Link::Clean(_) => 0,
        Link::Dirty(n) => match &n.entries {
            Entries::Inner(e) => e
                .iter()
                .map(|(_, c)| largest_dirty(c))
                .fold(n.encoded_len(), usize::max),
            Entries::Leaf(_) => n.encoded_len(),
        },
    }
}

fn count_dirty(l: &Link) -> usize {
    match l {
        Link::Clean(_) => 0,
        Link::Dirty(n) => {
            1 + match &n.entries {
                Entries::Inner(e) => e.iter().map(|(_, c)| count_dirty(c)).sum(),
                Entries::Leaf(_) => 0,
            }
        }
    }
}

/// Hand `f` each dirty subtree under `link` (whose keys lie below `hi`, or anywhere)
/// that lies wholly below `bound`, topmost first; subtrees that reach `bound` are
/// searched further.
fn below_in(link: &Link, hi: Option<&[u8]>, bound: &[u8], f: &mut dyn FnMut(&Link)) {
    let Link::Dirty(node) = link else { return };
    if hi.is_some_and(|h| h <= bound) {
        return f(link);
    }
    if let Entries::Inner(e) = &node.entries {
        for (i, (_, child)) in e.iter().enumerate() {
            let chi = e.get(i + 1).map(|(k, _)| k.as_slice()).or(hi);
            below_in(child, chi, bound, f);
            if chi.is_none_or(|h| h > bound) {
                break; // the children after this one lie above `bound` too
            }
        }
    }
}

/// `below_in` over a tree that `f` changes (writes).
fn below_in_mut(
    link: &mut Link,
    hi: Option<&[u8]>,
    bound: &[u8],
    f: &mut dyn FnMut(&mut Link) -> TreeResult<()>,
) -> TreeResult<()> {
    let Link::Dirty(node) = link else {
        return Ok(());
    };
    if hi.is_some_and(|h| h <= bound) {
        return f(link);
    }
    if let Entries::Inner(e) = &mut node.entries {
        for i in 0..e.len() {
            let chi = e
                .get(i + 1)
                .map(|(k, _)| k.clone())
                .or(hi.map(<[u8]>::to_vec));
            below_in_mut(&mut e[i].1, chi.as_deref(), bound, f)?;
            if chi.is_none_or(|h| h.as_slice() > bound) {
                break;
            }
        }
    }
    Ok(())
}

fn write_in(
    fs_id: u64,
    node_size: usize,
    link: &mut Link,
    seq: u64,
    alloc: &mut dyn FnMut() -> TreeResult<u64>,
    write: &mut dyn FnMut(u64, Vec<u8>) -> TreeResult<()>,
) -> TreeResult<()> {
    let Link::Dirty(node) = link else {
        return Ok(());
    };
    if let Entries::Inner(e) = &mut node.entries {
        for (_, child) in e.iter_mut() {
            write_in(fs_id, node_size, child, seq, alloc, write)?;
        }
    }
    let block = alloc()?;
    let bytes = node.encode(fs_id, seq, block, node_size)?;
    let crc = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes"));
    // The node in memory goes here: from now on it is its bytes, in the caller's hands.
    *link = Link::Clean(ChildPtr { block, crc, seq });
    write(block, bytes)?;
    Ok(())
}

fn check_in(
    cx: &Cx,
    link: &Link,
    level: u8,
    lo: Option<&[u8]>,
    hi: Option<&[u8]>,
    blocks: &mut Vec<u64>,
) -> TreeResult<()> {
    if let Link::Clean(p) = link {
        blocks.push(p.block);
    }
    let mut slot = None;
    let node = node_of(cx, link, level, &mut slot)?;
    let outside = |k: &[u8]| lo.is_some_and(|lo| k < lo) || hi.is_some_and(|hi| k >= hi);
    match &node.entries {
        Entries::Leaf(e) => {
            if let Some((k, _)) = e.iter().find(|(k, _)| outside(k)) {
                return Err(FormatError::Corrupt(format!(
                    "tree key {k:02x?} lies outside the range its parent gives its leaf"
                ))
                .into());
            }
        }
        Entries::Inner(e) => {
            prefetch_children(cx, e, 0, |_| true);
            for (i, (k, child)) in e.iter().enumerate() {
                if i > 0 && outside(k) {
                    return Err(FormatError::Corrupt(format!(
                        "tree separator {k:02x?} lies outside its node's range"
                    ))
                    .into());
                }
                let clo = if i == 0 { lo } else { Some(k.as_slice()) };
                let chi = e.get(i + 1).map(|(k, _)| k.as_slice()).or(hi);
                check_in(cx, child, level - 1, clo, chi, blocks)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::collections::HashMap;

    const FS_ID: u64 = 0x5eed;

    /// Nodes as written, by block.
    #[derive(Default)]
    struct MemStore(RefCell<HashMap<u64, Vec<u8>>>);

    impl NodeStore for MemStore {
        fn read(&self, block: u64) -> TreeResult<Vec<u8>> {
            self.0.borrow().get(&block).cloned().ok_or(TreeError::Io {
                block,
                why: "never written".into(),
            })
        }
    }

    /// A store over `MemStore` that counts each block's reads.
    struct Counting<'a> {
        inner: &'a MemStore,
        reads: RefCell<HashMap<u64, usize>>,
    }

    impl<'a> Counting<'a> {
        fn new(inner: &'a MemStore) -> Counting<'a> {
            Counting {
                inner,
                reads: RefCell::default(),
            }
        }

        fn total(&self) -> usize {
            self.reads.borrow().values().sum()
        }

        /// The reads of the block read most.
        fn most(&self) -> usize {
            self.reads.borrow().values().copied().max().unwrap_or(0)
        }
    }

    impl NodeStore for Counting<'_> {
        fn read(&self, block: u64) -> TreeResult<Vec<u8>> {
            *self.reads.borrow_mut().entry(block).or_default() += 1;
            self.inner.read(block)
        }
    }

    fn leaf(kvs: &[(&[u8], &[u8])]) -> Link {
        Link::Dirty(Box::new(Node {
            level: 0,
            entries: Entries::Leaf(Leaf::from_sorted(kvs.iter().copied())),
        }))
    }

    /// Write every dirty node to fresh blocks of `store`; the root written.
    fn write(t: &mut Tree, store: &MemStore) -> Option<Root> {
        let mut next = store.0.borrow().keys().max().copied().unwrap_or(0);
        let w = t
            .write_dirty(
                1,
                &mut || {
                    next += 1;
                    Ok(next)
                },
                &mut |b, bytes| {
                    store.0.borrow_mut().insert(b, bytes);
                    Ok(())
                },
            )
            .unwrap();
        w.root
    }

    /// The reviewer's case: a merge of two leaves that does not fit one node splits
    /// again at a key far longer than the separator it replaced, and the parent, near
    /// full, grows past its node. It must split as an insert's would, not be written
    /// cut short (release) or trip the encoder's assertion (debug).
    #[test]
    fn a_rebalance_that_lengthens_a_separator_splits_the_parent_it_overfills() {
        let a: Vec<(Vec<u8>, Vec<u8>)> = (1..=4)
            .map(|i| (format!("a{i}").into_bytes(), vec![i; 10]))
            .collect();
        // Six 70-byte keys between "b" and "c", empty values: 479 bytes.
        let b: Vec<(Vec<u8>, Vec<u8>)> = (0..6)
            .map(|i| (format!("b{}{i}", "x".repeat(68)).into_bytes(), Vec::new()))
            .collect();
        fn refs(kvs: &[(Vec<u8>, Vec<u8>)]) -> Vec<(&[u8], &[u8])> {
            kvs.iter().map(|(k, v)| (&k[..], &v[..])).collect()
        }
        let mut e = vec![
            (Vec::new(), leaf(&refs(&a))),
            (b"b".to_vec(), leaf(&refs(&b))),
        ];
        for c in b'c'..=b't' {
            e.push((vec![c], leaf(&[(&[c][..], &[][..])])));
        }
        let root = Node {
            level: 1,
            entries: Entries::Inner(e),
        };
        assert_eq!(root.encoded_len(), 494);
        let mut t = Tree::new(FS_ID, NODE_BYTES);
        t.root = Some(Link::Dirty(Box::new(root)));
        t.level = 1;
        let store = MemStore::default();

        // a1 leaves A small: merged with B it is 527 bytes, split again at B's fourth
        // key (70 bytes) where "b" (1 byte) was: the root would be 563 bytes.
        assert_eq!(t.remove(&store, b"a1").unwrap(), Some(vec![1; 10]));
        assert!(
            t.largest_dirty_node_bytes() <= NODE_BYTES,
            "a node of {} bytes",
            t.largest_dirty_node_bytes()
        );
        assert_eq!(t.level, 2, "the root split, growing the tree");
        let t = Tree::open(FS_ID, NODE_BYTES, write(&mut t, &store)).unwrap();
        t.check(&store).unwrap();
        assert_eq!(t.get(&store, b"t").unwrap(), Some(Vec::new()));
        assert_eq!(t.get(&store, b"a1").unwrap(), None);
        for (k, v) in a[1..].iter().chain(&b) {
            assert_eq!(t.get(&store, k).unwrap().as_ref(), Some(v));
        }
    }

    const NODE_BYTES: usize = 512;
    /// Keys `thinned_tree` inserted, every third of them left.
    const THINNED: u32 = 6000;

    fn key(i: u32) -> Vec<u8> {
        format!("k{i:05}").into_bytes()
    }

    /// A tree of small nodes, written to `store`, of nodes of every fill: `THINNED`
    /// keys inserted in order (leaves split half full), then those not a multiple of 3
    /// removed in a scattered order (rebalancing as they go), so a removal from it may
    /// rebalance or not.
    fn thinned_tree(store: &MemStore) -> Option<Root> {
        let mut t = Tree::new(FS_ID, NODE_BYTES);
        for i in 0..THINNED {
            t.insert(store, &key(i), &[7; 20]).unwrap();
        }
        for i in (0..THINNED)
            .map(|i| i * 2749 % THINNED)
            .filter(|i| i % 3 != 0)
        {
            t.remove(store, &key(i)).unwrap();
        }
        write(&mut t, store)
    }

    /// A removal goes down once: each node on its path is read once (it was read twice,
    /// a lookup to see whether the key is there, then the descent that removes it), and
    /// every node it reads is one it changes, but for a key not there, which reads its
    /// path once and changes nothing.
    #[test]
    fn a_removal_reads_each_node_on_its_path_once() {
        let store = MemStore::default();
        let root = thinned_tree(&store);
        let levels = root.unwrap().level as usize + 1;
        assert!(levels >= 4, "a tree of {levels} levels");

        let c = Counting::new(&store);
        let mut t = Tree::open(FS_ID, NODE_BYTES, root).unwrap();
        assert_eq!(t.remove(&c, b"k01500x").unwrap(), None);
        assert_eq!((c.total(), c.most()), (levels, 1));
        assert!(!t.is_dirty(), "a removal of nothing changed the tree");

        let (mut plain, mut rebalanced) = (0, 0);
        for i in (0..THINNED).step_by(3) {
            let c = Counting::new(&store);
            let mut t = Tree::open(FS_ID, NODE_BYTES, root).unwrap();
            assert_eq!(t.remove(&c, &key(i)).unwrap(), Some(vec![7; 20]));
            assert_eq!(c.most(), 1, "key {i}: a node read twice");
            // Each node read became dirty, its block freed: the path, and the siblings
            // of a rebalance.
            assert_eq!(c.total(), t.freed.len(), "key {i}: a node read for nothing");
            if c.total() == levels {
                plain += 1;
            } else {
                rebalanced += 1;
            }
            assert_eq!(t.get(&store, &key(i)).unwrap(), None);
        }
        assert!(
            plain > 0 && rebalanced > 0,
            "{plain} plain, {rebalanced} rebalanced"
        );
    }

    /// A rebalance whose sibling cannot be read fails the removal, and leaves the tree
    /// as it was: the clean nodes read on the way are dropped, their blocks not freed
    /// (the tree still points at them).
    #[test]
    fn a_removal_that_fails_below_a_clean_node_leaves_the_tree_unchanged() {
        let store = MemStore::default();
        let root = thinned_tree(&store);
        // A removal that rebalances: it reads more than its path.
        let (i, sibling) = (0..THINNED)
            .step_by(3)
            .find_map(|i| {
                let path = Counting::new(&store);
                let t = Tree::open(FS_ID, NODE_BYTES, root).unwrap();
                t.get(&path, &key(i)).unwrap();
                let c = Counting::new(&store);
                let mut t = Tree::open(FS_ID, NODE_BYTES, root).unwrap();
                t.remove(&c, &key(i)).unwrap();
                let path = path.reads.into_inner();
                let sibling = c
                    .reads
                    .into_inner()
                    .into_keys()
                    .find(|b| !path.contains_key(b));
                sibling.map(|b| (i, b))
            })
            .expect("a removal that rebalances");
        let damaged = MemStore(RefCell::new(store.0.borrow().clone()));
        damaged.0.borrow_mut().remove(&sibling);
        let mut t = Tree::open(FS_ID, NODE_BYTES, root).unwrap();
        assert!(t.remove(&damaged, &key(i)).is_err());
        assert!(!t.is_dirty(), "freed {:?}", t.freed);
        assert_eq!(t.get(&store, &key(i)).unwrap(), Some(vec![7; 20]));
    }
}
