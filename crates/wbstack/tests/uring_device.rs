//! The io_uring file device, driven directly with requests.
//!
//! Files live under CARGO_TARGET_TMPDIR (on the build disk) because /tmp may be a
//! filesystem without O_DIRECT.

use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use wbstack::block::bio::{Bio, BioFlags, BlkError, BlkResult, Op, Request};
use wbstack::buf::IoBuf;
use wbstack::dev::uring::{probe_io_uring, UringDevice};
use wbstack::dev::{Completer, Device, DeviceSpec, RqComplete};

const WAIT: Duration = Duration::from_secs(10);

#[derive(Default)]
struct Collector {
    done: Mutex<Vec<(Request, BlkResult)>>,
    cv: Condvar,
}

impl RqComplete for Collector {
    fn complete(&self, rq: Request, status: BlkResult) {
        self.done.lock().unwrap().push((rq, status));
        self.cv.notify_all();
    }
}

impl Collector {
    fn new() -> Arc<Collector> {
        Arc::new(Collector::default())
    }

    /// Wait (bounded) until `n` requests completed and take them, in completion order.
    fn wait(&self, n: usize) -> Vec<(Request, BlkResult)> {
        let deadline = Instant::now() + WAIT;
        let mut g = self.done.lock().unwrap();
        while g.len() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "only {} of {n} requests completed within {WAIT:?}",
                g.len()
            );
            g = self.cv.wait_timeout(g, left).unwrap().0;
        }
        g.drain(..).collect()
    }

    fn completer(self: &Arc<Self>) -> Completer {
        self.clone()
    }
}

fn tmpdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("uring-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap()
}

fn open(spec: &str) -> Result<UringDevice, String> {
    let s = DeviceSpec::parse(spec).map_err(|e| e.to_string())?;
    UringDevice::from_spec(&s).map_err(|e| e.to_string())
}

/// A fresh device on a new file of `size`. Where io_uring is forbidden the test fails
/// with the reason: a file device that cannot run is a failure, not a skip.
fn device(dir: &Path, size: &str) -> Option<(UringDevice, PathBuf)> {
    if let Err(why) = probe_io_uring() {
        panic!("the file: device needs io_uring: {why}");
    }
    let path = dir.join("disk.img");
    let dev = open(&format!("file:{},create=1,size={size}", path.display())).unwrap();
    Some((dev, path))
}

/// A 1 MiB device whose first 16 KiB hold `pattern(seed)`, then its file cut to 10 KiB
/// under it: a read crossing 10 KiB comes back short.
fn shrunk_under_the_device(dir: &Path, seed: u64) -> (UringDevice, Vec<u8>) {
    let (dev, path) = device(dir, "1M").expect("io_uring was probed");
    let a = pattern(seed, 16384);
    run(&dev, write_rq(0, &a)).1.unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(10240)
        .unwrap();
    (dev, a)
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (seed.wrapping_mul(31).wrapping_add(i as u64 / 7) % 251) as u8)
        .collect()
}

fn write_rq(sector: u64, data: &[u8]) -> Request {
    Request::from_bio(Bio::write(sector, IoBuf::from_slice(data)), 1)
}

fn read_rq(sector: u64, len: usize) -> Request {
    Request::from_bio(Bio::read(sector, len), 1)
}

/// One request made of one bio per chunk, as the block layer's merging produces.
fn multi_rq(mut bios: Vec<Bio>) -> Request {
    let rest = bios.split_off(1);
    let mut rq = Request::from_bio(bios.pop().unwrap(), 1);
    for b in rest {
        assert_eq!(b.sector, rq.end_sector());
        rq.nr_sectors += b.nr_sectors;
        rq.nr_segments += 1;
        rq.bios.push(b);
    }
    rq
}

fn data_of(rq: &Request) -> Vec<u8> {
    rq.buffers()
        .flat_map(|b| b.as_slice().iter().copied())
        .collect()
}

/// Queue, commit and wait for one request.
fn run(dev: &UringDevice, rq: Request) -> (Request, BlkResult) {
    let c = Collector::new();
    dev.queue_rq(rq, &c.completer());
    dev.commit_rqs(0);
    c.wait(1).pop().unwrap()
}

