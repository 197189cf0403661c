//! Format 4's checkpoint: the metadata tree (`fs::btree`, keys of `fs::metatree`)
//! brought up to date with what changed since the last checkpoint, written
//! copy-on-write, and a small root record in the checkpoint slot. A checkpoint costs
//! what changed, and no slot caps the metadata.
//!
//! Order, at a checkpoint of transaction T (the committer; nothing else commits
//! meanwhile, so the journal is restarted only after T's state is durable):
//! 1. under `st`, at T's close: the changed keys' current values
//!    (`metatree::capture`);
//! 2. without `st`: their operations made and applied to the tree a chunk at a time,
//!    each chunk's leaves read ahead together, the dirty nodes written to blocks taken
//!    from the allocator (plain writes);
//! 3. the root record into the older slot with PREFLUSH|FUA: the nodes are durable
//!    before it, it before anything that relies on it;
//! 4. only then the blocks of the nodes it replaced go back to the allocator: until
//!    the new root was durable, a crash would have used the old one. In the same step
//!    (under `st`) the inode cache reads back from the new root (`DurableTree`), and
//!    may drop the inodes whose changes it holds (`fs::inodes`).

use super::alloc::FreeSpace;
use super::btree::store::DeviceStore;
use super::btree::{Root, Tree, TreeError, TreeResult};
use super::dir;
use super::error::{FsError, FsResult};
use super::format::Checkpoint;
use super::inodes::{AskPart, DirMiss, DirentsFound, DirentsRead, InodeSource, Read};
use super::meta::Meta;
use super::metatree::{self, Captured, RootRecord, SpaceRecord};
use crate::block::RequestQueue;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Node size of the metadata tree: one block.
pub const NODE_SIZE: usize = 4096;
/// Bytes of tree nodes kept in memory (written or read), beyond the dirty ones.
pub const NODE_CACHE_BYTES: usize = 128 << 20;
/// Nodes a checkpoint sends to the device at a time (4 MiB).
const WRITE_BATCH: usize = 1024;
/// Changes a checkpoint applies between writes of the nodes it is done with: at most
/// about as many dirty leaves (64 MiB) wait in memory.
const EARLY_WRITE_OPS: usize = 16384;

/// The volume's tree, its nodes' store, and where the next node goes.
pub(super) struct MetaTree {
    pub tree: Tree,
    pub store: Arc<DeviceStore>,
    cursor: u64,
    durable: Arc<DurableTree>,
}

/// The tree as its last durable root has it: where the inode cache reads back inodes
/// it dropped (`fs::inodes`), while the committer changes `MetaTree::tree` for the next
/// checkpoint. A durable root's nodes stay on disk until the next root is durable, and
/// the root moves only in `MetaTree::release`, under `st`, as every read back runs: a
/// read never meets a node block already given back.
pub(super) struct DurableTree {
    fs_id: u64,
    store: Arc<DeviceStore>,
    /// The root, and the inode cache's durable generation it holds.
    root: Mutex<(Option<Root>, u64)>,
    /// Directories of more groups of names come back unlisted (`metatree::load_inode`;
    /// the `dir_listed_max` knob).
    listed_max: Arc<AtomicUsize>,
}

impl DurableTree {
    fn tree(&self) -> (FsResult<Tree>, u64) {
        let (root, gen) = *self.root.lock();
        (
            Tree::open(self.fs_id, NODE_SIZE, root).map_err(tree_err),
            gen,
        )
    }
}

/// A read back's error: EIO when the device failed a read (as a data read's), a
/// corruption naming `what` otherwise.
fn read_back_err(what: &str, e: metatree::LoadError) -> FsError {
    match e {
        metatree::LoadError::Tree(TreeError::Io { .. }) => FsError::Io,
        other => FsError::Corrupt(format!("{what}: {other}")),
    }
}

impl InodeSource for DurableTree {
    fn read_inodes(&self, inos: &[u64]) -> Read {
        let (tree, gen) = self.tree();
        let inodes = tree.and_then(|t| {
            let mut out = Vec::with_capacity(inos.len());
            for &ino in inos {
                // Names are hashed with the fs_id as seed (`Meta::name_seed`).
                let listed_max = self.listed_max.load(Ordering::Relaxed);
                let i = metatree::load_inode(&t, &*self.store, self.fs_id, ino, listed_max)
                    .map_err(|e| read_back_err(&format!("reading inode {ino} back"), e))?;
                out.extend(i.map(|i| (ino, i)));
            }
            Ok(out)
        });
        Read { gen, inodes }
    }

