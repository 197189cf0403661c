//! Disk statistics with the kernel's fields and meanings (/proc/diskstats), and the
//! three ways of keeping them that seed 002 compares (`iostats`):
//!
//! - `off`: nothing is counted.
//! - `atomic`: the baseline before the seed's change: one set of shared atomic counters
//!   per device, including a shared `in_flight[2]` incremented at start and decremented
//!   at completion, so every IO from every CPU writes the same cache lines.
//! - `tags`: in_flight is never counted; it is derived when needed by walking the busy
//!   tags of every hardware queue. The other counters live in per-thread shards summed
//!   on read. io_ticks / time_in_queue are folded in at most once per millisecond (one
//!   jiffy at HZ=1000) by whichever thread wins the stamp, as `part_round_stats` did.

use crate::block::bio::Op;
use crossbeam_utils::CachePadded;
use std::fmt;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicU8, Ordering};

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IoStatsMode {
    Off,
    Atomic,
    Tags,
}

impl IoStatsMode {
    pub fn parse(s: &str) -> Result<IoStatsMode, String> {
        match s {
            "off" | "0" => Ok(IoStatsMode::Off),
            "atomic" => Ok(IoStatsMode::Atomic),
            "tags" | "on" | "1" => Ok(IoStatsMode::Tags),
            _ => Err(format!(
                "unknown iostats mode '{s}' (expected off, atomic or tags)"
            )),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            IoStatsMode::Off => "off",
            IoStatsMode::Atomic => "atomic",
            IoStatsMode::Tags => "tags",
        }
    }
    fn from_u8(v: u8) -> IoStatsMode {
        match v {
            0 => IoStatsMode::Off,
            1 => IoStatsMode::Atomic,
            _ => IoStatsMode::Tags,
        }
    }
}

impl fmt::Display for IoStatsMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Per-group counters: [READ, WRITE, DISCARD, FLUSH].
#[derive(Default)]
struct Counters {
    ios: [AtomicU64; 4],
    merges: [AtomicU64; 4],
    sectors: [AtomicU64; 4],
    nsecs: [AtomicU64; 4],
}

impl Counters {
    fn add_into(&self, d: &mut DiskStats) {
        for g in 0..4 {
            d.ios[g] += self.ios[g].load(Ordering::Relaxed);
            d.merges[g] += self.merges[g].load(Ordering::Relaxed);
            d.sectors[g] += self.sectors[g].load(Ordering::Relaxed);
            d.nsecs[g] += self.nsecs[g].load(Ordering::Relaxed);
        }
    }
}

const NR_SHARDS: usize = 64;
/// Shard for threads beyond NR_SHARDS live at once: shared, so updated atomically.
const OVERFLOW_SHARD: usize = NR_SHARDS;

/// Which shards are owned by a live thread (bit i = shard i).
static SHARD_OWNERS: AtomicU64 = AtomicU64::new(0);

/// A thread's exclusive claim on a shard, released when the thread exits, as a CPU
/// owns its per-CPU counters.
struct ShardClaim(usize);

impl ShardClaim {
    fn claim() -> ShardClaim {
        let mut cur = SHARD_OWNERS.load(Ordering::Relaxed);
        loop {
            let free = !cur;
            if free == 0 {
                return ShardClaim(OVERFLOW_SHARD);
            }
            let bit = free.trailing_zeros() as usize;
            match SHARD_OWNERS.compare_exchange_weak(
                cur,
                cur | 1 << bit,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => return ShardClaim(bit),
                Err(v) => cur = v,
            }
        }
    }
}

impl Drop for ShardClaim {
    fn drop(&mut self) {
        if self.0 < NR_SHARDS {
            SHARD_OWNERS.fetch_and(!(1u64 << self.0), Ordering::AcqRel);
        }
    }
}

thread_local! {
    static SHARD: ShardClaim = ShardClaim::claim();
}

