//! IO-less dirty throttling (balance_dirty_pages, design.md's throttle): dd writers
//! faster than a disk, with dirty and writeback pages plotted against the background
//! threshold, the setpoint and the limit, and the writers' pause lengths. Not a seed's
//! A/B: it shows the controller the other experiments run under.

use crate::bench::benchfs::BenchFs;
use crate::bench::volfs;
use crate::lab::plots::{Plot, PlotKind};
use crate::lab::timeline::Timeline;
use crate::lab::{fmt_int, outln, ArmRun, Experiment, LabOpts};
use serde::Serialize;
use std::time::Instant;
use wbstack::writeback::wb::PAUSE_BUCKETS_MS;

#[derive(Serialize, Clone, Debug)]
pub struct DirtyArm {
    pub name: String,
    pub writers: usize,
    pub bytes: u64,
    /// The writers' bytes over their time, then with the final sync.
    pub write_mib_s: f64,
    pub write_mib_s_incl_sync: f64,
    pub pauses: u64,
    pub pause_mean_ms: f64,
    pub pause_max_ms: f64,
    /// Pauses by length, buckets of `PAUSE_BUCKETS_MS` then the rest.
    pub pause_hist: Vec<u64>,
    /// Largest dirty + writeback seen, against the limit then (pages).
    pub max_dirty_pages: u64,
    pub limit_pages: u64,
}

/// A disk, so writers outrun the device and the throttle sets their pace.
pub const DIRTY_DEVICE: &str = "sim:hdd,size=64G,data=meta,seed=1";

pub fn dirty(o: &LabOpts) -> Result<Experiment<DirtyArm>, String> {
    let (bytes, cache) = if o.full {
        (12u64 << 30, "4G")
    } else if o.quick {
        (768u64 << 20, "256M")
    } else {
        (3u64 << 30, "1G")
    };
    let mut arms = Vec::new();
    let mut timelines = Vec::new();
    let mut commands = Vec::new();
    for writers in [1usize, 4] {
        let mount = format!("cache_size={cache}");
        let fs = volfs::open_vol(DIRTY_DEVICE, &mount)?;
        commands.push(format!(
            "wbstack lab dirty{}   # the {writers}-writer arm: {writers} dd of {} MiB each on {DIRTY_DEVICE} -o {mount}",
            crate::lab::scale_flag(o.quick, o.full),
            (bytes / writers as u64) >> 20
        ));
        let run = ArmRun::start(
            o,
            &format!("dirty: {writers} writer(s)"),
            Some(bytes >> 20),
            "MiB",
            Some(fs.clone()),
            |m| m.bytes() >> 20,
        );
        let t0 = Instant::now();
        let each = bytes / writers as u64;
        let res: Result<(), String> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..writers)
                .map(|i| {
                    let (fs, meter) = (fs.clone(), run.meter.clone());
                    s.spawn(move || {
                        crate::bench::tardd::dd(
                            &*fs,
                            &format!("dd{i}"),
                            each,
                            1 << 20,
                            &meter.bytes,
                        )
                    })
                })
                .collect();
            hs.into_iter().try_for_each(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("dirty: a writer panicked".into()))
            })
        });
        let write_s = t0.elapsed().as_secs_f64();
        let synced = res.and_then(|()| fs.sync().map_err(|e| format!("dirty: sync: {e}")));
        let total_s = t0.elapsed().as_secs_f64();
        timelines.push(run.finish());
        synced?;
        let tl = timelines.last().expect("pushed above");
        let st = fs.volume().bdi().stats();
        let max_dirty = tl
            .points("nr_dirty")
            .iter()
            .zip(tl.points("nr_writeback"))
            .map(|(d, w)| (d.1 + w.1) as u64)
            .max()
            .unwrap_or(0);
        arms.push(DirtyArm {
            name: format!("{writers}w"),
            writers,
            bytes,
            write_mib_s: (bytes >> 20) as f64 / write_s.max(1e-9),
            write_mib_s_incl_sync: (bytes >> 20) as f64 / total_s.max(1e-9),
            pauses: st.pauses,
            pause_mean_ms: st.pause_ns_total as f64 / st.pauses.max(1) as f64 / 1e6,
            pause_max_ms: st.pause_ns_max as f64 / 1e6,
            pause_hist: st.pause_hist.to_vec(),
            max_dirty_pages: max_dirty,
            limit_pages: tl.points("limit").last().map_or(0, |p| p.1 as u64),
        });
    }
    let plots = dirty_plots(&arms, &timelines);
    Ok(Experiment {
        experiment: "dirty",
        arms,
        note: Some(format!(
            "dd writers (bs 1 MiB) of {} MiB in all, then sync; page cache {cache}, {DIRTY_DEVICE}",
            bytes >> 20
        )),
        plots,
        commands,
    })
}

