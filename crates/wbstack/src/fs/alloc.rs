//! Free-space allocation: an extent map of free blocks and the allocator built on it.
//!
//! Why an extent map and not a bitmap: a device can be 100 TiB (2^35 blocks of 4 KiB); a
//! bitmap would cost 4 GiB of memory and a full scan at mount, while "a 100 TiB sparse
//! image must mkfs and mount in under a second". A `BTreeMap<start, len>` of free extents
//! costs memory by the number of extents (one for a fresh filesystem), and every operation
//! is O(log extents) (plus, for allocations, the number of pieces handed out).
//!
//! [`FreeSpace`] is the bare map. [`Allocator`] adds what the filesystem needs on top:
//!
//! * **Reservations** (delayed allocation, like ext4's `dirty_clusters` accounting):
//!   `write()` reserves space so a full device fails the write with ENOSPC, and writeback
//!   later converts the reservation into real blocks with [`Allocator::alloc_reserved`],
//!   which cannot fail for lack of space, so dirty data is never lost at writeback.
//! * **A goal cursor** (like ext4's per-inode goal / the mballoc stream allocator):
//!   allocations without an explicit goal start where the previous one ended, so the
//!   inodes written back one after the other in one pass get consecutive extents.
//! * **Deferred frees**: blocks freed by journal transaction `tid` still hold data that the
//!   last committed metadata points at; reusing them before `tid` commits would let a crash
//!   expose another file's data (or overwrite data recovery needs). They are kept aside
//!   and return to the free map only at [`Allocator::commit`].
//!
//! Nothing here does IO, takes locks or panics: every bad input comes back as an
//! [`AllocError`] saying in plain words what was wrong.

use std::collections::{BTreeMap, BTreeSet};

/// How many free extents an allocation looks at, walking forward from its goal, before it
/// gives up on locality and takes the best-fitting extent from the size index. Bounds the
/// cost of one allocation on a badly fragmented map to O(this + log extents).
const GOAL_SCAN_LIMIT: usize = 64;

/// Why an allocation operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// Not enough free (unreserved) space.
    #[error("no space left on device")]
    NoSpace,
    /// The on-disk free-space information contradicts itself (overlapping extents, a double
    /// free, replay of a range that is not free): the filesystem needs `wbstack fsck`.
    #[error("free-space map is corrupt: {0}")]
    Corrupt(String),
    /// The caller asked for something meaningless (zero length, out of the device, more
    /// than it reserved).
    #[error("invalid allocation request: {0}")]
    Invalid(String),
}

impl AllocError {
    /// The errno a syscall-like API reports for this error: ENOSPC, EUCLEAN (the kernel's
    /// "filesystem corrupted", what ext4 returns for inconsistent metadata) or EINVAL.
    pub fn errno(&self) -> i32 {
        match self {
            AllocError::NoSpace => libc::ENOSPC,
            AllocError::Corrupt(_) => libc::EUCLEAN,
            AllocError::Invalid(_) => libc::EINVAL,
        }
    }
}

/// A map of the free extents of `[first_data_block, nr_blocks)`.
///
/// Two indexes of the same extents are kept: by start (for coalescing, locality and
/// range checks) and by (length, start) (so a best fit or the largest extent is found in
/// O(log extents) however fragmented the map is). Adjacent free extents are always
/// merged, so the map is canonical: freeing everything leaves exactly one extent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FreeSpace {
    first: u64,
    end: u64,
    /// start -> len, non-overlapping, non-adjacent, all len > 0.
    by_start: BTreeMap<u64, u64>,
    /// (len, start) of the same extents.
    by_size: BTreeSet<(u64, u64)>,
    free: u64,
}

impl FreeSpace {
    /// All of `[first, nr_blocks)` free: what mkfs starts from. O(1) whatever the size.
    /// If `first >= nr_blocks` the map is empty (a device too small to hold data); it does
    /// not panic.
    pub fn new(first: u64, nr_blocks: u64) -> Self {
        let mut fs = Self::empty(first, nr_blocks);
        if fs.end > fs.first {
            fs.insert_ext(fs.first, fs.end - fs.first);
        }
        fs
    }

    fn empty(first: u64, nr_blocks: u64) -> Self {
        FreeSpace {
            first: first.min(nr_blocks),
            end: nr_blocks,
            by_start: BTreeMap::new(),
            by_size: BTreeSet::new(),
            free: 0,
        }
    }

