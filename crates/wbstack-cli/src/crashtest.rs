//! `wbstack crashtest`: proves the filesystem keeps its promises across power cuts.
//!
//! Each cut makes a fresh filesystem on a simulated device, runs a mixed workload from
//! several threads with writeback and journal commits in the background, cuts the power
//! (torn writes on) at a seeded point, then reboots, runs fsck, mounts, runs fsck again
//! after an unmount, and compares what came back with an exact log of what the workload
//! did and what was acknowledged.
//!
//! - Every 512-byte sector the workload writes describes itself (inode, sector index,
//!   write version, and a payload derived from them), so reading it back says exactly
//!   which write put it there, or that no write of this file at this offset did.
//! - Namespace operations and truncates (everything the filesystem journals) are logged
//!   under one lock around the operation itself, so the log's order is the journal's;
//!   the recovered tree must equal the tree after some prefix of them, and that prefix
//!   must hold everything an acknowledged fsync / fdatasync / sync covered.
//! - Data writes are logged when they return (under the file's own lock, so a file's
//!   writes and truncates are in the order they happened), with the log position at
//!   which they started.
//!
//! The checker ([`check`]) is a pure function of the log and the recovered state, so
//! tests feed it states with known violations.
//!
//! Threads: two by default, because one thread never has a namespace operation, a
//! write and an fsync of different files in flight at once, and group commit, a
//! commit racing new records, and writeback racing a truncate only happen with several.
//! The price is ordering, paid by the log's lock (above).
//!
//! Replay: cut i uses seed `--seed + i`. The seed fixes each thread's operations, where
//! the cut is placed, the device's timing model and which sectors a torn cut keeps of a
//! given set of writes. It does not fix how the threads interleave, nor when the
//! flusher and the committer run (real time), so a replay hits the same kind of moment,
//! not always the same one; with `--threads 1` only the background threads vary.
//!
//! `CRASHTEST_DEBUG=1` prints, for every failing cut, the whole operation log, the
//! recovered tree and fsck's notes on stderr.

use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};
use wbstack::block::{BioFlags, BlkError, BlkResult, Op, QueueConfig, Request, RequestQueue};
use wbstack::dev::sim::SimDevice;
use wbstack::dev::{Completer, Device, DeviceRef, DeviceSpec, Geometry, RqComplete};
use wbstack::fs::format::Superblock;
use wbstack::fs::fsck::fsck;
use wbstack::fs::{
    File, FsError, FsResult, InodeKind, MkfsOptions, MountOptions, OpenOptions, Volume,
};

pub const SECTOR: u64 = 512;
const MAGIC: &[u8; 8] = b"WBCRASH1";

fn mix(mut z: u64) -> u64 {
    // splitmix64's finaliser: every input bit moves every output bit.
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The 512 bytes that version `ver` of sector `idx` of inode `ino` holds: a header
/// naming all three, a payload derived from them, and a checksum.
pub fn sector_image(ino: u64, idx: u64, ver: u64) -> [u8; SECTOR as usize] {
    let mut b = [0u8; SECTOR as usize];
    b[0..8].copy_from_slice(MAGIC);
    b[8..16].copy_from_slice(&ino.to_le_bytes());
    b[16..24].copy_from_slice(&idx.to_le_bytes());
    b[24..32].copy_from_slice(&ver.to_le_bytes());
    let mut x = mix(ino ^ mix(idx ^ mix(ver)));
    for c in b[32..504].chunks_exact_mut(8) {
        x = mix(x);
        c.copy_from_slice(&x.to_le_bytes());
    }
    let sum = b[..504].chunks_exact(8).fold(0u64, |a, c| {
        mix(a ^ u64::from_le_bytes(c.try_into().unwrap()))
    });
    b[504..].copy_from_slice(&sum.to_le_bytes());
    b
}

/// The data of one write of `sectors` sectors from sector `first` of `ino`.
pub fn write_payload(ino: u64, first: u64, sectors: u64, ver: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity((sectors * SECTOR) as usize);
    for s in first..first + sectors {
        v.extend_from_slice(&sector_image(ino, s, ver));
    }
    v
}

/// What a sector read back holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sector {
    Zero,
    /// Exactly what version `ver` of sector `idx` of `ino` was written as.
    Written {
        ino: u64,
        idx: u64,
        ver: u64,
    },
    /// Anything else: bytes no write of the workload produced.
    Garbage,
}

/// Identify a sector (or the first bytes of one, at the end of a file).
pub fn classify(buf: &[u8]) -> Sector {
    if buf.iter().all(|&b| b == 0) {
        return Sector::Zero;
    }
    if buf.len() < 32 || &buf[0..8] != MAGIC {
        return Sector::Garbage;
    }
    let word = |i: usize| u64::from_le_bytes(buf[i..i + 8].try_into().unwrap());
    let (ino, idx, ver) = (word(8), word(16), word(24));
    if sector_image(ino, idx, ver)[..buf.len()] == *buf {
        Sector::Written { ino, idx, ver }
    } else {
        Sector::Garbage
    }
}

/// What an fsync-like call covered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Barrier {
    Fsync(u64),
    Fdatasync(u64),
    Sync,
}

impl Barrier {
    fn covers(self, ino: u64) -> bool {
        match self {
            Barrier::Fsync(i) | Barrier::Fdatasync(i) => i == ino,
            Barrier::Sync => true,
        }
    }
}

/// One entry of the operation log. Only operations that returned Ok are logged, except
/// writes, which are logged either way (`ok: false`: some of it may have reached the
/// page cache, so it may show up, but it was never acknowledged).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Entry {
    Create {
        dir: u64,
        name: String,
        ino: u64,
        is_dir: bool,
    },
    Link {
        dir: u64,
        name: String,
        ino: u64,
    },
    /// unlink or rmdir.
    Unlink {
        dir: u64,
        name: String,
        ino: u64,
    },
    Rename {
        from_dir: u64,
        from: String,
        to_dir: u64,
        to: String,
        ino: u64,
        /// The inode the target name named before (rename over an existing file).
        victim: Option<u64>,
    },
    /// ftruncate to `size` bytes.
    Truncate {
        ino: u64,
        size: u64,
    },
    /// `sectors` sectors from sector `sector`, data `write_payload(ino, sector, sectors,
    /// ver)`; `start` is the log length when the write was issued.
    Write {
        ino: u64,
        sector: u64,
        sectors: u64,
        ver: u64,
        start: usize,
        ok: bool,
    },
    /// An fsync / fdatasync / sync was called; `id` pairs it with its ack.
    BarrierStart {
        id: u64,
        kind: Barrier,
    },
    /// ... and returned Ok.
    BarrierAck {
        id: u64,
    },
}

impl Entry {
    /// Whether the filesystem journals it (it is ordered with every other such entry).
    pub fn journaled(&self) -> bool {
        matches!(
            self,
            Entry::Create { .. }
                | Entry::Link { .. }
                | Entry::Unlink { .. }
                | Entry::Rename { .. }
                | Entry::Truncate { .. }
        )
    }

    /// Inodes whose journal position this entry moves (what fsync of them waits for).
    fn touched(&self) -> Vec<u64> {
        match self {
            Entry::Create { dir, ino, .. }
            | Entry::Link { dir, ino, .. }
            | Entry::Unlink { dir, ino, .. } => vec![*dir, *ino],
            Entry::Rename {
                from_dir,
                to_dir,
                ino,
                victim,
                ..
            } => {
                let mut v = vec![*from_dir, *to_dir, *ino];
                v.extend(victim);
                v
            }
            Entry::Truncate { ino, .. } => vec![*ino],
            _ => Vec::new(),
        }
    }
}

/// The operation log of one cut.
#[derive(Clone, Debug, Default)]
pub struct Log {
    pub entries: Vec<Entry>,
    /// The volume defers truncations to zero (`flush_on_close`): one is journaled when
    /// the file is next closed (after its writeback), fsynced, synced or truncated
    /// again, together with the rewrite, not when it happens.
    pub deferred_zero_truncates: bool,
    next_barrier: u64,
}

impl Log {
    pub fn new() -> Log {
        Log::default()
    }
    /// The log of a volume that does (`flush_on_close`) or does not defer truncations
    /// to zero.
    pub fn deferring_zero_truncates(deferred: bool) -> Log {
        Log {
            deferred_zero_truncates: deferred,
            ..Log::default()
        }
    }
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    pub fn push(&mut self, e: Entry) -> usize {
        self.entries.push(e);
        self.entries.len() - 1
    }
    pub fn start_barrier(&mut self, kind: Barrier) -> u64 {
        self.next_barrier += 1;
        let id = self.next_barrier;
        self.push(Entry::BarrierStart { id, kind });
        id
    }
    pub fn ack_barrier(&mut self, id: u64) {
        self.push(Entry::BarrierAck { id });
    }

    /// Whether `e` is journaled at its place in the log (a deferred truncation to zero
    /// is journaled later, at a point the log does not know).
    pub fn journaled_here(&self, e: &Entry) -> bool {
        e.journaled() && !(self.deferred_zero_truncates && is_zero_truncate(e))
    }
}

fn is_zero_truncate(e: &Entry) -> bool {
    matches!(e, Entry::Truncate { size: 0, .. })
}

