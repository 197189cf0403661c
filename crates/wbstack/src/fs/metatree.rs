//! The metadata as keys of the B+tree (`fs::btree`): the schema, the tree operations
//! that bring the tree up to date with what `Meta::apply` changed (`capture`, then
//! `apply_captured`; `ops` for all at once), and the metadata rebuilt from a tree
//! (`load`). Format 4's checkpoint (`fs::checkpoint`) writes these keys.
//!
//! Keys sort as bytes; numbers in keys are big-endian so they sort as numbers, and all
//! of one inode's keys sit together (one leaf serves a stat, a short extent list or a
//! small directory):
//! - `00` → filesystem record: next inode number
//! - `01 ino 00` → the inode's own fields
//! - `01 ino 01 chunk` → symlink target, in chunks
//! - `01 ino 02 fblock` → extent: device block, length
//! - `01 ino 03 hash name` → directory entry: inode. `hash` is a seeded 64-bit hash of
//!   the name, so a directory's entries are in hash order: a lookup is one descent, and
//!   the hash is a readdir cookie that stays valid across creates and deletes (as
//!   ext4's htree)
//! - `01 ino 04 name 00 chunk` → extended attribute value, in chunks
//! - `02 ino` → orphan
//!
//! Values are little-endian, like the rest of the format. Every decoder is total.

use super::alloc::FreeSpace;
use super::btree::{ChildPtr, NodeStore, Root, Tree, TreeError, TreeResult};
use super::dir::Cold;
use super::format::{InodeKind, XATTR_SIZE_MAX};
use super::inodes::{AskPart, DirentRead, DirentsFound, GroupRead};
use super::meta::{valid_name, Changes, Inode, Meta, MetaError, ROOT_INO, TARGET_MAX};
use rustc_hash::FxHashMap;
use std::collections::BTreeSet;
use std::ops::Bound;

const FS_RECORD: u8 = 0x00;
const INODE_SPACE: u8 = 0x01;
const ORPHAN_SPACE: u8 = 0x02;
const CORE: u8 = 0x00;
const TARGET: u8 = 0x01;
const EXTENT: u8 = 0x02;
const DIRENT: u8 = 0x03;
const XATTR: u8 = 0x04;
/// Bytes of a target or attribute value per key: well under the largest entry of a
/// 4 KiB node.
pub const CHUNK: usize = 768;

/// A change to make to the tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TreeOp {
    Put(Vec<u8>, Vec<u8>),
    Del(Vec<u8>),
    /// Every key starting with this prefix.
    DelPrefix(Vec<u8>),
}

fn inode_prefix(ino: u64, space: u8) -> Vec<u8> {
    let mut k = Vec::with_capacity(32);
    k.push(INODE_SPACE);
    k.extend_from_slice(&ino.to_be_bytes());
    k.push(space);
    k
}

fn core_key(ino: u64) -> Vec<u8> {
    inode_prefix(ino, CORE)
}

fn extent_key(ino: u64, fb: u64) -> Vec<u8> {
    let mut k = inode_prefix(ino, EXTENT);
    k.extend_from_slice(&fb.to_be_bytes());
    k
}

/// FNV-1a over the seed and the name, with the top bit cleared (a cookie is a
/// non-negative file position) and never below `dir::FIRST_COOKIE`, so the cookies of
/// the start, `.` and `..` (0, 1, 2) are never a name's.
pub fn name_hash(seed: u64, name: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in seed.to_le_bytes().iter().chain(name) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h >> 1).max(super::dir::FIRST_COOKIE)
}

/// The key of directory `dir`'s entry `name`, whose hash is `hash`.
fn dirent_key_hashed(dir: u64, hash: u64, name: &[u8]) -> Vec<u8> {
    let mut k = inode_prefix(dir, DIRENT);
    k.extend_from_slice(&hash.to_be_bytes());
    k.extend_from_slice(name);
    k
}

fn xattr_prefix(ino: u64, name: &[u8]) -> Vec<u8> {
    let mut k = inode_prefix(ino, XATTR);
    k.extend_from_slice(name);
    k.push(0);
    k
}

fn orphan_key(ino: u64) -> Vec<u8> {
    let mut k = vec![ORPHAN_SPACE];
    k.extend_from_slice(&ino.to_be_bytes());
    k
}

fn encode_core(i: &Inode) -> [u8; CORE_BYTES] {
    let mut v = [0u8; CORE_BYTES];
    v[0] = i.kind as u8;
    let mut at = 1;
    let mut put = |b: &[u8]| {
        v[at..at + b.len()].copy_from_slice(b);
        at += b.len();
    };
    for x in [i.mode, i.uid, i.gid, i.links] {
        put(&x.to_le_bytes());
    }
    for x in [i.size, i.atime_ns, i.mtime_ns, i.ctime_ns] {
        put(&x.to_le_bytes());
    }
    put(&i.rdev.to_le_bytes());
    // Format 5: a directory's parent and subdirectory count, which a directory read
    // back alone could not derive from the entries naming it.
    put(&i.parent.to_le_bytes());
    put(&i.subdirs.to_le_bytes());
    debug_assert_eq!(at, CORE_BYTES);
    v
}

/// What a directory entry names: the inode, and (format 5) its kind, so readdir need
/// not read the inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Named {
    ino: u64,
    /// None: format 4, which did not record it (a load resolves it).
    kind: Option<InodeKind>,
}

/// A directory entry's value: the inode, then its kind's byte.
fn encode_dirent(n: Named) -> Vec<u8> {
    let mut v = n.ino.to_le_bytes().to_vec();
    v.extend(n.kind.map(|k| k as u8));
    v
}

/// `encode_dirent` undone: format 4's 8 bytes or format 5's 9.
fn decode_dirent(v: &[u8]) -> Option<Named> {
    let ino = le64(v, 0)?;
    let kind = match v.len() {
        8 => None,
        9 => Some(InodeKind::from_u8(v[8]).ok()?),
        _ => return None,
    };
    Some(Named { ino, kind })
}

/// Put a chunked value under `prefix` (keys `prefix chunk`), after deleting the old.
fn put_chunks(ops: &mut Vec<TreeOp>, prefix: Vec<u8>, value: Option<&[u8]>) {
    ops.push(TreeOp::DelPrefix(prefix.clone()));
    let Some(value) = value else { return };
    // An empty value is one empty chunk, so it still exists.
    let chunks: Vec<&[u8]> = if value.is_empty() {
        vec![&[]]
    } else {
        value.chunks(CHUNK).collect()
    };
    for (n, c) in chunks.into_iter().enumerate() {
        let mut k = prefix.clone();
        k.push(n as u8);
        ops.push(TreeOp::Put(k, c.to_vec()));
    }
}

/// Sort and drop repeats.
fn settle<T: Ord>(v: &mut Vec<T>) {
    v.sort_unstable();
    v.dedup();
}

/// The tree operations that bring a tree holding the state before `ch` to `meta`'s.
/// Costs what changed, not what exists.
pub fn ops(meta: &Meta, ch: Changes) -> Vec<TreeOp> {
    capture(meta, ch).ops()
}

