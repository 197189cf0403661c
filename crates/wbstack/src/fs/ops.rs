//! Namespace and attribute operations by inode number, as the VFS calls a filesystem
//! (and so as the FUSE front end does): every one takes the caller's credentials and
//! asks `fs::perm` before changing anything. The path-based API of `volume.rs` is the
//! library's own and runs as root.

use super::dir::DirPageEntry;
use super::error::{FsError, FsResult};
use super::format::{InodeKind, Record, XATTR_NAME_MAX, XATTR_SIZE_MAX};
use super::perm::{self, Cred, MAY_EXEC, MAY_READ, MAY_WRITE};
use super::volume::{File, NewNode, OpenOptions, Stat, Volume};

/// ext4's EXT4_LINK_MAX.
pub const LINK_MAX: u32 = 65000;
/// Bytes of extended attributes one inode may hold (names and values).
pub const XATTR_INODE_MAX: usize = 64 * 1024;

/// renameat2's flags.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RenameFlags {
    /// RENAME_NOREPLACE: fail with EEXIST if the target exists.
    pub noreplace: bool,
    /// RENAME_EXCHANGE: swap the two names atomically; both must exist.
    pub exchange: bool,
}

/// A timestamp setattr may set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimeSet {
    Now,
    At(u64),
}

/// What setattr changes (None = leave as is).
#[derive(Clone, Debug, Default)]
pub struct SetAttrIno {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    /// The size change comes through a file opened for writing (ftruncate): its
    /// permission was checked at open.
    pub size_by_open_file: bool,
    pub atime: Option<TimeSet>,
    pub mtime: Option<TimeSet>,
}

/// setxattr's flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XattrMode {
    /// Create or replace.
    Any,
    /// XATTR_CREATE: fail with EEXIST if it exists.
    Create,
    /// XATTR_REPLACE: fail with ENODATA if it does not.
    Replace,
}

fn name_str(name: &[u8]) -> String {
    String::from_utf8_lossy(name).into_owned()
}

impl Volume {
    /// getattr.
    pub fn getattr(&self, ino: u64) -> FsResult<Stat> {
        self.vol.faulting(|| self.stat_ino(ino))
    }

    /// lookup: `name` in directory `dir`, which the caller must be able to search.
    pub fn lookup_as(&self, c: &Cred, dir: u64, name: &[u8]) -> FsResult<Stat> {
        self.vol.faulting(|| {
            if name.len() > super::meta::NAME_MAX {
                super::volume::check_name(name)?;
            }
            let st = self.vol.st.lock();
            perm::check(c, st.inode(dir)?, MAY_EXEC, "lookup")?;
            let ino = st.lookup(dir, name)?;
            self.vol.stat_of(&st, ino)
        })
    }

    /// access(2): `mask` of MAY_READ | MAY_WRITE | MAY_EXEC (0 asks existence only).
    pub fn access_as(&self, c: &Cred, ino: u64, mask: u32) -> FsResult<()> {
        self.vol.faulting(|| {
            let st = self.vol.st.lock();
            let i = st.inode(ino)?;
            if mask == 0 {
                return Ok(());
            }
            perm::check(c, i, mask, "access")
        })
    }

    /// mknod and mkdir: a file, directory, FIFO, socket or device node (mode holds the
    /// type bits and the permissions, umask already applied).
    pub fn mknod_as(
        &self,
        c: &Cred,
        dir: u64,
        name: &[u8],
        mode: u32,
        rdev: u32,
    ) -> FsResult<Stat> {
        self.vol.faulting(|| {
            let kind = InodeKind::from_mode(mode).ok_or_else(|| {
                FsError::Invalid(format!("mknod of file type {:#o}", mode & 0o170000))
            })?;
            if kind == InodeKind::Symlink {
                return Err(FsError::Invalid("mknod cannot make a symlink".into()));
            }
            if matches!(kind, InodeKind::CharDev | InodeKind::BlockDev) && !c.is_root() {
                return Err(FsError::NotPermitted("mknod of a device node".into()));
            }
            let rdev = if matches!(kind, InodeKind::CharDev | InodeKind::BlockDev) {
                rdev
            } else {
                0
            };
            let mut st = self.vol.st.lock();
            perm::may_change_dir(c, st.inode(dir)?, "create")?;
            let owner = perm::new_inode_owner(c, st.inode(dir)?, kind, mode);
            let node = NewNode {
                kind,
                owner,
                target: None,
                rdev,
            };
            let ino = self.vol.create_node_as(&mut st, dir, name, &node)?;
            self.vol.stat_of(&st, ino)
        })
    }

