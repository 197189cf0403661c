//! The simulated devices driven directly (no block layer): timing, data, power cuts,
//! fault injection and spec errors.

use parking_lot::{Condvar, Mutex};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;
use std::time::{Duration, Instant};
use wbstack::block::bio::{Bio, BioFlags, BlkError, BlkResult, Request};
use wbstack::buf::IoBuf;
use wbstack::clock::{ClockRef, ManualClock, RealClock};
use wbstack::dev::sim::SimDevice;
use wbstack::dev::{self, Completer, DeviceRef, RqComplete};

/// Bound on every wait for something that should happen: generous, since a loaded
/// machine can be slow, but a hang still fails instead of blocking the suite.
const PATIENCE: Duration = Duration::from_secs(10);

/// Tests that measure real-time throughput run one at a time: on a two-core machine a
/// concurrent test could starve the submitter and let the device queue run dry.
static TIMING: std::sync::Mutex<()> = std::sync::Mutex::new(());

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
    /// Wait until at least `n` completions are held, at most `limit`.
    fn wait_for(&self, n: usize, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let mut g = self.done.lock();
        while g.len() < n {
            if self.cv.wait_until(&mut g, deadline).timed_out() {
                return g.len() >= n;
            }
        }
        true
    }

    fn take(&self) -> Vec<(Request, BlkResult)> {
        std::mem::take(&mut *self.done.lock())
    }
}

struct Sim {
    dev: DeviceRef,
    c: Arc<Collector>,
    done: Completer,
}

impl Sim {
    fn open_with(spec: &str, clock: ClockRef) -> Sim {
        let dev = dev::open(spec, clock).unwrap_or_else(|e| panic!("{e}"));
        let c = Arc::new(Collector::default());
        Sim {
            dev,
            done: c.clone(),
            c,
        }
    }

    fn open(spec: &str) -> Sim {
        Sim::open_with(spec, RealClock::new())
    }

    fn sim(&self) -> &SimDevice {
        self.dev
            .as_any()
            .downcast_ref::<SimDevice>()
            .expect("a sim device")
    }

    fn submit(&self, rq: Request) {
        self.dev.queue_rq(rq, &self.done);
    }

    /// Submit one request and wait for its completion (nothing else may be in flight).
    fn run(&self, rq: Request) -> (Request, BlkResult) {
        self.submit(rq);
        assert!(self.c.wait_for(1, PATIENCE), "request never completed");
        let mut v = self.c.take();
        assert_eq!(v.len(), 1, "one completion expected");
        v.pop().unwrap()
    }

    fn write(&self, sector: u64, data: &[u8], flags: BioFlags) -> BlkResult {
        let bio = Bio::write(sector, IoBuf::from_slice(data)).with_flags(flags);
        self.run(Request::from_bio(bio, 1)).1
    }

    fn read(&self, sector: u64, len: usize) -> (Vec<u8>, BlkResult) {
        let (rq, st) = self.run(Request::from_bio(Bio::read(sector, len), 1));
        let data = rq.buffers().next().unwrap().as_slice().to_vec();
        (data, st)
    }

    fn read_ok(&self, sector: u64, len: usize) -> Vec<u8> {
        let (d, st) = self.read(sector, len);
        st.expect("read failed");
        d
    }

    fn flush(&self) -> BlkResult {
        self.run(Request::from_bio(Bio::flush(), 0)).1
    }
}

/// Bytes that differ per sector and per `tag`, never zero, so a lost sector shows.
fn pattern(sector: u64, len: usize, tag: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((sector + (i / 512) as u64) as u8).wrapping_mul(31) ^ tag | 1)
        .collect()
}

/// Keep `depth` requests outstanding until `total` have completed; returns the time
/// from the first submission to the last completion.
fn sustain(
    s: &Sim,
    total: usize,
    depth: usize,
    mut next: impl FnMut(usize) -> Request,
) -> Duration {
    let start = Instant::now();
    let mut submitted = 0;
    while submitted < depth.min(total) {
        s.submit(next(submitted));
        submitted += 1;
    }
    let mut completed = 0;
    while completed < total {
        assert!(
            s.c.wait_for(1, PATIENCE),
            "device stalled at {completed}/{total}"
        );
        for (_, st) in s.c.take() {
            st.expect("io failed");
            completed += 1;
            if submitted < total {
                s.submit(next(submitted));
                submitted += 1;
            }
        }
    }
    start.elapsed()
}

