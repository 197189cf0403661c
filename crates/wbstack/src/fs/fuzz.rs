//! The fuzz harness: what the fuzz targets (`fuzz/fuzz_targets/*.rs` at the repository
//! root) and the regression corpus test (`tests/fuzz_corpus.rs`) feed their bytes to, so
//! an input the fuzzer found replays as an ordinary test through the same code.
//!
//! Four targets: [`superblock`], [`journal_txn`] (a transaction, its records replayed
//! onto a fresh filesystem), [`checkpoint`] (its image decoded into the metadata model
//! and checked) and [`image`] (a whole image: fsck, mount, use, unmount, fsck, mount).
//! Whatever the bytes, the library must not panic, hang, or allocate more than the
//! device holds, and a refusal must name the damaged structure. Beyond that each harness
//! asserts properties whose failure is a bug, so the fuzzer reports it as a crash:
//! - an accepted structure encodes to bytes that decode to the same value;
//! - `peek_len` (how replay and mount size their reads) agrees with `decode`;
//! - fsck and mount agree: fsck finds an image clean exactly when mount accepts it;
//! - a mounted image, used (every name walked and read, files written, renamed and
//!   removed) and unmounted, is clean and mounts again.
//!
//! Checksums: a mutated structure almost never keeps its CRC32C, so a fuzzer feeding
//! raw bytes would exercise little beyond the checksum test. Each decoder harness also
//! runs on a copy with the checksum recomputed, and a whole image can ask for every
//! checksum on it to be recomputed ([`FIX_CHECKSUMS`]), which takes mutations to the
//! fields behind the checksums.
//!
//! A whole image is a small device (at most [`IMAGE_MAX_BLOCKS`]) given as a compact
//! list of byte runs ([`pack_image`]), since an image is mostly zeros and a fuzzer
//! mutates a few kilobytes far better than megabytes.

use super::dir::DirPageEntry;
use super::format::{
    crc, Checkpoint, Record, Records, Superblock, Txn, BLOCK_SIZE, CKPT_HEADER, SB_BLOCKS,
    SB_FIELDS, TXN_HEADER,
};
use super::fsck::fsck;
use super::meta::{ApplyMode, Meta, ROOT_INO};
use super::{Cred, FsError, InodeKind, MountOptions, OpenOptions, RenameFlags, Volume};
use crate::block::{QueueConfig, RequestQueue};
use crate::dev::null::NullDevice;
use crate::dev::DeviceSpec;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

const BS: usize = BLOCK_SIZE;

/// What an input led to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Decoded (or mounted, used and remounted), every property holding.
    Accepted,
    /// Refused, with the error (which names the damaged structure).
    Refused(String),
}

impl Outcome {
    fn or(self, other: Outcome) -> Outcome {
        match self {
            Outcome::Accepted => Outcome::Accepted,
            Outcome::Refused(_) => other,
        }
    }
}

/// Device size of the seed images (8 MiB: the smallest layout plus some data). The
/// journal and checkpoint targets decode against this geometry, so the free extents
/// and block numbers of seeds taken from real images are in range.
pub const SEED_BLOCKS: u64 = 2048;
/// First data block of a [`SEED_BLOCKS`] layout: two superblocks, a journal of 256
/// blocks, two checkpoint slots of 512 (`Superblock::layout`'s minimums).
pub const SEED_DATA_START: u64 = 2 + 256 + 2 * 512;
/// The name-hash seed (a volume's fs_id) the checkpoint target decodes images with:
/// only the order of directory entries depends on it.
pub const SEED_NAME_SEED: u64 = 0;

// ---- superblock --------------------------------------------------------------------

/// One superblock block, as read and with its checksum recomputed.
pub fn superblock(data: &[u8]) -> Outcome {
    let raw = superblock_props(data);
    let mut fixed = data.to_vec();
    fix_superblock(&mut fixed);
    raw.or(superblock_props(&fixed))
}

