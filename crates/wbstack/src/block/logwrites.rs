//! Log-writes: a device between the block layer and another device that records every
//! write and flush that reaches it, in the order that decides what a power cut may keep
//! (the kernel's dm-log-writes, which CrashMonkey replays).
//!
//! - A write is logged when it completes successfully, with its data: until then the
//!   device owes it nothing. A failed write moved no data and is not logged.
//! - A cache flush (a FLUSH request, or PREFLUSH on a write) is logged when it is
//!   *submitted*, as a [`LogKind::Flush`] mark: the writes logged before the mark
//!   completed before the flush was sent, so they are durable once it completes; writes
//!   completing while it runs come after the mark and are not covered.
//! - A FUA write is durable when it completes, and only it: it is logged with `fua` set.
//!
//! So the log's marks cut it into windows. A crash leaves on the media every write
//! before some mark, plus any subset of the writes of the window after it, each kept
//! whole or torn (any subset of its sectors): [`WriteLog::windows`] names them and
//! [`WriteLog::image`] builds one such state. Anything a caller was told is durable was
//! told at some [`WriteLog::position`]; [`WriteLog::ack_cutoff`] says up to which
//! position a state must honour what callers were told.

use super::bio::{BioFlags, BlkResult, Op, Request};
use crate::dev::store::SparseStore;
use crate::dev::{Completer, Device, DeviceRef, RqComplete};
use parking_lot::Mutex;
use std::sync::Arc;

pub const SECTOR: u64 = 512;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogKind {
    /// Data written at `sector` (completed; not durable until a later mark).
    Write,
    /// A discard completed: the range reads back as zeros once durable.
    Discard,
    /// A cache flush was submitted: every earlier entry is durable when it completes.
    Flush,
}

#[derive(Clone, Debug)]
pub struct LogEntry {
    pub kind: LogKind,
    pub sector: u64,
    pub nr_sectors: u64,
    /// A FUA write: durable when it completed.
    pub fua: bool,
    /// The log's length when the request was submitted: an entry submitted after a
    /// FUA write completed (`submitted_at` > that write's index) may depend on it, so
    /// no crash keeps it without that write.
    pub submitted_at: usize,
    /// The data of a write (empty for the other kinds).
    pub data: Arc<[u8]>,
}

/// One window: the marks `mark` (the durable prefix is every entry before it) and the
/// writes after it, up to the next mark.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Window {
    /// Entries `0..prefix_end` are durable in every state of this window.
    pub prefix_end: usize,
    /// Indices of the write and discard entries a crash may keep any subset of.
    pub pending: Vec<usize>,
    /// The position of the next mark (or the log's end): every acknowledgement made
    /// before it relied only on the prefix.
    pub next_mark: usize,
}

/// What a crash kept of one pending entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kept {
    Whole,
    /// Only these sectors (offsets within the write) reached the media.
    Sectors(Vec<u64>),
}

#[derive(Default)]
pub struct WriteLog {
    entries: Vec<LogEntry>,
}

impl WriteLog {
    pub fn entries(&self) -> &[LogEntry] {
        &self.entries
    }

    /// The log's length now: the value to record when telling a caller something is
    /// durable (the crash states before the next mark must honour it).
    pub fn position(&self) -> usize {
        self.entries.len()
    }

    fn is_mark(e: &LogEntry) -> bool {
        e.kind == LogKind::Flush
    }

    /// The windows of the log: one starting at the log's beginning (nothing durable
    /// yet) and one after each mark.
    pub fn windows(&self) -> Vec<Window> {
        let mut starts = vec![0usize];
        starts.extend(
            self.entries
                .iter()
                .enumerate()
                .filter(|(_, e)| Self::is_mark(e))
                .map(|(i, _)| i + 1),
        );
        starts
            .iter()
            .map(|&start| {
                let end = self.entries[start..]
                    .iter()
                    .position(Self::is_mark)
                    .map(|k| start + k)
                    .unwrap_or(self.entries.len());
                Window {
                    prefix_end: start,
                    pending: (start..end)
                        .filter(|&i| {
                            matches!(self.entries[i].kind, LogKind::Write | LogKind::Discard)
                        })
                        .collect(),
                    next_mark: end,
                }
            })
            .collect()
    }

    /// Apply entries `0..end` to `img` in log order (the durable prefix of a window).
    /// Applying a longer prefix to an image of a shorter one extends it: `from` is where
    /// `img` stopped.
    pub fn apply_prefix(&self, img: &mut SparseStore, from: usize, end: usize) {
        debug_assert!(from <= end && end <= self.entries.len());
        for e in &self.entries[from..end] {
            Self::apply(img, e, None);
        }
    }

    /// Up to which log position the state of `w` that kept `kept` must honour what
    /// callers were told (an acknowledgement at position `p` binds it when `p <=` the
    /// cutoff): until the first FUA write of the window it did not keep whole (the crash
    /// came before that write completed), else until the next mark.
    pub fn ack_cutoff(&self, w: &Window, kept: &[(usize, Kept)]) -> usize {
        w.pending
            .iter()
            .copied()
            .filter(|&i| self.entries[i].fua)
            .find(|i| !kept.iter().any(|(k, how)| k == i && *how == Kept::Whole))
            .unwrap_or(w.next_mark)
    }

