//! The page cache: per-inode mappings of 4 KiB pages with dirty / writeback / towrite
//! state, buffered reads and writes at any offset, on-demand readahead, LRU reclaim of
//! clean pages, and the generic writepages that turns dirty pages into bios.

use super::errseq::ErrSeq;
use crate::block::{Bio, BioEndIo, BioFlags, BlkError, BlkResult, Plug};
use crate::buf::IoBuf;
use crate::writeback::{Bdi, WbInode, Wbc};
use parking_lot::{Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

pub const PAGE_SIZE: usize = 4096;
const PAGE_SECTORS: u64 = (PAGE_SIZE / 512) as u64;

/// Where an inode's pages live on the device. Implemented by a filesystem.
pub trait AddressSpaceOps: Send + Sync + 'static {
    /// Map `n` pages of `ino` from page `index` for writing, allocating blocks where
    /// needed (delayed allocation happens here). Returns (first sector, pages) runs
    /// covering the range in order; runs covering fewer than `n` pages mean the rest
    /// has nowhere to go (the inode was deleted meanwhile) and is dropped, not failed.
    fn map_write(&self, ino: u64, index: u64, n: u64) -> Result<Vec<(u64, u64)>, BlkError>;
    /// Map for reading: (Some(first sector) or None for a hole, pages) runs in order.
    fn map_read(&self, ino: u64, index: u64, n: u64) -> Result<Vec<(Option<u64>, u64)>, BlkError>;
    /// Pages [index, index+n) are about to be written by `write()`: reserve what they
    /// need (delayed allocation) so a full device fails the write, never the writeback.
    /// Called before any page changes; an error fails the write.
    fn prepare_write(&self, _ino: u64, _index: u64, _n: u64) -> BlkResult {
        Ok(())
    }
    /// A write that `prepare_write` covered for pages [index, index+n) of `m` failed
    /// (a partial page's read): what it reserved for pages it never dirtied is held by
    /// no page, and nothing would ever release it. Called without the mapping's lock,
    /// while the failed write still counts among `m.writers()`.
    fn release_write(&self, _m: &Mapping, _index: u64, _n: u64) {}
    /// Write the inode's metadata (write_inode).
    fn write_inode(&self, _ino: u64, _sync: bool) -> BlkResult {
        Ok(())
    }
    /// A thread is about to sleep until pages of `ino` leave writeback: a filesystem
    /// holding the writes of some back (journaled data waiting for its home write)
    /// sends them now. Called without the mapping's lock.
    fn writeback_wait(&self, _ino: u64) {}
    /// The last page of `ino`'s mapping left the cache (reclaim or truncation): the
    /// kernel puts an unused inode on the inode LRU only now (`mapping_shrinkable`).
    /// Called without the mapping's lock or the cache's LRU lock.
    fn mapping_emptied(&self, _ino: u64) {}
    /// Data writes ended (ordered-data hook: only now may metadata pointing at their
    /// blocks be journaled), before their pages leave writeback: one, or every write
    /// of a completion batch (`block::bio::completion_batch`) in order.
    fn end_writes(&self, _done: &[WriteDone<'_>]) {}
}

/// A data write that ended, as `AddressSpaceOps::end_writes` is told of it.
pub struct WriteDone<'a> {
    pub ino: u64,
    /// Pages [index, index + pages) of the file, written at `sector` (as `map_write`
    /// returned it).
    pub index: u64,
    pub pages: u64,
    pub sector: u64,
    /// The file's size in bytes when the write ended.
    pub i_size: u64,
    pub status: &'a BlkResult,
}

#[derive(Clone, Debug)]
pub struct CacheConfig {
    /// Bytes of page cache; clean pages are reclaimed to stay under it, and the dirty
    /// thresholds are fractions of it (it is the "dirtyable memory").
    pub cache_size: u64,
    /// Largest readahead window, in pages (read_ahead_kb / 4).
    pub ra_max_pages: u64,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            cache_size: 1 << 30,
            ra_max_pages: 32,
        }
    }
}

struct LruEntry {
    mapping: Weak<Mapping>,
    index: u64,
}

/// Global page cache state, shared by every device.
pub struct PageCache {
    pub cfg: CacheConfig,
    /// The readahead limit in force (read_ahead_kb / 4; settable at run time).
    ra_max_pages: AtomicU64,
    nr_pages: AtomicU64,
    nr_dirty: AtomicU64,
    nr_writeback: AtomicU64,
    lru: Mutex<VecDeque<LruEntry>>,
}

impl PageCache {
    pub fn new(cfg: CacheConfig) -> Arc<PageCache> {
        Arc::new(PageCache {
            ra_max_pages: AtomicU64::new(cfg.ra_max_pages),
            cfg,
            nr_pages: AtomicU64::new(0),
            nr_dirty: AtomicU64::new(0),
            nr_writeback: AtomicU64::new(0),
            lru: Mutex::new(VecDeque::new()),
        })
    }
    pub fn ra_max_pages(&self) -> u64 {
        self.ra_max_pages.load(Ordering::Relaxed)
    }
    pub fn set_ra_max_pages(&self, pages: u64) {
        self.ra_max_pages.store(pages, Ordering::Relaxed);
    }
    pub fn capacity_pages(&self) -> u64 {
        (self.cfg.cache_size / PAGE_SIZE as u64).max(16)
    }
    pub fn nr_pages(&self) -> u64 {
        self.nr_pages.load(Ordering::Relaxed)
    }
    /// NR_FILE_DIRTY.
    pub fn nr_dirty(&self) -> u64 {
        self.nr_dirty.load(Ordering::Relaxed)
    }
    /// NR_WRITEBACK.
    pub fn nr_writeback(&self) -> u64 {
        self.nr_writeback.load(Ordering::Relaxed)
    }

    /// Add pages of `m` to the LRU's young end. Pages leave the cache without leaving the
    /// LRU (a truncation, a failed read, a deleted file's mapping dropped): reclaim skips
    /// such entries when it meets them, but below the capacity it never runs, and each
    /// entry kept the dead mapping's allocation alive (its `Weak`). So once the LRU
    /// holds more than twice the cache's pages (and 1024 more), the stale entries go
    /// (`compact_lru`): every page inserted costs O(1) amortised, and memory follows
    /// the pages cached, not the pages ever inserted.
    fn lru_add(&self, m: &Weak<Mapping>, indexes: impl Iterator<Item = u64>) {
        let mut lru = self.lru.lock();
        lru.extend(indexes.map(|index| LruEntry {
            mapping: m.clone(),
            index,
        }));
        if lru.len() as u64 > 2 * self.nr_pages() + 1024 {
            Self::compact_lru(&mut lru);
        }
    }

    /// Drop the LRU entries naming no page: a mapping gone, a page gone, or a second
    /// entry for a page (a page dropped and inserted again). Mappings are only
    /// try-locked, as in `reclaim` (the caller may hold one: insertion takes a mapping's
    /// lock, then this one); an entry whose mapping is busy stays.
    fn compact_lru(lru: &mut VecDeque<LruEntry>) {
        let mut seen: rustc_hash::FxHashSet<(usize, u64)> = Default::default();
        lru.retain(|e| {
            if e.mapping.strong_count() == 0 {
                return false;
            }
            // While any Weak to it lives, its address names only this mapping.
            if !seen.insert((e.mapping.as_ptr() as usize, e.index)) {
                return false;
            }
            let Some(m) = e.mapping.upgrade() else {
                return false;
            };
            let present = m
                .inner
                .try_lock()
                .is_none_or(|inner| inner.pages.get(&e.index).is_some());
            present
        });
    }

    /// Entries on the LRU (tests: it stays within a bound of the pages cached).
    #[cfg(test)]
    fn lru_len(&self) -> usize {
        self.lru.lock().len()
    }

    /// Reclaim clean, idle pages (second chance on referenced ones) until under the
    /// capacity, looking at a bounded number of pages: a few times the excess, so one
    /// call costs in proportion to what it must free, not to the size of the cache
    /// (a full scan per call, with the LRU locked, stalled every reader and writer
    /// whenever the cache was full of pages it could not free yet).
    fn reclaim(&self) {
        let cap = self.capacity_pages();
        let nr = self.nr_pages();
        if nr <= cap {
            return;
        }
        let Some(mut lru) = self.lru.try_lock() else {
            // Someone is reclaiming already; they free for everyone.
            return;
        };
        let mut budget = lru.len().min(((nr - cap) as usize).saturating_mul(4) + 256);
        let mut emptied = Vec::new();
        while self.nr_pages() > cap && budget > 0 {
            budget -= 1;
            let Some(e) = lru.pop_front() else { break };
            let Some(m) = e.mapping.upgrade() else {
                continue;
            };
            // Try only: page insertion takes a mapping's lock, then this LRU lock, so
            // waiting for a mapping here would be the other order (the kernel's reclaim
            // likewise only trylocks a page and moves on).
            let Some(mut inner) = m.inner.try_lock() else {
                lru.push_back(e);
                continue;
            };
            let pinned = inner.pinned.contains(&e.index);
            match inner.pages.get_mut(&e.index) {
                None => {}
                Some(p) if p.dirty || p.writeback || p.reading || !p.uptodate || pinned => {
                    drop(inner);
                    lru.push_back(e);
                }
                Some(p) if p.referenced => {
                    p.referenced = false;
                    drop(inner);
                    lru.push_back(e);
                }
                Some(_) => {
                    inner.pages.remove(&e.index);
                    self.nr_pages.fetch_sub(1, Ordering::Relaxed);
                    if inner.pages.is_empty() {
                        drop(inner);
                        emptied.push(m);
                    }
                }
            }
        }
        drop(lru);
        for m in emptied {
            m.ops.mapping_emptied(m.ino);
        }
    }
}

