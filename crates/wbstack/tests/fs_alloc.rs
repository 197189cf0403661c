//! Free-space allocator: model-checked with proptest against a set of used blocks, plus
//! the properties the filesystem relies on (adjacent writeback extents, reservations that
//! cannot fail, deferred frees, O(extents) cost on a 100 TiB device).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use wbstack::fs::alloc::{AllocError, Allocator, FreeSpace};

const FIRST: u64 = 3;
const NR: u64 = 3 + 80;
const TOTAL: u64 = NR - FIRST;

#[derive(Debug, Clone)]
enum Op {
    Alloc(u64, Option<u64>),
    AllocNext(u64),
    Reserve(u64),
    Unreserve(u64),
    AllocReserved(u64),
    Free(usize, u64, u64),
    FreeDeferred(usize),
    NextTid,
    Commit,
    AllocExact(u64, u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1u64..20, proptest::option::of(0u64..NR + 5)).prop_map(|(n, g)| Op::Alloc(n, g)),
        (1u64..12).prop_map(Op::AllocNext),
        (0u64..30).prop_map(Op::Reserve),
        (0u64..30).prop_map(Op::Unreserve),
        (1u64..20).prop_map(Op::AllocReserved),
        (any::<usize>(), 0u64..8, 1u64..8).prop_map(|(i, o, l)| Op::Free(i, o, l)),
        any::<usize>().prop_map(Op::FreeDeferred),
        Just(Op::NextTid),
        Just(Op::Commit),
        (0u64..NR + 2, 1u64..6).prop_map(|(s, n)| Op::AllocExact(s, n)),
    ]
}

/// The model: which blocks are used, which are freed-but-uncommitted, what is reserved.
struct Model {
    used: BTreeSet<u64>,
    /// Used extents we may free (start, len).
    owned: Vec<(u64, u64)>,
    deferred: BTreeSet<u64>,
    reserved: u64,
    tid: u64,
}

impl Model {
    fn free(&self) -> u64 {
        TOTAL - self.used.len() as u64 - self.deferred.len() as u64
    }
    fn take(&mut self, ext: &[(u64, u64)], n: u64) {
        assert_eq!(
            ext.iter().map(|e| e.1).sum::<u64>(),
            n,
            "wrong size: {ext:?}"
        );
        for &(s, l) in ext {
            assert!(l > 0);
            for b in s..s + l {
                assert!((FIRST..NR).contains(&b), "block {b} outside the device");
                assert!(
                    !self.deferred.contains(&b),
                    "deferred block {b} reused before commit"
                );
                assert!(self.used.insert(b), "block {b} handed out twice");
            }
            self.owned.push((s, l));
        }
    }
}

fn check(a: &Allocator, m: &Model) {
    let (total, free, avail) = a.statfs();
    assert_eq!(total, TOTAL);
    assert_eq!(
        free,
        m.free() - m.reserved,
        "free + used + deferred + reserved != total"
    );
    assert_eq!(a.deferred_blocks(), m.deferred.len() as u64);
    assert_eq!(a.reserved(), m.reserved);
    assert_eq!(avail, m.free() - m.reserved);
    // The map is canonical: sorted, non-overlapping, non-adjacent, matching the model.
    let mut prev_end = None;
    let mut sum = 0;
    for (s, l) in a.space().extents() {
        assert!(l > 0);
        if let Some(pe) = prev_end {
            assert!(s > pe, "extents not coalesced/sorted at {s}");
        }
        for b in s..s + l {
            assert!(!m.used.contains(&b) && !m.deferred.contains(&b));
        }
        prev_end = Some(s + l);
        sum += l;
    }
    assert_eq!(sum, free + m.reserved);
}