    /// Builds the map from free extents `(start, len)` read from a checkpoint, in any order.
    /// Adjacent extents are merged. Fails with `Corrupt` if an extent is empty, overflows,
    /// lies outside `[first, nr_blocks)` or overlaps another: such a checkpoint would make
    /// the allocator hand out blocks twice.
    pub fn from_extents<I>(first: u64, nr_blocks: u64, extents: I) -> Result<Self, AllocError>
    where
        I: IntoIterator<Item = (u64, u64)>,
    {
        if first > nr_blocks {
            return Err(AllocError::Corrupt(format!(
                "the first data block {first} is beyond the end of the device ({nr_blocks} blocks)"
            )));
        }
        let mut list: Vec<(u64, u64)> = extents.into_iter().collect();
        list.sort_unstable();
        let mut fs = Self::empty(first, nr_blocks);
        // The extent being built (merging adjacent input extents).
        let mut cur: Option<(u64, u64)> = None;
        for (start, len) in list {
            if len == 0 {
                return Err(AllocError::Corrupt(format!(
                    "free extent at block {start} has length zero"
                )));
            }
            let Some(ext_end) = start.checked_add(len) else {
                return Err(AllocError::Corrupt(format!(
                    "free extent at block {start} of {len} blocks runs past the largest block number"
                )));
            };
            if start < first || ext_end > nr_blocks {
                return Err(AllocError::Corrupt(format!(
                    "free extent {start}..{ext_end} lies outside the data area {first}..{nr_blocks}"
                )));
            }
            match cur {
                Some((cs, cl)) if cs + cl > start => {
                    return Err(AllocError::Corrupt(format!(
                        "free extents {cs}..{} and {start}..{ext_end} overlap",
                        cs + cl
                    )));
                }
                Some((cs, cl)) if cs + cl == start => cur = Some((cs, cl + len)),
                Some((cs, cl)) => {
                    fs.insert_ext(cs, cl);
                    cur = Some((start, len));
                }
                None => cur = Some((start, len)),
            }
        }
        if let Some((cs, cl)) = cur {
            fs.insert_ext(cs, cl);
        }
        Ok(fs)
    }

    /// The first block the map covers (blocks before it hold the superblock, journal...).
    pub fn first_data_block(&self) -> u64 {
        self.first
    }

    /// One past the last block of the device.
    pub fn nr_blocks(&self) -> u64 {
        self.end
    }

    /// Number of blocks the map covers, free or not.
    pub fn total_blocks(&self) -> u64 {
        self.end - self.first
    }

    /// Number of free blocks.
    pub fn free_blocks(&self) -> u64 {
        self.free
    }

    /// Number of free extents: what the map costs in memory and in a checkpoint.
    pub fn nr_extents(&self) -> usize {
        self.by_start.len()
    }

    /// The free extents `(start, len)` in block order (what a checkpoint stores).
    pub fn extents(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.by_start.iter().map(|(&s, &l)| (s, l))
    }

    /// The longest free extent's length (0 if none).
    pub fn largest_extent(&self) -> u64 {
        self.by_size.iter().next_back().map_or(0, |&(l, _)| l)
    }

    /// Whether all of `[start, start + n)` is free. False for `n == 0` or a range outside
    /// the device.
    pub fn is_free(&self, start: u64, n: u64) -> bool {
        let Some(end) = start.checked_add(n) else {
            return false;
        };
        if n == 0 {
            return false;
        }
        match self.containing(start) {
            Some((s, l)) => s + l >= end,
            None => false,
        }
    }

    /// Whether any block of `[start, start + n)` is free.
    pub fn overlaps_free(&self, start: u64, n: u64) -> bool {
        let end = start.saturating_add(n);
        if n == 0 {
            return false;
        }
        // The last extent starting before `end` is the only candidate: any earlier one
        // ends before it starts.
        match self.by_start.range(..end).next_back() {
            Some((&s, &l)) => s + l > start,
            None => false,
        }
    }

