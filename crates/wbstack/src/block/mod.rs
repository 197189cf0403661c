//! The block layer: bios become requests, per-thread plugs merge and sort them,
//! blk-mq hardware queues hand them to the device under a tag, the rq_qos chain may
//! throttle them, and diskstats account for them.

pub mod bio;
