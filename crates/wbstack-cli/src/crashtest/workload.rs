//! The workload: threads of mixed operations logged against the model.

use super::*;
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use wbstack::fs::{File, FsError, FsResult, OpenOptions, Volume};

/// How a cut is placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Mode {
    /// At operation `at`, arm the device to cut when the `n`-th request from then
    /// enters it, whichever thread (a workload thread, the flusher, the committer)
    /// sends it.
    Io,
    /// Cut at once at operation `at`, with whatever background IO is in flight.
    Now,
    /// At operation `at`, arm for `n` requests and fsync (or sync): the cut lands inside
    /// its writeback, cache flush or commit.
    Fsync,
    /// At operation `at`, arm for the next journal write: the cut lands on a commit
    /// (PREFLUSH|FUA) in flight.
    Journal,
    /// When the journal is nearly full, arm for the next write to a checkpoint slot:
    /// the cut lands on the checkpoint that empties the journal.
    Checkpoint,
    /// After all operations, arm for `n` requests and sync.
    End,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct CutPlan {
    pub mode: Mode,
    pub at: u64,
    pub n: u64,
}

impl CutPlan {
    pub fn new(seed: u64, ops: u64) -> CutPlan {
        let mut rng = ChaCha8Rng::seed_from_u64(mix(seed ^ 0x6375_7470_6c61_6e00));
        let r = rng.gen_range(0..100);
        let at = rng.gen_range(0..ops.max(1));
        let (mode, n) = match r {
            0..30 => (Mode::Io, rng.gen_range(1..=48)),
            30..45 => (Mode::Now, 0),
            45..60 => (Mode::Fsync, rng.gen_range(1..=12)),
            60..75 => (Mode::Journal, 1),
            75..88 => (Mode::Checkpoint, 1),
            _ => (Mode::End, rng.gen_range(1..=24)),
        };
        CutPlan {
            mode,
            at: if mode == Mode::End { ops } else { at },
            n,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Create,
    Mkdir,
    Link,
    Unlink,
    Rename,
    RenameOver,
    /// Write a new file, rename it over an existing name without fsync, close it
    /// (an editor's save): what flush_on_close makes safe.
    Replace,
    RenameDir,
    Rmdir,
    Append,
    BigAppend,
    Overwrite,
    Unaligned,
    Truncate,
    Fsync,
    Fdatasync,
    /// fsync of a directory: its entries' creates, links, renames and unlinks durable.
    FsyncDir,
    Sync,
    Close,
}

/// The operation mix, in weights.
pub(crate) const MIX: &[(Kind, u32)] = &[
    (Kind::Create, 10),
    (Kind::Mkdir, 2),
    (Kind::Link, 4),
    (Kind::Unlink, 6),
    (Kind::Rename, 5),
    (Kind::RenameOver, 4),
    (Kind::Replace, 4),
    (Kind::RenameDir, 2),
    (Kind::Rmdir, 1),
    (Kind::Append, 16),
    (Kind::BigAppend, 2),
    (Kind::Overwrite, 8),
    (Kind::Unaligned, 8),
    (Kind::Truncate, 6),
    (Kind::Fsync, 12),
    (Kind::Fdatasync, 4),
    (Kind::FsyncDir, 2),
    (Kind::Sync, 1),
    (Kind::Close, 4),
];

pub(crate) fn pick_kind(rng: &mut ChaCha8Rng) -> Kind {
    let total: u32 = MIX.iter().map(|m| m.1).sum();
    let mut x = rng.gen_range(0..total);
    for &(k, w) in MIX {
        if x < w {
            return k;
        }
        x -= w;
    }
    Kind::Create
}

pub(crate) const MAX_FILES: usize = 48;
pub(crate) const MAX_DIRS: usize = 12;
pub(crate) const FILE_MAX: u64 = 2 << 20;
pub(crate) const BLOCK: u64 = 4096;

pub(crate) struct FileRec {
    links: u32,
    handle: Option<Arc<File>>,
    /// Serialises the file's writes and truncates with their log entries; holds the
    /// model's size of the file.
    lock: Arc<Mutex<u64>>,
    size: u64,
}

impl FileRec {
    fn alive(&self) -> bool {
        self.links > 0 || self.handle.is_some()
    }
}

/// The workload's view of the filesystem (ordered maps: seeded choices must not depend
/// on hash order), and the log.
pub(crate) struct Model {
    pub(crate) log: Log,
    pub(crate) root: u64,
    pub(crate) dirs: BTreeMap<u64, BTreeMap<String, u64>>,
    pub(crate) parent: HashMap<u64, (u64, String)>,
    pub(crate) files: BTreeMap<u64, FileRec>,
    pub(crate) names: u64,
    pub(crate) budget: u64,
    pub(crate) unexpected: Vec<String>,
}

impl Model {
    fn fresh(&mut self, prefix: &str) -> String {
        self.names += 1;
        format!("{prefix}{}", self.names)
    }

    fn dir_path(&self, mut d: u64) -> String {
        let mut parts = Vec::new();
        while d != self.root {
            let (p, n) = &self.parent[&d];
            parts.push(n.as_str());
            d = *p;
        }
        parts.reverse();
        format!("/{}", parts.join("/"))
    }

    fn path(&self, dir: u64, name: &str) -> String {
        let d = self.dir_path(dir);
        if d == "/" {
            format!("/{name}")
        } else {
            format!("{d}/{name}")
        }
    }

    fn pick_dir(&self, rng: &mut ChaCha8Rng) -> u64 {
        let keys: Vec<u64> = self.dirs.keys().copied().collect();
        keys[rng.gen_range(0..keys.len())]
    }

    /// Every name of a regular file: (directory, name, inode).
    fn file_names(&self) -> Vec<(u64, String, u64)> {
        let mut v = Vec::new();
        for (&d, ents) in &self.dirs {
            for (n, &i) in ents {
                if self.files.contains_key(&i) {
                    v.push((d, n.clone(), i));
                }
            }
        }
        v
    }

    fn pick_name(&self, rng: &mut ChaCha8Rng) -> Option<(u64, String, u64)> {
        let mut v = self.file_names();
        (!v.is_empty()).then(|| v.swap_remove(rng.gen_range(0..v.len())))
    }

    fn pick_file(&self, rng: &mut ChaCha8Rng, open_only: bool) -> Option<u64> {
        let v: Vec<u64> = self
            .files
            .iter()
            .filter(|(_, f)| {
                if open_only {
                    f.handle.is_some()
                } else {
                    f.alive()
                }
            })
            .map(|(&i, _)| i)
            .collect();
        (!v.is_empty()).then(|| v[rng.gen_range(0..v.len())])
    }

    fn live_bytes(&self) -> u64 {
        self.files
            .values()
            .filter(|f| f.alive())
            .map(|f| f.size)
            .sum()
    }

    fn named_files(&self) -> usize {
        self.files.values().filter(|f| f.links > 0).count()
    }

    /// An open handle of `ino`, opening it by one of its names if it has none.
    fn handle(&mut self, vol: &Volume, ino: u64) -> FsResult<Arc<File>> {
        if let Some(h) = &self.files[&ino].handle {
            return Ok(h.clone());
        }
        let Some((d, n, _)) = self.file_names().into_iter().find(|e| e.2 == ino) else {
            return Err(FsError::Corrupt(format!(
                "model: inode {ino} has neither a name nor a handle"
            )));
        };
        let path = self.path(d, &n);
        let f = vol.open(&path, &OpenOptions::read_write())?;
        if f.ino() != ino {
            return Err(FsError::Corrupt(format!(
                "{path} opened inode {} where the model has {ino}",
                f.ino()
            )));
        }
        let h = Arc::new(f);
        self.files.get_mut(&ino).unwrap().handle = Some(h.clone());
        Ok(h)
    }

    /// close(2) of `ino`'s descriptor, exactly where its entry is logged: other holders
    /// (a write, an fsync in progress) let go of it without this lock, so it waits
    /// here for them, and no entry logged later can come before the close. A close
    /// that came later (the last holder's drop) resolved a deferred truncation where
    /// the checker did not expect it: after a truncation logged after its Close entry
    /// (crashtest seed 70187 failed so, the rewrite's close requiring writes made after
    /// the truncation was already journaled). The last close of an unlinked file
    /// deletes it.
    fn close(&mut self, ino: u64) {
        let Some(h) = self.files.get_mut(&ino).unwrap().handle.take() else {
            return;
        };
        self.log.push(Entry::Close { ino });
        // A holder is inside one call (write_all_at, fsync) and lets go when it
        // returns. Bounded: a call that waits for the device around a power cut must
        // not stop every other thread behind this lock (a 10-cut test hung once in a
        // loaded CI run with an unbounded wait, cause not found); past the bound the
        // close comes at the holder's drop, as before.
        let t0 = std::time::Instant::now();
        while Arc::strong_count(&h) > 1 && t0.elapsed() < CLOSE_WAIT {
            std::thread::yield_now();
        }
        drop(h);
    }

    /// `ino` lost a name; its size leaves the budget when it lost its last one and is
    /// closed (the filesystem deleted it).
    fn unlinked(&mut self, ino: u64) {
        if let Some(f) = self.files.get_mut(&ino) {
            f.links -= 1;
        }
    }

    /// Whether `d` is `top` or inside it.
    fn within(&self, mut d: u64, top: u64) -> bool {
        loop {
            if d == top {
                return true;
            }
            if d == self.root {
                return false;
            }
            d = self.parent[&d].0;
        }
    }
}

pub(crate) struct Ctx {
    pub(crate) vol: Volume,
    pub(crate) probe: Arc<Probe>,
    /// Journal blocks written since mount at which the next commit checkpoints.
    pub(crate) ckpt_at: u64,
    /// The operation at which the cut was armed or made (u64::MAX: not yet).
    pub(crate) placed_at: AtomicU64,
    pub(crate) model: Mutex<Model>,
    pub(crate) next_op: Arc<AtomicU64>,
    pub(crate) versions: AtomicU64,
    pub(crate) ops: u64,
    pub(crate) plan: CutPlan,
}

/// One operation of `kind`; `last` is the file this thread wrote last (applications
/// mostly fsync what they just wrote, which is also what makes fsync commit).
pub(crate) fn do_op(
    ctx: &Ctx,
    rng: &mut ChaCha8Rng,
    kind: Kind,
    last: &mut Option<u64>,
) -> FsResult<()> {
    let vol = &ctx.vol;
    let mut m = ctx.model.lock();
    let kind = match kind {
        Kind::Create | Kind::Link if m.named_files() >= MAX_FILES => Kind::Unlink,
        Kind::Mkdir if m.dirs.len() >= MAX_DIRS => Kind::Create,
        k => k,
    };
    if m.named_files() == 0 && !matches!(kind, Kind::Mkdir | Kind::Sync) {
        return create(vol, &mut m, rng);
    }
    match kind {
        Kind::Create => create(vol, &mut m, rng),
        Kind::Mkdir => {
            let dir = m.pick_dir(rng);
            let name = m.fresh("d");
            let ino = vol.mkdir(&m.path(dir, &name), 0o755)?;
            m.log.push(Entry::Create {
                dir,
                name: name.clone(),
                ino,
                is_dir: true,
            });
            m.dirs.get_mut(&dir).unwrap().insert(name.clone(), ino);
            m.dirs.insert(ino, BTreeMap::new());
            m.parent.insert(ino, (dir, name));
            Ok(())
        }
        Kind::Link => {
            let (d, n, ino) = m.pick_name(rng).unwrap();
            let nd = m.pick_dir(rng);
            let nn = m.fresh("l");
            vol.link(&m.path(d, &n), &m.path(nd, &nn))?;
            m.log.push(Entry::Link {
                dir: nd,
                name: nn.clone(),
                ino,
            });
            m.dirs.get_mut(&nd).unwrap().insert(nn, ino);
            m.files.get_mut(&ino).unwrap().links += 1;
            Ok(())
        }
        Kind::Unlink => {
            let (d, n, ino) = m.pick_name(rng).unwrap();
            vol.unlink(&m.path(d, &n))?;
            m.log.push(Entry::Unlink {
                dir: d,
                name: n.clone(),
                ino,
            });
            m.dirs.get_mut(&d).unwrap().remove(&n);
            m.unlinked(ino);
            Ok(())
        }
        Kind::Rename => {
            let (d, n, ino) = m.pick_name(rng).unwrap();
            let nd = m.pick_dir(rng);
            let nn = m.fresh("r");
            vol.rename(&m.path(d, &n), &m.path(nd, &nn))?;
            m.log.push(Entry::Rename {
                from_dir: d,
                from: n.clone(),
                to_dir: nd,
                to: nn.clone(),
                ino,
                victim: None,
            });
            m.dirs.get_mut(&d).unwrap().remove(&n);
            m.dirs.get_mut(&nd).unwrap().insert(nn, ino);
            Ok(())
        }
        Kind::RenameOver => {
            let names = m.file_names();
            if names.len() < 2 {
                return create(vol, &mut m, rng);
            }
            let a = rng.gen_range(0..names.len());
            let mut b = rng.gen_range(0..names.len() - 1);
            if b >= a {
                b += 1;
            }
            let ((d, n, ino), (nd, nn, victim)) = (names[a].clone(), names[b].clone());
            vol.rename(&m.path(d, &n), &m.path(nd, &nn))?;
            if victim == ino {
                // Two names of one inode: rename(2) does nothing, and logs nothing.
                return Ok(());
            }
            m.log.push(Entry::Rename {
                from_dir: d,
                from: n.clone(),
                to_dir: nd,
                to: nn.clone(),
                ino,
                victim: Some(victim),
            });
            m.dirs.get_mut(&d).unwrap().remove(&n);
            m.dirs.get_mut(&nd).unwrap().insert(nn, ino);
            m.unlinked(victim);
            Ok(())
        }
        Kind::Replace => {
            let (d, n, victim) = m.pick_name(rng).unwrap();
            let (tmp, ino) = create_in(vol, &mut m, d, "t")?;
            let lock = m.files[&ino].lock.clone();
            let start = m.log.len();
            let room = m.budget.saturating_sub(m.live_bytes());
            drop(m);
            *last = Some(ino);
            // One write_all_at: every block of the new file is first written by it.
            write(ctx, rng, Kind::Append, ino, &lock, start, room)?;
            let mut m = ctx.model.lock();
            // Other threads may have renamed or unlinked either name meanwhile; the
            // model's lock holds both still from here to the rename's log entry.
            let named = |m: &Model, name: &str| m.dirs.get(&d).and_then(|e| e.get(name)).copied();
            if named(&m, &tmp) != Some(ino) || named(&m, &n) != Some(victim) {
                return Ok(());
            }
            vol.rename(&m.path(d, &tmp), &m.path(d, &n))?;
            m.log.push(Entry::Rename {
                from_dir: d,
                from: tmp.clone(),
                to_dir: d,
                to: n.clone(),
                ino,
                victim: Some(victim),
            });
            m.dirs.get_mut(&d).unwrap().remove(&tmp);
            m.dirs.get_mut(&d).unwrap().insert(n, ino);
            m.unlinked(victim);
            // Closed after the rename, as Kind::Close closes.
            m.close(ino);
            Ok(())
        }
        Kind::RenameDir => {
            let subdirs: Vec<u64> = m.dirs.keys().copied().filter(|&d| d != m.root).collect();
            if subdirs.is_empty() {
                return create(vol, &mut m, rng);
            }
            let d = subdirs[rng.gen_range(0..subdirs.len())];
            let targets: Vec<u64> = m
                .dirs
                .keys()
                .copied()
                .filter(|&t| !m.within(t, d))
                .collect();
            let nd = targets[rng.gen_range(0..targets.len())];
            let (od, on) = m.parent[&d].clone();
            let nn = m.fresh("d");
            vol.rename(&m.path(od, &on), &m.path(nd, &nn))?;
            m.log.push(Entry::Rename {
                from_dir: od,
                from: on.clone(),
                to_dir: nd,
                to: nn.clone(),
                ino: d,
                victim: None,
            });
            m.dirs.get_mut(&od).unwrap().remove(&on);
            m.dirs.get_mut(&nd).unwrap().insert(nn.clone(), d);
            m.parent.insert(d, (nd, nn));
            Ok(())
        }
        Kind::Rmdir => {
            let empty: Vec<u64> = m
                .dirs
                .iter()
                .filter(|(&d, e)| d != m.root && e.is_empty())
                .map(|(&d, _)| d)
                .collect();
            if empty.is_empty() {
                return create(vol, &mut m, rng);
            }
            let d = empty[rng.gen_range(0..empty.len())];
            let (p, n) = m.parent[&d].clone();
            vol.rmdir(&m.path(p, &n))?;
            m.log.push(Entry::Unlink {
                dir: p,
                name: n.clone(),
                ino: d,
            });
            m.dirs.get_mut(&p).unwrap().remove(&n);
            m.dirs.remove(&d);
            m.parent.remove(&d);
            Ok(())
        }
        Kind::Append | Kind::BigAppend | Kind::Overwrite | Kind::Unaligned => {
            let ino = m.pick_file(rng, false).unwrap();
            let lock = m.files[&ino].lock.clone();
            let start = m.log.len();
            let room = m.budget.saturating_sub(m.live_bytes());
            drop(m);
            *last = Some(ino);
            write(ctx, rng, kind, ino, &lock, start, room)
        }
        Kind::Truncate => {
            let ino = m.pick_file(rng, false).unwrap();
            let lock = m.files[&ino].lock.clone();
            let room = m.budget.saturating_sub(m.live_bytes());
            drop(m);
            let mut size = lock.lock();
            let to = match rng.gen_range(0..4) {
                0 => 0,
                1 => rng.gen_range(0..=*size / BLOCK) * BLOCK,
                2 => rng.gen_range(0..=*size / SECTOR) * SECTOR,
                _ => *size + rng.gen_range(1..=64u64).min(room / SECTOR) * SECTOR,
            };
            // The truncate is journaled: logged under the model's lock, in order with
            // every namespace operation.
            let mut m = ctx.model.lock();
            if !m.files.get(&ino).is_some_and(|f| f.alive()) {
                // Closed and unlinked by another thread since it was picked.
                return Ok(());
            }
            // The descriptor is the model's, taken under its lock: a Close cannot
            // have let it go while this truncation runs.
            let h = m.handle(vol, ino)?;
            h.set_len(to)?;
            drop(h);
            m.log.push(Entry::Truncate { ino, size: to });
            *size = to;
            m.files.get_mut(&ino).unwrap().size = to;
            Ok(())
        }
        Kind::Fsync | Kind::Fdatasync => {
            let ino = match *last {
                Some(i) if m.files[&i].alive() && rng.gen_ratio(3, 4) => i,
                _ => m.pick_file(rng, false).unwrap(),
            };
            let h = m.handle(vol, ino)?;
            let data = kind == Kind::Fdatasync;
            let id = m.log.start_barrier(if data {
                Barrier::Fdatasync(ino)
            } else {
                Barrier::Fsync(ino)
            });
            drop(m);
            let r = if data { h.fdatasync() } else { h.fsync() };
            drop(h);
            r?;
            ctx.model.lock().log.ack_barrier(id);
            Ok(())
        }
        Kind::FsyncDir => {
            // fsync(2) of a directory descriptor is, in the library, a commit of the
            // journal up to now (what the FUSE front end's fsyncdir calls). For the
            // checker it is an fsync of the directory's inode: the directory's own
            // journaled changes, under the inode rule.
            let dir = m.pick_dir(rng);
            let id = m.log.start_barrier(Barrier::Fsync(dir));
            drop(m);
            vol.commit_now()?;
            ctx.model.lock().log.ack_barrier(id);
            Ok(())
        }
        Kind::Sync => {
            let id = m.log.start_barrier(Barrier::Sync);
            drop(m);
            vol.sync()?;
            ctx.model.lock().log.ack_barrier(id);
            Ok(())
        }
        Kind::Close => {
            let Some(ino) = m.pick_file(rng, true) else {
                return Ok(());
            };
            m.close(ino);
            Ok(())
        }
    }
}

pub(crate) fn create(vol: &Volume, m: &mut Model, rng: &mut ChaCha8Rng) -> FsResult<()> {
    let dir = m.pick_dir(rng);
    create_in(vol, m, dir, "f").map(|_| ())
}

/// Create and open a new file in `dir` named `prefix` and a fresh number: its name
/// and inode.
pub(crate) fn create_in(
    vol: &Volume,
    m: &mut Model,
    dir: u64,
    prefix: &str,
) -> FsResult<(String, u64)> {
    let name = m.fresh(prefix);
    let o = OpenOptions {
        read: true,
        write: true,
        create: true,
        exclusive: true,
        ..OpenOptions::default()
    };
    let f = vol.open(&m.path(dir, &name), &o)?;
    let ino = f.ino();
    m.log.push(Entry::Create {
        dir,
        name: name.clone(),
        ino,
        is_dir: false,
    });
    m.dirs.get_mut(&dir).unwrap().insert(name.clone(), ino);
    m.files.insert(
        ino,
        FileRec {
            links: 1,
            handle: Some(Arc::new(f)),
            lock: Arc::new(Mutex::new(0)),
            size: 0,
        },
    );
    Ok((name, ino))
}

/// One write of `kind` to `ino`, `room` bytes of budget left.
#[allow(clippy::too_many_arguments)]
pub(crate) fn write(
    ctx: &Ctx,
    rng: &mut ChaCha8Rng,
    kind: Kind,
    ino: u64,
    lock: &Mutex<u64>,
    start: usize,
    room: u64,
) -> FsResult<()> {
    let mut size = lock.lock();
    // The descriptor is taken only now, with the file's lock: a holder never waits
    // for a lock (a Close waits under the model's lock for the holders, and a writer
    // holding this lock waits for the model's).
    let h = {
        let mut m = ctx.model.lock();
        if !m.files.get(&ino).is_some_and(|f| f.alive()) {
            return Ok(()); // closed and unlinked by another thread since it was picked
        }
        m.handle(&ctx.vol, ino)?
    };
    let end_sector = *size / SECTOR;
    let (mut first, mut n) = match kind {
        Kind::Append => (
            end_sector,
            if rng.gen_ratio(1, 8) {
                rng.gen_range(33..=128)
            } else {
                rng.gen_range(1..=32)
            },
        ),
        Kind::BigAppend => (end_sector, rng.gen_range(512..=2048)),
        Kind::Overwrite => {
            let blocks = *size / BLOCK;
            let b = rng.gen_range(0..=blocks);
            (b * 8, rng.gen_range(1..=8) * 8)
        }
        _ => {
            let mut s = rng.gen_range(0..=end_sector);
            if s % 8 == 0 {
                s += rng.gen_range(1..8);
            }
            (s, rng.gen_range(1..=20))
        }
    };
    let grow = ((first + n) * SECTOR).saturating_sub(*size);
    if grow > room || (first + n) * SECTOR > FILE_MAX {
        // Over budget: overwrite inside the file instead (or nothing, if it is empty).
        if end_sector == 0 {
            return Ok(());
        }
        first = rng.gen_range(0..end_sector);
        n = n.min(end_sector - first);
    }
    let ver = ctx.versions.fetch_add(1, Ordering::Relaxed) + 1;
    let data = write_payload(ino, first, n, ver);
    let r = h.write_all_at(first * SECTOR, &data);
    // Before the log's lock: another thread's fsync may log its start meanwhile, yet
    // begin its call after this write returned, and then it covers this write.
    let done = stamp();
    // Let go of the descriptor before the model's lock, as every holder does: a Close
    // waits under that lock until it holds the descriptor's last reference.
    drop(h);
    let mut m = ctx.model.lock();
    m.log.push(Entry::Write {
        ino,
        sector: first,
        sectors: n,
        ver,
        start,
        ok: r.is_ok(),
        done,
    });
    if r.is_ok() {
        *size = (*size).max((first + n) * SECTOR);
        m.files.get_mut(&ino).unwrap().size = *size;
    }
    r.map(|_| ())
}

/// How long a Close waits for the descriptor's other holders (`Model::close`).
const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// Unexpected errors kept per cut.
pub(crate) const MAX_UNEXPECTED: usize = 20;

pub(crate) fn worker(ctx: Arc<Ctx>, thread: u64, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(mix(seed ^ mix(thread + 1)));
    let mut last = None;
    loop {
        let j = ctx.next_op.fetch_add(1, Ordering::SeqCst);
        if j >= ctx.ops {
            break;
        }
        let mut kind = pick_kind(&mut rng);
        let place = match ctx.plan.mode {
            Mode::Checkpoint => {
                let js = ctx.vol.journal_stats();
                js.checkpoints > 0 || js.bytes / BLOCK + 4 >= ctx.ckpt_at
            }
            Mode::End => false,
            _ => j == ctx.plan.at,
        };
        let first = place
            && ctx
                .placed_at
                .compare_exchange(u64::MAX, j, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok();
        if first {
            match ctx.plan.mode {
                Mode::Io => ctx.probe.arm(ctx.plan.n),
                Mode::Now => ctx.probe.cut_now(),
                Mode::Journal => ctx.probe.arm_on(Area::Journal),
                Mode::Checkpoint => ctx.probe.arm_on(Area::Checkpoint),
                Mode::Fsync => {
                    ctx.probe.arm(ctx.plan.n);
                    kind = if rng.gen_ratio(1, 4) {
                        Kind::Sync
                    } else {
                        Kind::Fsync
                    };
                }
                Mode::End => {}
            }
        }
        if !ctx.probe.powered() {
            break;
        }
        if let Err(e) = do_op(&ctx, &mut rng, kind, &mut last) {
            // After the cut, operations fail: that is the device dying, not a bug.
            if !ctx.probe.powered() {
                break;
            }
            let mut m = ctx.model.lock();
            if m.unexpected.len() < MAX_UNEXPECTED {
                m.unexpected.push(format!("operation {j} ({kind:?}): {e}"));
            }
        }
    }
}
