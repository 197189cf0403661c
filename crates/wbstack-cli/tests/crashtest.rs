//! `wbstack crashtest`: the checker catches every kind of violation it claims to, a
//! small run of real cuts, the CLI's flags, and minimal reproductions of the library
//! bugs crashtest found.

use parking_lot::{Condvar, Mutex};
use std::sync::Arc;
use std::time::{Duration, Instant};
use wbstack::block::{Bio, BioFlags, BlkError, BlkResult, QueueConfig, Request, RequestQueue};
use wbstack::buf::IoBuf;
use wbstack::clock::RealClock;
use wbstack::dev::sim::SimDevice;
use wbstack::dev::{self, Completer, DeviceRef, RqComplete};
use wbstack::fs::fsck::fsck;
use wbstack::fs::{MkfsOptions, MountOptions, OpenOptions, Volume};

// ---------------------------------------------------------------------------------
// The checker, fed states with known violations.

use wbstack_cli::crashtest::{
    check, classify, sector_image, stamp, Barrier, CrashOpts, Entry, FsyncRule, Log, Recovered,
    ReplayFile, Sector, Verdict,
};

const ROOT: u64 = 1;

fn create(log: &mut Log, dir: u64, name: &str, ino: u64) {
    log.push(Entry::Create {
        dir,
        name: name.into(),
        ino,
        is_dir: false,
    });
}

fn write(log: &mut Log, ino: u64, sector: u64, sectors: u64, ver: u64) {
    let start = log.len();
    log.push(Entry::Write {
        ino,
        sector,
        sectors,
        ver,
        start,
        ok: true,
        done: 0,
    });
}

fn fsync(log: &mut Log, ino: u64) {
    let id = log.start_barrier(Barrier::Fsync(ino));
    log.ack_barrier(id);
}

/// A file's content: version `vers[s]` of each sector s (0: zeros).
fn content(ino: u64, vers: &[u64]) -> Vec<u8> {
    let mut v = Vec::new();
    for (s, &ver) in vers.iter().enumerate() {
        if ver == 0 {
            v.extend_from_slice(&[0u8; 512]);
        } else {
            v.extend_from_slice(&sector_image(ino, s as u64, ver));
        }
    }
    v
}

fn recovered(entries: &[(u64, &str, u64)], files: Vec<(u64, Vec<u8>)>) -> Recovered {
    Recovered {
        entries: entries
            .iter()
            .map(|&(d, n, i)| (d, n.to_string(), i, false))
            .collect(),
        files: files.into_iter().collect(),
    }
}

fn assert_clean(v: &Verdict) {
    assert!(v.clean(), "{v:#?}");
}

/// /f (inode 2): version 1 of sectors 0..8, fsynced.
fn one_fsynced_file() -> Log {
    let mut log = Log::new();
    create(&mut log, ROOT, "f", 2);
    write(&mut log, 2, 0, 8, 1);
    fsync(&mut log, 2);
    log
}

#[test]
fn sectors_describe_themselves() {
    let img = sector_image(7, 3, 9);
    assert_eq!(
        classify(&img),
        Sector::Written {
            ino: 7,
            idx: 3,
            ver: 9
        }
    );
    assert_eq!(classify(&[0u8; 512]), Sector::Zero);
    assert_eq!(
        classify(&img[..100]),
        Sector::Written {
            ino: 7,
            idx: 3,
            ver: 9
        },
        "the head of a sector at the end of a file"
    );
    for pos in [0, 9, 17, 30, 200, 511] {
        let mut bad = img;
        bad[pos] ^= 0x40;
        assert_eq!(classify(&bad), Sector::Garbage, "byte {pos} flipped");
    }
    // Same inode and sector, another version: other bytes.
    assert_ne!(sector_image(7, 3, 10)[..], img[..]);
}

#[test]
fn the_recovered_state_that_matches_passes() {
    let log = one_fsynced_file();
    let r = recovered(&[(ROOT, "f", 2)], vec![(2, content(2, &[1; 8]))]);
    let v = check(&log, &r, FsyncRule::Global);
    assert_clean(&v);
    assert_eq!(v.prefix, Some(1));
}

#[test]
fn a_lost_fsynced_sector_is_counted() {
    let log = one_fsynced_file();
    let mut vers = [1u64; 8];
    vers[3] = 0;
    let r = recovered(&[(ROOT, "f", 2)], vec![(2, content(2, &vers))]);
    let v = check(&log, &r, FsyncRule::Global);
    assert_eq!(v.fsynced_bytes_lost, 512, "{v:#?}");
    assert_eq!(v.garbage_blocks_exposed, 0);
    // A file shorter than what was fsynced lost its tail.
    let r = recovered(&[(ROOT, "f", 2)], vec![(2, content(2, &[1; 4]))]);
    assert_eq!(check(&log, &r, FsyncRule::Global).fsynced_bytes_lost, 2048);
}

#[test]
fn an_older_version_than_the_fsynced_one_is_lost_data() {
    let mut log = one_fsynced_file();
    write(&mut log, 2, 0, 8, 2);
    fsync(&mut log, 2);
    let mut vers = [2u64; 8];
    vers[5] = 1;
    let r = recovered(&[(ROOT, "f", 2)], vec![(2, content(2, &vers))]);
    let v = check(&log, &r, FsyncRule::Global);
    assert_eq!(v.fsynced_bytes_lost, 512, "{v:#?}");
}

#[test]
fn a_torn_overwrite_of_fsynced_data_is_fine() {
    let mut log = one_fsynced_file();
    write(&mut log, 2, 2, 4, 2); // in place, never fsynced
    let r = recovered(
        &[(ROOT, "f", 2)],
        vec![(2, content(2, &[1, 1, 2, 1, 2, 2, 1, 1]))],
    );
    assert_clean(&check(&log, &r, FsyncRule::Global));
    // Unfsynced data may be missing (a hole), but never older than the fsync.
    let mut log = Log::new();
    create(&mut log, ROOT, "f", 2);
    write(&mut log, 2, 0, 8, 1);
    let r = recovered(&[(ROOT, "f", 2)], vec![(2, content(2, &[1, 0, 0, 1]))]);
    assert_clean(&check(&log, &r, FsyncRule::Global));
}

#[test]
fn garbage_is_counted_by_block() {
    let log = one_fsynced_file();
    let mut bytes = content(2, &[1; 8]);
    // Another inode's sector, this inode's sector at another offset, noise.
    bytes[512..1024].copy_from_slice(&sector_image(9, 1, 1));
    bytes[1024..1536].copy_from_slice(&sector_image(2, 5, 1));
    bytes[3584..4096].copy_from_slice(&[0x5a; 512]);
    let r = recovered(&[(ROOT, "f", 2)], vec![(2, bytes)]);
    let v = check(&log, &r, FsyncRule::Global);
    assert_eq!(v.garbage_sectors, 3, "{v:#?}");
    assert_eq!(v.garbage_blocks_exposed, 1, "all three in block 0");
    assert_eq!(v.fsynced_bytes_lost, 3 * 512, "they were fsynced too");
    // In a file never fsynced: garbage all the same, nothing lost.
    let mut log = Log::new();
    create(&mut log, ROOT, "g", 3);
    write(&mut log, 3, 0, 16, 4);
    let mut bytes = content(3, &[4; 16]);
    bytes[4096..4608].copy_from_slice(&sector_image(3, 8, 5)); // version 5 never existed
    let v = check(
        &log,
        &recovered(&[(ROOT, "g", 3)], vec![(3, bytes)]),
        FsyncRule::Global,
    );
    assert_eq!((v.garbage_blocks_exposed, v.fsynced_bytes_lost), (1, 0));
}

