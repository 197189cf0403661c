//! The filesystem's side of the page cache (ext4's address_space_operations).
//!
//! Delayed allocation, as ext4 does it: `write()` reserves one block per page that has
//! no block yet (`prepare_write`), writeback allocates them (`map_write`) where the
//! previous allocation ended (so consecutive inodes of one pass get adjacent extents),
//! and only when the data write completed (`end_writes`) is the extent logged (ordered
//! data). Blocks allocated for a write still in flight are "pending": if the file is
//! truncated or deleted meanwhile they are freed when the write ends, never before
//! (a late write must not land in a block someone else owns).

use super::*;

/// The filesystem's side of the page cache (`AddressSpaceOps`).
pub(in crate::fs) struct Aops {
    /// Set once, when the volume it serves is built (after it: the volume holds it). A
    /// lock around it was one more lock every write and completion took.
    pub vol: std::sync::OnceLock<Weak<Vol>>,
}

impl Aops {
    fn vol(&self) -> Result<Arc<Vol>, BlkError> {
        self.vol.get().and_then(Weak::upgrade).ok_or(BlkError::Io)
    }
}

impl AddressSpaceOps for Aops {
    fn prepare_write(&self, ino: u64, index: u64, n: u64) -> BlkResult {
        match self.try_prepare_write(ino, index, n) {
            // ext4_should_retry_alloc: blocks freed by a transaction not yet committed
            // are space about to come back; commit it and try once more.
            // Blocks kept for the next checkpoint's nodes come back once it is
            // durable: take it, and try again.
            Err(BlkError::NoSpace) => {
                let vol = self.vol()?;
                let (deferred, for_ckpt) = {
                    let st = vol.st.lock();
                    (
                        st.meta.alloc.deferred_blocks(),
                        st.meta.alloc.held_for_checkpoint(),
                    )
                };
                if deferred == 0 && for_ckpt == 0 {
                    return Err(BlkError::NoSpace);
                }
                vol.commit_and_release().map_err(|_| BlkError::NoSpace)?;
                if for_ckpt > 0 {
                    vol.checkpoint_now().map_err(|_| BlkError::NoSpace)?;
                }
                self.try_prepare_write(ino, index, n)
            }
            r => r,
        }
    }

    fn release_write(&self, m: &Mapping, index: u64, n: u64) {
        let Ok(vol) = self.vol() else {
            return;
        };
        let ino = m.ino();
        let mut st = vol.st.lock();
        let st = &mut *st;
        // Another write past its prepare_write may have found a page reserved here
        // and reserved nothing itself; a truncation's head rewrite reserves before
        // its write. Either keeps the reservations (released with the file, or
        // used by a later write of the page).
        if m.writers() > 1 || st.truncating.contains_key(&ino) {
            return;
        }
        let Some(l) = st.live.get_mut(&ino) else {
            return;
        };
        let reserved: Vec<u64> = l.delalloc.range(index..index + n).collect();
        let owing = m.pages_owing_write(reserved.iter().copied(), false);
        // Both in page order: what owes no write is what is not in `owing`.
        let orphans: Vec<u64> = reserved
            .into_iter()
            .filter(|p| owing.binary_search(p).is_err())
            .collect();
        if orphans.is_empty() {
            return;
        }
        for p in &orphans {
            l.delalloc.remove(p);
        }
        let r = st.meta.alloc.unreserve(orphans.len() as u64);
        st.allocator_broken("releasing the reservations of a failed write", r);
    }

