//! What a crash may and may not do to acknowledged operations: the self-describing
//! sectors, the operation log, and the pure checker.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

pub const SECTOR: u64 = 512;
pub(crate) const MAGIC: &[u8; 8] = b"WBCRASH1";

pub(crate) fn mix(mut z: u64) -> u64 {
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
        /// `stamp()` taken when the write returned; 0: not known. A write logged after
        /// a barrier's start may still have returned before the barrier's call began
        /// (it takes the log's lock afterwards), and then the barrier covers it.
        #[serde(default)]
        done: u64,
    },
    /// `sectors` sectors from sector `sector` overwritten with zeros (a punched hole or
    /// a zeroed range: the volume writes zeros through the page cache, as data).
    Zero {
        ino: u64,
        sector: u64,
        sectors: u64,
        ok: bool,
    },
    /// An fsync / fdatasync / sync was called; `id` pairs it with its ack.
    BarrierStart {
        id: u64,
        kind: Barrier,
        /// `stamp()` taken after this entry was logged, before the call: every write
        /// stamped `done` below it returned before the call began.
        #[serde(default)]
        at: u64,
    },
    /// ... and returned Ok.
    BarrierAck {
        id: u64,
    },
    /// The workload let go of its descriptor of the file: close(2) comes now, or when
    /// the last thread still using the descriptor lets go, never before. Every write
    /// logged before it returned before the close.
    Close {
        ino: u64,
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
        let at = stamp();
        self.push(Entry::BarrierStart { id, kind, at });
        id
    }
    pub fn ack_barrier(&mut self, id: u64) {
        self.push(Entry::BarrierAck { id });
    }

    /// Whether the volume runs with `flush_on_close` (the same option that defers
    /// truncations to zero, and journals one at the next close with the rewrite).
    pub fn flush_on_close(&self) -> bool {
        self.deferred_zero_truncates
    }

    /// Whether `e` is journaled at its place in the log (a deferred truncation to zero
    /// is journaled later, at a point the log does not know).
    pub fn journaled_here(&self, e: &Entry) -> bool {
        e.journaled() && !(self.deferred_zero_truncates && is_zero_truncate(e))
    }
}

/// A process-wide order of events the log cannot order itself (a write's return, a
/// barrier's call), never 0.
pub fn stamp() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
}

pub(crate) fn is_zero_truncate(e: &Entry) -> bool {
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
    /// With `flush_on_close`: bytes of a file's newly allocated data, written before
    /// it was renamed over another name, missing although that rename is durable
    /// (read back older, zeros, garbage, or past the end), and not already counted in
    /// `fsynced_bytes_lost`.
    pub renamed_bytes_lost: u64,
    /// The first problems, in words.
    pub problems: Vec<String>,
}

pub(crate) const MAX_PROBLEMS: usize = 12;
/// Sectors of a page (the volume's block): the unit writeback allocates and writes.
const SECTORS_PER_BLOCK: u64 = 4096 / SECTOR;

impl Verdict {
    pub fn clean(&self) -> bool {
        !self.namespace_not_prefix
            && self.fsynced_ops_lost == 0
            && self.fsynced_bytes_lost == 0
            && self.garbage_sectors == 0
            && self.stale_sectors_exposed == 0
            && self.size_errors == 0
            && self.renamed_bytes_lost == 0
    }

    fn note(&mut self, p: String) {
        if self.problems.len() < MAX_PROBLEMS {
            self.problems.push(p);
        }
    }
}

pub(crate) fn dentry_hash(d: &Dentry) -> u64 {
    let mut h = mix(d.0 ^ mix(d.2 ^ mix(d.3 as u64)));
    for c in d.1.as_bytes().chunks(8) {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        h = mix(h ^ u64::from_le_bytes(w));
    }
    h
}

/// The directory tree as a set of entries, changed by journaled log entries.
pub(crate) struct Tree {
    set: BTreeSet<Dentry>,
    /// Sum of the entries' hashes: equal sets have equal sums, whatever the order.
    hash: u64,
    is_dir: HashMap<u64, bool>,
}

impl Tree {
    pub(crate) fn new() -> Tree {
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
            Entry::BarrierStart { id, kind, .. } if acked.contains(id) => {
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
            check_file(
                log, ino, content, p, &jbefore, &acked, &vers, &zeros, &mut d,
            );
        }
        // In sectors (and files, for sizes), so no kind of violation outweighs another.
        let bad = d.fsynced_bytes_lost / SECTOR
            + d.garbage_sectors
            + d.stale_sectors_exposed
            + d.size_errors
            + d.renamed_bytes_lost / SECTOR;
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
        v.renamed_bytes_lost = d.renamed_bytes_lost;
        for p in d.problems {
            v.note(p);
        }
    }
    v
}

