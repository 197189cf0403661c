//! The request queue of one device: validation and splitting of bios, blk-mq
//! hardware queues with tags, dispatch to the driver, completion, accounting.

use super::bio::{Bio, BioEndIo, BioFlags, BlkError, BlkResult, Op, Request, SECTOR_SIZE};
use super::plug;
use super::qos::{LatencyWindow, RqQos};
use super::stats::{DiskStats, IoStatsMode, StatsState};
use super::tags::{HctxTags, RQ_INFLIGHT_READ, RQ_INFLIGHT_WRITE};
use super::wbt::{self, Wbt, WbtConfig, WbtState};
use crate::buf::IoBuf;
use crate::clock::{ClockRef, RealClock};
use crate::dev::{self, Completer, DeviceRef, Geometry, RqComplete};
use parking_lot::{Condvar, Mutex, MutexGuard, RwLock};
use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

/// Default soft limit on request size (the kernel's BLK_DEF_MAX_SECTORS_CAP, 1280 KiB).
pub const DEFAULT_MAX_SECTORS_KB: u32 = 1280;

/// Queue settings (the kernel's /sys/block/X/queue knobs that live here).
#[derive(Clone)]
pub struct QueueConfig {
    pub iostats: IoStatsMode,
    /// Largest request built by merging, in KiB (bounded by the device's max_hw_sectors).
    pub max_sectors_kb: u32,
    /// Tags per hardware queue; defaults to the device's queue depth.
    pub nr_requests: Option<u32>,
    /// Writeback throttling target in µs (sysfs wbt_lat_usec): None = on with the
    /// default for the device (2 ms, or 75 ms if rotational), Some(0) = off.
    pub wbt_lat_usec: Option<u64>,
    pub clock: ClockRef,
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            iostats: IoStatsMode::Tags,
            max_sectors_kb: DEFAULT_MAX_SECTORS_KB,
            nr_requests: None,
            wbt_lat_usec: None,
            clock: RealClock::new(),
        }
    }
}

/// The limits bios and merges are checked against.
#[derive(Clone, Copy, Debug)]
pub struct QueueLimits {
    pub logical_block_size: u32,
    pub capacity_sectors: u64,
    pub max_hw_sectors: u32,
    pub max_segments: u32,
    pub max_segment_size: u32,
}

impl QueueLimits {
    /// Physical segments of one bio: its buffer is contiguous, cut at max_segment_size.
    #[inline]
    pub fn bio_segments(&self, bio: &Bio) -> u32 {
        match &bio.buf {
            Some(b) => (b.len() as u32).div_ceil(self.max_segment_size).max(1),
            None => 0,
        }
    }
}

static NEXT_QUEUE_ID: AtomicU64 = AtomicU64::new(1);
static NEXT_THREAD: AtomicU32 = AtomicU32::new(0);

thread_local! {
    /// This thread's index, which picks its hardware queue (the kernel maps CPUs).
    static THREAD_IDX: Cell<u32> = const { Cell::new(u32::MAX) };
    /// Where this thread last found a free tag.
    static TAG_HINT: Cell<u32> = const { Cell::new(0) };
}

/// How long a wait in the block layer waits in the thread's own rings at a time before
/// looking again at what it waits for.
pub(crate) const OWN_POLL_NS: u64 = 1_000_000;

#[inline]
fn thread_idx() -> u32 {
    THREAD_IDX.with(|c| {
        let v = c.get();
        if v != u32::MAX {
            return v;
        }
        let n = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
        c.set(n);
        n
    })
}

/// Everything completion needs, shared with the device through the `Completer`.
struct QueueCore {
    hctxs: Box<[HctxTags]>,
    stats: StatsState,
    lat: LatencyWindow,
    qos: RwLock<Vec<Arc<dyn RqQos>>>,
    qos_active: AtomicBool,
    /// Called directly rather than through `qos`: off, it costs a relaxed load at
    /// submission and one at dispatch; on, reads pay a few more.
    wbt: Wbt,
    clock: ClockRef,
    /// Writes completed without FUA (successful or not): what a volatile cache may
    /// still hold. A filesystem that saw this unchanged since it last issued a flush
    /// knows a FUA write alone is durable with everything before it.
    volatile_writes: AtomicU64,
}

