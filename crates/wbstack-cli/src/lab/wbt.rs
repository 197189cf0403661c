//! Seed 003: reads under heavy background writeback, writeback throttling off and on.

use crate::bench::benchfs::BenchFs;
use crate::bench::volfs;
use crate::lab::plots::{nines, Plot, PlotKind};
use crate::lab::timeline::Timeline;
use crate::lab::ArmRun;
use crate::lab::{outln, Experiment, LabOpts};
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;

#[derive(Serialize, Clone, Debug)]
pub struct WbtArm {
    pub name: String,
    pub device: String,
    /// `dirty_set`: a dirty set below the throttle point, written back in the background
    /// while the reads run (the seed's case); `flood`: a dd faster than the device,
    /// throttled by balance_dirty_pages all along.
    pub scenario: &'static str,
    /// `off`, `kernel` (the kernel's wbt rules) or `on` (wbstack's defaults).
    pub wbt: &'static str,
    /// 0: wbt off; else its target.
    pub wbt_lat_usec: u64,
    #[serde(flatten)]
    pub figures: crate::bench::readlat::ReadlatFigures,
    /// The dd's bytes over the time from its first write until they were on the
    /// device (a sync after the reads): the writeback wbt throttles.
    pub writeback_mib_s: f64,
    /// Where wbt's scaling ended (negative: deeper than default).
    pub wbt_scale_step: i64,
    pub wbt_waits: u64,
}

/// The arms of one device and scenario: wbt off, the kernel's rules, wbstack's.
const WBT_ARMS: [(&str, &str); 3] = [
    ("off", "wbt_lat_usec=0"),
    ("kernel", "wbt_judge=min,wbt_scale_up_when_limited=0"),
    ("on", ""),
];

