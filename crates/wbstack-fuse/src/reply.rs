//! What a request handler needs of its transport: who is asking, and how to answer.
//!
//! The handlers (`server.rs`) are written against these traits, not against fuser's
//! types, so that one handler serves both transports: fuser's reads of /dev/fuse
//! (its `Reply*` types implement the traits here by delegation) and FUSE over
//! io_uring (`uring/`, whose one reply type encodes every kind of answer into its
//! ring entry). fuser's request parsing and reply types are private to it, so a
//! transport of our own could not reuse them.

use fuser::{Errno, FileAttr, FileHandle, FileType, FopenFlags, Generation, INodeNo};
use std::ffi::OsStr;
use std::time::Duration;

/// The caller's identity, from the request's header.
pub trait Caller {
    fn uid(&self) -> u32;
    fn gid(&self) -> u32;
    fn pid(&self) -> u32;
}

impl Caller for fuser::Request {
    fn uid(&self) -> u32 {
        fuser::Request::uid(self)
    }
    fn gid(&self) -> u32 {
        fuser::Request::gid(self)
    }
    fn pid(&self) -> u32 {
        fuser::Request::pid(self)
    }
}

/// Every answer may be an error instead. Answers are `Send`: fsync answers from a
/// waiter thread.
pub trait Fail: Send + 'static {
    fn error(self, e: Errno);
    /// Whether the handler may block before replying (an fsync waiting for its
    /// commit) on the thread that called it.
    fn may_block(&self) -> bool {
        false
    }
}

pub trait EntryReply: Fail {
    fn entry(self, ttl: &Duration, attr: &FileAttr, generation: Generation);
}

pub trait AttrReply: Fail {
    fn attr(self, ttl: &Duration, attr: &FileAttr);
}

pub trait EmptyReply: Fail {
    fn ok(self);
}

pub trait DataReply: Fail {
    fn data(self, data: &[u8]);
    /// The first `len` bytes of a buffer the handler filled and gives away: a
    /// transport that keeps the reply as bytes takes it without copying it again.
    fn data_owned(self, mut buf: Vec<u8>, len: usize)
    where
        Self: Sized,
    {
        buf.truncate(len);
        self.data(&buf)
    }
}

pub trait OpenReply: Fail {
    fn opened(self, fh: FileHandle, flags: FopenFlags);
}

pub trait WriteReply: Fail {
    fn written(self, size: u32);
}

pub trait CreateReply: Fail {
    fn created(
        self,
        ttl: &Duration,
        attr: &FileAttr,
        generation: Generation,
        fh: FileHandle,
        flags: FopenFlags,
    );
}

/// The fields of statfs(2) a FUSE reply carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatfsOut {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
}

pub trait StatfsReply: Fail {
    fn statfs(self, s: StatfsOut);
}

pub trait XattrReply: Fail {
    /// The size a buffer must have (the caller asked with size 0).
    fn size(self, size: u32);
    fn data(self, data: &[u8]);
}

pub trait LseekReply: Fail {
    fn offset(self, offset: i64);
}

pub trait DirReply: Fail {
    /// Adds an entry; true when the kernel's buffer is full and this one did not fit.
    fn add(&mut self, ino: INodeNo, offset: u64, kind: FileType, name: &OsStr) -> bool;
    fn ok(self);
}

macro_rules! fails {
    ($($t:ty),*) => {$(
        impl Fail for $t {
            fn error(self, e: Errno) {
                <$t>::error(self, e)
            }
        }
    )*};
}

fails!(
    fuser::ReplyEntry,
    fuser::ReplyAttr,
    fuser::ReplyEmpty,
    fuser::ReplyData,
    fuser::ReplyOpen,
    fuser::ReplyWrite,
    fuser::ReplyCreate,
    fuser::ReplyStatfs,
    fuser::ReplyXattr,
    fuser::ReplyLseek,
    fuser::ReplyDirectory
);

impl EntryReply for fuser::ReplyEntry {
    fn entry(self, ttl: &Duration, attr: &FileAttr, generation: Generation) {
        fuser::ReplyEntry::entry(self, ttl, attr, generation)
    }
}

impl AttrReply for fuser::ReplyAttr {
    fn attr(self, ttl: &Duration, attr: &FileAttr) {
        fuser::ReplyAttr::attr(self, ttl, attr)
    }
}

impl EmptyReply for fuser::ReplyEmpty {
    fn ok(self) {
        fuser::ReplyEmpty::ok(self)
    }
}

impl DataReply for fuser::ReplyData {
    fn data(self, data: &[u8]) {
        fuser::ReplyData::data(self, data)
    }
}

impl OpenReply for fuser::ReplyOpen {
    fn opened(self, fh: FileHandle, flags: FopenFlags) {
        fuser::ReplyOpen::opened(self, fh, flags)
    }
}

impl WriteReply for fuser::ReplyWrite {
    fn written(self, size: u32) {
        fuser::ReplyWrite::written(self, size)
    }
}

impl CreateReply for fuser::ReplyCreate {
    fn created(
        self,
        ttl: &Duration,
        attr: &FileAttr,
        generation: Generation,
        fh: FileHandle,
        flags: FopenFlags,
    ) {
        fuser::ReplyCreate::created(self, ttl, attr, generation, fh, flags)
    }
}

impl StatfsReply for fuser::ReplyStatfs {
    fn statfs(self, s: StatfsOut) {
        fuser::ReplyStatfs::statfs(
            self, s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.frsize,
        )
    }
}

impl XattrReply for fuser::ReplyXattr {
    fn size(self, size: u32) {
        fuser::ReplyXattr::size(self, size)
    }
    fn data(self, data: &[u8]) {
        fuser::ReplyXattr::data(self, data)
    }
}

impl LseekReply for fuser::ReplyLseek {
    fn offset(self, offset: i64) {
        fuser::ReplyLseek::offset(self, offset)
    }
}

impl DirReply for fuser::ReplyDirectory {
    fn add(&mut self, ino: INodeNo, offset: u64, kind: FileType, name: &OsStr) -> bool {
        fuser::ReplyDirectory::add(self, ino, offset, kind, name)
    }
    fn ok(self) {
        fuser::ReplyDirectory::ok(self)
    }
}
