//! Completes requests at a due time on a device thread: the "hardware" of the null
//! device's `completion_nsec` and of the simulated devices' timing model.
//!
//! Time comes from the injected clock, so with a manual clock a test decides exactly
//! when each request completes.

use crate::block::bio::{BlkError, BlkResult, Request};
use crate::clock::{ClockRef, Waiter};
use crate::dev::Completer;
use parking_lot::Mutex;
use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::sync::Arc;
use std::thread::JoinHandle;

/// What to do with a request when it falls due (move its data), returning its status.
pub type FinishFn = Box<dyn Fn(&mut Request) -> BlkResult + Send + Sync>;

struct Entry {
    due: u64,
    seq: u64,
    rq: Request,
    done: Completer,
    /// A status decided at submission (injected EIO): data is not moved.
    status: Option<BlkResult>,
}

impl PartialEq for Entry {
    fn eq(&self, o: &Self) -> bool {
        (self.due, self.seq) == (o.due, o.seq)
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Entry {
    // Reversed: BinaryHeap is a max-heap and we want the earliest due first.
    fn cmp(&self, o: &Self) -> Ordering {
        (o.due, o.seq).cmp(&(self.due, self.seq))
    }
}

#[derive(Default)]
struct State {
    heap: BinaryHeap<Entry>,
    seq: u64,
    held: bool,
    stop: bool,
}

struct Inner {
    clock: ClockRef,
    waiter: Arc<Waiter>,
    state: Mutex<State>,
    finish: FinishFn,
}

pub struct CompletionTimer {
    inner: Arc<Inner>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl CompletionTimer {
    pub fn new(name: &str, clock: ClockRef, finish: FinishFn) -> CompletionTimer {
        let waiter = Waiter::new();
        clock.register_waiter(&waiter);
        let inner = Arc::new(Inner {
            clock,
            waiter,
            state: Mutex::new(State::default()),
            finish,
        });
        let i2 = inner.clone();
        let thread = std::thread::Builder::new()
            .name(format!("{name}-cq"))
            .spawn(move || {
                // A completion is late by whatever the wait overshoots.
                crate::clock::precise_timers();
                run(&i2)
            })
            .expect("spawn device completion thread");
        CompletionTimer {
            inner,
            thread: Mutex::new(Some(thread)),
        }
    }

    /// Complete `rq` at `due` (clock ns). With `status` set, complete it with that status
    /// and without moving data.
    pub fn schedule(&self, due: u64, rq: Request, done: &Completer, status: Option<BlkResult>) {
        let mut st = self.inner.state.lock();
        let seq = st.seq;
        st.seq += 1;
        let earliest = st.heap.peek().is_none_or(|top| due < top.due);
        st.heap.push(Entry {
            due,
            seq,
            rq,
            done: done.clone(),
            status,
        });
        drop(st);
        if earliest {
            self.inner.waiter.kick();
        }
    }

    /// While held, nothing completes (requests stay "in the device").
    pub fn set_held(&self, held: bool) {
        self.inner.state.lock().held = held;
        self.inner.waiter.kick();
    }

    pub fn pending(&self) -> usize {
        self.inner.state.lock().heap.len()
    }

    /// Complete everything pending with `err`, without moving data (power cut).
    pub fn fail_all(&self, err: BlkError) {
        self.inner.fail_all(err);
    }
}

impl Inner {
    fn fail_all(&self, err: BlkError) {
        let entries: Vec<Entry> = std::mem::take(&mut self.state.lock().heap).into_vec();
        for e in entries {
            e.done.complete(e.rq, Err(err.clone()));
        }
    }
}

impl Drop for CompletionTimer {
    fn drop(&mut self) {
        self.inner.state.lock().stop = true;
        self.inner.waiter.kick();
        if let Some(t) = self.thread.lock().take() {
            if t.thread().id() == std::thread::current().id() {
                // Dropped from a completion callback (it held the last reference to the
                // device): the thread cannot wait for itself. It goes on with the
                // requests it took off the heap with this one, then sees `stop` and
                // fails the rest itself, outside any callback.
                return;
            }
            let _ = t.join();
        }
        // Nobody may wait forever on a request of a device that is gone (the thread
        // has failed them, unless a callback's panic killed it first).
        self.fail_all(BlkError::Io);
    }
}

fn run(inner: &Inner) {
    let mut due_now = Vec::new();
    loop {
        let deadline = {
            let mut st = inner.state.lock();
            if st.stop {
                drop(st);
                inner.fail_all(BlkError::Io);
                return;
            }
            if st.held {
                None
            } else {
                let now = inner.clock.now_ns();
                while st.heap.peek().is_some_and(|e| e.due <= now) {
                    due_now.push(st.heap.pop().unwrap());
                }
                st.heap.peek().map(|e| e.due)
            }
        };
        if !due_now.is_empty() {
            for mut e in due_now.drain(..) {
                let status = match e.status.take() {
                    Some(s) => s,
                    None => (inner.finish)(&mut e.rq),
                };
                e.done.complete(e.rq, status);
            }
            continue;
        }
        match deadline {
            Some(d) => inner.clock.wait_until(&inner.waiter, d),
            None => inner.waiter.wait(),
        }
    }
}