/// Seed 003: readlat (4 KiB sequential reads of a cold file, 10 ms target, piped to a
/// writer) while heavy writeback runs, wbt off, with the kernel's rules and with
/// wbstack's, on a simulated disk and SSD.
///
/// The seed's writes came from its own pipeline, so its writeback began while the reads
/// ran and its writer was not held back: here a dd dumps a dirty set below the throttle
/// point (dirty_ratio=60 of an 8 GiB cache, 2 GiB quick) 0.3 s into the reads (0.1 s
/// quick), and the
/// flusher writes it back in the background for the rest of the run. The `flood`
/// scenario (sim:ssd) adds the harsher case the seed did not have: a dd faster than the
/// device, throttled all along, which wbt by design serves at full depth.
pub fn wbt(o: &LabOpts) -> Result<Experiment<WbtArm>, String> {
    use crate::bench::readlat::{self, ReadlatOpts};
    // (device, default target, scenario, read bytes, dd bytes)
    let delay = Duration::from_millis(if o.quick { 100 } else { 300 });
    // --full reads four times as much (the seed read a 9 GB file; at a disk's 80 MB/s
    // that would be two minutes per arm, nine arms): the dirty set stays below the
    // throttle point, as in the seed.
    let scale = if o.full { 4 } else { 1 };
    let runs: Vec<(&str, u64, &'static str, u64, u64)> = if o.quick {
        vec![
            (
                "sim:hdd,size=64G,data=meta,seed=1",
                75_000,
                "dirty_set",
                32 << 20,
                512 << 20,
            ),
            (
                "sim:ssd,size=64G,data=meta,seed=1",
                2_000,
                "dirty_set",
                64 << 20,
                512 << 20,
            ),
            (
                "sim:ssd,size=64G,data=meta,seed=1",
                2_000,
                "flood",
                64 << 20,
                1 << 30,
            ),
        ]
    } else {
        vec![
            (
                "sim:hdd,size=64G,data=meta,seed=1",
                75_000,
                "dirty_set",
                128 << 20,
                2 << 30,
            ),
            (
                "sim:ssd,size=64G,data=meta,seed=1",
                2_000,
                "dirty_set",
                256 << 20,
                2 << 30,
            ),
            (
                "sim:ssd,size=64G,data=meta,seed=1",
                2_000,
                "flood",
                256 << 20,
                2 << 30,
            ),
        ]
    };
    let mut arms = Vec::new();
    let mut timelines = Vec::new();
    let mut curves = Vec::new();
    let mut commands = Vec::new();
    for (dev, default_lat, scenario, read, dd) in runs {
        let read = read * scale;
        for (wbt, wbt_opts) in WBT_ARMS {
            let kind = dev.split(',').next().unwrap_or(dev);
            // The dirty set lies between the background threshold (10%) and the point
            // where balance_dirty_pages starts to throttle ((10% + 60%) / 2).
            let mut mount = format!(
                "cache_size={},dirty_ratio=60",
                if o.quick { "2G" } else { "8G" }
            );
            // On a disk every window the reader waits for costs a seek behind the
            // writeback: 128 KiB windows leave the reads seek-bound with wbt or without
            // it, so the disk reads 1 MiB per seek (all three arms alike).
            if kind == "sim:hdd" {
                mount.push_str(",read_ahead_kb=1024");
            }
            if !wbt_opts.is_empty() {
                mount = format!("{mount},{wbt_opts}");
            }
            let fs = volfs::open_vol(dev, &mount)?;
            commands.push(format!(
                "wbstack bench readlat --device {dev} -o {mount} --size {}M --background-dd {}M --dd-delay {}ms",
                read >> 20,
                dd >> 20,
                if scenario == "dirty_set" { delay.as_millis() } else { 0 }
            ));
            let run = ArmRun::start(
                o,
                &format!("wbt: {kind} {scenario} wbt {wbt}"),
                Some(read >> 20),
                "MiB read",
                Some(fs.clone()),
                |m| m.bytes() >> 20,
            );
            let opts = ReadlatOpts {
                meter: Some(run.meter.clone()),
                size: read,
                background_dd: dd,
                dd_delay: if scenario == "dirty_set" {
                    delay
                } else {
                    Duration::ZERO
                },
                ..Default::default()
            };
            let r = readlat::run(&opts, fs.clone() as Arc<dyn BenchFs>);
            timelines.push(run.finish());
            let r = r?;
            curves.push(
                r.read
                    .percentiles
                    .iter()
                    // Cached reads take under the histogram's 1 usec resolution: drawn
                    // at 1 on the log scale rather than dropped.
                    .map(|p| (p.pct, p.us.max(1) as f64))
                    .collect::<Vec<_>>(),
            );
            let w = &r.extra["wbt"];
            arms.push(WbtArm {
                name: format!("{kind}-{scenario}-{wbt}"),
                device: dev.into(),
                scenario,
                wbt,
                wbt_lat_usec: if wbt == "off" { 0 } else { default_lat },
                figures: r.figures.clone(),
                writeback_mib_s: r.dd.as_ref().map_or(0.0, |d| d.durable_mib_s),
                wbt_scale_step: w["scale_step"].as_i64().unwrap_or(0),
                wbt_waits: w["waits"][0].as_u64().unwrap_or(0),
            });
        }
    }
    let plots = wbt_plots(&arms, &timelines, &curves);
    Ok(Experiment {
        plots,
        commands,
        experiment: "wbt",
        arms,
        note: Some(
            "readlat: 4 KiB sequential reads of a cold file, 10 ms target, piped to a writer \
             (read_ahead_kb=1024 on sim:hdd); \
             dirty_set: a dd dumps a dirty set just after the reads begin (below the throttle point) \
             and the flusher writes it back meanwhile; flood: a dd faster than the device, \
             throttled all along. Arms: wbt off, the kernel's rules (wbt_judge=min, \
             wbt_scale_up_when_limited=0), wbstack's defaults"
                .into(),
        ),
    })
}

/// Per device and scenario: the read latency curve, late reads over time, and wbt's
/// step beside the queue depth.
fn wbt_plots(arms: &[WbtArm], timelines: &[Timeline], curves: &[Vec<(f64, f64)>]) -> Vec<Plot> {
    let mut groups: Vec<(String, &str)> = Vec::new();
    for a in arms {
        let g = (
            a.device.split(',').next().unwrap_or(&a.device).to_string(),
            a.scenario,
        );
        if !groups.contains(&g) {
            groups.push(g);
        }
    }
    let mut plots = Vec::new();
    for (dev, scenario) in groups {
        let id = format!("{}-{}", dev.replace(':', "-"), scenario.replace('_', "-"));
        let members: Vec<usize> = (0..arms.len())
            .filter(|&i| arms[i].device.starts_with(dev.as_str()) && arms[i].scenario == scenario)
            .collect();
        let mut lat = Plot::new(
            &format!("wbt-latency-{id}"),
            &format!("seed 003, {dev} {scenario}: read latency percentiles"),
            PlotKind::Percentiles,
            "percentile",
            "read latency (usec, log scale, <1 at 1)",
        )
        .log_y();
        let mut late = Plot::new(
            &format!("wbt-late-{id}"),
            &format!("seed 003, {dev} {scenario}: late reads (over 10 ms) so far"),
            PlotKind::Lines,
            "time (s)",
            "late reads",
        );
        let mut step = Plot::new(
            &format!("wbt-step-{id}"),
            &format!("seed 003, {dev} {scenario}: wbt's scale step and the queue depth"),
            PlotKind::Lines,
            "time (s)",
            "step / requests in flight",
        );
        for &i in &members {
            let (a, tl) = (&arms[i], &timelines[i]);
            lat = lat.series(
                &format!("wbt {}", a.wbt),
                curves[i].iter().map(|&(p, us)| (nines(p), us)).collect(),
            );
            late = late.series(&format!("wbt {}", a.wbt), tl.points("late"));
            if a.wbt != "off" {
                step = step.series(&format!("wbt {}: scale step", a.wbt), tl.points("wbt_step"));
            }
            step = step.series(
                &format!("wbt {}: queue depth", a.wbt),
                tl.points("queue_depth"),
            );
        }
        plots.extend([lat, late, step]);
    }
    plots
}