/// Pages claimed for one write, `pages` from index `first`, and their data as it was
/// at the claim, in one buffer.
struct ClaimedRun {
    first: u64,
    pages: u64,
    copy: IoBuf,
}

/// Pages claimed for writeback and not yet handed to a bio (nor ended), in file order:
/// if the code between the claim and the bio panics (the filesystem's `map_write`, the
/// block layer), the unwind ends their writeback with EIO. Left under writeback, they
/// would keep every waiter for them (fsync, truncate, sync, unmount) waiting forever.
struct Unsubmitted<'a> {
    mapping: &'a Mapping,
    gen: WbGen,
    pages: VecDeque<Range<u64>>,
}

impl Unsubmitted<'_> {
    /// The next `n` pages, from `index`, are handed over (to a bio, or ended).
    fn handed_over(&mut self, index: u64, n: u64) {
        let front = self.pages.front_mut().expect("pages handed over twice");
        debug_assert_eq!(front.start, index, "pages handed over out of order");
        front.start += n;
        debug_assert!(
            front.start <= front.end,
            "more pages handed over than claimed"
        );
        if front.is_empty() {
            self.pages.pop_front();
        }
    }
}

impl Drop for Unsubmitted<'_> {
    fn drop(&mut self) {
        debug_assert!(
            self.pages.is_empty() || std::thread::panicking(),
            "claimed pages neither submitted nor ended: {:?}",
            self.pages
        );
        for r in std::mem::take(&mut self.pages) {
            let n = r.end - r.start;
            self.mapping
                .end_writeback_as(r.start, n, self.gen, None, Err(BlkError::Io));
        }
    }
}

/// Which claim put a page under writeback: a per-mapping generation stamped on the
/// pages one claim takes (a batch of `writepages`, or `claim_dirty`) and carried by
/// the write's completion, which ends writeback only on pages still bearing it. A page
/// dropped under writeback (`set_size`) may have been written again and claimed anew
/// at the same index by the time the old write completes: that completion must leave
/// the new page, whose own write is still in flight, alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WbGen(u64);

struct Page {
    buf: IoBuf,
    dirty: bool,
    writeback: bool,
    /// The claim that put the page under writeback (meaningful while `writeback`).
    wb_gen: WbGen,
    towrite: bool,
    uptodate: bool,
    /// A read is filling it; wait on the mapping's condvar.
    reading: bool,
    /// The read filling it (meaningful while `reading`): a read's completion fills
    /// only the pages still bearing its generation. A page dropped mid-read (a
    /// truncation) may be back at the same index with a read of its own in flight,
    /// of another block, by the time the old read completes.
    read_gen: u64,
    referenced: bool,
}

impl Page {
    fn with_buf(buf: IoBuf, uptodate: bool) -> Page {
        Page {
            buf,
            dirty: false,
            writeback: false,
            wb_gen: WbGen(0),
            towrite: false,
            uptodate,
            reading: false,
            read_gen: 0,
            referenced: true,
        }
    }

    /// A page whose whole content is `data` (never zeroed first).
    fn with_data(data: &[u8]) -> Page {
        Page::with_buf(IoBuf::from_slice(data), true)
    }

    fn new() -> Page {
        Page::with_buf(IoBuf::zeroed(PAGE_SIZE), false)
    }
}