#[test]
fn a_tree_after_no_prefix_is_caught() {
    let mut log = Log::new();
    create(&mut log, ROOT, "a", 2);
    create(&mut log, ROOT, "b", 3);
    let r = recovered(&[(ROOT, "b", 3)], vec![(3, Vec::new())]);
    let v = check(&log, &r, FsyncRule::Inode);
    assert!(v.namespace_not_prefix, "{v:#?}");
    assert!(!v.clean());
    // Either prefix is fine: nothing was fsynced.
    for tree in [vec![], vec![(ROOT, "a", 2)]] {
        let files = tree.iter().map(|&(_, _, i)| (i, Vec::new())).collect();
        assert_clean(&check(&log, &recovered(&tree, files), FsyncRule::Global));
    }
}

#[test]
fn operations_an_fsync_covered_must_be_there() {
    let mut log = one_fsynced_file();
    create(&mut log, ROOT, "b", 3);
    fsync(&mut log, 2); // /f unchanged since its last fsync
    let only_f = recovered(&[(ROOT, "f", 2)], vec![(2, content(2, &[1; 8]))]);
    let v = check(&log, &only_f, FsyncRule::Global);
    assert_eq!(v.fsynced_ops_lost, 1, "{v:#?}");
    assert_eq!(v.fsynced_ops_lost_inode_rule, 0);
    // The inode rule asks only for /f's own changes.
    assert_clean(&check(&log, &only_f, FsyncRule::Inode));
    // A rename of the fsynced file itself is covered under both rules.
    log.push(Entry::Rename {
        from_dir: ROOT,
        from: "f".into(),
        to_dir: ROOT,
        to: "b".into(),
        ino: 2,
        victim: Some(3),
    });
    fsync(&mut log, 2);
    let before = recovered(
        &[(ROOT, "f", 2), (ROOT, "b", 3)],
        vec![(2, content(2, &[1; 8])), (3, Vec::new())],
    );
    let v = check(&log, &before, FsyncRule::Inode);
    assert_eq!(v.fsynced_ops_lost, 1, "{v:#?}");
    let after = recovered(&[(ROOT, "b", 2)], vec![(2, content(2, &[1; 8]))]);
    assert_clean(&check(&log, &after, FsyncRule::Inode));
}

#[test]
fn sync_covers_every_file() {
    let mut log = Log::new();
    create(&mut log, ROOT, "a", 2);
    write(&mut log, 2, 0, 4, 1);
    create(&mut log, ROOT, "b", 3);
    write(&mut log, 3, 0, 4, 2);
    let id = log.start_barrier(Barrier::Sync);
    log.ack_barrier(id);
    let r = recovered(
        &[(ROOT, "a", 2), (ROOT, "b", 3)],
        vec![(2, content(2, &[1; 4])), (3, content(3, &[2, 2, 0, 2]))],
    );
    assert_eq!(check(&log, &r, FsyncRule::Inode).fsynced_bytes_lost, 512);
    // Without the ack, nothing was promised.
    log.entries.pop();
    assert_clean(&check(&log, &r, FsyncRule::Inode));
}

#[test]
fn truncated_data_must_not_come_back() {
    let mut log = one_fsynced_file();
    log.push(Entry::Truncate { ino: 2, size: 1024 });
    log.push(Entry::Truncate { ino: 2, size: 4096 });
    create(&mut log, ROOT, "g", 3); // durable, so both truncates are
    let r = |vers: &[u64]| {
        recovered(
            &[(ROOT, "f", 2), (ROOT, "g", 3)],
            vec![(2, content(2, vers)), (3, Vec::new())],
        )
    };
    let v = check(&log, &r(&[1, 1, 1, 1, 0, 0, 0, 0]), FsyncRule::Global);
    assert_eq!(v.stale_sectors_exposed, 2, "{v:#?}");
    assert_clean(&check(
        &log,
        &r(&[1, 1, 0, 0, 0, 0, 0, 0]),
        FsyncRule::Global,
    ));
    // Longer than the file ever was since the truncate down.
    let v = check(&log, &r(&[1, 1, 0, 0, 0, 0, 0, 0, 0, 0]), FsyncRule::Global);
    assert_eq!(v.size_errors, 1, "{v:#?}");
    // If the truncates are not durable (no /g), the fsynced data must be whole.
    let mut log = one_fsynced_file();
    log.push(Entry::Truncate { ino: 2, size: 1024 });
    create(&mut log, ROOT, "g", 3);
    let f_only = |vers: &[u64]| recovered(&[(ROOT, "f", 2)], vec![(2, content(2, vers))]);
    assert_clean(&check(&log, &f_only(&[1; 8]), FsyncRule::Global));
    let v = check(&log, &f_only(&[1, 1, 1, 1, 1, 0, 0, 0]), FsyncRule::Global);
    assert_eq!(v.fsynced_bytes_lost, 3 * 512, "{v:#?}");
}

#[test]
fn a_lost_covered_truncate_is_lost_operations_not_stale_data() {
    // The tree cannot tell whether the truncate is durable; the data says it is not.
    // Under the global rule the fsync of /g covered it: that is one lost operation.
    let mut log = Log::new();
    create(&mut log, ROOT, "f", 2);
    write(&mut log, 2, 0, 8, 1);
    create(&mut log, ROOT, "g", 3);
    fsync(&mut log, 2);
    log.push(Entry::Truncate { ino: 2, size: 0 });
    fsync(&mut log, 3);
    let r = recovered(
        &[(ROOT, "f", 2), (ROOT, "g", 3)],
        vec![(2, content(2, &[1; 8])), (3, Vec::new())],
    );
    let v = check(&log, &r, FsyncRule::Global);
    assert_eq!(v.prefix_candidates, vec![2, 3]);
    assert_eq!(
        (v.fsynced_ops_lost, v.fsynced_ops_lost_inode_rule),
        (1, 0),
        "{v:#?}"
    );
    assert_eq!((v.stale_sectors_exposed, v.size_errors), (0, 0), "{v:#?}");
    assert_clean(&check(&log, &r, FsyncRule::Inode));
}

