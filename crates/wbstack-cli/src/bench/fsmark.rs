//! `wbstack bench fsmark`: fs_mark 3.3's file-creation benchmark (seed 000, seed 004) over
//! a `BenchFs`.
//!
//! As in fs_mark: one thread per `-d` directory (or `-t` threads spread evenly over them),
//! each creating `-n` files per loop, named with 40 bytes (16 of hex time stamp padded
//! with '~', then 24 random [0-9A-Z]); with `-D` the files go to `%02x` subdirectories, a
//! new one every 180 s (time hash, starting at `now % D`) or every `-N` files (round
//! robin). Each file: create, write `-s` bytes of zeros in `-w` sized writes, then per
//! `-S`: 0 nothing, 1 fsync, A start an asynchronous flush (reaped later); then close.
//! Files/sec of a loop is the sum over threads of files / the thread's loop time; App
//! Overhead sums each thread's loop time not spent in create/write/fsync/close.

use crate::bench::benchfs::{add_stats, err, BenchFile, BenchFs, DeviceWrites, FlushWait};
use crate::progress::Progress;
use crate::util::process_cpu;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use wbstack::block::DiskStats;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum SyncMethod {
    /// -S0: no sync, no fsync.
    None,
    /// -S1: fsync before close.
    Fsync,
    /// -S A: an asynchronous flush before close, waited on later.
    Async,
}

impl SyncMethod {
    pub fn parse(s: &str) -> Result<SyncMethod, String> {
        match s {
            "0" => Ok(SyncMethod::None),
            "1" => Ok(SyncMethod::Fsync),
            "A" | "a" => Ok(SyncMethod::Async),
            _ => Err(format!(
                "unknown sync method '{s}' (0: no sync, 1: fsync before close, A: async flush before close)"
            )),
        }
    }
    /// fs_mark's description line.
    pub fn describe(self) -> &'static str {
        match self {
            SyncMethod::None => "NO SYNC: Test does not issue sync() or fsync() calls.",
            SyncMethod::Fsync => "FSYNC_BEFORE_CLOSE: fsync() called before close.",
            SyncMethod::Async => {
                "ASYNC_FLUSH_BEFORE_CLOSE: an asynchronous fsync is started before close and reaped later."
            }
        }
    }
}

#[derive(Clone, Debug)]
pub struct FsmarkOpts {
    /// `-d`: directories inside the target, one thread each (at least one).
    pub dirs: Vec<String>,
    /// `-t`: threads, a multiple of the number of directories (0: one per directory).
    pub threads: usize,
    /// `-D`: subdirectories (0: none; otherwise at least 2).
    pub subdirs: u32,
    /// `-N`: files per subdirectory before moving to the next (round robin); 0: time hash.
    pub per_subdir: u32,
    /// Seconds per subdirectory of the time hash (fs_mark: 180).
    pub secs_per_subdir: u64,
    /// `-n`: files per thread per loop.
    pub files: u64,
    /// `-s`: bytes per file.
    pub size: u64,
    /// `-w`: bytes per write call.
    pub io_size: usize,
    /// `-L`: loops.
    pub loops: u32,
    /// Keep the files of each loop (fs_mark: -k, implied by -L); else unlink them,
    /// untimed, after the loop.
    pub keep: bool,
    pub sync: SyncMethod,
    /// -S A: asynchronous flushes a thread keeps in flight before reaping the oldest.
    pub async_depth: usize,
    /// Sync the filesystem after the last loop, timed (the "including sync" figures).
    pub final_sync: bool,
    /// Progress lines on stderr.
    pub progress: bool,
    /// Counters to bump as the run goes (a sampler reads them); None: a private one.
    pub meter: Option<std::sync::Arc<crate::bench::meter::Meter>>,
}

impl Default for FsmarkOpts {
    fn default() -> Self {
        FsmarkOpts {
            dirs: vec!["fsmark".into()],
            threads: 0,
            subdirs: 0,
            per_subdir: 0,
            secs_per_subdir: 180,
            files: 1000,
            size: 51200,
            io_size: 16384,
            loops: 1,
            keep: false,
            sync: SyncMethod::Fsync,
            async_depth: 64,
            final_sync: true,
            progress: false,
            meter: None,
        }
    }
}

