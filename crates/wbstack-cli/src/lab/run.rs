//! The lab's driver: says up front what it will run and how long that takes, runs each
//! experiment (and its kernel arms), prints its table or JSON, and writes the report.

use crate::lab::kernel::{self, KernelFs};
use crate::lab::report::{self, Run, RunInfo, Section};
use crate::lab::{dirty, expire, fsync, inflight, plug, wbt, Experiment, LabOpts, EXPERIMENTS};
use crate::progress::human_secs;
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

pub struct LabRequest {
    pub experiments: Vec<String>,
    pub opts: LabOpts,
    pub kernel: Vec<KernelFs>,
    pub report: Option<PathBuf>,
    /// A replay: the first run, read back from its run.json.
    pub replay_of: Option<Run>,
}

/// Seconds an experiment takes on this kind of machine (2 CPUs), measured: for the plan
/// printed up front.
fn estimate_s(name: &str, o: &LabOpts) -> f64 {
    let (quick, default, full) = match name {
        "plug" => (3.0, 13.0, 50.0),
        "expire" => (20.0, 50.0, 65.0),
        "inflight" => (6.0, 56.0, 56.0),
        "wbt" => (31.0, 105.0, 380.0),
        "fsync" => (9.0, 50.0, 420.0),
        "dirty" => (11.0, 42.0, 170.0),
        _ => (0.0, 0.0, 0.0),
    };
    if o.full {
        full
    } else if o.quick {
        quick
    } else {
        default
    }
}

/// Memory the simulated devices and caches of an experiment need at most (the sim
/// devices keep written data in memory), in GiB.
fn memory_gib(name: &str, o: &LabOpts) -> f64 {
    match (name, o.full) {
        ("plug", true) => 5.0,
        ("fsync", true) => 6.0,
        ("expire", _) => 4.0,
        ("dirty", true) => 4.5,
        _ => 2.0,
    }
}

pub fn git_commit() -> String {
    option_env!("WBSTACK_GIT_COMMIT")
        .unwrap_or("unknown")
        .to_string()
}

pub fn kernel_version() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

fn section<A: Serialize>(
    e: Experiment<A>,
    table: fn(&Experiment<A>) -> String,
    meaning: fn(&Experiment<A>) -> String,
    json: bool,
) -> Result<Section, String> {
    let data = serde_json::to_value(&e).map_err(|x| x.to_string())?;
    let t = table(&e);
    if json {
        println!("{}", serde_json::to_string(&e).map_err(|x| x.to_string())?);
    } else {
        println!("{t}");
    }
    Ok(Section {
        experiment: e.experiment.to_string(),
        table: t,
        meaning: meaning(&e),
        commands: e.commands,
        data,
        plots: e.plots,
        kernel: None,
        kernel_table: String::new(),
        elapsed_s: 0.0,
    })
}

