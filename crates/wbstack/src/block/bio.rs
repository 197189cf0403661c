//! Bios (what upper layers submit) and requests (what devices execute).

use super::stats::IoStatsMode;
use crate::buf::IoBuf;
use smallvec::SmallVec;
use std::sync::Arc;

pub const SECTOR_SHIFT: u32 = 9;
pub const SECTOR_SIZE: u64 = 512;

/// The operation of a bio or request. Stat groups follow the kernel's op_stat_group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    Read,
    Write,
    /// An empty cache flush (REQ_OP_FLUSH / REQ_PREFLUSH without data).
    Flush,
    Discard,
}

impl Op {
    /// Index of the kernel's stat group: READ, WRITE, DISCARD, FLUSH.
    #[inline]
    pub fn stat_group(self) -> usize {
        match self {
            Op::Read => 0,
            Op::Write => 1,
            Op::Discard => 2,
            Op::Flush => 3,
        }
    }
    pub fn is_write(self) -> bool {
        matches!(self, Op::Write | Op::Discard)
    }
    pub fn has_data(self) -> bool {
        matches!(self, Op::Read | Op::Write)
    }
}

/// Bio/request flags (the REQ_* bits that matter here).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct BioFlags(pub u16);

impl BioFlags {
    pub const SYNC: BioFlags = BioFlags(1);
    pub const META: BioFlags = BioFlags(1 << 1);
    /// Forced unit access: durable when it completes.
    pub const FUA: BioFlags = BioFlags(1 << 2);
    /// Flush the volatile cache before this write.
    pub const PREFLUSH: BioFlags = BioFlags(1 << 3);
    /// Background writeback (kupdate / background works), for wbt's classes.
    pub const BACKGROUND: BioFlags = BioFlags(1 << 4);
    /// Never merge this bio with another.
    pub const NOMERGE: BioFlags = BioFlags(1 << 5);
    /// Sync and idle: O_DIRECT-like writes that wbt never tracks.
    pub const IDLE: BioFlags = BioFlags(1 << 6);

    pub const fn empty() -> BioFlags {
        BioFlags(0)
    }
    #[inline]
    pub const fn contains(self, other: BioFlags) -> bool {
        self.0 & other.0 == other.0
    }
    #[inline]
    pub const fn intersects(self, other: BioFlags) -> bool {
        self.0 & other.0 != 0
    }
    /// Flags that forbid merging (kernel's REQ_NOMERGE_FLAGS).
    #[inline]
    pub const fn no_merge(self) -> bool {
        self.intersects(BioFlags(Self::NOMERGE.0 | Self::FUA.0 | Self::PREFLUSH.0))
    }
}

impl std::ops::BitOr for BioFlags {
    type Output = BioFlags;
    fn bitor(self, rhs: BioFlags) -> BioFlags {
        BioFlags(self.0 | rhs.0)
    }
}
impl std::ops::BitOrAssign for BioFlags {
    fn bitor_assign(&mut self, rhs: BioFlags) {
        self.0 |= rhs.0
    }
}

/// Why an IO failed. Maps onto errno values for the layers above.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BlkError {
    /// The device reported a media or transport error (EIO).
    #[error("I/O error on device")]
    Io,
    /// The device lost power; nothing more completes until it is rebooted.
    #[error("device lost power")]
    PowerLoss,
    /// The device does not support the operation (EOPNOTSUPP).
    #[error("operation not supported by the device: {0}")]
    NotSupported(String),
    /// The bio itself is malformed (EINVAL): unaligned, past the end, wrong length.
    #[error("invalid bio: {0}")]
    Invalid(String),
    /// The filesystem above has no room for the data (ENOSPC): raised by its
    /// reservation at write time, so the page cache can pass it to `write()`.
    #[error("no space left on device")]
    NoSpace,
}

impl BlkError {
    pub fn errno(&self) -> i32 {
        match self {
            BlkError::Io | BlkError::PowerLoss => libc::EIO,
            BlkError::NotSupported(_) => libc::EOPNOTSUPP,
            BlkError::Invalid(_) => libc::EINVAL,
            BlkError::NoSpace => libc::ENOSPC,
        }
    }
}

pub type BlkResult = Result<(), BlkError>;

/// Called once when a bio completes, with the bio handed back (a read's buffer holds
/// the data) and its status.
pub trait BioEndIo: Send + Sync {
    fn end_io(&self, bio: Bio, status: BlkResult);
}

