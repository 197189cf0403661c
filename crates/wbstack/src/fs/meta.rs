//! The filesystem's durable metadata model: every inode, directory entry and extent, the
//! orphan list and the allocator, changed only by [`Meta::apply`] of journal records.
//!
//! The same `apply` runs live (an operation logs a record and applies it at once) and at
//! mount (replaying the journal after the checkpoint), so the state recovery rebuilds is
//! the state the running filesystem had, by construction. The one difference between the
//! two is the allocator's side of a record: live, `MapExtent`'s blocks were already
//! allocated at writeback and frees are deferred until the transaction commits; on replay
//! the blocks are taken from (and given back to) the free map directly.
//!
//! Nothing here does IO. Every inconsistency comes back as a [`MetaError`] in plain
//! words, never a panic: the same code checks images for `fsck`.

use super::alloc::{AllocError, Allocator, FreeSpace};
use super::dir::{name_hash, Dir};
use super::extents::ExtentMap;
use super::format::{FormatError, InodeKind, Reader, Record, Writer, BLOCK_SIZE};
use super::inodes::{InodeSource, Inodes, MetaCacheStats, Read};
use super::metatree::SpaceRecord;
use rustc_hash::FxHashMap;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

pub const ROOT_INO: u64 = 1;
/// Directory-entry names are at most this long (NAME_MAX).
pub const NAME_MAX: usize = 255;
/// A symlink target is at most one block (PATH_MAX-like).
pub const TARGET_MAX: usize = BLOCK_SIZE;
/// The largest file size (the kernel's MAX_LFS_FILESIZE, i64::MAX): offsets past it
/// do not fit the VFS's loff_t, and byte arithmetic on sizes stays far from overflow.
pub const MAX_FILE_SIZE: u64 = i64::MAX as u64;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct MetaError(pub String);

impl From<AllocError> for MetaError {
    fn from(e: AllocError) -> Self {
        MetaError(e.to_string())
    }
}

impl From<FormatError> for MetaError {
    fn from(e: FormatError) -> Self {
        MetaError(e.to_string())
    }
}

fn bad<T>(m: String) -> Result<T, MetaError> {
    Err(MetaError(m))
}

/// One inode as it is on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inode {
    pub kind: InodeKind,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Directory entries naming it (for a directory: 1, the entry in its parent).
    pub links: u32,
    /// On-disk size: bytes of the file whose data is known written.
    pub size: u64,
    pub atime_ns: u64,
    pub mtime_ns: u64,
    pub ctime_ns: u64,
    /// file block -> (device block, length), non-overlapping; adjacent runs merged.
    pub extents: ExtentMap,
    /// Directories: name -> inode, in readdir (name hash) order.
    pub entries: Dir,
    /// Symlinks: the target.
    pub target: Vec<u8>,
    /// Directories: the directory holding its entry (the root is its own parent).
    pub parent: u64,
    /// Directories: entries that are directories (derived; keeps nlink O(1)).
    pub subdirs: u32,
    /// Device nodes: the device number (the kernel's new_encode_dev).
    pub rdev: u32,
    /// Extended attributes, full names ("user.x") to values.
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
}

impl Inode {
    fn new(kind: InodeKind, mode: u32, uid: u32, gid: u32, t: u64) -> Inode {
        Inode {
            kind,
            mode,
            uid,
            gid,
            links: 0,
            size: 0,
            atime_ns: t,
            mtime_ns: t,
            ctime_ns: t,
            extents: ExtentMap::new(),
            entries: Dir::new(),
            target: Vec::new(),
            parent: 0,
            subdirs: 0,
            rdev: 0,
            xattrs: BTreeMap::new(),
        }
    }

    /// An inode read back from the metadata tree (times and the rest set by the caller).
    pub(super) fn new_loaded(kind: InodeKind, mode: u32, uid: u32, gid: u32) -> Inode {
        Inode::new(kind, mode, uid, gid, 0)
    }

    /// Bytes this inode adds to the image's extras section (v2: rdev and xattrs).
    fn extra_bytes(&self) -> u64 {
        if self.rdev == 0 && self.xattrs.is_empty() {
            return 0;
        }
        8 + 4
            + 4
            + self
                .xattrs
                .iter()
                .map(|(n, v)| 8 + n.len() as u64 + v.len() as u64)
                .sum::<u64>()
    }

    pub fn is_dir(&self) -> bool {
        self.kind == InodeKind::Dir
    }

    /// Blocks mapped (allocated and journaled).
    pub fn blocks(&self) -> u64 {
        self.extents.values().map(|e| e.1).sum()
    }

    /// The device block holding file block `fb`, if mapped.
    pub fn lookup_block(&self, fb: u64) -> Option<u64> {
        let (&f, &(s, l)) = self.extents.range(..=fb).next_back()?;
        (fb - f < l).then(|| s + (fb - f))
    }

    /// The mapped run containing file block `fb`: (device block of fb, blocks left in it).
    pub fn mapped_run(&self, fb: u64) -> Option<(u64, u64)> {
        let (&f, &(s, l)) = self.extents.range(..=fb).next_back()?;
        (fb - f < l).then(|| (s + (fb - f), l - (fb - f)))
    }

    /// The first mapped file block at or after `fb`.
    pub fn next_mapped(&self, fb: u64) -> Option<u64> {
        if self.lookup_block(fb).is_some() {
            return Some(fb);
        }
        self.extents.range(fb..).next().map(|(&f, _)| f)
    }

    /// What `stat` reports as nlink: a directory counts its own `.` and every
    /// subdirectory's `..`.
    pub fn nlink(&self) -> u32 {
        if self.is_dir() {
            self.links + 1 + self.subdirs
        } else {
            self.links
        }
    }
}

/// Whose allocator side a record takes (see the module comment).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApplyMode {
    /// Journal replay or fsck: allocations and frees act on the free map at once.
    Replay,
    /// A running filesystem logging into transaction `tid`: `MapExtent` blocks were
    /// allocated already; frees wait until `tid` commits.
    Live { tid: u64 },
}

/// The whole durable metadata.
#[derive(Clone, Debug)]
pub struct Meta {
    /// Every inode, or on a mounted format 4 volume those in use and those changed
    /// since the last durable checkpoint (`fs::inodes`). Boxed: the map's buckets are
    /// sized in powers of two above the count, and an inline inode would spend its full
    /// size on every empty bucket; and a box stays put while the map grows under a
    /// shared borrow.
    inodes: Inodes,
    /// Inodes that exist, in memory or not.
    nr_inodes: u64,
    pub next_ino: u64,
    pub orphans: BTreeSet<u64>,
    pub alloc: Allocator,
    /// Encoded size of the checkpoint image less its free extents, kept up to date so an
    /// operation that would make it outgrow its slot is refused up front instead of
    /// jamming the journal.
    image_bytes: ImageBytes,
    /// What `apply` changed since `take_changes`, when tracked (`track_changes`): what
    /// an incremental checkpoint writes into the metadata tree (`fs::metatree`).
    changes: Option<Box<Changes>>,
    /// Blocks the metadata tree's durable nodes take (format 4): used, like extents,
    /// by "inode 0". Unknown (empty, not kept) on a volume mounted without reading the
    /// tree whole (`tree_blocks_known`).
    pub tree_blocks: BTreeSet<u64>,
    pub tree_blocks_known: bool,
    /// Format 5: the free space of the state this metadata describes (the data area
    /// less every extent and every durable node of the tree), which a checkpoint
    /// records so mount need not derive it from every extent. The allocator's map
    /// differs: blocks of writes in flight are taken there and free here, and frees
    /// wait there for their transaction's commit.
    view: Option<FreeSpace>,
    /// The seed of directory entries' name hashes (the volume's fs_id): their order and
    /// readdir cookies, and the metadata tree's dirent keys.
    pub name_seed: u64,
    /// Checkpoints that took their changes (`take_checkpoint_changes`) and have not yet
    /// taken their nodes' blocks, by generation, with the blocks they may need: still
    /// kept from writes (`checkpoint_need_blocks`), since their changes no longer count
    /// in `open_changed`.
    capturing: Vec<CapturingNeed>,
}

/// A checkpoint between taking its changes and taking its nodes' blocks: its
/// changes' generation and the node blocks it may need.
#[derive(Clone, Copy, Debug)]
struct CapturingNeed {
    gen: u64,
    blocks: u64,
}

