//! The `wbstack` tools: benchmarks and the lab of seed experiments.

pub mod admin;
pub mod bench;
pub mod crashtest;
pub mod lab;
pub mod mount;
pub mod progress;
pub mod soak;
pub mod util;
