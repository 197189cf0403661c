//! Replies encoded as /dev/fuse would carry them after `fuse_out_header` (the uapi
//! structs' layouts: fuse_entry_out, fuse_attr_out, fuse_open_out, fuse_dirent...),
//! handed to the ring thread that waits for them.

use crate::reply::{
    AttrReply, CreateReply, DataReply, DirReply, EmptyReply, EntryReply, Fail, LseekReply,
    OpenReply, StatfsOut, StatfsReply, WriteReply, XattrReply,
};
use crossbeam_channel::Sender;
use fuser::{Errno, FileAttr, FileHandle, FileType, FopenFlags, Generation, INodeNo};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A reply: the error (negative errno, 0) and the body after `fuse_out_header`.
pub(super) struct Out {
    pub(super) error: i32,
    pub(super) body: Vec<u8>,
}

/// Every kind of answer, encoded as /dev/fuse would carry it and sent to the ring
/// thread that waits for it.
#[derive(Clone)]
pub(super) struct RingReply {
    pub(super) tx: Sender<Out>,
    /// The entry's payload size: no reply may be longer.
    pub(super) max: usize,
}

impl RingReply {
    fn send(self, body: Vec<u8>) {
        if body.len() > self.max {
            return self.error(Errno::ERANGE);
        }
        self.put(Out { error: 0, body });
    }

    /// The entry takes one answer, the first: a second (a bug) is reported and
    /// dropped, never waited on, since nothing reads it and the ring thread that
    /// would wait is the one that reads the first.
    fn put(&self, out: Out) {
        if self.tx.try_send(out).is_err() {
            eprintln!("wbstack mount: a ring request answered twice (a bug); the second answer is dropped");
        }
    }
}

impl Fail for RingReply {
    fn error(self, e: Errno) {
        self.put(Out {
            error: -i32::from(e),
            body: Vec::new(),
        });
    }
    /// A ring thread's one entry waits for this reply whatever the handler does, and
    /// the kernel gives the CPU's next request to another thread's entry.
    fn may_block(&self) -> bool {
        true
    }
}

pub(super) fn put_u32(v: &mut Vec<u8>, x: u32) {
    v.extend_from_slice(&x.to_ne_bytes());
}

pub(super) fn put_u64(v: &mut Vec<u8>, x: u64) {
    v.extend_from_slice(&x.to_ne_bytes());
}

pub(super) fn secs_nsec(t: SystemTime) -> (u64, u32) {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (d.as_secs(), d.subsec_nanos()),
        // Before 1970: the kernel's fuse_attr holds seconds as u64 of an i64.
        Err(e) => {
            let d = e.duration();
            let (s, ns) = (d.as_secs() as i64, d.subsec_nanos());
            if ns == 0 {
                ((-s) as u64, 0)
            } else {
                ((-s - 1) as u64, 1_000_000_000 - ns)
            }
        }
    }
}

pub(super) fn mode_of(kind: FileType, perm: u16) -> u32 {
    let t = match kind {
        FileType::NamedPipe => libc::S_IFIFO,
        FileType::CharDevice => libc::S_IFCHR,
        FileType::BlockDevice => libc::S_IFBLK,
        FileType::Directory => libc::S_IFDIR,
        FileType::RegularFile => libc::S_IFREG,
        FileType::Symlink => libc::S_IFLNK,
        FileType::Socket => libc::S_IFSOCK,
    };
    t | u32::from(perm)
}

/// `struct fuse_attr` (88 bytes).
pub(super) fn put_attr(v: &mut Vec<u8>, a: &FileAttr) {
    let (at, atn) = secs_nsec(a.atime);
    let (mt, mtn) = secs_nsec(a.mtime);
    let (ct, ctn) = secs_nsec(a.ctime);
    for x in [a.ino.0, a.size, a.blocks, at, mt, ct] {
        put_u64(v, x);
    }
    for x in [
        atn,
        mtn,
        ctn,
        mode_of(a.kind, a.perm),
        a.nlink,
        a.uid,
        a.gid,
        a.rdev,
        a.blksize,
        0,
    ] {
        put_u32(v, x);
    }
}

/// `struct fuse_entry_out` (128 bytes).
pub(super) fn put_entry(v: &mut Vec<u8>, ttl: &Duration, a: &FileAttr, generation: Generation) {
    put_u64(v, a.ino.0);
    put_u64(v, generation.0);
    put_u64(v, ttl.as_secs());
    put_u64(v, ttl.as_secs());
    put_u32(v, ttl.subsec_nanos());
    put_u32(v, ttl.subsec_nanos());
    put_attr(v, a);
}

