//! `wbstack soak DIR|SPEC`: hours of mixed load with self-checking contents. Each
//! thread owns its files and a model of them: creates, appends, overwrites, renames,
//! truncates, fsyncs, reads (checked against the model) and deletes, chosen by a
//! seeded generator. A watchdog names any operation running longer than the stall
//! bound; memory (the process holding the page cache: this one for a SPEC, the mount's
//! daemon for a wbstack DIR) must stay under cache_size plus a stated slack.

use crate::bench::benchfs::{BenchFs, DirFs};
use crate::bench::volfs::VolumeFs;
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct SoakOpts {
    /// A directory (a kernel filesystem or a wbstack mount) or a device spec (a fresh
    /// wbstack volume in this process).
    pub target: String,
    pub threads: usize,
    pub duration: Duration,
    pub seed: u64,
    pub files_per_thread: usize,
    pub max_file_bytes: usize,
    /// An operation taking longer than this is a stall: the run fails naming it.
    pub stall: Duration,
    /// RSS may exceed the page cache's size by this much (the daemon's or this
    /// process's own memory, the models, the threads).
    pub rss_slack_bytes: u64,
    /// Mount options for a SPEC target.
    pub mount_opts: String,
    pub interval: Duration,
    pub progress: bool,
}

impl Default for SoakOpts {
    fn default() -> Self {
        SoakOpts {
            target: "sim:ssd,size=2G".into(),
            threads: 16,
            duration: Duration::from_secs(600),
            seed: 1,
            files_per_thread: 24,
            max_file_bytes: 256 * 1024,
            stall: Duration::from_secs(30),
            rss_slack_bytes: 512 << 20,
            mount_opts: String::new(),
            interval: Duration::from_secs(10),
            progress: true,
        }
    }
}

#[derive(Debug, Default, Serialize)]
pub struct SoakReport {
    pub target: String,
    pub seconds: f64,
    pub ops: u64,
    pub bytes_written: u64,
    pub bytes_read: u64,
    pub fsyncs: u64,
    pub max_latency_ms: f64,
    /// The kind of operation that took `max_latency_ms`.
    pub slowest_op: String,
    /// The process's RSS at its highest, less what a simulated device kept in memory
    /// of the data written to it (`SimDevice::bytes_held`), as the bound is checked.
    pub max_rss_bytes: u64,
    pub rss_bound_bytes: u64,
    /// Wrong contents, unexpected errors, stalls, memory over the bound.
    pub failures: Vec<String>,
    /// The volume's metadata invariants after the run (SPEC targets).
    pub check_problems: Vec<String>,
    /// Inodes the inode cache evicted during the run (SPEC targets; 0 otherwise).
    pub inodes_evicted: u64,
}

/// What a thread is doing now, for the watchdog.
struct Doing {
    op: &'static str,
    path: String,
    since: Option<Instant>,
}