fn within(actual: f64, expected: f64, tol: f64) -> bool {
    (actual - expected).abs() <= expected * tol
}

#[test]
fn ssd_small_random_writes_are_capped_by_iops() {
    let _t = TIMING.lock().unwrap_or_else(|e| e.into_inner());
    let s = Sim::open("sim:ssd,iops=20000");
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let blocks = (1u64 << 40) / 4096;
    let buf = vec![0x5au8; 4096];
    let n = 10_000;
    let t = sustain(&s, n, 128, |_| {
        let sector = rng.gen_range(0..blocks) * 8;
        Request::from_bio(Bio::write(sector, IoBuf::from_slice(&buf)), 1)
    });
    let iops = n as f64 / t.as_secs_f64();
    eprintln!("4 KiB random writes: {iops:.0} IOPS");
    assert!(
        within(iops, 20_000.0, 0.10),
        "4 KiB random writes at {iops:.0} IOPS, expected 20000"
    );
    assert_eq!(s.sim().stats().writes, n as u64);
}

#[test]
fn ssd_large_writes_are_capped_by_bandwidth() {
    let _t = TIMING.lock().unwrap_or_else(|e| e.into_inner());
    let s = Sim::open("sim:ssd,bw=200M");
    let mib = vec![0xa5u8; 1 << 20];
    // A multiple of the 4 channels, so the last round is full.
    let n = 100;
    let t = sustain(&s, n, 64, |i| {
        Request::from_bio(Bio::write(i as u64 * 2048, IoBuf::from_slice(&mib)), 16)
    });
    let rate = n as f64 / t.as_secs_f64();
    eprintln!("1 MiB writes: {rate:.1} MiB/s");
    assert!(
        within(rate, 200.0, 0.10),
        "1 MiB writes at {rate:.1} MiB/s, expected 200"
    );
    assert_eq!(s.sim().stats().bytes_written, (n as u64) << 20);
}

#[test]
fn hdd_random_reads_are_far_slower_than_sequential() {
    let _t = TIMING.lock().unwrap_or_else(|e| e.into_inner());
    let n = 32;
    let seq = Sim::open("sim:hdd");
    let t_seq = sustain(&seq, n, 32, |i| {
        Request::from_bio(Bio::read(i as u64 * 8, 4096), 1)
    });
    let rnd = Sim::open("sim:hdd");
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let blocks = (1u64 << 40) / 4096;
    let t_rnd = sustain(&rnd, n, 32, |_| {
        Request::from_bio(Bio::read(rng.gen_range(0..blocks) * 8, 4096), 1)
    });
    eprintln!("hdd: 32 random 4 KiB reads {t_rnd:?}, 32 sequential {t_seq:?}");
    // Seek plus half a revolution on average is ~10 ms, against 26 us of transfer.
    assert!(
        t_rnd > t_seq * 10,
        "random {t_rnd:?} vs sequential {t_seq:?}"
    );
    assert!(
        t_rnd > Duration::from_millis(32 * 3),
        "random reads too fast: {t_rnd:?}"
    );
}

#[test]
fn data_reads_back() {
    let s = Sim::open("sim:ssd");
    let a = pattern(0, 8192, 1);
    s.write(0, &a, BioFlags::empty()).unwrap();
    // A two-bio request: the device must walk its buffers in order.
    let b1 = pattern(64, 4096, 2);
    let b2 = pattern(72, 12288, 3);
    let mut rq = Request::from_bio(Bio::write(64, IoBuf::from_slice(&b1)), 1);
    rq.bios.push(Bio::write(72, IoBuf::from_slice(&b2)));
    rq.nr_sectors += 24;
    rq.nr_segments += 1;
    rq.tag = 5;
    rq.hctx = 0;
    let (rq, st) = s.run(rq);
    st.unwrap();
    assert_eq!(rq.tag, 5, "the request comes back as it went in");

    assert_eq!(s.read_ok(0, 8192), a);
    let mut both = b1.clone();
    both.extend_from_slice(&b2);
    assert_eq!(s.read_ok(64, 16384), both);
    // A two-bio read splits the same data over its buffers.
    let mut rq = Request::from_bio(Bio::read(64, 8192), 1);
    rq.bios.push(Bio::read(80, 8192));
    rq.nr_sectors += 16;
    let (rq, st) = s.run(rq);
    st.unwrap();
    let got: Vec<u8> = rq.buffers().flat_map(|b| b.as_slice().to_vec()).collect();
    assert_eq!(got, both);
    // Never written: zeros.
    assert!(s.read_ok(1 << 30, 4096).iter().all(|&x| x == 0));

    s.run(Request::from_bio(Bio::discard(0, 8), 1)).1.unwrap();
    let after = s.read_ok(0, 8192);
    assert!(
        after[..4096].iter().all(|&x| x == 0),
        "discarded block reads zeros"
    );
    assert_eq!(&after[4096..], &a[4096..]);

    let st = s.sim().stats();
    assert_eq!((st.writes, st.reads, st.discards), (2, 5, 1));
}

