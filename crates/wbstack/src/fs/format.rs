//! The on-disk format: superblock (block 0, copy in block 1), the metadata journal's
//! transactions of logical records, and checkpoint slots. Everything is little-endian
//! and checksummed with CRC32C; every decoder returns a `FormatError` saying what is
//! wrong, never panics, whatever the bytes.

use std::fmt;

pub const BLOCK_SIZE: usize = 4096;
pub const SB_MAGIC: u64 = u64::from_le_bytes(*b"WBSTACK1");
/// Version 2 added device nodes, FIFOs and sockets (their kinds and `rdev`) and
/// extended attributes; version 3 journaled data blocks (`Record::DataBlock`,
/// `Record::Revoke`); version 4 the metadata tree; version 5 a tree mount need not
/// read whole (a directory's parent and subdirectory count in its inode record, the
/// inode count and the free space in the checkpoint record); version 6 the journal as a
/// ring (`fs::jspace`: a transaction may wrap to the journal's start behind a checkpoint
/// written in the background, which a version 5 binary's replay would not follow: it
/// meets a version error instead). Older images are read and upgraded at mount.
pub const FORMAT_VERSION: u32 = 6;
/// The whole-metadata checkpoint's version: what mkfs writes when asked for it
/// (`MkfsOptions::format`), and what an older image of that kind becomes at its first
/// mount.
pub const WHOLE_VERSION: u32 = 3;
/// The first version whose checkpoint is the metadata tree.
pub const TREE_VERSION: u32 = 4;
/// The first tree version a mount need not read whole.
pub const LAZY_VERSION: u32 = 5;
/// The tree version mkfs writes, and a version 4 or 5 image becomes at its first
/// mount: its journal is a ring.
pub const RING_VERSION: u32 = 6;
/// What mkfs writes unless asked: the metadata tree, read on demand (faster than
/// version 3 from a few hundred thousand files on, and its mount does not grow with
/// them).
pub const DEFAULT_VERSION: u32 = RING_VERSION;
/// The oldest version this build reads.
pub const OLDEST_VERSION: u32 = 1;
pub const TXN_MAGIC: u32 = u32::from_le_bytes(*b"TXN1");
pub const CKPT_MAGIC: u32 = u32::from_le_bytes(*b"CKP1");
/// Superblock copies live in these blocks.
pub const SB_BLOCKS: [u64; 2] = [0, 1];

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error("not a wbstack image: the magic number is {0:#018x}, expected {SB_MAGIC:#018x}")]
    BadMagic(u64),
    #[error("format version {0} is not supported (this build reads versions {OLDEST_VERSION} to {FORMAT_VERSION}; a newer wbstack made this image)")]
    BadVersion(u32),
    #[error("{what} checksum mismatch (stored {stored:#010x}, computed {computed:#010x}); run `wbstack fsck`")]
    Checksum {
        what: &'static str,
        stored: u32,
        computed: u32,
    },
    #[error("{0} is truncated")]
    Truncated(&'static str),
    #[error("{0}")]
    Corrupt(String),
}

pub fn crc(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}

/// Appends little-endian fields.
#[derive(Default)]
pub struct Writer(pub Vec<u8>);

impl Writer {
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// Length-prefixed bytes (u32 length).
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.u32(b.len() as u32);
        self.0.extend_from_slice(b);
        self
    }
}

