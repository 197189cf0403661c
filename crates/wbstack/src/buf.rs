//! Page-aligned IO buffers, usable for O_DIRECT.

use smallvec::SmallVec;
use std::alloc::{self, Layout};
use std::ptr::NonNull;

/// Alignment of every IO buffer: one page, which satisfies O_DIRECT on any logical
/// block size up to 4 KiB.
pub const IO_ALIGN: usize = 4096;

/// An owned, zero-initialised, 4 KiB-aligned byte buffer.
pub struct IoBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: IoBuf uniquely owns its allocation (like Vec<u8>), so moving it to or sharing
// `&IoBuf` with another thread is as safe as for Vec<u8>.
unsafe impl Send for IoBuf {}
// SAFETY: as above; `&IoBuf` only gives read access.
unsafe impl Sync for IoBuf {}

impl IoBuf {
    /// The allocation of a `len`-byte buffer: `len` rounded up to whole pages. A length
    /// whose rounding overflows (or exceeds isize::MAX) panics here, before anything is
    /// allocated: rounded with wrapping arithmetic it would come out as 0 and a buffer
    /// claiming `len` bytes would own one page.
    fn layout(len: usize) -> Layout {
        len.max(1)
            .checked_next_multiple_of(IO_ALIGN)
            .and_then(|size| Layout::from_size_align(size, IO_ALIGN).ok())
            .unwrap_or_else(|| panic!("an IoBuf of {len} bytes is too large to allocate"))
    }

    /// A zeroed buffer of `len` bytes.
    pub fn zeroed(len: usize) -> IoBuf {
        let layout = Self::layout(len);
        if layout.size() == IO_ALIGN {
            let ptr = pool::get();
            // SAFETY: the pool hands out an exclusively owned, 4096-aligned page of
            // 4096 writable bytes.
            unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, IO_ALIGN) };
            return IoBuf { ptr, len };
        }
        // SAFETY: layout has non-zero size (len.max(1) rounded up to 4096).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        IoBuf { ptr, len }
    }

    /// A buffer holding a copy of `data`, written once by the copy (`concat`): a
    /// commit's tens of MiB zeroed first cost a pass over them for nothing.
    pub fn from_slice(data: &[u8]) -> IoBuf {
        IoBuf::concat(std::iter::once(data))
    }

    /// One buffer holding `parts` back to back. Its memory is written once, by the
    /// copies, never zeroed first: writeback gathers each run of pages this way, and
    /// zeroing half a megabyte before overwriting it cost as much as the copy.
    pub fn concat<'a>(parts: impl Iterator<Item = &'a [u8]>) -> IoBuf {
        // The parts are taken in one pass: sizing the buffer from one pass of the
        // iterator and copying from another would trust the two to agree, and a caller's
        // iterator need not (a clone may yield other slices), which would write past the
        // allocation.
        let parts: SmallVec<[&[u8]; 16]> = parts.collect();
        let len = parts
            .iter()
            .try_fold(0usize, |n, p| n.checked_add(p.len()))
            .unwrap_or_else(|| panic!("IoBuf::concat: the parts' lengths overflow usize"));
        if len < IO_ALIGN {
            let mut b = IoBuf::zeroed(len);
            let mut at = 0;
            for p in &parts {
                b.as_mut_slice()[at..at + p.len()].copy_from_slice(p);
                at += p.len();
            }
            return b;
        }
        let layout = Self::layout(len);
        let ptr = if len == IO_ALIGN {
            // One whole page: from the pool, as `Drop` gives it back there.
            pool::get()
        } else {
            // SAFETY: layout has a non-zero size (len > IO_ALIGN).
            let raw = unsafe { alloc::alloc(layout) };
            NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout))
        };
        let raw = ptr.as_ptr();
        let mut at = 0;
        for p in &parts {
            // SAFETY: `len` is the sum of these very slices' lengths (collected once,
            // immutable since), so [at, at+p.len()) lies inside the allocation of at
            // least `len` bytes; it is new (or a pool page, exclusively ours) and cannot
            // overlap the borrowed part.
            unsafe { std::ptr::copy_nonoverlapping(p.as_ptr(), raw.add(at), p.len()) };
            at += p.len();
        }
        // Every byte of [0, len) is now initialised, as as_slice requires; the rounding
        // past len is never exposed.
        IoBuf { ptr, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is a live allocation of at least `len` initialised (zeroed) bytes,
        // owned by self; the shared borrow of self prevents concurrent mutation.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice; the unique borrow of self makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for IoBuf {
    fn drop(&mut self) {
        let layout = Self::layout(self.len);
        if layout.size() == IO_ALIGN {
            pool::put(self.ptr);
            return;
        }
        // SAFETY: ptr was allocated in `zeroed` with exactly this layout (len unchanged).
        unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) }
    }
}

