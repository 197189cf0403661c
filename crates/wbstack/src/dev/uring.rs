//! The file device: a regular file or a block device driven with O_DIRECT through one
//! io_uring.
//!
//! Spec: `file:PATH[,size=SIZE][,create=1][,lbs=4096][,hw_queues=1][,qd=128]
//! [,max_hw_kb=32768][,wc=1][,rotational=0]`.
//!
//! - A regular file's size defaults to its length. With `create=1,size=SIZE` a missing
//!   file is created and a shorter one extended; a longer one is used up to `size`.
//! - A block device's size and logical block size come from the device; `size` may
//!   select a prefix of it.
//!
//! Execution follows blk-mq's batching contract: `queue_rq` only writes SQEs into a
//! submission ring and `commit_rqs` hands the batch to the kernel with one
//! `io_uring_enter`. While the kernel owns a request, the request and its iovec array sit
//! in a slab of its ring indexed by the SQE's user_data, which is what keeps the memory
//! the kernel reads and writes alive and in place.
//!
//! Two kinds of ring, as fio runs io_uring:
//! - A thread that polls (`Device::poll`, which `bench blk` calls while it waits) gets its
//!   own ring at its first poll, for the requests it queues from then on:
//!   SINGLE_ISSUER and DEFER_TASKRUN, the file registered, kept in a thread-local list
//!   and touched by no other thread, so it takes no lock. The kernel posts its
//!   completions only when that thread waits in it (`io_uring_enter` with GETEVENTS): no
//!   other thread is woken per IO and nothing interrupts the thread while it works.
//!   The price is the contract: such a thread must wait for its requests by polling.
//!   The block layer's own waits honour it (a tag, a wbt slot, `BioWait` reap the
//!   thread's rings through `poll_own_rings` instead of sleeping). The ring is drained
//!   when the thread drops the device, when it exits, or at its next poll or wait after
//!   another thread dropped the device (the ring holds a reference to the file and the
//!   buffers until then). A kernel refusing DEFER_TASKRUN (before 6.1) keeps pollers on
//!   the shared ring.
//! - Every other thread (the flusher, fsync, the committer: threads that submit and then
//!   sleep on a condition) shares one ring under a lock. A dedicated completion thread
//!   waits on it and reaps; a thread waiting in `poll` reaps it too.
//!
//! Why: with one shared ring, every completion woke the completion thread as well as
//! the polling submitter (2.4 context switches per IO against fio's 1 at QD1), and the
//! two contended for the completion ring. Registered buffers are not used: buffers are
//! the page pool's and the callers', anywhere in memory, and pinning them per IO
//! (`gup_fast_fallback`) costs about 2% in the profile.

use super::{
    geometry_from_spec, Completer, Device, DeviceSpec, Geometry, SpecError, GEOMETRY_KEYS,
};
use crate::block::bio::{BioFlags, BlkError, BlkResult, Op, Request, SECTOR_SHIFT};
use io_uring::{opcode, squeue, types, EnterFlags, IoUring};
use parking_lot::Mutex;
use smallvec::SmallVec;
use std::any::Any;
use std::cell::RefCell;
use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Device ids, naming a device's private rings in a thread's list.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// user_data of the NOP that tells the completion thread to wind down. Slot indices are
/// shifted left by one, so no request can carry it.
const SHUTDOWN: u64 = u64::MAX;
/// Low bit of user_data: the CQE belongs to the FSYNC linked ahead of a PREFLUSH write
/// rather than to the request's own operation.
const PREFLUSH_TAG: u64 = 1;
/// The kernel's IORING_MAX_ENTRIES; larger rings are refused.
const MAX_RING_ENTRIES: u64 = 32768;
/// UIO_MAXIOV: a READV/WRITEV with more iovecs fails with EINVAL, so longer requests go
/// in several SQEs through the short-IO path.
const MAX_IOV_PER_SQE: usize = 1024;
/// MAX_RW_COUNT: the kernel truncates any single read or write to this.
const MAX_RW_BYTES: usize = 0x7fff_f000;

/// Counters for tests and the CLI, to see batching at work.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UringStats {
    /// `io_uring_enter` calls that submitted SQEs.
    pub submit_calls: u64,
    /// SQEs written to the submission ring.
    pub sqes: u64,
    /// Short reads and writes resubmitted for their remainder.
    pub short_resubmits: u64,
    /// Private rings made for polling threads.
    pub private_rings: u64,
    /// Of `sqes`, those written to private rings.
    pub private_sqes: u64,
}

/// The iovec array of one request.
struct IoVecs(Box<[libc::iovec]>);

// SAFETY: the raw pointers point into the IoBufs of the request stored next to this
// array in the same `Slot`; IoBuf is Send, and the array is only read or changed by
// whoever holds the slab lock.
unsafe impl Send for IoVecs {}

/// A request the kernel is working on.
struct Slot {
    rq: Request,
    done: Completer,
    iov: IoVecs,
    /// First iovec not fully transferred yet (a short IO leaves it trimmed in place).
    first: usize,
    /// File offset of the first byte not transferred yet.
    offset: u64,
    /// CQEs still to come; the request completes when this reaches zero.
    cqes: u32,
    status: BlkResult,
}

#[derive(Default)]
struct Inner {
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    live: usize,
    /// The device is being dropped: short IOs are failed instead of resubmitted, so the
    /// completion thread can finish.
    closing: bool,
}

impl Inner {
    fn insert(&mut self, slot: Slot) -> usize {
        self.live += 1;
        match self.free.pop() {
            Some(i) => {
                self.slots[i] = Some(slot);
                i
            }
            None => {
                self.slots.push(Some(slot));
                self.slots.len() - 1
            }
        }
    }

    fn remove(&mut self, idx: usize) -> Option<Slot> {
        let s = self.slots.get_mut(idx)?.take()?;
        self.live -= 1;
        self.free.push(idx);
        Some(s)
    }
}

struct Shared {
    ring: IoUring,
    file: File,
    is_bdev: bool,
    path: String,
    /// The slab of in-flight requests. Its lock also guards the submission ring: every
    /// SubmissionQueue is created and dropped while holding it.
    inner: Mutex<Inner>,
    /// SQEs were pushed since the last submission.
    unsubmitted: AtomicBool,
    /// Serialises reading the completion ring: the completion thread and pollers
    /// (submitters reaping their own completions) both reap.
    cq_lock: Mutex<()>,
    /// The shutdown NOP was reaped (by whichever reaper got it).
    shutdown_seen: AtomicBool,
    submit_calls: AtomicU64,
    sqes: AtomicU64,
    short_resubmits: AtomicU64,
    /// Requests in flight on every ring, the shared one and the private ones.
    live: AtomicUsize,
    /// Private rings made for polling threads, and the SQEs written to them.
    private_rings: AtomicU64,
    private_sqes: AtomicU64,
    /// This kernel refused a private ring: pollers reap the shared one.
    no_private: AtomicBool,
    /// The device was dropped: a private ring of it left in another thread is drained
    /// and closed the next time that thread polls, waits or exits.
    dropped: AtomicBool,
    /// Names this device's private rings in the threads' lists.
    id: u64,
    /// `lock_image`'s descriptor: the image is this device's while it is open. It lives
    /// here rather than in `UringDevice` because every ring holds a reference to
    /// `Shared`: a private ring left in another thread at device drop keeps the lock
    /// until it has drained (its Drop waits for every request), so no new opener can use
    /// the image while this device's writes are still in flight.
    _lock: File,
}

