//! wbstack: the Linux writeback stack, rebuilt in userspace.
//!
//! Layers, bottom up: [`dev`] (devices), [`block`] (bios, plugging, blk-mq, stats).
//! See ARCHITECTURE.md at the repository root.

pub mod block;
pub mod buf;
pub mod clock;
pub mod dev;
pub mod fs;
pub mod mm;
pub mod smallmap;
pub mod spin;
pub mod testfs;
pub mod trace;
pub mod writeback;