/// Reads little-endian fields with bounds checks; running off the end is `Truncated`.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8], what: &'static str) -> Reader<'a> {
        Reader { buf, pos: 0, what }
    }
    pub fn pos(&self) -> usize {
        self.pos
    }
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], FormatError> {
        if self.remaining() < n {
            return Err(FormatError::Truncated(self.what));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    pub fn u8(&mut self) -> Result<u8, FormatError> {
        Ok(self.take(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16, FormatError> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    pub fn u32(&mut self) -> Result<u32, FormatError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    pub fn u64(&mut self) -> Result<u64, FormatError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    pub fn bytes(&mut self) -> Result<&'a [u8], FormatError> {
        let n = self.u32()? as usize;
        self.take(n)
    }
}

/// Bytes of the superblock's fields; its CRC32C follows them.
pub const SB_FIELDS: usize = 8 + 4 + 4 + 8 + 8 + 8 + 4 * 8 + 8 + 8 + 8;

/// Where everything lives, in 4 KiB blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub version: u32,
    pub block_size: u32,
    pub nr_blocks: u64,
    pub journal_start: u64,
    pub journal_blocks: u64,
    /// The two alternating checkpoint slots.
    pub checkpoint: [(u64, u64); 2],
    /// First block of the data area (everything after the metadata areas).
    pub data_start: u64,
    /// Identifies this filesystem (stamped into journal transactions, so a stale
    /// journal of a previous mkfs on the same device is never replayed).
    pub fs_id: u64,
    pub created_ns: u64,
}

impl Superblock {
    /// Lay out a new filesystem of `nr_blocks`: journal and checkpoint slots sized from
    /// the device (bounded), data after them.
    pub fn layout(nr_blocks: u64, fs_id: u64, created_ns: u64) -> Result<Superblock, FormatError> {
        let journal_blocks = (nr_blocks / 64).clamp(256, 32768);
        let ckpt_blocks = (nr_blocks / 64).clamp(512, 262144);
        let journal_start = 2;
        let a = journal_start + journal_blocks;
        let b = a + ckpt_blocks;
        let data_start = b + ckpt_blocks;
        if data_start + 16 > nr_blocks {
            return Err(FormatError::Corrupt(format!(
                "a device of {nr_blocks} blocks is too small: metadata alone needs {data_start} blocks"
            )));
        }
        Ok(Superblock {
            version: FORMAT_VERSION,
            block_size: BLOCK_SIZE as u32,
            nr_blocks,
            journal_start,
            journal_blocks,
            checkpoint: [(a, ckpt_blocks), (b, ckpt_blocks)],
            data_start,
            fs_id,
            created_ns,
        })
    }

    /// One block: the fields, then the CRC32C of everything before it.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u64(SB_MAGIC)
            .u32(self.version)
            .u32(self.block_size)
            .u64(self.nr_blocks);
        w.u64(self.journal_start).u64(self.journal_blocks);
        for (s, n) in self.checkpoint {
            w.u64(s).u64(n);
        }
        w.u64(self.data_start).u64(self.fs_id).u64(self.created_ns);
        let c = crc(&w.0);
        w.u32(c);
        w.0.resize(BLOCK_SIZE, 0);
        w.0
    }

    pub fn decode(buf: &[u8]) -> Result<Superblock, FormatError> {
        let mut r = Reader::new(buf, "superblock");
        let magic = r.u64()?;
        if magic != SB_MAGIC {
            return Err(FormatError::BadMagic(magic));
        }
        let version = r.u32()?;
        if !(OLDEST_VERSION..=FORMAT_VERSION).contains(&version) {
            return Err(FormatError::BadVersion(version));
        }
        let block_size = r.u32()?;
        let nr_blocks = r.u64()?;
        let journal_start = r.u64()?;
        let journal_blocks = r.u64()?;
        let checkpoint = [(r.u64()?, r.u64()?), (r.u64()?, r.u64()?)];
        let data_start = r.u64()?;
        let fs_id = r.u64()?;
        let created_ns = r.u64()?;
        let end = r.pos();
        let stored = r.u32()?;
        let computed = crc(&buf[..end]);
        if stored != computed {
            return Err(FormatError::Checksum {
                what: "superblock",
                stored,
                computed,
            });
        }
        let sb = Superblock {
            version,
            block_size,
            nr_blocks,
            journal_start,
            journal_blocks,
            checkpoint,
            data_start,
            fs_id,
            created_ns,
        };
        sb.check()?;
        Ok(sb)
    }

    /// Geometry sanity: areas in order, inside the device, not overlapping.
    pub fn check(&self) -> Result<(), FormatError> {
        let bad = |m: String| Err(FormatError::Corrupt(format!("superblock geometry: {m}")));
        if self.block_size as usize != BLOCK_SIZE {
            return bad(format!(
                "block size {} (only {BLOCK_SIZE} is supported)",
                self.block_size
            ));
        }
        let areas = [
            ("journal", self.journal_start, self.journal_blocks),
            ("checkpoint A", self.checkpoint[0].0, self.checkpoint[0].1),
            ("checkpoint B", self.checkpoint[1].0, self.checkpoint[1].1),
        ];
        let mut prev_end = 2u64;
        for (name, start, len) in areas {
            let Some(end) = start.checked_add(len) else {
                return bad(format!("{name} overflows"));
            };
            if len == 0 || start < prev_end || end > self.nr_blocks {
                return bad(format!(
                    "{name} at block {start}+{len} overlaps another area or leaves the device"
                ));
            }
            prev_end = end;
        }
        // Checkpoints alternate between the slots and the running filesystem bounds its
        // metadata by one slot's size (`Vol::check_meta_room`): a smaller other slot
        // would refuse the next checkpoint.
        if self.checkpoint[0].1 != self.checkpoint[1].1 {
            return bad(format!(
                "checkpoint slots of {} and {} blocks (they must be equal)",
                self.checkpoint[0].1, self.checkpoint[1].1
            ));
        }
        if self.data_start < prev_end || self.data_start >= self.nr_blocks {
            return bad(format!(
                "data area starts at block {} (metadata ends at {prev_end})",
                self.data_start
            ));
        }
        Ok(())
    }
}

/// What kind of inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InodeKind {
    File = 1,
    Dir = 2,
    Symlink = 3,
    Fifo = 4,
    Socket = 5,
    CharDev = 6,
    BlockDev = 7,
}