/// Single pages come from 2 MiB slabs and return to a free list, as the kernel's page
/// allocator would: a 4 KiB-aligned allocation from the general allocator costs ~14 µs
/// here (memalign), which would cap buffered writes near 250 MiB/s. Slabs are never
/// returned to the system; the pool is bounded by the peak number of live pages (the
/// page cache's size plus IO in flight).
///
/// Fresh memory costs about twice the copy into it (a fault, a memcg charge and a clear
/// per 4 KiB page). Neither huge pages nor a thread populating slabs ahead of need
/// helped on this VM: the host takes freed huge pages back (free page reporting) and
/// touching them again ran at 0.4 GB/s, and a second thread populating contended with
/// the writer for the same kernel locks. Recycled pages are the fast path.
mod pool {
    use super::IO_ALIGN;
    use parking_lot::Mutex;
    use std::alloc::{self, Layout};
    use std::ptr::NonNull;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::OnceLock;

    pub(super) const SLAB_PAGES: usize = 512;

    /// Free page addresses (as usize so the list is Send).
    static FREE: Mutex<Vec<usize>> = Mutex::new(Vec::new());

    pub(super) fn get() -> NonNull<u8> {
        if let Some(p) = FREE.lock().pop() {
            // SAFETY: only non-null page addresses are ever pushed.
            return unsafe { NonNull::new_unchecked(p as *mut u8) };
        }
        // Populating a slab takes a few hundred microseconds: outside the free list's
        // lock, so other threads keep taking and giving back pages meanwhile (two
        // threads short at once each map a slab; both slabs are used).
        let slab = new_slab();
        let base = slab.as_ptr() as usize;
        FREE.lock()
            .extend((1..SLAB_PAGES).map(|i| base + i * IO_ALIGN));
        slab
    }

    /// Address space reserved once for slabs (not memory: pages are only taken as slabs
    /// are populated). 64 GiB: more pages than a page cache on a machine of this kind
    /// holds; past it, slabs are mapped one at a time.
    const RESERVE_BYTES: usize = 64 << 30;

    /// The reservation, if the system granted it (its address, as usize so it is
    /// shared between threads as the free list's are), and how much of it slabs took.
    struct Reserve {
        base: usize,
        used: AtomicUsize,
    }