/// What is known of each deferred truncation to zero: whether something proves it
/// durable, and the truncation that would journal it first.
pub(crate) struct ZeroTruncates {
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
                    Entry::BarrierStart { id, kind, .. }
                        if kind.covers(*ino) && acked.contains(id) =>
                    {
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
pub(crate) fn check_file(
    log: &Log,
    ino: u64,
    content: &[u8],
    p: Option<usize>,
    jbefore: &[usize],
    acked: &HashSet<u64>,
    vers: &HashMap<u64, (u64, u64, u64)>,
    zeros: &ZeroTruncates,
    v: &mut Verdict,
) {
    let es = &log.entries;
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
        let foc = log.flush_on_close();
        judge_file(ino, content, es, p, &durable, foc, acked, vers, &mut d);
        let bad = d.fsynced_bytes_lost / SECTOR
            + d.garbage_sectors
            + d.stale_sectors_exposed
            + d.size_errors
            + d.renamed_bytes_lost / SECTOR;
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
        v.renamed_bytes_lost += d.renamed_bytes_lost;
        for n in d.problems {
            v.note(n);
        }
    }
}

/// One reading of one file: `durable(i, p)` says whether the journaled entry (a
/// truncation, a rename) at log index `i` is durable at prefix `p`; `flush_on_close`:
/// the volume's option (auto_da_alloc), whose promises about renames over and
/// truncations to zero then hold.
#[allow(clippy::too_many_arguments)]
pub(crate) fn judge_file(
    ino: u64,
    content: &[u8],
    es: &[Entry],
    p: Option<usize>,
    durable: &dyn Fn(usize, usize) -> bool,
    flush_on_close: bool,
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
            Entry::Zero {
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
    // The latest call stamp of an acknowledged barrier covering the file: a write
    // logged after it that returned before that call began is covered too.
    let mut barrier_at = 0u64;
    // flush_on_close defers a truncation to zero only of a file with data on disk
    // (old extents to keep): certain once an acknowledged barrier wrote some, and no
    // truncation or rename over (whose commit may still wait) came after it. Barriers
    // in flight: (id, whether the file had acknowledged data at their start).
    let mut on_disk = false;
    let mut in_flight: Vec<(u64, bool)> = Vec::new();
    // Set by such a deferred truncation that is durable in this reading: its first
    // resolution is journaled with the data written back before it, so if that is a
    // close, every write before the close is there (old content or new, never empty).
    let mut close_watch = false;
    // flush_on_close's replace promise (fs/flush.rs): the commit of a rename over
    // another name waits for the renamed file's pages that had no block yet or a
    // write in flight; a page rewritten in place over a block already written is
    // started, not waited for. The log cannot see writeback, so what it can tell is
    // newly allocated: a block of a file created in this log, neither truncated nor
    // zeroed since (no block of it was ever freed, or kept for a deferred
    // truncation), can have been written back only after the first write that touched
    // it, so that write's sectors are in the block's first copy, which is either
    // durable before the rename or ordered with it. Later writes to the block may have
    // landed in place: not required. `fresh`: the file is such a file; `first`: by
    // file block, the first write touching it (version, acknowledged, its sectors).
    let mut fresh = false;
    let mut first: BTreeMap<u64, (u64, bool, u64, u64)> = BTreeMap::new();
    // What durable renames over require, as `req` and `lb` for barriers.
    let mut rreq: Vec<Option<usize>> = vec![None; nsec as usize];
    let mut rlb = 0u64;
    // Everything acknowledged so far must be there: an acknowledged barrier, or the
    // close that resolved a durable deferred truncation under flush_on_close.
    let require_all = |hist: &[Vec<(u64, bool)>], req: &mut [Option<usize>], size: u64| {
        for s in 0..size.div_ceil(SECTOR) {
            let h = &hist[s as usize];
            req[s as usize] = Some(h.iter().rposition(|x| x.1).map_or(0, |k| k + 1));
        }
    };
    for (i, e) in es.iter().enumerate() {
        match e {
            Entry::Create { ino: c, .. } if *c == ino => {
                fresh = true;
                first.clear();
            }
            Entry::Write { ino: w, ver, .. } if *w == ino && frozen => {
                unseen.insert(*ver);
            }
            Entry::Write {
                ino: w,
                sector,
                sectors,
                ver,
                ok,
                done,
                ..
            } if *w == ino => {
                let covered = *ok && *done != 0 && *done < barrier_at;
                if fresh {
                    for b in
                        sector / SECTORS_PER_BLOCK..(sector + sectors).div_ceil(SECTORS_PER_BLOCK)
                    {
                        first
                            .entry(b)
                            .or_insert((*ver, *ok, *sector, sector + sectors));
                    }
                }
                for s in *sector..sector + sectors {
                    let h = &mut hist[s as usize];
                    h.push((*ver, *ok));
                    if covered {
                        req[s as usize] = Some(req[s as usize].unwrap_or(0).max(h.len()));
                    }
                }
                let end = (sector + sectors) * SECTOR;
                ub = ub.max(end);
                if *ok {
                    size = size.max(end);
                }
                if covered {
                    lb = lb.max(size);
                }
            }
            Entry::Zero {
                ino: w,
                sector,
                sectors,
                ok,
            } if *w == ino && !frozen => {
                fresh = false;
                // Version 0 is no write's: it stands for the zeros.
                for s in *sector..sector + sectors {
                    hist[s as usize].push((0, *ok));
                }
            }
            Entry::Truncate { ino: t, .. } if *t == ino && frozen => fresh = false,
            Entry::Truncate { ino: t, size: to } if *t == ino => {
                fresh = false;
                let durable = p.is_some_and(|p| durable(i, p));
                let deferred = flush_on_close && *to == 0 && on_disk;
                close_watch = deferred && durable;
                on_disk = false;
                for b in &mut in_flight {
                    b.1 = false;
                }
                if !durable && *to == 0 && p.is_some() {
                    frozen = true;
                }
                if durable {
                    if *to < size {
                        for s in to.div_ceil(SECTOR)..nsec {
                            hist[s as usize].clear();
                            req[s as usize] = None;
                            rreq[s as usize] = None;
                        }
                        lb = lb.min(*to);
                        rlb = rlb.min(*to);
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
            Entry::BarrierStart { id, kind, at } if kind.covers(ino) => {
                // Any fsync of the file resolves a deferred truncation first.
                close_watch = false;
                if acked.contains(id) {
                    require_all(&hist, &mut req, size);
                    lb = lb.max(size);
                    barrier_at = barrier_at.max(*at);
                    let data = hist.iter().any(|h| h.iter().any(|x| x.1 && x.0 != 0));
                    in_flight.push((*id, data));
                }
            }
            Entry::BarrierAck { id } => {
                if let Some(k) = in_flight.iter().position(|b| b.0 == *id) {
                    on_disk |= in_flight.swap_remove(k).1;
                }
            }
            Entry::Close { ino: c } if *c == ino && close_watch => {
                close_watch = false;
                require_all(&hist, &mut req, size);
                lb = lb.max(size);
            }
            Entry::Rename {
                ino: r,
                victim: Some(_),
                ..
            } if *r == ino && flush_on_close => {
                if fresh && p.is_some_and(|p| durable(i, p)) {
                    // Writes logged before the rename returned before its call (it is
                    // logged under the log's lock held across the call); a write logged
                    // after it raced it or came after, and is not required.
                    for (&b, &(ver, ok, from, to)) in &first {
                        if !ok {
                            // Which of its pages reached the cache is unknown.
                            continue;
                        }
                        let block = b * SECTORS_PER_BLOCK..(b + 1) * SECTORS_PER_BLOCK;
                        for s in from.max(block.start)..to.min(block.end) {
                            if let Some(k) = hist[s as usize].iter().position(|x| x.0 == ver) {
                                let r = &mut rreq[s as usize];
                                *r = Some(r.unwrap_or(0).max(k + 1));
                                rlb = rlb.max((s + 1) * SECTOR);
                            }
                        }
                    }
                }
                // It resolves a deferred truncation itself, and until its commit a
                // truncation is journaled at once, not deferred.
                close_watch = false;
                on_disk = false;
                for b in &mut in_flight {
                    b.1 = false;
                }
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
    let mut renamed_lost: Vec<(u64, String)> = Vec::new();
    for s in 0..len.div_ceil(SECTOR) {
        let bytes = &content[(s * SECTOR) as usize..((s + 1) * SECTOR).min(len) as usize];
        let need = if judged { req[s as usize] } else { None };
        let need_data = need.is_some_and(|k| k > 0);
        let class = classify(bytes);
        let lost_before = lost_sectors.len();
        match class {
            Sector::Zero => {
                // Zeros are what a zeroing at or after the required one left, or what
                // nothing required.
                let at = hist[s as usize].iter().rposition(|x| x.0 == 0);
                if need.is_some_and(|k| k > 0 && at.is_none_or(|a| a + 1 < k)) {
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
        let rneed = if judged { rreq[s as usize] } else { None };
        if let Some(k) = rneed.filter(|&k| k > 0 && lost_sectors.len() == lost_before) {
            let h = &hist[s as usize];
            let short = match class {
                Sector::Zero => h
                    .iter()
                    .rposition(|x| x.0 == 0)
                    .is_none_or(|a| a + 1 < k)
                    .then(|| "zeros".to_string()),
                Sector::Written { ino: wi, idx, ver } if wi == ino && idx == s => h
                    .iter()
                    .position(|x| x.0 == ver)
                    .is_none_or(|a| a + 1 < k)
                    .then(|| format!("version {ver}, older than the one written before")),
                _ => Some("garbage".into()),
            };
            if let Some(why) = short {
                renamed_lost.push((s, why));
            }
        }
    }
    if judged && rlb > len {
        // Sectors past the end the barriers' rule did not already count.
        for s in len.max(lb).div_ceil(SECTOR)..rlb.div_ceil(SECTOR) {
            renamed_lost.push((s, "past the end of the file".into()));
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
    v.renamed_bytes_lost += renamed_lost.len() as u64 * SECTOR;
    if !renamed_lost.is_empty() {
        let shown: Vec<String> = renamed_lost
            .iter()
            .take(8)
            .map(|(s, what)| format!("{s} ({what})"))
            .collect();
        v.note(format!(
            "inode {ino}: {} sector(s) written before a durable rename over another name (flush_on_close) lost: {}{}",
            renamed_lost.len(),
            shown.join(", "),
            if renamed_lost.len() > 8 { ", ..." } else { "" }
        ));
    }
}