pub(super) fn put_open(v: &mut Vec<u8>, fh: FileHandle, flags: FopenFlags) {
    put_u64(v, fh.0);
    put_u32(v, flags.bits());
    put_u32(v, 0);
}

impl EntryReply for RingReply {
    fn entry(self, ttl: &Duration, attr: &FileAttr, generation: Generation) {
        let mut v = Vec::with_capacity(128);
        put_entry(&mut v, ttl, attr, generation);
        self.send(v)
    }
}

impl AttrReply for RingReply {
    fn attr(self, ttl: &Duration, attr: &FileAttr) {
        let mut v = Vec::with_capacity(104);
        put_u64(&mut v, ttl.as_secs());
        put_u32(&mut v, ttl.subsec_nanos());
        put_u32(&mut v, 0);
        put_attr(&mut v, attr);
        self.send(v)
    }
}

impl EmptyReply for RingReply {
    fn ok(self) {
        self.send(Vec::new())
    }
}

impl DataReply for RingReply {
    fn data(self, data: &[u8]) {
        self.send(data.to_vec())
    }
    fn data_owned(self, mut buf: Vec<u8>, len: usize) {
        buf.truncate(len);
        self.send(buf)
    }
}

impl OpenReply for RingReply {
    fn opened(self, fh: FileHandle, flags: FopenFlags) {
        let mut v = Vec::with_capacity(16);
        put_open(&mut v, fh, flags);
        self.send(v)
    }
}

impl WriteReply for RingReply {
    fn written(self, size: u32) {
        let mut v = Vec::with_capacity(8);
        put_u32(&mut v, size);
        put_u32(&mut v, 0);
        self.send(v)
    }
}

impl CreateReply for RingReply {
    fn created(
        self,
        ttl: &Duration,
        attr: &FileAttr,
        generation: Generation,
        fh: FileHandle,
        flags: FopenFlags,
    ) {
        let mut v = Vec::with_capacity(144);
        put_entry(&mut v, ttl, attr, generation);
        put_open(&mut v, fh, flags);
        self.send(v)
    }
}

impl StatfsReply for RingReply {
    fn statfs(self, s: StatfsOut) {
        let mut v = Vec::with_capacity(80);
        for x in [s.blocks, s.bfree, s.bavail, s.files, s.ffree] {
            put_u64(&mut v, x);
        }
        for x in [s.bsize, s.namelen, s.frsize, 0, 0, 0, 0, 0, 0, 0] {
            put_u32(&mut v, x);
        }
        self.send(v)
    }
}

impl XattrReply for RingReply {
    fn size(self, size: u32) {
        let mut v = Vec::with_capacity(8);
        put_u32(&mut v, size);
        put_u32(&mut v, 0);
        self.send(v)
    }
    fn data(self, data: &[u8]) {
        self.send(data.to_vec())
    }
}

impl LseekReply for RingReply {
    fn offset(self, offset: i64) {
        let mut v = Vec::with_capacity(8);
        put_u64(&mut v, offset as u64);
        self.send(v)
    }
}

/// A readdir reply: `struct fuse_dirent`s, each padded to 8 bytes, up to the size
/// the kernel asked for.
pub(super) struct DirOut {
    pub(super) reply: RingReply,
    pub(super) buf: Vec<u8>,
    pub(super) max: usize,
}

impl DirOut {
    pub(super) fn new(reply: RingReply, max: usize) -> DirOut {
        DirOut {
            reply,
            buf: Vec::new(),
            max,
        }
    }
}

impl Fail for DirOut {
    fn error(self, e: Errno) {
        self.reply.error(e)
    }
}

impl DirReply for DirOut {
    fn add(&mut self, ino: INodeNo, offset: u64, kind: FileType, name: &OsStr) -> bool {
        let name = name.as_bytes();
        let len = (24 + name.len()).next_multiple_of(8);
        if self.buf.len() + len > self.max {
            return true;
        }
        put_u64(&mut self.buf, ino.0);
        put_u64(&mut self.buf, offset);
        put_u32(&mut self.buf, name.len() as u32);
        put_u32(&mut self.buf, mode_of(kind, 0) >> 12);
        self.buf.extend_from_slice(name);
        self.buf.resize(self.buf.len().next_multiple_of(8), 0);
        false
    }
    fn ok(self) {
        self.reply.send(self.buf)
    }
}