/// Bytes of an inode's own fields as the tree holds them (`encode_core`).
const CORE_BYTES: usize = CORE_BYTES_V4 + 8 + 4;
/// Format 4's record, without parent and subdirectory count.
const CORE_BYTES_V4: usize = 1 + 4 * 4 + 8 * 4 + 4;

/// A changed piece of metadata and its value now (none: it is gone).
#[derive(PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Now<K, V> {
    key: K,
    value: Option<V>,
}

/// A directory entry's place in the tree: its key's parts.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct DirentAt {
    dir: u64,
    hash: u64,
    name: Vec<u8>,
}

/// An extended attribute's place in the tree.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct XattrAt {
    ino: u64,
    name: Vec<u8>,
}

/// The current values of the changed keys, copied out of the metadata: the part of
/// making a checkpoint's tree operations that needs the metadata as of the
/// checkpoint, and so holds `st` (or is taken copy-on-write: `fs::cowcapture`). The
/// keys and their sorting are built after (`Captured::ops`), while creates go on.
#[derive(PartialEq, Eq)]
pub struct Captured {
    /// The inode cache's generation (`Changes::gen`).
    pub gen: u64,
    /// What a format 5 root record holds of the state (`Meta::space_record`).
    pub space: Option<SpaceRecord>,
    next_ino: u64,
    deleted: Vec<u64>,
    inodes: Vec<Now<u64, [u8; CORE_BYTES]>>,
    /// (inode, file block) to (device block, length).
    extents: Vec<Now<(u64, u64), (u64, u64)>>,
    /// To the inode named.
    dirents: Vec<Now<DirentAt, Named>>,
    targets: Vec<Now<u64, Vec<u8>>>,
    xattrs: Vec<Now<XattrAt, Vec<u8>>>,
    orphans: Vec<Now<u64, ()>>,
}

/// The values now of the keys `ch` names.
pub fn capture(meta: &Meta, mut ch: Changes) -> Captured {
    let mut out = Captured::start(meta, &mut ch);
    let mut at = KeyCursor::default();
    for ino in changed_inodes(&ch) {
        // Every changed inode is in memory (`fs::inodes`), or deleted: none is read back.
        let i = meta.resident(ino);
        debug_assert!(
            i.is_some() || !meta.is_lazy() || meta.is_changed(ino),
            "inode {ino} has a change to write but left memory"
        );
        out.take_inode(&ch, &mut at, meta.name_seed, ino, i);
    }
    out
}

/// Every inode `ch` (settled) names a key of, sorted: the units a capture copies.
pub fn changed_inodes(ch: &Changes) -> Vec<u64> {
    let mut v: Vec<u64> = ch
        .inodes
        .iter()
        .copied()
        .chain(ch.extents.iter().map(|e| e.0))
        .chain(ch.dirents.iter().map(|d| d.0))
        .chain(ch.targets.iter().copied())
        .chain(ch.xattrs.iter().map(|x| x.0))
        .collect();
    // Runs of sorted numbers: the sort merges them in near linear time.
    settle(&mut v);
    v
}

/// Where `take_inode` left off in each settled list of a `Changes`: a capture takes
/// inodes in increasing order, so each list is walked once, with a gallop from the
/// last place, instead of a binary search of the whole list per inode and kind (at
/// the mount of a journal of half a million creates those searches, a cache miss per
/// step, were 29% of the mount's checkpoint).
#[derive(Default)]
pub(super) struct KeyCursor {
    inodes: usize,
    extents: usize,
    dirents: usize,
    targets: usize,
    xattrs: usize,
}

/// The first index of sorted `v` whose key is not below `ino`. `from` is a guess that
/// only ever stands below it: a gallop from there when everything before `from` is
/// below `ino` (a walk in increasing order), else a binary search of the whole list.
fn seek<T>(v: &[T], from: usize, ino: u64, key: &impl Fn(&T) -> u64) -> usize {
    if from > v.len() || (from > 0 && key(&v[from - 1]) >= ino) {
        return v.partition_point(|e| key(e) < ino);
    }
    // Everything below `lo` is below `ino`.
    let mut lo = from;
    let mut step = 1;
    while lo + step <= v.len() && key(&v[lo + step - 1]) < ino {
        lo += step;
        step *= 2;
    }
    let hi = (lo + step).min(v.len());
    lo + v[lo..hi].partition_point(|e| key(e) < ino)
}

/// The entries of a settled (sorted) list that belong to inode `ino`; `at` moves past
/// them.
fn of_inode<'v, T>(v: &'v [T], at: &mut usize, ino: u64, key: impl Fn(&T) -> u64) -> &'v [T] {
    let lo = seek(v, *at, ino, &key);
    let hi = match ino.checked_add(1) {
        Some(next) => seek(v, lo, next, &key),
        None => v.len(),
    };
    *at = hi;
    &v[lo..hi]
}

/// Whether sorted `v` holds `ino`; `at` moves past it.
fn holds(v: &[u64], at: &mut usize, ino: u64) -> bool {
    let lo = seek(v, *at, ino, &|&x| x);
    let found = v.get(lo) == Some(&ino);
    *at = lo + usize::from(found);
    found
}

impl Captured {
    /// A capture of `ch`, settled here (repeats dropped, each kind sorted), holding
    /// so far what belongs to no inode: the filesystem record, the free space, the
    /// deletions and the orphans. Each inode's keys come with `take_inode`.
    pub(super) fn start(meta: &Meta, ch: &mut Changes) -> Captured {
        // Repeats dropped first (an inode is noted by most records about it); sorting
        // numbers is cheap next to a lookup each.
        for v in [
            &mut ch.deleted,
            &mut ch.inodes,
            &mut ch.targets,
            &mut ch.orphans,
        ] {
            settle(v);
        }
        settle(&mut ch.extents);
        settle(&mut ch.xattrs);
        // By directory only (numbers, not names, compared): `take_inode` finds a
        // directory's entries, and `into_chunks` sorts and drops repeats after `st`.
        ch.dirents.sort_unstable_by_key(|d| d.0);
        Captured {
            gen: ch.gen,
            space: meta.space_record(),
            next_ino: meta.next_ino,
            deleted: std::mem::take(&mut ch.deleted),
            // A value per key (dirents: at most), so no list grows by copying itself.
            inodes: Vec::with_capacity(ch.inodes.len()),
            extents: Vec::with_capacity(ch.extents.len()),
            dirents: Vec::with_capacity(ch.dirents.len()),
            targets: Vec::with_capacity(ch.targets.len()),
            xattrs: Vec::with_capacity(ch.xattrs.len()),
            orphans: std::mem::take(&mut ch.orphans)
                .into_iter()
                .map(|ino| Now {
                    key: ino,
                    value: meta.orphans.contains(&ino).then_some(()),
                })
                .collect(),
        }
    }

