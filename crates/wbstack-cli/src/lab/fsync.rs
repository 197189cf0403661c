//! Seed 004: fs_mark with fsync, group commit and async flush.

use crate::bench::benchfs::BenchFs;
use crate::bench::fsmark::{self, FsmarkOpts, FsmarkReport, SyncMethod};
use crate::bench::meter::Meter;
use crate::bench::volfs;
use crate::lab::plots::{Plot, PlotKind};
use crate::lab::ArmRun;
use crate::lab::{fmt_int, outln, Experiment, LabOpts};
use serde::Serialize;
use std::sync::Arc;

/// The window of every count in an arm and of every ratio or rate made from them:
/// fs_mark's loops and its final sync, the time `wall_s` measures, and not the untimed
/// unlinks between loops (`bench fsmark`'s totals, so the arm's command shows the same).
pub const FSYNC_WINDOW: &str = "loops_and_final_sync";

#[derive(Serialize, Clone, Debug)]
pub struct FsyncArm {
    pub name: String,
    /// fs_mark's -S: "0", "1" or "A".
    pub sync: String,
    pub threads: usize,
    /// The mount's journal_data_kb (0: ordered data; the lab states it in every arm).
    pub journal_data_kb: u64,
    /// The mount's commit_flush=always: every commit flushes (the behaviour before
    /// commits flushed only when a write completed since the last flush).
    pub commit_flush_always: bool,
    /// The mount's logbufs: journal writes in flight at once.
    pub logbufs: usize,
    /// What the counts below cover: [`FSYNC_WINDOW`].
    pub window: &'static str,
    pub files: u64,
    /// fs_mark's average files/s over the loops.
    pub files_per_sec: f64,
    pub files_per_sec_incl_sync: f64,
    /// fs_mark's files/s in the last loop: the sustained-writeback phase, with more
    /// files written than the page cache holds.
    pub last_loop_files_per_sec: f64,
    /// fsync calls (-S1) or asynchronous flushes (-A).
    pub fsyncs: u64,
    /// Cache flushes the device completed (empty flushes and PREFLUSH writes, counted
    /// as diskstats counts them).
    pub device_flushes: u64,
    /// fsyncs / device_flushes.
    pub fsyncs_per_flush: f64,
    pub journal_commits: u64,
    /// Write requests the device completed.
    pub write_ios: u64,
    /// write_ios / wall_s.
    pub write_iops: f64,
    /// fsyncs retired per device IO, fsyncs / (write_ios + device_flushes): the seed's
    /// "10 per IO".
    pub fsyncs_per_device_io: f64,
    pub cpu_s: f64,
    /// The window's time.
    pub wall_s: f64,
}

/// An arm's figures from its fs_mark run, each count over [`FSYNC_WINDOW`]: fs_mark
/// counts them all over the window it times. (They were taken over different windows
/// before: the device's from the format to the end of the run, unlinks included, the
/// commits since the mount, fs_mark's over its own, so their ratios were off.)
fn arm_figures(arm: &ArmSpec, r: &FsmarkReport) -> Result<FsyncArm, String> {
    let t = &r.totals;
    let missing = |what: &str| format!("fsync {}: fs_mark counted no {what}", arm.name);
    let write_ios = t.write_ios.ok_or_else(|| missing("device writes"))?;
    let flushes = t.flushes.ok_or_else(|| missing("device flushes"))?;
    let commits = t
        .journal_commits
        .ok_or_else(|| missing("journal commits"))?;
    Ok(FsyncArm {
        name: arm.name.into(),
        sync: sync_flag(arm.sync).into(),
        threads: arm.threads,
        journal_data_kb: arm.journal_data_kb,
        commit_flush_always: arm.commit_flush_always,
        logbufs: arm.logbufs,
        window: FSYNC_WINDOW,
        files: t.files,
        files_per_sec: t.files_per_sec,
        files_per_sec_incl_sync: t.files_per_sec_incl_sync,
        last_loop_files_per_sec: r.loops.last().map_or(0.0, |l| l.files_per_sec),
        fsyncs: t.fsyncs,
        device_flushes: flushes,
        fsyncs_per_flush: t.fsyncs as f64 / flushes.max(1) as f64,
        journal_commits: commits,
        write_ios,
        write_iops: write_ios as f64 / t.wall_s.max(1e-9),
        fsyncs_per_device_io: t.fsyncs as f64 / (write_ios + flushes).max(1) as f64,
        cpu_s: t.cpu_s,
        wall_s: t.wall_s,
    })
}

