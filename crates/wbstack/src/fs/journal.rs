//! The metadata journal as mount reads it: the superblock, the newest valid checkpoint
//! and the transactions after it, replayed (`load`); what mount then does before it
//! writes anything (`prepare_mount`). Mount itself is `fs::mount`'s, the committer
//! that writes the journal `fs::commit`'s, the waits on it `fs::sync`'s.
//!
//! On disk a commit is one write of one transaction at the journal head, with
//! PREFLUSH|FUA: PREFLUSH makes every data write that completed before it durable first
//! (ordered data: extents are only logged once their data write completed), FUA makes
//! the transaction itself durable. A transaction torn by a crash fails its CRC and ends
//! the journal. With journaled data (`fs::jdata`) a transaction also carries small
//! fsyncs' data blocks; replay keeps the newest unrevoked copy of each and mount writes
//! them home before its checkpoint. When the journal is three quarters full (or at unmount) the committer
//! writes a checkpoint instead: the whole metadata image, taken under the same lock that
//! closes the transaction, to the older of the two slots; it commits that transaction,
//! and the journal starts again at its first block. The slot it replaces is never the
//! one a crash would need: the newest valid checkpoint and the journal after it stay
//! intact until the new checkpoint is durable.

use super::checkpoint::{meta_reserve, MetaTree};
use super::error::{FsError, FsResult};
use super::format::JBlockData;
use super::format::{
    Checkpoint, FormatError, Record, Superblock, Txn, LAZY_VERSION, RING_VERSION, SB_BLOCKS,
    TREE_VERSION, WHOLE_VERSION,
};
use super::meta::{ApplyMode, Meta, MetaError};
use super::metatree;
use super::mkfs::{device_blocks, read_blocks, PAGE};
use crate::block::RequestQueue;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Journal blocks read per IO during replay.
const REPLAY_WINDOW: u64 = 256;
/// The largest checkpoint sequence and transaction number an image may hold: no run of
/// commits reaches it (2^62 at a million a second take 146,000 years), and counting on
/// from a forged larger one would overflow.
const COUNTER_MAX: u64 = 1 << 62;
/// Transaction ids every mount skips. Journal writes go out up to `MAX_LOGBUFS` at a
/// time, so a power cut can lose one while later ones land: those stay in the journal,
/// valid, carrying the very tids the next mount's transactions would take, and one of
/// them replayed after the new transaction that took its predecessor's place (same
/// position, same length: the same operation again) would bring back a change nobody
/// was told was durable, after changes it never saw. Mount's checkpoint moves the tids
/// on past every one that could have been in flight (jbd2 moves its sequence on after
/// recovery for the same reason), so replay never expects one of them again. Mount
/// cannot tell a clean unmount from such a cut (nothing after the checkpoint replays in
/// both), so it does so every time.
pub(super) const TIDS_SKIPPED_AT_MOUNT: u64 = 1 << 10;
const _: () = assert!((super::volume::MAX_LOGBUFS as u64) < TIDS_SKIPPED_AT_MOUNT);

/// What loading an image found: the state after replay, and what was wrong on the way.
pub struct Loaded {
    pub sb: Superblock,
    pub meta: Meta,
    pub ckpt_slot: usize,
    pub ckpt_seq: u64,
    pub ckpt_tid: u64,
    /// Every transaction up to this one was replayed.
    pub last_tid: u64,
    pub txns_replayed: u64,
    /// Why replay stopped (the end of the journal is normally a torn or stale block).
    pub journal_end: String,
    /// Problems that do not stop a mount (a bad superblock copy, a bad older slot).
    pub warnings: Vec<String>,
    /// A record that could not be applied (fsck mode only; mount fails instead).
    pub replay_error: Option<String>,
    /// Journaled data blocks replay found, by final location (the newest copy of
    /// each, none revoked): mount writes them home before its checkpoint.
    pub jdata: BTreeMap<u64, JBlockData>,
    /// The metadata tree the checkpoint points at (format 4; none before).
    pub(super) tree: Option<MetaTree>,
    /// Inodes are read on demand (a format 5 mount): none was checked.
    pub lazy: bool,
    /// Where the checkpoint record disagrees with the tree it records (fsck).
    pub record_problems: Vec<String>,
}