    /// Inode `ino`'s keys that `ch` (settled by `start`) names, as `i` holds them now
    /// (none: deleted). Every key of one inode comes from one call. `at`: where the
    /// last call left off (calls in increasing inode order cost least; any order is
    /// right).
    /// Values copied so far (deleted inodes and orphans, known at the start, aside).
    pub(super) fn values(&self) -> usize {
        self.inodes.len()
            + self.extents.len()
            + self.dirents.len()
            + self.targets.len()
            + self.xattrs.len()
    }

    pub(super) fn take_inode(
        &mut self,
        ch: &Changes,
        at: &mut KeyCursor,
        seed: u64,
        ino: u64,
        i: Option<&Inode>,
    ) {
        if holds(&ch.inodes, &mut at.inodes, ino) {
            self.inodes.push(Now {
                key: ino,
                value: i.map(encode_core),
            });
        }
        for &(_, fb) in of_inode(&ch.extents, &mut at.extents, ino, |e| e.0) {
            self.extents.push(Now {
                key: (ino, fb),
                value: i.and_then(|i| i.extents.get(&fb).copied()),
            });
        }
        for (_, name) in of_inode(&ch.dirents, &mut at.dirents, ino, |d| d.0) {
            let hash = name_hash(seed, name);
            debug_assert!(
                i.is_none_or(|d| d.entries.cold_in(Cold::range(hash, hash)).is_none()),
                "a changed entry of directory {ino} in a cold group"
            );
            let value = i
                .and_then(|d| d.entries.entry_at(hash, name))
                .map(|(ino, kind)| Named { ino, kind });
            self.dirents.push(Now {
                key: DirentAt {
                    dir: ino,
                    hash,
                    name: name.clone(),
                },
                value,
            });
        }
        if holds(&ch.targets, &mut at.targets, ino) {
            self.targets.push(Now {
                key: ino,
                // A symlink's target is empty only between its create and its SetTarget.
                value: i
                    .filter(|i| i.kind == InodeKind::Symlink && !i.target.is_empty())
                    .map(|i| i.target.clone()),
            });
        }
        for (_, name) in of_inode(&ch.xattrs, &mut at.xattrs, ino, |x| x.0) {
            self.xattrs.push(Now {
                key: XattrAt {
                    ino,
                    name: name.clone(),
                },
                value: i.and_then(|i| i.xattrs.get(name)).cloned(),
            });
        }
    }
}

/// The key set to `value`, or deleted.
fn put_or_del(ops: &mut Vec<TreeOp>, key: Vec<u8>, value: Option<Vec<u8>>) {
    ops.push(match value {
        Some(v) => TreeOp::Put(key, v),
        None => TreeOp::Del(key),
    });
}

impl Captured {
    /// The tree operations, all at once, in key order.
    pub fn ops(self) -> Vec<TreeOp> {
        let mut chunks = self.into_chunks();
        let mut ops = Vec::new();
        while let Some(c) = chunks.next_chunk(usize::MAX) {
            ops.extend(c);
        }
        // Stable, and a prefix sorts before every key it covers, so a DelPrefix still
        // comes before the puts of the same chunked value. Each kind came out in key
        // order, and the sort merges such runs in near linear time.
        ops.sort_by(|a, b| op_key(a).cmp(op_key(b)));
        ops
    }

    /// The tree operations a chunk at a time (`OpChunks::next_chunk`), so a
    /// checkpoint holds one chunk of them, not every key and value at once.
    pub fn into_chunks(self) -> OpChunks {
        let s = self.sorted();
        OpChunks {
            head: vec![TreeOp::Put(
                vec![FS_RECORD],
                s.next_ino.to_le_bytes().to_vec(),
            )],
            deleted: s.deleted.into_iter(),
            inodes: s.inodes.into_iter(),
            extents: s.extents.into_iter(),
            dirents: s.dirents.into_iter(),
            targets: s.targets.into_iter(),
            xattrs: s.xattrs.into_iter(),
            orphans: s.orphans.into_iter(),
            next: Default::default(),
            last: None,
        }
    }

    /// Each kind in key order, each key once.
    pub(super) fn sorted(mut self) -> Captured {
        // Entries by directory, then hash (a comparison of two numbers mostly), then
        // name: their key order (a capture takes them by name). A copy-on-write capture
        // (`fs::cowcapture`) takes inodes out of order: every kind is sorted, each key
        // once (an inode's keys come from one `take_inode`).
        self.dirents.sort_unstable_by(|a, b| a.key.cmp(&b.key));
        // A name linked and unlinked again is noted twice, with one value.
        self.dirents.dedup_by(|a, b| a.key == b.key);
        self.inodes.sort_unstable_by_key(|n| n.key);
        self.extents.sort_unstable_by_key(|n| n.key);
        self.targets.sort_unstable_by_key(|n| n.key);
        self.xattrs.sort_unstable_by(|a, b| a.key.cmp(&b.key));
        debug_assert!(
            self.dirents.windows(2).all(|w| w[0].key < w[1].key)
                && self.inodes.windows(2).all(|w| w[0].key < w[1].key)
                && self.extents.windows(2).all(|w| w[0].key < w[1].key),
            "a key captured twice"
        );
        self
    }
}

/// Kinds of change a checkpoint makes, each its own sorted stream (`OpChunks::next`).
const KINDS: usize = 7;

/// A checkpoint's tree operations, made as they are applied.
pub struct OpChunks {
    /// The filesystem record: the first operation (its key sorts first).
    head: Vec<TreeOp>,
    deleted: std::vec::IntoIter<u64>,
    inodes: std::vec::IntoIter<Now<u64, [u8; CORE_BYTES]>>,
    extents: std::vec::IntoIter<Now<(u64, u64), (u64, u64)>>,
    dirents: std::vec::IntoIter<Now<DirentAt, Named>>,
    targets: std::vec::IntoIter<Now<u64, Vec<u8>>>,
    xattrs: std::vec::IntoIter<Now<XattrAt, Vec<u8>>>,
    orphans: std::vec::IntoIter<Now<u64, ()>>,
    /// Each kind's next operations (one key's, or the keys of one chunked value),
    /// waiting for the merge; empty when taken (or the kind is spent).
    next: [Vec<TreeOp>; KINDS],
    /// The last key handed out, to check that chunks come in key order.
    last: Option<Vec<u8>>,
}