fn run(ops: Vec<Op>) {
    let mut a = Allocator::new(FreeSpace::new(FIRST, NR));
    let mut m = Model {
        used: BTreeSet::new(),
        owned: Vec::new(),
        deferred: BTreeSet::new(),
        reserved: 0,
        tid: 1,
    };
    for op in ops {
        match op {
            Op::Alloc(n, g) => match a.alloc(n, g) {
                Ok(ext) => m.take(&ext, n),
                Err(e) => {
                    assert_eq!(e, AllocError::NoSpace);
                    assert!(n > m.free() - m.reserved);
                }
            },
            Op::AllocNext(n) => match a.alloc_next(n) {
                Ok(ext) => {
                    m.take(&ext, n);
                    // The cursor ends up right after what was handed out.
                    let &(s, l) = ext.last().unwrap();
                    assert_eq!(a.cursor(), s + l);
                }
                Err(e) => {
                    assert_eq!(e, AllocError::NoSpace);
                    assert!(n > m.free() - m.reserved);
                }
            },
            Op::Reserve(n) => match a.reserve(n) {
                Ok(()) => m.reserved += n,
                Err(e) => {
                    assert_eq!(e, AllocError::NoSpace);
                    assert!(n > m.free() - m.reserved);
                }
            },
            Op::Unreserve(n) => match a.unreserve(n) {
                Ok(()) => m.reserved -= n,
                Err(e) => {
                    assert!(matches!(e, AllocError::Invalid(_)));
                    assert!(n > m.reserved);
                }
            },
            Op::AllocReserved(n) => match a.alloc_reserved(n, None) {
                Ok(ext) => {
                    m.take(&ext, n);
                    m.reserved -= n;
                }
                Err(e) => {
                    assert!(matches!(e, AllocError::Invalid(_)), "{e:?}");
                    assert!(n > m.reserved, "reserved allocation failed: {e}");
                }
            },
            Op::Free(i, off, len) => {
                if m.owned.is_empty() {
                    continue;
                }
                let i = i % m.owned.len();
                let (s, l) = m.owned[i];
                let off = off % l;
                let len = len.min(l - off);
                a.free(s + off, len).unwrap();
                // Double free is refused.
                assert!(matches!(a.free(s + off, len), Err(AllocError::Corrupt(_))));
                m.owned.swap_remove(i);
                if off > 0 {
                    m.owned.push((s, off));
                }
                if off + len < l {
                    m.owned.push((s + off + len, l - off - len));
                }
                for b in s + off..s + off + len {
                    m.used.remove(&b);
                }
            }
            Op::FreeDeferred(i) => {
                if m.owned.is_empty() {
                    continue;
                }
                let (s, l) = m.owned.swap_remove(i % m.owned.len());
                a.free_deferred(m.tid, s, l).unwrap();
                assert!(a.free_deferred(m.tid, s, l).is_err());
                assert!(matches!(a.free(s, l), Err(AllocError::Corrupt(_))));
                for b in s..s + l {
                    m.used.remove(&b);
                    m.deferred.insert(b);
                }
            }
            Op::NextTid => m.tid += 1,
            Op::Commit => {
                let released = a.commit(m.tid).unwrap();
                assert_eq!(released, m.deferred.len() as u64);
                m.deferred.clear();
                m.tid += 1;
            }
            Op::AllocExact(s, n) => {
                let all_free = (s..s + n).all(|b| {
                    (FIRST..NR).contains(&b) && !m.used.contains(&b) && !m.deferred.contains(&b)
                });
                match a.alloc_exact(s, n) {
                    Ok(()) => {
                        assert!(all_free && n <= m.free() - m.reserved);
                        m.take(&[(s, n)], n);
                    }
                    Err(AllocError::NoSpace) => assert!(all_free && n > m.free() - m.reserved),
                    Err(_) => assert!(!all_free),
                }
            }
        }
        check(&a, &m);
    }
    // Everything reserved can still be allocated.
    if m.reserved > 0 {
        let r = m.reserved;
        let ext = a.alloc_reserved(r, None).unwrap();
        m.take(&ext, r);
        m.reserved = 0;
    }
    // Free everything: the map coalesces back to exactly one extent.
    for (s, l) in std::mem::take(&mut m.owned) {
        a.free_deferred(m.tid, s, l).unwrap();
    }
    a.commit(m.tid).unwrap();
    assert_eq!(
        a.space().extents().collect::<Vec<_>>(),
        vec![(FIRST, TOTAL)]
    );
    assert_eq!(a.statfs(), (TOTAL, TOTAL, TOTAL));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn model_check(ops in proptest::collection::vec(op(), 1..60)) {
        run(ops);
    }
}

