//! Writeback: per-device dirty inode lists, the flusher thread and its works, and the
//! queueing policy.

pub mod policy;
pub mod wb;

pub use wb::{Bdi, WbConfig, WbInode, Wbc, WorkHandle};
