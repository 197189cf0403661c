//! The FUSE request handlers: each request of /dev/fuse becomes one call of the
//! Volume's inode-level API (`wbstack::fs::ops`) with the caller's credentials.
//!
//! File data goes to wbstack's page cache only: every open is FOPEN_DIRECT_IO, so the
//! kernel keeps no copy and every read and write reaches the Volume, where writeback,
//! throttling, plugging and wbt act on it (mmap still works through
//! FUSE_DIRECT_IO_ALLOW_MMAP). fsync never parks a request thread: it waits on a
//! small pool of its own and replies from there (replies are Send).

use crate::counters::{Counters, Op};
use crate::ctl::{self, CtlFile, CTL_DIR_INO, CTL_NAME};
use crate::reply::{
    AttrReply, Caller, CreateReply, DataReply, DirReply, EmptyReply, EntryReply, LseekReply,
    OpenReply, StatfsOut, StatfsReply, WriteReply, XattrReply,
};
use crossbeam_channel::{unbounded, Sender};
use fuser::{
    AccessFlags, Errno, FileAttr, FileHandle, FileType, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenFlags, RenameFlags as FuseRenameFlags, ReplyAttr, ReplyCreate,
    ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyLseek, ReplyOpen, ReplyStatfs,
    ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use wbstack::fs::{
    Cred, File, FsError, FsResult, InodeKind, OpenOptions, RenameFlags, SetAttrIno, Stat, TimeSet,
    Volume, XattrMode,
};

/// How long the kernel may trust an entry or attributes: every change goes through
/// this daemon, and the kernel updates or drops what a reply changes, so a long TTL
/// only saves LOOKUP and GETATTR round trips.
const TTL: Duration = Duration::from_secs(3600);
/// Threads waiting on fsync (and on the trace file) so that no request thread does.
const WAITERS: usize = 32;
/// The largest request or reply body: max_write (and the kernel's 256 pages).
pub const MAX_PAYLOAD: usize = 1 << 20;

/// Whether FUSE over io_uring was asked for, and granted at INIT.
struct UringWish {
    want: bool,
    granted: std::sync::atomic::AtomicBool,
}

/// What an open file handle holds.
enum Handle {
    File(File),
    /// A directory of the volume, walked by readdir cookie (the name hash): an offset
    /// is the cookie of the entry before, so a resume holds nothing between calls and
    /// stays valid whatever is created or deleted meanwhile (`wbstack::fs::dir`).
    Dir {
        ino: u64,
    },
    /// The control directory's listing, taken at opendir: offsets index into it.
    CtlDir(Vec<(Vec<u8>, u64, FileType)>),
    Ctl {
        file: CtlFile,
        content: Vec<u8>,
    },
}

type Job = Box<dyn FnOnce() + Send>;

/// Result of the final unmount, for the process that mounted.
pub type UnmountResult = Arc<Mutex<Option<FsResult<()>>>>;

pub struct WbFs {
    vol: Option<Arc<Volume>>,
    handles: RwLock<HashMap<u64, Arc<Handle>>>,
    next_fh: AtomicU64,
    counters: Arc<Counters>,
    waiters: Sender<Job>,
    owner_uid: u32,
    read_only: bool,
    unmounted: UnmountResult,
    trace_readers: Arc<AtomicU64>,
    /// Set once the session exists (`serve`): how the server tells the kernel of a
    /// change it made itself, which no reply carries.
    pub notifier: Arc<std::sync::OnceLock<fuser::Notifier>>,
    uring: UringWish,
}

fn errno(e: &FsError) -> Errno {
    Errno::from_i32(e.errno())
}

fn time(ns: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_nanos(ns)
}

fn ns_of(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos().min(u64::MAX as u128) as u64)
}

fn file_type(k: InodeKind) -> FileType {
    match k {
        InodeKind::File => FileType::RegularFile,
        InodeKind::Dir => FileType::Directory,
        InodeKind::Symlink => FileType::Symlink,
        InodeKind::Fifo => FileType::NamedPipe,
        InodeKind::Socket => FileType::Socket,
        InodeKind::CharDev => FileType::CharDevice,
        InodeKind::BlockDev => FileType::BlockDevice,
    }
}

fn attr(s: &Stat) -> FileAttr {
    FileAttr {
        ino: INodeNo(s.ino),
        size: s.size,
        blocks: s.blocks,
        atime: time(s.atime_ns),
        mtime: time(s.mtime_ns),
        ctime: time(s.ctime_ns),
        crtime: time(s.ctime_ns),
        kind: file_type(s.kind),
        perm: (s.mode & 0o7777) as u16,
        nlink: s.nlink,
        uid: s.uid,
        gid: s.gid,
        rdev: s.rdev,
        blksize: 4096,
        flags: 0,
    }
}

/// The caller's credentials; supplementary groups from /proc (FUSE sends only the
/// fsuid and fsgid), read only for callers that are not root.
fn cred(req: &impl Caller) -> Cred {
    let (uid, gid) = (req.uid(), req.gid());
    if uid == 0 {
        return Cred::new(0, gid, Vec::new());
    }
    let groups = std::fs::read_to_string(format!("/proc/{}/status", req.pid()))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| l.strip_prefix("Groups:")).map(|g| {
                g.split_whitespace()
                    .filter_map(|x| x.parse().ok())
                    .collect()
            })
        })
        .unwrap_or_default();
    Cred::new(uid, gid, groups)
}