/// What a wait for a page's read found.
enum Waited<'a> {
    Present(MutexGuard<'a, Inner>),
    /// Truncated away meanwhile: the caller looks the page up again.
    Gone(MutexGuard<'a, Inner>),
}

/// ondemand_readahead's state (struct file_ra_state): the newest window and the page
/// that, when a read reaches it, starts the next window in the background.
#[derive(Default)]
struct Readahead {
    /// Page after the last one read: a read starting here is sequential.
    next: u64,
    /// Pages in the newest window.
    window: u64,
    /// First page after the newest window.
    end: u64,
    /// PG_readahead: the page whose read starts the next window (asynchronous
    /// readahead), so a sequential reader finds its pages read or in flight. `None`
    /// after a random read.
    marker: Option<u64>,
}

impl Readahead {
    /// get_next_ra_size: grow fast while small, then double, up to `max`.
    fn next_size(cur: u64, max: u64) -> u64 {
        if cur < max / 16 { cur * 4 } else { cur * 2 }.min(max)
    }
}

struct Inner {
    pages: crate::smallmap::SmallMap<Page>,
    size: u64,
    nr_dirty: u64,
    /// Pages under writeback.
    nr_wb: u64,
    /// The last writeback generation handed out (`WbGen`); never reused.
    wb_gen: u64,
    /// The last read generation handed out (`Page::read_gen`); never reused.
    read_gen: u64,
    /// Cyclic writeback cursor (mapping->writeback_index).
    writeback_index: u64,
    ra: Readahead,
    /// Latest read error (a reader waiting on a page that failed to read gets it).
    error: Option<BlkError>,
    /// Reads failed so far: a waiter whose page is gone with no read failed since it
    /// looked lost the page to a truncation, and looks again.
    read_failures: u64,
    /// Pages threads wait to read, one entry per waiter (the folio reference a reader
    /// holds in the kernel): reclaim leaves them, so a waiter never wakes to find the
    /// page it waited for freed before it could copy it.
    pinned: Vec<u64>,
    /// The legacy AS_EIO / AS_ENOSPC bit: the errno of a write error not yet reported
    /// by `write_and_wait` (filemap_check_errors consumes it; errseq does not).
    as_err: Option<i32>,
}

/// Pages one `write_at` fills, or one `read_at` copies, under one hold of the
/// mapping's lock.
const BATCH_PAGES: usize = 64;

/// What a batch of `write_at` did that others must learn (`Mapping::publish`).
#[derive(Default)]
struct WriteBatch {
    /// Pages handled under the current hold.
    pages: usize,
    /// Pages inserted, for the LRU.
    fresh: Vec<u64>,
    /// Pages made dirty and not yet counted globally.
    dirtied: u64,
    /// Pages made dirty by the whole write (for throttling).
    total_dirtied: u64,
    /// The batch made the inode's first dirty page.
    queue_inode: bool,
}

/// One inode's pages.
pub struct Mapping {
    ino: u64,
    wb_err: ErrSeq,
    bdi: Arc<Bdi>,
    ops: Arc<dyn AddressSpaceOps>,
    inner: Mutex<Inner>,
    /// Signalled when a page leaves writeback or finishes reading.
    cv: Condvar,
    me: Weak<Mapping>,
    /// Writes between their `prepare_write` and their end: a failed one may release
    /// only reservations no other write in progress counts on.
    writers: std::sync::atomic::AtomicU32,
    /// The inode's i_rwsem, as the filesystem uses it: its writes hold it shared, a
    /// truncation exclusive, so no truncation frees a block between a write's
    /// reservation (which found the block and reserved nothing) and its copy.
    i_rwsem: RwLock<()>,
    /// Truncations waiting for `i_rwsem`.
    truncations_waiting: std::sync::atomic::AtomicU32,
}

impl Mapping {
    pub fn new(ino: u64, size: u64, bdi: Arc<Bdi>, ops: Arc<dyn AddressSpaceOps>) -> Arc<Mapping> {
        Arc::new_cyclic(|me| Mapping {
            ino,
            wb_err: ErrSeq::new(),
            bdi,
            ops,
            inner: Mutex::new(Inner {
                pages: crate::smallmap::SmallMap::default(),
                size,
                nr_dirty: 0,
                nr_wb: 0,
                wb_gen: 0,
                read_gen: 0,
                writeback_index: 0,
                ra: Readahead::default(),
                error: None,
                read_failures: 0,
                pinned: Vec::new(),
                as_err: None,
            }),
            cv: Condvar::new(),
            me: me.clone(),
            writers: std::sync::atomic::AtomicU32::new(0),
            i_rwsem: RwLock::new(()),
            truncations_waiting: std::sync::atomic::AtomicU32::new(0),
        })
    }

    pub fn ino(&self) -> u64 {
        self.ino
    }
    pub fn bdi(&self) -> &Arc<Bdi> {
        &self.bdi
    }
    pub fn size(&self) -> u64 {
        self.inner.lock().size
    }
    pub fn nr_dirty(&self) -> u64 {
        self.inner.lock().nr_dirty
    }
    /// Hold for a write through the filesystem: shared with other writes, excluding
    /// truncation (`lock_for_truncate`). Not taken again while held: a truncation
    /// waiting for it would stop the second taking.
    pub fn lock_for_write(&self) -> RwLockReadGuard<'_, ()> {
        self.i_rwsem.read()
    }
    /// Hold for a truncation: waits for every write in progress, and keeps new ones
    /// out until dropped.
    pub fn lock_for_truncate(&self) -> RwLockWriteGuard<'_, ()> {
        self.truncations_waiting.fetch_add(1, Ordering::SeqCst);
        let g = self.i_rwsem.write();
        let prev = self.truncations_waiting.fetch_sub(1, Ordering::SeqCst);
        debug_assert!(prev > 0, "a truncation stopped waiting twice");
        g
    }
    /// Truncations waiting for writes in progress (`lock_for_truncate`).
    pub fn truncations_waiting(&self) -> u32 {
        self.truncations_waiting.load(Ordering::SeqCst)
    }
    /// Writes in progress (past their `prepare_write`, not yet returned).
    pub fn writers(&self) -> u32 {
        self.writers.load(Ordering::SeqCst)
    }
    /// Of the pages at `indices`, those holding data still to be written: dirty, or
    /// under writeback (with `dirty_only`, dirty: written again since their last claim,
    /// if under writeback). One hold of the lock for them all, in the order given.
    pub fn pages_owing_write(
        &self,
        indices: impl IntoIterator<Item = u64>,
        dirty_only: bool,
    ) -> Vec<u64> {
        let inner = self.inner.lock();
        indices
            .into_iter()
            .filter(|i| {
                inner
                    .pages
                    .get(i)
                    .is_some_and(|p| p.dirty || (!dirty_only && p.writeback))
            })
            .collect()
    }
    pub fn nr_pages(&self) -> usize {
        self.inner.lock().pages.len()
    }
    /// Pages currently under writeback.
    pub fn nr_writeback(&self) -> usize {
        self.inner.lock().nr_wb as usize
    }
    /// The latest read error seen on this mapping, if any.
    pub fn error(&self) -> Option<BlkError> {
        self.inner.lock().error.clone()
    }
    /// The writeback error sequence (`mapping->wb_err`): open files sample it and
    /// fsync reports what changed since, once per file. It lives as long as the
    /// mapping, so the error outlives the failed pages' eviction.
    pub fn wb_err(&self) -> &ErrSeq {
        &self.wb_err
    }

    fn arc(&self) -> Arc<Mapping> {
        self.me.upgrade().expect("mapping in use is alive")
    }

    fn cache(&self) -> &PageCache {
        self.bdi.cache()
    }

    fn insert_page(&self, inner: &mut Inner, index: u64) {
        self.insert_page_with(inner, index, Page::new());
    }

    fn insert_page_with(&self, inner: &mut Inner, index: u64, page: Page) {
        inner.pages.insert(index, page);
        self.cache().nr_pages.fetch_add(1, Ordering::Relaxed);
        self.cache().lru_add(&self.me, std::iter::once(index));
    }

    /// Mark one page dirty, counted at once; returns whether it was clean. (`write_at`
    /// counts its pages per batch instead, see `publish`.)
    fn set_dirty(&self, inner: &mut Inner, index: u64) -> bool {
        let Some(p) = inner.pages.get_mut(&index) else {
            debug_assert!(false, "set_dirty of a missing page {index}");
            return false;
        };
        if p.dirty {
            return false;
        }
        p.dirty = true;
        inner.nr_dirty += 1;
        self.cache().nr_dirty.fetch_add(1, Ordering::Relaxed);
        self.bdi.account_dirtied(1);
        true
    }

    fn clear_dirty(&self, p: &mut Page, nr_dirty: &mut u64) {
        if p.dirty {
            p.dirty = false;
            p.towrite = false;
            debug_assert!(*nr_dirty > 0, "a dirty page not counted");
            *nr_dirty -= 1;
            let prev = self.cache().nr_dirty.fetch_sub(1, Ordering::Relaxed);
            debug_assert!(prev > 0, "a dirty page not counted globally");
            self.bdi.account_cleaned(1);
        }
    }

    /// A new writeback generation, for the pages of one claim. A claim takes a page
    /// index at most once, so (index, generation) names one write of one page.
    fn next_wb_gen(inner: &mut Inner) -> WbGen {
        inner.wb_gen += 1;
        WbGen(inner.wb_gen)
    }

    /// Put a clean page under writeback for the claim `gen`.
    fn start_page_writeback(p: &mut Page, nr_wb: &mut u64, gen: WbGen) {
        debug_assert!(!p.writeback, "a page claimed twice for writeback");
        p.writeback = true;
        p.wb_gen = gen;
        *nr_wb += 1;
    }

    /// Buffered write of `data` at byte `off`. Partial pages inside the file are read
    /// first (read-modify-write); the writer is then throttled (never made to write).
    ///
    /// Pages are filled in batches under one hold of the mapping's lock, with their
    /// LRU entries and the global dirty counts published once per batch: per page, the
    /// lock, the LRU lock and four shared counters cost as much as the copy itself.
    pub fn write_at(&self, off: u64, data: &[u8]) -> Result<usize, BlkError> {
        self.write_at_as(off, data, true)
    }

    /// `write_at` without the dirty throttle, for a write of a page or two made while
    /// holding something the flusher waits for (a truncation's rewritten partial last
    /// page: flush batches wait for truncations in progress, so a throttled sleep there
    /// would wait for writeback that waits for it).
    pub fn write_at_unthrottled(&self, off: u64, data: &[u8]) -> Result<usize, BlkError> {
        debug_assert!(
            data.len() <= 2 * PAGE_SIZE,
            "an unthrottled write of {} bytes",
            data.len()
        );
        self.write_at_as(off, data, false)
    }

    fn write_at_as(&self, off: u64, data: &[u8], throttle: bool) -> Result<usize, BlkError> {
        if data.is_empty() {
            return Ok(0);
        }
        let first = off / PAGE_SIZE as u64;
        let n = (off + data.len() as u64 - 1) / PAGE_SIZE as u64 - first + 1;
        // Counted before `prepare_write`: a failed write that finds no other writer
        // counted (under the filesystem's lock) knows none relies on its reservations.
        self.writers.fetch_add(1, Ordering::SeqCst);
        let r = self.ops.prepare_write(self.ino, first, n).and_then(|()| {
            let mut done = 0;
            match self.fill_pages(off, data, throttle, &mut done) {
                Ok(()) => Ok(done),
                Err(e) => {
                    self.ops.release_write(self, first, n);
                    // As generic_perform_write: what was copied is the write's result,
                    // the error only if nothing was (the caller sees the short count
                    // and its retry meets the error).
                    if done > 0 {
                        Ok(done)
                    } else {
                        Err(e)
                    }
                }
            }
        });
        let prev = self.writers.fetch_sub(1, Ordering::SeqCst);
        debug_assert!(prev > 0, "a write ended that never began");
        r
    }

    /// `write_at_as` past its reservation.
    /// `done` counts the bytes copied, which stay written when a later page fails.
    fn fill_pages(
        &self,
        off: u64,
        data: &[u8],
        throttle: bool,
        done: &mut usize,
    ) -> Result<(), BlkError> {
        let mut batch = WriteBatch::default();
        let mut inner = self.inner.lock();
        while *done < data.len() {
            let pos = off + *done as u64;
            let index = pos / PAGE_SIZE as u64;
            let in_page = (pos % PAGE_SIZE as u64) as usize;
            let n = (PAGE_SIZE - in_page).min(data.len() - *done);
            let partial = in_page != 0 || n != PAGE_SIZE;
            if batch.pages >= BATCH_PAGES {
                // Let writeback and readers in between batches of a long write.
                self.publish(&mut batch);
                drop(inner);
                self.queue_inode(&mut batch);
                inner = self.inner.lock();
            }
            match inner.pages.get(&index) {
                None if partial && index * (PAGE_SIZE as u64) < inner.size => {
                    self.publish(&mut batch);
                    let seen = inner.read_failures;
                    drop(inner);
                    self.queue_inode(&mut batch);
                    self.read_pages(index, 1)?;
                    match self.wait_page_read(self.inner.lock(), index, seen)? {
                        Waited::Present(g) => inner = g,
                        Waited::Gone(g) => {
                            inner = g;
                            continue;
                        }
                    }
                }
                None if !partial => {
                    // Fully overwritten: built from the data, never zeroed first.
                    let page = Page::with_data(&data[*done..*done + n]);
                    inner.pages.insert(index, page);
                    batch.fresh.push(index);
                }
                None => {
                    // A partial page at or past EOF: the rest of it reads as zeros.
                    let mut page = Page::new();
                    page.uptodate = true;
                    inner.pages.insert(index, page);
                    batch.fresh.push(index);
                }
                Some(p) if p.reading || (partial && !p.uptodate) => {
                    // Listed before any wait that can fail: what this write dirtied so
                    // far is written back whatever the read does (a failed write that
                    // returned here left its pages dirty on no list, for good).
                    self.publish(&mut batch);
                    let seen = inner.read_failures;
                    drop(inner);
                    self.queue_inode(&mut batch);
                    match self.wait_page_read(self.inner.lock(), index, seen) {
                        Ok(Waited::Present(g)) => inner = g,
                        Ok(Waited::Gone(g)) => {
                            inner = g;
                            continue;
                        }
                        // Another reader's read failed: a page this write covers whole
                        // needs nothing of it.
                        Err(_) if !partial => {
                            inner = self.inner.lock();
                            continue;
                        }
                        Err(e) => return Err(e),
                    }
                    if partial && !inner.pages[&index].uptodate {
                        let seen = inner.read_failures;
                        drop(inner);
                        self.read_pages(index, 1)?;
                        match self.wait_page_read(self.inner.lock(), index, seen)? {
                            Waited::Present(g) => inner = g,
                            Waited::Gone(g) => {
                                inner = g;
                                continue;
                            }
                        }
                    }
                }
                Some(_) => {}
            }
            let was_clean_inode = inner.nr_dirty == 0;
            {
                let Some(p) = inner.pages.get_mut(&index) else {
                    debug_assert!(false, "page {index} of inode {} vanished", self.ino);
                    self.publish(&mut batch);
                    drop(inner);
                    self.queue_inode(&mut batch);
                    return Err(BlkError::Io);
                };
                p.buf.as_mut_slice()[in_page..in_page + n].copy_from_slice(&data[*done..*done + n]);
                p.uptodate = true;
                p.referenced = true;
                if !p.dirty {
                    p.dirty = true;
                    inner.nr_dirty += 1;
                    batch.dirtied += 1;
                    batch.queue_inode |= was_clean_inode;
                }
            }
            let end = pos + n as u64;
            if end > inner.size {
                inner.size = end;
            }
            batch.pages += 1;
            *done += n;
        }
        self.publish(&mut batch);
        drop(inner);
        self.queue_inode(&mut batch);
        let dirtied = batch.total_dirtied;
        self.cache().reclaim();
        if dirtied > 0 && throttle {
            self.bdi.balance_dirty_pages(dirtied);
        }
        Ok(())
    }

    /// Make a batch of `write_at` visible: the new pages join the LRU and the global
    /// count, the dirtied ones the dirty counts. Called with the mapping's lock held,
    /// before anyone else can see the pages: writeback cleaning a page before its
    /// dirtying was counted would take the global count below zero.
    fn publish(&self, batch: &mut WriteBatch) {
        let cache = self.cache();
        if !batch.fresh.is_empty() {
            cache
                .nr_pages
                .fetch_add(batch.fresh.len() as u64, Ordering::Relaxed);
            cache.lru_add(&self.me, batch.fresh.drain(..));
        }
        if batch.dirtied > 0 {
            cache.nr_dirty.fetch_add(batch.dirtied, Ordering::Relaxed);
            self.bdi.account_dirtied(batch.dirtied);
            batch.total_dirtied += batch.dirtied;
            batch.dirtied = 0;
        }
        batch.pages = 0;
    }

    /// __mark_inode_dirty for a batch that dirtied the inode's first page: only the
    /// clean→dirty transition queues it. Called without the mapping's lock: the bdi's
    /// lists lock is taken before a mapping's lock, never inside it.
    fn queue_inode(&self, batch: &mut WriteBatch) {
        if std::mem::take(&mut batch.queue_inode) {
            self.bdi.mark_inode_dirty(self.arc());
        }
    }

    /// Wait until `index` is not being read, pinned meanwhile. Returns the lock with
    /// the page present (`Present`), or `Gone` if a truncation took it (look again);
    /// an error if a read failed since `failures_seen` (an `Inner::read_failures`
    /// sampled before the caller's read started) and the page is gone.
    fn wait_page_read<'a>(
        &self,
        mut inner: MutexGuard<'a, Inner>,
        index: u64,
        failures_seen: u64,
    ) -> Result<Waited<'a>, BlkError> {
        let mut pinned = false;
        let r = loop {
            match inner.pages.get(&index) {
                Some(p) if p.reading => {
                    if !pinned {
                        inner.pinned.push(index);
                        pinned = true;
                    }
                    // Without the lock: the read may sit in this thread's plug (a
                    // caller's outer plug holds it), and a device completing inline
                    // ends it here, in `end_read`, which takes the lock.
                    MutexGuard::unlocked(&mut inner, crate::block::flush_plug);
                    if inner.pages.get(&index).is_some_and(|p| p.reading) {
                        self.cv.wait(&mut inner);
                    }
                }
                Some(_) => break Ok(true),
                None if inner.read_failures != failures_seen => {
                    break Err(inner.error.clone().unwrap_or(BlkError::Io))
                }
                None => break Ok(false),
            }
        };
        if pinned {
            let Some(at) = inner.pinned.iter().position(|&i| i == index) else {
                debug_assert!(false, "page {index} of inode {} lost its pin", self.ino);
                return Err(BlkError::Io);
            };
            inner.pinned.swap_remove(at);
            if inner.pinned.is_empty() {
                inner.pinned = Vec::new();
            }
        }
        match r? {
            true => Ok(Waited::Present(inner)),
            false => Ok(Waited::Gone(inner)),
        }
    }

    /// Buffered read into `out` at byte `off`; returns bytes read (short at EOF).
    pub fn read_at(&self, off: u64, out: &mut [u8]) -> Result<usize, BlkError> {
        let mut len = out.len();
        let mut done = 0usize;
        while done < len {
            let pos = off + done as u64;
            let index = pos / PAGE_SIZE as u64;
            let in_page = (pos % PAGE_SIZE as u64) as usize;
            let mut inner = self.inner.lock();
            // The size as of now, not of the call: a truncation meanwhile ends the read
            // at its new end (and a page past it is never read in again, `read_pages`).
            let size = inner.size;
            if pos >= size {
                break;
            }
            len = len.min((size - off) as usize);
            let seen = inner.read_failures;
            let present = inner
                .pages
                .get(&index)
                .is_some_and(|p| p.uptodate || p.reading);
            let eof_pages = size.div_ceil(PAGE_SIZE as u64);
            // ra_max_pages 0 (read_ahead_kb=0) still reads the page asked for.
            let max = self.cache().ra_max_pages().max(1);
            if !present {
                // page_cache_sync_ra: a sequential miss grows the window, any other
                // starts small. The next window starts when the reader leaves this
                // page (the kernel's async_size = size - req_size).
                let ra = &mut inner.ra;
                ra.window = if index == ra.next && ra.window > 0 {
                    Readahead::next_size(ra.window, max)
                } else {
                    4.min(max)
                };
                let window = ra.window.min(eof_pages - index);
                ra.end = index + window;
                ra.marker = (window > 1).then_some(index + 1);
                drop(inner);
                self.read_pages(index, window)?;
                inner = self.inner.lock();
            } else if inner.ra.marker == Some(index) && inner.ra.end < eof_pages {
                // page_cache_async_ra: the reader reached the marker, so read the next
                // window now, while it consumes this one; its first page is the next
                // marker. An error is left for the read that needs the page.
                let ra = &mut inner.ra;
                ra.window = Readahead::next_size(ra.window, max);
                let start = ra.end;
                let window = ra.window.min(eof_pages - start);
                ra.end = start + window;
                ra.marker = Some(start);
                drop(inner);
                let _ = self.read_pages(start, window);
                inner = self.inner.lock();
            }
            inner = match self.wait_page_read(inner, index, seen)? {
                Waited::Present(g) => g,
                // Truncated while read: look again (at the size the file has now).
                Waited::Gone(_) => continue,
            };
            // And the size after the wait, as filemap_read reads i_size once it has the
            // folio: a truncation into this page while it was read ends the copy there.
            let size = inner.size;
            if pos >= size {
                break;
            }
            len = len.min((size - off) as usize);
            let n = (PAGE_SIZE - in_page).min(len - done);
            {
                let p = inner.pages.get_mut(&index).unwrap();
                p.referenced = true;
                out[done..done + n].copy_from_slice(&p.buf.as_slice()[in_page..in_page + n]);
            }
            done += n;
            let mut next = index + 1;
            // The pages that follow and need nothing (cached, up to date, not a
            // readahead marker) are copied under the same hold of the lock, up to a
            // batch: a lock per page cost as much as the copy.
            let marker = inner.ra.marker;
            let mut held = 1;
            while done < len && held < BATCH_PAGES && marker != Some(next) {
                let Some(p) = inner.pages.get_mut(&next) else {
                    break;
                };
                if !p.uptodate || p.reading {
                    break;
                }
                let n = PAGE_SIZE.min(len - done);
                p.referenced = true;
                out[done..done + n].copy_from_slice(&p.buf.as_slice()[..n]);
                done += n;
                next += 1;
                held += 1;
            }
            inner.ra.next = next;
            drop(inner);
        }
        self.cache().reclaim();
        Ok(done)
    }

    /// Start reading the absent pages of [index, index+n) (one bio per mapped run, in a
    /// plug); holes become zero pages at once.
    fn read_pages(&self, index: u64, n: u64) -> BlkResult {
        let mut todo = Vec::new();
        let gen = {
            let mut inner = self.inner.lock();
            inner.read_gen += 1;
            let gen = inner.read_gen;
            // Never past the end as of now: a reader that looked at the size before a
            // truncation would otherwise bring the cut-off pages back, read from blocks
            // the truncation is about to free, and a later extension would show them.
            let end = (index + n).min(inner.size.div_ceil(PAGE_SIZE as u64));
            for i in index..end {
                match inner.pages.get_mut(&i) {
                    Some(p) if p.uptodate || p.reading => {}
                    Some(p) => {
                        p.reading = true;
                        p.read_gen = gen;
                        todo.push(i);
                    }
                    None => {
                        self.insert_page(&mut inner, i);
                        let p = inner.pages.get_mut(&i).unwrap();
                        p.reading = true;
                        p.read_gen = gen;
                        todo.push(i);
                    }
                }
            }
            gen
        };
        if todo.is_empty() {
            return Ok(());
        }
        let q = self.bdi.queue().clone();
        let _plug = Plug::start();
        // Contiguous runs of pages to read.
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for i in todo {
            match runs.last_mut() {
                Some((s, c)) if *s + *c == i => *c += 1,
                _ => runs.push((i, 1)),
            }
        }
        for (start, cnt) in runs {
            let map = match self.ops.map_read(self.ino, start, cnt) {
                Ok(m) => m,
                Err(e) => {
                    self.end_read(start, cnt, gen, None, Err(e.clone()));
                    return Err(e);
                }
            };
            let mut idx = start;
            for (sector, pages) in map {
                match sector {
                    None => self.end_read(idx, pages, gen, None, Ok(())),
                    Some(sec) => {
                        let bio = Bio::read(sec, (pages as usize) * PAGE_SIZE).with_end_io(
                            Arc::new(ReadEnd {
                                mapping: self.arc(),
                                index: idx,
                                pages,
                                gen,
                            }),
                        );
                        if let Err(e) = q.submit_bio(bio) {
                            self.end_read(idx, pages, gen, None, Err(e.clone()));
                            return Err(e);
                        }
                    }
                }
                idx += pages;
            }
        }
        Ok(())
    }

    /// The read `gen` of [index, index+n) ended: it fills, or on failure drops, only
    /// the pages it is still reading (`Page::read_gen`), never a page that replaced
    /// one of them.
    fn end_read(&self, index: u64, n: u64, gen: u64, data: Option<&IoBuf>, status: BlkResult) {
        let mut inner = self.inner.lock();
        let size_now = inner.size;
        let ok = status.is_ok();
        let mut own = false;
        for k in 0..n {
            let i = index + k;
            let Some(p) = inner.pages.get_mut(&i) else {
                continue;
            };
            if !p.reading || p.read_gen != gen {
                continue;
            }
            own = true;
            p.reading = false;
            if ok {
                match data {
                    Some(d) => p.buf.as_mut_slice().copy_from_slice(
                        &d.as_slice()[k as usize * PAGE_SIZE..(k as usize + 1) * PAGE_SIZE],
                    ),
                    None => p.buf.as_mut_slice().fill(0),
                }
                // A truncation into this page while it was read zeroed a tail the read
                // then filled with the old bytes: past the end a page holds zeros, so
                // an extension reads them (`cut_pages`).
                let in_file = size_now
                    .saturating_sub(i * PAGE_SIZE as u64)
                    .min(PAGE_SIZE as u64) as usize;
                p.buf.as_mut_slice()[in_file..].fill(0);
                p.uptodate = true;
            } else if !p.uptodate && !p.dirty {
                inner.pages.remove(&i);
                self.cache().nr_pages.fetch_sub(1, Ordering::Relaxed);
            }
        }
        // A failure of pages all gone or replaced is nobody's: their waiters look
        // again (`Waited::Gone`) rather than take an error of a read they no longer need.
        if let (Err(e), true) = (status, own) {
            inner.error = Some(e);
            inner.read_failures += 1;
        }
        drop(inner);
        self.cv.notify_all();
    }

    /// Change the file size; pages past the new end are dropped (dirty ones too), even
    /// under writeback: their writes still complete, ending the writeback of no page
    /// that replaced them (`WbGen`). Only for a file whose blocks go with it (deletion,
    /// eviction, a deferred truncation to zero); a truncation that keeps the file's
    /// blocks uses `truncate`.
    pub fn set_size(&self, size: u64) {
        let mut inner = self.inner.lock();
        self.cut_pages(&mut inner, size, false);
    }

    /// truncate_setsize and truncate_pagecache: set the size, then drop the pages past
    /// it once no write of theirs is in flight, waiting for the writes of those pages
    /// and of the new partial last page. A page claimed for writeback is copied at once
    /// but mapped to a block later; once this returns, no write of the old content past
    /// the new end is in flight or yet to be mapped, so a filesystem that logs the
    /// truncation after it can never map such a write inside a later extension, nor see
    /// it land in a block the truncation freed. Concurrent writes past the new end are
    /// ordered before the truncation (their pages are dropped). Must not be called
    /// holding a lock that write completion takes.
    pub fn truncate(&self, size: u64) {
        crate::block::flush_plug();
        let mut inner = self.inner.lock();
        let had_pages = !inner.pages.is_empty();
        // An extension cuts nothing: no old content past the end to wait for.
        let shrink = size < inner.size;
        while self.cut_pages(&mut inner, size, true) && shrink {
            self.sleep_on_writeback(&mut inner, |m, i| m.cut_pages(i, size, true));
        }
        let emptied = had_pages && inner.pages.is_empty();
        drop(inner);
        if emptied {
            self.ops.mapping_emptied(self.ino);
        }
    }

    /// Set the size and drop the pages past it, zeroing the tail of a partial last
    /// page. With `keep_writeback`, pages under writeback stay (cleaned, so not claimed
    /// again) and the answer is whether a write past the new end, or of the partial
    /// last page, is still in flight.
    fn cut_pages(&self, inner: &mut Inner, size: u64, keep_writeback: bool) -> bool {
        let first_gone = size.div_ceil(PAGE_SIZE as u64);
        let gone: Vec<u64> = inner.pages.range(first_gone..).map(|(k, _)| *k).collect();
        for k in gone {
            let mut nd = inner.nr_dirty;
            let p = inner.pages.get_mut(&k).unwrap();
            self.clear_dirty(p, &mut nd);
            inner.nr_dirty = nd;
            if keep_writeback && p.writeback {
                continue;
            }
            let p = inner.pages.remove(&k).unwrap();
            if p.writeback {
                // Its IO still completes (and then finds its page gone, or another
                // page at this index: see `WbGen`); waiters must not wait for a page
                // gone.
                debug_assert!(inner.nr_wb > 0, "a page under writeback not counted");
                inner.nr_wb -= 1;
            }
            self.cache().nr_pages.fetch_sub(1, Ordering::Relaxed);
        }
        // Zero the tail of a now-partial last page so a later extension reads zeros.
        if !size.is_multiple_of(PAGE_SIZE as u64) {
            if let Some(p) = inner.pages.get_mut(&(size / PAGE_SIZE as u64)) {
                p.buf.as_mut_slice()[(size % PAGE_SIZE as u64) as usize..].fill(0);
            }
        }
        inner.size = size;
        inner
            .pages
            .range(size / PAGE_SIZE as u64..)
            .any(|(_, p)| p.writeback)
    }

    /// Generic writepages (write_cache_pages): write the selected dirty pages as bios,
    /// contiguous pages in one bio, inside this inode's own plug (a no-op when the
    /// flusher already holds one for the whole pass).
    pub fn writepages(&self, wbc: &mut Wbc) -> BlkResult {
        let max_pages = (self.bdi.queue().max_sectors() as u64 / PAGE_SECTORS).max(1);
        let (lo, hi) = wbc.range.unwrap_or((0, u64::MAX));
        let integrity = wbc.sync_all || wbc.tagged;
        // Phase 1, under the lock and cheap: tag, and pick the pages to visit, in order.
        let (keys, mut next_cursor) = {
            let mut inner = self.inner.lock();
            if integrity {
                // tag_pages_for_writeback: only pages dirty now are written, so a writer
                // that keeps dirtying cannot livelock this pass.
                for (_, p) in inner.pages.range_mut(lo..=hi) {
                    if p.dirty {
                        p.towrite = true;
                    }
                }
            }
            let start = if wbc.range_cyclic {
                inner.writeback_index
            } else {
                lo
            };
            let mut keys = Vec::new();
            let mut next_cursor = None;
            for pass in 0..2 {
                let (a, b) = if pass == 0 {
                    (start, hi)
                } else {
                    (lo, start.saturating_sub(1))
                };
                if pass == 1 && (!wbc.range_cyclic || start == lo) {
                    break;
                }
                // Look only as far as this call may write (plus room for busy pages it
                // skips), not at every dirty page of a huge file.
                let limit = if integrity {
                    usize::MAX
                } else {
                    (wbc.nr_to_write.max(0) as usize).saturating_add(64)
                };
                let pass_keys: Vec<u64> = inner
                    .pages
                    .range(a..=b.max(a))
                    .filter(|(_, p)| if integrity { p.towrite } else { p.dirty })
                    .map(|(k, _)| *k)
                    .take(limit)
                    .collect();
                let full = pass_keys.len() == limit;
                keys.extend(pass_keys);
                if full {
                    // More may follow: the next visit continues after this batch.
                    next_cursor = keys.last().map(|k| k + 1);
                    break;
                }
            }
            (keys, next_cursor)
        };
        // Phase 2, one request's worth of pages at a time: claim and copy them under the
        // lock, then submit with the lock dropped. The lock is never held for long (a
        // completion of this file's earlier writes, on the device's completion thread,
        // needs it, and every completion behind that one would wait), nor across a
        // dispatch (which may complete inline, into this same lock).
        let q = self.bdi.queue().clone();
        let _plug = Plug::start();
        let mut first_err = Ok(());
        let mut i = 0;
        while i < keys.len() {
            // Runs of pages copied, each into one buffer, and the page indexes of the
            // run claimed but not copied yet.
            let mut runs: Vec<ClaimedRun> = Vec::new();
            let mut open_run: Option<Range<u64>> = None;
            let mut claimed = 0u64;
            let gen;
            {
                let mut inner = self.inner.lock();
                // One generation for the batch: `keys` holds each index once, so no
                // page is claimed twice under it, even across the sleeps below.
                gen = Self::next_wb_gen(&mut inner);
                while i < keys.len() && claimed < max_pages {
                    let k = keys[i];
                    if wbc.nr_to_write <= 0 && !wbc.sync_all {
                        next_cursor = Some(k);
                        i = keys.len();
                        break;
                    }
                    i += 1;
                    let mut skip = false;
                    while inner.pages.get(&k).is_some_and(|p| p.writeback) {
                        if !wbc.sync_all {
                            wbc.pages_skipped += 1;
                            skip = true;
                            break;
                        }
                        // Copied before the lock goes: a truncation may drop pages
                        // under writeback, and a writer may change them.
                        Self::copy_run(&inner, open_run.take(), &mut runs);
                        self.sleep_on_writeback(&mut inner, |_, i| {
                            i.pages.get(&k).is_some_and(|p| p.writeback)
                        });
                    }
                    if skip {
                        continue;
                    }
                    let (mut nd, mut nw) = (inner.nr_dirty, inner.nr_wb);
                    let Some(p) = inner.pages.get_mut(&k) else {
                        continue;
                    };
                    if p.writeback || !p.dirty {
                        continue;
                    }
                    self.clear_dirty(p, &mut nd);
                    Self::start_page_writeback(p, &mut nw, gen);
                    inner.nr_dirty = nd;
                    inner.nr_wb = nw;
                    match &mut open_run {
                        Some(r) if r.end == k => r.end += 1,
                        _ => {
                            Self::copy_run(&inner, open_run.take(), &mut runs);
                            open_run = Some(k..k + 1);
                        }
                    }
                    claimed += 1;
                    wbc.nr_to_write -= 1;
                    wbc.written += 1;
                }
                Self::copy_run(&inner, open_run.take(), &mut runs);
            }
            if claimed == 0 {
                continue;
            }
            self.cache()
                .nr_writeback
                .fetch_add(claimed, Ordering::Relaxed);
            self.bdi.account_writeback_start(claimed);
            // Before any bio of this batch can complete, so sync sees it; every batch:
            // the last completion of an earlier one may have unregistered the inode
            // (registered once per call, a later batch's writes were invisible to
            // sync's wait).
            self.bdi
                .inode_writeback_start(&(self.arc() as Arc<dyn WbInode>));
            let mut unsubmitted = Unsubmitted {
                mapping: self,
                gen,
                pages: runs.iter().map(|r| r.first..r.first + r.pages).collect(),
            };
            if let Err(e) = self.submit_runs(&q, runs, &mut unsubmitted, wbc.bio_flags()) {
                first_err = first_err.and(Err(e));
            }
        }
        if wbc.range_cyclic {
            self.inner.lock().writeback_index = next_cursor.unwrap_or(0);
        }
        first_err
    }

    /// Copy a run of pages just claimed, those at indexes `run`, into one buffer, in
    /// the hold of the mapping's lock that claimed them: the bio's data is the pages as
    /// they were at their claim, copied once (a copy per page, then their
    /// concatenation into the bio's buffer, copied a multi-page run twice).
    fn copy_run(inner: &Inner, run: Option<Range<u64>>, runs: &mut Vec<ClaimedRun>) {
        let Some(run) = run else { return };
        let (first, pages) = (run.start, run.end - run.start);
        let copy = IoBuf::concat(run.map(|k| {
            let p = &inner.pages[&k];
            debug_assert!(p.writeback, "page {k} copied for a write, not claimed");
            debug_assert_eq!(p.buf.len(), PAGE_SIZE, "page {k} is not a whole page");
            p.buf.as_slice()
        }));
        runs.push(ClaimedRun { first, pages, copy });
    }

    /// Map and submit runs of claimed pages (under writeback) as bios, each handed
    /// over from `unsubmitted` as it goes.
    fn submit_runs(
        &self,
        q: &Arc<crate::block::RequestQueue>,
        runs: Vec<ClaimedRun>,
        unsubmitted: &mut Unsubmitted<'_>,
        flags: BioFlags,
    ) -> BlkResult {
        let gen = unsubmitted.gen;
        let mut first_err = Ok(());
        for ClaimedRun {
            first: start,
            pages: n,
            copy,
        } in runs
        {
            let map = match self.ops.map_write(self.ino, start, n) {
                Ok(m) => m,
                Err(e) => {
                    unsubmitted.handed_over(start, n);
                    self.end_writeback(start, n, gen, u64::MAX, Err(e.clone()));
                    first_err = first_err.and(Err(e));
                    continue;
                }
            };
            let mapped: u64 = map.iter().map(|r| r.1).sum();
            debug_assert!(mapped <= n, "the map covers more than the run");
            // Pieces are handed over in file order: the unmapped rest after them.
            let mut unmapped_rest = None;
            if mapped < n {
                // The filesystem has no blocks for the rest (the inode went away while
                // its pages were being claimed): nothing to write, nothing failed.
                unmapped_rest = Some(start + mapped..start + n);
            }
            // The run's copy is the bio's buffer as it is when one extent holds it all
            // (nearly always); each piece of a run split across extents copies its part.
            let single = map.len() == 1 && mapped == n;
            let mut copy = Some(copy);
            let mut idx = start;
            for (sector, cnt) in map {
                let buf = if single {
                    copy.take().expect("one extent, one bio")
                } else {
                    let c = copy.as_ref().expect("kept for every piece");
                    let at = (idx - start) as usize * PAGE_SIZE;
                    IoBuf::from_slice(&c.as_slice()[at..at + cnt as usize * PAGE_SIZE])
                };
                let bio = Bio::write(sector, buf)
                    .with_flags(flags)
                    .with_end_io(Arc::new(WriteEnd {
                        mapping: self.arc(),
                        index: idx,
                        pages: cnt,
                        gen,
                        sector,
                    }));
                // Handed over first: the bio may complete, and end them, inline.
                unsubmitted.handed_over(idx, cnt);
                if let Err(e) = q.submit_bio(bio) {
                    self.end_writeback(idx, cnt, gen, sector, Err(e.clone()));
                    first_err = first_err.and(Err(e));
                }
                idx += cnt;
            }
            if let Some(rest) = unmapped_rest {
                unsubmitted.handed_over(rest.start, rest.end - rest.start);
                self.end_writeback(rest.start, rest.end - rest.start, gen, u64::MAX, Ok(()));
            }
        }
        first_err
    }

    /// Claim every dirty page for a write the filesystem makes itself (data journaled
    /// in a commit, `fs::jdata`): when 1 to `max` pages are dirty and no page is
    /// under writeback, each is cleaned, put under writeback and copied, as
    /// `writepages` claims a page. The filesystem ends their writeback with
    /// [`Mapping::end_claimed`] or gives them back with [`Mapping::unclaim`], naming
    /// the claim by the generation returned with the pages.
    pub fn claim_dirty(&self, max: u64) -> Option<(WbGen, Vec<(u64, IoBuf)>)> {
        let mut inner = self.inner.lock();
        // Nothing of the inode in flight: once claimed, every page under writeback is
        // one the caller writes, so it need not wait for any other.
        if inner.nr_dirty == 0 || inner.nr_dirty > max || inner.nr_wb > 0 {
            return None;
        }
        let keys: Vec<u64> = inner
            .pages
            .iter()
            .filter(|(_, p)| p.dirty)
            .map(|(k, _)| *k)
            .collect();
        let gen = Self::next_wb_gen(&mut inner);
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            let (mut nd, mut nw) = (inner.nr_dirty, inner.nr_wb);
            let p = inner.pages.get_mut(&k).expect("listed above");
            self.clear_dirty(p, &mut nd);
            Self::start_page_writeback(p, &mut nw, gen);
            out.push((k, IoBuf::from_slice(p.buf.as_slice())));
            inner.nr_dirty = nd;
            inner.nr_wb = nw;
        }
        drop(inner);
        let n = out.len() as u64;
        self.cache().nr_writeback.fetch_add(n, Ordering::Relaxed);
        self.bdi.account_writeback_start(n);
        self.bdi
            .inode_writeback_start(&(self.arc() as Arc<dyn WbInode>));
        Some((gen, out))
    }

    /// End the writeback of pages claimed by [`Mapping::claim_dirty`] (their home
    /// write completed, or failed: the error goes to the mapping as any write error),
    /// without the filesystem's `end_writes`: their metadata went with the data. Each
    /// claimed page is ended exactly once; a page cut away meanwhile (or replaced by a
    /// newer one at its index) only has its write counted out.
    pub fn end_claimed(&self, index: u64, n: u64, gen: WbGen, status: BlkResult) {
        self.end_writeback_as(index, n, gen, None, status);
    }

    /// Give back pages claimed by [`Mapping::claim_dirty`] (as claim `gen`) that the
    /// filesystem did not take after all: dirty again (if still the claimed page) and
    /// out of writeback.
    pub fn unclaim(&self, gen: WbGen, pages: &[u64]) {
        {
            let mut inner = self.inner.lock();
            for &k in pages {
                if inner
                    .pages
                    .get(&k)
                    .is_some_and(|p| p.writeback && p.wb_gen == gen)
                {
                    self.set_dirty(&mut inner, k);
                }
            }
        }
        for &k in pages {
            self.end_writeback_as(k, 1, gen, None, Ok(()));
        }
        self.bdi.mark_inode_dirty(self.arc());
    }

    fn end_writeback(&self, index: u64, n: u64, gen: WbGen, sector: u64, status: BlkResult) {
        self.end_writeback_as(index, n, gen, Some(sector), status);
    }

    /// The write of pages [index, index+n), claimed as `gen`, ended: those of its pages
    /// still here leave writeback, and the global counts lose the `n` pages once.
    fn end_writeback_as(
        &self,
        index: u64,
        n: u64,
        gen: WbGen,
        sector: Option<u64>,
        status: BlkResult,
    ) {
        if let Some(sector) = sector {
            self.ops.end_writes(&[WriteDone {
                ino: self.ino,
                index,
                pages: n,
                sector,
                i_size: self.size(),
                status: &status,
            }]);
        }
        self.end_writeback_pages(index, n, gen, status);
    }

    /// The pages' part of `end_writeback_as`, once the filesystem has been told.
    fn end_writeback_pages(&self, index: u64, n: u64, gen: WbGen, status: BlkResult) {
        let mut inner = self.inner.lock();
        for i in index..index + n {
            if let Some(p) = inner.pages.get_mut(&i) {
                // A failed page is left clean, as the kernel does: the error lives in
                // the mapping, not the page, and the data is not retried. A page of
                // another claim is not this write's: the page this write copied was
                // cut away under writeback (`set_size`) and the index written again.
                if p.writeback && p.wb_gen == gen {
                    p.writeback = false;
                    debug_assert!(inner.nr_wb > 0, "a page under writeback not counted");
                    inner.nr_wb -= 1;
                }
            }
        }
        if let Err(e) = &status {
            // The error lives in the mapping, for every open file to be told once.
            self.wb_err.set(e.errno());
            let prev = inner.as_err.unwrap_or(0);
            // EIO wins over ENOSPC when both are pending (filemap_check_errors).
            if prev != libc::EIO {
                inner.as_err = Some(e.errno());
            }
        }
        let idle = inner.nr_wb == 0;
        drop(inner);
        let prev = self.cache().nr_writeback.fetch_sub(n, Ordering::Relaxed);
        debug_assert!(prev >= n, "{n} pages left writeback with {prev} counted");
        self.bdi.account_written(n, status.is_ok());
        if idle {
            self.bdi.inode_writeback_end(self);
        }
        self.cv.notify_all();
    }

    /// Sleep until a page leaves writeback. First, without the lock, send what may be
    /// what the sleeper waits for: this thread's plugged bios, and writes the
    /// filesystem holds back (`AddressSpaceOps::writeback_wait`); then sleep only if
    /// `still` (re-checked under the lock) says the wait is still needed.
    fn sleep_on_writeback(
        &self,
        inner: &mut MutexGuard<'_, Inner>,
        still: impl FnOnce(&Self, &mut Inner) -> bool,
    ) {
        MutexGuard::unlocked(inner, || {
            crate::block::flush_plug();
            self.ops.writeback_wait(self.ino);
        });
        if still(self, inner) {
            self.cv.wait(inner);
        }
    }

    /// Wait until no page in [lo, hi] is under writeback.
    pub fn wait_writeback(&self, lo: u64, hi: u64) {
        crate::block::flush_plug();
        let mut inner = self.inner.lock();
        let busy = |i: &Inner| {
            if lo == 0 && hi == u64::MAX {
                i.nr_wb > 0
            } else {
                i.nr_wb > 0 && i.pages.range(lo..=hi).any(|(_, p)| p.writeback)
            }
        };
        while busy(&inner) {
            self.sleep_on_writeback(&mut inner, |_, i| busy(i));
        }
    }

    /// filemap_write_and_wait_range: write every page dirty now (tagged, so concurrent
    /// dirtiers cannot livelock it) and wait for them. Byte range. Reports (and
    /// clears) the legacy error bit: a write error is returned to the first caller
    /// after it, whichever; per-file reporting is errseq's (see `wb_err`).
    pub fn write_and_wait(&self, start: u64, end: u64) -> BlkResult {
        self.write_and_wait_keep_errors(start, end)?;
        self.check_errors()
    }

    /// filemap_check_errors: take the legacy error bit.
    fn check_errors(&self) -> BlkResult {
        match self.inner.lock().as_err.take() {
            Some(libc::ENOSPC) => Err(BlkError::NoSpace),
            Some(_) => Err(BlkError::Io),
            None => Ok(()),
        }
    }

    /// The same without consuming the legacy error bit (file_write_and_wait_range,
    /// what fsync uses before its errseq check). Returns submission errors only.
    pub fn write_and_wait_keep_errors(&self, start: u64, end: u64) -> BlkResult {
        let (lo, hi) = (start / PAGE_SIZE as u64, end / PAGE_SIZE as u64);
        let mut wbc = Wbc::sync_range(lo, hi);
        let r = self.writepages(&mut wbc);
        self.wait_writeback(lo, hi);
        if self.nr_dirty() == 0 {
            self.bdi.inode_maybe_clean(self.ino);
        }
        r
    }
}

