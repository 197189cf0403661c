//! Fuzz target `superblock`: one superblock block, as read and with its checksum recomputed
//! (wbstack::fs::fuzz::superblock; its regression corpus is crates/wbstack/tests/fuzz-corpus/superblock).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The outcome (accepted or refused) is not a failure either way; a panic is.
    wbstack::fs::fuzz::superblock(data);
});
