//! The filesystem through its public API: namespace, data, delayed allocation, the
//! journal across remounts and crashes, ENOSPC, bad images.

mod common;

use common::{fresh_with, queue, quiet, sim, writeback_held_in_device};
use std::sync::Arc;
use wbstack::block::RequestQueue;
use wbstack::fs::fsck::fsck;
use wbstack::fs::{FsError, InodeKind, MkfsOptions, OpenOptions, Volume};

fn fresh(spec: &str) -> (Arc<RequestQueue>, Volume) {
    fresh_with(spec, quiet())
}

fn assert_clean(q: &Arc<RequestQueue>) {
    let r = fsck(q);
    assert!(r.is_clean(), "fsck: {:#?}", r);
}

fn write_file(v: &Volume, path: &str, data: &[u8]) {
    let f = v.create(path).unwrap();
    assert_eq!(f.write_at(0, data).unwrap(), data.len());
    f.close().unwrap();
}

fn read_file(v: &Volume, path: &str) -> Vec<u8> {
    let f = v.open(path, &OpenOptions::read()).unwrap();
    let mut buf = vec![0u8; f.size() as usize];
    assert_eq!(f.read_at(0, &mut buf).unwrap(), buf.len());
    buf
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(31).wrapping_add(seed * 7919) as u8)
        .collect()
}

#[test]
fn files_and_directories_survive_unmount() {
    let (q, v) = fresh("sim:ssd,size=256M");
    v.mkdir("/a", 0o755).unwrap();
    v.mkdir_all("/a/b/c", 0o700).unwrap();
    write_file(&v, "/a/b/c/f1", &pattern(1, 10_000));
    write_file(&v, "/a/f2", &pattern(2, 4096 * 300 + 5));
    v.symlink("b/c/f1", "/a/link").unwrap();
    v.link("/a/f2", "/hard").unwrap();
    assert_eq!(v.stat("/a/f2").unwrap().nlink, 2);
    assert_eq!(v.stat("/a").unwrap().nlink, 3); // ., its entry, b's ..
    v.unmount().unwrap();
    assert_clean(&q);

    let v = Volume::mount(q.clone(), quiet()).unwrap();
    assert_eq!(read_file(&v, "/a/b/c/f1"), pattern(1, 10_000));
    assert_eq!(read_file(&v, "/hard"), pattern(2, 4096 * 300 + 5));
    assert_eq!(read_file(&v, "/a/link"), pattern(1, 10_000));
    assert_eq!(v.readlink("/a/link").unwrap(), "b/c/f1");
    assert_eq!(v.lstat("/a/link").unwrap().kind, InodeKind::Symlink);
    let names: Vec<String> = v
        .readdir("/a")
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, ["b", "f2", "link"]);
    v.unmount().unwrap();
    assert_clean(&q);
}

#[test]
fn namespace_errors_map_to_errno() {
    let (_q, v) = fresh("sim:ssd,size=64M");
    v.mkdir("/d", 0o755).unwrap();
    write_file(&v, "/d/f", b"x");
    let e = |r: Result<(), FsError>| r.unwrap_err().errno();
    assert_eq!(e(v.mkdir("/d", 0o755).map(|_| ())), libc::EEXIST);
    assert_eq!(e(v.rmdir("/d")), libc::ENOTEMPTY);
    assert_eq!(e(v.unlink("/d")), libc::EISDIR);
    assert_eq!(e(v.rmdir("/d/f")), libc::ENOTDIR);
    assert_eq!(e(v.unlink("/nope")), libc::ENOENT);
    assert_eq!(e(v.mkdir("/d/f/x", 0o755).map(|_| ())), libc::ENOTDIR);
    assert_eq!(e(v.rename("/", "/x")), libc::EINVAL);
    assert_eq!(e(v.rename("/d", "/d/sub")), libc::EINVAL);
    assert_eq!(e(v.link("/d", "/d2")), libc::EPERM);
    let long = "/".to_string() + &"n".repeat(256);
    assert_eq!(e(v.mkdir(&long, 0o755).map(|_| ())), libc::ENAMETOOLONG);
    v.symlink("/loop2", "/loop1").unwrap();
    v.symlink("/loop1", "/loop2").unwrap();
    assert_eq!(e(v.stat("/loop1").map(|_| ())), libc::ELOOP);
    let f = v.open("/d/f", &OpenOptions::read()).unwrap();
    assert_eq!(f.write_at(0, b"y").unwrap_err().errno(), libc::EBADF);
    assert_eq!(
        v.open(
            "/d/f",
            &OpenOptions {
                create: true,
                exclusive: true,
                ..OpenOptions::create()
            }
        )
        .err()
        .unwrap()
        .errno(),
        libc::EEXIST
    );
    assert_eq!(
        v.open("/d", &OpenOptions::read()).err().unwrap().errno(),
        libc::EISDIR
    );
    assert!(v.check().is_empty(), "{:?}", v.check());
}

#[test]
fn rename_over_existing_and_unlink_of_open_file() {
    let (q, v) = fresh("sim:ssd,size=64M");
    write_file(&v, "/old", &pattern(3, 9000));
    write_file(&v, "/new", &pattern(4, 5000));
    v.rename("/new", "/old").unwrap();
    assert_eq!(read_file(&v, "/old"), pattern(4, 5000));
    assert_eq!(v.stat("/new").unwrap_err().errno(), libc::ENOENT);
    // An open file keeps its data after its last name is gone.
    let f = v.open("/old", &OpenOptions::read_write()).unwrap();
    v.unlink("/old").unwrap();
    let mut buf = vec![0u8; 5000];
    f.read_at(0, &mut buf).unwrap();
    assert_eq!(buf, pattern(4, 5000));
    f.write_at(5000, b"more").unwrap();
    v.sync().unwrap();
    let used = v.statfs().free;
    f.close().unwrap();
    v.sync().unwrap();
    assert!(
        v.statfs().free > used,
        "blocks of the deleted file are freed"
    );
    assert_eq!(v.statfs().files, 1);
    v.unmount().unwrap();
    assert_clean(&q);
}