pub const NAME_LEN: usize = 40;
pub const RAND_LEN: usize = 24;

/// One fs_mark table row and the device's figures over the loop.
#[derive(Clone, Debug, Serialize)]
pub struct FsmarkLoop {
    pub fsuse_pct: u32,
    /// Files written so far, all loops.
    pub count: u64,
    pub size: u64,
    pub files_per_sec: f64,
    pub app_overhead_us: u64,
    /// Files written in this loop.
    pub files: u64,
    pub wall_s: f64,
    pub cpu_s: f64,
    /// fsync calls (-S1) or asynchronous flushes (-S A).
    pub fsyncs: u64,
    /// Device figures over the loop; null when the device is unknown.
    pub write_ios: Option<u64>,
    pub write_iops: Option<f64>,
    pub write_mib_s: Option<f64>,
    pub avg_write_kib: Option<f64>,
    pub flushes: Option<u64>,
    /// Journal commits over the loop; null when the filesystem does not count them.
    pub journal_commits: Option<u64>,
}

/// The whole run's figures. Every count (fsyncs, device writes and flushes, journal
/// commits) and every rate made from one covers the same window, the one `wall_s`
/// times: the loops and the final sync, not the untimed unlinks between loops.
#[derive(Clone, Debug, Serialize)]
pub struct FsmarkTotals {
    pub files: u64,
    /// fs_mark's "Average Files/sec" (mean of the loops' figures).
    pub files_per_sec: f64,
    pub p50_files_per_sec: f64,
    /// Files over the whole run including the final sync.
    pub files_per_sec_incl_sync: f64,
    /// Wall time of the loops, of the final sync, and of both.
    pub loops_s: f64,
    pub sync_s: f64,
    pub wall_s: f64,
    pub cpu_s: f64,
    pub fsyncs: u64,
    pub write_ios: Option<u64>,
    pub write_iops: Option<f64>,
    pub write_mib_s: Option<f64>,
    pub avg_write_kib: Option<f64>,
    pub flushes: Option<u64>,
    pub journal_commits: Option<u64>,
    pub write_ios_per_1000_files: Option<f64>,
    pub flushes_per_file: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct FsmarkReport {
    pub tool: &'static str,
    pub target: String,
    pub threads: usize,
    pub sync: SyncMethod,
    /// How -S A flushes were done ("io_uring", "threads" or the filesystem's own).
    pub async_mechanism: Option<String>,
    pub loops: Vec<FsmarkLoop>,
    pub totals: FsmarkTotals,
    pub extra: serde_json::Value,
}

/// One thread's loop.
#[derive(Default)]
struct ThreadLoop {
    files: u64,
    loop_us: u64,
    ops_us: u64,
    fsyncs: u64,
}

/// Where the next file goes (fs_mark's setup_file_name state of one thread).
struct Namer {
    rng: rand_chacha::ChaCha8Rng,
    subdirs: u32,
    per_subdir: u32,
    secs_per_subdir: u64,
    current: u32,
    in_current: u32,
    start_sec: Option<u64>,
}

fn now_sec() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

impl Namer {
    fn new(o: &FsmarkOpts, thread: usize) -> Namer {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        // fs_mark seeds random() from the microseconds; the thread index keeps two
        // threads started in the same microsecond apart.
        let seed = now.as_nanos() as u64 ^ (thread as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        Namer {
            rng: rand_chacha::ChaCha8Rng::seed_from_u64(seed),
            subdirs: o.subdirs,
            per_subdir: o.per_subdir,
            secs_per_subdir: o.secs_per_subdir,
            // Short runs must not always land in the first subdirectories.
            current: if o.subdirs > 0 {
                (now.as_secs() % o.subdirs as u64) as u32
            } else {
                0
            },
            in_current: 0,
            start_sec: None,
        }
    }

    /// (subdirectory or "", file name) of the next file.
    fn next(&mut self) -> (String, String) {
        let sec = now_sec();
        let start = *self.start_sec.get_or_insert(sec);
        let sub = if self.subdirs == 0 {
            String::new()
        } else {
            if self.per_subdir > 0 {
                if self.in_current >= self.per_subdir {
                    self.current += 1;
                    self.in_current = 0;
                }
                self.current %= self.subdirs;
                self.in_current += 1;
            } else if sec - start > self.secs_per_subdir {
                self.current = (self.current + 1) % self.subdirs;
                self.start_sec = Some(sec);
            }
            format!("{:02x}", self.current)
        };
        (sub, file_name(sec, &mut self.rng))
    }
}

/// fs_mark's 40-byte name: the low 16 hex digits of the time (padded with '~'), then 24
/// random upper-case letters and digits.
pub fn file_name(sec: u64, rng: &mut impl Rng) -> String {
    const SEQ: usize = NAME_LEN - RAND_LEN;
    const CHARS: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ";
    let hex = format!("{sec:x}");
    let mut s = String::with_capacity(NAME_LEN);
    if hex.len() > SEQ {
        s.push_str(&hex[hex.len() - SEQ..]);
    } else {
        s.push_str(&hex);
        s.extend(std::iter::repeat_n('~', SEQ - hex.len()));
    }
    for _ in 0..RAND_LEN {
        s.push(CHARS[rng.gen_range(0..CHARS.len())] as char);
    }
    s
}

fn join(a: &str, b: &str) -> String {
    match (a.is_empty(), b.is_empty()) {
        (true, _) => b.to_string(),
        (_, true) => a.to_string(),
        _ => format!("{a}/{b}"),
    }
}

fn us(d: Duration) -> u64 {
    d.as_micros() as u64
}

fn validate(o: &FsmarkOpts) -> Result<usize, String> {
    if o.dirs.is_empty() {
        return Err("fsmark: give at least one directory with -d".into());
    }
    if o.subdirs == 1 {
        return Err("fsmark: -D (subdirectories) must be at least 2".into());
    }
    if o.per_subdir > 0 && o.subdirs == 0 {
        return Err("fsmark: -N (files per subdirectory) needs -D".into());
    }
    if o.files == 0 {
        return Err("fsmark: -n (files per loop) must be at least 1".into());
    }
    if o.loops == 0 {
        return Err("fsmark: -L (loops) must be at least 1".into());
    }
    if o.io_size == 0 {
        return Err("fsmark: -w (bytes per write) must be at least 1".into());
    }
    if o.async_depth == 0 {
        return Err("fsmark: --async-depth must be at least 1".into());
    }
    let n = o.dirs.len();
    let threads = if o.threads == 0 { n } else { o.threads };
    if threads < n || threads % n != 0 {
        return Err(format!(
            "fsmark: threads ({threads}) must be a multiple of the number of directories ({n})"
        ));
    }
    Ok(threads)
}

/// fs_mark's header lines (after the command line, which the caller prints).
pub fn header(o: &FsmarkOpts, threads: usize) -> Vec<String> {
    let mut v = vec![format!("#\tVersion 3.3 (wbstack), {threads} thread(s)")];
    v.push(format!("#\tSync method: {}", o.sync.describe()));
    if o.subdirs > 1 {
        if o.per_subdir > 0 {
            v.push(format!(
                "#\tDirectories:  Round Robin between directories across {} subdirectories with {} files per subdirectory.",
                o.subdirs, o.per_subdir
            ));
        } else {
            v.push(format!(
                "#\tDirectories:  Time based hash between directories across {} subdirectories with {} seconds per subdirectory.",
                o.subdirs, o.secs_per_subdir
            ));
        }
    } else {
        v.push("#\tDirectories:  no subdirectories used".into());
    }
    v.push(format!(
        "#\tFile names: {NAME_LEN} bytes long, ({} initial bytes of time stamp with {RAND_LEN} random bytes at end of name)",
        NAME_LEN - RAND_LEN
    ));
    v.push(format!(
        "#\tFiles info: size {} bytes, written with an IO size of {} bytes per write",
        o.size, o.io_size
    ));
    v.push(
        "#\tApp overhead is time in microseconds spent in the test not doing file writing related system calls."
            .into(),
    );
    v.push(String::new());
    v.push(format!(
        "{:>6} {:>12} {:>12} {:>12} {:>16} {:>10} {:>9} {:>9} {:>9}",
        "FSUse%",
        "Count",
        "Size",
        "Files/sec",
        "App Overhead",
        "WriteIOs",
        "IOPS",
        "MiB/s",
        "KiB/IO"
    ));
    v
}

fn opt_u(v: Option<u64>) -> String {
    v.map_or("-".into(), |x| x.to_string())
}
fn opt_f(v: Option<f64>, prec: usize) -> String {
    v.map_or("-".into(), |x| format!("{x:.prec$}"))
}

/// One table row: fs_mark's five columns, then the device's writes over the loop.
pub fn loop_line(l: &FsmarkLoop) -> String {
    format!(
        "{:>6} {:>12} {:>12} {:>12.1} {:>16} {:>10} {:>9} {:>9} {:>9}",
        l.fsuse_pct,
        l.count,
        l.size,
        l.files_per_sec,
        l.app_overhead_us,
        opt_u(l.write_ios),
        opt_f(l.write_iops, 0),
        opt_f(l.write_mib_s, 1),
        opt_f(l.avg_write_kib, 1)
    )
}

/// The closing lines.
pub fn summary_lines(r: &FsmarkReport) -> Vec<String> {
    let t = &r.totals;
    let mut v = vec![format!("Average Files/sec: {:>12.1}", t.files_per_sec)];
    v.push(format!("p50 Files/sec: {:.0}", t.p50_files_per_sec));
    v.push(format!(
        "Including final sync: {} files in {:.2}s ({:.2}s sync): {:.1} files/s; device writes: {} ({} per 1000 files, {} KiB avg, {} MiB/s), flushes: {}; CPU {:.2}s",
        t.files,
        t.wall_s,
        t.sync_s,
        t.files_per_sec_incl_sync,
        opt_u(t.write_ios),
        opt_f(t.write_ios_per_1000_files, 1),
        opt_f(t.avg_write_kib, 1),
        opt_f(t.write_mib_s, 1),
        opt_u(t.flushes),
        t.cpu_s
    ));
    v
}

/// Run fs_mark on `fs`. Nothing is printed but progress (if asked).
pub fn run(o: &FsmarkOpts, fs: Arc<dyn BenchFs>) -> Result<FsmarkReport, String> {
    run_with(o, fs, &mut |_| {})
}

/// As `run`, calling `on_loop` after every loop (to print the table as it goes).
pub fn run_with(
    o: &FsmarkOpts,
    fs: Arc<dyn BenchFs>,
    on_loop: &mut dyn FnMut(&FsmarkLoop),
) -> Result<FsmarkReport, String> {
    let threads = validate(o)?;
    let dirs: Vec<String> = o
        .dirs
        .iter()
        .map(|d| d.trim_matches('/').to_string())
        .collect();
    for d in &dirs {
        fs.mkdir_all(d).map_err(err("fsmark: mkdir"))?;
    }
    let (total, used) = fs.usage().map_err(err("fsmark: usage"))?;
    let per_loop_bytes = o.size * o.files * threads as u64;
    if total > 0 && total - used < per_loop_bytes {
        return Err(format!(
            "fsmark: insufficient free space on {} to create {} new files of {} bytes",
            fs.name(),
            o.files * threads as u64,
            o.size
        ));
    }
    let meter = o.meter.clone().unwrap_or_default();
    let done = &meter.ops;
    let target_files = o.files * threads as u64 * o.loops as u64;
    let _progress = {
        let meter = meter.clone();
        Progress::start(o.progress, Duration::from_secs(2), move || {
            format!("fsmark: {} of {} files", meter.ops(), target_files)
        })
    };
    // The totals cover the loops and the final sync, not the untimed unlinks between
    // loops (fs_mark leaves unlink time out of its figures too).
    let run_cpu0 = process_cpu();
    let mut run_disk = fs.disk_stats().map(|_| DiskStats::default());
    let mut run_commits = fs.journal_commits().map(|_| 0u64);
    let commits_between = |a: Option<u64>, b: Option<u64>| Some(b?.saturating_sub(a?));
    let mut loops_s = 0.0;
    let mut loops = Vec::new();
    let mut count = 0u64;
    let mut fsyncs_total = 0u64;
    // The last loop's files, deleted only after the final sync: deleted first, their
    // dirty pages die with them and the sync has nothing to write.
    let mut last_created = Vec::new();
    for loop_no in 0..o.loops {
        let disk0 = fs.disk_stats();
        let commits0 = fs.journal_commits();
        let cpu0 = process_cpu();
        let t0 = Instant::now();
        let results: Vec<Result<(ThreadLoop, Vec<String>), String>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads)
                .map(|i| {
                    let fs = fs.clone();
                    let dir = dirs[i % dirs.len()].clone();
                    // Named, as the library's own threads are, so a profile
                    // (perf report --sort comm) tells the workers from teardown.
                    std::thread::Builder::new()
                        .name(format!("fsmark-{i}"))
                        .spawn_scoped(s, move || thread_loop(o, &*fs, &dir, i, done))
                        .map_err(|e| format!("fsmark: cannot start a worker thread: {e}"))
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h?.join()
                        .unwrap_or_else(|_| Err("fsmark: a worker thread panicked".into()))
                })
                .collect()
        });
        let wall = t0.elapsed().as_secs_f64();
        loops_s += wall;
        let disk1 = fs.disk_stats();
        let loop_commits = commits_between(commits0, fs.journal_commits());
        if let (Some(acc), Some(a), Some(b)) = (run_disk.as_mut(), &disk1, &disk0) {
            add_stats(acc, &a.delta(b));
        }
        if let (Some(acc), Some(c)) = (run_commits.as_mut(), loop_commits) {
            *acc += c;
        }
        let cpu = process_cpu() - cpu0;
        let mut files_per_sec = 0.0;
        let mut overhead = 0u64;
        let mut files = 0u64;
        let mut fsyncs = 0u64;
        let mut created = Vec::new();
        for r in results {
            let (t, names) = r?;
            files += t.files;
            fsyncs += t.fsyncs;
            files_per_sec += t.files as f64 / (t.loop_us.max(1) as f64 / 1e6);
            overhead += t.loop_us.saturating_sub(t.ops_us);
            created.extend(names);
        }
        count += files;
        fsyncs_total += fsyncs;
        let dev = DeviceWrites::between(&disk0, &disk1, wall);
        let (total, used) = fs.usage().map_err(err("fsmark: usage"))?;
        let l = FsmarkLoop {
            fsuse_pct: if total == 0 {
                0
            } else {
                (used as f64 * 100.0 / total as f64) as u32
            },
            count,
            size: o.size,
            files_per_sec,
            app_overhead_us: overhead,
            files,
            wall_s: wall,
            cpu_s: (cpu.user + cpu.sys).as_secs_f64(),
            fsyncs,
            write_ios: dev.map(|d| d.write_ios),
            write_iops: dev.map(|d| d.write_iops),
            write_mib_s: dev.map(|d| d.write_mib_s),
            avg_write_kib: dev.map(|d| d.avg_write_kib),
            flushes: dev.map(|d| d.flushes),
            journal_commits: loop_commits,
        };
        on_loop(&l);
        loops.push(l);
        if !o.keep {
            if loop_no + 1 == o.loops {
                last_created = created;
            } else {
                for p in &created {
                    fs.unlink(p).map_err(err("fsmark: unlink"))?;
                }
            }
        }
    }
    let disk0 = fs.disk_stats();
    let commits0 = fs.journal_commits();
    let ts = Instant::now();
    if o.final_sync {
        fs.sync().map_err(err("fsmark: sync"))?;
    }
    let sync_s = ts.elapsed().as_secs_f64();
    let wall_s = loops_s + sync_s;
    if let (Some(acc), Some(a), Some(b)) = (run_disk.as_mut(), &fs.disk_stats(), &disk0) {
        add_stats(acc, &a.delta(b));
    }
    if let (Some(acc), Some(c)) = (
        run_commits.as_mut(),
        commits_between(commits0, fs.journal_commits()),
    ) {
        *acc += c;
    }
    let cpu = process_cpu() - run_cpu0;
    for p in &last_created {
        fs.unlink(p).map_err(err("fsmark: unlink"))?;
    }
    let dev = run_disk.map(|d| DeviceWrites::from_delta(&d, wall_s));
    let mut fps: Vec<f64> = loops.iter().map(|l| l.files_per_sec).collect();
    fps.sort_by(|a, b| b.total_cmp(a));
    let files = count;
    let totals = FsmarkTotals {
        files,
        files_per_sec: fps.iter().sum::<f64>() / fps.len() as f64,
        p50_files_per_sec: fps[fps.len() / 2],
        files_per_sec_incl_sync: files as f64 / wall_s.max(1e-9),
        loops_s,
        sync_s,
        wall_s,
        cpu_s: (cpu.user + cpu.sys).as_secs_f64(),
        fsyncs: fsyncs_total,
        write_ios: dev.map(|d| d.write_ios),
        write_iops: dev.map(|d| d.write_iops),
        write_mib_s: dev.map(|d| d.write_mib_s),
        avg_write_kib: dev.map(|d| d.avg_write_kib),
        flushes: dev.map(|d| d.flushes),
        journal_commits: run_commits,
        write_ios_per_1000_files: dev.map(|d| d.write_ios as f64 * 1000.0 / files as f64),
        flushes_per_file: dev.map(|d| d.flushes as f64 / files as f64),
    };
    Ok(FsmarkReport {
        tool: "fsmark",
        target: fs.name(),
        threads,
        sync: o.sync,
        async_mechanism: (o.sync == SyncMethod::Async)
            .then(|| crate::bench::benchfs::async_flush_mechanism().to_string()),
        loops,
        totals,
        extra: fs.extra_stats(),
    })
}