/// Where a format 5 checkpoint record's inode count and free space disagree with the
/// metadata read whole from its tree.
fn space_disagrees(m: &Meta, space: &metatree::SpaceRecord) -> Vec<String> {
    let mut p = Vec::new();
    if m.nr_inodes() != space.nr_inodes {
        p.push(format!(
            "the record counts {} inodes, the tree holds {}",
            space.nr_inodes,
            m.nr_inodes()
        ));
    }
    let derived: Vec<(u64, u64)> = m.alloc.space().extents().collect();
    if derived != space.free {
        let first = derived
            .iter()
            .zip(&space.free)
            .find(|(a, b)| a != b)
            .map_or_else(
                || "their extent counts".to_string(),
                |(a, b)| format!("free extent {}+{} against {}+{}", b.0, b.1, a.0, a.1),
            );
        p.push(format!(
            "the record's free space ({} extents) is not the data area less the tree's \
             extents and nodes ({} extents): first difference at {first}",
            space.free.len(),
            derived.len()
        ));
    }
    p
}

/// Read the superblock (either copy), the newest valid checkpoint and replay the
/// journal after it. `strict` (mount) fails on a record that does not apply; otherwise
/// (fsck) the error is reported and replay stops there. `dir_listed_max` is the
/// mount's (`MountOptions`), for the directories replay reads back.
pub fn load(q: &Arc<RequestQueue>, strict: bool, dir_listed_max: usize) -> FsResult<Loaded> {
    let (sb, warnings) = read_superblock(q)?;
    load_after_superblock(q, sb, warnings, strict, dir_listed_max)
}

/// The first valid superblock copy, and what was wrong with the others. An error here
/// means the device holds no wbstack filesystem (or cannot be read): fsck's exit 8.
pub fn read_superblock(q: &Arc<RequestQueue>) -> FsResult<(Superblock, Vec<String>)> {
    let nr = device_blocks(q)?;
    let mut warnings = Vec::new();
    let mut sb = None;
    let mut first_err = None;
    for b in SB_BLOCKS {
        if b >= nr {
            break;
        }
        match Superblock::decode(&read_blocks(q, b, 1)?) {
            Ok(s) => {
                if sb.is_none() {
                    sb = Some(s);
                }
            }
            Err(e) => {
                warnings.push(format!("superblock copy in block {b}: {e}"));
                first_err.get_or_insert(e);
            }
        }
    }
    match sb {
        Some(s) => Ok((s, warnings)),
        None => Err(FsError::Format(first_err.unwrap_or(
            FormatError::Truncated("device (too small to hold a superblock)"),
        ))),
    }
}

