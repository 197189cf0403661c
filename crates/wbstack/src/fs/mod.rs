//! The filesystem: a small extent filesystem with delayed allocation and an
//! ordered-data metadata journal, mounted as a [`Volume`] with [`File`] handles.
//!
//! - `format`: on-disk structures (superblock, journal transactions, checkpoints).
//! - `btree`: the copy-on-write B+tree the metadata moves to (not used by the volume yet).
//! - `checkpoint`: format 4's checkpoint, the tree written copy-on-write.
//! - `alloc`: free space as an extent map; reservations, goal cursor, deferred frees.
//! - `extents`: an inode's extent map (inline while it holds one extent).
//! - `dcache`: the dentry cache, for walks through directories without `st`.
//! - `dir`: a directory's entries in readdir order (by name hash: the cookies).
//! - `lazylru`: the lazily kept LRU order both caches (inodes, tree nodes) share.
//! - `icache`: the inode cache (mappings of files, evicted past a limit when at rest).
//! - `metatree`: the metadata as keys of the B+tree (schema, incremental ops, load).
//! - `cowcapture`: a checkpoint's capture by copy on write, without holding `st`.
//! - `meta`: the durable metadata and the one `apply` that both live operations and
//!   journal replay use; fsck's invariant checks.
//! - `volume`: the mounted filesystem, namespace operations, delayed allocation.
//! - `namei`: path resolution, through the dentry cache or under `st`.
//! - `ops`: the same operations by inode number with the caller's credentials, as
//!   the VFS (and the FUSE front end) calls them; `perm`: who may do what.
//! - `mkfs`: a new filesystem on a device. `journal`: load and replay (mount's and
//!   fsck's). `mount`: mount, unmount, crash. `commit`: the committer (group commit,
//!   checkpoints). `sync`: what syncfs and fsync write and wait for.
//! - `jspace`: the journal as a ring: placement, the live part, when checkpoints are due.
//! - `fsck`: the offline checker.
//! - `fuzz` (hidden): the harness of the fuzz targets and of the regression corpus test.

pub mod alloc;
pub mod btree;
mod checkpoint;
mod commit;
mod cowcapture;
pub mod dcache;
pub mod dir;
pub mod error;
pub mod extents;
pub mod flush;
pub mod format;
pub mod fsck;
#[doc(hidden)]
pub mod fuzz;
mod icache;
pub mod inodes;
mod jdata;
pub mod journal;
pub mod jspace;
mod lazylru;
pub mod meta;
pub mod metatree;
pub mod mkfs;
mod mount;
mod namei;
pub mod ops;
pub mod perm;
mod sync;
pub mod tunables;
pub mod volume;

pub use dir::DirPageEntry;
pub use error::{FsError, FsResult};
pub use flush::FlushHandle;
pub use format::InodeKind;
pub use mkfs::MkfsOptions;
pub use ops::{RenameFlags, SetAttrIno, TimeSet, XattrMode};
pub use perm::Cred;
pub use volume::{
    DirEntry, File, InodeCacheStats, JournalStats, MountOptions, OpenOptions, SetAttr, Stat,
    StatFs, Volume,
};
