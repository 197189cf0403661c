//! Writeback queueing policy (b_dirty / b_io / b_more_io). Placeholder.