type Finished = (Request, Completer, BlkResult);

impl Shared {
    fn fd(&self) -> types::Fd {
        types::Fd(self.file.as_raw_fd())
    }

    /// The file as an SQE names it: index 0 of the ring's registered files (a private
    /// ring), or the descriptor.
    fn target(&self, fixed: bool) -> types::Fd {
        if fixed {
            types::Fd(0)
        } else {
            self.fd()
        }
    }

    fn fsync_entry(&self, user_data: u64, fixed: bool) -> squeue::Entry {
        fix(
            opcode::Fsync::new(self.target(fixed))
                .flags(types::FsyncFlags::DATASYNC)
                .build()
                .user_data(user_data),
            fixed,
        )
    }

    /// The SQEs of a request just stored at `idx`: its read or write, behind a linked
    /// FSYNC for PREFLUSH; a FSYNC for a flush; a hole punch for a discard.
    fn entries(&self, slot: &Slot, idx: usize, fixed: bool) -> SmallVec<[squeue::Entry; 2]> {
        let ud = (idx as u64) << 1;
        let rq = &slot.rq;
        let has_data = !slot.iov.0.is_empty();
        let mut entries: SmallVec<[squeue::Entry; 2]> = SmallVec::new();
        match rq.op {
            Op::Read | Op::Write => {
                if rq.op == Op::Write && rq.flags.contains(BioFlags::PREFLUSH) {
                    // The link makes the kernel start the write only after the flush
                    // succeeded (and cancel it otherwise), as PREFLUSH requires.
                    let flush = self.fsync_entry(ud | PREFLUSH_TAG, fixed);
                    entries.push(if has_data {
                        flush.flags(squeue::Flags::IO_LINK)
                    } else {
                        flush
                    });
                }
                if has_data {
                    entries.push(self.rw_entry(slot, idx, fixed));
                }
            }
            Op::Flush => entries.push(self.fsync_entry(ud, fixed)),
            Op::Discard => entries.push(fix(
                opcode::Fallocate::new(self.target(fixed), rq.bytes())
                    .offset(slot.offset)
                    .mode(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE)
                    .build()
                    .user_data(ud),
                fixed,
            )),
        }
        entries
    }

    /// The read or write of the part of `slot`'s data not transferred yet.
    fn rw_entry(&self, slot: &Slot, idx: usize, fixed: bool) -> squeue::Entry {
        let iov = &slot.iov.0[slot.first..];
        let n = iov.len().min(MAX_IOV_PER_SQE);
        let rw_flags = if slot.rq.flags.contains(BioFlags::FUA) {
            libc::RWF_DSYNC
        } else {
            0
        };
        let write = slot.rq.op == Op::Write;
        let fd = self.target(fixed);
        let e = if n == 1 {
            // READ/WRITE saves the kernel copying an iovec for the common single-buffer case.
            let (base, len) = (
                iov[0].iov_base as *mut u8,
                iov[0].iov_len.min(MAX_RW_BYTES) as u32,
            );
            if write {
                opcode::Write::new(fd, base, len)
                    .offset(slot.offset)
                    .rw_flags(rw_flags)
                    .build()
            } else {
                opcode::Read::new(fd, base, len)
                    .offset(slot.offset)
                    .rw_flags(rw_flags)
                    .build()
            }
        } else if write {
            opcode::Writev::new(fd, iov.as_ptr(), n as u32)
                .offset(slot.offset)
                .rw_flags(rw_flags)
                .build()
        } else {
            opcode::Readv::new(fd, iov.as_ptr(), n as u32)
                .offset(slot.offset)
                .rw_flags(rw_flags)
                .build()
        };
        fix(e.user_data((idx as u64) << 1), fixed)
    }

