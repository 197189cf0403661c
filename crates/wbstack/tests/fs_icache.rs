//! The inode cache (issue 16): unused inodes at rest are evicted past `inode_cache`,
//! inodes that still owe something (uncommitted changes, dirty or cached pages, an
//! unreported writeback error, an open file) are kept, and an evicted inode comes back
//! from the durable metadata exactly as it was.

mod common;

use common::{fresh_with, quiet, sim};
use wbstack::fs::{MountOptions, OpenOptions, Volume};

fn limit(n: usize) -> MountOptions {
    let mut o = quiet();
    o.inode_cache = n;
    o
}

/// The whole file, through an open of its own (closed again).
fn read_file(v: &Volume, path: &str) -> Vec<u8> {
    let f = v.open(path, &OpenOptions::read()).unwrap();
    let data = read_all(&f);
    f.close().unwrap();
    data
}

fn read_all(f: &wbstack::fs::File) -> Vec<u8> {
    let mut buf = vec![0u8; f.size() as usize];
    assert_eq!(f.read_at(0, &mut buf).unwrap(), buf.len());
    buf
}

fn touch(v: &Volume, path: &str) {
    v.create(path).unwrap().close().unwrap();
}

/// Creates outrunning commits: every inode over the limit waits for a commit, so a
/// prune that found only such waits is not repeated until a commit or a flush happens
/// (each open and close used to pass over the same inodes again); after the commit the
/// next ones evict.
#[test]
fn prunes_wait_for_a_commit_instead_of_passing_over_the_same_inodes() {
    let (_q, v) = fresh_with("sim:ssd,size=64M", limit(4));
    for i in 0..200 {
        touch(&v, &format!("/f{i}"));
    }
    let s = v.inode_cache_stats();
    assert_eq!(s.evicted, 0, "nothing committed yet: {s:?}");
    assert!(
        s.examined <= 16,
        "{} inodes examined for 200 creates: the waiting inodes were passed over again and again",
        s.examined
    );
    v.sync().unwrap();
    touch(&v, "/after");
    let s = v.inode_cache_stats();
    assert!(s.evicted >= 32, "the commit let a batch go: {s:?}");
}

#[test]
fn committed_unused_inodes_are_evicted_and_uncommitted_ones_kept() {
    let (_q, v) = fresh_with("sim:ssd,size=64M", limit(0));
    touch(&v, "/a");
    touch(&v, "/b");
    let s = v.inode_cache_stats();
    assert_eq!(
        (s.cached, s.evicted),
        (2, 0),
        "created in the running transaction: a later fsync must still wait for it"
    );
    v.sync().unwrap();
    // The next last close prunes: a and b are committed, empty and unused.
    touch(&v, "/c");
    let s = v.inode_cache_stats();
    assert_eq!((s.cached, s.evicted), (1, 2), "{s:?}");
    // Each comes back from the durable metadata as it was.
    let a = v.open("/a", &OpenOptions::read_write()).unwrap();
    a.write_at(0, b"hello").unwrap();
    a.fsync().unwrap();
    a.close().unwrap();
    assert_eq!(read_file(&v, "/a"), b"hello");
    assert_eq!(v.stat("/b").unwrap().size, 0);
}

#[test]
fn an_open_or_dirty_inode_is_never_evicted() {
    let (_q, v) = fresh_with("sim:ssd,size=64M", limit(0));
    let open = v.create("/open").unwrap();
    open.write_at(0, &[7u8; 10_000]).unwrap();
    let dirty = v.create("/dirty").unwrap();
    dirty.write_at(0, &[8u8; 5000]).unwrap();
    dirty.close().unwrap();
    for i in 0..50 {
        touch(&v, &format!("/f{i}"));
    }
    let s = v.inode_cache_stats();
    assert!(s.cached >= 2, "{s:?}");
    assert_eq!(s.evicted, 0, "nothing committed yet: {s:?}");
    v.sync().unwrap();
    for i in 0..50 {
        touch(&v, &format!("/g{i}"));
    }
    // The open file and the written one keep their (clean, cached) pages.
    let s = v.inode_cache_stats();
    assert!(s.evicted >= 50, "the empty files went: {s:?}");
    assert_eq!(read_all(&open), vec![7u8; 10_000]);
    assert_eq!(read_file(&v, "/dirty"), vec![8u8; 5000]);
    open.close().unwrap();
}