/// The encoded size of the whole-metadata image less its free extents (formats up to
/// 3, whose checkpoint slot bounds it); not kept (None) for a volume whose inodes are
/// read on demand, which has no such image and does not know every inode's size.
#[derive(Clone, Copy, Debug)]
struct ImageBytes(Option<u64>);

impl ImageBytes {
    fn add(&mut self, n: u64) {
        if let Some(b) = &mut self.0 {
            *b += n;
        }
    }

    fn sub(&mut self, n: u64) {
        if let Some(b) = &mut self.0 {
            *b -= n;
        }
    }
}

/// The keys of the durable state that records changed: each names a piece of metadata
/// whose current value (or absence) the next checkpoint writes. Noted by appending,
/// repeats and all: every record of a running filesystem notes something here, under
/// `st`, and a sorted set's insert (with a name's comparisons through its heap
/// pointer) cost creates more than the rest of the checkpoint. `metatree::capture` sorts
/// and drops repeats once, at the checkpoint.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// An inode's own fields (kind, mode, owner, links, size, times, rdev).
    pub inodes: Vec<u64>,
    /// (inode, file block) of an extent.
    pub extents: Vec<(u64, u64)>,
    /// (directory, name) of an entry.
    pub dirents: Vec<(u64, Vec<u8>)>,
    pub targets: Vec<u64>,
    /// (inode, name) of an extended attribute.
    pub xattrs: Vec<(u64, Vec<u8>)>,
    pub orphans: Vec<u64>,
    /// Inodes deleted: every key of theirs goes.
    pub deleted: Vec<u64>,
    /// The generation of the inode cache these changes go out as (`fs::inodes`): once
    /// a checkpoint holding them is durable, their inodes may be dropped.
    pub gen: u64,
}

impl Changes {
    /// Add `o`'s keys to these.
    pub fn append(&mut self, mut o: Changes) {
        self.inodes.append(&mut o.inodes);
        self.extents.append(&mut o.extents);
        self.dirents.append(&mut o.dirents);
        self.targets.append(&mut o.targets);
        self.xattrs.append(&mut o.xattrs);
        self.orphans.append(&mut o.orphans);
        self.deleted.append(&mut o.deleted);
    }

    pub fn is_empty(&self) -> bool {
        *self
            == Changes {
                gen: self.gen,
                ..Changes::default()
            }
    }
}

// ino, kind, mode/uid/gid/links, size and three times, then the extent count, entry
// count and target length prefixes.
const INODE_FIXED_BYTES: u64 = 8 + 1 + 4 * 4 + 8 * 4 + 4 + 4 + 4;
const FREE_EXTENT_BYTES: u64 = 16;
const EXTENT_BYTES: u64 = 24;
const ENTRY_FIXED_BYTES: u64 = 4 + 8;

impl Meta {
    /// A fresh filesystem: the root directory and every data block free.
    pub fn mkfs(data_start: u64, nr_blocks: u64, now_ns: u64, name_seed: u64) -> Meta {
        let mut root = Inode::new(InodeKind::Dir, 0o755, 0, 0, now_ns);
        root.links = 1;
        root.parent = ROOT_INO;
        let mut m = Meta::with_space(
            FxHashMap::from_iter([(ROOT_INO, Box::new(root))]),
            ROOT_INO + 1,
            BTreeSet::new(),
            FreeSpace::new(data_start, nr_blocks),
            BTreeSet::new(),
            name_seed,
        );
        m.image_bytes = ImageBytes(Some(m.image_bytes_without_free()));
        m
    }

    /// What the checkpoint image of this state takes but for its free extents,
    /// counted without encoding it (a format 4 mount of a million inodes would
    /// otherwise encode 100 MB only to learn its size).
    fn image_bytes_without_free(&mut self) -> u64 {
        // next_ino and the counts of inodes, orphans, free extents and extras.
        let counts = 5 * 8;
        let inodes: u64 = self
            .inodes
            .all_resident()
            .values()
            .map(|i| {
                INODE_FIXED_BYTES
                    + i.extents.len() as u64 * EXTENT_BYTES
                    + i.entries
                        .iter()
                        .map(|(n, _)| ENTRY_FIXED_BYTES + n.len() as u64)
                        .sum::<u64>()
                    + i.target.len() as u64
                    + i.extra_bytes()
            })
            .sum();
        let n = counts + inodes + self.orphans.len() as u64 * 8;
        debug_assert_eq!(
            n,
            self.encode_image().len() as u64 - self.free_bytes(),
            "the image size counted is not the encoded size"
        );
        n
    }

    /// The metadata of these parts over this free space, nothing reserved, deferred or
    /// tracked; the caller sets `image_bytes`.
    fn with_space(
        inodes: FxHashMap<u64, Box<Inode>>,
        next_ino: u64,
        orphans: BTreeSet<u64>,
        space: FreeSpace,
        tree_blocks: BTreeSet<u64>,
        name_seed: u64,
    ) -> Meta {
        Meta {
            nr_inodes: inodes.len() as u64,
            inodes: Inodes::new(inodes),
            next_ino,
            orphans,
            alloc: Allocator::new(space),
            image_bytes: ImageBytes(Some(0)),
            changes: None,
            tree_blocks,
            tree_blocks_known: true,
            view: None,
            name_seed,
            capturing: Vec::new(),
        }
    }

    fn free_bytes(&self) -> u64 {
        self.alloc.space().nr_extents() as u64 * FREE_EXTENT_BYTES
    }

    /// The size of the checkpoint image this state encodes to (exact but for the count
    /// of free extents, which the allocator's map approximates).
    pub fn image_bytes(&self) -> u64 {
        self.image_bytes.0.unwrap_or(0) + self.free_bytes()
    }

    /// Inode `ino` (read back from the metadata tree if it is not in memory).
    pub fn get(&self, ino: u64) -> Result<&Inode, MetaError> {
        self.find(ino)?
            .ok_or_else(|| MetaError(format!("inode {ino} does not exist")))
    }

    /// Inode `ino`, or none if it does not exist; an error only if reading it back
    /// failed.
    pub fn find(&self, ino: u64) -> Result<Option<&Inode>, MetaError> {
        if ino >= self.next_ino {
            // Never created (and a read of the tree for every create would cost more
            // than the create).
            return Ok(self.inodes.resident(ino));
        }
        self.inodes.fetch(ino)
    }

    /// Inode `ino` for a change made in place, not through `apply` (sizes and times
    /// a transaction restates at its close): it stays in memory until a checkpoint
    /// holds it.
    pub fn find_mut(&mut self, ino: u64) -> Result<Option<&mut Inode>, MetaError> {
        self.inodes.fetch_mut(ino)
    }

    /// Inode `ino` if it is in memory, without IO: for inodes in use (open, with pages
    /// or IO in flight), which are never dropped.
    pub fn resident(&self, ino: u64) -> Option<&Inode> {
        self.inodes.resident(ino)
    }

    /// Inode `ino` for a change in place, if it is in memory (no IO): for inodes in
    /// use, which are never dropped.
    pub fn resident_mut(&mut self, ino: u64) -> Option<&mut Inode> {
        self.inodes.resident_mut(ino)
    }

    /// `resident` and the allocator together (writeback maps an inode's pages while
    /// it allocates).
    pub fn resident_with_alloc(&mut self, ino: u64) -> (Option<&Inode>, &mut Allocator) {
        (self.inodes.resident(ino), &mut self.alloc)
    }

    fn get_mut(&mut self, ino: u64) -> Result<&mut Inode, MetaError> {
        self.find_mut(ino)?
            .ok_or_else(|| MetaError(format!("inode {ino} does not exist")))
    }

    /// How many inodes exist.
    pub fn nr_inodes(&self) -> u64 {
        self.nr_inodes
    }

    /// The inodes in memory: every inode unless the cache reads them back on demand
    /// (`load_all` first for a walk of them all).
    /// Read only: an inode changes through `find_mut`/`resident_mut`, which note the
    /// change first (`fs::cowcapture`).
    pub fn resident_inodes(&self) -> &FxHashMap<u64, Box<Inode>> {
        self.inodes.all_resident()
    }

    /// From now on inodes may be dropped from memory (`evict`) and are read back from
    /// `source` on demand.
    pub fn set_source(&mut self, source: Arc<dyn InodeSource>) {
        self.inodes.set_source(source);
    }

    /// The checkpoint of generation `gen` is durable.
    pub fn gen_durable(&mut self, gen: u64) {
        self.inodes.durable(gen);
    }