/// One thread's loop (fs_mark's do_run): returns its timing and the paths it created.
fn thread_loop(
    o: &FsmarkOpts,
    fs: &dyn BenchFs,
    dir: &str,
    idx: usize,
    done: &AtomicU64,
) -> Result<(ThreadLoop, Vec<String>), String> {
    let buf = vec![0u8; o.io_size.min(o.size.max(1) as usize)];
    let mut namer = Namer::new(o, idx);
    let mut t = ThreadLoop::default();
    let mut names = Vec::with_capacity(if o.keep { 0 } else { o.files as usize });
    let mut inflight: VecDeque<Box<dyn FlushWait>> = VecDeque::new();
    let reap = |w: Box<dyn FlushWait>, ops: &mut u64| -> Result<(), String> {
        let s = Instant::now();
        w.wait().map_err(err("fsmark: async flush"))?;
        *ops += us(s.elapsed());
        Ok(())
    };
    let start = Instant::now();
    for _ in 0..o.files {
        let (sub, name) = namer.next();
        let target_dir = join(dir, &sub);
        // fs_mark makes the subdirectory before every file (EEXIST ignored), untimed.
        if !sub.is_empty() {
            fs.mkdir_all(&target_dir).map_err(err("fsmark: mkdir"))?;
        }
        let path = join(&target_dir, &name);

        let s = Instant::now();
        let mut f: Box<dyn BenchFile> = fs.create(&path).map_err(err("fsmark: create"))?;
        t.ops_us += us(s.elapsed());

        let mut off = 0u64;
        while off < o.size {
            let n = (o.size - off).min(buf.len() as u64) as usize;
            let s = Instant::now();
            f.write_at(off, &buf[..n]).map_err(err("fsmark: write"))?;
            t.ops_us += us(s.elapsed());
            off += n as u64;
        }

        match o.sync {
            SyncMethod::None => {}
            SyncMethod::Fsync => {
                let s = Instant::now();
                f.fsync().map_err(err("fsmark: fsync"))?;
                t.ops_us += us(s.elapsed());
                t.fsyncs += 1;
            }
            SyncMethod::Async => {
                let s = Instant::now();
                let w = f.start_flush().map_err(err("fsmark: async flush"))?;
                t.ops_us += us(s.elapsed());
                t.fsyncs += 1;
                inflight.push_back(w);
                if inflight.len() > o.async_depth {
                    let w = inflight.pop_front().expect("non-empty");
                    reap(w, &mut t.ops_us)?;
                }
            }
        }

        let s = Instant::now();
        f.close().map_err(err("fsmark: close"))?;
        t.ops_us += us(s.elapsed());
        t.files += 1;
        done.fetch_add(1, Ordering::Relaxed);
        if !o.keep {
            names.push(path);
        }
    }
    // The loop is not over until every flush it started has completed.
    while let Some(w) = inflight.pop_front() {
        reap(w, &mut t.ops_us)?;
    }
    t.loop_us = us(start.elapsed());
    Ok((t, names))
}
