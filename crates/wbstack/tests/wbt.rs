//! Writeback throttling on real request queues: class limits, the wake rule, switching
//! at run time, and read latency under a background-write flood on a simulated SSD.
//!
//! Every queue here runs on a `ManualClock`, so windows close only when a test moves
//! time. Tests that need the device to hold requests use `HeldDevice`, which completes
//! them only when the test says so, in the test's own thread: whatever a completion
//! wakes has been decided by the time `complete_one` returns.

use parking_lot::{Condvar, Mutex};
use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use wbstack::block::bio::BioEndIo;
use wbstack::block::wbt::{EnableState, LatStatus, RWQ_BG, RWQ_DISCARD};
use wbstack::block::{Bio, BioFlags, BlkResult, Op, QueueConfig, Request, RequestQueue};
use wbstack::buf::IoBuf;
use wbstack::clock::{Clock, ManualClock, NSEC_PER_MSEC, NSEC_PER_USEC};
use wbstack::dev::sim::SimDevice;
use wbstack::dev::{Completer, Device, Geometry};

const MS: u64 = NSEC_PER_MSEC;
const US: u64 = NSEC_PER_USEC;

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::yield_now();
    }
}

/// A device that keeps every request until the test completes it.
struct HeldDevice {
    geo: Geometry,
    held: Mutex<VecDeque<(Request, Completer)>>,
    cv: Condvar,
}

impl HeldDevice {
    fn new(wc: bool, rotational: bool, qd: u32) -> Arc<HeldDevice> {
        Arc::new(HeldDevice {
            geo: Geometry {
                size_bytes: 1 << 30,
                logical_block_size: 4096,
                max_hw_sectors: 4096,
                max_segments: 128,
                max_segment_size: 65536,
                rotational,
                write_cache: wc,
                nr_hw_queues: 1,
                queue_depth: qd,
            },
            held: Mutex::new(VecDeque::new()),
            cv: Condvar::new(),
        })
    }
    fn pending(&self) -> usize {
        self.held.lock().len()
    }
    fn pending_ops(&self) -> Vec<Op> {
        self.held.lock().iter().map(|(r, _)| r.op).collect()
    }
    /// Complete the oldest request here, in this thread.
    fn complete_one(&self) -> Op {
        let (rq, done) = self.held.lock().pop_front().expect("a request to complete");
        let op = rq.op;
        done.complete(rq, Ok(()));
        op
    }
    fn complete_all(&self) {
        while self.pending() > 0 {
            self.complete_one();
        }
    }
    /// Wait until exactly `n` requests are held (bounded).
    fn wait_pending(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut h = self.held.lock();
        while h.len() != n {
            assert!(
                !self.cv.wait_until(&mut h, deadline).timed_out() || h.len() == n,
                "timed out waiting for {n} requests in the device, have {}",
                h.len()
            );
        }
    }
}