    /// Drop clean inodes not `pinned` until `keep` are in memory, examining at most
    /// `budget`; the ones dropped.
    /// Whether an `evict` to `keep` has anything to try (a prune skips its locks if not).
    pub fn wants_evict(&self, keep: usize) -> bool {
        self.inodes.wants_evict(keep)
    }

    pub fn evict(&mut self, keep: usize, pinned: &dyn Fn(u64) -> bool) -> Vec<u64> {
        self.inodes.evict(keep, pinned)
    }

    pub fn cache_stats(&self) -> MetaCacheStats {
        self.inodes.stats()
    }

    /// Inodes changed since the last checkpoint took its changes (`Inodes::open_changed`).
    pub fn open_changed(&self) -> usize {
        self.inodes.open_changed()
    }

    /// Blocks checkpoints may need for tree nodes, all at once (the nodes they replace
    /// are freed only once their root is durable): the next one's (`open_need_blocks`),
    /// and those of checkpoints that took their changes but not yet their nodes' blocks.
    pub fn checkpoint_need_blocks(&self) -> u64 {
        let capturing: u64 = self.capturing.iter().map(|c| c.blocks).sum();
        self.open_need_blocks() + capturing
    }

    /// The node blocks a checkpoint of the changes not yet taken may need: a leaf for
    /// each inode changed since the last one, as scattered updates (chmod, touch) of
    /// inodes far apart cost, a parent per 64 of those, and the root's path. The
    /// journal does not bound this: a 66-byte restatement can dirty a whole leaf.
    /// Creates cost less (new inodes and their entries share leaves); an inode whose
    /// entries or extents span many leaves, changed all over, could cost more.
    fn open_need_blocks(&self) -> u64 {
        const ROOT_PATH_NODES: u64 = 32;
        if self.changes.is_none() {
            // No tree (format 3's image goes to its fixed slot).
            return 0;
        }
        let leaves = self.open_changed() as u64;
        leaves + leaves / 64 + ROOT_PATH_NODES
    }

    /// `take_changes` for a checkpoint of the running volume: the blocks its nodes may
    /// need stay kept from writes until it took them (`checkpoint_nodes_taken`). Once
    /// the changes were taken, `open_changed` no longer counted them, and writes could
    /// take the blocks the checkpoint was about to need: under load, a checkpoint
    /// slow to reach its node allocation found the volume full and failed it.
    pub fn take_checkpoint_changes(&mut self) -> Changes {
        let blocks = self.open_need_blocks();
        let c = self.take_changes();
        self.capturing.push(CapturingNeed { gen: c.gen, blocks });
        c
    }

    /// The checkpoint of generation `gen` took its nodes' blocks (or failed to): its
    /// need is no longer kept from writes.
    pub fn checkpoint_nodes_taken(&mut self, gen: u64) {
        let at = self.capturing.iter().position(|c| c.gen == gen);
        debug_assert!(
            at.is_some(),
            "checkpoint {gen} took nodes it never asked room for"
        );
        if let Some(i) = at {
            self.capturing.remove(i);
        }
    }

    /// From now on keep the free space of the described state (`view`), starting from
    /// the allocator's map, which is that space when nothing is in flight (mkfs, and
    /// a mount before replay).
    pub fn keep_view(&mut self) {
        self.view = Some(self.alloc.space().clone());
    }

    /// What a format 5 checkpoint records of this state (none before format 5).
    pub fn space_record(&self) -> Option<SpaceRecord> {
        self.view.as_ref().map(|v| SpaceRecord {
            nr_inodes: self.nr_inodes,
            free: v.extents().collect(),
        })
    }

    /// Tree nodes took `blocks` (`checkpoint::alloc_nodes`).
    pub(super) fn nodes_taken(&mut self, blocks: &[u64]) -> Result<(), MetaError> {
        for &b in blocks {
            if self.tree_blocks_known {
                let fresh = self.tree_blocks.insert(b);
                debug_assert!(fresh, "tree block {b} handed out twice");
            }
            if let Some(v) = &mut self.view {
                v.alloc_exact(b, 1)?;
            }
        }
        Ok(())
    }

    /// Tree nodes gave `blocks` back (their new root is durable).
    pub(super) fn nodes_freed(&mut self, blocks: &[u64]) -> Result<(), MetaError> {
        for &b in blocks {
            if self.tree_blocks_known && !self.tree_blocks.remove(&b) {
                return bad(format!("tree block {b} freed but not in use by the tree"));
            }
            if let Some(v) = &mut self.view {
                v.free(b, 1)?;
            }
            self.alloc.free(b, 1)?;
        }
        Ok(())
    }

    /// Whether inodes are read on demand (and may leave memory).
    pub fn is_lazy(&self) -> bool {
        self.inodes.is_lazy()
    }

    /// Whether `ino` was changed (or deleted) since the last durable checkpoint.
    pub fn is_changed(&self, ino: u64) -> bool {
        self.inodes.is_changed(ino)
    }

    /// The inodes asked for but not in memory since the last call (`fs::inodes`).
    pub fn take_misses(&mut self) -> Vec<u64> {
        self.inodes.take_misses()
    }

    pub fn clear_misses(&self) {
        self.inodes.clear_misses();
    }

    /// The cold directory groups missed since the last call (`fs::dir`).
    pub fn take_dir_misses(&mut self) -> Vec<super::inodes::DirMiss> {
        self.inodes.take_dir_misses()
    }

    /// Install directory groups read back; false if the durable root moved on since.
    pub fn install_dirents(
        &mut self,
        read: super::inodes::DirentsRead,
        asked: &[super::inodes::DirMiss],
    ) -> Result<bool, super::error::FsError> {
        self.inodes.install_dirents(read, asked)
    }

    /// Keep every directory's resident groups resident (a walk of every entry), or
    /// let them go cold again.
    pub fn hold_dirs(&mut self, hold: bool) {
        self.inodes.hold_dirs(hold);
    }

    /// Hold the directories of `misses` not in `held` yet (`Inodes::hold_dir`), and
    /// add them to it: an operation about to read their groups back keeps them, and
    /// their known ranges, until it ran again and calls `release_dirs(held)`.
    pub fn hold_dirs_missed(&mut self, misses: &[super::inodes::DirMiss], held: &mut Vec<u64>) {
        for m in misses {
            if !held.contains(&m.dir) {
                self.inodes.hold_dir(m.dir, true);
                held.push(m.dir);
            }
        }
    }

    /// Let go of the directories `hold_dirs_missed` held.
    pub fn release_dirs(&mut self, held: &[u64]) {
        for &dir in held {
            self.inodes.hold_dir(dir, false);
        }
    }

    /// Every directory in memory with cold groups, each with its whole range of hashes.
    pub fn cold_dirs(&self) -> Vec<super::inodes::DirMiss> {
        self.inodes
            .all_resident()
            .iter()
            .filter_map(|(&dir, i)| {
                i.entries
                    .all_resident()
                    .err()
                    .map(|cold| super::inodes::DirMiss { dir, cold })
            })
            .collect()
    }

    /// Send directories' clean groups of entries cold, when due (`Inodes::shrink_dirs`).
    pub fn shrink_dirs(&mut self) -> usize {
        self.inodes.shrink_dirs()
    }

    pub fn has_misses(&self) -> bool {
        self.inodes.has_misses()
    }

    /// Where inodes not in memory are read back from (none: all are in memory).
    pub fn source(&self) -> Option<Arc<dyn InodeSource>> {
        self.inodes.source()
    }

    /// Keep `inos` in memory until `unpin` (an operation about to run again).
    pub fn pin(&mut self, inos: &[u64]) {
        self.inodes.pin(inos);
    }

    pub fn unpin(&mut self, inos: &[u64]) {
        self.inodes.unpin(inos);
    }

    /// Install inodes read back; false if the durable root moved on since the read.
    pub fn install(
        &mut self,
        read: Read,
        asked: Option<&[u64]>,
    ) -> Result<bool, super::error::FsError> {
        let space = self.alloc.space();
        self.inodes
            .install(read, asked, |ino, i| read_back_sound(space, ino, i))
    }

    /// Record from now on which keys `apply` changes (off: nothing is kept).
    pub fn track_changes(&mut self, on: bool) {
        self.changes = on.then(Box::default);
    }

    /// Start copying out `changes` (just taken) by copy on write (`fs::cowcapture`);
    /// a volume whose inodes are not a cache (nothing stamps their changes) captures
    /// them at once instead (`metatree::capture`).
    pub fn begin_capture(&mut self, changes: Changes) -> Option<super::metatree::Captured> {
        if !self.inodes.is_lazy() {
            return Some(super::metatree::capture(self, changes));
        }
        let p = super::cowcapture::PendingCapture::new(self, changes);
        self.inodes.begin_capture(p);
        None
    }