#[test]
fn a_deferred_truncation_to_zero_leaves_old_or_new_content_never_a_mix() {
    let build = |deferred: bool, fsync_after: bool| {
        let mut log = Log::deferring_zero_truncates(deferred);
        create(&mut log, ROOT, "f", 2);
        write(&mut log, 2, 0, 8, 1);
        fsync(&mut log, 2);
        log.push(Entry::Truncate { ino: 2, size: 0 });
        write(&mut log, 2, 0, 4, 2);
        if fsync_after {
            fsync(&mut log, 2);
        }
        create(&mut log, ROOT, "g", 3); // durable: everything journaled before it is
        log
    };
    let r = |vers: &[u64]| {
        recovered(
            &[(ROOT, "f", 2), (ROOT, "g", 3)],
            vec![(2, content(2, vers)), (3, Vec::new())],
        )
    };
    let log = build(true, false);
    // The truncation waits for the close: old content, or the new one.
    assert_clean(&check(&log, &r(&[1; 8]), FsyncRule::Global));
    assert_clean(&check(&log, &r(&[2; 4]), FsyncRule::Global));
    let v = check(&log, &r(&[2, 2, 2, 2, 1, 1, 1, 1]), FsyncRule::Global);
    assert_eq!(v.stale_sectors_exposed, 4, "a mix: {v:#?}");
    // Journaled where it happened (no deferral), /g's durability says it is durable.
    let v = check(&build(false, false), &r(&[1; 8]), FsyncRule::Global);
    assert!(v.stale_sectors_exposed > 0, "{v:#?}");
    // An fsync after it makes it durable, deferred or not.
    let v = check(&build(true, true), &r(&[1; 8]), FsyncRule::Global);
    assert!(
        v.fsynced_bytes_lost > 0 && v.stale_sectors_exposed > 0,
        "{v:#?}"
    );
    assert_clean(&check(&build(true, true), &r(&[2; 4]), FsyncRule::Global));
}

/// flush_on_close: a truncation to zero of a file with data on disk, a rewrite and a
/// close: the close writes the file back and journals the truncation with the new
/// extents, so the file holds its old content or all it had at the close, never an
/// empty or short file. A file with no data on disk, or never closed, is promised
/// nothing of the kind.
#[test]
fn a_truncation_to_zero_rewritten_and_closed_is_old_or_whole_under_flush_on_close() {
    let build = |on_disk: bool, close: bool| {
        let mut log = Log::deferring_zero_truncates(true);
        create(&mut log, ROOT, "f", 2);
        write(&mut log, 2, 0, 8, 1);
        if on_disk {
            fsync(&mut log, 2);
        }
        log.push(Entry::Truncate { ino: 2, size: 0 });
        write(&mut log, 2, 0, 4, 2);
        if close {
            log.push(Entry::Close { ino: 2 });
        }
        // After the close: not covered.
        write(&mut log, 2, 4, 4, 3);
        create(&mut log, ROOT, "g", 3);
        log
    };
    let r = |vers: &[u64]| {
        recovered(
            &[(ROOT, "f", 2), (ROOT, "g", 3)],
            vec![(2, content(2, vers)), (3, Vec::new())],
        )
    };
    let log = build(true, true);
    for whole in [vec![1; 8], vec![2; 4], vec![2, 2, 2, 2, 3, 3, 3, 3]] {
        assert_clean(&check(&log, &r(&whole), FsyncRule::Inode));
    }
    for short in [vec![], vec![2, 2, 0, 0]] {
        let v = check(&log, &r(&short), FsyncRule::Inode);
        assert!(v.fsynced_bytes_lost > 0, "{short:?}: {v:#?}");
    }
    assert_clean(&check(&build(false, true), &r(&[]), FsyncRule::Inode));
    assert_clean(&check(&build(true, false), &r(&[]), FsyncRule::Inode));
}

/// /a (2): fsynced. /a.new (3): created, then each (sector, sectors, version) of
/// `before` written, renamed over /a without fsync, each of `after` written, closed.
/// /g (4) is created last: journaled after the rename, so its name makes the rename
/// durable.
fn replace_log(flush_on_close: bool, before: &[(u64, u64, u64)], after: &[(u64, u64, u64)]) -> Log {
    let mut log = Log::deferring_zero_truncates(flush_on_close);
    create(&mut log, ROOT, "a", 2);
    write(&mut log, 2, 0, 8, 1);
    fsync(&mut log, 2);
    create(&mut log, ROOT, "a.new", 3);
    for &(s, n, ver) in before {
        write(&mut log, 3, s, n, ver);
    }
    log.push(Entry::Rename {
        from_dir: ROOT,
        from: "a.new".into(),
        to_dir: ROOT,
        to: "a".into(),
        ino: 3,
        victim: Some(2),
    });
    for &(s, n, ver) in after {
        write(&mut log, 3, s, n, ver);
    }
    log.push(Entry::Close { ino: 3 });
    create(&mut log, ROOT, "g", 4);
    log
}

/// The replaced name after the durable rename, holding `vers` of /a.new's inode.
fn replaced(vers: &[u64]) -> Recovered {
    recovered(
        &[(ROOT, "a", 3), (ROOT, "g", 4)],
        vec![(3, content(3, vers)), (4, Vec::new())],
    )
}

/// flush_on_close's replace promise: a new file written, renamed over an existing
/// name without fsync, then closed. Once the rename is durable the name holds every
/// byte written before it; an empty or partial file is a lost promise.
#[test]
fn a_durable_rename_over_carries_the_new_files_data_with_flush_on_close() {
    let log = replace_log(true, &[(0, 16, 2)], &[]);
    assert_clean(&check(&log, &replaced(&[2; 16]), FsyncRule::Inode));
    let mut second_block_zeros = vec![2; 8];
    second_block_zeros.extend([0; 8]);
    for (short, lost) in [
        (vec![], 16),
        (vec![2; 8], 8),
        (second_block_zeros, 8),
        ([vec![2, 2, 2, 0], vec![2; 12]].concat(), 1),
    ] {
        let v = check(&log, &replaced(&short), FsyncRule::Inode);
        assert_eq!(v.renamed_bytes_lost, lost * 512, "{short:?}: {v:#?}");
        // Nothing was fsynced: only the new rule sees it.
        assert_eq!(v.fsynced_bytes_lost, 0, "{short:?}: {v:#?}");
        assert!(!v.clean());
    }
    // Not durable (the tree before the rename): the old file, or the new one empty
    // under its temporary name.
    let before = recovered(
        &[(ROOT, "a", 2), (ROOT, "a.new", 3)],
        vec![(2, content(2, &[1; 8])), (3, Vec::new())],
    );
    assert_clean(&check(&log, &before, FsyncRule::Inode));
    // Without flush_on_close nothing orders the data with the rename.
    let v = check(
        &replace_log(false, &[(0, 16, 2)], &[]),
        &replaced(&[]),
        FsyncRule::Inode,
    );
    assert_clean(&v);
}

