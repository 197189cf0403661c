//! The lab experiments on wbstack's filesystem: seed 000 (writeback_plug) and seed 001
//! (expire_first). Each runs both arms in one process on fresh simulated devices and
//! prints the thread's table shape beside the thread's own figures.

use crate::benchfs::BenchFs;
use crate::fsmark::{self, FsmarkOpts, SyncMethod};
use crate::lab::{Experiment, LabOpts};
use crate::tardd::{self, TarSource, TarddOpts};
use crate::volfs;
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;

fn pct(new: f64, old: f64) -> String {
    if old == 0.0 {
        return "-".into();
    }
    format!("{:+.1}%", (new / old - 1.0) * 100.0)
}

fn fmt_int(v: f64) -> String {
    let s = format!("{:.0}", v);
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 && c != '-' {
            out.push(',');
        }
        out.push(c);
    }
    out
}

// ---- seed 000: writeback_plug ----------------------------------------------------------

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
pub const PLUG_DEVICE: &str = "sim:ssd,size=32G,iops=27000";

/// Seed 000: fs_mark, 2 threads, 4 KiB files, no sync, with writeback_plug on and off.
/// The page cache is small against the files written, so most of the run is in the
/// "sustained IO-bound" phase where writeback sets the pace, as in the seed.
pub fn plug(o: &LabOpts) -> Result<Experiment<PlugArm>, String> {
    let (files, loops, cache) = if o.quick {
        (10_000, 2, "128M")
    } else {
        (25_000, 4, "512M")
    };
    let mut arms = Vec::new();
    for on in [false, true] {
        if !o.json {
            crate::util::status(&format!("  plug: writeback_plug={}", u8::from(on)));
        }
        let fs = volfs::open(
            PLUG_DEVICE,
            &format!("writeback_plug={},cache_size={cache}", u8::from(on)),
        )?;
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
        let r = fsmark::run(&opts, fs)?;
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
    if !o.json {
        crate::util::status_done();
    }
    Ok(Experiment {
        experiment: "plug",
        arms,
        note: Some(format!(
            "fs_mark -d 0 -d 1 -D 100 -S0 -n {files} -s 4096 -L {loops}, page cache {cache}, {PLUG_DEVICE}; wall and files/s include the final sync"
        )),
    })
}

pub fn print_plug(e: &Experiment<PlugArm>) {
    println!("seed 000 — writeback: plug writeback at a high level");
    if let Some(n) = &e.note {
        println!("{n}");
    }
    println!();
    println!(
        "{:<12} {:>7} {:>7} {:>13} {:>13} {:>8} {:>11} {:>9}",
        "", "wall", "CPU", "create rate", "incl. sync", "write", "bandwidth", "avg write"
    );
    println!(
        "{:<12} {:>7} {:>7} {:>13} {:>13} {:>8} {:>11} {:>9}",
        "", "time", "", "(avg files/s)", "(files/s)", "IOPS", "", "size"
    );
    println!("{}", "-".repeat(88));
    let row = |label: &str, a: &PlugArm| {
        println!(
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
        row("unpatched", a);
    }
    if let Some(a) = on {
        row("patched", a);
    }
    if let (Some(off), Some(on)) = (off, on) {
        println!(
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
        println!();
        println!(
            "the seed (8 threads, 100 TB sparse XFS on 4 SSDs behind a 27,000-IOPS controller):"
        );
        println!("  2013 improvement  -26.44%  -14.68%  +36.67% (24,000 -> 32,800)   -94.23% (26,000 -> 1,500)  +38.46% (130 -> 180 MB/s)");
        println!("  2014 improvement  -43.8%   -13.3%   +62.7%  (32,500 -> 52,900)   -94.6%  (28,000 -> 1,500)  +86.6%  (150 -> 280 MB/s)");
        println!();
        println!(
            "physical write IOPS with the plug: {:.1}% of without; average write {:.0} KiB; files/s {:.2}x",
            on.write_iops / off.write_iops.max(1e-9) * 100.0,
            on.avg_write_kib,
            on.files_per_sec / off.files_per_sec.max(1e-9)
        );
    }
}

// ---- seed 001: expire_first ------------------------------------------------------------

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
pub const EXPIRE_DEVICE: &str = "sim:hdd,size=64G";

/// Seed 001: tar (a synthetic source tree) and dd at once, expire_first on and off,
/// on a simulated disk with a page cache of 3 GiB as in the thread.
pub fn expire(o: &LabOpts) -> Result<Experiment<ExpireArm>, String> {
    let (files, dd, cache) = if o.quick {
        (20_000usize, 1u64 << 30, "1G")
    } else {
        (26_000, 3u64 << 30, "3G")
    };
    let mut arms = Vec::new();
    for on in [false, true] {
        if !o.json {
            crate::util::status(&format!("  expire: expire_first={}", u8::from(on)));
        }
        let fs: Arc<dyn BenchFs> = volfs::open(
            EXPIRE_DEVICE,
            &format!("expire_first={},cache_size={cache}", u8::from(on)),
        )?;
        let opts = TarddOpts {
            source: TarSource::Synthetic { files, seed: 1 },
            dd_size: dd,
            ..Default::default()
        };
        let r = tardd::run(&opts, fs)?;
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
    if !o.json {
        crate::util::status_done();
    }
    Ok(Experiment {
        experiment: "expire",
        arms,
        note: Some(format!(
            "tar -x of a synthetic tree of {files} files and dd bs=1M of {} MiB at once, then sync; page cache {cache}, {EXPIRE_DEVICE}",
            dd >> 20
        )),
    })
}

pub fn print_expire(e: &Experiment<ExpireArm>) {
    println!("seed 001 — writeback: sync expired inodes first in background writeback");
    if let Some(n) = &e.note {
        println!("{n}");
    }
    println!();
    println!(
        "{:<14} {:>8} {:>8} {:>10} {:>13} {:>16} {:>9}",
        "expire_first", "tar s", "dd s", "total s", "max rounds", "max first-write", "rounds"
    );
    println!(
        "{:<14} {:>8} {:>8} {:>10} {:>13} {:>16} {:>9}",
        "", "", "", "incl sync", "waited", "delay s", ""
    );
    println!("{}", "-".repeat(84));
    for a in &e.arms {
        println!(
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
    println!();
    println!(
        "the seed (XFS on a disk, 3 GB RAM, tar jxf linux-2.6.38.3 + dd 1000 MiB, mean of 5):"
    );
    println!("  without: tar 29.00 s, dd 14.53 s; with: tar 26.77 s, dd 13.36 s; tar+dd+sync 244.36 s vs 239.91 s for all 5");
    if let (Some(off), Some(on)) = (
        e.arms.iter().find(|a| !a.expire_first),
        e.arms.iter().find(|a| a.expire_first),
    ) {
        println!();
        println!(
            "with expire_first: total {} ({:.2} s vs {:.2} s), longest wait {} round(s) vs {}",
            pct(on.total_s, off.total_s),
            on.total_s,
            off.total_s,
            on.max_rounds_waited,
            off.max_rounds_waited
        );
    }
}

// ---- seed 004: fsync, group commit and async flush ----------------------------------

#[derive(Serialize, Clone, Debug)]
pub struct FsyncArm {
    pub name: String,
    /// fs_mark's -S: "0", "1" or "A".
    pub sync: String,
    pub threads: usize,
    /// The mount's journal_data_kb (0: ordered data, the default).
    pub journal_data_kb: u64,
    pub files: u64,
    /// fs_mark's average files/s over the loops.
    pub files_per_sec: f64,
    pub files_per_sec_incl_sync: f64,
    /// fs_mark's files/s in the last loop: the sustained-writeback phase, with more
    /// files written than the page cache holds.
    pub last_loop_files_per_sec: f64,
    /// fsync calls (-S1) or asynchronous flushes (-A).
    pub fsyncs: u64,
    /// Cache flushes the device executed (empty flushes and PREFLUSH writes).
    pub device_flushes: u64,
    pub fsyncs_per_flush: f64,
    pub journal_commits: u64,
    pub write_ios: u64,
    pub write_iops: f64,
    /// fsyncs retired per device IO (writes + flushes), the seed's "10 per IO".
    pub fsyncs_per_device_io: f64,
    pub cpu_s: f64,
    pub wall_s: f64,
}

/// The device of seed 004's sketch: an SSD with a volatile cache (each flush costs
/// flush_lat) behind a 27,000-IOPS controller.
pub const FSYNC_DEVICE: &str = "sim:ssd,size=32G";
/// journal_data_kb of the journaled-data arms.
pub const FSYNC_JDATA_KB: u64 = 64;
/// Asynchronous flushes each thread keeps in flight in the -A arm: an aio ring's worth.
pub const FSYNC_ASYNC_DEPTH: usize = 1024;

/// Seed 004: fs_mark of 4 KiB files with 8 threads at -S0, -S1 and -A, and 1 thread at
/// -S1, each on a fresh volume.
pub fn fsync(o: &LabOpts) -> Result<Experiment<FsyncArm>, String> {
    use wbstack::dev::sim::SimDevice;
    // The page cache holds a quarter of what the 8-thread arms write, so the last loop
    // runs in the seed's sustained-writeback phase (dirty pages at the thresholds,
    // writeback setting the pace) rather than filling an empty cache.
    let (files, loops, cache) = if o.quick {
        (2_000u64, 2u32, "32M")
    } else {
        (10_000, 2, "160M")
    };
    let mut mount = wbstack::fs::MountOptions::default();
    mount
        .parse(&format!("cache_size={cache}"))
        .map_err(|e| e.to_string())?;
    // The last two arms: the same -S1 runs with journaled data (fs::jdata), each
    // fsync's data carried in its commit.
    let arms_spec: [(&str, SyncMethod, usize, u64); 6] = [
        ("S0-8", SyncMethod::None, 8, 0),
        ("S1-8", SyncMethod::Fsync, 8, 0),
        ("A-8", SyncMethod::Async, 8, 0),
        ("S1-1", SyncMethod::Fsync, 1, 0),
        ("S1-8j", SyncMethod::Fsync, 8, FSYNC_JDATA_KB),
        ("S1-1j", SyncMethod::Fsync, 1, FSYNC_JDATA_KB),
    ];
    let mut arms = Vec::new();
    for (name, sync, threads, jdata_kb) in arms_spec {
        if !o.json {
            crate::util::status(&format!("  fsync: {name}"));
        }
        let mopts = wbstack::fs::MountOptions {
            journal_data_kb: jdata_kb,
            ..mount.clone()
        };
        let vfs = Arc::new(volfs::VolumeFs::format(FSYNC_DEVICE, mopts)?);
        let q = vfs.volume().queue().clone();
        let sim = || {
            q.device()
                .as_any()
                .downcast_ref::<SimDevice>()
                .map(|s| s.stats())
                .unwrap_or_default()
        };
        let before = sim();
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
        let r = fsmark::run(&opts, vfs.clone() as Arc<dyn BenchFs>)?;
        let after = sim();
        let t = &r.totals;
        let flushes = after.flushes - before.flushes;
        let device_ios = (after.writes - before.writes) + flushes;
        arms.push(FsyncArm {
            name: name.into(),
            sync: match sync {
                SyncMethod::None => "0",
                SyncMethod::Fsync => "1",
                SyncMethod::Async => "A",
            }
            .into(),
            threads,
            journal_data_kb: jdata_kb,
            files: t.files,
            files_per_sec: t.files_per_sec,
            files_per_sec_incl_sync: t.files_per_sec_incl_sync,
            last_loop_files_per_sec: r.loops.last().map_or(0.0, |l| l.files_per_sec),
            fsyncs: t.fsyncs,
            device_flushes: flushes,
            fsyncs_per_flush: t.fsyncs as f64 / flushes.max(1) as f64,
            journal_commits: vfs.volume().journal_stats().commits,
            write_ios: t.write_ios.unwrap_or(0),
            write_iops: t.write_iops.unwrap_or(0.0),
            fsyncs_per_device_io: t.fsyncs as f64 / device_ios.max(1) as f64,
            cpu_s: t.cpu_s,
            wall_s: t.wall_s,
        });
    }
    if !o.json {
        crate::util::status_done();
    }
    Ok(Experiment {
        experiment: "fsync",
        arms,
        note: Some(format!(
            "fs_mark -D 100 -n {files} -s 4096 -L {loops} per thread (1-thread arm: {} files), {FSYNC_DEVICE} (flush 200 us, 27,000 write IOPS), page cache {cache} (a quarter of what 8 threads write); -A keeps {FSYNC_ASYNC_DEPTH} flushes in flight per thread",
            files / 4
        )),
    })
}

pub fn print_fsync(e: &Experiment<FsyncArm>) {
    println!("seed 004 — writeback errors, fsync batching, async flush (open-write-[flush]-close of 4 KiB files)");
    if let Some(n) = &e.note {
        println!("{n}");
    }
    println!();
    println!(
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
    println!(
        "{:<6} {:>7} {:>11} {:>11} {:>11} {:>8} {:>9} {:>8} {:>9} {:>9} {:>8}",
        "", "", "(fs_mark)", "(sustained)", "", "", "(device)", "", "flush", "IOPS", "dev IO"
    );
    println!("{}", "-".repeat(108));
    for a in &e.arms {
        println!(
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
    println!();
    println!("the seed (XFS, 8 threads, 10 million 4 KiB files, sustained writeback phase):");
    println!("  -S0 ~35,000 files/s (~2,000 IOPS); -S1 ~1,000 files/s (~2 IOs per fsync); -A ~30,000 files/s, ~10 fsyncs retired per device IO");
    let get = |n: &str| e.arms.iter().find(|a| a.name == n);
    if let (Some(s0), Some(s1), Some(a), Some(one)) =
        (get("S0-8"), get("S1-8"), get("A-8"), get("S1-1"))
    {
        println!();
        println!(
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
        println!(
            "journal_data_kb={FSYNC_JDATA_KB} (the j arms): 8-thread -S1 is {:.1}x 1-thread -S1 (ordered data: {:.1}x), {:.1} fsyncs per device IO (ordered: {:.1}); files/s {:.2}x and {:.2}x ordered data's (8 and 1 thread)",
            j8.files_per_sec / j1.files_per_sec.max(1e-9),
            s1.files_per_sec / one.files_per_sec.max(1e-9),
            j8.fsyncs_per_device_io,
            s1.fsyncs_per_device_io,
            j8.files_per_sec / s1.files_per_sec.max(1e-9),
            j1.files_per_sec / one.files_per_sec.max(1e-9)
        );
    }
}

// ---- seed 003: writeback throttling --------------------------------------------------

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
    pub figures: crate::readlat::ReadlatFigures,
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
    use crate::readlat::{self, ReadlatOpts};
    // (device, default target, scenario, read bytes, dd bytes)
    let delay = Duration::from_millis(if o.quick { 100 } else { 300 });
    let runs: Vec<(&str, u64, &'static str, u64, u64)> = if o.quick {
        vec![
            (
                "sim:hdd,size=64G,data=meta",
                75_000,
                "dirty_set",
                32 << 20,
                512 << 20,
            ),
            (
                "sim:ssd,size=64G,data=meta",
                2_000,
                "dirty_set",
                64 << 20,
                512 << 20,
            ),
            (
                "sim:ssd,size=64G,data=meta",
                2_000,
                "flood",
                64 << 20,
                1 << 30,
            ),
        ]
    } else {
        vec![
            (
                "sim:hdd,size=64G,data=meta",
                75_000,
                "dirty_set",
                128 << 20,
                2 << 30,
            ),
            (
                "sim:ssd,size=64G,data=meta",
                2_000,
                "dirty_set",
                256 << 20,
                2 << 30,
            ),
            (
                "sim:ssd,size=64G,data=meta",
                2_000,
                "flood",
                256 << 20,
                2 << 30,
            ),
        ]
    };
    let mut arms = Vec::new();
    for (dev, default_lat, scenario, read, dd) in runs {
        for (wbt, wbt_opts) in WBT_ARMS {
            let kind = dev.split(',').next().unwrap_or(dev);
            crate::util::status(&format!("  wbt: {kind} {scenario} wbt {wbt}"));
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
            let fs = volfs::open(dev, &mount)?;
            let opts = ReadlatOpts {
                size: read,
                background_dd: dd,
                dd_delay: if scenario == "dirty_set" {
                    delay
                } else {
                    Duration::ZERO
                },
                ..Default::default()
            };
            let r = readlat::run(&opts, fs)?;
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
    crate::util::status_done();
    Ok(Experiment {
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

pub fn print_wbt(e: &Experiment<WbtArm>) {
    println!("seed 003 — writeback throttling: reads under heavy background writeback");
    if let Some(n) = &e.note {
        println!("{n}");
    }
    println!();
    println!(
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
    println!(
        "{:<26} {:>7} {:>8} {:>8} {:>8} {:>5} {:>8} {:>8} {:>7} {:>7} {:>5}",
        "", "usec", "usec", "usec", "usec", "", "usec", "p99.99", "KB/s", "MiB/s", ""
    );
    println!("{}", "-".repeat(109));
    for a in &e.arms {
        println!(
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
    println!();
    println!("the seed (read-to-pipe-async of a 9 GB file to gzip, 75% of memory in CPU hogs):");
    println!("  off: p99 54 us, p99.99 17,952 us, Over=333, max 215,367 us; writers p99.99 1,142 us; read 88,988 KB/s, write 60,019 KB/s");
    println!("  on:  p99 55 us, p99.99  2,652 us, Over=1,   max  10,221 us; writers p99.99 1,106 us; read 95,506 KB/s, write 59,970 KB/s");
    println!("  (improvement: p99.99 0.15x, max 0.05x, Over 0.003x, write rate 100%)");
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
                println!(
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
}
