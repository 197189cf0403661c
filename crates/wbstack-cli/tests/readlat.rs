//! readlat on a DirFs, with reads observed or slowed down through a wrapping BenchFs.

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::io;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use wbstack::block::DiskStats;
use wbstack_cli::bench::benchfs::{BenchFile, BenchFs, DirFs, FlushWait};
use wbstack_cli::bench::readlat::{self, ReadlatOpts, PERCENTILES};

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

type Hook = Arc<dyn Fn(&str, u64) + Send + Sync>;

/// A DirFs whose reads call `hook(path, offset)` first.
struct HookFs {
    inner: DirFs,
    hook: Hook,
}

struct HookFile {
    inner: Box<dyn BenchFile>,
    path: String,
    hook: Hook,
}

impl BenchFile for HookFile {
    fn write_at(&mut self, off: u64, buf: &[u8]) -> io::Result<()> {
        self.inner.write_at(off, buf)
    }
    fn read_at(&mut self, off: u64, buf: &mut [u8]) -> io::Result<usize> {
        (self.hook)(&self.path, off);
        self.inner.read_at(off, buf)
    }
    fn size(&mut self) -> io::Result<u64> {
        self.inner.size()
    }
    fn set_len(&mut self, size: u64) -> io::Result<()> {
        self.inner.set_len(size)
    }
    fn fsync(&mut self) -> io::Result<()> {
        self.inner.fsync()
    }
    fn start_flush(&mut self) -> io::Result<Box<dyn FlushWait>> {
        self.inner.start_flush()
    }
    fn close(self: Box<Self>) -> io::Result<()> {
        self.inner.close()
    }
}

impl BenchFs for HookFs {
    fn name(&self) -> String {
        format!("hooked {}", self.inner.name())
    }
    fn mkdir_all(&self, p: &str) -> io::Result<()> {
        self.inner.mkdir_all(p)
    }
    fn create(&self, p: &str) -> io::Result<Box<dyn BenchFile>> {
        self.inner.create(p)
    }
    fn open(&self, p: &str, write: bool) -> io::Result<Box<dyn BenchFile>> {
        Ok(Box::new(HookFile {
            inner: self.inner.open(p, write)?,
            path: p.to_string(),
            hook: self.hook.clone(),
        }))
    }
    fn rename(&self, a: &str, b: &str) -> io::Result<()> {
        self.inner.rename(a, b)
    }
    fn unlink(&self, p: &str) -> io::Result<()> {
        self.inner.unlink(p)
    }
    fn symlink(&self, t: &str, p: &str) -> io::Result<()> {
        self.inner.symlink(t, p)
    }
    fn sync(&self) -> io::Result<()> {
        self.inner.sync()
    }
    fn usage(&self) -> io::Result<(u64, u64)> {
        self.inner.usage()
    }
    fn disk_stats(&self) -> Option<DiskStats> {
        self.inner.disk_stats()
    }
    fn drop_cache(&self, p: &str) -> io::Result<bool> {
        self.inner.drop_cache(p)
    }
}

fn hooked(root: &Path, hook: impl Fn(&str, u64) + Send + Sync + 'static) -> Arc<dyn BenchFs> {
    Arc::new(HookFs {
        inner: DirFs::new(root).unwrap(),
        hook: Arc::new(hook),
    })
}

fn opts(size: u64, target_ms: u64) -> ReadlatOpts {
    ReadlatOpts {
        size,
        target: Duration::from_millis(target_ms),
        keep: true,
        ..Default::default()
    }
}

fn same_files(root: &Path) {
    let a = std::fs::read(root.join("readlat/readlat.in")).unwrap();
    let b = std::fs::read(root.join("readlat/readlat.out")).unwrap();
    assert_eq!(a.len(), b.len());
    assert!(a == b, "the pipe's output is the input");
}

