//! The page cache and writeback engine over the test filesystem: plugging the whole
//! pass (seed 000), reclaim, readahead, sync without livelock, kupdate timing, and
//! IO-less throttling bounds. Counts and states, not wall-clock.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use wbstack::block::QueueConfig;
use wbstack::clock::{ManualClock, NSEC_PER_SEC};
use wbstack::dev::sim::SimDevice;
use wbstack::mm::throttle::DirtyConfig;
use wbstack::mm::{CacheConfig, PAGE_SIZE};
use wbstack::testfs::{quiet_wb, within_a_minute, TestVolume};
use wbstack::writeback::WbConfig;

fn page(ino: u64, i: u64) -> Vec<u8> {
    (0..PAGE_SIZE)
        .map(|k| (ino as usize * 131 + i as usize * 7 + k) as u8)
        .collect()
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::yield_now();
    }
}

fn volume(spec: &str, cache: CacheConfig, wb: WbConfig, region: u64) -> TestVolume {
    TestVolume::open(spec, QueueConfig::default(), cache, wb, region).unwrap()
}

#[test]
fn plugging_the_pass_merges_adjacent_small_files() {
    let n = 2000u64;
    let mut writes = Vec::new();
    for plug in [true, false] {
        let v = volume(
            "null,memory_backed=1,lbs=4096,size=64M",
            CacheConfig::default(),
            quiet_wb(plug),
            1,
        );
        for ino in 0..n {
            v.file(ino).write_at(0, &page(ino, 0)).unwrap();
        }
        let before = v.q.diskstats();
        v.bdi.sync().unwrap();
        let d = v.q.diskstats().delta(&before);
        assert_eq!(d.sectors[1], n * 8, "every page written once");
        writes.push(d.writes());
        // Data reads back from the device.
        for ino in (0..n).step_by(97) {
            let f = v.evict(ino, 4096).unwrap();
            let mut out = vec![0u8; 4096];
            assert_eq!(f.read_at(0, &mut out).unwrap(), 4096);
            assert_eq!(out, page(ino, 0));
        }
    }
    let (on, off) = (writes[0], writes[1]);
    assert_eq!(
        off, n,
        "without the pass plug every file is its own request"
    );
    // Page-cache pages are separate segments: max_segments (128) caps each request at
    // 128 files (512 KiB), below max_sectors_kb.
    assert!(on <= n.div_ceil(128) + 1, "plug on: {on} requests");
}

#[test]
fn evicted_data_reads_back_and_reclaim_keeps_the_cache_bounded() {
    let cache = CacheConfig {
        cache_size: 256 * 4096,
        ..Default::default()
    };
    let v = volume(
        "null,memory_backed=1,lbs=4096,size=64M",
        cache,
        quiet_wb(true),
        64,
    );
    for ino in 0..16u64 {
        let f = v.file(ino);
        for i in 0..64u64 {
            f.write_at(i * 4096, &page(ino, i)).unwrap();
        }
        v.bdi.sync().unwrap();
        assert!(
            v.cache.nr_pages() <= 256 + 64,
            "cache grew to {}",
            v.cache.nr_pages()
        );
    }
    // Reading everything back goes through reclaim and readahead.
    for ino in 0..16u64 {
        let f = v.file(ino);
        for i in 0..64u64 {
            let mut out = vec![0u8; 4096];
            f.read_at(i * 4096, &mut out).unwrap();
            assert_eq!(out, page(ino, i), "ino {ino} page {i}");
        }
        assert!(v.cache.nr_pages() <= 256 + 64);
    }
    // Partial writes are read-modify-write against evicted pages.
    let f = v.evict(3, 64 * 4096).unwrap();
    f.write_at(4096 + 100, b"hello").unwrap();
    let mut out = vec![0u8; 4096];
    f.read_at(4096, &mut out).unwrap();
    let mut want = page(3, 1);
    want[100..105].copy_from_slice(b"hello");
    assert_eq!(out, want);
    // Holes past the written part read as zeros.
    let g = v.file(40);
    g.write_at(3 * 4096, &page(40, 3)).unwrap();
    let mut hole = vec![1u8; 4096];
    g.read_at(0, &mut hole).unwrap();
    assert!(hole.iter().all(|&b| b == 0));
}

#[test]
fn reclaim_never_drops_a_dirty_page() {
    let cache = CacheConfig {
        cache_size: 64 * 4096,
        ..Default::default()
    };
    let v = volume(
        "sim:ssd,size=64M,iops=1000000,bw=10G,lat=1us",
        cache,
        quiet_wb(true),
        512,
    );
    let sim = v.q.device().as_any().downcast_ref::<SimDevice>().unwrap();
    let f = v.file(0);
    for i in 0..200u64 {
        f.write_at(i * 4096, &page(0, i)).unwrap();
    }
    assert_eq!(f.nr_dirty(), 200);
    assert!(
        v.cache.nr_pages() >= 200,
        "dirty pages stay although over capacity"
    );
    sim.hold(true);
    let h = v.bdi.start_writeback();
    wait_for("writeback to start", || v.cache.nr_writeback() == 200);
    // Reads of other data push reclaim: pages under writeback must survive.
    let g = v.file(1);
    for i in 0..100u64 {
        g.write_at(i * 4096, &page(1, i)).unwrap();
    }
    assert_eq!(f.nr_pages(), 200);
    sim.hold(false);
    h.wait().unwrap();
    v.bdi.sync().unwrap();
    let f = v.evict(0, 200 * 4096).unwrap();
    for i in 0..200u64 {
        let mut out = vec![0u8; 4096];
        f.read_at(i * 4096, &mut out).unwrap();
        assert_eq!(out, page(0, i));
    }
}