#[test]
fn delayed_allocation_reserves_at_write_and_allocates_adjacent_extents() {
    let (q, v) = fresh("sim:ssd,size=64M");
    let free0 = v.statfs();
    for i in 0..20 {
        write_file(&v, &format!("/f{i:02}"), &pattern(i, 4096));
    }
    // Nothing allocated yet, but the space is promised: used, to statfs, as ext4's
    // delayed allocation is.
    let s = v.statfs();
    assert_eq!(s.free, free0.free - 20);
    assert_eq!(s.available, free0.available - 20);
    assert!(v.fiemap("/f00").unwrap().is_empty());
    assert_eq!(v.stat("/f00").unwrap().blocks, 8);
    let before = q.diskstats();
    v.sync().unwrap();
    let d = q.diskstats().delta(&before);
    // One writeback pass: consecutive inodes get consecutive blocks, and the plug
    // merges their 20 bios into one data write (plus the journal commit).
    let first = v.fiemap("/f00").unwrap()[0].1;
    for i in 0..20u64 {
        assert_eq!(
            v.fiemap(&format!("/f{i:02}")).unwrap(),
            vec![(0, first + i, 1)]
        );
    }
    assert!(
        d.writes() <= 3,
        "{} writes for 20 adjacent files",
        d.writes()
    );
    assert_eq!(v.statfs().free, free0.free - 20);
    v.unmount().unwrap();
    assert_clean(&q);
}

#[test]
fn enospc_fails_the_write_and_loses_nothing_fsynced() {
    let (q, v) = fresh("sim:ssd,size=8M");
    let keep = pattern(9, 64 * 1024);
    let f = v.create("/keep").unwrap();
    f.write_at(0, &keep).unwrap();
    f.fsync().unwrap();
    f.close().unwrap();
    let g = v.create("/fill").unwrap();
    let chunk = vec![0xabu8; 256 * 1024];
    let mut off = 0u64;
    let err = loop {
        match g.write_at(off, &chunk) {
            Ok(_) => off += chunk.len() as u64,
            Err(e) => break e,
        }
        assert!(off < 64 << 20, "the device never filled");
    };
    assert_eq!(err.errno(), libc::ENOSPC);
    assert!(v.statfs().available < 64);
    // Writeback of what was accepted cannot fail for lack of space.
    g.fsync().unwrap();
    assert_eq!(g.stat().unwrap().size, off);
    g.close().unwrap();
    v.unmount().unwrap();
    assert_clean(&q);
    let v = Volume::mount(q.clone(), quiet()).unwrap();
    assert_eq!(read_file(&v, "/keep"), keep);
    assert_eq!(v.stat("/fill").unwrap().size, off);
    v.unlink("/fill").unwrap();
    v.unmount().unwrap();
    assert_clean(&q);
}

/// `/f{n}`: 100 bytes of its pattern, fsynced (one commit).
fn fsynced_file(v: &Volume, n: u64) {
    let f = v.create(&format!("/f{n}")).unwrap();
    f.write_at(0, &pattern(n, 100)).unwrap();
    f.fsync().unwrap();
    f.close().unwrap();
}

/// Cut the power, remount, and find `/f0` .. `/f{n-1}` as `fsynced_file` wrote them:
/// the newest checkpoint plus the journal after it must hold everything.
fn crash_and_find_fsynced_files(q: &Arc<RequestQueue>, v: Volume, n: u64) {
    sim(q).power_cut(false);
    v.crash();
    sim(q).reboot();
    assert_clean(q);
    let v = Volume::mount(q.clone(), quiet()).unwrap();
    for i in 0..n {
        assert_eq!(
            read_file(&v, &format!("/f{i}")),
            pattern(i, 100),
            "file {i} of {n}"
        );
    }
    v.unmount().unwrap();
    assert_clean(q);
}

#[test]
fn journal_wraps_through_checkpoints_and_replays() {
    let (q, v) = fresh("sim:ssd,size=64M");
    let jblocks = v.superblock().journal_blocks;
    let mut n = 0;
    // Enough fsynced creates to fill the journal several times over.
    while v.journal_stats().checkpoints < 3 {
        fsynced_file(&v, n);
        n += 1;
        assert!(n < 100 * jblocks, "no checkpoint after {n} commits");
    }
    let js = v.journal_stats();
    assert!(js.commits > jblocks / 2, "{js:?}");
    crash_and_find_fsynced_files(&q, v, n);
}

/// Background checkpoints let the journal run on as a ring: transactions wrap to its
/// start while the tail follows the newest durable checkpoint. A crash at any point
/// past the wrap (with a checkpoint in flight or not) keeps every fsynced file.
#[test]
fn journal_ring_wraps_behind_background_checkpoints_and_replays() {
    for extra in [0u64, 5, 29, 61] {
        let (q, v) = fresh("sim:ssd,size=64M");
        let jblocks = v.superblock().journal_blocks;
        let mut n = 0;
        let mut wrapped_at = None;
        loop {
            fsynced_file(&v, n);
            n += 1;
            assert!(n < 100 * jblocks, "no wrap after {n} commits");
            let js = v.journal_stats();
            if js.journal_wraps >= 2 && wrapped_at.is_none() {
                wrapped_at = Some(n);
            }
            if wrapped_at.is_some_and(|w| n >= w + extra) {
                break;
            }
        }
        let js = v.journal_stats();
        // Every checkpoint went in the background, none in place of a commit.
        assert!(js.checkpoints_background >= 2, "{js:?}");
        assert_eq!(js.checkpoints, js.checkpoints_background, "{js:?}");
        crash_and_find_fsynced_files(&q, v, n);
    }
}

#[test]
fn crash_keeps_every_fsynced_file_and_exposes_no_garbage() {
    for seed in 1..=4u64 {
        let (q, v) = fresh(&format!("sim:ssd,size=64M,seed={seed}"));
        for i in 0..40u64 {
            write_file(
                &v,
                &format!("/synced{i}"),
                &pattern(i, 3000 + 1000 * i as usize),
            );
        }
        v.sync().unwrap();
        // Unsynced work in flight when the power goes: new files, appends, renames.
        for i in 0..40u64 {
            write_file(&v, &format!("/late{i}"), &pattern(100 + i, 8192));
        }
        v.rename("/synced0", "/renamed0").unwrap();
        let h = v.bdi().start_writeback();
        sim(&q).power_cut(true);
        let _ = h.wait();
        v.crash();
        sim(&q).reboot();
        assert_clean(&q);
        let v = Volume::mount(q.clone(), quiet()).unwrap();
        for i in 1..40u64 {
            assert_eq!(
                read_file(&v, &format!("/synced{i}")),
                pattern(i, 3000 + 1000 * i as usize),
                "seed {seed} file {i}"
            );
        }
        // The rename is either done or not; the data is intact either way.
        let p = if v.stat("/renamed0").is_ok() {
            "/renamed0"
        } else {
            "/synced0"
        };
        assert_eq!(read_file(&v, p), pattern(0, 3000));
        // A late file is absent, empty, or holds exactly its data: never other bytes.
        for i in 0..40u64 {
            if let Ok(st) = v.stat(&format!("/late{i}")) {
                let got = read_file(&v, &format!("/late{i}"));
                let want = pattern(100 + i, 8192);
                assert!(
                    got.is_empty() || got == want[..got.len()],
                    "seed {seed}: /late{i} ({} bytes) holds foreign data",
                    st.size
                );
            }
        }
        v.unmount().unwrap();
        assert_clean(&q);
    }
}