/// Only newly allocated data is ordered with the rename (fs/flush.rs, ext4's
/// data=ordered): a block's first write is in its first copy, but a later write to a
/// block already written back lands in place and is not waited for; writes after the
/// rename are not covered at all.
#[test]
fn a_rename_over_requires_only_each_blocks_first_write_before_it() {
    // Block 0: sectors 0..4 by version 2, then 4..8 by version 3 (in place if block 0
    // was written back between them). Block 1: version 4 only. Block 2: version 5,
    // after the rename.
    let log = replace_log(true, &[(0, 4, 2), (4, 4, 3), (8, 8, 4)], &[(16, 8, 5)]);
    let mut vers = vec![2, 2, 2, 2, 3, 3, 3, 3];
    vers.extend([4; 8]);
    let whole = [vers.clone(), vec![5; 8]].concat();
    assert_clean(&check(&log, &replaced(&whole), FsyncRule::Inode));
    assert_clean(&check(&log, &replaced(&vers), FsyncRule::Inode));
    // Version 3 never reached the disk: block 0 as version 2 wrote it back.
    let in_place_lost = [vec![2, 2, 2, 2, 0, 0, 0, 0], vec![4; 8]].concat();
    assert_clean(&check(&log, &replaced(&in_place_lost), FsyncRule::Inode));
    // Block 1 held only version 4: newly allocated, so it must be there.
    let v = check(&log, &replaced(&vers[..8]), FsyncRule::Inode);
    assert_eq!(v.renamed_bytes_lost, 8 * 512, "{v:#?}");
    // So must version 2's sectors, the first write of block 0.
    let first_lost = [vec![0, 0, 2, 2, 3, 3, 3, 3], vec![4; 8]].concat();
    let v = check(&log, &replaced(&first_lost), FsyncRule::Inode);
    assert_eq!(v.renamed_bytes_lost, 2 * 512, "{v:#?}");
    // A truncation before the rename: the log cannot tell which blocks are new.
    let mut log = replace_log(true, &[(0, 16, 2)], &[]);
    let at = log
        .entries
        .iter()
        .position(|e| matches!(e, Entry::Rename { .. }))
        .unwrap();
    log.entries
        .insert(at, Entry::Truncate { ino: 3, size: 4096 });
    assert_clean(&check(&log, &replaced(&[]), FsyncRule::Inode));
}

#[test]
fn hard_links_and_renames_over_files_are_one_inode() {
    let mut log = Log::new();
    create(&mut log, ROOT, "a", 2);
    write(&mut log, 2, 0, 2, 1);
    log.push(Entry::Link {
        dir: ROOT,
        name: "l".into(),
        ino: 2,
    });
    create(&mut log, ROOT, "b", 3);
    log.push(Entry::Rename {
        from_dir: ROOT,
        from: "a".into(),
        to_dir: ROOT,
        to: "b".into(),
        ino: 2,
        victim: Some(3),
    });
    fsync(&mut log, 2);
    let r = recovered(
        &[(ROOT, "l", 2), (ROOT, "b", 2)],
        vec![(2, content(2, &[1, 1]))],
    );
    assert_clean(&check(&log, &r, FsyncRule::Global));
    // The other inode's data under a name of this one is garbage.
    let r = recovered(
        &[(ROOT, "l", 2), (ROOT, "b", 2)],
        vec![(2, content(3, &[1, 1]))],
    );
    assert_eq!(check(&log, &r, FsyncRule::Global).garbage_blocks_exposed, 1);
}

/// fsync promises the data of writes that returned before its call began. A write
/// that returned first may still be logged after the fsync's start (its thread takes
/// the log's lock afterwards): the stamps say which came first.
#[test]
fn an_fsync_covers_a_write_that_returned_before_its_call_though_logged_after_its_start() {
    let build = |before_the_call: bool| {
        let mut log = Log::new();
        create(&mut log, ROOT, "f", 2);
        let start = log.len();
        let returned = stamp();
        let id = log.start_barrier(Barrier::Fsync(2));
        log.push(Entry::Write {
            ino: 2,
            sector: 0,
            sectors: 8,
            ver: 1,
            start,
            ok: true,
            done: if before_the_call { returned } else { stamp() },
        });
        log.ack_barrier(id);
        log
    };
    let r = |vers: &[u64]| recovered(&[(ROOT, "f", 2)], vec![(2, content(2, vers))]);
    let v = check(&build(true), &r(&[]), FsyncRule::Inode);
    assert_eq!(v.fsynced_bytes_lost, 8 * 512, "{v:#?}");
    assert_clean(&check(&build(true), &r(&[1; 8]), FsyncRule::Inode));
    // Racing with the call: it may or may not be there.
    assert_clean(&check(&build(false), &r(&[]), FsyncRule::Inode));
    assert_clean(&check(&build(false), &r(&[1; 8]), FsyncRule::Inode));
}

/// fsync of a directory (logged as an fsync of its inode) makes its entries durable:
/// a create in it that completed before the call must be there.
#[test]
fn a_directory_fsync_covers_the_entries_made_in_it() {
    let mut log = Log::new();
    log.push(Entry::Create {
        dir: ROOT,
        name: "d".into(),
        ino: 2,
        is_dir: true,
    });
    create(&mut log, 2, "f", 3);
    fsync(&mut log, 2);
    let dir_only = Recovered {
        entries: [(ROOT, "d".to_string(), 2, true)].into_iter().collect(),
        files: Default::default(),
    };
    let v = check(&log, &dir_only, FsyncRule::Inode);
    assert_eq!(v.fsynced_ops_lost, 1, "{v:#?}");
    let mut both = dir_only.clone();
    both.entries.insert((2, "f".to_string(), 3, false));
    both.files.insert(3, Vec::new());
    assert_clean(&check(&log, &both, FsyncRule::Inode));
}

#[test]
fn a_write_that_failed_may_show_but_is_never_required() {
    let mut log = one_fsynced_file();
    let start = log.len();
    log.push(Entry::Write {
        ino: 2,
        sector: 0,
        sectors: 12,
        ver: 2,
        start,
        ok: false,
        done: 0,
    });
    fsync(&mut log, 2);
    for vers in [
        [1u64; 8].to_vec(),
        vec![2; 12],
        vec![2, 1, 2, 1, 1, 1, 1, 1, 0, 2],
    ] {
        let r = recovered(&[(ROOT, "f", 2)], vec![(2, content(2, &vers))]);
        assert_clean(&check(&log, &r, FsyncRule::Global));
    }
}

// ---------------------------------------------------------------------------------
// Real cuts.

fn small(cuts: u64, rule: FsyncRule) -> CrashOpts {
    CrashOpts {
        cuts,
        seed: 11,
        ops: 300,
        rule,
        ..CrashOpts::default()
    }
}

#[test]
fn real_cuts_run_mount_and_check() {
    // What holds of the library as it is: every cut mounts, fsck is clean, the tree is
    // a prefix, nothing hangs, and the figures add up.
    let s = wbstack_cli::crashtest::run(&small(4, FsyncRule::Inode)).unwrap();
    assert_eq!(s.cuts, 4);
    assert_eq!(
        (
            s.mount_failures,
            s.fsck_errors,
            s.namespace_not_prefix,
            s.hangs
        ),
        (0, 0, 0, 0),
        "{s:#?}"
    );
    assert!(s.ops > 0 && s.fsyncs_acked > 0);
    assert_eq!(s.failed_cuts as usize, s.failures.len());
    let modes = &s.landed;
    assert_eq!(
        modes.mode_io
            + modes.mode_now
            + modes.mode_fsync
            + modes.mode_journal
            + modes.mode_checkpoint
            + modes.mode_end,
        4
    );
}