impl OpChunks {
    /// The next operations, about `max` of them; none once all are out. They come in
    /// key order across chunks, not only within one (each kind is sorted, and the
    /// kinds are merged), so what lies below a chunk's last key is final for the
    /// checkpoint (`Tree::write_dirty_below`). No key is changed by two kinds: an
    /// inode's keys are of one kind each, and a deleted inode has no value left to put.
    pub fn next_chunk(&mut self, max: usize) -> Option<Vec<TreeOp>> {
        let mut ops = std::mem::take(&mut self.head);
        // A chunk is about `max` operations: sized once (a few over, for the last
        // key's chunked value), not doubled up to it.
        ops.reserve(max.min(2 * APPLY_CHUNK) + 4);
        while ops.len() < max {
            for kind in 0..KINDS {
                self.fill(kind);
            }
            let Some(kind) = (0..KINDS)
                .filter(|&k| !self.next[k].is_empty())
                .min_by(|&a, &b| op_key(&self.next[a][0]).cmp(op_key(&self.next[b][0])))
            else {
                break;
            };
            ops.append(&mut self.next[kind]);
        }
        if ops.is_empty() {
            return None;
        }
        debug_assert!(
            ops.windows(2).all(|w| op_key(&w[0]) <= op_key(&w[1]))
                && self.last.as_deref().is_none_or(|l| l <= op_key(&ops[0])),
            "a checkpoint's operations out of key order"
        );
        self.last = ops.last().map(|o| op_key(o).to_vec());
        Some(ops)
    }

    /// Make `kind`'s next operations if none wait.
    fn fill(&mut self, kind: usize) {
        let ops = &mut self.next[kind];
        if !ops.is_empty() {
            return;
        }
        match kind {
            0 => {
                if let Some(ino) = self.deleted.next() {
                    let mut p = vec![INODE_SPACE];
                    p.extend_from_slice(&ino.to_be_bytes());
                    ops.push(TreeOp::DelPrefix(p));
                }
            }
            1 => {
                if let Some(n) = self.inodes.next() {
                    put_or_del(ops, core_key(n.key), n.value.map(|v| v.to_vec()));
                }
            }
            2 => {
                if let Some(n) = self.extents.next() {
                    let (ino, fb) = n.key;
                    let run = n
                        .value
                        .map(|(s, l)| [s.to_le_bytes(), l.to_le_bytes()].concat());
                    put_or_del(ops, extent_key(ino, fb), run);
                }
            }
            3 => {
                if let Some(n) = self.dirents.next() {
                    let d = n.key;
                    let key = dirent_key_hashed(d.dir, d.hash, &d.name);
                    put_or_del(ops, key, n.value.map(encode_dirent));
                }
            }
            4 => {
                if let Some(n) = self.targets.next() {
                    put_chunks(ops, inode_prefix(n.key, TARGET), n.value.as_deref());
                }
            }
            5 => {
                if let Some(n) = self.xattrs.next() {
                    let x = n.key;
                    put_chunks(ops, xattr_prefix(x.ino, &x.name), n.value.as_deref());
                }
            }
            _ => {
                if let Some(n) = self.orphans.next() {
                    put_or_del(ops, orphan_key(n.key), n.value.map(|()| Vec::new()));
                }
            }
        }
    }
}

fn op_key(op: &TreeOp) -> &[u8] {
    match op {
        TreeOp::Put(k, _) | TreeOp::Del(k) | TreeOp::DelPrefix(k) => k,
    }
}

/// Every key of `meta`, as changes from an empty tree (mkfs, or an older image's first
/// tree).
pub fn all_changes(meta: &mut Meta) -> Changes {
    let mut c = Changes::default();
    for (&ino, i) in meta.resident_inodes().iter() {
        c.inodes.push(ino);
        c.extents.extend(i.extents.iter().map(|(&f, _)| (ino, f)));
        c.dirents
            .extend(i.entries.iter().map(|(n, _)| (ino, n.to_vec())));
        if i.kind == InodeKind::Symlink {
            c.targets.push(ino);
        }
        c.xattrs.extend(i.xattrs.keys().map(|n| (ino, n.clone())));
    }
    c.orphans.extend(meta.orphans.iter().copied());
    c
}

/// Apply `ops` to the tree, in order.
pub fn apply(tree: &mut Tree, store: &dyn NodeStore, ops: &[TreeOp]) -> TreeResult<()> {
    // A chunk at a time, its leaves read ahead together: ops come in key order, so a
    // chunk is one stretch of the tree.
    for chunk in ops.chunks(APPLY_CHUNK) {
        apply_sorted(tree, store, chunk)?;
    }
    Ok(())
}

/// Apply a checkpoint's captured changes, making their operations a chunk at a time.
pub fn apply_captured(tree: &mut Tree, store: &dyn NodeStore, c: Captured) -> TreeResult<()> {
    apply_captured_by(tree, store, c, APPLY_CHUNK)
}

/// `apply_captured` in chunks of about `chunk` operations (tests vary it).
pub fn apply_captured_by(
    tree: &mut Tree,
    store: &dyn NodeStore,
    c: Captured,
    chunk: usize,
) -> TreeResult<()> {
    let mut chunks = c.into_chunks();
    while let Some(chunk) = chunks.next_chunk(chunk) {
        apply_sorted(tree, store, &chunk)?;
    }
    Ok(())
}

/// What `apply_captured_with` calls after each chunk: (the tree, the chunk's number of
/// operations, its last key).
pub type AfterChunk<'a, E> = dyn FnMut(&mut Tree, usize, &[u8]) -> Result<(), E> + 'a;

/// `apply_captured`, calling `after(tree, ops, last)` after each chunk of `ops`
/// operations whose last key is `last`: the chunks come in key order, so nothing below
/// `last` changes again (`OpChunks::next_chunk`).
pub fn apply_captured_with<E: From<TreeError>>(
    tree: &mut Tree,
    store: &dyn NodeStore,
    c: Captured,
    after: &mut AfterChunk<'_, E>,
) -> Result<(), E> {
    let mut chunks = c.into_chunks();
    while let Some(chunk) = chunks.next_chunk(APPLY_CHUNK) {
        apply_sorted(tree, store, &chunk)?;
        let last = op_key(chunk.last().expect("a chunk is never empty"));
        after(tree, chunk.len(), last)?;
    }
    Ok(())
}

/// Operations sorted by key: their leaves read ahead together, then applied.
fn apply_sorted(tree: &mut Tree, store: &dyn NodeStore, ops: &[TreeOp]) -> TreeResult<()> {
    let keys: Vec<&[u8]> = ops.iter().map(op_key).collect();
    tree.prefetch_leaves(store, &keys)?;
    apply_chunk(tree, store, ops)
}

/// Operations applied per read-ahead of their leaves: a few thousand leaves at most,
/// well inside the node cache.
const APPLY_CHUNK: usize = 4096;