/// [`load`] once the superblock is known.
pub fn load_after_superblock(
    q: &Arc<RequestQueue>,
    sb: Superblock,
    mut warnings: Vec<String>,
    strict: bool,
    dir_listed_max: usize,
) -> FsResult<Loaded> {
    let nr = device_blocks(q)?;
    if sb.nr_blocks > nr {
        return Err(FsError::Corrupt(format!(
            "the filesystem spans {} blocks but the device has only {nr} (a truncated image?)",
            sb.nr_blocks
        )));
    }
    // The newest valid checkpoint.
    let mut best: Option<(usize, Checkpoint)> = None;
    let mut slot_errs = Vec::new();
    for (i, &(start, len)) in sb.checkpoint.iter().enumerate() {
        let res = (|| -> Result<Checkpoint, String> {
            let first = read_blocks(q, start, 1).map_err(|e| e.to_string())?;
            let bytes = Checkpoint::peek_len(&first).map_err(|e| e.to_string())? as u64;
            if bytes > len * PAGE {
                return Err(format!(
                    "claims {bytes} bytes but the slot holds {}",
                    len * PAGE
                ));
            }
            let all = read_blocks(q, start, bytes / PAGE).map_err(|e| e.to_string())?;
            let c = Checkpoint::decode(&all).map_err(|e| e.to_string())?;
            if c.fs_id != sb.fs_id {
                return Err(format!("belongs to another filesystem ({:#x})", c.fs_id));
            }
            if c.seq > COUNTER_MAX || c.tid > COUNTER_MAX {
                return Err(format!(
                    "sequence {} or transaction {} is beyond any count of commits",
                    c.seq, c.tid
                ));
            }
            if c.journal_pos >= sb.journal_blocks {
                return Err(format!(
                    "points at journal block {} of {}",
                    c.journal_pos, sb.journal_blocks
                ));
            }
            Ok(c)
        })();
        match res {
            Ok(c) => {
                if best.as_ref().is_none_or(|(_, b)| c.seq > b.seq) {
                    best = Some((i, c));
                }
            }
            Err(e) => slot_errs.push(format!("checkpoint slot {i}: {e}")),
        }
    }
    let Some((slot, ckpt)) = best else {
        return Err(FsError::Corrupt(format!(
            "no valid checkpoint ({})",
            slot_errs.join("; ")
        )));
    };
    // A bad slot is normal after a crash during a checkpoint write; report it for fsck.
    warnings.extend(slot_errs);
    let data = sb.data_start..sb.nr_blocks;
    let mut lazy = false;
    let mut record_problems = Vec::new();
    let (mut meta, tree) = if sb.version >= TREE_VERSION {
        let corrupt =
            |e: &dyn std::fmt::Display| FsError::Corrupt(format!("checkpoint {}: {e}", ckpt.seq));
        // A read the device failed stays EIO: the image may be fine.
        let loading = |e: FsError| match e {
            FsError::Io => FsError::Io,
            e => corrupt(&e),
        };
        let rec = metatree::decode_root(&ckpt.image).map_err(|e| corrupt(&e))?;
        let tree = MetaTree::open(q.clone(), sb.fs_id, data, rec.root).map_err(|e| corrupt(&e))?;
        (tree.listed_max()).store(dir_listed_max, std::sync::atomic::Ordering::Relaxed);
        let mut meta = match &rec.space {
            // Mount of format 5: nothing read whole.
            Some(space) if strict => {
                lazy = true;
                tree.load_lazy(space, sb.data_start, sb.nr_blocks)
                    .map_err(loading)?
            }
            // fsck (or format 4): every node and inode, and the record checked
            // against what they say.
            _ => {
                let m = tree
                    .load(sb.fs_id, sb.data_start, sb.nr_blocks)
                    .map_err(loading)?;
                if let Some(space) = &rec.space {
                    record_problems.extend(
                        space_disagrees(&m, space)
                            .into_iter()
                            .map(|p| format!("checkpoint {}: {p}", ckpt.seq)),
                    );
                }
                m
            }
        };
        // What replay changes goes into the tree at mount's checkpoint.
        meta.track_changes(true);
        meta.alloc.set_meta_reserve(meta_reserve(sb.journal_blocks));
        meta.keep_view();
        if lazy {
            meta.set_source(tree.source());
        }
        (meta, Some(tree))
    } else {
        let meta = Meta::decode_image(&ckpt.image, sb.data_start, sb.nr_blocks, sb.fs_id)
            .map_err(|e| FsError::Corrupt(format!("checkpoint {}: {e}", ckpt.seq)))?;
        (meta, None)
    };
    let r = replay(q, &sb, &mut meta, ckpt.journal_pos, ckpt.tid, strict)?;
    Ok(Loaded {
        sb,
        meta,
        ckpt_slot: slot,
        ckpt_seq: ckpt.seq,
        ckpt_tid: ckpt.tid,
        last_tid: r.last_tid,
        txns_replayed: r.txns,
        journal_end: r.end,
        warnings,
        replay_error: r.error,
        jdata: r.jdata,
        tree,
        lazy,
        record_problems,
    })
}

/// What mount does to a loaded image whose metadata passed `Meta::check` (operations
/// rely on every invariant, so an image breaking one is refused, never half-trusted)
/// before it writes anything: delete the orphans, then encode the new checkpoint, which
/// must fit the slot it goes to, as of transaction `mount_tid` (the tids skipped:
/// `TIDS_SKIPPED_AT_MOUNT`). fsck runs the same steps, so an image fsck finds clean
/// mounts. Returns the orphans deleted and the checkpoint (seq and slot after `l`'s).
pub(super) fn prepare_mount(l: &mut Loaded) -> FsResult<(Vec<u64>, MountCheckpoint)> {
    if l.last_tid > COUNTER_MAX - TIDS_SKIPPED_AT_MOUNT {
        // Its checkpoint would hold a tid no load accepts.
        return Err(FsError::Corrupt(format!(
            "transaction {} is too close to the end of any count of commits",
            l.last_tid
        )));
    }
    let orphans: Vec<u64> = l.meta.orphans.iter().copied().collect();
    for ino in &orphans {
        apply_at_mount(
            &mut l.meta,
            &super::format::Record::Delete { ino: *ino },
            ApplyMode::Replay,
        )?
        .map_err(|e| FsError::Corrupt(format!("orphan {ino}: {e}")))?;
    }
    let Some(tree) = l.tree.as_mut() else {
        let slot = 1 - l.ckpt_slot;
        let ckpt = Checkpoint {
            fs_id: l.sb.fs_id,
            seq: l.ckpt_seq + 1,
            tid: mount_tid(l),
            journal_pos: 0,
            image: l.meta.encode_image(),
        }
        .encode();
        let room = l.sb.checkpoint[slot].1 * PAGE;
        if ckpt.len() as u64 > room {
            return Err(FsError::Corrupt(format!(
                "the metadata ({} bytes) no longer fits checkpoint slot {slot} ({room} bytes)",
                ckpt.len()
            )));
        }
        return Ok((orphans, MountCheckpoint::Image(ckpt)));
    };
    // The changes go into the tree now (reads only: writing is mount's), so what
    // cannot go in is found by fsck too.
    let mut changes = l.meta.take_changes();
    if l.sb.version < LAZY_VERSION {
        // A format 4 tree, read whole: every inode rewritten in format 5's record
        // (with its parent and subdirectory count), once.
        changes.append(metatree::all_changes(&mut l.meta));
    }
    let gen = changes.gen;
    if changes.is_empty() {
        // The tree is the state already (a clean unmount's, or a cut with nothing to
        // replay): mount's checkpoint is its root record again, holding the tids moved
        // on, and writes no node.
        let space = l.meta.space_record();
        return Ok((orphans, MountCheckpoint::Tree { gen, space }));
    }
    let mut captured = metatree::capture(&l.meta, changes);
    let space = captured.space.take();
    metatree::apply_captured(&mut tree.tree, &*tree.store, captured).map_err(|e| match e {
        e @ super::btree::TreeError::Io { .. } => FsError::from(e),
        e => FsError::Corrupt(format!("the metadata tree: {e}")),
    })?;
    Ok((orphans, MountCheckpoint::Tree { gen, space }))
}

