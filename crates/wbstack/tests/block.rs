//! Block layer behaviour: plug merging and limits (reference §3.9), diskstats and
//! in-flight accounting (§5.6), tags, bad input, splitting.

mod common_recorder;

use common_recorder::{Recorder, RqInfo};
use std::sync::Arc;
use std::time::{Duration, Instant};
use wbstack::block::{
    Bio, BioFlags, BioWait, BlkError, IoStatsMode, Op, Plug, QueueConfig, RequestQueue,
};
use wbstack::buf::IoBuf;
use wbstack::clock::{ManualClock, RealClock};
use wbstack::dev::{self, null::NullDevice};

fn null_queue(spec: &str, iostats: IoStatsMode) -> (Arc<Recorder>, Arc<RequestQueue>) {
    let dev = dev::open(spec, RealClock::new()).unwrap();
    let rec = Recorder::new(dev);
    let q = RequestQueue::new(
        rec.clone(),
        QueueConfig {
            iostats,
            ..Default::default()
        },
    )
    .unwrap();
    (rec, q)
}

fn pattern(len: usize, seed: u64) -> IoBuf {
    let mut b = IoBuf::zeroed(len);
    for (i, x) in b.as_mut_slice().iter_mut().enumerate() {
        *x = (i as u64).wrapping_mul(31).wrapping_add(seed * 131) as u8;
    }
    b
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::yield_now();
    }
}

#[test]
fn sequential_64k_bios_merge_up_to_max_sectors() {
    // Reference §3.9 scenario 1: 21 sequential 64 KiB bios in one plug → one
    // 1280 KiB request of 20 bios; the 21st starts a new request, and since the last
    // request reached 128 KiB the plug is flushed before it is added.
    let (rec, q) = null_queue("null,memory_backed=1,hw_queues=1", IoStatsMode::Tags);
    let w = BioWait::new();
    {
        let _plug = Plug::start();
        for i in 0..21u64 {
            let bio = Bio::write(i * 128, pattern(65536, i)).with_end_io(w.clone());
            q.submit_bio(bio).unwrap();
            if i == 19 {
                assert_eq!(
                    rec.log.lock().len(),
                    0,
                    "nothing leaves the plug while it merges"
                );
            }
        }
        assert_eq!(
            rec.log.lock().len(),
            1,
            "flushed before adding the 21st request"
        );
        assert_eq!(wbstack::block::plug::plugged_requests(), 1);
    }
    let log = rec.take();
    assert_eq!(log.len(), 2);
    assert_eq!(
        (
            log[0].sector,
            log[0].nr_sectors,
            log[0].nr_bios,
            log[0].nr_segments
        ),
        (0, 2560, 20, 20)
    );
    assert_eq!(
        (log[1].sector, log[1].nr_sectors, log[1].nr_bios),
        (2560, 128, 1)
    );
    assert_eq!(w.wait_n(21).len(), 21);
    let d = q.diskstats();
    assert_eq!(d.writes(), 2);
    assert_eq!(d.merges[1], 19);
    assert_eq!(d.sectors[1], 21 * 128);
    // Data written through merged requests reads back identical.
    let back = q.read_sync(0, 21 * 65536).unwrap();
    for i in 0..21usize {
        assert_eq!(
            &back.as_slice()[i * 65536..(i + 1) * 65536],
            pattern(65536, i as u64).as_slice()
        );
    }
}

#[test]
fn thirty_three_scattered_writes_flush_at_the_33rd() {
    // §3.9 scenario 2.
    let (rec, q) = null_queue("null,hw_queues=1,qd=64", IoStatsMode::Tags);
    let w = BioWait::new();
    let _plug = Plug::start();
    for i in 0..33u64 {
        q.submit_bio(Bio::write(i * 1000, IoBuf::zeroed(4096)).with_end_io(w.clone()))
            .unwrap();
    }
    assert_eq!(rec.log.lock().len(), 32);
    assert_eq!(wbstack::block::plug::plugged_requests(), 1);
    drop(_plug);
    assert_eq!(rec.take().len(), 33);
}

#[test]
fn segment_limit_cuts_at_128_discontiguous_bios() {
    // §3.9 scenario 6: 129 separately allocated 4 KiB bios back to back on disk.
    let (rec, q) = null_queue("null,hw_queues=1", IoStatsMode::Tags);
    {
        let _plug = Plug::start();
        for i in 0..129u64 {
            q.submit_bio(Bio::write(i * 8, IoBuf::zeroed(4096)))
                .unwrap();
        }
    }
    let log = rec.take();
    assert_eq!(log.len(), 2);
    assert_eq!(
        (log[0].nr_bios, log[0].nr_segments, log[0].nr_sectors),
        (128, 128, 1024)
    );
    assert_eq!((log[1].sector, log[1].nr_bios), (1024, 1));
}