#[inline]
fn my_shard() -> usize {
    SHARD.try_with(|s| s.0).unwrap_or(OVERFLOW_SHARD)
}

/// Add to a counter of this thread's shard. A shard has one owner, so a plain load and
/// store suffices (no locked instruction), except in the shared overflow shard.
#[inline]
fn shard_add(shard: usize, c: &AtomicU64, v: u64) {
    if shard == OVERFLOW_SHARD {
        c.fetch_add(v, Ordering::Relaxed);
    } else {
        c.store(c.load(Ordering::Relaxed).wrapping_add(v), Ordering::Relaxed);
    }
}

/// The accounting state of one device.
pub struct StatsState {
    mode: AtomicU8,
    /// The `atomic` mode's shared counters and in-flight pair (deliberately one place).
    shared: CachePadded<Counters>,
    shared_in_flight: CachePadded<[AtomicI64; 2]>,
    /// The `tags` mode's per-thread shards.
    shards: Box<[CachePadded<Counters>]>,
    /// Millisecond of the last io_ticks update, and the two time integrals (ms).
    stamp_ms: CachePadded<AtomicU64>,
    io_ticks_ms: AtomicU64,
    time_in_queue_ms: AtomicU64,
}

impl StatsState {
    pub fn new(mode: IoStatsMode) -> StatsState {
        StatsState {
            mode: AtomicU8::new(mode as u8),
            shared: Default::default(),
            shared_in_flight: Default::default(),
            shards: (0..=NR_SHARDS).map(|_| Default::default()).collect(),
            stamp_ms: CachePadded::new(AtomicU64::new(u64::MAX)),
            io_ticks_ms: AtomicU64::new(0),
            time_in_queue_ms: AtomicU64::new(0),
        }
    }

    #[inline]
    pub fn mode(&self) -> IoStatsMode {
        IoStatsMode::from_u8(self.mode.load(Ordering::Relaxed))
    }

    pub fn set_mode(&self, m: IoStatsMode) {
        self.mode.store(m as u8, Ordering::Relaxed);
    }