#[test]
fn cuts_run_in_parallel_are_reported_in_cut_order() {
    let s = wbstack_cli::crashtest::run(&CrashOpts {
        jobs: 3,
        ..small(6, FsyncRule::Inode)
    })
    .unwrap();
    assert_eq!(s.cuts, 6);
    assert_eq!(s.failed_cuts, 0, "{:#?}", s.failures);
    assert_eq!(s.hangs, 0);
}

#[test]
fn ten_cuts_pass_with_zeros() {
    let s = wbstack_cli::crashtest::run(&small(10, FsyncRule::Inode)).unwrap();
    assert_eq!(s.failed_cuts, 0, "{:#?}", s.failures);
    assert_eq!(
        (
            s.fsynced_bytes_lost,
            s.garbage_blocks_exposed,
            s.fsck_errors
        ),
        (0, 0, 0)
    );
}

#[test]
fn a_broken_ordering_fails_cuts_and_their_replay_files_fail_the_same_way() {
    // The test-only switch: the device drops PREFLUSH, so a commit no longer makes the
    // data before it durable and fsynced data is lost at a cut.
    let dir = tempfile::tempdir().unwrap();
    let o = CrashOpts {
        save_dir: Some(dir.path().to_path_buf()),
        drop_preflush: true,
        ..small(6, FsyncRule::Inode)
    };
    let s = wbstack_cli::crashtest::run(&o).unwrap();
    assert!(s.failed_cuts > 0, "dropping PREFLUSH must fail some cut");
    // A cut whose first life passed and whose second failed has no replay file (it
    // rebuilds the first life only).
    let (replayable, second_only): (Vec<_>, Vec<_>) =
        s.failures.iter().partition(|f| f.replay_file.is_some());
    assert!(second_only.iter().all(|f| f.second_life_failed()));
    assert!(
        !replayable.is_empty(),
        "dropping PREFLUSH must fail some first life"
    );
    for f in replayable {
        let path = f.replay_file.as_ref().expect("partitioned");
        let file = ReplayFile::load(std::path::Path::new(path)).unwrap();
        assert_eq!(file.header.seed, f.seed);
        assert_eq!(file.header.failure, f.reasons());
        // Twice, to show it does not depend on anything but the file.
        for _ in 0..2 {
            let r = file.check().unwrap();
            assert!(r.failed(), "{path}: the replay passed");
            assert_eq!(r.reasons(), f.reasons(), "{path}");
        }
    }
    let first = s.failures.iter().find_map(|f| f.replay_file.as_ref());
    let out = wbstack(&["crashtest", "--replay", first.expect("checked above")]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("replayed: FAIL"), "{text}");
}

#[test]
fn a_damaged_replay_file_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.replay");
    for (bytes, says) in [
        (b"NOTAREPLAYFILE".to_vec(), "wrong magic"),
        (b"WBREPLAY".to_vec(), "ends inside the version"),
        (
            [
                &b"WBREPLAY"[..],
                &1u32.to_le_bytes(),
                &u64::MAX.to_le_bytes(),
            ]
            .concat(),
            "longer than the file",
        ),
        (
            [
                &b"WBREPLAY"[..],
                &1u32.to_le_bytes(),
                &2u64.to_le_bytes(),
                b"{}",
            ]
            .concat(),
            "does not parse",
        ),
        (
            [&b"WBREPLAY"[..], &9u32.to_le_bytes()].concat(),
            "version 9",
        ),
    ] {
        std::fs::write(&path, &bytes).unwrap();
        let err = ReplayFile::load(&path).err().expect("a damaged file loads");
        assert!(err.contains(says), "{err}");
        let out = wbstack(&["crashtest", "--replay", path.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&out.stderr).contains(says));
    }
}

#[test]
fn cut_plans_are_a_function_of_the_seed() {
    use wbstack_cli::crashtest::CutPlan;
    let a = format!("{:?}", CutPlan::new(5, 3000));
    assert_eq!(a, format!("{:?}", CutPlan::new(5, 3000)));
    let modes: std::collections::BTreeSet<String> = (0..200)
        .map(|s| format!("{:?}", CutPlan::new(s, 3000).mode))
        .collect();
    assert_eq!(modes.len(), 6, "every placement is used: {modes:?}");
}

fn sim(q: &Arc<RequestQueue>) -> &SimDevice {
    q.device().as_any().downcast_ref::<SimDevice>().unwrap()
}

/// No periodic writeback or commit: the test decides when things happen.
/// Ordered data: the volumes here reproduce ordered-data bugs crashtest found (data
/// written home before the commit that needs it). Journaled data, the default for
/// small fsyncs, keeps an fsynced page under writeback until its home write, and has
/// its own tests (`the_workload_takes_the_journaled_data_path_and_cuts_pass`, fs_jdata).
fn quiet() -> MountOptions {
    let mut o = MountOptions::default();
    o.wb.dirty_writeback_centisecs = 0;
    o.commit_interval_ms = 3_600_000;
    o.journal_data_kb = 0;
    o
}

fn fresh(spec: &str) -> (Arc<RequestQueue>, Volume) {
    let q = RequestQueue::open(spec, QueueConfig::default()).unwrap();
    Volume::mkfs(&q, &MkfsOptions::default()).unwrap();
    let v = Volume::mount(q.clone(), quiet()).unwrap();
    (q, v)
}

/// Power cut (nothing torn), crash, reboot, fsck, mount; with fsck's notes (where
/// replay stopped, and why).
fn cut_and_remount(q: &Arc<RequestQueue>, v: Volume) -> (Volume, Vec<String>) {
    sim(q).power_cut(false);
    v.crash();
    sim(q).reboot();
    let r = fsck(q);
    assert!(r.is_clean(), "{r:#?}");
    (Volume::mount(q.clone(), quiet()).unwrap(), r.notes)
}

/// Found by crashtest: a commit with no records (a cache flush for fsync) consumed a
/// transaction id without writing it, so replay stopped at the gap (fixed in 23f9d19).
#[test]
fn a_flush_only_commit_does_not_end_the_journal() {
    let (q, v) = fresh("sim:ssd,size=64M");
    let a = v.create("/a").unwrap();
    a.write_at(0, &[1u8; 8192]).unwrap();
    a.fsync().unwrap();
    // An overwrite in place stamps /a's mtime into the running transaction; fsync of
    // another file commits that transaction before /a's data is written.
    a.write_at(0, &[2u8; 4096]).unwrap();
    let z = v.create("/z").unwrap();
    z.fsync().unwrap();
    // Now /a's data is written after its last commit: fsync needs only a cache flush,
    // and the committer makes it an empty "transaction".
    a.fsync().unwrap();
    let b = v.create("/b").unwrap();
    b.fsync().unwrap();
    drop((a, z, b));
    let (v, notes) = cut_and_remount(&q, v);
    assert!(v.stat("/z").is_ok());
    assert!(
        v.stat("/b").is_ok(),
        "/b was created and fsynced before the cut; fsck: {notes:?}"
    );
    let f = v.open("/a", &OpenOptions::read()).unwrap();
    let mut buf = vec![0u8; 4096];
    f.read_at(0, &mut buf).unwrap();
    assert_eq!(buf, vec![2u8; 4096], "/a's fsynced overwrite");
}

