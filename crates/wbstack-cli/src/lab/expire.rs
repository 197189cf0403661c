//! Seed 001 (expire_first): tar and dd at once, with expired inodes written first or not.

use crate::bench::benchfs::BenchFs;
use crate::bench::tardd::{self, TarSource, TarddOpts};
use crate::bench::volfs;
use crate::lab::plots::{Plot, PlotKind};
use crate::lab::timeline::Timeline;
use crate::lab::ArmRun;
use crate::lab::{outln, pct, Experiment, LabOpts};
use serde::Serialize;
use std::sync::Arc;
use wbstack::writeback::policy::VisitRecord;

#[derive(Serialize, Clone, Debug)]
pub struct ExpireArm {
    pub name: String,
    pub expire_first: bool,
    pub tar_s: f64,
    pub dd_s: f64,
    pub total_s: f64,
    pub files: u64,
    pub dd_mib: f64,
    /// Most refills (rounds) any inode waited between being queued and being written.
    pub max_rounds_waited: u64,
    /// Longest time from an inode's first dirtying to its first writeback.
    pub max_first_write_delay_s: f64,
    pub writeback_rounds: u64,
}

/// The device of seed 001: a disk (the thread's dd ran at ~70 MB/s on XFS on sda7).
pub const EXPIRE_DEVICE: &str = "sim:hdd,size=64G,seed=1";

/// Seed 001: tar (a synthetic source tree) and dd at once, expire_first on and off,
/// on a simulated disk with a page cache of 3 GiB as in the thread.
pub fn expire(o: &LabOpts) -> Result<Experiment<ExpireArm>, String> {
    let (files, dd, cache) = if o.full {
        // linux-2.6.38.3 holds about 36,000 files; the seed's dd wrote 1000 MiB.
        (36_000usize, 3u64 << 30, "3G")
    } else if o.quick {
        (20_000usize, 1u64 << 30, "1G")
    } else {
        (26_000, 3u64 << 30, "3G")
    };
    let mut arms = Vec::new();
    let mut timelines = Vec::new();
    let mut visits = Vec::new();
    let mut commands = Vec::new();
    for on in [false, true] {
        let mount = format!("expire_first={},cache_size={cache}", u8::from(on));
        let fs = volfs::open_vol(EXPIRE_DEVICE, &mount)?;
        fs.volume().bdi().enable_history();
        commands.push(format!(
            "wbstack bench tardd --device {EXPIRE_DEVICE} -o {mount} --files {files} --dd-size {}M",
            dd >> 20
        ));
        let run = ArmRun::start(
            o,
            &format!("expire: expire_first={}", u8::from(on)),
            Some(dd >> 20),
            "MiB of dd",
            Some(fs.clone()),
            |m| m.bytes() >> 20,
        );
        let opts = TarddOpts {
            source: TarSource::Synthetic { files, seed: 1 },
            dd_size: dd,
            meter: Some(run.meter.clone()),
            ..Default::default()
        };
        let r = tardd::run(&opts, fs.clone() as Arc<dyn BenchFs>);
        timelines.push(run.finish());
        let r = r?;
        visits.push(fs.volume().bdi().visit_log());
        let x = &r.extra;
        arms.push(ExpireArm {
            name: if on { "on" } else { "off" }.into(),
            expire_first: on,
            tar_s: r.tar_s,
            dd_s: r.dd_s,
            total_s: r.total_s,
            files: r.files,
            dd_mib: r.dd_bytes as f64 / (1 << 20) as f64,
            max_rounds_waited: x["max_rounds_waited"].as_u64().unwrap_or(0),
            max_first_write_delay_s: x["max_first_write_delay_s"].as_f64().unwrap_or(0.0),
            writeback_rounds: x["writeback_rounds"].as_u64().unwrap_or(0),
        });
    }
    let plots = expire_plots(&arms, &timelines, &visits, files as f64, dd as f64);
    Ok(Experiment {
        experiment: "expire",
        arms,
        note: Some(format!(
            "tar -x of a synthetic tree of {files} files and dd bs=1M of {} MiB at once, then sync; page cache {cache}, {EXPIRE_DEVICE}",
            dd >> 20
        )),
        plots,
        commands,
    })
}

/// Points of a per-inode plot at most: tens of thousands of dots would weigh
/// megabytes of SVG and show nothing more.
const MAX_INODE_POINTS: usize = 2000;

