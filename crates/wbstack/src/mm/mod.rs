//! Memory management: the page cache, dirty accounting and dirty throttling.

pub mod cache;
pub mod errseq;
pub mod throttle;

pub use cache::{AddressSpaceOps, CacheConfig, Mapping, PageCache, WbGen, WriteDone, PAGE_SIZE};
pub use errseq::ErrSeq;
