//! Directories (issue 16): entries in name-hash order with the hash as the readdir
//! cookie, so lookup, create and a resumed readdir each cost O(log n), and a walk
//! returns every entry that exists throughout it exactly once whatever changes
//! meanwhile; a directory of a million entries is made, walked under concurrent
//! changes, and emptied.

mod common;

use common::{fresh_with, quiet};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};
use wbstack::fs::dir::{name_hash, Dir};
use wbstack::fs::{Cred, DirPageEntry, InodeKind, OpenOptions, Volume};

fn file(_: u64) -> InodeKind {
    InodeKind::File
}

/// A whole walk of `d` in pages of `page` entries.
fn walk(d: &Dir, page: usize) -> Vec<DirPageEntry> {
    let mut out: Vec<DirPageEntry> = Vec::new();
    loop {
        let after = out.last().map_or(0, |e| e.cookie);
        let p = d.page(after, page, file).expect("every entry resident");
        if p.is_empty() {
            return out;
        }
        assert!(p.len() >= page.min(1), "an empty page before the end");
        out.extend(p);
    }
}

#[derive(Clone, Debug)]
enum Op {
    Insert(u8, u64),
    Remove(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (any::<u8>(), 1..1000u64).prop_map(|(n, i)| Op::Insert(n, i)),
        any::<u8>().prop_map(Op::Remove),
    ]
}

fn name(n: u8) -> Vec<u8> {
    format!("name-{n}").into_bytes()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, .. ProptestConfig::default() })]

    /// Against a map: what each operation returns, the lookups, the count, and a walk
    /// in any page size returning everything once, in (hash, name) order.
    #[test]
    fn a_dir_behaves_as_a_map_in_hash_order(
        ops in prop::collection::vec(op(), 0..300),
        seed in any::<u64>(),
        page in 1..40usize,
    ) {
        let mut d = Dir::new();
        let mut model: BTreeMap<Vec<u8>, u64> = BTreeMap::new();
        for o in ops {
            match o {
                Op::Insert(n, i) => {
                    prop_assert_eq!(d.insert(seed, &name(n), i), model.insert(name(n), i));
                }
                Op::Remove(n) => {
                    prop_assert_eq!(d.remove(seed, &name(n)), model.remove(&name(n)));
                }
            }
            prop_assert_eq!(d.len(), model.len());
        }
        for n in 0..=255u8 {
            prop_assert_eq!(d.get(seed, &name(n)), Ok(model.get(&name(n)).copied()));
        }
        let mut want: Vec<(u64, Vec<u8>, u64)> = model
            .iter()
            .map(|(n, &i)| (name_hash(seed, n), n.clone(), i))
            .collect();
        want.sort();
        let got: Vec<(u64, Vec<u8>, u64)> =
            walk(&d, page).into_iter().map(|e| (e.cookie, e.name, e.ino)).collect();
        prop_assert_eq!(got, want);
    }

    /// A walk resumed page by page while names come and go between pages: every name
    /// present from start to end is returned exactly once, no name twice, and nothing
    /// that was never there.
    #[test]
    fn a_walk_under_changes_returns_each_lasting_entry_once(
        initial in prop::collection::btree_set(any::<u8>(), 0..200),
        changes in prop::collection::vec(prop::collection::vec(op(), 0..8), 0..60),
        seed in any::<u64>(),
        page in 1..20usize,
    ) {
        let mut d = Dir::new();
        for &n in &initial {
            d.insert(seed, &name(n), u64::from(n) + 1);
        }
        let mut lasting: BTreeSet<Vec<u8>> = initial.iter().map(|&n| name(n)).collect();
        let mut ever = lasting.clone();
        let mut seen: BTreeSet<Vec<u8>> = BTreeSet::new();
        let mut cookie = 0;
        let mut changes = changes.into_iter();
        loop {
            let p = d.page(cookie, page, file).expect("every entry resident");
            let Some(last) = p.last() else { break };
            cookie = last.cookie;
            for e in p {
                prop_assert!(ever.contains(&e.name), "{:?} was never there", e.name);
                prop_assert!(seen.insert(e.name.clone()), "{:?} returned twice", e.name);
            }
            for o in changes.next().unwrap_or_default() {
                match o {
                    Op::Insert(n, i) => {
                        d.insert(seed, &name(n), i);
                        ever.insert(name(n));
                    }
                    Op::Remove(n) => {
                        d.remove(seed, &name(n));
                        lasting.remove(&name(n));
                    }
                }
            }
        }
        let missed: Vec<_> = lasting.difference(&seen).collect();
        prop_assert!(missed.is_empty(), "lasting entries never returned: {:?}", missed);
    }
}

/// Resident memory of this process, from /proc.
fn rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb * 1024
}

fn big_name(i: u64) -> Vec<u8> {
    format!("entry-{i:07}").into_bytes()
}

/// Walk directory `dir` of `v` as the FUSE mount does, `page` entries a call.
fn walk_volume(v: &Volume, dir: u64, page: usize, mut each: impl FnMut(&DirPageEntry)) {
    let mut cookie = 0;
    loop {
        let p = v.readdir_page(dir, cookie, page).unwrap();
        let Some(last) = p.last() else { return };
        cookie = last.cookie;
        p.iter().for_each(&mut each);
    }
}