#[test]
fn nested_plug_dispatches_at_outer_finish_and_sorts_by_sector() {
    let (rec, q) = null_queue("null,hw_queues=1", IoStatsMode::Tags);
    let outer = Plug::start();
    {
        let _inner = Plug::start();
        for s in [800u64, 16, 400, 8, 0] {
            q.submit_bio(Bio::write(s, IoBuf::zeroed(4096))).unwrap();
        }
    }
    assert!(rec.log.lock().is_empty(), "inner finish is a no-op");
    drop(outer);
    let log = rec.take();
    let sectors: Vec<u64> = log.iter().map(|r| r.sector).collect();
    // 0,8,16 merged (back and front merges) into one request; the rest sorted.
    assert_eq!(sectors, vec![0, 400, 800]);
    assert_eq!(log[0].nr_sectors, 24);
}

#[test]
fn flush_and_fua_keep_their_order_through_a_plug() {
    let (rec, q) = null_queue("null,hw_queues=1", IoStatsMode::Tags);
    {
        let _plug = Plug::start();
        q.submit_bio(Bio::write(800, IoBuf::zeroed(4096))).unwrap();
        q.submit_bio(Bio::write(808, IoBuf::zeroed(4096))).unwrap();
        q.submit_bio(Bio::flush()).unwrap();
        q.submit_bio(Bio::write(816, IoBuf::zeroed(4096)).with_flags(BioFlags::FUA))
            .unwrap();
        q.submit_bio(Bio::write(0, IoBuf::zeroed(4096))).unwrap();
    }
    let log: Vec<(Op, u64)> = rec.take().iter().map(|r| (r.op, r.sector)).collect();
    assert_eq!(
        log,
        vec![
            (Op::Write, 800),
            (Op::Flush, 0),
            (Op::Write, 816),
            (Op::Write, 0)
        ]
    );
}

#[test]
fn waiting_on_own_plugged_bio_does_not_deadlock() {
    let (_rec, q) = null_queue("null,hw_queues=1", IoStatsMode::Tags);
    let _plug = Plug::start();
    let w = BioWait::new();
    q.submit_bio(Bio::write(0, IoBuf::zeroed(4096)).with_end_io(w.clone()))
        .unwrap();
    assert_eq!(wbstack::block::plug::plugged_requests(), 1);
    let (_bio, st) = w.wait_one(); // flushes the plug before sleeping
    st.unwrap();
    // Also a sync read while plugged.
    q.read_sync(0, 4096).unwrap();
}

#[test]
fn tag_exhaustion_blocks_and_resumes() {
    let dev = dev::open("null,hw_queues=1,qd=2", RealClock::new()).unwrap();
    let q = RequestQueue::new(dev.clone(), QueueConfig::default()).unwrap();
    let null = dev.as_any().downcast_ref::<NullDevice>().unwrap();
    null.hold(true);
    let w = BioWait::new();
    for i in 0..2 {
        q.submit_bio(Bio::write(i * 8, IoBuf::zeroed(4096)).with_end_io(w.clone()))
            .unwrap();
    }
    assert_eq!(q.in_flight(), [0, 2]);
    let (q2, w2) = (q.clone(), w.clone());
    let t = std::thread::spawn(move || {
        q2.submit_bio(Bio::write(64, IoBuf::zeroed(4096)).with_end_io(w2))
            .unwrap();
    });
    // The third submitter is stuck on a tag while the device holds both.
    wait_until("two requests held", || null.pending() == 2);
    assert!(!t.is_finished());
    assert_eq!(w.completed(), 0);
    null.hold(false);
    t.join().unwrap();
    assert_eq!(w.wait_n(3).len(), 3);
    assert_eq!(q.in_flight(), [0, 0]);
}

