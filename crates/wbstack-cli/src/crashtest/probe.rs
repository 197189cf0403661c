//! Where a cut lands: a device between the block layer and the simulated device that
//! knows what is inside the device when the power goes.

use super::*;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use wbstack::block::{BioFlags, BlkError, BlkResult, Op, Request};
use wbstack::dev::sim::SimDevice;
use wbstack::dev::{Completer, Device, DeviceRef, RqComplete};
use wbstack::fs::format::Superblock;

/// Where on the device a request goes (from the superblock's layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Area {
    Superblock,
    Journal,
    Checkpoint,
    Data,
    Flush,
}

impl Area {
    fn name(self) -> &'static str {
        match self {
            Area::Superblock => "superblock",
            Area::Journal => "journal",
            Area::Checkpoint => "checkpoint",
            Area::Data => "data",
            Area::Flush => "flush",
        }
    }
}

/// Sector ranges of the journal, the checkpoint slots and the data area.
#[derive(Clone, Copy)]
pub(crate) struct Layout {
    journal: (u64, u64),
    ckpt: [(u64, u64); 2],
    data: u64,
}

impl Layout {
    fn of(sb: &Superblock) -> Layout {
        let s = |b: u64| b * (wbstack::fs::format::BLOCK_SIZE as u64 / SECTOR);
        let run = |(start, len): (u64, u64)| (s(start), s(start + len));
        Layout {
            journal: run((sb.journal_start, sb.journal_blocks)),
            ckpt: [run(sb.checkpoint[0]), run(sb.checkpoint[1])],
            data: s(sb.data_start),
        }
    }

    fn area(&self, sector: u64) -> Area {
        let inside = |(a, b): (u64, u64)| (a..b).contains(&sector);
        if sector >= self.data {
            Area::Data
        } else if inside(self.journal) {
            Area::Journal
        } else if self.ckpt.iter().any(|&r| inside(r)) {
            Area::Checkpoint
        } else {
            Area::Superblock
        }
    }
}

pub(crate) struct RqInfo {
    area: Area,
    bytes: u64,
    write: bool,
    fua: bool,
    preflush: bool,
    /// A cache flush: the volatile writes completed when it was issued, all it covers.
    covers: Option<(u64, u64)>,
}

/// Requests of one area inside the device at the cut.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct InFlight {
    pub requests: u64,
    pub bytes: u64,
}

/// What was going on when the power went.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Landing {
    /// Requests inside the device, by area: superblock, journal, checkpoint, data, flush.
    pub in_flight: BTreeMap<String, InFlight>,
    /// Of those, requests carrying PREFLUSH or FUA (a commit or a checkpoint).
    pub in_flight_preflush_fua: u64,
    /// Volatile writes completed that no completed cache flush covers (one covers the
    /// writes completed before it was issued): what a torn cut keeps part of.
    pub unflushed_writes: u64,
    pub unflushed_bytes: u64,
    /// Requests sent to the device since mkfs, before the cut.
    pub requests_before: u64,
    /// Workload operations started before the cut.
    pub op: u64,
}

impl Landing {
    pub(crate) fn describe(&self) -> String {
        let mut parts: Vec<String> = self
            .in_flight
            .iter()
            .map(|(a, f)| {
                if f.bytes > 0 {
                    format!("{a} {} ({} KiB)", f.requests, f.bytes >> 10)
                } else {
                    format!("{a} {}", f.requests)
                }
            })
            .collect();
        if parts.is_empty() {
            parts.push("nothing in flight".into());
        }
        if self.unflushed_writes > 0 {
            parts.push(format!(
                "unflushed {} ({} KiB)",
                self.unflushed_writes,
                self.unflushed_bytes >> 10
            ));
        }
        parts.join(", ")
    }
}

#[derive(Default)]
pub(crate) struct ProbeState {
    layout: Option<Layout>,
    next_id: u64,
    inflight: BTreeMap<u64, RqInfo>,
    /// Volatile writes (count, bytes) completed so far, and of those, covered by a
    /// completed cache flush.
    completed: (u64, u64),
    flushed: (u64, u64),
    landing: Option<Landing>,
    ops: Arc<AtomicU64>,
    /// Cut when the n-th request to this area from now enters the device.
    trigger: Option<(Area, u64)>,
}

impl ProbeState {
    /// The first call after the power went: what is inside the device now is what the
    /// cut hit (later requests fail at once, they were never inside).
    fn snapshot(&mut self) {
        if self.landing.is_some() {
            return;
        }
        let mut l = Landing {
            unflushed_writes: self.completed.0 - self.flushed.0,
            unflushed_bytes: self.completed.1 - self.flushed.1,
            requests_before: self.next_id,
            op: self.ops.load(Ordering::SeqCst),
            ..Landing::default()
        };
        for r in self.inflight.values() {
            let e = l.in_flight.entry(r.area.name().to_string()).or_default();
            e.requests += 1;
            e.bytes += r.bytes;
            l.in_flight_preflush_fua += (r.fua || r.preflush) as u64;
        }
        self.landing = Some(l);
    }
}

pub(crate) struct Probe {
    inner: DeviceRef,
    st: Arc<Mutex<ProbeState>>,
    /// A lying device, for testing crashtest itself: PREFLUSH is dropped from every
    /// request, so a commit no longer makes the data written before it durable.
    drop_preflush: bool,
}