    fn map_write(&self, ino: u64, index: u64, n: u64) -> Result<Vec<(u64, u64)>, BlkError> {
        let vol = self.vol()?;
        #[cfg(test)]
        if vol
            .panic_next_map_write
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            panic!("a bug in map_write (test)");
        }
        let r = self.try_map_write(&vol, ino, index, n);
        if let Err(e) = &r {
            // The pages' writeback fails with it (their file's errseq); syncfs hears
            // of it too, as the kernel's mapping_set_error tells the superblock.
            vol.sb_err.set(e.errno());
        }
        r
    }

    fn writeback_wait(&self, ino: u64) {
        if let Ok(vol) = self.vol() {
            vol.kick_home(ino);
        }
    }

    fn mapping_emptied(&self, ino: u64) {
        if let Ok(vol) = self.vol() {
            vol.icache.lock().queue(ino);
        }
    }

    fn map_read(&self, ino: u64, index: u64, n: u64) -> Result<Vec<(Option<u64>, u64)>, BlkError> {
        let vol = self.vol()?;
        let st = vol.st.lock();
        let Some(i) = st.meta.find(ino).map_err(|_| BlkError::Io)? else {
            return Err(BlkError::Invalid(format!("inode {ino} was deleted")));
        };
        let live = st.live.get(&ino);
        let old_valid = !live.is_some_and(|l| l.trunc_pending);
        let mut runs: Vec<(Option<u64>, u64)> = Vec::new();
        let end = index + n;
        let mut p = index;
        while p < end {
            let (blk, k) = if let Some((blk, left)) = old_valid.then(|| i.mapped_run(p)).flatten() {
                (Some(blk), left.min(end - p))
            } else if let Some((s, k)) = live.and_then(|l| l.unjournaled_block(p)) {
                (Some(s), k.min(end - p))
            } else if old_valid {
                // A hole up to the next mapped block.
                let next = i.next_mapped(p).unwrap_or(end).min(end);
                (None, (next - p).max(1))
            } else {
                (None, 1)
            };
            match (runs.last_mut(), blk) {
                (Some((None, c)), None) => *c += k,
                _ => runs.push((blk.map(|b| b * SECTORS_PER_BLOCK), k)),
            }
            p += k;
        }
        Ok(runs)
    }

    fn end_writes(&self, done: &[WriteDone<'_>]) {
        let Ok(vol) = self.vol() else { return };
        for chunk in done.chunks(END_WRITES_PER_HOLD) {
            let now = vol.clock.now_ns();
            let gen = vol.barrier_started.load(Ordering::Acquire);
            let mut st = vol.st.lock();
            for d in chunk {
                Self::end_write_locked(&vol, &mut st, now, gen, d);
            }
        }
    }
}

/// Ended writes handled per hold of the state lock: a hold of a few µs, what a
/// creating thread spins through (`spin::SPINS`) instead of sleeping.
const END_WRITES_PER_HOLD: usize = 16;

impl Aops {
    /// A failed write's blocks, file pages [first, first + n), were freed: a page of
    /// them written again meanwhile reserved nothing (its write found this write's
    /// block, `Live::unjournaled_block`), so it gets a reservation now, from the
    /// blocks just freed, or its next writeback could meet a full volume and lose data
    /// that write() accepted. A writer between its `prepare_write` and its copy may
    /// not have dirtied its page yet: with one in progress, every page of the range
    /// still cached is given one (one the writer then does not dirty stays held, as
    /// `release_write` leaves a concurrent writer's, until the file goes).
    fn reserve_for_rewritten(vol: &Vol, st: &mut State, ino: u64, first: u64, n: u64) {
        let Some(m) = vol.icache.lock().get(&ino).cloned() else {
            return; // no mapping: no page was written again
        };
        let writing = m.writers() > 0;
        let Some(l) = st.live.get_mut(&ino) else {
            return;
        };
        let unreserved = (first..first + n).filter(|p| !l.delalloc.contains(p));
        let pages = m.pages_owing_write(unreserved, !writing);
        if pages.is_empty() {
            return;
        }
        l.delalloc.extend(pages.iter().copied());
        let r = st.meta.alloc.reserve_freed(pages.len() as u64);
        st.allocator_broken(
            "reserving, from a failed write's blocks, for its rewritten pages",
            r,
        );
    }