    /// Whether a crash can keep `kept` of `w`: not when it keeps a write submitted after
    /// a FUA write of the window completed but not that FUA write (the crash came before
    /// the FUA write completed, so the later one was never sent).
    pub fn possible(&self, w: &Window, kept: &[(usize, Kept)]) -> bool {
        let cutoff = self.ack_cutoff(w, kept);
        kept.iter()
            .all(|(i, _)| self.entries[*i].submitted_at <= cutoff)
    }

    /// The crash state of `w` that kept `kept` of its pending entries (in log order),
    /// built on `prefix`, an image of entries `0..w.prefix_end`.
    pub fn image(&self, prefix: &SparseStore, kept: &[(usize, Kept)]) -> SparseStore {
        let mut img = prefix.clone();
        let mut sorted: Vec<&(usize, Kept)> = kept.iter().collect();
        sorted.sort_by_key(|(i, _)| *i);
        for (i, k) in sorted {
            let e = &self.entries[*i];
            debug_assert!(matches!(e.kind, LogKind::Write | LogKind::Discard));
            Self::apply(&mut img, e, Some(k));
        }
        img
    }

    fn apply(img: &mut SparseStore, e: &LogEntry, kept: Option<&Kept>) {
        match (e.kind, kept) {
            (LogKind::Write, None | Some(Kept::Whole)) => img.write(e.sector, &e.data),
            (LogKind::Write, Some(Kept::Sectors(s))) => {
                for &off in s {
                    debug_assert!(off < e.nr_sectors, "a torn sector outside its write");
                    let b = (off * SECTOR) as usize;
                    img.write(e.sector + off, &e.data[b..b + SECTOR as usize]);
                }
            }
            (LogKind::Discard, None | Some(Kept::Whole)) => img.discard(e.sector, e.nr_sectors),
            (LogKind::Discard, Some(Kept::Sectors(s))) => {
                for &off in s {
                    img.discard(e.sector + off, 1);
                }
            }
            (LogKind::Flush, _) => {}
        }
    }
}

/// The log-writes device: passes every request to `inner` and logs what it must.
pub struct LogWrites {
    inner: DeviceRef,
    log: Arc<Mutex<WriteLog>>,
}

impl LogWrites {
    pub fn new(inner: DeviceRef) -> LogWrites {
        LogWrites {
            inner,
            log: Arc::new(Mutex::new(WriteLog::default())),
        }
    }

    pub fn inner(&self) -> &DeviceRef {
        &self.inner
    }

    pub fn position(&self) -> usize {
        self.log.lock().position()
    }

    /// The log so far (a request still inside the device is not in it).
    pub fn take_log(&self) -> WriteLog {
        std::mem::take(&mut *self.log.lock())
    }

    pub fn with_log<R>(&self, f: impl FnOnce(&WriteLog) -> R) -> R {
        f(&self.log.lock())
    }
}

fn flush_mark() -> LogEntry {
    LogEntry {
        kind: LogKind::Flush,
        sector: 0,
        nr_sectors: 0,
        fua: false,
        submitted_at: 0,
        data: Arc::from(Vec::new()),
    }
}

impl Device for LogWrites {
    crate::stacked_device!(inner);
    fn queue_rq(&self, rq: Request, done: &Completer) {
        let submitted_at = {
            let mut log = self.log.lock();
            if rq.op == Op::Flush || rq.flags.contains(BioFlags::PREFLUSH) {
                let at = log.entries.len();
                log.entries.push(LogEntry {
                    submitted_at: at,
                    ..flush_mark()
                });
            }
            log.entries.len()
        };
        let d: Completer = Arc::new(LogDone {
            log: self.log.clone(),
            done: done.clone(),
            submitted_at,
        });
        self.inner.queue_rq(rq, &d);
    }
}

struct LogDone {
    log: Arc<Mutex<WriteLog>>,
    done: Completer,
    submitted_at: usize,
}

impl RqComplete for LogDone {
    fn complete(&self, rq: Request, status: BlkResult) {
        if status.is_ok() {
            let entry = match rq.op {
                Op::Write => {
                    let mut data = Vec::with_capacity(rq.bytes() as usize);
                    for b in rq.buffers() {
                        data.extend_from_slice(b.as_slice());
                    }
                    debug_assert_eq!(data.len() as u64, rq.bytes());
                    Some(LogEntry {
                        kind: LogKind::Write,
                        sector: rq.sector,
                        nr_sectors: rq.nr_sectors as u64,
                        fua: rq.flags.contains(BioFlags::FUA),
                        submitted_at: self.submitted_at,
                        data: Arc::from(data),
                    })
                }
                Op::Discard => Some(LogEntry {
                    kind: LogKind::Discard,
                    sector: rq.sector,
                    nr_sectors: rq.nr_sectors as u64,
                    fua: false,
                    submitted_at: self.submitted_at,
                    data: Arc::from(Vec::new()),
                }),
                Op::Read | Op::Flush => None,
            };
            if let Some(e) = entry {
                self.log.lock().entries.push(e);
            }
        }
        self.done.complete(rq, status);
    }
}