    fn read_dirents(&self, asked: &[DirMiss]) -> DirentsRead {
        let (tree, gen) = self.tree();
        let found = tree.and_then(|t| {
            let mut out = DirentsFound::default();
            for m in asked {
                let store = &*self.store;
                let err = |e| read_back_err(&format!("reading directory {} back", m.dir), e);
                if m.cold == dir::ALL {
                    let l = metatree::load_listing(&t, store, self.fs_id, m.dir).map_err(err)?;
                    out.entries.extend(l.entries);
                    out.groups.extend(l.groups);
                    out.parts.extend(l.parts);
                } else {
                    let e = metatree::load_dirents(&t, store, self.fs_id, m.dir, m.cold)
                        .map_err(err)?;
                    out.parts.push(AskPart {
                        entries: e.len(),
                        groups: 0,
                    });
                    out.entries.extend(e);
                }
            }
            Ok(out)
        });
        DirentsRead { gen, found }
    }

    fn read_all(&self) -> Read {
        let (tree, gen) = self.tree();
        let inodes = tree.and_then(|t| {
            metatree::load_files(&t, &*self.store, self.fs_id)
                .map_err(|e| read_back_err("reading the inodes back", e))
        });
        Read { gen, inodes }
    }
}

/// What `MetaTree::write` did: the new root, the blocks of the nodes it replaced (free
/// once the root is durable), and the bytes of nodes written.
#[derive(Default)]
pub(super) struct TreeWrite {
    pub root: Option<Root>,
    pub freed: Vec<u64>,
    pub bytes: u64,
    /// The blocks the written nodes took.
    pub new: Vec<u64>,
}

fn load_err(e: metatree::LoadError) -> FsError {
    match e {
        metatree::LoadError::Tree(t) => tree_err(t),
        metatree::LoadError::Meta(m) => FsError::Corrupt(m.0),
    }
}

impl From<TreeError> for FsError {
    fn from(e: TreeError) -> FsError {
        tree_err(e)
    }
}

fn tree_err(e: TreeError) -> FsError {
    match e {
        TreeError::Format(f) => FsError::Format(f),
        TreeError::NoSpace(_) => FsError::NoSpace,
        TreeError::Io { .. } => FsError::Io,
        other => FsError::Corrupt(other.to_string()),
    }
}

impl MetaTree {
    pub fn open(
        q: Arc<RequestQueue>,
        fs_id: u64,
        data: std::ops::Range<u64>,
        root: Option<Root>,
    ) -> FsResult<MetaTree> {
        let cursor = data.start;
        let store = Arc::new(DeviceStore::new(q, NODE_SIZE, data, NODE_CACHE_BYTES));
        Ok(MetaTree {
            tree: Tree::open(fs_id, NODE_SIZE, root).map_err(tree_err)?,
            durable: Arc::new(DurableTree {
                fs_id,
                store: store.clone(),
                // Generation 0: what the inode cache counts as durable before its first
                // checkpoint.
                root: Mutex::new((root, 0)),
                listed_max: Arc::new(AtomicUsize::new(metatree::LISTED_MAX)),
            }),
            store,
            cursor,
        })
    }

    /// Every node of the durable tree checked (levels, key fences, no block twice), and
    /// the metadata it holds (mount and fsck).
    pub fn load(&self, seed: u64, data_start: u64, nr_blocks: u64) -> FsResult<Meta> {
        let blocks = self.tree.check(&*self.store).map_err(tree_err)?;
        metatree::load(
            &self.tree,
            &*self.store,
            seed,
            &blocks,
            data_start,
            nr_blocks,
        )
        .map_err(load_err)
    }

    /// What mount needs of a format 5 tree, without reading it whole
    /// (`metatree::load_lazy`).
    pub fn load_lazy(
        &self,
        space: &SpaceRecord,
        data_start: u64,
        nr_blocks: u64,
    ) -> FsResult<Meta> {
        metatree::load_lazy(
            &self.tree,
            &*self.store,
            self.durable.fs_id,
            space,
            data_start,
            nr_blocks,
        )
        .map_err(load_err)
    }