#[test]
fn meta_and_data_bios_never_share_a_request() {
    // data=meta keeps a request's data by its META flag: a bio merged into a request
    // of the other kind would be kept, or dropped, as that kind.
    for meta_first in [false, true] {
        let q = RequestQueue::open("sim:ssd,size=64M,data=meta", QueueConfig::default()).unwrap();
        let flags = |meta: bool| {
            if meta {
                BioFlags::META
            } else {
                BioFlags::empty()
            }
        };
        let w = BioWait::new();
        {
            let _plug = Plug::start();
            for (sector, meta) in [(0u64, meta_first), (8, !meta_first)] {
                let fill = if meta { 0x11 } else { 0x22 };
                q.submit_bio(
                    Bio::write(sector, IoBuf::from_slice(&[fill; 4096]))
                        .with_flags(flags(meta))
                        .with_end_io(w.clone()),
                )
                .unwrap();
            }
        }
        for (_, st) in w.wait_n(2) {
            st.unwrap();
        }
        // The byte a block is filled with, None if it is not uniform.
        let fill = |sector| {
            let b = q.read_sync(sector, 4096).unwrap();
            let s = b.as_slice();
            s.iter().all(|&x| x == s[0]).then_some(s[0])
        };
        let (meta_at, data_at) = if meta_first { (0, 8) } else { (8, 0) };
        assert_eq!(
            fill(meta_at),
            Some(0x11),
            "meta first: {meta_first}: the META write is kept"
        );
        assert_eq!(
            fill(data_at),
            Some(0),
            "meta first: {meta_first}: the data write is not"
        );
        assert_eq!(q.diskstats().merges, [0; 4]);
    }
}

#[test]
fn exact_diskstats_for_a_known_workload() {
    for mode in [IoStatsMode::Atomic, IoStatsMode::Tags] {
        let (_rec, q) = null_queue("null,memory_backed=1,hw_queues=2", mode);
        let w = BioWait::new();
        {
            let _plug = Plug::start();
            // 8 adjacent 4 KiB writes → 1 request, 7 merges.
            for i in 0..8u64 {
                q.submit_bio(Bio::write(i * 8, IoBuf::zeroed(4096)).with_end_io(w.clone()))
                    .unwrap();
            }
            // 3 scattered writes → 3 requests.
            for i in 0..3u64 {
                q.submit_bio(
                    Bio::write(10_000 + i * 100, IoBuf::zeroed(4096)).with_end_io(w.clone()),
                )
                .unwrap();
            }
        }
        w.wait_n(11);
        for i in 0..5u64 {
            q.read_sync(i * 8, 4096).unwrap();
        }
        q.flush_sync().unwrap();
        q.discard_sync(20_000, 64).unwrap();
        // A PREFLUSH|FUA write (a journal commit) counts as a write and a flush, as the
        // kernel's blk-flush sequence does; FUA alone adds no flush.
        q.write_sync(
            30_000,
            IoBuf::zeroed(4096),
            BioFlags::PREFLUSH | BioFlags::FUA,
        )
        .unwrap();
        q.write_sync(31_000, IoBuf::zeroed(4096), BioFlags::FUA)
            .unwrap();
        let d = q.diskstats();
        assert_eq!(d.ios, [5, 6, 1, 2], "{mode}");
        assert_eq!(d.merges, [0, 7, 0, 0], "{mode}");
        assert_eq!(d.sectors, [40, 104, 64, 0], "{mode}");
        assert_eq!(d.in_flight, [0, 0]);
        let line = d.line(254, 0, "wbs0");
        assert!(line.starts_with(" 254       0 wbs0 5 0 40 "), "{line}");
        assert_eq!(line.split_whitespace().count(), 3 + 17);
    }
    // iostats=off counts nothing.
    let (_rec, q) = null_queue("null", IoStatsMode::Off);
    q.write_sync(0, IoBuf::zeroed(4096), BioFlags::empty())
        .unwrap();
    assert_eq!(q.diskstats().ios, [0; 4]);
}

#[test]
fn in_flight_equals_outstanding_requests_while_held() {
    for mode in [IoStatsMode::Atomic, IoStatsMode::Tags] {
        let dev = dev::open("null,hw_queues=2,qd=32", RealClock::new()).unwrap();
        let q = RequestQueue::new(
            dev.clone(),
            QueueConfig {
                iostats: mode,
                ..Default::default()
            },
        )
        .unwrap();
        let null = dev.as_any().downcast_ref::<NullDevice>().unwrap();
        null.hold(true);
        let w = BioWait::new();
        for i in 0..5u64 {
            q.submit_bio(Bio::read(i * 1000, 4096).with_end_io(w.clone()))
                .unwrap();
        }
        for i in 0..3u64 {
            q.submit_bio(Bio::write(50_000 + i * 1000, IoBuf::zeroed(4096)).with_end_io(w.clone()))
                .unwrap();
        }
        assert_eq!(q.diskstats().in_flight, [5, 3], "{mode}");
        assert_eq!(q.in_flight(), [5, 3]);
        null.hold(false);
        w.wait_n(8);
        assert_eq!(q.diskstats().in_flight, [0, 0]);
    }
}

