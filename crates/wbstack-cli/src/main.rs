//! The `wbstack` command line.

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use wbstack::block::IoStatsMode;
use wbstack_cli::admin;
use wbstack_cli::bench::benchfs::{self, BenchFs};
use wbstack_cli::bench::blkbench::{self, BlkJob, Rw};

/// mimalloc, not glibc's malloc: a million-file run allocates and frees small objects
/// (inodes, entries, tree leaves) from several threads, and glibc's heap shrank and
/// grew under it (its page faults and sysmalloc were a tenth of the CPU at three million
/// files).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
use wbstack_cli::bench::fsmark::{self, FsmarkOpts, SyncMethod};
use wbstack_cli::lab::{self, LabOpts};

use wbstack_cli::bench::readlat::{self, ReadlatOpts};
use wbstack_cli::bench::tardd::{self, TarSource, TarddOpts};
use wbstack_cli::util::{duration_arg, size_arg};

#[derive(Parser)]
#[command(
    name = "wbstack",
    version,
    about = "The Linux writeback stack, rebuilt in userspace"
)]
struct Cli {
    /// Record the trace events (wbt_stat, wbt_lat, wbt_step, writeback_*, ...) and write
    /// them to this file as JSON lines when the command ends; the newest 1,000,000 are
    /// kept.
    #[arg(long, global = true, value_name = "FILE")]
    trace: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the seed experiments (all of them, quick, when none is named).
    Lab(LabArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Make a filesystem on an image (a file path or device spec).
    Mkfs(MkfsArgs),
    /// Check a filesystem image; exit 0 clean, 4 problems found, 8 not checkable.
    Fsck(ImageArgs),
    /// Mount an image (replaying its journal), print its usage, unmount.
    Info(ImageArgs),
    /// Cut the power of a simulated device under a mixed workload, again and again, and
    /// check that every fsync's promise survived, nothing is garbage and fsck is clean.
    Crashtest(CrashtestArgs),
    /// Mount an image (or a device spec: sim:ssd is an in-memory volume) on a
    /// directory through FUSE; in the background unless --foreground.
    Mount(MountCliArgs),
    /// Unmount a wbstack mount and wait for its final writeback and checkpoint.
    Umount(UmountArgs),
    /// Read or set a mounted volume's run-time knobs (no knob: list them all).
    Ctl(CtlArgs),
    /// syncfs of a mounted volume: write every dirty page back, commit the journal,
    /// flush the device (sync(1) does not reach a FUSE daemon).
    Sync(SyncArgs),
    /// iostat -x for a mounted volume, a line per interval.
    Iostat(IostatArgs),
    /// Mixed load with self-checking contents for a long time: no wrong read, no
    /// stall, memory bounded (a directory, e.g. a wbstack mount, or a device spec).
    Soak(SoakArgs),
}

#[derive(Args)]
struct SoakArgs {
    /// A directory (a wbstack mount or any filesystem) or a device spec.
    target: String,
    #[arg(long, default_value_t = 16)]
    threads: usize,
    #[arg(long, default_value = "10m", value_parser = duration_arg)]
    duration: Duration,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// An operation longer than this fails the run, naming it.
    #[arg(long, default_value = "30s", value_parser = duration_arg)]
    stall: Duration,
    /// Memory allowed above the page cache's size.
    #[arg(long, default_value = "512M", value_parser = size_arg)]
    rss_slack: u64,
    /// Mount options for a device spec.
    #[arg(short = 'o', default_value = "")]
    options: String,
    /// Seconds between progress lines.
    #[arg(long, default_value = "10", value_parser = duration_arg)]
    interval: Duration,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct MountCliArgs {
    /// An image made by `wbstack mkfs` (a path), or a device spec.
    source: String,
    /// Where to mount it.
    dir: PathBuf,
    /// Mount options: every -o of the bench tools (cache_size, dirty_ratio,
    /// wbt_lat_usec, flush_on_close, ...) and allow_other, default_permissions, ro,
    /// threads=N.
    #[arg(short = 'o', value_name = "OPTS")]
    options: Vec<String>,
    /// Stay attached (^C unmounts).
    #[arg(long)]
    foreground: bool,
    /// Where a background daemon writes its messages (default: nowhere).
    #[arg(long, value_name = "FILE")]
    log: Option<PathBuf>,
}

#[derive(Args)]
struct UmountArgs {
    dir: PathBuf,
}

#[derive(Args)]
struct CtlArgs {
    /// The mount point.
    dir: PathBuf,
    /// knob (read it) or knob=value (set it).
    knob: Option<String>,
}

#[derive(Args)]
struct SyncArgs {
    /// The mount point.
    dir: PathBuf,
}

#[derive(Args)]
struct IostatArgs {
    /// The mount point.
    dir: PathBuf,
    /// Seconds between lines.
    #[arg(default_value = "1", value_parser = duration_arg)]
    interval: Duration,
    /// Lines to print (default: until interrupted).
    #[arg(long)]
    count: Option<u64>,
    /// One JSON object per line.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct CrashtestArgs {
    /// A simulated device: sim:ssd or sim:hdd[,options] (size defaults to 64M; crashtest
    /// sets seed and the cut itself).
    #[arg(long, default_value = "sim:ssd")]
    device: String,
    /// Power cuts, each on a fresh filesystem.
    #[arg(long, default_value_t = 20)]
    cuts: u64,
    /// Seed of the first cut; cut i uses SEED+i, so --seed S --cuts 1 replays cut S.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Workload operations per cut, all threads together (about 2,300 fill the journal
    /// of a 64M device, so a checkpoint happens).
    #[arg(long, default_value_t = 3000)]
    ops: u64,
    /// Workload threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// What an acknowledged fsync covers of the namespace: inode (the file's own changes
    /// and their transactions: the contract, as ext4's) or global (every operation done
    /// before it: stronger than promised, for study).
    #[arg(long, default_value = "inode", value_parser = wbstack_cli::crashtest::FsyncRule::parse)]
    fsync_rule: wbstack_cli::crashtest::FsyncRule,
    /// Mount options (name=value,...) on top of crashtest's short intervals and its
    /// journal_data_kb=64 (0 for ordered data only); with --states only journal_data_kb
    /// applies (default 0 there).
    #[arg(short = 'o', long = "options", default_value = "")]
    options: String,
    /// Journal commit interval in milliseconds.
    #[arg(long, default_value_t = 20)]
    commit_ms: u64,
    /// Cuts run at once: a simulated disk's cuts mostly wait on its clock, so a run on
    /// sim:hdd goes about this many times faster (a cut's own threads are unchanged).
    #[arg(long, default_value_t = 1)]
    jobs: usize,
    /// Where a failing cut writes its replay file (crash-seed-SEED.replay).
    #[arg(long, default_value = ".")]
    save_dir: std::path::PathBuf,
    /// Rebuild the crash state a replay file holds and check it again (the other
    /// options are ignored: the file has them).
    #[arg(long, value_name = "FILE")]
    replay: Option<std::path::PathBuf>,
    /// Instead of power cuts during a random workload: every crash state of the write
    /// logs of short workloads from the kernel's crash-consistency bug reports
    /// (CrashMonkey's method; --workload picks some, --seed seeds the sampling).
    #[arg(long)]
    states: bool,
    /// With --states: a workload to run (repeatable; default all): rename-over,
    /// replace, link-unlink, truncate-write, fsync-dir, fdatasync-extend, fallocate-keep-size,
    /// punch-hole, mount-ops, random.
    #[arg(long, requires = "states")]
    workload: Vec<String>,
    /// With --states: windows of at most this many writes are checked in every subset.
    #[arg(long, default_value_t = 8, requires = "states")]
    exhaustive_up_to: usize,
    /// With --states: random subsets checked per larger window.
    #[arg(long, default_value_t = 32, requires = "states")]
    samples: usize,
    /// With --states: torn versions of each multi-sector write.
    #[arg(long, default_value_t = 2, requires = "states")]
    torn: usize,
    /// With --states: how many seeds of the random workload run.
    #[arg(long, default_value_t = 24, requires = "states")]
    random_seeds: u64,
    /// For testing crashtest itself: the device drops PREFLUSH, so commits no longer
    /// make earlier data durable and cuts must fail.
    #[arg(long, hide = true)]
    unsafe_drop_preflush: bool,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct MkfsArgs {
    /// A file path (created sparse with --size) or a device spec.
    image: String,
    /// Size of the image file to create or extend (e.g. 4G, 100T).
    #[arg(long, value_parser = size_arg)]
    size: Option<u64>,
    /// Format version: 6 (the default: the metadata as a copy-on-write B+tree, whose
    /// checkpoints write what changed in the background, whose mount reads only what it
    /// needs, and whose inodes stay in memory only while in use), 5 (the same but for
    /// the journal ring; 6 after its first mount) or 3 (whole-metadata checkpoints).
    #[arg(long, value_parser = parse_format)]
    format: Option<u32>,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ImageArgs {
    /// A file path or device spec.
    image: String,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct LabArgs {
    /// Experiments to run: plug (seed 000), expire (001), inflight (002), wbt (003),
    /// fsync (004), dirty (dirty throttling). Without one, every experiment runs with
    /// --quick.
    experiments: Vec<String>,
    /// Small sizes and short runs.
    #[arg(long)]
    quick: bool,
    /// Near the seeds' own scale (minutes to tens of minutes; the plan is printed first).
    #[arg(long, conflicts_with = "quick")]
    full: bool,
    /// Print one JSON object per experiment.
    #[arg(long)]
    json: bool,
    /// Repetitions of each arm, interleaved (median reported); the inflight
    /// experiment's (the others run each arm once).
    #[arg(long, value_parser = at_least_one)]
    rounds: Option<usize>,
    /// Run time of each arm, e.g. 3 or 500ms; the inflight experiment's (the others
    /// size their runs by work, not time).
    #[arg(long, value_parser = duration_arg)]
    runtime: Option<Duration>,
    /// Write a report: DIR/index.html (plots inline), DIR/*.json, DIR/run.json.
    #[arg(long, value_name = "DIR")]
    report: Option<PathBuf>,
    /// Add arms on a kernel filesystem on a loop device on this disk (and wbstack on a
    /// file: device and through the mount beside it): ext4, xfs or both.
    #[arg(long, value_name = "ext4|xfs|both")]
    kernel: Option<String>,
    /// Run a report's experiments again (DIR/run.json) and write a second report beside
    /// the first, with the differences.
    #[arg(long, value_name = "RUN_JSON", conflicts_with_all = ["experiments", "quick", "full", "report", "kernel"])]
    replay: Option<PathBuf>,
}

#[derive(Subcommand)]
enum BenchCmd {
    /// fio-like load on the block layer of one device.
    Blk(BlkArgs),
    /// Many adjacent small files written back with writeback_plug on and off (test fs).
    Smallfiles(SmallfilesArgs),
    /// One buffered writer faster than the device: dirty throttling at work.
    Dirty(DirtyArgs),
    /// fs_mark: threads creating small files, per -S with fsync or async flush (seeds 000, 004).
    Fsmark(FsmarkArgs),
    /// tar -x of a source tree while dd streams a large file, then sync (seed 001).
    Tardd(TarddArgs),
    /// Sequential 4 KiB reads with a latency target, piped to a writer (seed 003).
    Readlat(ReadlatArgs),
}

/// Where a file-level workload runs: wbstack's filesystem and/or a kernel filesystem.
#[derive(Args)]
struct TargetArgs {
    /// wbstack's filesystem on this device spec (as `bench blk --device`).
    #[arg(long)]
    device: Option<String>,
    /// Mount options of the wbstack filesystem, name=value,... e.g.
    /// writeback_plug=0,expire_first=0,cache_size=512M,dirty_ratio=20,commit=5.
    #[arg(short = 'o', long = "mount-opts", default_value = "")]
    mount_opts: String,
    /// A directory on a kernel filesystem. With --device too, both run, one after the other.
    #[arg(long)]
    dir_path: Option<PathBuf>,
    /// One JSON object per target, one per line.
    #[arg(long)]
    json: bool,
}

impl TargetArgs {
    fn open(&self) -> Result<Vec<Arc<dyn BenchFs>>, String> {
        benchfs::open_targets_with(
            self.device.as_deref(),
            &self.mount_opts,
            self.dir_path.as_deref(),
        )
    }
}

#[derive(Args)]
struct FsmarkArgs {
    #[command(flatten)]
    target: TargetArgs,
    /// Directory inside the target, one thread each (repeat the flag for more).
    #[arg(short = 'd', value_name = "DIR", required = true)]
    dirs: Vec<String>,
    /// Threads: a multiple of the number of -d directories (default: one per directory).
    #[arg(short = 't', default_value_t = 0)]
    threads: usize,
    /// Subdirectories per directory (at least 2).
    #[arg(short = 'D', default_value_t = 0)]
    subdirs: u32,
    /// Files per subdirectory before the next one (round robin); default: time hash.
    #[arg(short = 'N', default_value_t = 0)]
    per_subdir: u32,
    /// Seconds per subdirectory of the time hash.
    #[arg(long, default_value_t = 180)]
    secs_per_subdir: u64,
    /// Files per thread per loop.
    #[arg(short = 'n', default_value_t = 1000)]
    files: u64,
    /// Bytes per file.
    #[arg(short = 's', default_value = "51200", value_parser = size_arg)]
    size: u64,
    /// Bytes per write call.
    #[arg(short = 'w', default_value = "16384", value_parser = size_arg)]
    io_size: u64,
    /// Loops (implies -k, as in fs_mark).
    #[arg(short = 'L')]
    loops: Option<u32>,
    /// Keep the files after each loop.
    #[arg(short = 'k')]
    keep: bool,
    /// Sync method: 0 none, 1 fsync before close, A asynchronous flush before close.
    #[arg(short = 'S', default_value = "1", value_parser = SyncMethod::parse)]
    sync: SyncMethod,
    /// -S A: flushes in flight per thread before the oldest is waited on.
    #[arg(long, default_value_t = 64)]
    async_depth: usize,
    /// Skip the final (timed) sync of the filesystem.
    #[arg(long)]
    no_final_sync: bool,
    /// End as a crash of the process would, without unmounting: the next mount of
    /// the image (`wbstack info IMG`) replays the journal, which measures recovery.
    /// Only for one wbstack target on a file or block device.
    #[arg(long)]
    crash: bool,
}

#[derive(Args)]
struct TarddArgs {
    #[command(flatten)]
    target: TargetArgs,
    /// An uncompressed tar file to extract (default: a synthetic source tree).
    #[arg(long)]
    tar: Option<PathBuf>,
    /// Files of the synthetic tree.
    #[arg(long, default_value_t = 20_000)]
    files: usize,
    /// Seed of the synthetic tree.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Bytes the dd writes (bs 1 MiB).
    #[arg(long, default_value = "2G", value_parser = size_arg)]
    dd_size: u64,
    /// Directory inside the target for the tree and the dd file.
    #[arg(long, default_value = "tardd")]
    dir: String,
}

#[derive(Args)]
struct ReadlatArgs {
    #[command(flatten)]
    on: TargetArgs,
    /// File to read, inside the target (default: write --size bytes first, then drop
    /// them from the cache).
    #[arg(long)]
    file: Option<String>,
    #[arg(long, default_value = "512M", value_parser = size_arg)]
    size: u64,
    /// Latency target of one read (a bare number is seconds).
    #[arg(long, default_value = "10ms", value_parser = duration_arg)]
    target: Duration,
    #[arg(long, default_value = "4k", value_parser = size_arg)]
    bs: u64,
    /// CPU hog threads running meanwhile.
    #[arg(long, default_value_t = 0)]
    hogs: usize,
    /// Memory the hogs hold between them.
    #[arg(long, default_value = "0", value_parser = size_arg)]
    hog_mem: u64,
    /// A concurrent buffered dd of this many bytes (bs 1 MiB): heavy writeback.
    #[arg(long, default_value = "0", value_parser = size_arg)]
    background_dd: u64,
    /// Bytes the dd writes before the reads start.
    #[arg(long, default_value = "0", value_parser = size_arg)]
    dd_lead: u64,
    /// Start the dd this long after the reads (e.g. 500ms), so heavy writeback begins
    /// while they run; not with --dd-lead.
    #[arg(long, default_value = "0", value_parser = duration_arg)]
    dd_delay: Duration,
    /// Reader threads at most.
    #[arg(long, default_value_t = 512)]
    max_readers: usize,
    /// "read latency=" lines printed, at most.
    #[arg(long, default_value_t = 20)]
    print_max: usize,
    /// Directory inside the target for the files of the run.
    #[arg(long, default_value = "readlat")]
    dir: String,
    /// Keep the files of the run.
    #[arg(long)]
    keep: bool,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(Args)]
struct SmallfilesArgs {
    #[arg(long, default_value = "sim:ssd")]
    device: String,
    #[arg(long, default_value_t = 10000)]
    files: u64,
    #[arg(long, default_value = "4k", value_parser = size_arg)]
    file_size: u64,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct DirtyArgs {
    /// The device; `data=meta` keeps the filesystem's metadata but not the file's data.
    #[arg(long, default_value = "sim:ssd,data=meta")]
    device: String,
    /// Bytes written in all.
    #[arg(long, default_value = "2G", value_parser = size_arg)]
    size: u64,
    #[arg(long, default_value = "1M", value_parser = size_arg)]
    bs: u64,
    /// Page cache size (the dirtyable memory the thresholds are fractions of).
    #[arg(long, default_value = "4G", value_parser = size_arg)]
    cache: u64,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct BlkArgs {
    /// Device spec: null, sim:ssd, sim:hdd, file:PATH (with ,key=value options).
    #[arg(long, default_value = "null")]
    device: String,
    #[arg(long, default_value_t = 1)]
    jobs: usize,
    #[arg(long, default_value = "randread", value_parser = Rw::parse)]
    rw: Rw,
    #[arg(long, default_value = "4k", value_parser = size_arg)]
    bs: u64,
    #[arg(long, default_value_t = 1)]
    iodepth: usize,
    /// Bios submitted together under one plug, as fio's iodepth_batch_submit (its
    /// default is 1 too): 1 submits each alone, 0 refills the whole free depth at once.
    #[arg(long, default_value_t = 1)]
    iodepth_batch: usize,
    /// Seconds (or a duration such as 500ms).
    #[arg(long, default_value = "5", value_parser = duration_arg)]
    runtime: Duration,
    #[arg(long, default_value = "tags", value_parser = IoStatsMode::parse)]
    iostats: IoStatsMode,
    /// Bytes of the device to range over (default: all of it).
    #[arg(long, value_parser = size_arg)]
    size: Option<u64>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where completions are reaped: `poll` (by the job thread, where the device
    /// supports it, as fio does) or `thread` (the device's completion thread).
    #[arg(long, default_value = "poll", value_parser = ["poll", "thread"])]
    reap: String,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Also run fio (io_uring, O_DIRECT) with the same job on the same file:PATH: the
    /// same rw, bs, iodepth, batch and jobs, each job over the same region.
    #[arg(long)]
    fio: bool,
    /// With --fio: run fio first. The side that runs second finds the file (and a
    /// disk's cache and wear) as the first left it, so a fair comparison alternates
    /// the order over rounds (scripts/vs-fio does).
    #[arg(long, requires = "fio")]
    fio_first: bool,
}

fn run_lab(a: LabArgs) -> Result<(), String> {
    use wbstack_cli::lab::run::{self as labrun, LabRequest};
    use wbstack_cli::progress::Sink;
    let sink = Sink::detect();
    if let Some(p) = &a.replay {
        return labrun::run(labrun::replay_request(p, sink, a.json)?);
    }
    let all = a.experiments.is_empty();
    let experiments = if all {
        lab::EXPERIMENTS.iter().map(|s| s.to_string()).collect()
    } else {
        a.experiments.clone()
    };
    labrun::run(LabRequest {
        experiments,
        opts: LabOpts {
            quick: (a.quick || all) && !a.full,
            full: a.full,
            json: a.json,
            rounds: a.rounds,
            runtime: a.runtime,
            sink,
        },
        kernel: match &a.kernel {
            Some(k) => lab::kernel::parse_kernel(k)?,
            None => Vec::new(),
        },
        report: a.report,
        replay_of: None,
    })
}

fn run_blk(a: BlkArgs) -> Result<(), String> {
    let job = BlkJob {
        device: a.device.clone(),
        jobs: a.jobs,
        rw: a.rw,
        bs: a.bs as usize,
        iodepth: a.iodepth,
        runtime: a.runtime,
        iostats: a.iostats,
        span: a.size,
        seed: a.seed,
        poll: a.reap == "poll",
        batch: a.iodepth_batch,
    };
    let fio_path = if a.fio {
        let spec = wbstack::dev::DeviceSpec::parse(&a.device).map_err(|e| e.to_string())?;
        Some(spec.path.ok_or("--fio needs a file:PATH device")?)
    } else {
        None
    };
    let run_fio = |layout: blkbench::Layout, path: &str| {
        wbstack_cli::bench::fio::run(&wbstack_cli::bench::fio::FioJob {
            path,
            rw: a.rw.name(),
            bs: a.bs as usize,
            iodepth: a.iodepth,
            batch: a.iodepth_batch,
            jobs: a.jobs,
            runtime_s: a.runtime.as_secs_f64(),
            layout,
        })
    };
    let (r, fio) = match &fio_path {
        None => (blkbench::run(&job)?, None),
        Some(p) if a.fio_first => {
            let f = run_fio(blkbench::layout(&job)?, p)?;
            (blkbench::run(&job)?, Some(f))
        }
        Some(p) => {
            let r = blkbench::run(&job)?;
            let f = run_fio(r.layout, p)?;
            (r, Some(f))
        }
    };
    let order = if a.fio_first {
        ["fio", "wbstack"]
    } else {
        ["wbstack", "fio"]
    };
    if a.json {
        let mut v = serde_json::to_value(&r).map_err(|e| e.to_string())?;
        if let Some(f) = &fio {
            v["fio"] = serde_json::to_value(f).map_err(|e| e.to_string())?;
            v["vs_fio"] = serde_json::json!(r.iops / f.iops.max(1.0));
            v["order"] = serde_json::json!(order);
        }
        println!("{v}");
    } else {
        blkbench::print_human(&r);
        if let Some(f) = &fio {
            println!("run order: {}, then {}", order[0], order[1]);
            println!(
                "fio (io_uring, direct, same job): IOPS={}, BW={:.1}MiB/s, p50={:.1}us p99={:.1}us, usr={:.1}% sys={:.1}%",
                wbstack_cli::util::si(f.iops),
                f.mib_s,
                f.lat_p50_us,
                f.lat_p99_us,
                f.usr_pct,
                f.sys_pct
            );
            println!(
                "wbstack / fio IOPS: {:.1}%",
                r.iops / f.iops.max(1.0) * 100.0
            );
        }
    }
    Ok(())
}

fn print_json(v: &impl serde::Serialize) -> Result<(), String> {
    println!("{}", serde_json::to_string(v).map_err(|e| e.to_string())?);
    Ok(())
}

/// Why `fsmark --crash` cannot run on these targets, if it cannot. The crash leaves the
/// image for the next process to mount and replay (`wbstack info IMG`), so the device
/// must outlive this process: a file or block device. Checked before the targets are
/// opened, which formats them.
fn crash_target_error(t: &TargetArgs) -> Option<String> {
    const NEED: &str =
        "fsmark: --crash needs one wbstack target on a file or block device (--device file:PATH, no --dir-path)";
    if t.dir_path.is_some() {
        return Some(format!(
            "{NEED}: a kernel filesystem cannot be left crashed by this process"
        ));
    }
    let Some(dev) = t.device.as_deref() else {
        return Some(NEED.into());
    };
    match wbstack::dev::spec_kind(dev) {
        Some("null") => Some(format!(
            "{NEED}: the null device keeps no data past this process (memory_backed=1 holds it in this process's memory), so there would be nothing to mount and replay"
        )),
        Some("sim") => Some(format!(
            "{NEED}: a simulated device's contents die with the process (`wbstack crashtest` cuts the power of one within the process)"
        )),
        // A file, or a spec that opening the targets refuses with its own reason.
        _ => None,
    }
}

fn run_fsmark(a: FsmarkArgs) -> Result<(), String> {
    if a.crash {
        if let Some(e) = crash_target_error(&a.target) {
            return Err(e);
        }
    }
    let targets = a.target.open()?;
    let o = FsmarkOpts {
        dirs: a.dirs.clone(),
        threads: a.threads,
        subdirs: a.subdirs,
        per_subdir: a.per_subdir,
        secs_per_subdir: a.secs_per_subdir,
        files: a.files,
        size: a.size,
        io_size: usize::try_from(a.io_size).map_err(|_| "-w is too large".to_string())?,
        loops: a.loops.unwrap_or(1),
        keep: a.keep || a.loops.is_some(),
        sync: a.sync,
        async_depth: a.async_depth,
        final_sync: !a.no_final_sync,
        progress: !a.target.json,
        meter: None,
    };
    let json = a.target.json;
    for fs in targets {
        if !json {
            let threads = if o.threads == 0 {
                o.dirs.len()
            } else {
                o.threads
            };
            println!();
            println!("#  {}", std::env::args().collect::<Vec<_>>().join(" "));
            println!("#\tTarget: {}", fs.name());
            for l in fsmark::header(&o, threads) {
                println!("{l}");
            }
        }
        let r = fsmark::run_with(&o, fs.clone(), &mut |l| {
            if !json {
                wbstack_cli::progress::println(&fsmark::loop_line(l));
            }
        })?;
        if json {
            print_json(&r)?;
        } else {
            for l in fsmark::summary_lines(&r) {
                println!("{l}");
            }
        }
        if a.crash {
            use std::io::Write;
            std::io::stdout().flush().map_err(|e| e.to_string())?;
            // No unmount, no drop: the journal's committed transactions are on the
            // device and the running one is lost, as in a crash.
            std::mem::forget(fs);
            std::process::exit(0);
        }
    }
    Ok(())
}

fn run_tardd(a: TarddArgs) -> Result<(), String> {
    let targets = a.target.open()?;
    let o = TarddOpts {
        source: match &a.tar {
            Some(p) => TarSource::File(p.clone()),
            None => TarSource::Synthetic {
                files: a.files,
                seed: a.seed,
            },
        },
        dd_size: a.dd_size,
        dd_bs: 1 << 20,
        dir: a.dir.clone(),
        progress: !a.target.json,
        meter: None,
    };
    for fs in targets {
        let r = tardd::run(&o, fs)?;
        if a.target.json {
            print_json(&r)?;
        } else {
            println!("== tardd on {}", r.target);
            for l in tardd::human_lines(&r) {
                println!("{l}");
            }
        }
    }
    Ok(())
}

fn run_readlat(a: ReadlatArgs) -> Result<(), String> {
    let targets = a.on.open()?;
    let o = ReadlatOpts {
        file: a.file.clone(),
        size: a.size,
        bs: usize::try_from(a.bs).map_err(|_| "--bs is too large".to_string())?,
        target: a.target,
        hogs: a.hogs,
        hog_mem: a.hog_mem,
        background_dd: a.background_dd,
        dd_lead: a.dd_lead,
        dd_delay: a.dd_delay,
        max_readers: a.max_readers,
        print_max: a.print_max,
        dir: a.dir.clone(),
        keep: a.keep,
        seed: a.seed,
        progress: !a.on.json,
        meter: None,
    };
    for fs in targets {
        let name = fs.name();
        if !a.on.json {
            println!("== readlat on {name}");
        }
        let r = readlat::run(&o, fs)?;
        if a.on.json {
            print_json(&r)?;
        } else {
            let late = r.figures.read_over + r.write.over;
            if late as usize > o.print_max {
                eprintln!(
                    "[... {} more late reads/writes not printed]",
                    late as usize - o.print_max
                );
            }
            for l in readlat::human_lines(&r) {
                println!("{l}");
            }
            if let Some(d) = &r.dd {
                println!(
                    "background dd: {} MiB in {:.2}s ({:.1} MiB/s), on the device {:.2}s after it began ({:.1} MiB/s)",
                    d.bytes >> 20,
                    d.secs,
                    d.mib_s,
                    d.durable_s,
                    d.durable_mib_s
                );
            }
            if let Some(d) = &r.device {
                println!(
                    "device: {} reads, {} writes ({:.1} KiB avg, {:.1} MiB/s while reading), {} flushes; reader threads {}",
                    d.read_ios, d.write_ios, d.avg_write_kib, d.write_mib_s, d.flushes, r.reader_threads
                );
            }
        }
    }
    Ok(())
}

/// A format mkfs writes: 3, 5 or 6 (4 was the tree before mount read it on demand; 5
/// is 6 without the journal ring, and becomes 6 at its first mount).
fn parse_format(s: &str) -> Result<u32, String> {
    match s.trim() {
        "3" => Ok(3),
        "5" => Ok(5),
        "6" => Ok(6),
        _ => Err(format!("{s:?}: mkfs writes format 3, 5 or 6")),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if cli.trace.is_some() {
        wbstack::trace::enable(1_000_000);
    }
    let code = run(cli.cmd);
    if let Some(path) = cli.trace {
        if let Err(e) = std::fs::write(&path, wbstack::trace::dump_jsonl()) {
            eprintln!("wbstack: writing the trace to {}: {e}", path.display());
            return ExitCode::from(2);
        }
    }
    code
}

fn run(cmd: Cmd) -> ExitCode {
    let res = match cmd {
        Cmd::Mkfs(a) => admin::mkfs(&a.image, a.size, a.format).and_then(|r| {
            if a.json {
                println!("{}", serde_json::to_string(&r).map_err(|e| e.to_string())?);
            } else {
                admin::print_mkfs(&r);
            }
            Ok(())
        }),
        Cmd::Fsck(a) => match admin::check(&a.image) {
            Ok((r, code)) => {
                if a.json {
                    println!("{}", serde_json::to_string(&r).unwrap_or_default());
                } else {
                    admin::print_fsck(&a.image, &r);
                }
                return ExitCode::from(code);
            }
            Err(e) => {
                eprintln!("wbstack fsck: {e}");
                return ExitCode::from(admin::FSCK_NOT_CHECKED);
            }
        },
        Cmd::Info(a) => admin::info(&a.image).and_then(|r| {
            if a.json {
                println!("{}", serde_json::to_string(&r).map_err(|e| e.to_string())?);
            } else {
                admin::print_info(&r);
            }
            Ok(())
        }),
        Cmd::Crashtest(a) => {
            if let Some(file) = &a.replay {
                return match wbstack_cli::crashtest::replay_cli(file, a.json) {
                    Ok(code) => ExitCode::from(code),
                    Err(e) => {
                        eprintln!("wbstack crashtest: {e}");
                        ExitCode::from(2)
                    }
                };
            }
            if a.states {
                if a.exhaustive_up_to > 20 {
                    eprintln!("wbstack crashtest: --exhaustive-up-to {}: at most 20 (2^20 states per window)", a.exhaustive_up_to);
                    return ExitCode::from(2);
                }
                let o = wbstack_cli::crashtest::StatesOpts {
                    workloads: a.workload,
                    seed: a.seed,
                    exhaustive_up_to: a.exhaustive_up_to,
                    samples: a.samples,
                    torn: a.torn,
                    random_seeds: a.random_seeds,
                    rule: a.fsync_rule,
                    save_dir: Some(a.save_dir),
                    progress: !a.json,
                    drop_preflush: a.unsafe_drop_preflush,
                    journal_data_kb: {
                        // Only journal_data_kb of -o changes what --states records.
                        let mut m = wbstack::fs::MountOptions::default();
                        if let Err(e) = m.parse(&a.options) {
                            eprintln!("wbstack crashtest: -o: {e}");
                            return ExitCode::from(2);
                        }
                        m.journal_data_kb
                    },
                };
                return match wbstack_cli::crashtest::states_cli(&o, a.json) {
                    Ok(code) => ExitCode::from(code),
                    Err(e) => {
                        eprintln!("wbstack crashtest: {e}");
                        ExitCode::from(2)
                    }
                };
            }
            let o = wbstack_cli::crashtest::CrashOpts {
                device: a.device,
                cuts: a.cuts,
                seed: a.seed,
                ops: a.ops,
                threads: a.threads,
                rule: a.fsync_rule,
                mount_opts: a.options,
                commit_ms: a.commit_ms,
                jobs: a.jobs,
                progress: true,
                save_dir: Some(a.save_dir),
                drop_preflush: a.unsafe_drop_preflush,
            };
            match wbstack_cli::crashtest::cli(&o, a.json) {
                Ok(code) => return ExitCode::from(code),
                Err(e) => Err(e),
            }
        }
        Cmd::Mount(a) => wbstack_cli::mount::mount(&wbstack_cli::mount::MountArgs {
            source: a.source,
            dir: a.dir,
            options: a.options,
            foreground: a.foreground,
            log: a.log,
        })
        .map_err(|e| format!("mount: {e}")),
        Cmd::Umount(a) => wbstack_cli::mount::umount(&a.dir).map_err(|e| format!("umount: {e}")),
        Cmd::Ctl(a) => {
            wbstack_cli::mount::ctl::ctl(&a.dir, a.knob.as_deref()).map(|s| print!("{s}"))
        }
        Cmd::Sync(a) => wbstack_cli::mount::ctl::sync(&a.dir).map_err(|e| format!("sync: {e}")),
        Cmd::Iostat(a) => wbstack_cli::mount::iostat::run(&a.dir, a.interval, a.count, a.json),
        Cmd::Soak(a) => {
            let o = wbstack_cli::soak::SoakOpts {
                target: a.target,
                threads: a.threads.max(1),
                duration: a.duration,
                seed: a.seed,
                stall: a.stall,
                rss_slack_bytes: a.rss_slack,
                mount_opts: a.options,
                interval: a.interval,
                ..Default::default()
            };
            match wbstack_cli::soak::run(&o) {
                Ok(r) => {
                    if a.json {
                        println!("{}", serde_json::to_string(&r).unwrap_or_default());
                    } else {
                        wbstack_cli::soak::print(&r);
                    }
                    let ok = r.failures.is_empty() && r.check_problems.is_empty();
                    return if ok {
                        ExitCode::SUCCESS
                    } else {
                        ExitCode::from(1)
                    };
                }
                Err(e) => Err(e),
            }
        }
        Cmd::Lab(a) => run_lab(a),
        Cmd::Bench(BenchCmd::Blk(a)) => run_blk(a),
        Cmd::Bench(BenchCmd::Smallfiles(a)) => {
            wbstack_cli::bench::wbbench::smallfiles(&a.device, a.files, a.file_size).map(|arms| {
                if a.json {
                    let v = serde_json::json!({"experiment": "smallfiles", "arms": arms});
                    println!("{v}");
                } else {
                    wbstack_cli::bench::wbbench::print_smallfiles(&arms);
                }
            })
        }
        Cmd::Bench(BenchCmd::Fsmark(a)) => run_fsmark(a),
        Cmd::Bench(BenchCmd::Tardd(a)) => run_tardd(a),
        Cmd::Bench(BenchCmd::Readlat(a)) => run_readlat(a),
        Cmd::Bench(BenchCmd::Dirty(a)) => {
            wbstack_cli::bench::wbbench::dirty(&a.device, a.size, a.bs, a.cache).and_then(|r| {
                if a.json {
                    println!("{}", serde_json::to_string(&r).map_err(|e| e.to_string())?);
                } else {
                    wbstack_cli::bench::wbbench::print_dirty(&r);
                }
                Ok(())
            })
        }
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("wbstack: {e}");
            ExitCode::from(2)
        }
    }
}

/// A count of one or more (`--rounds 0` would leave nothing to take a median of).
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}