fn sync_flag(sync: SyncMethod) -> &'static str {
    match sync {
        SyncMethod::None => "0",
        SyncMethod::Fsync => "1",
        SyncMethod::Async => "A",
    }
}

/// The device of seed 004's sketch: an SSD with a volatile cache (each flush costs
/// flush_lat) behind a 27,000-IOPS controller.
pub const FSYNC_DEVICE: &str = "sim:ssd,size=32G,seed=1";
/// journal_data_kb of the journaled-data arms.
pub const FSYNC_JDATA_KB: u64 = 64;
/// Asynchronous flushes each thread keeps in flight in the -A arm: an aio ring's worth.
pub const FSYNC_ASYNC_DEPTH: usize = 1024;

/// One arm of the experiment: fs_mark's sync method and threads, and the mount's
/// journal settings.
struct ArmSpec {
    name: &'static str,
    sync: SyncMethod,
    threads: usize,
    journal_data_kb: u64,
    commit_flush_always: bool,
    logbufs: usize,
}

impl ArmSpec {
    const fn new(name: &'static str, sync: SyncMethod, threads: usize) -> ArmSpec {
        ArmSpec {
            name,
            sync,
            threads,
            journal_data_kb: 0,
            commit_flush_always: false,
            logbufs: wbstack::fs::volume::DEFAULT_LOGBUFS,
        }
    }
    const fn jdata(mut self) -> ArmSpec {
        self.journal_data_kb = FSYNC_JDATA_KB;
        self
    }
}

