//! Path resolution (the kernel's `fs/namei.c`): a path's components walked from the
//! root, symlinks followed, under `st`; or, for the directories of a path the dentry
//! cache holds, before `st` is taken (`fs::dcache`), confirmed under it with one load.

use super::dcache::Walked;
use super::error::{FsError, FsResult};
use super::format::InodeKind;
use super::meta::ROOT_INO;
use super::volume::{check_name, State, Vol};
use std::sync::Arc;

/// Symlinks followed while resolving one path (the kernel's MAXSYMLINKS).
pub(super) const MAX_SYMLINKS: u32 = 40;

/// A path, its directories walked through the dentry cache before `st` is taken
/// (`Vol::path_walk`): the resolutions below confirm that walk under `st` instead of
/// walking again.
pub(super) struct PathWalk<'p> {
    pub path: &'p str,
    /// The components of its directories (all but the last).
    dirs: Vec<&'p [u8]>,
    /// The last component; None for the root.
    last: Option<&'p [u8]>,
    walked: Option<Walked>,
}

impl std::fmt::Display for PathWalk<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.path)
    }
}

/// What an open that may create finds at a path (`Vol::resolve_for_create`).
pub(super) enum Resolved {
    Found(u64),
    /// `name` is not in `dir`.
    Missing {
        dir: u64,
        name: Vec<u8>,
    },
    /// `name` is a symlink to nothing: the create is tried at the link's name (and
    /// fails, as the name exists).
    Dangling {
        name: Vec<u8>,
    },
}

/// A last component a create may make: not "..", a valid name.
fn creatable(path: &str, last: &[u8]) -> FsResult<()> {
    if last == b".." {
        return Err(ends_in_dotdot(path));
    }
    check_name(last)
}

fn ends_in_dotdot(path: &str) -> FsError {
    FsError::Invalid(format!("{path:?} ends in \"..\""))
}

/// Split a path into its components (empty ones and "." dropped).
pub(super) fn components(path: &str) -> Vec<&[u8]> {
    path.split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .map(str::as_bytes)
        .collect()
}