#[test]
fn every_block_is_read_once_and_piped_through_unchanged() {
    let dir = tmp();
    let reads: Arc<Mutex<BTreeMap<u64, u32>>> = Default::default();
    let r2 = reads.clone();
    let fs = hooked(dir.path(), move |p, off| {
        if p.ends_with("readlat.in") {
            *r2.lock().entry(off).or_default() += 1;
        }
    });
    let size = (1 << 20) + 1000;
    // A target far above any read: with fio's lost wakeup every block would wait it out.
    let t = Instant::now();
    let r = readlat::run(&opts(size, 5000), fs).unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "the issuer slept out a target: {:?}",
        t.elapsed()
    );
    let blocks = size.div_ceil(4096);
    assert_eq!(r.blocks, blocks);
    assert_eq!(r.bytes, size);
    let reads = reads.lock();
    assert_eq!(reads.len() as u64, blocks, "every block read");
    for (i, (off, n)) in reads.iter().enumerate() {
        assert_eq!(*off, i as u64 * 4096);
        assert_eq!(*n, 1, "block at {off} read {n} times");
    }
    assert_eq!(r.read.samples, blocks);
    assert_eq!(
        r.write.samples, blocks,
        "every block written to the pipe once"
    );
    assert_eq!(r.output_bytes, size);
    same_files(dir.path());
    assert!(r.cold, "the input was dropped from the cache");
    assert_eq!((r.figures.read_over, r.read.over, r.write.over), (0, 0, 0));
    assert_eq!(
        r.reader_threads, 1,
        "no read was late, so one reader did them all"
    );
    assert_eq!(r.read.percentiles.len(), PERCENTILES.len());
    assert!(r.read.percentiles.windows(2).all(|w| w[0].us <= w[1].us));
    assert_eq!(r.figures.read_max_us, r.read.max_us);
    assert!(r.figures.read_kib_s > 0 && r.figures.write_kib_s > 0);
}