/// Seed 004: fs_mark of 4 KiB files with 8 threads at -S0, -S1 and -A, and 1 thread at
/// -S1, each on a fresh volume.
pub fn fsync(o: &LabOpts) -> Result<Experiment<FsyncArm>, String> {
    // The page cache holds a quarter of what the 8-thread arms write, so the last loop
    // runs in the seed's sustained-writeback phase (dirty pages at the thresholds,
    // writeback setting the pace) rather than filling an empty cache.
    let (files, loops, cache) = if o.full {
        // A million files from 8 threads, four times the cache: the seed's sustained
        // writeback phase for most of the run.
        (62_500u64, 2u32, "1G")
    } else if o.quick {
        (2_000u64, 2u32, "32M")
    } else {
        (10_000, 2, "160M")
    };
    let mut mount = wbstack::fs::MountOptions::default();
    mount
        .parse(&format!("cache_size={cache}"))
        .map_err(|e| e.to_string())?;
    // The j arms: the same -S1 runs with journaled data (fs::jdata), each fsync's data
    // carried in its commit; S1-8jf with commit_flush=always, every commit a flush;
    // S1-8j1 with logbufs=1, each commit written only once the one before finished.
    let arms_spec = [
        ArmSpec::new("S0-8", SyncMethod::None, 8),
        ArmSpec::new("S1-8", SyncMethod::Fsync, 8),
        ArmSpec::new("A-8", SyncMethod::Async, 8),
        ArmSpec::new("S1-1", SyncMethod::Fsync, 1),
        ArmSpec::new("S1-8j", SyncMethod::Fsync, 8).jdata(),
        ArmSpec {
            commit_flush_always: true,
            ..ArmSpec::new("S1-8jf", SyncMethod::Fsync, 8).jdata()
        },
        ArmSpec {
            logbufs: 1,
            ..ArmSpec::new("S1-8j1", SyncMethod::Fsync, 8).jdata()
        },
        ArmSpec::new("S1-1j", SyncMethod::Fsync, 1).jdata(),
    ];
    let mut arms = Vec::new();
    let mut timelines = Vec::new();
    let mut commands = Vec::new();
    for arm in arms_spec {
        let ArmSpec {
            name,
            sync,
            threads,
            journal_data_kb: jdata_kb,
            commit_flush_always: flush_always,
            logbufs,
        } = arm;
        let mopts = wbstack::fs::MountOptions {
            journal_data_kb: jdata_kb,
            commit_flush_always: flush_always,
            logbufs,
            ..mount.clone()
        };
        let vfs = Arc::new(volfs::VolumeFs::format(FSYNC_DEVICE, mopts)?);
        // The 1-thread arm writes as many files per thread as the others in total would
        // take too long at fsync speed: a quarter of one thread's share is enough to
        // measure its rate.
        let per_thread = if threads == 1 { files / 4 } else { files };
        let opts = FsmarkOpts {
            dirs: (0..threads).map(|i| i.to_string()).collect(),
            subdirs: 100,
            files: per_thread,
            size: 4096,
            loops,
            sync,
            async_depth: FSYNC_ASYNC_DEPTH,
            final_sync: true,
            ..Default::default()
        };
        let sync_flag = sync_flag(sync);
        commands.push(format!(
            "wbstack bench fsmark --device {FSYNC_DEVICE} -o cache_size={cache},journal_data_kb={jdata_kb},logbufs={logbufs}{} {} -D 100 -S{sync_flag} -n {per_thread} -s 4096 -L {loops}{}",
            if flush_always { ",commit_flush=always" } else { "" },
            (0..threads).map(|i| format!("-d {i}")).collect::<Vec<_>>().join(" "),
            if sync == SyncMethod::Async { format!(" --async-depth {FSYNC_ASYNC_DEPTH}") } else { String::new() }
        ));
        let run = ArmRun::start(
            o,
            &format!("fsync: {name}"),
            Some(per_thread * threads as u64 * loops as u64),
            "files",
            Some(vfs.clone()),
            Meter::ops,
        );
        let opts = FsmarkOpts {
            meter: Some(run.meter.clone()),
            ..opts
        };
        let r = fsmark::run(&opts, vfs.clone() as Arc<dyn BenchFs>);
        timelines.push(run.finish());
        arms.push(arm_figures(&arm, &r?)?);
    }
    let mut rate = Plot::new(
        "fsync-rate",
        "seed 004: files/s over time",
        PlotKind::Lines,
        "time (s)",
        "files/s (log scale)",
    )
    .log_y();
    for (a, tl) in arms.iter().zip(&timelines) {
        rate = rate.series(&a.name, tl.rate("ops"));
    }
    let cats: Vec<String> = arms.iter().map(|a| a.name.clone()).collect();
    let per = |f: fn(&FsyncArm) -> f64| {
        arms.iter()
            .enumerate()
            .filter(|(_, a)| a.sync != "0")
            .map(|(i, a)| (i as f64, f(a)))
            .collect::<Vec<_>>()
    };
    let batching = Plot::new(
        "fsync-per-flush",
        "seed 004: fsyncs retired per device flush and per device IO",
        PlotKind::Bars,
        "arm",
        "fsyncs",
    )
    .categories(cats)
    .series("per device flush", per(|a| a.fsyncs_per_flush))
    .series(
        "per device IO (writes + flushes)",
        per(|a| a.fsyncs_per_device_io),
    );
    Ok(Experiment {
        plots: vec![rate, batching],
        commands,
        experiment: "fsync",
        arms,
        note: Some(format!(
            "fs_mark -D 100 -n {files} -s 4096 -L {loops} per thread (1-thread arm: {} files), {FSYNC_DEVICE} (flush 200 us, 27,000 write IOPS), page cache {cache} (a quarter of what 8 threads write); -A keeps {FSYNC_ASYNC_DEPTH} flushes in flight per thread",
            files / 4
        )),
    })
}