fn superblock_props(buf: &[u8]) -> Outcome {
    match Superblock::decode(buf) {
        Ok(sb) => {
            let enc = sb.encode();
            assert_eq!(
                Superblock::decode(&enc).as_ref(),
                Ok(&sb),
                "a decoded superblock does not survive encoding"
            );
            assert_eq!(
                &enc[..SB_FIELDS + 4],
                &buf[..SB_FIELDS + 4],
                "a decoded superblock encodes to other bytes"
            );
            Outcome::Accepted
        }
        Err(e) => Outcome::Refused(e.to_string()),
    }
}

fn fix_superblock(buf: &mut [u8]) {
    if buf.len() >= SB_FIELDS + 4 {
        let c = crc(&buf[..SB_FIELDS]);
        buf[SB_FIELDS..SB_FIELDS + 4].copy_from_slice(&c.to_le_bytes());
    }
}

// ---- journal transaction -----------------------------------------------------------

/// One journal transaction (whole blocks, as in the journal), as read and with its
/// checksum recomputed; the records of a valid one are replayed onto a fresh
/// filesystem of the seed geometry.
pub fn journal_txn(data: &[u8]) -> Outcome {
    let raw = txn_props(data);
    let mut fixed = data.to_vec();
    fix_txn(&mut fixed);
    raw.or(txn_props(&fixed))
}

fn le_u32(buf: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(buf.get(at..at + 4)?.try_into().ok()?))
}

fn le_u64(buf: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(buf.get(at..at + 8)?.try_into().ok()?))
}

/// Recompute the CRC of the structure at the start of `buf` whose header ends with its
/// length field at `header - 4` (a transaction's body, a checkpoint's image).
fn fix_trailing_crc(buf: &mut [u8], header: usize) {
    let Some(len) = le_u32(buf, header - 4) else {
        return;
    };
    let at = header + len as usize;
    if at + 4 <= buf.len() {
        let c = crc(&buf[..at]);
        buf[at..at + 4].copy_from_slice(&c.to_le_bytes());
    }
}

fn fix_txn(buf: &mut [u8]) {
    fix_trailing_crc(buf, TXN_HEADER);
}

fn txn_props(buf: &[u8]) -> Outcome {
    let fs_id = le_u64(buf, 4).unwrap_or(0);
    let peek = Txn::peek_len(buf, fs_id);
    match Txn::decode(buf) {
        Ok((t, len)) => {
            assert_eq!(peek, Ok(len), "peek_len and decode disagree");
            let enc = t.encode();
            assert_eq!(enc.len(), len, "a transaction re-encodes to another length");
            assert_eq!(
                Txn::decode(&enc),
                Ok((t.clone(), len)),
                "a decoded transaction does not survive encoding"
            );
            replay_records(&t.records);
            Outcome::Accepted
        }
        Err(e) => Outcome::Refused(e.to_string()),
    }
}

/// Apply each record to a fresh filesystem as replay would (a record that does not
/// apply changes nothing and is skipped); whatever state results must encode to a
/// checkpoint image that decodes to it, or a checkpoint after replay would lose it.
fn replay_records(records: &Records) {
    let mut m = Meta::mkfs(SEED_DATA_START, SEED_BLOCKS, 0, SEED_NAME_SEED);
    let applied = records
        .iter()
        .filter(|r| m.apply(r, ApplyMode::Replay).is_ok())
        .count();
    assert!(applied <= records.len());
    meta_round_trip(&mut m, true);
}

/// `m` encodes to an image that decodes to `m`; with `exact`, the running estimate of
/// the image's size (which bounds the metadata by a checkpoint slot) is exact.
fn meta_round_trip(m: &mut Meta, exact: bool) {
    let img = m.encode_image();
    if exact {
        assert_eq!(
            img.len() as u64,
            m.image_bytes(),
            "the checkpoint image size estimate is wrong"
        );
    }
    let back = Meta::decode_image(&img, SEED_DATA_START, SEED_BLOCKS, SEED_NAME_SEED)
        .unwrap_or_else(|e| panic!("a checkpoint image the encoder wrote does not decode: {e}"));
    assert!(
        *back.resident_inodes() == *m.resident_inodes()
            && back.orphans == m.orphans
            && back.next_ino == m.next_ino,
        "a checkpoint image decodes to another state"
    );
}

