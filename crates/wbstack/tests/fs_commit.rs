//! The committer's journal writes in flight (`logbufs`): with two, the next
//! transaction is closed and written while the one before is still in flight, yet a
//! commit is reported durable (its fsyncs return) only once every earlier one is; a
//! later transaction that reached the disk before an earlier one is not replayed.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use wbstack::block::{BioFlags, BlkError, Op, QueueConfig, Request, RequestQueue};
use wbstack::dev::{Completer, Device, DeviceRef};
use wbstack::fs::{MkfsOptions, MountOptions, Volume};

/// A memory-backed device that, while armed, keeps the journal's commit writes (FUA)
/// until the test completes them, one by one in any order (`complete`), or the power
/// fails (`power_fail`: they never reach the media and fail, as does every request
/// after). Everything else passes straight through to the null device below, which
/// completes at once.
struct CommitGate {
    inner: DeviceRef,
    armed: AtomicBool,
    dead: AtomicBool,
    held: parking_lot::Mutex<Vec<(Request, Completer)>>,
}

impl CommitGate {
    fn new() -> Arc<CommitGate> {
        let inner = wbstack::dev::open(
            "null,memory_backed=1,lbs=4096,size=64M",
            QueueConfig::default().clock,
        )
        .unwrap();
        Arc::new(CommitGate {
            inner,
            armed: AtomicBool::new(false),
            dead: AtomicBool::new(false),
            held: parking_lot::Mutex::new(Vec::new()),
        })
    }
    fn held(&self) -> usize {
        self.held.lock().len()
    }
    /// The sector of the `i`-th held write.
    fn sector(&self, i: usize) -> u64 {
        self.held.lock()[i].0.sector
    }
    /// Complete the `i`-th held write (arrival order among those still held).
    fn complete(&self, i: usize) {
        let (rq, done) = self.held.lock().remove(i);
        self.inner.queue_rq(rq, &done);
    }
    /// The power fails: the held writes never reach the media, and they and every
    /// later request fail.
    fn power_fail(&self) {
        self.dead.store(true, Ordering::SeqCst);
        let held = std::mem::take(&mut *self.held.lock());
        for (rq, done) in held {
            done.complete(rq, Err(BlkError::PowerLoss));
        }
    }
}

impl Device for CommitGate {
    fn queue_rq(&self, rq: Request, done: &Completer) {
        if self.dead.load(Ordering::SeqCst) {
            done.complete(rq, Err(BlkError::PowerLoss));
        } else if self.armed.load(Ordering::SeqCst)
            && rq.op == Op::Write
            && rq.flags.contains(BioFlags::FUA)
        {
            self.held.lock().push((rq, done.clone()));
        } else {
            self.inner.queue_rq(rq, done);
        }
    }
    wbstack::stacked_device!(inner);
}

fn options(logbufs: usize) -> MountOptions {
    let mut o = common::quiet();
    o.logbufs = logbufs;
    o
}

fn gated(logbufs: usize) -> (Arc<CommitGate>, Arc<RequestQueue>, Volume) {
    let gate = CommitGate::new();
    let q = RequestQueue::new(gate.clone(), QueueConfig::default()).unwrap();
    Volume::mkfs(&q, &MkfsOptions::default()).unwrap();
    let v = Volume::mount(q.clone(), options(logbufs)).unwrap();
    (gate, q, v)
}

fn wait_for(what: &str, cond: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < Duration::from_secs(20), "timed out: {what}");
        std::thread::yield_now();
    }
}

/// Create `path` and fsync it on a thread of its own.
fn create_and_fsync(
    v: &Arc<Volume>,
    path: &'static str,
) -> std::thread::JoinHandle<wbstack::fs::FsResult<()>> {
    let v = v.clone();
    std::thread::spawn(move || {
        let f = v.create(path)?;
        f.write_at(0, path.as_bytes())?;
        f.fsync()
    })
}

#[test]
fn a_second_commit_is_written_while_the_first_is_in_flight_and_finishes_after_it() {
    let (gate, _q, v) = gated(2);
    let v = Arc::new(v);
    let base = v.journal_stats().committed_tid;
    gate.armed.store(true, Ordering::SeqCst);

    let a = create_and_fsync(&v, "/a");
    wait_for("a's commit to reach the device", || gate.held() == 1);
    let b = create_and_fsync(&v, "/b");
    wait_for("b's commit to be written beside a's", || gate.held() == 2);
    assert!(
        gate.sector(1) > gate.sector(0),
        "the second commit follows the first in the journal"
    );
    assert_eq!(v.journal_stats().commits_overlapped, 1);

    // The later commit lands first: nothing is durable yet, since replay would stop
    // at the earlier one.
    gate.complete(1);
    assert_eq!(v.journal_stats().committed_tid, base);
    assert!(!a.is_finished() && !b.is_finished());

    gate.complete(0);
    a.join().unwrap().unwrap();
    b.join().unwrap().unwrap();
    let s = v.journal_stats();
    assert_eq!(s.committed_tid, base + 2);
    assert_eq!(s.commits, 2);
    gate.armed.store(false, Ordering::SeqCst);
    assert!(v.check().is_empty(), "{:?}", v.check());
    Arc::into_inner(v).unwrap().unmount().unwrap();
}