    pub fn symlink_as(&self, c: &Cred, dir: u64, name: &[u8], target: &[u8]) -> FsResult<Stat> {
        self.vol.faulting(|| {
            let mut st = self.vol.st.lock();
            perm::may_change_dir(c, st.inode(dir)?, "symlink")?;
            let gid = perm::new_inode_owner(c, st.inode(dir)?, InodeKind::Symlink, 0o777).1;
            let node = NewNode {
                kind: InodeKind::Symlink,
                owner: (c.uid, gid, 0o777),
                target: Some(target),
                rdev: 0,
            };
            let ino = self.vol.create_node_as(&mut st, dir, name, &node)?;
            self.vol.stat_of(&st, ino)
        })
    }

    pub fn readlink_ino(&self, ino: u64) -> FsResult<Vec<u8>> {
        self.vol.faulting(|| {
            let st = self.vol.st.lock();
            let i = st.inode(ino)?;
            if i.kind != InodeKind::Symlink {
                return Err(FsError::Invalid(format!("inode {ino} is not a symlink")));
            }
            Ok(i.target.clone())
        })
    }

    /// link: a new name `name` in `dir` for inode `ino`.
    pub fn link_as(&self, c: &Cred, ino: u64, dir: u64, name: &[u8]) -> FsResult<Stat> {
        self.vol.faulting(|| {
            super::volume::check_name(name)?;
            let mut st = self.vol.st.lock();
            st.check_writable()?;
            perm::may_change_dir(c, st.inode(dir)?, "link")?;
            let i = st.inode(ino)?;
            if i.is_dir() {
                return Err(FsError::NotPermitted(
                    "hard links to directories are not allowed".into(),
                ));
            }
            if i.links >= LINK_MAX {
                return Err(FsError::TooManyLinks(format!("inode {ino}")));
            }
            if i.links == 0 {
                // An open, unlinked file cannot get a name back (no O_TMPFILE here).
                return Err(FsError::NotFound(format!("inode {ino}")));
            }
            if matches!(st.find(dir, name), Ok(Some(_))) {
                return Err(FsError::Exists(name_str(name)));
            }
            self.vol.check_meta_room(&st, 64 + name.len() as u64)?;
            let now = self.vol.now();
            st.log_link(dir, name, ino, now)?;
            st.stamp(dir, now, true);
            st.stamp(ino, now, false);
            self.vol.stat_of(&st, ino)
        })
    }

    /// unlink (rmdir when `dir_only`), with the sticky-directory rule.
    pub fn unlink_as(&self, c: &Cred, dir: u64, name: &[u8], dir_only: bool) -> FsResult<()> {
        self.vol.faulting(|| {
            {
                let st = self.vol.st.lock();
                let ino = st.lookup(dir, name)?;
                perm::may_delete(c, st.inode(dir)?, st.inode(ino)?, "unlink")?;
            }
            self.vol.unlink_at(dir, name, dir_only)
        })
    }