// ---- checkpoint --------------------------------------------------------------------

/// One checkpoint slot's contents, as read and with the checksum recomputed; the image
/// of a valid one is decoded (seed geometry), checked, and if consistent has its
/// orphans deleted as mount does.
pub fn checkpoint(data: &[u8]) -> Outcome {
    let raw = ckpt_props(data);
    let mut fixed = data.to_vec();
    fix_trailing_crc(&mut fixed, CKPT_HEADER);
    raw.or(ckpt_props(&fixed))
}

fn ckpt_props(buf: &[u8]) -> Outcome {
    let peek = Checkpoint::peek_len(buf);
    match Checkpoint::decode(buf) {
        Ok(c) => {
            let enc = c.encode();
            assert_eq!(peek, Ok(enc.len()), "peek_len and decode disagree");
            assert_eq!(
                Checkpoint::decode(&enc).as_ref(),
                Ok(&c),
                "a decoded checkpoint does not survive encoding"
            );
            metadata_image(&c.image)
        }
        Err(e) => Outcome::Refused(e.to_string()),
    }
}

fn metadata_image(img: &[u8]) -> Outcome {
    // Formats 4 and 5: a root record (the tree's nodes are not in this input; the
    // `image` target and the tree's own property tests cover them), format 5's with
    // the inode count and free space, checked as mount reads them. Older formats: the
    // whole metadata image, still read when an older image is upgraded.
    if img.starts_with(b"WBRT") || img.starts_with(b"WBR2") {
        return match super::metatree::decode_root(img) {
            Ok(root) => {
                if let Some(space) = &root.space {
                    if let Err(e) = super::alloc::FreeSpace::from_extents(
                        SEED_DATA_START,
                        SEED_BLOCKS,
                        space.free.iter().copied(),
                    ) {
                        return Outcome::Refused(format!("the record's free space: {e}"));
                    }
                }
                assert_eq!(
                    super::metatree::decode_root(&super::metatree::encode_root(&root)).ok(),
                    Some(root),
                    "a decoded root record does not survive encoding"
                );
                Outcome::Accepted
            }
            Err(e) => Outcome::Refused(e.to_string()),
        };
    }
    let mut m = match Meta::decode_image(img, SEED_DATA_START, SEED_BLOCKS, SEED_NAME_SEED) {
        Ok(m) => m,
        Err(e) => return Outcome::Refused(format!("checkpoint image: {e}")),
    };
    let problems = m.check();
    if !problems.is_empty() {
        return Outcome::Refused(problems.join("; "));
    }
    meta_round_trip(&mut m, false);
    let orphans: Vec<u64> = m.orphans.iter().copied().collect();
    for ino in orphans {
        if let Err(e) = m.apply(&Record::Delete { ino }, ApplyMode::Replay) {
            panic!("check() passed but orphan {ino} cannot be deleted: {e}");
        }
    }
    let problems = m.check();
    assert!(
        problems.is_empty(),
        "deleting the orphans of a clean image broke it: {problems:?}"
    );
    Outcome::Accepted
}

// ---- whole image -------------------------------------------------------------------

/// The largest device a packed image describes (16 MiB): bounds what one input may
/// make the library read and allocate.
pub const IMAGE_MAX_BLOCKS: u64 = 4096;
/// Flag of a packed image: recompute every checksum on it before mounting.
pub const FIX_CHECKSUMS: u8 = 1;
/// Zero bytes that end a run in [`pack_image`] (shorter gaps stay inside the run).
const PACK_GAP: usize = 32;

/// A device image held as its non-zero blocks.
#[derive(Clone, Debug, Default)]
pub struct SparseImage {
    pub blocks: u64,
    pub map: BTreeMap<u64, Vec<u8>>,
}