    /// One ended data write: the extent it mapped is logged (ordered data), what was
    /// truncated away meanwhile freed, the size on disk moved.
    fn end_write_locked(vol: &Vol, st: &mut State, now: u64, gen: u64, d: &WriteDone<'_>) {
        let WriteDone {
            ino,
            index,
            pages: n,
            sector,
            i_size,
            status,
        } = *d;
        if sector == u64::MAX {
            return; // never submitted: map_write failed and undid nothing
        }
        let blk = sector / SECTORS_PER_BLOCK;
        if !st.inflight.contains_key(&blk) {
            // An overwrite in place (`try_map_write`): ended first, whatever follows
            // (exactly one `end_io` per `begin_io`); its blocks, if freed meanwhile, are
            // free now.
            let r = st.meta.alloc.end_io(blk, n);
            st.allocator_broken("ending an overwrite in place", r);
        }
        if status.is_ok() && !st.jblocks.is_empty() {
            // Written in place over a block the journal holds an older copy of (this
            // file's, or another's it was freed from): replay must not write that copy
            // over this data. fsync of the inode waits for the revoke's transaction.
            for b in blk..blk + n {
                // A block waiting to be sent home belongs to a page under writeback
                // (or, freed, is not released before its home write): never written
                // here meanwhile.
                debug_assert!(st.jhome.iter().all(|h| h.block != b));
                if st.jblocks.remove(&b).is_some()
                    && st.log(Record::Revoke { block: b }, &[ino], now).is_err()
                {
                    return;
                }
            }
        }
        // How far this write extends the file's data on disk: all of it for an
        // overwrite of blocks already mapped, only the blocks it mapped for new ones (a
        // write truncated away while in flight must not bring the size back).
        let mut written_end = ((index + n) * PAGE).min(i_size);
        if let Some(inf) = st.inflight.remove(&blk) {
            if let Some(l) = st.live.get_mut(&inf.ino) {
                if l.pending.get(&inf.fblock).is_some_and(|e| e.0 == blk) {
                    l.pending.remove(&inf.fblock);
                }
            }
            let limit = i_size.div_ceil(PAGE);
            let alive = match (status, st.meta.resident(inf.ino).is_some()) {
                (Ok(()), true) => inf
                    .dead_from
                    .unwrap_or(u64::MAX)
                    .min(limit)
                    .saturating_sub(inf.fblock)
                    .min(inf.len),
                _ => 0,
            };
            let deferred = st.live.get(&inf.ino).is_some_and(|l| l.trunc_pending);
            if alive > 0 && deferred {
                // Journaled with the deferred truncation, in one transaction.
                let l = st.live.get_mut(&inf.ino).expect("checked");
                l.deferred_maps.insert(inf.fblock, (blk, alive));
            } else if alive > 0 {
                let rec = Record::MapExtent {
                    ino: inf.ino,
                    file_block: inf.fblock,
                    start: blk,
                    len: alive,
                };
                if st.log(rec, &[inf.ino], now).is_err() {
                    // The journal is gone (aborted): the data is on disk but never
                    // referenced; nothing more to do.
                    return;
                }
            }
            if alive < inf.len {
                // Never referenced by any committed metadata: reusable at once.
                let r = st.meta.alloc.free(blk + alive, inf.len - alive);
                st.allocator_broken("freeing the blocks of a write truncated away", r);
                if status.is_err() {
                    Self::reserve_for_rewritten(
                        vol,
                        st,
                        inf.ino,
                        inf.fblock + alive,
                        inf.len - alive,
                    );
                }
            }
            written_end = written_end.min((inf.fblock + alive) * PAGE);
            if !st.ordered.is_empty() {
                vol.ordered_cv.notify_all();
            }
        }
        if let Err(e) = status {
            vol.sb_err.set(e.errno());
            return;
        }
        if let Some(l) = st.live.get_mut(&ino).filter(|l| l.trunc_pending) {
            l.deferred_size = l.deferred_size.max(written_end);
            l.note_data_gen(gen);
            return;
        }
        if let Some(i) = st.meta.resident_mut(ino) {
            if written_end > i.size {
                i.size = written_end;
                st.txn_inodes.insert(ino);
                st.touch(&[ino], false, now);
            }
        }
        if let Some(l) = st.live.get_mut(&ino) {
            l.note_data_gen(gen);
        }
    }
}