#[test]
fn readahead_reads_sequential_files_in_window_sized_requests() {
    // Windows 4, 8, 16, then 32 pages (128 KiB) to the end of 2048 pages.
    assert_eq!(
        cold_sequential_reads(CacheConfig::default()),
        3 + (2048 - 28u64).div_ceil(32)
    );
}

/// Device reads of reading an 8 MiB file page by page, cold, with this readahead limit.
fn cold_sequential_reads(cache: CacheConfig) -> u64 {
    let v = volume(
        "null,memory_backed=1,lbs=4096,size=64M",
        cache,
        quiet_wb(true),
        4096,
    );
    let f = v.file(0);
    let data: Vec<u8> = (0..8u64 << 20).map(|i| (i * 7 / 4096) as u8).collect();
    f.write_at(0, &data).unwrap();
    v.bdi.sync().unwrap();
    let f = v.evict(0, data.len() as u64).unwrap();
    let before = v.q.diskstats();
    let mut out = vec![0u8; 4096];
    for i in 0..(data.len() / 4096) {
        f.read_at(i as u64 * 4096, &mut out).unwrap();
        assert_eq!(&out[..], &data[i * 4096..(i + 1) * 4096]);
    }
    let d = v.q.diskstats().delta(&before);
    assert_eq!(
        d.sectors[0],
        (data.len() / 512) as u64,
        "each page read once"
    );
    d.reads()
}

#[test]
fn a_sequential_reader_starts_the_next_window_before_it_needs_it() {
    let v = volume(
        "null,memory_backed=1,lbs=4096,size=64M",
        CacheConfig::default(),
        quiet_wb(true),
        4096,
    );
    let f = v.file(0);
    f.write_at(0, &vec![7u8; 1 << 20]).unwrap();
    v.bdi.sync().unwrap();
    let f = v.evict(0, 1 << 20).unwrap();
    let before = v.q.diskstats();
    let mut out = vec![0u8; 4096];
    let read_pages = |n: u64| {
        let d = v.q.diskstats().delta(&before);
        assert_eq!(d.sectors[0] % 8, 0);
        assert_eq!(d.sectors[0] / 8, n);
    };
    f.read_at(0, &mut out).unwrap();
    read_pages(4); // the first window, synchronously
    f.read_at(4096, &mut out).unwrap();
    read_pages(4 + 8); // leaving the first page started the next window
    f.read_at(2 * 4096, &mut out).unwrap();
    f.read_at(3 * 4096, &mut out).unwrap();
    read_pages(4 + 8); // nothing more until the reader enters that window
    f.read_at(4 * 4096, &mut out).unwrap();
    read_pages(4 + 8 + 16);
    // A jump elsewhere starts a new stream: a small window, the next one as the reader
    // moves on.
    f.read_at(100 * 4096, &mut out).unwrap();
    f.read_at(101 * 4096, &mut out).unwrap();
    read_pages(4 + 8 + 16 + 4 + 8);
}

#[test]
fn read_ahead_kb_is_in_kib_and_zero_reads_only_the_page_asked_for() {
    let ra = |v: &str| {
        let mut o = wbstack::fs::MountOptions::default();
        o.parse(&format!("read_ahead_kb={v}")).unwrap();
        o.cache
    };
    assert_eq!(ra("2560").ra_max_pages, 640);
    assert_eq!(ra("1M").ra_max_pages, 256);
    assert_eq!(ra("0").ra_max_pages, 0);
    // 2048 pages: windows 4, 16 (fourfold while under a sixteenth of the limit), 32, 64,
    // 128, then 256 pages (also the device's largest IO) to the end.
    assert_eq!(
        cold_sequential_reads(ra("1024")),
        5 + (2048 - 244u64).div_ceil(256)
    );
    assert_eq!(cold_sequential_reads(ra("0")), 2048);
}

#[test]
fn sync_is_not_livelocked_by_a_writer_that_keeps_dirtying() {
    let v = Arc::new(volume(
        "sim:ssd,size=64M,iops=200000,bw=1G,lat=20us",
        CacheConfig::default(),
        quiet_wb(true),
        256,
    ));
    let f = v.file(0);
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let (f2, s2, r2) = (f.clone(), stop.clone(), rounds.clone());
    let writer = std::thread::spawn(move || {
        while !s2.load(Ordering::Relaxed) {
            for i in 0..256u64 {
                f2.write_at(i * 4096, &page(9, i)).unwrap();
            }
            r2.fetch_add(1, Ordering::Relaxed);
        }
    });
    wait_for("the writer to dirty the file", || {
        rounds.load(Ordering::Relaxed) >= 2
    });
    for _ in 0..3 {
        v.bdi.sync().unwrap(); // returns although the file is dirtied again all along
    }
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    v.bdi.sync().unwrap();
    assert_eq!(f.nr_dirty(), 0);
}

#[test]
fn kupdate_writes_only_expired_inodes() {
    let clock = ManualClock::new(0);
    let qcfg = QueueConfig {
        clock: clock.clone(),
        ..Default::default()
    };
    let wb = WbConfig {
        dirty: DirtyConfig {
            dirty_bytes: 1 << 40,
            dirty_background_bytes: 1 << 39,
            ..Default::default()
        },
        ..Default::default()
    };
    let v = TestVolume::open(
        "null,memory_backed=1,lbs=4096,size=64M",
        qcfg,
        CacheConfig::default(),
        wb,
        16,
    )
    .unwrap();
    let old = v.file(1);
    old.write_at(0, &page(1, 0)).unwrap();
    // 10 s later a second file is dirtied; its pages must wait for their own expiry.
    for _ in 0..2 {
        let passes = v.bdi.stats().passes;
        clock.advance(5 * NSEC_PER_SEC);
        wait_for("a kupdate pass", || v.bdi.stats().passes > passes);
    }
    let young = v.file(2);
    young.write_at(0, &page(2, 0)).unwrap();
    for _ in 0..3 {
        let passes = v.bdi.stats().passes;
        clock.advance(5 * NSEC_PER_SEC);
        wait_for("a kupdate pass", || v.bdi.stats().passes > passes);
    }
    assert_eq!(v.q.diskstats().writes(), 0, "nothing expired before 30 s");
    // t = 30 s: the old file is expired, the young one (dirtied at 10 s) is not.
    clock.advance(5 * NSEC_PER_SEC);
    wait_for("the old inode written", || old.nr_dirty() == 0);
    assert_eq!(young.nr_dirty(), 1, "kupdate leaves unexpired inodes alone");
    for _ in 0..2 {
        clock.advance(5 * NSEC_PER_SEC);
    }
    wait_for("the young inode written at 40 s", || young.nr_dirty() == 0);
}