#[test]
fn alloc_next_is_adjacent() {
    let mut a = Allocator::new(FreeSpace::new(10, 10_000));
    let mut end = None;
    for n in [1, 7, 3, 100, 16] {
        let ext = a.alloc_next(n).unwrap();
        assert_eq!(ext.len(), 1);
        if let Some(e) = end {
            assert_eq!(ext[0].0, e, "not adjacent");
        }
        end = Some(ext[0].0 + ext[0].1);
    }
    // Reserved (writeback) allocations continue at the cursor too: consecutive inodes in
    // one writeback pass get consecutive extents.
    a.reserve(50).unwrap();
    let x = a.alloc_reserved(20, None).unwrap();
    let y = a.alloc_reserved(30, None).unwrap();
    assert_eq!(x[0].0, end.unwrap());
    assert_eq!(y, vec![(x[0].0 + 20, 30)]);
    // A cursor sitting on used space moves on to the next free extent after it.
    a.set_cursor(10);
    let z = a.alloc_next(4).unwrap();
    assert_eq!(z, vec![(y[0].0 + 30, 4)]);
}

#[test]
fn reservation_protects_writeback() {
    let mut a = Allocator::new(FreeSpace::new(0, 100));
    a.reserve(60).unwrap();
    assert_eq!(a.reserve(41), Err(AllocError::NoSpace));
    assert_eq!(a.alloc(41, None), Err(AllocError::NoSpace));
    assert_eq!(a.alloc_exact(50, 41), Err(AllocError::NoSpace));
    a.alloc(40, None).unwrap();
    assert_eq!(a.available(), 0);
    // The reservation is used space to statfs, as ext4's delayed allocation is.
    assert_eq!(a.statfs(), (100, 0, 0));
    let e = a.reserve(1).unwrap_err();
    assert_eq!(e.errno(), libc::ENOSPC);
    // The reservation is still fully allocatable, in however many pieces.
    let ext = a.alloc_reserved(60, None).unwrap();
    assert_eq!(ext.iter().map(|e| e.1).sum::<u64>(), 60);
    assert!(matches!(
        a.alloc_reserved(1, None),
        Err(AllocError::Invalid(_))
    ));
    assert!(matches!(a.unreserve(1), Err(AllocError::Invalid(_))));
}

#[test]
fn deferred_frees_wait_for_commit() {
    let mut a = Allocator::new(FreeSpace::new(0, 10));
    let ext = a.alloc(10, None).unwrap();
    assert_eq!(ext, vec![(0, 10)]);
    a.free_deferred(5, 0, 4).unwrap();
    a.free_deferred(6, 4, 2).unwrap();
    assert_eq!(a.statfs(), (10, 0, 0));
    assert_eq!(a.alloc(1, None), Err(AllocError::NoSpace));
    assert_eq!(a.reserve(1), Err(AllocError::NoSpace));
    assert_eq!(a.commit(5).unwrap(), 4);
    assert_eq!(a.statfs(), (10, 4, 4));
    assert_eq!(a.alloc(4, None).unwrap(), vec![(0, 4)]);
    // Frees recorded for a transaction that already committed are refused.
    assert!(matches!(
        a.free_deferred(5, 6, 1),
        Err(AllocError::Invalid(_))
    ));
    assert_eq!(a.commit(7).unwrap(), 2);
    assert_eq!(a.space().extents().collect::<Vec<_>>(), vec![(4, 2)]);
}