impl SparseImage {
    /// `n` blocks from `start` (zeros where nothing was written).
    pub fn read(&self, start: u64, n: u64) -> Vec<u8> {
        let mut out = vec![0u8; n as usize * BS];
        for (b, data) in self.map.range(start..start.saturating_add(n)) {
            let off = (b - start) as usize * BS;
            out[off..off + BS].copy_from_slice(data);
        }
        out
    }

    /// Whole blocks at `start`; all-zero blocks not already present stay absent.
    pub fn write(&mut self, start: u64, data: &[u8]) {
        for (i, blk) in data.chunks(BS).enumerate() {
            let b = start + i as u64;
            if b >= self.blocks {
                return;
            }
            if blk.iter().any(|&x| x != 0) || self.map.contains_key(&b) {
                let mut v = blk.to_vec();
                v.resize(BS, 0);
                self.map.insert(b, v);
            }
        }
    }

    fn write_bytes(&mut self, mut off: u64, mut bytes: &[u8]) {
        let size = self.blocks * BS as u64;
        while !bytes.is_empty() && off < size {
            let b = off / BS as u64;
            let within = (off % BS as u64) as usize;
            let n = bytes.len().min(BS - within);
            let blk = self.map.entry(b).or_insert_with(|| vec![0u8; BS]);
            blk[within..within + n].copy_from_slice(&bytes[..n]);
            off += n as u64;
            bytes = &bytes[n..];
        }
    }
}

/// The compact form of a device image of `image.len()` bytes (whole blocks, at most
/// [`IMAGE_MAX_BLOCKS`]): `flags` (u8), the device size in blocks (u16 LE), then runs
/// of bytes, each its byte offset (u32 LE), its length (u16 LE) and the bytes. Runs of
/// zeros are left out.
pub fn pack_image(flags: u8, image: &[u8]) -> Vec<u8> {
    let blocks = (image.len() / BS) as u16;
    let mut out = vec![flags];
    out.extend_from_slice(&blocks.to_le_bytes());
    let mut i = 0;
    while i < image.len() {
        if image[i] == 0 {
            i += 1;
            continue;
        }
        // A run: from here to the last non-zero byte before a gap of PACK_GAP zeros.
        let start = i;
        let mut last = i;
        while i < image.len() && i - last <= PACK_GAP && i - start < u16::MAX as usize {
            if image[i] != 0 {
                last = i;
            }
            i += 1;
        }
        let run = &image[start..=last];
        out.extend_from_slice(&(start as u32).to_le_bytes());
        out.extend_from_slice(&(run.len() as u16).to_le_bytes());
        out.extend_from_slice(run);
        i = last + 1;
    }
    out
}

/// The flags and image of [`pack_image`]'s form, whatever the bytes: a missing size
/// means [`SEED_BLOCKS`], sizes are clamped to 1..=[`IMAGE_MAX_BLOCKS`], runs past the
/// device or the input are cut short.
pub fn unpack_image(data: &[u8]) -> (u8, SparseImage) {
    let flags = data.first().copied().unwrap_or(0);
    let blocks = match data.get(1..3) {
        Some(b) => u16::from_le_bytes([b[0], b[1]]) as u64,
        None => SEED_BLOCKS,
    };
    let mut img = SparseImage {
        blocks: blocks.clamp(1, IMAGE_MAX_BLOCKS),
        map: BTreeMap::new(),
    };
    let mut rest = data.get(3..).unwrap_or(&[]);
    while rest.len() >= 6 {
        let off = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as u64;
        let len = u16::from_le_bytes([rest[4], rest[5]]) as usize;
        let end = (6 + len).min(rest.len());
        img.write_bytes(off, &rest[6..end]);
        rest = &rest[end..];
    }
    (flags, img)
}