/// What mount's checkpoint writes (`prepare_mount`).
pub(super) enum MountCheckpoint {
    /// A whole-metadata checkpoint, encoded (formats up to 3).
    Image(Vec<u8>),
    /// The tree's dirty nodes, then its root record (format 4), holding the inode
    /// cache's generation `gen`.
    Tree {
        gen: u64,
        space: Option<metatree::SpaceRecord>,
    },
}

/// The transaction mount's checkpoint holds the state as of: the last one replayed,
/// then `TIDS_SKIPPED_AT_MOUNT` more that no transaction will ever carry.
pub(super) fn mount_tid(l: &Loaded) -> u64 {
    l.last_tid + TIDS_SKIPPED_AT_MOUNT
}

/// The version an image is at after its mount: a tree's, format 5; a whole-metadata
/// image's, format 3.
pub(super) fn upgraded_version(sb: &Superblock) -> u32 {
    if sb.version >= TREE_VERSION {
        RING_VERSION
    } else {
        WHOLE_VERSION
    }
}

/// Apply `rec` at mount (replay, orphans), reading back the inodes it needs first on a
/// volume whose inodes are read on demand: mount runs alone, so it reads them itself.
/// The outer error fails the mount (an inode could not be read back: EIO, or a
/// corrupt tree); the inner one is the record's own (it does not apply), which ends a
/// replay where a torn transaction would.
fn apply_at_mount(
    meta: &mut Meta,
    rec: &Record,
    mode: ApplyMode,
) -> FsResult<Result<(), MetaError>> {
    meta.take_misses();
    meta.take_dir_misses();
    // Directories read back stay resident until the record applies
    // (`Meta::hold_dirs_missed`): a read large enough makes a shrink due, which the
    // next install runs first.
    let mut held: Vec<u64> = Vec::new();
    let r = apply_reading(meta, rec, mode, &mut held);
    meta.release_dirs(&held);
    r
}

fn apply_reading(
    meta: &mut Meta,
    rec: &Record,
    mode: ApplyMode,
    held: &mut Vec<u64>,
) -> FsResult<Result<(), MetaError>> {
    loop {
        let r = meta.apply(rec, mode);
        let missed = meta.take_misses();
        let dirs_missed = meta.take_dir_misses();
        let (Err(_), false, Some(src)) = (
            &r,
            missed.is_empty() && dirs_missed.is_empty(),
            meta.source(),
        ) else {
            return Ok(r);
        };
        meta.hold_dirs_missed(&dirs_missed, held);
        // Each round installs what it missed (or finds it gone): it ends. Inodes
        // first: a directory's groups go into the directory read back.
        let moved = if !missed.is_empty() {
            !meta.install(src.read_inodes(&missed), Some(&missed))?
        } else {
            !meta.install_dirents(src.read_dirents(&dirs_missed), &dirs_missed)?
        };
        if moved {
            return Err(FsError::Corrupt(
                "the durable root moved during mount".into(),
            ));
        }
    }
}

/// What replay found.
struct Replayed {
    last_tid: u64,
    txns: u64,
    end: String,
    error: Option<String>,
    jdata: BTreeMap<u64, JBlockData>,
}