#[test]
fn from_extents_validates() {
    let fs = FreeSpace::from_extents(2, 100, [(50, 10), (2, 3), (5, 5), (60, 40)]).unwrap();
    assert_eq!(fs.extents().collect::<Vec<_>>(), vec![(2, 8), (50, 50)]);
    assert_eq!(fs.free_blocks(), 58);
    let cases: [(&[(u64, u64)], &str); 5] = [
        (&[(10, 5), (14, 2)], "overlap"),
        (&[(1, 3)], "outside"),
        (&[(95, 6)], "outside"),
        (&[(10, 0)], "length zero"),
        (&[(u64::MAX - 1, 5)], "past the largest"),
    ];
    for (ext, why) in cases {
        match FreeSpace::from_extents(2, 100, ext.iter().copied()) {
            Err(AllocError::Corrupt(reason)) => {
                assert!(
                    reason.contains(why),
                    "{ext:?}: reason {reason:?} lacks {why:?}"
                )
            }
            other => panic!("{ext:?} accepted or wrong error: {other:?}"),
        }
    }
    assert!(FreeSpace::from_extents(200, 100, []).is_err());
    assert_eq!(AllocError::Corrupt("x".into()).errno(), libc::EUCLEAN);
}

#[test]
fn hundred_tib_costs_extents_not_size() {
    const NR: u64 = 1 << 35; // 100+ TiB of 4 KiB blocks
    let t = Instant::now();
    let fs = FreeSpace::new(1024, NR);
    assert_eq!(fs.nr_extents(), 1);
    assert_eq!(fs.free_blocks(), NR - 1024);
    let mut a = Allocator::new(fs);
    // Replay 10,000 scattered allocations (as from a journal), fragmenting the map.
    let step = NR / 10_001;
    let mut held = Vec::new();
    for i in 1..=10_000u64 {
        let s = i * step;
        let n = 1 + i % 7;
        a.alloc_exact(s, n).unwrap();
        held.push((s, n));
    }
    assert_eq!(a.space().nr_extents(), 10_001);
    // 10,000 more scattered allocations with goals across the device.
    for i in 0..10_000u64 {
        let goal = (i * 7919 % 10_000) * step + step / 2;
        let n = 1 + i % 13;
        let ext = a.alloc(n, Some(goal)).unwrap();
        assert_eq!(ext, vec![(goal, n)]);
        held.push(ext[0]);
    }
    assert_eq!(a.space().nr_extents(), 20_001);
    a.reserve(NR / 2).unwrap();
    let big = a.alloc_reserved(NR / 2, None).unwrap();
    held.extend(big);
    for (i, (s, n)) in held.into_iter().enumerate() {
        a.free_deferred(i as u64 / 1000, s, n).unwrap();
    }
    a.commit(u64::MAX).unwrap();
    assert_eq!(
        a.space().extents().collect::<Vec<_>>(),
        vec![(1024, NR - 1024)]
    );
    // The counts above are the test; the time only catches work per block (2^35 of
    // them would take minutes), so its bound is far from the ~0.5 s a debug build
    // takes here, and a loaded CI machine cannot fail it.
    let took = t.elapsed();
    assert!(took < Duration::from_secs(30), "took {took:?}");
}

#[test]
fn no_panics_on_edge_inputs() {
    let mut fs = FreeSpace::new(0, u64::MAX);
    assert!(fs.alloc(u64::MAX, None).is_ok());
    assert!(fs.free(u64::MAX - 1, 2).is_err());
    assert!(fs.free(0, u64::MAX).is_ok());
    assert!(!fs.is_free(u64::MAX, 1));
    assert!(!fs.is_free(5, 0));
    assert!(fs.alloc_exact(u64::MAX - 3, 10).is_err());
    let mut empty = Allocator::new(FreeSpace::new(10, 3));
    assert_eq!(empty.statfs(), (0, 0, 0));
    assert_eq!(empty.alloc_next(1), Err(AllocError::NoSpace));
    assert_eq!(empty.reserve(0), Ok(()));
    assert!(empty.commit(0).is_ok());
    assert!(empty.free_deferred(0, 0, 1).is_err());
}