pub fn table_wbt(e: &Experiment<WbtArm>) -> String {
    let mut out = String::new();
    outln!(
        out,
        "seed 003 — writeback throttling: reads under heavy background writeback"
    );
    if let Some(n) = &e.note {
        outln!(out, "{n}");
    }
    outln!(out);
    outln!(
        out,
        "{:<26} {:>7} {:>8} {:>8} {:>8} {:>5} {:>8} {:>8} {:>7} {:>7} {:>5}",
        "arm",
        "wbt lat",
        "read p50",
        "p99",
        "p99.99",
        "Over",
        "max",
        "write",
        "read",
        "wback",
        "step"
    );
    outln!(
        out,
        "{:<26} {:>7} {:>8} {:>8} {:>8} {:>5} {:>8} {:>8} {:>7} {:>7} {:>5}",
        "",
        "usec",
        "usec",
        "usec",
        "usec",
        "",
        "usec",
        "p99.99",
        "KB/s",
        "MiB/s",
        ""
    );
    outln!(out, "{}", "-".repeat(109));
    for a in &e.arms {
        outln!(
            out,
            "{:<26} {:>7} {:>8} {:>8} {:>8} {:>5} {:>8} {:>8} {:>7} {:>7.0} {:>5}",
            a.name,
            a.wbt_lat_usec,
            a.figures.read_p50_us,
            a.figures.read_p99_us,
            a.figures.read_p9999_us,
            a.figures.read_over,
            a.figures.read_max_us,
            a.figures.write_p9999_us,
            a.figures.read_kib_s,
            a.writeback_mib_s,
            a.wbt_scale_step
        );
    }
    outln!(out);
    outln!(
        out,
        "the seed (read-to-pipe-async of a 9 GB file to gzip, 75% of memory in CPU hogs):"
    );
    outln!(out, "  off: p99 54 us, p99.99 17,952 us, Over=333, max 215,367 us; writers p99.99 1,142 us; read 88,988 KB/s, write 60,019 KB/s");
    outln!(out, "  on:  p99 55 us, p99.99  2,652 us, Over=1,   max  10,221 us; writers p99.99 1,106 us; read 95,506 KB/s, write 59,970 KB/s");
    outln!(
        out,
        "  (improvement: p99.99 0.15x, max 0.05x, Over 0.003x, write rate 100%)"
    );
    let mut groups: Vec<(&str, &str)> = Vec::new();
    for a in &e.arms {
        let g = (a.device.split(',').next().unwrap_or(&a.device), a.scenario);
        if !groups.contains(&g) {
            groups.push(g);
        }
    }
    for (dev, scenario) in groups {
        let get = |wbt: &str| {
            e.arms
                .iter()
                .find(|a| a.device.starts_with(dev) && a.scenario == scenario && a.wbt == wbt)
        };
        let Some(off) = get("off") else { continue };
        for wbt in ["kernel", "on"] {
            if let Some(on) = get(wbt) {
                outln!(
                out,
                    "{dev} {scenario}, wbt {wbt}: p99.99 {:.2}x, max {:.2}x, Over {:.2}x of off; write rate {:.0}%, writeback {:.0}% of off",
                    on.figures.read_p9999_us as f64 / off.figures.read_p9999_us.max(1) as f64,
                    on.figures.read_max_us as f64 / off.figures.read_max_us.max(1) as f64,
                    on.figures.read_over as f64 / off.figures.read_over.max(1) as f64,
                    on.figures.write_kib_s as f64 / off.figures.write_kib_s.max(1) as f64 * 100.0,
                    on.writeback_mib_s / off.writeback_mib_s.max(1e-9) * 100.0
                );
            }
        }
    }
    out
}

pub fn print_wbt(e: &Experiment<WbtArm>) {
    print!("{}", table_wbt(e));
}
