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
            eprint!("\r  plug: writeback_plug={}   ", u8::from(on));
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
        eprint!("\r{:40}\r", "");
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
            eprint!("\r  expire: expire_first={}   ", u8::from(on));
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
        eprint!("\r{:40}\r", "");
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