#[test]
fn data_off_reads_zeros() {
    let s = Sim::open("sim:ssd,data=0");
    s.write(0, &pattern(0, 4096, 1), BioFlags::empty()).unwrap();
    let mut bio = Bio::read(0, 4096);
    bio.buf.as_mut().unwrap().as_mut_slice().fill(0xee);
    let (rq, st) = s.run(Request::from_bio(bio, 1));
    st.unwrap();
    assert!(rq
        .buffers()
        .next()
        .unwrap()
        .as_slice()
        .iter()
        .all(|&x| x == 0));
}

#[test]
fn invalid_requests_fail_without_panicking() {
    let s = Sim::open("sim:ssd,size=1G");
    let end = (1u64 << 30) / 512;
    let st = s.write(end - 8, &[1u8; 8192], BioFlags::empty());
    assert!(matches!(st, Err(BlkError::Invalid(_))), "{st:?}");
    let st = s.write(3, &[1u8; 4096], BioFlags::empty());
    assert!(matches!(st, Err(BlkError::Invalid(_))), "unaligned: {st:?}");
    let mut rq = Request::from_bio(Bio::write(0, IoBuf::from_slice(&[1u8; 4096])), 1);
    rq.nr_sectors = 16;
    assert!(
        matches!(s.run(rq).1, Err(BlkError::Invalid(_))),
        "length mismatch"
    );
    s.write(end - 8, &[1u8; 4096], BioFlags::empty()).unwrap();
}

#[test]
fn power_cut_drops_exactly_the_unflushed_writes() {
    let s = Sim::open("sim:ssd");
    let a = pattern(0, 4096, 1);
    let a2 = pattern(0, 4096, 9);
    let b = pattern(8, 4096, 2);
    let c = pattern(16, 4096, 3);
    let d = pattern(24, 1024, 4);
    s.write(0, &a, BioFlags::empty()).unwrap();
    s.flush().unwrap();
    s.write(0, &a2, BioFlags::empty()).unwrap(); // overwrites flushed data, unflushed
    s.write(8, &b, BioFlags::empty()).unwrap();
    s.write(16, &c, BioFlags::FUA).unwrap();
    // A partial chunk written FUA next to unflushed data in the same chunk.
    let s512 = Sim::open("sim:ssd,lbs=512");
    s512.write(24, &d[..512], BioFlags::empty()).unwrap();
    s512.write(25, &d[512..], BioFlags::FUA).unwrap();
    assert_eq!(s.read_ok(0, 4096), a2, "before the cut reads see the cache");

    s.sim().power_cut(false);
    s512.sim().power_cut(false);
    assert!(!s.sim().powered());
    assert_eq!(s.write(32, &a, BioFlags::empty()), Err(BlkError::PowerLoss));
    assert_eq!(s.read(0, 4096).1, Err(BlkError::PowerLoss));
    s.sim().reboot();
    s512.sim().reboot();

    assert_eq!(
        s.read_ok(0, 4096),
        a,
        "flushed data survives, the unflushed overwrite is gone"
    );
    assert!(
        s.read_ok(8, 4096).iter().all(|&x| x == 0),
        "unflushed write is gone"
    );
    assert_eq!(s.read_ok(16, 4096), c, "FUA write survives");
    assert!(
        s.read_ok(32, 4096).iter().all(|&x| x == 0),
        "write refused while dark"
    );
    let got = s512.read_ok(24, 1024);
    assert!(
        got[..512].iter().all(|&x| x == 0),
        "unflushed neighbour of a FUA write is gone"
    );
    assert_eq!(&got[512..], &d[512..]);

    // PREFLUSH on a write makes what came before durable.
    s.write(40, &b, BioFlags::empty()).unwrap();
    s.write(48, &c, BioFlags::PREFLUSH).unwrap();
    s.sim().power_cut(false);
    s.sim().reboot();
    assert_eq!(s.read_ok(40, 4096), b);
    assert!(
        s.read_ok(48, 4096).iter().all(|&x| x == 0),
        "the write after the preflush is not durable"
    );

    let st = s.sim().stats();
    assert_eq!((st.power_cuts, st.fua_writes, st.flushes), (2, 1, 2));
}