fn read_all(v: &Volume, path: &str) -> Vec<u8> {
    let f = v.open(path, &OpenOptions::read()).unwrap();
    let mut buf = vec![0u8; f.size() as usize];
    assert_eq!(f.read_at(0, &mut buf).unwrap(), buf.len());
    buf
}

#[test]
fn a_durable_truncate_and_extension_reads_zeros_past_the_cut() {
    let (q, v) = fresh("sim:ssd,size=64M");
    let a = v.create("/a").unwrap();
    a.write_at(0, &[1u8; 8192]).unwrap();
    a.fsync().unwrap();
    a.set_len(1024).unwrap();
    a.set_len(8192).unwrap();
    // fsync of another file commits the running transaction (both truncates of /a)
    // without writing /a's pages.
    let z = v.create("/z").unwrap();
    z.fsync().unwrap();
    drop((a, z));
    let (v, _) = cut_and_remount(&q, v);
    let got = read_all(&v, "/a");
    assert_eq!(got.len(), 8192, "both truncates were committed");
    assert!(got[..1024].iter().all(|&b| b == 1));
    let stale = got[1024..].iter().filter(|&&b| b != 0).count();
    assert_eq!(
        stale, 0,
        "{stale} bytes past the truncation point show the data truncated away"
    );
}

#[test]
fn an_uncommitted_truncate_does_not_zero_fsynced_data() {
    // A cache-less device: a completed write is durable, so the zeroed block reaches the
    // media as soon as writeback writes it.
    let (q, v) = fresh("sim:ssd,size=64M,wc=0");
    let a = v.create("/a").unwrap();
    a.write_at(0, &[1u8; 8192]).unwrap();
    a.fsync().unwrap();
    a.set_len(1024).unwrap(); // not committed: no fsync, no periodic commit
    v.bdi().start_writeback().wait().unwrap();
    let t0 = std::time::Instant::now();
    while v.cache().nr_writeback() > 0 {
        assert!(t0.elapsed().as_secs() < 10, "writeback never completed");
        std::thread::yield_now();
    }
    drop(a);
    let (v, notes) = cut_and_remount(&q, v);
    let got = read_all(&v, "/a");
    assert_eq!(got.len(), 8192, "the truncate was not committed: {notes:?}");
    let zeroed = got.iter().filter(|&&b| b != 1).count();
    assert_eq!(
        zeroed, 0,
        "{zeroed} fsynced bytes read as zeros though the truncate never happened"
    );
}

#[test]
fn fsync_covers_the_files_own_namespace_operations() {
    // The contract (ext4's, POSIX's): fsync makes the file's data and metadata durable,
    // with the namespace operations it took part in (its creation, its renames), and
    // whatever shared their transaction; not unrelated later operations on other files.
    let (q, v) = fresh("sim:ssd,size=64M");
    let a = v.create("/a").unwrap();
    a.write_at(0, &[1u8; 4096]).unwrap();
    a.fsync().unwrap();
    v.rename("/a", "/a2").unwrap();
    v.create("/b").unwrap();
    // /a's inode changed in the rename: its fsync commits it (and /b's creation, which
    // came first in the same transaction).
    a.fsync().unwrap();
    v.mkdir("/d", 0o755).unwrap();
    // /a has not changed since: nothing of it is left to commit, so this fsync does not
    // make /d durable (an fsync of /d's parent directory would).
    a.fsync().unwrap();
    drop(a);
    let (v, notes) = cut_and_remount(&q, v);
    assert!(
        v.stat("/a2").is_ok() && v.stat("/b").is_ok(),
        "fsck: {notes:?}"
    );
    assert!(v.stat("/a").is_err(), "the rename is durable");
}

/// Completions of requests sent straight to a device.
#[derive(Default)]
struct Collector {
    done: Mutex<Vec<(Request, BlkResult)>>,
    cv: Condvar,
}

impl RqComplete for Collector {
    fn complete(&self, rq: Request, status: BlkResult) {
        self.done.lock().push((rq, status));
        self.cv.notify_all();
    }
}

impl Collector {
    /// The next completion, waiting at most 10 s.
    fn next(&self) -> (Request, BlkResult) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut g = self.done.lock();
        while g.is_empty() {
            assert!(
                !self.cv.wait_until(&mut g, deadline).timed_out(),
                "a request never completed"
            );
        }
        g.remove(0)
    }
}

fn rq_write(sector: u64, data: &[u8], flags: BioFlags) -> Request {
    Request::from_bio(
        Bio::write(sector, IoBuf::from_slice(data)).with_flags(flags),
        1,
    )
}

/// Found by crashtest: a torn power cut persisted sectors of an in-flight PREFLUSH write
/// whose flush never ran, while the writes that flush covered were torn (fixed in
/// f81f245: the sim honours PREFLUSH when the write enters the device).
#[test]
fn a_preflush_write_persists_nothing_before_its_flush() {
    let mut broken = Vec::new();
    for seed in 1..=8u64 {
        let d: DeviceRef =
            dev::open(&format!("sim:ssd,size=16M,seed={seed}"), RealClock::new()).unwrap();
        let sim = d.as_any().downcast_ref::<SimDevice>().unwrap();
        let c = Arc::new(Collector::default());
        let done: Completer = c.clone();
        // A data write completes into the device's volatile cache...
        let data = vec![0xd5u8; 4096];
        d.queue_rq(rq_write(0, &data, BioFlags::empty()), &done);
        assert_eq!(c.next().1, Ok(()));
        // ...then a commit (PREFLUSH|FUA) is inside the device when the power goes.
        let commit = vec![0xc3u8; 4096];
        sim.hold(true);
        d.queue_rq(
            rq_write(1024, &commit, BioFlags::PREFLUSH | BioFlags::FUA),
            &done,
        );
        sim.power_cut(true);
        assert_eq!(c.next().1, Err(BlkError::PowerLoss));
        sim.hold(false);
        sim.reboot();
        let read = |sector: u64| {
            d.queue_rq(Request::from_bio(Bio::read(sector, 4096), 1), &done);
            let (rq, st) = c.next();
            st.unwrap();
            let bytes = rq.buffers().next().unwrap().as_slice().to_vec();
            bytes
        };
        let (got_data, got_commit) = (read(0), read(1024));
        let commit_landed = got_commit.chunks(512).any(|s| s == &commit[..512]);
        let data_whole = got_data == data;
        // The flush precedes the write's data: if any of the commit reached the media,
        // the flush was done and the data write before it is durable in full.
        if commit_landed && !data_whole {
            broken.push(seed);
        }
    }
    assert!(
        broken.is_empty(),
        "seeds {broken:?}: sectors of the PREFLUSH write persisted, the data before its flush did not"
    );
}