/// The work deferred to the end of the completion batch running on this thread
/// (`completion_batch`), once each; `None` outside a batch.
type BatchEnds = Option<Vec<fn()>>;

thread_local! {
    static BATCH_END: std::cell::RefCell<BatchEnds> = const { std::cell::RefCell::new(None) };
}

/// Run `f`, which ends bios, as one completion batch: an `end_io` in it may leave the
/// part of its work that takes a contended lock to the batch's end
/// (`defer_to_batch_end`), where one call does it for every bio of the batch. A request
/// merged from 128 small files' writes took the filesystem's state lock 128 times in a
/// row, against the threads creating files, where it now takes it a few times. A batch
/// nested in another (a completion that completes IO inline) ends on its own.
pub fn completion_batch<R>(f: impl FnOnce() -> R) -> R {
    /// Ends the batch even when a completion panics: the bios ended before it left
    /// work here that waiters depend on.
    struct Batch(BatchEnds);
    impl Drop for Batch {
        fn drop(&mut self) {
            let ends = BATCH_END.with(|b| b.replace(self.0.take()));
            for end in ends.expect("the batch's list is set while it runs") {
                end();
            }
        }
    }
    let _batch = Batch(BATCH_END.with(|b| b.replace(Some(Vec::new()))));
    f()
}

/// Inside a completion batch, have `end` run once at its end and return true; outside
/// one, return false (the caller does its work now).
pub fn defer_to_batch_end(end: fn()) -> bool {
    BATCH_END.with(|b| match &mut *b.borrow_mut() {
        Some(ends) => {
            if !ends.iter().any(|e| std::ptr::fn_addr_eq(*e, end)) {
                ends.push(end);
            }
            true
        }
        None => false,
    })
}

/// A block IO: one contiguous range of sectors and, for reads and writes, one buffer.
pub struct Bio {
    pub op: Op,
    pub flags: BioFlags,
    /// First 512-byte sector.
    pub sector: u64,
    /// Length in sectors. For reads and writes it equals `buf.len() / 512`.
    pub nr_sectors: u32,
    pub buf: Option<IoBuf>,
    pub end_io: Option<Arc<dyn BioEndIo>>,
    /// The submitter's cookie, untouched by the block layer.
    pub private: u64,
}

impl Bio {
    pub fn read(sector: u64, len: usize) -> Bio {
        Bio {
            op: Op::Read,
            flags: BioFlags::empty(),
            sector,
            nr_sectors: (len as u64 >> SECTOR_SHIFT) as u32,
            buf: Some(IoBuf::zeroed(len)),
            end_io: None,
            private: 0,
        }
    }
    pub fn write(sector: u64, buf: IoBuf) -> Bio {
        Bio {
            op: Op::Write,
            flags: BioFlags::empty(),
            sector,
            nr_sectors: (buf.len() as u64 >> SECTOR_SHIFT) as u32,
            buf: Some(buf),
            end_io: None,
            private: 0,
        }
    }
    pub fn flush() -> Bio {
        Bio {
            op: Op::Flush,
            flags: BioFlags::PREFLUSH,
            sector: 0,
            nr_sectors: 0,
            buf: None,
            end_io: None,
            private: 0,
        }
    }
    pub fn discard(sector: u64, nr_sectors: u32) -> Bio {
        Bio {
            op: Op::Discard,
            flags: BioFlags::empty(),
            sector,
            nr_sectors,
            buf: None,
            end_io: None,
            private: 0,
        }
    }
    pub fn with_flags(mut self, f: BioFlags) -> Bio {
        self.flags |= f;
        self
    }
    pub fn with_end_io(mut self, e: Arc<dyn BioEndIo>) -> Bio {
        self.end_io = Some(e);
        self
    }
    pub fn bytes(&self) -> u64 {
        (self.nr_sectors as u64) << SECTOR_SHIFT
    }
    pub fn end_sector(&self) -> u64 {
        self.sector + self.nr_sectors as u64
    }
    /// Hand the bio back to its submitter. The bio keeps its end_io (as bi_end_io
    /// stays set in the kernel), so a submitter can reuse it as it is.
    pub fn complete(self, status: BlkResult) {
        if let Some(e) = self.end_io.clone() {
            e.end_io(self, status);
        }
    }
}