    /// Allocates `n` blocks, returned as extents `(start, len)` in block order.
    ///
    /// Placement, in order of preference:
    /// 1. one extent starting exactly at `goal` if the free extent holding `goal` is long
    ///    enough (so an allocation continues the previous one);
    /// 2. the first free extent after `goal` (or after the start of the data area without
    ///    a goal) that fits, looking at no more than a bounded number of extents;
    /// 3. the smallest free extent that fits anywhere (best fit, which keeps big extents
    ///    for big requests);
    /// 4. several extents, largest first, the last piece from a best fit.
    ///
    /// Fails with `NoSpace`, changing nothing, if fewer than `n` blocks are free, and with
    /// `Invalid` for `n == 0`.
    pub fn alloc(&mut self, n: u64, goal: Option<u64>) -> Result<Vec<(u64, u64)>, AllocError> {
        if n == 0 {
            return Err(AllocError::Invalid("cannot allocate zero blocks".into()));
        }
        if n > self.free {
            return Err(AllocError::NoSpace);
        }
        if let Some(start) = self.find_near(n, goal) {
            self.remove_range(start, n);
            return Ok(vec![(start, n)]);
        }
        // Best fit, else gather pieces. Each round either finishes or takes a whole extent
        // (the largest), so the number of rounds is at most the number of pieces.
        let mut pieces = Vec::new();
        let mut remaining = n;
        while remaining > 0 {
            let fit = self.by_size.range((remaining, 0)..).next().copied();
            let (len, start) = match fit {
                Some((_, s)) => (remaining, s),
                None => match self.by_size.iter().next_back().copied() {
                    Some((l, s)) => (l, s),
                    // Unreachable while `free` is accurate; fail rather than panic, after
                    // putting back what was taken so nothing changes.
                    None => {
                        for (s, l) in pieces {
                            self.insert_free(s, l);
                        }
                        return Err(AllocError::Corrupt(
                            "free block count disagrees with the free extents".into(),
                        ));
                    }
                },
            };
            self.remove_range(start, len);
            pieces.push((start, len));
            remaining -= len;
        }
        pieces.sort_unstable();
        Ok(pieces)
    }

    /// Steps 1 and 2 of [`alloc`](Self::alloc): a start for `n` blocks at or after `goal`.
    fn find_near(&self, n: u64, goal: Option<u64>) -> Option<u64> {
        let goal = goal.unwrap_or(self.first);
        if let Some((s, l)) = self.containing(goal) {
            if s + l - goal >= n {
                return Some(goal);
            }
        }
        // Cheap exit: nothing anywhere is long enough.
        if self.largest_extent() < n {
            return None;
        }
        self.by_start
            .range(goal..)
            .take(GOAL_SCAN_LIMIT)
            .find(|&(_, &l)| l >= n)
            .map(|(&s, _)| s)
    }

    /// Marks exactly `[start, start + n)` used: journal replay re-applying an allocation.
    /// Fails with `Corrupt` if any of it is not free (replay would double-allocate) and
    /// with `Invalid` for an empty or out-of-device range.
    pub fn alloc_exact(&mut self, start: u64, n: u64) -> Result<(), AllocError> {
        self.check_range(start, n)?;
        if !self.is_free(start, n) {
            return Err(AllocError::Corrupt(format!(
                "blocks {start}..{} are not all free and cannot be allocated again",
                start + n
            )));
        }
        self.remove_range(start, n);
        Ok(())
    }

    /// Returns `[start, start + n)` to the free map, merging it with free neighbours.
    /// Fails with `Corrupt` if any of it is already free (a double free means two owners
    /// thought they had the block) and with `Invalid` for an empty or out-of-device range.
    pub fn free(&mut self, start: u64, n: u64) -> Result<(), AllocError> {
        self.check_range(start, n)?;
        if self.overlaps_free(start, n) {
            return Err(AllocError::Corrupt(format!(
                "double free: some of blocks {start}..{} are already free",
                start + n
            )));
        }
        self.insert_free(start, n);
        Ok(())
    }

    fn check_range(&self, start: u64, n: u64) -> Result<(), AllocError> {
        if n == 0 {
            return Err(AllocError::Invalid(format!("empty range at block {start}")));
        }
        match start.checked_add(n) {
            Some(end) if start >= self.first && end <= self.end => Ok(()),
            _ => Err(AllocError::Invalid(format!(
                "blocks {start}..{} are outside the data area {}..{}",
                start as u128 + n as u128,
                self.first,
                self.end
            ))),
        }
    }

