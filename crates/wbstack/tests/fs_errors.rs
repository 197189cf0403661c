//! Writeback errors and durability (issue 6), after xfstests' fsync-err and
//! generic/441: errseq reporting per open file, group commit, async flush,
//! flush-on-close ordering, ENOSPC.

use std::sync::Arc;
use wbstack::block::{QueueConfig, RequestQueue};
use wbstack::dev::sim::SimDevice;
use wbstack::fs::fsck::fsck;
use wbstack::fs::{MkfsOptions, MountOptions, OpenOptions, Volume};

fn sim(q: &Arc<RequestQueue>) -> &SimDevice {
    q.device().as_any().downcast_ref::<SimDevice>().unwrap()
}

fn quiet() -> MountOptions {
    let mut o = MountOptions::default();
    o.wb.dirty_writeback_centisecs = 0;
    o.commit_interval_ms = 3_600_000;
    o
}

fn fresh(spec: &str, o: MountOptions) -> (Arc<RequestQueue>, Volume) {
    let q = RequestQueue::open(spec, QueueConfig::default()).unwrap();
    Volume::mkfs(&q, &MkfsOptions::default()).unwrap();
    let v = Volume::mount(q.clone(), o).unwrap();
    (q, v)
}

/// Fail every data write from now on (the metadata areas sit below the data area).
fn fail_data_writes(q: &Arc<RequestQueue>, v: &Volume) {
    let first = v.superblock().data_start * 8;
    sim(q).inject_eio(first..u64::MAX / 2, false, true);
}

fn eio(r: Result<(), wbstack::fs::FsError>) -> i32 {
    match r {
        Ok(()) => 0,
        Err(e) => e.errno(),
    }
}

#[test]
fn every_open_file_sees_a_writeback_error_exactly_once() {
    let (q, v) = fresh("sim:ssd,size=64M", quiet());
    let a = v.create("/f").unwrap();
    let b = v.open("/f", &OpenOptions::read_write()).unwrap();
    a.write_at(0, &[1u8; 8192]).unwrap();
    fail_data_writes(&q, &v);
    assert_eq!(eio(a.fsync()), libc::EIO);
    assert_eq!(eio(a.fsync()), 0, "reported once to a");
    assert_eq!(eio(b.fsync()), libc::EIO, "and once to b");
    assert_eq!(eio(b.fsync()), 0);
    // Opened after the error was seen: nothing to report.
    let c = v.open("/f", &OpenOptions::read_write()).unwrap();
    assert_eq!(eio(c.fsync()), 0);
    // A new error after it was seen is a new report for everyone.
    a.write_at(0, &[2u8; 4096]).unwrap();
    assert_eq!(eio(c.fsync()), libc::EIO);
    assert_eq!(eio(a.fsync()), libc::EIO);
    assert_eq!(eio(b.fsync()), libc::EIO);
    assert_eq!(eio(b.fsync()), 0);
}

#[test]
fn an_error_nobody_saw_reaches_a_later_opener_and_survives_eviction() {
    let mut o = quiet();
    o.cache.cache_size = 4 << 20; // small: other writes evict the failed pages
    let (q, v) = fresh("sim:ssd,size=128M", o);
    let a = v.create("/f").unwrap();
    a.write_at(0, &[1u8; 16384]).unwrap();
    a.close().unwrap();
    fail_data_writes(&q, &v);
    // Writeback by the flusher, not by an fsync: nobody has seen the error yet.
    v.bdi().sync().unwrap();
    sim(&q).clear_faults();
    // Push the failed (clean) pages out of the cache: twice its size in other data.
    let filler = v.create("/filler").unwrap();
    for i in 0..128u64 {
        filler.write_at(i * 65536, &[9u8; 65536]).unwrap();
    }
    filler.fsync().unwrap();
    assert_eq!(
        v.mapping_of("/f").unwrap().nr_pages(),
        0,
        "failed pages evicted"
    );
    let d = v.open("/f", &OpenOptions::read_write()).unwrap();
    assert_eq!(
        eio(d.fsync()),
        libc::EIO,
        "opened before anyone saw it: reported"
    );
    assert_eq!(eio(d.fsync()), 0);
    let e = v.open("/f", &OpenOptions::read_write()).unwrap();
    assert_eq!(eio(e.fsync()), 0, "opened after it was seen: not reported");
}

#[test]
fn volume_sync_reports_a_volume_error_once_per_caller() {
    let (q, v) = fresh("sim:ssd,size=64M", quiet());
    let x = v.create("/x").unwrap();
    let y = v.create("/y").unwrap();
    let bad = v.create("/bad").unwrap();
    bad.write_at(0, &[3u8; 4096]).unwrap();
    bad.close().unwrap();
    fail_data_writes(&q, &v);
    assert_eq!(eio(v.sync()), libc::EIO);
    assert_eq!(eio(v.sync()), 0);
    assert_eq!(eio(x.syncfs()), libc::EIO, "x has its own cursor");
    assert_eq!(eio(x.syncfs()), 0);
    assert_eq!(eio(y.syncfs()), libc::EIO);
    // fsync of an unrelated inode is not told of another inode's error.
    y.write_at(0, b"fine").unwrap();
    sim(&q).clear_faults();
    assert_eq!(eio(y.fsync()), 0);
}

#[test]
fn legacy_write_and_wait_consumes_the_error_but_fsync_still_reports_it() {
    // Reference 6.6 scenario 7.
    let (q, v) = fresh("sim:ssd,size=64M", quiet());
    let a = v.create("/f").unwrap();
    a.write_at(0, &[1u8; 4096]).unwrap();
    fail_data_writes(&q, &v);
    let m = v.mapping_of("/f").unwrap();
    assert!(m.write_and_wait(0, u64::MAX).is_err());
    assert!(
        m.write_and_wait(0, u64::MAX).is_ok(),
        "the legacy bit is consumed"
    );
    assert_eq!(
        eio(a.fsync()),
        libc::EIO,
        "errseq still reports it to the file"
    );
}

#[test]
fn fsck_is_clean_after_failed_writeback() {
    let (q, v) = fresh("sim:ssd,size=64M", quiet());
    for i in 0..10 {
        let f = v.create(&format!("/f{i}")).unwrap();
        f.write_at(0, &[i as u8; 12288]).unwrap();
    }
    fail_data_writes(&q, &v);
    let _ = v.sync();
    sim(&q).clear_faults();
    v.sync().unwrap();
    v.unmount().unwrap();
    let r = fsck(&q);
    assert!(r.is_clean(), "{r:#?}");
}