struct Shared {
    stop: AtomicBool,
    ops: AtomicU64,
    written: AtomicU64,
    read: AtomicU64,
    fsyncs: AtomicU64,
    max_lat_ns: AtomicU64,
    /// The slowest operation so far: (ns, kind).
    slowest: Mutex<(u64, &'static str)>,
    failures: Mutex<Vec<String>>,
    doing: Vec<Mutex<Doing>>,
}

impl Shared {
    fn fail(&self, msg: String) {
        self.failures.lock().push(msg);
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The process whose memory holds the cache: a wbstack mount's daemon, or this one.
fn cache_pid(target: &Path) -> Option<u32> {
    std::fs::read_to_string(target.join(".wbstack/pid"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

fn rss_bytes(pid: Option<u32>) -> u64 {
    let path = match pid {
        Some(p) => format!("/proc/{p}/status"),
        None => "/proc/self/status".into(),
    };
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| {
                    v.split_whitespace()
                        .next()
                        .and_then(|k| k.parse::<u64>().ok())
                })
        })
        .map_or(0, |kib| kib * 1024)
}

fn cache_size(target: &Path, opts: &str) -> u64 {
    if let Ok(s) = std::fs::read_to_string(target.join(".wbstack/stat")) {
        if let Some(pages) = s
            .lines()
            .find_map(|l| l.strip_prefix("cache_capacity_pages "))
            .and_then(|v| v.trim().parse::<u64>().ok())
        {
            return pages * 4096;
        }
    }
    let mut o = wbstack::fs::MountOptions::default();
    // Checked already when the volume was made.
    if o.parse(opts).is_err() {
        return wbstack::mm::CacheConfig::default().cache_size;
    }
    o.cache.cache_size
}

pub fn run(o: &SoakOpts) -> Result<SoakReport, String> {
    let dir = Path::new(&o.target);
    let is_dir = dir.is_dir();
    let (fs, vol): (Arc<dyn BenchFs>, Option<Arc<VolumeFs>>) = if is_dir {
        (Arc::new(DirFs::new(dir)?), None)
    } else {
        let mut mo = wbstack::fs::MountOptions::default();
        mo.parse(&o.mount_opts).map_err(|e| e.to_string())?;
        let v = Arc::new(VolumeFs::format(&o.target, mo)?);
        (v.clone(), Some(v))
    };
    let pid = if is_dir { cache_pid(dir) } else { None };
    let model_bytes = (o.threads * o.files_per_thread * o.max_file_bytes) as u64;
    let cache = if is_dir && pid.is_none() {
        0 // a kernel filesystem: its cache is the kernel's, not a process's
    } else {
        cache_size(dir, &o.mount_opts)
    };
    let rss_bound = cache + o.rss_slack_bytes + if pid.is_none() { model_bytes } else { 0 };
    let shared = Arc::new(Shared {
        stop: AtomicBool::new(false),
        ops: AtomicU64::new(0),
        written: AtomicU64::new(0),
        read: AtomicU64::new(0),
        fsyncs: AtomicU64::new(0),
        max_lat_ns: AtomicU64::new(0),
        slowest: Mutex::new((0, "")),
        failures: Mutex::new(Vec::new()),
        doing: (0..o.threads)
            .map(|_| {
                Mutex::new(Doing {
                    op: "",
                    path: String::new(),
                    since: None,
                })
            })
            .collect(),
    });
    let base = format!("soak-{}", o.seed);
    fs.mkdir_all(&base).map_err(|e| format!("{base}: {e}"))?;
    let start = Instant::now();
    let workers: Vec<_> = (0..o.threads)
        .map(|t| {
            let (fs, shared, o) = (fs.clone(), shared.clone(), o.clone());
            let dir = format!("{base}/t{t}");
            std::thread::Builder::new()
                .name(format!("soak-{t}"))
                .spawn(move || worker(&*fs, &shared, &o, t, &dir))
                .map_err(|e| e.to_string())
        })
        .collect::<Result<_, _>>()?;
    let mut max_rss = 0;
    let mut next_line = start + o.interval;
    // A simulated device keeps the data written to it in this process's memory: the
    // disk's, not the volume's, and it grows with every block the run writes anew, so
    // the faster the run the more of it. The bound is on the rest.
    let sim = vol.as_ref().and_then(|v| {
        v.volume()
            .queue()
            .device()
            .as_any()
            .downcast_ref::<wbstack::dev::sim::SimDevice>()
    });
    let device_bytes = || sim.map_or(0, |s| s.bytes_held());
    while start.elapsed() < o.duration && !shared.stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(200));
        let rss = rss_bytes(pid).saturating_sub(device_bytes());
        max_rss = max_rss.max(rss);
        if rss > rss_bound {
            shared.fail(format!(
                "RSS {} MiB over the bound of {} MiB",
                rss >> 20,
                rss_bound >> 20
            ));
        }
        for (t, d) in shared.doing.iter().enumerate() {
            let d = d.lock();
            if let Some(since) = d.since.filter(|s| s.elapsed() > o.stall) {
                let msg = format!(
                    "thread soak-{t} stuck {:.1} s in {} of {}",
                    since.elapsed().as_secs_f64(),
                    d.op,
                    d.path
                );
                drop(d);
                shared.fail(msg);
                break;
            }
        }
        if o.progress && Instant::now() >= next_line {
            next_line += o.interval;
            crate::util::status(&format!(
                "soak {:>5.0} s: {} ops, {} MiB written, {} MiB read, {} fsyncs, max latency {:.1} ms, RSS {} MiB",
                start.elapsed().as_secs_f64(),
                shared.ops.load(Ordering::Relaxed),
                shared.written.load(Ordering::Relaxed) >> 20,
                shared.read.load(Ordering::Relaxed) >> 20,
                shared.fsyncs.load(Ordering::Relaxed),
                shared.max_lat_ns.load(Ordering::Relaxed) as f64 / 1e6,
                rss >> 20
            ));
        }
    }
    shared.stop.store(true, Ordering::Relaxed);
    let stalled = !shared.failures.lock().iter().all(|f| !f.contains("stuck"));
    if stalled {
        // A stuck thread may never return: report without joining it.
        return Ok(report(o, &shared, start, max_rss, rss_bound, Vec::new(), 0));
    }
    for w in workers {
        if w.join().is_err() {
            shared.fail("a soak thread panicked".into());
        }
    }
    if o.progress {
        crate::util::status_done();
    }
    let mut problems = Vec::new();
    if let Err(e) = fs.sync() {
        shared.fail(format!("final sync: {e}"));
    }
    let mut evicted = 0;
    if let Some(v) = vol {
        problems = v.volume().check();
        evicted = v.volume().inode_cache_stats().evicted;
    }
    Ok(report(
        o, &shared, start, max_rss, rss_bound, problems, evicted,
    ))
}

fn report(
    o: &SoakOpts,
    s: &Shared,
    start: Instant,
    max_rss: u64,
    rss_bound: u64,
    check_problems: Vec<String>,
    inodes_evicted: u64,
) -> SoakReport {
    SoakReport {
        target: o.target.clone(),
        seconds: start.elapsed().as_secs_f64(),
        ops: s.ops.load(Ordering::Relaxed),
        bytes_written: s.written.load(Ordering::Relaxed),
        bytes_read: s.read.load(Ordering::Relaxed),
        fsyncs: s.fsyncs.load(Ordering::Relaxed),
        max_latency_ms: s.max_lat_ns.load(Ordering::Relaxed) as f64 / 1e6,
        slowest_op: s.slowest.lock().1.to_string(),
        max_rss_bytes: max_rss,
        rss_bound_bytes: rss_bound,
        failures: s.failures.lock().clone(),
        check_problems,
        inodes_evicted,
    }
}

/// One thread's loop over its own files; `model[i]` is file i's contents (None: it
/// does not exist).
fn worker(fs: &dyn BenchFs, s: &Shared, o: &SoakOpts, t: usize, dir: &str) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(o.seed ^ ((t as u64 + 1) << 32));
    if let Err(e) = fs.mkdir_all(dir) {
        return s.fail(format!("{dir}: {e}"));
    }
    let mut model: Vec<Option<Vec<u8>>> = vec![None; o.files_per_thread];
    let path = |i: usize| format!("{dir}/f{i}");
    while !s.stop.load(Ordering::Relaxed) {
        let i = rng.gen_range(0..model.len());
        let p = path(i);
        let kind = rng.gen_range(0..100);
        let op: &'static str = match (&model[i], kind) {
            (None, _) => "create",
            (Some(_), 0..=19) => "append",
            (Some(_), 20..=39) => "overwrite",
            (Some(_), 40..=49) => "truncate",
            (Some(_), 50..=57) => "fsync",
            (Some(_), 58..=64) => "rename",
            (Some(_), 65..=69) => "delete",
            (Some(_), _) => "read",
        };
        {
            let mut d = s.doing[t].lock();
            d.op = op;
            d.path.clone_from(&p);
            d.since = Some(Instant::now());
        }
        let t0 = Instant::now();
        let r = step(fs, s, o, &mut rng, &mut model, i, op, &path);
        let ns = t0.elapsed().as_nanos() as u64;
        s.doing[t].lock().since = None;
        if s.max_lat_ns.fetch_max(ns, Ordering::Relaxed) < ns {
            let mut w = s.slowest.lock();
            if ns > w.0 {
                *w = (ns, op);
            }
        }
        s.ops.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = r {
            return s.fail(format!("soak-{t}: {op} of {p}: {e}"));
        }
    }
}