fn apply_chunk(tree: &mut Tree, store: &dyn NodeStore, ops: &[TreeOp]) -> TreeResult<()> {
    let mut rest = ops;
    while let Some(op) = rest.first() {
        match op {
            TreeOp::Put(..) => {
                // The run of puts from here goes in with one descent per node it lands
                // under, if in key order (the contract; else one at a time).
                let puts: Vec<(&[u8], &[u8])> = rest
                    .iter()
                    .map_while(|o| match o {
                        TreeOp::Put(k, v) => Some((k.as_slice(), v.as_slice())),
                        _ => None,
                    })
                    .collect();
                rest = &rest[puts.len()..];
                if puts.windows(2).all(|w| w[0].0 <= w[1].0) {
                    tree.insert_sorted(store, &puts)?;
                } else {
                    for (k, v) in &puts {
                        tree.insert(store, k, v)?;
                    }
                }
                continue;
            }
            TreeOp::Del(k) => {
                tree.remove(store, k)?;
            }
            TreeOp::DelPrefix(p) => {
                let mut keys = Vec::new();
                tree.for_each(store, Bound::Included(p), Bound::Unbounded, &mut |k, _| {
                    let inside = k.starts_with(p);
                    if inside {
                        keys.push(k.to_vec());
                    }
                    inside
                })?;
                for k in keys {
                    tree.remove(store, &k)?;
                }
            }
        }
        rest = &rest[1..];
    }
    Ok(())
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{0}")]
    Tree(#[from] TreeError),
    #[error("{0}")]
    Meta(#[from] MetaError),
}

fn corrupt(m: String) -> LoadError {
    LoadError::Meta(MetaError(m))
}

fn be64(b: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(b.get(..8)?.try_into().ok()?))
}

fn le64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

fn le32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// Keys decoded into the parts of metadata, in key order: a whole tree's, or one
/// inode's. Checks what decoding needs (key shapes, hashes, names, chunk order);
/// `Meta::check` finds the rest.
#[derive(Default)]
struct Parts {
    next_ino: Option<u64>,
    inodes: FxHashMap<u64, Box<Inode>>,
    /// Directory entries with their names: (directory, hash, name, what it names).
    entries: Vec<(u64, u64, Vec<u8>, Named)>,
    /// Set for a lazy volume's read back: a group whose kinds are all recorded goes
    /// cold in its directory as the scan passes it, its names never kept (a cold
    /// directory of a million entries read back allocated a million names, and kept
    /// them all at once, to drop them again).
    cold: Option<ColdGroups>,
    extents: Vec<(u64, u64, u64, u64)>,
    targets: FxHashMap<u64, Vec<u8>>,
    xattrs: Vec<(u64, Vec<u8>, Vec<u8>)>,
    orphans: BTreeSet<u64>,
    /// The chunk expected next for the value being assembled (target or xattr).
    chunk_at: Option<(Vec<u8>, u8)>,
}

/// The group of entries a lazy read back is reading, which goes cold once it ends if
/// every kind in it is recorded.
#[derive(Default)]
struct ColdGroups {
    /// The group of the last entry read: its names, in `arena`, until it ends and
    /// turns out cold (they are dropped) or not (they go to `Parts::entries`).
    open: Option<ColdGroup>,
    arena: Vec<u8>,
    names: Vec<(usize, Named)>,
    /// Set for a listing (`load_listing`): a cold group is counted here, not in its
    /// directory (there is none: the directory is in memory already).
    listing: Option<Vec<GroupRead>>,
}

/// A group of names sharing a hash.
#[derive(Clone, Copy)]
struct ColdGroup {
    dir: u64,
    hash: u64,
    names: usize,
    subdirs: u32,
}

impl ColdGroups {
    /// The entry `name` of directory `dir`, whose hash is `hash` (checked). Its
    /// directory's core record came before it (keys sort by inode, the core first).
    fn push(
        &mut self,
        dir: u64,
        hash: u64,
        name: &[u8],
        n: Named,
        out: Out<'_>,
    ) -> Result<(), LoadError> {
        if self.open.is_some_and(|g| (g.dir, g.hash) != (dir, hash)) {
            self.close(out)?;
        }
        let g = self.open.get_or_insert(ColdGroup {
            dir,
            hash,
            names: 0,
            subdirs: 0,
        });
        g.names += 1;
        g.subdirs += u32::from(n.kind == Some(InodeKind::Dir));
        self.arena.extend_from_slice(name);
        self.names.push((self.arena.len(), n));
        Ok(())
    }

    /// The open group ends: cold in its directory if every kind in it is recorded (an
    /// entry cold must say whether it names a directory), else its names go to
    /// `entries`.
    fn close(&mut self, out: Out<'_>) -> Result<(), LoadError> {
        let Some(g) = self.open.take() else {
            return Ok(());
        };
        if self.names.iter().all(|(_, n)| n.kind.is_some()) {
            if let Some(l) = self.listing.as_mut() {
                l.push(GroupRead {
                    dir: g.dir,
                    hash: g.hash,
                    names: u32::try_from(g.names).map_err(|_| {
                        corrupt(format!("directory {}: a group of {} names", g.dir, g.names))
                    })?,
                    subdirs: g.subdirs,
                });
            } else {
                let d = out.inodes.get_mut(&g.dir).ok_or_else(|| {
                    corrupt(format!("an entry of inode {}, which does not exist", g.dir))
                })?;
                d.entries.add_cold(g.hash, g.names, g.subdirs);
            }
        } else {
            let mut start = 0;
            for &(end, n) in &self.names {
                out.entries
                    .push((g.dir, g.hash, self.arena[start..end].to_vec(), n));
                start = end;
            }
        }
        self.drop_open();
        Ok(())
    }

    /// Forget the open group: closed, or left unfinished by a scan that stopped.
    fn drop_open(&mut self) {
        self.open = None;
        self.arena.clear();
        self.names.clear();
    }
}

/// Where a cold group's end puts it.
struct Out<'a> {
    inodes: &'a mut FxHashMap<u64, Box<Inode>>,
    entries: &'a mut Vec<(u64, u64, Vec<u8>, Named)>,
}

impl Parts {
    /// The keys in (`from`, `to`) of `tree`; `cold` as for `Parts::cold`.
    fn scan(
        tree: &Tree,
        store: &dyn NodeStore,
        seed: u64,
        from: Bound<&[u8]>,
        to: Bound<&[u8]>,
        cold: bool,
    ) -> Result<Parts, LoadError> {
        let mut p = Parts {
            cold: cold.then(ColdGroups::default),
            ..Parts::default()
        };
        p.scan_more(tree, store, seed, from, to, |_| true)?;
        Ok(p)
    }

    /// Add the keys in (`from`, `to`) of `tree` while `more` holds for each key; false
    /// if it stopped the scan (a cold group left open then is dropped, unfinished).
    fn scan_more(
        &mut self,
        tree: &Tree,
        store: &dyn NodeStore,
        seed: u64,
        from: Bound<&[u8]>,
        to: Bound<&[u8]>,
        mut more: impl FnMut(&[u8]) -> bool,
    ) -> Result<bool, LoadError> {
        let mut err: Option<LoadError> = None;
        let mut stopped = false;
        tree.for_each(store, from, to, &mut |k, v| {
            if !more(k) {
                stopped = true;
                return false;
            }
            match self.key(seed, k, v) {
                Ok(()) => true,
                Err(e) => {
                    err = Some(e);
                    false
                }
            }
        })?;
        if let Some(e) = err {
            return Err(e);
        }
        if let Some(c) = self.cold.as_mut() {
            if stopped {
                c.drop_open();
            } else {
                let out = Out {
                    inodes: &mut self.inodes,
                    entries: &mut self.entries,
                };
                c.close(out)?;
            }
        }
        Ok(!stopped)
    }

