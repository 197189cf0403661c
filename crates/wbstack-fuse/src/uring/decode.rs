//! Requests as the kernel lays them into a ring entry, decoded into calls of the
//! `WbFs` handlers (fuser's parser is private to it, so the rings need their own).
//! The body is what /dev/fuse would carry after `fuse_in_header`: the first argument
//! (in the entry's op_in) then the rest (the payload).

use super::encode::{DirOut, RingReply};
use crate::reply::{Caller, EmptyReply, Fail};
use crate::server::WbFs;
use fuser::{
    AccessFlags, Errno, FileHandle, INodeNo, LockOwner, OpenFlags, RenameFlags, TimeOrNow,
    WriteFlags,
};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub(super) mod op {
    pub(crate) const LOOKUP: u32 = 1;
    pub(crate) const GETATTR: u32 = 3;
    pub(crate) const SETATTR: u32 = 4;
    pub(crate) const READLINK: u32 = 5;
    pub(crate) const SYMLINK: u32 = 6;
    pub(crate) const MKNOD: u32 = 8;
    pub(crate) const MKDIR: u32 = 9;
    pub(crate) const UNLINK: u32 = 10;
    pub(crate) const RMDIR: u32 = 11;
    pub(crate) const RENAME: u32 = 12;
    pub(crate) const LINK: u32 = 13;
    pub(crate) const OPEN: u32 = 14;
    pub(crate) const READ: u32 = 15;
    pub(crate) const WRITE: u32 = 16;
    pub(crate) const STATFS: u32 = 17;
    pub(crate) const RELEASE: u32 = 18;
    pub(crate) const FSYNC: u32 = 20;
    pub(crate) const SETXATTR: u32 = 21;
    pub(crate) const GETXATTR: u32 = 22;
    pub(crate) const LISTXATTR: u32 = 23;
    pub(crate) const REMOVEXATTR: u32 = 24;
    pub(crate) const FLUSH: u32 = 25;
    pub(crate) const OPENDIR: u32 = 27;
    pub(crate) const READDIR: u32 = 28;
    pub(crate) const RELEASEDIR: u32 = 29;
    pub(crate) const FSYNCDIR: u32 = 30;
    pub(crate) const ACCESS: u32 = 34;
    pub(crate) const CREATE: u32 = 35;
    pub(crate) const DESTROY: u32 = 38;
    pub(crate) const FALLOCATE: u32 = 43;
    pub(crate) const RENAME2: u32 = 45;
    pub(crate) const LSEEK: u32 = 46;
}

/// Requests the kernel may send with any uid (fuser's list for `SessionACL::Owner`).
pub(super) fn nobodys(opcode: u32) -> bool {
    matches!(
        opcode,
        op::DESTROY
            | op::READ
            | op::READDIR
            | op::WRITE
            | op::FSYNC
            | op::FSYNCDIR
            | op::RELEASE
            | op::RELEASEDIR
    )
}

pub(super) struct RingCaller {
    pub(super) uid: u32,
    pub(super) gid: u32,
    pub(super) pid: u32,
}

impl Caller for RingCaller {
    fn uid(&self) -> u32 {
        self.uid
    }
    fn gid(&self) -> u32 {
        self.gid
    }
    fn pid(&self) -> u32 {
        self.pid
    }
}

/// A request's body as /dev/fuse would carry it: its first argument (the fixed part,
/// in the entry's op_in) then the rest (names, data: the payload). Read in order; no
/// field straddles the two.
pub(super) struct Body<'a> {
    pub(super) parts: [&'a [u8]; 2],
    pub(super) part: usize,
    pub(super) at: usize,
}

impl<'a> Body<'a> {
    pub(super) fn new(head: &'a [u8], tail: &'a [u8]) -> Body<'a> {
        Body {
            parts: [head, tail],
            part: 0,
            at: 0,
        }
    }
    pub(super) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.part == 0 && self.at == self.parts[0].len() {
            (self.part, self.at) = (1, 0);
        }
        let v = self.parts.get(self.part)?.get(self.at..self.at + n)?;
        self.at += n;
        Some(v)
    }
    pub(super) fn u32(&mut self) -> Option<u32> {
        Some(u32::from_ne_bytes(self.take(4)?.try_into().ok()?))
    }
    pub(super) fn u64(&mut self) -> Option<u64> {
        Some(u64::from_ne_bytes(self.take(8)?.try_into().ok()?))
    }
    pub(super) fn name(&mut self) -> Option<&'a OsStr> {
        let _ = self.take(0)?;
        let rest = self.parts[self.part].get(self.at..)?;
        let end = rest.iter().position(|&c| c == 0)?;
        self.at += end + 1;
        Some(OsStr::from_bytes(&rest[..end]))
    }
    pub(super) fn rest(&mut self) -> Option<&'a [u8]> {
        let _ = self.take(0)?;
        let r = self.parts[self.part].get(self.at..)?;
        self.at += r.len();
        Some(r)
    }
}

