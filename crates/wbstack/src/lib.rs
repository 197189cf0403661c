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

/// The message a panic was raised with (`panic!`'s text), for reports of a panic that
/// a thread contained (`catch_unwind`) instead of dying of it.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}