    /// The free extent holding block `b`, if any.
    fn containing(&self, b: u64) -> Option<(u64, u64)> {
        self.by_start
            .range(..=b)
            .next_back()
            .filter(|&(&s, &l)| b - s < l)
            .map(|(&s, &l)| (s, l))
    }

    fn insert_ext(&mut self, s: u64, l: u64) {
        self.by_start.insert(s, l);
        self.by_size.insert((l, s));
        self.free += l;
    }

    fn remove_ext(&mut self, s: u64, l: u64) {
        self.by_start.remove(&s);
        self.by_size.remove(&(l, s));
        self.free -= l;
    }

    /// Inserts a range known not to overlap any free extent, coalescing with neighbours.
    fn insert_free(&mut self, start: u64, n: u64) {
        let mut s = start;
        let mut l = n;
        if let Some((ps, pl)) = self
            .by_start
            .range(..start)
            .next_back()
            .map(|(&a, &b)| (a, b))
        {
            if ps + pl == start {
                self.remove_ext(ps, pl);
                s = ps;
                l += pl;
            }
        }
        if let Some(nl) = self.by_start.get(&(start + n)).copied() {
            self.remove_ext(start + n, nl);
            l += nl;
        }
        self.insert_ext(s, l);
    }

    /// Removes a range known to lie inside one free extent, splitting it.
    fn remove_range(&mut self, start: u64, n: u64) {
        let Some((s, l)) = self.containing(start) else {
            return;
        };
        self.remove_ext(s, l);
        if start > s {
            self.insert_ext(s, start - s);
        }
        let tail = (s + l).saturating_sub(start + n);
        if tail > 0 {
            self.insert_ext(start + n, tail);
        }
    }
}

/// The filesystem's allocator: the free map plus reservations, a goal cursor and frees
/// deferred until their journal transaction commits.
///
/// Accounting: every block of the data area is exactly one of free (in the map), used
/// (handed out), or deferred (freed by an uncommitted transaction). Reservations are a
/// claim on free blocks, and the allocator keeps `reserved <= free` at all times, which is
/// why [`alloc_reserved`](Self::alloc_reserved) can never run out of space.
#[derive(Debug, Clone)]
pub struct Allocator {
    space: FreeSpace,
    reserved: u64,
    cursor: u64,
    /// tid -> ranges freed by that transaction, not yet reusable.
    deferred: BTreeMap<u64, Vec<(u64, u64)>>,
    /// The same ranges by start (start -> len), to reject freeing a block twice.
    deferred_ranges: BTreeMap<u64, u64>,
    deferred_blocks: u64,
    /// Every tid up to and including this one has committed.
    committed: Option<u64>,
    /// Blocks kept from writes for the metadata tree's copy-on-write nodes, so a
    /// checkpoint (and a mount's) finds room on a filesystem writes have filled.
    meta_reserve: u64,
    /// Blocks the next checkpoint may need for tree nodes (`Meta::checkpoint_need_blocks`):
    /// writes leave them too, when more than `meta_reserve`.
    meta_pending: u64,
    /// Blocks an overwrite in place is in flight to, with how many: one freed
    /// meanwhile (its file deleted or truncated, the freeing committed) is `held`, not
    /// free, until they end, or a late write would land in a block another file got.
    busy: BTreeMap<u64, u32>,
    /// Blocks free but for writes in flight to them (`busy`): deferred blocks (counted
    /// in `deferred_blocks`, one-block entries of `deferred_ranges`) until then.
    held: BTreeSet<u64>,
}

impl Allocator {
    /// An allocator over `space` with nothing reserved or deferred and the cursor at the
    /// start of the data area.
    pub fn new(space: FreeSpace) -> Self {
        let cursor = space.first_data_block();
        Allocator {
            space,
            reserved: 0,
            cursor,
            deferred: BTreeMap::new(),
            deferred_ranges: BTreeMap::new(),
            deferred_blocks: 0,
            committed: None,
            meta_reserve: 0,
            meta_pending: 0,
            busy: BTreeMap::new(),
            held: BTreeSet::new(),
        }
    }

    /// An overwrite in place of `[start, start + n)` is in flight (its blocks stay
    /// unusable, if freed meanwhile, until `end_io`).
    pub fn begin_io(&mut self, start: u64, n: u64) {
        for b in start..start + n {
            *self.busy.entry(b).or_default() += 1;
        }
    }