/// Recompute the checksums of both superblock copies, both checkpoint slots and every
/// transaction found in the journal (as replay walks it, but past a bad one too).
pub fn fix_checksums(img: &mut SparseImage) {
    for b in SB_BLOCKS {
        if let Some(blk) = img.map.get_mut(&b) {
            fix_superblock(blk);
        }
    }
    let Some(sb) = SB_BLOCKS
        .iter()
        .find_map(|&b| Superblock::decode(&img.read(b, 1)).ok())
    else {
        return;
    };
    for (start, len) in sb.checkpoint {
        if start.checked_add(len).is_none_or(|e| e > img.blocks) {
            continue;
        }
        let Ok(bytes) = Checkpoint::peek_len(&img.read(start, 1)) else {
            continue;
        };
        let n = (bytes / BS) as u64;
        if n <= len {
            let mut buf = img.read(start, n);
            fix_trailing_crc(&mut buf, CKPT_HEADER);
            img.write(start, &buf);
        }
    }
    let end = sb
        .journal_start
        .saturating_add(sb.journal_blocks)
        .min(img.blocks);
    let mut pos = sb.journal_start;
    while pos < end {
        if !img.map.contains_key(&pos) {
            pos += 1;
            continue;
        }
        match Txn::peek_len(&img.read(pos, 1), sb.fs_id) {
            Ok(bytes) if pos + (bytes / BS) as u64 <= end => {
                let n = (bytes / BS) as u64;
                let mut buf = img.read(pos, n);
                fix_txn(&mut buf);
                img.write(pos, &buf);
                pos += n;
            }
            _ => pos += 1,
        }
    }
}

/// A memory-backed null device holding `img`, and its queue.
pub fn device(img: &SparseImage) -> Result<Arc<RequestQueue>, String> {
    let spec = format!(
        "null,memory_backed=1,size={},hw_queues=1",
        img.blocks * BS as u64
    );
    let cfg = QueueConfig::default();
    let spec = DeviceSpec::parse(&spec).map_err(|e| e.to_string())?;
    let dev = NullDevice::from_spec(&spec, cfg.clock.clone()).map_err(|e| e.to_string())?;
    for (b, data) in &img.map {
        dev.load(b * (BS as u64 / 512), data)?;
    }
    RequestQueue::new(Arc::new(dev), cfg).map_err(|e| e.to_string())
}

/// Mount options of the harness: no periodic writeback or commit, so what happens is
/// what the harness does.
pub fn mount_options() -> MountOptions {
    let mut o = MountOptions::default();
    o.wb.dirty_writeback_centisecs = 0;
    o.commit_interval_ms = 3_600_000;
    // Small fsyncs of a mounted image go through the journaled-data path too.
    o.journal_data_kb = 16;
    o
}

/// Words of which a refusal must hold one: the structure found damaged.
const STRUCTURES: [&str; 15] = [
    "superblock",
    "tree",
    "checkpoint",
    "journal",
    "transaction",
    "image",
    "inode",
    "directory",
    "orphan",
    "extent",
    "block",
    "symlink",
    "attribute",
    "device",
    "slot",
];

fn names_a_structure(msg: &str) -> bool {
    STRUCTURES.iter().any(|s| msg.contains(s))
}

/// A whole packed image: fsck, mount (both must agree, but that a format 5 mount reads
/// less than fsck and may accept what fsck refuses), and when fsck is clean and it
/// mounts, use it, unmount, fsck (clean) and mount again.
pub fn image(data: &[u8]) -> Outcome {
    let (flags, mut img) = unpack_image(data);
    if flags & FIX_CHECKSUMS != 0 {
        fix_checksums(&mut img);
    }
    let q = device(&img).unwrap_or_else(|e| panic!("the harness's device: {e}"));
    let report = fsck(&q);
    for p in &report.problems {
        assert!(names_a_structure(p), "an fsck problem naming nothing: {p}");
    }
    match (report.is_clean(), Volume::mount(q.clone(), mount_options())) {
        (true, Ok(v)) => {
            exercise(&v);
            if let Err(e) = v.unmount() {
                panic!("unmount of a mounted image failed: {e}");
            }
            let after = fsck(&q);
            assert!(
                after.is_clean(),
                "fsck after use and unmount: {:?}",
                after.problems
            );
            match Volume::mount(q, mount_options()) {
                Ok(v) => {
                    if let Err(e) = v.unmount() {
                        panic!("second unmount failed: {e}");
                    }
                }
                Err(e) => panic!("a used and unmounted image does not mount again: {e}"),
            }
            Outcome::Accepted
        }
        (true, Err(e)) => panic!("fsck found the image clean but mount refused it: {e}"),
        // Format 5 mounts without reading the tree whole: what it did not read, it
        // cannot refuse (as a kernel filesystem finds a bad inode when it reads it).
        // Its own reads (root record, filesystem record, orphans, replay's inodes) are
        // what this input tried; the volume is not used.
        (false, Ok(v)) if v.superblock().version >= super::format::LAZY_VERSION => {
            v.crash();
            Outcome::Refused(report.problems.join("; "))
        }
        (false, Ok(v)) => {
            v.crash();
            panic!(
                "mount accepted an image in which fsck found {:?}",
                report.problems
            )
        }
        (false, Err(e)) => {
            let msg = e.to_string();
            assert!(names_a_structure(&msg), "a refusal naming nothing: {msg}");
            Outcome::Refused(msg)
        }
    }
}

