//! Seed 000 (writeback_plug): fs_mark of small files with the high-level plug on and off.

use crate::bench::fsmark::{self, FsmarkOpts, SyncMethod};
use crate::bench::meter::Meter;
use crate::bench::volfs;
use crate::lab::plots::{Plot, PlotKind};
use crate::lab::ArmRun;
use crate::lab::{fmt_int, outln, pct, Experiment, LabOpts};
use serde::Serialize;

#[derive(Serialize, Clone, Debug)]
pub struct PlugArm {
    pub name: String,
    pub writeback_plug: bool,
    pub files: u64,
    /// fs_mark's average files/s over the loops.
    pub files_per_sec: f64,
    pub files_per_sec_incl_sync: f64,
    pub write_ios: u64,
    pub write_iops: f64,
    pub write_mib_s: f64,
    pub avg_write_kib: f64,
    pub cpu_s: f64,
    pub wall_s: f64,
}

/// The device of seed 000: an SSD behind a controller capped at 27,000 random 4 KiB
/// write IOPS (Dave Chinner's test box).
pub const PLUG_DEVICE: &str = "sim:ssd,size=32G,iops=27000,seed=1";

/// Seed 000: fs_mark, 2 threads, 4 KiB files, no sync, with writeback_plug on and off.
/// The page cache is small against the files written, so most of the run is in the
/// "sustained IO-bound" phase where writeback sets the pace, as in the seed.
pub fn plug(o: &LabOpts) -> Result<Experiment<PlugArm>, String> {
    let (files, loops, cache) = if o.full {
        (100_000, 4, "1G")
    } else if o.quick {
        (10_000, 2, "128M")
    } else {
        (25_000, 4, "512M")
    };
    let mut arms = Vec::new();
    let mut timelines = Vec::new();
    let mut sizes = Vec::new();
    let mut commands = Vec::new();
    for on in [false, true] {
        let mount = format!("writeback_plug={},cache_size={cache}", u8::from(on));
        let fs = volfs::open_vol(PLUG_DEVICE, &mount)?;
        let opts = FsmarkOpts {
            dirs: vec!["0".into(), "1".into()],
            subdirs: 100,
            files,
            size: 4096,
            loops,
            sync: SyncMethod::None,
            final_sync: true,
            ..Default::default()
        };
        commands.push(format!(
            "wbstack bench fsmark --device {PLUG_DEVICE} -o {mount} -d 0 -d 1 -D 100 -S0 -n {files} -s 4096 -L {loops}"
        ));
        let run = ArmRun::start(
            o,
            &format!("plug: writeback_plug={}", u8::from(on)),
            Some(files * 2 * loops as u64),
            "files",
            Some(fs.clone()),
            Meter::ops,
        );
        let opts = FsmarkOpts {
            meter: Some(run.meter.clone()),
            ..opts
        };
        let r = fsmark::run(&opts, fs.clone());
        timelines.push(run.finish());
        let r = r?;
        sizes.push(
            volfs::sim_stats(&fs)
                .map(|s| s.write_size_hist)
                .unwrap_or_default(),
        );
        let t = &r.totals;
        arms.push(PlugArm {
            name: if on { "on" } else { "off" }.into(),
            writeback_plug: on,
            files: t.files,
            files_per_sec: t.files_per_sec,
            files_per_sec_incl_sync: t.files_per_sec_incl_sync,
            write_ios: t.write_ios.unwrap_or(0),
            write_iops: t.write_iops.unwrap_or(0.0),
            write_mib_s: t.write_mib_s.unwrap_or(0.0),
            avg_write_kib: t.avg_write_kib.unwrap_or(0.0),
            cpu_s: t.cpu_s,
            wall_s: t.wall_s,
        });
    }
    let mut rate = Plot::new(
        "plug-rate",
        "seed 000: files created and device write IOPS over time",
        PlotKind::Lines,
        "time (s)",
        "per second (log scale)",
    )
    .log_y();
    for (a, tl) in arms.iter().zip(&timelines) {
        rate = rate
            .series(&format!("plug {}: files/s", a.name), tl.rate("ops"))
            .series(
                &format!("plug {}: write IOPS", a.name),
                tl.rate("dev_write_ios"),
            );
    }
    let mut hist = Plot::new(
        "plug-write-sizes",
        "seed 000: device write sizes",
        PlotKind::Bars,
        "write size (at most)",
        "% of device writes",
    )
    .categories(crate::lab::write_size_labels());
    for (a, h) in arms.iter().zip(&sizes) {
        let total: u64 = h.iter().sum();
        hist = hist.series(
            &format!("plug {}", a.name),
            h.iter()
                .enumerate()
                .map(|(i, &n)| (i as f64, n as f64 * 100.0 / total.max(1) as f64))
                .collect(),
        );
    }
    Ok(Experiment {
        experiment: "plug",
        arms,
        note: Some(format!(
            "fs_mark -d 0 -d 1 -D 100 -S0 -n {files} -s 4096 -L {loops}, page cache {cache}, {PLUG_DEVICE}; wall and files/s include the final sync"
        )),
        plots: vec![rate, hist],
        commands,
    })
}