    /// renameat2.
    pub fn rename_as(
        &self,
        c: &Cred,
        od: u64,
        on: &[u8],
        nd: u64,
        nn: &[u8],
        flags: RenameFlags,
    ) -> FsResult<()> {
        self.vol.faulting(|| {
            if flags.noreplace && flags.exchange {
                return Err(FsError::Invalid(
                    "RENAME_NOREPLACE with RENAME_EXCHANGE".into(),
                ));
            }
            {
                let st = self.vol.st.lock();
                let src = st.lookup(od, on)?;
                let si = st.inode(src)?;
                perm::may_delete(c, st.inode(od)?, si, "rename")?;
                let victim = st.find(nd, nn)?;
                match victim {
                    Some(v) => {
                        if flags.noreplace {
                            return Err(FsError::Exists(name_str(nn)));
                        }
                        perm::may_delete(c, st.inode(nd)?, st.inode(v)?, "rename")?;
                        if flags.exchange && od != nd && st.inode(v)?.is_dir() {
                            perm::check(c, st.inode(v)?, MAY_WRITE, "rename")?;
                        }
                    }
                    None if flags.exchange => return Err(FsError::NotFound(name_str(nn))),
                    None => perm::may_change_dir(c, st.inode(nd)?, "rename")?,
                }
                // A directory changing parent rewrites its "..": write permission on it.
                if si.is_dir() && od != nd {
                    perm::check(c, si, MAY_WRITE, "rename")?;
                }
            }
            if flags.exchange {
                self.exchange(od, on, nd, nn)
            } else {
                self.vol.rename_at(od, on, nd, nn)
            }
        })
    }

    /// RENAME_EXCHANGE: both entries swap inodes in one transaction.
    fn exchange(&self, od: u64, on: &[u8], nd: u64, nn: &[u8]) -> FsResult<()> {
        let mut st = self.vol.st.lock();
        st.check_writable()?;
        let a = st.lookup(od, on)?;
        let b = st.lookup(nd, nn)?;
        if a == b {
            return Ok(());
        }
        // Neither directory may end up inside itself.
        for (moved, into) in [(a, nd), (b, od)] {
            if st.inode(moved)?.is_dir() {
                st.check_not_into_itself(moved, into)?;
            }
        }
        let now = self.vol.now();
        st.log_unlink(od, on, a, now)?;
        st.log_unlink(nd, nn, b, now)?;
        st.log_link(od, on, b, now)?;
        st.log_link(nd, nn, a, now)?;
        for ino in [od, nd] {
            st.stamp(ino, now, true);
        }
        for ino in [a, b] {
            st.stamp(ino, now, false);
        }
        Ok(())
    }

    /// opendir: `ino` is a directory `c` may read. What a walk of it then returns is
    /// `readdir_page`'s.
    pub fn opendir_as(&self, c: &Cred, ino: u64) -> FsResult<()> {
        self.vol.faulting(|| {
            let st = self.vol.st.lock();
            perm::check(c, st.dir(ino)?, MAY_READ, "readdir")
        })
    }

    /// Up to `max` entries of directory `ino` after readdir cookie `cookie` (0: from
    /// the start; "." and ".." are the caller's, at cookies 1 and 2), in cookie order,
    /// names not necessarily UTF-8. A walk resumed from each page's last cookie returns
    /// every entry that exists throughout it exactly once, whatever is created and
    /// removed meanwhile, and costs O(log n) a page: nothing is kept between pages
    /// (`fs::dir`). Permission is opendir's (`opendir_as`), as POSIX checks it at open.
    pub fn readdir_page(&self, ino: u64, cookie: u64, max: usize) -> FsResult<Vec<DirPageEntry>> {
        self.vol.faulting(|| {
            let st = self.vol.st.lock();
            st.meta.clear_misses();
            let page = st
                .dir(ino)?
                .entries
                .page(cookie, max, |c| st.kind_of(c))
                .map_err(|cold| super::inodes::note_dir_miss(ino, cold))?;
            st.missed()?;
            Ok(page)
        })
    }

    /// The parent of directory `ino` (for "..").
    pub fn parent_of(&self, ino: u64) -> FsResult<u64> {
        self.vol.faulting(|| {
            let st = self.vol.st.lock();
            let i = st.inode(ino)?;
            Ok(if i.is_dir() {
                i.parent.max(super::meta::ROOT_INO)
            } else {
                ino
            })
        })
    }

