//! `wbstack crashtest`: the checker catches every kind of violation it claims to, a
//! small run of real cuts, the CLI's flags, and minimal reproductions of the library
//! bugs crashtest found.

use std::sync::Arc;
use wbstack::block::{QueueConfig, RequestQueue};
use wbstack::dev::sim::SimDevice;
use wbstack::fs::fsck::fsck;
use wbstack::fs::{MkfsOptions, MountOptions, OpenOptions, Volume};

fn sim(q: &Arc<RequestQueue>) -> &SimDevice {
    q.device().as_any().downcast_ref::<SimDevice>().unwrap()
}

/// No periodic writeback or commit: the test decides when things happen.
fn quiet() -> MountOptions {
    let mut o = MountOptions::default();
    o.wb.dirty_writeback_centisecs = 0;
    o.commit_interval_ms = 3_600_000;
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

#[test]
#[ignore = "library bug: a commit with no records (a cache flush for fsync) consumes a transaction id without writing it, so replay stops at the gap"]
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