    /// The keys of the key spaces (first bytes) `spaces`.
    fn scan_spaces(
        tree: &Tree,
        store: &dyn NodeStore,
        seed: u64,
        spaces: std::ops::Range<u8>,
        cold: bool,
    ) -> Result<Parts, LoadError> {
        let (from, to) = ([spaces.start], [spaces.end]);
        Parts::scan(
            tree,
            store,
            seed,
            Bound::Included(&from[..]),
            Bound::Excluded(&to[..]),
            cold,
        )
    }

    fn key(&mut self, seed: u64, k: &[u8], v: &[u8]) -> Result<(), LoadError> {
        match k.first() {
            Some(&FS_RECORD) if k.len() == 1 => {
                self.next_ino =
                    Some(le64(v, 0).ok_or_else(|| corrupt("a short filesystem record".into()))?);
            }
            Some(&ORPHAN_SPACE) if k.len() == 9 => {
                self.orphans.insert(be64(&k[1..]).expect("9 bytes"));
            }
            Some(&INODE_SPACE) if k.len() >= 10 => {
                let ino = be64(&k[1..]).expect("10 bytes");
                let rest = &k[10..];
                match k[9] {
                    CORE if rest.is_empty() => {
                        self.inodes.insert(ino, Box::new(decode_core(ino, v)?));
                    }
                    EXTENT if rest.len() == 8 => {
                        let fb = be64(rest).expect("8 bytes");
                        let (Some(s), Some(l)) = (le64(v, 0), le64(v, 8)) else {
                            return Err(corrupt(format!("inode {ino}: a short extent")));
                        };
                        if v.len() != 16
                            || l == 0
                            || fb.checked_add(l).is_none()
                            || s.checked_add(l).is_none()
                        {
                            return Err(corrupt(format!(
                                "inode {ino} has a bad extent at file block {fb}"
                            )));
                        }
                        self.extents.push((ino, fb, s, l));
                    }
                    DIRENT if rest.len() > 8 => {
                        let name = &rest[8..];
                        if !valid_name(name) || be64(rest) != Some(name_hash(seed, name)) {
                            return Err(corrupt(format!("directory {ino} has an invalid entry")));
                        }
                        let c = decode_dirent(v)
                            .ok_or_else(|| corrupt(format!("directory {ino}: a bad entry")))?;
                        let hash = be64(rest).expect("checked above");
                        match self.cold.as_mut() {
                            Some(g) => {
                                let out = Out {
                                    inodes: &mut self.inodes,
                                    entries: &mut self.entries,
                                };
                                g.push(ino, hash, name, c, out)?;
                            }
                            None => self.entries.push((ino, hash, name.to_vec(), c)),
                        }
                    }
                    TARGET if rest.len() == 1 => {
                        let t = self.targets.entry(ino).or_default();
                        let want = if t.is_empty() {
                            0
                        } else {
                            t.len().div_ceil(CHUNK) as u8
                        };
                        if rest[0] != want || t.len() + v.len() > TARGET_MAX {
                            return Err(corrupt(format!("symlink {ino}: a bad target chunk")));
                        }
                        t.extend_from_slice(v);
                    }
                    XATTR if rest.len() >= 2 && rest[rest.len() - 2] == 0 => {
                        let name = &rest[..rest.len() - 2];
                        let n = rest[rest.len() - 1];
                        let same = self
                            .chunk_at
                            .as_ref()
                            .is_some_and(|(p, _)| p.as_slice() == &k[..k.len() - 1]);
                        if n == 0 {
                            self.xattrs.push((ino, name.to_vec(), v.to_vec()));
                            self.chunk_at = Some((k[..k.len() - 1].to_vec(), 1));
                        } else if same && self.chunk_at.as_ref().is_some_and(|(_, w)| *w == n) {
                            let x = self.xattrs.last_mut().expect("chunk 0 came first");
                            if x.2.len() + v.len() > XATTR_SIZE_MAX {
                                return Err(corrupt(format!(
                                    "inode {ino} has an oversized extended attribute"
                                )));
                            }
                            x.2.extend_from_slice(v);
                            self.chunk_at = Some((k[..k.len() - 1].to_vec(), n.wrapping_add(1)));
                        } else {
                            return Err(corrupt(format!(
                                "inode {ino}: an extended attribute chunk out of order"
                            )));
                        }
                    }
                    _ => return Err(corrupt(format!("an unknown key {k:02x?}"))),
                }
            }
            _ => return Err(corrupt(format!("an unknown key {k:02x?}"))),
        }
        Ok(())
    }

    /// Every inode with its extents, entries, target and attributes in place (the
    /// cold groups of a scan with `cold` are in place already).
    fn into_inodes(mut self) -> Result<FxHashMap<u64, Box<Inode>>, LoadError> {
        let orphan_of = |ino: u64| format!("inode {ino}, which does not exist");
        let inodes = &mut self.inodes;
        for (ino, fb, s, l) in self.extents {
            let i = inodes
                .get_mut(&ino)
                .ok_or_else(|| corrupt(format!("an extent of {}", orphan_of(ino))))?;
            i.extents.insert(fb, (s, l));
        }
        for (dir, h, name, Named { ino: c, kind }) in &self.entries {
            let d = inodes
                .get_mut(dir)
                .ok_or_else(|| corrupt(format!("an entry of {}", orphan_of(*dir))))?;
            if d.entries.insert_at(*h, name, *c, *kind).is_some() {
                return Err(corrupt(format!(
                    "directory {dir} holds the same name twice"
                )));
            }
        }
        for (ino, t) in self.targets {
            let i = inodes
                .get_mut(&ino)
                .ok_or_else(|| corrupt(format!("a target of {}", orphan_of(ino))))?;
            i.target = t;
        }
        for (ino, name, v) in self.xattrs {
            let i = inodes
                .get_mut(&ino)
                .ok_or_else(|| corrupt(format!("an attribute of {}", orphan_of(ino))))?;
            i.xattrs.insert(name, v);
        }
        Ok(self.inodes)
    }
}

/// An inode's own fields from its core record.
fn decode_core(ino: u64, v: &[u8]) -> Result<Inode, LoadError> {
    let kind = v
        .first()
        .copied()
        .ok_or_else(|| corrupt(format!("inode {ino}: an empty record")))?;
    let kind = InodeKind::from_u8(kind)
        .map_err(|_| corrupt(format!("inode {ino} has unknown kind {kind}")))?;
    if v.len() != CORE_BYTES && v.len() != CORE_BYTES_V4 {
        return Err(corrupt(format!(
            "inode {ino}: a record of {} bytes",
            v.len()
        )));
    }
    let f = |at| le32(v, at).expect("a whole record");
    let g = |at| le64(v, at).expect("a whole record");
    let mut i = Inode::new_loaded(kind, f(1), f(5), f(9));
    i.links = f(13);
    i.size = g(17);
    i.atime_ns = g(25);
    i.mtime_ns = g(33);
    i.ctime_ns = g(41);
    i.rdev = f(49);
    if v.len() == CORE_BYTES {
        i.parent = g(53);
        i.subdirs = f(61);
    }
    Ok(i)
}

