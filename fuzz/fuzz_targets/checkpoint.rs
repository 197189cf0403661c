//! Fuzz target `checkpoint`: one checkpoint slot; a valid one's image decoded, checked, its orphans deleted
//! (wbstack::fs::fuzz::checkpoint; its regression corpus is crates/wbstack/tests/fuzz-corpus/checkpoint).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The outcome (accepted or refused) is not a failure either way; a panic is.
    wbstack::fs::fuzz::checkpoint(data);
});