/// A directory entry: (parent inode, name, inode, is a directory).
pub type Dentry = (u64, String, u64, bool);

/// What a mount after the cut shows.
#[derive(Clone, Debug, Default)]
pub struct Recovered {
    /// Every entry of every directory reachable from the root.
    pub entries: BTreeSet<Dentry>,
    /// The content of every regular file reachable from the root, by inode.
    pub files: BTreeMap<u64, Vec<u8>>,
}

/// What an acknowledged fsync promises about namespace operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum FsyncRule {
    /// Every namespace operation anywhere in the volume that completed before the fsync
    /// started: stronger than POSIX or ext4 promise, and than wbstack does.
    Global,
    /// Up to the last journaled change of the inode itself, its last write included:
    /// the contract (`File::fsync`'s documentation, as ext4 does). The default.
    Inode,
}

impl FsyncRule {
    pub fn parse(s: &str) -> Result<FsyncRule, String> {
        match s {
            "global" => Ok(FsyncRule::Global),
            "inode" => Ok(FsyncRule::Inode),
            _ => Err(format!("'{s}': expected global or inode")),
        }
    }
}

/// The checker's findings for one recovered state.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Verdict {
    /// Journaled operations in the log.
    pub journaled_ops: usize,
    /// Prefixes (counts of journaled operations) whose tree equals the recovered one.
    pub prefix_candidates: Vec<usize>,
    /// The prefix the data was judged against.
    pub prefix: Option<usize>,
    /// The shortest prefix the acknowledged barriers allow, under the rule in force and
    /// under the inode rule.
    pub required_prefix: usize,
    pub required_prefix_inode_rule: usize,
    /// The recovered tree is the tree after no prefix of the log.
    pub namespace_not_prefix: bool,
    /// Journaled operations covered by an acknowledged barrier that are missing, under
    /// the rule in force and under the inode rule.
    pub fsynced_ops_lost: usize,
    pub fsynced_ops_lost_inode_rule: usize,
    /// Bytes an acknowledged barrier covered that read back as something older, zeros,
    /// garbage, or past the end of the file.
    pub fsynced_bytes_lost: u64,
    /// 4 KiB file blocks showing a sector no write of that file at that offset produced.
    pub garbage_blocks_exposed: u64,
    pub garbage_sectors: u64,
    /// Sectors showing a write of this file at this offset that a durable truncate had
    /// cut away (data that must read as zeros, or not at all).
    pub stale_sectors_exposed: u64,
    /// Files longer than any size they had since their last durable truncate.
    pub size_errors: u64,
    /// The first problems, in words.
    pub problems: Vec<String>,
}

const MAX_PROBLEMS: usize = 12;

impl Verdict {
    pub fn clean(&self) -> bool {
        !self.namespace_not_prefix
            && self.fsynced_ops_lost == 0
            && self.fsynced_bytes_lost == 0
            && self.garbage_sectors == 0
            && self.stale_sectors_exposed == 0
            && self.size_errors == 0
    }

    fn note(&mut self, p: String) {
        if self.problems.len() < MAX_PROBLEMS {
            self.problems.push(p);
        }
    }
}

fn dentry_hash(d: &Dentry) -> u64 {
    let mut h = mix(d.0 ^ mix(d.2 ^ mix(d.3 as u64)));
    for c in d.1.as_bytes().chunks(8) {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        h = mix(h ^ u64::from_le_bytes(w));
    }
    h
}

/// The directory tree as a set of entries, changed by journaled log entries.
struct Tree {
    set: BTreeSet<Dentry>,
    /// Sum of the entries' hashes: equal sets have equal sums, whatever the order.
    hash: u64,
    is_dir: HashMap<u64, bool>,
}

impl Tree {
    fn new() -> Tree {
        Tree {
            set: BTreeSet::new(),
            hash: 0,
            is_dir: HashMap::new(),
        }
    }

    fn add(&mut self, d: Dentry) {
        let h = dentry_hash(&d);
        if self.set.insert(d) {
            self.hash = self.hash.wrapping_add(h);
        }
    }

    fn remove(&mut self, d: Dentry) {
        let h = dentry_hash(&d);
        if self.set.remove(&d) {
            self.hash = self.hash.wrapping_sub(h);
        }
    }

    fn dir(&self, ino: u64) -> bool {
        self.is_dir.get(&ino).copied().unwrap_or(false)
    }

    fn apply(&mut self, e: &Entry) {
        match e {
            Entry::Create {
                dir,
                name,
                ino,
                is_dir,
            } => {
                self.is_dir.insert(*ino, *is_dir);
                self.add((*dir, name.clone(), *ino, *is_dir));
            }
            Entry::Link { dir, name, ino } => self.add((*dir, name.clone(), *ino, self.dir(*ino))),
            Entry::Unlink { dir, name, ino } => {
                self.remove((*dir, name.clone(), *ino, self.dir(*ino)))
            }
            Entry::Rename {
                from_dir,
                from,
                to_dir,
                to,
                ino,
                victim,
            } => {
                if let Some(v) = victim {
                    self.remove((*to_dir, to.clone(), *v, self.dir(*v)));
                }
                let d = self.dir(*ino);
                self.remove((*from_dir, from.clone(), *ino, d));
                self.add((*to_dir, to.clone(), *ino, d));
            }
            _ => {}
        }
    }
}

/// Judge a recovered state against the log (see the module documentation).
pub fn check(log: &Log, rec: &Recovered, rule: FsyncRule) -> Verdict {
    let es = &log.entries;
    let mut v = Verdict::default();
    // jbefore[i]: journaled entries before entry i (the prefix that holds all of them).
    let mut jbefore = Vec::with_capacity(es.len() + 1);
    let mut j = 0;
    for e in es {
        jbefore.push(j);
        j += log.journaled_here(e) as usize;
    }
    jbefore.push(j);
    v.journaled_ops = j;

    let rec_hash = rec
        .entries
        .iter()
        .fold(0u64, |a, d| a.wrapping_add(dentry_hash(d)));
    // The tree after each prefix, by hash first, then confirmed entry by entry.
    let mut t = Tree::new();
    let mut candidates = Vec::new();
    let consider = |t: &Tree, pos: usize, candidates: &mut Vec<usize>| {
        if t.hash == rec_hash && t.set == rec.entries {
            candidates.push(pos);
        }
    };
    consider(&t, 0, &mut candidates);
    for (pos, e) in es.iter().filter(|e| log.journaled_here(e)).enumerate() {
        t.apply(e);
        consider(&t, pos + 1, &mut candidates);
    }
    v.prefix_candidates = candidates.clone();

    // What the acknowledged barriers require.
    let acked: HashSet<u64> = es
        .iter()
        .filter_map(|e| match e {
            Entry::BarrierAck { id } => Some(*id),
            _ => None,
        })
        .collect();
    let mut touch_fsync: HashMap<u64, usize> = HashMap::new();
    let mut touch_data: HashMap<u64, usize> = HashMap::new();
    let (mut need, mut need_inode) = (0usize, 0usize);
    for (i, e) in es.iter().enumerate() {
        if log.journaled_here(e) {
            for ino in e.touched() {
                for m in [&mut touch_fsync, &mut touch_data] {
                    let r = m.entry(ino).or_default();
                    *r = (*r).max(jbefore[i] + 1);
                }
            }
        }
        match e {
            // A write stamps the inode's mtime in the transaction running when it was
            // issued: fsync (not fdatasync) waits for that transaction.
            Entry::Write {
                ino,
                start,
                ok: true,
                ..
            } => {
                let r = touch_fsync.entry(*ino).or_default();
                *r = (*r).max(jbefore[*start]);
            }
            // A deferred truncation stamps the inode in the running transaction too.
            Entry::Truncate { ino, size: 0 } if !log.journaled_here(e) => {
                let r = touch_fsync.entry(*ino).or_default();
                *r = (*r).max(jbefore[i]);
            }
            Entry::BarrierStart { id, kind } if acked.contains(id) => {
                let all = jbefore[i];
                let (inode, ruled) = match kind {
                    Barrier::Sync => (all, all),
                    Barrier::Fsync(ino) => {
                        let r = touch_fsync.get(ino).copied().unwrap_or(0);
                        (r, if rule == FsyncRule::Global { all } else { r })
                    }
                    // fdatasync promises less by design: the inode's own changes only.
                    Barrier::Fdatasync(ino) => {
                        let r = touch_data.get(ino).copied().unwrap_or(0);
                        (r, r)
                    }
                };
                need = need.max(ruled).max(inode);
                need_inode = need_inode.max(inode);
            }
            _ => {}
        }
    }
    v.required_prefix = need;
    v.required_prefix_inode_rule = need_inode;

    if candidates.is_empty() {
        v.namespace_not_prefix = true;
        v.note(format!(
            "the recovered tree ({} entries) is the tree after no prefix of the {} journaled operations",
            rec.entries.len(),
            j
        ));
    }

    // The data, judged at every prefix the tree allows (they differ in which truncates
    // are durable), longest first. The verdict is the most charitable reading: clean
    // data at an admissible prefix passes; clean data only at a shorter one means
    // covered operations (truncates among them) were lost, not that the data is bad;
    // otherwise the least bad admissible prefix, or the least bad of all.
    let vers: HashMap<u64, (u64, u64, u64)> = es
        .iter()
        .filter_map(|e| match e {
            Entry::Write {
                ino,
                sector,
                sectors,
                ver,
                ..
            } => Some((*ver, (*ino, *sector, *sectors))),
            _ => None,
        })
        .collect();
    let zeros = ZeroTruncates::of(log, &acked);
    let positions: Vec<Option<usize>> = if candidates.is_empty() {
        vec![None]
    } else {
        candidates.iter().rev().map(|&p| Some(p)).collect()
    };
    let mut judged: Vec<(u64, Verdict)> = Vec::new();
    for p in positions {
        let mut d = Verdict {
            prefix: p,
            ..Verdict::default()
        };
        for (&ino, content) in &rec.files {
            check_file(ino, content, es, p, &jbefore, &acked, &vers, &zeros, &mut d);
        }
        // In sectors (and files, for sizes), so no kind of violation outweighs another.
        let bad = d.fsynced_bytes_lost / SECTOR
            + d.garbage_sectors
            + d.stale_sectors_exposed
            + d.size_errors;
        let done = bad == 0 && p.is_none_or(|p| p >= need);
        judged.push((bad, d));
        if done {
            break;
        }
    }
    let admissible = |d: &Verdict| d.prefix.is_none_or(|p| p >= need);
    let least = |it: &mut dyn Iterator<Item = &(u64, Verdict)>| {
        it.min_by_key(|(bad, d)| (*bad, std::cmp::Reverse(d.prefix)))
            .cloned()
    };
    let chosen = judged
        .iter()
        .find(|(bad, d)| *bad == 0 && admissible(d))
        .or_else(|| judged.iter().find(|(bad, _)| *bad == 0))
        .cloned()
        .or_else(|| least(&mut judged.iter().filter(|(_, d)| admissible(d))))
        .or_else(|| least(&mut judged.iter()));
    if let Some((_, d)) = chosen {
        if let Some(p) = d.prefix.filter(|&p| p < need) {
            v.fsynced_ops_lost = need - p;
            v.fsynced_ops_lost_inode_rule = need_inode.saturating_sub(p);
            v.note(format!(
                "the recovered state is the state after {p} journaled operations, but acknowledged barriers covered {need}{}",
                if p >= need_inode {
                    format!(" (only the global rule asks for more than {need_inode})")
                } else {
                    String::new()
                }
            ));
        }
        v.prefix = d.prefix;
        v.fsynced_bytes_lost = d.fsynced_bytes_lost;
        v.garbage_blocks_exposed = d.garbage_blocks_exposed;
        v.garbage_sectors = d.garbage_sectors;
        v.stale_sectors_exposed = d.stale_sectors_exposed;
        v.size_errors = d.size_errors;
        for p in d.problems {
            v.note(p);
        }
    }
    v
}