/// The million-entry directory: created, every name looked up, every file
/// opened and closed through an inode cache of 1024 (the inodes' page-cache state
/// stays bounded by it, not by the million), walked while another thread creates and
/// removes names of its own, then emptied. The walk's memory is a page, not the
/// directory. `WBSTACK_BIG_DIR` sets the entry count.
#[test]
fn a_million_entry_directory_is_created_walked_under_changes_and_emptied() {
    let n: u64 = std::env::var("WBSTACK_BIG_DIR")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000_000);
    let mut o = quiet();
    o.commit_interval_ms = 1000;
    o.inode_cache = 1024;
    let (_q, v) = fresh_with("sim:ssd,size=8G,data=meta", o);
    let c = Cred::root();
    let dir = v.mknod_as(&c, 1, b"big", 0o040755, 0).unwrap().ino;
    let mut inos = Vec::with_capacity(n as usize);
    for i in 0..n {
        inos.push(v.mknod_as(&c, dir, &big_name(i), 0o100644, 0).unwrap().ino);
    }
    for (i, &ino) in inos.iter().enumerate() {
        assert_eq!(v.lookup_as(&c, dir, &big_name(i as u64)).unwrap().ino, ino);
    }
    assert_eq!(v.getattr(dir).unwrap().nlink, 2);
    // Committed, so each inode is at rest once closed and may be evicted.
    v.sync().unwrap();
    let rss_before_opens = rss_bytes();
    let mut cached_most = 0;
    for (i, &ino) in inos.iter().enumerate() {
        v.open_as(&c, ino, &OpenOptions::read())
            .unwrap()
            .close()
            .unwrap();
        if i % 4096 == 0 {
            cached_most = cached_most.max(v.inode_cache_stats().cached);
        }
    }
    // RSS may shrink as well (freed memory returned): growth only.
    let opened_growth = rss_bytes().saturating_sub(rss_before_opens);
    let s = v.inode_cache_stats();
    assert!(
        cached_most <= 1024 + 64,
        "the inode cache held {cached_most} inodes at once, over its limit of 1024"
    );
    assert!(
        s.evicted + 1100 >= n,
        "only {} evictions for {n} opens",
        s.evicted
    );
    // Checkpoints made due during the creates (past `inode_cache` changes) let the
    // inodes leave memory, so the opens read them back through the tree's node cache,
    // which fills to its bound (128 MiB); a million inodes kept would be several
    // hundred MiB more.
    assert!(
        opened_growth < (64 << 20) + (128 << 20),
        "opening every file grew RSS by {opened_growth} bytes: inodes were kept past the cache"
    );

    // Walk while a second thread churns names of its own through the directory. Past
    // `inode_cache` changes the churn would make checkpoints due, each writing new tree
    // nodes into the simulated device's memory (`data=meta`); this measures the walk,
    // so its changes wait for the commit interval instead.
    v.set_tunable("inode_cache", "1000000").unwrap();
    // The directory's inode may have left memory: bring it back before the baseline,
    // so what is measured is the walk's own memory (its entries come back as hashes,
    // and each page reads its own groups back: `fs::dir`).
    v.readdir_page(dir, 0, 1).unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    // Less the tree's node cache, which the walk's reads fill up to `node_cache`
    // (128 MiB): a buffer cache with its own bound, not the walk's memory. A listing
    // used to fill it before this baseline; a page now reads only its own leaves.
    let rss_own = || rss_bytes() - v.inode_cache_stats().node_cache_bytes;
    let rss_before = rss_own();
    let mut seen = vec![false; n as usize];
    let mut churned = 0u64;
    let mut rss_peak = rss_before;
    std::thread::scope(|s| {
        let churn = s.spawn(|| {
            let mut k = 0u64;
            // Bounded: the records of the running transaction (up to a quarter of the
            // journal) would otherwise grow with however long the walk takes.
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && k < 20_000 {
                let nm = format!("churn-{}", k % 64).into_bytes();
                if k % 128 < 64 {
                    v.mknod_as(&c, dir, &nm, 0o100644, 0).unwrap();
                } else {
                    v.unlink_as(&c, dir, &nm, false).unwrap();
                }
                k += 1;
            }
            k
        });
        let mut calls = 0u64;
        walk_volume(&v, dir, 256, |e| {
            if let Some(i) = e.name.strip_prefix(b"entry-") {
                let i: usize = std::str::from_utf8(i).unwrap().parse().unwrap();
                assert!(!seen[i], "entry {i} returned twice");
                seen[i] = true;
                assert_eq!(e.ino, inos[i]);
                assert_eq!(e.kind, InodeKind::File);
            } else {
                assert!(e.name.starts_with(b"churn-"), "a stranger: {:?}", e.name);
            }
            calls += 1;
            if calls.is_multiple_of(65536) {
                rss_peak = rss_peak.max(rss_own());
            }
        });
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        churned = churn.join().unwrap();
    });
    let missed = seen.iter().filter(|s| !**s).count();
    assert_eq!(
        missed, 0,
        "entries present throughout the walk were not returned"
    );
    assert!(churned > 0, "the walk never overlapped a change");
    // A listing of the directory taken whole would hold tens of bytes per entry.
    let grown = rss_peak - rss_before;
    assert!(
        grown < 16 << 20,
        "the walk grew RSS by {grown} bytes: it holds more than a page"
    );

    // Empty it (the churn's leftovers too) and check the directory and the volume.
    for i in 0..n {
        v.unlink_as(&c, dir, &big_name(i), false).unwrap();
    }
    let rest: Vec<Vec<u8>> = v
        .readdir_page(dir, 0, 1000)
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    for nm in &rest {
        v.unlink_as(&c, dir, nm, false).unwrap();
    }
    assert!(v.readdir_page(dir, 0, 1).unwrap().is_empty());
    v.unlink_as(&c, 1, b"big", true).unwrap();
    v.sync().unwrap();
    assert_eq!(v.statfs().files, 1, "only the root is left");
}