    /// `Inodes::capture_step`.
    pub fn capture_step(&mut self, max: usize) -> bool {
        self.inodes.capture_step(max)
    }

    /// `Inodes::capture_changes`.
    pub fn capture_changes(&self) -> Option<(u64, std::sync::Arc<Changes>)> {
        self.inodes.capture_changes()
    }

    /// `Inodes::capture_set_inodes`.
    pub fn capture_set_inodes(&mut self, gen: u64, inodes: Vec<u64>) {
        self.inodes.capture_set_inodes(gen, inodes)
    }

    /// `Inodes::take_capture`.
    pub fn take_capture(&mut self) -> Option<super::cowcapture::PendingCapture> {
        self.inodes.take_capture()
    }

    /// The keys changed since the last call (or since tracking began), as a generation
    /// of their own.
    pub fn take_changes(&mut self) -> Changes {
        let mut c = self
            .changes
            .as_mut()
            .map(|c| std::mem::take(&mut **c))
            .unwrap_or_default();
        c.gen = self.inodes.close_gen();
        c
    }

    /// Apply one record. On error nothing of the record is applied.
    pub fn apply(&mut self, rec: &Record, mode: ApplyMode) -> Result<(), MetaError> {
        self.apply_record(rec, mode)?;
        if let Some(c) = self.changes.as_deref_mut() {
            match rec {
                Record::Create { ino, .. }
                | Record::SetSize { ino, .. }
                | Record::SetAttr { ino, .. }
                | Record::SetRdev { ino, .. } => {
                    c.inodes.push(*ino);
                }
                Record::Link { parent, name, ino } | Record::Unlink { parent, name, ino } => {
                    // The parent's record holds its subdirectory count.
                    c.inodes.push(*parent);
                    c.inodes.push(*ino);
                    c.dirents.push((*parent, name.clone()));
                }
                Record::Truncate { ino, .. } => {
                    c.inodes.push(*ino);
                }
                Record::SetTarget { ino, .. } => {
                    c.targets.push(*ino);
                }
                Record::Orphan { ino } => {
                    c.orphans.push(*ino);
                }
                Record::Delete { ino } => {
                    c.deleted.push(*ino);
                    c.orphans.push(*ino);
                }
                Record::SetXattr { ino, name, .. } | Record::RemoveXattr { ino, name } => {
                    c.xattrs.push((*ino, name.clone()));
                }
                // Extents are noted where they change (in `apply_record`).
                Record::MapExtent { .. } | Record::DataBlock { .. } | Record::Revoke { .. } => {}
            }
        }
        Ok(())
    }

    /// An inode's own fields were changed in place (sizes and times the running
    /// transaction restates at its close): the next checkpoint writes them.
    pub(super) fn note_inode(&mut self, ino: u64) {
        if let Some(c) = self.changes.as_deref_mut() {
            c.inodes.push(ino);
        }
        // Stamped again now: the change in place was stamped when made, maybe with a
        // generation a checkpoint has made durable since, and the next checkpoint must
        // find the inode in memory to write it.
        self.inodes.note_changed(ino);
    }

    fn note_extent(&mut self, ino: u64, fb: u64) {
        if let Some(c) = self.changes.as_deref_mut() {
            c.extents.push((ino, fb));
        }
    }