/// What is known of each deferred truncation to zero: whether something proves it
/// durable, and the truncation that would journal it first.
struct ZeroTruncates {
    /// Log index -> (an acknowledged fsync/fdatasync/sync of the file came after it,
    /// the log index of the next truncation of the file to another size).
    info: HashMap<usize, (bool, Option<usize>)>,
}

impl ZeroTruncates {
    fn of(log: &Log, acked: &HashSet<u64>) -> ZeroTruncates {
        let es = &log.entries;
        let mut info = HashMap::new();
        for (i, e) in es.iter().enumerate() {
            let Entry::Truncate { ino, size: 0 } = e else {
                continue;
            };
            if log.journaled_here(e) {
                continue;
            }
            let mut resolved = false;
            let mut next = None;
            for (k, f) in es.iter().enumerate().skip(i + 1) {
                match f {
                    Entry::BarrierStart { id, kind } if kind.covers(*ino) && acked.contains(id) => {
                        resolved = true;
                        break;
                    }
                    Entry::Truncate { ino: t, size } if t == ino && *size > 0 => {
                        next = Some(k);
                        break;
                    }
                    _ => {}
                }
            }
            info.insert(i, (resolved, next));
        }
        ZeroTruncates { info }
    }

    /// Whether the deferred truncation at log index `i` is durable at prefix `p`:
    /// Some(answer), or None when both are possible.
    fn durable(&self, i: usize, p: usize, jbefore: &[usize]) -> Option<bool> {
        let &(resolved, next) = self.info.get(&i)?;
        if resolved {
            return Some(true);
        }
        if p < jbefore[i] {
            // Something journaled before it is missing.
            return Some(false);
        }
        if next.is_some_and(|k| p > jbefore[k]) {
            // Journaled just before the next truncation, which is durable.
            return Some(true);
        }
        None
    }
}

/// Judge one file's content at prefix `p` (None: the namespace matched no prefix, so
/// only bytes that no write of this file at this offset produced are counted). Where
/// deferred truncations to zero may or may not be durable, every possibility is tried
/// (the durable ones are the first ones: each is journaled before any later one) and
/// the best counts.
#[allow(clippy::too_many_arguments)]
fn check_file(
    ino: u64,
    content: &[u8],
    es: &[Entry],
    p: Option<usize>,
    jbefore: &[usize],
    acked: &HashSet<u64>,
    vers: &HashMap<u64, (u64, u64, u64)>,
    zeros: &ZeroTruncates,
    v: &mut Verdict,
) {
    let unknown: Vec<usize> = match p {
        Some(p) => es
            .iter()
            .enumerate()
            .filter(|(i, e)| {
                matches!(e, Entry::Truncate { ino: t, .. } if *t == ino)
                    && zeros.info.contains_key(i)
                    && zeros.durable(*i, p, jbefore).is_none()
            })
            .map(|(i, _)| i)
            .collect(),
        None => Vec::new(),
    };
    let mut best: Option<(u64, Verdict)> = None;
    for k in 0..=unknown.len() {
        let durable = |i: usize, p: usize| match zeros.durable(i, p, jbefore) {
            Some(d) => d,
            None if zeros.info.contains_key(&i) => unknown[..k].contains(&i),
            None => jbefore[i] < p,
        };
        let mut d = Verdict::default();
        judge_file(ino, content, es, p, &durable, acked, vers, &mut d);
        let bad = d.fsynced_bytes_lost / SECTOR
            + d.garbage_sectors
            + d.stale_sectors_exposed
            + d.size_errors;
        if best.as_ref().is_none_or(|(b, _)| bad < *b) {
            best = Some((bad, d));
        }
    }
    if let Some((_, d)) = best {
        v.fsynced_bytes_lost += d.fsynced_bytes_lost;
        v.garbage_blocks_exposed += d.garbage_blocks_exposed;
        v.garbage_sectors += d.garbage_sectors;
        v.stale_sectors_exposed += d.stale_sectors_exposed;
        v.size_errors += d.size_errors;
        for n in d.problems {
            v.note(n);
        }
    }
}