fn dirty_plots(arms: &[DirtyArm], timelines: &[Timeline]) -> Vec<Plot> {
    let mut plots = Vec::new();
    let mib = |tl: &Timeline, col: &str| {
        tl.points(col)
            .into_iter()
            .map(|(t, pages)| (t, pages * 4096.0 / (1u64 << 20) as f64))
            .collect::<Vec<_>>()
    };
    for (a, tl) in arms.iter().zip(timelines) {
        let mut p = Plot::new(
            &format!("dirty-levels-{}", a.name),
            &format!(
                "dirty throttling, {} writer(s): dirty memory against the levels",
                a.writers
            ),
            PlotKind::Lines,
            "time (s)",
            "MiB",
        );
        // balance_dirty_pages steers dirty + writeback (NR_FILE_DIRTY + NR_WRITEBACK)
        // to the setpoint, so that sum is the line to read against the levels.
        let sum: Vec<(f64, f64)> = mib(tl, "nr_dirty")
            .iter()
            .zip(mib(tl, "nr_writeback"))
            .map(|(d, w)| (d.0, d.1 + w.1))
            .collect();
        p = p.series("dirty + writeback", sum);
        for (col, name) in [
            ("nr_dirty", "dirty"),
            ("nr_writeback", "writeback"),
            ("bg_thresh", "background threshold"),
            ("setpoint", "setpoint"),
            ("limit", "limit"),
        ] {
            p = p.series(name, mib(tl, col));
        }
        plots.push(p);
    }
    let mut cats: Vec<String> = PAUSE_BUCKETS_MS.iter().map(|ms| format!("<{ms}")).collect();
    cats.push(format!(
        ">={}",
        PAUSE_BUCKETS_MS[PAUSE_BUCKETS_MS.len() - 1]
    ));
    let mut pauses = Plot::new(
        "dirty-pauses",
        "dirty throttling: the writers' pause lengths",
        PlotKind::Bars,
        "pause (ms)",
        "% of pauses",
    )
    .categories(cats);
    for a in arms {
        let n = a.pauses.max(1) as f64;
        pauses = pauses.series(
            &format!("{} writer(s)", a.writers),
            a.pause_hist
                .iter()
                .enumerate()
                .map(|(i, &c)| (i as f64, c as f64 * 100.0 / n))
                .collect(),
        );
    }
    plots.push(pauses);
    plots
}

pub fn table_dirty(e: &Experiment<DirtyArm>) -> String {
    let mut out = String::new();
    outln!(
        out,
        "dirty throttling — IO-less balance_dirty_pages (writers faster than the disk)"
    );
    if let Some(n) = &e.note {
        outln!(out, "{n}");
    }
    outln!(out);
    outln!(
        out,
        "{:<8} {:>10} {:>11} {:>9} {:>10} {:>9} {:>12} {:>10}",
        "writers",
        "MiB/s",
        "incl sync",
        "pauses",
        "mean ms",
        "max ms",
        "max dirty",
        "limit"
    );
    outln!(out, "{}", "-".repeat(86));
    for a in &e.arms {
        outln!(
            out,
            "{:<8} {:>10.1} {:>11.1} {:>9} {:>10.1} {:>9.1} {:>9} MiB {:>6} MiB",
            a.writers,
            a.write_mib_s,
            a.write_mib_s_incl_sync,
            fmt_int(a.pauses as f64),
            a.pause_mean_ms,
            a.pause_max_ms,
            (a.max_dirty_pages * 4096) >> 20,
            (a.limit_pages * 4096) >> 20
        );
    }
    outln!(out);
    outln!(
        out,
        "the kernel's design: dirty pages settle around the setpoint, pauses stay under 200 ms (max_pause), and writers share the disk's bandwidth"
    );
    out
}

pub fn print_dirty(e: &Experiment<DirtyArm>) {
    print!("{}", table_dirty(e));
}