    /// Apply the captured changes, write the dirty nodes to blocks `alloc(goal, n)`
    /// gives (near the last ones), and return the new root and the blocks of the nodes
    /// it replaced. The changes go in key order, and every `EARLY_WRITE_OPS` the nodes
    /// below the last one applied are written: a checkpoint holds about that many
    /// changes' nodes in memory, not all of its own (a million new files in a thousand
    /// directories dirty every leaf of their entries).
    pub fn write(
        &mut self,
        changes: Captured,
        seq: u64,
        alloc: &mut dyn FnMut(u64, usize) -> FsResult<Vec<u64>>,
    ) -> FsResult<TreeWrite> {
        let mut early = TreeWrite::default();
        let mut applied = 0;
        let (store, cursor) = (&self.store, &mut self.cursor);
        metatree::apply_captured_with(
            &mut self.tree,
            &**store,
            changes,
            &mut |tree: &mut Tree, ops: usize, last: &[u8]| -> FsResult<()> {
                applied += ops;
                if applied < EARLY_WRITE_OPS {
                    return Ok(());
                }
                applied = 0;
                let n = tree.dirty_nodes_below(last);
                write_dirty(store, cursor, n, alloc, &mut early, tree, &mut |t, a, w| {
                    t.write_dirty_below(last, seq, a, w)
                })
            },
        )?;
        let mut w = self.write_nodes(seq, alloc)?;
        w.bytes += early.bytes;
        early.new.append(&mut w.new);
        w.new = early.new;
        Ok(w)
    }

    /// Write the dirty nodes (changes applied already, as mount's replay does) as
    /// `write` does.
    pub fn write_nodes(
        &mut self,
        seq: u64,
        alloc: &mut dyn FnMut(u64, usize) -> FsResult<Vec<u64>>,
    ) -> FsResult<TreeWrite> {
        let n = self.tree.dirty_nodes();
        let mut out = TreeWrite::default();
        let mut root = None;
        let mut freed = Vec::new();
        write_dirty(
            &self.store,
            &mut self.cursor,
            n,
            alloc,
            &mut out,
            &mut self.tree,
            &mut |t, a, w| {
                let written = t.write_dirty(seq, a, w)?;
                root = written.root;
                freed = written.freed;
                Ok(written.nodes)
            },
        )?;
        out.root = root;
        out.freed = freed;
        Ok(out)
    }

    /// Where `meta`'s inode cache reads back what it dropped.
    pub fn source(&self) -> Arc<dyn InodeSource> {
        self.durable.clone()
    }

    /// The `dir_listed_max` knob, shared with the read backs.
    pub fn listed_max(&self) -> Arc<AtomicUsize> {
        self.durable.listed_max.clone()
    }

    /// The new root of `w` is durable, holding the changes of generation `gen`: the
    /// blocks of the nodes it replaced go back to `meta`'s allocator, their cached bytes
    /// are no nodes any more, and inodes are read back from it. Under `st`.
    pub fn release(&self, meta: &mut Meta, w: &TreeWrite, gen: u64) -> FsResult<()> {
        *self.durable.root.lock() = (w.root, gen);
        meta.gen_durable(gen);
        free_nodes(meta, &w.freed)?;
        for &b in &w.freed {
            self.store.forget(b);
        }
        Ok(())
    }
}

/// The checkpoint record of tree write `w`: its root, as checkpoint `seq` of
/// transaction `tid` (the journal starts over after it), and from format 5 the space
/// of the state it holds. `space` was taken with the changes, when the nodes of the
/// tree before were in use and this write's were not: it is brought to the new tree
/// (its nodes taken, the nodes they replaced free).
pub(super) fn root_record(
    fs_id: u64,
    seq: u64,
    tid: u64,
    journal_pos: u64,
    w: &TreeWrite,
    space: Option<SpaceRecord>,
    data: std::ops::Range<u64>,
) -> FsResult<Vec<u8>> {
    Ok(Checkpoint {
        fs_id,
        seq,
        tid,
        journal_pos,
        image: root_image(seq, w, space, data)?,
    }
    .encode())
}

/// `root_record`'s image: the root record alone.
pub(super) fn root_image(
    seq: u64,
    w: &TreeWrite,
    space: Option<SpaceRecord>,
    data: std::ops::Range<u64>,
) -> FsResult<Vec<u8>> {
    let space = match space {
        None => None,
        Some(s) => {
            let bad = |e: super::alloc::AllocError| {
                FsError::Corrupt(format!("the free space of checkpoint {seq}: {e}"))
            };
            let mut free = FreeSpace::from_extents(data.start, data.end, s.free).map_err(bad)?;
            for &b in &w.new {
                free.alloc_exact(b, 1).map_err(bad)?;
            }
            for &b in &w.freed {
                free.free(b, 1).map_err(bad)?;
            }
            Some(SpaceRecord {
                nr_inodes: s.nr_inodes,
                free: free.extents().collect(),
            })
        }
    };
    Ok(metatree::encode_root(&RootRecord {
        root: w.root,
        space,
    }))
}