    /// An overwrite in place of `[start, start + n)` ended: blocks freed while it was
    /// in flight, and written by nothing else now, become free.
    pub fn end_io(&mut self, start: u64, n: u64) -> Result<(), AllocError> {
        for b in start..start + n {
            match self.busy.get_mut(&b) {
                Some(c) if *c > 1 => *c -= 1,
                Some(_) => {
                    self.busy.remove(&b);
                    if self.held.remove(&b) {
                        self.deferred_ranges.remove(&b);
                        self.deferred_blocks -= 1;
                        self.space.free(b, 1)?;
                    }
                }
                None => {
                    return Err(AllocError::Corrupt(format!(
                        "block {b}: the end of an overwrite that was not in flight"
                    )))
                }
            }
        }
        Ok(())
    }

    /// Blocks freed but held for writes in flight to them.
    pub fn held_blocks(&self) -> u64 {
        self.held.len() as u64
    }

    /// `[start, start + n)` is free now, but for blocks an overwrite is in flight to,
    /// which are held until it ends. Returns the blocks freed now.
    fn release(&mut self, start: u64, n: u64) -> Result<u64, AllocError> {
        let end = start + n;
        let busy: Vec<u64> = self.busy.range(start..end).map(|(b, _)| *b).collect();
        let mut from = start;
        let mut freed = 0;
        for b in busy {
            if b > from {
                self.space.free(from, b - from)?;
                freed += b - from;
            }
            self.held.insert(b);
            self.deferred_ranges.insert(b, 1);
            self.deferred_blocks += 1;
            from = b + 1;
        }
        if end > from {
            self.space.free(from, end - from)?;
            freed += end - from;
        }
        Ok(freed)
    }

    /// Keep `blocks` free blocks from writes, for metadata (`alloc_meta`).
    pub fn set_meta_reserve(&mut self, blocks: u64) {
        self.meta_reserve = blocks;
    }

    /// Blocks the next checkpoint may need for its nodes: kept from writes beyond
    /// `meta_reserve`, since a checkpoint takes all its new nodes' blocks before it
    /// frees the nodes they replace.
    pub fn set_meta_pending(&mut self, blocks: u64) {
        self.meta_pending = blocks;
    }

    /// Blocks kept from writes only until the next checkpoint (what it may need beyond
    /// the fixed reserve): a checkpoint gives them back.
    pub fn held_for_checkpoint(&self) -> u64 {
        self.meta_pending.max(self.meta_reserve) - self.meta_reserve
    }

    /// Free blocks nobody reserved: all that tree nodes may take.
    pub fn meta_headroom(&self) -> u64 {
        self.unreserved()
    }

    /// Free blocks nobody reserved (metadata may use all of them).
    fn unreserved(&self) -> u64 {
        self.space.free_blocks().saturating_sub(self.reserved)
    }

    /// The free map (committed free space), e.g. to write a checkpoint.
    pub fn space(&self) -> &FreeSpace {
        &self.space
    }

    /// Blocks reserved by writes not yet allocated.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// Blocks freed by transactions that have not committed.
    pub fn deferred_blocks(&self) -> u64 {
        self.deferred_blocks
    }

    /// Free blocks neither reserved, deferred nor kept for metadata: what a new
    /// `write()` may still claim.
    pub fn available(&self) -> u64 {
        self.unreserved()
            .saturating_sub(self.meta_reserve.max(self.meta_pending))
    }

    /// `(total, free, available)` blocks for statfs (`f_blocks`, `f_bfree`, `f_bavail`).
    /// Deferred blocks count as neither free nor available: they cannot be used yet.
    /// Reserved ones (delayed allocation) count as used, as ext4's dirty clusters do:
    /// else df showed data written to the cache as neither used nor available until
    /// its writeback, up to dirty_expire later.
    pub fn statfs(&self) -> (u64, u64, u64) {
        (
            self.space.total_blocks(),
            self.unreserved(),
            self.available(),
        )
    }

    /// Where the next goal-less allocation starts looking.
    pub fn cursor(&self) -> u64 {
        self.cursor
    }