#[test]
fn write_cache_off_makes_every_write_durable() {
    let s = Sim::open("sim:ssd,wc=0");
    let a = pattern(0, 4096, 1);
    s.write(0, &a, BioFlags::empty()).unwrap();
    s.run(Request::from_bio(Bio::discard(8, 8), 1)).1.unwrap();
    s.sim().power_cut(true);
    s.sim().reboot();
    assert_eq!(s.read_ok(0, 4096), a);
}

#[test]
fn requests_in_flight_at_the_cut_fail_with_power_loss() {
    let s = Sim::open("sim:ssd");
    let a = pattern(0, 4096, 1);
    s.write(0, &a, BioFlags::FUA).unwrap();
    s.sim().hold(true);
    s.submit(Request::from_bio(
        Bio::write(0, IoBuf::from_slice(&pattern(0, 4096, 2))),
        1,
    ));
    s.submit(Request::from_bio(Bio::read(8, 4096), 1));
    s.submit(Request::from_bio(Bio::flush(), 0));
    assert_eq!(s.sim().pending(), 3);
    assert!(
        !s.c.wait_for(1, Duration::from_millis(20)),
        "held requests completed"
    );
    s.sim().power_cut(false);
    assert!(s.c.wait_for(3, PATIENCE));
    let done = s.c.take();
    assert_eq!(done.len(), 3);
    assert!(
        done.iter().all(|(_, st)| *st == Err(BlkError::PowerLoss)),
        "{:?}",
        done.iter().map(|d| &d.1).collect::<Vec<_>>()
    );
    assert_eq!(s.sim().pending(), 0);
    s.sim().reboot();
    s.sim().hold(false);
    assert_eq!(s.read_ok(0, 4096), a, "the write in flight moved no data");
}

/// Which sectors of an unflushed (or, with `in_flight`, held) 64 KiB write survive a
/// torn power cut.
fn torn_survivors(seed: u64, in_flight: bool) -> Vec<bool> {
    let s = Sim::open(&format!("sim:ssd,seed={seed}"));
    let sector = 1024;
    let data = pattern(sector, 65536, 7);
    if in_flight {
        s.sim().hold(true);
        s.submit(Request::from_bio(
            Bio::write(sector, IoBuf::from_slice(&data)),
            16,
        ));
        s.sim().power_cut(true);
        assert!(s.c.wait_for(1, PATIENCE));
        assert_eq!(s.c.take()[0].1, Err(BlkError::PowerLoss));
        s.sim().hold(false);
    } else {
        s.write(sector, &data, BioFlags::empty()).unwrap();
        s.sim().power_cut(true);
    }
    s.sim().reboot();
    let got = s.read_ok(sector, 65536);
    got.chunks(512)
        .zip(data.chunks(512))
        .map(|(g, d)| {
            if g == d {
                true
            } else {
                assert!(
                    g.iter().all(|&x| x == 0),
                    "a 512-byte sector is all old or all new"
                );
                false
            }
        })
        .collect()
}

#[test]
fn torn_power_cut_keeps_a_reproducible_strict_subset() {
    for in_flight in [false, true] {
        let one = torn_survivors(1, in_flight);
        let kept = one.iter().filter(|&&k| k).count();
        assert!(
            kept > 0 && kept < one.len(),
            "in_flight={in_flight}: kept {kept} of {}",
            one.len()
        );
        assert_eq!(one, torn_survivors(1, in_flight), "same seed, same tear");
        assert_ne!(
            one,
            torn_survivors(2, in_flight),
            "another seed, another tear"
        );
    }
}

#[test]
fn cut_after_n_requests() {
    let s = Sim::open("sim:ssd,cut_after=3");
    let a = pattern(0, 4096, 1);
    s.write(0, &a, BioFlags::empty()).unwrap();
    s.flush().unwrap();
    assert_eq!(
        s.write(8, &a, BioFlags::FUA),
        Err(BlkError::PowerLoss),
        "the third request meets the cut"
    );
    assert!(!s.sim().powered());
    s.sim().reboot();
    assert_eq!(s.read_ok(0, 4096), a);
    assert!(s.read_ok(8, 4096).iter().all(|&x| x == 0));

    s.sim().power_cut_after(2, false);
    s.read_ok(0, 4096);
    assert_eq!(s.read(0, 4096).1, Err(BlkError::PowerLoss));
    s.sim().reboot();
    assert_eq!(s.sim().stats().power_cuts, 2);
}