impl std::fmt::Debug for Bio {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Bio({:?} {:?} sector {} +{})",
            self.op, self.flags, self.sector, self.nr_sectors
        )
    }
}

/// A request: one or more bios covering a contiguous sector range, dispatched to a
/// device as a single command with one tag.
pub struct Request {
    pub op: Op,
    pub flags: BioFlags,
    pub sector: u64,
    pub nr_sectors: u32,
    /// The bios in ascending sector order; each is one or more physical segments.
    pub bios: SmallVec<[Bio; 1]>,
    pub nr_segments: u32,
    /// Hardware queue and tag, assigned at dispatch.
    pub hctx: u16,
    pub tag: u32,
    /// When accounting started (request creation), for diskstats' ticks.
    pub start_ns: u64,
    /// How the request is accounted, decided with `start_ns` at its creation (the
    /// kernel's RQF_IO_STAT): its start and completion are counted the same way
    /// whatever `iostats` says meanwhile, or an in-flight count would never come back
    /// down and ticks would be measured from a stamp never taken.
    pub io_stat: IoStatsMode,
    /// When the request was handed to the device, for service-latency stats (wbt).
    pub io_start_ns: u64,
    /// Set when a size or segment check failed: never try to merge into it again.
    pub nomerge: bool,
    /// Per-request scratch for the rq_qos chain's policies.
    pub qos_flags: u8,
    /// The queue's own wbt: tracked class, read, service-latency stamp
    /// (`block::wbt::flags`).
    pub wbt_flags: u8,
}

impl Request {
    pub fn from_bio(bio: Bio, segments: u32) -> Request {
        let mut bios = SmallVec::new();
        let (op, flags, sector, nr_sectors) = (bio.op, bio.flags, bio.sector, bio.nr_sectors);
        bios.push(bio);
        Request {
            op,
            flags,
            sector,
            nr_sectors,
            bios,
            nr_segments: segments,
            hctx: 0,
            tag: 0,
            start_ns: 0,
            io_stat: IoStatsMode::Off,
            io_start_ns: 0,
            nomerge: flags.no_merge(),
            qos_flags: 0,
            wbt_flags: 0,
        }
    }
    pub fn end_sector(&self) -> u64 {
        self.sector + self.nr_sectors as u64
    }
    pub fn bytes(&self) -> u64 {
        (self.nr_sectors as u64) << SECTOR_SHIFT
    }
    /// The data segments of this request in device order.
    pub fn buffers(&self) -> impl Iterator<Item = &IoBuf> {
        self.bios.iter().filter_map(|b| b.buf.as_ref())
    }
    pub fn buffers_mut(&mut self) -> impl Iterator<Item = &mut IoBuf> {
        self.bios.iter_mut().filter_map(|b| b.buf.as_mut())
    }
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Request({:?} {:?} sector {} +{} bios {} segs {} tag {}/{})",
            self.op,
            self.flags,
            self.sector,
            self.nr_sectors,
            self.bios.len(),
            self.nr_segments,
            self.hctx,
            self.tag
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    thread_local! {
        static RUNS: Cell<u32> = const { Cell::new(0) };
    }
    fn count_run() {
        RUNS.with(|r| r.set(r.get() + 1));
    }
    fn runs() -> u32 {
        RUNS.with(|r| r.get())
    }

    #[test]
    fn work_deferred_in_a_batch_runs_once_at_its_end_and_a_nested_batch_ends_on_its_own() {
        assert!(
            !defer_to_batch_end(count_run),
            "no batch: the caller works now"
        );
        completion_batch(|| {
            assert!(defer_to_batch_end(count_run));
            assert!(defer_to_batch_end(count_run));
            completion_batch(|| assert!(defer_to_batch_end(count_run)));
            assert_eq!(runs(), 1, "the inner batch ran its own deferred work");
            assert!(defer_to_batch_end(count_run));
        });
        assert_eq!(
            runs(),
            2,
            "the outer batch's, deferred three times, ran once"
        );
        let panicked = std::panic::catch_unwind(|| {
            completion_batch(|| {
                assert!(defer_to_batch_end(count_run));
                panic!("a completion panics");
            })
        });
        assert!(panicked.is_err());
        assert_eq!(
            runs(),
            3,
            "a batch that panicked still ran its deferred work"
        );
        assert!(!defer_to_batch_end(count_run), "and left no batch open");
    }
}
