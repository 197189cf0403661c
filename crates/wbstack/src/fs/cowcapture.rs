//! A checkpoint's capture by copy on write (issue 16).
//!
//! A checkpoint writes the values its changed keys have at the close of its
//! transaction. Copying them all out while the close holds `st` (`metatree::capture`)
//! stopped every namespace operation for as long as a lookup per key took: 100 to
//! 250 ms at a checkpoint of 131,072 changed inodes, the default `inode_cache`. Here
//! the close only sorts the keys and notes the inodes they belong to (`PendingCapture::new`);
//! the committer copies those inodes a batch at a time, taking `st` per batch
//! (`step`), and an operation about to change one of them first has it copied as it
//! was (`before_change`, from `Inodes::note_changed`, which every change of an inode
//! passes through before it is made), as a snapshot's copy-on-write does.
//!
//! Which inodes are still to copy needs no set of its own: an inode changed in the
//! closed generation is stamped with it (`fs::inodes`), and its first change since
//! the close stamps it with the next. The committer copies, in inode order, those
//! still stamped with the closed generation; `before_change` copies an inode at the
//! first change only, and only if the committer has not passed it yet. An inode with
//! no key among the changes (stamped by a look that changed nothing) copies nothing.
//! The list of inodes to copy is made at the committer's first batch, not at the
//! close: the close holds `st` only to sort the keys.

use super::meta::{Changes, Inode, Meta};
use super::metatree::{changed_inodes, Captured, KeyCursor};
use std::sync::Arc;

/// Inodes the committer copies per hold of `st`: about 1 ms of lookups.
pub const CAPTURE_BATCH: usize = 4096;

pub struct PendingCapture {
    /// The generation the closed transaction's changes are stamped with.
    gen: u64,
    seed: u64,
    /// The keys, settled (`Captured::start`); shared so the list of their inodes can
    /// be made without `st` (`changes_to_list`).
    changes: Arc<Changes>,
    /// Every inode the keys belong to, sorted: made by the committer without `st`
    /// (`set_inodes`), or else by the first `step`.
    inodes: Option<Vec<u64>>,
    /// The committer has been through `inodes[..next]`.
    next: usize,
    /// Where the committer's copies left off in `changes`.
    at: KeyCursor,
    out: Captured,
    /// What the capture under `st` at the close would have taken, to check against.
    #[cfg(debug_assertions)]
    expect: Captured,
}

impl PendingCapture {
    /// At the close, under `st`: the changes of the generation just closed.
    pub fn new(meta: &Meta, mut changes: Changes) -> PendingCapture {
        #[cfg(debug_assertions)]
        let expect = super::metatree::capture(meta, changes.clone());
        let out = Captured::start(meta, &mut changes);
        PendingCapture {
            gen: changes.gen,
            seed: meta.name_seed,
            changes: Arc::new(changes),
            inodes: None,
            next: 0,
            at: KeyCursor::default(),
            out,
            #[cfg(debug_assertions)]
            expect,
        }
    }

    pub fn gen(&self) -> u64 {
        self.gen
    }

    /// The keys, while the list of their inodes is still to be made: the committer
    /// makes it without `st` (`changed_inodes` of 130,000 inodes' keys takes 5 ms,
    /// which every namespace operation waited for when the first `step` made it)
    /// and gives it back with `set_inodes`.
    pub fn changes_to_list(&self) -> Option<Arc<Changes>> {
        self.inodes.is_none().then(|| self.changes.clone())
    }

    /// The list `changed_inodes` made of `changes_to_list`'s keys, unless a `step`
    /// made it meanwhile. Nothing is passed until the committer steps, so an inode
    /// changing before then was copied at its change (`before_change`), as before.
    pub fn set_inodes(&mut self, inodes: Vec<u64>) {
        debug_assert!(
            self.inodes.as_ref().is_none_or(|v| *v == inodes),
            "two lists of a capture's inodes differ"
        );
        debug_assert_eq!(
            inodes,
            changed_inodes(&self.changes),
            "a list of other keys"
        );
        self.inodes.get_or_insert(inodes);
    }

    /// Inode `ino`, stamped with the closed generation until now, is about to change
    /// (or be deleted): copy its keys as they are, unless the committer did.
    pub fn before_change(&mut self, ino: u64, i: Option<&Inode>) {
        let passed = self
            .inodes
            .as_ref()
            .is_some_and(|v| v.get(self.next).is_none_or(|&n| ino < n));
        if !passed {
            // Out of the committer's order: its own search, from the start.
            let mut at = KeyCursor::default();
            self.out
                .take_inode(&self.changes, &mut at, self.seed, ino, i);
        }
    }

    /// Copy the next inodes that have not changed since the close (`stamp`: an
    /// inode's generation, `get`: the inode in memory), until `max` inodes or `max`
    /// keys are done; true once all are.
    pub fn step<'a>(
        &mut self,
        max: usize,
        stamp: impl Fn(u64) -> Option<u64>,
        get: impl Fn(u64) -> Option<&'a Inode>,
    ) -> bool {
        let inodes = self
            .inodes
            .get_or_insert_with(|| changed_inodes(&self.changes));
        let values_before = self.out.values();
        let mut end = self.next;
        // Bounded by keys as well as inodes: an inode's keys are copied at once, and a
        // directory's may be thousands (at fs_mark -S0, the step through its 20,000
        // directories, made first so numbered first, held `st` 36-56 ms; 1 ms for
        // 4096 files).
        while end < inodes.len() && end - self.next < max && self.out.values() - values_before < max
        {
            let ino = inodes[end];
            end += 1;
            let g = stamp(ino);
            // Not durable yet, so still stamped: with the closed generation, or the
            // next one once changed since (and copied then).
            debug_assert!(
                g.is_some_and(|g| g >= self.gen),
                "inode {ino} changed in generation {} lost its stamp ({g:?})",
                self.gen
            );
            if g == Some(self.gen) {
                self.out
                    .take_inode(&self.changes, &mut self.at, self.seed, ino, get(ino));
            }
        }
        self.next = end;
        self.next == inodes.len()
    }

    /// Every inode copied: the capture, as the close would have taken it.
    pub fn finish(self) -> Captured {
        debug_assert!(
            self.inodes.as_ref().is_some_and(|v| self.next == v.len()),
            "a capture finished early"
        );
        #[cfg(debug_assertions)]
        {
            let got = self.out.sorted();
            let expect = self.expect.sorted();
            debug_assert!(
                got == expect,
                "the copy-on-write capture of generation {} differs from the values at the close",
                self.gen
            );
            got
        }
        #[cfg(not(debug_assertions))]
        self.out
    }
}