#[test]
fn many_files_through_a_small_cache_stay_bounded_and_intact() {
    let mut o = limit(64);
    o.cache.cache_size = 1 << 20; // 256 pages: page reclaim empties old mappings
    let (_q, v) = fresh_with("sim:ssd,size=256M", o);
    let n = 2000u32;
    for i in 0..n {
        let f = v.create(&format!("/f{i}")).unwrap();
        f.write_at(0, &i.to_le_bytes().repeat(1024)).unwrap();
        f.close().unwrap();
        if i % 500 == 499 {
            v.sync().unwrap();
        }
    }
    v.sync().unwrap();
    // Read every file back: each read opens, rebuilds evicted mappings, and closes.
    for i in 0..n {
        let want = i.to_le_bytes().repeat(1024);
        assert_eq!(read_file(&v, &format!("/f{i}")), want, "file {i}");
    }
    let s = v.inode_cache_stats();
    let pages = v.cache().capacity_pages();
    assert!(
        s.cached <= s.limit + pages + 32,
        "cached {} over limit {} + {pages} mappings with pages: {s:?}",
        s.cached,
        s.limit
    );
    assert!(s.live <= s.cached + 2, "per-inode state follows: {s:?}");
    assert!(s.evicted >= u64::from(n), "{s:?}");
    // The limit is a run-time knob too.
    v.set_tunable("inode_cache", "100000").unwrap();
    assert_eq!(v.tunable("inode_cache").unwrap(), "100000");
    assert!(v.set_tunable("inode_cache", "lots").is_err());
    assert_eq!(v.tunable("inode_cache").unwrap(), "100000");
    v.unmount().unwrap();
}

#[test]
fn an_unreported_writeback_error_keeps_its_inode_cached() {
    let mut o = limit(0);
    o.cache.cache_size = 4 << 20;
    let (q, v) = fresh_with("sim:ssd,size=128M", o);
    let a = v.create("/f").unwrap();
    a.write_at(0, &[1u8; 16384]).unwrap();
    a.close().unwrap();
    let first = v.superblock().data_start * 8;
    sim(&q).inject_eio(first..u64::MAX / 2, false, true);
    // Writeback by the flusher, not by an fsync: nobody has seen the error yet.
    v.bdi().sync().unwrap();
    sim(&q).clear_faults();
    v.sync().unwrap_err();
    // Push the failed pages out of the page cache, and churn the inode cache.
    let filler = v.create("/filler").unwrap();
    for i in 0..128u64 {
        filler.write_at(i * 65536, &[9u8; 65536]).unwrap();
    }
    filler.fsync().unwrap();
    filler.close().unwrap();
    v.sync().unwrap();
    for i in 0..50 {
        touch(&v, &format!("/t{i}"));
    }
    v.sync().unwrap();
    // Each last close evicts a batch (32) of what is at rest.
    for i in 0..3 {
        touch(&v, &format!("/u{i}"));
    }
    assert!(
        v.inode_cache_stats().evicted >= 50,
        "{:?}",
        v.inode_cache_stats()
    );
    let d = v.open("/f", &OpenOptions::read_write()).unwrap();
    assert_eq!(
        d.fsync().map_err(|e| e.errno()),
        Err(libc::EIO),
        "the error outlives the pages and the churn"
    );
}

/// The metadata tree's node cache keeps to `node_cache` (a mount option and a knob):
/// a checkpoint of thousands of inodes fills it only up to the limit, inodes read back
/// past it find their nodes on the device (counted as misses), and a lower limit drops
/// nodes at once.
#[test]
fn the_node_cache_keeps_to_its_limit() {
    let mut o = limit(16);
    o.parse("node_cache=64k").unwrap();
    assert_eq!(o.node_cache, 64 << 10);
    let (_q, v) = fresh_with("sim:ssd,size=256M", o);
    assert_eq!(v.tunable("node_cache").unwrap(), "65536");
    let n = 3000;
    for i in 0..n {
        touch(&v, &format!("/f{i}"));
    }
    v.checkpoint().unwrap();
    let s = v.inode_cache_stats();
    assert!(
        s.node_cache_bytes > 0 && s.node_cache_bytes <= 64 << 10,
        "{s:?}"
    );
    // Most inodes left memory once the checkpoint held them; each comes back through
    // its leaf, which the small cache no longer holds.
    touch(&v, "/churn");
    for i in 0..n {
        v.stat(&format!("/f{i}")).unwrap();
    }
    let after = v.inode_cache_stats();
    assert!(after.inodes_read_back > 0, "{after:?}");
    assert!(
        after.node_cache_misses > s.node_cache_misses,
        "nodes read from the device: {s:?} then {after:?}"
    );
    assert!(after.node_cache_bytes <= 64 << 10, "{after:?}");
    v.set_tunable("node_cache", "4096").unwrap();
    assert_eq!(v.tunable("node_cache").unwrap(), "4096");
    assert!(v.inode_cache_stats().node_cache_bytes <= 4096);
    assert!(v.set_tunable("node_cache", "lots").is_err());
    assert_eq!(v.tunable("node_cache").unwrap(), "4096");
    v.unmount().unwrap();
}