    /// setattr: chmod, chown, utimensat and truncate, each checked by `fs::perm`, all
    /// of them before anything changes: a refused setattr changes nothing (a truncation
    /// came first, and a chmod refused after it left the file cut). A mode that only
    /// clears set-id bits as a write by `c` would passes on `c`'s write permission (the
    /// kernel's own stripping; a chmod(2) doing just that from a non-owner who may
    /// write passes too, where Linux refuses it: the two look alike here).
    pub fn setattr_as(&self, c: &Cred, ino: u64, a: &SetAttrIno) -> FsResult<Stat> {
        self.vol.faulting(|| {
            let now = self.vol.now();
            // What the checks before a truncation decided: applied after it as decided,
            // not checked again (a change between must not fail the call with the file
            // already cut).
            let mut decided = None;
            if let Some(size) = a.size {
                let m = {
                    let mut st = self.vol.st.lock();
                    st.check_writable()?;
                    let i = st.inode(ino)?;
                    match i.kind {
                        InodeKind::Dir => return Err(FsError::IsDir(format!("inode {ino}"))),
                        InodeKind::File => {}
                        _ => return Err(FsError::Invalid(format!("truncate of inode {ino}"))),
                    }
                    if !a.size_by_open_file {
                        perm::check(c, i, MAY_WRITE, "truncate")?;
                    }
                    // The kernel sends the set-id bits it strips with a truncation as
                    // a mode of its own (ATTR_KILL_SUID, no handle_killpriv): the
                    // truncation's permission covers it, as ATTR_FORCE does for the VFS.
                    let forced_mode = a
                        .mode
                        .is_some_and(|m| Some(m & 0o7777) == perm::kill_suid(c, i));
                    decided = Some(attr_checks(c, i, a, forced_mode)?);
                    self.kill_priv_locked(&mut st, c, ino, now)?;
                    self.vol.mapping(&st, ino)?
                };
                if size > i64::MAX as u64 {
                    return Err(FsError::Invalid("size past the largest file size".into()));
                }
                self.vol.truncate(ino, &m, size)?;
            }
            let mut st = self.vol.st.lock();
            st.check_writable()?;
            let mode = match decided {
                Some(mode) => mode,
                None => {
                    let i = st.inode(ino)?;
                    // The kernel strips set-id bits itself before a change of the data
                    // that is neither a write nor a truncation (fallocate,
                    // copy_file_range: file_modified) and sends the mode less them, alone,
                    // as from the caller. Taken as that (ATTR_FORCE) from a caller who may
                    // write the file, not as a chmod, which only the owner may do: such a
                    // caller may clear them anyway (a truncation to the file's own size).
                    let forced_mode = a.uid.is_none()
                        && a.gid.is_none()
                        && a.mode
                            .is_some_and(|m| Some(m & 0o7777) == perm::kill_suid(c, i))
                        && perm::check(c, i, MAY_WRITE, "chmod").is_ok();
                    attr_checks(c, i, a, forced_mode)?
                }
            };
            let changed = mode.is_some() || a.uid.is_some() || a.gid.is_some();
            let times = a.atime.is_some() || a.mtime.is_some();
            // chown drops a file's capabilities too (ATTR_KILL_PRIV in chown_common).
            if (a.uid.is_some() || a.gid.is_some()) && has_caps(st.inode(ino)?) {
                self.drop_caps_locked(&mut st, ino, now)?;
            }
            if changed || times {
                let wall = now + st.wall_offset_ns;
                let resolve = |t: TimeSet| match t {
                    TimeSet::Now => wall,
                    TimeSet::At(ns) => ns,
                };
                let i = st
                    .meta
                    .find_mut(ino)?
                    .ok_or_else(|| FsError::NotFound(format!("inode {ino}")))?;
                if let Some(m) = mode {
                    i.mode = m;
                }
                if let Some(u) = a.uid {
                    i.uid = u;
                }
                if let Some(g) = a.gid {
                    i.gid = g;
                }
                if let Some(t) = a.atime {
                    i.atime_ns = resolve(t);
                }
                if let Some(t) = a.mtime {
                    i.mtime_ns = resolve(t);
                }
                i.ctime_ns = wall;
                st.txn_inodes.insert(ino);
                // Mode and ownership are not "just timestamps": fdatasync must not skip them.
                st.touch(&[ino], !changed, now);
            }
            self.vol.stat_of(&st, ino)
        })
    }

