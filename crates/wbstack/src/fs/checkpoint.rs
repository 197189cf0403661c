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
use super::btree::{Root, Tree, TreeError};
use super::error::{FsError, FsResult};
use super::format::Checkpoint;
use super::inodes::{InodeSource, Read};
use super::meta::{Meta, MetaError};
use super::metatree::{self, Captured, RootRecord, SpaceRecord};
use crate::block::RequestQueue;
use parking_lot::Mutex;
use std::sync::Arc;

/// Node size of the metadata tree: one block.
pub const NODE_SIZE: usize = 4096;
/// Bytes of tree nodes kept in memory (written or read), beyond the dirty ones.
pub const NODE_CACHE_BYTES: usize = 128 << 20;
/// Nodes a checkpoint sends to the device at a time (4 MiB).
const WRITE_BATCH: usize = 1024;

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
}

impl DurableTree {
    fn tree(&self) -> (Result<Tree, MetaError>, u64) {
        let (root, gen) = *self.root.lock();
        let t = Tree::open(self.fs_id, NODE_SIZE, root).map_err(|e| MetaError(e.to_string()));
        (t, gen)
    }
}

impl InodeSource for DurableTree {
    fn read_inodes(&self, inos: &[u64]) -> Read {
        let (tree, gen) = self.tree();
        let inodes = tree.and_then(|t| {
            let mut out = Vec::with_capacity(inos.len());
            for &ino in inos {
                // Names are hashed with the fs_id as seed (`Meta::name_seed`).
                let i = metatree::load_inode(&t, &*self.store, self.fs_id, ino)
                    .map_err(|e| MetaError(format!("reading inode {ino} back: {e}")))?;
                out.extend(i.map(|i| (ino, i)));
            }
            Ok(out)
        });
        Read { gen, inodes }
    }

    fn read_all(&self) -> Read {
        let (tree, gen) = self.tree();
        let inodes = tree.and_then(|t| {
            metatree::load_files(&t, &*self.store, self.fs_id)
                .map_err(|e| MetaError(format!("reading the inodes back: {e}")))
        });
        Read { gen, inodes }
    }
}

/// What `MetaTree::write` did: the new root, the blocks of the nodes it replaced (free
/// once the root is durable), and the bytes of nodes written.
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

fn tree_err(e: TreeError) -> FsError {
    match e {
        TreeError::Format(f) => FsError::Format(f),
        TreeError::NoSpace(_) => FsError::NoSpace,
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
    /// gives (all at once, near the last ones), and return the new root and the blocks
    /// of the nodes it replaced.
    pub fn write(
        &mut self,
        changes: Captured,
        seq: u64,
        alloc: &mut dyn FnMut(u64, usize) -> FsResult<Vec<u64>>,
    ) -> FsResult<TreeWrite> {
        metatree::apply_captured(&mut self.tree, &*self.store, changes).map_err(tree_err)?;
        self.write_nodes(seq, alloc)
    }

    /// Write the dirty nodes (changes applied already, as mount's replay does) as
    /// `write` does.
    pub fn write_nodes(
        &mut self,
        seq: u64,
        alloc: &mut dyn FnMut(u64, usize) -> FsResult<Vec<u64>>,
    ) -> FsResult<TreeWrite> {
        let n = self.tree.dirty_nodes();
        let mut blocks = if n > 0 {
            alloc(self.cursor, n)?
        } else {
            Vec::new()
        };
        debug_assert_eq!(blocks.len(), n);
        if let Some(&last) = blocks.iter().max() {
            self.cursor = last + 1;
        }
        let new = blocks.clone();
        blocks.reverse();
        // Sent a batch at a time as they are encoded: a checkpoint's nodes are held
        // once (in memory as nodes, or as bytes in flight), not in every form at once.
        let mut batch: Vec<(u64, Vec<u8>)> = Vec::with_capacity(WRITE_BATCH);
        let store = &self.store;
        let w = self
            .tree
            .write_dirty(
                seq,
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
        self.store.write(batch).map_err(tree_err)?;
        Ok(TreeWrite {
            root: w.root,
            freed: w.freed,
            bytes: (w.nodes * NODE_SIZE) as u64,
            new,
        })
    }

    /// Where `meta`'s inode cache reads back what it dropped.
    pub fn source(&self) -> Arc<dyn InodeSource> {
        self.durable.clone()
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
    w: &TreeWrite,
    space: Option<SpaceRecord>,
    data: std::ops::Range<u64>,
) -> FsResult<Vec<u8>> {
    Ok(Checkpoint {
        fs_id,
        seq,
        tid,
        journal_pos: 0,
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

/// Give the blocks of replaced nodes back (their new root is durable).
fn free_nodes(meta: &mut Meta, blocks: &[u64]) -> FsResult<()> {
    meta.nodes_freed(blocks).map_err(|e| FsError::Corrupt(e.0))
}