fn read_back(dev: &UringDevice, sector: u64, len: usize) -> Vec<u8> {
    let (rq, st) = run(dev, read_rq(sector, len));
    st.unwrap();
    data_of(&rq)
}

#[test]
fn geometry_follows_the_spec() {
    let dir = tmpdir();
    let Some((dev, path)) = device(dir.path(), "8M") else {
        return;
    };
    let g = dev.geometry();
    assert_eq!(g.size_bytes, 8 << 20);
    assert_eq!(g.logical_block_size, 4096);
    assert_eq!(
        (g.nr_hw_queues, g.queue_depth, g.max_hw_sectors),
        (1, 128, 65536)
    );
    assert!(g.write_cache && !g.rotational);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 8 << 20);
    assert!(!dev.is_block_device());
    drop(dev);

    // The existing file's length is the default size; a smaller size uses a prefix.
    let dev = open(&format!("file:{}", path.display())).unwrap();
    assert_eq!(dev.geometry().size_bytes, 8 << 20);
    drop(dev);
    let dev = open(&format!(
        "file:{},size=1M,lbs=512,qd=4,hw_queues=2",
        path.display()
    ))
    .unwrap();
    let g = dev.geometry();
    assert_eq!(
        (
            g.size_bytes,
            g.logical_block_size,
            g.queue_depth,
            g.nr_hw_queues
        ),
        (1 << 20, 512, 4, 2)
    );
    drop(dev);
    // create=1 with a larger size extends the file.
    let dev = open(&format!("file:{},size=12M,create=1", path.display())).unwrap();
    assert_eq!(dev.geometry().size_bytes, 12 << 20);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 12 << 20);

    // Through the generic entry point as well.
    drop(dev);
    let d = wbstack::dev::open(
        &format!("file:{}", path.display()),
        wbstack::clock::RealClock::new(),
    )
    .unwrap();
    assert!(d.as_any().downcast_ref::<UringDevice>().is_some());
}

#[test]
fn write_then_read_single_and_multi_segment() {
    let dir = tmpdir();
    let Some((dev, _)) = device(dir.path(), "8M") else {
        return;
    };

    let a = pattern(1, 4096);
    let (_, st) = run(&dev, write_rq(8, &a));
    st.unwrap();
    assert_eq!(read_back(&dev, 8, 4096), a);

    // A merged write of three bios (one WRITEV), read back as one buffer and as three.
    let chunks = [pattern(2, 4096), pattern(3, 8192), pattern(4, 4096)];
    let mut sector = 64;
    let bios = chunks
        .iter()
        .map(|c| {
            let b = Bio::write(sector, IoBuf::from_slice(c));
            sector += (c.len() / 512) as u64;
            b
        })
        .collect();
    let before = dev.stats();
    let (rq, st) = run(&dev, multi_rq(bios));
    st.unwrap();
    assert_eq!((rq.bios.len(), rq.nr_sectors), (3, 32));
    assert_eq!(
        dev.stats().sqes - before.sqes,
        1,
        "a merged request is one SQE"
    );
    let all: Vec<u8> = chunks.concat();
    assert_eq!(read_back(&dev, 64, 16384), all);
    let (rq, st) = run(
        &dev,
        multi_rq(vec![
            Bio::read(64, 8192),
            Bio::read(80, 4096),
            Bio::read(88, 4096),
        ]),
    );
    st.unwrap();
    assert_eq!(data_of(&rq), all);
    assert_eq!(dev.in_flight(), 0);
}

