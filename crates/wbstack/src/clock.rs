//! Time source for every policy and simulated device.
//!
//! Policies and simulated devices never read the wall clock directly: they take a
//! `Clock`, so a test can drive them with a [`ManualClock`] and a failing run can be
//! replayed exactly.

use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub const NSEC_PER_USEC: u64 = 1_000;
pub const NSEC_PER_MSEC: u64 = 1_000_000;
pub const NSEC_PER_SEC: u64 = 1_000_000_000;

/// A monotonic nanosecond clock.
pub trait Clock: Send + Sync + 'static {
    /// Nanoseconds since the clock's epoch.
    fn now_ns(&self) -> u64;

    /// The same time at tick granularity (the kernel's jiffies), much cheaper to read:
    /// for accounting that only needs milliseconds (diskstats). Never ahead of now_ns.
    fn coarse_ns(&self) -> u64 {
        self.now_ns()
    }

    /// True when time only moves when a test advances it.
    fn is_manual(&self) -> bool {
        false
    }

    /// Make `advance` (manual clocks) kick this waiter. A no-op for the real clock.
    fn register_waiter(&self, _waiter: &Arc<Waiter>) {}

    /// Block until `now_ns() >= deadline` or until `waiter` is kicked, whichever first.
    /// May return early; callers re-check.
    fn wait_until(&self, waiter: &Waiter, deadline: u64) {
        let now = self.now_ns();
        if deadline > now {
            waiter.wait_timeout(Duration::from_nanos(deadline - now));
        }
    }
}

pub type ClockRef = Arc<dyn Clock>;

/// Let the calling thread's timed waits end when they are due: Linux lets a timer of
/// an ordinary thread fire up to 50 µs late (timer slack) to batch wakeups, and a
/// simulated device completing at its due time through such waits delivered an 80 µs
/// SSD write in about 130 µs. Returns whether the slack is now 1 ns.
pub fn precise_timers() -> bool {
    // SAFETY: prctl(PR_SET_TIMERSLACK) takes an integer and touches no memory of ours;
    // PR_GET_TIMERSLACK returns the value. Both exist on every Linux since 2.6.28.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) == 0
            && libc::prctl(libc::PR_GET_TIMERSLACK) == 1
    }
}

/// The real monotonic clock (CLOCK_MONOTONIC, and CLOCK_MONOTONIC_COARSE for
/// `coarse_ns`; both count from the same origin, so they compare).
pub struct RealClock {
    base_ns: u64,
}

fn clock_ns(id: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own; both clock ids used here exist
    // on every Linux since 2.6.32, so it cannot fail.
    unsafe { libc::clock_gettime(id, &mut ts) };
    ts.tv_sec as u64 * NSEC_PER_SEC + ts.tv_nsec as u64
}

impl RealClock {
    pub fn new() -> Arc<Self> {
        Arc::new(RealClock {
            base_ns: clock_ns(libc::CLOCK_MONOTONIC),
        })
    }
}

impl Clock for RealClock {
    #[inline]
    fn now_ns(&self) -> u64 {
        clock_ns(libc::CLOCK_MONOTONIC).saturating_sub(self.base_ns)
    }
    #[inline]
    fn coarse_ns(&self) -> u64 {
        clock_ns(libc::CLOCK_MONOTONIC_COARSE).saturating_sub(self.base_ns)
    }
}

/// A clock that only moves when told to. Threads blocked in `wait_until` on it are
/// woken by `advance`.
pub struct ManualClock {
    now: AtomicU64,
    waiters: Mutex<Vec<std::sync::Weak<Waiter>>>,
}

impl ManualClock {
    pub fn new(start_ns: u64) -> Arc<Self> {
        Arc::new(ManualClock {
            now: AtomicU64::new(start_ns),
            waiters: Mutex::new(Vec::new()),
        })
    }

    pub fn advance(&self, ns: u64) {
        self.now.fetch_add(ns, Ordering::SeqCst);
        self.kick_all();
    }

    pub fn set(&self, ns: u64) {
        self.now.store(ns, Ordering::SeqCst);
        self.kick_all();
    }

    fn kick_all(&self) {
        let mut w = self.waiters.lock();
        w.retain(|weak| match weak.upgrade() {
            Some(waiter) => {
                waiter.kick();
                true
            }
            None => false,
        });
    }
}

impl Clock for ManualClock {
    fn now_ns(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }
    fn is_manual(&self) -> bool {
        true
    }
    fn register_waiter(&self, waiter: &Arc<Waiter>) {
        self.waiters.lock().push(Arc::downgrade(waiter));
    }
    fn wait_until(&self, waiter: &Waiter, deadline: u64) {
        if self.now_ns() >= deadline {
            return;
        }
        // Time moves only through `advance`, which kicks every registered waiter.
        waiter.wait();
    }
}

/// A one-slot wakeup: `kick` makes the next (or current) `wait` return.
/// Spurious returns are allowed; callers re-check their condition.
#[derive(Default)]
pub struct Waiter {
    kicked: Mutex<bool>,
    cv: Condvar,
}

impl Waiter {
    pub fn new() -> Arc<Self> {
        Arc::new(Waiter::default())
    }
    pub fn kick(&self) {
        let mut k = self.kicked.lock();
        *k = true;
        self.cv.notify_all();
    }
    pub fn wait(&self) {
        let mut k = self.kicked.lock();
        if !*k {
            self.cv.wait(&mut k);
        }
        *k = false;
    }
    pub fn wait_timeout(&self, d: Duration) {
        let mut k = self.kicked.lock();
        if !*k {
            self.cv.wait_for(&mut k, d);
        }
        *k = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_wakes_waiter_on_advance() {
        let clock = ManualClock::new(0);
        let waiter = Waiter::new();
        clock.register_waiter(&waiter);
        let c2 = clock.clone();
        let w2 = waiter.clone();
        let t = std::thread::spawn(move || {
            while c2.now_ns() < 5_000 {
                c2.wait_until(&w2, 5_000);
            }
            c2.now_ns()
        });
        clock.advance(5_000);
        assert_eq!(t.join().unwrap(), 5_000);
    }
}

#[cfg(test)]
mod real_tests {
    use super::*;

    #[test]
    fn coarse_time_trails_fine_time_by_at_most_a_tick() {
        let c = RealClock::new();
        for _ in 0..1000 {
            let coarse = c.coarse_ns();
            let fine = c.now_ns();
            assert!(coarse <= fine, "coarse {coarse} ahead of fine {fine}");
            assert!(
                fine - coarse < 50 * NSEC_PER_MSEC,
                "coarse clock lags by more than any HZ tick"
            );
        }
    }
}

#[cfg(test)]
mod slack_tests {
    #[test]
    fn precise_timers_sets_this_threads_slack_only() {
        // In a thread of its own: the slack is per thread, and a test thread is reused.
        let set = std::thread::spawn(super::precise_timers).join().unwrap();
        assert!(set, "the slack of the thread that asked is 1 ns");
        // SAFETY: PR_GET_TIMERSLACK reads an integer of this thread.
        let here = unsafe { libc::prctl(libc::PR_GET_TIMERSLACK) };
        assert_ne!(here, 1, "another thread's slack is untouched");
    }
}
