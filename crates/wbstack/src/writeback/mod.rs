//! Writeback: per-device dirty inode lists, the flusher, and the queueing policy.

pub mod policy;