#[test]
fn orphans_are_deleted_at_mount() {
    let (q, v) = fresh("sim:ssd,size=64M");
    write_file(&v, "/victim", &pattern(5, 40_000));
    v.sync().unwrap();
    let free_with = v.statfs().free;
    let f = v.open("/victim", &OpenOptions::read()).unwrap();
    v.unlink("/victim").unwrap();
    v.sync().unwrap(); // the unlink (and the orphan record) are durable
    sim(&q).power_cut(false);
    std::mem::forget(f); // the process died with the file open
    v.crash();
    sim(&q).reboot();
    let r = fsck(&q);
    assert!(r.is_clean(), "{r:#?}");
    assert_eq!(r.orphans, 1);
    let v = Volume::mount(q.clone(), quiet()).unwrap();
    assert_eq!(v.statfs().free, free_with + 10);
    assert_eq!(v.statfs().files, 1);
    v.unmount().unwrap();
    let r = fsck(&q);
    assert!(r.is_clean() && r.orphans == 0, "{r:#?}");
}

#[test]
fn extents_are_journaled_only_after_their_data_is_written() {
    let (q, v) = fresh("sim:ssd,size=64M");
    write_file(&v, "/a", &pattern(1, 8192));
    let h = writeback_held_in_device(&q, &v);
    // Blocks are allocated and the write is in the device, but no metadata maps
    // them yet: any commit now would leave /a without them, never pointing at
    // blocks that may hold garbage.
    assert!(v.fiemap("/a").unwrap().is_empty());
    assert_eq!(
        v.stat("/a").unwrap().blocks,
        16,
        "counted as reserved meanwhile"
    );
    sim(&q).hold(false);
    h.wait().unwrap(); // a WB_SYNC_NONE work ends at submission, not completion
    v.sync().unwrap();
    assert_eq!(v.fiemap("/a").unwrap().len(), 1);
    sim(&q).power_cut(false);
    v.crash();
    sim(&q).reboot();
    assert_clean(&q);
    let v = Volume::mount(q.clone(), quiet()).unwrap();
    assert_eq!(read_file(&v, "/a"), pattern(1, 8192));
    v.unmount().unwrap();
}

#[test]
fn bad_images_are_refused_with_a_reason() {
    let q = queue("sim:ssd,size=16M");
    let e = Volume::mount(q.clone(), quiet()).err().unwrap().to_string();
    assert!(e.contains("not a wbstack image"), "{e}");
    Volume::mkfs(&q, &MkfsOptions::default()).unwrap();
    // Block 0 damaged: the copy in block 1 is used.
    q.write_sync(3 * 8, wbstack::buf::IoBuf::zeroed(4096), Default::default())
        .unwrap();
    let mut sb = q.read_sync(0, 4096).unwrap();
    sb.as_mut_slice()[20] ^= 0xff;
    q.write_sync(0, sb, Default::default()).unwrap();
    let v = Volume::mount(q.clone(), quiet()).unwrap();
    write_file(&v, "/x", b"still works");
    v.unmount().unwrap();
    let r = fsck(&q);
    assert!(r.is_clean(), "{r:#?}");
    assert!(r.notes.iter().any(|n| n.contains("block 0")), "{r:#?}");
    // Both copies gone.
    let mut sb = q.read_sync(8, 4096).unwrap();
    sb.as_mut_slice()[20] ^= 0xff;
    q.write_sync(8, sb, Default::default()).unwrap();
    let e = Volume::mount(q.clone(), quiet()).err().unwrap().to_string();
    assert!(e.contains("checksum") && e.contains("fsck"), "{e}");
    assert!(!fsck(&q).is_clean());
}

#[test]
fn an_empty_commit_leaves_no_gap_in_the_journal() {
    // A sync with nothing to journal still closes a transaction; the transactions
    // after it must replay (found by the crash tester: a skipped tid ended replay).
    let (q, v) = fresh("sim:ssd,size=64M");
    v.sync().unwrap();
    v.sync().unwrap();
    write_file(&v, "/after", b"durable");
    v.sync().unwrap();
    sim(&q).power_cut(false);
    v.crash();
    sim(&q).reboot();
    assert_clean(&q);
    let v = Volume::mount(q.clone(), quiet()).unwrap();
    assert_eq!(read_file(&v, "/after"), b"durable");
    v.unmount().unwrap();
}

/// Return once the truncation to `size` that thread `t` runs either waits for the
/// writes of the pages it cuts (the size is the new one, pages are still in flight)
/// or has gone through.
fn truncation_waits_or_is_done(
    m: &wbstack::mm::Mapping,
    size: u64,
    t: &std::thread::JoinHandle<()>,
) {
    let t0 = std::time::Instant::now();
    while !(t.is_finished() || (m.size() == size && m.nr_writeback() > 0)) {
        assert!(
            t0.elapsed().as_secs() < 10,
            "the truncation neither waited nor finished"
        );
        std::thread::yield_now();
    }
}

#[test]
fn a_write_truncated_away_in_flight_does_not_bring_the_size_back() {
    let (q, v) = fresh("sim:ssd,size=64M");
    let f = Arc::new(v.create("/f").unwrap());
    let m = v.mapping_of("/f").unwrap();
    f.write_at(0, &pattern(1, 16384)).unwrap();
    let h = writeback_held_in_device(&q, &v);
    // The truncation waits for the write it cuts: it is dead when it completes.
    let t = {
        let f = f.clone();
        std::thread::spawn(move || f.set_len(0).unwrap())
    };
    truncation_waits_or_is_done(&m, 0, &t);
    sim(&q).hold(false);
    t.join().unwrap();
    h.wait().unwrap();
    f.write_at(20000, b"x").unwrap(); // the file grows again, sparsely, in the cache
    let t0 = std::time::Instant::now();
    while v.cache().nr_writeback() > 0 || sim(&q).pending() > 0 {
        assert!(
            t0.elapsed().as_secs() < 10,
            "the held write never completed"
        );
        std::thread::yield_now();
    }
    // Commit whatever the completion logged, then crash before /f's new page is written.
    let g = v.create("/g").unwrap();
    g.fsync().unwrap();
    sim(&q).power_cut(false);
    drop((f, g));
    v.crash();
    sim(&q).reboot();
    assert_clean(&q);
    let v = Volume::mount(q.clone(), quiet()).unwrap();
    assert_eq!(v.stat("/f").unwrap().size, 0, "the truncation stands");
    v.unmount().unwrap();
}