pub fn run(req: LabRequest) -> Result<(), String> {
    for n in &req.experiments {
        if !EXPERIMENTS.contains(&n.as_str()) {
            return Err(format!(
                "unknown experiment '{n}' (known: {})",
                EXPERIMENTS.join(", ")
            ));
        }
    }
    if let Some(dir) = &req.report {
        // Fail before an hour of work, not after it.
        std::fs::create_dir_all(dir).map_err(|e| format!("--report {}: {e}", dir.display()))?;
    }
    let o = &req.opts;
    let total: f64 = req.experiments.iter().map(|n| estimate_s(n, o)).sum();
    let mem = req
        .experiments
        .iter()
        .map(|n| memory_gib(n, o))
        .fold(0.0, f64::max);
    eprintln!(
        "lab: {} ({}), about {}{}; no disk for wbstack's arms (the simulated devices keep their data in memory: up to {mem:.0} GiB){}",
        req.experiments.join(", "),
        if o.full {
            "--full: near the seeds' scale"
        } else if o.quick {
            "quick sizes"
        } else {
            "default sizes"
        },
        human_secs(total),
        if req.kernel.is_empty() {
            String::new()
        } else {
            " plus the kernel arms".into()
        },
        if req.kernel.is_empty() {
            String::new()
        } else {
            "; the kernel arms write their files to sparse images on this disk, in WBSTACK_LAB_DIR or /var/tmp/wbstack-lab-kernel (checked for free space first)"
                .into()
        }
    );
    let t_all = Instant::now();
    let started_unix_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut sections = Vec::new();
    for name in &req.experiments {
        let t0 = Instant::now();
        let json = o.json;
        let mut s = match name.as_str() {
            "inflight" => section(
                inflight::inflight(o)?,
                inflight::table_inflight,
                meaning_inflight,
                json,
            )?,
            "plug" => section(plug::plug(o)?, plug::table_plug, meaning_plug, json)?,
            "expire" => section(
                expire::expire(o)?,
                expire::table_expire,
                meaning_expire,
                json,
            )?,
            "fsync" => section(fsync::fsync(o)?, fsync::table_fsync, meaning_fsync, json)?,
            "wbt" => section(wbt::wbt(o)?, wbt::table_wbt, meaning_wbt, json)?,
            "dirty" => section(dirty::dirty(o)?, dirty::table_dirty, meaning_dirty, json)?,
            other => return Err(format!("unknown experiment '{other}'")),
        };
        if !req.kernel.is_empty() {
            let k = kernel::run(name, &req.kernel, o)?;
            if json {
                println!("{}", serde_json::to_string(&k).map_err(|e| e.to_string())?);
            } else {
                kernel::print(&k);
            }
            s.kernel_table = kernel::table(&k);
            s.plots.extend(kernel::headline_plot(&k));
            s.kernel = Some(k);
        }
        s.elapsed_s = t0.elapsed().as_secs_f64();
        sections.push(s);
    }
    if let Some(dir) = &req.report {
        let r = &req.replay_of;
        let info = RunInfo {
            command: std::env::args().collect::<Vec<_>>().join(" "),
            experiments: req.experiments.clone(),
            quick: o.quick,
            full: o.full,
            kernel: req.kernel.iter().map(|k| k.name().to_string()).collect(),
            rounds: o.rounds,
            runtime_ms: o.runtime.map(|d| d.as_millis() as u64),
            git_commit: git_commit(),
            kernel_version: kernel_version(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            started_unix_s,
            elapsed_s: t_all.elapsed().as_secs_f64(),
        };
        let run = Run { info, sections };
        report::write(dir, &run, r.as_ref())?;
        eprintln!(
            "lab: report in {} ({} plots), {} in all",
            dir.join("index.html").display(),
            run.sections.iter().map(|s| s.plots.len()).sum::<usize>(),
            human_secs(run.info.elapsed_s)
        );
    }
    Ok(())
}

/// A replay: the options of `DIR/run.json`, a report written beside it.
pub fn replay_request(
    path: &std::path::Path,
    sink: crate::progress::Sink,
    json: bool,
) -> Result<LabRequest, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("--replay {}: {e}", path.display()))?;
    let first: Run = serde_json::from_str(&text)
        .map_err(|e| format!("--replay {}: not a lab run.json: {e}", path.display()))?;
    let dir = path.parent().unwrap_or(std::path::Path::new("."));
    let mut out = dir.join("replay");
    let mut n = 1;
    while out.exists() {
        n += 1;
        out = dir.join(format!("replay-{n}"));
    }
    let kernel = first
        .info
        .kernel
        .iter()
        .map(|k| kernel::parse_kernel(k).map(|v| v[0]))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(LabRequest {
        experiments: first.info.experiments.clone(),
        opts: LabOpts {
            quick: first.info.quick,
            full: first.info.full,
            json,
            rounds: first.info.rounds,
            runtime: first.info.runtime_ms.map(std::time::Duration::from_millis),
            sink,
        },
        kernel,
        report: Some(out),
        replay_of: Some(first),
    })
}

fn ratio(a: f64, b: f64) -> f64 {
    a / b.max(1e-9)
}

fn meaning_plug(e: &Experiment<plug::PlugArm>) -> String {
    let (Some(off), Some(on)) = (
        e.arms.iter().find(|a| !a.writeback_plug),
        e.arms.iter().find(|a| a.writeback_plug),
    ) else {
        return String::new();
    };
    format!(
        "With writeback_plug the flusher issued {:.1}% of the device writes it issued without it ({:.0} KiB average against {:.0} KiB), and fs_mark created files {:.2}x as fast. The seed saw -94% write IOPS and +37% to +63% files/s: plugging at the top of writeback lets adjacent small files merge into large writes, so a device limited by IOPS stops setting the pace.",
        ratio(on.write_iops, off.write_iops) * 100.0,
        on.avg_write_kib,
        off.avg_write_kib,
        ratio(on.files_per_sec, off.files_per_sec)
    )
}