impl QueueCore {
    /// In-flight requests owned by the driver, by walking every hardware queue's tags.
    fn in_flight_tags(&self) -> [u64; 2] {
        let mut c = [0u32; 2];
        for h in self.hctxs.iter() {
            h.in_flight(&mut c);
        }
        [c[0] as u64, c[1] as u64]
    }

    #[inline]
    fn round_stats(&self, mode: IoStatsMode, now: u64) {
        match mode {
            IoStatsMode::Off => {}
            IoStatsMode::Atomic => self.stats.round(now, || {
                let f = self.stats.atomic_in_flight();
                f[0] + f[1]
            }),
            IoStatsMode::Tags => self.stats.round(now, || {
                let f = self.in_flight_tags();
                f[0] + f[1]
            }),
        }
    }

    /// Service latency (wbt, latency windows) needs the fine clock; accounting, at
    /// tick granularity like the kernel's jiffies, does not.
    #[inline]
    fn needs_fine_time(&self) -> bool {
        self.qos_active.load(Ordering::Relaxed) || self.lat.is_armed()
    }
}

impl RqComplete for QueueCore {
    fn complete(&self, mut rq: Request, status: BlkResult) {
        let mode = rq.io_stat;
        let mut coarse = None;
        if mode != IoStatsMode::Off {
            let now = self.clock.coarse_ns();
            coarse = Some(now);
            self.round_stats(mode, now);
            let nsecs = now.saturating_sub(rq.start_ns);
            self.stats.done(mode, rq.op, rq.nr_sectors, nsecs);
            // The kernel splits a PREFLUSH write into a flush request and the write
            // (blk-flush), and diskstats counts that flush (fields 15-16): so do we, or
            // an fsync's flush would vanish from iostat and the lab's flush counts.
            if rq.op == Op::Write && rq.flags.contains(BioFlags::PREFLUSH) {
                self.stats.done_preflush(mode, nsecs);
            }
        }
        let wbt_flags = rq.wbt_flags;
        let wbt_sample = wbt_flags & wbt::flags::STAT != 0 && self.wbt.is_armed();
        if wbt_sample || self.needs_fine_time() {
            let now = self.clock.now_ns();
            if wbt_sample {
                self.wbt
                    .add_sample(rq.op, now.saturating_sub(rq.io_start_ns));
            }
            if self.lat.is_armed() {
                self.lat.add(rq.op, now.saturating_sub(rq.io_start_ns));
            }
            if self.qos_active.load(Ordering::Relaxed) {
                for q in self.qos.read().iter() {
                    q.done(&rq, now);
                }
            }
        }
        crate::trace::emit("block_rq_complete", || {
            let now = self.clock.now_ns();
            serde_json::json!({
                "op": format!("{:?}", rq.op),
                "sector": rq.sector,
                "nr_sector": rq.nr_sectors,
                // From dispatch (tag) to completion, and from the request's creation.
                "service_ns": if rq.io_start_ns == 0 { 0 } else { now.saturating_sub(rq.io_start_ns) },
                "total_ns": now.saturating_sub(rq.start_ns),
                "wbt_flags": wbt_flags,
                "error": status.is_err(),
            })
        });
        // Before the tag is freed: the tag is what identifies the watched read.
        if wbt_flags & (wbt::flags::TRACKED | wbt::flags::READ) != 0 {
            let now = coarse.unwrap_or_else(|| self.clock.coarse_ns());
            self.wbt.done(&rq, wbt_flags, now);
        }
        if rq.op == Op::Write && !rq.flags.contains(BioFlags::FUA) {
            // Before the bios end: whatever their completion makes depend on this
            // write (an extent logged for ordered data) is seen after the count is.
            self.volatile_writes.fetch_add(1, Ordering::AcqRel);
        }
        // Free the tag before ending the bios, so a submitter woken by its bio finds it.
        self.hctxs[rq.hctx as usize].put(rq.tag);
        let n = rq.bios.len();
        if n == 1 {
            let bio = rq.bios.pop().unwrap();
            bio.complete(status);
        } else {
            super::bio::completion_batch(|| {
                for bio in rq.bios.drain(..) {
                    bio.complete(status.clone());
                }
            });
        }
    }
}

