//! Who may do what: the kernel's permission rules (generic_permission,
//! inode_owner_or_capable, may_delete's sticky rule, setattr_prepare, the set-id bits
//! that chmod, chown and write clear), decided here and nowhere else. The inode-level
//! operations (`fs/ops.rs`) call these under the state lock, so a decision and the
//! change it allows see the same inode.

use super::error::{FsError, FsResult};
use super::format::InodeKind;
use super::meta::Inode;

pub const MAY_EXEC: u32 = 1;
pub const MAY_WRITE: u32 = 2;
pub const MAY_READ: u32 = 4;

const S_ISUID: u32 = 0o4000;
const S_ISGID: u32 = 0o2000;
const S_ISVTX: u32 = 0o1000;
const S_IXGRP: u32 = 0o010;

/// The caller's credentials: fsuid, fsgid and supplementary groups. Root (uid 0) has
/// the capabilities the checks below consult (CAP_DAC_OVERRIDE, CAP_FOWNER,
/// CAP_CHOWN, CAP_FSETID).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cred {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

impl Cred {
    /// The library's own callers: every check passes as for root.
    pub fn root() -> Cred {
        Cred::default()
    }

    pub fn new(uid: u32, gid: u32, groups: Vec<u32>) -> Cred {
        Cred { uid, gid, groups }
    }

    pub fn is_root(&self) -> bool {
        self.uid == 0
    }

    pub fn in_group(&self, gid: u32) -> bool {
        self.gid == gid || self.groups.contains(&gid)
    }

    fn owns(&self, i: &Inode) -> bool {
        self.is_root() || self.uid == i.uid
    }
}

fn denied(what: &str) -> FsError {
    FsError::Access(what.to_string())
}

/// generic_permission: `mask` of MAY_READ | MAY_WRITE | MAY_EXEC against the owner,
/// group or other bits; root passes all but executing a file no one may execute.
pub fn check(c: &Cred, i: &Inode, mask: u32, what: &str) -> FsResult<()> {
    if c.is_root() {
        if mask & MAY_EXEC != 0 && i.kind != InodeKind::Dir && i.mode & 0o111 == 0 {
            return Err(denied(what));
        }
        return Ok(());
    }
    let bits = if c.uid == i.uid {
        i.mode >> 6
    } else if c.in_group(i.gid) {
        i.mode >> 3
    } else {
        i.mode
    } & 7;
    if bits & mask == mask {
        Ok(())
    } else {
        Err(denied(what))
    }
}

/// Adding or removing an entry of directory `d`: write and search on it.
pub fn may_change_dir(c: &Cred, d: &Inode, what: &str) -> FsResult<()> {
    check(c, d, MAY_WRITE | MAY_EXEC, what)
}

/// may_delete's sticky rule: in a sticky directory only the file's owner, the
/// directory's owner or root may remove or rename an entry.
pub fn may_delete(c: &Cred, d: &Inode, victim: &Inode, what: &str) -> FsResult<()> {
    may_change_dir(c, d, what)?;
    if d.mode & S_ISVTX != 0 && !c.is_root() && c.uid != d.uid && c.uid != victim.uid {
        return Err(FsError::NotPermitted(format!(
            "{what}: the directory is sticky and the file is not yours"
        )));
    }
    Ok(())
}

/// The mode and group a new inode gets in directory `d` (the caller applied the
/// umask): a set-group-id directory passes its group on, and its set-group-id bit to
/// new subdirectories.
pub fn new_inode_owner(c: &Cred, d: &Inode, kind: InodeKind, mode: u32) -> (u32, u32, u32) {
    let mut mode = mode & 0o7777;
    let mut gid = c.gid;
    if d.mode & S_ISGID != 0 {
        gid = d.gid;
        if kind == InodeKind::Dir {
            mode |= S_ISGID;
        }
    } else if mode & S_ISGID != 0 && kind != InodeKind::Dir && !c.in_group(gid) && !c.is_root() {
        // inode_init_owner: no set-group-id file for a group the creator is not in.
        mode &= !S_ISGID;
    }
    (c.uid, gid, mode)
}

/// chmod: only the owner or root; a non-member's set-group-id bit on a file is
/// dropped silently, as setattr_prepare does.
pub fn chmod(c: &Cred, i: &Inode, mode: u32) -> FsResult<u32> {
    if !c.owns(i) {
        return Err(FsError::NotPermitted("chmod: not the owner".into()));
    }
    let mut mode = mode & 0o7777;
    if !c.is_root() && !c.in_group(i.gid) {
        mode &= !S_ISGID;
    }
    Ok(mode)
}