fn meaning_expire(e: &Experiment<expire::ExpireArm>) -> String {
    let (Some(off), Some(on)) = (
        e.arms.iter().find(|a| !a.expire_first),
        e.arms.iter().find(|a| a.expire_first),
    ) else {
        return String::new();
    };
    format!(
        "With expire_first tar+dd+sync took {:.2}x the time of without; the most refill rounds any inode waited went from {} to {}, while the longest delay to an inode's first write went from {:.1} s to {:.1} s. Background writeback then takes only expired inodes while the streaming dd keeps b_io busy, so young small files wait until they expire or a sync comes (bounded by dirty_expire_centisecs, as in the seed's patch): fewer rounds behind the streamer, later first writes, and little change in throughput (the seed: tar -8%, dd -8%).",
        ratio(on.total_s, off.total_s),
        off.max_rounds_waited,
        on.max_rounds_waited,
        off.max_first_write_delay_s,
        on.max_first_write_delay_s
    )
}

fn meaning_inflight(e: &Experiment<inflight::InflightArm>) -> String {
    use wbstack::block::IoStatsMode;
    let get = |j: usize, m: IoStatsMode| e.arms.iter().find(|a| a.jobs == j && a.iostats == m);
    let jobs = e.arms.iter().map(|a| a.jobs).max().unwrap_or(0);
    let (Some(at), Some(tg)) = (get(jobs, IoStatsMode::Atomic), get(jobs, IoStatsMode::Tags))
    else {
        return String::new();
    };
    format!(
        "At {jobs} jobs, shared atomic in-flight counters kept {:.0}% of the IOPS of no accounting and tag-based counting kept {:.0}%. The seed lost 88% to the atomic counter on 48 queues and 4.7% with tags; on this 2-CPU machine there is little cache-line bouncing to remove, so the gap is small here.",
        at.vs_off * 100.0,
        tg.vs_off * 100.0
    )
}

fn meaning_wbt(e: &Experiment<wbt::WbtArm>) -> String {
    let find = |dev: &str, sc: &str, w: &str| {
        e.arms
            .iter()
            .find(|a| a.device.starts_with(dev) && a.scenario == sc && a.wbt == w)
    };
    let (Some(off), Some(on)) = (
        find("sim:hdd", "dirty_set", "off"),
        find("sim:hdd", "dirty_set", "on"),
    ) else {
        return String::new();
    };
    format!(
        "On the disk with a dirty set written back under the reads, wbt took the reads' 99.99th percentile from {} to {} usec ({:.2}x) and late reads from {} to {}, at {:.0}% of the writeback rate. The seed saw p99.99 0.15x and Over 333 to 1 at the same write rate: wbt shrinks the background writes' queue depth while reads miss their latency target.",
        off.figures.read_p9999_us,
        on.figures.read_p9999_us,
        ratio(on.figures.read_p9999_us as f64, off.figures.read_p9999_us as f64),
        off.figures.read_over,
        on.figures.read_over,
        ratio(on.writeback_mib_s, off.writeback_mib_s) * 100.0
    )
}

fn meaning_fsync(e: &Experiment<fsync::FsyncArm>) -> String {
    let get = |n: &str| e.arms.iter().find(|a| a.name == n);
    let (Some(s0), Some(s1), Some(a), Some(one)) =
        (get("S0-8"), get("S1-8"), get("A-8"), get("S1-1"))
    else {
        return String::new();
    };
    format!(
        "Async flush (-A) ran at {:.0}% of -S0's files/s in the last (sustained) loop with {:.1} fsyncs retired per device flush, and 8 fsyncing threads ran {:.1}x one. The seed's -A reached about 86% of -S0 (30k against 35k files/s) with about 10 fsyncs per device IO: grouping fsyncs into shared journal commits is what lets many small durable files cost few flushes.",
        ratio(a.last_loop_files_per_sec, s0.last_loop_files_per_sec) * 100.0,
        a.fsyncs_per_flush,
        ratio(s1.files_per_sec, one.files_per_sec)
    )
}

fn meaning_dirty(e: &Experiment<dirty::DirtyArm>) -> String {
    let (Some(one), Some(four)) = (e.arms.first(), e.arms.last()) else {
        return String::new();
    };
    format!(
        "One writer ran at {:.0} MiB/s and four at {:.0} MiB/s together, with pauses of {:.1} and {:.1} ms on average (at most {:.0} ms), while dirty memory peaked at {} MiB against a limit of {} MiB. IO-less throttling paces writers by sleeping them in proportion to how far dirty memory is above the setpoint, so the disk's bandwidth is shared and no writer waits on IO itself.",
        one.write_mib_s,
        four.write_mib_s,
        one.pause_mean_ms,
        four.pause_mean_ms,
        one.pause_max_ms.max(four.pause_max_ms),
        (one.max_dirty_pages.max(four.max_dirty_pages) * 4096) >> 20,
        (one.limit_pages * 4096) >> 20
    )
}