impl WbInode for Mapping {
    fn ino(&self) -> u64 {
        self.ino
    }
    fn writepages(&self, wbc: &mut Wbc) -> BlkResult {
        Mapping::writepages(self, wbc)
    }
    fn has_dirty_pages(&self) -> bool {
        self.nr_dirty() > 0
    }
    fn write_inode(&self, sync: bool) -> BlkResult {
        self.ops.write_inode(self.ino, sync)
    }
    fn wait_writeback_all(&self) {
        self.wait_writeback(0, u64::MAX);
    }
    fn under_writeback(&self) -> bool {
        self.inner.lock().nr_wb > 0
    }
    fn check_errors(&self) -> BlkResult {
        Mapping::check_errors(self)
    }
}

struct WriteEnd {
    mapping: Arc<Mapping>,
    index: u64,
    pages: u64,
    /// The claim that put these pages under writeback.
    gen: WbGen,
    sector: u64,
}

impl BioEndIo for WriteEnd {
    fn end_io(&self, _bio: Bio, status: BlkResult) {
        if crate::block::bio::defer_to_batch_end(end_deferred_writes) {
            DEFERRED_WRITE_ENDS.with(|d| {
                d.borrow_mut().push(DeferredWriteEnd {
                    mapping: self.mapping.clone(),
                    index: self.index,
                    pages: self.pages,
                    gen: self.gen,
                    sector: self.sector,
                    status,
                })
            });
        } else {
            self.mapping
                .end_writeback(self.index, self.pages, self.gen, self.sector, status);
        }
    }
}