/// One device's request queue.
pub struct RequestQueue {
    id: u64,
    dev: DeviceRef,
    core: Arc<QueueCore>,
    done: Completer,
    limits: QueueLimits,
    max_sectors: AtomicU32,
}

impl RequestQueue {
    pub fn new(dev: DeviceRef, cfg: QueueConfig) -> Result<Arc<RequestQueue>, BlkError> {
        let g = dev.geometry().clone();
        let depth = cfg.nr_requests.unwrap_or(g.queue_depth);
        if depth == 0 || depth > 4096 {
            return Err(BlkError::Invalid(format!(
                "nr_requests={depth}: must be from 1 to 4096"
            )));
        }
        let id = NEXT_QUEUE_ID.fetch_add(1, Ordering::Relaxed);
        let wbt = Wbt::new(WbtConfig {
            queue_depth: depth,
            rotational: g.rotational,
            wc: g.write_cache,
            lat_usec: cfg.wbt_lat_usec,
            clock: cfg.clock.clone(),
            queue_id: id,
        });
        let core = Arc::new(QueueCore {
            hctxs: (0..g.nr_hw_queues.max(1))
                .map(|_| HctxTags::new(depth))
                .collect(),
            stats: StatsState::new(cfg.iostats),
            lat: LatencyWindow::default(),
            qos: RwLock::new(Vec::new()),
            qos_active: AtomicBool::new(false),
            wbt,
            clock: cfg.clock.clone(),
            volatile_writes: AtomicU64::new(0),
        });
        let limits = QueueLimits {
            logical_block_size: g.logical_block_size,
            capacity_sectors: g.nr_sectors(),
            max_hw_sectors: g.max_hw_sectors,
            max_segments: g.max_segments,
            max_segment_size: g.max_segment_size,
        };
        let q = RequestQueue {
            id,
            dev,
            done: core.clone(),
            core,
            limits,
            max_sectors: AtomicU32::new(0),
        };
        q.set_max_sectors_kb(cfg.max_sectors_kb)?;
        Ok(Arc::new(q))
    }

    /// Open the device named by `spec` and put a queue in front of it.
    pub fn open(spec: &str, cfg: QueueConfig) -> Result<Arc<RequestQueue>, String> {
        let dev = dev::open(spec, cfg.clock.clone()).map_err(|e| e.to_string())?;
        RequestQueue::new(dev, cfg).map_err(|e| e.to_string())
    }

    pub fn id(&self) -> u64 {
        self.id
    }
    pub fn device(&self) -> &DeviceRef {
        &self.dev
    }
    pub fn geometry(&self) -> &Geometry {
        self.dev.geometry()
    }
    pub fn limits(&self) -> QueueLimits {
        self.limits
    }
    pub fn clock(&self) -> &ClockRef {
        &self.core.clock
    }

    /// Current soft request-size limit in sectors (max_sectors_kb × 2).
    #[inline]
    pub fn max_sectors(&self) -> u32 {
        self.max_sectors.load(Ordering::Relaxed)
    }
    pub fn max_sectors_kb(&self) -> u32 {
        self.max_sectors() / 2
    }
    pub fn set_max_sectors_kb(&self, kb: u32) -> Result<(), BlkError> {
        let lbs_kb = (self.limits.logical_block_size / 1024).max(1);
        if kb < lbs_kb || kb > self.limits.max_hw_sectors / 2 {
            return Err(BlkError::Invalid(format!(
                "max_sectors_kb={kb}: must be from {lbs_kb} to the device's max_hw_sectors_kb {}",
                self.limits.max_hw_sectors / 2
            )));
        }
        self.max_sectors.store(kb * 2, Ordering::Relaxed);
        Ok(())
    }

    pub fn iostats(&self) -> IoStatsMode {
        self.core.stats.mode()
    }
    /// Switch the accounting mode for requests created from now on; those already
    /// created finish the way they started (`Request::io_stat`).
    pub fn set_iostats(&self, m: IoStatsMode) {
        self.core.stats.set_mode(m);
    }

    pub fn nr_hw_queues(&self) -> usize {
        self.core.hctxs.len()
    }

    pub fn add_qos(&self, q: Arc<dyn RqQos>) {
        self.core.qos.write().push(q);
        self.core.qos_active.store(true, Ordering::Release);
    }