#[test]
fn many_outstanding_with_one_commit() {
    let dir = tmpdir();
    let Some((dev, _)) = device(dir.path(), "8M") else {
        return;
    };
    let c = Collector::new();
    let n = 64u64;
    let before = dev.stats();
    for i in 0..n {
        dev.queue_rq(write_rq(i * 16, &pattern(100 + i, 8192)), &c.completer());
    }
    assert_eq!(
        dev.stats().submit_calls,
        before.submit_calls,
        "queue_rq must not submit"
    );
    dev.commit_rqs(0);
    let after = dev.stats();
    assert_eq!(
        after.submit_calls - before.submit_calls,
        1,
        "one io_uring_enter per batch"
    );
    assert_eq!(after.sqes - before.sqes, n);
    for (_, st) in c.wait(n as usize) {
        st.unwrap();
    }

    for i in 0..n {
        dev.queue_rq(read_rq(i * 16, 8192), &c.completer());
    }
    dev.commit_rqs(0);
    let done = c.wait(n as usize);
    assert_eq!(done.len(), n as usize);
    for (rq, st) in done {
        st.unwrap();
        assert_eq!(
            data_of(&rq),
            pattern(100 + rq.sector / 16, 8192),
            "sector {}",
            rq.sector
        );
    }
    // Nothing queued since: a commit costs no syscall.
    let s = dev.stats().submit_calls;
    dev.commit_rqs(0);
    assert_eq!(dev.stats().submit_calls, s);
}

/// A ring smaller than the batch: pushing finds the submission ring full and submits to
/// make room, never splitting a PREFLUSH pair; the completion ring overflows into the
/// kernel's backlog.
#[test]
fn batch_larger_than_the_ring() {
    if probe_io_uring().is_err() {
        return;
    }
    let dir = tmpdir();
    let path = dir.path().join("small-ring.img");
    let dev = open(&format!("file:{},create=1,size=4M,qd=2", path.display())).unwrap();
    let c = Collector::new();
    let before = dev.stats();
    for i in 0..20u64 {
        let b =
            Bio::write(i * 8, IoBuf::from_slice(&pattern(i, 4096))).with_flags(BioFlags::PREFLUSH);
        dev.queue_rq(Request::from_bio(b, 1), &c.completer());
    }
    dev.commit_rqs(0);
    for (rq, st) in c.wait(20) {
        assert!(st.is_ok(), "{rq:?}: {st:?}");
    }
    let s = dev.stats();
    assert_eq!(s.sqes - before.sqes, 40);
    assert!(s.submit_calls - before.submit_calls >= 19, "{s:?}");
    for i in 0..20u64 {
        assert_eq!(read_back(&dev, i * 8, 4096), pattern(i, 4096));
    }
}