#[test]
fn a_page_claimed_for_writeback_before_a_truncation_is_not_mapped_after_it() {
    // Writeback copies a page when it claims it and maps a block for it later, one
    // bio after another; wbt makes the flusher wait between the two. A truncation in
    // that gap, then an extension over the same offsets, used to let the old copy be
    // mapped and journaled inside the new size: stale data in a file that reads as
    // zeros there (found by crashtest as stale sectors).
    let (q, v) = fresh("sim:ssd,size=64M");
    let f = Arc::new(v.create("/f").unwrap());
    let m = v.mapping_of("/f").unwrap();
    let pages = 64u64;
    let end = 2 * pages * 4096;
    f.write_at(0, &pattern(1, end as usize)).unwrap();
    f.fsync().unwrap();
    // Every other page rewritten: one bio each (the blocks are not adjacent), many
    // more than wbt lets into the device at once.
    for i in 0..pages {
        f.write_at((2 * i + 1) * 4096, &pattern(i + 2, 4096))
            .unwrap();
    }
    let h = writeback_held_in_device(&q, &v);
    // The flusher claims the whole batch first, then maps and submits page by page
    // until wbt holds it: most pages are claimed and not mapped yet.
    assert_eq!(m.nr_writeback(), pages as usize);
    assert!(sim(&q).pending() < pages as usize);
    let t = {
        let f = f.clone();
        std::thread::spawn(move || {
            f.set_len(4096).unwrap();
            f.set_len(end).unwrap();
        })
    };
    truncation_waits_or_is_done(&m, 4096, &t);
    sim(&q).hold(false);
    t.join().unwrap();
    h.wait().unwrap();
    let t0 = std::time::Instant::now();
    while v.cache().nr_writeback() > 0 || sim(&q).pending() > 0 {
        assert!(
            t0.elapsed().as_secs() < 10,
            "the held writes never completed"
        );
        std::thread::yield_now();
    }
    assert_eq!(f.size(), end);
    v.sync().unwrap();
    sim(&q).power_cut(false);
    drop(f);
    v.crash();
    sim(&q).reboot();
    assert_clean(&q);
    let v = Volume::mount(q.clone(), quiet()).unwrap();
    let data = read_file(&v, "/f");
    assert_eq!(data.len() as u64, end);
    assert_eq!(data[..4096], pattern(1, 4096)[..]);
    let stale: Vec<usize> = data
        .chunks(4096)
        .enumerate()
        .skip(1)
        .filter(|(_, c)| c.iter().any(|&b| b != 0))
        .map(|(i, _)| i)
        .collect();
    assert!(
        stale.is_empty(),
        "pages showing data truncated away: {stale:?}"
    );
    let map = v.fiemap("/f").unwrap();
    assert!(map.iter().all(|&(fb, _, _)| fb == 0), "{map:?}");
    v.unmount().unwrap();
}

/// A running transaction that reaches a quarter of the journal commits at once, however
/// long its interval (jbd2's j_max_transaction_buffers): the records held in memory and
/// a crash's replay stay bounded under a fast stream of operations.
#[test]
fn a_transaction_commits_when_it_fills_a_quarter_of_the_journal() {
    let (_q, v) = fresh_with("sim:ssd,size=64M", quiet());
    let journal_bytes = v.superblock().journal_blocks * 4096;
    let before = v.journal_stats().commits;
    // Each create logs a create and a link record of ~80 bytes: enough files to fill a
    // quarter of the journal twice, with no fsync and an hour's commit interval.
    let files = journal_bytes / 4 / 80 * 2;
    for i in 0..files {
        v.create(&format!("/file-with-a-longish-name-{i}"))
            .unwrap()
            .close()
            .unwrap();
    }
    let t0 = std::time::Instant::now();
    while v.journal_stats().commits == before {
        assert!(
            t0.elapsed().as_secs() < 10,
            "no commit of a full transaction"
        );
        std::thread::yield_now();
    }
    let s = v.journal_stats();
    assert!(
        s.bytes <= journal_bytes,
        "the commits were at most a quarter of the journal each: {s:?}"
    );
    v.unmount().unwrap();
}

/// After a clean unmount the newest checkpoint is the state: mount writes one block,
/// its checkpoint's root record again with the tids moved on (no node of the metadata
/// tree, no whole-metadata image), and changes after it survive a power cut through
/// replay.
#[test]
fn a_mount_after_a_clean_unmount_writes_only_a_root_record() {
    let (q, v) = fresh("sim:ssd,size=64M");
    write_file(&v, "/a", b"one");
    v.unmount().unwrap();
    let before = q.diskstats();
    let v = Volume::mount(q.clone(), quiet()).unwrap();
    let d = q.diskstats().delta(&before);
    assert_eq!(d.writes(), 1, "mount's writes: {d:?}");
    assert_eq!(d.sectors[1], 8, "one block: {d:?}");
    let v = fsync_then_power_cut(&q, v, "/b", b"two");
    assert_eq!(read_file(&v, "/a"), b"one");
    assert_eq!(
        read_file(&v, "/b"),
        b"two",
        "replayed after the skipped checkpoint"
    );
    v.unmount().unwrap();
    assert_clean(&q);
}

/// Create `path` holding `data`, fsync it, cut the power, and mount again (fsck clean
/// before the mount).
fn fsync_then_power_cut(q: &Arc<RequestQueue>, v: Volume, path: &str, data: &[u8]) -> Volume {
    let f = v.create(path).unwrap();
    f.write_at(0, data).unwrap();
    f.fsync().unwrap();
    sim(q).power_cut(false);
    v.crash();
    sim(q).reboot();
    assert_clean(q);
    Volume::mount(q.clone(), quiet()).unwrap()
}

fn fresh_format(spec: &str, format: u32) -> (Arc<RequestQueue>, Volume) {
    let q = queue(spec);
    Volume::mkfs(
        &q,
        &MkfsOptions {
            format: Some(format),
            ..MkfsOptions::default()
        },
    )
    .unwrap();
    let v = Volume::mount(q.clone(), quiet()).unwrap();
    (q, v)
}