/// The metadata a tree holds. `used` are blocks the tree's own nodes take, so the free
/// space is the data area less them and every extent.
pub fn load(
    tree: &Tree,
    store: &dyn NodeStore,
    seed: u64,
    used: &[u64],
    data_start: u64,
    nr_blocks: u64,
) -> Result<Meta, LoadError> {
    let mut parts = Parts::scan(tree, store, seed, Bound::Unbounded, Bound::Unbounded, false)?;
    let next_ino = parts
        .next_ino
        .ok_or_else(|| corrupt("no filesystem record".into()))?;
    let orphans = std::mem::take(&mut parts.orphans);
    let mut inodes = parts.into_inodes()?;
    if !inodes.contains_key(&ROOT_INO) {
        return Err(corrupt("the root directory is missing".into()));
    }
    // Format 5 records each directory's parent and subdirectory count, which the
    // entries naming it say too: derived again here, they must agree.
    let stored: Vec<(u64, u64, u32)> = inodes
        .iter_mut()
        .filter(|(_, i)| i.is_dir() && (i.parent, i.subdirs) != (0, 0))
        .map(|(&ino, i)| {
            let s = (ino, i.parent, i.subdirs);
            (i.parent, i.subdirs) = (0, 0);
            s
        })
        .collect();
    let meta = Meta::assemble(inodes, next_ino, orphans, used, data_start, nr_blocks, seed)?;
    for (ino, parent, subdirs) in stored {
        let i = meta.resident(ino).expect("loaded");
        if (i.parent, i.subdirs) != (parent, subdirs) {
            return Err(corrupt(format!(
                "directory {ino} records parent {parent} and {subdirs} subdirectories, but \
                 its entries say parent {} and {}",
                i.parent, i.subdirs
            )));
        }
    }
    Ok(meta)
}

/// What mount needs of a format 5 tree, read without reading it whole: the next inode
/// number, the orphans, and (from the root record) the inode count and free space.
/// Inodes are read on demand (`fs::inodes`).
pub fn load_lazy(
    tree: &Tree,
    store: &dyn NodeStore,
    seed: u64,
    space: &SpaceRecord,
    data_start: u64,
    nr_blocks: u64,
) -> Result<Meta, LoadError> {
    let fs = tree.get(store, &[FS_RECORD])?;
    let next_ino = fs
        .as_deref()
        .and_then(|v| le64(v, 0).filter(|_| v.len() == 8))
        .ok_or_else(|| corrupt("no filesystem record, or a bad one".into()))?;
    let parts = Parts::scan_spaces(tree, store, seed, ORPHAN_SPACE..ORPHAN_SPACE + 1, false)?;
    let free = FreeSpace::from_extents(data_start, nr_blocks, space.free.iter().copied())
        .map_err(|e| corrupt(format!("the checkpoint's free space: {e}")))?;
    Ok(Meta::lazy(
        next_ino,
        space.nr_inodes,
        parts.orphans,
        free,
        seed,
    ))
}

/// One inode as the tree holds it (none: not there), with its extents, entries, target
/// and attributes; a directory's parent and subdirectory count as format 5 records
/// them (a format 4 tree is only ever read whole, which derives them). A directory of
/// more than `listed_max` groups of names comes back unlisted (`LISTED_MAX` unless
/// the `dir_listed_max` knob says otherwise).
pub fn load_inode(
    tree: &Tree,
    store: &dyn NodeStore,
    seed: u64,
    ino: u64,
    listed_max: usize,
) -> Result<Option<Inode>, LoadError> {
    let key = |sub: u8| inode_prefix(ino, sub);
    let end = ino
        .checked_add(1)
        .map(|next| inode_prefix(next, CORE)[..9].to_vec());
    let mut p = Parts {
        cold: Some(ColdGroups::default()),
        ..Parts::default()
    };
    let (dirents, xattrs) = (key(DIRENT), key(XATTR));
    // Its core, target and extents.
    let all = |_: &[u8]| true;
    p.scan_more(
        tree,
        store,
        seed,
        Bound::Included(&key(CORE)[..9]),
        Bound::Excluded(&dirents),
        all,
    )?;
    // Its entries, listed up to `listed_max` groups; past that the directory comes
    // back unlisted (`Dir::unlisted`), its entries read back by hash as they are met.
    let listed = p.scan_more(
        tree,
        store,
        seed,
        Bound::Included(&dirents),
        Bound::Excluded(&xattrs),
        groups_up_to(listed_max),
    )?;
    if !listed {
        let d = (p.inodes.get_mut(&ino))
            .ok_or_else(|| corrupt(format!("entries of inode {ino}, which does not exist")))?;
        d.entries = super::dir::Dir::unlisted();
        p.entries.retain(|e| e.0 != ino);
    }
    // Its extended attributes.
    let to = end.as_deref().map_or(Bound::Unbounded, Bound::Excluded);
    p.scan_more(tree, store, seed, Bound::Included(&xattrs), to, all)?;
    let mut inodes = p.into_inodes()?;
    Ok(inodes.remove(&ino).map(|b| *b))
}

/// For `Parts::scan_more` over one directory's entries: true for the keys of its
/// first `cap` groups of names sharing a hash.
fn groups_up_to(cap: usize) -> impl FnMut(&[u8]) -> bool {
    let (mut groups, mut last) = (0usize, None);
    move |k| {
        // A dirent key: the inode's 10-byte prefix, then the name's hash.
        let h = k.get(10..).and_then(be64);
        if h != last {
            groups += 1;
            last = h;
        }
        groups <= cap
    }
}

/// The default most groups of entries a directory read back (`load_inode`) is listed with: a
/// larger one comes back unlisted, since listing it reads every entry (about 20 a
/// node: 4,096 groups are some 200 nodes, a few milliseconds).
pub const LISTED_MAX: usize = 4096;

/// Every inode the tree holds, as `load_inode` reads each.
pub fn load_files(
    tree: &Tree,
    store: &dyn NodeStore,
    seed: u64,
) -> Result<Vec<(u64, Inode)>, LoadError> {
    let parts = Parts::scan_spaces(tree, store, seed, INODE_SPACE..ORPHAN_SPACE, true)?;
    Ok(parts
        .into_inodes()?
        .into_iter()
        .map(|(ino, i)| (ino, *i))
        .collect())
}

/// The entries of directory `dir` whose hashes are in `asked` (`from..=to`, the first
/// `max_groups` groups of it if set), in key order (a lazy volume's cold groups:
/// `fs::dir`).
pub fn load_dirents(
    tree: &Tree,
    store: &dyn NodeStore,
    seed: u64,
    dir: u64,
    asked: Cold,
) -> Result<Vec<DirentRead>, LoadError> {
    let lo = dirent_key_hashed(dir, asked.from, &[]);
    let hi = match asked.to.checked_add(1) {
        Some(next) => dirent_key_hashed(dir, next, &[]),
        None => inode_prefix(dir, DIRENT + 1),
    };
    let mut p = Parts::default();
    let cap = asked.max_groups.map_or(usize::MAX, |n| n.get() as usize);
    let to = Bound::Excluded(&hi[..]);
    p.scan_more(
        tree,
        store,
        seed,
        Bound::Included(&lo),
        to,
        groups_up_to(cap),
    )?;
    Ok(dirents_read(p.entries))
}