/// A finished journal write wakes the fsync waiters of its own transaction only:
/// b, waiting for the next one still in flight, sleeps through a's finish.
#[test]
fn a_finished_commit_wakes_only_its_own_waiters() {
    let (gate, _q, v) = gated(2);
    let v = Arc::new(v);
    gate.armed.store(true, Ordering::SeqCst);
    let woken = v.journal_stats().sync_woken;

    let a = create_and_fsync(&v, "/a");
    wait_for("a's commit to reach the device", || gate.held() == 1);
    let b = create_and_fsync(&v, "/b");
    wait_for("b's commit to be written beside a's", || gate.held() == 2);

    gate.complete(0);
    a.join().unwrap().unwrap();
    // Counted once the wake-up that released a returned, with everyone it woke.
    wait_for("a's wake-up counted", || {
        v.journal_stats().sync_woken > woken
    });
    assert_eq!(
        v.journal_stats().sync_woken,
        woken + 1,
        "b was woken by a's commit"
    );
    assert!(!b.is_finished());
    gate.complete(0);
    b.join().unwrap().unwrap();
    wait_for("b's wake-up counted", || {
        v.journal_stats().sync_woken > woken + 1
    });
    assert_eq!(v.journal_stats().sync_woken, woken + 2);
    gate.armed.store(false, Ordering::SeqCst);
    Arc::into_inner(v).unwrap().unmount().unwrap();
}

#[test]
fn with_one_log_buffer_the_next_commit_waits_for_the_one_in_flight() {
    let (gate, _q, v) = gated(1);
    let v = Arc::new(v);
    let base = v.journal_stats().committed_tid;
    gate.armed.store(true, Ordering::SeqCst);

    let a = create_and_fsync(&v, "/a");
    wait_for("a's commit to reach the device", || gate.held() == 1);
    let waits = v.journal_stats().sync_waits;
    let b = create_and_fsync(&v, "/b");
    wait_for("b's fsync to ask for a commit", || {
        v.journal_stats().sync_waits > waits
    });
    gate.complete(0);
    a.join().unwrap().unwrap();
    wait_for("b's commit", || gate.held() == 1);
    gate.complete(0);
    b.join().unwrap().unwrap();
    let s = v.journal_stats();
    assert_eq!(s.committed_tid, base + 2);
    assert_eq!(s.commits_overlapped, 0, "a commit went out beside another");
    gate.armed.store(false, Ordering::SeqCst);
    Arc::into_inner(v).unwrap().unmount().unwrap();
}

#[test]
fn a_later_commit_that_landed_before_a_lost_one_is_not_replayed() {
    let (gate, _q, v) = gated(2);
    let v = Arc::new(v);
    // Durable before the gate: a file both commits below change nothing of.
    let f = v.create("/kept").unwrap();
    f.write_at(0, b"kept").unwrap();
    f.fsync().unwrap();
    drop(f);
    gate.armed.store(true, Ordering::SeqCst);

    let a = create_and_fsync(&v, "/a");
    wait_for("a's commit to reach the device", || gate.held() == 1);
    let b = create_and_fsync(&v, "/b");
    wait_for("b's commit to be written beside a's", || gate.held() == 2);
    // b's commit reaches the media; a's never does (the power fails).
    gate.complete(1);
    gate.power_fail();
    assert!(a.join().unwrap().is_err(), "a's fsync returned success");
    assert!(b.join().unwrap().is_err(), "b's fsync returned success");
    Arc::into_inner(v).unwrap().crash();

    // The media as the power left it.
    let q = RequestQueue::new(gate.inner.clone(), QueueConfig::default()).unwrap();
    let report = wbstack::fs::fsck::fsck(&q);
    assert!(report.is_clean(), "{:?}", report.problems);
    let v = Volume::mount(q, options(2)).unwrap();
    assert!(v.stat("/kept").is_ok(), "a durable file is gone");
    assert!(v.stat("/a").is_err(), "the lost commit's file exists");
    assert!(
        v.stat("/b").is_err(),
        "the commit after the lost one was replayed"
    );
    assert!(v.check().is_empty(), "{:?}", v.check());
    v.unmount().unwrap();
}

#[test]
fn logbufs_is_a_mount_option_and_a_knob_with_bounds() {
    let mut o = MountOptions::default();
    o.parse("logbufs=4").unwrap();
    assert_eq!(o.logbufs, 4);
    for bad in ["logbufs=0", "logbufs=9", "logbufs=two"] {
        let e = o.parse(bad).unwrap_err().to_string();
        assert!(e.contains("logbufs"), "{bad}: {e}");
    }
    assert_eq!(MountOptions::default().logbufs, 8, "XFS's default");
    let (_gate, _q, v) = gated(2);
    assert_eq!(v.tunable("logbufs").unwrap(), "2");
    v.set_tunable("logbufs", "1").unwrap();
    assert_eq!(v.tunable("logbufs").unwrap(), "1");
    assert!(v.set_tunable("logbufs", "0").is_err());
    assert_eq!(v.tunable("logbufs").unwrap(), "1");
    v.unmount().unwrap();
}