/// Several submitters at once (one per hardware queue), each queueing batches and
/// committing them, while the completion thread reaps.
#[test]
fn concurrent_submitters() {
    let dir = tmpdir();
    if probe_io_uring().is_err() {
        return;
    }
    let path = dir.path().join("mq.img");
    let dev = Arc::new(
        open(&format!(
            "file:{},create=1,size=16M,hw_queues=4,qd=32",
            path.display()
        ))
        .unwrap(),
    );
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let dev = dev.clone();
            std::thread::spawn(move || {
                let c = Collector::new();
                // Each thread owns 1 MiB: 256 blocks, written in batches of 8, then read.
                let base = t * 2048;
                for batch in 0..32u64 {
                    for j in 0..8u64 {
                        let blk = batch * 8 + j;
                        dev.queue_rq(
                            write_rq(base + blk * 8, &pattern(t * 1000 + blk, 4096)),
                            &c.completer(),
                        );
                    }
                    dev.commit_rqs(t as u16);
                    for (_, st) in c.wait(8) {
                        st.unwrap();
                    }
                }
                for batch in 0..32u64 {
                    for j in 0..8u64 {
                        dev.queue_rq(read_rq(base + (batch * 8 + j) * 8, 4096), &c.completer());
                    }
                    dev.commit_rqs(t as u16);
                    for (rq, st) in c.wait(8) {
                        st.unwrap();
                        let blk = (rq.sector - base) / 8;
                        assert_eq!(data_of(&rq), pattern(t * 1000 + blk, 4096));
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(dev.in_flight(), 0);
}

#[test]
fn fua_flush_and_preflush() {
    let dir = tmpdir();
    let Some((dev, _)) = device(dir.path(), "8M") else {
        return;
    };

    let a = pattern(7, 8192);
    let rq = Request::from_bio(
        Bio::write(32, IoBuf::from_slice(&a)).with_flags(BioFlags::FUA),
        1,
    );
    let (_, st) = run(&dev, rq);
    st.unwrap();
    assert_eq!(read_back(&dev, 32, 8192), a);

    let before = dev.stats();
    let (rq, st) = run(&dev, Request::from_bio(Bio::flush(), 0));
    st.unwrap();
    assert_eq!(rq.op, Op::Flush);
    assert_eq!(dev.stats().sqes - before.sqes, 1);

    // PREFLUSH: an FSYNC linked ahead of the write, two SQEs and two CQEs, one completion.
    let b = pattern(8, 4096);
    let before = dev.stats();
    let rq = Request::from_bio(
        Bio::write(48, IoBuf::from_slice(&b)).with_flags(BioFlags::PREFLUSH | BioFlags::FUA),
        1,
    );
    let (_, st) = run(&dev, rq);
    st.unwrap();
    assert_eq!(dev.stats().sqes - before.sqes, 2);
    assert_eq!(read_back(&dev, 48, 4096), b);
    assert_eq!(dev.in_flight(), 0);
}

#[test]
fn discard_punches_a_hole() {
    let dir = tmpdir();
    let Some((dev, _)) = device(dir.path(), "8M") else {
        return;
    };
    let a = pattern(9, 32768);
    run(&dev, write_rq(0, &a)).1.unwrap();
    // Discard the middle 16 KiB.
    let (_, st) = run(&dev, Request::from_bio(Bio::discard(16, 32), 0));
    st.unwrap();
    let back = read_back(&dev, 0, 32768);
    assert_eq!(back[..8192], a[..8192]);
    assert!(back[8192..24576].iter().all(|&x| x == 0));
    assert_eq!(back[24576..], a[24576..]);
}

/// Short IO for real: the file shrinks under the device, so a read crossing the new end
/// returns fewer bytes; the remainder is resubmitted, reads 0 bytes and fails.
#[test]
fn short_read_is_resubmitted_then_fails_at_end_of_file() {
    let dir = tmpdir();
    let (dev, a) = shrunk_under_the_device(dir.path(), 11);

    // Single buffer (READ): 10 KiB arrive, the 6 KiB remainder reads nothing.
    let before = dev.stats();
    let (rq, st) = run(&dev, read_rq(0, 16384));
    assert_eq!(st, Err(BlkError::Io));
    assert_eq!(data_of(&rq)[..10240], a[..10240]);
    assert_eq!(dev.stats().short_resubmits - before.short_resubmits, 1);

    // Four buffers (READV): the short read ends 2 KiB into the third, which is resubmitted
    // from its middle.
    let before = dev.stats();
    let (rq, st) = run(
        &dev,
        multi_rq(vec![
            Bio::read(0, 4096),
            Bio::read(8, 4096),
            Bio::read(16, 4096),
            Bio::read(24, 4096),
        ]),
    );
    assert_eq!(st, Err(BlkError::Io));
    assert_eq!(data_of(&rq)[..10240], a[..10240]);
    assert_eq!(dev.stats().short_resubmits - before.short_resubmits, 1);
    assert_eq!(dev.in_flight(), 0);
}

#[test]
fn bad_specs_say_why() {
    let dir = tmpdir();
    let d = dir.path().display();
    let cases = [
        (format!("file:{d}/missing.img"), "no such file"),
        (format!("file:{d}/missing.img"), "create=1,size=SIZE"),
        (format!("file:{d}/new.img,create=1"), "needs size=SIZE"),
        (
            format!("file:{d}/new.img,create=1,size=10000"),
            "not a multiple of the logical block size",
        ),
        (
            format!("file:{d}/new.img,create=1,size=0"),
            "larger than zero",
        ),
        (
            format!("file:{d}/new.img,create=1,size=1M,colour=blue"),
            "unknown option 'colour'",
        ),
        (
            format!("file:{d}/new.img,create=1,size=1M,lbs=3000"),
            "power of two",
        ),
        (format!("file:{d}"), "is a directory"),
        ("file:".to_string(), "needs a path"),
    ];
    for (spec, want) in cases {
        let e = open(&spec).err().unwrap_or_else(|| panic!("{spec} opened"));
        assert!(e.contains(want), "{spec}: {e}");
    }
    // None of the failures left a file behind.
    assert!(!dir.path().join("new.img").exists());

    let odd = dir.path().join("odd.img");
    std::fs::write(&odd, vec![0u8; 6000]).unwrap();
    let e = open(&format!("file:{}", odd.display())).err().unwrap();
    assert!(
        e.contains("not a multiple of the logical block size 4096"),
        "{e}"
    );
    let empty = dir.path().join("empty.img");
    std::fs::write(&empty, b"").unwrap();
    let e = open(&format!("file:{}", empty.display())).err().unwrap();
    assert!(e.contains("is empty"), "{e}");
    let small = dir.path().join("small.img");
    std::fs::write(&small, vec![0u8; 8192]).unwrap();
    let e = open(&format!("file:{},size=1M", small.display()))
        .err()
        .unwrap();
    assert!(e.contains("add ,create=1 to extend it"), "{e}");
}

#[test]
fn drop_with_requests_in_flight_does_not_hang() {
    let dir = tmpdir();
    let Some((dev, _)) = device(dir.path(), "8M") else {
        return;
    };
    let c = Collector::new();
    for i in 0..64u64 {
        dev.queue_rq(write_rq(i * 8, &pattern(i, 4096)), &c.completer());
    }
    dev.commit_rqs(0);
    // Queued and never committed: dropping must still complete them.
    for i in 64..80u64 {
        dev.queue_rq(read_rq(i * 8, 4096), &c.completer());
    }
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        drop(dev);
        let _ = tx.send(());
    });
    rx.recv_timeout(WAIT).expect("dropping the device hung");
    let done = c.wait(80);
    assert_eq!(done.len(), 80);
    for (rq, st) in done {
        assert!(matches!(st, Ok(()) | Err(BlkError::Io)), "{rq:?}: {st:?}");
    }
}

/// Holds the last reference to the device and drops it from the completion callback,
/// i.e. on the device's own completion thread.
struct DropInCallback {
    dev: Mutex<Option<Arc<UringDevice>>>,
    /// The test has dropped its own reference.
    go: Mutex<mpsc::Receiver<()>>,
    was_last: Mutex<bool>,
    inner: Arc<Collector>,
}

impl RqComplete for DropInCallback {
    fn complete(&self, rq: Request, status: BlkResult) {
        self.go.lock().unwrap().recv_timeout(WAIT).unwrap();
        let dev = self.dev.lock().unwrap().take().unwrap();
        *self.was_last.lock().unwrap() = Arc::strong_count(&dev) == 1;
        drop(dev);
        self.inner.complete(rq, status);
    }
}

#[test]
fn last_reference_dropped_in_a_completion() {
    let dir = tmpdir();
    let Some((dev, _)) = device(dir.path(), "1M") else {
        return;
    };
    let dev = Arc::new(dev);
    let c = Collector::new();
    let (tx, rx) = mpsc::channel();
    let cb = Arc::new(DropInCallback {
        dev: Mutex::new(Some(dev.clone())),
        go: Mutex::new(rx),
        was_last: Mutex::new(false),
        inner: c.clone(),
    });
    let completer: Completer = cb.clone();
    dev.queue_rq(write_rq(0, &pattern(5, 4096)), &completer);
    dev.commit_rqs(0);
    drop(dev);
    tx.send(()).unwrap();
    let (_, st) = c.wait(1).pop().unwrap();
    st.unwrap();
    assert!(
        *cb.was_last.lock().unwrap(),
        "the callback did not hold the last reference"
    );
}

/// Deleting the loop device again even when the test fails.
struct Loop(String);

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = std::process::Command::new("losetup")
            .args(["-d", &self.0])
            .status();
    }
}