impl Vol {
    /// `path`, its directories walked through the dentry cache: without `st`, so
    /// call it before taking `st`.
    pub(super) fn path_walk<'p>(&self, path: &'p str) -> PathWalk<'p> {
        let mut dirs = components(path);
        let last = dirs.pop();
        let walked = last.and_then(|_| self.dcache.walk(ROOT_INO, &dirs));
        PathWalk {
            path,
            dirs,
            last,
            walked,
        }
    }

    /// Under `st`: the directory holding the path's last component: the dentry
    /// cache's walk when no directory entry went away since it was made, else a walk
    /// under `st`.
    fn walk_dirs(&self, st: &State, p: &PathWalk, budget: &mut u32) -> FsResult<u64> {
        match p.walked {
            Some(w) if self.dcache.still_valid(&w) => Ok(w.dir),
            _ => self.walk(st, ROOT_INO, &p.dirs, budget, p.path),
        }
    }

    /// unlink(2) or rmdir(2) of a path: its directory found (the dentry cache's walk
    /// confirmed, or a walk) in the hold of `st` that removes the name, so the name
    /// removed is the one the path names when it goes, whatever was renamed between
    /// the walk and the lock.
    pub(super) fn unlink_path(&self, p: &PathWalk, rmdir: bool) -> FsResult<()> {
        let mut st = self.st.lock();
        let (dir, name) = self.resolve_parent(&st, p)?;
        self.unlink_in(&mut st, dir, &name, rmdir)
    }

    /// rename(2) of two paths, both directories found in the hold of `st` that moves
    /// the name (as `unlink_path`).
    pub(super) fn rename_paths(self: &Arc<Self>, from: &PathWalk, to: &PathWalk) -> FsResult<()> {
        let st = self.st.lock();
        let (od, on) = self.resolve_parent(&st, from)?;
        let (nd, nn) = self.resolve_parent(&st, to)?;
        self.rename_in(st, od, &on, nd, &nn)
    }

    /// Resolve a path to (parent directory, last name) without looking the last name up.
    pub(super) fn resolve_parent(&self, st: &State, p: &PathWalk) -> FsResult<(u64, Vec<u8>)> {
        let Some(last) = p.last else {
            return Err(FsError::Invalid(format!("{:?} names the root", p.path)));
        };
        let mut budget = MAX_SYMLINKS;
        let dir = self.walk_dirs(st, p, &mut budget)?;
        creatable(p.path, last)?;
        Ok((dir, last.to_vec()))
    }

    /// `resolve` (following the last component) for an open that may create: a name
    /// the path's directory lacks comes back with that directory, from the same walk,
    /// where it would be made (as `resolve_parent` gives it).
    pub(super) fn resolve_for_create(&self, st: &State, p: &PathWalk) -> FsResult<Resolved> {
        let Some(last) = p.last else {
            return Ok(Resolved::Found(ROOT_INO));
        };
        let path = p.path;
        let mut budget = MAX_SYMLINKS;
        let dir = match self.walk_dirs(st, p, &mut budget) {
            // As resolve_parent reports it: a path ending in ".." before a missing
            // directory on the way.
            Err(FsError::NotFound(_)) if last == b".." => return Err(ends_in_dotdot(path)),
            r => r?,
        };
        match st.find(dir, last)? {
            None => {
                creatable(path, last)?;
                Ok(Resolved::Missing {
                    dir,
                    name: last.to_vec(),
                })
            }
            Some(ino) => match self.follow(st, dir, ino, &mut budget, path) {
                Err(FsError::NotFound(_)) => {
                    creatable(path, last)?;
                    Ok(Resolved::Dangling {
                        name: last.to_vec(),
                    })
                }
                r => r.map(Resolved::Found),
            },
        }
    }

    /// Follow `comps` from `start`, following every symlink met (each costs budget).
    /// The directories it passes through by name go into the dentry cache.
    pub(super) fn walk(
        &self,
        st: &State,
        start: u64,
        comps: &[&[u8]],
        budget: &mut u32,
        path: &str,
    ) -> FsResult<u64> {
        let mut cur = start;
        for c in comps {
            let next = st.lookup(cur, c).map_err(|e| match e {
                FsError::NotFound(_) => FsError::NotFound(path.to_string()),
                FsError::NotDir(_) => FsError::NotDir(path.to_string()),
                e => e,
            })?;
            let resolved = self.follow(st, cur, next, budget, path)?;
            self.cache_dentry(st, cur, c, next);
            cur = resolved;
        }
        Ok(cur)
    }

    /// Under `st`: `name` in `dir`, just looked up, names `ino`; cached if `ino` is a
    /// directory (`fs::dcache` holds nothing else).
    pub(super) fn cache_dentry(&self, st: &State, dir: u64, name: &[u8], ino: u64) {
        if *name != *b".." && st.meta.resident(ino).is_some_and(|i| i.is_dir()) {
            self.dcache.insert(dir, name, ino);
        }
    }

    /// If `ino` (found in `dir`) is a symlink, resolve it.
    pub(super) fn follow(
        &self,
        st: &State,
        dir: u64,
        ino: u64,
        budget: &mut u32,
        path: &str,
    ) -> FsResult<u64> {
        let i = st.inode(ino)?;
        if i.kind != InodeKind::Symlink {
            return Ok(ino);
        }
        if *budget == 0 {
            return Err(FsError::Loop(path.to_string()));
        }
        *budget -= 1;
        let target = String::from_utf8_lossy(&i.target).into_owned();
        let start = if target.starts_with('/') {
            ROOT_INO
        } else {
            dir
        };
        let comps = components(&target);
        self.walk(st, start, &comps, budget, path)
    }

    /// Resolve a whole path; `follow_last` follows a symlink in the last component.
    pub(super) fn resolve(&self, st: &State, p: &PathWalk, follow_last: bool) -> FsResult<u64> {
        let Some(last) = p.last else {
            return Ok(ROOT_INO);
        };
        let mut budget = MAX_SYMLINKS;
        let dir = self.walk_dirs(st, p, &mut budget)?;
        let ino = st.lookup(dir, last).map_err(|e| match e {
            FsError::NotFound(_) => FsError::NotFound(p.path.to_string()),
            e => e,
        })?;
        if follow_last {
            self.follow(st, dir, ino, &mut budget, p.path)
        } else {
            Ok(ino)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::{QueueConfig, RequestQueue};
    use crate::fs::mkfs::MkfsOptions;
    use crate::fs::volume::{MountOptions, Volume};

    fn volume() -> Volume {
        let q = RequestQueue::open("sim:ssd,size=64M", QueueConfig::default()).unwrap();
        Volume::mkfs(&q, &MkfsOptions::default()).unwrap();
        let mut o = MountOptions::default();
        o.wb.dirty_writeback_centisecs = 0;
        Volume::mount(q, o).unwrap()
    }

    /// What an open that creates finds at `path`, walked in the dentry cache now and
    /// confirmed under `st` after `between` ran: the dentry cache's answer when it
    /// still holds, the walk under `st` otherwise.
    fn create_target(v: &Volume, path: &str, between: impl FnOnce()) -> FsResult<u64> {
        let p = v.vol.path_walk(path);
        assert!(p.walked.is_some(), "{path}: not in the dentry cache");
        between();
        let st = v.vol.st.lock();
        match v.vol.resolve_for_create(&st, &p)? {
            Resolved::Missing { dir, .. } => Ok(dir),
            Resolved::Found(ino) => Ok(ino),
            Resolved::Dangling { .. } => panic!("no symlinks here"),
        }
    }

    #[test]
    fn a_walk_made_before_a_rename_or_rmdir_is_walked_again_under_st() {
        let v = volume();
        v.mkdir_all("/a/b", 0o755).unwrap();
        v.mkdir("/c", 0o755).unwrap();
        let b = v.lookup_path("/a/b").unwrap();
        // Nothing removed between: the cached walk is the answer.
        assert_eq!(create_target(&v, "/a/b/f", || {}).unwrap(), b);
        let hits = v.inode_cache_stats().dentry_walk_hits;
        // /a/b moved to /c/b after the walk: under `st`, /a/b is gone.
        let r = create_target(&v, "/a/b/f", || v.rename("/a/b", "/c/b").unwrap());
        assert!(matches!(r, Err(FsError::NotFound(_))), "{r:?}");
        assert_eq!(create_target(&v, "/c/b/f", || {}).unwrap(), b);
        // Removed after the walk: no create in a deleted directory.
        let r = create_target(&v, "/c/b/f", || v.rmdir("/c/b").unwrap());
        assert!(matches!(r, Err(FsError::NotFound(_))), "{r:?}");
        // A file unlinked between leaves the walk standing (only directories count).
        v.mkdir("/c/d", 0o755).unwrap();
        v.create("/c/x").unwrap().close().unwrap();
        let d = v.lookup_path("/c/d").unwrap();
        let seq_hits = v.inode_cache_stats().dentry_walk_hits;
        assert_eq!(
            create_target(&v, "/c/d/f", || v.unlink("/c/x").unwrap()).unwrap(),
            d
        );
        assert!(v.inode_cache_stats().dentry_walk_hits > seq_hits.max(hits));
        assert!(v.check().is_empty(), "{:?}", v.check());
        v.unmount().unwrap();
    }

    #[test]
    fn unlink_and_rename_act_on_what_the_path_names_when_they_take_st() {
        let v = volume();
        v.mkdir("/a", 0o755).unwrap();
        v.create("/a/f").unwrap().close().unwrap();
        v.create("/a/g").unwrap().close().unwrap();
        let old_a = v.lookup_path("/a").unwrap();
        // Walked while /a was the first directory; then /a moves to /b and a new /a
        // with its own f and g takes the name.
        let unlink = v.vol.path_walk("/a/f");
        let rename = v.vol.path_walk("/a/g");
        let target = v.vol.path_walk("/a/h");
        assert!(unlink.walked.is_some_and(|w| w.dir == old_a));
        v.rename("/a", "/b").unwrap();
        v.mkdir("/a", 0o755).unwrap();
        v.create("/a/f").unwrap().close().unwrap();
        v.create("/a/g").unwrap().close().unwrap();
        v.vol.unlink_path(&unlink, false).unwrap();
        v.vol.rename_paths(&rename, &target).unwrap();
        // The new /a's names changed; the moved directory's stayed.
        assert!(matches!(v.stat("/a/f"), Err(FsError::NotFound(_))));
        assert!(matches!(v.stat("/a/g"), Err(FsError::NotFound(_))));
        assert!(v.stat("/a/h").is_ok());
        for kept in ["/b/f", "/b/g"] {
            assert!(v.stat(kept).is_ok(), "{kept}");
        }
        assert!(matches!(v.stat("/b/h"), Err(FsError::NotFound(_))));
        // A walk through a directory removed since: ENOENT, as a walk under `st` finds.
        let gone = v.vol.path_walk("/b/f");
        v.rename("/b", "/c").unwrap();
        let r = v.vol.unlink_path(&gone, false);
        assert!(matches!(r, Err(FsError::NotFound(_))), "{r:?}");
        assert!(v.stat("/c/f").is_ok());
        assert!(v.check().is_empty(), "{:?}", v.check());
        v.unmount().unwrap();
    }

    #[test]
    fn mkdir_all_of_cached_directories_takes_no_state_lock() {
        let v = volume();
        v.mkdir_all("/x/y/z", 0o755).unwrap();
        // Held here: a mkdir_all that needed `st` would never return.
        let st = v.vol.st.lock();
        v.mkdir_all("/x/y/z", 0o755).unwrap();
        v.mkdir_all("/x/y", 0o755).unwrap();
        drop(st);
        // Walked through a symlink: under `st`, and it works.
        v.symlink("/x/y", "/l").unwrap();
        v.mkdir_all("/l/z/w", 0o755).unwrap();
        assert!(v.stat("/x/y/z/w").is_ok());
        v.unmount().unwrap();
    }
}