/// Apply the transactions after checkpoint `tid` found from journal block `pos` on.
/// The transaction of tid `expect` at journal block `pos`, read through the window
/// `[win_start, win_start + win.len())`; Err(why) when there is none (the end of the
/// journal, a torn or stale transaction), Ok(Err) only for a failed read.
fn next_txn(
    q: &Arc<RequestQueue>,
    sb: &Superblock,
    pos: u64,
    expect: u64,
    win_start: &mut u64,
    win: &mut Vec<u8>,
) -> FsResult<Result<(Txn, u64), String>> {
    let jb = sb.journal_blocks;
    if pos >= jb {
        return Ok(Err("the end of the journal area".to_string()));
    }
    let have = |ws: u64, w: &Vec<u8>, p: u64, n: u64| {
        ws != u64::MAX && p >= ws && (p + n) * PAGE <= ws * PAGE + w.len() as u64
    };
    if !have(*win_start, win, pos, 1) {
        *win_start = pos;
        *win = read_blocks(q, sb.journal_start + pos, REPLAY_WINDOW.min(jb - pos))?;
    }
    let off = ((pos - *win_start) * PAGE) as usize;
    let len = match Txn::peek_len(&win[off..], sb.fs_id) {
        Ok(l) => l as u64,
        Err(e) => return Ok(Err(format!("journal block {pos}: {e}"))),
    };
    if pos + len / PAGE > jb {
        return Ok(Err(format!(
            "journal block {pos}: a transaction running past the journal's end"
        )));
    }
    if !have(*win_start, win, pos, len / PAGE) {
        *win_start = pos;
        *win = read_blocks(
            q,
            sb.journal_start + pos,
            (len / PAGE).max(REPLAY_WINDOW.min(jb - pos)),
        )?;
    }
    let off = ((pos - *win_start) * PAGE) as usize;
    let txn = match Txn::decode(&win[off..off + len as usize]) {
        Ok((t, _)) => t,
        Err(e) => return Ok(Err(format!("journal block {pos}: {e} (torn by a crash)"))),
    };
    if txn.tid != expect {
        return Ok(Err(format!(
            "journal block {pos}: transaction {} where {expect} was due (stale)",
            txn.tid
        )));
    }
    Ok(Ok((txn, len)))
}

fn replay(
    q: &Arc<RequestQueue>,
    sb: &Superblock,
    meta: &mut Meta,
    mut pos: u64,
    tid: u64,
    strict: bool,
) -> FsResult<Replayed> {
    let mut expect = tid + 1;
    let mut replayed = 0;
    // The newest journaled copy of each block, unless revoked since.
    let mut jdata: BTreeMap<u64, JBlockData> = BTreeMap::new();
    // A window of journal blocks read in one IO: [win_start, win_start + win.len()).
    let mut win_start = u64::MAX;
    let mut win: Vec<u8> = Vec::new();
    // The journal is a ring (`fs::jspace`): where the due transaction is not, it may
    // have wrapped to block 0 (looked for once per transaction; the end reported is
    // where it was first looked for).
    let mut not_at_head: Option<String> = None;
    let end = loop {
        let found = next_txn(q, sb, pos, expect, &mut win_start, &mut win)?;
        let (txn, len) = match found {
            Ok(t) => t,
            Err(why) if pos != 0 && not_at_head.is_none() => {
                not_at_head = Some(why);
                pos = 0;
                continue;
            }
            Err(why) => break not_at_head.take().unwrap_or(why),
        };
        not_at_head = None;
        // This transaction's data and revokes, in order, kept only once all of it
        // applied.
        let mut txn_data: Vec<(u64, Option<&JBlockData>)> = Vec::new();
        for (k, rec) in txn.records.iter().enumerate() {
            let applied = apply_at_mount(meta, rec, ApplyMode::Replay)?;
            match (rec, &applied) {
                (Record::DataBlock { block, data }, Ok(())) => txn_data.push((*block, Some(data))),
                (Record::Revoke { block }, Ok(())) => txn_data.push((*block, None)),
                _ => {}
            }
            if let Err(e) = applied {
                let msg = format!("journal transaction {expect}, record {k} ({rec:?}): {e}");
                if strict {
                    return Err(FsError::Corrupt(msg));
                }
                return Ok(Replayed {
                    last_tid: expect - 1,
                    txns: replayed,
                    end: "a record that does not apply".into(),
                    error: Some(msg),
                    jdata,
                });
            }
        }
        for (block, data) in txn_data {
            match data {
                Some(d) => jdata.insert(block, d.clone()),
                None => jdata.remove(&block),
            };
        }
        replayed += 1;
        expect += 1;
        pos += len / PAGE;
    };
    Ok(Replayed {
        last_tid: expect - 1,
        txns: replayed,
        end,
        error: None,
        jdata,
    })
}