/// At most this many inodes are visited by the walk (a bound on one input's time).
const WALK_MAX: usize = 2000;

/// What a mounted image must allow: every name looked at and read (directories,
/// attributes, xattrs, symlink targets, the first and last pages of files), then
/// changes that allocate, free and rename.
fn exercise(v: &Volume) {
    let c = Cred::root();
    let mut seen = BTreeSet::new();
    let mut stack = vec![ROOT_INO];
    let mut a_file: Option<(u64, Vec<u8>)> = None;
    while let Some(d) = stack.pop() {
        if seen.len() >= WALK_MAX || !seen.insert(d) {
            continue;
        }
        if let Err(e) = v.opendir_as(&c, d) {
            panic!("opendir of directory {d}: {e}");
        }
        // In small pages, so resuming from a cookie is exercised too.
        let mut entries = Vec::new();
        loop {
            let after = entries.last().map_or(0, |e: &DirPageEntry| e.cookie);
            let page = v
                .readdir_page(d, after, 7)
                .unwrap_or_else(|e| panic!("readdir of directory {d}: {e}"));
            if page.is_empty() {
                break;
            }
            entries.extend(page);
        }
        for DirPageEntry {
            name, ino, kind, ..
        } in entries
        {
            if let Err(e) = v.getattr(ino) {
                panic!("getattr of inode {ino}: {e}");
            }
            let names = v
                .listxattr_as(&c, ino)
                .unwrap_or_else(|e| panic!("listxattr of inode {ino}: {e}"));
            for n in names {
                if let Err(e) = v.getxattr_as(&c, ino, &n) {
                    panic!("getxattr of a listed attribute of inode {ino}: {e}");
                }
            }
            match kind {
                InodeKind::Dir => stack.push(ino),
                InodeKind::Symlink => {
                    if let Err(e) = v.readlink_ino(ino) {
                        panic!("readlink of symlink {ino}: {e}");
                    }
                }
                InodeKind::File => {
                    read_ends(v, &c, ino);
                    a_file.get_or_insert((d, name));
                }
                _ => {}
            }
        }
    }
    change(v, &c, a_file);
}

/// Read a file's first 64 KiB and its last page.
fn read_ends(v: &Volume, c: &Cred, ino: u64) {
    let f = v
        .open_as(c, ino, &OpenOptions::read())
        .unwrap_or_else(|e| panic!("open of file {ino}: {e}"));
    let mut buf = vec![0u8; 64 << 10];
    if let Err(e) = f.read_at(0, &mut buf) {
        panic!("read of file {ino}: {e}");
    }
    let size = f.size();
    if size > BS as u64 {
        if let Err(e) = f.read_at(size - BS as u64, &mut buf[..BS]) {
            panic!("read of file {ino} at its end: {e}");
        }
    }
    if let Err(e) = f.close() {
        panic!("close of file {ino}: {e}");
    }
}

/// A change a consistent image must take, or refuse only for want of room or because
/// the image already holds the name.
fn allowed(what: &str, r: Result<(), FsError>) {
    match r {
        Ok(()) | Err(FsError::NoSpace) | Err(FsError::Exists(_)) => {}
        Err(e) => panic!("{what} on a mounted image: {e}"),
    }
}

