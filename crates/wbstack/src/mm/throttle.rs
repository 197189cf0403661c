//! Dirty throttling (IO-less balance_dirty_pages). Placeholder.