/// A write's end left to its completion batch's end (`end_deferred_writes`).
struct DeferredWriteEnd {
    mapping: Arc<Mapping>,
    index: u64,
    pages: u64,
    gen: WbGen,
    sector: u64,
    status: BlkResult,
}

thread_local! {
    static DEFERRED_WRITE_ENDS: std::cell::RefCell<Vec<DeferredWriteEnd>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// End the writes of this thread's completion batch: each filesystem is told of its
/// writes in one `end_writes` call (it takes its state lock once for many, not once a
/// file), then their pages leave writeback, as `end_writeback_as` orders one write.
fn end_deferred_writes() {
    let ends = DEFERRED_WRITE_ENDS.with(|d| std::mem::take(&mut *d.borrow_mut()));
    let ops_of = |e: &DeferredWriteEnd| Arc::as_ptr(&e.mapping.ops) as *const ();
    let mut first = 0;
    while first < ends.len() {
        let ops = ops_of(&ends[first]);
        let run = ends[first..]
            .iter()
            .take_while(|e| ops_of(e) == ops)
            .count();
        let done: Vec<WriteDone<'_>> = ends[first..first + run]
            .iter()
            .map(|e| WriteDone {
                ino: e.mapping.ino,
                index: e.index,
                pages: e.pages,
                sector: e.sector,
                i_size: e.mapping.size(),
                status: &e.status,
            })
            .collect();
        ends[first].mapping.ops.end_writes(&done);
        first += run;
    }
    for e in ends {
        e.mapping
            .end_writeback_pages(e.index, e.pages, e.gen, e.status);
    }
}

struct ReadEnd {
    mapping: Arc<Mapping>,
    index: u64,
    pages: u64,
    /// The read's generation (`Page::read_gen`).
    gen: u64,
}

impl BioEndIo for ReadEnd {
    fn end_io(&self, bio: Bio, status: BlkResult) {
        self.mapping
            .end_read(self.index, self.pages, self.gen, bio.buf.as_ref(), status);
    }
}

impl Wbc {
    fn bio_flags(&self) -> BioFlags {
        if self.sync_all {
            BioFlags::SYNC
        } else if self.for_background || self.for_kupdate {
            BioFlags::BACKGROUND
        } else {
            BioFlags::empty()
        }
    }
}

#[cfg(test)]
mod read_gen_tests {
    use super::*;
    use crate::dev::sim::SimDevice;
    use std::time::{Duration, Instant};

    fn wait_for(what: &str, cond: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::yield_now();
        }
    }

    fn reading(m: &Mapping, index: u64) -> Option<u64> {
        let inner = m.inner.lock();
        inner
            .pages
            .get(&index)
            .filter(|p| p.reading)
            .map(|p| p.read_gen)
    }

    /// A partial write that reads its page while the caller holds a plug: the read
    /// waits in the plug, and a device that completes inline ends it in the waiting
    /// thread's flush of the plug. Before, the flush ran under the mapping's lock,
    /// which the read's completion takes: the writer deadlocked on itself.
    #[test]
    fn a_page_read_held_in_the_callers_plug_completes_inline_without_deadlock() {
        let v = crate::testfs::quiet_volume("null,size=64M,memory_backed=1").unwrap();
        v.file(1).write_at(0, &[0x11u8; 2 * 4096]).unwrap();
        v.bdi.sync().unwrap();
        let f = v.evict(1, 2 * 4096).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let writer = std::thread::spawn(move || {
            let plug = Plug::start();
            let r = f.write_at(4096 + 100, &[0x22u8; 100]);
            drop(plug);
            let mut page = [0u8; 4096];
            let read = f.read_at(4096, &mut page);
            tx.send((r, read, page)).unwrap();
        });
        let (r, read, page) = rx
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("the writer deadlocked on its own plugged read");
        writer.join().unwrap();
        assert_eq!(r.unwrap(), 100);
        assert_eq!(read.unwrap(), 4096);
        assert!(page[..100].iter().all(|&b| b == 0x11));
        assert!(page[100..200].iter().all(|&b| b == 0x22));
        assert!(page[200..].iter().all(|&b| b == 0x11));
    }

    /// A read still in flight when a truncation drops its page, completing after the
    /// page is back with a read of its own: it neither fills the new page with its
    /// data nor, failing, drops it or fails its waiter.
    #[test]
    fn a_read_of_a_truncated_page_completing_late_leaves_its_successor_alone() {
        let v = crate::testfs::quiet_volume("sim:ssd,size=64M").unwrap();
        let sim = v.q.device().as_any().downcast_ref::<SimDevice>().unwrap();
        v.file(1).write_at(0, &[0x11u8; 3 * 4096]).unwrap();
        v.bdi.sync().unwrap();
        let f = v.evict(1, 3 * 4096).unwrap();

        // The first read of page 2 is in the device when a truncation drops the page.
        sim.hold(true);
        let reader = {
            let f = f.clone();
            std::thread::spawn(move || f.read_at(2 * 4096, &mut [0u8; 4096]))
        };
        wait_for("the first read in the device", || sim.pending() == 1);
        let old = reading(&f, 2).expect("page 2 reading");
        f.truncate(2 * 4096);

        // The file grows again, and a partial write of page 2 reads it anew.
        f.write_at(3 * 4096, &[0x33u8; 4096]).unwrap();
        let writer = {
            let f = f.clone();
            std::thread::spawn(move || f.write_at(2 * 4096 + 100, &[0x22u8; 100]))
        };
        wait_for("the second read in the device", || sim.pending() == 2);
        let new = reading(&f, 2).expect("page 2 reading again");
        assert_ne!(old, new);
        let failures = f.inner.lock().read_failures;

        // The first read's completion arrives now: stale data, then a failure.
        f.end_read(2, 1, old, Some(&IoBuf::from_slice(&[0xeeu8; 4096])), Ok(()));
        assert_eq!(reading(&f, 2), Some(new), "a stale read filled the page");
        f.end_read(2, 1, old, None, Err(BlkError::Io));
        assert_eq!(
            reading(&f, 2),
            Some(new),
            "a stale failure dropped the page"
        );
        assert_eq!(f.inner.lock().read_failures, failures);

        sim.hold(false);
        assert_eq!(writer.join().unwrap().unwrap(), 100);
        // The first reader sleeps until a read ends; it then finds its page gone, or
        // a page of the grown file, and reads what is there without error.
        reader.join().unwrap().unwrap();
        let mut got = vec![0u8; 4096];
        assert_eq!(f.read_at(2 * 4096, &mut got).unwrap(), 4096);
        // The device still holds the first content (the test filesystem's blocks
        // are fixed), read by the second read; the write sits on top of it.
        assert!(got[..100].iter().all(|&b| b == 0x11), "{:x?}", &got[..8]);
        assert!(got[100..200].iter().all(|&b| b == 0x22));
        assert!(got[200..].iter().all(|&b| b == 0x11));
    }
}