/// A real block device: size and logical block size come from the device. Needs root
/// and losetup (the test command runs as root, as CI does).
#[test]
fn loop_block_device() {
    probe_io_uring().expect("io_uring");
    let dir = tmpdir();
    let backing = dir.path().join("loop.img");
    std::fs::File::create(&backing)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    let out = std::process::Command::new("losetup")
        .args(["--find", "--show", "-b", "4096"])
        .arg(&backing)
        .output();
    let dev_path = match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_string(),
        Ok(o) => panic!(
            "cannot attach a loop device (needs root and losetup): {}",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => panic!("cannot run losetup: {e}"),
    };
    let _guard = Loop(dev_path.clone());

    let dev = open(&format!("file:{dev_path}")).unwrap();
    assert!(dev.is_block_device());
    let g = dev.geometry().clone();
    assert_eq!((g.size_bytes, g.logical_block_size), (8 << 20, 4096));
    let name = dev_path.trim_start_matches("/dev/");
    let rot = std::fs::read_to_string(format!("/sys/block/{name}/queue/rotational")).unwrap();
    assert_eq!(g.rotational, rot.trim() == "1");

    let a = pattern(21, 8192);
    run(&dev, write_rq(16, &a)).1.unwrap();
    assert_eq!(read_back(&dev, 16, 8192), a);
    run(&dev, Request::from_bio(Bio::flush(), 0)).1.unwrap();
    let (_, st) = run(&dev, Request::from_bio(Bio::discard(16, 16), 0));
    assert!(matches!(st, Err(BlkError::NotSupported(_))), "{st:?}");
    drop(dev);

    let e = open(&format!("file:{dev_path},lbs=512")).err().unwrap();
    assert!(
        e.contains("smaller than the logical block size 4096"),
        "{e}"
    );
    let e = open(&format!("file:{dev_path},size=16M")).err().unwrap();
    assert!(e.contains("larger than"), "{e}");
    let dev = open(&format!("file:{dev_path},size=4M")).unwrap();
    assert_eq!(dev.geometry().size_bytes, 4 << 20);
}