    /// This queue's writeback throttling.
    pub fn wbt(&self) -> &Wbt {
        &self.core.wbt
    }

    /// The wbt latency target in µs, 0 when off (sysfs wbt_lat_usec).
    pub fn wbt_lat_usec(&self) -> u64 {
        self.core.wbt.lat_usec()
    }

    /// Set the wbt latency target in µs; 0 turns wbt off. Pins the setting.
    pub fn set_wbt_lat_usec(&self, usec: u64) {
        self.core.wbt.set_lat_usec(usec);
    }

    /// Whether wbt grows depth only after windows in which its limit held writes back
    /// (true, the default) or after every window whose reads met the target (false,
    /// the kernel's rule).
    pub fn set_wbt_scale_up_when_limited(&self, on: bool) {
        self.core.wbt.set_scale_up_when_limited(on);
    }

    /// How wbt judges a window's reads: the fastest against the target (`Min`, the
    /// kernel's wbt) or the tail (`Tail`, the default: blk-iolatency's rule).
    pub fn set_wbt_judge(&self, j: super::wbt::WbtJudge) {
        self.core.wbt.set_judge(j);
    }

    /// wbt's step, limits, window and wait counts.
    pub fn wbt_state(&self) -> WbtState {
        self.core.wbt.state()
    }

    pub fn latency_window(&self) -> &LatencyWindow {
        &self.core.lat
    }

    /// Requests owned by the driver [read, write], from the busy tags (sysfs `inflight`).
    pub fn in_flight(&self) -> [u64; 2] {
        self.core.in_flight_tags()
    }

    /// All /proc/diskstats fields. Time in progress is folded in up to now first, so a
    /// long request is accounted up to the read.
    pub fn diskstats(&self) -> DiskStats {
        let mode = self.core.stats.mode();
        self.core.round_stats(mode, self.core.clock.coarse_ns());
        let mut d = self.core.stats.snapshot();
        d.in_flight = match mode {
            IoStatsMode::Off => [0, 0],
            IoStatsMode::Atomic => self.core.stats.atomic_in_flight(),
            IoStatsMode::Tags => self.core.in_flight_tags(),
        };
        d
    }

    fn check_bio(&self, bio: &Bio) -> BlkResult {
        let lim = &self.limits;
        let lbs_sectors = (lim.logical_block_size as u64) / SECTOR_SIZE;
        match bio.op {
            Op::Flush => return Ok(()),
            Op::Read | Op::Write => {
                let Some(buf) = &bio.buf else {
                    return Err(BlkError::Invalid(format!(
                        "{:?} bio at sector {} has no buffer",
                        bio.op, bio.sector
                    )));
                };
                if buf.len() as u64 != bio.bytes() {
                    return Err(BlkError::Invalid(format!(
                        "bio at sector {} says {} sectors ({} bytes) but its buffer holds {} bytes",
                        bio.sector,
                        bio.nr_sectors,
                        bio.bytes(),
                        buf.len()
                    )));
                }
            }
            Op::Discard => {}
        }
        if bio.nr_sectors == 0 {
            return Err(BlkError::Invalid(format!(
                "empty {:?} bio at sector {}",
                bio.op, bio.sector
            )));
        }
        if !bio.sector.is_multiple_of(lbs_sectors)
            || !(bio.nr_sectors as u64).is_multiple_of(lbs_sectors)
        {
            return Err(BlkError::Invalid(format!(
                "bio at sector {} of {} sectors is not aligned to the logical block size ({} bytes)",
                bio.sector, bio.nr_sectors, lim.logical_block_size
            )));
        }
        if bio.end_sector() > lim.capacity_sectors {
            return Err(BlkError::Invalid(format!(
                "bio at sector {} of {} sectors ends past the end of the device ({} sectors)",
                bio.sector, bio.nr_sectors, lim.capacity_sectors
            )));
        }
        Ok(())
    }