/// Format 5 keeps the metadata in a copy-on-write tree: a namespace of every kind
/// survives unmount, remount and a power cut after fsync, and fsck finds it clean.
#[test]
fn the_metadata_tree_keeps_the_namespace_across_remounts_and_power_cuts() {
    let (q, v) = fresh_format("sim:ssd,size=64M", 5);
    // Upgraded at its first mount: from now on its journal may wrap.
    assert_eq!(v.superblock().version, wbstack::fs::format::RING_VERSION);
    v.mkdir("/d", 0o755).unwrap();
    for i in 0..300 {
        write_file(&v, &format!("/d/f{i}"), &pattern(i, 100 + i as usize * 7));
    }
    v.symlink("/d/f1", "/s").unwrap();
    v.rename("/d/f2", "/moved").unwrap();
    v.unlink("/d/f3").unwrap();
    v.unmount().unwrap();
    assert_clean(&q);
    let v = Volume::mount(q.clone(), quiet()).unwrap();
    assert_eq!(read_file(&v, "/d/f299"), pattern(299, 100 + 299 * 7));
    assert_eq!(read_file(&v, "/moved"), pattern(2, 114));
    assert!(v.stat("/d/f3").is_err());
    assert_eq!(v.readlink("/s").unwrap(), "/d/f1");
    // Changes after the checkpoint, fsynced, then the power goes.
    let v = fsync_then_power_cut(&q, v, "/late", b"after the tree");
    assert_eq!(read_file(&v, "/late"), b"after the tree");
    assert_eq!(v.readdir("/d").unwrap().len(), 298);
    v.unmount().unwrap();
    assert_clean(&q);
}

/// A checkpoint writes what changed: after one small change to a volume of 3000 files,
/// format 5's checkpoint writes a few tree nodes where format 3 writes the whole
/// metadata again.
#[test]
fn a_tree_checkpoint_writes_what_changed() {
    let written = |format: u32| {
        let (q, v) = fresh_format("sim:ssd,size=128M", format);
        for i in 0..3000 {
            write_file(&v, &format!("/file-{i:05}"), b"x");
        }
        v.unmount().unwrap();
        let v = Volume::mount(q.clone(), quiet()).unwrap();
        write_file(&v, "/file-01234", b"changed");
        let before = q.diskstats().sectors[1];
        v.unmount().unwrap();
        (q.diskstats().sectors[1] - before) * 512
    };
    let (v3, v5) = (written(3), written(5));
    eprintln!("the last unmount's writes: format 3 {v3} bytes, format 5 {v5} bytes");
    assert!(
        v5 * 4 < v3,
        "the last unmount wrote {v5} bytes in format 5, {v3} in format 3"
    );
}

