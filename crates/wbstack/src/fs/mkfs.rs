//! mkfs: a new, empty filesystem on a device (its superblock copies, an empty journal,
//! the first checkpoint), and the device helpers mount and replay share.

use super::checkpoint::{alloc_nodes, meta_reserve, root_image, MetaTree};
use super::error::{FsError, FsResult};
use super::format::{
    Checkpoint, Superblock, BLOCK_SIZE, DEFAULT_VERSION, LAZY_VERSION, RING_VERSION, SB_BLOCKS,
    TREE_VERSION, WHOLE_VERSION,
};
use super::meta::Meta;
use super::metatree;
use super::volume::MountOptions;
use crate::block::{BioFlags, RequestQueue};
use crate::buf::IoBuf;
use std::sync::Arc;

pub(super) const PAGE: u64 = BLOCK_SIZE as u64;

#[derive(Clone, Debug, Default)]
pub struct MkfsOptions {
    /// Filesystem id stamped into every structure (random when None).
    pub fs_id: Option<u64>,
    /// Format version to write: 3 (whole-metadata checkpoints) or 5 (the metadata
    /// tree; 5, the same without the journal ring, upgraded at the first mount); None:
    /// `DEFAULT_VERSION` (6).
    pub format: Option<u32>,
}

impl MkfsOptions {
    /// What a tool's fresh volume is made with: the format its mount options ask for
    /// (`-o format=N`), a random fs_id.
    pub fn for_mount(o: &MountOptions) -> MkfsOptions {
        MkfsOptions {
            format: o.format,
            ..MkfsOptions::default()
        }
    }
}

pub(super) fn sector(block: u64) -> u64 {
    block * (PAGE / 512)
}

pub(super) fn read_blocks(q: &Arc<RequestQueue>, block: u64, n: u64) -> FsResult<Vec<u8>> {
    let buf = q.read_sync(sector(block), (n * PAGE) as usize)?;
    Ok(buf.as_slice().to_vec())
}

pub(super) fn device_blocks(q: &RequestQueue) -> FsResult<u64> {
    let g = q.geometry();
    if g.logical_block_size as u64 > PAGE {
        return Err(FsError::Invalid(format!(
            "the device's logical block size {} is larger than the filesystem block ({PAGE})",
            g.logical_block_size
        )));
    }
    Ok(g.size_bytes / PAGE)
}

/// Write a new, empty filesystem on the device.
pub fn mkfs(q: &Arc<RequestQueue>, o: &MkfsOptions) -> FsResult<Superblock> {
    let nr = device_blocks(q)?;
    let clock = q.clock();
    // The root's timestamps are wall-clock time, as every inode's (see
    // State::wall_offset_ns); a manual clock keeps its own time for determinism.
    let now = if clock.is_manual() {
        clock.now_ns()
    } else {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    };
    let fs_id = o.fs_id.unwrap_or_else(rand::random);
    let mut sb = Superblock::layout(nr, fs_id, now).map_err(FsError::Format)?;
    sb.version = match o.format {
        None => DEFAULT_VERSION,
        Some(v @ (WHOLE_VERSION | LAZY_VERSION | RING_VERSION)) => v,
        Some(v) => {
            return Err(FsError::Invalid(format!(
                "format {v}: mkfs writes format {WHOLE_VERSION}, {LAZY_VERSION} or {RING_VERSION}"
            )))
        }
    };
    let mut meta = Meta::mkfs(sb.data_start, nr, now, fs_id);
    let image = if sb.version >= TREE_VERSION {
        meta.alloc.set_meta_reserve(meta_reserve(sb.journal_blocks));
        meta.keep_view();
        let mut mt = MetaTree::open(q.clone(), fs_id, sb.data_start..nr, None)?;
        let changes = metatree::all_changes(&mut meta);
        let mut all = metatree::capture(&meta, changes);
        let space = all.space.take();
        let w = mt.write(all, 1, &mut |goal, n| alloc_nodes(&mut meta, goal, n))?;
        root_image(1, &w, space, sb.data_start..nr)?
    } else {
        meta.encode_image()
    };
    let ckpt = Checkpoint {
        fs_id,
        seq: 1,
        tid: 0,
        journal_pos: 0,
        image,
    }
    .encode();
    q.write_sync(
        sector(sb.checkpoint[0].0),
        IoBuf::from_slice(&ckpt),
        BioFlags::META,
    )?;
    // Whatever a previous filesystem left in slot B and the journal is recognised as
    // foreign by its fs_id anyway; clearing their first blocks keeps fsck's report clean.
    let zero = IoBuf::zeroed(BLOCK_SIZE);
    q.write_sync(sector(sb.checkpoint[1].0), zero.clone(), BioFlags::META)?;
    if q.device().first_write_allocates() {
        // The whole journal, so commits overwrite: a journal write into a hole of a
        // sparse image allocates in the host filesystem, and with FUA waits for the
        // host's journal.
        q.write_zeroes_sync(sector(sb.journal_start), sector(sb.journal_blocks))?;
    } else {
        q.write_sync(sector(sb.journal_start), zero, BioFlags::META)?;
    }
    let enc = sb.encode();
    for b in SB_BLOCKS {
        q.write_sync(sector(b), IoBuf::from_slice(&enc), BioFlags::META)?;
    }
    q.flush_sync()?;
    Ok(sb)
}