    /// Submit a bio. It is merged into the thread's plug, queued there, or dispatched
    /// at once; its `end_io` is called when it completes. A malformed bio is refused
    /// with `BlkError::Invalid` and dropped without calling `end_io`.
    pub fn submit_bio(self: &Arc<Self>, bio: Bio) -> BlkResult {
        self.check_bio(&bio)?;
        let max = match bio.op {
            Op::Discard => self.limits.max_hw_sectors,
            _ => self.max_sectors(),
        };
        if bio.op.has_data() && bio.nr_sectors > max {
            return self.submit_split(bio, max);
        }
        // Flushes and FUA/PREFLUSH writes are never held in a plug: what was plugged
        // before them is dispatched first, so they reach the device in submission order.
        let ordered = bio.op == Op::Flush
            || bio
                .flags
                .intersects(BioFlags(BioFlags::FUA.0 | BioFlags::PREFLUSH.0));
        let plugged = plug::is_plugged();
        if plugged && ordered {
            plug::flush_plug();
        }
        let bio = if plugged && !bio.flags.no_merge() {
            match plug::try_merge(self, bio) {
                Ok(()) => return Ok(()),
                Err(bio) => bio,
            }
        } else {
            bio
        };
        let io_stat = self.core.stats.mode();
        let stats_on = io_stat != IoStatsMode::Off;
        let wbt_on = self.core.wbt.enabled();
        // One coarse read serves both accounting and wbt's read stamps.
        let mut start_ns = if stats_on || wbt_on {
            self.core.clock.coarse_ns()
        } else {
            0
        };
        let mut wbt_flags = 0;
        if wbt_on {
            let (f, slept) = self.core.wbt.throttle(&bio, start_ns);
            wbt_flags = f;
            if slept && stats_on {
                start_ns = self.core.clock.coarse_ns();
            }
        }
        let mut qos_flags = 0;
        if self.core.qos_active.load(Ordering::Relaxed) {
            for q in self.core.qos.read().iter() {
                qos_flags |= q.throttle(&bio);
            }
        }
        let segs = self.limits.bio_segments(&bio);
        let mut rq = Request::from_bio(bio, segs);
        rq.qos_flags = qos_flags;
        rq.wbt_flags = wbt_flags;
        if stats_on {
            rq.start_ns = start_ns;
            rq.io_stat = io_stat;
        }
        if plugged && !ordered {
            plug::add(self.clone(), rq);
        } else {
            let h = self.dispatch(rq);
            self.dev.commit_rqs(h);
        }
        Ok(())
    }

    /// Split a bio larger than the request limit into children (bio_split_to_limits);
    /// the parent completes when the last child does, with the first error.
    fn submit_split(self: &Arc<Self>, mut bio: Bio, max_sectors: u32) -> BlkResult {
        let lbs_sectors = self.limits.logical_block_size / SECTOR_SIZE as u32;
        let step = (max_sectors / lbs_sectors).max(1) * lbs_sectors;
        let n = bio.nr_sectors.div_ceil(step);
        let parent_buf = bio.buf.take().expect("checked: data bio has a buffer");
        let mut children = Vec::with_capacity(n as usize);
        for i in 0..n {
            let off = i * step;
            let len = step.min(bio.nr_sectors - off);
            let bytes = (off as usize * 512)..((off + len) as usize * 512);
            let buf = match bio.op {
                Op::Write => IoBuf::from_slice(&parent_buf.as_slice()[bytes.clone()]),
                _ => IoBuf::zeroed(bytes.len()),
            };
            let mut c = Bio::write(bio.sector + off as u64, buf);
            c.op = bio.op;
            c.flags = bio.flags;
            c.private = bytes.start as u64;
            children.push(c);
        }
        bio.buf = Some(parent_buf);
        let parent = Arc::new(SplitParent {
            remaining: AtomicU32::new(n),
            state: Mutex::new((Some(bio), Ok(()))),
        });
        for mut c in children {
            c.end_io = Some(parent.clone());
            self.submit_bio(c)?;
        }
        Ok(())
    }

