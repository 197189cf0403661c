//! blk-mq tags: a per-hardware-queue sparse bitmap (like lib/sbitmap.c) plus the
//! state of the request holding each tag, so in-flight counts can be had by walking
//! the busy tags instead of keeping a shared counter (seed 002).

use crossbeam_utils::CachePadded;
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};

/// The state of the request that owns a tag, as seen by the in-flight walk.
pub const RQ_IDLE: u8 = 0;
/// Allocated but not yet handed to the driver (the walk does not count it).
pub const RQ_ALLOCATED: u8 = 1;
pub const RQ_INFLIGHT_READ: u8 = 2;
pub const RQ_INFLIGHT_WRITE: u8 = 3;

/// A sparse bitmap of `depth` tags. Bits are spread over several words, each on its own
/// cache line, so threads allocating from different words do not share a line.
pub struct Sbitmap {
    words: Box<[CachePadded<AtomicU64>]>,
    shift: u32,
    depth: u32,
}

impl Sbitmap {
    pub fn new(depth: u32) -> Sbitmap {
        assert!(depth >= 1);
        // As the kernel does: shrink the word width until there are at least four words,
        // so small tag sets still spread over several cache lines.
        let mut shift = 6u32;
        while shift > 0 && (4u64 << shift) > depth as u64 {
            shift -= 1;
        }
        let per = 1u32 << shift;
        let nwords = depth.div_ceil(per);
        let words = (0..nwords)
            .map(|_| CachePadded::new(AtomicU64::new(0)))
            .collect();
        Sbitmap {
            words,
            shift,
            depth,
        }
    }

    pub fn depth(&self) -> u32 {
        self.depth
    }

    #[inline]
    fn word_mask(&self, w: usize) -> u64 {
        let per = 1u32 << self.shift;
        let bits = (self.depth - (w as u32) * per).min(per);
        if bits == 64 {
            u64::MAX
        } else {
            (1u64 << bits) - 1
        }
    }

    /// Take a free bit, starting the search at the word of `hint`.
    #[inline]
    pub fn get(&self, hint: u32) -> Option<u32> {
        let n = self.words.len();
        let start = ((hint >> self.shift) as usize) % n;
        for i in 0..n {
            let w = (start + i) % n;
            let mask = self.word_mask(w);
            let word = &self.words[w];
            let mut cur = word.load(Ordering::Relaxed);
            loop {
                let free = !cur & mask;
                if free == 0 {
                    break;
                }
                let bit = free.trailing_zeros();
                let prev = word.fetch_or(1 << bit, Ordering::Acquire);
                if prev & (1 << bit) == 0 {
                    return Some(((w as u32) << self.shift) + bit);
                }
                cur = prev;
            }
        }
        None
    }

    #[inline]
    pub fn put(&self, tag: u32) {
        let w = (tag >> self.shift) as usize;
        let bit = tag & ((1 << self.shift) - 1);
        self.words[w].fetch_and(!(1u64 << bit), Ordering::Release);
    }

    /// Call `f` for every set bit.
    pub fn for_each_set(&self, mut f: impl FnMut(u32)) {
        for (w, word) in self.words.iter().enumerate() {
            let mut v = word.load(Ordering::Acquire);
            while v != 0 {
                let bit = v.trailing_zeros();
                f(((w as u32) << self.shift) + bit);
                v &= v - 1;
            }
        }
    }

    /// Number of set bits (the hamming weight).
    pub fn weight(&self) -> u32 {
        self.words
            .iter()
            .map(|w| w.load(Ordering::Relaxed).count_ones())
            .sum()
    }
}

/// The tags of one hardware queue, the state of each tag's request, and the wait queue
/// of threads that found no free tag.
pub struct HctxTags {
    pub bitmap: Sbitmap,
    state: Box<[AtomicU8]>,
    waiters: AtomicUsize,
    wait_lock: Mutex<()>,
    wait_cv: Condvar,
}

impl HctxTags {
    pub fn new(depth: u32) -> HctxTags {
        HctxTags {
            bitmap: Sbitmap::new(depth),
            state: (0..depth).map(|_| AtomicU8::new(RQ_IDLE)).collect(),
            waiters: AtomicUsize::new(0),
            wait_lock: Mutex::new(()),
            wait_cv: Condvar::new(),
        }
    }