#[test]
fn mkfs_refuses_an_unknown_format() {
    let q = queue("sim:ssd,size=64M");
    let e = Volume::mkfs(
        &q,
        &MkfsOptions {
            format: Some(4),
            ..MkfsOptions::default()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("format 4"), "{e}");
}

/// Creates walk their directories through the dentry cache while another thread moves
/// one of those directories back and forth and makes and removes another: every
/// create either lands in a directory that exists (and its file is found there, or
/// wherever that directory moved) or fails with ENOENT; none lands in a removed
/// directory, and the volume and fsck find it consistent.
#[test]
fn creates_racing_directory_renames_and_rmdirs_land_only_in_live_directories() {
    let (q, v) = fresh("sim:ssd,size=256M");
    v.mkdir_all("/a/x", 0o755).unwrap();
    v.mkdir("/b", 0o755).unwrap();
    const ROUNDS: usize = 3000;
    let made: Vec<Vec<String>> = std::thread::scope(|s| {
        s.spawn(|| {
            for _ in 0..ROUNDS {
                v.rename("/a/x", "/b/x").unwrap();
                v.rename("/b/x", "/a/x").unwrap();
                match v.mkdir("/a/y", 0o755) {
                    Ok(_) | Err(FsError::Exists(_)) => {}
                    Err(e) => panic!("mkdir /a/y: {e}"),
                }
                match v.rmdir("/a/y") {
                    Ok(()) | Err(FsError::NotEmpty(_)) => {}
                    Err(e) => panic!("rmdir /a/y: {e}"),
                }
            }
        });
        let creators: Vec<_> = (0..2)
            .map(|t| {
                let v = &v;
                s.spawn(move || {
                    let mut made = Vec::new();
                    for i in 0..ROUNDS {
                        let name = format!("f{t}-{i}");
                        match v.create(&format!("/a/x/{name}")) {
                            Ok(f) => {
                                f.close().unwrap();
                                made.push(name.clone());
                            }
                            Err(FsError::NotFound(_)) => {}
                            Err(e) => panic!("create /a/x/{name}: {e}"),
                        }
                        let y = format!("/a/y/{name}");
                        match v.create(&y) {
                            // Made in a live /a/y: there until unlinked, so the
                            // rmdir above fails meanwhile.
                            Ok(f) => {
                                f.close().unwrap();
                                v.unlink(&y).unwrap();
                            }
                            Err(FsError::NotFound(_)) => {}
                            Err(e) => panic!("create {y}: {e}"),
                        }
                    }
                    made
                })
            })
            .collect();
        creators.into_iter().map(|c| c.join().unwrap()).collect()
    });
    let made: Vec<String> = made.into_iter().flatten().collect();
    assert!(!made.is_empty(), "no create ever found /a/x");
    let mut listed: Vec<String> = v
        .readdir("/a/x")
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    listed.sort();
    let mut made = made;
    made.sort();
    assert_eq!(listed, made);
    // The last rmdir may have met a file a creator had not unlinked yet; every file
    // made in /a/y is gone now, so /a/y is empty if it is there at all.
    match v.rmdir("/a/y") {
        Ok(()) | Err(FsError::NotFound(_)) => {}
        Err(e) => panic!("rmdir /a/y after the run: {e}"),
    }
    let s = v.inode_cache_stats();
    assert!(s.dentry_walk_hits > 0, "{s:?}");
    assert!(v.check().is_empty(), "{:?}", v.check());
    v.unmount().unwrap();
    assert!(fsck(&q).is_clean());
}

/// Create `path` holding `data` and fsync it: one journal transaction of its own.
fn fsynced(v: &Volume, path: &str, data: &[u8]) {
    let f = v.create(path).unwrap();
    f.write_at(0, data).unwrap();
    f.fsync().unwrap();
    f.close().unwrap();
}

/// Journal writes go out several at once, so a power cut can lose one while a later
/// one lands: that later transaction stays in the journal, valid, with the tid the
/// next mount's transactions take again. Mount moves the tids on past it (jbd2 moves
/// its sequence on after recovery), so after a second cut it is never replayed after
/// the new transaction that took its predecessor's place and length.
#[test]
fn a_transaction_left_beyond_a_lost_one_is_never_replayed_after_a_later_crash() {
    use wbstack::block::BioFlags;
    use wbstack::buf::IoBuf;
    let (q, v) = fresh("sim:ssd,size=64M");
    let journal_sector = v.superblock().journal_start * 8;
    let data = pattern(1, 4096);
    for f in ["/f1", "/f2", "/f3"] {
        fsynced(&v, f, &data);
    }
    sim(&q).power_cut(false);
    v.crash();
    sim(&q).reboot();
    // The first of the three lost: replay finds nothing due where the journal starts.
    q.write_sync(journal_sector, IoBuf::zeroed(4096), BioFlags::FUA)
        .unwrap();
    let v = Volume::mount(q.clone(), quiet()).unwrap();
    for f in ["/f1", "/f2", "/f3"] {
        assert!(matches!(v.stat(f), Err(FsError::NotFound(_))), "{f}");
    }
    // The same operation again: a transaction as long as the lost one, where it was.
    fsynced(&v, "/g1", &data);
    sim(&q).power_cut(false);
    v.crash();
    sim(&q).reboot();
    assert_clean(&q);
    let v = Volume::mount(q.clone(), quiet()).unwrap();
    assert_eq!(read_file(&v, "/g1"), data);
    for f in ["/f2", "/f3"] {
        assert!(
            matches!(v.stat(f), Err(FsError::NotFound(_))),
            "{f}: a transaction of the first run replayed after the second's"
        );
    }
    v.unmount().unwrap();
    assert_clean(&q);
}

/// O_TRUNC truncates whatever the access mode (Linux's O_RDONLY|O_TRUNC), and a file an
/// open just created is not truncated again.
#[test]
fn a_read_only_truncating_open_truncates() {
    let (q, v) = fresh("sim:ssd,size=64M");
    write_file(&v, "/t", b"to be cut");
    let o = OpenOptions {
        truncate: true,
        ..OpenOptions::read()
    };
    let f = v.open("/t", &o).unwrap();
    assert_eq!(f.size(), 0);
    f.close().unwrap();
    assert_eq!(v.stat("/t").unwrap().size, 0);
    v.unmount().unwrap();
    assert_clean(&q);
}

/// An encoded POSIX ACL (version 2): (tag, perm, id) entries.
fn acl(entries: &[(u16, u16, u32)]) -> Vec<u8> {
    let mut v = 2u32.to_le_bytes().to_vec();
    for (tag, perm, id) in entries {
        v.extend_from_slice(&tag.to_le_bytes());
        v.extend_from_slice(&perm.to_le_bytes());
        v.extend_from_slice(&id.to_le_bytes());
    }
    v
}

/// Permissions are the mode's alone: an ACL that is exactly a mode sets it, one with
/// named users or groups and a default ACL are refused (EOPNOTSUPP, as on a filesystem
/// mounted noacl) instead of being stored and shown but never enforced.
#[test]
fn acls_beyond_the_mode_are_refused_not_stored_unenforced() {
    use wbstack::fs::{Cred, XattrMode};
    let (q, v) = fresh("sim:ssd,size=64M");
    write_file(&v, "/f", b"x");
    v.mkdir("/d", 0o755).unwrap();
    let (f, d) = (v.stat("/f").unwrap().ino, v.stat("/d").unwrap().ino);
    let root = Cred::root();
    let set =
        |ino, name: &[u8], value: &[u8]| v.setxattr_as(&root, ino, name, value, XattrMode::Any);
    // user::rw- group::r-- other::---: mode 0640.
    set(
        f,
        b"system.posix_acl_access",
        &acl(&[(1, 6, 0), (4, 4, 0), (0x20, 0, 0)]),
    )
    .unwrap();
    assert_eq!(v.stat("/f").unwrap().mode & 0o777, 0o640);
    // user:1000:--- with a mask: refused, the mode unchanged, nothing stored.
    let named = acl(&[
        (1, 6, 0),
        (2, 0, 1000),
        (4, 4, 0),
        (0x10, 6, 0),
        (0x20, 0, 0),
    ]);
    let e = set(f, b"system.posix_acl_access", &named).unwrap_err();
    assert_eq!(e.errno(), libc::EOPNOTSUPP, "{e}");
    assert_eq!(v.stat("/f").unwrap().mode & 0o777, 0o640);
    let e = set(
        d,
        b"system.posix_acl_default",
        &acl(&[(1, 7, 0), (4, 5, 0), (0x20, 5, 0)]),
    )
    .unwrap_err();
    assert_eq!(e.errno(), libc::EOPNOTSUPP, "{e}");
    for ino in [f, d] {
        assert!(v.listxattr_as(&root, ino).unwrap().is_empty());
    }
    v.unmount().unwrap();
    assert_clean(&q);
}

/// A setattr is checked whole before anything changes: a truncation with the kernel's
/// own stripping of set-id bits passes on the truncation's permission (ATTR_FORCE), and
/// one with a mode its caller may not set leaves the file as it was.
#[test]
fn a_refused_setattr_changes_nothing_and_a_truncation_may_strip_set_id_bits() {
    use wbstack::fs::{Cred, SetAttrIno, TimeSet};
    let (q, v) = fresh("sim:ssd,size=64M");
    write_file(&v, "/f", &[7u8; 10_000]);
    let ino = v.stat("/f").unwrap().ino;
    let root = Cred::root();
    let owner = SetAttrIno {
        uid: Some(1000),
        gid: Some(100),
        ..SetAttrIno::default()
    };
    v.setattr_as(&root, ino, &owner).unwrap();
    // After the chown, which clears set-id bits.
    let suid = SetAttrIno {
        mode: Some(0o104775),
        ..SetAttrIno::default()
    };
    v.setattr_as(&root, ino, &suid).unwrap();
    // A member of the owning group: may write, may not chmod.
    let member = Cred::new(2000, 100, vec![100]);
    let refused = SetAttrIno {
        size: Some(0),
        mode: Some(0o100777),
        ..SetAttrIno::default()
    };
    let e = v.setattr_as(&member, ino, &refused).unwrap_err();
    assert_eq!(e.errno(), libc::EPERM, "{e}");
    let s = v.stat("/f").unwrap();
    assert_eq!(
        (s.size, s.mode & 0o7777),
        (10_000, 0o4775),
        "changed by a refused setattr"
    );
    // What `truncate -s 0` sends for it: the size, the mode less S_ISUID, the times.
    let truncate = SetAttrIno {
        size: Some(0),
        mode: Some(0o100775),
        mtime: Some(TimeSet::Now),
        ..SetAttrIno::default()
    };
    v.setattr_as(&member, ino, &truncate).unwrap();
    let s = v.stat("/f").unwrap();
    assert_eq!((s.size, s.mode & 0o7777), (0, 0o775));
    v.unmount().unwrap();
    assert_clean(&q);
}

/// An open with O_TRUNC is a truncation: by anyone but root it clears set-user-id (and
/// group-executable set-group-id), in an open of an existing file and in a create that
/// finds the file there, whose attributes show it; `open_reporting_as` says so (a FUSE
/// OPEN's reply carries no mode, so the server tells the kernel). An open without
/// O_TRUNC, or root's, clears nothing; nor does one refused.
#[test]
fn a_truncating_open_by_another_user_clears_set_id_bits() {
    use wbstack::fs::{Cred, SetAttrIno};
    let (q, v) = fresh("sim:ssd,size=64M");
    write_file(&v, "/f", &[7u8; 10_000]);
    let ino = v.stat("/f").unwrap().ino;
    let root = Cred::root();
    let chmod = |mode: u32| {
        let a = SetAttrIno {
            mode: Some(mode),
            ..SetAttrIno::default()
        };
        v.setattr_as(&root, ino, &a).unwrap();
    };
    let mode = || v.stat("/f").unwrap().mode & 0o7777;
    let other = Cred::new(2000, 2000, vec![]);
    let truncating = OpenOptions {
        write: true,
        truncate: true,
        ..OpenOptions::default()
    };
    chmod(0o106757);
    let (f, cleared) = v
        .open_reporting_as(&other, ino, &OpenOptions::read_write())
        .unwrap();
    f.close().unwrap();
    assert!(!cleared);
    assert_eq!(
        mode(),
        0o6757,
        "an open without O_TRUNC cleared set-id bits"
    );
    let (f, cleared) = v.open_reporting_as(&root, ino, &truncating).unwrap();
    f.close().unwrap();
    assert!(!cleared);
    assert_eq!(mode(), 0o6757, "root's truncating open cleared set-id bits");
    let (f, cleared) = v.open_reporting_as(&other, ino, &truncating).unwrap();
    f.close().unwrap();
    assert!(cleared);
    assert_eq!(mode(), 0o757);
    // O_RDONLY|O_TRUNC truncates all the same.
    chmod(0o104757);
    let read_trunc = OpenOptions {
        truncate: true,
        ..OpenOptions::read()
    };
    let (f, cleared) = v.open_reporting_as(&other, ino, &read_trunc).unwrap();
    f.close().unwrap();
    assert!(cleared);
    assert_eq!(mode(), 0o757);
    // Refused (no write permission): nothing changes.
    chmod(0o104755);
    let Err(e) = v.open_reporting_as(&other, ino, &truncating) else {
        panic!("a truncating open without write permission succeeded");
    };
    assert_eq!(e.errno(), libc::EACCES, "{e}");
    assert_eq!(mode(), 0o4755);
    // A create (O_CREAT|O_TRUNC, no O_EXCL) that finds the file: its stat shows the
    // cleared mode.
    write_file(&v, "/f", &[7u8; 10_000]);
    chmod(0o104757);
    let (f, s) = v
        .create_as(&other, 1, b"f", 0o644, &OpenOptions::create())
        .unwrap();
    f.close().unwrap();
    assert_eq!((s.ino, s.size, s.mode & 0o7777), (ino, 0, 0o757));
    assert_eq!(mode(), 0o757);
    v.unmount().unwrap();
    assert_clean(&q);
}

/// The mode alone, less the set-id bits a write by the caller clears, is what the
/// kernel sends before a fallocate or copy_file_range (file_modified): it passes on the
/// caller's write permission, not the owner's chmod right. Anything more, or a caller
/// who may not write, is a chmod, refused to a non-owner.
#[test]
fn a_mode_that_only_clears_set_id_bits_passes_on_write_permission() {
    use wbstack::fs::{Cred, SetAttrIno};
    let (q, v) = fresh("sim:ssd,size=64M");
    write_file(&v, "/f", &[7u8; 10_000]);
    let ino = v.stat("/f").unwrap().ino;
    let root = Cred::root();
    let other = Cred::new(2000, 2000, vec![]);
    let set = |c: &Cred, mode: u32| {
        let a = SetAttrIno {
            mode: Some(mode),
            ..SetAttrIno::default()
        };
        v.setattr_as(c, ino, &a).map(|s| s.mode & 0o7777)
    };
    set(&root, 0o106757).unwrap();
    // More than the set-id bits: a chmod.
    let e = set(&other, 0o100755).unwrap_err();
    assert_eq!(e.errno(), libc::EPERM, "{e}");
    // Only set-user-id, where a write clears set-group-id too: a chmod.
    let e = set(&other, 0o102757).unwrap_err();
    assert_eq!(e.errno(), libc::EPERM, "{e}");
    assert_eq!(v.stat("/f").unwrap().mode & 0o7777, 0o6757);
    assert_eq!(set(&other, 0o100757).unwrap(), 0o757);
    // Without write permission: a chmod.
    set(&root, 0o104755).unwrap();
    let e = set(&other, 0o100755).unwrap_err();
    assert_eq!(e.errno(), libc::EPERM, "{e}");
    assert_eq!(v.stat("/f").unwrap().mode & 0o7777, 0o4755);
    v.unmount().unwrap();
    assert_clean(&q);
}

/// A file truncated at its open (the truncation deferred: its new data goes to new
/// blocks), written, and renamed over another: the commit holding the rename holds
/// the truncation and the new extents too, even while the flusher, which would
/// otherwise resolve the truncation, is busy. After a power cut the target is its old
/// content or the new one, never the renamed file's content from before its
/// truncation.
#[test]
fn a_rename_over_commits_the_renamed_files_deferred_truncation_with_it() {
    let (q, v) = fresh_with("sim:ssd,size=64M", quiet());
    for (path, byte) in [("/t", 0x11u8), ("/a", 0x22)] {
        let f = v.create(path).unwrap();
        f.write_at(0, &[byte; 8192]).unwrap();
        f.fsync().unwrap();
        f.close().unwrap();
    }
    // The flusher busy until the end of the test.
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    v.bdi().queue_job(Box::new(move || {
        let _ = started_tx.send(());
        let _ = release_rx.recv();
    }));
    started_rx
        .recv_timeout(std::time::Duration::from_secs(30))
        .expect("the flusher took the blocking job");
    let t = v
        .open(
            "/t",
            &OpenOptions {
                write: true,
                truncate: true,
                ..Default::default()
            },
        )
        .unwrap();
    t.write_at(0, &[0x33u8; 4096]).unwrap();
    v.mapping_of("/t")
        .unwrap()
        .write_and_wait(0, u64::MAX)
        .unwrap();
    t.close().unwrap();
    v.rename("/t", "/a").unwrap();
    v.commit_now().unwrap();
    sim(&q).power_cut(false);
    let _ = release_tx.send(());
    v.crash();
    sim(&q).reboot();
    let v = Volume::mount(q.clone(), quiet()).unwrap();
    let f = v.open("/a", &OpenOptions::default()).unwrap();
    let mut back = vec![0u8; 8192];
    let n = f.read_at(0, &mut back).unwrap();
    let got = &back[..n];
    assert!(
        got == [0x22u8; 8192] || got == [0x33u8; 4096],
        "after the cut /a holds {n} bytes starting {:x?}",
        &got[..got.len().min(4)]
    );
    assert!(v.check().is_empty(), "{:?}", v.check());
    v.unmount().unwrap();
}

/// An asynchronous flush asked of a file still open after its volume stopped (a
/// crash, an unmount by another handle) completes, with an error: its batch job
/// found no flusher to run it, and its waiter waited for good.
#[test]
fn an_async_flush_after_the_volume_stopped_completes_with_an_error() {
    let (_q, v) = fresh_with("sim:ssd,size=64M", quiet());
    let f = v.create("/f").unwrap();
    f.write_at(0, &[7u8; 4096]).unwrap();
    v.crash();
    let h = f.flush_async();
    let t0 = std::time::Instant::now();
    let r = loop {
        match &h {
            Err(e) => break Err(e.clone()),
            Ok(h) => {
                if let Some(r) = h.poll() {
                    break r;
                }
            }
        }
        assert!(t0.elapsed().as_secs() < 10, "the flush never completed");
        std::thread::yield_now();
    };
    assert!(r.is_err(), "a flush of a stopped volume succeeded");
}

/// File capabilities go with any change of the file's data or owner, whoever makes
/// it (file_remove_privs, cap_inode_killpriv; chown's ATTR_KILL_PRIV): a write, a
/// truncation, a truncating open, a chown. Only root sets or removes security.*.
/// Before, a write by another user through the mount left a rewritten program its
/// capabilities.
#[test]
fn a_write_truncation_or_chown_drops_file_capabilities() {
    use wbstack::fs::ops::XattrMode;
    use wbstack::fs::{Cred, SetAttrIno};
    const CAPS: &[u8] = b"security.capability";
    let (q, v) = fresh("sim:ssd,size=64M");
    write_file(&v, "/prog", &[7u8; 10_000]);
    let ino = v.stat("/prog").unwrap().ino;
    let root = Cred::root();
    let other = Cred::new(2000, 2000, vec![]);
    let chmod = SetAttrIno {
        mode: Some(0o100777),
        ..SetAttrIno::default()
    };
    v.setattr_as(&root, ino, &chmod).unwrap();
    let grant = || {
        v.setxattr_as(&root, ino, CAPS, &[1, 2, 3, 4], XattrMode::Any)
            .unwrap()
    };
    let has_caps = || v.getxattr_as(&root, ino, CAPS).is_ok();
    // Only root sets or removes them.
    let e = v
        .setxattr_as(&other, ino, CAPS, &[1], XattrMode::Any)
        .unwrap_err();
    assert_eq!(e.errno(), libc::EPERM);
    grant();
    assert_eq!(
        v.removexattr_as(&other, ino, CAPS).unwrap_err().errno(),
        libc::EPERM
    );
    // A write, by anyone (root too).
    for c in [&root, &other] {
        grant();
        assert!(v.kill_suid_as(c, ino).unwrap(), "uid {}", c.uid);
        assert!(!has_caps(), "a write by uid {} kept them", c.uid);
        assert!(!v.kill_suid_as(c, ino).unwrap(), "nothing left to drop");
    }
    // A truncation.
    grant();
    let cut = SetAttrIno {
        size: Some(100),
        ..SetAttrIno::default()
    };
    v.setattr_as(&other, ino, &cut).unwrap();
    assert!(!has_caps(), "a truncation kept them");
    // A truncating open; an open that does not truncate keeps them.
    grant();
    let (f, _) = v
        .open_reporting_as(&root, ino, &OpenOptions::read_write())
        .unwrap();
    f.close().unwrap();
    assert!(has_caps());
    let truncating = OpenOptions {
        write: true,
        truncate: true,
        ..OpenOptions::default()
    };
    let (f, cleared) = v.open_reporting_as(&root, ino, &truncating).unwrap();
    f.close().unwrap();
    assert!(cleared && !has_caps(), "a truncating open kept them");
    // A chown.
    grant();
    let chown = SetAttrIno {
        uid: Some(0),
        ..SetAttrIno::default()
    };
    v.setattr_as(&root, ino, &chown).unwrap();
    assert!(!has_caps(), "a chown kept them");
    // Durable as any change: gone after a remount.
    grant();
    assert!(v.kill_suid_as(&root, ino).unwrap());
    v.unmount().unwrap();
    assert_clean(&q);
    let v = Volume::mount(q.clone(), quiet()).unwrap();
    assert!(v.getxattr_as(&root, ino, CAPS).is_err());
    v.unmount().unwrap();
}

/// A truncation whose new end falls in a hole past the size on disk (a write beyond
/// it, not yet written back, left the hole) keeps the size it sets: with no head to
/// rewrite, nothing else carries it to disk. Found by the mount's model test when the
/// head's rewrite was first skipped (the file came back at its old size).
#[test]
fn a_truncation_into_a_hole_past_the_size_on_disk_keeps_its_size() {
    let (q, v) = fresh("sim:ssd,size=64M");
    write_file(&v, "/f", &[1u8; 2 * 4096]);
    let f = v.open("/f", &OpenOptions::read_write()).unwrap();
    // Pages 2..=9 a hole, page 10 dirty: the size on disk is still 8192.
    f.write_at(10 * 4096, &[2u8; 4096]).unwrap();
    f.set_len(5 * 4096 + 100).unwrap();
    f.close().unwrap();
    assert_eq!(v.stat("/f").unwrap().size, 5 * 4096 + 100);
    v.unmount().unwrap();
    assert_clean(&q);
    let v = Volume::mount(q.clone(), quiet()).unwrap();
    let f = v.open("/f", &OpenOptions::read()).unwrap();
    assert_eq!(f.size(), 5 * 4096 + 100);
    let mut b = vec![9u8; 5 * 4096 + 100];
    assert_eq!(f.read_at(0, &mut b).unwrap(), b.len());
    assert!(b[..2 * 4096].iter().all(|&x| x == 1));
    assert!(b[2 * 4096..].iter().all(|&x| x == 0));
    f.close().unwrap();
    v.unmount().unwrap();
}
