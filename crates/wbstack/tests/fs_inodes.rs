//! Metadata on demand (issue 16): on a format 5 volume an inode not in use and unchanged
//! since the durable checkpoint leaves memory past `inode_cache`, and comes back from
//! the metadata tree exactly as it was; a deleted one never comes back.

mod common;

use common::{queue, quiet};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use wbstack::block::RequestQueue;
use wbstack::fs::format::InodeKind;
use wbstack::fs::ops::XattrMode;
use wbstack::fs::perm::Cred;
use wbstack::fs::{FsError, MkfsOptions, MountOptions, Stat, Volume};

const LIMIT: usize = 8;

fn mount(q: &Arc<RequestQueue>) -> Volume {
    mount_with_cache(q, LIMIT)
}

fn mount_with_cache(q: &Arc<RequestQueue>, inode_cache: usize) -> Volume {
    let mut o: MountOptions = quiet();
    o.inode_cache = inode_cache;
    Volume::mount(q.clone(), o).unwrap()
}

/// The mounted volume passes its checks, unmounts, and fsck finds it clean.
fn check_unmount_fsck(v: Volume) {
    assert!(v.check().is_empty(), "{:?}", v.check());
    let q = v.queue().clone();
    v.unmount().unwrap();
    let r = wbstack::fs::fsck::fsck(&q);
    assert!(r.is_clean(), "{:?}", r.problems);
}

/// Everything a file shows: its stat, data, target and attribute.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    stat: Stat,
    data: Vec<u8>,
    target: Option<String>,
    xattr: Option<Vec<u8>>,
}

fn look(v: &Volume, path: &str) -> Seen {
    let mut stat = v.lstat(path).unwrap();
    // Looking reads, and a read may move atime.
    stat.atime_ns = 0;
    let target = v.readlink(path).ok();
    let data = if target.is_none() {
        let f = v.open(path, &wbstack::fs::OpenOptions::read()).unwrap();
        let mut buf = vec![0u8; f.size() as usize];
        assert_eq!(f.read_at(0, &mut buf).unwrap(), buf.len());
        f.close().unwrap();
        buf
    } else {
        Vec::new()
    };
    let xattr = v.getxattr_as(&Cred::root(), stat.ino, b"user.k").ok();
    Seen {
        stat,
        data,
        target,
        xattr,
    }
}

fn look_all(v: &Volume, paths: &[String]) -> BTreeMap<String, Seen> {
    paths.iter().map(|p| (p.clone(), look(v, p))).collect()
}

/// Drop the files' pages (an inode with pages stays, as the kernel's does while its
/// pages are cached), checkpoint (reads changed atimes), then open and close a file
/// until at most `bound` inodes are in memory: each open and close prunes a batch of
/// mappings, then the inodes they held.
fn prune_until(v: &Volume, paths: &[String], bound: u64) -> usize {
    for p in paths {
        v.drop_cache(p).unwrap();
    }
    v.checkpoint().unwrap();
    for n in 0..1000 {
        if v.inode_cache_stats().inodes_resident <= bound {
            return n;
        }
        v.create("/d/churn").unwrap().close().unwrap();
    }
    panic!("inodes stayed in memory: {:?}", v.inode_cache_stats());
}