fn fill(rng: &mut impl Rng, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rng.fill(&mut v[..]);
    v
}

#[allow(clippy::too_many_arguments)]
fn step(
    fs: &dyn BenchFs,
    s: &Shared,
    o: &SoakOpts,
    rng: &mut impl Rng,
    model: &mut [Option<Vec<u8>>],
    i: usize,
    op: &str,
    path: &dyn Fn(usize) -> String,
) -> Result<(), String> {
    let p = path(i);
    let e = |e: std::io::Error| e.to_string();
    match op {
        "create" => {
            let n = rng.gen_range(0..o.max_file_bytes / 4);
            let data = fill(rng, n);
            let mut f = fs.create(&p).map_err(e)?;
            f.write_at(0, &data).map_err(e)?;
            f.close().map_err(e)?;
            s.written.fetch_add(data.len() as u64, Ordering::Relaxed);
            model[i] = Some(data);
        }
        "append" | "overwrite" => {
            let cur = model[i].as_mut().expect("exists");
            let len = rng.gen_range(1..16 * 1024);
            let off = if op == "append" {
                cur.len()
            } else {
                rng.gen_range(0..=cur.len())
            };
            if off + len > o.max_file_bytes {
                return Ok(());
            }
            let data = fill(rng, len);
            let mut f = fs.open(&p, true).map_err(e)?;
            f.write_at(off as u64, &data).map_err(e)?;
            f.close().map_err(e)?;
            if cur.len() < off + len {
                cur.resize(off + len, 0);
            }
            cur[off..off + len].copy_from_slice(&data);
            s.written.fetch_add(len as u64, Ordering::Relaxed);
        }
        "truncate" => {
            let cur = model[i].as_mut().expect("exists");
            let len = rng.gen_range(0..=o.max_file_bytes / 2);
            let mut f = fs.open(&p, true).map_err(e)?;
            f.set_len(len as u64).map_err(e)?;
            f.close().map_err(e)?;
            cur.resize(len, 0);
        }
        "fsync" => {
            let mut f = fs.open(&p, true).map_err(e)?;
            f.fsync().map_err(e)?;
            f.close().map_err(e)?;
            s.fsyncs.fetch_add(1, Ordering::Relaxed);
        }
        "rename" => {
            let j = rng.gen_range(0..model.len());
            if j != i {
                fs.rename(&p, &path(j)).map_err(e)?;
                model[j] = model[i].take();
            }
        }
        "delete" => {
            fs.unlink(&p).map_err(e)?;
            model[i] = None;
        }
        _ => {
            let want = model[i].as_ref().expect("exists");
            let mut f = fs.open(&p, false).map_err(e)?;
            let mut got = vec![0u8; want.len() + 4096];
            let mut n = 0;
            loop {
                let r = f.read_at(n as u64, &mut got[n..]).map_err(e)?;
                if r == 0 || n + r == got.len() {
                    n += r;
                    break;
                }
                n += r;
            }
            f.close().map_err(e)?;
            s.read.fetch_add(n as u64, Ordering::Relaxed);
            if got[..n] != want[..] {
                let at = got[..n]
                    .iter()
                    .zip(want)
                    .position(|(a, b)| a != b)
                    .unwrap_or(n.min(want.len()));
                return Err(format!(
                    "contents differ from the model: {n} bytes read, {} expected, first difference at byte {at}",
                    want.len()
                ));
            }
        }
    }
    Ok(())
}

pub fn print(r: &SoakReport) {
    println!(
        "soak on {}: {:.0} s, {} ops, {} MiB written, {} MiB read, {} fsyncs, max latency {:.1} ms ({}), max RSS {} MiB (bound {} MiB)",
        r.target,
        r.seconds,
        r.ops,
        r.bytes_written >> 20,
        r.bytes_read >> 20,
        r.fsyncs,
        r.max_latency_ms,
        r.slowest_op,
        r.max_rss_bytes >> 20,
        r.rss_bound_bytes >> 20
    );
    for f in &r.failures {
        println!("FAIL: {f}");
    }
    for p in &r.check_problems {
        println!("CHECK: {p}");
    }
    if r.failures.is_empty() && r.check_problems.is_empty() {
        println!("every read matched the model; no stall, memory within the bound");
    }
}
