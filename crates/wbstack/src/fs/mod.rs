//! The filesystem (issue 4, in progress): on-disk format and free-space allocation so
//! far; namespace, journal, recovery and fsck build on these.

pub mod alloc;
pub mod format;
