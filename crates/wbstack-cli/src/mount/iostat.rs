//! `wbstack iostat DIR [INTERVAL]`: iostat -x's columns for a mounted volume, from its
//! control directory's `diskstats`, plus dirty and writeback pages and wbt's step.

use serde::Serialize;
use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};
use wbstack::block::stats::DiskStats;

/// One interval's figures, iostat -x's names.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct IostatLine {
    pub r_s: f64,
    pub w_s: f64,
    pub rkb_s: f64,
    pub wkb_s: f64,
    pub rrqm_s: f64,
    pub wrqm_s: f64,
    pub r_await: f64,
    pub w_await: f64,
    pub aqu_sz: f64,
    pub rareq_sz: f64,
    pub wareq_sz: f64,
    pub util_pct: f64,
    pub f_s: f64,
    pub dirty_pages: u64,
    pub writeback_pages: u64,
    pub wbt_step: i64,
}

/// iostat -x's arithmetic over a diskstats delta taken `secs` apart.
pub fn compute(d: &DiskStats, secs: f64, stat: &HashMap<String, i64>) -> IostatLine {
    let per = |v: u64| v as f64 / secs;
    let avg = |num: f64, den: u64| if den == 0 { 0.0 } else { num / den as f64 };
    IostatLine {
        r_s: per(d.ios[0]),
        w_s: per(d.ios[1]),
        rkb_s: per(d.sectors[0]) / 2.0,
        wkb_s: per(d.sectors[1]) / 2.0,
        rrqm_s: per(d.merges[0]),
        wrqm_s: per(d.merges[1]),
        r_await: avg(d.nsecs[0] as f64 / 1e6, d.ios[0]),
        w_await: avg(d.nsecs[1] as f64 / 1e6, d.ios[1]),
        aqu_sz: d.time_in_queue_ms as f64 / (secs * 1000.0),
        rareq_sz: avg(d.sectors[0] as f64 / 2.0, d.ios[0]),
        wareq_sz: avg(d.sectors[1] as f64 / 2.0, d.ios[1]),
        util_pct: (d.io_ticks_ms as f64 / (secs * 10.0)).min(100.0),
        f_s: per(d.ios[3]),
        dirty_pages: stat.get("nr_dirty").copied().unwrap_or(0).max(0) as u64,
        writeback_pages: stat.get("nr_writeback").copied().unwrap_or(0).max(0) as u64,
        wbt_step: stat.get("wbt_scale_step").copied().unwrap_or(0),
    }
}

pub fn parse_stat(text: &str) -> HashMap<String, i64> {
    text.lines()
        .filter_map(|l| l.split_once(' '))
        .filter_map(|(k, v)| v.trim().parse().ok().map(|v| (k.to_string(), v)))
        .collect()
}

fn read(dir: &Path) -> Result<(DiskStats, HashMap<String, i64>), String> {
    let base = dir.join(".wbstack");
    let ds = std::fs::read_to_string(base.join("diskstats"))
        .map_err(|e| format!("{}: not a wbstack mount ({e})", dir.display()))?;
    let d = DiskStats::parse(ds.trim())?;
    let st = std::fs::read_to_string(base.join("stat")).map_err(|e| e.to_string())?;
    Ok((d, parse_stat(&st)))
}

pub const HEADER: &str = "Device       r/s      w/s     rkB/s     wkB/s  rrqm/s  wrqm/s r_await w_await aqu-sz rareq-sz wareq-sz  %util     f/s    dirty writeback wbt_step";

pub fn format(l: &IostatLine) -> String {
    format!(
        "wbs0   {:>9.1} {:>8.1} {:>9.1} {:>9.1} {:>7.1} {:>7.1} {:>7.2} {:>7.2} {:>6.2} {:>8.1} {:>8.1} {:>6.1} {:>7.1} {:>8} {:>9} {:>8}",
        l.r_s, l.w_s, l.rkb_s, l.wkb_s, l.rrqm_s, l.wrqm_s, l.r_await, l.w_await, l.aqu_sz,
        l.rareq_sz, l.wareq_sz, l.util_pct, l.f_s, l.dirty_pages, l.writeback_pages, l.wbt_step
    )
}

/// Print a line per interval, `count` times (forever when None).
pub fn run(dir: &Path, interval: Duration, count: Option<u64>, json: bool) -> Result<(), String> {
    let (mut prev, _) = read(dir)?;
    let mut t0 = Instant::now();
    if !json {
        println!("{HEADER}");
    }
    let mut n = 0;
    while count.is_none_or(|c| n < c) {
        std::thread::sleep(interval);
        let (cur, stat) = read(dir)?;
        let now = Instant::now();
        let l = compute(&cur.delta(&prev), (now - t0).as_secs_f64(), &stat);
        if json {
            println!("{}", serde_json::to_string(&l).map_err(|e| e.to_string())?);
        } else {
            println!("{}", format(&l));
        }
        prev = cur;
        t0 = now;
        n += 1;
    }
    Ok(())
}