    /// Write `entries` into the submission ring, back to back so a link chain is never
    /// split across two submissions. `_locked` proves the caller holds the slab lock.
    fn push(&self, _locked: &mut Inner, entries: &[squeue::Entry]) {
        loop {
            {
                // SAFETY: the caller holds `inner`'s lock (`_locked` can only be borrowed
                // through its guard) and every SubmissionQueue in this file is created and
                // dropped under that lock, so no other one exists.
                let mut sq = unsafe { self.ring.submission_shared() };
                // A tail behind the kernel's head (a queue dropped outside the lock
                // storing a stale tail) would make `push_multiple` write over SQEs the
                // kernel has not read: impossible, and stopped here if it ever is not.
                assert!(
                    sq.len() <= sq.capacity(),
                    "io_uring SQ tail behind its head ({} entries of {})",
                    sq.len(),
                    sq.capacity()
                );
                // SAFETY: each entry either references no memory (NOP, FSYNC, FALLOCATE)
                // or points at the iovec array and IoBufs of a Slot already stored in the
                // slab. The array is a boxed slice and the IoBufs are heap allocations, so
                // neither moves when the slab grows, and the Slot is only removed after
                // its last CQE has been reaped: the memory stays valid until the kernel is
                // done with it.
                if unsafe { sq.push_multiple(entries) }.is_ok() {
                    self.sqes.fetch_add(entries.len() as u64, Ordering::Relaxed);
                    // The flag is raised only below, once `sq` is dropped: dropping it
                    // publishes the SQ tail. Raised before that, a commit on another
                    // thread could take the flag, enter with the old tail and submit
                    // nothing, and this push's own commit would then find the flag down:
                    // the SQE sat in the ring for good (a mount hung this way in CI).
                    drop(sq);
                    self.unsubmitted.store(true, Ordering::Release);
                    return;
                }
            }
            // The ring is full: the kernel copies SQEs out at submission, so handing it
            // what is queued makes room. The caller holds the slab lock already.
            if !self.submit_locked() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    /// Hand every queued SQE to the kernel with one `io_uring_enter`; false if the kernel
    /// kept refusing.
    fn submit(&self) -> bool {
        self.submit_with(|| {
            let _g = self.inner.lock();
            // SAFETY: SubmissionQueues of the shared ring exist only under `inner`'s
            // lock, held here, so this is the only one; it is only read.
            // Bound to a local, so the queue is dropped before the guard: its drop
            // stores the tail it read, and a block's tail-expression temporary (edition
            // 2021) outlives the block's locals. Dropped after the guard, it put the
            // tail back behind other threads' pushes: the kernel's head ran past it
            // (the next push's length wrapped), and SQEs were lost or read as garbage.
            let pending = unsafe { self.ring.submission_shared() }.len();
            pending
        })
    }

    /// `submit` for a caller already holding the slab lock.
    fn submit_locked(&self) -> bool {
        self.submit_with(|| {
            // SAFETY: the caller holds `inner`'s lock and has no SubmissionQueue alive
            // (push drops its own before submitting), so this is the only one.
            unsafe { self.ring.submission_shared() }.len()
        })
    }

    fn submit_with(&self, pending: impl Fn() -> usize) -> bool {
        // Acquire pairs with `push`'s release: the tail of every push whose flag this
        // takes is visible to the `io_uring_enter` below.
        self.unsubmitted.swap(false, Ordering::AcqRel);
        if self.submit_ring(&self.ring, pending) {
            return true;
        }
        // Leave the SQEs queued; the next commit, push or drop retries.
        self.unsubmitted.store(true, Ordering::Release);
        false
    }

    /// `io_uring_enter` until everything queued in `ring`'s SQ when called has been
    /// submitted (`pending` counts the SQEs still in the SQ): a short submit (the
    /// kernel took fewer than queued, e.g. out of request memory) is entered again for
    /// the rest. Transient refusals, and submits taking nothing, are retried with a
    /// backoff for up to about a second; false if SQEs are left (the caller retries
    /// later: SQEs in the ring cannot be taken back).
    fn submit_ring(&self, ring: &IoUring, pending: impl Fn() -> usize) -> bool {
        let mut left = usize::MAX;
        let mut stalled = 0u32;
        loop {
            match ring.submitter().submit() {
                Ok(n) => {
                    if n > 0 {
                        self.submit_calls.fetch_add(1, Ordering::Relaxed);
                    }
                    // Stop once the SQ is empty, or once as many SQEs as were queued at
                    // the first call went in (others' later pushes are theirs to submit).
                    let now = pending();
                    left = left.min(now + n).saturating_sub(n);
                    if now == 0 || left == 0 {
                        return true;
                    }
                    if n > 0 {
                        stalled = 0;
                        continue;
                    }
                }
                Err(e) if transient(&e) => {}
                Err(_) => return false,
            }
            stalled += 1;
            if stalled >= 1000 {
                return false;
            }
            std::thread::sleep(Duration::from_micros(1 << stalled.min(10)));
        }
    }

    /// Account one CQE to its request, resubmitting a short IO's remainder (into
    /// `resubmit`) and moving a request whose last CQE arrived to `finished`.
    fn on_cqe(
        &self,
        inner: &mut Inner,
        user_data: u64,
        res: i32,
        fixed: bool,
        resubmit: &mut Vec<squeue::Entry>,
        finished: &mut Vec<Finished>,
    ) {
        let idx = (user_data >> 1) as usize;
        let closing = inner.closing;
        let Some(slot) = inner.slots.get_mut(idx).and_then(Option::as_mut) else {
            return;
        };
        slot.cqes = slot.cqes.saturating_sub(1);
        let status = if user_data & PREFLUSH_TAG != 0 {
            // A failed flush also cancels the linked write (its CQE reads -ECANCELED).
            if res < 0 {
                Err(BlkError::Io)
            } else {
                Ok(())
            }
        } else {
            match slot.rq.op {
                Op::Read | Op::Write if res >= 0 && slot.status.is_ok() => {
                    let n = res as usize;
                    slot.first += advance_iovecs(&mut slot.iov.0[slot.first..], n);
                    slot.offset += n as u64;
                    if slot.first == slot.iov.0.len() {
                        Ok(())
                    } else if n == 0 || closing {
                        // No progress (a read at end of file) would loop forever, and on
                        // shutdown nobody is left to wait for a retry.
                        Err(BlkError::Io)
                    } else {
                        resubmit.push(self.rw_entry(slot, idx, fixed));
                        slot.cqes += 1;
                        self.short_resubmits.fetch_add(1, Ordering::Relaxed);
                        Ok(())
                    }
                }
                Op::Discard if res == -libc::EOPNOTSUPP => Err(BlkError::NotSupported(format!(
                    "the filesystem holding {} cannot punch holes",
                    self.path
                ))),
                _ if res < 0 => Err(BlkError::Io),
                _ => Ok(()),
            }
        };
        if let Err(e) = status {
            if slot.status.is_ok() {
                slot.status = Err(e);
            }
        }
        if slot.cqes == 0 {
            if let Some(s) = inner.remove(idx) {
                self.live.fetch_sub(1, Ordering::Relaxed);
                finished.push((s.rq, s.done, s.status));
            }
        }
    }
}

/// Mark an SQE built with `Shared::target` as naming a registered file.
fn fix(e: squeue::Entry, fixed: bool) -> squeue::Entry {
    if fixed {
        e.flags(squeue::Flags::FIXED_FILE)
    } else {
        e
    }
}

fn transient(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
    )
}

/// Drop the first `n` transferred bytes from the front of `iov`, for resubmitting a
/// short read or write from exactly where the kernel stopped: fully transferred
/// segments are skipped and a partly transferred one is trimmed in place. Returns how
/// many leading segments are finished.
fn advance_iovecs(iov: &mut [libc::iovec], mut n: usize) -> usize {
    let mut skip = 0;
    while let Some(v) = iov.get_mut(skip) {
        if n >= v.iov_len {
            n -= v.iov_len;
            skip += 1;
        } else {
            v.iov_base = (v.iov_base as *mut u8).wrapping_add(n).cast();
            v.iov_len -= n;
            break;
        }
    }
    skip
}

/// One iovec per data buffer of `rq`, in device order.
fn build_iovecs(rq: &mut Request) -> Result<Vec<libc::iovec>, BlkError> {
    let write = rq.op == Op::Write;
    let mut iov = Vec::with_capacity(rq.bios.len());
    let mut total = 0u64;
    for b in rq.buffers_mut() {
        if b.is_empty() {
            continue;
        }
        total += b.len() as u64;
        // Writes only let the kernel read the buffer; the pointer type is the iovec's.
        let base = if write {
            b.as_ptr() as *mut u8
        } else {
            b.as_mut_ptr()
        };
        iov.push(libc::iovec {
            iov_base: base.cast(),
            iov_len: b.len(),
        });
    }
    if total != rq.bytes() {
        return Err(BlkError::Invalid(format!(
            "request covers {} bytes but its buffers hold {total}",
            rq.bytes()
        )));
    }
    Ok(iov)
}

/// Reusable buffers of one reaper.
#[derive(Default)]
struct Reaper {
    batch: Vec<(u64, i32)>,
    resubmit: Vec<squeue::Entry>,
    finished: Vec<Finished>,
}

impl Shared {
    /// Take every CQE available, account it, resubmit short IOs, and complete finished
    /// requests (outside every lock: callbacks may queue new requests). Returns the
    /// number of requests completed and the number of live requests left.
    fn reap(&self, r: &mut Reaper) -> (usize, usize) {
        {
            let _cq = self.cq_lock.lock();
            // SAFETY: CompletionQueues are only created under cq_lock, so no other one
            // exists while this one lives.
            let cq = unsafe { self.ring.completion_shared() };
            r.batch.extend(cq.map(|c| (c.user_data(), c.result())));
        }
        if r.batch.is_empty() {
            return (0, self.inner.lock().live);
        }
        let pushed;
        let live = {
            let mut g = self.inner.lock();
            for (ud, res) in r.batch.drain(..) {
                if ud == SHUTDOWN {
                    self.shutdown_seen.store(true, Ordering::SeqCst);
                } else {
                    self.on_cqe(&mut g, ud, res, false, &mut r.resubmit, &mut r.finished);
                }
            }
            pushed = !r.resubmit.is_empty();
            for e in r.resubmit.drain(..) {
                self.push(&mut g, std::slice::from_ref(&e));
            }
            g.live
        };
        if pushed {
            // No commit_rqs is coming for resubmitted remainders.
            self.submit();
        }
        let n = r.finished.len();
        complete_all(&mut r.finished);
        (n, live)
    }
}

/// io_uring_getevents_arg (include/uapi/linux/io_uring.h), for a bounded wait.
#[repr(C)]
struct GeteventsArg {
    sigmask: u64,
    sigmask_sz: u32,
    min_wait_usec: u32,
    ts: u64,
}

fn completion_loop(sh: Arc<Shared>) {
    let mut r = Reaper::default();
    loop {
        // SAFETY: no argument pointer is passed and to_submit is 0, so the kernel only
        // waits for a CQE; submitting stays with commit_rqs.
        let res = unsafe {
            sh.ring
                .submitter()
                .enter::<libc::sigset_t>(0, 1, EnterFlags::GETEVENTS.bits(), None)
        };
        if let Err(e) = res {
            if !transient(&e) {
                // Not expected from a valid ring; keep polling rather than abandon IO
                // the kernel still holds.
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let (_, live) = sh.reap(&mut r);
        if sh.shutdown_seen.load(Ordering::SeqCst) && live == 0 {
            return;
        }
    }
}

impl Shared {
    /// Wait in the shared ring for up to `timeout_ns` for a completion (0: only run
    /// this thread's task work), without reaping.
    fn wait_shared(&self, timeout_ns: u64) {
        if let Err(e) = enter_getevents(&self.ring, 0, timeout_ns) {
            if e.raw_os_error() == Some(libc::EINVAL) {
                // A kernel without EXT_ARG: run task work and reap without waiting.
                // SAFETY: no argument pointer is passed and nothing is submitted.
                let _ = unsafe {
                    self.ring.submitter().enter::<libc::sigset_t>(
                        0,
                        0,
                        EnterFlags::GETEVENTS.bits(),
                        None,
                    )
                };
            }
        }
    }
}

/// One `io_uring_enter` on `ring`: submit `to_submit` SQEs and wait up to `timeout_ns`
/// for a completion (none asked for when 0), running this thread's task work.
fn enter_getevents(ring: &IoUring, to_submit: u32, timeout_ns: u64) -> io::Result<usize> {
    let ts = libc::timespec {
        tv_sec: (timeout_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (timeout_ns % 1_000_000_000) as libc::c_long,
    };
    let arg = GeteventsArg {
        sigmask: 0,
        sigmask_sz: 0,
        min_wait_usec: 0,
        ts: &ts as *const _ as u64,
    };
    let want = u32::from(timeout_ns > 0);
    // SAFETY: EXT_ARG makes the kernel read `arg` (and the timespec it points to) during
    // this call only; both live on this stack frame until it returns. The SQEs submitted
    // were pushed by callers that keep their memory alive until their CQEs.
    unsafe {
        ring.submitter().enter(
            to_submit,
            want,
            (EnterFlags::GETEVENTS | EnterFlags::EXT_ARG).bits(),
            Some(&arg),
        )
    }
}

fn complete_all(finished: &mut Vec<Finished>) {
    for (rq, done, status) in finished.drain(..) {
        done.complete(rq, status);
    }
}

/// A polling thread's own ring on one device: SINGLE_ISSUER and DEFER_TASKRUN, so the
/// kernel posts its completions only when this thread waits in it, and the file is
/// registered. Only the owning thread ever touches it (it lives in `PRIVATE`), so it
/// needs no lock; its slab is its own.
struct Private {
    ring: IoUring,
    slab: Inner,
    unsubmitted: bool,
    batch: Vec<(u64, i32)>,
    resubmit: Vec<squeue::Entry>,
    /// Last, so it is dropped last: the image lock (in `Shared`) outlives the ring.
    sh: Arc<Shared>,
}

thread_local! {
    /// This thread's private rings, one per device it polls (usually one).
    static PRIVATE: RefCell<Vec<Private>> = const { RefCell::new(Vec::new()) };
}

/// Run `f` on this thread's private ring of device `id`; None when there is none (the
/// thread never polled, or its rings are being torn down at thread exit).
fn on_private<R>(id: u64, f: impl FnOnce(&mut Private) -> R) -> Option<R> {
    PRIVATE
        .try_with(|c| {
            // Never borrowed while completions run, so this fails only if a completion
            // callback of a ring being dropped queues a request: it goes to the shared
            // ring.
            let mut v = c.try_borrow_mut().ok()?;
            v.iter_mut().find(|l| l.sh.id == id).map(f)
        })
        .ok()
        .flatten()
}

/// Give `slot` to this thread's private ring of device `id`; back when there is none.
fn with_private(id: u64, slot: Slot) -> Option<Slot> {
    let mut slot = Some(slot);
    on_private(id, |l| {
        if let Some(s) = slot.take() {
            l.queue(s);
        }
    });
    slot
}

/// Poll this thread's private ring of `sh`, making it on the first call. None when
/// the thread has no private ring holding requests (the caller polls the shared ring).
fn poll_private(sh: &Arc<Shared>, timeout_ns: u64, finished: &mut Vec<Finished>) -> Option<usize> {
    if sh.no_private.load(Ordering::Relaxed) || sh.dropped.load(Ordering::Relaxed) {
        // No new ring for a device being dropped (a completion callback polling it).
        return None;
    }
    let mut dead = Vec::new();
    let r = PRIVATE
        .try_with(|c| {
            let mut v = c.try_borrow_mut().ok()?;
            take_dead(&mut v, &mut dead);
            let l = match v.iter().position(|l| Arc::ptr_eq(&l.sh, sh)) {
                Some(p) => &mut v[p],
                None => match Private::new(sh) {
                    Ok(l) => {
                        sh.private_rings.fetch_add(1, Ordering::Relaxed);
                        v.push(l);
                        v.last_mut()?
                    }
                    Err(_) => {
                        // DEFER_TASKRUN needs 6.1: poll the shared ring as before.
                        sh.no_private.store(true, Ordering::Relaxed);
                        return None;
                    }
                },
            };
            if l.slab.live == 0 {
                return None;
            }
            Some(l.poll(timeout_ns, finished))
        })
        .ok()
        .flatten();
    // Dropping a ring drains it (Private's Drop), outside the thread's ring list.
    drop(dead);
    r
}

/// Move out the private rings of dropped devices, to be drained and closed outside the
/// borrow.
fn take_dead(v: &mut Vec<Private>, dead: &mut Vec<Private>) {
    dead.extend(v.extract_if(.., |l| l.sh.dropped.load(Ordering::Relaxed)));
}

/// For the block layer's waits (a tag, a wbt slot, a synchronous bio): a thread whose
/// requests sit in its private rings must reap them itself, or they never complete.
/// Waits up to `timeout_ns` in one of them and completes what arrived; None when this
/// thread has no request in any private ring (the caller may sleep).
pub fn poll_own_rings(timeout_ns: u64) -> Option<usize> {
    let mut finished = Vec::new();
    let mut dead = Vec::new();
    let r = PRIVATE
        .try_with(|c| {
            let mut v = c.try_borrow_mut().ok()?;
            take_dead(&mut v, &mut dead);
            let mut n = None;
            let mut wait = timeout_ns;
            for l in v.iter_mut().filter(|l| l.slab.live > 0) {
                *n.get_or_insert(0) += l.poll(wait, &mut finished);
                wait = 0;
            }
            n
        })
        .ok()
        .flatten();
    complete_all(&mut finished);
    // Dropping a ring drains it (Private's Drop), outside the thread's ring list.
    drop(dead);
    r
}

impl Private {
    fn new(sh: &Arc<Shared>) -> io::Result<Private> {
        let entries = sh.ring.params().sq_entries();
        let mut b = IoUring::builder();
        b.dontfork()
            .setup_cqsize(entries * 2)
            .setup_submit_all()
            .setup_single_issuer()
            .setup_defer_taskrun();
        let ring = b.build(entries)?;
        require_nodrop(&ring)?;
        // A registered file saves a descriptor lookup and reference per SQE.
        ring.submitter().register_files(&[sh.file.as_raw_fd()])?;
        Ok(Private {
            sh: sh.clone(),
            ring,
            slab: Inner::default(),
            unsubmitted: false,
            batch: Vec::new(),
            resubmit: Vec::new(),
        })
    }

    fn queue(&mut self, slot: Slot) {
        let idx = self.slab.insert(slot);
        let mut entries = SmallVec::new();
        if let Some(s) = self.slab.slots[idx].as_mut() {
            entries = self.sh.entries(s, idx, true);
            s.cqes = entries.len() as u32;
        }
        self.push(&entries);
    }

    fn push(&mut self, entries: &[squeue::Entry]) {
        loop {
            // SAFETY: as in Shared::push: every entry references no memory or the
            // iovecs and buffers of a Slot stored in this ring's slab, which stays there
            // (unmoved: boxed slice, heap buffers) until its last CQE is reaped. The
            // submission queue is borrowed through `&mut self.ring`, so it is the only one.
            if unsafe { self.ring.submission().push_multiple(entries) }.is_ok() {
                let n = entries.len() as u64;
                self.sh.sqes.fetch_add(n, Ordering::Relaxed);
                self.sh.private_sqes.fetch_add(n, Ordering::Relaxed);
                self.unsubmitted = true;
                return;
            }
            if !self.submit() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    fn submit(&mut self) -> bool {
        let ring = &self.ring;
        self.unsubmitted = !self.sh.submit_ring(ring, || {
            // SAFETY: only this thread touches the ring, and no SubmissionQueue of it is
            // alive here (`push` drops its own before submitting): this is the only one,
            // and it is only read.
            unsafe { ring.submission_shared() }.len()
        });
        !self.unsubmitted
    }

    /// Submit what is queued, wait up to `timeout_ns` for a completion (DEFER_TASKRUN:
    /// this is when the kernel posts them), reap and account every CQE. Finished
    /// requests go to `finished`, to be completed outside the thread's ring list.
    fn poll(&mut self, timeout_ns: u64, finished: &mut Vec<Finished>) -> usize {
        let to_submit = if self.unsubmitted {
            self.ring.submission().len() as u32
        } else {
            0
        };
        if enter_getevents(&self.ring, to_submit, timeout_ns).is_ok() && to_submit > 0 {
            self.sh.submit_calls.fetch_add(1, Ordering::Relaxed);
        }
        if to_submit > 0 {
            self.unsubmitted = !self.ring.submission().is_empty();
            if self.unsubmitted {
                // A short or refused submit: hand the kernel the rest now (what it keeps
                // refusing waits for the next poll or commit).
                self.submit();
            }
        }
        self.reap(finished)
    }

    fn reap(&mut self, finished: &mut Vec<Finished>) -> usize {
        let before = finished.len();
        self.batch
            .extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
        for (ud, res) in self.batch.drain(..) {
            self.sh
                .on_cqe(&mut self.slab, ud, res, true, &mut self.resubmit, finished);
        }
        if !self.resubmit.is_empty() {
            let rs = std::mem::take(&mut self.resubmit);
            for e in &rs {
                self.push(std::slice::from_ref(e));
            }
            self.resubmit = rs;
            self.resubmit.clear();
            self.submit();
        }
        finished.len() - before
    }
}

impl Drop for Private {
    /// Wait for every request of this ring to complete, then complete them; then the
    /// ring closes and, if it held the last reference to the device, the image lock is
    /// released.
    ///
    /// There is no deadline: the kernel may use a request's buffers until its CQE, so
    /// the slab (and `sh`, with the file and the lock) must live until the last one,
    /// however slow the disk. A ring making no progress for 10 s is reported once, and
    /// waited for still (a leak instead would also have to keep the lock and the ring
    /// forever, and would lose the completions of requests someone waits for).
    ///
    /// Every CQE is reaped before any completion callback runs: a callback that panics
    /// then unwinds through a ring with nothing in flight, so the unwinding frees no
    /// buffer the kernel still holds (and the remaining requests, already finished,
    /// are dropped uncompleted).
    fn drop(&mut self) {
        let mut finished = Vec::new();
        let mut last_progress = std::time::Instant::now();
        let mut reported = false;
        while self.slab.live > 0 {
            if self.poll(10_000_000, &mut finished) > 0 {
                last_progress = std::time::Instant::now();
            } else if !reported && last_progress.elapsed() >= Duration::from_secs(10) {
                reported = true;
                use std::io::Write;
                let _ = writeln!(
                    io::stderr(),
                    "wbstack: {} requests on {} have not completed for 10 s; still waiting",
                    self.slab.live,
                    self.sh.path
                );
            }
        }
        complete_all(&mut finished);
    }
}

/// The file device.
pub struct UringDevice {
    spec: String,
    geo: Geometry,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl UringDevice {
    pub fn from_spec(spec: &DeviceSpec) -> Result<UringDevice, SpecError> {
        let path = match spec.path.as_deref() {
            Some(p) if !p.is_empty() => p.to_string(),
            _ => return Err(spec.err("file needs a path, as in file:/var/tmp/disk.img")),
        };
        let create = spec.bool("create", false)?;
        let size_given = spec.has("size");
        let want_size = spec.size("size", 0)?;
        let defaults = Geometry {
            size_bytes: 0,
            logical_block_size: 4096,
            max_hw_sectors: 65536,
            max_segments: 128,
            max_segment_size: 65536,
            rotational: false,
            write_cache: true,
            nr_hw_queues: 1,
            queue_depth: 128,
        };

        let meta = match std::fs::metadata(&path) {
            Ok(m) => Some(m),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(spec.err(open_error(&path, &e))),
        };
        let is_bdev = meta
            .as_ref()
            .is_some_and(|m| m.file_type().is_block_device());
        if let Some(m) = &meta {
            if m.is_dir() {
                return Err(spec.err(format!(
                    "{path} is a directory; give a file or block device"
                )));
            }
            if !m.is_file() && !is_bdev {
                return Err(spec.err(format!(
                    "{path} is neither a regular file nor a block device"
                )));
            }
        }

        let (geo, file) = if is_bdev {
            // Opening first is the only way to learn a block device's size and block size.
            let file = open_direct(&path).map_err(|e| spec.err(open_error(&path, &e)))?;
            let dev_size = (&file)
                .seek(SeekFrom::End(0))
                .map_err(|e| spec.err(format!("cannot size {path}: {e}")))?;
            let dev_lbs = bdev_logical_block_size(&file)
                .map_err(|e| spec.err(format!("BLKSSZGET on {path}: {e}")))?;
            let rdev = meta.as_ref().map(|m| m.rdev()).unwrap_or(0);
            let sys = format!("/sys/dev/block/{}:{}", libc::major(rdev), libc::minor(rdev));
            let geo = geometry_from_spec(
                spec,
                Geometry {
                    size_bytes: if size_given { want_size } else { dev_size },
                    logical_block_size: dev_lbs,
                    rotational: sysfs_queue(&sys, "rotational").is_some_and(|v| v == "1"),
                    write_cache: sysfs_queue(&sys, "write_cache").is_none_or(|v| v == "write back"),
                    ..defaults
                },
            )?;
            if geo.logical_block_size < dev_lbs {
                return Err(spec.err(format!(
                    "lbs={} is smaller than the logical block size {dev_lbs} of {path}; O_DIRECT would refuse such IO",
                    geo.logical_block_size
                )));
            }
            if geo.size_bytes > dev_size {
                return Err(spec.err(format!(
                    "size={} is larger than {path} ({dev_size} bytes)",
                    geo.size_bytes
                )));
            }
            spec.finish(&format!("{GEOMETRY_KEYS}, create"))?;
            (geo, Some(file))
        } else {
            let len = meta.as_ref().map_or(0, |m| m.len());
            if meta.is_none() && !create {
                return Err(spec.err(format!(
                    "no such file {path}; create one with ,create=1,size=SIZE"
                )));
            }
            if meta.is_none() && !size_given {
                return Err(spec.err(format!(
                    "create=1 needs size=SIZE to know how large to make {path}"
                )));
            }
            if !size_given {
                let lbs = spec.size("lbs", defaults.logical_block_size as u64)?;
                if len == 0 {
                    return Err(spec.err(format!(
                        "{path} is empty; give ,create=1,size=SIZE to extend it"
                    )));
                }
                if lbs.is_power_of_two() && len % lbs != 0 {
                    return Err(spec.err(format!(
                        "{path} is {len} bytes, not a multiple of the logical block size {lbs}; \
                         give size= (a multiple of {lbs}) to use a prefix of it"
                    )));
                }
            }
            let geo = geometry_from_spec(
                spec,
                Geometry {
                    size_bytes: if size_given { want_size } else { len },
                    ..defaults
                },
            )?;
            if geo.size_bytes > len && !create {
                return Err(spec.err(format!(
                    "{path} is {len} bytes, smaller than size={}; add ,create=1 to extend it",
                    geo.size_bytes
                )));
            }
            spec.finish(&format!("{GEOMETRY_KEYS}, create"))?;
            (geo, None)
        };

        // The ring comes before any change to the filesystem, so a machine without
        // io_uring leaves no file behind.
        let entries = (geo.nr_hw_queues as u64 * geo.queue_depth as u64).clamp(2, MAX_RING_ENTRIES);
        let ring = setup_ring(entries.next_power_of_two() as u32)
            .map_err(|e| spec.err(ring_setup_error(&e)))?;

        // The lock comes before any change to the file: an image in use is refused
        // before it could be created or extended under its user. A missing file is
        // created empty to have something to lock (and removed again on failure).
        let lock =
            lock_image(&path, meta.is_none()).map_err(|e| spec.err(open_error(&path, &e)))?;
        let file = match file {
            Some(f) => f,
            None => {
                // The length now, under the lock (a previous holder may have extended it).
                let len = lock.metadata().map_or(0, |m| m.len());
                if geo.size_bytes > len {
                    // Extending goes through a plain descriptor: O_DIRECT is irrelevant to
                    // set_len, and a filesystem refusing O_DIRECT should still be reported
                    // as such rather than as a failed create.
                    OpenOptions::new()
                        .write(true)
                        .create(true)
                        .truncate(false)
                        .open(&path)
                        .and_then(|f| f.set_len(geo.size_bytes))
                        .map_err(|e| spec.err(format!("cannot create or extend {path}: {e}")))?;
                }
                open_direct(&path).map_err(|e| {
                    if meta.is_none() {
                        // Do not leave behind a file the device could not use.
                        let _ = std::fs::remove_file(&path);
                    }
                    spec.err(open_error(&path, &e))
                })?
            }
        };

        let shared = Arc::new(Shared {
            ring,
            file,
            is_bdev,
            path,
            inner: Mutex::new(Inner::default()),
            cq_lock: Mutex::new(()),
            shutdown_seen: AtomicBool::new(false),
            unsubmitted: AtomicBool::new(false),
            submit_calls: AtomicU64::new(0),
            sqes: AtomicU64::new(0),
            short_resubmits: AtomicU64::new(0),
            live: AtomicUsize::new(0),
            private_rings: AtomicU64::new(0),
            private_sqes: AtomicU64::new(0),
            no_private: AtomicBool::new(false),
            dropped: AtomicBool::new(false),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            _lock: lock,
        });
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("wbstack-uring".into())
            .spawn(move || completion_loop(sh))
            .map_err(|e| spec.err(format!("cannot start the io_uring completion thread: {e}")))?;
        Ok(UringDevice {
            spec: spec.raw.clone(),
            geo,
            shared,
            thread: Some(thread),
        })
    }

    /// Whether the device is a block device (discard unsupported) rather than a file.
    pub fn is_block_device(&self) -> bool {
        self.shared.is_bdev
    }

    pub fn stats(&self) -> UringStats {
        let sh = &self.shared;
        UringStats {
            submit_calls: sh.submit_calls.load(Ordering::Relaxed),
            sqes: sh.sqes.load(Ordering::Relaxed),
            short_resubmits: sh.short_resubmits.load(Ordering::Relaxed),
            private_rings: sh.private_rings.load(Ordering::Relaxed),
            private_sqes: sh.private_sqes.load(Ordering::Relaxed),
        }
    }

    /// Requests handed to the device and not completed yet.
    pub fn in_flight(&self) -> usize {
        self.shared.live.load(Ordering::Relaxed)
    }
}

fn open_direct(path: &str) -> io::Result<File> {
    // std adds O_CLOEXEC itself.
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
}

/// One user of an image at a time: a second mount, an `info` (which replays the
/// journal and writes a checkpoint) or a mkfs beside a running mount would write the
/// same journal and checkpoints under it. An advisory lock on a descriptor of its own,
/// held by the device and released when it is dropped (or the process dies), as
/// util-linux's tools lock devices; not on the IO descriptor, which a thread's private
/// ring may keep open until that thread next waits.
fn lock_image(path: &str, create: bool) -> io::Result<File> {
    let f = if create {
        // std's create needs write access; the descriptor is only ever locked.
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?
    } else {
        OpenOptions::new().read(true).open(path)?
    };
    // A holder that was just killed lets go only once the kernel has torn down its
    // io_uring (in flight requests first), which can take a moment after the kill:
    // a remount right after `kill -9` waits for that, a bounded while, instead of
    // failing. flock has no timed wait, hence the polling.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    loop {
        // SAFETY: flock takes a descriptor `f` owns and touches no memory.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(f);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) || std::time::Instant::now() >= deadline {
            return Err(e);
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Why opening PATH failed, in words that say what to do about it.
fn open_error(path: &str, e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::ENOENT) => format!("no such file {path}; create one with ,create=1,size=SIZE"),
        Some(libc::EACCES | libc::EPERM) => format!("permission denied opening {path} read-write"),
        // open(2) reports a filesystem without direct IO support as EINVAL.
        Some(libc::EINVAL) => format!(
            "O_DIRECT is not supported on the filesystem holding {path} (e.g. tmpfs); \
             put the file on a disk filesystem such as ext4 or xfs"
        ),
        Some(libc::EROFS) => format!("{path} is on a read-only filesystem"),
        Some(libc::EISDIR) => format!("{path} is a directory; give a file or block device"),
        Some(libc::EBUSY) => format!("{path} is busy (held exclusively by another user)"),
        Some(libc::EWOULDBLOCK) => format!(
            "{path} is in use by another wbstack device (a mount, a benchmark or a tool \
             holds it); unmount or stop it first (a mount's usage: df, or .wbstack/stat)"
        ),
        _ => format!("cannot open {path}: {e}"),
    }
}

fn bdev_logical_block_size(f: &File) -> io::Result<u32> {
    let mut lbs: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one int through the pointer, which points at a live local
    // of that type; the descriptor is owned by `f`.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), libc::BLKSSZGET, &mut lbs as *mut libc::c_int) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(lbs.max(512) as u32)
    }
}

/// A queue attribute of a block device; a partition has none of its own and shares its
/// disk's (one directory up).
fn sysfs_queue(dev_dir: &str, attr: &str) -> Option<String> {
    [
        format!("{dev_dir}/queue/{attr}"),
        format!("{dev_dir}/../queue/{attr}"),
    ]
    .iter()
    .find_map(|p| std::fs::read_to_string(p).ok())
    .map(|s| s.trim().to_string())
}

fn setup_ring(sq_entries: u32) -> io::Result<IoUring> {
    let build = |submit_all: bool| {
        let coop = submit_all;
        let mut b = IoUring::builder();
        // Twice the SQ: a PREFLUSH write posts two CQEs.
        b.dontfork().setup_cqsize(sq_entries * 2);
        if coop {
            // Completion task work then waits until the submitter next enters the
            // kernel, instead of interrupting it (fio sets this too).
            b.setup_coop_taskrun();
        }
        if submit_all {
            // Without it one bad SQE stops the rest of the batch from being submitted.
            b.setup_submit_all();
        }
        b.build(sq_entries)
    };
    let ring = match build(true) {
        // Kernels before 5.18 (SUBMIT_ALL) or 5.19 (COOP_TASKRUN) refuse the flags.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => build(false),
        r => r,
    }?;
    require_nodrop(&ring)?;
    Ok(ring)
}

/// The CQ holds twice the SQ's entries, which covers every request the block layer
/// can have in flight (its tags: hardware queues × depth, each request at most two CQEs
/// at a time) but nothing bounds the shared ring's requests by the CQ itself. With
/// NODROP (5.5) a CQE that finds the CQ full waits in the kernel's overflow list (and
/// `io_uring_enter` answers EBUSY, retried, until it is flushed) instead of being
/// dropped, which would leave its request and buffers in the slab forever; a kernel
/// without it is refused.
fn require_nodrop(ring: &IoUring) -> io::Result<()> {
    if ring.params().is_feature_nodrop() {
        Ok(())
    } else {
        Err(io::Error::other(
            "this kernel's io_uring may drop completions (no IORING_FEAT_NODROP, before 5.5)",
        ))
    }
}

fn ring_setup_error(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::EPERM | libc::ENOSYS | libc::EACCES) => format!(
            "io_uring is not permitted on this machine (io_uring_setup: {e}); \
             see /proc/sys/kernel/io_uring_disabled and the container's seccomp profile"
        ),
        Some(libc::ENOMEM) => {
            format!("io_uring_setup: {e}; the locked-memory limit may be too low (ulimit -l)")
        }
        _ => format!("io_uring_setup failed: {e}"),
    }
}

/// Check that this process may use io_uring; the error says why not.
pub fn probe_io_uring() -> Result<(), String> {
    IoUring::new(2).map(drop).map_err(|e| ring_setup_error(&e))
}

impl Device for UringDevice {
    fn geometry(&self) -> &Geometry {
        &self.geo
    }

    fn first_write_allocates(&self) -> bool {
        // A regular file may have holes (create= extends it sparse); a block device
        // has none.
        !self.shared.is_bdev
    }

    fn spec(&self) -> &str {
        &self.spec
    }

    fn queue_rq(&self, mut rq: Request, done: &Completer) {
        let sh = &*self.shared;
        let end = rq
            .sector
            .saturating_add(rq.nr_sectors as u64)
            .saturating_mul(512);
        if end > self.geo.size_bytes {
            let e = BlkError::Invalid(format!("{rq:?} ends past the device"));
            return done.complete(rq, Err(e));
        }
        let preflush = rq.op == Op::Write && rq.flags.contains(BioFlags::PREFLUSH);
        let iov = match rq.op {
            Op::Read | Op::Write => match build_iovecs(&mut rq) {
                Ok(v) => v,
                Err(e) => return done.complete(rq, Err(e)),
            },
            Op::Discard if sh.is_bdev => {
                let e = BlkError::NotSupported(format!("discard on block device {}", sh.path));
                return done.complete(rq, Err(e));
            }
            _ => Vec::new(),
        };
        let empty = match rq.op {
            Op::Read | Op::Write => iov.is_empty() && !preflush,
            Op::Discard => rq.nr_sectors == 0,
            Op::Flush => false,
        };
        if empty {
            return done.complete(rq, Ok(()));
        }
        let offset = rq.sector << SECTOR_SHIFT;
        let slot = Slot {
            rq,
            done: done.clone(),
            iov: IoVecs(iov.into_boxed_slice()),
            first: 0,
            offset,
            cqes: 0,
            status: Ok(()),
        };
        sh.live.fetch_add(1, Ordering::Relaxed);
        // A thread that polls has its own ring; everybody else shares one.
        let Some(slot) = with_private(sh.id, slot) else {
            return;
        };
        let mut g = sh.inner.lock();
        let idx = g.insert(slot);
        let mut entries = SmallVec::new();
        if let Some(s) = g.slots[idx].as_mut() {
            entries = sh.entries(s, idx, false);
            s.cqes = entries.len() as u32;
        }
        sh.push(&mut g, &entries);
    }

    fn commit_rqs(&self, _hctx: u16) {
        // This thread's private ring, if it has one with SQEs queued.
        on_private(self.shared.id, |l| {
            if l.unsubmitted {
                l.submit();
            }
        });
        // One ring serves every hardware queue, so a commit submits all of them; skip the
        // syscall when nothing was queued since the last one.
        if self.shared.unsubmitted.load(Ordering::Acquire) {
            self.shared.submit();
        }
    }

    /// Reap completions in the caller's thread. io_uring completes direct IO through
    /// task work run by the submitting thread, so a submitter that waits here gets its
    /// completions without a trip through the completion thread.
    fn can_poll(&self) -> bool {
        true
    }

    fn poll(&self, _hctx: u16, timeout_ns: u64) -> usize {
        let sh = &self.shared;
        // The first poll gives the thread its private ring, for the requests it queues
        // from then on; while that ring holds none, the thread reaps the shared one.
        let mut finished = Vec::new();
        let mut n = poll_private(sh, timeout_ns, &mut finished);
        complete_all(&mut finished);
        if n.is_none() {
            sh.wait_shared(timeout_ns);
        }
        if n.is_none() || sh.inner.lock().live > 0 {
            // Requests of threads that never poll, on the shared ring: whoever waits
            // reaps them too (the completion thread otherwise).
            let mut r = Reaper::default();
            *n.get_or_insert(0) += sh.reap(&mut r).0;
        }
        n.unwrap_or(0)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for UringDevice {
    fn drop(&mut self) {
        let sh = &self.shared;
        sh.dropped.store(true, Ordering::SeqCst);
        // This thread's private ring is drained here. Another thread's stays with that
        // thread (only it can reap a DEFER_TASKRUN ring), holding the file and the
        // buffers until it has drained it: at its next poll or wait, or when it exits.
        let mine = PRIVATE
            .try_with(|c| {
                let mut v = c.try_borrow_mut().ok()?;
                let pos = v.iter().position(|l| l.sh.id == sh.id)?;
                Some(v.swap_remove(pos))
            })
            .ok()
            .flatten();
        // Dropping the ring drains it (Private's Drop).
        drop(mine);
        {
            let mut g = sh.inner.lock();
            g.closing = true;
            sh.push(&mut g, &[opcode::Nop::new().build().user_data(SHUTDOWN)]);
        }
        // Requests queued without a commit go out with the NOP: once pushed, SQEs cannot
        // be taken back, and the completion thread then waits for all of them, because
        // the kernel may be using their buffers until their CQEs arrive.
        sh.submit();
        if let Some(t) = self.thread.take() {
            if t.thread().id() == std::thread::current().id() {
                // Dropped from a completion callback: the thread cannot wait for itself,
                // but it goes on reaping (it holds its own reference to the ring) and
                // exits once the last request completed.
                return;
            }
            if t.join().is_err() {
                // A completion callback panicked and killed the thread with IO possibly
                // still in the kernel's hands: leak the ring and the buffers rather than
                // free memory the kernel may still write into.
                std::mem::forget(Arc::clone(&self.shared));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iov(base: usize, len: usize) -> libc::iovec {
        libc::iovec {
            iov_base: base as *mut libc::c_void,
            iov_len: len,
        }
    }

    fn lens(v: &[libc::iovec]) -> Vec<(usize, usize)> {
        v.iter().map(|v| (v.iov_base as usize, v.iov_len)).collect()
    }

    #[test]
    fn advance_whole_and_partial_segments() {
        let mut v = [iov(0x10000, 4096), iov(0x20000, 8192), iov(0x40000, 4096)];
        assert_eq!(advance_iovecs(&mut v, 0), 0);
        assert_eq!(
            lens(&v),
            [(0x10000, 4096), (0x20000, 8192), (0x40000, 4096)]
        );

        // Exactly the first segment.
        let mut w = v;
        assert_eq!(advance_iovecs(&mut w, 4096), 1);
        assert_eq!(lens(&w[1..]), [(0x20000, 8192), (0x40000, 4096)]);

        // Into the middle of the second segment: it is trimmed from the front.
        let mut w = v;
        let skip = advance_iovecs(&mut w, 4096 + 512);
        assert_eq!(skip, 1);
        assert_eq!(
            lens(&w[skip..]),
            [(0x20000 + 512, 8192 - 512), (0x40000, 4096)]
        );
        // A second short transfer continues from the trimmed segment.
        let skip2 = advance_iovecs(&mut w[skip..], 8192 - 512 + 1024);
        assert_eq!(skip2, 1);
        assert_eq!(lens(&w[skip + skip2..]), [(0x40000 + 1024, 3072)]);
        assert_eq!(advance_iovecs(&mut w[skip + skip2..], 3072), 1);

        // Everything at once.
        let mut w = v;
        assert_eq!(advance_iovecs(&mut w, 16384), 3);

        // Empty segments in front of the transfer point are skipped too.
        let mut w = [iov(0x1000, 0), iov(0x2000, 512)];
        assert_eq!(advance_iovecs(&mut w, 0), 1);
        assert_eq!(advance_iovecs(&mut [], 100), 0);
    }

    #[test]
    fn error_messages_name_the_cause() {
        let e = open_error("/dev/shm/x", &io::Error::from_raw_os_error(libc::EINVAL));
        assert!(
            e.contains("O_DIRECT is not supported") && e.contains("/dev/shm/x"),
            "{e}"
        );
        let e = open_error("/x", &io::Error::from_raw_os_error(libc::EACCES));
        assert!(e.contains("permission denied"), "{e}");
        for errno in [libc::EPERM, libc::ENOSYS] {
            let e = ring_setup_error(&io::Error::from_raw_os_error(errno));
            assert!(
                e.contains("io_uring is not permitted on this machine (io_uring_setup: "),
                "{e}"
            );
        }
    }
}