impl Collector {
    fn count(&self) -> usize {
        self.done.lock().unwrap().len()
    }
}

/// Poll `dev` in this thread until `n` requests completed (bounded), and take them.
/// Returns them and how many the polls themselves completed.
fn poll_until(dev: &UringDevice, c: &Collector, n: usize) -> (Vec<(Request, BlkResult)>, usize) {
    let deadline = Instant::now() + WAIT;
    let mut polled = 0;
    while c.count() < n {
        assert!(
            Instant::now() < deadline,
            "only {} of {n} requests completed within {WAIT:?} of polling",
            c.count()
        );
        polled += dev.poll(0, 1_000_000);
    }
    (c.wait(n), polled)
}

/// A thread that polls gets its own ring at its first poll: the requests it queues from
/// then on go there (SINGLE_ISSUER, DEFER_TASKRUN, a registered file) and complete when
/// it waits in `poll`, with batching counted as on the shared ring.
#[test]
fn polling_thread_reaps_its_own_ring() {
    let dir = tmpdir();
    let Some((dev, _)) = device(dir.path(), "8M") else {
        return;
    };
    let c = Collector::new();
    // Nothing in flight: the first poll makes the ring and returns at once.
    assert_eq!(dev.poll(0, 0), 0);
    let s0 = dev.stats();
    assert_eq!(s0.private_rings, 1, "{s0:?}");
    let n = 32u64;
    for i in 0..n {
        // Every kind of SQE goes through the private ring: writes, PREFLUSH + FUA.
        let mut b = Bio::write(i * 8, IoBuf::from_slice(&pattern(200 + i, 4096)));
        if i % 8 == 0 {
            b = b.with_flags(BioFlags::PREFLUSH | BioFlags::FUA);
        }
        dev.queue_rq(Request::from_bio(b, 1), &c.completer());
    }
    dev.commit_rqs(0);
    let s1 = dev.stats();
    assert_eq!(s1.submit_calls - s0.submit_calls, 1, "one enter per batch");
    assert_eq!(s1.private_sqes - s0.private_sqes, n + 4, "{s1:?}");
    assert_eq!(dev.in_flight(), n as usize);
    let (done, polled) = poll_until(&dev, &c, n as usize);
    assert_eq!(polled, n as usize, "the polls completed them all");
    for (rq, st) in done {
        assert!(st.is_ok(), "{rq:?}: {st:?}");
    }
    // A flush and a read back, through the same ring.
    dev.queue_rq(Request::from_bio(Bio::flush(), 0), &c.completer());
    for i in 0..n {
        dev.queue_rq(read_rq(i * 8, 4096), &c.completer());
    }
    dev.commit_rqs(0);
    let (done, _) = poll_until(&dev, &c, n as usize + 1);
    for (rq, st) in done {
        st.unwrap();
        if rq.op == Op::Read {
            assert_eq!(data_of(&rq), pattern(200 + rq.sector / 8, 4096));
        }
    }
    assert_eq!(dev.in_flight(), 0);
    assert_eq!(dev.stats().private_rings, 1, "one ring per thread");
}

