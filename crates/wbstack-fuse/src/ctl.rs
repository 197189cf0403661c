//! The control directory, `MOUNT/.wbstack/`, like a device's sysfs directory: one file
//! per run-time knob (`cat` reads it, `echo N >` sets it; a bad value fails the write
//! with EINVAL and keeps the old one), and read-only files: `diskstats` (the kernel's
//! line), `stat` (cache, writeback, throttling, wbt, journal and the daemon's request
//! counters, as `name value` lines like /proc/vmstat), `pid` (the daemon's), and
//! `trace` (trace events as JSON lines, streaming while it is read). The root's
//! readdir does not list it, so no workload walks into it.

use crate::counters::Counters;
use wbstack::fs::tunables::TUNABLES;
use wbstack::fs::Volume;

pub const CTL_NAME: &[u8] = b".wbstack";
/// Inode numbers far above any the volume allocates (it counts up from 2).
pub const CTL_DIR_INO: u64 = 1 << 62;

/// One file of the control directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CtlFile {
    Knob(&'static str),
    Diskstats,
    Stat,
    Pid,
    Trace,
}

impl CtlFile {
    pub fn name(self) -> &'static str {
        match self {
            CtlFile::Knob(k) => k,
            CtlFile::Diskstats => "diskstats",
            CtlFile::Stat => "stat",
            CtlFile::Pid => "pid",
            CtlFile::Trace => "trace",
        }
    }

    pub fn writable(self) -> bool {
        matches!(self, CtlFile::Knob(_))
    }
}

/// Every file, in directory order, with its inode number.
pub fn files() -> Vec<(u64, CtlFile)> {
    let fixed = [CtlFile::Diskstats, CtlFile::Stat, CtlFile::Pid, CtlFile::Trace];
    TUNABLES
        .iter()
        .map(|k| CtlFile::Knob(k))
        .chain(fixed)
        .enumerate()
        .map(|(i, f)| (CTL_DIR_INO + 1 + i as u64, f))
        .collect()
}

pub fn is_ctl(ino: u64) -> bool {
    ino >= CTL_DIR_INO
}

pub fn by_ino(ino: u64) -> Option<CtlFile> {
    files().into_iter().find(|(i, _)| *i == ino).map(|(_, f)| f)
}

pub fn by_name(name: &[u8]) -> Option<(u64, CtlFile)> {
    files().into_iter().find(|(_, f)| f.name().as_bytes() == name)
}

/// What reading the file shows now (`trace` streams instead; see the front end).
pub fn content(vol: &Volume, counters: &Counters, f: CtlFile) -> Result<Vec<u8>, String> {
    Ok(match f {
        CtlFile::Knob(k) => format!("{}\n", vol.tunable(k).map_err(|e| e.to_string())?),
        CtlFile::Diskstats => format!("{}\n", vol.queue().diskstats().line(254, 0, "wbs0")),
        CtlFile::Pid => format!("{}\n", std::process::id()),
        CtlFile::Stat => stat(vol, counters),
        CtlFile::Trace => String::new(),
    }
    .into_bytes())
}

fn stat(vol: &Volume, counters: &Counters) -> String {
    let cache = vol.cache();
    let bdi = vol.bdi();
    let wb = bdi.stats();
    let (limit, bg) = bdi.thresholds();
    let wbt = vol.queue().wbt_state();
    let j = vol.journal_stats();
    let mut lines = vec![
        ("nr_cache_pages", cache.nr_pages()),
        ("cache_capacity_pages", cache.capacity_pages()),
        ("nr_dirty", cache.nr_dirty()),
        ("nr_writeback", cache.nr_writeback()),
        ("dirty_background_thresh", bg),
        ("dirty_thresh", limit),
        ("wb_passes", wb.passes),
        ("wb_pages_written", wb.pages_written),
        ("wb_write_bandwidth", wb.write_bandwidth),
        ("wb_dirty_ratelimit", wb.dirty_ratelimit),
        ("throttle_pauses", wb.pauses),
        ("throttle_pause_ms_total", wb.pause_ns_total / 1_000_000),
        ("throttle_pause_ms_max", wb.pause_ns_max / 1_000_000),
        ("write_errors", bdi.write_errors()),
        ("wbt_enabled", u64::from(wbt.enabled)),
        ("wbt_lat_usec", wbt.min_lat_nsec / 1000),
        ("wbt_queue_depth", u64::from(wbt.queue_depth)),
        ("wbt_wb_normal", u64::from(wbt.wb_normal)),
        ("wbt_wb_background", u64::from(wbt.wb_background)),
        ("journal_commits", j.commits),
        ("journal_checkpoints", j.checkpoints),
        ("journal_flushes", j.flushes),
        ("journal_bytes", j.bytes),
        ("journal_sync_waits", j.sync_waits),
        ("fuse_requests", counters.total()),
    ];
    let ops: Vec<(String, u64)> = counters
        .snapshot()
        .into_iter()
        .map(|(n, c)| (format!("fuse_{n}"), c))
        .collect();
    let mut s = String::new();
    lines.sort_by_key(|(n, _)| *n == "fuse_requests");
    for (n, v) in lines {
        s.push_str(&format!("{n} {v}\n"));
    }
    // A signed step, unlike the counters above.
    s.push_str(&format!("wbt_scale_step {}\n", wbt.scale_step));
    for (n, v) in ops {
        s.push_str(&format!("{n} {v}\n"));
    }
    s
}

/// Apply a write to a knob file: the first line of `data`, trimmed.
pub fn write(vol: &Volume, f: CtlFile, data: &[u8]) -> Result<(), String> {
    let CtlFile::Knob(k) = f else {
        return Err(format!("{} is read-only", f.name()));
    };
    let text = std::str::from_utf8(data).map_err(|_| "not UTF-8".to_string())?;
    let value = text.lines().next().unwrap_or("").trim();
    vol.set_tunable(k, value).map_err(|e| e.to_string())
}
