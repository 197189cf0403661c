//! Fuzz target `image`: a whole packed image: fsck and mount must agree; a mounted one is used, unmounted, checked and remounted
//! (wbstack::fs::fuzz::image; its regression corpus is crates/wbstack/tests/fuzz-corpus/image).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The outcome (accepted or refused) is not a failure either way; a panic is.
    wbstack::fs::fuzz::image(data);
});
