//! The block layer: bios become requests, per-thread plugs merge and sort them,
//! blk-mq hardware queues hand them to the device under a tag, the rq_qos chain may
//! throttle them, and diskstats account for them.

pub mod bio;
pub mod logwrites;
pub mod plug;
pub mod qos;
pub mod queue;
pub mod stats;
pub mod tags;
pub mod wbt;

pub use bio::{Bio, BioEndIo, BioFlags, BlkError, BlkResult, Op, Request};
pub use plug::{flush_plug, Plug};
pub use queue::{BioWait, QueueConfig, QueueLimits, RequestQueue};
pub use stats::{DiskStats, IoStatsMode};
pub use wbt::{Wbt, WbtState};