/// One reading of one file: `durable(i, p)` says whether the truncation at log index
/// `i` is durable at prefix `p`.
#[allow(clippy::too_many_arguments)]
fn judge_file(
    ino: u64,
    content: &[u8],
    es: &[Entry],
    p: Option<usize>,
    durable: &dyn Fn(usize, usize) -> bool,
    acked: &HashSet<u64>,
    vers: &HashMap<u64, (u64, u64, u64)>,
    v: &mut Verdict,
) {
    let len = content.len() as u64;
    let mut nsec = len.div_ceil(SECTOR);
    for e in es {
        match e {
            Entry::Write {
                ino: i,
                sector,
                sectors,
                ..
            } if *i == ino => nsec = nsec.max(sector + sectors),
            Entry::Truncate { ino: i, size } if *i == ino => nsec = nsec.max(size.div_ceil(SECTOR)),
            _ => {}
        }
    }
    // Per sector: the versions written since the last durable truncate that cut it
    // (with whether the write was acknowledged), and how many of them an acknowledged
    // barrier put out of reach (the value must be that one's or a later one's).
    let mut hist: Vec<Vec<(u64, bool)>> = vec![Vec::new(); nsec as usize];
    let mut req: Vec<Option<usize>> = vec![None; nsec as usize];
    // Sizes: the model's (from acknowledged writes and truncates), the lower bound the
    // barriers and durable truncates set, and the largest the file had since its last
    // durable truncate down.
    let (mut size, mut lb, mut ub) = (0u64, 0u64, 0u64);
    // After a truncation to zero that is not durable nothing written later can show:
    // it went to blocks only a later (not durable) transaction maps.
    let mut frozen = false;
    let mut unseen: HashSet<u64> = HashSet::new();
    for (i, e) in es.iter().enumerate() {
        match e {
            Entry::Write { ino: w, ver, .. } if *w == ino && frozen => {
                unseen.insert(*ver);
            }
            Entry::Write {
                ino: w,
                sector,
                sectors,
                ver,
                ok,
                ..
            } if *w == ino => {
                for s in *sector..sector + sectors {
                    hist[s as usize].push((*ver, *ok));
                }
                let end = (sector + sectors) * SECTOR;
                ub = ub.max(end);
                if *ok {
                    size = size.max(end);
                }
            }
            Entry::Truncate { ino: t, .. } if *t == ino && frozen => {}
            Entry::Truncate { ino: t, size: to } if *t == ino => {
                let durable = p.is_some_and(|p| durable(i, p));
                if !durable && *to == 0 && p.is_some() {
                    frozen = true;
                }
                if durable {
                    if *to < size {
                        for s in to.div_ceil(SECTOR)..nsec {
                            hist[s as usize].clear();
                            req[s as usize] = None;
                        }
                        lb = lb.min(*to);
                        ub = *to;
                    } else {
                        lb = lb.max(*to);
                        ub = ub.max(*to);
                    }
                } else {
                    ub = ub.max(*to);
                }
                size = *to;
            }
            Entry::BarrierStart { id, kind } if kind.covers(ino) && acked.contains(id) => {
                for s in 0..size.div_ceil(SECTOR) {
                    let h = &hist[s as usize];
                    req[s as usize] = Some(h.iter().rposition(|x| x.1).map_or(0, |k| k + 1));
                }
                lb = lb.max(size);
            }
            _ => {}
        }
    }
    let judged = p.is_some();
    if judged && len > ub {
        v.size_errors += 1;
        v.note(format!(
            "inode {ino}: {len} bytes long, but never longer than {ub} since its last durable truncate"
        ));
    }
    let mut garbage_blocks = BTreeSet::new();
    let mut lost_sectors = Vec::new();
    for s in 0..len.div_ceil(SECTOR) {
        let bytes = &content[(s * SECTOR) as usize..((s + 1) * SECTOR).min(len) as usize];
        let need = if judged { req[s as usize] } else { None };
        let need_data = need.is_some_and(|k| k > 0);
        match classify(bytes) {
            Sector::Zero => {
                if need_data {
                    lost_sectors.push((s, "zeros".to_string()));
                }
            }
            Sector::Written { ino: wi, idx, ver }
                if wi == ino
                    && idx == s
                    && vers
                        .get(&ver)
                        .is_some_and(|&(vi, f, n)| vi == ino && (f..f + n).contains(&s)) =>
            {
                if !judged {
                    continue;
                }
                let at = hist[s as usize].iter().position(|x| x.0 == ver);
                if let Some(k) = need {
                    if k > 0 && at.is_none_or(|a| a + 1 < k) {
                        lost_sectors
                            .push((s, format!("version {ver}, older than the fsynced one")));
                    }
                }
                if unseen.contains(&ver) {
                    v.stale_sectors_exposed += 1;
                    v.note(format!(
                        "inode {ino} sector {s}: version {ver}, written after a truncation to zero that is not durable (old and new content mixed)"
                    ));
                } else if at.is_none() {
                    v.stale_sectors_exposed += 1;
                    v.note(format!(
                        "inode {ino} sector {s}: version {ver}, which a durable truncate had cut away"
                    ));
                }
            }
            other => {
                v.garbage_sectors += 1;
                garbage_blocks.insert(s / 8);
                v.note(format!(
                    "inode {ino} sector {s}: garbage ({})",
                    match other {
                        Sector::Written { ino, idx, ver } =>
                            format!("sector {idx} of inode {ino}, version {ver}"),
                        _ => "bytes no write produced".into(),
                    }
                ));
                if need_data {
                    lost_sectors.push((s, "garbage".into()));
                }
            }
        }
    }
    if judged && lb > len {
        for s in len.div_ceil(SECTOR)..lb.div_ceil(SECTOR) {
            lost_sectors.push((s, "past the end of the file".into()));
        }
        v.note(format!(
            "inode {ino}: {len} bytes long, but {lb} bytes were fsynced"
        ));
    }
    v.garbage_blocks_exposed += garbage_blocks.len() as u64;
    v.fsynced_bytes_lost += lost_sectors.len() as u64 * SECTOR;
    if !lost_sectors.is_empty() {
        let shown: Vec<String> = lost_sectors
            .iter()
            .take(8)
            .map(|(s, what)| format!("{s} ({what})"))
            .collect();
        v.note(format!(
            "inode {ino}: {} fsynced sector(s) lost: {}{}",
            lost_sectors.len(),
            shown.join(", "),
            if lost_sectors.len() > 8 { ", ..." } else { "" }
        ));
    }
}

// ---------------------------------------------------------------------------------
// Where a cut lands: a device between the block layer and the simulated device that
// knows what is inside the device when the power goes.

/// Where on the device a request goes (from the superblock's layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Area {
    Superblock,
    Journal,
    Checkpoint,
    Data,
    Flush,
}

impl Area {
    fn name(self) -> &'static str {
        match self {
            Area::Superblock => "superblock",
            Area::Journal => "journal",
            Area::Checkpoint => "checkpoint",
            Area::Data => "data",
            Area::Flush => "flush",
        }
    }
}

/// Sector ranges of the journal, the checkpoint slots and the data area.
#[derive(Clone, Copy)]
struct Layout {
    journal: (u64, u64),
    ckpt: [(u64, u64); 2],
    data: u64,
}

impl Layout {
    fn of(sb: &Superblock) -> Layout {
        let s = |b: u64| b * (wbstack::fs::format::BLOCK_SIZE as u64 / SECTOR);
        let run = |(start, len): (u64, u64)| (s(start), s(start + len));
        Layout {
            journal: run((sb.journal_start, sb.journal_blocks)),
            ckpt: [run(sb.checkpoint[0]), run(sb.checkpoint[1])],
            data: s(sb.data_start),
        }
    }

    fn area(&self, sector: u64) -> Area {
        let inside = |(a, b): (u64, u64)| (a..b).contains(&sector);
        if sector >= self.data {
            Area::Data
        } else if inside(self.journal) {
            Area::Journal
        } else if self.ckpt.iter().any(|&r| inside(r)) {
            Area::Checkpoint
        } else {
            Area::Superblock
        }
    }
}

struct RqInfo {
    area: Area,
    bytes: u64,
    write: bool,
    fua: bool,
    preflush: bool,
}

/// Requests of one area inside the device at the cut.
#[derive(Clone, Debug, Default, Serialize)]
pub struct InFlight {
    pub requests: u64,
    pub bytes: u64,
}

/// What was going on when the power went.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Landing {
    /// Requests inside the device, by area: superblock, journal, checkpoint, data, flush.
    pub in_flight: BTreeMap<String, InFlight>,
    /// Of those, requests carrying PREFLUSH or FUA (a commit or a checkpoint).
    pub in_flight_preflush_fua: u64,
    /// Writes completed since the last cache flush completed: what a torn cut keeps
    /// part of.
    pub unflushed_writes: u64,
    pub unflushed_bytes: u64,
    /// Requests sent to the device since mkfs, before the cut.
    pub requests_before: u64,
    /// Workload operations started before the cut.
    pub op: u64,
}

impl Landing {
    fn describe(&self) -> String {
        let mut parts: Vec<String> = self
            .in_flight
            .iter()
            .map(|(a, f)| {
                if f.bytes > 0 {
                    format!("{a} {} ({} KiB)", f.requests, f.bytes >> 10)
                } else {
                    format!("{a} {}", f.requests)
                }
            })
            .collect();
        if parts.is_empty() {
            parts.push("nothing in flight".into());
        }
        if self.unflushed_writes > 0 {
            parts.push(format!(
                "unflushed {} ({} KiB)",
                self.unflushed_writes,
                self.unflushed_bytes >> 10
            ));
        }
        parts.join(", ")
    }
}

#[derive(Default)]
struct ProbeState {
    layout: Option<Layout>,
    next_id: u64,
    inflight: BTreeMap<u64, RqInfo>,
    unflushed: (u64, u64),
    landing: Option<Landing>,
    ops: Arc<AtomicU64>,
    /// Cut when the n-th request to this area from now enters the device.
    trigger: Option<(Area, u64)>,
}

impl ProbeState {
    /// The first call after the power went: what is inside the device now is what the
    /// cut hit (later requests fail at once, they were never inside).
    fn snapshot(&mut self) {
        if self.landing.is_some() {
            return;
        }
        let mut l = Landing {
            unflushed_writes: self.unflushed.0,
            unflushed_bytes: self.unflushed.1,
            requests_before: self.next_id,
            op: self.ops.load(Ordering::SeqCst),
            ..Landing::default()
        };
        for r in self.inflight.values() {
            let e = l.in_flight.entry(r.area.name().to_string()).or_default();
            e.requests += 1;
            e.bytes += r.bytes;
            l.in_flight_preflush_fua += (r.fua || r.preflush) as u64;
        }
        self.landing = Some(l);
    }
}

struct Probe {
    inner: DeviceRef,
    st: Arc<Mutex<ProbeState>>,
}

impl Probe {
    fn new(inner: DeviceRef, ops: Arc<AtomicU64>) -> Result<Probe, String> {
        if inner.as_any().downcast_ref::<SimDevice>().is_none() {
            return Err("crashtest needs a simulated device (sim:ssd or sim:hdd)".into());
        }
        Ok(Probe {
            inner,
            st: Arc::new(Mutex::new(ProbeState {
                ops,
                ..ProbeState::default()
            })),
        })
    }

    fn sim(&self) -> &SimDevice {
        self.inner
            .as_any()
            .downcast_ref::<SimDevice>()
            .expect("checked in Probe::new")
    }