    /// A new anonymous private read-write mapping of `len` bytes with `flags` added, or
    /// None if the system refuses it.
    fn map_anonymous(len: usize, flags: libc::c_int) -> Option<NonNull<u8>> {
        // SAFETY: a new mapping at an address the kernel picks, touching no existing
        // memory. The result is checked for MAP_FAILED, and a mapping that succeeded
        // is never at null.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags,
                -1,
                0,
            );
            (p != libc::MAP_FAILED).then(|| NonNull::new_unchecked(p as *mut u8))
        }
    }

    fn reserve() -> Option<&'static Reserve> {
        static RESERVE: OnceLock<Option<Reserve>> = OnceLock::new();
        RESERVE
            .get_or_init(|| {
                // MAP_NORESERVE: no memory or swap committed for it. Refused where
                // overcommit is strict: slabs are then mapped one by one.
                let base = map_anonymous(RESERVE_BYTES, libc::MAP_NORESERVE)?;
                Some(Reserve {
                    base: base.as_ptr() as usize,
                    used: AtomicUsize::new(0),
                })
            })
            .as_ref()
    }

    /// Slabs carved from the reservation so far (tests).
    #[cfg(test)]
    pub(super) fn slabs_carved() -> usize {
        reserve().map_or(0, |r| {
            r.used.load(Ordering::Relaxed) / (SLAB_PAGES * IO_ALIGN)
        })
    }

    /// A slab of populated pages. Carved from the reservation and populated with
    /// MADV_POPULATE_WRITE, which holds the process's mmap lock for reading: a mapping
    /// of its own per slab (mmap with MAP_POPULATE) took it for writing, so two writers
    /// growing the cache at once waited for each other's populate (2-thread fs_mark,
    /// cache phase: 40% of the writers' sleeps were in mmap). Populated in one call, the
    /// kernel fills 512 pages at once instead of taking 512 faults on first touch.
    fn new_slab() -> NonNull<u8> {
        let len = SLAB_PAGES * IO_ALIGN;
        if let Some(r) = reserve() {
            let at = r.used.fetch_add(len, Ordering::Relaxed);
            if at + len <= RESERVE_BYTES {
                // SAFETY: inside a mapping that succeeded, so not null.
                let slab = unsafe { NonNull::new_unchecked((r.base + at) as *mut u8) };
                // SAFETY: [slab, slab + len) lies inside the reservation (checked above)
                // and was handed to no one else (fetch_add); populating only faults its
                // pages in.
                let rc =
                    unsafe { libc::madvise(slab.as_ptr().cast(), len, libc::MADV_POPULATE_WRITE) };
                // Refused by a kernel without it (EINVAL: before 5.14), interrupted, or
                // short of memory (as MAP_POPULATE fails, silently): the pages are then
                // faulted in on first touch, where a lack of memory meets every
                // allocation alike.
                debug_assert!(
                    rc == 0
                        || matches!(
                            std::io::Error::last_os_error().raw_os_error(),
                            Some(libc::EINVAL | libc::EINTR | libc::EAGAIN | libc::ENOMEM)
                        ),
                    "MADV_POPULATE_WRITE on a slab of the reservation: {}",
                    std::io::Error::last_os_error()
                );
                return slab;
            }
        }
        map_anonymous(len, libc::MAP_POPULATE).unwrap_or_else(|| {
            alloc::handle_alloc_error(Layout::from_size_align(len, IO_ALIGN).expect("slab layout"))
        })
    }

    pub(super) fn put(p: NonNull<u8>) {
        FREE.lock().push(p.as_ptr() as usize);
    }
}