#[test]
fn a_writer_faster_than_the_device_is_throttled_within_the_limits() {
    let cache = CacheConfig {
        cache_size: 64 << 20,
        ..Default::default()
    };
    let wb = WbConfig {
        dirty_writeback_centisecs: 0,
        ..Default::default()
    };
    let v = Arc::new(volume("sim:ssd,size=1G,bw=100M,data=0", cache, wb, 1 << 18));
    let (thresh, bg) = v.bdi.thresholds();
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    // What balance_dirty_pages limits: dirty plus under writeback.
    let peak_total = Arc::new(AtomicU64::new(0));
    let (v2, s2, p2, t2) = (v.clone(), stop.clone(), peak.clone(), peak_total.clone());
    let monitor = std::thread::spawn(move || {
        while !s2.load(Ordering::Relaxed) {
            let d = v2.cache.nr_dirty();
            p2.fetch_max(d, Ordering::Relaxed);
            t2.fetch_max(d + v2.cache.nr_writeback(), Ordering::Relaxed);
            std::thread::yield_now();
        }
    });
    let f = v.file(0);
    let buf = vec![7u8; 1 << 20];
    for i in 0..48u64 {
        f.write_at(i << 20, &buf).unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    monitor.join().unwrap();
    let s = v.bdi.stats();
    let peak = peak.load(Ordering::Relaxed);
    // Overshoot allowance: the ratelimit (at most thresh/32 plus one call's pages).
    assert!(
        peak <= thresh + thresh / 32 + 256,
        "dirty peaked at {peak} pages, limit {thresh}"
    );
    let peak_total = peak_total.load(Ordering::Relaxed);
    assert!(
        peak_total > bg,
        "the writer got past the background threshold ({peak_total} <= {bg})"
    );
    assert!(s.pauses > 0, "the writer was paused");
    assert!(
        s.pause_ns_max <= 200_000_000,
        "a pause of {} ns",
        s.pause_ns_max
    );
    v.bdi.sync().unwrap();
}

#[test]
fn fsync_work_writes_only_its_range_and_waits() {
    let v = volume(
        "null,memory_backed=1,lbs=4096,size=64M",
        CacheConfig::default(),
        quiet_wb(true),
        64,
    );
    let f = v.file(0);
    let g = v.file(1);
    for i in 0..16u64 {
        f.write_at(i * 4096, &page(0, i)).unwrap();
    }
    g.write_at(0, &page(1, 0)).unwrap();
    v.bdi.fsync_range(0, 4, 7).wait().unwrap();
    assert_eq!(f.nr_dirty(), 12, "only pages 4..=7 written");
    assert_eq!(f.nr_writeback(), 0, "and waited for");
    assert_eq!(g.nr_dirty(), 1, "other inodes untouched");
    assert_eq!(v.q.diskstats().sectors[1], 4 * 8);
    v.bdi.fsync_range(0, 0, u64::MAX).wait().unwrap();
    assert_eq!(f.nr_dirty(), 0);
    // A clean inode's fsync is a no-op that still completes.
    v.bdi.fsync_range(7, 0, u64::MAX).wait().unwrap();
}

/// The test filesystem, counting the times a thread is about to sleep until pages
/// leave writeback (how a test knows an fsync is waiting for a write), and recording
/// each `end_writes` call.
struct Observing {
    fs: Arc<wbstack::testfs::TestFs>,
    waits: AtomicU64,
    /// Whose pages under writeback an `end_writes` call counts.
    bdi: parking_lot::Mutex<Option<Arc<wbstack::writeback::Bdi>>>,
    calls: parking_lot::Mutex<Vec<EndWritesCall>>,
}

impl Observing {
    fn new(fs: Arc<wbstack::testfs::TestFs>) -> Observing {
        Observing {
            fs,
            waits: AtomicU64::new(0),
            bdi: parking_lot::Mutex::new(None),
            calls: parking_lot::Mutex::new(Vec::new()),
        }
    }
}

/// One `end_writes` call: the (inode, first page, pages) it was told of, and how many
/// pages were still under writeback then.
#[derive(Debug, PartialEq)]
struct EndWritesCall {
    writes: Vec<(u64, u64, u64)>,
    under_writeback: u64,
}

impl wbstack::mm::AddressSpaceOps for Observing {
    fn map_write(
        &self,
        ino: u64,
        index: u64,
        n: u64,
    ) -> Result<Vec<(u64, u64)>, wbstack::block::BlkError> {
        self.fs.map_write(ino, index, n)
    }
    fn map_read(
        &self,
        ino: u64,
        index: u64,
        n: u64,
    ) -> Result<Vec<(Option<u64>, u64)>, wbstack::block::BlkError> {
        self.fs.map_read(ino, index, n)
    }
    fn writeback_wait(&self, _ino: u64) {
        self.waits.fetch_add(1, Ordering::SeqCst);
    }
    fn end_writes(&self, done: &[wbstack::mm::WriteDone<'_>]) {
        let under_writeback = self.bdi.lock().as_ref().map_or(0, |b| b.nr_writeback());
        let writes = done.iter().map(|d| (d.ino, d.index, d.pages)).collect();
        self.calls.lock().push(EndWritesCall {
            writes,
            under_writeback,
        });
    }
}

#[test]
fn fsync_waits_for_writeback_started_before_it_and_reports_its_error() {
    // Once a WB_SYNC_NONE pass has written an inode's only dirty page the inode is
    // clean, so it has left the writeback lists, while its page is still under
    // writeback: its fsync must still wait for that write, and report its failure.
    let v = volume(
        "sim:ssd,size=64M",
        CacheConfig::default(),
        quiet_wb(true),
        16,
    );
    let sim = v.q.device().as_any().downcast_ref::<SimDevice>().unwrap();
    for (ino, fails) in [(1u64, false), (2, true)] {
        let ops = Arc::new(Observing::new(v.fs.clone()));
        let f = wbstack::mm::Mapping::new(ino, 0, v.bdi.clone(), ops.clone());
        f.write_at(0, &page(ino, 0)).unwrap();
        if fails {
            let sector = ino * 16 * 8;
            sim.inject_eio(sector..sector + 8, false, true);
        }
        sim.hold(true);
        v.bdi.start_writeback().wait().unwrap();
        wait_for("the write to reach the device", || sim.pending() == 1);
        assert_eq!((v.bdi.nr_dirty(), v.bdi.nr_writeback()), (0, 1));

        let h = v.bdi.fsync_range(ino, 0, u64::MAX);
        wait_for("the fsync to wait for the write, or to return", || {
            ops.waits.load(Ordering::SeqCst) > 0 || h.is_done()
        });
        assert!(
            !h.is_done(),
            "inode {ino}: fsync returned with its write in flight"
        );
        sim.hold(false);
        let r = h.wait();
        assert_eq!(v.bdi.nr_writeback(), 0, "inode {ino}: fsync returned early");
        if fails {
            assert_eq!(r, Err(wbstack::block::BlkError::Io), "the write's error");
            sim.clear_faults();
        } else {
            r.unwrap();
        }
    }
}

#[test]
fn a_pass_emits_the_kernels_trace_events_as_json_lines() {
    let v = volume(
        "null,memory_backed=1,lbs=4096,size=64M",
        CacheConfig::default(),
        quiet_wb(true),
        1,
    );
    for ino in 1000..1010u64 {
        v.file(ino).write_at(0, &page(ino, 0)).unwrap();
    }
    wbstack::trace::enable(1 << 16);
    v.bdi.sync().unwrap();
    let dump = wbstack::trace::dump_jsonl();
    wbstack::trace::disable();
    let events: Vec<serde_json::Value> = dump
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    let names: Vec<&str> = events.iter().filter_map(|e| e["event"].as_str()).collect();
    for want in [
        "writeback_start",
        "writeback_queue_io",
        "writeback_single_inode",
        "writeback_written",
        "block_plug",
        "block_unplug",
    ] {
        assert!(names.contains(&want), "no {want} in {names:?}");
    }
    let ours = events
        .iter()
        .filter(|e| {
            e["event"] == "writeback_single_inode"
                && e["fields"]["ino"]
                    .as_u64()
                    .is_some_and(|i| (1000..1010).contains(&i))
        })
        .count();
    assert_eq!(ours, 10, "one visit per inode");
}

#[test]
fn sync_waits_for_writeback_started_before_it() {
    // wait_sb_inodes: pages a WB_SYNC_NONE pass put under writeback are no longer
    // dirty, so sync's own pass does not visit them; it must still wait for them.
    let v = Arc::new(volume(
        "sim:ssd,size=64M",
        CacheConfig::default(),
        quiet_wb(true),
        16,
    ));
    v.file(3).write_at(0, &page(3, 0)).unwrap();
    let sim = v.q.device().as_any().downcast_ref::<SimDevice>().unwrap();
    sim.hold(true);
    v.bdi.start_writeback().wait().unwrap();
    wait_for("the write to reach the device", || sim.pending() == 1);
    assert_eq!(v.cache.nr_writeback(), 1);
    let v2 = v.clone();
    let t = std::thread::spawn(move || {
        v2.bdi.sync().unwrap();
        v2.cache.nr_writeback()
    });
    // Give a wrong sync every chance to return early, then let the device go.
    let t0 = Instant::now();
    while !t.is_finished() && t0.elapsed() < Duration::from_millis(200) {
        std::thread::yield_now();
    }
    sim.hold(false);
    assert_eq!(
        t.join().unwrap(),
        0,
        "sync returned with pages under writeback"
    );
}

/// An inode whose "any dirty pages?" answer is staged by the test: the first check
/// after `arm` runs `during_check` (another thread dirtying the inode) and answers from
/// before it, exactly the interleaving of a write landing inside the clean check.
struct StagedInode {
    dirty: AtomicBool,
    writes: AtomicU64,
    armed: AtomicBool,
    during_check: parking_lot::Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl wbstack::writeback::WbInode for StagedInode {
    fn ino(&self) -> u64 {
        7
    }
    fn writepages(&self, _wbc: &mut wbstack::writeback::Wbc) -> wbstack::block::BlkResult {
        self.writes.fetch_add(1, Ordering::SeqCst);
        self.dirty.store(false, Ordering::SeqCst);
        Ok(())
    }
    fn has_dirty_pages(&self) -> bool {
        let before = self.dirty.load(Ordering::SeqCst);
        if self.armed.swap(false, Ordering::SeqCst) {
            if let Some(f) = self.during_check.lock().take() {
                f();
            }
        }
        before
    }
}

#[test]
fn a_page_dirtied_while_its_inode_is_found_clean_is_not_forgotten() {
    // Found by crashtest: "no dirty pages" and taking the inode off the lists were two
    // steps; a page dirtied between them left the inode dirty on no list, never
    // written back, not even by sync.
    let v = Arc::new(volume(
        "sim:ssd,size=64M",
        CacheConfig::default(),
        quiet_wb(true),
        64,
    ));
    let inode = Arc::new(StagedInode {
        dirty: AtomicBool::new(true),
        writes: AtomicU64::new(0),
        armed: AtomicBool::new(false),
        during_check: parking_lot::Mutex::new(None),
    });
    v.bdi.mark_inode_dirty(inode.clone());
    inode.dirty.store(false, Ordering::SeqCst); // an fsync wrote it all
    let marked = Arc::new(AtomicBool::new(false));
    let (bdi, ino2, m2) = (v.bdi.clone(), inode.clone(), marked.clone());
    *inode.during_check.lock() = Some(Box::new(move || {
        // A writer dirties a page and marks the inode dirty, from another thread. If
        // the check holds the lists lock (as it must) this cannot finish now: wait a
        // bounded time, then let the check go on with its stale answer.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            ino2.dirty.store(true, Ordering::SeqCst);
            bdi.mark_inode_dirty(ino2.clone());
            m2.store(true, Ordering::SeqCst);
            let _ = tx.send(());
        });
        let _ = rx.recv_timeout(Duration::from_millis(200));
    }));
    inode.armed.store(true, Ordering::SeqCst);
    v.bdi.inode_maybe_clean(7);
    wait_for("the writer's mark_inode_dirty", || {
        marked.load(Ordering::SeqCst)
    });
    let before = inode.writes.load(Ordering::SeqCst);
    v.bdi.sync().unwrap();
    assert!(
        inode.writes.load(Ordering::SeqCst) > before,
        "the re-dirtied inode was left off the lists: sync never wrote it"
    );
}

#[test]
fn a_long_write_counts_every_page_once_across_its_batches() {
    // 300 pages: several of write_at's lock-hold batches, with a partial page at each
    // end; the middle of the file is then rewritten across a partial page that must be
    // read back first (after eviction), which ends a batch early.
    let v = volume(
        "sim:ssd,size=64M,iops=1000000,bw=10G,lat=1us",
        CacheConfig::default(),
        quiet_wb(true),
        1024,
    );
    let f = v.file(0);
    let data: Vec<u8> = (0..300 * PAGE_SIZE + 1000)
        .map(|k| (k % 251) as u8)
        .collect();
    f.write_at(100, &data).unwrap();
    let pages = (100 + data.len()).div_ceil(PAGE_SIZE) as u64;
    assert_eq!(f.nr_dirty(), pages);
    assert_eq!(f.nr_pages() as u64, pages);
    assert_eq!(v.cache.nr_pages(), pages);
    assert_eq!(v.cache.nr_dirty(), pages);
    assert_eq!(v.bdi.nr_dirty(), pages);
    assert_eq!(f.size(), 100 + data.len() as u64);
    v.bdi.sync().unwrap();
    assert_eq!(v.cache.nr_dirty(), 0);
    assert_eq!(v.bdi.nr_dirty(), 0);

    // Rewrite from the middle of page 10 to the middle of page 150 of the evicted file:
    // both partial pages are read first, the pages between are replaced.
    let f = v.evict(0, f.size()).unwrap();
    let patch = vec![0xeeu8; 140 * PAGE_SIZE];
    let at = 10 * PAGE_SIZE as u64 + 2048;
    f.write_at(at, &patch).unwrap();
    assert_eq!(f.nr_dirty(), 141);
    assert_eq!(v.cache.nr_dirty(), 141);
    let mut out = vec![0u8; 300 * PAGE_SIZE + 1100];
    let n = f.read_at(0, &mut out).unwrap();
    assert_eq!(n, 100 + data.len());
    let mut want = vec![0u8; 100];
    want.extend_from_slice(&data);
    want[at as usize..at as usize + patch.len()].copy_from_slice(&patch);
    assert!(out[..n] == want[..], "content after the rewrite");
    v.bdi.sync().unwrap();
    assert_eq!(v.cache.nr_dirty(), 0);
}

/// A device that keeps the writes it is handed until the test completes them, one by
/// one and in any order (`complete`), by passing them to the memory-backed null
/// device below, which completes them at once in the calling thread. Reads pass
/// straight through.
struct WriteGate {
    inner: wbstack::dev::DeviceRef,
    held: parking_lot::Mutex<Vec<(wbstack::block::Request, wbstack::dev::Completer)>>,
}

impl WriteGate {
    fn new() -> Arc<WriteGate> {
        let inner = wbstack::dev::open(
            "null,memory_backed=1,lbs=4096,size=64M",
            QueueConfig::default().clock,
        )
        .unwrap();
        Arc::new(WriteGate {
            inner,
            held: parking_lot::Mutex::new(Vec::new()),
        })
    }
    fn held(&self) -> usize {
        self.held.lock().len()
    }
    /// Complete the `i`-th held write (in arrival order among those still held).
    fn complete(&self, i: usize) {
        let (rq, done) = self.held.lock().remove(i);
        self.inner.queue_rq(rq, &done);
    }
}

impl wbstack::dev::Device for WriteGate {
    fn queue_rq(&self, rq: wbstack::block::Request, done: &wbstack::dev::Completer) {
        if rq.op == wbstack::block::Op::Write {
            self.held.lock().push((rq, done.clone()));
        } else {
            self.inner.queue_rq(rq, done);
        }
    }
    wbstack::stacked_device!(inner);
}

/// A test volume over a `WriteGate`.
fn gated_volume() -> (Arc<WriteGate>, TestVolume) {
    let gate = WriteGate::new();
    let q = wbstack::block::RequestQueue::new(gate.clone(), QueueConfig::default()).unwrap();
    (
        gate,
        TestVolume::new(q, CacheConfig::default(), quiet_wb(false), 16),
    )
}

/// A background writeback pass over everything dirty.
fn background() -> wbstack::writeback::Wbc {
    wbstack::writeback::Wbc {
        nr_to_write: i64::MAX,
        for_background: true,
        ..Default::default()
    }
}

#[test]
fn a_late_completion_of_a_cut_page_leaves_its_rewrite_under_writeback() {
    // set_size(0) drops page 0 while its write is in flight (the deferred truncation
    // of a file that stays in use does this). The file is written again and the new
    // page 0 goes under writeback too. The old write completing must end nothing but
    // its own write: the new page stays under writeback until its own write completes.
    let (gate, v) = gated_volume();
    let f = v.file(0);

    f.write_at(0, &page(0, 0)).unwrap();
    f.writepages(&mut background()).unwrap();
    wait_for("the old write to reach the device", || gate.held() == 1);
    assert_eq!(f.nr_writeback(), 1);

    f.set_size(0);
    assert_eq!(f.nr_pages(), 0);
    assert_eq!(f.nr_writeback(), 0, "the cut page is no longer waited for");
    assert_eq!(
        v.cache.nr_writeback(),
        1,
        "the old write is still in flight"
    );

    f.write_at(0, &page(0, 1)).unwrap();
    f.writepages(&mut background()).unwrap();
    wait_for("the new write to reach the device", || gate.held() == 2);
    assert_eq!(f.nr_writeback(), 1);
    assert_eq!(v.cache.nr_writeback(), 2);
    assert_eq!(v.bdi.nr_writeback(), 2);

    // The old write completes; the new one is still held by the device.
    gate.complete(0);
    assert_eq!(gate.held(), 1);
    assert_eq!(v.cache.nr_writeback(), 1, "one write is still in flight");
    assert_eq!(v.bdi.nr_writeback(), 1);
    assert_eq!(
        f.nr_writeback(),
        1,
        "the old write's completion ended the writeback of the rewritten page, \
         whose own write is still in flight"
    );
    // Another pass must not claim the page again while its write is in flight.
    f.write_at(0, &page(0, 2)).unwrap();
    f.writepages(&mut background()).unwrap();
    assert_eq!(gate.held(), 1, "a page under writeback was written again");

    gate.complete(0);
    assert_eq!(f.nr_writeback(), 0);
    assert_eq!(v.cache.nr_writeback(), 0);
    assert_eq!(v.bdi.nr_writeback(), 0);
    // The third version is written once the second is home.
    f.writepages(&mut background()).unwrap();
    wait_for("the third write", || gate.held() == 1);
    gate.complete(0);
    assert_eq!(f.nr_writeback(), 0);
    assert_eq!(v.cache.nr_writeback(), 0);
    let f = v.evict(0, PAGE_SIZE as u64).unwrap();
    let mut out = vec![0u8; PAGE_SIZE];
    f.read_at(0, &mut out).unwrap();
    assert_eq!(out, page(0, 2));
}

#[test]
fn claimed_pages_and_bio_writes_end_only_their_own_pages() {
    // The same as above across the filesystem's own writes of claimed pages
    // (`claim_dirty`, journaled data): each end, of a bio or of a claim, ends the
    // writeback of the pages it wrote and of no newer page at their index.
    let (gate, v) = gated_volume();
    let f = v.file(0);

    // A bio write in flight, cut; the rewrite claimed by the filesystem.
    f.write_at(0, &page(0, 0)).unwrap();
    f.writepages(&mut background()).unwrap();
    wait_for("the bio write to reach the device", || gate.held() == 1);
    f.set_size(0);
    f.write_at(0, &page(0, 1)).unwrap();
    let (claim, pages) = f
        .claim_dirty(4)
        .expect("nothing of the file under writeback");
    assert_eq!(pages.len(), 1);
    assert_eq!(f.nr_writeback(), 1);
    gate.complete(0);
    assert_eq!(
        f.nr_writeback(),
        1,
        "the bio's completion ended a claimed page"
    );
    assert_eq!(v.cache.nr_writeback(), 1);
    f.end_claimed(0, 1, claim, Ok(()));
    assert_eq!(f.nr_writeback(), 0);
    assert_eq!(v.cache.nr_writeback(), 0);
    assert_eq!(v.bdi.nr_writeback(), 0);

    // A claim in flight, cut; the rewrite goes out as a bio: the old claim's end must
    // leave it under writeback.
    f.write_at(0, &page(0, 2)).unwrap();
    let (old, _) = f.claim_dirty(4).unwrap();
    f.set_size(0);
    f.write_at(0, &page(0, 3)).unwrap();
    f.writepages(&mut background()).unwrap();
    wait_for("the bio write to reach the device", || gate.held() == 1);
    assert_eq!(v.cache.nr_writeback(), 2);
    f.end_claimed(0, 1, old, Ok(()));
    assert_eq!(
        f.nr_writeback(),
        1,
        "a claim's end ended a bio write's page"
    );
    assert_eq!(v.cache.nr_writeback(), 1);
    gate.complete(0);
    assert_eq!(f.nr_writeback(), 0);
    assert_eq!(v.cache.nr_writeback(), 0);

    // A claim given back after its page was cut and the index claimed anew: the new
    // claim's page stays clean and under writeback.
    f.write_at(0, &page(0, 4)).unwrap();
    let (old, _) = f.claim_dirty(4).unwrap();
    f.set_size(0);
    f.write_at(0, &page(0, 5)).unwrap();
    let (new, _) = f.claim_dirty(4).unwrap();
    assert_ne!(old, new);
    f.unclaim(old, &[0]);
    assert_eq!(
        f.nr_dirty(),
        0,
        "giving back the old claim dirtied the new page"
    );
    assert_eq!(
        f.nr_writeback(),
        1,
        "giving back the old claim ended the new one"
    );
    assert_eq!(v.cache.nr_writeback(), 1);
    f.end_claimed(0, 1, new, Ok(()));
    assert_eq!(f.nr_writeback(), 0);
    assert_eq!(v.cache.nr_writeback(), 0);
    assert_eq!(v.bdi.nr_writeback(), 0);
    assert_eq!(v.cache.nr_dirty(), 0);
}

/// A write waiting for another reader's read of a page it covers in part, when that
/// read fails: the write stops there and returns the short count of the pages it
/// copied before the wait (generic_perform_write), which are on the dirty lists (a sync
/// writes them); and a write covering such a page whole never fails for someone
/// else's read (whose reader then fails, or finds the written page if the write
/// landed first: a race CI met once).
#[test]
fn a_write_failed_by_another_readers_error_leaves_no_dirty_page_unlisted() {
    let cache = CacheConfig {
        ra_max_pages: 0,
        ..Default::default()
    };
    let v = volume("sim:ssd,size=64M", cache, quiet_wb(true), 64);
    let sim = v.q.device().as_any().downcast_ref::<SimDevice>().unwrap();
    for ino in [1u64, 2] {
        let f = v.file(ino);
        for i in 0..3u64 {
            f.write_at(i * 4096, &page(ino, i)).unwrap();
        }
    }
    v.bdi.sync().unwrap();
    for (ino, partial) in [(1u64, true), (2, false)] {
        let f = v.evict(ino, 3 * 4096).unwrap();
        // Page 2 of the file (the test filesystem's fixed region) fails its reads.
        let sector = (ino * 64 + 2) * 8;
        sim.inject_eio(sector..sector + 8, true, false);
        sim.hold(true);
        let reader = {
            let f = f.clone();
            std::thread::spawn(move || {
                let mut b = vec![0u8; 4096];
                f.read_at(2 * 4096, &mut b).map(|_| b)
            })
        };
        wait_for("the reader's read inside the device", || sim.pending() == 1);
        // Pages 0 and 1 whole, page 2 in part or whole.
        let len = if partial { 2 * 4096 + 100 } else { 3 * 4096 };
        let data = vec![0xabu8; len];
        let writer = {
            let f = f.clone();
            std::thread::spawn(move || f.write_at(0, &data))
        };
        wait_for("the writer waiting on page 2", || f.nr_dirty() == 2);
        sim.hold(false);
        let read = reader.join().unwrap();
        let w = writer.join().unwrap();
        match read {
            Err(_) => {}
            // The writer's whole page went in after the failed read dropped the page
            // and before the reader looked again: the reader finds it, as
            // filemap_read_folio finds a folio made uptodate meanwhile. Never when the
            // page is covered in part, whose write needs the failed read.
            Ok(b) => assert!(
                !partial && b == [0xabu8; 4096],
                "inode {ino}: a read that did not fail returned what no write wrote"
            ),
        }
        sim.clear_faults();
        if partial {
            assert_eq!(
                w.unwrap(),
                2 * 4096,
                "the pages copied before the failed read"
            );
        } else {
            assert_eq!(
                w.unwrap(),
                len,
                "a whole-page write failed for another's read"
            );
        }
        v.bdi.sync().unwrap();
        assert_eq!(f.nr_dirty(), 0, "inode {ino}: dirty pages no sync writes");
    }
}

#[test]
fn a_merged_requests_writes_reach_the_filesystem_in_one_call_before_any_page_leaves_writeback() {
    // Eight one-page files on adjacent blocks, written in one plugged pass: one request
    // of eight bios, whose ends the filesystem hears of in one `end_writes` (one hold
    // of its state lock, not eight), while all eight pages are still under writeback
    // (ordered data: the extents are logged before a waiter sees the pages written).
    let v = volume(
        "sim:ssd,size=64M",
        CacheConfig::default(),
        quiet_wb(true),
        1,
    );
    let ops = Arc::new(Observing::new(v.fs.clone()));
    *ops.bdi.lock() = Some(v.bdi.clone());
    let files: Vec<_> = (1..=8u64)
        .map(|ino| {
            let f = wbstack::mm::Mapping::new(ino, 0, v.bdi.clone(), ops.clone());
            f.write_at(0, &page(ino, 0)).unwrap();
            f
        })
        .collect();
    v.bdi.sync().unwrap();
    let ds = v.q.diskstats();
    assert_eq!(
        (ds.ios[1], ds.merges[1]),
        (1, 7),
        "one merged write request"
    );
    let calls = std::mem::take(&mut *ops.calls.lock());
    let writes = (1..=8u64).map(|ino| (ino, 0, 1)).collect();
    assert_eq!(
        calls,
        vec![EndWritesCall {
            writes,
            under_writeback: 8
        }]
    );
    assert!(files
        .iter()
        .all(|f| f.nr_writeback() == 0 && f.nr_dirty() == 0));

    // A request of one bio is ended at once, as before.
    files[3].write_at(0, &page(4, 1)).unwrap();
    v.bdi.sync().unwrap();
    let one = EndWritesCall {
        writes: vec![(4, 0, 1)],
        under_writeback: 1,
    };
    assert_eq!(*ops.calls.lock(), vec![one]);
    *ops.bdi.lock() = None;
}

/// The test filesystem's map, with every run of pages handed back one extent per page
/// (as a fragmented allocation would): each piece's bio carries its own part of the
/// run's copy.
struct OneExtentPerPage(Arc<wbstack::testfs::TestFs>, AtomicU64);

impl wbstack::mm::AddressSpaceOps for OneExtentPerPage {
    fn map_write(
        &self,
        ino: u64,
        index: u64,
        n: u64,
    ) -> Result<Vec<(u64, u64)>, wbstack::block::BlkError> {
        let whole = self.0.map_write(ino, index, n)?;
        assert_eq!(
            whole.len(),
            1,
            "the test filesystem maps a run in one extent"
        );
        self.1.fetch_add(u64::from(n > 1), Ordering::SeqCst);
        Ok((0..n).map(|i| (whole[0].0 + i * 8, 1)).collect())
    }
    fn map_read(
        &self,
        ino: u64,
        index: u64,
        n: u64,
    ) -> Result<Vec<(Option<u64>, u64)>, wbstack::block::BlkError> {
        self.0.map_read(ino, index, n)
    }
}

#[test]
fn a_run_mapped_to_several_extents_writes_each_page_where_its_extent_says() {
    let v = volume(
        "null,memory_backed=1,lbs=4096,size=64M",
        CacheConfig {
            ra_max_pages: 0,
            ..CacheConfig::default()
        },
        quiet_wb(true),
        64,
    );
    let ops = Arc::new(OneExtentPerPage(v.fs.clone(), AtomicU64::new(0)));
    let ino = 3;
    let f = wbstack::mm::Mapping::new(ino, 0, v.bdi.clone(), ops.clone());
    let data: Vec<u8> = (0..40).flat_map(|i| page(ino, i)).collect();
    f.write_at(0, &data).unwrap();
    let before = v.q.diskstats();
    v.bdi.sync().unwrap();
    let d = v.q.diskstats().delta(&before);
    assert_eq!(d.sectors[1], 40 * 8, "every page written once");
    assert!(
        ops.1.load(Ordering::SeqCst) > 0,
        "no run of pages was split"
    );
    // Read back through the test filesystem's own map, from the device.
    let back = v.evict(ino, data.len() as u64).unwrap();
    let mut out = vec![0u8; data.len()];
    assert_eq!(back.read_at(0, &mut out).unwrap(), data.len());
    for i in 0..40 {
        let r = i * PAGE_SIZE..(i + 1) * PAGE_SIZE;
        assert!(out[r.clone()] == data[r], "page {i} read back wrong");
    }
}

/// A bug that panics the filesystem's writepages (its map_write) in the flusher is
/// contained there: the sync that met it fails with EIO instead of hanging, no page of
/// the file stays under writeback (two runs were claimed, neither submitted), the
/// file's error is reported once, the panic hook hears of it once, and the flusher goes
/// on: the other file is written in the same sync, and the next fsync of the file that
/// failed (its I_SYNC let go) writes its new data.
#[test]
fn a_panic_in_writepages_fails_the_sync_and_the_flusher_goes_on() {
    let v = Arc::new(
        wbstack::testfs::TestVolume::open(
            "null,size=64M,memory_backed=1",
            QueueConfig::default(),
            CacheConfig {
                ra_max_pages: 0,
                ..Default::default()
            },
            quiet_wb(true),
            64,
        )
        .unwrap(),
    );
    let heard = Arc::new(parking_lot::Mutex::new(Vec::<String>::new()));
    let h = heard.clone();
    v.bdi
        .set_panic_hook(Arc::new(move |what: &str| h.lock().push(what.to_string())));
    // Two runs of file 1 (pages 0-1 and 4-5), one of file 2.
    for (ino, i) in [(1, 0), (1, 1), (1, 4), (1, 5), (2, 0)] {
        v.file(ino)
            .write_at(i * PAGE_SIZE as u64, &page(ino, i))
            .unwrap();
    }
    v.fs.panicking_map_writes.store(1, Ordering::SeqCst);
    let v2 = v.clone();
    let r = within_a_minute("a sync after writepages panicked", move || v2.bdi.sync());
    assert_eq!(r, Err(wbstack::block::BlkError::Io));
    assert_eq!(v.bdi.panics(), 1);
    let heard_now = heard.lock().clone();
    assert_eq!(heard_now.len(), 1, "{heard_now:?}");
    assert!(
        heard_now[0].starts_with("writepages panicked: a bug in map_write of inode "),
        "{heard_now:?}"
    );
    // Which file met the panic depends on the pass's order; its pages ended with EIO.
    let failed: Vec<u64> = [1u64, 2]
        .into_iter()
        .filter(|&ino| v.file(ino).wb_err().check(0) != 0)
        .collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    for ino in [1, 2] {
        let f = v.file(ino);
        assert_eq!((f.nr_dirty(), f.nr_writeback()), (0, 0), "inode {ino}");
    }
    assert_eq!(v.bdi.nr_writeback(), 0);
    // The flusher goes on: the failed file's rewrite is written by its fsync.
    let ino = failed[0];
    let f = v.file(ino);
    for i in [0, 1, 4, 5] {
        f.write_at(i * PAGE_SIZE as u64, &page(ino + 10, i))
            .unwrap();
    }
    let v2 = v.clone();
    let r = within_a_minute("an fsync after the panic", move || {
        v2.bdi.fsync_range(ino, 0, u64::MAX).wait()
    });
    // The fsync reports the earlier write error once (errseq), or nothing if the sync
    // already did; either way the pages are now written.
    assert!(r.is_ok() || r == Err(wbstack::block::BlkError::Io), "{r:?}");
    assert_eq!((f.nr_dirty(), f.nr_writeback()), (0, 0));
    assert_eq!(v.bdi.panics(), 1);
    let f = v.evict(ino, 6 * PAGE_SIZE as u64).unwrap();
    for i in [0, 1, 4, 5] {
        let mut got = vec![0u8; PAGE_SIZE];
        f.read_at(i * PAGE_SIZE as u64, &mut got).unwrap();
        assert!(got == page(ino + 10, i), "page {i} of inode {ino}");
    }
    let other = 3 - ino;
    let f = v.evict(other, PAGE_SIZE as u64).unwrap();
    let mut got = vec![0u8; PAGE_SIZE];
    f.read_at(0, &mut got).unwrap();
    assert!(
        got == page(other, 0),
        "the other file's page was not written"
    );
}