#[cfg(test)]
mod read_truncate_tests {
    use crate::dev::sim::SimDevice;
    use crate::testfs::TestVolume;
    use std::time::{Duration, Instant};

    fn volume() -> TestVolume {
        crate::testfs::quiet_volume("sim:ssd,size=64M").unwrap()
    }

    /// A reader that looked at the size before a truncation reads no page past the
    /// new end back into the cache: read from blocks the truncation frees, such a page
    /// would show its old bytes after the file grew again.
    #[test]
    fn a_read_started_before_a_truncation_brings_back_no_page_past_the_new_end() {
        let v = volume();
        v.file(1).write_at(0, &[0x11u8; 4 * 4096]).unwrap();
        v.bdi.sync().unwrap();
        let f = v.evict(1, 4 * 4096).unwrap();
        f.truncate(4096);
        // What a reader that took the size (4 pages) before the truncation asks for.
        f.read_pages(2, 2).unwrap();
        let inner = f.inner.lock();
        assert!(
            inner.pages.get(&2).is_none() && inner.pages.get(&3).is_none(),
            "pages past the end read back in"
        );
        drop(inner);
        let mut got = vec![0u8; 8192];
        assert_eq!(f.read_at(0, &mut got).unwrap(), 4096);
    }

    /// A truncation into a page being read zeroes its tail; the read, completing
    /// after, must not put the old tail back, or an extension would read it.
    #[test]
    fn a_page_read_across_a_truncation_into_it_keeps_its_tail_zeroed() {
        let v = volume();
        let sim = v.q.device().as_any().downcast_ref::<SimDevice>().unwrap();
        v.file(1).write_at(0, &[0x11u8; 2 * 4096]).unwrap();
        v.bdi.sync().unwrap();
        let f = v.evict(1, 2 * 4096).unwrap();
        sim.hold(true);
        let reader = {
            let f = f.clone();
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 4096];
                let n = f.read_at(4096, &mut buf).unwrap();
                (n, buf)
            })
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while sim.pending() != 1 {
            assert!(
                Instant::now() < deadline,
                "the read never reached the device"
            );
            std::thread::yield_now();
        }
        f.truncate(4096 + 100);
        sim.hold(false);
        let (n, buf) = reader.join().unwrap();
        // The reader ends at the end the file has now.
        assert_eq!(n, 100);
        assert!(buf[..100].iter().all(|&b| b == 0x11));
        let inner = f.inner.lock();
        let page = inner.pages.get(&1).expect("page 1 cached");
        assert!(page.uptodate);
        assert!(
            page.buf.as_slice()[100..].iter().all(|&b| b == 0),
            "the old tail is back past the end"
        );
        drop(inner);
        // Grown again, the file reads zeros past the old cut.
        f.truncate(2 * 4096);
        let mut got = vec![0xffu8; 4096];
        assert_eq!(f.read_at(4096, &mut got).unwrap(), 4096);
        assert!(got[..100].iter().all(|&b| b == 0x11));
        assert!(got[100..].iter().all(|&b| b == 0), "{:x?}", &got[100..108]);
    }
}

