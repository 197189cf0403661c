//! The `wbstack` command line.

use clap::{Args, Parser, Subcommand};
use std::process::ExitCode;
use std::time::Duration;
use wbstack::block::IoStatsMode;
use wbstack_cli::blkbench::{self, BlkJob, Rw};
use wbstack_cli::lab::{self, LabOpts};
use wbstack_cli::util::{duration_arg, size_arg};

#[derive(Parser)]
#[command(
    name = "wbstack",
    version,
    about = "The Linux writeback stack, rebuilt in userspace"
)]
struct Cli {
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
}

#[derive(Args)]
struct LabArgs {
    /// Experiment to run: inflight. Without one, every experiment runs with --quick.
    experiment: Option<String>,
    /// Small sizes and short runs.
    #[arg(long)]
    quick: bool,
    /// Print one JSON object per experiment.
    #[arg(long)]
    json: bool,
    /// Repetitions of each arm, interleaved (median reported).
    #[arg(long)]
    rounds: Option<usize>,
    /// Run time of each arm, e.g. 3 or 500ms.
    #[arg(long, value_parser = duration_arg)]
    runtime: Option<Duration>,
}

#[derive(Subcommand)]
enum BenchCmd {
    /// fio-like load on the block layer of one device.
    Blk(BlkArgs),
    /// Many adjacent small files written back with writeback_plug on and off (test fs).
    Smallfiles(SmallfilesArgs),
    /// One buffered writer faster than the device: dirty throttling at work (test fs).
    Dirty(DirtyArgs),
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
    #[arg(long, default_value = "sim:ssd,data=0")]
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
    /// Also run fio (io_uring, O_DIRECT) with the same job on the same file:PATH.
    #[arg(long)]
    fio: bool,
}

fn run_lab(a: LabArgs) -> Result<(), String> {
    let names: Vec<String> = match &a.experiment {
        Some(e) => vec![e.clone()],
        None => lab::EXPERIMENTS.iter().map(|s| s.to_string()).collect(),
    };
    let opts = LabOpts {
        quick: a.quick || a.experiment.is_none(),
        json: a.json,
        rounds: a.rounds,
        runtime: a.runtime,
    };
    for name in names {
        match name.as_str() {
            "inflight" => {
                let e = lab::inflight(&opts)?;
                if a.json {
                    println!("{}", serde_json::to_string(&e).map_err(|e| e.to_string())?);
                } else {
                    lab::print_inflight(&e);
                }
            }
            other => {
                return Err(format!(
                    "unknown experiment '{other}' (known: {})",
                    lab::EXPERIMENTS.join(", ")
                ));
            }
        }
    }
    Ok(())
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
    };
    let fio_path = if a.fio {
        let spec = wbstack::dev::DeviceSpec::parse(&a.device).map_err(|e| e.to_string())?;
        Some(spec.path.ok_or("--fio needs a file:PATH device")?)
    } else {
        None
    };
    let r = blkbench::run(&job)?;
    let fio = match &fio_path {
        Some(p) => {
            let span = a
                .size
                .unwrap_or_else(|| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0));
            Some(wbstack_cli::fio::run(
                p,
                a.rw.name(),
                a.bs as usize,
                a.iodepth,
                a.jobs,
                a.runtime.as_secs_f64(),
                span,
            )?)
        }
        None => None,
    };
    if a.json {
        let mut v = serde_json::to_value(&r).map_err(|e| e.to_string())?;
        if let Some(f) = &fio {
            v["fio"] = serde_json::to_value(f).map_err(|e| e.to_string())?;
            v["vs_fio"] = serde_json::json!(r.iops / f.iops.max(1.0));
        }
        println!("{v}");
    } else {
        blkbench::print_human(&r);
        if let Some(f) = &fio {
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let res = match cli.cmd {
        Cmd::Lab(a) => run_lab(a),
        Cmd::Bench(BenchCmd::Blk(a)) => run_blk(a),
        Cmd::Bench(BenchCmd::Smallfiles(a)) => {
            wbstack_cli::wbbench::smallfiles(&a.device, a.files, a.file_size).and_then(|arms| {
                if a.json {
                    let v = serde_json::json!({"experiment": "smallfiles", "arms": arms});
                    println!("{v}");
                } else {
                    wbstack_cli::wbbench::print_smallfiles(&arms);
                }
                Ok(())
            })
        }
        Cmd::Bench(BenchCmd::Dirty(a)) => {
            wbstack_cli::wbbench::dirty(&a.device, a.size, a.bs, a.cache).and_then(|r| {
                if a.json {
                    println!("{}", serde_json::to_string(&r).map_err(|e| e.to_string())?);
                } else {
                    wbstack_cli::wbbench::print_dirty(&r);
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