/// Requests of a thread that never polls go to the shared ring: they complete when
/// nobody waits (the completion thread) and when another thread waits in `poll`.
#[test]
fn shared_ring_completes_with_and_without_a_waiter() {
    let dir = tmpdir();
    let Some((dev, _)) = device(dir.path(), "8M") else {
        return;
    };
    let dev = Arc::new(dev);
    let c = Collector::new();
    // Nobody waits.
    for i in 0..16u64 {
        dev.queue_rq(write_rq(i * 8, &pattern(300 + i, 4096)), &c.completer());
    }
    dev.commit_rqs(0);
    for (_, st) in c.wait(16) {
        st.unwrap();
    }
    assert_eq!(dev.stats().private_sqes, 0);
    // Another thread waits in poll while this one submits and does not.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let poller = {
        let (dev, stop) = (dev.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                n += dev.poll(0, 1_000_000);
            }
            n
        })
    };
    for round in 0..20u64 {
        for i in 0..16u64 {
            dev.queue_rq(read_rq(i * 8, 4096), &c.completer());
        }
        dev.commit_rqs(0);
        for (rq, st) in c.wait(16) {
            st.unwrap();
            assert_eq!(data_of(&rq), pattern(300 + rq.sector / 8, 4096), "{round}");
        }
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    poller.join().unwrap();
    let s = dev.stats();
    assert_eq!(s.private_sqes, 0, "{s:?}");
    assert_eq!(dev.in_flight(), 0);
}

/// Teardown with requests in a polling thread's private ring: dropped by that thread
/// (the drop drains its ring), and left in flight by a thread that exits after another
/// thread dropped the device (the thread's exit drains its ring).
#[test]
fn private_ring_teardown_with_requests_in_flight() {
    let dir = tmpdir();
    let Some((dev, path)) = device(dir.path(), "8M") else {
        return;
    };
    let c = Collector::new();
    dev.poll(0, 0);
    for i in 0..48u64 {
        dev.queue_rq(write_rq(i * 8, &pattern(400 + i, 4096)), &c.completer());
    }
    dev.commit_rqs(0);
    // Queued without a commit too.
    for i in 48..64u64 {
        dev.queue_rq(write_rq(i * 8, &pattern(400 + i, 4096)), &c.completer());
    }
    assert!(dev.stats().private_sqes >= 64);
    drop(dev);
    let done = c.wait(64);
    for (rq, st) in done {
        assert!(st.is_ok(), "{rq:?}: {st:?}");
    }

    // Another thread's ring outlives the device.
    let dev = Arc::new(open(&format!("file:{}", path.display())).unwrap());
    let (to_main, from_thread) = mpsc::channel();
    let (to_thread, from_main) = mpsc::channel::<()>();
    let t = {
        let (dev, c) = (dev.clone(), c.clone());
        std::thread::spawn(move || {
            dev.poll(0, 0);
            for i in 0..64u64 {
                dev.queue_rq(read_rq(i * 8, 4096), &c.completer());
            }
            dev.commit_rqs(0);
            assert_eq!(dev.stats().private_rings, 1);
            drop(dev);
            to_main.send(()).unwrap();
            // Exits with its requests unreaped once the device is gone.
            from_main.recv_timeout(WAIT).unwrap();
        })
    };
    from_thread.recv_timeout(WAIT).unwrap();
    assert!(dev.in_flight() <= 64);
    drop(dev);
    to_thread.send(()).unwrap();
    t.join().unwrap();
    let done = c.wait(64);
    for (rq, st) in done {
        st.unwrap();
        assert_eq!(data_of(&rq), pattern(400 + rq.sector / 8, 4096));
    }
}

