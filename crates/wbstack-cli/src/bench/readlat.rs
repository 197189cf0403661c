//! `wbstack bench readlat`: seed 003's read latency tool, like fio's
//! t/read-to-pipe-async, without its lost wakeup.
//!
//! An issuer walks a file in `bs` blocks. Each read goes to a reader thread; the issuer
//! waits for it at most `target`, then issues the next block anyway, on another reader
//! (a new thread if none is idle). So a stall of the device shows up as one late read per
//! target interval it lasts, not as a single one (no coordinated omission). Completed
//! blocks are put back in order and written to a real pipe(2) (the write latency is that
//! of the pipe write, as fio's writes to stdout; it stalls when the pipe is full because
//! the consumer is throttled); a consumer thread, gzip's part in the seed, drains the
//! pipe into an output file on the same filesystem. A real pipe rather than a channel:
//! its 64 KiB kernel buffer and blocking writes are what the seed's writer latency was.
//!
//! fio's reader signals completion without holding the lock or setting a predicate, so
//! the issuer can miss the wakeup and sleep out the whole target (~10 ms per block when
//! reads are fast). Here completion is a flag set under the lock and the issuer waits
//! for the flag.

use crate::bench::benchfs::{err, BenchFs, DeviceWrites};
use crate::bench::hog::Hogs;
use crate::progress::Progress;
use hdrhistogram::Histogram;
use parking_lot::{Condvar, Mutex};
use rand::{RngCore, SeedableRng};
use serde::Serialize;
use std::collections::{BTreeMap, VecDeque};
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// fio's percentile list.
pub const PERCENTILES: [f64; 10] = [
    50.0, 75.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.99, 99.999, 99.9999,
];

#[derive(Clone, Debug)]
pub struct ReadlatOpts {
    /// File to read, inside the target; None: create `size` bytes first (seeded random
    /// contents) and drop it from the cache.
    pub file: Option<String>,
    pub size: u64,
    pub bs: usize,
    /// Latency target of a read; a read not done by then lets the next one go.
    pub target: Duration,
    /// CPU hog threads, and the memory they hold between them.
    pub hogs: usize,
    pub hog_mem: u64,
    /// Bytes a concurrent buffered dd writes (bs 1 MiB) while the reads run; 0: none.
    pub background_dd: u64,
    /// Bytes the dd writes before the reads start (at least its first block), so the
    /// reads meet writeback already under way.
    pub dd_lead: u64,
    /// Time from the start of the reads to the start of the dd (with `dd_lead` 0), so
    /// the writeback begins while reads are running, as the seed's did.
    pub dd_delay: Duration,
    /// Reader threads at most (a stall longer than this many targets queues reads).
    pub max_readers: usize,
    /// "read latency=N usec" lines printed to stderr as they happen, at most.
    pub print_max: usize,
    /// Directory inside the target for the files of the run.
    pub dir: String,
    /// Keep the files made by the run (input if created, output, dd).
    pub keep: bool,
    pub seed: u64,
    pub progress: bool,
    /// Counters to bump as the run goes (a sampler reads them); None: a private one.
    pub meter: Option<std::sync::Arc<crate::bench::meter::Meter>>,
}