    fn apply_record(&mut self, rec: &Record, mode: ApplyMode) -> Result<(), MetaError> {
        match rec {
            Record::Create {
                ino,
                kind,
                mode: m,
                uid,
                gid,
                time_ns,
            } => {
                if *ino <= ROOT_INO || self.find(*ino)?.is_some() {
                    return bad(format!(
                        "create of inode {ino}, which exists or is reserved"
                    ));
                }
                // The last number stays unused: next_ino must be able to pass every inode.
                let Some(next) = ino.checked_add(1) else {
                    return bad(format!("create of inode {ino}, past the last inode number"));
                };
                self.inodes
                    .insert(*ino, Box::new(Inode::new(*kind, *m, *uid, *gid, *time_ns)));
                self.nr_inodes += 1;
                self.next_ino = self.next_ino.max(next);
                self.image_bytes.add(INODE_FIXED_BYTES);
            }
            Record::Link { parent, name, ino } => {
                let c = self.get(*ino)?;
                let (child_kind, child_links) = (c.kind, c.links);
                let child_is_dir = child_kind == InodeKind::Dir;
                if child_is_dir && child_links > 0 {
                    return bad(format!("second link to directory {ino}"));
                }
                if child_links == u32::MAX {
                    return bad(format!("link to inode {ino}, whose link count is full"));
                }
                let h = name_hash(self.name_seed, name);
                let stamp = self.inodes.stamp();
                let p = self.get_mut(*parent)?;
                if !p.is_dir() {
                    return bad(format!(
                        "link into inode {parent}, which is not a directory"
                    ));
                }
                // Checked and inserted in one walk of the directory (every create
                // comes here: the check's own walk was a sixth of the create's hold).
                match p
                    .entries
                    .insert_new_at(h, name, *ino, Some(child_kind), stamp)
                {
                    Ok(true) => {}
                    Ok(false) => {
                        return bad(format!(
                            "link of {:?} into directory {parent}: the name exists",
                            String::from_utf8_lossy(name)
                        ))
                    }
                    // Replay (a live operation looked the name up first, which read
                    // its group back): nothing changed yet, read it and apply again.
                    Err(cold) => return Err(super::inodes::note_dir_miss(*parent, cold)),
                }
                p.subdirs += u32::from(child_is_dir);
                let c = self.get_mut(*ino)?;
                c.links += 1;
                if child_is_dir {
                    c.parent = *parent;
                }
                self.image_bytes.add(ENTRY_FIXED_BYTES + name.len() as u64);
            }
            Record::Unlink { parent, name, ino } => {
                let p = self.get(*parent)?;
                let h = name_hash(self.name_seed, name);
                let found = p
                    .entries
                    .lookup_at(h, name)
                    .map_err(|cold| super::inodes::note_dir_miss(*parent, cold))?;
                if found.map(|e| e.0) != Some(*ino) {
                    return bad(format!(
                        "unlink of {:?} from directory {parent}: it does not name inode {ino}",
                        String::from_utf8_lossy(name)
                    ));
                }
                if self.get(*ino)?.links == 0 {
                    return bad(format!("unlink of inode {ino} with no links"));
                }
                let child_is_dir = self.get(*ino)?.is_dir();
                let stamp = self.inodes.stamp();
                let p = self.get_mut(*parent)?;
                p.entries.remove_at(h, name, stamp);
                p.subdirs -= u32::from(child_is_dir);
                let c = self.get_mut(*ino)?;
                c.links -= 1;
                if c.is_dir() {
                    c.parent = 0;
                }
                self.image_bytes.sub(ENTRY_FIXED_BYTES + name.len() as u64);
            }
            Record::SetSize { ino, size } => {
                self.get_mut(*ino)?.size = *size;
            }
            Record::Truncate { ino, size } => {
                let i = self.get(*ino)?;
                if i.kind != InodeKind::File {
                    return bad(format!("truncate of inode {ino}, not a regular file"));
                }
                let keep = size.div_ceil(BLOCK_SIZE as u64);
                let mut freed = Vec::new();
                let mut kept_tail = None;
                for (&f, &(s, l)) in i.extents.range(..) {
                    if f + l <= keep {
                        continue;
                    }
                    if f < keep {
                        let k = keep - f;
                        kept_tail = Some((f, (s, k)));
                        freed.push((f, s + k, l - k));
                    } else {
                        freed.push((f, s, l));
                    }
                }
                self.free_blocks(freed.iter().map(|&(_, s, l)| (s, l)), mode)?;
                for &(f, _, _) in &freed {
                    self.note_extent(*ino, f);
                }
                let i = self.get_mut(*ino)?;
                for (f, _, _) in &freed {
                    i.extents.remove(f);
                }
                if let Some((f, e)) = kept_tail {
                    i.extents.insert(f, e);
                }
                i.size = *size;
                let removed = freed.len() as u64 - u64::from(kept_tail.is_some());
                self.image_bytes.sub(removed * EXTENT_BYTES);
            }
            Record::SetAttr {
                ino,
                mode: m,
                uid,
                gid,
                atime_ns,
                mtime_ns,
                ctime_ns,
            } => {
                let i = self.get_mut(*ino)?;
                i.mode = *m;
                i.uid = *uid;
                i.gid = *gid;
                i.atime_ns = *atime_ns;
                i.mtime_ns = *mtime_ns;
                i.ctime_ns = *ctime_ns;
            }
            Record::MapExtent {
                ino,
                file_block,
                start,
                len,
            } => {
                let (ino, fb, start, len) = (*ino, *file_block, *start, *len);
                let i = self.get(ino)?;
                if i.kind != InodeKind::File {
                    return bad(format!(
                        "extent mapped into inode {ino}, not a regular file"
                    ));
                }
                if len == 0 || fb.checked_add(len).is_none() {
                    return bad(format!("extent of {len} blocks at file block {fb}"));
                }
                if i.next_mapped(fb).is_some_and(|n| n < fb + len) {
                    return bad(format!(
                        "extent {fb}+{len} of inode {ino} overlaps one already mapped"
                    ));
                }
                if mode == ApplyMode::Replay {
                    self.alloc.alloc_exact(start, len)?;
                }
                if let Some(v) = &mut self.view {
                    v.alloc_exact(start, len)?;
                }
                let i = self.get_mut(ino)?;
                let mut f0 = fb;
                let mut s0 = start;
                let mut l0 = len;
                let mut merged = 0;
                // Merge with the run ending just before (in the file and on the device).
                if let Some((&pf, &(ps, pl))) = i.extents.range(..fb).next_back() {
                    if pf + pl == fb && ps + pl == start {
                        i.extents.remove(&pf);
                        f0 = pf;
                        s0 = ps;
                        l0 += pl;
                        merged += 1;
                    }
                }
                let mut swallowed_next = false;
                if let Some(&(ns, nl)) = i.extents.get(&(fb + len)) {
                    if ns == start + len {
                        i.extents.remove(&(fb + len));
                        l0 += nl;
                        merged += 1;
                        swallowed_next = true;
                    }
                }
                i.extents.insert(f0, (s0, l0));
                self.image_bytes.add(EXTENT_BYTES);
                self.image_bytes.sub(merged * EXTENT_BYTES);
                // The keys this record changed: the merged run's (the run before's, when
                // it grew), and the next run's when it was swallowed. `fb` itself is a
                // key only when it is `f0`: nothing was mapped there (checked above). A
                // key noted that never held a value costs the checkpoint a deletion's
                // descent of the tree for nothing: that was one per new small file.
                self.note_extent(ino, f0);
                if swallowed_next {
                    self.note_extent(ino, fb + len);
                }
            }
            Record::SetTarget { ino, target } => {
                let i = self.get_mut(*ino)?;
                if i.kind != InodeKind::Symlink {
                    return bad(format!("symlink target set on inode {ino}, not a symlink"));
                }
                let old = i.target.len() as u64;
                i.target = target.clone();
                self.image_bytes.add(target.len() as u64);
                self.image_bytes.sub(old);
            }
            Record::Orphan { ino } => {
                if self.get(*ino)?.links != 0 {
                    return bad(format!("orphan inode {ino} still has names"));
                }
                self.orphans.insert(*ino);
                self.image_bytes.add(8);
            }
            Record::Delete { ino } => {
                let i = self.get(*ino)?;
                if *ino == ROOT_INO || i.links != 0 {
                    return bad(format!("delete of inode {ino}, which still has names"));
                }
                // Replay may meet a directory read back unlisted: its first entry, if
                // any, is read back first.
                let has_entries = (i.entries.has_entries())
                    .map_err(|cold| super::inodes::note_dir_miss(*ino, cold))?;
                if has_entries {
                    return bad(format!("delete of directory {ino}, which is not empty"));
                }
                let ext: Vec<(u64, u64)> = i.extents.values().copied().collect();
                let target = i.target.len() as u64 + i.extra_bytes();
                self.free_blocks(ext.iter().copied(), mode)?;
                let gone = self.inodes.remove(*ino);
                debug_assert!(gone.is_some(), "inode {ino} was read for its delete");
                self.nr_inodes -= 1;
                if self.orphans.remove(ino) {
                    self.image_bytes.sub(8);
                }
                self.image_bytes
                    .sub(INODE_FIXED_BYTES + ext.len() as u64 * EXTENT_BYTES + target);
            }
            Record::SetRdev { ino, rdev } => {
                let i = self.get_mut(*ino)?;
                if !matches!(i.kind, InodeKind::CharDev | InodeKind::BlockDev) {
                    return bad(format!("device number set on inode {ino}, not a device"));
                }
                let old = i.extra_bytes();
                i.rdev = *rdev;
                let new = i.extra_bytes();
                self.image_bytes.add(new);
                self.image_bytes.sub(old);
            }
            Record::SetXattr { ino, name, value } => {
                let i = self.get_mut(*ino)?;
                if !user_xattr_allowed(i.kind, name) {
                    return bad(format!(
                        "a user.* extended attribute set on inode {ino}, a {:?}",
                        i.kind
                    ));
                }
                let old = i.extra_bytes();
                i.xattrs.insert(name.clone(), value.clone());
                let new = i.extra_bytes();
                self.image_bytes.add(new);
                self.image_bytes.sub(old);
            }
            Record::RemoveXattr { ino, name } => {
                let i = self.get_mut(*ino)?;
                let old = i.extra_bytes();
                if i.xattrs.remove(name).is_none() {
                    return bad(format!("inode {ino} has no extended attribute to remove"));
                }
                let new = i.extra_bytes();
                self.image_bytes.add(new);
                self.image_bytes.sub(old);
            }
            // Data, not metadata: replay (journal.rs) writes it home; here only its
            // place is checked, so an image can never send it outside the data area.
            Record::DataBlock { block, .. } => {
                let sp = self.alloc.space();
                if *block < sp.first_data_block() || *block >= sp.nr_blocks() {
                    return bad(format!(
                        "journaled data for block {block}, outside the data area"
                    ));
                }
            }
            Record::Revoke { .. } => {}
        }
        Ok(())
    }

    fn free_blocks(
        &mut self,
        runs: impl Iterator<Item = (u64, u64)>,
        mode: ApplyMode,
    ) -> Result<(), MetaError> {
        for (s, l) in runs {
            if let Some(v) = &mut self.view {
                v.free(s, l)?;
            }
            match mode {
                ApplyMode::Replay => self.alloc.free(s, l)?,
                ApplyMode::Live { tid } => self.alloc.free_deferred(tid, s, l)?,
            }
        }
        Ok(())
    }

    /// Every block some inode maps, and the metadata tree's nodes (owner 0), sorted:
    /// (start, len, owner).
    pub fn used_extents(&mut self) -> Vec<(u64, u64, u64)> {
        let mut v: Vec<(u64, u64, u64)> = self
            .inodes
            .all_resident()
            .iter()
            .flat_map(|(&ino, i)| i.extents.values().map(move |&(s, l)| (s, l, ino)))
            .chain(self.tree_blocks.iter().map(|&b| (b, 1, 0)))
            .collect();
        v.sort_unstable();
        v
    }

    /// The free extents as the durable state sees them: the complement of every mapped
    /// extent in the data area. (Blocks allocated for writes still in flight, and blocks
    /// freed by transactions not yet committed, are free here: after a crash they are.)
    pub fn durable_free(&mut self) -> Vec<(u64, u64)> {
        let first = self.alloc.space().first_data_block();
        let end = self.alloc.space().nr_blocks();
        let mut out = Vec::new();
        let mut at = first;
        for (s, l, _) in self.used_extents() {
            if s > at {
                out.push((at, s - at));
            }
            at = at.max(s + l);
        }
        if end > at {
            out.push((at, end - at));
        }
        out
    }

    // ---- checkpoint image ------------------------------------------------------------

