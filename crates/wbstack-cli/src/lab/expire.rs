//! Seed 001 (expire_first): tar and dd at once, with expired inodes written first or not.

use crate::benchfs::BenchFs;
use crate::lab::{pct, Experiment, LabOpts};
use crate::tardd::{self, TarSource, TarddOpts};
use crate::volfs;
use serde::Serialize;
use std::sync::Arc;

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
