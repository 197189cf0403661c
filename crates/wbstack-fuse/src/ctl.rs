//! The control directory, `MOUNT/.wbstack/`, like a device's sysfs directory: one file
//! per run-time knob (`cat` reads it, `echo N >` sets it; a bad value fails the write
//! with EINVAL and keeps the old one), and read-only files: `diskstats` (the kernel's
//! line), `stat` (cache, writeback, throttling, wbt, journal and the daemon's request
//! counters, as `name value` lines like /proc/vmstat), `pid` (the daemon's), `trace`
//! (trace events as JSON lines, streaming while it is read), and on a simulated device
//! `faults` (its fault switches: EIO ranges, a dying device, latency spikes). One file
//! acts: a write to `sync` is the volume's syncfs (`Volume::sync`: every dirty page
//! written back, the journal committed, the device's cache flushed), since the kernel
//! sends sync(2) and syncfs(2) to no FUSE daemon (only virtiofs gets FUSE_SYNCFS); the
//! write fails with the error syncfs would return. The root's readdir does not list
//! the directory, so no workload walks into it.

use crate::counters::Counters;
use std::sync::atomic::Ordering;
use wbstack::dev::sim::SimDevice;
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
    /// A simulated device's fault switches (only on a sim device).
    Faults,
    /// Written to: syncfs of the volume.
    Sync,
}

impl CtlFile {
    pub fn name(self) -> &'static str {
        match self {
            CtlFile::Knob(k) => k,
            CtlFile::Diskstats => "diskstats",
            CtlFile::Stat => "stat",
            CtlFile::Pid => "pid",
            CtlFile::Trace => "trace",
            CtlFile::Faults => "faults",
            CtlFile::Sync => "sync",
        }
    }

    pub fn writable(self) -> bool {
        matches!(self, CtlFile::Knob(_) | CtlFile::Faults | CtlFile::Sync)
    }
}

/// Every file, in directory order, with its inode number.
pub fn files() -> Vec<(u64, CtlFile)> {
    let fixed = [
        CtlFile::Diskstats,
        CtlFile::Stat,
        CtlFile::Pid,
        CtlFile::Trace,
        CtlFile::Faults,
        CtlFile::Sync,
    ];
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
    files()
        .into_iter()
        .find(|(_, f)| f.name().as_bytes() == name)
}