    /// The image a checkpoint stores: next_ino, the inodes, the orphans, the free map.
    pub fn encode_image(&mut self) -> Vec<u8> {
        let mut w = Writer(Vec::with_capacity(
            self.image_bytes.0.unwrap_or(0) as usize + 64,
        ));
        let free = self.durable_free();
        let inodes = self.inodes.all_resident();
        w.u64(self.next_ino);
        w.u64(inodes.len() as u64);
        let mut inos: Vec<&u64> = inodes.keys().collect();
        inos.sort_unstable();
        for ino in inos {
            let i = &inodes[ino];
            w.u64(*ino)
                .u8(i.kind as u8)
                .u32(i.mode)
                .u32(i.uid)
                .u32(i.gid)
                .u32(i.links)
                .u64(i.size)
                .u64(i.atime_ns)
                .u64(i.mtime_ns)
                .u64(i.ctime_ns);
            w.u32(i.extents.len() as u32);
            for (&f, &(s, l)) in &i.extents {
                w.u64(f).u64(s).u64(l);
            }
            w.u32(i.entries.len() as u32);
            for (name, c) in i.entries.iter() {
                w.bytes(name).u64(c);
            }
            w.bytes(&i.target);
        }
        w.u64(self.orphans.len() as u64);
        for o in &self.orphans {
            w.u64(*o);
        }
        w.u64(free.len() as u64);
        for (s, l) in free {
            w.u64(s).u64(l);
        }
        // v2: device numbers and extended attributes, for the inodes that have any.
        let mut extra: Vec<(&u64, &Box<Inode>)> =
            inodes.iter().filter(|(_, i)| i.extra_bytes() > 0).collect();
        extra.sort_unstable_by_key(|(ino, _)| **ino);
        w.u64(extra.len() as u64);
        for (ino, i) in extra {
            w.u64(*ino).u32(i.rdev).u32(i.xattrs.len() as u32);
            for (n, v) in &i.xattrs {
                w.bytes(n).bytes(v);
            }
        }
        w.0
    }

    /// Rebuild the metadata from a checkpoint image. Checks what decoding needs (bounds,
    /// kinds, names, the free map); `check` finds the rest.
    pub fn decode_image(
        buf: &[u8],
        data_start: u64,
        nr_blocks: u64,
        name_seed: u64,
    ) -> Result<Meta, MetaError> {
        let mut r = Reader::new(buf, "checkpoint image");
        let next_ino = r.u64()?;
        let n = r.u64()?;
        // Every inode takes more than 64 bytes: a count beyond that is corruption, and
        // checking first keeps a forged count from reserving huge memory.
        if n > buf.len() as u64 / 64 + 1 {
            return bad(format!(
                "the image claims {n} inodes in {} bytes",
                buf.len()
            ));
        }
        let mut inodes = FxHashMap::with_capacity_and_hasher(n as usize, Default::default());
        let mut parents: Vec<(u64, u64)> = Vec::new();
        for _ in 0..n {
            let ino = r.u64()?;
            let k = r.u8()?;
            let kind = InodeKind::from_u8(k)
                .map_err(|_| MetaError(format!("inode {ino} has unknown kind {k}")))?;
            let mut i = Inode::new(kind, r.u32()?, r.u32()?, r.u32()?, 0);
            i.links = r.u32()?;
            i.size = r.u64()?;
            i.atime_ns = r.u64()?;
            i.mtime_ns = r.u64()?;
            i.ctime_ns = r.u64()?;
            let ne = r.u32()?;
            for _ in 0..ne {
                let (f, s, l) = (r.u64()?, r.u64()?, r.u64()?);
                // Every later sum over an extent (its file end, its device end) is then
                // free of overflow; where it lies on the device is `check`'s business.
                if l == 0
                    || f.checked_add(l).is_none()
                    || s.checked_add(l).is_none()
                    || i.extents.insert(f, (s, l)).is_some()
                {
                    return bad(format!("inode {ino} has a bad extent at file block {f}"));
                }
            }
            check_extent_order(ino, &i.extents)?;
            let nd = r.u32()?;
            for _ in 0..nd {
                let name = r.bytes()?.to_vec();
                if !valid_name(&name) {
                    return bad(format!("directory {ino} has an invalid entry name"));
                }
                let c = r.u64()?;
                if i.entries.insert(name_seed, &name, c).is_some() {
                    return bad(format!("directory {ino} holds the same name twice"));
                }
                parents.push((c, ino));
            }
            i.target = r.bytes()?.to_vec();
            if inodes.insert(ino, Box::new(i)).is_some() {
                return bad(format!("inode {ino} appears twice"));
            }
        }
        derive_parents(&mut inodes, parents);
        let no = r.u64()?;
        if no > buf.len() as u64 / 8 {
            return bad(format!("the image claims {no} orphans"));
        }
        let mut orphans = BTreeSet::new();
        for _ in 0..no {
            orphans.insert(r.u64()?);
        }
        let nf = r.u64()?;
        if nf > buf.len() as u64 / 16 {
            return bad(format!("the image claims {nf} free extents"));
        }
        let mut free = Vec::with_capacity(nf as usize);
        for _ in 0..nf {
            free.push((r.u64()?, r.u64()?));
        }
        // v2's extras section; a version 1 image ends before it.
        let v1 = r.remaining() == 0;
        if !v1 {
            let nx = r.u64()?;
            if nx > buf.len() as u64 / 16 {
                return bad(format!("the image claims {nx} inodes with extras"));
            }
            let mut with_extras = BTreeSet::new();
            for _ in 0..nx {
                let ino = r.u64()?;
                let rdev = r.u32()?;
                let n = r.u32()?;
                let Some(i) = inodes.get_mut(&ino) else {
                    return bad(format!("extras for inode {ino}, which does not exist"));
                };
                if !with_extras.insert(ino) {
                    return bad(format!("extras for inode {ino} appear twice"));
                }
                i.rdev = rdev;
                for _ in 0..n {
                    let name = super::format::xattr_name(&mut r)?;
                    let value = r.bytes()?;
                    if value.len() > super::format::XATTR_SIZE_MAX {
                        return bad(format!("inode {ino} has an oversized extended attribute"));
                    }
                    if i.xattrs.insert(name, value.to_vec()).is_some() {
                        return bad(format!(
                            "inode {ino} holds the same extended attribute twice"
                        ));
                    }
                }
            }
        }
        if r.remaining() != 0 {
            return bad(format!("{} stray bytes after the image", r.remaining()));
        }
        let space = FreeSpace::from_extents(data_start, nr_blocks, free)?;
        let mut m = Meta::with_space(inodes, next_ino, orphans, space, BTreeSet::new(), name_seed);
        m.image_bytes = ImageBytes(Some(
            buf.len() as u64 - nf * FREE_EXTENT_BYTES + if v1 { 8 } else { 0 },
        ));
        Ok(m)
    }

    /// A format 5 volume's metadata at mount, no inode read yet (`fs::metatree::
    /// load_lazy`): every inode is read back on demand, once a source is set.
    pub(super) fn lazy(
        next_ino: u64,
        nr_inodes: u64,
        orphans: BTreeSet<u64>,
        free: FreeSpace,
        name_seed: u64,
    ) -> Meta {
        let mut m = Meta::with_space(
            FxHashMap::default(),
            next_ino,
            orphans,
            free,
            BTreeSet::new(),
            name_seed,
        );
        m.nr_inodes = nr_inodes;
        m.tree_blocks_known = false;
        m.image_bytes = ImageBytes(None);
        m
    }

    /// The metadata from its parts as the tree holds them (`fs::metatree::load`):
    /// directories' parents and subdirectory counts derived from the entries, the free
    /// space the data area less every extent and the tree's own node blocks (`used`).
    pub(super) fn assemble(
        mut inodes: FxHashMap<u64, Box<Inode>>,
        next_ino: u64,
        orphans: BTreeSet<u64>,
        used: &[u64],
        data_start: u64,
        nr_blocks: u64,
        name_seed: u64,
    ) -> Result<Meta, MetaError> {
        let mut parents = Vec::new();
        let mut taken: Vec<(u64, u64)> = used.iter().map(|&b| (b, 1)).collect();
        for (&ino, i) in &inodes {
            check_extent_order(ino, &i.extents)?;
            taken.extend(i.extents.values().copied());
            parents.extend(i.entries.inodes().map(|c| (c, ino)));
        }
        derive_parents(&mut inodes, parents);
        taken.sort_unstable();
        let mut free = Vec::new();
        let mut at = data_start;
        for (s, l) in taken {
            if s < at || s.checked_add(l).is_none_or(|e| e > nr_blocks) {
                return bad(format!(
                    "blocks {s}..+{l} lie outside the data area or are used twice"
                ));
            }
            if s > at {
                free.push((at, s - at));
            }
            at = s + l;
        }
        if nr_blocks > at {
            free.push((at, nr_blocks - at));
        }
        let space = FreeSpace::from_extents(data_start, nr_blocks, free)?;
        let mut m = Meta::with_space(
            inodes,
            next_ino,
            orphans,
            space,
            used.iter().copied().collect(),
            name_seed,
        );
        m.image_bytes = ImageBytes(Some(m.image_bytes_without_free()));
        Ok(m)
    }