/// A queue over a null device on a manual clock, one hardware queue.
fn manual_null_queue(
    iostats: IoStatsMode,
) -> (Arc<ManualClock>, dev::DeviceRef, Arc<RequestQueue>) {
    let clock = ManualClock::new(1000 * 1_000_000_000);
    let dev = dev::open("null,hw_queues=1", clock.clone()).unwrap();
    let q = RequestQueue::new(
        dev.clone(),
        QueueConfig {
            iostats,
            clock: clock.clone(),
            ..Default::default()
        },
    )
    .unwrap();
    (clock, dev, q)
}

#[test]
fn switching_iostats_with_io_in_flight_leaves_diskstats_sound() {
    // Each request is counted out the way it was counted in (RQF_IO_STAT), whatever
    // the mode is when it completes.
    let ms = 1_000_000u64;
    for (from, to) in [
        (IoStatsMode::Atomic, IoStatsMode::Tags),
        (IoStatsMode::Atomic, IoStatsMode::Off),
        (IoStatsMode::Tags, IoStatsMode::Atomic),
    ] {
        let (clock, dev, q) = manual_null_queue(from);
        let null = dev.as_any().downcast_ref::<NullDevice>().unwrap();
        q.diskstats();
        null.hold(true);
        let w = BioWait::new();
        q.submit_bio(Bio::write(0, IoBuf::zeroed(4096)).with_end_io(w.clone()))
            .unwrap();
        q.set_iostats(to);
        clock.advance(10 * ms);
        null.hold(false);
        w.wait_n(1);
        q.set_iostats(IoStatsMode::Atomic);
        let idle = q.diskstats();
        assert_eq!(idle.in_flight, [0, 0], "{from} -> {to}");
        assert_eq!(idle.ios[1], 1, "{from} -> {to}: the write is counted once");
        clock.advance(100 * ms);
        assert_eq!(
            q.diskstats().io_ticks_ms,
            idle.io_ticks_ms,
            "{from} -> {to}: io_ticks grew on an idle disk"
        );
        // The next write is in flight, and counted so.
        null.hold(true);
        q.submit_bio(Bio::write(8, IoBuf::zeroed(4096)).with_end_io(w.clone()))
            .unwrap();
        assert_eq!(q.diskstats().in_flight, [0, 1], "{from} -> {to}");
        null.hold(false);
        w.wait_n(1);
    }
}

/// A flush in flight is counted as the kernel counts it (op_is_write: a read), the
/// same in either accounting mode.
#[test]
fn a_flush_in_flight_counts_alike_in_atomic_and_tags_modes() {
    for mode in [IoStatsMode::Atomic, IoStatsMode::Tags] {
        let (_clock, dev, q) = manual_null_queue(mode);
        let null = dev.as_any().downcast_ref::<NullDevice>().unwrap();
        null.hold(true);
        let w = BioWait::new();
        q.submit_bio(Bio::flush().with_end_io(w.clone())).unwrap();
        assert_eq!(q.diskstats().in_flight, [1, 0], "{mode}");
        null.hold(false);
        w.wait_n(1);
        assert_eq!(q.diskstats().in_flight, [0, 0], "{mode}");
    }
}

#[test]
fn a_request_started_with_iostats_off_is_not_counted_when_they_come_on() {
    let ms = 1_000_000u64;
    let (clock, dev, q) = manual_null_queue(IoStatsMode::Off);
    let null = dev.as_any().downcast_ref::<NullDevice>().unwrap();
    null.hold(true);
    let w = BioWait::new();
    q.submit_bio(Bio::write(0, IoBuf::zeroed(4096)).with_end_io(w.clone()))
        .unwrap();
    q.set_iostats(IoStatsMode::Tags);
    clock.advance(10 * ms);
    null.hold(false);
    w.wait_n(1);
    // Counting it would take its start as the clock's zero: 1000 s of write ticks.
    let d = q.diskstats();
    assert_eq!((d.ios[1], d.nsecs[1]), (0, 0), "{d:?}");
    // A write started with iostats on is counted, from its start.
    null.hold(true);
    q.submit_bio(Bio::write(8, IoBuf::zeroed(4096)).with_end_io(w.clone()))
        .unwrap();
    clock.advance(10 * ms);
    null.hold(false);
    w.wait_n(1);
    let d = q.diskstats();
    assert_eq!((d.ios[1], d.ticks_ms(1)), (1, 10), "{d:?}");
}

