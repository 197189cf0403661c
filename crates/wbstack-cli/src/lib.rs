//! The `wbstack` tools: benchmarks and the lab of seed experiments.

pub mod blkbench;
pub mod fio;
pub mod lab;
pub mod util;
pub mod wbbench;