#[test]
fn slow_reads_do_not_hold_up_the_next_and_each_counts_once() {
    let dir = tmp();
    let slow = [10u64, 20, 30, 40, 50];
    let fs = hooked(dir.path(), move |p, off| {
        if p.ends_with("readlat.in") && slow.contains(&(off / 4096)) {
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    let t = Instant::now();
    let r = readlat::run(&opts(256 << 10, 50), fs).unwrap();
    let wall = t.elapsed();
    assert_eq!(r.figures.read_over, 5, "one late read per slow block");
    assert!(r.figures.read_max_us >= 200_000);
    assert!(r.reader_threads >= 2, "late reads got readers of their own");
    // In turn, the five would take a second; overlapped, ~5 targets plus one.
    assert!(
        wall < Duration::from_millis(900),
        "slow reads serialised: {wall:?}"
    );
    // Blocks completed out of order still reach the pipe in order.
    same_files(dir.path());
    assert_eq!(r.write.samples, r.blocks);
}

#[test]
fn a_stall_counts_one_late_read_per_target_interval() {
    let dir = tmp();
    // The device stalls for 200 ms when block 100 is read: every read that starts
    // meanwhile completes when the stall ends, as reads queued behind a stuck device.
    let stall_end: Arc<Mutex<Option<Instant>>> = Default::default();
    let s2 = stall_end.clone();
    let fs = hooked(dir.path(), move |p, off| {
        if !p.ends_with("readlat.in") {
            return;
        }
        let until = {
            let mut g = s2.lock();
            if off == 100 * 4096 && g.is_none() {
                *g = Some(Instant::now() + Duration::from_millis(200));
            }
            *g
        };
        if let Some(u) = until {
            let now = Instant::now();
            if now < u {
                std::thread::sleep(u - now);
            }
        }
    });
    let r = readlat::run(&opts(512 << 10, 20), fs).unwrap();
    // Reads issued 0, 20, ..., 180 ms into the stall wait 200, 180, ..., 20 ms: those
    // over 20 ms are late, about stall / target of them (fewer if the issuer wakes late).
    assert!(
        (7..=11).contains(&r.figures.read_over),
        "a 200 ms stall at a 20 ms target: {} late reads",
        r.figures.read_over
    );
    assert!(
        r.figures.read_max_us >= 190_000,
        "max {}",
        r.figures.read_max_us
    );
    assert!(r.reader_threads as u64 >= r.figures.read_over.min(8));
    same_files(dir.path());
}

#[test]
fn an_existing_file_is_read_and_kept_and_bad_input_is_an_error() {
    let dir = tmp();
    let fs: Arc<dyn BenchFs> = Arc::new(DirFs::new(dir.path()).unwrap());
    readlat::make_input(&*fs, "given", 100_000, 3).unwrap();
    let o = ReadlatOpts {
        file: Some("given".into()),
        bs: 8192,
        target: Duration::from_secs(1),
        ..Default::default()
    };
    let r = readlat::run(&o, fs.clone()).unwrap();
    assert_eq!((r.bytes, r.blocks, r.output_bytes), (100_000, 13, 100_000));
    assert!(
        dir.path().join("given").exists(),
        "a given file is never removed"
    );
    assert!(
        !dir.path().join("readlat/readlat.out").exists(),
        "without keep the output is removed"
    );

    std::fs::write(dir.path().join("empty"), b"").unwrap();
    let cases: Vec<(ReadlatOpts, &str)> = vec![
        (
            ReadlatOpts {
                file: Some("missing".into()),
                ..Default::default()
            },
            "missing",
        ),
        (
            ReadlatOpts {
                file: Some("empty".into()),
                ..Default::default()
            },
            "empty",
        ),
        (
            ReadlatOpts {
                bs: 0,
                ..Default::default()
            },
            "--bs",
        ),
        (
            ReadlatOpts {
                target: Duration::ZERO,
                ..Default::default()
            },
            "--target",
        ),
        (
            ReadlatOpts {
                dd_lead: 1 << 20,
                dd_delay: Duration::from_millis(1),
                background_dd: 2 << 20,
                ..Default::default()
            },
            "exclude each other",
        ),
    ];
    for (o, want) in cases {
        let e = readlat::run(&o, fs.clone()).err().unwrap();
        assert!(e.contains(want), "expected '{want}' in: {e}");
    }
}

#[test]
fn a_delayed_dd_starts_while_the_reads_run() {
    // On wbstack, so the device's write count tells when the dd's data went out.
    let fs = wbstack_cli::bench::volfs::open("sim:ssd,size=1G,data=meta", "").unwrap();
    let o = ReadlatOpts {
        size: 16 << 20,
        background_dd: 4 << 20,
        dd_delay: Duration::from_millis(1),
        ..Default::default()
    };
    let r = readlat::run(&o, fs).unwrap();
    let dd = r.dd.expect("dd summary");
    assert_eq!(r.output_bytes, 16 << 20);
    // 16 MiB of cold reads take tens of ms on the simulated device; a millisecond in,
    // the dd writes into the cache, whole blocks, and a sync at the end puts them out.
    assert!(
        dd.bytes >= 1 << 20 && dd.bytes.is_multiple_of(1 << 20) && dd.bytes <= 4 << 20,
        "{dd:?}"
    );
    assert!(dd.durable_s >= dd.secs, "{dd:?}");
    let dev = r.device.expect("device stats");
    assert!(dev.read_ios > 0, "the input came from the device");
}

#[test]
fn background_dd_and_hogs_run_alongside() {
    let dir = tmp();
    let fs: Arc<dyn BenchFs> = Arc::new(DirFs::new(dir.path()).unwrap());
    let o = ReadlatOpts {
        size: 256 << 10,
        hogs: 1,
        hog_mem: 1 << 20,
        background_dd: 3 << 20,
        dd_lead: 1 << 20,
        ..Default::default()
    };
    let r = readlat::run(&o, fs).unwrap();
    assert_eq!(r.hogs, 1);
    let dd = r.dd.clone().expect("dd summary");
    assert!(
        dd.bytes >= 1 << 20 && dd.bytes <= 3 << 20 && dd.bytes.is_multiple_of(1 << 20),
        "the reads started after the dd's lead: {}",
        dd.bytes
    );
    assert_eq!(r.output_bytes, 256 << 10);
    assert!(
        dd.durable_s >= dd.secs && dd.durable_mib_s > 0.0,
        "the dd's data reached the device after its writes: {dd:?}"
    );
    let left: Vec<_> = std::fs::read_dir(dir.path().join("readlat"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "the run's files are removed: {left:?}");
    let text = readlat::human_lines(&r).join("\n");
    for want in [
        "Latency percentiles (usec) (READERS)",
        "\t50.0000th: ",
        "\t99.9999th: ",
        "\tOver=",
        "Latency percentiles (usec) (WRITERS)",
        "Read rate (KB/sec) : ",
        "Write rate (KB/sec): ",
    ] {
        assert!(text.contains(want), "'{want}' missing in:\n{text}");
    }
}