#[test]
fn injected_eio_fails_the_request_and_moves_no_data() {
    let s = Sim::open("sim:ssd");
    let good = pattern(96, 4096, 1);
    s.write(96, &good, BioFlags::empty()).unwrap();
    s.sim().inject_eio(100..200, true, true);
    assert_eq!(
        s.write(96, &pattern(96, 4096, 2), BioFlags::empty()),
        Err(BlkError::Io)
    );
    assert_eq!(s.read(96, 4096).1, Err(BlkError::Io));
    s.write(200, &good, BioFlags::empty())
        .expect("the range end is exclusive");
    s.write(88, &good, BioFlags::empty())
        .expect("below the range");
    s.sim().clear_faults();
    assert_eq!(s.read_ok(96, 4096), good, "the failed write moved no data");

    s.sim().inject_eio(100..200, false, true);
    assert_eq!(s.read_ok(96, 4096), good, "writes only");
    assert_eq!(
        s.write(96, &pattern(96, 4096, 3), BioFlags::empty()),
        Err(BlkError::Io)
    );
    s.sim().clear_faults();
    assert_eq!(s.sim().stats().eio_injected, 3);

    s.sim().eio_after(2);
    s.read_ok(0, 4096);
    s.flush().unwrap();
    assert_eq!(s.read(0, 4096).1, Err(BlkError::Io));
    assert_eq!(s.flush(), Err(BlkError::Io));
    s.sim().clear_faults();
    s.read_ok(0, 4096);

    let s = Sim::open("sim:ssd,eio=0-8,eio_after=2");
    assert_eq!(s.write(0, &good, BioFlags::empty()), Err(BlkError::Io));
    s.write(8, &good, BioFlags::empty()).unwrap();
    assert_eq!(s.write(16, &good, BioFlags::empty()), Err(BlkError::Io));
}

#[test]
fn latency_spike_delays_requests() {
    let clock = ManualClock::new(0);
    let s = Sim::open_with("sim:ssd,spike=1:50ms", clock.clone());
    s.submit(Request::from_bio(Bio::read(0, 4096), 1));
    clock.advance(10_000_000);
    assert!(
        !s.c.wait_for(1, Duration::from_millis(30)),
        "a 50 ms spike completed after 10 ms"
    );
    clock.advance(41_000_000);
    assert!(s.c.wait_for(1, PATIENCE));
}

#[test]
fn manual_clock_gates_completion() {
    let clock = ManualClock::new(1_000_000);
    let s = Sim::open_with("sim:ssd", clock.clone());
    // 1/27000 s of controller, 4 KiB at 100 MiB/s per channel, 80 us: ~156 us.
    s.submit(Request::from_bio(
        Bio::write(0, IoBuf::from_slice(&[3u8; 4096])),
        1,
    ));
    assert_eq!(s.sim().pending(), 1);
    assert!(
        !s.c.wait_for(1, Duration::from_millis(50)),
        "completed with the clock stopped"
    );
    clock.advance(150_000);
    assert!(
        !s.c.wait_for(1, Duration::from_millis(50)),
        "completed before its due time"
    );
    clock.advance(10_000);
    assert!(
        s.c.wait_for(1, PATIENCE),
        "not completed after its due time"
    );
    s.c.take()[0].1.clone().unwrap();
    assert_eq!(s.sim().pending(), 0);
}

#[test]
fn bad_specs_are_errors() {
    for (spec, needle) in [
        ("sim:ssd,iops=abc", "iops"),
        ("sim:ssd,size=1001", "size"),
        ("sim:ssd,bogus=1", "bogus"),
        ("sim:floppy", "floppy"),
        ("sim:ssd,spike=0.5", "spike"),
        ("sim:ssd,eio=9-3", "eio"),
        ("sim:hdd,lat=1ms", "lat"),
    ] {
        let e = dev::open(spec, RealClock::new())
            .err()
            .unwrap_or_else(|| panic!("{spec} opened"));
        assert!(e.to_string().contains(needle), "{spec}: {e}");
    }
    dev::open(
        "sim:ssd,iops=27000,bw=400M,lat=80us,seed=9,data=0,spike=0.01:50ms",
        RealClock::new(),
    )
    .unwrap();
    dev::open(
        "sim:hdd,rpm=5400,seek_min=1ms,seek_max=15ms,bw=100M,cut_after=5,torn=1",
        RealClock::new(),
    )
    .unwrap();
}