/// The short-IO path on a polling thread's own ring: the remainder goes back into the
/// same ring (with its registered file) and the thread's polls complete the request.
#[test]
fn short_read_on_a_private_ring() {
    let dir = tmpdir();
    let (dev, a) = shrunk_under_the_device(dir.path(), 12);
    assert_eq!(dev.poll(0, 0), 0);
    let before = dev.stats();
    let c = Collector::new();
    dev.queue_rq(
        multi_rq(vec![Bio::read(0, 8192), Bio::read(16, 8192)]),
        &c.completer(),
    );
    dev.commit_rqs(0);
    let (mut done, polled) = poll_until(&dev, &c, 1);
    assert_eq!(polled, 1);
    let (rq, st) = done.pop().unwrap();
    assert_eq!(st, Err(BlkError::Io));
    assert_eq!(data_of(&rq)[..10240], a[..10240]);
    let s = dev.stats();
    assert_eq!(s.short_resubmits - before.short_resubmits, 1, "{s:?}");
    assert_eq!(s.private_sqes - before.private_sqes, 2, "{s:?}");
    assert_eq!(dev.in_flight(), 0);
}

/// The image lock is held until every ring's IO has drained: a polling thread's private
/// ring outliving the device (its requests unreaped until that thread next polls or
/// exits) keeps a second opener out, which could otherwise use the image and have the
/// old ring's writes land under it.
#[test]
fn a_second_open_waits_for_another_threads_ring_to_drain() {
    let dir = tmpdir();
    let Some((dev, path)) = device(dir.path(), "8M") else {
        return;
    };
    let dev = Arc::new(dev);
    let c = Collector::new();
    let n = 16u64;
    let (to_main, from_thread) = mpsc::channel();
    let (to_thread, from_main) = mpsc::channel::<()>();
    let t = {
        let (dev, c) = (dev.clone(), c.clone());
        std::thread::spawn(move || {
            dev.poll(0, 0);
            for i in 0..n {
                dev.queue_rq(write_rq(i * 8, &pattern(500 + i, 4096)), &c.completer());
            }
            dev.commit_rqs(0);
            assert_eq!(dev.stats().private_rings, 1);
            drop(dev);
            to_main.send(()).unwrap();
            // Holds its ring, unreaped, until told; its exit then drains it.
            from_main.recv_timeout(WAIT).unwrap();
        })
    };
    from_thread.recv_timeout(WAIT).unwrap();
    drop(dev);
    // DEFER_TASKRUN: nothing completes until the thread waits in its ring.
    assert_eq!(c.count(), 0, "the thread's requests are still in its ring");
    let e = open(&format!("file:{}", path.display())).err();
    assert!(
        e.as_deref().is_some_and(|e| e.contains("in use")),
        "a second open while the old ring holds writes: {e:?}"
    );
    to_thread.send(()).unwrap();
    t.join().unwrap();
    for (rq, st) in c.wait(n as usize) {
        assert!(st.is_ok(), "{rq:?}: {st:?}");
    }
    // Drained: the image is free, and holds what the old ring wrote.
    let dev = open(&format!("file:{}", path.display())).unwrap();
    for i in 0..n {
        assert_eq!(read_back(&dev, i * 8, 4096), pattern(500 + i, 4096));
    }
}

/// An image in use is refused before it is changed: a second opener asking to extend
/// it leaves its length alone.
#[test]
fn opening_an_image_in_use_does_not_extend_it() {
    let dir = tmpdir();
    let Some((dev, path)) = device(dir.path(), "8M") else {
        return;
    };
    let e = open(&format!("file:{},create=1,size=16M", path.display())).err();
    assert!(e.as_deref().is_some_and(|e| e.contains("in use")), "{e:?}");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 8 << 20);
    drop(dev);
    let dev = open(&format!("file:{},create=1,size=16M", path.display())).unwrap();
    assert_eq!(dev.geometry().size_bytes, 16 << 20);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 16 << 20);
}