    // ---- invariants (fsck) -----------------------------------------------------------

    /// Every invariant of the durable state, as a list of problems in plain words
    /// (empty when the filesystem is consistent). Orphans are not problems: mount
    /// deletes them.
    /// `check` of a volume mounted without reading its tree whole, which does not keep
    /// the tree's node blocks: `nodes` are they (a walk of the tree).
    pub fn check_with_nodes(&mut self, nodes: &[u64]) -> Vec<String> {
        debug_assert!(!self.tree_blocks_known);
        self.tree_blocks = nodes.iter().copied().collect();
        self.tree_blocks_known = true;
        let p = self.check();
        self.tree_blocks = BTreeSet::new();
        self.tree_blocks_known = false;
        p
    }

    pub fn check(&mut self) -> Vec<String> {
        let mut p = Vec::new();
        let first = self.alloc.space().first_data_block();
        let end = self.alloc.space().nr_blocks();
        // Extents: in bounds, inside the file, owned once.
        let mut used = self.used_extents();
        let inodes = self.inodes.all_resident();
        if inodes.len() as u64 != self.nr_inodes {
            p.push(format!(
                "{} inodes counted but {} exist",
                self.nr_inodes,
                inodes.len()
            ));
        }
        match inodes.get(&ROOT_INO) {
            Some(r) if r.is_dir() => {}
            Some(_) => p.push("the root inode is not a directory".to_string()),
            None => p.push("the root directory is missing".to_string()),
        }
        if let Some(max) = inodes.keys().max() {
            if *max >= self.next_ino {
                p.push(format!(
                    "inode {max} exists but the next free inode number is {}",
                    self.next_ino
                ));
            }
        }
        for &(s, l, ino) in &used {
            if s < first || s.checked_add(l).is_none_or(|e| e > end) {
                p.push(format!(
                    "inode {ino}: extent at block {s} of {l} blocks lies outside the data area {first}..{end}"
                ));
            }
        }
        for (ino, i) in inodes {
            if i.kind != InodeKind::File && !i.extents.is_empty() {
                p.push(format!("inode {ino}: a {:?} with data extents", i.kind));
            }
            let limit = i.size.div_ceil(BLOCK_SIZE as u64);
            if let Some((&f, &(_, l))) = i.extents.iter().next_back() {
                if f.saturating_add(l) > limit {
                    p.push(format!(
                        "inode {ino}: file blocks up to {} are mapped but the size is {} bytes",
                        f.saturating_add(l),
                        i.size
                    ));
                }
            }
            if i.size > MAX_FILE_SIZE {
                p.push(format!(
                    "inode {ino}: size {} is beyond the largest file ({MAX_FILE_SIZE} bytes)",
                    i.size
                ));
            }
            if i.kind != InodeKind::Symlink && !i.target.is_empty() {
                p.push(format!("inode {ino}: a {:?} with a symlink target", i.kind));
            }
            if i.target.len() > TARGET_MAX {
                p.push(format!(
                    "symlink {ino}: a target of {} bytes (at most {TARGET_MAX})",
                    i.target.len()
                ));
            }
            if i.xattrs.keys().any(|n| !user_xattr_allowed(i.kind, n)) {
                p.push(format!(
                    "inode {ino}: a {:?} with user.* extended attributes",
                    i.kind
                ));
            }
            if i.rdev != 0 && !matches!(i.kind, InodeKind::CharDev | InodeKind::BlockDev) {
                p.push(format!("inode {ino}: a {:?} with a device number", i.kind));
            }
        }
        used.sort_unstable();
        // Sums saturate: the extents checked here may be anything an image held.
        let end_of = |s: u64, l: u64| s.saturating_add(l);
        for w in used.windows(2) {
            let (a, b) = (w[0], w[1]);
            if end_of(a.0, a.1) > b.0 {
                p.push(format!(
                    "blocks {}..{} belong to both inode {} and inode {}",
                    b.0,
                    end_of(a.0, a.1).min(end_of(b.0, b.1)),
                    a.2,
                    b.2
                ));
            }
        }
        // Free space is exactly the complement of what is used.
        let mut free_blocks = 0u64;
        for (s, l) in self.alloc.space().extents() {
            free_blocks = free_blocks.saturating_add(l);
            let lo = used.partition_point(|u| end_of(u.0, u.1) <= s);
            if let Some(u) = used.get(lo) {
                if u.0 < end_of(s, l) {
                    p.push(format!(
                        "blocks {}..{} are marked free but belong to inode {}",
                        u.0.max(s),
                        end_of(u.0, u.1).min(end_of(s, l)),
                        u.2
                    ));
                }
            }
        }
        let used_blocks = used.iter().fold(0u64, |n, u| n.saturating_add(u.1));
        let total = end.saturating_sub(first);
        if free_blocks.saturating_add(used_blocks) < total {
            p.push(format!(
                "{} blocks are neither free nor used by any inode (leaked)",
                total - free_blocks - used_blocks
            ));
        }
        // Link counts and the directory tree.
        let mut refs: FxHashMap<u64, u32> = FxHashMap::default();
        for (ino, i) in inodes {
            if !i.entries.is_empty() && !i.is_dir() {
                p.push(format!(
                    "inode {ino} has directory entries but is not a directory"
                ));
            }
            for (name, c, kind) in i.entries.iter_kinds() {
                let n = String::from_utf8_lossy(name);
                match inodes.get(&c) {
                    None => p.push(format!(
                        "directory {ino}: entry {n:?} points at inode {c}, which does not exist"
                    )),
                    Some(ci) if kind.is_some_and(|k| k != ci.kind) => p.push(format!(
                        "directory {ino}: entry {n:?} records a {:?} but inode {c} is a {:?}",
                        kind.expect("some"),
                        ci.kind
                    )),
                    Some(ci) if ci.is_dir() && ci.parent != *ino => p.push(format!(
                        "directory {c} is named {n:?} in {ino} but its parent is {}",
                        ci.parent
                    )),
                    Some(_) => *refs.entry(c).or_default() += 1,
                }
            }
            if i.kind == InodeKind::Symlink && i.target.is_empty() {
                p.push(format!("symlink {ino} has no target"));
            }
        }
        for (ino, i) in inodes {
            let want = if *ino == ROOT_INO {
                1
            } else {
                refs.get(ino).copied().unwrap_or(0)
            };
            if i.links != want {
                p.push(format!(
                    "inode {ino}: link count {} but {want} directory entries name it",
                    i.links
                ));
            }
            if i.is_dir() && *ino != ROOT_INO && want > 1 {
                p.push(format!("directory {ino} has {want} names"));
            }
            if *ino != ROOT_INO && want == 0 && !self.orphans.contains(ino) {
                p.push(format!(
                    "inode {ino} has no name and is not on the orphan list (lost)"
                ));
            }
        }
        for o in &self.orphans {
            match inodes.get(o) {
                None => p.push(format!("orphan {o} does not exist")),
                Some(i) if i.links != 0 => p.push(format!("orphan {o} still has names")),
                // Mount deletes orphans, and a directory only once it is empty.
                Some(i) if !i.entries.is_empty() => {
                    p.push(format!("orphan directory {o} is not empty"))
                }
                _ => {}
            }
        }
        // Every directory reachable from the root, once (no cycles, no detached trees).
        let mut seen = BTreeSet::new();
        let mut stack = vec![ROOT_INO];
        while let Some(d) = stack.pop() {
            if !seen.insert(d) {
                p.push(format!("directory {d} is reached twice (a cycle)"));
                continue;
            }
            if let Some(i) = inodes.get(&d) {
                stack.extend(
                    i.entries
                        .inodes()
                        .filter(|c| inodes.get(c).is_some_and(|ci| ci.is_dir())),
                );
            }
        }
        for (ino, i) in inodes {
            if i.is_dir() && !seen.contains(ino) && i.links > 0 {
                p.push(format!("directory {ino} is not reachable from the root"));
            }
        }
        p
    }
}

/// user.* attributes live only on files and directories (as `perm::xattr` rules, after
/// the kernel): elsewhere one could be listed but never read.
fn user_xattr_allowed(kind: InodeKind, name: &[u8]) -> bool {
    !name.starts_with(b"user.") || matches!(kind, InodeKind::File | InodeKind::Dir)
}

/// A valid directory-entry name: 1..=255 bytes, no '/', no NUL, not "." or "..".
/// Extents are kept in file order; each must end before the next begins.
fn check_extent_order(ino: u64, extents: &ExtentMap) -> Result<(), MetaError> {
    let mut file_end = 0;
    for (&f, &(_, l)) in extents {
        if f < file_end {
            return bad(format!(
                "inode {ino} maps file block {f} twice (overlapping extents)"
            ));
        }
        file_end = f + l;
    }
    Ok(())
}

