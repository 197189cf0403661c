//! The `wbstack` tools: benchmarks and the lab of seed experiments.

pub mod admin;
pub mod benchfs;
pub mod blkbench;
pub mod crashtest;
pub mod fio;
pub mod fsmark;
pub mod hog;
pub mod lab;
pub mod meter;
pub mod mount;
pub mod progress;
pub mod readlat;
pub mod soak;
pub mod tardd;
pub mod util;
pub mod volfs;
pub mod wbbench;