    fn set_mode_locked(
        &self,
        st: &mut super::volume::State,
        ino: u64,
        mode: u32,
        now: u64,
    ) -> FsResult<()> {
        let wall = now + st.wall_offset_ns;
        let i = st
            .meta
            .find_mut(ino)?
            .ok_or_else(|| FsError::NotFound(format!("inode {ino}")))?;
        i.mode = mode;
        i.ctime_ns = wall;
        st.txn_inodes.insert(ino);
        st.touch(&[ino], false, now);
        Ok(())
    }

    /// A write by `c` drops the file's privileges, as file_remove_privs does: set-user-id
    /// (and group-executable set-group-id) unless `c` is root (should_remove_suid), and
    /// file capabilities whoever writes (security.capability, cap_inode_killpriv: a
    /// program rewritten by anyone must not keep the privileges granted to the old
    /// one). Whether anything changed (a FUSE server then tells the kernel, whose
    /// cached mode a write's reply does not refresh).
    pub fn kill_suid_as(&self, c: &Cred, ino: u64) -> FsResult<bool> {
        self.vol.faulting(|| {
            let mut st = self.vol.st.lock();
            let now = self.vol.now();
            self.kill_priv_locked(&mut st, c, ino, now)
        })
    }

    /// `kill_suid_as` in a hold of `st`.
    fn kill_priv_locked(
        &self,
        st: &mut super::volume::State,
        c: &Cred,
        ino: u64,
        now: u64,
    ) -> FsResult<bool> {
        let i = st.inode(ino)?;
        let mode = perm::kill_suid(c, i);
        let caps = has_caps(i);
        if mode.is_none() && !caps {
            return Ok(false);
        }
        st.check_writable()?;
        if let Some(mode) = mode {
            self.set_mode_locked(st, ino, mode, now)?;
        }
        if caps {
            self.drop_caps_locked(st, ino, now)?;
        }
        Ok(true)
    }

    /// Remove the file's capabilities (cap_inode_killpriv).
    fn drop_caps_locked(&self, st: &mut super::volume::State, ino: u64, now: u64) -> FsResult<()> {
        st.log(
            Record::RemoveXattr {
                ino,
                name: XATTR_CAPS.to_vec(),
            },
            &[ino],
            now,
        )?;
        st.stamp(ino, now, false);
        Ok(())
    }

    /// open of an existing inode, with its access checked.
    pub fn open_as(&self, c: &Cred, ino: u64, o: &OpenOptions) -> FsResult<File> {
        Ok(self.open_reporting_as(c, ino, o)?.0)
    }

    /// `open_as`, and whether it cleared set-id bits: an O_TRUNC is a truncation, and
    /// one by `c` clears them as a write does (the VFS's do_truncate on open). A FUSE
    /// server tells the kernel then, since an OPEN's reply carries no mode.
    pub fn open_reporting_as(&self, c: &Cred, ino: u64, o: &OpenOptions) -> FsResult<(File, bool)> {
        self.vol.faulting(|| {
            let mut cleared = false;
            {
                let mut st = self.vol.st.lock();
                let i = st.inode(ino)?;
                let mut mask = 0;
                if o.read {
                    mask |= MAY_READ;
                }
                if o.write || o.truncate {
                    mask |= MAY_WRITE;
                }
                perm::check(c, i, mask, "open")?;
                // In the hold that checked the permission, so only a caller that may
                // truncate clears them.
                if o.truncate {
                    cleared = self.kill_priv_locked(&mut st, c, ino, self.vol.now())?;
                }
            }
            Ok((self.vol.open_ino(ino, o, false)?, cleared))
        })
    }