impl InodeKind {
    pub fn from_u8(v: u8) -> Result<InodeKind, FormatError> {
        match v {
            1 => Ok(InodeKind::File),
            2 => Ok(InodeKind::Dir),
            3 => Ok(InodeKind::Symlink),
            4 => Ok(InodeKind::Fifo),
            5 => Ok(InodeKind::Socket),
            6 => Ok(InodeKind::CharDev),
            7 => Ok(InodeKind::BlockDev),
            _ => Err(FormatError::Corrupt(format!("unknown inode kind {v}"))),
        }
    }

    /// The file-type bits of st_mode (S_IFREG, ...).
    pub fn mode_bits(self) -> u32 {
        match self {
            InodeKind::File => 0o100000,
            InodeKind::Dir => 0o040000,
            InodeKind::Symlink => 0o120000,
            InodeKind::Fifo => 0o010000,
            InodeKind::Socket => 0o140000,
            InodeKind::CharDev => 0o020000,
            InodeKind::BlockDev => 0o060000,
        }
    }

    /// The kind named by st_mode's file-type bits.
    pub fn from_mode(mode: u32) -> Option<InodeKind> {
        Some(match mode & 0o170000 {
            0o100000 | 0 => InodeKind::File,
            0o040000 => InodeKind::Dir,
            0o120000 => InodeKind::Symlink,
            0o010000 => InodeKind::Fifo,
            0o140000 => InodeKind::Socket,
            0o020000 => InodeKind::CharDev,
            0o060000 => InodeKind::BlockDev,
            _ => return None,
        })
    }
}

/// Longest extended attribute name and value (the VFS's XATTR_NAME_MAX, XATTR_SIZE_MAX).
pub const XATTR_NAME_MAX: usize = 255;
pub const XATTR_SIZE_MAX: usize = 65536;

/// A journaled data block's content: shared, not copied, between the record that
/// carries it and the home write that follows the commit (`fs::jdata`), in a page of
/// the IO buffer pool (recycled; a fresh heap copy per fsync faulted in new memory
/// under `st`).
pub type JBlockData = std::sync::Arc<crate::buf::IoBuf>;

