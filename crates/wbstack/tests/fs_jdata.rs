//! Journaled data (`fs::jdata`, mount option `journal_data_kb`): a small fsync carries
//! its data in the commit, one device write. Replay of journaled data blocks: whole,
//! torn, with a checksum mismatch, stale after a later ordered write of the same block
//! (revoked), and home before a checkpoint forgets the journal.

mod common;

use std::sync::Arc;
use wbstack::block::{BioFlags, RequestQueue};
use wbstack::buf::IoBuf;
use wbstack::fs::format::*;
use wbstack::fs::{MountOptions, OpenOptions, Volume};

fn jopts(kb: u64) -> MountOptions {
    let mut o = common::quiet();
    o.journal_data_kb = kb;
    o
}

fn pattern(tag: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ tag ^ (i / 4096) as u8)
        .collect()
}

fn read_all(v: &Volume, path: &str) -> Vec<u8> {
    let f = v.open(path, &OpenOptions::read()).unwrap();
    let mut b = vec![0u8; f.size() as usize];
    let n = f.read_at(0, &mut b).unwrap();
    b.truncate(n);
    b
}

/// Cut the power (unflushed writes are lost: a home write not yet made durable by a
/// later flush is gone, only the journal holds the data), then mount again.
fn cut(q: &Arc<RequestQueue>, v: Volume) {
    common::sim(q).power_cut(false);
    v.crash();
    common::sim(q).reboot();
}