/// chown: only root changes the owner (or anyone to the same owner); the owner may
/// change the group to one they belong to. Returns the mode after the change: a
/// non-directory loses set-user-id, and set-group-id when it is group-executable
/// (ATTR_KILL_SUID / ATTR_KILL_SGID, applied for root too).
pub fn chown(c: &Cred, i: &Inode, uid: Option<u32>, gid: Option<u32>) -> FsResult<u32> {
    let uid_change = uid.is_some_and(|u| u != i.uid);
    if !c.is_root() {
        if uid_change {
            return Err(FsError::NotPermitted(
                "chown: only root changes the owner".into(),
            ));
        }
        if gid.is_some() && (c.uid != i.uid || gid.is_some_and(|g| !c.in_group(g))) {
            return Err(FsError::NotPermitted(
                "chown: only the owner, to a group they are in".into(),
            ));
        }
        if uid.is_some() && c.uid != i.uid {
            return Err(FsError::NotPermitted("chown: not the owner".into()));
        }
    }
    let mut mode = i.mode;
    if i.kind != InodeKind::Dir && (uid.is_some() || gid.is_some()) {
        mode &= !S_ISUID;
        if mode & S_IXGRP != 0 {
            mode &= !S_ISGID;
        }
    }
    Ok(mode)
}

/// utimensat: explicit times need the owner or root; "now" also whoever may write.
pub fn set_times(c: &Cred, i: &Inode, explicit: bool) -> FsResult<()> {
    if c.owns(i) {
        return Ok(());
    }
    if explicit {
        return Err(FsError::NotPermitted("utimes: not the owner".into()));
    }
    check(c, i, MAY_WRITE, "utimes")
}

/// The mode a write (or truncate) by `c` leaves: should_remove_suid clears
/// set-user-id, and set-group-id when group-executable, unless the writer is root.
/// None when nothing changes.
pub fn kill_suid(c: &Cred, i: &Inode) -> Option<u32> {
    if c.is_root() || i.kind != InodeKind::File {
        return None;
    }
    let mut mode = i.mode;
    mode &= !S_ISUID;
    if mode & S_IXGRP != 0 {
        mode &= !S_ISGID;
    }
    (mode != i.mode).then_some(mode)
}

/// Extended attributes: user.* follows the file's read/write permission and exists
/// only on files and directories; trusted.* is root's; security.* is set by root
/// only and system.posix_acl_* by the owner, both readable by anyone who may look
/// at the inode.
pub fn xattr(c: &Cred, i: &Inode, name: &[u8], write: bool) -> FsResult<()> {
    let mask = if write { MAY_WRITE } else { MAY_READ };
    if name.starts_with(b"user.") {
        if !matches!(i.kind, InodeKind::File | InodeKind::Dir) {
            return Err(if write {
                FsError::NotPermitted("user.* attributes only on files and directories".into())
            } else {
                FsError::NoData("user.* attributes only on files and directories".into())
            });
        }
        if write && i.kind == InodeKind::Dir && i.mode & S_ISVTX != 0 && !c.owns(i) {
            return Err(FsError::NotPermitted("sticky directory".into()));
        }
        return check(c, i, mask, "xattr");
    }
    if name.starts_with(b"trusted.") {
        return if c.is_root() {
            Ok(())
        } else {
            Err(FsError::NotPermitted(
                "trusted.* attributes are root's".into(),
            ))
        };
    }
    if name.starts_with(b"system.posix_acl_") {
        if write && !c.owns(i) {
            return Err(FsError::NotPermitted(
                "setting an ACL: not the owner".into(),
            ));
        }
        return Ok(());
    }
    if name.starts_with(b"security.") {
        // cap_inode_setxattr / cap_inode_removexattr: CAP_SYS_ADMIN, or CAP_SETFCAP
        // for file capabilities; a user who could write the file must not grant a
        // program privileges (nor take them away).
        return if write && !c.is_root() {
            Err(FsError::NotPermitted(
                "security.* attributes are set by root".into(),
            ))
        } else {
            Ok(())
        };
    }
    Err(FsError::NotSupported(format!(
        "extended attribute namespace of {:?}",
        String::from_utf8_lossy(name)
    )))
}