/// A logical metadata change, as journaled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// A new inode.
    Create {
        ino: u64,
        kind: InodeKind,
        mode: u32,
        uid: u32,
        gid: u32,
        time_ns: u64,
    },
    /// A directory entry `name` in `parent` pointing at `ino` (nlink +1).
    Link {
        parent: u64,
        name: Vec<u8>,
        ino: u64,
    },
    /// Remove an entry (nlink −1; at 0 the inode becomes an orphan until last close).
    Unlink {
        parent: u64,
        name: Vec<u8>,
        ino: u64,
    },
    /// The on-disk size (the kernel's i_disksize): grows only after the data under it
    /// was written, so a crash never shows a file longer than what reached the disk.
    SetSize { ino: u64, size: u64 },
    /// Shrink (or grow) to `size`, freeing every block wholly past it. The freed blocks
    /// are derived from the inode, so replay cannot free the wrong ones.
    Truncate { ino: u64, size: u64 },
    SetAttr {
        ino: u64,
        mode: u32,
        uid: u32,
        gid: u32,
        atime_ns: u64,
        mtime_ns: u64,
        ctime_ns: u64,
    },
    /// File blocks [file_block, +len) live at device blocks [start, +len). Journaled only
    /// after the data writes completed (ordered data).
    MapExtent {
        ino: u64,
        file_block: u64,
        start: u64,
        len: u64,
    },
    /// A symlink's target.
    SetTarget { ino: u64, target: Vec<u8> },
    /// The inode has no names left but is still open: delete it at mount if the
    /// matching `Delete` never made it to the journal.
    Orphan { ino: u64 },
    /// The inode (no names left, not open) is gone and its blocks are free.
    Delete { ino: u64 },
    /// A device node's device number (v2).
    SetRdev { ino: u64, rdev: u32 },
    /// Set extended attribute `name` to `value` (v2).
    SetXattr {
        ino: u64,
        name: Vec<u8>,
        value: Vec<u8>,
    },
    /// Remove extended attribute `name` (v2).
    RemoveXattr { ino: u64, name: Vec<u8> },
    /// Journaled data (v3, data=journal for small fsyncs): the whole content of data
    /// block `block` (its final location), checked by its own CRC32C besides the
    /// transaction's. Replay writes it home unless a later record revokes it; the
    /// running filesystem writes it home right after the commit, and always before the
    /// journal space holding it is reused (a checkpoint).
    DataBlock { block: u64, data: JBlockData },
    /// Block `block` was written in place through ordered data after an earlier
    /// transaction journaled a copy of it (v3): replay must not write that older copy.
    Revoke { block: u64 },
}

impl Record {
    /// Bytes `encode` writes, without encoding (what the running transaction adds up
    /// to decide when it is big enough to commit).
    pub fn encoded_len(&self) -> usize {
        // Tag byte, then the fields; `bytes` is a u32 length and the bytes.
        1 + match self {
            Record::Create { .. } => 8 + 1 + 4 * 3 + 8,
            Record::Link { name, .. } | Record::Unlink { name, .. } => 8 + 4 + name.len() + 8,
            Record::SetSize { .. } | Record::Truncate { .. } => 16,
            Record::SetAttr { .. } => 8 + 4 * 3 + 8 * 3,
            Record::MapExtent { .. } => 32,
            Record::SetTarget { target, .. } => 8 + 4 + target.len(),
            Record::Orphan { .. } | Record::Delete { .. } | Record::Revoke { .. } => 8,
            Record::SetRdev { .. } => 8 + 4,
            Record::SetXattr { name, value, .. } => 8 + 4 + name.len() + 4 + value.len(),
            Record::RemoveXattr { name, .. } => 8 + 4 + name.len(),
            Record::DataBlock { data, .. } => 8 + 4 + 4 + data.len(),
        }
    }

