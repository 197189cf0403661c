//! The journal as a ring (jbd2's log): where the next transaction goes, how much of
//! the journal replay still needs, and when a checkpoint is due.
//!
//! Replay starts at the newest durable checkpoint's `journal_pos` (the tail) and reads
//! transactions in tid order up to the head. A checkpoint taken in the background
//! covers every transaction up to one the committer already wrote to the journal; the
//! committer goes on writing after it meanwhile, and the tail moves up once the
//! checkpoint is durable. A transaction is one contiguous write: one that does not fit
//! before the journal's end goes to block 0 (replay, meeting no transaction of the
//! due tid where it stands, looks there: tids are unique, so the one due is the next
//! wherever it is). The head never reaches the tail from below, so `head == tail`
//! only when nothing is live.
//!
//! The policy (all in journal blocks): a background checkpoint starts when the live
//! part passes half the journal, the committer waits for one in flight when it passes
//! three quarters, and a checkpoint is written in place of a commit (the committer
//! waiting for it, as before background checkpoints) only when a transaction would not
//! fit at all.

/// The ring's positions, in blocks relative to the journal's start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct JournalRing {
    /// Where the next transaction goes (unless it wraps).
    pub head: u64,
    /// Where replay starts: the newest durable checkpoint's `journal_pos`.
    pub tail: u64,
    /// The journal's size.
    pub blocks: u64,
}

impl JournalRing {
    pub fn new(pos: u64, blocks: u64) -> JournalRing {
        debug_assert!(pos < blocks.max(1), "journal position {pos} of {blocks}");
        JournalRing {
            head: pos,
            tail: pos,
            blocks,
        }
    }

    /// Blocks replay would read (with those skipped at the end by a wrap).
    pub fn used(&self) -> u64 {
        self.used_from(self.tail)
    }

    /// Where a transaction of `len` blocks goes, if it fits without overwriting
    /// anything replay needs.
    pub fn place(&self, len: u64) -> Option<u64> {
        if self.head >= self.tail {
            // Short of the very end: the head stays a valid position for a
            // checkpoint's `journal_pos`.
            if self.head + len < self.blocks {
                Some(self.head)
            } else if len < self.tail {
                Some(0)
            } else {
                None
            }
        } else if self.head + len < self.tail {
            Some(self.head)
        } else {
            None
        }
    }

    /// A transaction of `len` blocks was written at `pos` (from `place`).
    pub fn advance(&mut self, pos: u64, len: u64) {
        debug_assert_eq!(self.place(len), Some(pos), "a write the ring did not place");
        self.head = pos + len;
    }

    /// A checkpoint whose replay starts at `pos` is durable.
    pub fn checkpointed(&mut self, pos: u64) {
        debug_assert!(
            self.used_from(pos) <= self.used(),
            "checkpoint at {pos} outside the live journal {self:?}"
        );
        self.tail = pos;
    }

    /// A checkpoint written in place of a commit: nothing in the journal is live.
    pub fn reset(&mut self) {
        self.head = 0;
        self.tail = 0;
    }

    fn used_from(&self, pos: u64) -> u64 {
        if self.head >= pos {
            self.head - pos
        } else {
            self.blocks - pos + self.head
        }
    }

    /// A background checkpoint is due with `next` more blocks written.
    pub fn background_due(&self, next: u64) -> bool {
        self.used() + next > self.blocks / 2
    }

    /// The committer waits for a background checkpoint in flight before closing.
    pub fn must_wait(&self) -> bool {
        self.used() > self.blocks * 3 / 4
    }
}

/// The journal blocks written after a checkpoint at which a background one starts
/// (what the crash test aims its cuts at).
pub fn checkpoint_due_blocks(journal_blocks: u64) -> u64 {
    journal_blocks / 2
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_transaction_that_does_not_fit_at_the_end_wraps_before_the_tail() {
        let mut r = JournalRing::new(0, 100);
        r.advance(0, 60);
        // Replay still needs [0, 60): nothing may go to block 0.
        assert_eq!(r.place(50), None);
        r.checkpointed(60);
        assert_eq!(r.used(), 0);
        r.advance(60, 30);
        assert_eq!(r.place(20), Some(0), "wraps: 90 + 20 > 100");
        r.advance(0, 20);
        assert_eq!(
            r.used(),
            60,
            "40 live at the end (10 skipped) and 20 at the start"
        );
        // The head never reaches the tail.
        assert_eq!(r.place(40), None);
        assert_eq!(r.place(39), Some(20));
    }

    proptest! {
        /// Whatever is written and checkpointed, no placed write overlaps the blocks
        /// replay needs (tail to head), and `used` counts them.
        #[test]
        fn a_placed_write_never_overlaps_the_live_journal(
            steps in proptest::collection::vec((1u64..40, any::<bool>(), 0u8..4), 1..200)
        ) {
            let blocks = 128;
            let mut r = JournalRing::new(0, blocks);
            // The live transactions, oldest first: (pos, len).
            let mut live: std::collections::VecDeque<(u64, u64)> = Default::default();
            let mut pending_ckpt: Option<(u64, usize)> = None;
            for (len, ckpt, kind) in steps {
                if let Some(pos) = r.place(len) {
                    for &(p, l) in &live {
                        prop_assert!(pos + len <= p || p + l <= pos, "{pos}+{len} over {p}+{l}");
                    }
                    r.advance(pos, len);
                    live.push_back((pos, len));
                } else if kind == 0 {
                    r.reset();
                    live.clear();
                    pending_ckpt = None;
                }
                if ckpt && pending_ckpt.is_none() {
                    // A checkpoint covering what is written so far, durable later.
                    pending_ckpt = Some((r.head, live.len()));
                } else if let (Some((pos, n)), 1) = (pending_ckpt, kind) {
                    r.checkpointed(pos);
                    live.drain(..n);
                    pending_ckpt = None;
                }
                let live_blocks: u64 = live.iter().map(|&(_, l)| l).sum();
                prop_assert!(r.used() >= live_blocks);
                prop_assert!(r.used() < blocks);
                prop_assert!(r.head < blocks);
            }
        }
    }
}
