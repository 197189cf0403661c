//! Memory management: the page cache, dirty accounting and dirty throttling.

pub mod throttle;