    pub fn encode(&self, w: &mut Writer) {
        match self {
            Record::Create {
                ino,
                kind,
                mode,
                uid,
                gid,
                time_ns,
            } => {
                w.u8(1)
                    .u64(*ino)
                    .u8(*kind as u8)
                    .u32(*mode)
                    .u32(*uid)
                    .u32(*gid)
                    .u64(*time_ns);
            }
            Record::Link { parent, name, ino } => {
                w.u8(2).u64(*parent).bytes(name).u64(*ino);
            }
            Record::Unlink { parent, name, ino } => {
                w.u8(3).u64(*parent).bytes(name).u64(*ino);
            }
            Record::SetSize { ino, size } => {
                w.u8(4).u64(*ino).u64(*size);
            }
            Record::SetAttr {
                ino,
                mode,
                uid,
                gid,
                atime_ns,
                mtime_ns,
                ctime_ns,
            } => {
                w.u8(5)
                    .u64(*ino)
                    .u32(*mode)
                    .u32(*uid)
                    .u32(*gid)
                    .u64(*atime_ns)
                    .u64(*mtime_ns)
                    .u64(*ctime_ns);
            }
            Record::MapExtent {
                ino,
                file_block,
                start,
                len,
            } => {
                w.u8(6).u64(*ino).u64(*file_block).u64(*start).u64(*len);
            }
            Record::Truncate { ino, size } => {
                w.u8(7).u64(*ino).u64(*size);
            }
            Record::SetTarget { ino, target } => {
                w.u8(8).u64(*ino).bytes(target);
            }
            Record::Orphan { ino } => {
                w.u8(9).u64(*ino);
            }
            Record::Delete { ino } => {
                w.u8(10).u64(*ino);
            }
            Record::SetRdev { ino, rdev } => {
                w.u8(11).u64(*ino).u32(*rdev);
            }
            Record::SetXattr { ino, name, value } => {
                w.u8(12).u64(*ino).bytes(name).bytes(value);
            }
            Record::RemoveXattr { ino, name } => {
                w.u8(13).u64(*ino).bytes(name);
            }
            Record::DataBlock { block, data } => {
                w.u8(14)
                    .u64(*block)
                    .u32(crc(data.as_slice()))
                    .bytes(data.as_slice());
            }
            Record::Revoke { block } => {
                w.u8(15).u64(*block);
            }
        }
    }

    pub fn decode(r: &mut Reader) -> Result<Record, FormatError> {
        let tag = r.u8()?;
        // The same rule as the checkpoint image's (`valid_name`): a name replay accepts
        // but a checkpoint refuses would make the next checkpoint unreadable.
        let name = |r: &mut Reader| -> Result<Vec<u8>, FormatError> {
            let b = r.bytes()?;
            if !super::meta::valid_name(b) {
                return Err(FormatError::Corrupt(format!(
                    "invalid name of {} bytes in a journal record",
                    b.len()
                )));
            }
            Ok(b.to_vec())
        };
        Ok(match tag {
            1 => Record::Create {
                ino: r.u64()?,
                kind: InodeKind::from_u8(r.u8()?)?,
                mode: r.u32()?,
                uid: r.u32()?,
                gid: r.u32()?,
                time_ns: r.u64()?,
            },
            2 => Record::Link {
                parent: r.u64()?,
                name: name(r)?,
                ino: r.u64()?,
            },
            3 => Record::Unlink {
                parent: r.u64()?,
                name: name(r)?,
                ino: r.u64()?,
            },
            4 => Record::SetSize {
                ino: r.u64()?,
                size: r.u64()?,
            },
            5 => Record::SetAttr {
                ino: r.u64()?,
                mode: r.u32()?,
                uid: r.u32()?,
                gid: r.u32()?,
                atime_ns: r.u64()?,
                mtime_ns: r.u64()?,
                ctime_ns: r.u64()?,
            },
            6 => Record::MapExtent {
                ino: r.u64()?,
                file_block: r.u64()?,
                start: r.u64()?,
                len: r.u64()?,
            },
            7 => Record::Truncate {
                ino: r.u64()?,
                size: r.u64()?,
            },
            8 => {
                let ino = r.u64()?;
                let t = r.bytes()?;
                if t.is_empty() || t.len() > BLOCK_SIZE {
                    return Err(FormatError::Corrupt(format!(
                        "symlink target of {} bytes",
                        t.len()
                    )));
                }
                Record::SetTarget {
                    ino,
                    target: t.to_vec(),
                }
            }
            9 => Record::Orphan { ino: r.u64()? },
            10 => Record::Delete { ino: r.u64()? },
            11 => Record::SetRdev {
                ino: r.u64()?,
                rdev: r.u32()?,
            },
            12 => {
                let ino = r.u64()?;
                let name = xattr_name(r)?;
                let value = r.bytes()?;
                if value.len() > XATTR_SIZE_MAX {
                    return Err(FormatError::Corrupt(format!(
                        "an extended attribute value of {} bytes",
                        value.len()
                    )));
                }
                Record::SetXattr {
                    ino,
                    name,
                    value: value.to_vec(),
                }
            }
            13 => Record::RemoveXattr {
                ino: r.u64()?,
                name: xattr_name(r)?,
            },
            14 => {
                let block = r.u64()?;
                let stored = r.u32()?;
                let data = r.bytes()?;
                if data.len() != BLOCK_SIZE {
                    return Err(FormatError::Corrupt(format!(
                        "a journaled data block of {} bytes",
                        data.len()
                    )));
                }
                let computed = crc(data);
                if stored != computed {
                    return Err(FormatError::Checksum {
                        what: "journaled data block",
                        stored,
                        computed,
                    });
                }
                Record::DataBlock {
                    block,
                    data: std::sync::Arc::new(crate::buf::IoBuf::from_slice(data)),
                }
            }
            15 => Record::Revoke { block: r.u64()? },
            t => {
                return Err(FormatError::Corrupt(format!(
                    "unknown journal record type {t}"
                )))
            }
        })
    }
}