#[test]
fn a_preflush_write_counts_its_flush_but_leaves_in_flight_alone() {
    // The flush half of a PREFLUSH write is counted at completion only: it was never
    // started, so it must not count a request out of flight.
    let dev = dev::open("null,hw_queues=1", RealClock::new()).unwrap();
    let q = RequestQueue::new(
        dev.clone(),
        QueueConfig {
            iostats: IoStatsMode::Atomic,
            ..Default::default()
        },
    )
    .unwrap();
    let null = dev.as_any().downcast_ref::<NullDevice>().unwrap();
    q.write_sync(0, IoBuf::zeroed(4096), BioFlags::PREFLUSH)
        .unwrap();
    assert_eq!(q.diskstats().flushes(), 1);
    null.hold(true);
    let w = BioWait::new();
    q.submit_bio(Bio::read(8, 4096).with_end_io(w.clone()))
        .unwrap();
    assert_eq!(q.diskstats().in_flight, [1, 0]);
    null.hold(false);
    w.wait_n(1);
    assert_eq!(q.diskstats().in_flight, [0, 0]);
}

#[test]
fn io_ticks_and_time_in_queue_follow_the_kernel() {
    // §5.6 scenarios 1-3 on a manual clock, with requests held in the device.
    for mode in [IoStatsMode::Atomic, IoStatsMode::Tags] {
        let clock = ManualClock::new(1_000_000_000);
        let dev = dev::open("null,hw_queues=1", clock.clone()).unwrap();
        let q = RequestQueue::new(
            dev.clone(),
            QueueConfig {
                iostats: mode,
                clock: clock.clone(),
                ..Default::default()
            },
        )
        .unwrap();
        let null = dev.as_any().downcast_ref::<NullDevice>().unwrap();
        let ms = 1_000_000u64;
        // Prime the stamp so idle time before the first IO is not counted.
        q.diskstats();
        clock.advance(5 * ms);

        // 1. One 10 ms IO on an idle disk: io_ticks +10, time_in_queue +10.
        null.hold(true);
        let w = BioWait::new();
        q.submit_bio(Bio::read(0, 4096).with_end_io(w.clone()))
            .unwrap();
        assert_eq!(q.diskstats().in_flight, [1, 0]);
        clock.advance(10 * ms);
        null.hold(false);
        w.wait_n(1);
        let d1 = q.diskstats();
        assert_eq!((d1.io_ticks_ms, d1.time_in_queue_ms), (10, 10), "{mode}");
        assert_eq!(d1.ticks_ms(0), 10);

        // 2. Overlapping IOs [0,10] and [5,10] ms (the null device releases held
        // requests together): io_ticks is the union, 10; time_in_queue 5·1 + 5·2 = 15.
        clock.advance(100 * ms);
        q.diskstats();
        null.hold(true);
        let w = BioWait::new();
        q.submit_bio(Bio::read(8, 4096).with_end_io(w.clone()))
            .unwrap();
        clock.advance(5 * ms);
        q.submit_bio(Bio::read(16, 4096).with_end_io(w.clone()))
            .unwrap();
        clock.advance(5 * ms);
        null.hold(false);
        w.wait_n(2);
        let d2 = q.diskstats().delta(&d1);
        assert_eq!((d2.io_ticks_ms, d2.time_in_queue_ms), (10, 15), "{mode}");

        // 3. A long IO read while in progress is accounted up to the read.
        clock.advance(50 * ms);
        let before = q.diskstats();
        null.hold(true);
        let w = BioWait::new();
        q.submit_bio(Bio::read(24, 4096).with_end_io(w.clone()))
            .unwrap();
        clock.advance(3000 * ms);
        let mid = q.diskstats().delta(&before);
        assert_eq!(mid.io_ticks_ms, 3000, "{mode}");
        null.hold(false);
        w.wait_n(1);
    }
}