fn wait_home(v: &Volume, path: &str) {
    let m = v.mapping_of(path).unwrap();
    let t0 = std::time::Instant::now();
    while m.nr_writeback() > 0 {
        assert!(t0.elapsed().as_secs() < 10, "the home write never ended");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// The transactions in the journal area after a cut, with their first journal block.
fn journal_txns(q: &Arc<RequestQueue>) -> Vec<(u64, Txn, usize)> {
    let sb = Superblock::decode(q.read_sync(0, 4096).unwrap().as_slice()).unwrap();
    let all = q
        .read_sync(sb.journal_start * 8, (sb.journal_blocks * 4096) as usize)
        .unwrap();
    let all = all.as_slice();
    let mut out = Vec::new();
    let mut pos = 0usize;
    while pos < all.len() {
        match Txn::decode(&all[pos..]) {
            Ok((t, used)) => {
                out.push(((pos / 4096) as u64, t, used));
                pos += used;
            }
            Err(_) => pos += 4096,
        }
    }
    out
}

/// A file `a` created and made durable empty, then `data` written and fsynced through
/// the journaled path; the power is cut before anything else (the home write is lost).
/// Returns the journal block and length of the transaction carrying the data.
fn journaled_then_cut(q: &Arc<RequestQueue>, data: &[u8]) -> (u64, usize) {
    let v = Volume::mount(q.clone(), jopts(64)).unwrap();
    let f = v.create("/a").unwrap();
    f.fsync().unwrap();
    let sim_before = common::sim(q).stats();
    f.write_at(0, data).unwrap();
    f.fsync().unwrap();
    let sim_after = common::sim(q).stats();
    assert_eq!(
        sim_after.fua_writes,
        sim_before.fua_writes + 1,
        "one FUA write: the commit"
    );
    cut(q, v);
    let txns = journal_txns(q);
    let (pos, _, used) = txns
        .iter()
        .find(|(_, t, _)| {
            t.records.iter().any(
                |r| matches!(r, Record::DataBlock { data: d, .. } if d.as_slice() == &data[..4096]),
            )
        })
        .expect("a transaction carrying the data");
    (*pos, *used)
}

#[test]
fn a_small_fsync_is_one_write_and_its_data_is_replayed_home() {
    let q = common::queue("sim:ssd,size=64M");
    Volume::mkfs(&q, &Default::default()).unwrap();
    let data = pattern(1, 3 * 4096 + 100);
    journaled_then_cut(&q, &data);
    let v = Volume::mount(q.clone(), jopts(64)).unwrap();
    assert_eq!(read_all(&v, "/a"), data);
    assert!(v.check().is_empty(), "{:?}", v.check());
    // Mount wrote it home and checkpointed: it is there after a second cut too.
    cut(&q, v);
    let v = Volume::mount(q.clone(), jopts(0)).unwrap();
    v.drop_cache("/a").unwrap();
    assert_eq!(read_all(&v, "/a"), data);
    v.unmount().unwrap();
}

#[test]
fn a_torn_journaled_transaction_is_dropped_whole() {
    let q = common::queue("sim:ssd,size=64M");
    let sb = Volume::mkfs(&q, &Default::default()).unwrap();
    let data = pattern(2, 8192);
    let (pos, used) = journaled_then_cut(&q, &data);
    // Tear it: its last block never reached the disk.
    let last = sb.journal_start + pos + used as u64 / 4096 - 1;
    q.write_sync(last * 8, IoBuf::zeroed(4096), BioFlags::FUA)
        .unwrap();
    let v = Volume::mount(q.clone(), jopts(64)).unwrap();
    assert_eq!(v.stat("/a").unwrap().size, 0, "neither data nor size");
    assert!(v.check().is_empty(), "{:?}", v.check());
    v.unmount().unwrap();
}

#[test]
fn journaled_data_failing_its_own_checksum_is_dropped() {
    let q = common::queue("sim:ssd,size=64M");
    let sb = Volume::mkfs(&q, &Default::default()).unwrap();
    let data = pattern(3, 4096);
    let (pos, used) = journaled_then_cut(&q, &data);
    let at = (sb.journal_start + pos) * 8;
    let mut t = q.read_sync(at, used).unwrap().as_slice().to_vec();
    // Change one byte of the data and recompute the transaction's CRC, so only the
    // record's own checksum can catch it.
    let off = t
        .windows(64)
        .position(|w| w == &data[..64])
        .expect("the data in the transaction");
    t[off + 100] ^= 0x40;
    let body_len = u32::from_le_bytes(t[TXN_HEADER - 4..TXN_HEADER].try_into().unwrap()) as usize;
    let c = crc(&t[..TXN_HEADER + body_len]);
    t[TXN_HEADER + body_len..TXN_HEADER + body_len + 4].copy_from_slice(&c.to_le_bytes());
    match Txn::decode(&t) {
        Err(FormatError::Checksum { what, .. }) => assert_eq!(what, "journaled data block"),
        other => panic!("expected a data checksum mismatch, got {other:?}"),
    }
    q.write_sync(at, IoBuf::from_slice(&t), BioFlags::FUA)
        .unwrap();
    let v = Volume::mount(q.clone(), jopts(64)).unwrap();
    assert_eq!(v.stat("/a").unwrap().size, 0);
    assert!(v.check().is_empty(), "{:?}", v.check());
    v.unmount().unwrap();
}

/// The block's journaled copy is older than what an ordered write later put in place:
/// replay must not write it back (the revoke).
#[test]
fn a_journaled_copy_is_stale_after_a_later_ordered_write_of_the_same_block() {
    let (q, v) = common::fresh_with("sim:ssd,size=64M", jopts(64));
    let f = v.create("/a").unwrap();
    f.write_at(0, &pattern(4, 4096)).unwrap();
    f.fsync().unwrap();
    wait_home(&v, "/a");
    let blk = v.fiemap("/a").unwrap();
    // The same block, rewritten in place through ordered data.
    v.set_tunable("journal_data_kb", "0").unwrap();
    f.write_at(0, &pattern(5, 4096)).unwrap();
    f.fsync().unwrap();
    assert_eq!(v.fiemap("/a").unwrap(), blk, "overwritten in place");
    drop(f);
    cut(&q, v);
    assert!(journal_txns(&q)
        .iter()
        .any(|(_, t, _)| t.records.iter().any(|r| matches!(r, Record::Revoke { .. }))));
    let v = Volume::mount(q.clone(), jopts(64)).unwrap();
    v.drop_cache("/a").unwrap();
    assert_eq!(read_all(&v, "/a"), pattern(5, 4096));
    v.unmount().unwrap();
}

/// The block of a journaled file, deleted, goes to another file written through
/// ordered data: the old copy must not land in the new file. Format 3 and format 5:
/// in format 5 the tree's nodes may take the block first, and the old copy must not
/// land on them either (their checksums catch it at the mount, `check` and reads).
#[test]
fn a_journaled_copy_is_stale_once_its_block_belongs_to_another_file() {
    for format in [3, 5] {
        journaled_copy_stale_after_reuse(format);
    }
}

fn journaled_copy_stale_after_reuse(format: u32) {
    // A small device, so that a file filling it must take the freed block.
    let q = common::queue("sim:ssd,size=8M");
    let mkfs = wbstack::fs::MkfsOptions {
        format: Some(format),
        ..Default::default()
    };
    Volume::mkfs(&q, &mkfs).unwrap();
    let v = Volume::mount(q.clone(), jopts(64)).unwrap();
    let f = v.create("/a").unwrap();
    f.write_at(0, &pattern(6, 4096)).unwrap();
    f.fsync().unwrap();
    wait_home(&v, "/a");
    let old = v.fiemap("/a").unwrap()[0].1;
    drop(f);
    v.unlink("/a").unwrap();
    v.commit_now().unwrap();
    v.set_tunable("journal_data_kb", "0").unwrap();
    let avail = v.statfs().available as usize;
    let data = pattern(7, avail * 4096);
    let g = v.create("/b").unwrap();
    g.write_at(0, &data).unwrap();
    g.fsync().unwrap();
    drop(g);
    let reused = v
        .fiemap("/b")
        .unwrap()
        .iter()
        .find(|(_, s, l)| (*s..*s + *l).contains(&old))
        .map(|&(fb, s, _)| ((fb + old - s) * 4096) as usize);
    if format == 3 {
        assert!(reused.is_some(), "format 3: the freed block goes to /b");
    }
    // /b is full-size either way: every free block went to it, or to the tree.
    assert_eq!(v.statfs().available, 0, "format {format}");
    cut(&q, v);
    let v = Volume::mount(q.clone(), jopts(64)).unwrap();
    v.drop_cache("/b").unwrap();
    let back = read_all(&v, "/b");
    if let Some(at) = reused {
        assert_eq!(back[at..at + 4096], data[at..at + 4096], "the freed block");
    }
    assert!(back == data, "format {format}");
    assert!(v.check().is_empty(), "format {format}: {:?}", v.check());
    v.unmount().unwrap();
}

/// Many journaled fsyncs fill the journal: checkpoints write the journaled blocks home
/// first, so nothing is lost when the journal starts over.
#[test]
fn journaled_data_is_home_before_a_checkpoint_forgets_the_journal() {
    let (q, v) = common::fresh_with("sim:ssd,size=64M", jopts(64));
    let n = 120;
    for i in 0..n {
        let f = v.create(&format!("/f{i}")).unwrap();
        f.write_at(0, &pattern(i as u8, 8192)).unwrap();
        f.fsync().unwrap();
    }
    assert!(
        v.journal_stats().checkpoints >= 1,
        "{:?}",
        v.journal_stats()
    );
    cut(&q, v);
    let v = Volume::mount(q.clone(), jopts(64)).unwrap();
    for i in 0..n {
        assert_eq!(
            read_all(&v, &format!("/f{i}")),
            pattern(i as u8, 8192),
            "f{i}"
        );
    }
    assert!(v.check().is_empty(), "{:?}", v.check());
    v.unmount().unwrap();
}

/// Rewrites, appends and truncations mixed with journaled fsyncs, on one file, then a
/// cut: the file is what the last fsync saw.
#[test]
fn rewrites_and_truncations_between_journaled_fsyncs() {
    let (q, v) = common::fresh_with("sim:ssd,size=64M", jopts(16));
    let f = v.create("/a").unwrap();
    let mut model: Vec<u8> = Vec::new();
    for round in 0..40u32 {
        let tag = round as u8;
        match round % 5 {
            0 | 1 => {
                let off = (round as usize * 1000) % 12000;
                let d = pattern(tag, 3000);
                f.write_at(off as u64, &d).unwrap();
                if model.len() < off + d.len() {
                    model.resize(off + d.len(), 0);
                }
                model[off..off + d.len()].copy_from_slice(&d);
            }
            2 => {
                let len = model.len() / 2;
                f.set_len(len as u64).unwrap();
                model.truncate(len);
            }
            3 => {
                // Larger than the limit: the ordered path.
                let d = pattern(tag, 20000);
                f.write_at(0, &d).unwrap();
                if model.len() < d.len() {
                    model.resize(d.len(), 0);
                }
                model[..d.len()].copy_from_slice(&d);
            }
            _ => {
                f.set_len(0).unwrap();
                model.clear();
                let d = pattern(tag, 5000);
                f.write_at(0, &d).unwrap();
                model.extend_from_slice(&d);
            }
        }
        f.fsync().unwrap();
    }
    drop(f);
    cut(&q, v);
    let v = Volume::mount(q.clone(), jopts(16)).unwrap();
    assert_eq!(read_all(&v, "/a"), model);
    v.drop_cache("/a").unwrap();
    assert_eq!(read_all(&v, "/a"), model);
    assert!(v.check().is_empty(), "{:?}", v.check());
    v.unmount().unwrap();
}

#[test]
fn the_policy_takes_small_fsyncs_only() {
    let (_q, v) = common::fresh_with("sim:ssd,size=64M", jopts(8));
    assert_eq!(v.tunable("journal_data_kb").unwrap(), "8");
    let f = v.create("/small").unwrap();
    f.write_at(0, &pattern(1, 8192)).unwrap();
    let fua = common::sim(&_q).stats().fua_writes;
    let w = common::sim(&_q).stats().writes;
    f.fsync().unwrap();
    let s = common::sim(&_q).stats();
    assert_eq!((s.fua_writes - fua, s.writes - w >= 1), (1, true));
    wait_home(&v, "/small");
    // Over the limit: data first, then the commit (two writes before fsync returns).
    let g = v.create("/big").unwrap();
    g.write_at(0, &pattern(2, 12288)).unwrap();
    let w = common::sim(&_q).stats().writes;
    g.fsync().unwrap();
    assert!(common::sim(&_q).stats().writes - w >= 2);
    assert!(v.set_tunable("journal_data_kb", "x").is_err());
    v.set_tunable("journal_data_kb", "64k").unwrap();
    assert_eq!(v.tunable("journal_data_kb").unwrap(), "64");
    drop((f, g));
    v.unmount().unwrap();
}

/// `commit_flush=needed` (the default): a small journaled fsync after the last flush
/// is one FUA write and no flush; `always` flushes at every commit. A write completed
/// without FUA since the last flush (ordered data of another file, written back and
/// logged) makes the next commit flush again: after a power cut, the data its extent
/// names is there.
#[test]
fn a_journaled_fsync_flushes_only_when_a_write_completed_since_the_last_flush() {
    for always in [false, true] {
        let q = common::queue("sim:ssd,size=64M");
        Volume::mkfs(&q, &Default::default()).unwrap();
        let mut o = jopts(64);
        o.commit_flush_always = always;
        let v = Volume::mount(q.clone(), o.clone()).unwrap();
        // The first commit flushes whatever mount wrote.
        let f = v.create("/first").unwrap();
        f.write_at(0, &pattern(9, 4096)).unwrap();
        f.fsync().unwrap();
        // The committer sends held-back journaled blocks home once idle for 20 ms (the
        // clock is real here): a test thread stalled that long mid-round lets such a
        // write in, and its completion rightly calls for a flush. That round is run
        // again, with new files, a bounded number of times.
        let mut round = 0;
        let (dev0, j0, dev1, j1) = loop {
            let (dev0, j0) = (common::sim(&q).stats(), v.journal_stats());
            for i in 0..10u8 {
                let f = v.create(&format!("/r{round}f{i}")).unwrap();
                f.write_at(0, &pattern(i, 4096)).unwrap();
                f.fsync().unwrap();
            }
            let (dev1, j1) = (common::sim(&q).stats(), v.journal_stats());
            if dev1.writes == dev0.writes + 10 || round == 5 {
                break (dev0, j0, dev1, j1);
            }
            round += 1;
        };
        assert_eq!(
            j1.data_fsyncs - j0.data_fsyncs,
            10,
            "journaled (always={always})"
        );
        assert_eq!(
            dev1.fua_writes - dev0.fua_writes,
            10,
            "one commit write each"
        );
        let (flushes, unflushed) = if always { (10, 0) } else { (0, 10) };
        assert_eq!(dev1.flushes - dev0.flushes, flushes, "always={always}");
        assert_eq!(
            j1.commits_without_flush - j0.commits_without_flush,
            unflushed,
            "always={always}"
        );
        assert_eq!(
            dev1.writes,
            dev0.writes + 10,
            "no home write yet: held for a batch"
        );

        // Ordered data: too big to journal, written back (a volatile write), its extent
        // logged in the running transaction; a small fsync then commits that extent.
        let big = pattern(7, 128 * 1024);
        let b = v.create("/big").unwrap();
        b.write_at(0, &big).unwrap();
        v.mapping_of("/big")
            .unwrap()
            .write_and_wait(0, u64::MAX)
            .unwrap();
        let before = common::sim(&q).stats();
        let g = v.create("/g").unwrap();
        g.write_at(0, &pattern(11, 4096)).unwrap();
        g.fsync().unwrap();
        let after = common::sim(&q).stats();
        assert_eq!(
            after.flushes - before.flushes,
            1,
            "the extent's data is flushed first"
        );
        // The cut loses every write not flushed: /big's data must have been.
        common::sim(&q).power_cut(false);
        v.crash();
        common::sim(&q).reboot();
        let v = Volume::mount(q.clone(), o).unwrap();
        assert_eq!(read_all(&v, "/big"), big, "always={always}");
        assert_eq!(read_all(&v, "/g"), pattern(11, 4096));
        for i in 0..10u8 {
            let p = format!("/r{round}f{i}");
            assert_eq!(read_all(&v, &p), pattern(i, 4096));
        }
        assert!(v.check().is_empty(), "{:?}", v.check());
        v.unmount().unwrap();
    }
}

/// Dropping a file's cache right after a journaled fsync (its pages under writeback
/// until their home write) waits for that write: the next read finds the data, not
/// the block's old content.
#[test]
fn dropping_the_cache_after_a_journaled_fsync_keeps_what_it_made_durable() {
    let q = common::queue("sim:ssd,size=64M");
    Volume::mkfs(&q, &Default::default()).unwrap();
    let v = Volume::mount(q.clone(), jopts(64)).unwrap();
    let data = pattern(9, 4096);
    let f = v.create("/a").unwrap();
    f.write_at(0, &data).unwrap();
    f.close().unwrap();
    assert!(
        v.drop_cache("/a").unwrap(),
        "the cache of a closed file is dropped"
    );
    assert_eq!(
        v.journal_stats().data_blocks,
        1,
        "the fsync journaled the page"
    );
    assert!(read_all(&v, "/a") == data, "read back after the drop");
    v.unmount().unwrap();
}