impl Aops {
    fn try_map_write(
        &self,
        vol: &Vol,
        ino: u64,
        index: u64,
        n: u64,
    ) -> Result<Vec<(u64, u64)>, BlkError> {
        let mut st = vol.st.lock();
        let st = &mut *st;
        // An inode with pages is in memory: not there, it is deleted.
        let (i, alloc) = st.meta.resident_with_alloc(ino);
        let Some(i) = i else {
            // Deleted while its pages were claimed for writeback: nothing to write.
            return Ok(Vec::new());
        };
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let live = st.live.entry(ino).or_default();
        let old_valid = !live.trunc_pending;
        let mapped = |p: u64, live: &Live| {
            old_valid
                .then(|| i.mapped_run(p))
                .flatten()
                .or_else(|| live.unjournaled_block(p))
        };
        let end = index + n;
        // Every block this call allocates is reserved first, in one go: a stretch
        // refused for space after earlier ones were allocated left those allocated,
        // mapped and never written.
        let unreserved = (index..end)
            .filter(|&p| mapped(p, live).is_none() && !live.delalloc.contains(&p))
            .count() as u64;
        if unreserved > 0 {
            alloc.reserve(unreserved).map_err(|_| BlkError::NoSpace)?;
        }
        let mut in_place: Vec<(u64, u64)> = Vec::new();
        let mut p = index;
        while p < end {
            if let Some((blk, left)) = mapped(p, live) {
                // Overwrite in place (a page rewritten after its write completed).
                let k = left.min(end - p);
                runs.push((blk * SECTORS_PER_BLOCK, k));
                in_place.push((blk, k));
                p += k;
                continue;
            }
            // A stretch of pages without blocks: allocate them together.
            let mut k = 1;
            while p + k < end && mapped(p + k, live).is_none() {
                k += 1;
            }
            for q in p..p + k {
                live.delalloc.remove(&q);
            }
            // Continue the file where its previous block is, else where the last
            // allocation ended (consecutive inodes of a pass end up adjacent).
            let goal = p
                .checked_sub(1)
                .and_then(|prev| mapped(prev, live))
                .map(|(b, _)| b);
            let pieces = alloc
                .alloc_reserved(k, goal.map(|b| b + 1))
                .map_err(|e| BlkError::Invalid(e.to_string()))?;
            let mut fb = p;
            for (s, len) in pieces {
                live.pending.insert(fb, (s, len));
                st.inflight.insert(
                    s,
                    Inflight {
                        ino,
                        fblock: fb,
                        len,
                        dead_from: None,
                    },
                );
                runs.push((s * SECTORS_PER_BLOCK, len));
                fb += len;
            }
            p += k;
        }
        // Counted once nothing can fail: `end_writes` of each ends them. A deletion or
        // truncation freeing these blocks meanwhile leaves them unusable until then.
        for (blk, k) in in_place {
            alloc.begin_io(blk, k);
        }
        Ok(runs)
    }

    fn try_prepare_write(&self, ino: u64, index: u64, n: u64) -> BlkResult {
        let vol = self.vol()?;
        let now = vol.clock.now_ns();
        let mut st = vol.st.lock();
        if st.aborted.is_some() {
            return Err(BlkError::Io);
        }
        let Some(i) = st.meta.find(ino).map_err(|_| BlkError::Io)? else {
            return Err(BlkError::Invalid(format!("inode {ino} was deleted")));
        };
        let mut need = Vec::new();
        let live = st.live.get(&ino);
        // Old extents of a file whose truncation is deferred are not its blocks.
        let old_valid = !live.is_some_and(|l| l.trunc_pending);
        for p in index..index + n {
            let has_block = (old_valid && i.lookup_block(p).is_some())
                || live
                    .is_some_and(|l| l.delalloc.contains(&p) || l.unjournaled_block(p).is_some());
            if !has_block {
                need.push(p);
            }
        }
        if !need.is_empty() {
            st.refresh_meta_pending();
            st.meta
                .alloc
                .reserve(need.len() as u64)
                .map_err(|_| BlkError::NoSpace)?;
            st.live.entry(ino).or_default().delalloc.extend(need);
        }
        st.stamp(ino, now, true);
        Ok(())
    }
}
