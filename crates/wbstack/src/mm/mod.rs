//! Memory management: the page cache, dirty accounting and dirty throttling.

pub mod cache;
pub mod throttle;

pub use cache::{AddressSpaceOps, CacheConfig, Mapping, PageCache, PAGE_SIZE};