pub fn table_plug(e: &Experiment<PlugArm>) -> String {
    let mut out = String::new();
    outln!(out, "seed 000 — writeback: plug writeback at a high level");
    if let Some(n) = &e.note {
        outln!(out, "{n}");
    }
    outln!(out);
    outln!(
        out,
        "{:<12} {:>7} {:>7} {:>13} {:>13} {:>8} {:>11} {:>9}",
        "",
        "wall",
        "CPU",
        "create rate",
        "incl. sync",
        "write",
        "bandwidth",
        "avg write"
    );
    outln!(
        out,
        "{:<12} {:>7} {:>7} {:>13} {:>13} {:>8} {:>11} {:>9}",
        "",
        "time",
        "",
        "(avg files/s)",
        "(files/s)",
        "IOPS",
        "",
        "size"
    );
    outln!(out, "{}", "-".repeat(88));
    let row = |out: &mut String, label: &str, a: &PlugArm| {
        outln!(
            out,
            "{:<12} {:>6.2}s {:>6.2}s {:>13} {:>13} {:>8} {:>7.0}MB/s {:>6.1}KiB",
            label,
            a.wall_s,
            a.cpu_s,
            fmt_int(a.files_per_sec),
            fmt_int(a.files_per_sec_incl_sync),
            fmt_int(a.write_iops),
            a.write_mib_s * 1.048576,
            a.avg_write_kib
        );
    };
    let off = e.arms.iter().find(|a| !a.writeback_plug);
    let on = e.arms.iter().find(|a| a.writeback_plug);
    if let Some(a) = off {
        row(&mut out, "unpatched", a);
    }
    if let Some(a) = on {
        row(&mut out, "patched", a);
    }
    if let (Some(off), Some(on)) = (off, on) {
        outln!(
            out,
            "{:<12} {:>7} {:>7} {:>13} {:>13} {:>8} {:>11} {:>9}",
            "improvement",
            pct(on.wall_s, off.wall_s),
            pct(on.cpu_s, off.cpu_s),
            pct(on.files_per_sec, off.files_per_sec),
            pct(on.files_per_sec_incl_sync, off.files_per_sec_incl_sync),
            pct(on.write_iops, off.write_iops),
            pct(on.write_mib_s, off.write_mib_s),
            pct(on.avg_write_kib, off.avg_write_kib),
        );
        outln!(out);
        outln!(
            out,
            "the seed (8 threads, 100 TB sparse XFS on 4 SSDs behind a 27,000-IOPS controller):"
        );
        outln!(out, "  2013 improvement  -26.44%  -14.68%  +36.67% (24,000 -> 32,800)   -94.23% (26,000 -> 1,500)  +38.46% (130 -> 180 MB/s)");
        outln!(out, "  2014 improvement  -43.8%   -13.3%   +62.7%  (32,500 -> 52,900)   -94.6%  (28,000 -> 1,500)  +86.6%  (150 -> 280 MB/s)");
        outln!(out);
        outln!(
                out,
            "physical write IOPS with the plug: {:.1}% of without; average write {:.0} KiB; files/s {:.2}x",
            on.write_iops / off.write_iops.max(1e-9) * 100.0,
            on.avg_write_kib,
            on.files_per_sec / off.files_per_sec.max(1e-9)
        );
    }
    out
}

pub fn print_plug(e: &Experiment<PlugArm>) {
    print!("{}", table_plug(e));
}