#[test]
fn bad_bios_are_refused_with_a_reason() {
    let (_rec, q) = null_queue("null,size=1M,lbs=4096", IoStatsMode::Tags);
    let e = q
        .submit_bio(Bio::write(1, IoBuf::zeroed(4096)))
        .unwrap_err();
    assert!(
        matches!(&e, BlkError::Invalid(m) if m.contains("not aligned")),
        "{e}"
    );
    let e = q
        .submit_bio(Bio::write(2048 - 8, IoBuf::zeroed(8192)))
        .unwrap_err();
    assert!(
        matches!(&e, BlkError::Invalid(m) if m.contains("past the end")),
        "{e}"
    );
    let mut b = Bio::write(0, IoBuf::zeroed(4096));
    b.nr_sectors = 16;
    let e = q.submit_bio(b).unwrap_err();
    assert!(
        matches!(&e, BlkError::Invalid(m) if m.contains("buffer holds")),
        "{e}"
    );
    let e = q.submit_bio(Bio::write(0, IoBuf::zeroed(0))).unwrap_err();
    assert!(matches!(&e, BlkError::Invalid(_)), "{e}");
    assert_eq!(e.errno(), libc::EINVAL);
    assert!(q.set_max_sectors_kb(0).is_err());
    // Bad device specs.
    for spec in [
        "nul",
        "null,size=1001",
        "null,lbs=1000",
        "null,qd=0",
        "null,bogus=1",
        "null,size=12q",
    ] {
        let e = dev::open(spec, RealClock::new())
            .err()
            .unwrap_or_else(|| panic!("{spec} accepted"));
        assert!(
            e.to_string().contains(spec.split(',').next().unwrap()),
            "{e}"
        );
    }
}

#[test]
fn oversized_bios_are_split_and_complete_once() {
    let (rec, q) = null_queue("null,memory_backed=1,hw_queues=1", IoStatsMode::Tags);
    let data = pattern(4 << 20, 7);
    q.write_sync(0, data.clone(), BioFlags::empty()).unwrap();
    let log: Vec<u32> = rec.take().iter().map(|r| r.nr_sectors).collect();
    assert_eq!(log, vec![2560, 2560, 2560, 8192 - 3 * 2560]);
    let back = q.read_sync(0, 4 << 20).unwrap();
    assert_eq!(back.as_slice(), data.as_slice());
    assert_eq!(rec.take().len(), 4);
}

mod props {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Sub {
        Write { block: u64, blocks: u32 },
        Flush,
        Fua { block: u64 },
    }

    fn sub() -> impl Strategy<Value = Sub> {
        prop_oneof![
            8 => (0u64..96, 1u32..48).prop_map(|(block, blocks)| Sub::Write { block, blocks }),
            1 => Just(Sub::Flush),
            1 => (0u64..96).prop_map(|block| Sub::Fua { block }),
        ]
    }