/// The namespaces an extended attribute can be set in (`perm::xattr` refuses any
/// other), so the only ones an image can hold: a stored name outside them could be
/// listed but never read or removed.
pub const XATTR_NAMESPACES: [&[u8]; 4] =
    [b"user.", b"trusted.", b"security.", b"system.posix_acl_"];

/// An extended attribute's name as stored: 1 to XATTR_NAME_MAX bytes, no NUL, in one of
/// [`XATTR_NAMESPACES`].
pub fn xattr_name(r: &mut Reader) -> Result<Vec<u8>, FormatError> {
    let b = r.bytes()?;
    if b.is_empty() || b.len() > XATTR_NAME_MAX || b.contains(&0) {
        return Err(FormatError::Corrupt(format!(
            "invalid extended attribute name of {} bytes",
            b.len()
        )));
    }
    if !XATTR_NAMESPACES.iter().any(|ns| b.starts_with(ns)) {
        return Err(FormatError::Corrupt(format!(
            "extended attribute {:?} is in no known namespace",
            String::from_utf8_lossy(b)
        )));
    }
    Ok(b.to_vec())
}

/// A transaction's records, in chunks of a fixed capacity: the running transaction
/// grows to a quarter of the journal (hundreds of thousands of records) under `st`,
/// and a `Vec` doubling there copied all of it into fresh memory while every namespace
/// operation waited.
#[derive(Clone, Debug, Default)]
pub struct Records {
    chunks: Vec<Vec<Record>>,
    len: usize,
}

impl Records {
    /// Records per chunk: 64 KiB or so, a few of the allocator's pages.
    const CHUNK: usize = 1024;

    pub fn new() -> Records {
        Records::default()
    }

    pub fn push(&mut self, r: Record) {
        match self.chunks.last_mut() {
            Some(c) if c.len() < Self::CHUNK => c.push(r),
            _ => {
                let mut c = Vec::with_capacity(Self::CHUNK);
                c.push(r);
                self.chunks.push(c);
            }
        }
        self.len += 1;
    }

    pub fn last_mut(&mut self) -> Option<&mut Record> {
        self.chunks.last_mut().and_then(|c| c.last_mut())
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn iter(&self) -> impl Iterator<Item = &Record> + Clone {
        self.chunks.iter().flatten()
    }
}

impl PartialEq for Records {
    /// The same records in the same order, however they are chunked.
    fn eq(&self, other: &Records) -> bool {
        self.len == other.len && self.iter().eq(other.iter())
    }
}

impl Eq for Records {}

impl From<Vec<Record>> for Records {
    fn from(v: Vec<Record>) -> Records {
        v.into_iter().collect()
    }
}

impl FromIterator<Record> for Records {
    fn from_iter<I: IntoIterator<Item = Record>>(iter: I) -> Records {
        let mut r = Records::new();
        for rec in iter {
            r.push(rec);
        }
        r
    }
}

impl<'a> IntoIterator for &'a Records {
    type Item = &'a Record;
    type IntoIter = std::iter::Flatten<std::slice::Iter<'a, Vec<Record>>>;

    fn into_iter(self) -> Self::IntoIter {
        self.chunks.iter().flatten()
    }
}

/// One journal transaction: header, records, and a CRC over both. A transaction that
/// fails its checksum or is cut short is the end of the valid journal (a crash tore it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Txn {
    pub fs_id: u64,
    pub tid: u64,
    pub records: Records,
}