fn expire_plots(
    arms: &[ExpireArm],
    timelines: &[Timeline],
    visits: &[Vec<VisitRecord>],
    files: f64,
    dd_bytes: f64,
) -> Vec<Plot> {
    let mut delay = Plot::new(
        "expire-first-write",
        "seed 001: each inode's delay from first dirtying to its first write",
        PlotKind::Points,
        "when the inode was first dirtied (s)",
        "delay to its first write (s)",
    );
    let rounds_cats: Vec<String> = (0..5)
        .map(|r| r.to_string())
        .chain(["5+".to_string()])
        .collect();
    let mut rounds = Plot::new(
        "expire-rounds-waited",
        "seed 001: refill rounds each inode's visit waited",
        PlotKind::Bars,
        "rounds waited",
        "% of visits",
    )
    .categories(rounds_cats);
    for (a, v) in arms.iter().zip(visits) {
        let firsts: Vec<&VisitRecord> = v
            .iter()
            .filter(|r| r.first_write_delay_ns.is_some())
            .collect();
        let t0 = firsts
            .iter()
            .map(|r| r.at_ns - r.first_write_delay_ns.unwrap_or(0))
            .min()
            .unwrap_or(0);
        let stride = firsts.len().div_ceil(MAX_INODE_POINTS).max(1);
        delay = delay.series(
            &format!("expire_first {}", a.name),
            firsts
                .iter()
                .step_by(stride)
                .map(|r| {
                    let d = r.first_write_delay_ns.unwrap_or(0);
                    ((r.at_ns - d - t0) as f64 / 1e9, d as f64 / 1e9)
                })
                .collect(),
        );
        let mut h = [0u64; 6];
        for r in v {
            h[(r.rounds_waited as usize).min(5)] += 1;
        }
        let n = v.len().max(1) as f64;
        rounds = rounds.series(
            &format!("expire_first {}", a.name),
            h.iter()
                .enumerate()
                .map(|(i, &c)| (i as f64, c as f64 * 100.0 / n))
                .collect(),
        );
    }
    let mut progress = Plot::new(
        "expire-progress",
        "seed 001: tar and dd progress over time",
        PlotKind::Lines,
        "time (s)",
        "% done",
    );
    for (a, tl) in arms.iter().zip(timelines) {
        let pct = |col: &str, total: f64| {
            tl.points(col)
                .into_iter()
                .map(|(t, v)| (t, v * 100.0 / total.max(1.0)))
                .collect()
        };
        progress = progress
            .series(&format!("tar, expire_first {}", a.name), pct("ops", files))
            .series(
                &format!("dd, expire_first {}", a.name),
                pct("bytes", dd_bytes),
            );
    }
    vec![delay, rounds, progress]
}

pub fn table_expire(e: &Experiment<ExpireArm>) -> String {
    let mut out = String::new();
    outln!(
        out,
        "seed 001 — writeback: sync expired inodes first in background writeback"
    );
    if let Some(n) = &e.note {
        outln!(out, "{n}");
    }
    outln!(out);
    outln!(
        out,
        "{:<14} {:>8} {:>8} {:>10} {:>13} {:>16} {:>9}",
        "expire_first",
        "tar s",
        "dd s",
        "total s",
        "max rounds",
        "max first-write",
        "rounds"
    );
    outln!(
        out,
        "{:<14} {:>8} {:>8} {:>10} {:>13} {:>16} {:>9}",
        "",
        "",
        "",
        "incl sync",
        "waited",
        "delay s",
        ""
    );
    outln!(out, "{}", "-".repeat(84));
    for a in &e.arms {
        outln!(
            out,
            "{:<14} {:>8.2} {:>8.2} {:>10.2} {:>13} {:>16.2} {:>9}",
            if a.expire_first {
                "on (patched)"
            } else {
                "off (2.6.39)"
            },
            a.tar_s,
            a.dd_s,
            a.total_s,
            a.max_rounds_waited,
            a.max_first_write_delay_s,
            a.writeback_rounds
        );
    }
    outln!(out);
    outln!(
        out,
        "the seed (XFS on a disk, 3 GB RAM, tar jxf linux-2.6.38.3 + dd 1000 MiB, mean of 5):"
    );
    outln!(out, "  without: tar 29.00 s, dd 14.53 s; with: tar 26.77 s, dd 13.36 s; tar+dd+sync 244.36 s vs 239.91 s for all 5");
    if let (Some(off), Some(on)) = (
        e.arms.iter().find(|a| !a.expire_first),
        e.arms.iter().find(|a| a.expire_first),
    ) {
        outln!(out);
        outln!(
            out,
            "with expire_first: total {} ({:.2} s vs {:.2} s), longest wait {} round(s) vs {}",
            pct(on.total_s, off.total_s),
            on.total_s,
            off.total_s,
            on.max_rounds_waited,
            off.max_rounds_waited
        );
    }
    out
}

pub fn print_expire(e: &Experiment<ExpireArm>) {
    print!("{}", table_expire(e));
}