    /// Fold elapsed time into io_ticks and time_in_queue, at most once per millisecond.
    /// `in_flight` is only asked for by the thread that wins the stamp.
    #[inline]
    pub fn round(&self, now_ns: u64, in_flight: impl FnOnce() -> u64) {
        let now_ms = now_ns / 1_000_000;
        let stamp = self.stamp_ms.load(Ordering::Relaxed);
        // Never move the stamp backwards: callers may pass a slightly stale time.
        if stamp != u64::MAX && now_ms <= stamp {
            return;
        }
        if self
            .stamp_ms
            .compare_exchange(stamp, now_ms, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
            || stamp == u64::MAX
        {
            return;
        }
        let inflight = in_flight();
        if inflight > 0 {
            let d = now_ms - stamp;
            self.io_ticks_ms.fetch_add(d, Ordering::Relaxed);
            self.time_in_queue_ms
                .fetch_add(d * inflight, Ordering::Relaxed);
        }
    }

    /// The shared in-flight pair of the `atomic` mode.
    pub fn atomic_in_flight(&self) -> [u64; 2] {
        let n = |i: usize| {
            let v = self.shared_in_flight[i].load(Ordering::Relaxed);
            // Every decrement is a request counted in at its start, and its completion
            // comes after its start in the counter's order.
            debug_assert!(v >= 0, "atomic in-flight count {v} below zero");
            v.max(0) as u64
        };
        [n(0), n(1)]
    }

    /// A request was handed to the driver.
    #[inline]
    pub fn start(&self, mode: IoStatsMode, op: Op) {
        if mode == IoStatsMode::Atomic {
            self.shared_in_flight[op.is_write() as usize].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A request completed.
    #[inline]
    pub fn done(&self, mode: IoStatsMode, op: Op, nr_sectors: u32, nsecs: u64) {
        if mode == IoStatsMode::Atomic {
            self.shared_in_flight[op.is_write() as usize].fetch_sub(1, Ordering::Relaxed);
        }
        self.count(mode, op, nr_sectors, nsecs);
    }

    /// The flush of a completed PREFLUSH write, which the kernel splits off as a
    /// request of its own (blk-flush): counted, but never started here, so it leaves
    /// the in-flight count alone.
    #[inline]
    pub fn done_preflush(&self, mode: IoStatsMode, nsecs: u64) {
        self.count(mode, Op::Flush, 0, nsecs);
    }

    #[inline]
    fn count(&self, mode: IoStatsMode, op: Op, nr_sectors: u32, nsecs: u64) {
        let g = op.stat_group();
        if mode == IoStatsMode::Atomic {
            let c = &self.shared;
            c.ios[g].fetch_add(1, Ordering::Relaxed);
            c.sectors[g].fetch_add(nr_sectors as u64, Ordering::Relaxed);
            c.nsecs[g].fetch_add(nsecs, Ordering::Relaxed);
        } else {
            let sh = my_shard();
            let c = &self.shards[sh];
            shard_add(sh, &c.ios[g], 1);
            shard_add(sh, &c.sectors[g], nr_sectors as u64);
            shard_add(sh, &c.nsecs[g], nsecs);
        }
    }

    /// A bio was merged into an existing request.
    #[inline]
    pub fn merged(&self, mode: IoStatsMode, op: Op) {
        match mode {
            IoStatsMode::Off => {}
            IoStatsMode::Atomic => {
                self.shared.merges[op.stat_group()].fetch_add(1, Ordering::Relaxed);
            }
            IoStatsMode::Tags => {
                let sh = my_shard();
                shard_add(sh, &self.shards[sh].merges[op.stat_group()], 1);
            }
        }
    }

    /// Sum of everything counted so far; `in_flight` is filled by the caller.
    pub fn snapshot(&self) -> DiskStats {
        let mut d = DiskStats::default();
        self.shared.add_into(&mut d);
        for s in self.shards.iter() {
            s.add_into(&mut d);
        }
        d.io_ticks_ms = self.io_ticks_ms.load(Ordering::Relaxed);
        d.time_in_queue_ms = self.time_in_queue_ms.load(Ordering::Relaxed);
        d
    }
}

/// The fields of one /proc/diskstats line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct DiskStats {
    /// Completed requests per group [read, write, discard, flush].
    pub ios: [u64; 4],
    /// Bios merged into an existing request, per group.
    pub merges: [u64; 4],
    /// 512-byte sectors transferred, per group.
    pub sectors: [u64; 4],
    /// Sum of request lifetimes (creation to completion), ns, per group.
    pub nsecs: [u64; 4],
    /// Requests in progress [read, write].
    pub in_flight: [u64; 2],
    /// Milliseconds with at least one request in progress (field 10).
    pub io_ticks_ms: u64,
    /// Milliseconds weighted by requests in progress (field 11).
    pub time_in_queue_ms: u64,
}

impl DiskStats {
    pub fn reads(&self) -> u64 {
        self.ios[0]
    }
    pub fn writes(&self) -> u64 {
        self.ios[1]
    }
    pub fn flushes(&self) -> u64 {
        self.ios[3]
    }
    pub fn ticks_ms(&self, g: usize) -> u64 {
        self.nsecs[g] / 1_000_000
    }

    /// The change since `earlier` (in_flight is the current value).
    pub fn delta(&self, earlier: &DiskStats) -> DiskStats {
        let mut d = *self;
        for g in 0..4 {
            d.ios[g] -= earlier.ios[g].min(d.ios[g]);
            d.merges[g] -= earlier.merges[g].min(d.merges[g]);
            d.sectors[g] -= earlier.sectors[g].min(d.sectors[g]);
            d.nsecs[g] -= earlier.nsecs[g].min(d.nsecs[g]);
        }
        d.io_ticks_ms -= earlier.io_ticks_ms.min(d.io_ticks_ms);
        d.time_in_queue_ms -= earlier.time_in_queue_ms.min(d.time_in_queue_ms);
        d
    }

    /// The 17 fields after major, minor and name, in /proc/diskstats order.
    pub fn fields(&self) -> [u64; 17] {
        [
            self.ios[0],
            self.merges[0],
            self.sectors[0],
            self.ticks_ms(0),
            self.ios[1],
            self.merges[1],
            self.sectors[1],
            self.ticks_ms(1),
            self.in_flight[0] + self.in_flight[1],
            self.io_ticks_ms,
            self.time_in_queue_ms,
            self.ios[2],
            self.merges[2],
            self.sectors[2],
            self.ticks_ms(2),
            self.ios[3],
            self.ticks_ms(3),
        ]
    }

    /// One line in the kernel's /proc/diskstats format.
    pub fn line(&self, major: u32, minor: u32, name: &str) -> String {
        let mut s = format!("{major:4} {minor:7} {name}");
        for f in self.fields() {
            s.push(' ');
            s.push_str(&f.to_string());
        }
        s
    }

    /// Parse a kernel statistics line: a `/sys/block/*/stat` (or `/sys/dev/block/M:m/stat`)
    /// line of bare fields, or a `/proc/diskstats` line (major, minor, name, then the
    /// fields). Kernels before 4.18 have 11 fields and before 5.5 have 15; the missing
    /// ones read as 0. The kernel reports one in-flight total, kept in `in_flight[0]`,
    /// so `fields()` gives it back unchanged. Times in milliseconds become `nsecs`.
    pub fn parse(line_or_sysfs_stat: &str) -> Result<DiskStats, String> {
        let toks: Vec<&str> = line_or_sysfs_stat.split_whitespace().collect();
        let is_diskstats = toks.len() >= 3
            && toks[0].parse::<u64>().is_ok()
            && toks[1].parse::<u64>().is_ok()
            && toks[2].parse::<u64>().is_err();
        let fields = if is_diskstats { &toks[3..] } else { &toks[..] };
        if fields.len() < 11 {
            return Err(format!(
                "disk statistics need at least 11 fields, got {}: '{}'",
                fields.len(),
                line_or_sysfs_stat.trim()
            ));
        }
        let mut f = [0u64; 17];
        for (i, t) in fields.iter().take(17).enumerate() {
            f[i] = t
                .parse()
                .map_err(|_| format!("disk statistics field {} is not a number: '{t}'", i + 1))?;
        }
        let ms = |v: u64| v.saturating_mul(1_000_000);
        Ok(DiskStats {
            ios: [f[0], f[4], f[11], f[15]],
            merges: [f[1], f[5], f[12], 0],
            sectors: [f[2], f[6], f[13], 0],
            nsecs: [ms(f[3]), ms(f[7]), ms(f[14]), ms(f[16])],
            in_flight: [f[8], 0],
            io_ticks_ms: f[9],
            time_in_queue_ms: f[10],
        })
    }

    /// A readable multi-line summary for tools.
    pub fn pretty(&self) -> String {
        let kib = |s: u64| s / 2;
        format!(
            "reads {} (merged {}, {} KiB, {} ms)  writes {} (merged {}, {} KiB, {} ms)\n\
             discards {} (merged {}, {} KiB)  flushes {} ({} ms)\n\
             in_flight {}  io_ticks {} ms  time_in_queue {} ms",
            self.ios[0],
            self.merges[0],
            kib(self.sectors[0]),
            self.ticks_ms(0),
            self.ios[1],
            self.merges[1],
            kib(self.sectors[1]),
            self.ticks_ms(1),
            self.ios[2],
            self.merges[2],
            kib(self.sectors[2]),
            self.ios[3],
            self.ticks_ms(3),
            self.in_flight[0] + self.in_flight[1],
            self.io_ticks_ms,
            self.time_in_queue_ms
        )
    }
}