#[cfg(test)]
mod lru_tests {
    use crate::block::QueueConfig;
    use crate::mm::CacheConfig;
    use crate::testfs::TestVolume;

    /// Pages that leave the cache below its capacity (truncated, or their mapping
    /// dropped) do not leave their LRU entries behind for good: a small file written
    /// and truncated, or replaced, 10,000 times keeps the LRU near the pages cached.
    #[test]
    fn the_lru_stays_near_the_pages_cached_when_pages_leave_below_capacity() {
        let wb = crate::testfs::quiet_wb(true);
        let v = TestVolume::open(
            "sim:ssd,size=64M",
            QueueConfig::default(),
            CacheConfig::default(),
            wb,
            64,
        )
        .unwrap();
        for i in 0..10_000u64 {
            let f = v.file(1 + i % 3);
            f.write_at(0, &[i as u8; 4096]).unwrap();
            f.truncate(0);
            if i % 2 == 0 {
                // The mapping itself goes (a deleted file's), and a new one comes.
                v.evict(1 + i % 3, 0).unwrap();
            }
        }
        v.file(1).write_at(0, &[7u8; 2 * 4096]).unwrap();
        let pages = v.cache.nr_pages();
        assert_eq!(pages, 2);
        let lru = v.cache.lru_len();
        assert!(
            lru as u64 <= 2 * pages + 1024,
            "{lru} LRU entries for {pages} pages cached"
        );
        // The pages still cached are still on it: reclaim can find them.
        assert!(lru >= 2);
    }
}