/// A `fuse_setattr_in` time: its seconds are a signed `time_t` carried in a u64 (a
/// time before 1970 is negative), as fuser reads them for /dev/fuse; None if it is out
/// of `SystemTime`'s range (answered EINVAL).
pub(super) fn time_of(secs: u64, nsecs: u32) -> Option<SystemTime> {
    let secs = secs as i64;
    let whole = match secs >= 0 {
        true => UNIX_EPOCH.checked_add(Duration::from_secs(secs.unsigned_abs())),
        false => UNIX_EPOCH.checked_sub(Duration::from_secs(secs.unsigned_abs())),
    };
    whole?.checked_add(Duration::from_nanos(u64::from(nsecs)))
}

/// Decodes one request (its fixed part and names as /dev/fuse carries them) and calls
/// its handler. A body too short for its opcode is answered EINVAL, an opcode the
/// server does not serve ENOSYS (as fuser's defaults answer).
pub(super) fn dispatch(
    fs: &WbFs,
    c: &RingCaller,
    opcode: u32,
    ino: INodeNo,
    mut b: Body<'_>,
    r: RingReply,
) {
    if decode(fs, c, opcode, ino, &mut b, &r).is_none() {
        r.error(Errno::EINVAL);
    }
}

/// None: the body was too short; the reply is still unsent and goes back to the caller.
pub(super) fn decode(
    fs: &WbFs,
    c: &RingCaller,
    opcode: u32,
    ino: INodeNo,
    b: &mut Body<'_>,
    r: &RingReply,
) -> Option<()> {
    let r = || r.clone();
    match opcode {
        op::LOOKUP => {
            let name = b.name()?;
            fs.lookup(c, ino, name, r());
        }
        op::GETATTR => {
            let flags = b.u32()?;
            let _dummy = b.u32()?;
            let fh = b.u64()?;
            let fh = (flags & 1 != 0).then_some(FileHandle(fh));
            fs.getattr(c, ino, fh, r());
        }
        op::SETATTR => {
            let valid = b.u32()?;
            let _pad = b.u32()?;
            let fh = b.u64()?;
            let size = b.u64()?;
            let _lock_owner = b.u64()?;
            let atime = b.u64()?;
            let mtime = b.u64()?;
            let _ctime = b.u64()?;
            let atimensec = b.u32()?;
            let mtimensec = b.u32()?;
            let _ctimensec = b.u32()?;
            let mode = b.u32()?;
            let _unused4 = b.u32()?;
            let uid = b.u32()?;
            let gid = b.u32()?;
            let set = |bit: u32| valid & bit != 0;
            let time = |now: bool, s: u64, ns: u32| match now {
                true => Some(TimeOrNow::Now),
                false => time_of(s, ns).map(TimeOrNow::SpecificTime),
            };
            let atime = if set(16) {
                Some(time(set(128), atime, atimensec)?)
            } else {
                None
            };
            let mtime = if set(32) {
                Some(time(set(256), mtime, mtimensec)?)
            } else {
                None
            };
            // FATTR_MODE 1, UID 2, GID 4, SIZE 8, ATIME 16, MTIME 32, FH 64,
            // ATIME_NOW 128, MTIME_NOW 256.
            fs.setattr(
                c,
                ino,
                set(1).then_some(mode),
                set(2).then_some(uid),
                set(4).then_some(gid),
                set(8).then_some(size),
                atime,
                mtime,
                None::<SystemTime>,
                set(64).then_some(FileHandle(fh)),
                None,
                None,
                None,
                None,
                r(),
            );
        }
        op::READLINK => fs.readlink(c, ino, r()),
        op::SYMLINK => {
            let name = b.name()?;
            let target = b.name()?;
            fs.symlink(c, ino, name, Path::new(target), r());
        }
        op::MKNOD => {
            let mode = b.u32()?;
            let rdev = b.u32()?;
            let umask = b.u32()?;
            let _pad = b.u32()?;
            let name = b.name()?;
            fs.mknod(c, ino, name, mode, umask, rdev, r());
        }
        op::MKDIR => {
            let mode = b.u32()?;
            let umask = b.u32()?;
            let name = b.name()?;
            fs.mkdir(c, ino, name, mode, umask, r());
        }
        op::UNLINK => fs.unlink(c, ino, b.name()?, r()),
        op::RMDIR => fs.rmdir(c, ino, b.name()?, r()),
        op::RENAME | op::RENAME2 => {
            let newdir = b.u64()?;
            let flags = if opcode == op::RENAME2 {
                let f = b.u32()?;
                let _pad = b.u32()?;
                f
            } else {
                0
            };
            let name = b.name()?;
            let newname = b.name()?;
            let flags = RenameFlags::from_bits_retain(flags);
            fs.rename(c, ino, name, INodeNo(newdir), newname, flags, r());
        }
        op::LINK => {
            let old = b.u64()?;
            let name = b.name()?;
            fs.link(c, INodeNo(old), ino, name, r());
        }
        op::OPEN | op::OPENDIR => {
            let flags = b.u32()?;
            let _open_flags = b.u32()?;
            if opcode == op::OPEN {
                fs.open(c, ino, OpenFlags(flags as i32), r());
            } else {
                fs.opendir(c, ino, OpenFlags(flags as i32), r());
            }
        }
        op::READ | op::READDIR => {
            let fh = FileHandle(b.u64()?);
            let offset = b.u64()?;
            let size = b.u32()?;
            let _read_flags = b.u32()?;
            let lock_owner = b.u64()?;
            let flags = b.u32()?;
            if opcode == op::READ {
                let lo = Some(LockOwner(lock_owner));
                fs.read(c, ino, fh, offset, size, OpenFlags(flags as i32), lo, r());
            } else {
                let dir = DirOut::new(r(), size as usize);
                fs.readdir(c, ino, fh, offset, dir);
            }
        }
        op::WRITE => {
            let fh = FileHandle(b.u64()?);
            let offset = b.u64()?;
            let size = b.u32()? as usize;
            let write_flags = b.u32()?;
            let lock_owner = b.u64()?;
            let flags = b.u32()?;
            let _pad = b.u32()?;
            let data = b.rest()?.get(..size)?;
            fs.write(
                c,
                ino,
                fh,
                offset,
                data,
                WriteFlags::from_bits_retain(write_flags),
                OpenFlags(flags as i32),
                Some(LockOwner(lock_owner)),
                r(),
            );
        }
        op::STATFS => fs.statfs(c, ino, r()),
        op::RELEASE | op::RELEASEDIR => {
            let fh = FileHandle(b.u64()?);
            let flags = OpenFlags(b.u32()? as i32);
            let release_flags = b.u32()?;
            let lock_owner = b.u64()?;
            if opcode == op::RELEASE {
                // FUSE_RELEASE_FLUSH 1, FUSE_RELEASE_FLOCK_UNLOCK 2
                let flush = release_flags & 1 != 0;
                fs.release(c, ino, fh, flags, Some(LockOwner(lock_owner)), flush, r());
            } else {
                fs.releasedir(c, ino, fh, flags, r());
            }
        }
        op::FSYNC | op::FSYNCDIR => {
            let fh = FileHandle(b.u64()?);
            let datasync = b.u32()? & 1 != 0;
            if opcode == op::FSYNC {
                fs.fsync(c, ino, fh, datasync, r());
            } else {
                fs.fsyncdir(c, ino, fh, datasync, r());
            }
        }
        op::SETXATTR => {
            let size = b.u32()? as usize;
            let flags = b.u32()? as i32;
            let name = b.name()?;
            let value = b.rest()?.get(..size)?;
            fs.setxattr(c, ino, name, value, flags, 0, r());
        }
        op::GETXATTR => {
            let size = b.u32()?;
            let _pad = b.u32()?;
            fs.getxattr(c, ino, b.name()?, size, r());
        }
        op::LISTXATTR => {
            let size = b.u32()?;
            fs.listxattr(c, ino, size, r());
        }
        op::REMOVEXATTR => fs.removexattr(c, ino, b.name()?, r()),
        op::FLUSH => {
            let fh = FileHandle(b.u64()?);
            let _unused = b.u32()?;
            let _pad = b.u32()?;
            let lock_owner = LockOwner(b.u64()?);
            fs.flush(c, ino, fh, lock_owner, r());
        }
        op::ACCESS => {
            let mask = b.u32()? as i32;
            fs.access(c, ino, AccessFlags::from_bits_retain(mask), r());
        }
        op::CREATE => {
            let flags = b.u32()? as i32;
            let mode = b.u32()?;
            let umask = b.u32()?;
            let _open_flags = b.u32()?;
            let name = b.name()?;
            fs.create(c, ino, name, mode, umask, flags, r());
        }
        op::FALLOCATE => {
            let fh = FileHandle(b.u64()?);
            let offset = b.u64()?;
            let length = b.u64()?;
            let mode = b.u32()? as i32;
            fs.fallocate(c, ino, fh, offset, length, mode, r());
        }
        op::LSEEK => {
            let fh = FileHandle(b.u64()?);
            let offset = b.u64()? as i64;
            let whence = b.u32()? as i32;
            fs.lseek(c, ino, fh, offset, whence, r());
        }
        // The connection's end: the volume unmounts when fuser's session ends.
        op::DESTROY => EmptyReply::ok(r()),
        _ => r().error(Errno::ENOSYS),
    }
    Some(())
}