#[test]
fn sync_is_not_failed_by_a_file_deleted_meanwhile() {
    let q = RequestQueue::open("sim:ssd,size=64M", QueueConfig::default()).unwrap();
    Volume::mkfs(&q, &MkfsOptions::default()).unwrap();
    let v = Arc::new(Volume::mount(q.clone(), MountOptions::default()).unwrap());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churn = {
        let (v, stop) = (v.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let p = format!("/f{}", i % 8);
                let f = v.create(&p).unwrap();
                f.write_at(0, &vec![7u8; 65536]).unwrap();
                v.unlink(&p).unwrap();
                drop(f); // last close of an unlinked file: deleted, dirty pages and all
                i += 1;
            }
        })
    };
    let mut failures = Vec::new();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(3) && failures.len() < 3 {
        if let Err(e) = v.sync() {
            failures.push(e.to_string());
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    churn.join().unwrap();
    assert!(failures.is_empty(), "sync failed: {failures:?}");
}

// ---------------------------------------------------------------------------------
// The command line.

fn wbstack(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_wbstack"))
        .args(args)
        .output()
        .expect("run wbstack")
}

#[test]
fn bad_flags_are_clear_errors() {
    for (args, says) in [
        (vec!["--device", "null"], "sim:ssd or sim:hdd"),
        (vec!["--device", "sim:ssd,cut_after=3"], "cut_after"),
        (vec!["--device", "sim:ssd,seed=4"], "--seed"),
        (vec!["--device", "sim:ssd,data=0"], "data=1"),
        (vec!["--device", "sim:ssd,bogus=1"], "bogus"),
        (vec!["--cuts", "0"], "--cuts"),
        (vec!["--threads", "0"], "--threads"),
        (vec!["--jobs", "0"], "--jobs"),
        (vec!["--ops", "0"], "--ops"),
        (vec!["--fsync-rule", "sometimes"], "global or inode"),
        (vec!["-o", "nonsense=1"], "nonsense"),
    ] {
        let mut a = vec!["crashtest"];
        a.extend(&args);
        let out = wbstack(&a);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

#[test]
fn json_has_the_figures_and_the_exit_code_follows_them() {
    let out = wbstack(&[
        "crashtest",
        "--cuts",
        "2",
        "--ops",
        "200",
        "--seed",
        "3",
        "--save-dir",
        std::env::temp_dir().to_str().unwrap(),
        "--json",
    ]);
    let v = json_of(&out);
    for k in [
        "cuts",
        "fsynced_bytes_lost",
        "garbage_blocks_exposed",
        "fsck_errors",
        "mount_failures",
        "fsynced_ops_lost",
        "failed_cuts",
        "landed",
    ] {
        assert!(!v[k].is_null(), "{k} missing: {v}");
    }
    assert_eq!(v["cuts"], 2);
    let failed = v["failed_cuts"].as_u64().unwrap();
    assert_eq!(out.status.code(), Some(if failed > 0 { 1 } else { 0 }));
    // Progress went to stderr, one line per cut.
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        err.lines().filter(|l| l.starts_with('[')).count(),
        2,
        "{err}"
    );
}

#[test]
fn a_cut_during_syncs_plug_flush_does_not_deadlock() {
    let (q, v) = fresh("sim:ssd,size=64M");
    let v = Arc::new(v);
    // B is dirtied first, so sync's pass visits it first and leaves its write in the
    // pass's plug.
    let b = v.create("/b").unwrap();
    b.write_at(0, &[2u8; 4096]).unwrap();
    let a = Arc::new(v.create("/a").unwrap());
    a.write_at(0, &[1u8; 4096]).unwrap();
    // A's page goes under writeback and stays inside the device...
    sim(&q).hold(true);
    let fsync = {
        let a = a.clone();
        std::thread::spawn(move || a.fsync())
    };
    let t0 = Instant::now();
    while sim(&q).pending() == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "A's write never reached the device"
        );
        std::thread::yield_now();
    }
    // ...and is dirtied again, so sync must wait for that write before writing it anew.
    a.write_at(0, &[3u8; 4096]).unwrap();
    // The next request into the device cuts the power: B's, when sync flushes its plug
    // in A's wait; the cut completes every request in flight, A's included, inline.
    sim(&q).power_cut_after(1, true);
    let (tx, rx) = std::sync::mpsc::channel();
    {
        let v = v.clone();
        std::thread::spawn(move || {
            let _ = tx.send(v.sync().is_err());
        });
    }
    let synced = rx.recv_timeout(Duration::from_secs(10));
    assert!(
        synced.is_ok(),
        "sync() did not return within 10 s after the power cut (deadlock)"
    );
    assert!(fsync.join().unwrap().is_err(), "A's write was cut");
    drop(b);
}

/// ftruncate(`path`, 0) through a handle of its own, on another thread.
fn truncate_to_zero_in_a_thread(
    v: &Arc<Volume>,
    path: &'static str,
) -> std::thread::JoinHandle<wbstack::fs::FsResult<()>> {
    let v = v.clone();
    std::thread::spawn(move || v.open(path, &OpenOptions::read_write())?.set_len(0))
}

