//! errseq (lib/errseq.c): a 32-bit error sequence shared by an inode (or a volume) and
//! sampled by every open file, so each file description is told of each writeback error
//! exactly once, however many files share the inode and whenever they were opened.
//!
//! Layout: bits 0–11 the errno, bit 12 SEEN (someone has reported the current value),
//! bits 13–31 a counter bumped when a new error arrives after the last one was seen.
//! Errors nobody has seen yet coalesce into one report (the latest errno wins).

use std::sync::atomic::{AtomicU32, Ordering};

const MAX_ERRNO: u32 = (1 << 12) - 1;
const SEEN: u32 = 1 << 12;
const CTR_INC: u32 = 1 << 13;

/// An error sequence (`errseq_t`). 0 means "no error ever".
#[derive(Debug, Default)]
pub struct ErrSeq(AtomicU32);

impl ErrSeq {
    pub const fn new() -> ErrSeq {
        ErrSeq(AtomicU32::new(0))
    }

    /// Record an error (`errno` > 0, e.g. `libc::EIO`): errseq_set. Returns the new
    /// value. The counter moves only if the previous error was seen, so a burst of
    /// unseen errors is reported once.
    pub fn set(&self, errno: i32) -> u32 {
        let err = errno.unsigned_abs() & MAX_ERRNO;
        if err == 0 {
            return self.0.load(Ordering::Acquire);
        }
        let mut old = self.0.load(Ordering::Acquire);
        loop {
            let mut new = (old & !(MAX_ERRNO | SEEN)) | err;
            if old & SEEN != 0 {
                new = new.wrapping_add(CTR_INC);
            }
            if new == old {
                return new;
            }
            match self
                .0
                .compare_exchange_weak(old, new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return new,
                Err(cur) => old = cur,
            }
        }
    }

    /// What a new opener records (errseq_sample): the current value if it has been
    /// seen, else 0, so an error nobody has reported yet is reported to this opener.
    pub fn sample(&self) -> u32 {
        let v = self.0.load(Ordering::Acquire);
        if v & SEEN != 0 {
            v
        } else {
            0
        }
    }

    /// The errno recorded since `since`, without consuming it (errseq_check); 0 if none.
    pub fn check(&self, since: u32) -> i32 {
        let v = self.0.load(Ordering::Acquire);
        if v == since {
            0
        } else {
            (v & MAX_ERRNO) as i32
        }
    }

    /// Report the error recorded since `*since` once (errseq_check_and_advance): marks
    /// the current value seen and moves `*since` to it. Returns the errno, or 0.
    pub fn check_and_advance(&self, since: &mut u32) -> i32 {
        let old = self.0.load(Ordering::Acquire);
        if old == *since {
            return 0;
        }
        let new = old | SEEN;
        if new != old {
            // Losing this race only means someone else marked it seen first.
            let _ = self
                .0
                .compare_exchange(old, new, Ordering::AcqRel, Ordering::Acquire);
        }
        *since = new;
        (new & MAX_ERRNO) as i32
    }

    /// The raw value (for tests and traces).
    pub fn raw(&self) -> u32 {
        self.0.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libc::{EIO, ENOSPC};

    #[test]
    fn each_opener_sees_an_error_once() {
        // Reference 6.6 scenarios 1-3.
        let e = ErrSeq::new();
        let (mut a, mut b) = (e.sample(), e.sample());
        e.set(EIO);
        assert_eq!(e.check_and_advance(&mut a), EIO);
        assert_eq!(e.check_and_advance(&mut a), 0);
        assert_eq!(e.check_and_advance(&mut b), EIO);
        assert_eq!(e.check_and_advance(&mut b), 0);
        let mut c = e.sample(); // opened after someone saw it
        assert_eq!(e.check_and_advance(&mut c), 0);
        let e2 = ErrSeq::new();
        e2.set(EIO);
        let mut d = e2.sample(); // opened before anyone saw it
        assert_eq!(e2.check_and_advance(&mut d), EIO);
    }

    #[test]
    fn latest_unseen_error_wins_and_seen_errors_count_again() {
        // Scenarios 4 and 5.
        let e = ErrSeq::new();
        let mut a = e.sample();
        e.set(EIO);
        e.set(ENOSPC);
        assert_eq!(e.check_and_advance(&mut a), ENOSPC);
        let seen = e.raw();
        e.set(EIO);
        assert_ne!(e.raw() & !MAX_ERRNO & !SEEN, seen & !MAX_ERRNO & !SEEN);
        assert_eq!(e.check_and_advance(&mut a), EIO);
        // Two errors with no observer in between: one report.
        e.set(EIO);
        e.set(EIO);
        assert_eq!(e.check_and_advance(&mut a), EIO);
        assert_eq!(e.check_and_advance(&mut a), 0);
        assert_eq!(e.check(a), 0);
    }
}