    /// create: a new regular file `name` in `dir`, opened (O_CREAT; with
    /// `o.exclusive`, an existing name fails with EEXIST).
    pub fn create_as(
        &self,
        c: &Cred,
        dir: u64,
        name: &[u8],
        mode: u32,
        o: &OpenOptions,
    ) -> FsResult<(File, Stat)> {
        self.vol.faulting(|| {
            enum Found {
                Created(u64, Stat),
                Existing(u64),
            }
            let found = {
                let mut st = self.vol.st.lock();
                match st.find(dir, name)? {
                    Some(_) if o.exclusive => return Err(FsError::Exists(name_str(name))),
                    Some(ino) => Found::Existing(ino),
                    None => {
                        perm::may_change_dir(c, st.inode(dir)?, "create")?;
                        let owner = perm::new_inode_owner(c, st.inode(dir)?, InodeKind::File, mode);
                        let ino =
                            self.vol
                                .create_absent(&mut st, dir, name, &NewNode::file(owner))?;
                        // Stated and opened in the hold that made it (one hold a
                        // create); the open last, so no error leaves it counted.
                        let s = self.vol.stat_of(&st, ino)?;
                        self.vol.open_created(&mut st, ino, o)?;
                        Found::Created(ino, s)
                    }
                }
            };
            match found {
                Found::Created(ino, s) => {
                    let m = self.vol.created_mapping(ino);
                    Ok((self.vol.open_file(ino, m, o, true)?, s))
                }
                Found::Existing(ino) => {
                    // Stated after the open: a mode its O_TRUNC changed is in the
                    // reply (a FUSE CREATE's carries the attributes).
                    let f = self.open_as(c, ino, o)?;
                    let s = f.stat()?;
                    Ok((f, s))
                }
            }
        })
    }

    // ---- extended attributes ---------------------------------------------------------

    pub fn getxattr_as(&self, c: &Cred, ino: u64, name: &[u8]) -> FsResult<Vec<u8>> {
        self.vol.faulting(|| {
            let st = self.vol.st.lock();
            let i = st.inode(ino)?;
            perm::xattr(c, i, name, false)?;
            i.xattrs
                .get(name)
                .cloned()
                .ok_or_else(|| FsError::NoData(name_str(name)))
        })
    }

    /// The names the caller may see (trusted.* only for root).
    pub fn listxattr_as(&self, c: &Cred, ino: u64) -> FsResult<Vec<Vec<u8>>> {
        self.vol.faulting(|| {
            let st = self.vol.st.lock();
            let i = st.inode(ino)?;
            Ok(i.xattrs
                .keys()
                .filter(|n| c.is_root() || !n.starts_with(b"trusted."))
                .cloned()
                .collect())
        })
    }

    pub fn setxattr_as(
        &self,
        c: &Cred,
        ino: u64,
        name: &[u8],
        value: &[u8],
        how: XattrMode,
    ) -> FsResult<()> {
        self.vol.faulting(|| {
            if name.is_empty() || name.len() > XATTR_NAME_MAX {
                return Err(FsError::Invalid(format!(
                    "an extended attribute name of {} bytes",
                    name.len()
                )));
            }
            if value.len() > XATTR_SIZE_MAX {
                return Err(FsError::TooBig(format!(
                    "an extended attribute value of {} bytes",
                    value.len()
                )));
            }
            let mut st = self.vol.st.lock();
            st.check_writable()?;
            let i = st.inode(ino)?;
            perm::xattr(c, i, name, true)?;
            if name == b"system.posix_acl_access" {
                return self.set_access_acl(&mut st, c, ino, value);
            }
            if name == b"system.posix_acl_default" {
                // Never inherited by what is created in the directory: stored, it
                // would show a policy nothing applies (a filesystem mounted noacl).
                return Err(FsError::NotSupported(
                    "default POSIX ACLs (permissions here are the mode's alone)".into(),
                ));
            }
            let old = i.xattrs.get(name);
            match (how, old) {
                (XattrMode::Create, Some(_)) => return Err(FsError::Exists(name_str(name))),
                (XattrMode::Replace, None) => return Err(FsError::NoData(name_str(name))),
                _ => {}
            }
            let used: usize = i
                .xattrs
                .iter()
                .filter(|(n, _)| n.as_slice() != name)
                .map(|(n, v)| n.len() + v.len())
                .sum();
            if used + name.len() + value.len() > XATTR_INODE_MAX {
                return Err(FsError::NoSpace);
            }
            self.vol
                .check_meta_room(&st, (name.len() + value.len() + 16) as u64)?;
            let now = self.vol.now();
            st.log(
                Record::SetXattr {
                    ino,
                    name: name.to_vec(),
                    value: value.to_vec(),
                },
                &[ino],
                now,
            )?;
            st.stamp(ino, now, false);
            Ok(())
        })
    }

