//! Simulated SSD and HDD: memory-backed devices with a timing model enforced in real
//! time through the injected clock, a volatile write cache that loses what was not
//! flushed when the power is cut, and fault injection.
//!
//! Specs (every option is optional; sizes take k/M/G/T suffixes, times ns/us/ms/s):
//!
//! - `sim:ssd[,opts]`: size=1T, lbs=4096, hw_queues=NCPU, qd=128, max_hw_kb=32768,
//!   wc=1, rotational=0, and the timing options
//!   - `iops=27000`: controller cost of each write or discard command is 1/iops, so a
//!     small random write workload cannot exceed it while large writes are bandwidth
//!     bound;
//!   - `riops=200000`: the same for reads;
//!   - `bw=400M`: media bandwidth in bytes/s, split over `par=4` channels;
//!   - `stripe=32k`: data is striped over the channels in units of this size by
//!     address, as an FTL spreads pages over dies: a request occupies the channels its
//!     units land on and each channel serves its units in arrival order, so a large
//!     write keeps every channel busy and a read waits for the writes queued ahead of
//!     it on its channels;
//!   - `lat=80us`: latency added after the transfer (pipelined, it costs no throughput);
//!   - `flush_lat=200us`: cost of a cache flush.
//! - `sim:hdd[,opts]`: size=1T, lbs=4096, hw_queues=1, qd=32, max_hw_kb=32768, wc=1,
//!   rotational=1, and `rpm=7200`, `seek_min=0.5ms` (track to track), `seek_max=12ms`
//!   (full stroke), `bw=150M`, `flush_lat=200us`. One head serves one request at a
//!   time: seek_min + (seek_max - seek_min) * sqrt(distance / capacity), plus a random
//!   fraction of a revolution, plus the transfer; a request that starts exactly where
//!   the previous one ended pays only the transfer.
//!
//! Both kinds take `seed=1` (every random decision: rotation, spikes, torn sectors),
//! `data=1` (`data=0` keeps no data and reads return zeros, for multi-GiB benchmarks;
//! `data=meta` keeps only writes flagged META, so a filesystem's metadata survives),
//! the faults `eio=START-END`, `eio_after=N`, `spike=PROB:DUR` (see the methods of the
//! same names on [`SimDevice`]), and `cut_after=N` with `torn=0|1` (see
//! [`SimDevice::power_cut_after`]).
//!
//! Due times come from a virtual schedule computed when a request is queued, not from
//! when the completion thread happens to wake up, so throughput is exact as long as the
//! device has work queued.

use super::store::{Chunk, SparseStore, CHUNK};
use super::timer::CompletionTimer;
use super::{
    geometry_from_spec, nr_cpus, Completer, Device, DeviceSpec, Geometry, RqComplete, SpecError,
    GEOMETRY_KEYS,
};
use crate::block::bio::{BioFlags, BlkError, BlkResult, Op, Request, SECTOR_SIZE};
use crate::clock::{ClockRef, NSEC_PER_MSEC, NSEC_PER_SEC, NSEC_PER_USEC};
use parking_lot::{Mutex, ReentrantMutex};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rustc_hash::FxHashMap;
use std::any::Any;
use std::ops::Range;
use std::sync::Arc;

/// RNG streams derived from the seed, so that e.g. enabling latency spikes does not
/// change which sectors a power cut tears.
const STREAM_TIMING: u64 = 0;
const STREAM_TORN_UNFLUSHED: u64 = 1;
/// In-flight request `id` tears with stream `STREAM_TORN_IN_FLIGHT + id`, so the result
/// does not depend on the order in which the cut fails them.
const STREAM_TORN_IN_FLIGHT: u64 = 2;

/// Counts of what the device was asked to do, since it was opened. Requests are counted
/// when queued (including those that then fail by injection); requests refused because
/// the device is dark or malformed are not.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    pub reads: u64,
    pub writes: u64,
    /// Empty flushes plus writes carrying PREFLUSH.
    pub flushes: u64,
    pub fua_writes: u64,
    pub discards: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Requests failed with EIO by `eio`/`eio_after`.
    pub eio_injected: u64,
    pub power_cuts: u64,
    /// Writes by size: bucket i counts writes of at most `4 KiB << i` bytes (and more
    /// than the bucket before); the last counts the larger ones.
    pub write_size_hist: [u64; WRITE_SIZE_BUCKETS],
}

/// Buckets of [`SimStats::write_size_hist`]: 4 KiB to 2 MiB, then larger.
pub const WRITE_SIZE_BUCKETS: usize = 11;