#[test]
fn clean_inodes_leave_memory_and_come_back_as_they_were() {
    let q = queue("sim:ssd,size=1G");
    let mk = MkfsOptions {
        format: Some(5),
        ..Default::default()
    };
    Volume::mkfs(&q, &mk).unwrap();
    let v = mount(&q);
    v.mkdir("/d", 0o755).unwrap();
    let mut paths = Vec::new();
    for i in 0..300u32 {
        let p = format!("/d/f{i}");
        let f = v.create(&p).unwrap();
        let len = (i as usize * 37) % 9000;
        let data: Vec<u8> = (0..len).map(|b| (b as u32 ^ i) as u8).collect();
        f.write_at(0, &data).unwrap();
        f.close().unwrap();
        if i % 7 == 0 {
            let ino = v.stat(&p).unwrap().ino;
            v.setxattr_as(
                &Cred::root(),
                ino,
                b"user.k",
                &i.to_le_bytes(),
                XattrMode::Create,
            )
            .unwrap();
        }
        if i % 10 == 0 {
            v.symlink(&format!("f{i}"), &format!("/d/s{i}")).unwrap();
            paths.push(format!("/d/s{i}"));
        }
        if i % 13 == 0 {
            v.link(&p, &format!("/d/h{i}")).unwrap();
            paths.push(format!("/d/h{i}"));
        }
        paths.push(p);
    }
    let before = look_all(&v, &paths);
    // Nothing leaves memory before a checkpoint holds it.
    for p in &paths {
        v.drop_cache(p).unwrap();
    }
    v.sync().unwrap();
    v.create("/d/churn").unwrap().close().unwrap();
    // The journal (16 MiB at this size) has not reached a checkpoint of its own.
    assert_eq!(v.journal_stats().checkpoints, 0);
    assert_eq!(v.inode_cache_stats().inodes_dropped, 0);
    // The root, /d, churn and the limit's worth of clean ones, at most.
    prune_until(&v, &paths, LIMIT as u64 + 3);
    let s = v.inode_cache_stats();
    assert!(s.inodes_dropped >= 300, "{s:?}");
    assert_eq!(look_all(&v, &paths), before, "inodes read back differ");
    let s = v.inode_cache_stats();
    assert!(s.inodes_read_back >= 300, "{s:?}");
    assert!(v.check().is_empty(), "{:?}", v.check());

    // A deleted inode does not come back from the tree, which still holds it until
    // the next checkpoint.
    prune_until(&v, &paths, LIMIT as u64 + 3);
    let gone = v.stat("/d/f1").unwrap().ino;
    v.unlink("/d/f1").unwrap();
    v.create("/d/churn").unwrap().close().unwrap();
    assert!(v.inode_cache_stats().inodes_resident <= LIMIT as u64 + 3);
    assert!(matches!(v.stat_ino(gone), Err(FsError::NotFound(_))));
    paths.retain(|p| p != "/d/f1");
    prune_until(&v, &paths, LIMIT as u64 + 3);
    assert!(matches!(v.stat_ino(gone), Err(FsError::NotFound(_))));
    let before = look_all(&v, &paths);
    // A change to a dropped inode sticks: it stays in memory until a checkpoint holds
    // it, then comes back changed.
    prune_until(&v, &paths, LIMIT as u64 + 3);
    let f = v
        .open("/d/f2", &wbstack::fs::OpenOptions::read_write())
        .unwrap();
    f.set_len(77).unwrap();
    f.close().unwrap();
    let f2 = look(&v, "/d/f2");
    assert_eq!(f2.stat.size, 77);
    // Changed and committed, but not yet in a checkpoint: kept while prunes drop the
    // others, where a read back would find the tree's old size.
    v.sync().unwrap();
    for p in &paths {
        v.drop_cache(p).unwrap();
    }
    for _ in 0..10 {
        v.create("/d/churn").unwrap().close().unwrap();
    }
    let s = v.inode_cache_stats();
    assert!(s.inodes_resident <= LIMIT as u64 + 4, "{s:?}");
    assert_eq!(look(&v, "/d/f2").stat.size, 77);
    assert_eq!(v.inode_cache_stats().inodes_read_back, s.inodes_read_back);
    prune_until(&v, &paths, LIMIT as u64 + 3);
    assert_eq!(look(&v, "/d/f2"), f2);
    let mut before = before;
    before.insert("/d/f2".into(), f2);
    v.unmount().unwrap();

    let v = mount(&q);
    assert_eq!(look_all(&v, &paths), before, "after a remount");
    check_unmount_fsck(v);
}

fn mkfs5(spec: &str) -> Arc<RequestQueue> {
    let q = queue(spec);
    let mk = MkfsOptions {
        format: Some(5),
        ..Default::default()
    };
    Volume::mkfs(&q, &mk).unwrap();
    q
}

/// `n` files of a few hundred bytes in each of two directories, one symlink and one
/// attribute per directory; their paths.
fn populate(v: &Volume, n: usize) -> Vec<String> {
    let mut paths = Vec::new();
    for d in ["/a", "/b"] {
        v.mkdir(d, 0o755).unwrap();
        for i in 0..n {
            let p = format!("{d}/f{i}");
            let f = v.create(&p).unwrap();
            f.write_at(0, &vec![i as u8; 100 + i % 500]).unwrap();
            f.close().unwrap();
            paths.push(p);
        }
        let l = format!("{d}/link");
        v.symlink("f0", &l).unwrap();
        paths.push(l);
        let ino = v.stat(&format!("{d}/f1")).unwrap().ino;
        v.setxattr_as(
            &Cred::root(),
            ino,
            b"user.k",
            d.as_bytes(),
            XattrMode::Create,
        )
        .unwrap();
    }
    paths
}

/// Device reads a mount of a volume of `n` files per directory takes.
fn mount_reads(n: usize) -> (u64, Volume, Vec<String>, BTreeMap<String, Seen>) {
    let q = mkfs5("sim:ssd,size=256M");
    let v = mount(&q);
    let paths = populate(&v, n);
    let before = look_all(&v, &paths);
    v.unmount().unwrap();
    let r0 = q.diskstats().ios[0];
    let v = mount(&q);
    let reads = q.diskstats().ios[0] - r0;
    (reads, v, paths, before)
}

/// A format 5 mount reads the root record, the filesystem record and the orphans, not
/// the tree: its reads do not grow with the files, no inode is in memory after it, and
/// every inode comes back on its first use.
#[test]
fn a_format_5_mount_reads_only_what_it_needs() {
    let (small, v, _, _) = mount_reads(20);
    v.unmount().unwrap();
    let (large, v, paths, before) = mount_reads(1500);
    eprintln!("mount reads: {small} for 40 files, {large} for 3000");
    assert!(
        large <= small + 2 && large <= 16,
        "a mount read {small} times for 40 files and {large} times for 3000"
    );
    let s = v.inode_cache_stats();
    assert_eq!(s.inodes_resident, 0, "{s:?}");
    assert_eq!(v.statfs().files, 3000 + 2 + 2 + 1);
    // A listing reads the directory, not the inodes it names: entries keep their kind.
    let kinds: Vec<InodeKind> = v.readdir("/a").unwrap().iter().map(|e| e.kind).collect();
    assert_eq!(kinds.len(), 1501);
    assert!(kinds.contains(&InodeKind::Symlink) && kinds.contains(&InodeKind::File));
    let s = v.inode_cache_stats();
    assert!(
        s.inodes_read_back <= 2,
        "the listing read the inodes back: {s:?}"
    );
    assert_eq!(look_all(&v, &paths), before);
    assert!(v.inode_cache_stats().inodes_read_back >= 3000);
    check_unmount_fsck(v);
}