/// Bytes of a transaction's header: magic, fs_id, tid, record count, body length (the
/// last field, so the CRC32C sits at `TXN_HEADER + body length`).
pub const TXN_HEADER: usize = 4 + 8 + 8 + 4 + 4;

impl Txn {
    /// The length `encode` gives (whole blocks), without encoding: the committer
    /// decides where the transaction goes under `st` and encodes it after.
    pub fn encoded_len(&self) -> usize {
        Txn::len_of_body(self.records.iter().map(Record::encoded_len).sum())
    }

    /// The length of a transaction whose records encode to `body_len` bytes.
    pub fn len_of_body(body_len: usize) -> usize {
        (TXN_HEADER + body_len + 4).next_multiple_of(BLOCK_SIZE)
    }

    /// Encoded and padded to whole blocks.
    pub fn encode(&self) -> Vec<u8> {
        // One buffer of the exact size: a big transaction is tens of MiB, and growing
        // (or copying a separate body) doubled its peak memory.
        let body_len: usize = self.records.iter().map(Record::encoded_len).sum();
        let len = Txn::len_of_body(body_len);
        let mut w = Writer(Vec::with_capacity(len));
        w.u32(TXN_MAGIC)
            .u64(self.fs_id)
            .u64(self.tid)
            .u32(self.records.len() as u32)
            .u32(body_len as u32);
        for r in &self.records {
            r.encode(&mut w);
        }
        debug_assert_eq!(
            w.0.len(),
            TXN_HEADER + body_len,
            "Record::encoded_len is exact"
        );
        let c = crc(&w.0);
        w.u32(c);
        let len = w.0.len().next_multiple_of(BLOCK_SIZE);
        w.0.resize(len, 0);
        debug_assert_eq!(w.0.len(), self.encoded_len());
        w.0
    }

    /// How many bytes (whole blocks) the transaction starting at `buf` occupies, from its
    /// header alone (the first block is enough), so a reader knows how much to read. An
    /// error means no transaction of filesystem `fs_id` starts here: the end of the log.
    pub fn peek_len(buf: &[u8], fs_id: u64) -> Result<usize, FormatError> {
        let mut r = Reader::new(buf, "journal transaction");
        let magic = r.u32()?;
        if magic != TXN_MAGIC {
            return Err(FormatError::Corrupt(format!(
                "no journal transaction here (magic {magic:#010x})"
            )));
        }
        let id = r.u64()?;
        if id != fs_id {
            return Err(FormatError::Corrupt(format!(
                "journal transaction of another filesystem ({id:#x})"
            )));
        }
        let _tid = r.u64()?;
        let _n = r.u32()?;
        let body_len = r.u32()? as usize;
        Ok((TXN_HEADER + body_len + 4).next_multiple_of(BLOCK_SIZE))
    }

    /// Decode the transaction at the start of `buf`; returns it and the bytes (whole
    /// blocks) it occupies.
    pub fn decode(buf: &[u8]) -> Result<(Txn, usize), FormatError> {
        let mut r = Reader::new(buf, "journal transaction");
        let magic = r.u32()?;
        if magic != TXN_MAGIC {
            return Err(FormatError::Corrupt(format!(
                "no journal transaction here (magic {magic:#010x})"
            )));
        }
        let fs_id = r.u64()?;
        let tid = r.u64()?;
        let n = r.u32()? as usize;
        let body_len = r.u32()? as usize;
        if body_len > buf.len() {
            return Err(FormatError::Truncated("journal transaction"));
        }
        let body = r.take(body_len)?;
        let end = r.pos();
        let stored = r.u32()?;
        let computed = crc(&buf[..end]);
        if stored != computed {
            return Err(FormatError::Checksum {
                what: "journal transaction",
                stored,
                computed,
            });
        }
        let mut br = Reader::new(body, "journal record");
        // Each record is at least 9 bytes: a count beyond that is corruption, and
        // checking first keeps a forged count from reserving huge memory.
        if n > body_len / 9 + 1 {
            return Err(FormatError::Corrupt(format!(
                "transaction {tid} claims {n} records in {body_len} bytes"
            )));
        }
        let mut records = Records::new();
        for _ in 0..n {
            records.push(Record::decode(&mut br)?);
        }
        if br.remaining() != 0 {
            return Err(FormatError::Corrupt(format!(
                "transaction {tid} has {} stray bytes",
                br.remaining()
            )));
        }
        Ok((
            Txn {
                fs_id,
                tid,
                records,
            },
            (TXN_HEADER + body_len + 4).next_multiple_of(BLOCK_SIZE),
        ))
    }
}