/// Blocks kept from writes for tree nodes: a journal's worth (a checkpoint's dirty
/// nodes grow with the records since the last one, which the journal bounds), at
/// least 64.
pub fn meta_reserve(journal_blocks: u64) -> u64 {
    journal_blocks.max(64)
}

/// What the next checkpoint's need for node blocks (`Meta::checkpoint_need_blocks`)
/// asks of a volume with `headroom` blocks tree nodes may take: `due` past half of it
/// (the committer checkpoints now), `tight` past three quarters (operations wait for
/// a checkpoint before changing more). Nothing changed, nothing is asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckpointRoom {
    pub due: bool,
    pub tight: bool,
}

pub fn checkpoint_room(changed: usize, need: u64, headroom: u64) -> CheckpointRoom {
    let asks = changed > 0;
    CheckpointRoom {
        due: asks && need * 2 > headroom,
        tight: asks && need * 4 > headroom * 3,
    }
}

/// `n` blocks for tree nodes from `meta`'s allocator near `goal` (the metadata
/// reserve included), leaving the data cursor where it was: nodes gather together,
/// data keeps its own placement.
pub(super) fn alloc_nodes(meta: &mut Meta, goal: u64, n: usize) -> FsResult<Vec<u64>> {
    let ext = meta
        .alloc
        .alloc_meta(n as u64, goal)
        .map_err(|_| FsError::NoSpace)?;
    let blocks: Vec<u64> = ext.iter().flat_map(|&(s, l)| s..s + l).collect();
    meta.nodes_taken(&blocks)
        .map_err(|e| FsError::Corrupt(e.0))?;
    Ok(blocks)
}

/// The way `write_dirty` writes nodes: `Tree::write_dirty` or `write_dirty_below`,
/// given where each node goes and where its bytes go; returns the nodes written.
type WriteNodes<'a> = dyn FnMut(
        &mut Tree,
        &mut dyn FnMut() -> TreeResult<u64>,
        &mut dyn FnMut(u64, Vec<u8>) -> TreeResult<()>,
    ) -> TreeResult<usize>
    + 'a;

/// Take `n` blocks from `alloc` (near `cursor`, which moves past them) and let `how`
/// write that many dirty nodes of `tree` to them, in batches through `store`; counted
/// into `out` (bytes, new blocks).
fn write_dirty(
    store: &DeviceStore,
    cursor: &mut u64,
    n: usize,
    alloc: &mut dyn FnMut(u64, usize) -> FsResult<Vec<u64>>,
    out: &mut TreeWrite,
    tree: &mut Tree,
    how: &mut WriteNodes<'_>,
) -> FsResult<()> {
    let mut blocks = if n > 0 {
        alloc(*cursor, n)?
    } else {
        Vec::new()
    };
    debug_assert_eq!(blocks.len(), n);
    if let Some(&last) = blocks.iter().max() {
        *cursor = last + 1;
    }
    out.new.extend_from_slice(&blocks);
    blocks.reverse();
    // Sent a batch at a time as they are encoded: a checkpoint's nodes are held once
    // (in memory as nodes, or as bytes in flight), not in every form at once.
    let mut batch: Vec<(u64, Vec<u8>)> = Vec::with_capacity(WRITE_BATCH);
    let written = how(
        tree,
        &mut || {
            blocks
                .pop()
                .ok_or_else(|| TreeError::NoSpace("fewer blocks than dirty nodes".into()))
        },
        &mut |b, bytes| {
            batch.push((b, bytes));
            if batch.len() < WRITE_BATCH {
                return Ok(());
            }
            store.write(std::mem::take(&mut batch))
        },
    )
    .map_err(tree_err)?;
    store.write(batch).map_err(tree_err)?;
    debug_assert_eq!(written, n, "dirty nodes counted and written differ");
    debug_assert!(blocks.is_empty(), "blocks taken for nodes left unused");
    out.bytes += (written * NODE_SIZE) as u64;
    Ok(())
}

/// Give the blocks of replaced nodes back (their new root is durable).
fn free_nodes(meta: &mut Meta, blocks: &[u64]) -> FsResult<()> {
    meta.nodes_freed(blocks).map_err(|e| FsError::Corrupt(e.0))
}

#[cfg(test)]
mod full_volume_tests {
    use crate::block::RequestQueue;
    use crate::fs::error::FsError;
    use crate::fs::volume::{MountOptions, SetAttr, Volume};