impl Device for HeldDevice {
    fn geometry(&self) -> &Geometry {
        &self.geo
    }
    fn spec(&self) -> &str {
        "held"
    }
    fn queue_rq(&self, rq: Request, done: &Completer) {
        self.held.lock().push_back((rq, done.clone()));
        self.cv.notify_all();
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

fn held_queue(
    wc: bool,
    lat: Option<u64>,
) -> (Arc<HeldDevice>, Arc<RequestQueue>, Arc<ManualClock>) {
    let clock = ManualClock::new(10_000 * MS);
    let dev = HeldDevice::new(wc, false, 64);
    let q = RequestQueue::new(
        dev.clone(),
        QueueConfig {
            wbt_lat_usec: lat,
            clock: clock.clone(),
            ..Default::default()
        },
    )
    .unwrap();
    (dev, q, clock)
}

#[derive(Default)]
struct Count(AtomicU64);
impl BioEndIo for Count {
    fn end_io(&self, _bio: Bio, status: BlkResult) {
        status.expect("IO succeeds");
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn write_bio(i: u64, flags: BioFlags, done: &Arc<Count>) -> Bio {
    // Scattered, so no two merge into one request.
    Bio::write(i * 64, IoBuf::zeroed(4096))
        .with_flags(flags)
        .with_end_io(done.clone())
}

/// A thread submitting `n` writes with `flags` without waiting for them.
fn spawn_writer(q: &Arc<RequestQueue>, n: u64, flags: BioFlags, base: u64) -> JoinHandle<()> {
    let q = q.clone();
    let done = Arc::new(Count::default());
    std::thread::spawn(move || {
        for i in 0..n {
            q.submit_bio(write_bio(base + i, flags, &done)).unwrap();
        }
    })
}

/// Submit `n` writes with `flags` from a thread and report how many reach the device
/// before the thread blocks in wbt; then release everything.
fn admitted(dev: &Arc<HeldDevice>, q: &Arc<RequestQueue>, flags: BioFlags, n: u64) -> usize {
    let t = spawn_writer(q, n, flags, 1_000);
    wait_until("the writer to block in wbt", || {
        q.wbt_state().waiting[RWQ_BG] == 1 || t.is_finished()
    });
    let got = dev.pending();
    drain(dev, t);
    got
}

#[test]
fn class_limits_on_a_queue() {
    let (dev, q, clock) = held_queue(false, None);
    let s = q.wbt_state();
    assert_eq!((s.max_depth, s.wb_normal, s.wb_background), (16, 8, 4));
    assert_eq!(q.wbt_lat_usec(), 2000);
    // A read completed 50 ms ago makes ordinary writes background. The first tracked
    // write arms the window; time stays inside it, so the step stays 0 throughout.
    read_one(&q, &dev);
    clock.advance(50 * MS);
    assert_eq!(
        admitted(&dev, &q, BioFlags::empty(), 40),
        4,
        "close to a read"
    );
    clock.advance(60 * MS);
    assert_eq!(
        admitted(&dev, &q, BioFlags::empty(), 40),
        8,
        "reads long gone"
    );
    assert_eq!(
        admitted(&dev, &q, BioFlags::BACKGROUND, 40),
        4,
        "background"
    );
    assert_eq!(admitted(&dev, &q, BioFlags::empty(), 40), 8, "normal");
    assert_eq!(
        admitted(&dev, &q, BioFlags::SYNC, 40),
        16,
        "fsync writeback"
    );
    assert_eq!(admitted(&dev, &q, BioFlags::META, 40), 16, "metadata");
    // O_DIRECT writes are not counted at all: all 40 reach the device.
    let waits = q.wbt_state().waits;
    assert_eq!(
        admitted(&dev, &q, BioFlags::SYNC | BioFlags::IDLE, 40),
        40,
        "O_DIRECT"
    );
    assert_eq!(q.wbt_state().waits, waits);
    // Discards have their own queue, limited to wb_background.
    let d = Arc::new(Count::default());
    let q2 = q.clone();
    let d2 = d.clone();
    let t = std::thread::spawn(move || {
        for i in 0..10u64 {
            q2.submit_bio(Bio::discard(i * 64, 8).with_end_io(d2.clone()))
                .unwrap();
        }
    });
    wait_until("a discard to block", || {
        q.wbt_state().waiting[RWQ_DISCARD] == 1
    });
    assert_eq!(dev.pending(), 4);
    assert_eq!(q.wbt_state().inflight, [0, 4]);
    drain(&dev, t);
    assert_eq!(d.0.load(Ordering::SeqCst), 10);
    // Flushes are not throttled.
    let f = Arc::new(Count::default());
    for _ in 0..20 {
        q.submit_bio(Bio::flush().with_end_io(f.clone())).unwrap();
    }
    assert_eq!(dev.pending(), 20);
    dev.complete_all();
    assert_eq!(q.wbt_state().windows, 0, "all within the first window");
}

/// A read submitted and completed now.
fn read_one(q: &Arc<RequestQueue>, dev: &HeldDevice) {
    let c = Arc::new(Count::default());
    q.submit_bio(Bio::read(1 << 20, 4096).with_end_io(c.clone()))
        .unwrap();
    assert_eq!(dev.complete_one(), Op::Read);
    assert_eq!(c.0.load(Ordering::SeqCst), 1);
}

/// Complete requests until `t` has submitted everything and the device is empty.
fn drain(dev: &HeldDevice, t: JoinHandle<()>) {
    while !t.is_finished() || dev.pending() > 0 {
        if dev.pending() > 0 {
            dev.complete_one();
        } else {
            std::thread::yield_now();
        }
    }
    t.join().unwrap();
}

#[test]
fn a_dirtier_sleeping_gives_every_write_full_depth() {
    let (dev, q, clock) = held_queue(false, None);
    let last_sleep = Arc::new(AtomicU64::new(0));
    let ls = last_sleep.clone();
    q.wbt().set_dirty_sleep_fn(Some(Arc::new(move || {
        let v = ls.load(Ordering::SeqCst);
        (v != 0).then_some(v)
    })));
    assert_eq!(admitted(&dev, &q, BioFlags::BACKGROUND, 40), 4);
    // The hook is asked at most once per clock tick: move time on after each change
    // (staying inside the first window, so the step stays 0).
    last_sleep.store(clock.now_ns() - 900 * MS, Ordering::SeqCst);
    clock.advance(MS);
    assert_eq!(admitted(&dev, &q, BioFlags::BACKGROUND, 40), 16);
    last_sleep.store(clock.now_ns() - 1_000 * MS, Ordering::SeqCst);
    clock.advance(MS);
    assert_eq!(
        admitted(&dev, &q, BioFlags::BACKGROUND, 40),
        4,
        "over 1 s ago"
    );
    assert_eq!(q.wbt_state().windows, 0);
}

#[test]
fn reads_never_wait_in_wbt() {
    let (dev, q, _clock) = held_queue(false, None);
    let writer = spawn_writer(&q, 10, BioFlags::BACKGROUND, 0);
    wait_until("the writer to block", || q.wbt_state().waiting[RWQ_BG] == 1);
    assert_eq!(dev.pending(), 4);
    let waits = q.wbt_state().waits;
    // Reads go straight to the device while writes of their queue are blocked, from a
    // plugged context as well as unplugged.
    let c = Arc::new(Count::default());
    for i in 0..8u64 {
        q.submit_bio(Bio::read((1 << 20) + i * 64, 4096).with_end_io(c.clone()))
            .unwrap();
    }
    assert_eq!(dev.pending(), 12);
    {
        let _plug = wbstack::block::Plug::start();
        for i in 0..8u64 {
            q.submit_bio(Bio::read((3 << 19) + i * 64, 4096).with_end_io(c.clone()))
                .unwrap();
        }
    }
    assert_eq!(dev.pending(), 20);
    let s = q.wbt_state();
    assert_eq!(s.waits, waits, "no read was counted as a wait");
    assert_eq!((s.waiting[RWQ_BG], s.inflight[RWQ_BG]), (1, 4));
    assert_eq!(
        dev.pending_ops().iter().filter(|o| **o == Op::Read).count(),
        16
    );
    drain(&dev, writer);
    assert_eq!(c.0.load(Ordering::SeqCst), 16);
    assert_eq!(q.wbt_state().inflight, [0, 0]);
}

#[test]
fn lat_zero_disables_and_switches_at_run_time() {
    let (dev, q, _clock) = held_queue(false, Some(0));
    let s = q.wbt_state();
    assert!(!s.enabled);
    assert_eq!(s.enable_state, EnableState::OffManual);
    assert_eq!(q.wbt_lat_usec(), 0);
    // Off: nothing is held back.
    let done = Arc::new(Count::default());
    for i in 0..40 {
        q.submit_bio(write_bio(i, BioFlags::BACKGROUND, &done))
            .unwrap();
    }
    assert_eq!(dev.pending(), 40);
    let s = q.wbt_state();
    assert_eq!((s.waits, s.inflight, s.armed), ([0, 0], [0, 0], false));
    // On at run time: the next writes are throttled. Untracked ones in flight do not
    // count against the limit.
    q.set_wbt_lat_usec(5_000);
    assert_eq!(q.wbt_lat_usec(), 5_000);
    assert_eq!(q.wbt_state().enable_state, EnableState::OnManual);
    let w = spawn_writer(&q, 10, BioFlags::BACKGROUND, 100);
    wait_until("the writer to block", || q.wbt_state().waiting[RWQ_BG] == 1);
    assert_eq!(dev.pending(), 44);
    // Off again: the sleeper is let go at once, and the rest of its writes too, with
    // nothing completing meanwhile.
    q.set_wbt_lat_usec(0);
    w.join().unwrap();
    assert_eq!(dev.pending(), 50);
    let s = q.wbt_state();
    assert_eq!((s.waiting, s.waits), ([0, 0], [1, 0]));
    // The 4 tracked while on, and the one let go holding a slot, are counted until
    // they complete.
    assert_eq!(s.inflight[RWQ_BG], 5);
    dev.complete_all();
    assert_eq!(q.wbt_state().inflight[RWQ_BG], 0);
    assert_eq!(done.0.load(Ordering::SeqCst), 40);
}

#[test]
fn sync_writes_get_max_depth_and_o_direct_is_not_counted() {
    let (dev, q, _clock) = held_queue(true, None);
    let done = Arc::new(Count::default());
    // O_DIRECT in flight does not reduce what SYNC writeback may have.
    for i in 0..30 {
        q.submit_bio(write_bio(i, BioFlags::SYNC | BioFlags::IDLE, &done))
            .unwrap();
    }
    let w = spawn_writer(&q, 20, BioFlags::SYNC, 100);
    wait_until("the writer to block", || q.wbt_state().waiting[RWQ_BG] == 1);
    assert_eq!(dev.pending(), 30 + 16);
    assert_eq!(q.wbt_state().inflight[RWQ_BG], 16);
    // Completing the untracked ones frees nothing for the writer.
    for _ in 0..30 {
        dev.complete_one();
    }
    assert_eq!(q.wbt_state().waiting[RWQ_BG], 1);
    for _ in 0..16 {
        dev.complete_one();
    }
    dev.wait_pending(4);
    dev.complete_all();
    w.join().unwrap();
    assert_eq!(done.0.load(Ordering::SeqCst), 30);
}

/// 4.9 scenario 8 on a queue: with a volatile write cache and no dirtier sleeping,
/// blocked writers are woken only when the queue has drained.
#[test]
fn with_write_cache_writers_wake_only_when_drained() {
    let (dev, q, _clock) = held_queue(true, None);
    let w = spawn_writer(&q, 12, BioFlags::BACKGROUND, 0);
    wait_until("the writer to block", || q.wbt_state().waiting[RWQ_BG] == 1);
    assert_eq!(dev.pending(), 4);
    for left in [3, 2, 1] {
        dev.complete_one();
        let s = q.wbt_state();
        assert_eq!(
            (s.inflight[RWQ_BG], s.waiting[RWQ_BG]),
            (left, 1),
            "not woken with {left} in flight"
        );
    }
    dev.complete_one();
    // The waker handed the slot over before returning: only it can take inflight
    // from 0 while the writer sleeps.
    assert!(q.wbt_state().inflight[RWQ_BG] >= 1, "woken at 0");
    dev.wait_pending(4);
    // Batches of four, each after a full drain.
    wait_until("the writer to block again", || {
        q.wbt_state().waiting[RWQ_BG] == 1
    });
    for left in [3, 2, 1] {
        dev.complete_one();
        assert_eq!(q.wbt_state().waiting[RWQ_BG], 1, "{left} in flight");
    }
    dev.complete_one();
    dev.wait_pending(4);
    dev.complete_all();
    w.join().unwrap();
    assert_eq!(q.wbt_state().waits[RWQ_BG], 2);

    // Without a write cache a waiter is let in as soon as wb_normal − inflight reaches
    // wb_background / 2.
    let (dev, q, _clock) = held_queue(false, None);
    let w = spawn_writer(&q, 5, BioFlags::BACKGROUND, 0);
    wait_until("the writer to block", || q.wbt_state().waiting[RWQ_BG] == 1);
    dev.complete_one();
    let s = q.wbt_state();
    assert_eq!(s.waiting[RWQ_BG], 0);
    assert_eq!(s.inflight[RWQ_BG], 4, "the slot was handed over");
    dev.wait_pending(4);
    drain(&dev, w);

    // With a write cache but a dirtier sleeping, the write cache rule does not apply.
    let (dev, q, clock) = held_queue(true, None);
    let now = clock.now_ns();
    q.wbt()
        .set_dirty_sleep_fn(Some(Arc::new(move || Some(now - 10 * MS))));
    let w = spawn_writer(&q, 17, BioFlags::BACKGROUND, 0);
    wait_until("the writer to block", || q.wbt_state().waiting[RWQ_BG] == 1);
    assert_eq!(dev.pending(), 16, "max_depth while a dirtier sleeps");
    // Woken against wb_normal (8) in batches of wb_background / 2: at 6 in flight.
    for _ in 0..9 {
        dev.complete_one();
    }
    assert_eq!(
        q.wbt_state().waiting[RWQ_BG],
        1,
        "still asleep at 7 in flight"
    );
    dev.complete_one();
    let s = q.wbt_state();
    assert_eq!((s.waiting[RWQ_BG], s.inflight[RWQ_BG]), (0, 7));
    drain(&dev, w);
}

/// Run a window on a held queue: `reads` reads and `writes` writes, each completing
/// `lat` after it was issued, then time moves to the end of the window and the timer
/// thread evaluates it. One write is tracked (it arms the window); the others are
/// O_DIRECT, which wbt samples but never holds back, so this thread cannot block on
/// the limits it is testing.
fn held_window(
    dev: &HeldDevice,
    q: &Arc<RequestQueue>,
    clock: &ManualClock,
    reads: u64,
    writes: u64,
    lat: u64,
) {
    let s0 = q.wbt_state();
    let start = clock.now_ns();
    let c = Arc::new(Count::default());
    for i in 0..writes {
        let flags = if i == 0 {
            BioFlags::BACKGROUND
        } else {
            BioFlags::SYNC | BioFlags::IDLE
        };
        q.submit_bio(write_bio(i, flags, &c)).unwrap();
    }
    for i in 0..reads {
        q.submit_bio(Bio::read((1 << 20) + i * 64, 4096).with_end_io(c.clone()))
            .unwrap();
    }
    clock.advance(lat);
    dev.complete_all();
    assert_eq!(c.0.load(Ordering::SeqCst), reads + writes);
    let s = q.wbt_state();
    assert!(s.armed, "a tracked write arms the window");
    let end = clock.now_ns().max(start + s.cur_win_nsec);
    clock.set(end);
    wait_until("the window to be evaluated", || {
        q.wbt_state().windows > s0.windows
    });
}

#[test]
fn a_new_target_takes_effect_within_a_window() {
    let (dev, q, clock) = held_queue(false, None);
    // The kernel's growth rule: a good window raises depth though no write waited.
    q.set_wbt_scale_up_when_limited(false);
    wbstack::trace::enable(1 << 16);
    // Reads at 5 ms against a 2 ms target, with writes going on: two steps down.
    held_window(&dev, &q, &clock, 2, 3, 5 * MS);
    held_window(&dev, &q, &clock, 2, 3, 5 * MS);
    let s = q.wbt_state();
    assert_eq!(s.last_status, Some(LatStatus::Exceeded));
    assert_eq!((s.scale_step, s.max_depth, s.wb_background), (2, 4, 1));
    assert_eq!(
        s.cur_win_nsec, 59_259_259,
        "a shorter window when scaled down"
    );
    // A 10 ms target: depth is back to the default at once, and the very next window
    // judges 5 ms reads as fine.
    q.set_wbt_lat_usec(10_000);
    let s = q.wbt_state();
    assert_eq!((s.scale_step, s.max_depth, s.wb_background), (0, 16, 4));
    assert_eq!(s.min_lat_nsec, 10 * MS);
    held_window(&dev, &q, &clock, 2, 3, 5 * MS);
    let s = q.wbt_state();
    assert_eq!(s.last_status, Some(LatStatus::Ok));
    assert_eq!(s.scale_step, -1);
    // Back to 2 ms: the next window is a violation again.
    q.set_wbt_lat_usec(2_000);
    held_window(&dev, &q, &clock, 2, 3, 5 * MS);
    assert_eq!(q.wbt_state().last_status, Some(LatStatus::Exceeded));
    assert_eq!(q.wbt_state().scale_step, 1);

    // The trace tells the same story for this queue.
    let id = q.id();
    let ev: Vec<_> = wbstack::trace::take()
        .into_iter()
        .filter(|e| e.fields["dev"] == id)
        .collect();
    let steps: Vec<(String, i64)> = ev
        .iter()
        .filter(|e| e.event == "wbt_step")
        .map(|e| {
            (
                e.fields["msg"].as_str().unwrap_or("").to_string(),
                e.fields["step"].as_i64().unwrap_or(99),
            )
        })
        .collect();
    let want = [
        ("scale down", 1),
        ("scale down", 2),
        ("scale up", -1),
        ("scale down", 1),
    ];
    assert_eq!(
        steps,
        want.map(|(m, s)| (m.to_string(), s)).to_vec(),
        "setting the target resets the step without a scale event"
    );
    let lats: Vec<u64> = ev
        .iter()
        .filter(|e| e.event == "wbt_lat")
        .map(|e| e.fields["lat_nsec"].as_u64().unwrap_or(0))
        .collect();
    assert_eq!(lats, [5 * MS, 5 * MS, 5 * MS]);
    let stat = ev
        .iter()
        .find(|e| e.event == "wbt_stat")
        .expect("a wbt_stat event");
    assert_eq!(stat.fields["rnr"], 2);
    assert_eq!(stat.fields["wnr"], 3);
    assert_eq!(stat.fields["rmin"], 5 * MS);
    let step_ev = ev.iter().find(|e| e.event == "wbt_step").unwrap();
    assert_eq!(step_ev.fields["max"], 8);
    assert_eq!(step_ev.fields["normal"], 4);
    assert_eq!(step_ev.fields["bg"], 2);
    assert_eq!(step_ev.fields["window_nsec"], 72_727_272);
}

#[test]
fn depth_does_not_grow_while_writes_stay_under_the_limit() {
    let (dev, q, clock) = held_queue(false, None);
    for _ in 0..3 {
        held_window(&dev, &q, &clock, 2, 3, MS / 2);
        let s = q.wbt_state();
        assert_eq!(s.last_status, Some(LatStatus::Ok));
        assert_eq!(
            s.scale_step, 0,
            "reads were fine but no write was held back"
        );
    }
    held_window(&dev, &q, &clock, 0, 3, MS);
    let s = q.wbt_state();
    assert_eq!(s.last_status, Some(LatStatus::UnknownWrites));
    assert_eq!((s.scale_step, s.max_depth), (0, 16));
    assert_eq!(s.waits, [0, 0]);
}

#[test]
fn the_timer_stops_when_idle() {
    let (dev, q, clock) = held_queue(false, None);
    // The kernel's growth rule, so that writes alone raise depth.
    q.set_wbt_scale_up_when_limited(false);
    held_window(&dev, &q, &clock, 0, 3, MS);
    // Writes only: deeper queues, and the timer keeps running while the step is not 0.
    assert_eq!(q.wbt_state().last_status, Some(LatStatus::UnknownWrites));
    assert_eq!(q.wbt_state().scale_step, -1);
    assert!(q.wbt_state().armed);
    // Five silent windows bring the step back to 0, then the timer stops.
    for i in 1..=5 {
        let w = q.wbt_state().windows;
        clock.advance(100 * MS);
        wait_until("a silent window", || q.wbt_state().windows > w);
        let s = q.wbt_state();
        assert_eq!(s.last_status, Some(LatStatus::Unknown));
        assert_eq!(s.armed, i < 5, "window {i}");
    }
    assert_eq!(q.wbt_state().scale_step, 0);
    let w = q.wbt_state().windows;
    clock.advance(1_000 * MS);
    // Nothing to wait for; the next tracked write starts it again.
    assert_eq!(q.wbt_state().windows, w);
    held_window(&dev, &q, &clock, 0, 3, MS);
    assert_eq!(q.wbt_state().windows, w + 1);
}

/// 4.9 scenario 6 on a queue: a read stuck in the device counts against the target
/// although it never completes within the window.
#[test]
fn a_stuck_read_is_a_violation_without_completions() {
    let (dev, q, clock) = held_queue(false, None);
    let c = Arc::new(Count::default());
    q.submit_bio(write_bio(0, BioFlags::BACKGROUND, &c))
        .unwrap();
    q.submit_bio(Bio::read(1 << 20, 4096).with_end_io(c.clone()))
        .unwrap();
    // The write completes; the read stays in the device for the whole window.
    assert_eq!(dev.complete_one(), Op::Write);
    clock.advance(100 * MS);
    wait_until("the window", || q.wbt_state().windows == 1);
    let s = q.wbt_state();
    assert_eq!(s.last_status, Some(LatStatus::Exceeded));
    assert_eq!(s.scale_step, 1);
    // Once it completes it is forgotten: the next window, with nothing read and
    // nothing written, has nothing to judge.
    assert_eq!(dev.complete_one(), Op::Read);
    clock.advance(s.cur_win_nsec);
    wait_until("the next window", || q.wbt_state().windows == 2);
    let s = q.wbt_state();
    assert_eq!(s.last_status, Some(LatStatus::Unknown));
    assert_eq!(s.scale_step, 1);
    assert_eq!(c.0.load(Ordering::SeqCst), 2);
}

/// A `Wbt` chained by hand through `add_qos` (the queue's own switched off) works
/// the same way through the generic rq_qos hooks.
#[test]
fn wbt_as_a_chained_rq_qos_policy() {
    use wbstack::block::wbt::{Wbt, WbtConfig};
    let (dev, q, clock) = held_queue(false, Some(0));
    let wbt = Arc::new(Wbt::new(WbtConfig {
        queue_depth: 64,
        rotational: false,
        wc: false,
        lat_usec: None,
        clock: clock.clone(),
        queue_id: 1_000_000 + q.id(),
    }));
    q.add_qos(wbt.clone());
    let w = spawn_writer(&q, 8, BioFlags::BACKGROUND, 0);
    wait_until("the writer to block", || wbt.state().waiting[RWQ_BG] == 1);
    assert_eq!(dev.pending(), 4);
    assert_eq!(q.wbt_state().waits, [0, 0], "the queue's own wbt is off");
    // Slow reads with the writes: the chained wbt judges them too.
    let c = Arc::new(Count::default());
    for i in 0..2u64 {
        q.submit_bio(Bio::read((1 << 20) + i * 64, 4096).with_end_io(c.clone()))
            .unwrap();
    }
    clock.advance(5 * MS);
    drain(&dev, w);
    clock.advance(100 * MS);
    wait_until("the window", || wbt.state().windows == 1);
    let s = wbt.state();
    assert_eq!(s.last_status, Some(LatStatus::Exceeded), "{s:?}");
    assert_eq!((s.scale_step, s.inflight), (1, [0, 0]));
}

// ---- Read latency under a background flood on a simulated SSD -----------------------

/// The state and voluntary/involuntary context switch counts of this process's threads
/// whose name starts with one of `names`.
fn thread_states(names: &[String]) -> HashMap<u64, (String, u64)> {
    let mut out = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for e in dir.flatten() {
        let Ok(status) = std::fs::read_to_string(e.path().join("status")) else {
            continue;
        };
        let field = |k: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .map(|v| v.trim().to_string())
                .unwrap_or_default()
        };
        let name = field("Name:");
        if !names.iter().any(|n| name.starts_with(n.as_str())) {
            continue;
        }
        let state = field("State:");
        let switches = field("voluntary_ctxt_switches:")
            .parse::<u64>()
            .unwrap_or(0)
            + field("nonvoluntary_ctxt_switches:")
                .parse::<u64>()
                .unwrap_or(0);
        let tid = e.file_name().to_string_lossy().parse().unwrap_or(0);
        out.insert(tid, (state, switches));
    }
    out
}

/// Wait until the named threads are all asleep and none ran between two looks: with a
/// manual clock nothing more happens until time moves.
fn settle(names: &[String]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let a = thread_states(names);
        if a.values().all(|(s, _)| s.starts_with('S')) {
            let b = thread_states(names);
            if a == b {
                return;
            }
        }
        assert!(Instant::now() < deadline, "threads never settled: {a:?}");
        std::thread::yield_now();
    }
}

struct FloodResult {
    /// Each read's latency from submission to completion, in clock ns.
    read_lat: Vec<u64>,
    bytes_written: u64,
    sim_ns: u64,
    waits: u64,
    windows: u64,
    /// Every scale_step the queue was at when a read completed.
    steps: Vec<i32>,
}

/// How a flood runs: the device, how far time moves per step, the writes' size.
struct Flood {
    spec: &'static str,
    cq_thread: &'static str,
    step_ns: u64,
    write_bytes: usize,
}

const SSD: Flood = Flood {
    spec: "sim:ssd,size=8G,hw_queues=1,qd=128,data=0",
    cq_thread: "sim-ssd-cq",
    step_ns: 50 * US,
    write_bytes: 32 << 10,
};

const HDD: Flood = Flood {
    spec: "sim:hdd,size=64G,data=0",
    cq_thread: "sim-hdd-cq",
    step_ns: MS,
    write_bytes: 32 << 10,
};

/// Three threads flood a simulated device with background writes while one thread
/// reads 4 KiB blocks sequentially, one at a time. Time moves a step at a time, only
/// when every thread involved is asleep, so the device always has what the threads
/// could submit.
fn flood(f: &Flood, wbt_lat_usec: Option<u64>, nr_reads: usize) -> FloodResult {
    let clock = ManualClock::new(0);
    let q = RequestQueue::open(
        f.spec,
        QueueConfig {
            wbt_lat_usec,
            clock: clock.clone(),
            ..Default::default()
        },
    )
    .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let written = Arc::new(Count::default());
    let mut names = vec![
        f.cq_thread.to_string(),
        format!("wbt-timer-{}", q.id()),
        "flood-reader".to_string(),
    ];
    let mut writers = vec![];
    let bs = f.write_bytes;
    for w in 0..3u64 {
        let (q, stop, written) = (q.clone(), stop.clone(), written.clone());
        let name = format!("flood-writer{w}");
        names.push(name.clone());
        writers.push(
            std::thread::Builder::new()
                .name(name)
                .spawn(move || {
                    let mut sector = (1 + w) << 22;
                    while !stop.load(Ordering::SeqCst) {
                        let bio = Bio::write(sector, IoBuf::zeroed(bs))
                            .with_flags(BioFlags::BACKGROUND)
                            .with_end_io(written.clone());
                        q.submit_bio(bio).unwrap();
                        sector += bs as u64 / 512;
                    }
                })
                .unwrap(),
        );
    }
    let lat = Arc::new(Mutex::new(Vec::with_capacity(nr_reads)));
    let reader = {
        let (q, clock, lat) = (q.clone(), clock.clone(), lat.clone());
        std::thread::Builder::new()
            .name("flood-reader".into())
            .spawn(move || {
                let mut steps = vec![];
                for i in 0..nr_reads as u64 {
                    let t0 = clock.now_ns();
                    q.read_sync(i * 8, 4096).unwrap();
                    lat.lock().push(clock.now_ns() - t0);
                    let step = q.wbt_state().scale_step;
                    if steps.last() != Some(&step) {
                        steps.push(step);
                    }
                }
                steps
            })
            .unwrap()
    };
    while !reader.is_finished() {
        settle(&names);
        clock.advance(f.step_ns);
    }
    let steps = reader.join().unwrap();
    let sim_ns = clock.now_ns();
    let s = q.wbt_state();
    stop.store(true, Ordering::SeqCst);
    // Writers blocked in wbt or on a tag need completions to get out.
    while writers.iter().any(|w| !w.is_finished()) {
        settle(&names);
        clock.advance(f.step_ns);
    }
    for w in writers {
        w.join().unwrap();
    }
    let sim = q.device().as_any().downcast_ref::<SimDevice>().unwrap();
    while sim.pending() > 0 {
        settle(&names);
        clock.advance(f.step_ns);
    }
    let read_lat = std::mem::take(&mut *lat.lock());
    FloodResult {
        read_lat,
        bytes_written: written.0.load(Ordering::SeqCst) * bs as u64,
        sim_ns,
        waits: s.waits[RWQ_BG],
        windows: s.windows,
        steps,
    }
}

fn p99(v: &[u64]) -> u64 {
    let mut v = v.to_vec();
    v.sort_unstable();
    v[(v.len() * 99 / 100).min(v.len() - 1)]
}

#[test]
fn wbt_keeps_reads_fast_under_a_background_flood() {
    let on = flood(&SSD, None, 2000);
    let off = flood(&SSD, Some(0), 40);
    let target = 2 * MS;
    let mb_s = |r: &FloodResult| r.bytes_written as f64 / r.sim_ns as f64 * 1e3;
    eprintln!(
        "wbt on: read p99 {} us max {} us, writes {:.0} MB/s, {} waits, {} windows; \
         steps {:?}; off: read p99 {} us, writes {:.0} MB/s",
        p99(&on.read_lat) / US,
        on.read_lat.iter().max().unwrap_or(&0) / US,
        mb_s(&on),
        on.waits,
        on.windows,
        on.steps,
        p99(&off.read_lat) / US,
        mb_s(&off),
    );
    assert_eq!(on.read_lat.len(), 2000);
    assert!(
        p99(&on.read_lat) <= 2 * target,
        "wbt on: read p99 {} us over twice the 2 ms target",
        p99(&on.read_lat) / US
    );
    assert!(
        p99(&off.read_lat) > 4 * target,
        "wbt off: read p99 {} us; the flood should push reads far past the target",
        p99(&off.read_lat) / US
    );
    assert!(on.waits > 0, "wbt did the throttling");
    assert_eq!(off.waits, 0);
    // Reads met the target with writes held back, so wbt gave writes more depth step by
    // step; when a tenth of a window's reads missed the target it cut depth, straight
    // to 0 from a negative step.
    assert!(on.windows >= 5, "{} windows", on.windows);
    let moves = on.steps.windows(2);
    assert!(
        moves.clone().filter(|w| w[1] == w[0] - 1).count() >= 3
            && moves
                .clone()
                .all(|w| w[1] == w[0] - 1 || w[1] == w[0] + 1 || (w[0] < 0 && w[1] == 0)),
        "steps {:?}",
        on.steps
    );
    // Writes still flow: throttling trades some write bandwidth, not most of it.
    assert!(mb_s(&on) > 0.5 * mb_s(&off), "writes starved under wbt");
}

#[test]
fn wbt_keeps_reads_under_target_on_a_disk() {
    let on = flood(&HDD, None, 150);
    let off = flood(&HDD, Some(0), 25);
    let target = 75 * MS;
    let mb_s = |r: &FloodResult| r.bytes_written as f64 / r.sim_ns as f64 * 1e3;
    eprintln!(
        "hdd wbt on: read p99 {} ms, writes {:.1} MB/s, {} windows, steps {:?}; \
         off: read p99 {} ms, writes {:.1} MB/s",
        p99(&on.read_lat) / MS,
        mb_s(&on),
        on.windows,
        on.steps,
        p99(&off.read_lat) / MS,
        mb_s(&off),
    );
    assert!(
        p99(&on.read_lat) <= target,
        "wbt on: read p99 {} ms over the 75 ms target",
        p99(&on.read_lat) / MS
    );
    assert!(
        p99(&off.read_lat) > 5 * target / 2,
        "wbt off: read p99 {} ms; 32 queued writes should cost reads far more",
        p99(&off.read_lat) / MS
    );
    assert!(on.waits > 0);
    // Reads met the target, so depth went up to the cap (24 = 3/4 of QD 32 at step
    // −1) and stayed there.
    assert_eq!(on.steps, [0, -1]);
    assert!(mb_s(&on) > 0.5 * mb_s(&off), "writes starved under wbt");
}
