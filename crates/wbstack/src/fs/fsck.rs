//! The offline checker: loads an image the way mount does, without changing it, and
//! reports every broken invariant in plain words. It never panics, whatever the bytes,
//! and it agrees with mount: an image it finds clean mounts, one it finds a problem in
//! is refused (mount runs the same `Meta::check` and `prepare_mount`).

use super::journal::{load_after_superblock, prepare_mount, read_superblock};
use crate::block::RequestQueue;
use std::sync::Arc;

/// What fsck found.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct FsckReport {
    /// A valid superblock was found, so the rest could be checked. False when the device
    /// could not be read or holds no wbstack filesystem (fsck(8)'s "operational error",
    /// `wbstack fsck`'s exit 8); then `problems` says why.
    pub checked: bool,
    /// Broken invariants: the filesystem is inconsistent if any.
    pub problems: Vec<String>,
    /// Things worth knowing that are not errors (a torn last transaction, orphans that
    /// the next mount deletes, a stale checkpoint slot).
    pub notes: Vec<String>,
    pub inodes: u64,
    pub directories: u64,
    pub files: u64,
    pub used_blocks: u64,
    pub free_blocks: u64,
    pub checkpoint_seq: u64,
    pub transactions_replayed: u64,
    pub orphans: u64,
}

impl FsckReport {
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Check the filesystem on `q`.
pub fn fsck(q: &Arc<RequestQueue>) -> FsckReport {
    let mut r = FsckReport::default();
    let (sb, warnings) = match read_superblock(q) {
        Ok(s) => s,
        Err(e) => {
            r.problems.push(format!("no wbstack filesystem: {e}"));
            return r;
        }
    };
    r.checked = true;
    let mut l = match load_after_superblock(q, sb, warnings, false, super::metatree::LISTED_MAX) {
        Ok(l) => l,
        Err(e) => {
            r.problems.push(format!("cannot load the filesystem: {e}"));
            return r;
        }
    };
    r.notes.append(&mut l.warnings);
    r.notes.push(format!(
        "checkpoint {} (transaction {}), then {} journal transaction(s); the journal ends at {}",
        l.ckpt_seq, l.ckpt_tid, l.txns_replayed, l.journal_end
    ));
    if let Some(e) = l.replay_error.take() {
        r.problems.push(e);
    }
    r.problems.append(&mut l.record_problems);
    r.problems.extend(l.meta.check());
    let all = l.meta.resident_inodes();
    r.inodes = all.len() as u64;
    r.directories = all.values().filter(|i| i.is_dir()).count() as u64;
    r.files = all
        .values()
        .filter(|i| i.kind == super::format::InodeKind::File)
        .count() as u64;
    r.used_blocks = all.values().map(|i| i.blocks()).sum();
    let m = &l.meta;
    r.free_blocks = m.alloc.space().free_blocks();
    r.checkpoint_seq = l.ckpt_seq;
    r.transactions_replayed = l.txns_replayed;
    r.orphans = m.orphans.len() as u64;
    if r.orphans > 0 {
        r.notes.push(format!(
            "{} orphan inode(s) (deleted while open): the next mount frees them",
            r.orphans
        ));
    }
    // What mount would do next, on this copy (fsck writes nothing): only meaningful,
    // and only safe to encode, when every invariant holds.
    if r.problems.is_empty() {
        if let Err(e) = prepare_mount(&mut l) {
            r.problems.push(e.to_string());
        }
    }
    r
}