fn dirents_read(entries: Vec<(u64, u64, Vec<u8>, Named)>) -> Vec<DirentRead> {
    entries
        .into_iter()
        .map(|(d, hash, name, Named { ino, kind })| DirentRead {
            dir: d,
            hash,
            name,
            ino,
            kind,
        })
        .collect()
}

/// The listing of directory `dir` (an unlisted one's: `fs::dir::ALL`): each group of
/// entries counted, its names dropped as the scan passes it, unless a kind in it is
/// not recorded (format 4), whose names come back whole.
pub fn load_listing(
    tree: &Tree,
    store: &dyn NodeStore,
    seed: u64,
    dir: u64,
) -> Result<DirentsFound, LoadError> {
    let mut p = Parts {
        cold: Some(ColdGroups {
            listing: Some(Vec::new()),
            ..ColdGroups::default()
        }),
        ..Parts::default()
    };
    let (from, to) = (inode_prefix(dir, DIRENT), inode_prefix(dir, DIRENT + 1));
    let all = |_: &[u8]| true;
    p.scan_more(
        tree,
        store,
        seed,
        Bound::Included(&from),
        Bound::Excluded(&to),
        all,
    )?;
    let groups = p.cold.and_then(|c| c.listing).expect("set above");
    let entries = dirents_read(p.entries);
    Ok(DirentsFound {
        parts: vec![AskPart {
            entries: entries.len(),
            groups: groups.len(),
        }],
        entries,
        groups,
    })
}

const ROOT_MAGIC: u32 = 0x5452_4257; // "WBRT"
/// Format 5's record: the root, then what mount needs without reading the tree whole.
const ROOT2_MAGIC: u32 = 0x3252_4257; // "WBR2"

/// A tree checkpoint's record in its slot: where the tree's root is (none: an empty
/// tree), and from format 5 what mount needs without reading every inode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RootRecord {
    pub root: Option<Root>,
    /// None: format 4 (mount reads the tree whole and derives these).
    pub space: Option<SpaceRecord>,
}

/// The state the tree holds, summed up: its inode count and its free space (the data
/// area less every extent and every node of the tree).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpaceRecord {
    pub nr_inodes: u64,
    pub free: Vec<(u64, u64)>,
}

/// A checkpoint slot's image of a tree checkpoint (`RootRecord`).
pub fn encode_root(r: &RootRecord) -> Vec<u8> {
    let magic = if r.space.is_some() {
        ROOT2_MAGIC
    } else {
        ROOT_MAGIC
    };
    let mut v = magic.to_le_bytes().to_vec();
    match r.root {
        None => v.push(0),
        Some(r) => {
            v.push(1);
            v.extend_from_slice(&r.ptr.block.to_le_bytes());
            v.extend_from_slice(&r.ptr.crc.to_le_bytes());
            v.extend_from_slice(&r.ptr.seq.to_le_bytes());
            v.push(r.level);
        }
    }
    if let Some(s) = &r.space {
        v.extend_from_slice(&s.nr_inodes.to_le_bytes());
        v.extend_from_slice(&(s.free.len() as u64).to_le_bytes());
        for (start, len) in &s.free {
            v.extend_from_slice(&start.to_le_bytes());
            v.extend_from_slice(&len.to_le_bytes());
        }
    }
    v
}

pub fn decode_root(b: &[u8]) -> Result<RootRecord, MetaError> {
    let bad = |m: &str| MetaError(format!("checkpoint root record: {m}"));
    let v2 = match le32(b, 0) {
        Some(ROOT_MAGIC) => false,
        Some(ROOT2_MAGIC) => true,
        _ => return Err(bad("not a tree root record")),
    };
    let (root, at) = match b.get(4) {
        Some(0) => (None, 5),
        Some(1) if b.len() >= 26 => (
            Some(Root {
                ptr: ChildPtr {
                    block: le64(b, 5).expect("26 bytes"),
                    crc: le32(b, 13).expect("26 bytes"),
                    seq: le64(b, 17).expect("26 bytes"),
                },
                level: b[25],
            }),
            26,
        ),
        _ => return Err(bad("a bad root flag or a short record")),
    };
    if !v2 {
        if b.len() != at {
            return Err(bad("a record of the wrong length"));
        }
        return Ok(RootRecord { root, space: None });
    }
    let (Some(nr_inodes), Some(n)) = (le64(b, at), le64(b, at + 8)) else {
        return Err(bad("a short record"));
    };
    // Bounded by the bytes that hold them before anything is allocated.
    let rest = (b.len() - (at + 16).min(b.len())) as u64;
    if n.checked_mul(16) != Some(rest) {
        return Err(bad(&format!("{n} free extents in {rest} bytes")));
    }
    let free = (0..n as usize)
        .map(|k| {
            let o = at + 16 + 16 * k;
            (
                le64(b, o).expect("counted"),
                le64(b, o + 8).expect("counted"),
            )
        })
        .collect();
    Ok(RootRecord {
        root,
        space: Some(SpaceRecord { nr_inodes, free }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// A walk of `of_inode` and `holds` with one cursor, in any order of inodes,
        /// finds what a binary search of the whole list finds.
        #[test]
        fn the_cursor_finds_what_a_search_finds(
            mut list in prop::collection::vec(0u64..200, 0..300),
            mut asks in prop::collection::vec(0u64..210, 0..60),
            in_order in any::<bool>(),
        ) {
            list.sort_unstable();
            if in_order {
                asks.sort_unstable();
            }
            let pairs: Vec<(u64, u64)> = list.iter().enumerate().map(|(n, &i)| (i, n as u64)).collect();
            let mut set = list.clone();
            set.dedup();
            let (mut at_pairs, mut at_set) = (0, 0);
            for ino in asks {
                let lo = pairs.partition_point(|p| p.0 < ino);
                let hi = pairs.partition_point(|p| p.0 <= ino);
                prop_assert_eq!(of_inode(&pairs, &mut at_pairs, ino, |p| p.0), &pairs[lo..hi]);
                prop_assert_eq!(holds(&set, &mut at_set, ino), set.binary_search(&ino).is_ok());
            }
        }
    }

    #[test]
    fn the_last_inode_number_has_no_successor_to_seek() {
        let v = [(u64::MAX - 1, 0u64), (u64::MAX, 1), (u64::MAX, 2)];
        let mut at = 0;
        assert_eq!(of_inode(&v, &mut at, u64::MAX, |p| p.0), &v[1..]);
        assert_eq!(at, 3);
    }
}