fn open_options(flags: i32) -> OpenOptions {
    let acc = flags & libc::O_ACCMODE;
    OpenOptions {
        read: acc == libc::O_RDONLY || acc == libc::O_RDWR,
        write: acc == libc::O_WRONLY || acc == libc::O_RDWR,
        create: false,
        truncate: flags & libc::O_TRUNC != 0,
        exclusive: flags & libc::O_EXCL != 0,
        // The kernel places each O_APPEND write itself (at its i_size, under the inode
        // lock; every write goes through this mount, so that size is ours) and sends
        // its offset; a shared mmap's pages are written back through a handle that may
        // be append-mode, at their own offsets, which an append here would move to
        // the end of the file.
        append: false,
        mode: 0o644,
    }
}

fn reserved(parent: INodeNo, name: &OsStr) -> bool {
    parent == INodeNo::ROOT && name.as_bytes() == CTL_NAME
}

impl WbFs {
    pub fn new(
        vol: Volume,
        owner_uid: u32,
        read_only: bool,
        unmounted: UnmountResult,
        want_uring: bool,
    ) -> WbFs {
        let (tx, rx) = unbounded::<Job>();
        for i in 0..WAITERS {
            let rx = rx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("fuse-wait-{i}"))
                .spawn(move || {
                    for job in rx {
                        job();
                    }
                });
            if let Err(e) = spawned {
                eprintln!("wbstack mount: cannot start a waiter thread: {e}");
            }
        }
        WbFs {
            vol: Some(Arc::new(vol)),
            handles: RwLock::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            counters: Arc::new(Counters::default()),
            waiters: tx,
            owner_uid,
            read_only,
            unmounted,
            trace_readers: Arc::new(AtomicU64::new(0)),
            notifier: Arc::default(),
            uring: UringWish {
                want: want_uring,
                granted: Default::default(),
            },
        }
    }

    /// Whether INIT granted FUSE over io_uring.
    pub fn uring_granted(&self) -> bool {
        self.uring.granted.load(Ordering::Relaxed)
    }

    fn vol(&self) -> &Arc<Volume> {
        // Taken only by destroy, after the last request.
        self.vol.as_ref().expect("volume used after destroy")
    }

    pub fn counters(&self) -> Arc<Counters> {
        self.counters.clone()
    }

    pub(crate) fn counters_ref(&self) -> &Counters {
        &self.counters
    }

    /// readdir of a volume directory from `offset`: "." at cookie 1, ".." at 2, then
    /// the entries by cookie, a page at a time until the kernel's buffer is full. A
    /// group of names sharing a cookie (a 63-bit hash collision) that the buffer splits
    /// loses its rest to the resume, as on ext4.
    fn readdir_volume(&self, ino: u64, offset: u64, mut reply: impl DirReply) {
        const PAGE: usize = 128;
        let vol = self.vol();
        if offset < 1 && reply.add(INodeNo(ino), 1, FileType::Directory, OsStr::new(".")) {
            return reply.ok();
        }
        if offset < 2 {
            let parent = vol.parent_of(ino).unwrap_or(1);
            if reply.add(INodeNo(parent), 2, FileType::Directory, OsStr::new("..")) {
                return reply.ok();
            }
        }
        let mut cookie = offset.max(2);
        loop {
            let page = match vol.readdir_page(ino, cookie, PAGE) {
                Ok(p) => p,
                // Removed while open: its walk has ended, as the kernel's does.
                Err(FsError::NotFound(_)) => break,
                Err(e) => return reply.error(errno(&e)),
            };
            let Some(last) = page.last() else { break };
            cookie = last.cookie;
            for e in &page {
                let name = OsStr::from_bytes(&e.name);
                if reply.add(INodeNo(e.ino), e.cookie, file_type(e.kind), name) {
                    return reply.ok();
                }
            }
        }
        reply.ok()
    }

    fn add_handle(&self, h: Handle) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles.write().insert(fh, Arc::new(h));
        fh
    }

    fn handle(&self, fh: FileHandle) -> Result<Arc<Handle>, Errno> {
        self.handles.read().get(&fh.0).cloned().ok_or(Errno::EBADF)
    }

    fn file(&self, fh: FileHandle) -> Result<Arc<Handle>, Errno> {
        let h = self.handle(fh)?;
        match &*h {
            Handle::File(_) => Ok(h),
            _ => Err(Errno::EBADF),
        }
    }

    fn writable(&self) -> Result<(), Errno> {
        if self.read_only {
            Err(Errno::EROFS)
        } else {
            Ok(())
        }
    }

    fn ctl_dir_attr(&self) -> FileAttr {
        let now = SystemTime::now();
        FileAttr {
            ino: INodeNo(CTL_DIR_INO),
            size: 0,
            blocks: 0,
            atime: now,
            mtime: now,
            ctime: now,
            crtime: now,
            kind: FileType::Directory,
            perm: 0o755,
            nlink: 2,
            uid: self.owner_uid,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    fn ctl_attr(&self, ino: u64) -> Option<FileAttr> {
        if ino == CTL_DIR_INO {
            return Some(self.ctl_dir_attr());
        }
        let f = ctl::by_ino(ino)?;
        Some(FileAttr {
            ino: INodeNo(ino),
            kind: FileType::RegularFile,
            perm: if f.writable() { 0o644 } else { 0o444 },
            nlink: 1,
            ..self.ctl_dir_attr()
        })
    }

    /// Tells the kernel that the server cleared `ino`'s set-id bits for a request
    /// whose reply carries no attributes (a write, an OPEN with O_TRUNC). The kernel
    /// refreshes its cached mode only when told (up to TTL later otherwise), and exec
    /// reads that mode: a program changed by another user would still run set-id.
    /// Attributes only (offset -1): no page of the file is dropped.
    fn set_id_cleared(&self, ino: INodeNo) {
        if let Some(n) = self.notifier.get() {
            if let Err(e) = n.inval_inode(ino, -1, 0) {
                eprintln!("wbstack mount: telling the kernel of a cleared set-id bit: {e}");
            }
        }
    }

    fn reply_entry(reply: impl EntryReply, r: FsResult<Stat>) {
        match r {
            Ok(s) => reply.entry(&TTL, &attr(&s), Generation(0)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    /// Run `f`, which may block for a journal commit, where its reply's transport
    /// lets it (`inline`: `Fail::may_block`): on the calling thread when that thread holds nothing another request
    /// needs (a ring thread, whose one entry waits for this reply anyway), else on a
    /// waiter thread (a /dev/fuse request thread serves every request).
    fn defer(&self, inline: bool, f: impl FnOnce() + Send + 'static) {
        if inline {
            return f();
        }
        if let Err(e) = self.waiters.send(Box::new(f)) {
            // The pool is gone only at teardown: run it here rather than drop a reply.
            (e.into_inner())();
        }
    }
}

/// The handlers, one per opcode, with fuser's arguments: both transports call them
/// (fuser's session through `Served`, the rings through `uring::dispatch`).
#[allow(clippy::too_many_arguments)]
impl WbFs {
    pub(crate) fn lookup(
        &self,
        req: &impl Caller,
        parent: INodeNo,
        name: &OsStr,
        reply: impl EntryReply,
    ) {
        self.counters.count(Op::lookup);
        if reserved(parent, name) {
            return reply.entry(&TTL, &self.ctl_dir_attr(), Generation(0));
        }
        if parent.0 == CTL_DIR_INO {
            return match ctl::by_name(name.as_bytes()).and_then(|(i, _)| self.ctl_attr(i)) {
                Some(a) => reply.entry(&TTL, &a, Generation(0)),
                None => reply.error(Errno::ENOENT),
            };
        }
        match self.vol().lookup_as(&cred(req), parent.0, name.as_bytes()) {
            Ok(s) => reply.entry(&TTL, &attr(&s), Generation(0)),
            // A negative entry the kernel may cache (inode 0): fs_mark's lookup of a
            // name it is about to create costs one round trip, not two.
            Err(FsError::NotFound(_)) => {
                let mut a = self.ctl_dir_attr();
                a.ino = INodeNo(0);
                reply.entry(&TTL, &a, Generation(0))
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    pub(crate) fn getattr(
        &self,
        _req: &impl Caller,
        ino: INodeNo,
        _fh: Option<FileHandle>,
        reply: impl AttrReply,
    ) {
        self.counters.count(Op::getattr);
        if let Some(a) = ctl::is_ctl(ino.0).then(|| self.ctl_attr(ino.0)).flatten() {
            return reply.attr(&TTL, &a);
        }
        match self.vol().getattr(ino.0) {
            Ok(s) => reply.attr(&TTL, &attr(&s)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    pub(crate) fn setattr(
        &self,
        req: &impl Caller,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: impl AttrReply,
    ) {
        self.counters.count(Op::setattr);
        if ctl::is_ctl(ino.0) {
            // `echo N > knob` may truncate first: nothing to do.
            return match (self.ctl_attr(ino.0), mode, uid, gid) {
                (Some(a), None, None, None) => reply.attr(&TTL, &a),
                _ => reply.error(Errno::EPERM),
            };
        }
        if let Err(e) = self.writable() {
            return reply.error(e);
        }
        let t = |t: Option<TimeOrNow>| {
            t.map(|t| match t {
                TimeOrNow::Now => TimeSet::Now,
                TimeOrNow::SpecificTime(st) => TimeSet::At(ns_of(st)),
            })
        };
        let a = SetAttrIno {
            mode,
            uid,
            gid,
            size,
            size_by_open_file: fh.is_some_and(|fh| self.file(fh).is_ok()),
            atime: t(atime),
            mtime: t(mtime),
        };
        match self.vol().setattr_as(&cred(req), ino.0, &a) {
            Ok(s) => reply.attr(&TTL, &attr(&s)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    pub(crate) fn readlink(&self, _req: &impl Caller, ino: INodeNo, reply: impl DataReply) {
        self.counters.count(Op::readlink);
        match self.vol().readlink_ino(ino.0) {
            Ok(t) => reply.data(&t),
            Err(e) => reply.error(errno(&e)),
        }
    }

    pub(crate) fn mknod(
        &self,
        req: &impl Caller,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: impl EntryReply,
    ) {
        self.counters.count(Op::mknod);
        let mode = (mode & 0o170000) | (mode & 0o7777 & !umask);
        self.make_node(req, parent, name, mode, rdev, reply)
    }

    pub(crate) fn mkdir(
        &self,
        req: &impl Caller,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: impl EntryReply,
    ) {
        self.counters.count(Op::mkdir);
        let mode = 0o040000 | (mode & 0o7777 & !umask);
        self.make_node(req, parent, name, mode, 0, reply)
    }

    pub(crate) fn unlink(
        &self,
        req: &impl Caller,
        parent: INodeNo,
        name: &OsStr,
        reply: impl EmptyReply,
    ) {
        self.counters.count(Op::unlink);
        self.remove(req, parent, name, false, reply)
    }

    pub(crate) fn rmdir(
        &self,
        req: &impl Caller,
        parent: INodeNo,
        name: &OsStr,
        reply: impl EmptyReply,
    ) {
        self.counters.count(Op::rmdir);
        self.remove(req, parent, name, true, reply)
    }

    pub(crate) fn symlink(
        &self,
        req: &impl Caller,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: impl EntryReply,
    ) {
        self.counters.count(Op::symlink);
        if reserved(parent, link_name) || ctl::is_ctl(parent.0) {
            return reply.error(Errno::EEXIST);
        }
        if let Err(e) = self.writable() {
            return reply.error(e);
        }
        let r = self.vol().symlink_as(
            &cred(req),
            parent.0,
            link_name.as_bytes(),
            target.as_os_str().as_bytes(),
        );
        Self::reply_entry(reply, r)
    }

    pub(crate) fn rename(
        &self,
        req: &impl Caller,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: FuseRenameFlags,
        reply: impl EmptyReply,
    ) {
        self.counters.count(Op::rename);
        if reserved(parent, name)
            || reserved(newparent, newname)
            || ctl::is_ctl(parent.0)
            || ctl::is_ctl(newparent.0)
        {
            return reply.error(Errno::EPERM);
        }
        if let Err(e) = self.writable() {
            return reply.error(e);
        }
        if flags.contains(FuseRenameFlags::RENAME_WHITEOUT) {
            return reply.error(Errno::EINVAL);
        }
        let f = RenameFlags {
            noreplace: flags.contains(FuseRenameFlags::RENAME_NOREPLACE),
            exchange: flags.contains(FuseRenameFlags::RENAME_EXCHANGE),
        };
        match self.vol().rename_as(
            &cred(req),
            parent.0,
            name.as_bytes(),
            newparent.0,
            newname.as_bytes(),
            f,
        ) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    pub(crate) fn link(
        &self,
        req: &impl Caller,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: impl EntryReply,
    ) {
        self.counters.count(Op::link);
        if reserved(newparent, newname) || ctl::is_ctl(newparent.0) || ctl::is_ctl(ino.0) {
            return reply.error(Errno::EPERM);
        }
        if let Err(e) = self.writable() {
            return reply.error(e);
        }
        let r = self
            .vol()
            .link_as(&cred(req), ino.0, newparent.0, newname.as_bytes());
        Self::reply_entry(reply, r)
    }

    pub(crate) fn open(
        &self,
        req: &impl Caller,
        ino: INodeNo,
        flags: OpenFlags,
        reply: impl OpenReply,
    ) {
        self.counters.count(Op::open);
        let o = open_options(flags.0);
        if ctl::is_ctl(ino.0) {
            return self.open_ctl(req, ino.0, &o, reply);
        }
        if (o.write || o.truncate) && self.read_only {
            return reply.error(Errno::EROFS);
        }
        match self.vol().open_reporting_as(&cred(req), ino.0, &o) {
            Ok((f, cleared)) => {
                // An O_TRUNC cleared them (FUSE_ATOMIC_O_TRUNC: the kernel truncates
                // through this OPEN, not a SETATTR); an OPEN's reply carries no mode.
                if cleared {
                    self.set_id_cleared(ino);
                }
                let fh = self.add_handle(Handle::File(f));
                reply.opened(FileHandle(fh), Self::fopen_flags(&o));
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    pub(crate) fn read(
        &self,
        _req: &impl Caller,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: impl DataReply,
    ) {
        self.counters.count(Op::read);
        let h = match self.handle(fh) {
            Ok(h) => h,
            Err(e) => return reply.error(e),
        };
        match &*h {
            Handle::File(f) => {
                let mut buf = vec![0u8; size as usize];
                match f.read_at(offset, &mut buf) {
                    Ok(n) => reply.data_owned(buf, n),
                    Err(e) => reply.error(errno(&e)),
                }
            }
            Handle::Ctl {
                file: CtlFile::Trace,
                ..
            } => self.read_trace(size, reply),
            Handle::Ctl { content, .. } => {
                let start = (offset as usize).min(content.len());
                let end = (start + size as usize).min(content.len());
                reply.data(&content[start..end])
            }
            Handle::Dir { .. } | Handle::CtlDir(_) => reply.error(Errno::EISDIR),
        }
    }

    pub(crate) fn write(
        &self,
        req: &impl Caller,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: impl WriteReply,
    ) {
        self.counters.count(Op::write);
        let h = match self.handle(fh) {
            Ok(h) => h,
            Err(e) => return reply.error(e),
        };
        match &*h {
            Handle::File(f) => {
                // Only root-or-not matters here: no /proc read on the write path.
                let c = Cred::new(req.uid(), req.gid(), Vec::new());
                match self.vol().kill_suid_as(&c, ino.0) {
                    // A write's reply carries no attributes.
                    Ok(true) => self.set_id_cleared(ino),
                    Ok(false) => {}
                    Err(e) => return reply.error(errno(&e)),
                }
                match f.write_at(offset, data) {
                    Ok(n) => reply.written(n as u32),
                    Err(e) => reply.error(errno(&e)),
                }
            }
            Handle::Ctl { file, .. } => {
                let c = cred(req);
                if !c.is_root() && c.uid != self.owner_uid {
                    return reply.error(Errno::EACCES);
                }
                if *file == CtlFile::Sync {
                    // syncfs, which waits for writeback and a commit: off the request
                    // thread, as fsync is.
                    let (vol, n) = (self.vol().clone(), data.len() as u32);
                    return self.defer(reply.may_block(), move || match vol.sync() {
                        Ok(()) => reply.written(n),
                        Err(e) => reply.error(errno(&e)),
                    });
                }
                match ctl::write(self.vol(), *file, data) {
                    Ok(()) => reply.written(data.len() as u32),
                    Err(msg) => {
                        eprintln!("wbstack mount: {msg}");
                        reply.error(Errno::EINVAL)
                    }
                }
            }
            Handle::Dir { .. } | Handle::CtlDir(_) => reply.error(Errno::EISDIR),
        }
    }

    pub(crate) fn flush(
        &self,
        _req: &impl Caller,
        _ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: impl EmptyReply,
    ) {
        self.counters.count(Op::flush);
        match self.handle(fh).as_deref() {
            Ok(Handle::File(f)) => match f.flush_on_close() {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            },
            Ok(_) => reply.ok(),
            Err(e) => reply.error(*e),
        }
    }

    pub(crate) fn release(
        &self,
        _req: &impl Caller,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: impl EmptyReply,
    ) {
        self.counters.count(Op::release);
        let h = self.handles.write().remove(&fh.0);
        if let Some(h) = h {
            if let Handle::Ctl {
                file: CtlFile::Trace,
                ..
            } = &*h
            {
                if self.trace_readers.fetch_sub(1, Ordering::AcqRel) == 1 {
                    wbstack::trace::disable();
                }
            }
            // A waiter may still hold it (fsync in progress): the file closes when
            // the last holder lets go.
            if let Ok(Handle::File(f)) = Arc::try_unwrap(h).as_ref().map_err(|_| ()) {
                if let Err(e) = f.flush_on_close() {
                    eprintln!("wbstack mount: close: {e}");
                }
            }
        }
        reply.ok()
    }

    pub(crate) fn fsync(
        &self,
        _req: &impl Caller,
        _ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: impl EmptyReply,
    ) {
        self.counters.count(Op::fsync);
        let h = match self.file(fh) {
            Ok(h) => h,
            Err(e) => return reply.error(e),
        };
        self.defer(reply.may_block(), move || {
            let Handle::File(f) = &*h else {
                return reply.error(Errno::EBADF);
            };
            match if datasync { f.fdatasync() } else { f.fsync() } {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    pub(crate) fn opendir(
        &self,
        req: &impl Caller,
        ino: INodeNo,
        _flags: OpenFlags,
        reply: impl OpenReply,
    ) {
        self.counters.count(Op::opendir);
        if ino.0 == CTL_DIR_INO {
            let mut list = vec![
                (b".".to_vec(), CTL_DIR_INO, FileType::Directory),
                (b"..".to_vec(), 1, FileType::Directory),
            ];
            for (i, f) in ctl::files() {
                list.push((f.name().as_bytes().to_vec(), i, FileType::RegularFile));
            }
            let fh = self.add_handle(Handle::CtlDir(list));
            return reply.opened(FileHandle(fh), FopenFlags::empty());
        }
        if let Err(e) = self.vol().opendir_as(&cred(req), ino.0) {
            return reply.error(errno(&e));
        }
        let fh = self.add_handle(Handle::Dir { ino: ino.0 });
        reply.opened(FileHandle(fh), FopenFlags::empty());
    }

    pub(crate) fn readdir(
        &self,
        _req: &impl Caller,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: impl DirReply,
    ) {
        self.counters.count(Op::readdir);
        let h = match self.handle(fh) {
            Ok(h) => h,
            Err(e) => return reply.error(e),
        };
        match &*h {
            Handle::CtlDir(list) => {
                for (i, (name, ino, kind)) in list.iter().enumerate().skip(offset as usize) {
                    if reply.add(INodeNo(*ino), i as u64 + 1, *kind, OsStr::from_bytes(name)) {
                        break;
                    }
                }
                reply.ok()
            }
            &Handle::Dir { ino } => self.readdir_volume(ino, offset, reply),
            _ => reply.error(Errno::ENOTDIR),
        }
    }

    pub(crate) fn releasedir(
        &self,
        _req: &impl Caller,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: impl EmptyReply,
    ) {
        self.counters.count(Op::releasedir);
        self.handles.write().remove(&fh.0);
        reply.ok()
    }

    pub(crate) fn fsyncdir(
        &self,
        _req: &impl Caller,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: impl EmptyReply,
    ) {
        self.counters.count(Op::fsyncdir);
        // A directory's entries are metadata: durable once the journal commits
        // everything up to now (the same commit that fsync of a file waits for).
        let vol = self.vol().clone();
        self.defer(reply.may_block(), move || match vol.commit_now() {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        });
    }

    pub(crate) fn statfs(&self, _req: &impl Caller, _ino: INodeNo, reply: impl StatfsReply) {
        self.counters.count(Op::statfs);
        let s = self.vol().statfs();
        // Inodes are not preallocated: any free block could hold many.
        let ffree = s.free.saturating_mul(16);
        reply.statfs(StatfsOut {
            blocks: s.blocks,
            bfree: s.free,
            bavail: s.available,
            files: s.files + ffree,
            ffree,
            bsize: s.block_size as u32,
            namelen: 255,
            frsize: s.block_size as u32,
        });
    }

    pub(crate) fn setxattr(
        &self,
        req: &impl Caller,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: impl EmptyReply,
    ) {
        self.counters.count(Op::setxattr);
        if ctl::is_ctl(ino.0) {
            return reply.error(Errno::EPERM);
        }
        if let Err(e) = self.writable() {
            return reply.error(e);
        }
        let how = match flags {
            0 => XattrMode::Any,
            libc::XATTR_CREATE => XattrMode::Create,
            libc::XATTR_REPLACE => XattrMode::Replace,
            _ => return reply.error(Errno::EINVAL),
        };
        match self
            .vol()
            .setxattr_as(&cred(req), ino.0, name.as_bytes(), value, how)
        {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    pub(crate) fn getxattr(
        &self,
        req: &impl Caller,
        ino: INodeNo,
        name: &OsStr,
        size: u32,
        reply: impl XattrReply,
    ) {
        self.counters.count(Op::getxattr);
        if ctl::is_ctl(ino.0) {
            return reply.error(Errno::ENODATA);
        }
        match self.vol().getxattr_as(&cred(req), ino.0, name.as_bytes()) {
            Ok(v) => xattr_reply(reply, size, &v),
            Err(e) => reply.error(errno(&e)),
        }
    }

    pub(crate) fn listxattr(
        &self,
        req: &impl Caller,
        ino: INodeNo,
        size: u32,
        reply: impl XattrReply,
    ) {
        self.counters.count(Op::listxattr);
        if ctl::is_ctl(ino.0) {
            return xattr_reply(reply, size, &[]);
        }
        match self.vol().listxattr_as(&cred(req), ino.0) {
            Ok(names) => {
                let mut buf = Vec::new();
                for n in names {
                    buf.extend_from_slice(&n);
                    buf.push(0);
                }
                xattr_reply(reply, size, &buf)
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    pub(crate) fn removexattr(
        &self,
        req: &impl Caller,
        ino: INodeNo,
        name: &OsStr,
        reply: impl EmptyReply,
    ) {
        self.counters.count(Op::removexattr);
        if ctl::is_ctl(ino.0) {
            return reply.error(Errno::EPERM);
        }
        if let Err(e) = self.writable() {
            return reply.error(e);
        }
        match self
            .vol()
            .removexattr_as(&cred(req), ino.0, name.as_bytes())
        {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    pub(crate) fn access(
        &self,
        req: &impl Caller,
        ino: INodeNo,
        mask: AccessFlags,
        reply: impl EmptyReply,
    ) {
        self.counters.count(Op::access);
        if ctl::is_ctl(ino.0) {
            return reply.ok();
        }
        let bits = mask.bits() as u32 & 7;
        if bits & 2 != 0 && self.read_only {
            return reply.error(Errno::EROFS);
        }
        match self.vol().access_as(&cred(req), ino.0, bits) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    pub(crate) fn create(
        &self,
        req: &impl Caller,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: impl CreateReply,
    ) {
        self.counters.count(Op::create);
        if reserved(parent, name) || ctl::is_ctl(parent.0) {
            return reply.error(Errno::EEXIST);
        }
        if let Err(e) = self.writable() {
            return reply.error(e);
        }
        let o = open_options(flags);
        let mode = mode & 0o7777 & !umask;
        match self
            .vol()
            .create_as(&cred(req), parent.0, name.as_bytes(), mode, &o)
        {
            Ok((f, s)) => {
                let fh = self.add_handle(Handle::File(f));
                reply.created(
                    &TTL,
                    &attr(&s),
                    Generation(0),
                    FileHandle(fh),
                    Self::fopen_flags(&o),
                );
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    pub(crate) fn fallocate(
        &self,
        req: &impl Caller,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: impl EmptyReply,
    ) {
        self.counters.count(Op::fallocate);
        match self.file(fh).as_deref() {
            Ok(Handle::File(f)) => {
                // It changes the data, so it clears set-id bits as a write does. The
                // kernel has usually done so already with a SETATTR (file_modified),
                // and this finds nothing to clear; a kernel that did not is told, as
                // the reply carries no mode.
                let c = Cred::new(req.uid(), req.gid(), Vec::new());
                match self.vol().kill_suid_as(&c, ino.0) {
                    Ok(true) => self.set_id_cleared(ino),
                    Ok(false) => {}
                    Err(e) => return reply.error(errno(&e)),
                }
                match f.fallocate(mode, offset, length) {
                    Ok(()) => reply.ok(),
                    Err(e) => reply.error(errno(&e)),
                }
            }
            Ok(_) => reply.error(Errno::EBADF),
            Err(e) => reply.error(*e),
        }
    }

    pub(crate) fn lseek(
        &self,
        _req: &impl Caller,
        _ino: INodeNo,
        fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: impl LseekReply,
    ) {
        self.counters.count(Op::lseek);
        let h = self.file(fh);
        let Ok(Handle::File(f)) = h.as_deref() else {
            return reply.error(Errno::EBADF);
        };
        let hole = match whence {
            libc::SEEK_DATA => false,
            libc::SEEK_HOLE => true,
            _ => return reply.error(Errno::EINVAL),
        };
        if offset < 0 {
            return reply.error(Errno::ENXIO);
        }
        match f.seek_data(offset as u64, hole) {
            Ok(o) => reply.offset(o as i64),
            Err(e) => reply.error(errno(&e)),
        }
    }
}

impl WbFs {
    /// The capabilities and limits asked for at INIT.
    fn init_config(&self, config: &mut KernelConfig) -> std::io::Result<()> {
        // Each wished-for capability is optional: a kernel without one still mounts.
        for cap in [
            InitFlags::FUSE_PARALLEL_DIROPS,
            InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP,
            InitFlags::FUSE_ATOMIC_O_TRUNC,
            InitFlags::FUSE_BIG_WRITES,
            InitFlags::FUSE_MAX_PAGES,
        ] {
            if config.add_capabilities(cap).is_err() {
                eprintln!("wbstack mount: the kernel lacks {cap:?}; going on without it");
            }
        }
        if self.uring.want {
            // Granted only when the fuse module's enable_uring is on.
            let granted = config
                .add_capabilities(InitFlags::FUSE_OVER_IO_URING)
                .is_ok();
            self.uring.granted.store(granted, Ordering::Relaxed);
        }
        if let Err(max) = config.set_max_write(MAX_PAYLOAD as u32) {
            // The kernel's ceiling is taken instead.
            let _clamped = config.set_max_write(max);
        }
        if let Err(max) = config.set_max_background(64) {
            let _clamped = config.set_max_background(max);
        }
        Ok(())
    }

    /// The end of the session: unmount the volume (every request has been answered).
    fn destroy(&mut self) {
        let r = match self.vol.take().map(Arc::try_unwrap) {
            Some(Ok(vol)) => {
                self.handles.write().clear();
                vol.unmount()
            }
            Some(Err(vol)) => {
                // Handles still hold it (a waiter finishing): sync, then drop them.
                let r = vol.sync();
                self.handles.write().clear();
                match Arc::try_unwrap(vol) {
                    Ok(v) => r.and(v.unmount()),
                    Err(_) => r,
                }
            }
            None => Ok(()),
        };
        *self.unmounted.lock() = Some(r);
    }
}

/// Runs a handler so that a panic in it (a bug) answers its request EIO and leaves
/// the thread serving: the reply it owned is dropped as the panic unwinds (fuser's
/// replies send EIO when dropped unsent; a ring's waiting thread sees no reply).
/// Uncaught, the panic would end a request thread (a /dev/fuse mount has two) or a
/// ring thread with its entry held. A panic while holding the volume's state lock has
/// already failed the volume (`SpinMutex::with_on_panic`).
pub(crate) fn contained(op: &dyn std::fmt::Display, f: impl FnOnce()) {
    if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        eprintln!("wbstack mount: a handler panicked serving FUSE {op}: {msg}");
    }
}

/// What fuser's session serves: the handlers, shared with the io_uring threads.
pub struct Served {
    pub fs: Arc<WbFs>,
    pub rings: Arc<Mutex<Option<crate::uring::Rings>>>,
}

impl fuser::Filesystem for Served {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        self.fs.init_config(config)
    }

    fn destroy(&mut self) {
        // The rings' threads end with the connection (ENOTCONN); the volume is
        // unmounted only once none of them can call into it.
        if let Some(r) = self.rings.lock().take() {
            r.join();
        }
        match Arc::get_mut(&mut self.fs) {
            Some(fs) => fs.destroy(),
            None => {
                debug_assert!(false, "a handler outlived the session");
                eprintln!("wbstack mount: a request thread outlived the session; syncing only");
                let r = self.fs.vol().sync();
                *self.fs.unmounted.lock() = Some(r);
            }
        }
    }

    fn lookup(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        contained(&"lookup", || {
            WbFs::lookup(&self.fs, req, parent, name, reply)
        })
    }

    fn getattr(&self, req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        contained(&"getattr", || WbFs::getattr(&self.fs, req, ino, fh, reply))
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        crtime: Option<SystemTime>,
        chgtime: Option<SystemTime>,
        bkuptime: Option<SystemTime>,
        flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        contained(&"setattr", || {
            WbFs::setattr(
                &self.fs, req, ino, mode, uid, gid, size, atime, mtime, ctime, fh, crtime, chgtime,
                bkuptime, flags, reply,
            )
        })
    }

    fn readlink(&self, req: &Request, ino: INodeNo, reply: ReplyData) {
        contained(&"readlink", || WbFs::readlink(&self.fs, req, ino, reply))
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        contained(&"mknod", || {
            WbFs::mknod(&self.fs, req, parent, name, mode, umask, rdev, reply)
        })
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        contained(&"mkdir", || {
            WbFs::mkdir(&self.fs, req, parent, name, mode, umask, reply)
        })
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        contained(&"unlink", || {
            WbFs::unlink(&self.fs, req, parent, name, reply)
        })
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        contained(&"rmdir", || WbFs::rmdir(&self.fs, req, parent, name, reply))
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        contained(&"symlink", || {
            WbFs::symlink(&self.fs, req, parent, link_name, target, reply)
        })
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: FuseRenameFlags,
        reply: ReplyEmpty,
    ) {
        contained(&"rename", || {
            WbFs::rename(
                &self.fs, req, parent, name, newparent, newname, flags, reply,
            )
        })
    }

    fn link(
        &self,
        req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        contained(&"link", || {
            WbFs::link(&self.fs, req, ino, newparent, newname, reply)
        })
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        contained(&"open", || WbFs::open(&self.fs, req, ino, flags, reply))
    }

    fn read(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        flags: OpenFlags,
        lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        contained(&"read", || {
            WbFs::read(
                &self.fs, req, ino, fh, offset, size, flags, lock_owner, reply,
            )
        })
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        flags: OpenFlags,
        lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        contained(&"write", || {
            WbFs::write(
                &self.fs,
                req,
                ino,
                fh,
                offset,
                data,
                write_flags,
                flags,
                lock_owner,
                reply,
            )
        })
    }

    fn flush(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        contained(&"flush", || {
            WbFs::flush(&self.fs, req, ino, fh, lock_owner, reply)
        })
    }

    fn release(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        flags: OpenFlags,
        lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        contained(&"release", || {
            WbFs::release(&self.fs, req, ino, fh, flags, lock_owner, _flush, reply)
        })
    }

    fn fsync(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        contained(&"fsync", || {
            WbFs::fsync(&self.fs, req, ino, fh, datasync, reply)
        })
    }

    fn opendir(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        contained(&"opendir", || {
            WbFs::opendir(&self.fs, req, ino, flags, reply)
        })
    }

    fn readdir(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        reply: ReplyDirectory,
    ) {
        contained(&"readdir", || {
            WbFs::readdir(&self.fs, req, ino, fh, offset, reply)
        })
    }

    fn releasedir(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        contained(&"releasedir", || {
            WbFs::releasedir(&self.fs, req, ino, fh, flags, reply)
        })
    }

    fn fsyncdir(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        contained(&"fsyncdir", || {
            WbFs::fsyncdir(&self.fs, req, ino, fh, datasync, reply)
        })
    }

    fn statfs(&self, req: &Request, ino: INodeNo, reply: ReplyStatfs) {
        contained(&"statfs", || WbFs::statfs(&self.fs, req, ino, reply))
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        position: u32,
        reply: ReplyEmpty,
    ) {
        contained(&"setxattr", || {
            WbFs::setxattr(&self.fs, req, ino, name, value, flags, position, reply)
        })
    }

    fn getxattr(&self, req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        contained(&"getxattr", || {
            WbFs::getxattr(&self.fs, req, ino, name, size, reply)
        })
    }

    fn listxattr(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        contained(&"listxattr", || {
            WbFs::listxattr(&self.fs, req, ino, size, reply)
        })
    }

    fn removexattr(&self, req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        contained(&"removexattr", || {
            WbFs::removexattr(&self.fs, req, ino, name, reply)
        })
    }

    fn access(&self, req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        contained(&"access", || WbFs::access(&self.fs, req, ino, mask, reply))
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        contained(&"create", || {
            WbFs::create(&self.fs, req, parent, name, mode, umask, flags, reply)
        })
    }

    fn fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        contained(&"fallocate", || {
            WbFs::fallocate(&self.fs, req, ino, fh, offset, length, mode, reply)
        })
    }

    fn lseek(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        contained(&"lseek", || {
            WbFs::lseek(&self.fs, req, ino, fh, offset, whence, reply)
        })
    }
}

fn xattr_reply(reply: impl XattrReply, size: u32, v: &[u8]) {
    if size == 0 {
        reply.size(v.len() as u32)
    } else if (size as usize) < v.len() {
        reply.error(Errno::ERANGE)
    } else {
        reply.data(v)
    }
}

impl WbFs {
    fn fopen_flags(_o: &OpenOptions) -> FopenFlags {
        // Reads and writes go to wbstack's cache (DIRECT_IO). No FLUSH at close(2):
        // flush-on-close (auto_da_alloc) is ext4's ext4_release_file, at the last
        // close of the open file, which is FUSE's RELEASE; a FLUSH would only add a
        // synchronous round trip to every close.
        FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_NOFLUSH
    }

    /// mknod and mkdir: `mode` carries the file type, the umask already applied.
    fn make_node(
        &self,
        req: &impl Caller,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        rdev: u32,
        reply: impl EntryReply,
    ) {
        if reserved(parent, name) || ctl::is_ctl(parent.0) {
            return reply.error(Errno::EEXIST);
        }
        if let Err(e) = self.writable() {
            return reply.error(e);
        }
        let r = self
            .vol()
            .mknod_as(&cred(req), parent.0, name.as_bytes(), mode, rdev);
        Self::reply_entry(reply, r)
    }

    fn remove(
        &self,
        req: &impl Caller,
        parent: INodeNo,
        name: &OsStr,
        dir: bool,
        reply: impl EmptyReply,
    ) {
        if reserved(parent, name) || ctl::is_ctl(parent.0) {
            return reply.error(Errno::EPERM);
        }
        if let Err(e) = self.writable() {
            return reply.error(e);
        }
        match self
            .vol()
            .unlink_as(&cred(req), parent.0, name.as_bytes(), dir)
        {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn open_ctl(&self, req: &impl Caller, ino: u64, o: &OpenOptions, reply: impl OpenReply) {
        let Some(file) = ctl::by_ino(ino) else {
            return reply.error(Errno::EISDIR);
        };
        if o.write {
            let c = cred(req);
            if !file.writable() {
                return reply.error(Errno::EACCES);
            }
            if !c.is_root() && c.uid != self.owner_uid {
                return reply.error(Errno::EACCES);
            }
        }
        if file == CtlFile::Trace && self.trace_readers.fetch_add(1, Ordering::AcqRel) == 0 {
            wbstack::trace::enable(1 << 16);
        }
        let content = match ctl::content(self.vol(), &self.counters, file) {
            Ok(c) => c,
            Err(msg) => {
                eprintln!("wbstack mount: {msg}");
                return reply.error(Errno::EIO);
            }
        };
        let fh = self.add_handle(Handle::Ctl { file, content });
        let mut flags = FopenFlags::FOPEN_DIRECT_IO;
        if file == CtlFile::Trace {
            flags |= FopenFlags::FOPEN_NONSEEKABLE | FopenFlags::FOPEN_STREAM;
        }
        reply.opened(FileHandle(fh), flags);
    }

    /// Streaming read of the trace ring: waits (on a waiter thread) until events
    /// arrive, so `cat trace` follows the volume as trace_pipe does.
    fn read_trace(&self, size: u32, reply: impl DataReply) {
        self.defer(reply.may_block(), move || {
            let deadline = std::time::Instant::now() + Duration::from_secs(1);
            loop {
                let events = wbstack::trace::take_up_to(size as usize);
                if !events.is_empty() || std::time::Instant::now() >= deadline {
                    // An empty read would end `cat`: a keep-alive newline instead.
                    let out = if events.is_empty() {
                        b"\n".to_vec()
                    } else {
                        events
                    };
                    return reply.data(&out);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
    }
}