    fn check(subs: &[Sub], max_kb: u32, rec: &Recorder, q: &Arc<RequestQueue>) {
        q.set_max_sectors_kb(max_kb).unwrap();
        let w = BioWait::new();
        let mut expected = vec![0u8; 160 * 4096];
        let mut n = 0;
        let mut pending: Vec<(u64, u64)> = Vec::new();
        {
            let _plug = Plug::start();
            for (i, s) in subs.iter().enumerate() {
                let bio = match s {
                    Sub::Write { block, blocks } => {
                        let buf = pattern(*blocks as usize * 4096, i as u64 + 1);
                        let off = *block as usize * 4096;
                        expected[off..off + buf.len()].copy_from_slice(buf.as_slice());
                        Bio::write(block * 8, buf)
                    }
                    Sub::Flush => Bio::flush(),
                    Sub::Fua { block } => {
                        let buf = pattern(4096, 1000 + i as u64);
                        let off = *block as usize * 4096;
                        expected[off..off + 4096].copy_from_slice(buf.as_slice());
                        Bio::write(block * 8, buf).with_flags(BioFlags::FUA)
                    }
                };
                // The page cache never has two writes of one block in flight at once;
                // keep the model exact the same way: before a write that overlaps one
                // still pending, push the plug out and wait for everything pending.
                let range = (bio.sector, bio.end_sector());
                if bio.op == Op::Write && pending.iter().any(|&(a, b)| range.0 < b && a < range.1) {
                    w.wait_n(n);
                    n = 0;
                    pending.clear();
                }
                pending.push(range);
                q.submit_bio(bio.with_end_io(w.clone())).unwrap();
                n += 1;
            }
        }
        w.wait_n(n);
        let log = rec.take();
        let lim = q.limits();
        let max = q.max_sectors();
        let mut covered: Vec<(u64, u32)> = Vec::new();
        for r in &log {
            if r.op == Op::Write {
                assert!(
                    r.nr_sectors <= max,
                    "request {r:?} exceeds max_sectors {max}"
                );
                assert!(r.nr_segments <= lim.max_segments);
                // The bios of a request are contiguous and add up to it.
                let mut s = r.sector;
                for (bs, bn) in &r.bios {
                    assert_eq!(*bs, s, "{r:?}");
                    s += *bn as u64;
                }
                assert_eq!(s, r.sector + r.nr_sectors as u64);
                if r.flags.contains(BioFlags::FUA) {
                    assert_eq!(r.nr_bios, 1, "FUA writes never merge");
                }
                covered.extend(r.bios.iter().copied());
            }
        }
        let mut want: Vec<(u64, u32)> = subs
            .iter()
            .filter_map(|s| match s {
                Sub::Write { block, blocks } => Some((block * 8, blocks * 8)),
                Sub::Fua { block } => Some((block * 8, 8)),
                Sub::Flush => None,
            })
            .flat_map(|(s, n)| {
                // Split at max_sectors the way submit_bio does.
                (0..n.div_ceil(max)).map(move |i| (s + (i * max) as u64, max.min(n - i * max)))
            })
            .collect();
        covered.sort();
        want.sort();
        assert_eq!(
            covered, want,
            "requests cover exactly the submitted sectors"
        );
        assert_eq!(
            log.iter().filter(|r| r.op == Op::Flush).count(),
            subs.iter().filter(|s| matches!(s, Sub::Flush)).count()
        );
        let back = q.read_sync(0, expected.len()).unwrap();
        assert!(back.as_slice() == &expected[..], "data read back differs");
        rec.take();
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]
        #[test]
        fn plug_merging_is_exact_on_null(subs in prop::collection::vec(sub(), 1..60), max_kb in prop::sample::select(vec![8u32, 64, 128, 1280])) {
            let (rec, q) = null_queue("null,memory_backed=1,hw_queues=1,lbs=4096", IoStatsMode::Tags);
            check(&subs, max_kb, &rec, &q);
        }
    }

    // Non-overlapping batches in one plug: real merging across many bios, then the
    // same checks.
    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]
        #[test]
        fn plug_batches_merge_within_limits(blocks in prop::collection::btree_set(0u64..400, 1..200), max_kb in prop::sample::select(vec![16u32, 128, 1280])) {
            let (rec, q) = null_queue("null,memory_backed=1,hw_queues=1,lbs=4096", IoStatsMode::Tags);
            q.set_max_sectors_kb(max_kb).unwrap();
            let w = BioWait::new();
            let blocks: Vec<u64> = blocks.into_iter().collect();
            let mut order = blocks.clone();
            // Submit in a scrambled order so front merges and the sort are exercised.
            order.sort_by_key(|b| (b * 7919) % 401);
            {
                let _plug = Plug::start();
                for b in &order {
                    q.submit_bio(Bio::write(b * 8, pattern(4096, *b)).with_end_io(w.clone())).unwrap();
                }
            }
            w.wait_n(order.len());
            let log = rec.take();
            let max = q.max_sectors();
            let mut seen = Vec::new();
            for r in &log {
                prop_assert!(r.nr_sectors <= max);
                prop_assert!(r.nr_segments <= q.limits().max_segments);
                let mut s = r.sector;
                for (bs, bn) in &r.bios {
                    prop_assert_eq!(*bs, s);
                    s += *bn as u64;
                    seen.push(bs / 8);
                }
            }
            seen.sort();
            prop_assert_eq!(&seen, &blocks);
            prop_assert!(log.len() <= order.len());
            let d = q.diskstats();
            prop_assert_eq!(d.writes() + d.merges[1], order.len() as u64);
            for b in &blocks {
                let back = q.read_sync(b * 8, 4096).unwrap();
                prop_assert!(back.as_slice() == pattern(4096, *b).as_slice());
            }
        }
    }
}

#[allow(dead_code)]
fn _uses(_: RqInfo) {}

mod qos_chain {
    use super::*;
    use parking_lot::{Condvar, Mutex};
    use wbstack::block::qos::RqQos;
    use wbstack::block::Request;

    /// A one-at-a-time write limiter, like wbt at depth 1: throttle blocks while a
    /// tracked write is in flight, and flushes the caller's plug before sleeping.
    #[derive(Default)]
    struct DepthOne {
        inflight: Mutex<u32>,
        cv: Condvar,
        calls: Mutex<[u32; 3]>,
        max_seen: Mutex<u32>,
    }