    /// An access ACL with only the owner, group and other entries is exactly a mode
    /// (posix_acl_equiv_mode) and sets it. One with named users or groups is refused
    /// (EOPNOTSUPP, as on a filesystem mounted noacl): permissions here, the kernel's
    /// (no FUSE_POSIX_ACL) and this volume's own, are the mode's alone, so a stored
    /// one would show entries nothing enforces (`setfacl -m u:bob:--- f` leaving bob
    /// his read, a mask widening the group's bits).
    fn set_access_acl(
        &self,
        st: &mut super::volume::State,
        c: &Cred,
        ino: u64,
        value: &[u8],
    ) -> FsResult<()> {
        let bad = || FsError::Invalid("malformed POSIX ACL".into());
        if value.len() < 4 || !(value.len() - 4).is_multiple_of(8) {
            return Err(bad());
        }
        if u32::from_le_bytes(value[..4].try_into().map_err(|_| bad())?) != 2 {
            return Err(FsError::NotSupported("POSIX ACL version".into()));
        }
        let (mut user, mut group, mut mask, mut other) = (None, None, None, None);
        let mut named = false;
        for e in value[4..].chunks_exact(8) {
            let tag = u16::from_le_bytes([e[0], e[1]]);
            let perm = u32::from(u16::from_le_bytes([e[2], e[3]]) & 7);
            match tag {
                0x01 => user = Some(perm),
                0x04 => group = Some(perm),
                0x10 => mask = Some(perm),
                0x20 => other = Some(perm),
                0x02 | 0x08 => named = true,
                _ => return Err(bad()),
            }
        }
        let (Some(u), Some(g), Some(o)) = (user, group, other) else {
            return Err(bad());
        };
        if named && mask.is_none() {
            return Err(bad());
        }
        if named {
            return Err(FsError::NotSupported(
                "POSIX ACLs with named users or groups (permissions here are the mode's alone)"
                    .into(),
            ));
        }
        let i = st.inode(ino)?;
        let bits = (u << 6) | (mask.unwrap_or(g) << 3) | o;
        let mode = perm::chmod(c, i, (i.mode & !0o777) | bits)?;
        let now = self.vol.now();
        let key = b"system.posix_acl_access".to_vec();
        // One stored by an older version, now replaced by a mode.
        if i.xattrs.contains_key(&key) {
            st.log(Record::RemoveXattr { ino, name: key }, &[ino], now)?;
        }
        self.set_mode_locked(st, ino, mode, now)
    }

    pub fn removexattr_as(&self, c: &Cred, ino: u64, name: &[u8]) -> FsResult<()> {
        self.vol.faulting(|| {
            let mut st = self.vol.st.lock();
            st.check_writable()?;
            let i = st.inode(ino)?;
            perm::xattr(c, i, name, true)?;
            if !i.xattrs.contains_key(name) {
                return Err(FsError::NoData(name_str(name)));
            }
            let now = self.vol.now();
            st.log(
                Record::RemoveXattr {
                    ino,
                    name: name.to_vec(),
                },
                &[ino],
                now,
            )?;
            st.stamp(ino, now, false);
            Ok(())
        })
    }
}

/// File capabilities: dropped by any write, truncation or chown (`kill_suid_as`).
const XATTR_CAPS: &[u8] = b"security.capability";

/// A regular file with capabilities to drop.
fn has_caps(i: &super::meta::Inode) -> bool {
    i.kind == InodeKind::File && i.xattrs.contains_key(XATTR_CAPS)
}

/// fallocate's modes (FALLOC_FL_*).
pub const FALLOC_FL_KEEP_SIZE: i32 = 0x01;
pub const FALLOC_FL_PUNCH_HOLE: i32 = 0x02;
pub const FALLOC_FL_ZERO_RANGE: i32 = 0x10;