    #[inline]
    pub fn try_get(&self, hint: u32) -> Option<u32> {
        let t = self.bitmap.get(hint)?;
        self.state[t as usize].store(RQ_ALLOCATED, Ordering::Relaxed);
        Some(t)
    }

    /// Wait for a free tag. `before_sleep` runs before each sleep: it must push out
    /// everything this thread holds back (its plug, a device's unsubmitted batch), or
    /// the tags it waits for might never be freed.
    pub fn get_blocking(&self, hint: u32, mut before_sleep: impl FnMut()) -> u32 {
        if let Some(t) = self.try_get(hint) {
            return t;
        }
        loop {
            before_sleep();
            self.waiters.fetch_add(1, Ordering::SeqCst);
            let mut g = self.wait_lock.lock();
            // Re-check under the lock: a `put` between our failed try and here will
            // either be seen now or will notify after we sleep (it takes the lock).
            let got = self.try_get(hint);
            if got.is_none() {
                self.wait_cv.wait(&mut g);
            }
            drop(g);
            self.waiters.fetch_sub(1, Ordering::SeqCst);
            if let Some(t) = got.or_else(|| self.try_get(hint)) {
                return t;
            }
        }
    }

    #[inline]
    pub fn set_state(&self, tag: u32, st: u8) {
        self.state[tag as usize].store(st, Ordering::Release);
    }

    #[inline]
    pub fn put(&self, tag: u32) {
        self.state[tag as usize].store(RQ_IDLE, Ordering::Release);
        self.bitmap.put(tag);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            let _g = self.wait_lock.lock();
            self.wait_cv.notify_one();
        }
    }

    /// Requests owned by the driver, by direction [read, write]: walk the busy tags.
    pub fn in_flight(&self, out: &mut [u32; 2]) {
        self.bitmap
            .for_each_set(|t| match self.state[t as usize].load(Ordering::Acquire) {
                RQ_INFLIGHT_READ => out[0] += 1,
                RQ_INFLIGHT_WRITE => out[1] += 1,
                _ => {}
            });
    }

    pub fn busy(&self) -> u32 {
        self.bitmap.weight()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn sbitmap_hands_out_each_tag_once() {
        for depth in [1u32, 3, 16, 31, 64, 100, 128, 1000] {
            let sb = Sbitmap::new(depth);
            let mut seen = std::collections::HashSet::new();
            for i in 0..depth {
                let t = sb.get(i * 7).expect("tag available");
                assert!(t < depth);
                assert!(seen.insert(t), "tag {t} handed out twice");
            }
            assert_eq!(sb.get(0), None);
            assert_eq!(sb.weight(), depth);
            sb.put(depth / 2);
            assert_eq!(sb.get(0), Some(depth / 2));
        }
    }

    #[test]
    fn small_depths_spread_over_four_words() {
        let sb = Sbitmap::new(64);
        assert_eq!(sb.words.len(), 4);
        let sb = Sbitmap::new(128);
        assert_eq!(sb.words.len(), 4);
    }

    #[test]
    fn exhaustion_blocks_until_a_put() {
        let tags = Arc::new(HctxTags::new(2));
        let a = tags.try_get(0).unwrap();
        let _b = tags.try_get(0).unwrap();
        assert!(tags.try_get(0).is_none());
        let t2 = tags.clone();
        let sleeps = Arc::new(AtomicUsize::new(0));
        let s2 = sleeps.clone();
        let h = std::thread::spawn(move || {
            t2.get_blocking(0, || {
                s2.fetch_add(1, Ordering::SeqCst);
            })
        });
        // Wait (bounded) until the other thread is really waiting, then free a tag.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while tags.waiters.load(Ordering::SeqCst) == 0 {
            assert!(std::time::Instant::now() < deadline, "waiter never blocked");
            std::thread::yield_now();
        }
        tags.put(a);
        assert_eq!(h.join().unwrap(), a);
        assert!(
            sleeps.load(Ordering::SeqCst) >= 1,
            "before_sleep ran before blocking"
        );
    }
}