    /// Give `rq` a tag on this thread's hardware queue and hand it to the device.
    /// Returns the hardware queue, which the caller commits.
    pub(crate) fn dispatch(&self, mut rq: Request) -> u16 {
        let core = &*self.core;
        let h = (thread_idx() as usize % core.hctxs.len()) as u16;
        let tags = &core.hctxs[h as usize];
        let hint = TAG_HINT.with(|c| c.get());
        let tag = match tags.try_get(hint) {
            Some(t) => t,
            None => loop {
                // Never sleep on a tag while holding back IO that would free one: push
                // out the batch and the plug, and reap this thread's own polled
                // requests (which complete only when it polls) instead of sleeping.
                self.dev.commit_rqs(h);
                plug::flush_plug();
                if crate::dev::uring::poll_own_rings(OWN_POLL_NS).is_none() {
                    break tags.get_blocking(hint, || {
                        self.dev.commit_rqs(h);
                        plug::flush_plug();
                    });
                }
                if let Some(t) = tags.try_get(hint) {
                    break t;
                }
            },
        };
        TAG_HINT.with(|c| c.set(tag));
        rq.hctx = h;
        rq.tag = tag;
        let mode = rq.io_stat;
        if mode != IoStatsMode::Off {
            // Fold time in before this request counts as in flight. The request's own
            // creation stamp serves: a stale time only makes the once-per-tick gate
            // skip, and it saves a clock read per IO.
            core.round_stats(mode, rq.start_ns);
            core.stats.start(mode, rq.op);
        }
        // wbt needs service latencies only while its window is armed.
        let wbt_armed = core.wbt.is_armed();
        if wbt_armed || core.needs_fine_time() {
            let now = core.clock.now_ns();
            rq.io_start_ns = now;
            if wbt_armed {
                rq.wbt_flags |= wbt::flags::STAT;
                core.wbt.issue(&rq, rq.wbt_flags, now);
            }
            if core.qos_active.load(Ordering::Relaxed) {
                for q in core.qos.read().iter() {
                    q.issue(&rq, now);
                }
            }
        }
        // By op_is_write, as the kernel's blk_mq_in_flight_rw and the atomic count:
        // a flush (REQ_OP_FLUSH, an even op) is in flight as a read.
        tags.set_state(
            tag,
            if rq.op.is_write() {
                RQ_INFLIGHT_WRITE
            } else {
                RQ_INFLIGHT_READ
            },
        );
        self.dev.queue_rq(rq, &self.done);
        h
    }

    /// Reap this thread's completions from the device, waiting up to `timeout_ns`
    /// (polled IO). Returns how many requests completed here; 0 when the device
    /// completes on its own threads only. On the file device the first call gives the
    /// thread its own ring: from then on its requests complete only when it polls or
    /// waits in the block layer (see `dev::uring`).
    pub fn poll(&self, timeout_ns: u64) -> usize {
        plug::flush_plug();
        let h = (thread_idx() as usize % self.core.hctxs.len()) as u16;
        self.dev.poll(h, timeout_ns)
    }

    pub fn can_poll(&self) -> bool {
        self.dev.can_poll()
    }

    pub(crate) fn commit(&self, hctx: u16) {
        self.dev.commit_rqs(hctx);
    }

    pub(crate) fn stats_merged(&self, op: Op) {
        self.core.stats.merged(self.core.stats.mode(), op);
    }

    // ---- Synchronous helpers --------------------------------------------------------

    /// Read `len` bytes at `sector` and wait.
    pub fn read_sync(self: &Arc<Self>, sector: u64, len: usize) -> Result<IoBuf, BlkError> {
        let w = BioWait::new();
        self.submit_bio(Bio::read(sector, len).with_end_io(w.clone()))?;
        let (bio, st) = w.wait_one();
        st.map(|_| bio.buf.expect("read bio keeps its buffer"))
    }

    /// Write `buf` at `sector` with `flags` and wait.
    pub fn write_sync(self: &Arc<Self>, sector: u64, buf: IoBuf, flags: BioFlags) -> BlkResult {
        let w = BioWait::new();
        self.submit_bio(
            Bio::write(sector, buf)
                .with_flags(flags)
                .with_end_io(w.clone()),
        )?;
        w.wait_one().1
    }

    /// Writes completed without FUA since the queue was made. A flush issued after
    /// reading N covers the first N; while the count stays N, nothing completed that
    /// a volatile cache could lose, so a FUA write needs no PREFLUSH to be durable
    /// after everything before it.
    pub fn volatile_writes(&self) -> u64 {
        self.core.volatile_writes.load(Ordering::Acquire)
    }

    /// Flush the device's volatile cache and wait.
    pub fn flush_sync(self: &Arc<Self>) -> BlkResult {
        let w = BioWait::new();
        self.submit_bio(Bio::flush().with_end_io(w.clone()))?;
        w.wait_one().1
    }

