//! Taking a contended lock by spinning a while before sleeping, as the kernel's mutex
//! spins while its owner runs (optimistic spinning, `mutex_optimistic_spin`).
//!
//! The volume's state lock is held for microseconds at a time, by every namespace
//! operation, write and close. Two threads creating files in separate directories met
//! on it hundreds of thousands of times a second; parking_lot parks a waiter after a
//! few spins, so nearly every meeting became a futex sleep and wake-up, and two threads
//! made fewer files together than one alone (`bench fsmark -d 0 -d 1 -S0`, cache
//! phase: 0.75x of one thread). Spinning through a typical hold first made it 1.0x.
//! Userspace cannot see whether the owner is running, so the spin is bounded instead:
//! an owner that was preempted costs the waiter at most `SPINS` pauses before it
//! sleeps as before.

use parking_lot::{Condvar, Mutex, MutexGuard, WaitTimeoutResult};
use std::sync::atomic::{AtomicU32, Ordering};

/// Pauses before sleeping: a pause took about 5 ns on the Xeon this was tuned on and
/// 25 ns on a later host of the same kind (10^7 in a loop), so with a read of the lock
/// word each the spin lasts 5-25 µs, past the longest common hold of the volume's state
/// lock. Measured (2 threads, fsmark cache phase): 250 pauses gave 0.86x of one thread,
/// 1,000 gave 1.02x, 4,000 no more.
pub const SPINS: u32 = 1000;

/// Lock `m`, spinning up to `SPINS` pauses while another thread holds it before
/// sleeping on it.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    spin_try(m).unwrap_or_else(|| m.lock())
}

/// Up to `SPINS` pauses waiting for `m` to come free, taking it if it does.
/// Test-and-test-and-set: the spin reads the lock word and only tries to take it when
/// it looks free, so waiters do not bounce its cache line.
fn spin_try<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    for _ in 0..SPINS {
        if !m.is_locked() {
            if let Some(g) = m.try_lock() {
                return Some(g);
            }
        }
        std::hint::spin_loop();
    }
    None
}

/// Threads that may spin on one lock at once: a core each beside the owner's. With
/// more runnable threads than cores (two writers, the flusher and the completion
/// thread on two cores), a further spinner only burns a core that the owner, or other
/// work, needs: 12% of all CPU of a 320,000-file fs_mark on a file device was spent
/// spinning on the state lock, in closes, `map_write` and `end_write` (now `end_writes`).
fn max_spinners() -> u32 {
    static MAX: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        u32::try_from(cores.saturating_sub(1))
            .unwrap_or(u32::MAX)
            .max(1)
    })
}

/// A mutex whose only `lock` spins (`spin_try`) before sleeping, so that no taker can
/// bypass the spin, with at most `max_spinners` threads spinning at once; the others
/// sleep at once.
pub struct SpinMutex<T> {
    lock: Mutex<T>,
    /// Threads spinning on it now.
    spinners: AtomicU32,
    /// Run on the value when a thread panics holding it (`SpinGuard`'s drop).
    on_panic: Option<fn(&mut T)>,
}

impl<T> SpinMutex<T> {
    pub fn new(value: T) -> SpinMutex<T> {
        SpinMutex {
            lock: Mutex::new(value),
            spinners: AtomicU32::new(0),
            on_panic: None,
        }
    }

    /// A mutex whose value hears of a panic that unwinds through a hold of it
    /// (`on_panic`, under the lock, before the next holder): the value may be half
    /// changed, as a poisoned std mutex's, and its owner decides what that means.
    pub fn with_on_panic(value: T, on_panic: fn(&mut T)) -> SpinMutex<T> {
        SpinMutex {
            on_panic: Some(on_panic),
            ..SpinMutex::new(value)
        }
    }

    pub fn lock(&self) -> SpinGuard<'_, T> {
        SpinGuard {
            guard: self.lock_raw(),
            on_panic: self.on_panic,
        }
    }

    fn lock_raw(&self) -> MutexGuard<'_, T> {
        if let Some(g) = self.lock.try_lock() {
            return g;
        }
        if self.spinners.fetch_add(1, Ordering::Relaxed) < max_spinners() {
            let got = spin_try(&self.lock);
            self.spinners.fetch_sub(1, Ordering::Relaxed);
            if let Some(g) = got {
                return g;
            }
        } else {
            self.spinners.fetch_sub(1, Ordering::Relaxed);
        }
        self.lock.lock()
    }
}

/// A hold of a [`SpinMutex`].
pub struct SpinGuard<'a, T> {
    guard: MutexGuard<'a, T>,
    on_panic: Option<fn(&mut T)>,
}

impl<T> SpinGuard<'_, T> {
    /// Run `f` with the lock released, and take it again (`MutexGuard::unlocked`).
    pub fn unlocked<U>(s: &mut Self, f: impl FnOnce() -> U) -> U {
        MutexGuard::unlocked(&mut s.guard, f)
    }

    /// Wait on `cv`, the lock released meanwhile (`Condvar::wait`).
    pub fn wait(s: &mut Self, cv: &Condvar) {
        cv.wait(&mut s.guard);
    }

    /// Wait on `cv` at most `timeout` (`Condvar::wait_for`).
    pub fn wait_for(s: &mut Self, cv: &Condvar, timeout: std::time::Duration) -> WaitTimeoutResult {
        cv.wait_for(&mut s.guard, timeout)
    }
}

impl<T> std::ops::Deref for SpinGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> std::ops::DerefMut for SpinGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    fn drop(&mut self) {
        // Still held here: the inner guard is dropped after this.
        if std::thread::panicking() {
            if let Some(f) = self.on_panic {
                f(&mut self.guard);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// Four threads, 20,000 increments each, each through `incr`.
    fn increment_from_four_threads(incr: Arc<dyn Fn() + Send + Sync>) {
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let incr = incr.clone();
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        incr();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("a locking thread panicked");
        }
    }

    #[test]
    fn every_increment_under_contention_lands() {
        let m = Arc::new(Mutex::new(0u64));
        let shared = m.clone();
        increment_from_four_threads(Arc::new(move || *lock(&shared) += 1));
        assert_eq!(*m.lock(), 80_000);
    }

    #[test]
    fn a_spin_mutex_under_more_threads_than_spinners_loses_no_increment() {
        let m = Arc::new(SpinMutex::new(0u64));
        let shared = m.clone();
        increment_from_four_threads(Arc::new(move || *shared.lock() += 1));
        assert_eq!(*m.lock(), 80_000);
        // Every spinner counted itself out again.
        assert_eq!(m.spinners.load(Ordering::Relaxed), 0);
        assert!(max_spinners() >= 1);
    }

    #[test]
    fn a_waiter_past_its_spins_sleeps_until_the_owner_releases() {
        let m = Arc::new(Mutex::new(0u32));
        let held = m.lock();
        let started = Arc::new(AtomicBool::new(false));
        let waiter = {
            let (m, started) = (m.clone(), started.clone());
            std::thread::spawn(move || {
                started.store(true, Ordering::Release);
                *lock(&m) += 1;
            })
        };
        while !started.load(Ordering::Acquire) {
            std::thread::yield_now();
        }
        // Mutual exclusion: whether the waiter still spins or sleeps by now, it has
        // not taken the lock.
        assert!(!waiter.is_finished());
        assert_eq!(*held, 0);
        drop(held);
        waiter.join().expect("the waiter panicked");
        assert_eq!(*m.lock(), 1);
    }
}