#[test]
fn data_meta_keeps_only_meta_writes() {
    let q = wbstack::block::RequestQueue::open("sim:ssd,size=64M,data=meta", Default::default())
        .unwrap();
    let meta = IoBuf::from_slice(&[0x11u8; 4096]);
    let data = IoBuf::from_slice(&[0x22u8; 4096]);
    q.write_sync(0, meta, BioFlags::META).unwrap();
    q.write_sync(8, data, BioFlags::empty()).unwrap();
    assert_eq!(
        q.read_sync(0, 4096).unwrap().as_slice(),
        &[0x11u8; 4096][..]
    );
    assert_eq!(q.read_sync(8, 4096).unwrap().as_slice(), &[0u8; 4096][..]);
    let e = wbstack::block::RequestQueue::open("sim:ssd,data=some", Default::default())
        .err()
        .unwrap();
    assert!(e.contains("data=some") && e.contains("meta"), "{e}");
}

/// A sim with a manual clock and a 10 ms cache flush, so that writes can be in flight
/// while a flush is issued and complete while it runs (a 4 KiB write takes ~0.15 ms).
fn slow_flush_sim(lbs: u32) -> (Sim, Arc<ManualClock>) {
    let clock = ManualClock::new(0);
    let s = Sim::open_with(&format!("sim:ssd,lbs={lbs},flush_lat=10ms"), clock.clone());
    (s, clock)
}

impl Sim {
    fn submit_write(&self, sector: u64, data: &[u8], flags: BioFlags) {
        let bio = Bio::write(sector, IoBuf::from_slice(data)).with_flags(flags);
        self.submit(Request::from_bio(bio, 1));
    }

    /// Advance the clock by `ns` and take the `n` completions that fall due, each
    /// successful, as (op is a flush, sector); `left` requests stay inside the device.
    fn step(&self, clock: &ManualClock, ns: u64, n: usize, left: usize) -> Vec<(bool, u64)> {
        clock.advance(ns);
        assert!(self.c.wait_for(n, PATIENCE), "{n} completions expected");
        assert_eq!(self.sim().pending(), left, "requests left in the device");
        let done = self.c.take();
        assert_eq!(done.len(), n);
        done.into_iter()
            .map(|(rq, st)| {
                st.expect("request failed");
                (rq.op == wbstack::block::bio::Op::Flush, rq.sector)
            })
            .collect()
    }

    /// Cut and reboot; requests still inside (a flush) fail, and their completions
    /// (delivered by the cut itself) are dropped so later reads find only their own.
    fn cut_and_reboot(&self) {
        self.sim().power_cut(false);
        assert_eq!(self.sim().pending(), 0);
        for (_, st) in self.c.take() {
            assert_eq!(st, Err(BlkError::PowerLoss));
        }
        self.sim().reboot();
    }

    /// Read with the manual clock: it advances until the read falls due.
    fn read_at(&self, clock: &ManualClock, sector: u64, len: usize) -> Vec<u8> {
        self.submit(Request::from_bio(Bio::read(sector, len), 1));
        clock.advance(MS);
        assert!(self.c.wait_for(1, PATIENCE), "read never completed");
        let (rq, st) = self.c.take().pop().unwrap();
        st.expect("read failed");
        let data = rq.buffers().next().unwrap().as_slice().to_vec();
        data
    }

    fn zeros_at(&self, clock: &ManualClock, sector: u64, len: usize) -> bool {
        self.read_at(clock, sector, len).iter().all(|&x| x == 0)
    }
}

const MS: u64 = 1_000_000;