/// A checkpoint: the full metadata image as of transaction `tid`, in one of the two
/// alternating slots; mount takes the valid one with the higher `seq`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    pub fs_id: u64,
    pub seq: u64,
    /// Every transaction up to and including this one is in the image.
    pub tid: u64,
    /// Journal block (relative to the journal's start) where transaction `tid + 1` goes.
    pub journal_pos: u64,
    pub image: Vec<u8>,
}

/// Bytes of a checkpoint's header: magic, fs_id, seq, tid, journal_pos, image length
/// (the last field, so the CRC32C sits at `CKPT_HEADER + image length`).
pub const CKPT_HEADER: usize = 4 + 8 + 8 + 8 + 8 + 4;

impl Checkpoint {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u32(CKPT_MAGIC)
            .u64(self.fs_id)
            .u64(self.seq)
            .u64(self.tid)
            .u64(self.journal_pos)
            .bytes(&self.image);
        let c = crc(&w.0);
        w.u32(c);
        let len = w.0.len().next_multiple_of(BLOCK_SIZE);
        w.0.resize(len, 0);
        w.0
    }

    pub fn decode(buf: &[u8]) -> Result<Checkpoint, FormatError> {
        let mut r = Reader::new(buf, "checkpoint");
        let magic = r.u32()?;
        if magic != CKPT_MAGIC {
            return Err(FormatError::Corrupt(format!(
                "no checkpoint here (magic {magic:#010x})"
            )));
        }
        let fs_id = r.u64()?;
        let seq = r.u64()?;
        let tid = r.u64()?;
        let journal_pos = r.u64()?;
        let image = r.bytes()?.to_vec();
        let end = r.pos();
        let stored = r.u32()?;
        let computed = crc(&buf[..end]);
        if stored != computed {
            return Err(FormatError::Checksum {
                what: "checkpoint",
                stored,
                computed,
            });
        }
        Ok(Checkpoint {
            fs_id,
            seq,
            tid,
            journal_pos,
            image,
        })
    }

    /// Bytes (whole blocks) of the checkpoint whose first block is `buf`, from its
    /// header; an error if no checkpoint starts there.
    pub fn peek_len(buf: &[u8]) -> Result<usize, FormatError> {
        let mut r = Reader::new(buf, "checkpoint");
        let magic = r.u32()?;
        if magic != CKPT_MAGIC {
            return Err(FormatError::Corrupt(format!(
                "no checkpoint here (magic {magic:#010x})"
            )));
        }
        // fs_id, seq, tid and journal_pos: decode checks them.
        r.take(4 * 8)?;
        let len = r.u32()? as usize;
        Ok((CKPT_HEADER + len + 4).next_multiple_of(BLOCK_SIZE))
    }

    /// The newest valid checkpoint of this filesystem among the two slots.
    pub fn newest(fs_id: u64, slots: [&[u8]; 2]) -> Result<Checkpoint, FormatError> {
        let mut errs = Vec::new();
        let mut best: Option<Checkpoint> = None;
        for (i, s) in slots.iter().enumerate() {
            match Checkpoint::decode(s) {
                Ok(c) if c.fs_id == fs_id => {
                    if best.as_ref().is_none_or(|b| c.seq > b.seq) {
                        best = Some(c);
                    }
                }
                Ok(c) => errs.push(format!(
                    "slot {i} belongs to another filesystem ({:#x})",
                    c.fs_id
                )),
                Err(e) => errs.push(format!("slot {i}: {e}")),
            }
        }
        best.ok_or_else(|| {
            FormatError::Corrupt(format!("no valid checkpoint: {}", errs.join("; ")))
        })
    }
}

impl fmt::Display for Txn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "transaction {} ({} records)",
            self.tid,
            self.records.len()
        )
    }
}