/// Equal contents (a journal record that carries a block compares by its bytes).
impl PartialEq for IoBuf {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for IoBuf {}

impl Clone for IoBuf {
    fn clone(&self) -> Self {
        IoBuf::from_slice(self.as_slice())
    }
}

impl std::fmt::Debug for IoBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IoBuf({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages of slabs carved from the pool's reservation (and populated there) are
    /// whole, distinct, aligned and writable: pages are taken until a slab has been
    /// carved for them (the free list may hold pages other tests gave back), each
    /// written with its own pattern and read back after all were written.
    #[test]
    fn pages_of_slabs_carved_from_the_reservation_are_distinct_and_writable() {
        let before = pool::slabs_carved();
        let mut pages: Vec<IoBuf> = Vec::new();
        while pool::slabs_carved() == before {
            assert!(
                pages.len() < 16 * pool::SLAB_PAGES,
                "no slab came from the reservation after {} pages",
                pages.len()
            );
            let mut b = IoBuf::zeroed(IO_ALIGN);
            b.as_mut_slice().fill(pages.len() as u8);
            pages.push(b);
        }
        // The whole carved slab, beyond the page that carved it.
        for _ in 0..pool::SLAB_PAGES {
            let mut b = IoBuf::zeroed(IO_ALIGN);
            b.as_mut_slice().fill(pages.len() as u8);
            pages.push(b);
        }
        for (i, p) in pages.iter().enumerate() {
            assert_eq!(p.as_ptr() as usize % IO_ALIGN, 0);
            assert!(
                p.as_slice().iter().all(|&x| x == i as u8),
                "page {i} was overwritten"
            );
        }
        let mut addrs: Vec<usize> = pages.iter().map(|p| p.as_ptr() as usize).collect();
        addrs.sort_unstable();
        assert!(
            addrs.windows(2).all(|w| w[1] - w[0] >= IO_ALIGN),
            "pages overlap"
        );
    }

    #[test]
    fn concat_holds_the_parts_in_order() {
        let a: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
        let b = vec![7u8; 4096];
        let c = [9u8; 100];
        let big = IoBuf::concat([&a[..], &b[..], &c[..]].into_iter());
        assert_eq!(big.len(), 8292);
        assert_eq!(big.as_ptr() as usize % IO_ALIGN, 0);
        assert_eq!(&big.as_slice()[..4096], &a[..]);
        assert_eq!(&big.as_slice()[4096..8192], &b[..]);
        assert_eq!(&big.as_slice()[8192..], &c[..]);
        // Exactly a page: a pooled page, every byte written by the copies.
        let page = IoBuf::concat([&a[..100], &b[..3996]].into_iter());
        assert_eq!(page.len(), 4096);
        assert_eq!(page.as_ptr() as usize % IO_ALIGN, 0);
        assert_eq!(&page.as_slice()[..100], &a[..100]);
        assert!(page.as_slice()[100..].iter().all(|&x| x == 7));
        drop(page);
        let small = IoBuf::concat([&c[..10], &a[..20]].into_iter());
        assert_eq!(small.len(), 30);
        assert_eq!(&small.as_slice()[10..], &a[..20]);
        let empty = IoBuf::concat(std::iter::empty::<&[u8]>());
        assert!(empty.is_empty());
    }

    /// An iterator whose clones yield longer slices than the original: sizing from a
    /// clone and copying from the original (or the reverse) disagrees.
    #[derive(Clone)]
    struct Shifty<'a> {
        small: &'a [u8],
        big: &'a [u8],
        passes: std::rc::Rc<std::cell::Cell<u32>>,
        left: u32,
    }

    impl<'a> Iterator for Shifty<'a> {
        type Item = &'a [u8];
        fn next(&mut self) -> Option<&'a [u8]> {
            if self.left == 0 {
                return None;
            }
            self.left -= 1;
            // Every call on any clone counts; the first pass sees small parts, later
            // passes big ones.
            let n = self.passes.get();
            self.passes.set(n + 1);
            Some(if n < 3 { self.small } else { self.big })
        }
    }

    #[test]
    fn concat_of_an_inconsistent_iterator_stays_in_bounds() {
        let small = [1u8; 4096];
        let big = vec![2u8; 64 * 1024];
        let it = Shifty {
            small: &small,
            big: &big,
            passes: Default::default(),
            left: 3,
        };
        // One pass: three small parts, whatever a second pass would have said.
        let b = IoBuf::concat(it);
        assert_eq!(b.len(), 3 * 4096);
        assert!(b.as_slice().iter().all(|&x| x == 1));
    }

    #[test]
    #[should_panic(expected = "too large to allocate")]
    fn a_length_whose_rounding_overflows_is_refused() {
        let _ = IoBuf::zeroed(usize::MAX - 100);
    }

    #[test]
    fn pooled_pages_are_distinct_aligned_and_zeroed_on_reuse() {
        let mut pages: Vec<IoBuf> = (0..1500).map(|_| IoBuf::zeroed(4096)).collect();
        let mut addrs: Vec<usize> = pages.iter().map(|p| p.as_ptr() as usize).collect();
        addrs.sort();
        addrs.dedup();
        assert_eq!(addrs.len(), 1500, "no page handed out twice");
        assert!(addrs.iter().all(|a| a % IO_ALIGN == 0));
        for p in pages.iter_mut() {
            p.as_mut_slice().fill(0xee);
        }
        drop(pages);
        let again: Vec<IoBuf> = (0..1500).map(|_| IoBuf::zeroed(512)).collect();
        assert!(
            again.iter().all(|p| p.as_slice().iter().all(|&b| b == 0)),
            "reused pages are zeroed"
        );
    }

    #[test]
    fn aligned_zeroed_and_writable() {
        for len in [0usize, 1, 512, 4096, 4097, 1 << 20] {
            let mut b = IoBuf::zeroed(len);
            assert_eq!(b.as_ptr() as usize % IO_ALIGN, 0);
            assert_eq!(b.len(), len);
            assert!(b.as_slice().iter().all(|&x| x == 0));
            b.as_mut_slice()
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = i as u8);
            let c = b.clone();
            assert_eq!(c.as_slice(), b.as_slice());
        }
    }
}