    /// Moves the cursor (e.g. to the end of an inode's last extent, to extend it in place).
    pub fn set_cursor(&mut self, goal: u64) {
        self.cursor = goal;
    }

    /// Claims `n` blocks for a future [`alloc_reserved`](Self::alloc_reserved): called at
    /// `write()` time, so a full device fails the write instead of the writeback.
    pub fn reserve(&mut self, n: u64) -> Result<(), AllocError> {
        if n > self.available() {
            return Err(AllocError::NoSpace);
        }
        self.reserved += n;
        Ok(())
    }

    /// Reserves `n` of the blocks a failed data write just freed, for the data that
    /// still needs them, whatever the metadata headroom (`available` keeps it): they
    /// were data's before the failure, so the headroom never counted on them.
    pub fn reserve_freed(&mut self, n: u64) -> Result<(), AllocError> {
        if n > self.unreserved() {
            return Err(AllocError::Invalid(format!(
                "cannot reserve {n} freed blocks: only {} are unreserved",
                self.unreserved()
            )));
        }
        self.reserved += n;
        Ok(())
    }

    /// Gives back `n` reserved blocks (data truncated or overwritten before writeback).
    pub fn unreserve(&mut self, n: u64) -> Result<(), AllocError> {
        if n > self.reserved {
            return Err(AllocError::Invalid(format!(
                "cannot release {n} reserved blocks: only {} are reserved",
                self.reserved
            )));
        }
        self.reserved -= n;
        Ok(())
    }

    /// Turns `n` reserved blocks into an allocation, at `goal` or else at the cursor, and
    /// moves the cursor past it. Never fails for lack of space when `n` blocks are reserved;
    /// fails with `Invalid` if they are not.
    pub fn alloc_reserved(
        &mut self,
        n: u64,
        goal: Option<u64>,
    ) -> Result<Vec<(u64, u64)>, AllocError> {
        if n > self.reserved {
            return Err(AllocError::Invalid(format!(
                "allocation of {n} reserved blocks but only {} are reserved",
                self.reserved
            )));
        }
        let goal = goal.unwrap_or(self.cursor);
        let ext = self.space.alloc(n, Some(goal))?;
        self.reserved -= n;
        self.advance(&ext);
        Ok(ext)
    }

    /// Allocates `n` unreserved blocks near `goal` (the cursor if `None`), leaving reserved
    /// space alone, and moves the cursor past them.
    pub fn alloc(&mut self, n: u64, goal: Option<u64>) -> Result<Vec<(u64, u64)>, AllocError> {
        if n == 0 {
            return Err(AllocError::Invalid("cannot allocate zero blocks".into()));
        }
        if n > self.available() {
            return Err(AllocError::NoSpace);
        }
        let ext = self.space.alloc(n, Some(goal.unwrap_or(self.cursor)))?;
        self.advance(&ext);
        Ok(ext)
    }

    /// Allocates `n` blocks for metadata near `goal`, from all unreserved space (the
    /// metadata reserve included); the cursor stays where it was.
    pub fn alloc_meta(&mut self, n: u64, goal: u64) -> Result<Vec<(u64, u64)>, AllocError> {
        if n == 0 || n > self.unreserved() {
            return Err(AllocError::NoSpace);
        }
        self.space.alloc(n, Some(goal))
    }

    /// Allocates `n` unreserved blocks at the cursor and advances it, so back-to-back calls
    /// return adjacent extents while space there lasts.
    pub fn alloc_next(&mut self, n: u64) -> Result<Vec<(u64, u64)>, AllocError> {
        self.alloc(n, None)
    }

    /// Marks exactly `[start, start + n)` used (journal replay). Refuses, with `NoSpace`,
    /// to eat into reserved space (which would break the promise of `alloc_reserved`).
    pub fn alloc_exact(&mut self, start: u64, n: u64) -> Result<(), AllocError> {
        if n > self.unreserved() && self.space.is_free(start, n) {
            return Err(AllocError::NoSpace);
        }
        self.space.alloc_exact(start, n)
    }

    /// Frees `[start, start + n)` at once: only for blocks no committed metadata has ever
    /// pointed at (e.g. undoing an allocation whose transaction was never written).
    pub fn free(&mut self, start: u64, n: u64) -> Result<(), AllocError> {
        if self.overlaps_deferred(start, n) {
            return Err(AllocError::Corrupt(format!(
                "double free: some of blocks {start}..{} are already freed by a pending transaction",
                start.saturating_add(n)
            )));
        }
        self.release(start, n).map(|_| ())
    }