    /// Write zeroes over `nr_sectors` from `sector` and wait (blkdev_issue_zeroout): in
    /// bios of at most 4 MiB, a few in flight, so the buffers stay small however large
    /// the range; each is split to the device's limits as any bio is.
    pub fn write_zeroes_sync(self: &Arc<Self>, sector: u64, nr_sectors: u64) -> BlkResult {
        const CHUNK_SECTORS: u64 = (4 << 20) / SECTOR_SIZE;
        const IN_FLIGHT: usize = 4;
        let w = BioWait::new();
        let end = sector + nr_sectors;
        let (mut next, mut in_flight) = (sector, 0usize);
        while next < end || in_flight > 0 {
            if next < end && in_flight < IN_FLIGHT {
                let n = CHUNK_SECTORS.min(end - next);
                let buf = IoBuf::zeroed((n * SECTOR_SIZE) as usize);
                self.submit_bio(Bio::write(next, buf).with_end_io(w.clone()))?;
                next += n;
                in_flight += 1;
            } else {
                w.wait_one().1?;
                in_flight -= 1;
            }
        }
        Ok(())
    }

    pub fn discard_sync(self: &Arc<Self>, sector: u64, nr_sectors: u32) -> BlkResult {
        let w = BioWait::new();
        self.submit_bio(Bio::discard(sector, nr_sectors).with_end_io(w.clone()))?;
        w.wait_one().1
    }
}

struct SplitParent {
    remaining: AtomicU32,
    state: Mutex<(Option<Bio>, BlkResult)>,
}

impl BioEndIo for SplitParent {
    fn end_io(&self, child: Bio, status: BlkResult) {
        let mut st = self.state.lock();
        if let Err(e) = status {
            if st.1.is_ok() {
                st.1 = Err(e);
            }
        }
        if child.op == Op::Read {
            if let (Some(parent), Some(cb)) = (st.0.as_mut(), child.buf.as_ref()) {
                let off = child.private as usize;
                let pb = parent.buf.as_mut().expect("parent keeps its buffer");
                pb.as_mut_slice()[off..off + cb.len()].copy_from_slice(cb.as_slice());
            }
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            let parent = st.0.take().expect("parent completes once");
            let status = std::mem::replace(&mut st.1, Ok(()));
            drop(st);
            parent.complete(status);
        }
    }
}

/// Collects completed bios for a thread that waits on them. Waiting first flushes the
/// thread's plug, so waiting on one's own plugged IO cannot deadlock.
#[derive(Default)]
pub struct BioWait {
    /// In completion order; a deque so that taking them one at a time
    /// (`wait_one`) costs O(1) each, not a shift of the rest.
    done: Mutex<VecDeque<(Bio, BlkResult)>>,
    cv: Condvar,
}

impl BioWait {
    pub fn new() -> Arc<BioWait> {
        Arc::new(BioWait::default())
    }

    /// Wait until at least `n` bios have completed and take them (completion order).
    pub fn wait_n(&self, n: usize) -> Vec<(Bio, BlkResult)> {
        Vec::from(std::mem::take(&mut *self.wait_for(n)))
    }

    /// Wait for the first completion not yet taken and take it.
    pub fn wait_one(&self) -> (Bio, BlkResult) {
        self.wait_for(1)
            .pop_front()
            .expect("waited for a completion")
    }

    /// The completions, once at least `n` are in.
    fn wait_for(&self, n: usize) -> MutexGuard<'_, VecDeque<(Bio, BlkResult)>> {
        plug::flush_plug();
        let mut d = self.done.lock();
        while d.len() < n {
            // A thread that polls reaps its own requests (the completion may be ours).
            drop(d);
            let polled = crate::dev::uring::poll_own_rings(OWN_POLL_NS).is_some();
            d = self.done.lock();
            if !polled && d.len() < n {
                self.cv.wait(&mut d);
            }
        }
        d
    }

    pub fn completed(&self) -> usize {
        self.done.lock().len()
    }
}

impl BioEndIo for BioWait {
    fn end_io(&self, bio: Bio, status: BlkResult) {
        self.done.lock().push_back((bio, status));
        self.cv.notify_all();
    }
}