/// Directories' parents and subdirectory counts, derived from the (child, parent) of
/// every entry (the root is its own parent).
fn derive_parents(inodes: &mut FxHashMap<u64, Box<Inode>>, parents: Vec<(u64, u64)>) {
    for (c, p) in parents {
        if let Some(ci) = inodes.get_mut(&c).filter(|ci| ci.is_dir()) {
            ci.parent = p;
            if let Some(pi) = inodes.get_mut(&p) {
                pi.subdirs += 1;
            }
        }
    }
    if let Some(root) = inodes.get_mut(&ROOT_INO) {
        root.parent = ROOT_INO;
    }
    // Entries whose kind the image did not record (formats up to 4) take it from the
    // inode they name.
    let kinds: FxHashMap<u64, InodeKind> = inodes.iter().map(|(&ino, i)| (ino, i.kind)).collect();
    for i in inodes.values_mut().filter(|i| i.is_dir()) {
        i.entries.resolve_kinds(|c| kinds.get(&c).copied());
    }
}

pub fn valid_name(name: &[u8]) -> bool {
    !name.is_empty()
        && name.len() <= NAME_MAX
        && !name.contains(&b'/')
        && !name.contains(&0)
        && name != b"."
        && name != b".."
}

/// An inode read back from the tree (`Meta::install`) as the rest of the volume can
/// rely on: the tree is checked whole only by fsck, and a mount reads it lazily, so a
/// crafted or damaged image reaches here unchecked. Its extents lie in the data area,
/// in order, and on blocks the free map counts as used (else a write in place would
/// land on the superblock, the journal or a tree node, or on a block another file
/// gets); a directory's subdirectory count is the directories it lists (an rmdir would
/// take it below zero), and its link count fits.
fn read_back_sound(space: &FreeSpace, ino: u64, i: &Inode) -> Result<(), super::error::FsError> {
    let bad = |what: String| {
        Err(super::error::FsError::Corrupt(format!(
            "inode {ino} read back: {what}"
        )))
    };
    let mut file_end = 0u64;
    for (&fb, &(start, len)) in i.extents.iter() {
        let (Some(fend), Some(end)) = (fb.checked_add(len), start.checked_add(len)) else {
            return bad(format!("extent at file block {fb} overflows"));
        };
        if len == 0 || fb < file_end {
            return bad(format!("extent at file block {fb} is empty or overlaps"));
        }
        if start < space.first_data_block() || end > space.nr_blocks() {
            return bad(format!(
                "extent at file block {fb} maps blocks {start}..{end}, outside the data area"
            ));
        }
        if space.overlaps_free(start, len) {
            return bad(format!(
                "extent at file block {fb} maps blocks {start}..{end}, some of them free"
            ));
        }
        file_end = fend;
    }
    // Kinds are recorded with every entry from format 5 on, the only format read back.
    if let (true, Some(dirs)) = (i.is_dir(), i.entries.subdirs()) {
        if dirs != i.subdirs {
            return bad(format!(
                "{} subdirectories counted, {dirs} listed",
                i.subdirs
            ));
        }
        if i.links
            .checked_add(1)
            .and_then(|n| n.checked_add(i.subdirs))
            .is_none()
        {
            return bad("its link count overflows".into());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a crafted image could hold in an inode read back lazily is refused before
    /// the volume uses it: extents outside the data area, overlapping, or on free
    /// blocks, and a subdirectory count its entries do not bear out.
    #[test]
    fn an_inode_read_back_is_refused_when_its_image_is_unsound() {
        use crate::fs::error::FsError;
        let mut space = FreeSpace::new(100, 1000);
        space.alloc_exact(200, 10).unwrap();
        let file = |runs: &[(u64, u64, u64)]| {
            let mut i = Inode::new_loaded(InodeKind::File, 0o644, 0, 0);
            for &(fb, s, l) in runs {
                i.extents.insert(fb, (s, l));
            }
            i
        };
        assert!(read_back_sound(&space, 7, &file(&[(0, 200, 4), (4, 204, 6)])).is_ok());
        for (why, runs) in [
            ("the superblock", vec![(0u64, 0u64, 1u64)]),
            ("past the device", vec![(0, 205, 5), (5, 995, 10)]),
            ("free blocks", vec![(0, 208, 4)]),
            ("overlapping", vec![(0, 200, 4), (2, 204, 2)]),
            ("empty", vec![(0, 200, 0)]),
        ] {
            let r = read_back_sound(&space, 7, &file(&runs));
            assert!(matches!(r, Err(FsError::Corrupt(_))), "{why}: {r:?}");
        }
        let mut d = Inode::new_loaded(InodeKind::Dir, 0o755, 0, 0);
        d.links = 1;
        for (name, ino, kind) in [(&b"sub"[..], 8, InodeKind::Dir), (b"f", 9, InodeKind::File)] {
            d.entries
                .insert_at(super::super::dir::name_hash(0, name), name, ino, Some(kind));
        }
        d.subdirs = 1;
        assert!(read_back_sound(&space, 7, &d).is_ok());
        d.subdirs = 0;
        assert!(matches!(
            read_back_sound(&space, 7, &d),
            Err(FsError::Corrupt(_))
        ));
        d.subdirs = u32::MAX;
        assert!(matches!(
            read_back_sound(&space, 7, &d),
            Err(FsError::Corrupt(_))
        ));
    }

    fn live(m: &mut Meta, r: Record) {
        m.apply(&r, ApplyMode::Live { tid: 1 }).unwrap();
    }

    #[test]
    fn image_round_trip_and_checks() {
        let mut m = Meta::mkfs(100, 10_000, 7, 5);
        live(
            &mut m,
            Record::Create {
                ino: 2,
                kind: InodeKind::File,
                mode: 0o644,
                uid: 1,
                gid: 2,
                time_ns: 9,
            },
        );
        live(
            &mut m,
            Record::Link {
                parent: ROOT_INO,
                name: b"a".to_vec(),
                ino: 2,
            },
        );
        m.alloc.alloc_exact(100, 4).unwrap();
        live(
            &mut m,
            Record::MapExtent {
                ino: 2,
                file_block: 0,
                start: 100,
                len: 2,
            },
        );
        live(
            &mut m,
            Record::MapExtent {
                ino: 2,
                file_block: 2,
                start: 102,
                len: 2,
            },
        );
        live(
            &mut m,
            Record::SetSize {
                ino: 2,
                size: 4 * 4096,
            },
        );
        assert_eq!(m.get(2).unwrap().extents.len(), 1, "adjacent runs merge");
        let img = m.encode_image();
        assert_eq!(img.len() as u64, m.image_bytes(), "size estimate is exact");
        let mut back = Meta::decode_image(&img, 100, 10_000, 5).unwrap();
        assert_eq!(*back.resident_inodes(), *m.resident_inodes());
        assert!(back.check().is_empty(), "{:?}", back.check());
        // A truncate frees blocks only when its transaction commits.
        live(&mut m, Record::Truncate { ino: 2, size: 5000 });
        assert_eq!(m.get(2).unwrap().blocks(), 2);
        assert_eq!(m.alloc.deferred_blocks(), 2);
    }

    #[test]
    fn check_finds_double_ownership_and_bad_links() {
        let mut m = Meta::mkfs(10, 1000, 0, 5);
        for ino in [2, 3] {
            m.apply(
                &Record::Create {
                    ino,
                    kind: InodeKind::File,
                    mode: 0,
                    uid: 0,
                    gid: 0,
                    time_ns: 0,
                },
                ApplyMode::Replay,
            )
            .unwrap();
            m.apply(
                &Record::Link {
                    parent: ROOT_INO,
                    name: vec![b'a' + ino as u8],
                    ino,
                },
                ApplyMode::Replay,
            )
            .unwrap();
            m.get_mut(ino).unwrap().size = 8192;
        }
        m.get_mut(2).unwrap().extents.insert(0, (20, 2));
        m.get_mut(3).unwrap().extents.insert(0, (21, 2));
        m.get_mut(3).unwrap().links = 2;
        let p = m.check().join("\n");
        assert!(p.contains("belong to both inode 2 and inode 3"), "{p}");
        assert!(p.contains("marked free but belong"), "{p}");
        assert!(p.contains("link count 2 but 1"), "{p}");
    }
}