impl Default for ReadlatOpts {
    fn default() -> Self {
        ReadlatOpts {
            file: None,
            size: 512 << 20,
            bs: 4096,
            target: Duration::from_millis(10),
            hogs: 0,
            hog_mem: 0,
            background_dd: 0,
            dd_lead: 0,
            dd_delay: Duration::ZERO,
            max_readers: 512,
            print_max: 20,
            dir: "readlat".into(),
            keep: false,
            seed: 1,
            progress: false,
            meter: None,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Percentile {
    pub pct: f64,
    pub us: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct LatSummary {
    pub samples: u64,
    pub percentiles: Vec<Percentile>,
    pub over: u64,
    pub min_us: u64,
    pub max_us: u64,
}

impl LatSummary {
    fn from(h: &Histogram<u64>, over: u64) -> LatSummary {
        LatSummary {
            samples: h.len(),
            percentiles: PERCENTILES
                .iter()
                .map(|&p| Percentile {
                    pct: p,
                    us: h.value_at_quantile(p / 100.0),
                })
                .collect(),
            over,
            min_us: h.min(),
            max_us: h.max(),
        }
    }
    fn pct(&self, p: f64) -> u64 {
        self.percentiles
            .iter()
            .find(|x| x.pct == p)
            .map_or(0, |x| x.us)
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct DdSummary {
    pub bytes: u64,
    /// How long the dd's writes took (into the cache: throttled or not).
    pub secs: f64,
    pub mib_s: f64,
    /// From the dd's first write until a sync after the reads returned: how long its
    /// data took to reach the device, and that as a rate.
    pub durable_s: f64,
    pub durable_mib_s: f64,
}

/// The seed's headline figures of one run (flattened into every JSON that reports a
/// readlat run).
#[derive(Clone, Debug, Serialize)]
pub struct ReadlatFigures {
    pub read_p50_us: u64,
    pub read_p99_us: u64,
    pub read_p9999_us: u64,
    pub read_max_us: u64,
    pub read_over: u64,
    pub write_p9999_us: u64,
    pub read_kib_s: u64,
    pub write_kib_s: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct ReadlatReport {
    pub tool: &'static str,
    pub target: String,
    pub file: String,
    pub bs: usize,
    pub target_us: u64,
    pub blocks: u64,
    pub bytes: u64,
    /// Whether the input was dropped from the cache before the reads.
    pub cold: bool,
    #[serde(flatten)]
    pub figures: ReadlatFigures,
    pub read: LatSummary,
    pub write: LatSummary,
    /// Reader threads that were started (1 when no read was ever late).
    pub reader_threads: usize,
    /// Bytes the pipe consumer wrote to the output file.
    pub output_bytes: u64,
    pub hogs: usize,
    pub dd: Option<DdSummary>,
    pub device: Option<DeviceWrites>,
    pub extra: serde_json::Value,
}

/// The seed's output: percentiles, Over/min/max for readers and writers, then rates.
pub fn human_lines(r: &ReadlatReport) -> Vec<String> {
    let mut v = Vec::new();
    for (name, s) in [("READERS", &r.read), ("WRITERS", &r.write)] {
        v.push(format!("Latency percentiles (usec) ({name})"));
        for p in &s.percentiles {
            v.push(format!("\t{:2.4}th: {}", p.pct, p.us));
        }
        v.push(format!(
            "\tOver={}, min={}, max={}",
            s.over, s.min_us, s.max_us
        ));
    }
    v.push(format!("Read rate (KB/sec) : {}", r.figures.read_kib_s));
    v.push(format!("Write rate (KB/sec): {}", r.figures.write_kib_s));
    v
}

fn new_hist() -> Histogram<u64> {
    // 1 us .. 1 hour at 3 significant digits; larger values saturate.
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}

/// A read's completion, waited on by the issuer for at most the target.
struct Done {
    flag: Mutex<bool>,
    cv: Condvar,
}

struct PoolState {
    queue: VecDeque<(u64, Arc<Done>)>,
    /// Readers inside a read. A reader stops being busy before it reports the read
    /// done, so the issuer, woken by that report, counts it as free.
    busy: usize,
    exit: bool,
}

struct Shared {
    fs: Arc<dyn BenchFs>,
    path: String,
    bs: usize,
    size: u64,
    target_us: u64,
    pool: Mutex<PoolState>,
    pool_cv: Condvar,
    /// Blocks read and not yet written to the pipe, by sequence number.
    ready: Mutex<BTreeMap<u64, Vec<u8>>>,
    ready_cv: Condvar,
    failed: AtomicBool,
    error: Mutex<Option<String>>,
    printed: AtomicUsize,
    print_max: usize,
    meter: Arc<crate::bench::meter::Meter>,
}

impl Shared {
    fn fail(&self, e: String) {
        self.error.lock().get_or_insert(e);
        self.failed.store(true, Ordering::Release);
        // Wake everyone who may be waiting on a predicate that now includes `failed`.
        let _g = self.ready.lock();
        self.ready_cv.notify_all();
        drop(_g);
        let _p = self.pool.lock();
        self.pool_cv.notify_all();
    }

    /// Record one read's or write's latency since `start`; a late one counts in `over`
    /// and is printed (up to --print-max), as read-to-pipe-async does.
    /// Returns whether it was late.
    fn record(
        &self,
        what: &str,
        start: Instant,
        hist: &mut Histogram<u64>,
        over: &mut u64,
    ) -> bool {
        let us = start.elapsed().as_micros() as u64;
        hist.saturating_record(us);
        let late = us > self.target_us;
        if late {
            *over += 1;
            if self.printed.fetch_add(1, Ordering::Relaxed) < self.print_max {
                eprintln!("{what} latency={us} usec");
            }
        }
        late
    }
}

/// A reader thread: takes blocks off the queue until told to exit; returns its
/// histogram and late-read count.
fn reader(sh: Arc<Shared>) -> (Histogram<u64>, u64) {
    let mut hist = new_hist();
    let mut over = 0u64;
    let mut f = match sh.fs.open(&sh.path, false) {
        Ok(f) => f,
        Err(e) => {
            sh.fail(format!("readlat: open {}: {e}", sh.path));
            return (hist, over);
        }
    };
    loop {
        let (seq, done) = {
            let mut p = sh.pool.lock();
            loop {
                if let Some(w) = p.queue.pop_front() {
                    p.busy += 1;
                    break w;
                }
                if p.exit || sh.failed.load(Ordering::Acquire) {
                    return (hist, over);
                }
                sh.pool_cv.wait(&mut p);
            }
        };
        let off = seq * sh.bs as u64;
        let len = (sh.size - off).min(sh.bs as u64) as usize;
        let mut buf = vec![0u8; len];
        let s = Instant::now();
        let mut got = 0;
        while got < len {
            match f.read_at(off + got as u64, &mut buf[got..]) {
                Ok(0) => {
                    sh.fail(format!(
                        "readlat: {} is shorter than {} bytes (end of file at {})",
                        sh.path,
                        sh.size,
                        off + got as u64
                    ));
                    break;
                }
                Ok(n) => got += n,
                Err(e) => {
                    sh.fail(format!("readlat: read {} at {off}: {e}", sh.path));
                    break;
                }
            }
        }
        let late = sh.record("read", s, &mut hist, &mut over);
        sh.meter.ops.fetch_add(1, Ordering::Relaxed);
        sh.meter.bytes.fetch_add(len as u64, Ordering::Relaxed);
        if late {
            sh.meter.late.fetch_add(1, Ordering::Relaxed);
        }
        sh.pool.lock().busy -= 1;
        {
            let mut d = done.flag.lock();
            *d = true;
            done.cv.notify_one();
        }
        let mut r = sh.ready.lock();
        r.insert(seq, buf);
        sh.ready_cv.notify_one();
    }
}

/// The pipe writer (fio's writer thread): blocks in order into the pipe.
fn pipe_writer(
    sh: &Shared,
    blocks: u64,
    mut pipe: std::io::PipeWriter,
) -> (Histogram<u64>, u64, Instant) {
    let mut hist = new_hist();
    let mut over = 0;
    for seq in 0..blocks {
        let buf = {
            let mut r = sh.ready.lock();
            loop {
                if let Some(b) = r.remove(&seq) {
                    break b;
                }
                if sh.failed.load(Ordering::Acquire) {
                    return (hist, over, Instant::now());
                }
                sh.ready_cv.wait(&mut r);
            }
        };
        let s = Instant::now();
        if let Err(e) = pipe.write_all(&buf) {
            sh.fail(format!("readlat: write to pipe: {e}"));
            break;
        }
        sh.record("write", s, &mut hist, &mut over);
    }
    (hist, over, Instant::now())
}

/// The pipe's consumer: everything from the pipe into `out`.
fn consumer(fs: &dyn BenchFs, out: &str, mut pipe: std::io::PipeReader) -> Result<u64, String> {
    let mut f = fs.create(out).map_err(err("readlat: create output"))?;
    let mut buf = vec![0u8; 64 << 10];
    let mut off = 0u64;
    loop {
        let n = match pipe.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("readlat: read from pipe: {e}")),
        };
        f.write_at(off, &buf[..n])
            .map_err(err("readlat: write output"))?;
        off += n as u64;
    }
    f.close().map_err(err("readlat: close output"))?;
    Ok(off)
}

fn background_dd(
    fs: &dyn BenchFs,
    path: &str,
    size: u64,
    lead: u64,
    delay: Duration,
    started: std::sync::mpsc::Sender<()>,
    stop: &AtomicBool,
) -> Result<(DdSummary, Instant), String> {
    let mut started = Some(started);
    if !delay.is_zero() {
        if let Some(s) = started.take() {
            let _ = s.send(());
        }
        let until = Instant::now() + delay;
        while !stop.load(Ordering::Relaxed) && Instant::now() < until {
            std::thread::sleep((until - Instant::now()).min(Duration::from_millis(10)));
        }
    }
    let t0 = Instant::now();
    let mut f = fs.create(path).map_err(err("readlat: dd create"))?;
    let buf = vec![0u8; 1 << 20];
    let mut off = 0;
    while off < size && !stop.load(Ordering::Relaxed) {
        let n = (size - off).min(buf.len() as u64) as usize;
        f.write_at(off, &buf[..n])
            .map_err(err("readlat: dd write"))?;
        off += n as u64;
        if off >= lead.min(size) {
            if let Some(s) = started.take() {
                let _ = s.send(());
            }
        }
    }
    f.close().map_err(err("readlat: dd close"))?;
    let secs = t0.elapsed().as_secs_f64();
    Ok((
        DdSummary {
            bytes: off,
            secs,
            mib_s: off as f64 / (1u64 << 20) as f64 / secs.max(1e-9),
            durable_s: 0.0,
            durable_mib_s: 0.0,
        },
        t0,
    ))
}

/// Write `size` bytes of seeded random data to `path`.
pub fn make_input(fs: &dyn BenchFs, path: &str, size: u64, seed: u64) -> Result<(), String> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut f = fs.create(path).map_err(err("readlat: create input"))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut off = 0;
    while off < size {
        let n = (size - off).min(buf.len() as u64) as usize;
        rng.fill_bytes(&mut buf[..n]);
        f.write_at(off, &buf[..n])
            .map_err(err("readlat: write input"))?;
        off += n as u64;
    }
    f.fsync().map_err(err("readlat: fsync input"))?;
    f.close().map_err(err("readlat: close input"))
}

fn validate(o: &ReadlatOpts) -> Result<(), String> {
    if o.bs == 0 {
        return Err("readlat: --bs must be at least 1 byte".into());
    }
    if o.target.is_zero() {
        return Err("readlat: --target must be more than 0".into());
    }
    if o.max_readers == 0 {
        return Err("readlat: --max-readers must be at least 1".into());
    }
    if o.dd_lead > 0 && !o.dd_delay.is_zero() {
        return Err("readlat: --dd-lead and --dd-delay exclude each other (the dd runs before the reads, or after they began)".into());
    }
    if o.file.is_none() && o.size == 0 {
        return Err("readlat: --size must be more than 0".into());
    }
    Ok(())
}

pub fn run(o: &ReadlatOpts, fs: Arc<dyn BenchFs>) -> Result<ReadlatReport, String> {
    validate(o)?;
    let dir = o.dir.trim_matches('/').to_string();
    let inside = |name: &str| {
        if dir.is_empty() {
            name.to_string()
        } else {
            format!("{dir}/{name}")
        }
    };
    if !dir.is_empty() {
        fs.mkdir_all(&dir).map_err(err("readlat: mkdir"))?;
    }
    let (path, size, created) = match &o.file {
        Some(p) => {
            let mut f = fs
                .open(p, false)
                .map_err(err(format!("readlat: --file {p}")))?;
            let size = f.size().map_err(err("readlat: size of --file"))?;
            f.close().map_err(err("readlat: close"))?;
            if size == 0 {
                return Err(format!("readlat: --file {p} is empty"));
            }
            (p.trim_start_matches('/').to_string(), size, false)
        }
        None => {
            let p = inside("readlat.in");
            if o.progress {
                eprintln!("readlat: writing {} bytes to {p}", o.size);
            }
            make_input(&*fs, &p, o.size, o.seed)?;
            (p, o.size, true)
        }
    };
    let cold = fs
        .drop_cache(&path)
        .map_err(err("readlat: drop input from cache"))?;
    // The reads meet the dd's writeback, not the tail of writing the input.
    if !fs.settle().map_err(err("readlat: settle"))? {
        eprintln!("readlat: the device did not settle after writing the input; measuring anyway");
    }
    let out_path = inside("readlat.out");
    let dd_path = inside("readlat.dd");
    let blocks = size.div_ceil(o.bs as u64);

    let sh = Arc::new(Shared {
        fs: fs.clone(),
        path: path.clone(),
        bs: o.bs,
        size,
        target_us: o.target.as_micros() as u64,
        pool: Mutex::new(PoolState {
            queue: VecDeque::new(),
            busy: 0,
            exit: false,
        }),
        pool_cv: Condvar::new(),
        ready: Mutex::new(BTreeMap::new()),
        ready_cv: Condvar::new(),
        failed: AtomicBool::new(false),
        error: Mutex::new(None),
        printed: AtomicUsize::new(0),
        print_max: if o.progress { o.print_max } else { 0 },
        meter: o.meter.clone().unwrap_or_default(),
    });

    let hogs = Hogs::start(o.hogs, o.hog_mem);
    let dd_stop = Arc::new(AtomicBool::new(false));
    let dd = if o.background_dd > 0 {
        let (fs, stop, p, n, lead, delay) = (
            fs.clone(),
            dd_stop.clone(),
            dd_path.clone(),
            o.background_dd,
            o.dd_lead,
            o.dd_delay,
        );
        let (tx, rx) = std::sync::mpsc::channel();
        let h = std::thread::spawn(move || background_dd(&*fs, &p, n, lead, delay, tx, &stop));
        // The reads start once the dd is writing (or has failed: its error comes below).
        let _ = rx.recv();
        Some(h)
    } else {
        None
    };
    let _progress = {
        let sh = sh.clone();
        Progress::start(o.progress, Duration::from_secs(2), move || {
            format!(
                "readlat: {} of {} MiB read",
                sh.meter.bytes() >> 20,
                size >> 20
            )
        })
    };

    let (rd, wr) = std::io::pipe().map_err(err("readlat: pipe"))?;
    let disk0 = fs.disk_stats();
    let t0 = Instant::now();
    let consumer_h = {
        let fs = fs.clone();
        let out = out_path.clone();
        std::thread::spawn(move || consumer(&*fs, &out, rd))
    };
    let writer_h = {
        let sh = sh.clone();
        std::thread::spawn(move || pipe_writer(&sh, blocks, wr))
    };
    let mut readers = Vec::new();
    let spawn_reader = |readers: &mut Vec<std::thread::JoinHandle<(Histogram<u64>, u64)>>| {
        let sh = sh.clone();
        readers.push(std::thread::spawn(move || reader(sh)));
    };
    for seq in 0..blocks {
        if sh.failed.load(Ordering::Acquire) {
            break;
        }
        let done = Arc::new(Done {
            flag: Mutex::new(false),
            cv: Condvar::new(),
        });
        {
            let mut p = sh.pool.lock();
            p.queue.push_back((seq, done.clone()));
            if p.busy + p.queue.len() <= readers.len() {
                sh.pool_cv.notify_one();
            } else if readers.len() < o.max_readers {
                // Every reader is busy with a late read: this one gets a thread of its own.
                drop(p);
                spawn_reader(&mut readers);
            }
        }
        let mut d = done.flag.lock();
        let _ = done.cv.wait_while_for(&mut d, |fin| !*fin, o.target);
    }
    {
        let mut p = sh.pool.lock();
        p.exit = true;
        sh.pool_cv.notify_all();
    }
    let mut read_hist = new_hist();
    let mut read_over = 0;
    let nreaders = readers.len();
    for h in readers {
        let (hh, ov) = h
            .join()
            .map_err(|_| "readlat: a reader thread panicked".to_string())?;
        read_hist
            .add(&hh)
            .map_err(|e| format!("readlat: histogram: {e:?}"))?;
        read_over += ov;
    }
    let read_end = Instant::now();
    let (write_hist, write_over, write_end) = writer_h
        .join()
        .map_err(|_| "readlat: the writer thread panicked".to_string())?;
    let consumed = consumer_h
        .join()
        .map_err(|_| "readlat: the pipe consumer panicked".to_string())?;
    dd_stop.store(true, Ordering::Relaxed);
    let dd = match dd {
        Some(h) => Some(
            h.join()
                .map_err(|_| "readlat: the dd thread panicked".to_string())??,
        ),
        None => None,
    };
    let elapsed = t0.elapsed().as_secs_f64();
    let device = DeviceWrites::between(&disk0, &fs.disk_stats(), elapsed);
    // How long the dd's data took to reach the device, the reads' interference (and
    // wbt's throttling) included.
    let dd = match dd {
        Some((mut d, start)) => {
            fs.sync().map_err(err("readlat: sync after the dd"))?;
            d.durable_s = start.elapsed().as_secs_f64();
            d.durable_mib_s = d.bytes as f64 / (1u64 << 20) as f64 / d.durable_s.max(1e-9);
            Some(d)
        }
        None => None,
    };
    let nhogs = hogs.threads();
    drop(hogs);
    // The consumer's own error first: a failed consumer also breaks the pipe.
    let output_bytes = consumed?;
    if let Some(e) = sh.error.lock().take() {
        return Err(e);
    }

    if !o.keep {
        let mut rm = vec![out_path.clone()];
        if created {
            rm.push(path.clone());
        }
        if dd.is_some() {
            rm.push(dd_path.clone());
        }
        for p in rm {
            fs.unlink(&p).map_err(err("readlat: remove"))?;
        }
    }

    let kib = size / 1024;
    let rate = |end: Instant| {
        let us = end.duration_since(t0).as_micros() as u64;
        (kib * 1_000_000).checked_div(us).unwrap_or(0)
    };
    let read = LatSummary::from(&read_hist, read_over);
    let write = LatSummary::from(&write_hist, write_over);
    Ok(ReadlatReport {
        tool: "readlat",
        target: fs.name(),
        file: path,
        bs: o.bs,
        target_us: o.target.as_micros() as u64,
        blocks,
        bytes: size,
        cold,
        figures: ReadlatFigures {
            read_p50_us: read.pct(50.0),
            read_p99_us: read.pct(99.0),
            read_p9999_us: read.pct(99.99),
            read_max_us: read.max_us,
            read_over,
            write_p9999_us: write.pct(99.99),
            read_kib_s: rate(read_end),
            write_kib_s: rate(write_end),
        },
        read,
        write,
        reader_threads: nreaders,
        output_bytes,
        hogs: nhogs,
        dd,
        device,
        extra: fs.extra_stats(),
    })
}