/// Found by crashtest (seed 3411, replayed from its file): a truncation to zero made
/// while an fsync of an extending write was in flight left, after a cut, the file as it
/// was before the write: neither the fsynced size nor empty.
#[test]
fn a_truncation_to_zero_during_an_fsync_keeps_the_fsynced_write_or_the_truncation() {
    for round in 0..12u64 {
        let (q, v) = fresh("sim:ssd,size=64M");
        let v = Arc::new(v);
        let f = Arc::new(v.create("/f").unwrap());
        f.write_at(0, &vec![1u8; 43 * 512]).unwrap();
        f.fsync().unwrap();
        f.write_at(34 * 512, &vec![2u8; 15 * 512]).unwrap();
        sim(&q).hold(true);
        let fs = {
            let f = f.clone();
            std::thread::spawn(move || f.fsync())
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while sim(&q).pending() == 0 {
            assert!(Instant::now() < deadline, "the fsync sent nothing");
            std::thread::yield_now();
        }
        let tr = truncate_to_zero_in_a_thread(&v, "/f");
        // Let the truncation reach its wait on the held writes (or not: both orders
        // are tried across rounds).
        for _ in 0..round * 50 {
            std::thread::yield_now();
        }
        sim(&q).hold(false);
        fs.join().unwrap().unwrap();
        tr.join().unwrap().unwrap();
        drop(f);
        let v = Arc::try_unwrap(v).ok().unwrap();
        let (v, _) = cut_and_remount(&q, v);
        let got = read_all(&v, "/f");
        let mut want = vec![1u8; 49 * 512];
        want[34 * 512..].fill(2);
        assert!(
            got.is_empty() || got == want,
            "round {round}: {} bytes after the cut, neither 0 nor the fsynced {}",
            got.len(),
            want.len()
        );
    }
}

// ---------------------------------------------------------------------------------
// Every crash state of a write log (crashtest --states).

#[test]
fn every_crash_state_of_each_workload_keeps_what_was_acknowledged() {
    use wbstack_cli::crashtest::{run_states, StatesOpts, WORKLOADS};
    // 180 seeds of the random workload bring the run past 10,000 states (140 did
    // while every commit flushed; commits without PREFLUSH merge windows, and a
    // larger window is sampled, not enumerated).
    let s = run_states(&StatesOpts {
        random_seeds: 180,
        ..StatesOpts::default()
    })
    .unwrap();
    let failed: Vec<&String> = s.workloads.iter().flat_map(|w| &w.failed).collect();
    assert_eq!(s.failures, 0, "{failed:#?}");
    assert!(s.states >= 10_000, "only {} states", s.states);
    assert_eq!(s.workloads.len(), WORKLOADS.len());
    for w in &s.workloads {
        assert!(w.states > 0 && w.flushes > 0, "{w:?}");
    }
}

#[test]
fn every_crash_state_with_journaled_data_keeps_what_was_acknowledged() {
    use wbstack_cli::crashtest::{run_states, StatesOpts, WORKLOADS};
    // The same workloads with small fsyncs carrying their data in the commit: states
    // where the commit is durable and the home write is not, and the reverse.
    let s = run_states(&StatesOpts {
        random_seeds: 32,
        journal_data_kb: 64,
        ..StatesOpts::default()
    })
    .unwrap();
    let failed: Vec<&String> = s.workloads.iter().flat_map(|w| &w.failed).collect();
    assert_eq!(s.failures, 0, "{failed:#?}");
    assert_eq!(s.workloads.len(), WORKLOADS.len());
    assert!(s.states >= 1_500, "only {} states", s.states);
}

#[test]
fn a_dropped_preflush_fails_crash_states_and_their_replay_files_fail_too() {
    use wbstack_cli::crashtest::{run_states, StatesOpts};
    let dir = tempfile::tempdir().unwrap();
    let s = run_states(&StatesOpts {
        workloads: vec!["fdatasync-extend".into(), "punch-hole".into()],
        drop_preflush: true,
        save_dir: Some(dir.path().to_path_buf()),
        ..StatesOpts::default()
    })
    .unwrap();
    for w in &s.workloads {
        assert!(w.failures > 0, "{}: no state failed", w.workload);
    }
    let mut replayed = 0;
    for e in std::fs::read_dir(dir.path()).unwrap() {
        let file = ReplayFile::load(&e.unwrap().path()).unwrap();
        let r = file.check().unwrap();
        assert!(r.failed());
        assert_eq!(r.reasons(), file.header.failure);
        replayed += 1;
    }
    assert!(replayed > 0);
}

#[test]
fn an_unknown_workload_is_a_clear_error() {
    let out = wbstack(&["crashtest", "--states", "--workload", "nope"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("no workload 'nope'") && err.contains("rename-over"),
        "{err}"
    );
}

/// Found by crashtest on sim:hdd (seed 763, replayed from its file): a truncation to a
/// partial last block journals the cut and rewrites that block's head to a new block,
/// ordered before the commit; a truncation to zero right after, deferred, dropped the
/// head's write, so the commit went out with the cut and without the head: the file
/// kept its size with zeros where its fsynced head was.
#[test]
fn a_truncation_to_zero_after_a_partial_block_truncation_keeps_the_head_or_empties_the_file() {
    for round in 0..8u64 {
        let (q, v) = fresh("sim:ssd,size=64M");
        let v = Arc::new(v);
        let f = v.create("/f").unwrap();
        let old: Vec<u8> = (0..64 * 512).map(|i| (i % 251) as u8).collect();
        f.write_at(0, &old).unwrap();
        f.fsync().unwrap();
        // The head write of the cut block (5 blocks and 3 sectors) stays in the device
        // while the truncation to zero runs, in some rounds past the cut's own return.
        sim(&q).hold(true);
        f.set_len(5 * 4096 + 3 * 512).unwrap();
        let tr = truncate_to_zero_in_a_thread(&v, "/f");
        for _ in 0..round * 40 {
            std::thread::yield_now();
        }
        sim(&q).hold(false);
        tr.join().unwrap().unwrap();
        // A commit for another file's fsync: it carries whatever the running
        // transaction holds of /f, without resolving /f's deferred truncation.
        let z = v.create("/z").unwrap();
        z.fsync().unwrap();
        drop((f, z));
        let v = Arc::try_unwrap(v).ok().unwrap();
        let (v, _) = cut_and_remount(&q, v);
        let got = read_all(&v, "/f");
        assert!(
            got.is_empty() || got[..] == old[..got.len()],
            "round {round}: {} bytes after the cut, not a prefix of the fsynced content (zeros: {})",
            got.len(),
            got.iter().filter(|&&b| b == 0).count()
        );
    }
}

#[test]
fn the_workload_takes_the_journaled_data_path_and_cuts_pass() {
    // crashtest mounts with journal_data_kb=64: small fsyncs carry their data in the
    // commit, larger ones take ordered data; both are cut and checked.
    let s = wbstack_cli::crashtest::run(&small(6, FsyncRule::Inode)).unwrap();
    assert_eq!(s.failed_cuts, 0, "{:#?}", s.failures);
    assert!(
        s.journal_data_fsyncs > 0 && s.journal_data_fsyncs < s.fsyncs_acked + s.fdatasyncs_acked,
        "{} of {} fsyncs journaled their data",
        s.journal_data_fsyncs,
        s.fsyncs_acked + s.fdatasyncs_acked
    );
    let off = wbstack_cli::crashtest::run(&CrashOpts {
        mount_opts: "journal_data_kb=0".into(),
        ..small(3, FsyncRule::Inode)
    })
    .unwrap();
    assert_eq!(off.failed_cuts, 0, "{:#?}", off.failures);
    assert_eq!(off.journal_data_fsyncs, 0);
}

/// Format 5 (the metadata tree, written copy-on-write at checkpoints, read on demand):
/// power cuts with checkpoints in flight lose nothing fsynced, expose no garbage, and
/// recover clean.
#[test]
fn power_cuts_on_the_metadata_tree_lose_nothing_promised() {
    // A small inode cache: inodes leave memory and come back between the cuts.
    tree_cuts_lose_nothing("700", "format=5,inode_cache=8");
}

/// 24 cuts of crashtest with `options`: none fails.
fn tree_cuts_lose_nothing(seed: &str, options: &str) {
    let out = wbstack(&[
        "crashtest",
        "--cuts",
        "24",
        "--jobs",
        "2",
        "--seed",
        seed,
        "-o",
        options,
        "--save-dir",
        std::env::temp_dir().to_str().unwrap(),
        "--json",
    ]);
    let v = json_of(&out);
    assert_eq!(v["failed_cuts"].as_u64(), Some(0), "{v}");
    assert_eq!(v["cuts"].as_u64(), Some(24), "{v}");
    assert!(out.status.success(), "{v}");
}

/// The same with every directory read back unlisted (`dir_listed_max=0`: its names
/// read one hash at a time, removals kept absent until durable): replay into such
/// directories after a cut loses nothing and brings no removed name back.
#[test]
fn power_cuts_on_unlisted_directories_lose_nothing_promised() {
    tree_cuts_lose_nothing("701", "format=5,inode_cache=8,dir_listed_max=0");
}

/// The command's stdout as JSON, or a panic showing both streams.
fn json_of(out: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}