impl File {
    /// fallocate. Mode 0 and KEEP_SIZE check that the range's unwritten blocks fit in
    /// the free space (ENOSPC otherwise) and, for mode 0, extend the size; blocks are
    /// still allocated at writeback (delayed allocation), so a later write can in
    /// principle meet ENOSPC if others filled the device meanwhile. PUNCH_HOLE and
    /// ZERO_RANGE write zeros through the page cache: the range reads as zeros at
    /// once and after a crash once synced, though its blocks stay allocated.
    pub fn fallocate(&self, mode: i32, off: u64, len: u64) -> FsResult<()> {
        let known = FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE;
        if mode & !known != 0 {
            return Err(FsError::NotSupported(format!("fallocate mode {mode:#x}")));
        }
        if len == 0 {
            return Err(FsError::Invalid("fallocate of length 0".into()));
        }
        let end = off
            .checked_add(len)
            .filter(|e| *e <= i64::MAX as u64)
            .ok_or_else(|| FsError::TooBig("fallocate past the largest file size".into()))?;
        let keep = mode & FALLOC_FL_KEEP_SIZE != 0;
        if mode & FALLOC_FL_PUNCH_HOLE != 0 {
            if !keep || mode & FALLOC_FL_ZERO_RANGE != 0 {
                return Err(FsError::NotSupported(
                    "PUNCH_HOLE needs KEEP_SIZE and excludes ZERO_RANGE".into(),
                ));
            }
            let size = self.size();
            if off < size {
                self.write_zeros(off, end.min(size))?;
            }
            return Ok(());
        }
        if mode & FALLOC_FL_ZERO_RANGE != 0 {
            let size = self.size();
            let stop = if keep { end.min(size) } else { end };
            if off < stop {
                self.write_zeros(off, stop)?;
            }
            return Ok(());
        }
        let blocks = len.div_ceil(super::format::BLOCK_SIZE as u64);
        if blocks > self.volume_available_blocks() {
            return Err(FsError::NoSpace);
        }
        if !keep && end > self.size() {
            self.set_len(end)?;
        }
        Ok(())
    }

    fn write_zeros(&self, from: u64, to: u64) -> FsResult<()> {
        const CHUNK: u64 = 1 << 20;
        let zeros = vec![0u8; CHUNK.min(to - from) as usize];
        let mut pos = from;
        while pos < to {
            let n = (to - pos).min(CHUNK) as usize;
            // A short count (a later page failed) is retried, meeting the error.
            pos += self.write_at_raw(pos, &zeros[..n])? as u64;
        }
        Ok(())
    }

    /// lseek's SEEK_DATA and SEEK_HOLE in their simplest correct form: the whole
    /// file is data and the only hole is at its end (what lseek(2) allows).
    pub fn seek_data(&self, off: u64, hole: bool) -> FsResult<u64> {
        let size = self.size();
        if off >= size {
            return Err(FsError::NoSuchOffset);
        }
        Ok(if hole { size } else { off })
    }
}

/// The checks of a setattr's mode, owner and times against inode `i`, and the mode it
/// sets. `forced_mode`: the mode is the kernel's own stripping of set-id bits with a
/// truncation, checked by the truncation's permission. Times set to now with a
/// truncation through a file open for writing need no more than that open did (the
/// VFS's do_truncate).
fn attr_checks(
    c: &Cred,
    i: &super::meta::Inode,
    a: &SetAttrIno,
    forced_mode: bool,
) -> FsResult<Option<u32>> {
    let mut mode = None;
    if let Some(m) = a.mode {
        mode = Some(if forced_mode {
            m & 0o7777
        } else {
            perm::chmod(c, i, m)?
        });
    }
    if a.uid.is_some() || a.gid.is_some() {
        let mut after = i.clone();
        if let Some(m) = mode {
            after.mode = m;
        }
        mode = Some(perm::chown(c, &after, a.uid, a.gid)?);
    }
    let explicit =
        matches!(a.atime, Some(TimeSet::At(_))) || matches!(a.mtime, Some(TimeSet::At(_)));
    let by_truncation = a.size.is_some() && a.size_by_open_file && !explicit;
    if (a.atime.is_some() || a.mtime.is_some()) && !by_truncation {
        perm::set_times(c, i, explicit)?;
    }
    Ok(mode)
}