/// A crash leaves transactions in the journal: mount replays them into inodes it reads
/// back as their records name them, and everything fsynced is there.
#[test]
fn a_crash_replays_into_inodes_read_on_demand() {
    let q = mkfs5("sim:ssd,size=256M");
    let v = mount(&q);
    let mut paths = populate(&v, 200);
    v.checkpoint().unwrap();
    // After the checkpoint: a rewrite, a truncation, a rename, an unlink, a new file,
    // a mode change and a directory moved, each committed.
    let f = v
        .open("/a/f3", &wbstack::fs::OpenOptions::read_write())
        .unwrap();
    f.write_at(0, b"rewritten").unwrap();
    f.fsync().unwrap();
    f.close().unwrap();
    let f = v
        .open("/a/f4", &wbstack::fs::OpenOptions::read_write())
        .unwrap();
    f.set_len(1).unwrap();
    f.fsync().unwrap();
    f.close().unwrap();
    v.rename("/a/f5", "/b/moved").unwrap();
    v.unlink("/b/f6").unwrap();
    let f = v.create("/b/new").unwrap();
    f.write_at(0, b"new").unwrap();
    f.fsync().unwrap();
    f.close().unwrap();
    v.set_attr(
        "/a/f7",
        &wbstack::fs::SetAttr {
            mode: Some(0o600),
            ..Default::default()
        },
    )
    .unwrap();
    v.mkdir("/a/sub", 0o755).unwrap();
    v.rename("/a/sub", "/b/sub").unwrap();
    v.commit_now().unwrap();
    paths.retain(|p| !["/a/f5", "/b/f6"].contains(&p.as_str()));
    paths.extend(["/b/moved".to_string(), "/b/new".to_string()]);
    let before = look_all(&v, &paths);
    common::sim(&q).power_cut(false);
    v.crash();
    common::sim(&q).reboot();

    let v = mount(&q);
    assert!(v.inode_cache_stats().inodes_resident <= 40);
    assert_eq!(look_all(&v, &paths), before);
    assert_eq!(v.stat("/b/sub").unwrap().nlink, 2);
    assert_eq!(v.stat("/b").unwrap().nlink, 3);
    check_unmount_fsck(v);
}

/// Inodes read back for an operation stay in memory until it ran again, however hard
/// other threads prune (a cache of none: every prune drops every clean inode), and
/// whatever other threads' operations miss or fail on meanwhile.
#[test]
fn reads_back_survive_concurrent_prunes() {
    let q = mkfs5("sim:ssd,size=256M");
    let v = mount_with_cache(&q, 0);
    let paths = populate(&v, 100);
    v.checkpoint().unwrap();
    let churn = || v.create("/a/churn").unwrap().close().unwrap();
    // Failing operations and listings elsewhere: a thread's misses are its own.
    let elsewhere = || {
        assert!(matches!(v.mkdir("/a", 0o755), Err(FsError::Exists(_))));
        assert_eq!(v.readdir("/b").unwrap().len(), 101);
    };
    while_looping(&[&churn, &elsewhere], |churned| {
        // Rounds while the churn prunes, until it has pruned a thousand times over.
        let mut rounds = 0;
        while churned.load(Ordering::Relaxed) < 1000 || rounds < 5 {
            for p in &paths {
                v.lstat(p)
                    .unwrap_or_else(|e| panic!("round {rounds}: stat {p}: {e}"));
            }
            rounds += 1;
            assert!(rounds < 100_000, "the churn stalled");
        }
    });
    let s = v.inode_cache_stats();
    assert!(s.inodes_read_back > 0 && s.inodes_dropped > 0, "{s:?}");
    v.unmount().unwrap();
}