    impl RqQos for DepthOne {
        fn name(&self) -> &'static str {
            "depth-one"
        }
        fn throttle(&self, bio: &Bio) -> u8 {
            self.calls.lock()[0] += 1;
            if bio.op != Op::Write {
                return 0;
            }
            let mut n = self.inflight.lock();
            while *n >= 1 {
                wbstack::block::flush_plug();
                self.cv.wait(&mut n);
            }
            *n += 1;
            let mut m = self.max_seen.lock();
            *m = (*m).max(*n);
            1
        }
        fn issue(&self, _rq: &Request, _now: u64) {
            self.calls.lock()[1] += 1;
        }
        fn done(&self, rq: &Request, _now: u64) {
            self.calls.lock()[2] += 1;
            if rq.qos_flags == 1 {
                *self.inflight.lock() -= 1;
                self.cv.notify_all();
            }
        }
    }

    #[test]
    fn a_throttling_policy_never_deadlocks_a_plugged_submitter() {
        let dev = dev::open("null,hw_queues=1,completion_nsec=200us", RealClock::new()).unwrap();
        let q = RequestQueue::new(dev, QueueConfig::default()).unwrap();
        let qos = Arc::new(DepthOne::default());
        q.add_qos(qos.clone());
        let w = BioWait::new();
        {
            let _plug = Plug::start();
            for i in 0..10u64 {
                // Scattered: each write needs its own request, so each is throttled.
                q.submit_bio(Bio::write(i * 100, IoBuf::zeroed(4096)).with_end_io(w.clone()))
                    .unwrap();
            }
            q.submit_bio(Bio::read(5000, 4096).with_end_io(w.clone()))
                .unwrap();
        }
        assert_eq!(w.wait_n(11).len(), 11);
        assert_eq!(*qos.calls.lock(), [11, 11, 11]);
        assert_eq!(
            *qos.max_seen.lock(),
            1,
            "never more than one tracked write in flight"
        );
    }

    #[test]
    fn latency_windows_collect_only_while_armed() {
        let dev = dev::open("null,hw_queues=1,completion_nsec=1ms", RealClock::new()).unwrap();
        let q = RequestQueue::new(dev, QueueConfig::default()).unwrap();
        q.read_sync(0, 4096).unwrap();
        assert_eq!(
            q.latency_window().take()[0].nr,
            0,
            "nothing collected while disarmed"
        );
        q.latency_window().arm(true);
        for i in 0..3 {
            q.read_sync(i * 8, 4096).unwrap();
        }
        q.write_sync(64, IoBuf::zeroed(4096), BioFlags::empty())
            .unwrap();
        q.flush_sync().unwrap();
        let [r, wr] = q.latency_window().take();
        assert_eq!((r.nr, wr.nr), (3, 1), "flushes are not latency samples");
        assert!(
            r.min_ns >= 1_000_000 && r.max_ns >= r.min_ns && r.mean_ns() >= r.min_ns,
            "{r:?}"
        );
        assert_eq!(
            q.latency_window().take()[0].nr,
            0,
            "take starts a new window"
        );
    }
}

#[test]
fn an_image_loaded_into_a_null_device_reads_back_and_bad_loads_are_refused() {
    let dev = NullDevice::from_spec(
        &dev::DeviceSpec::parse("null,memory_backed=1,size=1M,hw_queues=1").unwrap(),
        RealClock::new(),
    )
    .unwrap();
    let image = pattern(8192, 7);
    dev.load(16, image.as_slice()).unwrap();
    assert!(dev.load(2047, &[0u8; 1024]).is_err(), "past the end");
    assert!(dev.load(0, &[0u8; 100]).is_err(), "not whole sectors");
    assert!(
        dev.load(u64::MAX, &[0u8; 512]).is_err(),
        "overflowing sector"
    );
    let q = RequestQueue::new(Arc::new(dev), QueueConfig::default()).unwrap();
    let w = BioWait::new();
    q.submit_bio(Bio::read(16, 8192).with_end_io(w.clone()))
        .unwrap();
    let (bio, status) = w.wait_one();
    status.unwrap();
    assert_eq!(bio.buf.unwrap().as_slice(), image.as_slice());
    let bare = NullDevice::from_spec(
        &dev::DeviceSpec::parse("null,size=1M").unwrap(),
        RealClock::new(),
    )
    .unwrap();
    assert!(bare.load(0, &[0u8; 512]).is_err(), "no store");
}