pub fn table_fsync(e: &Experiment<FsyncArm>) -> String {
    let mut out = String::new();
    outln!(out, "seed 004 — writeback errors, fsync batching, async flush (open-write-[flush]-close of 4 KiB files)");
    if let Some(n) = &e.note {
        outln!(out, "{n}");
    }
    outln!(
        out,
        "fsyncs, flushes, commits and the ratios and IOPS made from them: over fs_mark's loops and final sync ({FSYNC_WINDOW}), the time of \"incl sync\""
    );
    outln!(out);
    outln!(
        out,
        "{:<6} {:>7} {:>11} {:>11} {:>11} {:>8} {:>9} {:>8} {:>9} {:>9} {:>8}",
        "arm",
        "threads",
        "files/s",
        "last loop",
        "incl sync",
        "fsyncs",
        "flushes",
        "commits",
        "fsyncs/",
        "write",
        "fsyncs/"
    );
    outln!(
        out,
        "{:<6} {:>7} {:>11} {:>11} {:>11} {:>8} {:>9} {:>8} {:>9} {:>9} {:>8}",
        "",
        "",
        "(fs_mark)",
        "(sustained)",
        "",
        "",
        "(device)",
        "",
        "flush",
        "IOPS",
        "dev IO"
    );
    outln!(out, "{}", "-".repeat(108));
    for a in &e.arms {
        outln!(
            out,
            "{:<6} {:>7} {:>11} {:>11} {:>11} {:>8} {:>9} {:>8} {:>9.1} {:>9} {:>8.1}",
            a.name,
            a.threads,
            fmt_int(a.files_per_sec),
            fmt_int(a.last_loop_files_per_sec),
            fmt_int(a.files_per_sec_incl_sync),
            a.fsyncs,
            a.device_flushes,
            a.journal_commits,
            a.fsyncs_per_flush,
            fmt_int(a.write_iops),
            a.fsyncs_per_device_io
        );
    }
    outln!(out);
    outln!(
        out,
        "the seed (XFS, 8 threads, 10 million 4 KiB files, sustained writeback phase):"
    );
    outln!(out, "  -S0 ~35,000 files/s (~2,000 IOPS); -S1 ~1,000 files/s (~2 IOs per fsync); -A ~30,000 files/s, ~10 fsyncs retired per device IO");
    let get = |n: &str| e.arms.iter().find(|a| a.name == n);
    if let (Some(s0), Some(s1), Some(a), Some(one)) =
        (get("S0-8"), get("S1-8"), get("A-8"), get("S1-1"))
    {
        outln!(out);
        outln!(
                out,
            "-A: {:.0}% of -S0's files/s in the sustained last loop, {:.0}% including the final sync ({:.0}% of fs_mark's rate); {:.1} fsyncs per device flush; 8-thread -S1 is {:.1}x 1-thread -S1",
            a.last_loop_files_per_sec / s0.last_loop_files_per_sec.max(1e-9) * 100.0,
            a.files_per_sec_incl_sync / s0.files_per_sec_incl_sync.max(1e-9) * 100.0,
            a.files_per_sec / s0.files_per_sec.max(1e-9) * 100.0,
            a.fsyncs_per_flush,
            s1.files_per_sec / one.files_per_sec.max(1e-9)
        );
    }
    if let (Some(s1), Some(one), Some(j8), Some(j1)) =
        (get("S1-8"), get("S1-1"), get("S1-8j"), get("S1-1j"))
    {
        outln!(
                out,
            "journal_data_kb={FSYNC_JDATA_KB} (the j arms): 8-thread -S1 is {:.1}x 1-thread -S1 (ordered data: {:.1}x), {:.1} fsyncs per device IO (ordered: {:.1}); files/s {:.2}x and {:.2}x ordered data's (8 and 1 thread)",
            j8.files_per_sec / j1.files_per_sec.max(1e-9),
            s1.files_per_sec / one.files_per_sec.max(1e-9),
            j8.fsyncs_per_device_io,
            s1.fsyncs_per_device_io,
            j8.files_per_sec / s1.files_per_sec.max(1e-9),
            j1.files_per_sec / one.files_per_sec.max(1e-9)
        );
    }
    if let (Some(j8), Some(j1)) = (get("S1-8j"), get("S1-8j1")) {
        outln!(
            out,
            "logbufs={} (S1-8j) against 1 (S1-8j1): files/s {:.2}x ({} against {}), {} against {} commits",
            j8.logbufs,
            j8.files_per_sec / j1.files_per_sec.max(1e-9),
            fmt_int(j8.files_per_sec),
            fmt_int(j1.files_per_sec),
            j8.journal_commits,
            j1.journal_commits
        );
    }
    if let (Some(j8), Some(jf)) = (get("S1-8j"), get("S1-8jf")) {
        outln!(
            out,
            "commit_flush=needed (S1-8j) against always (S1-8jf): {:.1} against {:.1} fsyncs per device IO, {} against {} device flushes, files/s {:.2}x",
            j8.fsyncs_per_device_io,
            jf.fsyncs_per_device_io,
            j8.device_flushes,
            jf.device_flushes,
            j8.files_per_sec / jf.files_per_sec.max(1e-9)
        );
    }
    out
}

