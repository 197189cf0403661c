//! Fuzz target `journal_txn`: one journal transaction; a valid one's records replayed onto a fresh filesystem
//! (wbstack::fs::fuzz::journal_txn; its regression corpus is crates/wbstack/tests/fuzz-corpus/journal_txn).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The outcome (accepted or refused) is not a failure either way; a panic is.
    wbstack::fs::fuzz::journal_txn(data);
});