impl Probe {
    pub(crate) fn new(
        inner: DeviceRef,
        ops: Arc<AtomicU64>,
        drop_preflush: bool,
    ) -> Result<Probe, String> {
        if inner.as_any().downcast_ref::<SimDevice>().is_none() {
            return Err("crashtest needs a simulated device (sim:ssd or sim:hdd)".into());
        }
        Ok(Probe {
            inner,
            drop_preflush,
            st: Arc::new(Mutex::new(ProbeState {
                ops,
                ..ProbeState::default()
            })),
        })
    }

    pub(crate) fn sim(&self) -> &SimDevice {
        self.inner
            .as_any()
            .downcast_ref::<SimDevice>()
            .expect("checked in Probe::new")
    }

    pub(crate) fn set_layout(&self, sb: &Superblock) {
        self.st.lock().layout = Some(Layout::of(sb));
    }

    /// Cut when the `n`-th request from now enters the device (it is torn with the rest).
    pub(crate) fn arm(&self, n: u64) {
        self.sim().power_cut_after(n, true);
    }

    /// Cut when the next request to `area` enters the device (it is torn with the rest).
    pub(crate) fn arm_on(&self, area: Area) {
        self.st.lock().trigger = Some((area, 1));
    }

    pub(crate) fn cut_now(&self) {
        {
            let mut s = self.st.lock();
            s.snapshot();
            // A trigger left armed would cut the recovery (fsck and mount read and write
            // the same areas).
            s.trigger = None;
        }
        self.sim().power_cut(true);
    }

    /// No cut pending any more, whatever was armed.
    pub(crate) fn disarm(&self) {
        self.st.lock().trigger = None;
    }

    pub(crate) fn powered(&self) -> bool {
        self.sim().powered()
    }

    pub(crate) fn landing(&self) -> Landing {
        self.st.lock().landing.clone().unwrap_or_default()
    }
}

impl Device for Probe {
    wbstack::stacked_device!(inner);
    fn queue_rq(&self, mut rq: Request, done: &Completer) {
        if self.drop_preflush {
            rq.flags = BioFlags(rq.flags.0 & !BioFlags::PREFLUSH.0);
        }
        let mut fire = false;
        let id = {
            let mut s = self.st.lock();
            let area = match (rq.op, s.layout) {
                (Op::Flush, _) => Area::Flush,
                (_, Some(l)) => l.area(rq.sector),
                (_, None) => Area::Superblock,
            };
            if let Some((a, left)) = s.trigger.as_mut() {
                if *a == area {
                    *left -= 1;
                    if *left == 0 {
                        s.trigger = None;
                        fire = true;
                    }
                }
            }
            let id = s.next_id;
            s.next_id += 1;
            let preflush = rq.flags.contains(BioFlags::PREFLUSH);
            let covers = (rq.op == Op::Flush || preflush).then_some(s.completed);
            if preflush {
                // The sim flushes a write's PREFLUSH as the write enters it.
                s.flushed = s.completed;
            }
            s.inflight.insert(
                id,
                RqInfo {
                    area,
                    bytes: if rq.op == Op::Flush { 0 } else { rq.bytes() },
                    write: rq.op == Op::Write,
                    fua: rq.flags.contains(BioFlags::FUA),
                    preflush,
                    covers,
                },
            );
            id
        };
        let d: Completer = Arc::new(ProbeDone {
            st: self.st.clone(),
            id,
            done: done.clone(),
        });
        if fire {
            // This very request is the one inside the device when the power goes.
            self.sim().power_cut_after(1, true);
        }
        self.inner.queue_rq(rq, &d);
    }
}

pub(crate) struct ProbeDone {
    st: Arc<Mutex<ProbeState>>,
    id: u64,
    done: Completer,
}

impl RqComplete for ProbeDone {
    fn complete(&self, rq: Request, status: BlkResult) {
        {
            let mut s = self.st.lock();
            if matches!(status, Err(BlkError::PowerLoss)) {
                s.snapshot();
            }
            if let Some(r) = s.inflight.remove(&self.id) {
                if status.is_ok() {
                    if let (Some(c), Area::Flush) = (r.covers, r.area) {
                        // Flushes may complete out of issue order; each covers a prefix.
                        s.flushed = (s.flushed.0.max(c.0), s.flushed.1.max(c.1));
                    }
                    if r.write && !r.fua {
                        s.completed.0 += 1;
                        s.completed.1 += r.bytes;
                    }
                }
            }
        }
        self.done.complete(rq, status);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wbstack::block::Bio;
    use wbstack::buf::IoBuf;

    struct Done(Mutex<Vec<BlkResult>>);

    impl RqComplete for Done {
        fn complete(&self, _rq: Request, status: BlkResult) {
            self.0.lock().push(status);
        }
    }

    #[test]
    fn a_cut_disarms_a_trigger_that_never_fired() {
        let dev = wbstack::dev::open("sim:ssd,size=64M", QueueConfig::default().clock).unwrap();
        let probe = Probe::new(dev, Arc::new(AtomicU64::new(0)), false).unwrap();
        let sb = Superblock::layout(16384, 1, 0).unwrap();
        probe.set_layout(&sb);
        // Armed for a checkpoint write that never comes; the run ends with a cut.
        probe.arm_on(Area::Checkpoint);
        probe.cut_now();
        probe.sim().reboot();
        // Recovery's own checkpoint write must not cut the power again.
        let done = Arc::new(Done(Mutex::new(Vec::new())));
        let c: Completer = done.clone();
        let sector = sb.checkpoint[0].0 * (BLOCK / SECTOR);
        let bio = Bio::write(sector, IoBuf::zeroed(BLOCK as usize));
        probe.queue_rq(Request::from_bio(bio, 1), &c);
        assert!(probe.powered(), "the old trigger cut the recovery");
    }
}