/// What reading the file shows now (`trace` streams instead; see the front end).
pub fn content(vol: &Volume, counters: &Counters, f: CtlFile) -> Result<Vec<u8>, String> {
    Ok(match f {
        CtlFile::Knob(k) => format!("{}\n", vol.tunable(k).map_err(|e| e.to_string())?),
        CtlFile::Diskstats => format!("{}\n", vol.queue().diskstats().line(254, 0, "wbs0")),
        CtlFile::Pid => format!("{}\n", std::process::id()),
        CtlFile::Stat => stat(vol, counters),
        CtlFile::Trace => String::new(),
        CtlFile::Faults => match sim(vol) {
            Some(_) => FAULTS_HELP.to_string(),
            None => "not a simulated device: no fault switches\n".to_string(),
        },
        CtlFile::Sync => SYNC_HELP.to_string(),
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
    let ic = vol.inode_cache_stats();
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
        ("journal_checkpoints_background", j.checkpoints_background),
        ("journal_checkpoint_waits", j.checkpoint_waits),
        ("journal_wraps", j.journal_wraps),
        ("journal_flushes", j.flushes),
        ("journal_bytes", j.bytes),
        ("journal_sync_waits", j.sync_waits),
        ("journal_sync_woken", j.sync_woken),
        (
            "journal_checkpoint_close_ms_total",
            j.checkpoint_close_ns / 1_000_000,
        ),
        (
            "journal_checkpoint_close_ms_max",
            j.checkpoint_close_max_ns / 1_000_000,
        ),
        (
            "journal_commit_close_ms_max",
            j.commit_close_max_ns / 1_000_000,
        ),
        ("inode_cache_cached", ic.cached),
        ("inode_cache_live", ic.live),
        ("inode_cache_evicted", ic.evicted),
        ("inode_cache_examined", ic.examined),
        ("inodes_resident", ic.inodes_resident),
        ("inodes_read_back", ic.inodes_read_back),
        ("inodes_dropped", ic.inodes_dropped),
        ("dirents_resident", ic.dirents_resident),
        ("dirent_groups_read_back", ic.dirent_groups_read_back),
        ("dirents_dropped", ic.dirents_dropped),
        ("node_cache_bytes", ic.node_cache_bytes),
        ("node_cache_hits", ic.node_cache_hits),
        ("node_cache_misses", ic.node_cache_misses),
        ("dentries", ic.dentries),
        ("dentry_walk_hits", ic.dentry_walk_hits),
        ("dentry_walk_misses", ic.dentry_walk_misses),
        ("fuse_requests", counters.total()),
        (
            "fuse_ring_requests",
            counters.ring_requests.load(Ordering::Relaxed),
        ),
        (
            "fuse_ring_threads",
            counters.ring_threads.load(Ordering::Relaxed),
        ),
        ("data_start_sector", vol.superblock().data_start * 8),
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

const SYNC_HELP: &str = "\
# write anything here (`wbstack sync DIR` does) to write every dirty page back, commit
# the journal and flush the device: the kernel sends sync(2) and syncfs(2) to no FUSE
# daemon; the write fails with the error syncfs would return
";

const FAULTS_HELP: &str = "\
# write one command per line (sectors of 512 bytes; data starts at stat's data_start_sector):
#   eio START-END [r|w|rw]   reads and/or writes there fail with EIO (default rw)
#   eio_after N              every request after the next N fails
#   spike PROB:DURATION      a request completes DURATION later with probability PROB
#   clear                    no more faults
";

fn sim(vol: &Volume) -> Option<&SimDevice> {
    vol.queue().device().as_any().downcast_ref::<SimDevice>()
}

/// Apply a write to a knob file (its first line, trimmed) or to `faults` (each
/// line a command).
pub fn write(vol: &Volume, f: CtlFile, data: &[u8]) -> Result<(), String> {
    let text = std::str::from_utf8(data).map_err(|_| "not UTF-8".to_string())?;
    match f {
        CtlFile::Knob(k) => {
            let value = text.lines().next().unwrap_or("").trim();
            vol.set_tunable(k, value).map_err(|e| e.to_string())
        }
        CtlFile::Faults => {
            let dev = sim(vol).ok_or("not a simulated device: no fault switches")?;
            for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
                fault(dev, line)?;
            }
            Ok(())
        }
        _ => Err(format!("{} is read-only", f.name())),
    }
}

fn fault(dev: &SimDevice, line: &str) -> Result<(), String> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let bad = || {
        format!(
            "{line:?}: expected eio START-END [r|w|rw], eio_after N, spike PROB:DURATION or clear"
        )
    };
    match words.as_slice() {
        ["clear"] => dev.clear_faults(),
        ["eio", range, rest @ ..] => {
            let (a, b) = range.split_once('-').ok_or_else(bad)?;
            let start: u64 = a.parse().map_err(|_| bad())?;
            let end: u64 = b.parse().map_err(|_| bad())?;
            if end <= start {
                return Err(bad());
            }
            let (r, w) = match rest {
                [] | ["rw"] => (true, true),
                ["r"] => (true, false),
                ["w"] => (false, true),
                _ => return Err(bad()),
            };
            dev.inject_eio(start..end, r, w);
        }
        ["eio_after", n] => dev.eio_after(n.parse().map_err(|_| bad())?),
        ["spike", spec] => {
            let (p, d) = spec.split_once(':').ok_or_else(bad)?;
            let prob: f64 = p.parse().map_err(|_| bad())?;
            if !(0.0..=1.0).contains(&prob) {
                return Err(bad());
            }
            let ns = wbstack::dev::parse_duration(d).map_err(|e| format!("{line:?}: {e}"))?;
            dev.latency_spike(prob, ns);
        }
        _ => return Err(bad()),
    }
    Ok(())
}