    /// Records that transaction `tid` frees `[start, start + n)`. The blocks stay unusable
    /// until [`commit`](Self::commit) of `tid`: until then the committed metadata still
    /// points at them. Fails on a double free, a bad range, or a tid already committed.
    pub fn free_deferred(&mut self, tid: u64, start: u64, n: u64) -> Result<(), AllocError> {
        self.space.check_range(start, n)?;
        if let Some(c) = self.committed {
            if tid <= c {
                return Err(AllocError::Invalid(format!(
                    "transaction {tid} has already committed (transactions up to {c} have)"
                )));
            }
        }
        if self.space.overlaps_free(start, n) || self.overlaps_deferred(start, n) {
            return Err(AllocError::Corrupt(format!(
                "double free: some of blocks {start}..{} are already free or being freed",
                start + n
            )));
        }
        self.deferred.entry(tid).or_default().push((start, n));
        self.deferred_ranges.insert(start, n);
        self.deferred_blocks += n;
        Ok(())
    }

    /// Transaction `tid` (and every earlier one) has committed: their deferred frees become
    /// free space. Returns the number of blocks released.
    pub fn commit(&mut self, tid: u64) -> Result<u64, AllocError> {
        self.committed = Some(self.committed.map_or(tid, |c| c.max(tid)));
        let later = match tid.checked_add(1) {
            Some(next) => self.deferred.split_off(&next),
            None => BTreeMap::new(),
        };
        let done = std::mem::replace(&mut self.deferred, later);
        let mut released = 0;
        let mut first_err = None;
        for (s, l) in done.into_values().flatten() {
            self.deferred_ranges.remove(&s);
            self.deferred_blocks -= l;
            match self.release(s, l) {
                Ok(n) => released += n,
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(released),
        }
    }

    fn overlaps_deferred(&self, start: u64, n: u64) -> bool {
        if n == 0 {
            return false;
        }
        let end = start.saturating_add(n);
        match self.deferred_ranges.range(..end).next_back() {
            Some((&s, &l)) => s + l > start,
            None => false,
        }
    }

    fn advance(&mut self, ext: &[(u64, u64)]) {
        if let Some(&(s, l)) = ext.last() {
            self.cursor = s + l;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_at_goal_and_coalesce() {
        let mut fs = FreeSpace::new(10, 110);
        assert_eq!(fs.alloc(5, Some(20)).unwrap(), vec![(20, 5)]);
        assert_eq!(fs.nr_extents(), 2);
        assert_eq!(fs.alloc(5, Some(25)).unwrap(), vec![(25, 5)]);
        fs.free(20, 10).unwrap();
        assert_eq!(fs.extents().collect::<Vec<_>>(), vec![(10, 100)]);
    }

    #[test]
    fn gather_when_fragmented() {
        let mut fs = FreeSpace::from_extents(0, 100, [(0, 3), (10, 4), (50, 2)]).unwrap();
        let got = fs.alloc(8, None).unwrap();
        assert_eq!(got.iter().map(|e| e.1).sum::<u64>(), 8);
        assert_eq!(fs.free_blocks(), 1);
        assert_eq!(fs.alloc(2, None), Err(AllocError::NoSpace));
        assert_eq!(fs.free_blocks(), 1);
    }

    #[test]
    fn errors_and_errno() {
        let mut fs = FreeSpace::new(2, 10);
        assert!(matches!(fs.free(3, 1), Err(AllocError::Corrupt(_))));
        assert!(matches!(fs.free(0, 1), Err(AllocError::Invalid(_))));
        assert!(matches!(fs.free(u64::MAX, 2), Err(AllocError::Invalid(_))));
        assert!(matches!(fs.alloc(0, None), Err(AllocError::Invalid(_))));
        assert_eq!(AllocError::NoSpace.errno(), libc::ENOSPC);
        assert_eq!(AllocError::Corrupt(String::new()).errno(), libc::EUCLEAN);
        assert_eq!(AllocError::Invalid(String::new()).errno(), libc::EINVAL);
        assert_eq!(FreeSpace::new(10, 5).free_blocks(), 0);
    }
}