/// The bucket of a write of `bytes` in [`SimStats::write_size_hist`].
pub fn write_size_bucket(bytes: u64) -> usize {
    let blocks = bytes.div_ceil(4096).max(1);
    (blocks.next_power_of_two().trailing_zeros() as usize).min(WRITE_SIZE_BUCKETS - 1)
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct SsdTiming {
    write_cmd_ns: u64,
    read_cmd_ns: u64,
    /// Aggregate bytes/s; each of the `par` channels moves bw/par.
    bw: u64,
    lat_ns: u64,
    par: usize,
    stripe_sectors: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct HddTiming {
    rev_ns: u64,
    seek_min_ns: u64,
    seek_max_ns: u64,
    bw: u64,
    capacity_sectors: u64,
}

#[derive(Clone, Debug)]
enum Media {
    Ssd {
        t: SsdTiming,
        ctrl_free: u64,
        chan_free: Vec<u64>,
    },
    Hdd {
        t: HddTiming,
        head_free: u64,
        head_pos: u64,
    },
}

fn xfer_ns(bytes: u64, bw: u64) -> u64 {
    (bytes as u128 * NSEC_PER_SEC as u128 / bw.max(1) as u128).min(u64::MAX as u128) as u64
}

impl Media {
    fn ssd(t: SsdTiming) -> Media {
        let par = t.par.max(1);
        Media::Ssd {
            t,
            ctrl_free: 0,
            chan_free: vec![0; par],
        }
    }

    fn hdd(t: HddTiming) -> Media {
        Media::Hdd {
            t,
            head_free: 0,
            head_pos: 0,
        }
    }

    /// After a power cut the virtual schedule of the dead device means nothing.
    fn reset(&mut self) {
        match self {
            Media::Ssd {
                ctrl_free,
                chan_free,
                ..
            } => {
                *ctrl_free = 0;
                chan_free.iter_mut().for_each(|c| *c = 0);
            }
            Media::Hdd {
                head_free,
                head_pos,
                ..
            } => {
                *head_free = 0;
                *head_pos = 0;
            }
        }
    }

    /// When a read, write or discard arriving at `now` finishes on the media.
    fn service(
        &mut self,
        now: u64,
        op: Op,
        sector: u64,
        nr_sectors: u64,
        rng: &mut ChaCha8Rng,
    ) -> u64 {
        match self {
            Media::Ssd {
                t,
                ctrl_free,
                chan_free,
            } => {
                let cost = if op == Op::Read {
                    t.read_cmd_ns
                } else {
                    t.write_cmd_ns
                };
                // The controller is one FIFO for reads and writes alike: a read queued
                // behind a burst of writes waits for all of their commands.
                let ctrl_done = now.max(*ctrl_free).saturating_add(cost);
                *ctrl_free = ctrl_done;
                if !op.has_data() {
                    return ctrl_done.saturating_add(t.lat_ns);
                }
                // Each channel serves its units in arrival order: a read queued behind
                // writes on its channels waits for them, whatever the other channels do.
                let par = chan_free.len() as u64;
                let unit = t.stripe_sectors.max(1);
                let (mut s, end) = (sector, sector + nr_sectors);
                let mut done = ctrl_done;
                while s < end {
                    let u = s / unit;
                    let next = ((u + 1) * unit).min(end);
                    let ch = (u % par) as usize;
                    let fin = ctrl_done
                        .max(chan_free[ch])
                        .saturating_add(xfer_ns((next - s) * SECTOR_SIZE * par, t.bw));
                    chan_free[ch] = fin;
                    done = done.max(fin);
                    s = next;
                }
                done.saturating_add(t.lat_ns)
            }
            Media::Hdd {
                t,
                head_free,
                head_pos,
            } => {
                if !op.has_data() {
                    // A discard only updates the drive's mapping: no head movement.
                    return now.max(*head_free);
                }
                let start = now.max(*head_free);
                let position = if sector == *head_pos {
                    0
                } else {
                    let frac = (sector.abs_diff(*head_pos) as f64
                        / t.capacity_sectors.max(1) as f64)
                        .min(1.0);
                    let seek = t.seek_min_ns as f64
                        + t.seek_max_ns.saturating_sub(t.seek_min_ns) as f64 * frac.sqrt();
                    let rotation = rng.gen::<f64>() * t.rev_ns as f64;
                    (seek + rotation) as u64
                };
                *head_free = start
                    .saturating_add(position)
                    .saturating_add(xfer_ns(nr_sectors * SECTOR_SIZE, t.bw));
                *head_pos = sector + nr_sectors;
                *head_free
            }
        }
    }
}

#[derive(Clone, Debug)]
struct EioRange {
    sectors: Range<u64>,
    reads: bool,
    writes: bool,
}

#[derive(Clone, Debug, Default)]
struct Faults {
    eio: Vec<EioRange>,
    /// Requests that may still succeed before every later one fails.
    eio_after: Option<u64>,
    spike_prob: f64,
    spike_ns: u64,
}

/// The timing model and everything decided at submission, behind one lock so the
/// virtual schedule and the random decisions follow submission order exactly.
struct Model {
    media: Media,
    wc: bool,
    flush_ns: u64,
    /// When the last write or discard submitted so far completes: a flush waits for it.
    last_write_done: u64,
    rng: ChaCha8Rng,
    faults: Faults,
    stats: SimStats,
    dark: bool,
    /// Incremented by every reboot: a request belongs to the power cycle it entered in.
    epoch: u64,
    next_id: u64,
    /// (requests left before the cut, torn).
    cut_after: Option<(u64, bool)>,
}

impl Model {
    fn new(media: Media, wc: bool, flush_ns: u64, seed: u64) -> Model {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(STREAM_TIMING);
        Model {
            media,
            wc,
            flush_ns,
            last_write_done: 0,
            rng,
            faults: Faults::default(),
            stats: SimStats::default(),
            dark: false,
            epoch: 0,
            next_id: 0,
            cut_after: None,
        }
    }

    /// The completion time of a request arriving at `now`, advancing the schedule.
    fn due(&mut self, now: u64, op: Op, flags: BioFlags, sector: u64, nr_sectors: u32) -> u64 {
        // A volatile cache needs writing back on flush; without one, a flush only
        // waits for the writes before it.
        let flush_cost = if self.wc { self.flush_ns } else { 0 };
        let flush_done = self.last_write_done.max(now).saturating_add(flush_cost);
        let mut done = match op {
            Op::Flush => flush_done,
            _ => self
                .media
                .service(now, op, sector, nr_sectors as u64, &mut self.rng),
        };
        if op == Op::Write && flags.contains(BioFlags::PREFLUSH) {
            done = done.max(flush_done);
        }
        if self.faults.spike_prob > 0.0 && self.rng.gen_bool(self.faults.spike_prob) {
            done = done.saturating_add(self.faults.spike_ns);
        }
        if op.is_write() {
            self.last_write_done = self.last_write_done.max(done);
        }
        done
    }

    /// Whether the injected faults fail this request; counts it against `eio_after`.
    fn inject_eio(&mut self, rq: &Request) -> bool {
        let f = &mut self.faults;
        let mut fail = match f.eio_after.as_mut() {
            Some(0) => true,
            Some(left) => {
                *left -= 1;
                false
            }
            None => false,
        };
        let (start, end) = (rq.sector, rq.end_sector());
        fail |= f.eio.iter().any(|r| {
            let op_hit = match rq.op {
                Op::Read => r.reads,
                Op::Write => r.writes,
                _ => false,
            };
            op_hit && start < r.sectors.end && r.sectors.start < end
        });
        fail
    }

    fn count(&mut self, rq: &Request, failed: bool) {
        let s = &mut self.stats;
        match rq.op {
            Op::Read => {
                s.reads += 1;
                s.bytes_read += rq.bytes();
            }
            Op::Write => {
                s.writes += 1;
                s.bytes_written += rq.bytes();
                s.write_size_hist[write_size_bucket(rq.bytes())] += 1;
                s.fua_writes += rq.flags.contains(BioFlags::FUA) as u64;
                s.flushes += rq.flags.contains(BioFlags::PREFLUSH) as u64;
            }
            Op::Flush => s.flushes += 1,
            Op::Discard => s.discards += 1,
        }
        s.eio_injected += failed as u64;
    }

    /// Counts a submission against `cut_after`; returns `Some(torn)` when this one cuts.
    fn tick_cut_after(&mut self) -> Option<bool> {
        let (left, torn) = self.cut_after.as_mut()?;
        *left = left.saturating_sub(1);
        let (left, torn) = (*left, *torn);
        if left == 0 {
            self.cut_after = None;
            Some(torn)
        } else {
            None
        }
    }
}

/// The contents, before a generation's first volatile write to them, of the chunks it
/// wrote (None: absent, reads as zeros).
type UndoLog = FxHashMap<u64, Option<Chunk>>;

/// The volatile writes and discards that completed between two cache flushes being
/// issued: a flush covers exactly the generations closed when it was issued
/// (REQ_PREFLUSH: what completed before it), not the writes still in flight then nor
/// those completing while it runs.
#[derive(Default)]
struct Generation {
    undo: UndoLog,
    /// (sector, nr_sectors) of its writes and discards, for a torn cut.
    unflushed: Vec<(u64, u64)>,
}

/// The media contents, touched only when requests complete (in due order), when a
/// cache flush is issued, and by power cuts.
///
/// Only what a cut would lose is kept twice: before a volatile write first touches a
/// chunk in a generation, the chunk's version of before goes into that generation's
/// undo log, so the oldest log holding a chunk has its durable version, and each later
/// one its version once the generations before are durable. A flush completing then
/// just forgets the logs of the generations it covers (its cost does not grow with the
/// data written since the last one, which would stall every completion behind the
/// flush for as long as copying took), and a power cut puts every log back, newest
/// first.
struct Data {
    /// What reads return: media plus volatile cache.
    current: SparseStore,
    /// Oldest first; the last one is open and gets the writes completing now.
    gens: std::collections::VecDeque<Generation>,
    /// The number of `gens[0]`; numbers only grow, across power cycles too.
    first_gen: u64,
    dark: bool,
    epoch: u64,
    /// The present outage tears in-flight writes.
    torn_cut: bool,
    torn_rng: ChaCha8Rng,
}

impl Data {
    /// A cache flush is issued: closes the open generation and returns its number, the
    /// last one the flush covers.
    fn close_generation(&mut self) -> u64 {
        let closed = self.first_gen + self.gens.len() as u64 - 1;
        self.gens.push_back(Generation::default());
        closed
    }

    /// The cache flush covering generations up to `last` completed: they are durable.
    /// Returns their forgotten undo logs, for the caller to drop outside the lock.
    #[must_use]
    fn flush(&mut self, last: u64) -> Vec<Generation> {
        // A flush that completes after a later one finds its generations gone already;
        // the open generation is never covered (`close_generation` opened another).
        let n = (last + 1).saturating_sub(self.first_gen) as usize;
        let n = n.min(self.gens.len() - 1);
        self.first_gen += n as u64;
        self.gens.drain(..n).collect()
    }

    fn open_gen(&mut self) -> &mut Generation {
        self.gens.back_mut().expect("one generation is always open")
    }

    /// Sectors [sector, sector + nr) are about to change in the cache only.
    fn remember(&mut self, sector: u64, nr: u64) {
        let current = &self.current;
        let g = self.gens.back_mut().expect("one generation is always open");
        for idx in SparseStore::chunk_range(sector, nr) {
            if let std::collections::hash_map::Entry::Vacant(v) = g.undo.entry(idx) {
                v.insert(current.chunk(idx));
            }
        }
        self.note_unflushed(sector, nr);
    }

    /// `data` at `sector` reached the media (FUA): the version of its chunks every
    /// generation would put back gets it too, since it is newer than all of them and
    /// durable; their other sectors keep whatever durability they had.
    fn write_through(&mut self, sector: u64, data: &[u8]) {
        let mut pos = sector * SECTOR_SIZE;
        let mut done = 0;
        while done < data.len() {
            let idx = pos / CHUNK as u64;
            let off = (pos % CHUNK as u64) as usize;
            let n = (CHUNK - off).min(data.len() - done);
            for g in self.gens.iter_mut() {
                if n == CHUNK {
                    // The whole chunk is new and durable: current is its durable version.
                    g.undo.remove(&idx);
                } else if let Some(pre) = g.undo.get_mut(&idx) {
                    let c = pre.get_or_insert_with(|| Arc::new([0u8; CHUNK]));
                    Arc::make_mut(c)[off..off + n].copy_from_slice(&data[done..done + n]);
                }
            }
            done += n;
            pos += n as u64;
        }
    }

    fn note_unflushed(&mut self, sector: u64, nr: u64) {
        let unflushed = &mut self.open_gen().unflushed;
        // Coalescing sequential streams keeps the list short for large writeback.
        if let Some(last) = unflushed.last_mut() {
            if sector >= last.0 && sector <= last.0 + last.1 {
                last.1 = last.1.max(sector + nr - last.0);
                return;
            }
        }
        unflushed.push((sector, nr));
    }

    /// The power went: `current` falls back to the durable image. With `torn`, each
    /// unflushed sector reaches the media with probability 1/2 first. Sectors are
    /// visited in ascending order so the outcome depends only on the seed and which
    /// sectors were unflushed, not on completion order.
    fn lose_cache(&mut self, torn: bool) {
        if torn {
            let mut ranges: Vec<(u64, u64)> = (self.gens.iter())
                .flat_map(|g| g.unflushed.iter().map(|&(s, n)| (s, s + n)))
                .collect();
            ranges.sort_unstable();
            let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
            for (s, e) in ranges {
                match merged.last_mut() {
                    Some(last) if s <= last.1 => last.1 = last.1.max(e),
                    _ => merged.push((s, e)),
                }
            }
            for (start, end) in merged {
                let mut run: Option<u64> = None;
                for s in start..end {
                    let survives = self.torn_rng.gen::<bool>();
                    match (survives, run) {
                        (true, None) => run = Some(s),
                        (false, Some(r)) => {
                            self.persist(r, s);
                            run = None;
                        }
                        _ => {}
                    }
                }
                if let Some(r) = run {
                    self.persist(r, end);
                }
            }
        }
        // Newest first, so each chunk ends with its version from the oldest log holding
        // it: its durable one.
        self.first_gen += self.gens.len() as u64;
        while let Some(g) = self.gens.pop_back() {
            for (idx, pre) in g.undo {
                self.current.set_chunk(idx, pre);
            }
        }
        self.gens.push_back(Generation::default());
    }

    /// Sectors [start, end) of the cache reached the media.
    fn persist(&mut self, start: u64, end: u64) {
        let mut buf = vec![0u8; ((end - start) * SECTOR_SIZE) as usize];
        self.current.read(start, &mut buf);
        self.write_through(start, &buf);
    }
}

/// What the simulated media keeps (`data=`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DataMode {
    /// Every write (`data=1`).
    All,
    /// Nothing: reads return zeros (`data=0`, block-level benchmarks of many GiB).
    None,
    /// Only writes flagged META (`data=meta`): a filesystem's superblock, journal and
    /// checkpoints persist while its file data costs no memory, so a filesystem can
    /// run a multi-GiB benchmark and still mount.
    Meta,
}

struct Shared {
    data_mode: DataMode,
    wc: bool,
    seed: u64,
    data: Mutex<Data>,
}

impl Shared {
    /// Whether the media keeps what `rq` writes.
    fn keeps(&self, rq: &Request) -> bool {
        match self.data_mode {
            DataMode::All => true,
            DataMode::None => false,
            DataMode::Meta => rq.flags.contains(BioFlags::META),
        }
    }

    fn keeps_any(&self) -> bool {
        self.data_mode != DataMode::None
    }

    /// Complete `rq` on the media, or fail it if the power went out under it.
    fn finish(&self, rq: &mut Request, done: &SimDone, cut: bool) -> BlkResult {
        let mut guard = self.data.lock();
        let d = &mut *guard;
        if cut || d.dark || d.epoch != done.epoch {
            let this_outage = d.dark && d.epoch == done.epoch;
            if this_outage && d.torn_cut && !done.doomed && rq.op == Op::Write && self.keeps(rq) {
                self.tear_in_flight(d, rq, done.id);
            }
            return Err(BlkError::PowerLoss);
        }
        let forgotten = self.apply(d, rq, done);
        drop(guard);
        drop(forgotten);
        Ok(())
    }

    /// Move `rq`'s data; a flush returns the generations it made durable.
    fn apply(&self, d: &mut Data, rq: &mut Request, done: &SimDone) -> Vec<Generation> {
        match rq.op {
            Op::Read => {
                let mut sector = rq.sector;
                for b in rq.buffers_mut() {
                    if self.keeps_any() {
                        d.current.read(sector, b.as_mut_slice());
                    } else {
                        b.as_mut_slice().fill(0);
                    }
                    sector += b.len() as u64 / SECTOR_SIZE;
                }
            }
            Op::Write => {
                // (PREFLUSH was honoured when the request entered the device.)
                if !self.keeps(rq) {
                    return Vec::new();
                }
                let durable_now = !self.wc || rq.flags.contains(BioFlags::FUA);
                if !durable_now {
                    d.remember(rq.sector, rq.nr_sectors as u64);
                }
                let mut sector = rq.sector;
                for b in rq.buffers() {
                    d.current.write(sector, b.as_slice());
                    if durable_now {
                        d.write_through(sector, b.as_slice());
                    }
                    sector += b.len() as u64 / SECTOR_SIZE;
                }
            }
            Op::Discard => {
                if self.data_mode != DataMode::All {
                    return Vec::new();
                }
                let nr = rq.nr_sectors as u64;
                if self.wc {
                    d.remember(rq.sector, nr);
                }
                d.current.discard(rq.sector, nr);
            }
            Op::Flush => {
                if let Some(last) = done.flush_covers {
                    return d.flush(last);
                }
            }
        }
        Vec::new()
    }

    /// A write in flight at a torn cut: each of its sectors reached the media with
    /// probability 1/2. After the cut `current` is the media.
    fn tear_in_flight(&self, d: &mut Data, rq: &Request, id: u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        rng.set_stream(STREAM_TORN_IN_FLIGHT.wrapping_add(id));
        let mut sector = rq.sector;
        for b in rq.buffers() {
            for (i, s) in b.as_slice().chunks(SECTOR_SIZE as usize).enumerate() {
                if rng.gen::<bool>() {
                    d.current.write(sector + i as u64, s);
                }
            }
            sector += b.len() as u64 / SECTOR_SIZE;
        }
    }
}

/// Interposed on each request's completion, so data moves (or tears) on the same path
/// whether the request falls due normally or is failed by a power cut.
struct SimDone {
    inner: Completer,
    shared: Arc<Shared>,
    epoch: u64,
    id: u64,
    /// Injected EIO: the request was never going to write anything.
    doomed: bool,
    /// A cache flush: the last generation it covers, closed when it was issued.
    flush_covers: Option<u64>,
}

impl RqComplete for SimDone {
    fn complete(&self, mut rq: Request, status: BlkResult) {
        let status = match status {
            Ok(()) => self.shared.finish(&mut rq, self, false),
            Err(BlkError::PowerLoss) => self.shared.finish(&mut rq, self, true),
            Err(e) => Err(e),
        };
        self.inner.complete(rq, status);
    }
}

/// A simulated SSD or HDD (see the module documentation for its spec and model).
pub struct SimDevice {
    spec: String,
    geo: Geometry,
    clock: ClockRef,
    model: Mutex<Model>,
    shared: Arc<Shared>,
    /// Serialises power cuts and reboots, so the failing of one outage's requests can
    /// never hit requests of the next power cycle. Reentrant: a completion called while
    /// a cut fails requests may itself cut or reboot.
    power: ReentrantMutex<()>,
    timer: CompletionTimer,
}

const SSD_KEYS: &str = "iops, riops, bw, lat, par, stripe, flush_lat";
const HDD_KEYS: &str = "rpm, seek_min, seek_max, bw, flush_lat";
const COMMON_KEYS: &str = "seed, data, eio, eio_after, spike, cut_after, torn";

fn nonzero(spec: &DeviceSpec, key: &str, v: u64) -> Result<u64, SpecError> {
    if v == 0 {
        Err(spec.err(format!("{key}=0: must be larger than zero")))
    } else {
        Ok(v)
    }
}

fn parse_eio(spec: &DeviceSpec, v: &str) -> Result<Range<u64>, SpecError> {
    let bad = |why: &str| {
        spec.err(format!(
            "eio={v}: {why} (expected START-END in sectors, as in eio=2048-4096)"
        ))
    };
    let (a, b) = v.split_once('-').ok_or_else(|| bad("missing '-'"))?;
    let a: u64 = a
        .trim()
        .parse()
        .map_err(|_| bad("START is not a sector number"))?;
    let b: u64 = b
        .trim()
        .parse()
        .map_err(|_| bad("END is not a sector number"))?;
    if a >= b {
        return Err(bad("END must be larger than START"));
    }
    Ok(a..b)
}

fn parse_spike(spec: &DeviceSpec, v: &str) -> Result<(f64, u64), SpecError> {
    let bad = |why: String| {
        spec.err(format!(
            "spike={v}: {why} (expected PROB:DUR, as in spike=0.01:50ms)"
        ))
    };
    let (p, d) = v.split_once(':').ok_or_else(|| bad("missing ':'".into()))?;
    let p: f64 = p
        .trim()
        .parse()
        .map_err(|_| bad("PROB is not a number".into()))?;
    if !(0.0..=1.0).contains(&p) {
        return Err(bad("PROB must be from 0 to 1".into()));
    }
    let d = super::parse_duration(d).map_err(bad)?;
    Ok((p, d))
}

impl SimDevice {
    pub fn from_spec(spec: &DeviceSpec, clock: ClockRef) -> Result<SimDevice, SpecError> {
        let hdd = match spec.kind.as_str() {
            "sim:ssd" => false,
            "sim:hdd" => true,
            k => {
                return Err(spec.err(format!(
                    "'{k}' is not a simulated device (expected sim:ssd or sim:hdd)"
                )))
            }
        };
        let geo = geometry_from_spec(
            spec,
            Geometry {
                size_bytes: 1 << 40,
                logical_block_size: 4096,
                max_hw_sectors: 32768 * 2,
                max_segments: 128,
                max_segment_size: 65536,
                rotational: hdd,
                write_cache: true,
                nr_hw_queues: if hdd { 1 } else { nr_cpus().min(128) as u16 },
                queue_depth: if hdd { 32 } else { 128 },
            },
        )?;
        let bw = nonzero(
            spec,
            "bw",
            spec.size("bw", if hdd { 150 << 20 } else { 400 << 20 })?,
        )?;
        let flush_ns = spec.duration_ns("flush_lat", 200 * NSEC_PER_USEC)?;
        let media = if hdd {
            let rpm = spec.u64("rpm", 7200)?;
            if !(1..=1_000_000).contains(&rpm) {
                return Err(spec.err(format!("rpm={rpm}: must be from 1 to 1000000")));
            }
            let seek_min_ns = spec.duration_ns("seek_min", NSEC_PER_MSEC / 2)?;
            let seek_max_ns = spec.duration_ns("seek_max", 12 * NSEC_PER_MSEC)?;
            if seek_min_ns > seek_max_ns {
                return Err(spec.err(format!(
                    "seek_min ({seek_min_ns} ns) must not exceed seek_max ({seek_max_ns} ns)"
                )));
            }
            Media::hdd(HddTiming {
                rev_ns: 60 * NSEC_PER_SEC / rpm,
                seek_min_ns,
                seek_max_ns,
                bw,
                capacity_sectors: geo.nr_sectors(),
            })
        } else {
            let iops = nonzero(spec, "iops", spec.u64("iops", 27_000)?)?;
            let riops = nonzero(spec, "riops", spec.u64("riops", 200_000)?)?;
            let lat_ns = spec.duration_ns("lat", 80 * NSEC_PER_USEC)?;
            let par = spec.u64("par", 4)?;
            if !(1..=1024).contains(&par) {
                return Err(spec.err(format!(
                    "par={par}: the number of channels must be from 1 to 1024"
                )));
            }
            let stripe = spec.size("stripe", 32 << 10)?;
            if stripe < SECTOR_SIZE || !stripe.is_multiple_of(SECTOR_SIZE) {
                return Err(spec.err(format!(
                    "stripe={stripe}: the stripe unit must be a multiple of 512 bytes"
                )));
            }
            Media::ssd(SsdTiming {
                write_cmd_ns: NSEC_PER_SEC / iops,
                read_cmd_ns: NSEC_PER_SEC / riops,
                bw,
                lat_ns,
                par: par as usize,
                stripe_sectors: stripe / SECTOR_SIZE,
            })
        };
        let seed = spec.u64("seed", 1)?;
        let data_mode = match spec.str_opt("data").as_deref() {
            None | Some("1" | "on" | "yes" | "true") => DataMode::All,
            Some("0" | "off" | "no" | "false") => DataMode::None,
            Some("meta") => DataMode::Meta,
            Some(v) => {
                return Err(spec.err(format!(
                    "data={v}: expected 1 (keep all), 0 (keep nothing) or meta (keep META writes)"
                )))
            }
        };
        let mut faults = Faults::default();
        if let Some(v) = spec.str_opt("eio") {
            faults.eio.push(EioRange {
                sectors: parse_eio(spec, &v)?,
                reads: true,
                writes: true,
            });
        }
        if spec.has("eio_after") {
            faults.eio_after = Some(spec.u64("eio_after", 0)?);
        }
        if let Some(v) = spec.str_opt("spike") {
            (faults.spike_prob, faults.spike_ns) = parse_spike(spec, &v)?;
        }
        let cut_after = spec.u64("cut_after", 0)?;
        let torn = spec.bool("torn", false)?;
        if spec.has("torn") && cut_after == 0 {
            return Err(spec.err("torn applies to cut_after=N, which is missing"));
        }
        spec.finish(&format!(
            "{GEOMETRY_KEYS}, {}, {COMMON_KEYS}",
            if hdd { HDD_KEYS } else { SSD_KEYS }
        ))?;

        let mut model = Model::new(media, geo.write_cache, flush_ns, seed);
        model.faults = faults;
        if cut_after > 0 {
            model.cut_after = Some((cut_after, torn));
        }
        let mut torn_rng = ChaCha8Rng::seed_from_u64(seed);
        torn_rng.set_stream(STREAM_TORN_UNFLUSHED);
        let shared = Arc::new(Shared {
            data_mode,
            wc: geo.write_cache,
            seed,
            data: Mutex::new(Data {
                current: SparseStore::new(),
                gens: [Generation::default()].into(),
                first_gen: 0,
                dark: false,
                epoch: 0,
                torn_cut: false,
                torn_rng,
            }),
        });
        // Data moves in `SimDone`, which also sees requests failed by a power cut.
        let timer = CompletionTimer::new(
            if hdd { "sim-hdd" } else { "sim-ssd" },
            clock.clone(),
            Box::new(|_| Ok(())),
        );
        Ok(SimDevice {
            spec: spec.raw.clone(),
            geo,
            clock,
            model: Mutex::new(model),
            shared,
            power: ReentrantMutex::new(()),
            timer,
        })
    }

    /// Power failure. The device goes dark: every request inside it completes with
    /// `BlkError::PowerLoss` without touching the media, and every later request too, at
    /// once, until [`reboot`](Self::reboot). The contents fall back to the durable image:
    /// volatile writes no completed flush covers (a flush covers the writes completed
    /// before it was issued; FUA writes and wc=0 need none) are lost. With `torn`,
    /// each 512-byte sector of those writes and of writes in flight independently
    /// reaches the media with probability 1/2 (seeded), so one write can be torn.
    pub fn power_cut(&self, torn: bool) {
        let _power = self.power.lock();
        self.cut_locked(&mut self.model.lock(), torn);
        self.timer.fail_all(BlkError::PowerLoss);
    }

    /// Cut the power (as [`power_cut`](Self::power_cut)) when the `n_ios`-th request
    /// from now is queued; that request is inside the device at the cut, so with `torn`
    /// it may be partly written. `n_ios = 0` cuts now. Spec: `cut_after=N[,torn=1]`.
    pub fn power_cut_after(&self, n_ios: u64, torn: bool) {
        if n_ios == 0 {
            self.power_cut(torn);
        } else {
            self.model.lock().cut_after = Some((n_ios, torn));
        }
    }

    /// Power the device back on: it serves requests again and reads return what was
    /// durable at the cut. A no-op on a device that has power.
    pub fn reboot(&self) {
        let _power = self.power.lock();
        if !self.model.lock().dark {
            return;
        }
        // Nothing can enter while dark, so whatever is still inside belongs to the
        // outage (a cut triggered by cut_after that has not failed its requests yet).
        self.timer.fail_all(BlkError::PowerLoss);
        let mut m = self.model.lock();
        m.dark = false;
        m.epoch += 1;
        m.media.reset();
        m.last_write_done = 0;
        let mut d = self.shared.data.lock();
        d.dark = false;
        d.epoch = m.epoch;
        d.torn_cut = false;
    }

    /// What reads return now, as an image sharing its chunks with the device (no data
    /// copy): after a power cut and `reboot`, the durable image the cut left.
    pub fn image(&self) -> SparseStore {
        self.shared.data.lock().current.clone()
    }

    /// False between a power cut and the reboot.
    pub fn powered(&self) -> bool {
        !self.model.lock().dark
    }

    fn cut_locked(&self, m: &mut Model, torn: bool) {
        if m.dark {
            return;
        }
        m.dark = true;
        m.stats.power_cuts += 1;
        m.cut_after = None;
        let mut guard = self.shared.data.lock();
        let d = &mut *guard;
        d.dark = true;
        d.torn_cut = torn;
        d.lose_cache(torn && self.shared.keeps_any());
    }

    /// Media error: every read (if `reads`) or write (if `writes`) overlapping the
    /// sector range `sectors` fails with `BlkError::Io` and moves no data. Ranges add up
    /// until [`clear_faults`](Self::clear_faults). Spec: `eio=START-END` (reads and
    /// writes).
    pub fn inject_eio(&self, sectors: Range<u64>, reads: bool, writes: bool) {
        self.model.lock().faults.eio.push(EioRange {
            sectors,
            reads,
            writes,
        });
    }

    /// Dying device: the next `n` requests (of any kind, flushes included) behave, every
    /// later one fails with `BlkError::Io`. Spec: `eio_after=N` (counted from open).
    pub fn eio_after(&self, n: u64) {
        self.model.lock().faults.eio_after = Some(n);
    }

    /// Latency outliers (garbage collection, retries): each request with probability
    /// `prob` completes `extra_ns` later. It does not hold up the requests behind it,
    /// except flushes, which wait for every earlier write. Spec: `spike=PROB:DUR`.
    pub fn latency_spike(&self, prob: f64, extra_ns: u64) {
        let mut m = self.model.lock();
        // gen_bool panics outside [0, 1]; NaN means no spikes.
        m.faults.spike_prob = if prob.is_nan() {
            0.0
        } else {
            prob.clamp(0.0, 1.0)
        };
        m.faults.spike_ns = extra_ns;
    }

    /// Remove every EIO range, `eio_after` and latency spikes (not a pending
    /// `power_cut_after`).
    pub fn clear_faults(&self) {
        self.model.lock().faults = Faults::default();
    }

    /// Keep every request inside the device until `hold(false)` (tests of in-flight
    /// state); a power cut still fails them.
    pub fn hold(&self, on: bool) {
        self.timer.set_held(on);
    }

    /// Requests inside the device.
    pub fn pending(&self) -> usize {
        self.timer.pending()
    }

    pub fn stats(&self) -> SimStats {
        self.model.lock().stats.clone()
    }

    /// Bytes of data the simulated media keeps in memory: what reads return, and the
    /// older copies a power cut would put back (shared chunks counted once each way).
    /// The device's memory, not its user's: a soak bounding a volume's memory leaves
    /// it out.
    pub fn bytes_held(&self) -> u64 {
        let d = self.shared.data.lock();
        let undo: usize = d
            .gens
            .iter()
            .map(|g| g.undo.values().filter(|c| c.is_some()).count())
            .sum();
        d.current.bytes_held() + (undo * super::store::CHUNK) as u64
    }

    fn check(&self, rq: &Request) -> Result<(), BlkError> {
        if rq.op == Op::Flush {
            return Ok(());
        }
        let invalid = |why: String| Err(BlkError::Invalid(format!("{rq:?}: {why}")));
        let nr = rq.nr_sectors as u64;
        if nr == 0 {
            return invalid("no sectors".into());
        }
        match rq.sector.checked_add(nr) {
            Some(end) if end <= self.geo.nr_sectors() => {}
            _ => {
                return invalid(format!(
                    "beyond the end of the device ({} sectors)",
                    self.geo.nr_sectors()
                ))
            }
        }
        let lbs_sectors = self.geo.logical_block_size as u64 / SECTOR_SIZE;
        if !rq.sector.is_multiple_of(lbs_sectors) || !nr.is_multiple_of(lbs_sectors) {
            return invalid(format!(
                "not aligned to the logical block size {}",
                self.geo.logical_block_size
            ));
        }
        if rq.op.has_data() {
            if rq.nr_sectors > self.geo.max_hw_sectors {
                return invalid(format!(
                    "larger than max_hw_sectors {}",
                    self.geo.max_hw_sectors
                ));
            }
            let mut len = 0u64;
            for b in rq.buffers() {
                if !(b.len() as u64).is_multiple_of(SECTOR_SIZE) {
                    return invalid(format!(
                        "a buffer of {} bytes is not whole sectors",
                        b.len()
                    ));
                }
                len += b.len() as u64;
            }
            if len != rq.bytes() {
                return invalid(format!(
                    "buffers hold {len} bytes for {} bytes of sectors",
                    rq.bytes()
                ));
            }
        }
        Ok(())
    }
}

impl Device for SimDevice {
    fn geometry(&self) -> &Geometry {
        &self.geo
    }

    fn spec(&self) -> &str {
        &self.spec
    }

    fn queue_rq(&self, rq: Request, done: &Completer) {
        if let Err(e) = self.check(&rq) {
            done.complete(rq, Err(e));
            return;
        }
        let now = self.clock.now_ns();
        // Forgotten undo logs can be large: they are dropped after the locks.
        let mut forgotten: Vec<Generation> = Vec::new();
        let mut m = self.model.lock();
        if m.dark {
            drop(m);
            done.complete(rq, Err(BlkError::PowerLoss));
            return;
        }
        let doomed = m.inject_eio(&rq);
        m.count(&rq, doomed);
        let mut flush_covers = None;
        if rq.op == Op::Flush && !doomed {
            // What completed before the flush was issued, and nothing later.
            flush_covers = Some(self.shared.data.lock().close_generation());
        }
        if rq.op == Op::Write && rq.flags.contains(BioFlags::PREFLUSH) && !doomed {
            // The block layer's flush sequence completes the cache flush before the
            // write is issued, so what completed before this request is durable before
            // any sector of it can land: a cut that tears this write has flushed first.
            let mut d = self.shared.data.lock();
            let last = d.close_generation();
            forgotten = d.flush(last);
        }
        let due = m.due(now, rq.op, rq.flags, rq.sector, rq.nr_sectors);
        let id = m.next_id;
        m.next_id += 1;
        let wrapped: Completer = Arc::new(SimDone {
            inner: done.clone(),
            shared: self.shared.clone(),
            epoch: m.epoch,
            id,
            doomed,
            flush_covers,
        });
        // Scheduled under the model lock, so a power cut (which sets `dark` under it)
        // either sees this request in the timer or this request sees `dark`.
        self.timer
            .schedule(due, rq, &wrapped, doomed.then_some(Err(BlkError::Io)));
        let cut = m.tick_cut_after().map(|torn| (torn, m.epoch));
        if let Some((torn, _)) = cut {
            self.cut_locked(&mut m, torn);
        }
        drop(m);
        drop(forgotten);
        if let Some((_, epoch)) = cut {
            // Failing requests calls completions, which may queue more: no model lock.
            let _power = self.power.lock();
            if self.model.lock().epoch == epoch {
                self.timer.fail_all(BlkError::PowerLoss);
            }
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_sizes_fall_in_power_of_two_buckets() {
        assert_eq!(write_size_bucket(512), 0);
        assert_eq!(write_size_bucket(4096), 0);
        assert_eq!(write_size_bucket(4097), 1);
        assert_eq!(write_size_bucket(128 << 10), 5);
        assert_eq!(write_size_bucket(2 << 20), 9);
        assert_eq!(write_size_bucket(4 << 20), WRITE_SIZE_BUCKETS - 1);
        assert_eq!(write_size_bucket(64 << 20), WRITE_SIZE_BUCKETS - 1);
    }

    fn ssd_model(iops: u64, bw: u64, par: usize) -> Model {
        let t = SsdTiming {
            write_cmd_ns: NSEC_PER_SEC / iops,
            read_cmd_ns: NSEC_PER_SEC / 200_000,
            bw,
            lat_ns: 80 * NSEC_PER_USEC,
            par,
            stripe_sectors: 64,
        };
        Model::new(Media::ssd(t), true, 200 * NSEC_PER_USEC, 1)
    }

    fn hdd_model() -> Model {
        let t = HddTiming {
            rev_ns: 60 * NSEC_PER_SEC / 7200,
            seek_min_ns: NSEC_PER_MSEC / 2,
            seek_max_ns: 12 * NSEC_PER_MSEC,
            bw: 150 << 20,
            capacity_sectors: (1u64 << 40) / 512,
        };
        Model::new(Media::hdd(t), true, 200 * NSEC_PER_USEC, 1)
    }

    const NONE: BioFlags = BioFlags::empty();

    #[test]
    fn read_behind_writes_waits_for_them() {
        let mut m = ssd_model(27_000, 400 << 20, 4);
        let writes: Vec<u64> = (0..100)
            .map(|i| m.due(0, Op::Write, NONE, i * 8 * 1000, 8))
            .collect();
        let read = m.due(10, Op::Read, NONE, 123 * 8, 8);
        let last_write = *writes.iter().max().unwrap();
        assert!(read > last_write, "read {read} vs last write {last_write}");
        // The controller FIFO sets the pace: 100 commands of 1/27000 s each.
        assert!(read >= 100 * (NSEC_PER_SEC / 27_000));
        // The same read on an idle device is quick.
        let mut idle = ssd_model(27_000, 400 << 20, 4);
        assert!(idle.due(0, Op::Read, NONE, 0, 8) < 200 * NSEC_PER_USEC);
    }

    #[test]
    fn striping_spreads_a_write_and_queues_reads_behind_writes_on_their_channels() {
        // 4 channels of 100 MiB/s, 32 KiB units.
        let mut m = ssd_model(1_000_000, 400 << 20, 4);
        // One 1 MiB write keeps all four channels busy for a quarter of 1 MiB / 100 MiB/s.
        let w = m.due(0, Op::Write, NONE, 0, 2048);
        let quarter = xfer_ns(1 << 20, 400 << 20);
        assert!(
            w.abs_diff(1_000 + quarter + 80_000) < 1_000,
            "{w} vs {quarter}"
        );
        // A 32 KiB read anywhere waits for its channel's share of that write.
        let r = m.due(0, Op::Read, NONE, 1 << 20, 64);
        assert!(
            r > quarter,
            "read {r} finished before the write's share {quarter}"
        );
        // Ten more 1 MiB writes queued ahead: the read waits for all of them.
        let mut m = ssd_model(1_000_000, 400 << 20, 4);
        for i in 0..10 {
            m.due(0, Op::Write, NONE, i * 2048, 2048);
        }
        let r = m.due(0, Op::Read, NONE, 100 << 11, 64);
        assert!(r > 10 * quarter, "read {r} did not queue behind 10 writes");
        // Small reads on distinct units of an idle device run in parallel.
        let mut m = ssd_model(1_000_000, 400 << 20, 4);
        let ends: Vec<u64> = (0..4)
            .map(|i| m.due(0, Op::Read, NONE, i * 64, 64))
            .collect();
        let one = xfer_ns(32 << 10, 100 << 20);
        // (Each waits only for the controller's 5 us per command ahead of it.)
        assert!(
            ends.iter().all(|&e| e <= one + 80_000 + 4 * 5_000),
            "{ends:?}"
        );
    }

    #[test]
    fn flush_completes_after_earlier_writes() {
        let mut m = ssd_model(27_000, 400 << 20, 4);
        let mut last = 0;
        for i in 0..10 {
            last = last.max(m.due(1000, Op::Write, NONE, i * 2048, 2048));
        }
        let flush = m.due(2000, Op::Flush, BioFlags::PREFLUSH, 0, 0);
        assert_eq!(flush, last + 200 * NSEC_PER_USEC);
        // A later flush with nothing written in between waits only for itself.
        let t = flush + NSEC_PER_SEC;
        assert_eq!(
            m.due(t, Op::Flush, BioFlags::PREFLUSH, 0, 0),
            t + 200 * NSEC_PER_USEC
        );
        // A PREFLUSH write completes no earlier than the flush it carries.
        let w = m.due(t, Op::Write, BioFlags::PREFLUSH, 0, 8);
        assert!(w >= t + 200 * NSEC_PER_USEC);
    }

    #[test]
    fn without_write_cache_flush_costs_nothing() {
        let mut m = ssd_model(27_000, 400 << 20, 4);
        m.wc = false;
        let w = m.due(0, Op::Write, NONE, 0, 8);
        assert_eq!(m.due(1, Op::Flush, BioFlags::PREFLUSH, 0, 0), w);
    }

    #[test]
    fn ssd_small_writes_are_iops_bound_large_ones_bandwidth_bound() {
        let mut m = ssd_model(20_000, 200 << 20, 4);
        let n = 10_000u64;
        let last = (0..n)
            .map(|i| m.due(0, Op::Write, NONE, i * 8, 8))
            .max()
            .unwrap();
        let rate = n as f64 / (last as f64 / 1e9);
        assert!((rate - 20_000.0).abs() < 200.0, "4k rate {rate}");

        let mut m = ssd_model(20_000, 200 << 20, 4);
        let n = 400u64;
        let last = (0..n)
            .map(|i| m.due(0, Op::Write, NONE, i * 2048, 2048))
            .max()
            .unwrap();
        let mibs = n as f64 / (last as f64 / 1e9);
        assert!((mibs - 200.0).abs() < 2.0, "1M rate {mibs} MiB/s");
    }

    #[test]
    fn schedule_is_from_arrival_not_wakeup() {
        let mut m = ssd_model(20_000, 400 << 20, 4);
        let a = m.due(0, Op::Write, NONE, 0, 8);
        // Arriving long after the device went idle: no credit for the idle time, no debt.
        let b = m.due(NSEC_PER_SEC, Op::Write, NONE, 0, 8);
        assert_eq!(b - NSEC_PER_SEC, a);
    }

    #[test]
    fn hdd_sequential_skips_positioning() {
        let mut m = hdd_model();
        let seq_first = m.due(0, Op::Read, NONE, 0, 8);
        let xfer = xfer_ns(4096, 150 << 20);
        assert_eq!(seq_first, xfer, "head starts at sector 0");
        let seq_next = m.due(0, Op::Read, NONE, 8, 8);
        assert_eq!(seq_next, 2 * xfer);
        // A full-stroke seek pays seek_max plus up to one revolution.
        let far = (1u64 << 40) / 512 - 8;
        let t0 = seq_next;
        let done = m.due(0, Op::Read, NONE, far, 8);
        let service = done - t0 - xfer;
        assert!(
            service >= 12 * NSEC_PER_MSEC - NSEC_PER_MSEC / 100,
            "{service}"
        );
        assert!(
            service <= 12 * NSEC_PER_MSEC + 60 * NSEC_PER_SEC / 7200,
            "{service}"
        );
    }

    #[test]
    fn hdd_random_is_seeded() {
        let run = || {
            let mut m = hdd_model();
            (0..50)
                .map(|i| m.due(0, Op::Read, NONE, (i * 7919 * 1_000_003) % (1 << 31), 8))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
    }

    #[test]
    fn spikes_delay_single_requests() {
        let mut m = ssd_model(27_000, 400 << 20, 4);
        m.faults.spike_prob = 1.0;
        m.faults.spike_ns = 50 * NSEC_PER_MSEC;
        let a = m.due(0, Op::Write, NONE, 0, 8);
        assert!(a >= 50 * NSEC_PER_MSEC);
        m.faults.spike_prob = 0.0;
        let b = m.due(0, Op::Write, NONE, 8, 8);
        assert!(b < 50 * NSEC_PER_MSEC, "a spike does not hold up the queue");
        assert!(
            m.due(0, Op::Flush, NONE, 0, 0) > a,
            "but a flush waits for it"
        );
    }

    #[test]
    fn absurd_times_saturate_instead_of_overflowing() {
        for s in [
            "sim:ssd,lat=99999999999s,flush_lat=99999999999s,spike=1:99999999999s,bw=1",
            "sim:hdd,seek_max=99999999999s,bw=1",
        ] {
            let spec = DeviceSpec::parse(s).unwrap();
            let d = SimDevice::from_spec(&spec, crate::clock::RealClock::new()).unwrap();
            let mut m = d.model.lock();
            for i in 0..3 {
                m.due(
                    u64::MAX / 2,
                    Op::Write,
                    BioFlags::PREFLUSH,
                    i * (1 << 30),
                    65536,
                );
                m.due(u64::MAX / 2, Op::Flush, BioFlags::PREFLUSH, 0, 0);
            }
        }
    }

    fn spec_err(s: &str) -> String {
        let spec = DeviceSpec::parse(s).unwrap();
        match SimDevice::from_spec(&spec, crate::clock::RealClock::new()) {
            Ok(_) => panic!("{s} should not parse"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn bad_options_name_the_option() {
        assert!(spec_err("sim:ssd,iops=0").contains("iops"));
        assert!(spec_err("sim:ssd,par=0").contains("par"));
        assert!(spec_err("sim:ssd,bw=fast").contains("bw"));
        assert!(spec_err("sim:ssd,spike=2:1ms").contains("spike"));
        assert!(spec_err("sim:ssd,spike=0.1").contains("spike"));
        assert!(spec_err("sim:ssd,eio=10-5").contains("eio"));
        assert!(spec_err("sim:ssd,eio=x").contains("eio"));
        assert!(spec_err("sim:ssd,eio_after=x").contains("eio_after"));
        assert!(spec_err("sim:hdd,seek_min=20ms").contains("seek_min"));
        assert!(spec_err("sim:hdd,rpm=0").contains("rpm"));
        assert!(spec_err("sim:hdd,iops=100").contains("'iops'"));
        assert!(spec_err("sim:ssd,torn=1").contains("cut_after"));
        assert!(spec_err("sim:ssd,data=maybe").contains("data"));
    }

    #[test]
    fn defaults() {
        let spec = DeviceSpec::parse("sim:hdd").unwrap();
        let d = SimDevice::from_spec(&spec, crate::clock::RealClock::new()).unwrap();
        let g = d.geometry();
        assert_eq!(
            (
                g.size_bytes,
                g.logical_block_size,
                g.nr_hw_queues,
                g.queue_depth
            ),
            (1 << 40, 4096, 1, 32)
        );
        assert!(g.rotational && g.write_cache);
        assert_eq!(g.max_hw_sectors, 65536);
        let spec = DeviceSpec::parse("sim:ssd,wc=0,qd=64").unwrap();
        let d = SimDevice::from_spec(&spec, crate::clock::RealClock::new()).unwrap();
        let g = d.geometry();
        assert!(!g.rotational && !g.write_cache);
        assert_eq!(g.queue_depth, 64);
    }
}
