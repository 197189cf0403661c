//! Per-thread block plugging.
//!
//! While a thread holds a [`Plug`], the requests it submits are kept back in a
//! thread-local list where later bios merge into them; at the outermost plug's end
//! (or whenever the thread is about to block on IO) the list is sorted by sector and
//! dispatched. Limits as in the kernel (block/blk-mq.c: blk_add_rq_to_plug): at most
//! 32 requests (64 when they span several queues), and a plug whose last request has
//! reached 128 KiB is flushed before another request is added.

use super::bio::{Bio, BioFlags, Request};
use super::queue::RequestQueue;
use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::Arc;

/// BLK_MAX_REQUEST_COUNT.
pub const BLK_MAX_REQUEST_COUNT: usize = 32;
/// BLK_PLUG_FLUSH_SIZE.
pub const BLK_PLUG_FLUSH_SIZE: u64 = 128 * 1024;

struct PlugRq {
    q: Arc<RequestQueue>,
    rq: Request,
}

#[derive(Default)]
struct PlugState {
    depth: u32,
    list: Vec<PlugRq>,
    multiple_queues: bool,
    /// Counters for tests and trace: flushes, and requests dispatched from the plug.
    flushes: u64,
}

thread_local! {
    static PLUG: RefCell<PlugState> = RefCell::new(PlugState::default());
}

/// An active plug on this thread (RAII). Nested plugs are no-ops: only the outermost
/// one's end dispatches.
pub struct Plug {
    // A plug belongs to the thread that started it.
    _not_send: PhantomData<*const ()>,
}

impl Plug {
    pub fn start() -> Plug {
        let outermost = PLUG.with(|p| {
            let mut p = p.borrow_mut();
            p.depth += 1;
            p.depth == 1
        });
        if outermost {
            crate::trace::emit("block_plug", || serde_json::json!({}));
        }
        Plug {
            _not_send: PhantomData,
        }
    }

    /// End the plug now (same as dropping it).
    pub fn finish(self) {}
}

impl Drop for Plug {
    fn drop(&mut self) {
        let outermost = PLUG.with(|p| {
            let mut p = p.borrow_mut();
            p.depth -= 1;
            p.depth == 0
        });
        if outermost {
            flush_plug();
        }
    }
}

/// Is a plug active on this thread?
#[inline]
pub fn is_plugged() -> bool {
    PLUG.with(|p| p.borrow().depth > 0)
}

/// Requests held in this thread's plug.
pub fn plugged_requests() -> usize {
    PLUG.with(|p| p.borrow().list.len())
}

/// Times this thread's plug was flushed with requests in it.
pub fn plug_flushes() -> u64 {
    PLUG.with(|p| p.borrow().flushes)
}

/// Dispatch everything held in this thread's plug. Called at the end of the outermost
/// plug and by every path that is about to block waiting for IO.
pub fn flush_plug() {
    let list = PLUG.with(|p| {
        let mut p = p.borrow_mut();
        if p.list.is_empty() {
            return Vec::new();
        }
        p.multiple_queues = false;
        p.flushes += 1;
        std::mem::take(&mut p.list)
    });
    if !list.is_empty() {
        let n = list.len();
        crate::trace::emit("block_unplug", || serde_json::json!({"nr_rq": n}));
        dispatch_list(list);
    }
}

fn dispatch_list(mut list: Vec<PlugRq>) {
    // Sort by (queue, sector), stable so equal sectors keep submission order (a flush
    // or FUA write never overtakes an earlier write to the same place).
    list.sort_by_key(|p| (p.q.id(), p.rq.sector));
    let mut last: Option<(Arc<RequestQueue>, Vec<u16>)> = None;
    for PlugRq { q, rq } in list {
        if let Some((lq, hs)) = &last {
            if lq.id() != q.id() {
                for h in hs {
                    lq.commit(*h);
                }
                last = None;
            }
        }
        let h = q.dispatch(rq);
        match &mut last {
            Some((_, hs)) => {
                if !hs.contains(&h) {
                    hs.push(h)
                }
            }
            None => last = Some((q, vec![h])),
        }
    }
    if let Some((lq, hs)) = last {
        for h in hs {
            lq.commit(h);
        }
    }
}

/// Outcome of trying to merge a bio into a request.
enum Merge {
    Done,
    /// The bio is adjacent but the merged request would break a limit: the request
    /// must never be tried again.
    TooBig,
    No,
}

fn try_merge_rq(q: &RequestQueue, rq: &mut Request, bio: &mut Option<Bio>) -> Merge {
    let b = bio.as_ref().unwrap();
    if rq.nomerge || rq.op != b.op || b.flags.no_merge() {
        return Merge::No;
    }
    // A request carries one set of flags, its first bio's, and a device may act on
    // META (`sim:...,data=meta` keeps only META writes): a bio of the other kind
    // merged in would be treated as that kind.
    if rq.flags.contains(BioFlags::META) != b.flags.contains(BioFlags::META) {
        return Merge::No;
    }
    let back = rq.end_sector() == b.sector;
    let front = b.end_sector() == rq.sector;
    if !back && !front {
        return Merge::No;
    }
    let lim = q.limits();
    let max = if rq.op == super::bio::Op::Discard {
        lim.max_hw_sectors
    } else {
        q.max_sectors()
    };
    let segs = lim.bio_segments(b);
    if rq.nr_sectors as u64 + b.nr_sectors as u64 > max as u64
        || (rq.op.has_data() && rq.nr_segments + segs > lim.max_segments)
    {
        return Merge::TooBig;
    }
    let b = bio.take().unwrap();
    rq.nr_sectors += b.nr_sectors;
    rq.nr_segments += segs;
    if back {
        rq.bios.push(b);
    } else {
        rq.sector = b.sector;
        rq.bios.insert(0, b);
    }
    Merge::Done
}

/// Try to merge `bio` into a request of the same queue held in this thread's plug
/// (newest first, as kernels before 5.16 tried every same-queue request).
pub(crate) fn try_merge(q: &Arc<RequestQueue>, bio: Bio) -> Result<(), Bio> {
    let op = bio.op;
    let mut slot = Some(bio);
    let merged = PLUG.with(|p| {
        let mut p = p.borrow_mut();
        for prq in p.list.iter_mut().rev() {
            if prq.q.id() != q.id() {
                continue;
            }
            match try_merge_rq(q, &mut prq.rq, &mut slot) {
                Merge::Done => return true,
                Merge::TooBig => prq.rq.nomerge = true,
                Merge::No => {}
            }
        }
        false
    });
    if merged {
        q.stats_merged(op);
        Ok(())
    } else {
        Err(slot.unwrap())
    }
}

/// Add a new request to this thread's plug, flushing first when a plug limit is hit.
pub(crate) fn add(q: Arc<RequestQueue>, rq: Request) {
    let must_flush = PLUG.with(|p| {
        let p = p.borrow();
        let limit = if p.multiple_queues {
            2 * BLK_MAX_REQUEST_COUNT
        } else {
            BLK_MAX_REQUEST_COUNT
        };
        p.list.len() >= limit
            || p.list
                .last()
                .is_some_and(|l| l.rq.bytes() >= BLK_PLUG_FLUSH_SIZE)
    });
    if must_flush {
        flush_plug();
    }
    PLUG.with(|p| {
        let mut p = p.borrow_mut();
        if p.list.first().is_some_and(|f| f.q.id() != q.id()) {
            p.multiple_queues = true;
        }
        p.list.push(PlugRq { q, rq });
    });
}