fn change(v: &Volume, c: &Cred, a_file: Option<(u64, Vec<u8>)>) {
    let data = vec![0x5au8; 3 * BS + 100];
    allowed(
        "create, write and fsync",
        v.create_as(c, ROOT_INO, b"fuzz-new", 0o644, &OpenOptions::create())
            .and_then(|(f, _)| {
                f.write_all_at(0, &data)?;
                f.fsync()?;
                f.close()
            }),
    );
    allowed(
        "mkdir",
        v.mknod_as(c, ROOT_INO, b"fuzz-dir", 0o040755, 0).map(drop),
    );
    if let Ok(dir) = v.lookup_as(c, ROOT_INO, b"fuzz-dir") {
        if dir.kind == InodeKind::Dir {
            allowed(
                "rename",
                v.rename_as(
                    c,
                    ROOT_INO,
                    b"fuzz-new",
                    dir.ino,
                    b"moved",
                    RenameFlags::default(),
                ),
            );
        }
    }
    if let Some((dir, name)) = a_file {
        allowed("unlink", v.unlink_as(c, dir, &name, false));
    }
    allowed("sync", v.sync());
}

/// Make the fresh filesystem `sb` on `q` what version 1 wrote: a whole-metadata
/// checkpoint without the v2 extras section (the v2 encoder writes an empty one, a zero
/// count of 8 bytes), superblock version 1. For tests and seeds of the upgrade path.
pub fn make_version_1(
    q: &Arc<RequestQueue>,
    sb: &super::format::Superblock,
) -> super::FsResult<()> {
    use crate::block::BioFlags;
    use crate::buf::IoBuf;
    let mut image = Meta::mkfs(sb.data_start, sb.nr_blocks, 1, sb.fs_id).encode_image();
    let n = image.len();
    assert_eq!(&image[n - 8..], &[0u8; 8], "an empty extras section");
    image.truncate(n - 8);
    let c = super::format::Checkpoint {
        fs_id: sb.fs_id,
        seq: 1,
        tid: 0,
        journal_pos: 0,
        image,
    };
    q.write_sync(
        sb.checkpoint[0].0 * 8,
        IoBuf::from_slice(&c.encode()),
        BioFlags::FUA,
    )?;
    let mut old = sb.clone();
    old.version = 1;
    for b in super::format::SB_BLOCKS {
        q.write_sync(b * 8, IoBuf::from_slice(&old.encode()), BioFlags::FUA)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_the_format() {
        let sb = Superblock::layout(SEED_BLOCKS, 7, 0).unwrap();
        assert_eq!(sb.data_start, SEED_DATA_START);
        let enc = sb.encode();
        assert_eq!(
            u32::from_le_bytes(enc[SB_FIELDS..SB_FIELDS + 4].try_into().unwrap()),
            crc(&enc[..SB_FIELDS])
        );
    }

    #[test]
    fn pack_and_unpack_round_trip() {
        let mut image = vec![0u8; 3 * BS];
        image[5] = 1;
        image[5 + PACK_GAP] = 2; // within the gap: one run
        image[BS + 7] = 3;
        image[3 * BS - 1] = 4;
        let packed = pack_image(FIX_CHECKSUMS, &image);
        let (flags, img) = unpack_image(&packed);
        assert_eq!(flags, FIX_CHECKSUMS);
        assert_eq!(img.blocks, 3);
        assert_eq!(img.read(0, 3), image);
        assert!(packed.len() < 3 + 3 * (6 + PACK_GAP + 2));
        // Anything unpacks: empty, a size of zero, runs past the device.
        assert_eq!(unpack_image(&[]).1.blocks, SEED_BLOCKS);
        assert_eq!(unpack_image(&[0, 0, 0]).1.blocks, 1);
        let (_, img) = unpack_image(&[0, 1, 0, 0xff, 0x0f, 0, 0, 9, 0, 1, 2]);
        assert!(img.map.len() <= 1);
    }
}