/// Runs `body` while each of `loops` runs over and over on a thread of its own, and
/// stops them however `body` ends (a failed assertion too). `body` starts once the
/// first loop has run once, and gets how many times it has run.
fn while_looping<R>(loops: &[&(dyn Fn() + Sync)], body: impl FnOnce(&AtomicU64) -> R) -> R {
    struct Stop<'a>(&'a AtomicBool);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let stop = AtomicBool::new(false);
    let first_runs = AtomicU64::new(0);
    std::thread::scope(|s| {
        for (i, f) in loops.iter().enumerate() {
            let (stop, first_runs) = (&stop, &first_runs);
            s.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    f();
                    if i == 0 {
                        first_runs.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
        let _stop = Stop(&stop);
        let t0 = std::time::Instant::now();
        while first_runs.load(Ordering::Relaxed) == 0 {
            assert!(t0.elapsed().as_secs() < 10, "the first loop never ran");
            std::thread::yield_now();
        }
        body(&first_runs)
    })
}

/// An operation that meets its inodes one at a time (a path of many directories, none
/// in memory, none in the dentry cache: a fresh mount) is run again as often as it
/// makes progress: each rerun misses the next. Its walk fills the dentry cache, and
/// the next walk of the path reads back only the inodes it uses, not the directories
/// on the way.
#[test]
fn a_deep_path_of_dropped_directories_is_read_back_a_step_at_a_time() {
    let q = mkfs5("sim:ssd,size=256M");
    let v = mount_with_cache(&q, 0);
    let mut path = String::new();
    for i in 0..40 {
        path.push_str(&format!("/d{i}"));
        v.mkdir(&path, 0o755).unwrap();
    }
    let file = format!("{path}/f");
    v.create(&file).unwrap().close().unwrap();
    v.unmount().unwrap();
    let v = mount_with_cache(&q, 0);
    let before = v.inode_cache_stats();
    assert!(before.inodes_resident <= 3, "{before:?}");
    assert_eq!(before.dentries, 0, "{before:?}");
    assert_eq!(v.stat(&file).unwrap().size, 0);
    let after = v.inode_cache_stats();
    assert!(
        after.inodes_read_back >= before.inodes_read_back + 41,
        "{before:?} {after:?}"
    );
    assert_eq!(after.dentries, 40, "{after:?}");
    // Dropped again: the second stat walks the dentry cache, without `st`, and reads
    // back the last directory (to look the file up in it) and the file.
    v.checkpoint().unwrap();
    v.create("/churn").unwrap().close().unwrap();
    let before = v.inode_cache_stats();
    assert!(before.inodes_resident <= 3, "{before:?}");
    assert_eq!(v.stat(&file).unwrap().size, 0);
    let after = v.inode_cache_stats();
    assert_eq!(after.dentry_walk_hits, before.dentry_walk_hits + 1);
    assert_eq!(
        after.inodes_read_back,
        before.inodes_read_back + 2,
        "{before:?} {after:?}"
    );
    v.unmount().unwrap();
}

/// A read back the device fails is EIO to the operation (not a corruption), the
/// inode is not taken for gone, and the same operation works once the device reads
/// again; a mount
/// whose tree reads fail is EIO too, and loses nothing of the journal it could not
/// replay.
#[test]
fn a_failed_read_back_is_eio_and_harms_nothing() {
    let q = queue("sim:ssd,size=256M");
    let mk = MkfsOptions {
        format: Some(5),
        ..Default::default()
    };
    let sb = Volume::mkfs(&q, &mk).unwrap();
    let v = mount(&q);
    let paths = populate(&v, 100);
    let before = look_all(&v, &paths);
    v.checkpoint().unwrap();
    // Committed, not checkpointed: only the journal has it.
    let f = v.create("/a/late").unwrap();
    f.write_at(0, b"late").unwrap();
    f.fsync().unwrap();
    f.close().unwrap();
    common::sim(&q).power_cut(false);
    v.crash();
    common::sim(&q).reboot();
    // The tree's nodes live in the data area, after the journal and checkpoint slots.
    let tree_sectors = sb.data_start * 8..u64::MAX / 2;
    common::sim(&q).inject_eio(tree_sectors.clone(), true, false);
    match Volume::mount(q.clone(), quiet()) {
        Err(FsError::Io) => {}
        other => panic!("mount over failing tree reads: {:?}", other.err()),
    }
    common::sim(&q).clear_faults();
    let v = mount(&q);
    // A fresh mount has read none of /b's files.
    common::sim(&q).inject_eio(tree_sectors, true, false);
    assert_eq!(v.stat("/b/f50"), Err(FsError::Io));
    assert_eq!(v.stat("/b/f50"), Err(FsError::Io), "not remembered as gone");
    common::sim(&q).clear_faults();
    assert_eq!(look_all(&v, &paths), before);
    assert_eq!(v.stat("/a/late").unwrap().size, 4);
    check_unmount_fsck(v);
}

/// Inodes changed since the last checkpoint cannot leave memory, so past `inode_cache`
/// of them (and past `META_FULL_MIN`, 1024, however small the cache) a commit is a
/// checkpoint: with no fsync and a journal far from full, a create-heavy run's inodes
/// in memory stay bounded. Below it, a commit stays a journal write, and without the
/// rule every created inode stays in memory.
#[test]
fn changes_past_the_inode_cache_make_the_next_commit_a_checkpoint() {
    for limit in [64usize, 1_000_000] {
        let q = mkfs5("sim:ssd,size=1G");
        let v = mount_with_cache(&q, limit);
        v.mkdir("/d", 0o755).unwrap();
        let start = v.journal_stats().checkpoints;
        // 40 changes (files) and a commit: under the limit either way.
        for i in 0..40 {
            v.create(&format!("/d/a{i}")).unwrap().close().unwrap();
        }
        v.commit_now().unwrap();
        assert_eq!(v.journal_stats().checkpoints, start, "limit {limit}");
        if limit == 64 {
            // Past the limit, the committer is woken: no commit interval (an hour
            // here), no fsync, and a checkpoint all the same.
            for i in 0..1100 {
                v.create(&format!("/d/b{i}")).unwrap().close().unwrap();
            }
            let t0 = std::time::Instant::now();
            while v.journal_stats().checkpoints == start {
                assert!(t0.elapsed().as_secs() < 20, "the committer was not woken");
                std::thread::yield_now();
            }
        }
        // 10000 more, a commit every 200 (the committer, woken past the limit, may
        // take more checkpoints of its own).
        let mut most = 0;
        for i in 0..10_000 {
            v.create(&format!("/d/f{i}")).unwrap().close().unwrap();
            if i % 200 == 199 {
                v.commit_now().unwrap();
            }
            most = most.max(v.inode_cache_stats().inodes_resident);
        }
        let taken = v.journal_stats().checkpoints - start;
        if limit == 64 {
            // A checkpoint every 1024 changes, plus those made while it is written:
            // commits (this loop's `commit_now`) go on meanwhile, so a checkpoint slowed
            // by a busy machine covers more (8 to 10 on an idle one, 5 seen under load).
            assert!(taken >= 4, "a checkpoint every 1024 changes or so: {taken}");
            // Changes since the last checkpoint, those of the one being written, and
            // clean ones the prunes have not reached yet: bounded, not the 11140 made
            // (at most 3,000 on an idle machine, 4,400 seen with both CPUs busy).
            assert!(most <= 6000, "{most} inodes in memory at once");
        } else {
            assert_eq!(taken, 0, "the journal is far from full: no checkpoint");
            assert!(most > 10_000, "every inode stays: {most}");
        }
        check_unmount_fsck(v);
    }
}

/// Checkpoint, then open and close a file elsewhere: the prune at that close sends the
/// directories' clean entries cold (`fs::dir`).
fn shrink_dirs(v: &Volume) {
    v.checkpoint().unwrap();
    v.create("/churn").unwrap().close().unwrap();
}

/// Every entry of directory `ino`, walked a page of `max` at a time from cookie 0.
fn walk_pages(v: &Volume, ino: u64, max: usize) -> Vec<(String, u64)> {
    let (mut out, mut cookie) = (Vec::new(), 0);
    loop {
        let page = v.readdir_page(ino, cookie, max).unwrap();
        let Some(last) = page.last() else {
            return out;
        };
        cookie = last.cookie;
        out.extend(
            page.iter()
                .map(|e| (String::from_utf8(e.name.clone()).unwrap(), e.ino)),
        );
    }
}

/// A directory keeps in memory only the hashes of entries unchanged since the durable
/// checkpoint (issue 16: memory follows what is in use): after a checkpoint its names
/// leave memory, a create of a new name reads nothing back (its hash is not among the
/// directory's), and a lookup, a create of an existing name, a page of readdir, an
/// unlink, a rename and an rmdir each read back only the groups they need, and find
/// every entry as it was, through a remount too.
#[test]
fn a_directorys_clean_entries_leave_memory_and_come_back_on_use() {
    let q = mkfs5("sim:ssd,size=256M");
    // No inode leaves memory: only entries do.
    let v = mount_with_cache(&q, 1 << 20);
    v.mkdir("/d", 0o755).unwrap();
    v.mkdir("/d/sub", 0o755).unwrap();
    let n = 2000u64;
    for i in 0..n {
        v.create(&format!("/d/f{i}")).unwrap().close().unwrap();
    }
    let listing = |v: &Volume| -> BTreeMap<String, (u64, InodeKind)> {
        v.readdir("/d")
            .unwrap()
            .into_iter()
            .map(|e| (e.name, (e.ino, e.kind)))
            .collect()
    };
    let before = listing(&v);
    assert_eq!(before.len() as u64, n + 1);
    let s0 = v.inode_cache_stats();
    assert!(s0.dirents_resident > n, "{s0:?}");
    shrink_dirs(&v);
    let s = v.inode_cache_stats();
    assert!(s.dirents_dropped > n, "{s:?}");
    // /churn alone was changed since the checkpoint.
    assert_eq!(s.dirents_resident, 1, "{s:?}");

    // A lookup reads back the one group it needs.
    let ino17 = v.stat("/d/f17").unwrap().ino;
    assert_eq!(ino17, before["f17"].0);
    let s1 = v.inode_cache_stats();
    let read = |a: &wbstack::fs::InodeCacheStats, b: &wbstack::fs::InodeCacheStats| {
        b.dirent_groups_read_back - a.dirent_groups_read_back
    };
    assert!((1..=2).contains(&read(&s, &s1)), "{s:?} -> {s1:?}");
    // A new name reads nothing back: its hash alone says it is free.
    v.create("/d/new").unwrap().close().unwrap();
    let s2 = v.inode_cache_stats();
    assert_eq!(read(&s1, &s2), 0, "{s1:?} -> {s2:?}");
    // An existing name is found, not made twice.
    assert!(matches!(v.mkdir("/d/f5", 0o755), Err(FsError::Exists(_))));

    // readdir, whole and by pages, lists every entry exactly once.
    shrink_dirs(&v);
    let mut want = before.clone();
    let new_ino = v.stat("/d/new").unwrap().ino;
    want.insert("new".into(), (new_ino, InodeKind::File));
    let d_ino = v.stat("/d").unwrap().ino;
    shrink_dirs(&v);
    let s3 = v.inode_cache_stats();
    let mut paged = walk_pages(&v, d_ino, 64);
    let s4 = v.inode_cache_stats();
    assert!(read(&s3, &s4) > 0, "the pages read their groups back");
    paged.sort();
    let want_pairs: Vec<(String, u64)> = want.iter().map(|(k, v)| (k.clone(), v.0)).collect();
    assert_eq!(paged, want_pairs);
    shrink_dirs(&v);
    assert_eq!(listing(&v), want);

    // Unlink, rename over an existing name, and rmdir of entries that are cold.
    shrink_dirs(&v);
    v.unlink("/d/f100").unwrap();
    assert!(matches!(v.stat("/d/f100"), Err(FsError::NotFound(_))));
    v.rename("/d/f200", "/d/f300").unwrap();
    assert_eq!(v.stat("/d/f300").unwrap().ino, before["f200"].0);
    assert!(matches!(v.stat("/d/f200"), Err(FsError::NotFound(_))));
    assert!(matches!(v.rmdir("/d"), Err(FsError::NotEmpty(_))));
    v.rmdir("/d/sub").unwrap();
    for name in ["f100", "f200", "sub"] {
        want.remove(name);
    }
    want.insert("f300".into(), before["f200"]);
    shrink_dirs(&v);
    assert_eq!(listing(&v), want);

    // Through a remount: the directory comes back with hashes alone, and every entry
    // is found as it was.
    shrink_dirs(&v);
    v.unmount().unwrap();
    let v = mount_with_cache(&q, 1 << 20);
    assert_eq!(v.stat("/d/f17").unwrap().ino, ino17);
    let s = v.inode_cache_stats();
    assert_eq!(
        s.dirents_resident, 2,
        "the groups walked: d in /, f17 in /d: {s:?}"
    );
    assert_eq!(listing(&v), want);
    check_unmount_fsck(v);
}

/// A shrink pass goes a batch of directories per open or close (`Inodes::shrink_dirs`),
/// not all of them in one hold of `st`: with 601 directories, the open and close right
/// after a checkpoint leave some entries resident, and a few more operations finish the
/// pass; every entry is still found.
/// A batch of a shrink pass also ends once it sent 8,192 entries cold: of five
/// directories of 5,000 entries, the open and close right after a checkpoint shrink
/// four at most, so 5,000 entries at least stay resident until the next operations.
#[test]
fn a_shrink_pass_batch_ends_at_its_entries() {
    let q = mkfs5("sim:ssd,size=256M");
    let v = mount_with_cache(&q, 1 << 20);
    for d in 0..5 {
        v.mkdir(&format!("/d{d}"), 0o755).unwrap();
        for i in 0..5000 {
            v.create(&format!("/d{d}/f{i}")).unwrap().close().unwrap();
        }
    }
    shrink_dirs(&v);
    let first = v.inode_cache_stats();
    assert!(first.dirents_resident >= 5000, "{first:?}");
    for _ in 0..3 {
        v.create("/churn").unwrap().close().unwrap();
    }
    let done = v.inode_cache_stats();
    assert_eq!(done.dirents_resident, 1, "{done:?}");
    assert!(v.stat("/d4/f4999").is_ok());
    check_unmount_fsck(v);
}

#[test]
fn a_shrink_pass_goes_a_batch_of_directories_per_operation() {
    let q = mkfs5("sim:ssd,size=256M");
    let v = mount_with_cache(&q, 1 << 20);
    let n = 600;
    for i in 0..n {
        v.mkdir(&format!("/d{i}"), 0o755).unwrap();
        v.create(&format!("/d{i}/f")).unwrap().close().unwrap();
    }
    shrink_dirs(&v);
    let first = v.inode_cache_stats();
    // At most two batches of 256 of the 601 directories: 89 of them at least, each
    // with its entry, are left (the root's 601 too if it is among them).
    assert!(first.dirents_resident >= 89, "{first:?}");
    for _ in 0..2 {
        v.create("/churn").unwrap().close().unwrap();
    }
    let done = v.inode_cache_stats();
    // /churn alone was changed since the checkpoint.
    assert_eq!(done.dirents_resident, 1, "{done:?}");
    for i in 0..n {
        assert!(v.stat(&format!("/d{i}/f")).is_ok(), "/d{i}/f");
    }
    check_unmount_fsck(v);
}

/// A directory of more groups than `metatree::LISTED_MAX` comes back from the tree
/// unlisted (`fs::dir`): a lookup, a create, an unlink and a rename in it each read
/// back their own names' groups, a few tree nodes, not the directory's hundreds of
/// leaves; a name unlinked stays gone though the durable root still holds it; its
/// link count comes from its own record; rmdir of it while it has entries is refused,
/// readdir lists every entry, and emptied it is removed; the volume checks clean.
#[test]
fn a_large_directory_comes_back_unlisted_and_a_lookup_reads_only_its_name() {
    let q = mkfs5("sim:ssd,size=256M");
    let v = mount_with_cache(&q, 0);
    // Ten times the most a directory is listed with: read whole, its entries would
    // take some 400 tree leaves.
    let n = wbstack::fs::metatree::LISTED_MAX * 10;
    v.mkdir("/big", 0o755).unwrap();
    for i in 0..n {
        v.create(&format!("/big/f{i}")).unwrap().close().unwrap();
    }
    v.mkdir("/big/sub", 0o755).unwrap();
    v.unmount().unwrap();

    let v = mount_with_cache(&q, 0);
    let before = v.inode_cache_stats();
    assert_eq!(v.stat("/big/f7").unwrap().kind, InodeKind::File);
    let after = v.inode_cache_stats();
    // The root's group holding "big" (the root is small: listed), and f7's.
    assert_eq!(
        after.dirent_groups_read_back,
        before.dirent_groups_read_back + 2,
        "{before:?} {after:?}"
    );
    // The directory's own read back stops past `LISTED_MAX` groups (about 40 leaves
    // of these short names); the name's group is one descent of the tree.
    let nodes = after.node_cache_misses - before.node_cache_misses;
    assert!(nodes < 120, "{nodes} tree nodes read for one lookup");
    // rmdir of it, with nothing of it resident: its first group answers, not a
    // listing of every key (some 400 leaves).
    let v = {
        v.unmount().unwrap();
        mount_with_cache(&q, 0)
    };
    let before = v.inode_cache_stats();
    assert!(matches!(v.rmdir("/big"), Err(FsError::NotEmpty(_))));
    let after = v.inode_cache_stats();
    let nodes = after.node_cache_misses - before.node_cache_misses;
    assert!(nodes < 120, "{nodes} tree nodes read for an rmdir refused");
    assert_eq!(v.stat("/big").unwrap().nlink, 3, "., .. and sub's ..");

    let f5 = v.stat("/big/f5").unwrap().ino;
    let before = v.inode_cache_stats();
    v.create("/big/new").unwrap().close().unwrap();
    v.unlink("/big/f3").unwrap();
    v.rename("/big/f5", "/big/f6").unwrap();
    assert!(matches!(v.stat("/big/f3"), Err(FsError::NotFound(_))));
    assert!(matches!(v.stat("/big/f5"), Err(FsError::NotFound(_))));
    assert_eq!(v.stat("/big/new").unwrap().kind, InodeKind::File);
    let after = v.inode_cache_stats();
    // "new" read and found absent, f3, f6, and f5 again if a shrink sent its clean
    // group cold between two operations (one passes over a directory an operation
    // holds, `Meta::hold_dirs_missed`): one read per name, nothing else.
    let read = after.dirent_groups_read_back - before.dirent_groups_read_back;
    assert!((3..=4).contains(&read), "{before:?} {after:?}");
    assert!(
        after.node_cache_misses - before.node_cache_misses < 40,
        "{before:?} {after:?}"
    );
    // Committed, not checkpointed, then the power goes: replay applies the changes to
    // the directory read back unlisted at mount.
    v.commit_now().unwrap();
    common::sim(&q).power_cut(false);
    v.crash();
    common::sim(&q).reboot();
    let v = mount_with_cache(&q, 0);
    assert!(matches!(v.stat("/big/f3"), Err(FsError::NotFound(_))));
    assert!(matches!(v.stat("/big/f5"), Err(FsError::NotFound(_))));
    assert_eq!(v.stat("/big/f6").unwrap().ino, f5);
    assert_eq!(v.stat("/big/new").unwrap().kind, InodeKind::File);
    // A page of readdir reads its own groups, a few leaves, not the directory's
    // hundreds (the listing a count needs); the next resumes after it.
    let big = v.stat("/big").unwrap().ino;
    let before = v.inode_cache_stats();
    let page = v.readdir_page(big, 0, 512).unwrap();
    let after = v.inode_cache_stats();
    assert_eq!(page.len(), 512);
    let groups = after.dirent_groups_read_back - before.dirent_groups_read_back;
    assert!(
        (505..=512).contains(&groups),
        "{groups} groups read for a page"
    );
    let nodes = after.node_cache_misses - before.node_cache_misses;
    assert!(nodes < 40, "{nodes} tree nodes read for a page of 512");
    let page2 = v.readdir_page(big, page[511].cookie, 512).unwrap();
    assert!(page2[0].cookie > page[511].cookie && page2.len() == 512);
    // Durable now, then dropped: the unlinked name must not come back from the tree.
    v.checkpoint().unwrap();
    v.create("/churn").unwrap().close().unwrap();
    assert!(matches!(v.stat("/big/f3"), Err(FsError::NotFound(_))));

    assert!(matches!(v.rmdir("/big"), Err(FsError::NotEmpty(_))));
    let names = v.readdir("/big").unwrap();
    assert_eq!(names.len(), n, "{n} files and sub, less f3 and f5, and new");
    for e in &names {
        let p = format!("/big/{}", e.name);
        match e.kind {
            InodeKind::Dir => v.rmdir(&p).unwrap(),
            _ => v.unlink(&p).unwrap(),
        }
    }
    v.rmdir("/big").unwrap();
    check_unmount_fsck(v);
}

/// A walk of an unlisted directory (`dir_listed_max=0`: every directory comes back
/// without its list of names) page by page, as the FUSE mount walks, with names of
/// its own created and removed between the pages and checkpoints between them (each
/// lets clean groups leave memory, and with them the ranges a page knew whole): every
/// entry present throughout is returned exactly once, no stranger appears, each page
/// reads a bounded number of groups, and the volume checks clean.
#[test]
fn an_unlisted_directory_walked_under_changes_returns_each_lasting_entry_once() {
    let q = mkfs5("sim:ssd,size=256M");
    let v = mount_with_cache(&q, 0);
    let n = 3000usize;
    v.mkdir("/d", 0o755).unwrap();
    for i in 0..n {
        v.create(&format!("/d/f{i}")).unwrap().close().unwrap();
    }
    v.unmount().unwrap();

    let mut o: MountOptions = quiet();
    o.inode_cache = 0;
    o.dir_listed_max = 0;
    let v = Volume::mount(q.clone(), o).unwrap();
    assert_eq!(v.tunable("dir_listed_max").unwrap(), "0");
    assert!(v.set_tunable("dir_listed_max", "some").is_err());
    v.set_tunable("dir_listed_max", "4096").unwrap();
    assert_eq!(v.tunable("dir_listed_max").unwrap(), "4096");
    v.set_tunable("dir_listed_max", "0").unwrap();
    let d = v.stat("/d").unwrap().ino;
    let mut seen = vec![false; n];
    let (mut pages, mut churned, mut most_read) = (0u64, 0u64, 0u64);
    let mut cookie = 0;
    loop {
        let before = v.inode_cache_stats().dirent_groups_read_back;
        let p = v.readdir_page(d, cookie, 64).unwrap();
        let read = v.inode_cache_stats().dirent_groups_read_back - before;
        most_read = most_read.max(read);
        let Some(last) = p.last() else { break };
        assert!(last.cookie > cookie, "a page that does not move on");
        cookie = last.cookie;
        pages += 1;
        for e in &p {
            if let Some(i) = e.name.strip_prefix(b"f") {
                let i: usize = std::str::from_utf8(i).unwrap().parse().unwrap();
                assert!(!seen[i], "f{i} returned twice");
                seen[i] = true;
            } else {
                assert!(e.name.starts_with(b"churn-"), "a stranger: {:?}", e.name);
            }
        }
        // Names of its own come and go between the pages, and every third page a
        // checkpoint makes the walk's groups clean, so they may leave memory.
        for _ in 0..8 {
            let p = format!("/d/churn-{}", churned % 32);
            if churned % 64 < 32 {
                v.create(&p).unwrap().close().unwrap();
            } else {
                v.unlink(&p).unwrap();
            }
            churned += 1;
        }
        if pages % 3 == 0 {
            v.checkpoint().unwrap();
            // A lookup and a create after a shrink: their names' groups are read back
            // alone, whatever the ranges pages read before.
            assert_eq!(
                v.stat(&format!("/d/f{}", pages % 7)).unwrap().kind,
                InodeKind::File
            );
        }
    }
    let missed: Vec<usize> = (0..n).filter(|&i| !seen[i]).collect();
    assert!(missed.is_empty(), "never returned: {missed:?}");
    assert!(pages >= (n / 64) as u64, "{pages} pages");
    // A page of 64, or twice the names known absent in the range before it (the
    // churn's removals, at most 32 at once: `Dir::unlisted_page`).
    assert!(
        most_read <= 2 * 64 + 1,
        "a page read {most_read} groups back"
    );
    check_unmount_fsck(v);
}

/// A library page of more entries than a shrink waits for (`SHRINK_AFTER_GROUPS`,
/// 16,384 groups read back) of an unlisted directory: its read makes a shrink due, and
/// another thread's close runs it. The directory stays held from the read to the
/// page's rerun (`Meta::hold_dirs_missed`): the page comes back whole each round, its groups
/// read once, where an undone read was read again, up to `GROUP_REREADS` times, and
/// then failed.
#[test]
fn a_page_larger_than_a_shrink_survives_concurrent_shrinks() {
    let q = mkfs5("sim:ssd,size=256M");
    let v = mount_with_cache(&q, 0);
    let n = wbstack::fs::metatree::LISTED_MAX * 5;
    v.mkdir("/big", 0o755).unwrap();
    v.mkdir("/churn", 0o755).unwrap();
    for i in 0..n {
        v.create(&format!("/big/f{i}")).unwrap().close().unwrap();
    }
    v.unmount().unwrap();
    let v = mount_with_cache(&q, 0);
    let big = v.stat("/big").unwrap().ino;
    let churn = || v.create("/churn/f").unwrap().close().unwrap();
    while_looping(&[&churn], |_| {
        let mut shrunk = v.inode_cache_stats().dirents_dropped;
        for round in 0..6 {
            let before = v.inode_cache_stats().dirent_groups_read_back;
            let page = v
                .readdir_page(big, 0, n)
                .unwrap_or_else(|e| panic!("round {round}: {e}"));
            assert_eq!(page.len(), n, "round {round}");
            // Each group once (the churn's own directory a few): none read twice.
            let read = v.inode_cache_stats().dirent_groups_read_back - before;
            assert!(read < n as u64 + 64, "round {round}: {read} groups read");
            // The churn's closes send the page's groups cold again before the next.
            let t0 = std::time::Instant::now();
            loop {
                let now = v.inode_cache_stats().dirents_dropped;
                if now > shrunk {
                    shrunk = now;
                    break;
                }
                assert!(t0.elapsed().as_secs() < 30, "round {round}: no shrink");
                std::thread::yield_now();
            }
        }
    });
    v.unmount().unwrap();
}