    /// Metadata changes alone on a volume writes have filled: the checkpoints they
    /// need (each takes all its new nodes' blocks before it frees the old) find room,
    /// so unmount and the next mount succeed, and nothing is lost.
    /// A checkpoint that took its changes keeps the blocks its nodes may need from
    /// writes until it took them: taking the changes emptied `open_changed`, and a
    /// filling write could take those blocks first (the checkpoint then failed for
    /// space and the volume went read-only; the test below hit it under load).
    #[test]
    fn a_captured_checkpoint_keeps_its_room_until_its_nodes_take_it() {
        let v = crate::fs::volume::test_volume(|_| {});
        for i in 0..2000 {
            v.create(&format!("/f{i}")).unwrap().close().unwrap();
        }
        let mut st = v.vol.st.lock();
        st.refresh_meta_pending();
        let before = st.meta.alloc.available();
        let need = st.meta.checkpoint_need_blocks();
        assert!(need > 2000, "2000 new inodes need {need} blocks");
        let gen = st.meta.take_checkpoint_changes().gen;
        st.refresh_meta_pending();
        assert_eq!(st.meta.open_changed(), 0);
        assert_eq!(
            st.meta.checkpoint_need_blocks(),
            need + 32,
            "its need, and the root path's"
        );
        assert_eq!(
            st.meta.alloc.available() + 32,
            before,
            "writes got the checkpoint's room"
        );
        st.meta.checkpoint_nodes_taken(gen);
        st.refresh_meta_pending();
        // Given back (the nodes' own blocks are the tree's from now on).
        assert_eq!(st.meta.checkpoint_need_blocks(), 32);
        assert!(
            st.meta.alloc.available() > before,
            "its room still kept after its nodes took it: {} of {before}",
            st.meta.alloc.available()
        );
        drop(st);
        v.unmount().unwrap();
    }

    #[test]
    fn metadata_changes_on_a_volume_writes_filled_still_checkpoint_and_mount() {
        let q = RequestQueue::open("sim:ssd,size=64M", crate::block::QueueConfig::default())
            .expect("a simulated device");
        Volume::mkfs(&q, &crate::fs::mkfs::MkfsOptions::default()).expect("mkfs");
        let mut o = MountOptions::default();
        o.wb.dirty_writeback_centisecs = 0;
        o.commit_interval_ms = 3_600_000;
        let v = Volume::mount(q.clone(), o.clone()).expect("mount");
        const FILES: usize = 20_000;
        for d in 0..4 {
            v.mkdir(&format!("/d{d}"), 0o755).unwrap();
        }
        for i in 0..FILES {
            v.create(&format!("/d{}/f{i}", i % 4))
                .unwrap()
                .close()
                .unwrap();
        }
        v.sync().unwrap();
        // Writes take every block they may.
        let fill = v.create("/fill").unwrap();
        let chunk = vec![7u8; 256 << 10];
        let mut filled = 0u64;
        loop {
            match fill.write_at(filled, &chunk) {
                Ok(0) => break,
                Ok(n) => filled += n as u64,
                Err(FsError::NoSpace) => break,
                Err(e) => panic!("filling: {e}"),
            }
        }
        if let Err(e) = fill.fsync() {
            let st = v.vol.st.lock();
            panic!(
                "fsync of the filled file: {e:?}; aborted: {:?}; journal: {:?}; \
                 statfs {:?}; volume errseq {}",
                st.aborted,
                v.vol.jn.lock().error,
                st.meta.alloc.statfs(),
                v.vol.sb_err.raw(),
            );
        }
        fill.close().unwrap();
        assert!(filled > 16 << 20, "only {filled} bytes written");
        // Full but for what the fixed reserve and the next checkpoint keep.
        assert!(v.statfs().available < 1024, "{:?}", v.statfs());
        // Scattered changes of metadata alone, each inode's leaf its own.
        for i in (0..FILES).step_by(40) {
            let a = SetAttr {
                mode: Some(0o600),
                ..Default::default()
            };
            v.set_attr(&format!("/d{}/f{i}", i % 4), &a).unwrap();
        }
        v.unmount().expect("unmount's checkpoint");
        let v = Volume::mount(q, o).expect("mount after");
        for i in (0..FILES).step_by(40) {
            let st = v.stat(&format!("/d{}/f{i}", i % 4)).unwrap();
            assert_eq!(st.mode & 0o7777, 0o600, "file {i}");
        }
        assert_eq!(v.stat("/fill").unwrap().size, filled);
        assert!(v.check().is_empty(), "{:?}", v.check());
        v.unmount().unwrap();
    }
}