#[test]
fn a_flush_covers_the_writes_completed_before_it_was_issued_not_those_in_flight() {
    let (s, clock) = slow_flush_sim(4096);
    let (a, b) = (pattern(0, 4096, 1), pattern(8, 4096, 2));
    s.submit_write(0, &a, BioFlags::empty());
    assert_eq!(s.step(&clock, MS, 1, 0), [(false, 0)]);
    // b is in flight when the flush is issued, and completes first.
    s.submit_write(8, &b, BioFlags::empty());
    s.submit(Request::from_bio(Bio::flush(), 0));
    assert_eq!(s.step(&clock, MS, 1, 1), [(false, 8)]);
    assert_eq!(s.step(&clock, 20 * MS, 1, 0), [(true, 0)]);
    assert_eq!(s.read_at(&clock, 8, 4096), b, "reads see the cache");
    s.cut_and_reboot();
    assert_eq!(
        s.read_at(&clock, 0, 4096),
        a,
        "completed before the flush: durable"
    );
    assert!(s.zeros_at(&clock, 8, 4096), "in flight at the flush: lost");
}

#[test]
fn a_flush_does_not_cover_writes_issued_after_it_that_complete_first() {
    let (s, clock) = slow_flush_sim(4096);
    let (a, c) = (pattern(0, 4096, 1), pattern(0, 4096, 3));
    s.submit_write(0, &a, BioFlags::empty());
    assert_eq!(s.step(&clock, MS, 1, 0), [(false, 0)]);
    s.submit(Request::from_bio(Bio::flush(), 0));
    // Overwrites a in the cache, completing while the flush runs.
    s.submit_write(0, &c, BioFlags::empty());
    assert_eq!(s.step(&clock, MS, 1, 1), [(false, 0)]);
    assert_eq!(s.step(&clock, 20 * MS, 1, 0), [(true, 0)]);
    assert_eq!(s.read_at(&clock, 0, 4096), c, "reads see the cache");
    s.cut_and_reboot();
    assert_eq!(
        s.read_at(&clock, 0, 4096),
        a,
        "the flush made a durable, not the overwrite issued after it"
    );
}

#[test]
fn a_fua_write_is_durable_by_itself_across_flush_generations() {
    // 512-byte sectors of one 4 KiB chunk: the older flushed write (sectors 0-1), a FUA
    // write over sector 1 and a volatile write to sector 2, both completing while the
    // flush runs.
    let old = pattern(0, 1024, 1);
    let fua = pattern(1, 512, 2);
    let late = pattern(2, 512, 3);
    for flush_completes in [true, false] {
        let (s, clock) = slow_flush_sim(512);
        s.submit_write(0, &old, BioFlags::empty());
        assert_eq!(s.step(&clock, MS, 1, 0), [(false, 0)]);
        s.submit(Request::from_bio(Bio::flush(), 0));
        s.submit_write(1, &fua, BioFlags::FUA);
        s.submit_write(2, &late, BioFlags::empty());
        assert_eq!(s.step(&clock, MS, 2, 1), [(false, 1), (false, 2)]);
        if flush_completes {
            assert_eq!(s.step(&clock, 20 * MS, 1, 0), [(true, 0)]);
        }
        s.cut_and_reboot();
        let got = s.read_at(&clock, 0, 1536);
        let what = format!("flush completed: {flush_completes}");
        if flush_completes {
            assert_eq!(got[..512], old[..512], "{what}");
        } else {
            assert!(got[..512].iter().all(|&x| x == 0), "{what}");
        }
        assert_eq!(got[512..1024], fua[..], "{what}: the FUA write survives");
        assert!(
            got[1024..].iter().all(|&x| x == 0),
            "{what}: the write after the flush is lost"
        );
    }
}

#[test]
fn preflush_fua_covers_what_completed_before_it_and_itself() {
    let (s, clock) = slow_flush_sim(4096);
    let (a, b, p) = (
        pattern(0, 4096, 1),
        pattern(8, 4096, 2),
        pattern(16, 4096, 3),
    );
    s.submit_write(0, &a, BioFlags::empty());
    assert_eq!(s.step(&clock, MS, 1, 0), [(false, 0)]);
    s.submit_write(8, &b, BioFlags::empty());
    s.submit_write(16, &p, BioFlags::PREFLUSH | BioFlags::FUA);
    assert_eq!(s.step(&clock, MS, 1, 1), [(false, 8)]);
    assert_eq!(s.step(&clock, 20 * MS, 1, 0), [(false, 16)]);
    s.cut_and_reboot();
    assert_eq!(
        s.read_at(&clock, 0, 4096),
        a,
        "completed before the preflush"
    );
    assert!(
        s.zeros_at(&clock, 8, 4096),
        "in flight at the preflush: lost"
    );
    assert_eq!(s.read_at(&clock, 16, 4096), p, "the FUA write itself");
}