pub fn print_fsync(e: &Experiment<FsyncArm>) {
    print!("{}", table_fsync(e));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An arm's counts are fs_mark's over one window, its ratios are made of those very
    /// counts, and the table prints what the JSON holds.
    #[test]
    fn an_arms_counts_and_ratios_share_one_window_and_the_table_shows_them() {
        let arm = ArmSpec::new("S1-1", SyncMethod::Fsync, 1);
        let vfs = Arc::new(
            volfs::VolumeFs::format("sim:ssd,size=256M,seed=1", Default::default()).unwrap(),
        );
        let opts = FsmarkOpts {
            dirs: vec!["0".into()],
            subdirs: 4,
            files: 50,
            size: 4096,
            loops: 2,
            sync: SyncMethod::Fsync,
            final_sync: true,
            ..Default::default()
        };
        let r = fsmark::run(&opts, vfs.clone() as Arc<dyn BenchFs>).unwrap();
        let a = arm_figures(&arm, &r).unwrap();
        assert_eq!(a.window, FSYNC_WINDOW);
        assert_eq!((a.files, a.fsyncs), (100, 100));
        let t = &r.totals;
        assert_eq!(Some(a.write_ios), t.write_ios);
        assert_eq!(Some(a.device_flushes), t.flushes);
        assert_eq!(Some(a.journal_commits), t.journal_commits);
        assert_eq!(
            a.fsyncs_per_flush,
            a.fsyncs as f64 / a.device_flushes as f64
        );
        assert_eq!(
            a.fsyncs_per_device_io,
            a.fsyncs as f64 / (a.write_ios + a.device_flushes) as f64
        );
        // One thread: each fsync has new data of its own to write, so no device IO
        // serves two of them.
        assert!(a.fsyncs_per_device_io < 1.0, "{a:?}");
        // The window's commits, within the volume's since its mount.
        assert!(vfs.volume().journal_stats().commits >= a.journal_commits);

        let e = Experiment {
            experiment: "fsync",
            arms: vec![a.clone()],
            note: None,
            plots: Vec::new(),
            commands: Vec::new(),
        };
        let table = table_fsync(&e);
        let row = table
            .lines()
            .find(|l| l.starts_with("S1-1 "))
            .unwrap_or_else(|| panic!("no row for the arm: {table}"));
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cols[5], a.fsyncs.to_string(), "{row}");
        assert_eq!(cols[6], a.device_flushes.to_string(), "{row}");
        assert_eq!(cols[7], a.journal_commits.to_string(), "{row}");
        assert_eq!(cols[8], format!("{:.1}", a.fsyncs_per_flush), "{row}");
        assert_eq!(cols[10], format!("{:.1}", a.fsyncs_per_device_io), "{row}");
        assert!(table.contains(FSYNC_WINDOW), "{table}");
    }
}