    fn set_layout(&self, sb: &Superblock) {
        self.st.lock().layout = Some(Layout::of(sb));
    }

    /// Cut when the `n`-th request from now enters the device (it is torn with the rest).
    fn arm(&self, n: u64) {
        self.sim().power_cut_after(n, true);
    }

    /// Cut when the next request to `area` enters the device (it is torn with the rest).
    fn arm_on(&self, area: Area) {
        self.st.lock().trigger = Some((area, 1));
    }

    fn cut_now(&self) {
        {
            let mut s = self.st.lock();
            s.snapshot();
            // A trigger left armed would cut the recovery (fsck and mount read and write
            // the same areas).
            s.trigger = None;
        }
        self.sim().power_cut(true);
    }

    /// No cut pending any more, whatever was armed.
    fn disarm(&self) {
        self.st.lock().trigger = None;
    }

    fn powered(&self) -> bool {
        self.sim().powered()
    }

    fn landing(&self) -> Landing {
        self.st.lock().landing.clone().unwrap_or_default()
    }
}

impl Device for Probe {
    fn geometry(&self) -> &Geometry {
        self.inner.geometry()
    }
    fn spec(&self) -> &str {
        self.inner.spec()
    }
    fn queue_rq(&self, rq: Request, done: &Completer) {
        let mut fire = false;
        let id = {
            let mut s = self.st.lock();
            let area = match (rq.op, s.layout) {
                (Op::Flush, _) => Area::Flush,
                (_, Some(l)) => l.area(rq.sector),
                (_, None) => Area::Superblock,
            };
            if let Some((a, left)) = s.trigger.as_mut() {
                if *a == area {
                    *left -= 1;
                    if *left == 0 {
                        s.trigger = None;
                        fire = true;
                    }
                }
            }
            let id = s.next_id;
            s.next_id += 1;
            s.inflight.insert(
                id,
                RqInfo {
                    area,
                    bytes: if rq.op == Op::Flush { 0 } else { rq.bytes() },
                    write: rq.op == Op::Write,
                    fua: rq.flags.contains(BioFlags::FUA),
                    preflush: rq.flags.contains(BioFlags::PREFLUSH),
                },
            );
            id
        };
        let d: Completer = Arc::new(ProbeDone {
            st: self.st.clone(),
            id,
            done: done.clone(),
        });
        if fire {
            // This very request is the one inside the device when the power goes.
            self.sim().power_cut_after(1, true);
        }
        self.inner.queue_rq(rq, &d);
    }
    fn commit_rqs(&self, hctx: u16) {
        self.inner.commit_rqs(hctx)
    }
    fn poll(&self, hctx: u16, timeout_ns: u64) -> usize {
        self.inner.poll(hctx, timeout_ns)
    }
    fn can_poll(&self) -> bool {
        self.inner.can_poll()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

struct ProbeDone {
    st: Arc<Mutex<ProbeState>>,
    id: u64,
    done: Completer,
}

impl RqComplete for ProbeDone {
    fn complete(&self, rq: Request, status: BlkResult) {
        {
            let mut s = self.st.lock();
            if matches!(status, Err(BlkError::PowerLoss)) {
                s.snapshot();
            }
            if let Some(r) = s.inflight.remove(&self.id) {
                if status.is_ok() {
                    if r.preflush || r.area == Area::Flush {
                        s.unflushed = (0, 0);
                    }
                    if r.write && !r.fua {
                        s.unflushed.0 += 1;
                        s.unflushed.1 += r.bytes;
                    }
                }
            }
        }
        self.done.complete(rq, status);
    }
}

// ---------------------------------------------------------------------------------
// The workload.

/// How a cut is placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
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

#[derive(Clone, Copy, Debug, Serialize)]
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
enum Kind {
    Create,
    Mkdir,
    Link,
    Unlink,
    Rename,
    RenameOver,
    RenameDir,
    Rmdir,
    Append,
    BigAppend,
    Overwrite,
    Unaligned,
    Truncate,
    Fsync,
    Fdatasync,
    Sync,
    Close,
}

/// The operation mix, in weights.
const MIX: &[(Kind, u32)] = &[
    (Kind::Create, 10),
    (Kind::Mkdir, 2),
    (Kind::Link, 4),
    (Kind::Unlink, 6),
    (Kind::Rename, 5),
    (Kind::RenameOver, 4),
    (Kind::RenameDir, 2),
    (Kind::Rmdir, 1),
    (Kind::Append, 16),
    (Kind::BigAppend, 2),
    (Kind::Overwrite, 8),
    (Kind::Unaligned, 8),
    (Kind::Truncate, 6),
    (Kind::Fsync, 12),
    (Kind::Fdatasync, 4),
    (Kind::Sync, 1),
    (Kind::Close, 4),
];

fn pick_kind(rng: &mut ChaCha8Rng) -> Kind {
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

const MAX_FILES: usize = 48;
const MAX_DIRS: usize = 12;
const FILE_MAX: u64 = 2 << 20;
const BLOCK: u64 = 4096;

struct FileRec {
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
struct Model {
    log: Log,
    root: u64,
    dirs: BTreeMap<u64, BTreeMap<String, u64>>,
    parent: HashMap<u64, (u64, String)>,
    files: BTreeMap<u64, FileRec>,
    names: u64,
    budget: u64,
    unexpected: Vec<String>,
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

struct Ctx {
    vol: Volume,
    probe: Arc<Probe>,
    /// Journal blocks written since mount at which the next commit checkpoints.
    ckpt_at: u64,
    /// The operation at which the cut was armed or made (u64::MAX: not yet).
    placed_at: AtomicU64,
    model: Mutex<Model>,
    next_op: Arc<AtomicU64>,
    versions: AtomicU64,
    ops: u64,
    plan: CutPlan,
}

/// One operation of `kind`; `last` is the file this thread wrote last (applications
/// mostly fsync what they just wrote, which is also what makes fsync commit).
fn do_op(ctx: &Ctx, rng: &mut ChaCha8Rng, kind: Kind, last: &mut Option<u64>) -> FsResult<()> {
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
            let h = m.handle(vol, ino)?;
            let lock = m.files[&ino].lock.clone();
            let start = m.log.len();
            let room = m.budget.saturating_sub(m.live_bytes());
            drop(m);
            *last = Some(ino);
            write(ctx, rng, kind, ino, &h, &lock, start, room)
        }
        Kind::Truncate => {
            let ino = m.pick_file(rng, false).unwrap();
            let h = m.handle(vol, ino)?;
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
            h.set_len(to)?;
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
            if data {
                h.fdatasync()?;
            } else {
                h.fsync()?;
            }
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
            let h = m.files.get_mut(&ino).unwrap().handle.take();
            drop(m);
            // The last close of an unlinked file deletes it.
            drop(h);
            Ok(())
        }
    }
}

fn create(vol: &Volume, m: &mut Model, rng: &mut ChaCha8Rng) -> FsResult<()> {
    let dir = m.pick_dir(rng);
    let name = m.fresh("f");
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
    m.dirs.get_mut(&dir).unwrap().insert(name, ino);
    m.files.insert(
        ino,
        FileRec {
            links: 1,
            handle: Some(Arc::new(f)),
            lock: Arc::new(Mutex::new(0)),
            size: 0,
        },
    );
    Ok(())
}

/// One write of `kind` to `ino`, `room` bytes of budget left.
#[allow(clippy::too_many_arguments)]
fn write(
    ctx: &Ctx,
    rng: &mut ChaCha8Rng,
    kind: Kind,
    ino: u64,
    h: &File,
    lock: &Mutex<u64>,
    start: usize,
    room: u64,
) -> FsResult<()> {
    let mut size = lock.lock();
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
    let r = h.write_at(first * SECTOR, &data);
    let mut m = ctx.model.lock();
    m.log.push(Entry::Write {
        ino,
        sector: first,
        sectors: n,
        ver,
        start,
        ok: r.is_ok(),
    });
    if r.is_ok() {
        *size = (*size).max((first + n) * SECTOR);
        m.files.get_mut(&ino).unwrap().size = *size;
    }
    r.map(|_| ())
}

/// Unexpected errors kept per cut.
const MAX_UNEXPECTED: usize = 20;

fn worker(ctx: Arc<Ctx>, thread: u64, seed: u64) {
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

// ---------------------------------------------------------------------------------
// One cut.

/// What one cut did and found.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CutReport {
    pub cut: u64,
    /// Replays this cut: `--seed SEED --cuts 1` (with the same other flags).
    pub seed: u64,
    pub plan: Option<CutPlan>,
    /// The operation at which the cut was armed or made (None: after the workload).
    pub placed_at: Option<u64>,
    /// Workload operations started (all threads).
    pub ops: u64,
    pub log_entries: usize,
    pub fsyncs_acked: u64,
    pub fdatasyncs_acked: u64,
    pub syncs_acked: u64,
    pub landing: Landing,
    pub journal_commits: u64,
    pub journal_checkpoints: u64,
    pub device_writes: u64,
    pub device_flushes: u64,
    /// Problems of fsck before the mount, of the mounted metadata, and of fsck after
    /// the unmount.
    pub fsck_problems: Vec<String>,
    pub fsck_errors: u64,
    /// fsck's notes before the mount: the checkpoint, the transactions replayed and
    /// why the journal ended there.
    pub fsck_notes: Vec<String>,
    pub mount_error: Option<String>,
    /// Reading the recovered tree failed.
    pub recovery_error: Option<String>,
    pub unexpected_errors: Vec<String>,
    /// The cut did not finish within its time bound (threads left behind).
    pub hang: bool,
    pub verdict: Verdict,
    pub seconds: f64,
}

impl CutReport {
    pub fn failed(&self) -> bool {
        self.hang
            || self.fsck_errors > 0
            || self.mount_error.is_some()
            || self.recovery_error.is_some()
            || !self.unexpected_errors.is_empty()
            || !self.verdict.clean()
    }

    fn reasons(&self) -> String {
        let mut r = Vec::new();
        let v = &self.verdict;
        if self.hang {
            r.push("hang".to_string());
        }
        if let Some(e) = &self.mount_error {
            r.push(format!("mount failed: {e}"));
        }
        if let Some(e) = &self.recovery_error {
            r.push(format!("reading back failed: {e}"));
        }
        if self.fsck_errors > 0 {
            r.push(format!("{} fsck problem(s)", self.fsck_errors));
        }
        if !self.unexpected_errors.is_empty() {
            r.push(format!(
                "{} unexpected error(s)",
                self.unexpected_errors.len()
            ));
        }
        if v.namespace_not_prefix {
            r.push("namespace is no prefix".into());
        }
        if v.fsynced_ops_lost > 0 {
            r.push(format!("{} fsynced op(s) lost", v.fsynced_ops_lost));
        }
        if v.fsynced_bytes_lost > 0 {
            r.push(format!("{} fsynced bytes lost", v.fsynced_bytes_lost));
        }
        if v.garbage_sectors > 0 {
            r.push(format!("{} garbage block(s)", v.garbage_blocks_exposed));
        }
        if v.stale_sectors_exposed > 0 {
            r.push(format!("{} stale sector(s)", v.stale_sectors_exposed));
        }
        if v.size_errors > 0 {
            r.push(format!("{} size error(s)", v.size_errors));
        }
        r.join("; ")
    }
}

/// The options of a run.
#[derive(Clone, Debug)]
pub struct CrashOpts {
    /// sim:ssd or sim:hdd with options; crashtest adds the seed (and size=64M if none).
    pub device: String,
    pub cuts: u64,
    pub seed: u64,
    pub ops: u64,
    pub threads: usize,
    pub rule: FsyncRule,
    /// Mount options on top of crashtest's own (name=value,...).
    pub mount_opts: String,
    pub commit_ms: u64,
    pub progress: bool,
}

impl Default for CrashOpts {
    fn default() -> Self {
        CrashOpts {
            device: "sim:ssd".into(),
            cuts: 20,
            seed: 1,
            ops: 3000,
            threads: 2,
            rule: FsyncRule::Inode,
            mount_opts: String::new(),
            commit_ms: 20,
            progress: false,
        }
    }
}

/// The device spec of the cut with `seed`.
pub fn cut_spec(device: &str, seed: u64) -> Result<String, String> {
    let s = DeviceSpec::parse(device).map_err(|e| e.to_string())?;
    if !matches!(s.kind.as_str(), "sim:ssd" | "sim:hdd") {
        return Err(format!(
            "--device {device}: crashtest cuts the power of a simulated device: use sim:ssd or sim:hdd[,options]"
        ));
    }
    for k in ["seed", "cut_after", "torn"] {
        if s.has(k) {
            return Err(format!(
                "--device {device}: crashtest sets '{k}' itself for every cut (from --seed)"
            ));
        }
    }
    if let Some(d) = s.str_opt("data") {
        if !matches!(d.as_str(), "1" | "on" | "yes" | "true") {
            return Err(format!(
                "--device {device}: crashtest reads every byte back, so the device must keep its data (data=1)"
            ));
        }
    }
    let mut spec = s.raw.clone();
    if !s.has("size") {
        // Small enough that the journal (its minimum, 1 MiB) fills and checkpoints
        // happen during a cut's workload.
        spec.push_str(",size=64M");
    }
    spec.push_str(&format!(",seed={seed}"));
    Ok(spec)
}

/// crashtest's mount options: writeback and commits every few tens of milliseconds and
/// small dirty thresholds, so the cuts find them in flight; then the user's.
pub fn mount_options(o: &CrashOpts) -> Result<MountOptions, String> {
    let mut m = MountOptions {
        commit_interval_ms: o.commit_ms,
        ..MountOptions::default()
    };
    m.wb.dirty_writeback_centisecs = 1;
    m.wb.dirty_expire_centisecs = 3;
    m.wb.dirty.dirty_background_bytes = 256 << 10;
    m.wb.dirty.dirty_bytes = 4 << 20;
    m.parse(&o.mount_opts).map_err(|e| format!("-o: {e}"))?;
    Ok(m)
}

/// Walk the tree from the root and read every regular file.
pub fn recover(v: &Volume) -> FsResult<Recovered> {
    let mut r = Recovered::default();
    let root = v.stat("/")?.ino;
    let mut stack = vec![(String::new(), root)];
    while let Some((path, dino)) = stack.pop() {
        let list = v.readdir(if path.is_empty() { "/" } else { &path })?;
        for e in list {
            let p = format!("{path}/{}", e.name);
            let is_dir = e.kind == InodeKind::Dir;
            r.entries.insert((dino, e.name.clone(), e.ino, is_dir));
            if is_dir {
                stack.push((p, e.ino));
            } else if let std::collections::btree_map::Entry::Vacant(slot) = r.files.entry(e.ino) {
                let f = v.open(&p, &OpenOptions::read())?;
                let mut buf = vec![0u8; f.size() as usize];
                let mut off = 0;
                while off < buf.len() {
                    let n = f.read_at(off as u64, &mut buf[off..])?;
                    if n == 0 {
                        buf.truncate(off);
                        break;
                    }
                    off += n;
                }
                slot.insert(buf);
            }
        }
    }
    Ok(r)
}

/// A cut that has not finished after this long is reported as a hang.
const CUT_LIMIT: Duration = Duration::from_secs(180);

/// Run cut number `index` with `seed` (a fresh filesystem, workload, cut, recovery,
/// checks).
pub fn run_cut(o: &CrashOpts, index: u64, seed: u64) -> CutReport {
    let t0 = Instant::now();
    let mut rep = CutReport {
        cut: index,
        seed,
        ..CutReport::default()
    };
    if let Err(e) = cut_inner(o, seed, &mut rep) {
        rep.mount_error.get_or_insert(e);
    }
    rep.seconds = t0.elapsed().as_secs_f64();
    rep
}

fn cut_inner(o: &CrashOpts, seed: u64, rep: &mut CutReport) -> Result<(), String> {
    let spec = cut_spec(&o.device, seed)?;
    let mopts = mount_options(o)?;
    let plan = CutPlan::new(seed, o.ops);
    rep.plan = Some(plan);
    let cfg = QueueConfig::default();
    let dev = wbstack::dev::open(&spec, cfg.clock.clone()).map_err(|e| e.to_string())?;
    let next_op = Arc::new(AtomicU64::new(0));
    let probe = Arc::new(Probe::new(dev, next_op.clone())?);
    let q = RequestQueue::new(probe.clone(), cfg).map_err(|e| e.to_string())?;
    let sb = Volume::mkfs(
        &q,
        &MkfsOptions {
            fs_id: Some(mix(seed)),
        },
    )
    .map_err(|e| format!("mkfs: {e}"))?;
    probe.set_layout(&sb);
    let vol = Volume::mount(q.clone(), mopts.clone()).map_err(|e| format!("first mount: {e}"))?;
    let root = vol.stat("/").map_err(|e| e.to_string())?.ino;
    let budget = (sb.nr_blocks - sb.data_start) * BLOCK / 3;
    let mut dirs = BTreeMap::new();
    dirs.insert(root, BTreeMap::new());
    let ctx = Arc::new(Ctx {
        vol,
        probe: probe.clone(),
        ckpt_at: sb.journal_blocks * 3 / 4,
        placed_at: AtomicU64::new(u64::MAX),
        model: Mutex::new(Model {
            log: Log::deferring_zero_truncates(mopts.flush_on_close),
            root,
            dirs,
            parent: HashMap::new(),
            files: BTreeMap::new(),
            names: 0,
            budget,
            unexpected: Vec::new(),
        }),
        next_op: next_op.clone(),
        versions: AtomicU64::new(0),
        ops: o.ops,
        plan,
    });
    let handles: Vec<_> = (0..o.threads.max(1) as u64)
        .map(|t| {
            let c = ctx.clone();
            std::thread::Builder::new()
                .name(format!("crash-w{t}"))
                .spawn(move || worker(c, t, seed))
                .map_err(|e| format!("cannot start a workload thread: {e}"))
        })
        .collect::<Result<_, _>>()?;
    for h in handles {
        h.join()
            .map_err(|_| "a workload thread panicked".to_string())?;
    }
    if probe.powered() {
        // End mode, or an armed cut that the workload did not send enough requests to
        // reach: sync, with the cut armed, so it lands inside the sync's IO.
        if ctx.placed_at.load(Ordering::SeqCst) == u64::MAX {
            match plan.mode {
                Mode::Journal => probe.arm_on(Area::Journal),
                Mode::Checkpoint => {}
                _ => probe.arm(plan.n),
            }
        }
        let mut rng = ChaCha8Rng::seed_from_u64(mix(seed ^ 0xe4d));
        if let Err(e) = do_op(&ctx, &mut rng, Kind::Sync, &mut None) {
            if probe.powered() {
                ctx.model.lock().unexpected.push(format!("final sync: {e}"));
            }
        }
        if probe.powered() {
            probe.cut_now();
        }
    }
    rep.ops = next_op.load(Ordering::SeqCst).min(o.ops);
    let placed = ctx.placed_at.load(Ordering::SeqCst);
    rep.placed_at = (placed != u64::MAX).then_some(placed);
    let js = ctx.vol.journal_stats();
    rep.journal_commits = js.commits;
    rep.journal_checkpoints = js.checkpoints;
    let ds = probe.sim().stats();
    rep.device_writes = ds.writes;
    rep.device_flushes = ds.flushes;
    rep.landing = probe.landing();
    let Ok(ctx) = Arc::try_unwrap(ctx) else {
        return Err("the workload context is still shared after its threads ended".into());
    };
    // The machine stops with files still open: nothing is closed or written back.
    ctx.vol.crash();
    let model = ctx.model.into_inner();
    drop(model.files);
    let log = model.log;
    rep.unexpected_errors = model.unexpected;
    rep.log_entries = log.len();
    let kinds: HashMap<u64, Barrier> = log
        .entries
        .iter()
        .filter_map(|e| match e {
            Entry::BarrierStart { id, kind } => Some((*id, *kind)),
            _ => None,
        })
        .collect();
    for e in &log.entries {
        if let Entry::BarrierAck { id } = e {
            match kinds[id] {
                Barrier::Fsync(_) => rep.fsyncs_acked += 1,
                Barrier::Fdatasync(_) => rep.fdatasyncs_acked += 1,
                Barrier::Sync => rep.syncs_acked += 1,
            }
        }
    }
    probe.disarm();
    probe.sim().reboot();

    let before = fsck(&q);
    rep.fsck_notes = before.notes.clone();
    rep.fsck_problems.extend(
        before
            .problems
            .iter()
            .map(|p| format!("fsck before mount: {p}")),
    );
    let v = match Volume::mount(q.clone(), mopts) {
        Ok(v) => v,
        Err(e) => {
            rep.mount_error = Some(e.to_string());
            rep.fsck_errors = rep.fsck_problems.len() as u64;
            return Ok(());
        }
    };
    rep.fsck_problems
        .extend(v.check().into_iter().map(|p| format!("mounted: {p}")));
    match recover(&v) {
        Ok(r) => {
            rep.verdict = check(&log, &r, o.rule);
            if std::env::var_os("CRASHTEST_DEBUG").is_some() && !rep.verdict.clean() {
                for (i, e) in log.entries.iter().enumerate() {
                    eprintln!("log {i}: {e:?}");
                }
                for d in &r.entries {
                    eprintln!("recovered: {d:?}");
                }
                for (i, c) in &r.files {
                    eprintln!("recovered inode {i}: {} bytes", c.len());
                }
                for n in &rep.fsck_notes {
                    eprintln!("fsck: {n}");
                }
            }
        }
        Err(e) => rep.recovery_error = Some(e.to_string()),
    }
    if let Err(e) = v.unmount() {
        rep.fsck_problems
            .push(format!("unmount after recovery: {e}"));
    }
    let after = fsck(&q);
    rep.fsck_problems.extend(
        after
            .problems
            .iter()
            .map(|p| format!("fsck after unmount: {p}")),
    );
    rep.fsck_errors = rep.fsck_problems.len() as u64;
    Ok(())
}

// ---------------------------------------------------------------------------------
// A run of cuts.

/// Cuts by what was inside the device when the power went.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Landed {
    pub journal: u64,
    pub checkpoint: u64,
    pub data: u64,
    pub flush: u64,
    pub superblock: u64,
    /// Nothing inside the device.
    pub idle: u64,
    /// A commit, checkpoint or flush (PREFLUSH/FUA) inside the device.
    pub preflush_fua: u64,
    /// Completed writes not yet flushed from the device's cache.
    pub unflushed: u64,
    /// By how the cut was placed.
    pub mode_io: u64,
    pub mode_now: u64,
    pub mode_fsync: u64,
    pub mode_journal: u64,
    pub mode_checkpoint: u64,
    pub mode_end: u64,
}

/// One line per cut in the JSON: what it did, where it landed, what it found.
#[derive(Clone, Debug, Serialize)]
pub struct CutLine {
    pub cut: u64,
    pub seed: u64,
    pub mode: Option<Mode>,
    pub placed_at: Option<u64>,
    pub landed_at_op: u64,
    pub in_flight: String,
    pub ops: u64,
    pub fsyncs_acked: u64,
    pub commits: u64,
    pub checkpoints: u64,
    pub fsynced_bytes_lost: u64,
    pub garbage_blocks_exposed: u64,
    pub fsck_errors: u64,
    pub ok: bool,
    pub seconds: f64,
}

impl CutLine {
    fn of(r: &CutReport) -> CutLine {
        CutLine {
            cut: r.cut,
            seed: r.seed,
            mode: r.plan.map(|p| p.mode),
            placed_at: r.placed_at,
            landed_at_op: r.landing.op,
            in_flight: r.landing.describe(),
            ops: r.ops,
            fsyncs_acked: r.fsyncs_acked + r.fdatasyncs_acked + r.syncs_acked,
            commits: r.journal_commits,
            checkpoints: r.journal_checkpoints,
            fsynced_bytes_lost: r.verdict.fsynced_bytes_lost,
            garbage_blocks_exposed: r.verdict.garbage_blocks_exposed,
            fsck_errors: r.fsck_errors,
            ok: !r.failed(),
            seconds: r.seconds,
        }
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Summary {
    pub device: String,
    pub seed: u64,
    pub threads: usize,
    pub ops_per_cut: u64,
    pub fsync_rule: Option<FsyncRule>,
    pub cuts: u64,
    pub failed_cuts: u64,
    pub ops: u64,
    pub fsyncs_acked: u64,
    pub fdatasyncs_acked: u64,
    pub syncs_acked: u64,
    pub fsynced_bytes_lost: u64,
    pub garbage_blocks_exposed: u64,
    pub stale_sectors_exposed: u64,
    pub size_errors: u64,
    pub fsck_errors: u64,
    pub mount_failures: u64,
    pub recovery_errors: u64,
    pub namespace_not_prefix: u64,
    pub fsynced_ops_lost: u64,
    pub fsynced_ops_lost_inode_rule: u64,
    pub unexpected_errors: u64,
    pub hangs: u64,
    pub journal_commits: u64,
    pub journal_checkpoints: u64,
    pub landed: Landed,
    pub seconds: f64,
    /// Every cut, in one line.
    pub per_cut: Vec<CutLine>,
    /// Every failed cut, in full.
    pub failures: Vec<CutReport>,
}

impl Summary {
    fn add(&mut self, r: &CutReport) {
        self.cuts += 1;
        self.ops += r.ops;
        self.fsyncs_acked += r.fsyncs_acked;
        self.fdatasyncs_acked += r.fdatasyncs_acked;
        self.syncs_acked += r.syncs_acked;
        let v = &r.verdict;
        self.fsynced_bytes_lost += v.fsynced_bytes_lost;
        self.garbage_blocks_exposed += v.garbage_blocks_exposed;
        self.stale_sectors_exposed += v.stale_sectors_exposed;
        self.size_errors += v.size_errors;
        self.fsck_errors += r.fsck_errors;
        self.mount_failures += r.mount_error.is_some() as u64;
        self.recovery_errors += r.recovery_error.is_some() as u64;
        self.namespace_not_prefix += v.namespace_not_prefix as u64;
        self.fsynced_ops_lost += v.fsynced_ops_lost as u64;
        self.fsynced_ops_lost_inode_rule += v.fsynced_ops_lost_inode_rule as u64;
        self.unexpected_errors += r.unexpected_errors.len() as u64;
        self.hangs += r.hang as u64;
        self.journal_commits += r.journal_commits;
        self.journal_checkpoints += r.journal_checkpoints;
        let l = &r.landing;
        let has = |a: &str| l.in_flight.contains_key(a) as u64;
        let d = &mut self.landed;
        d.journal += has("journal");
        d.checkpoint += has("checkpoint");
        d.data += has("data");
        d.flush += has("flush");
        d.superblock += has("superblock");
        d.idle += l.in_flight.is_empty() as u64;
        d.preflush_fua += (l.in_flight_preflush_fua > 0) as u64;
        d.unflushed += (l.unflushed_writes > 0) as u64;
        match r.plan.map(|p| p.mode) {
            Some(Mode::Io) => d.mode_io += 1,
            Some(Mode::Now) => d.mode_now += 1,
            Some(Mode::Fsync) => d.mode_fsync += 1,
            Some(Mode::Journal) => d.mode_journal += 1,
            Some(Mode::Checkpoint) => d.mode_checkpoint += 1,
            Some(Mode::End) => d.mode_end += 1,
            None => {}
        }
        self.per_cut.push(CutLine::of(r));
        if r.failed() {
            self.failed_cuts += 1;
            self.failures.push(r.clone());
        }
    }
}

fn validate(o: &CrashOpts) -> Result<(), String> {
    if o.cuts == 0 {
        return Err("--cuts must be at least 1".into());
    }
    if o.ops == 0 || o.ops > 1_000_000 {
        return Err(format!("--ops {}: must be from 1 to 1000000", o.ops));
    }
    if o.threads == 0 || o.threads > 64 {
        return Err(format!("--threads {}: must be from 1 to 64", o.threads));
    }
    if o.commit_ms == 0 {
        return Err("--commit-ms must be at least 1".into());
    }
    mount_options(o)?;
    let spec = cut_spec(&o.device, o.seed)?;
    // Every option of the spec is checked by opening it once.
    wbstack::dev::open(&spec, QueueConfig::default().clock).map_err(|e| e.to_string())?;
    Ok(())
}

fn progress_line(r: &CutReport, total: u64) -> String {
    let at = r.placed_at.map_or("end".to_string(), |a| a.to_string());
    let plan = match r.plan {
        Some(p) => match p.mode {
            Mode::Io => format!("io@{at}+{}", p.n),
            Mode::Now => format!("now@{at}"),
            Mode::Fsync => format!("fsync@{at}+{}", p.n),
            Mode::Journal => format!("commit@{at}"),
            Mode::Checkpoint => format!("ckpt@{at}"),
            Mode::End => format!("end+{}", p.n),
        },
        None => "-".into(),
    };
    format!(
        "[{:>4}/{total}] seed {:<6} {:<13} at op {:>4}: {}; {} ops, {} fsyncs, {} commits, {} ckpt  {} ({:.2}s)",
        r.cut + 1,
        r.seed,
        plan,
        r.landing.op,
        r.landing.describe(),
        r.ops,
        r.fsyncs_acked + r.fdatasyncs_acked + r.syncs_acked,
        r.journal_commits,
        r.journal_checkpoints,
        if r.failed() {
            format!("FAIL: {}", r.reasons())
        } else {
            "ok".into()
        },
        r.seconds
    )
}

/// Run every cut; cut i uses seed `o.seed + i`.
pub fn run(o: &CrashOpts) -> Result<Summary, String> {
    validate(o)?;
    let t0 = Instant::now();
    let mut s = Summary {
        device: cut_spec(&o.device, o.seed)?
            .rsplit_once(",seed=")
            .map(|x| x.0.to_string())
            .unwrap_or_default(),
        seed: o.seed,
        threads: o.threads,
        ops_per_cut: o.ops,
        fsync_rule: Some(o.rule),
        ..Summary::default()
    };
    for i in 0..o.cuts {
        let seed = o.seed.wrapping_add(i);
        let (tx, rx) = mpsc::channel();
        let oc = o.clone();
        // The cut runs on its own thread so a hang (a thread of the filesystem or the
        // workload that never returns after the power went) is reported, not waited on.
        std::thread::Builder::new()
            .name(format!("crash-cut{i}"))
            .spawn(move || {
                let _ = tx.send(run_cut(&oc, i, seed));
            })
            .map_err(|e| format!("cannot start a cut thread: {e}"))?;
        let r = match rx.recv_timeout(CUT_LIMIT) {
            Ok(r) => r,
            Err(_) => CutReport {
                cut: i,
                seed,
                plan: Some(CutPlan::new(seed, o.ops)),
                hang: true,
                seconds: CUT_LIMIT.as_secs_f64(),
                ..CutReport::default()
            },
        };
        if o.progress {
            eprintln!("{}", progress_line(&r, o.cuts));
        }
        s.add(&r);
    }
    s.seconds = t0.elapsed().as_secs_f64();
    Ok(s)
}

pub fn print_human(s: &Summary) {
    println!(
        "crashtest: {} cut(s) on {}, {} thread(s), {} operations per cut, seeds {}..{}, fsync rule {}",
        s.cuts,
        s.device,
        s.threads,
        s.ops_per_cut,
        s.seed,
        s.seed + s.cuts.saturating_sub(1),
        match s.fsync_rule {
            Some(FsyncRule::Inode) => "inode",
            _ => "global",
        }
    );
    println!(
        "  workload: {} ops, {} fsyncs + {} fdatasyncs + {} syncs acknowledged, {} commits, {} checkpoints",
        s.ops,
        s.fsyncs_acked,
        s.fdatasyncs_acked,
        s.syncs_acked,
        s.journal_commits,
        s.journal_checkpoints
    );
    let l = &s.landed;
    println!(
        "  placed: after n requests {} / now {} / in an fsync {} / on a commit {} / on a checkpoint {} / at the end {}",
        l.mode_io, l.mode_now, l.mode_fsync, l.mode_journal, l.mode_checkpoint, l.mode_end
    );
    println!(
        "  landed with in flight: journal {}, checkpoint {}, data {}, flush {}, superblock {}; a commit/flush (PREFLUSH|FUA) {}; nothing {}; unflushed writes in the cache {}",
        l.journal, l.checkpoint, l.data, l.flush, l.superblock, l.preflush_fua, l.idle, l.unflushed
    );
    let rows: [(&str, u64); 12] = [
        ("fsynced_bytes_lost", s.fsynced_bytes_lost),
        ("garbage_blocks_exposed", s.garbage_blocks_exposed),
        ("stale_sectors_exposed", s.stale_sectors_exposed),
        ("size_errors", s.size_errors),
        ("fsck_errors", s.fsck_errors),
        ("mount_failures", s.mount_failures),
        ("recovery_errors", s.recovery_errors),
        ("namespace_not_prefix", s.namespace_not_prefix),
        ("fsynced_ops_lost", s.fsynced_ops_lost),
        ("fsynced_ops_lost_inode_rule", s.fsynced_ops_lost_inode_rule),
        ("unexpected_errors", s.unexpected_errors),
        ("hangs", s.hangs),
    ];
    for (k, v) in rows {
        println!("  {k:<28} {v}");
    }
    println!(
        "  failed cuts                  {} of {}   ({:.1}s)",
        s.failed_cuts, s.cuts, s.seconds
    );
    for f in &s.failures {
        println!();
        println!(
            "cut {} FAILED (replay: --seed {} --cuts 1): {}",
            f.cut,
            f.seed,
            f.reasons()
        );
        if let Some(p) = f.plan {
            println!(
                "  placed {:?} at op {} (n={}); landed at op {}: {}",
                p.mode,
                f.placed_at.map_or("end".to_string(), |a| a.to_string()),
                p.n,
                f.landing.op,
                f.landing.describe()
            );
        }
        println!(
            "  prefix {:?} of {} journaled ops (candidates {:?}; required {}, inode rule {})",
            f.verdict.prefix,
            f.verdict.journaled_ops,
            f.verdict.prefix_candidates,
            f.verdict.required_prefix,
            f.verdict.required_prefix_inode_rule
        );
        for n in &f.fsck_notes {
            println!("  fsck: {n}");
        }
        for p in f
            .verdict
            .problems
            .iter()
            .chain(&f.fsck_problems)
            .chain(&f.unexpected_errors)
        {
            println!("  - {p}");
        }
    }
}

/// `wbstack crashtest`: run, print, and return the exit code (0 every cut passed, 1 some
/// failed).
pub fn cli(o: &CrashOpts, json: bool) -> Result<u8, String> {
    let s = run(o)?;
    if json {
        println!("{}", serde_json::to_string(&s).map_err(|e| e.to_string())?);
    } else {
        print_human(&s);
    }
    Ok(if s.failed_cuts > 0 { 1 } else { 0 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use wbstack::block::Bio;
    use wbstack::buf::IoBuf;

    struct Done(Mutex<Vec<BlkResult>>);

    impl RqComplete for Done {
        fn complete(&self, _rq: Request, status: BlkResult) {
            self.0.lock().push(status);
        }
    }

    #[test]
    fn a_cut_disarms_a_trigger_that_never_fired() {
        let dev = wbstack::dev::open("sim:ssd,size=64M", QueueConfig::default().clock).unwrap();
        let probe = Probe::new(dev, Arc::new(AtomicU64::new(0))).unwrap();
        let sb = Superblock::layout(16384, 1, 0).unwrap();
        probe.set_layout(&sb);
        // Armed for a checkpoint write that never comes; the run ends with a cut.
        probe.arm_on(Area::Checkpoint);
        probe.cut_now();
        probe.sim().reboot();
        // Recovery's own checkpoint write must not cut the power again.
        let done = Arc::new(Done(Mutex::new(Vec::new())));
        let c: Completer = done.clone();
        let sector = sb.checkpoint[0].0 * (BLOCK / SECTOR);
        let bio = Bio::write(sector, IoBuf::zeroed(BLOCK as usize));
        probe.queue_rq(Request::from_bio(bio, 1), &c);
        assert!(probe.powered(), "the old trigger cut the recovery");
    }
}
