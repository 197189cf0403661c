//! Seed 002: the cost of in-flight accounting (iostats off, atomic, tags) on a null device.

use crate::bench::blkbench::{self, BlkJob, BlkReport, Rw};
use crate::lab::plots::{Plot, PlotKind};
use crate::lab::{outln, Experiment, LabOpts};
use crate::progress::Step;
use serde::Serialize;
use std::time::Duration;
use wbstack::block::IoStatsMode;

#[derive(Serialize)]
pub struct InflightArm {
    pub name: String,
    pub iostats: IoStatsMode,
    pub jobs: usize,
    pub iops: f64,
    pub usr_pct: f64,
    pub sys_pct: f64,
    pub cpu_total_pct: f64,
    pub lat_p50_us: f64,
    pub lat_p99_us: f64,
    /// IOPS relative to iostats=off at the same job count.
    pub vs_off: f64,
    /// IOPS of every round, in run order.
    pub rounds_iops: Vec<f64>,
}

fn median_by_iops(mut v: Vec<BlkReport>) -> (BlkReport, Vec<f64>) {
    let order: Vec<f64> = v.iter().map(|r| r.iops).collect();
    v.sort_by(|a, b| a.iops.total_cmp(&b.iops));
    let mid = v.len() / 2;
    (v.swap_remove(mid), order)
}

/// Seed 002: the cost of in-flight accounting on a null device, many jobs of 4 KiB
/// sync reads, with iostats off, atomic (shared counters) and tags.
pub fn inflight(o: &LabOpts) -> Result<Experiment<InflightArm>, String> {
    let rounds = o.rounds.unwrap_or(if o.quick { 1 } else { 3 });
    let runtime = o
        .runtime
        .unwrap_or(Duration::from_millis(if o.quick { 700 } else { 3000 }));
    let modes = [IoStatsMode::Off, IoStatsMode::Atomic, IoStatsMode::Tags];
    let job_counts = [2usize, 32];
    let mut arms = Vec::new();
    let mut commands = Vec::new();
    for &jobs in &job_counts {
        let mut runs: Vec<Vec<BlkReport>> = vec![Vec::new(); modes.len()];
        for round in 0..rounds {
            // Rotate the order each round so drift (thermal, noisy neighbours) spreads
            // over all arms instead of favouring the first.
            for k in 0..modes.len() {
                let m = (k + round) % modes.len();
                let job = BlkJob {
                    device: "null".into(),
                    jobs,
                    rw: Rw::RandRead,
                    bs: 4096,
                    iodepth: 1,
                    runtime,
                    iostats: modes[m],
                    span: None,
                    seed: round as u64 + 1,
                    poll: true,
                    batch: 1,
                };
                commands.push(format!(
                    "wbstack bench blk --device null --jobs {jobs} --rw randread --bs 4k --iodepth 1 --runtime {}ms --iostats {} --seed {}",
                    runtime.as_millis(),
                    modes[m],
                    round + 1
                ));
                let _step = Step::start(
                    o.sink,
                    &format!(
                        "inflight: jobs={jobs} iostats={} round {}/{rounds}",
                        modes[m],
                        round + 1
                    ),
                    None,
                    "",
                );
                runs[m].push(blkbench::run(&job)?);
            }
        }
        let meds: Vec<(BlkReport, Vec<f64>)> = runs.into_iter().map(median_by_iops).collect();
        let off_iops = meds[0].0.iops;
        for (r, order) in meds {
            arms.push(InflightArm {
                name: format!("{}-{}", r.iostats, jobs),
                iostats: r.iostats,
                jobs,
                iops: r.iops,
                usr_pct: r.usr_pct,
                sys_pct: r.sys_pct,
                cpu_total_pct: r.cpu_total_pct,
                lat_p50_us: r.lat_p50_us,
                lat_p99_us: r.lat_p99_us,
                vs_off: r.iops / off_iops,
                rounds_iops: order,
            });
        }
    }
    let mut bars = Plot::new(
        "inflight-iops",
        "seed 002: IOPS by in-flight accounting and job count (null device)",
        PlotKind::Bars,
        "jobs (4 KiB random reads, iodepth 1)",
        "IOPS",
    )
    .categories(job_counts.iter().map(|j| j.to_string()).collect());
    for m in modes {
        bars = bars.series(
            &format!("iostats={m}"),
            job_counts
                .iter()
                .enumerate()
                .filter_map(|(i, &j)| {
                    arms.iter()
                        .find(|a| a.jobs == j && a.iostats == m)
                        .map(|a| (i as f64, a.iops))
                })
                .collect(),
        );
    }
    Ok(Experiment {
        plots: vec![bars],
        commands,
        experiment: "inflight",
        arms,
        note: Some(format!("null device, 4 KiB random reads, iodepth 1, {rounds} round(s) of {:.1} s per arm, median", runtime.as_secs_f64())),
    })
}

pub fn table_inflight(e: &Experiment<InflightArm>) -> String {
    let mut out = String::new();
    let ncpu = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    outln!(out, "seed 002 — more scalable inflight tracking (null device, 4 KiB random reads, iodepth 1, {ncpu} CPUs)");
    if let Some(n) = &e.note {
        outln!(out, "{n}");
    }
    outln!(out);
    outln!(
        out,
        "{:>4}  {:<7} {:>9} {:>6} {:>6} {:>7}   seed (48 queues, 32 jobs)",
        "jobs",
        "stats",
        "IOPS",
        "usr",
        "sys",
        "vs off"
    );
    outln!(out, "{}", "-".repeat(88));
    let seed = |jobs: usize, m: IoStatsMode| -> &'static str {
        match (jobs, m) {
            (32, IoStatsMode::Off) => "off  21.0M 33.7% 67.3% (before) / 21.4M (after)",
            (32, IoStatsMode::Atomic) => "on   2.6M  5.4%  94.6% (before: atomic in_flight)",
            (32, IoStatsMode::Tags) => "on   20.4M 30.9% 69.0% (after: tags)",
            _ => "",
        }
    };
    for a in &e.arms {
        outln!(
            out,
            "{:>4}  {:<7} {:>9} {:>5.1}% {:>5.1}% {:>6.1}%   {}",
            a.jobs,
            a.iostats.name(),
            crate::util::si(a.iops),
            a.usr_pct,
            a.sys_pct,
            a.vs_off * 100.0,
            seed(a.jobs, a.iostats)
        );
    }
    outln!(out);
    for &jobs in &[2usize, 32] {
        let get = |m: IoStatsMode| e.arms.iter().find(|a| a.jobs == jobs && a.iostats == m);
        if let (Some(off), Some(at), Some(tg)) = (
            get(IoStatsMode::Off),
            get(IoStatsMode::Atomic),
            get(IoStatsMode::Tags),
        ) {
            outln!(
                out,
                "jobs={jobs}: atomic costs {:.1}% of off's IOPS, tags cost {:.1}% (seed: atomic -88%, tags -4.7%)",
                (1.0 - at.iops / off.iops) * 100.0,
                (1.0 - tg.iops / off.iops) * 100.0
            );
        }
    }
    outln!(out, "usr/sys are per job as in fio; this stack runs in user space, so the accounting cost shows as usr.");
    out
}

pub fn print_inflight(e: &Experiment<InflightArm>) {
    print!("{}", table_inflight(e));
}
