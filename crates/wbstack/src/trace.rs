//! Trace events named after the kernel's tracepoints, into a bounded ring buffer,
//! dumpable as JSON lines. Off by default: an `emit` then costs one relaxed load.

use parking_lot::Mutex;
use serde::Serialize;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

#[derive(Clone, Debug, Serialize)]
pub struct TraceEvent {
    /// Nanoseconds since tracing started.
    pub ts_ns: u64,
    pub event: &'static str,
    pub fields: serde_json::Value,
}

struct Ring {
    events: Mutex<VecDeque<TraceEvent>>,
    cap: Mutex<usize>,
    start: Instant,
}

static ENABLED: AtomicBool = AtomicBool::new(false);
static RING: OnceLock<Ring> = OnceLock::new();

fn ring() -> &'static Ring {
    RING.get_or_init(|| Ring {
        events: Mutex::new(VecDeque::new()),
        cap: Mutex::new(65536),
        start: Instant::now(),
    })
}

/// Start recording, keeping the newest `capacity` events.
pub fn enable(capacity: usize) {
    *ring().cap.lock() = capacity.max(1);
    ENABLED.store(true, Ordering::Release);
}

pub fn disable() {
    ENABLED.store(false, Ordering::Release);
}

#[inline]
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Record an event; `fields` is only built when tracing is on.
#[inline]
pub fn emit(event: &'static str, fields: impl FnOnce() -> serde_json::Value) {
    if !enabled() {
        return;
    }
    let r = ring();
    let ev = TraceEvent {
        ts_ns: r.start.elapsed().as_nanos() as u64,
        event,
        fields: fields(),
    };
    let cap = *r.cap.lock();
    let mut q = r.events.lock();
    while q.len() >= cap {
        q.pop_front();
    }
    q.push_back(ev);
}

/// Take every recorded event, oldest first.
pub fn take() -> Vec<TraceEvent> {
    ring().events.lock().drain(..).collect()
}

/// The oldest events as JSON lines, taken from the ring, at most `max_bytes` of them
/// (at least one event when any is recorded, however long): a streaming reader's
/// next chunk.
pub fn take_up_to(max_bytes: usize) -> Vec<u8> {
    let mut out = Vec::new();
    let mut q = ring().events.lock();
    while let Some(e) = q.front() {
        let line = serde_json::to_string(e).unwrap_or_default();
        if !out.is_empty() && out.len() + line.len() + 1 > max_bytes {
            break;
        }
        out.extend_from_slice(line.as_bytes());
        out.push(b'\n');
        q.pop_front();
    }
    out
}

/// Every recorded event as JSON lines (and clear the ring).
pub fn dump_jsonl() -> String {
    let mut s = String::new();
    for e in take() {
        s.push_str(&serde_json::to_string(&e).unwrap_or_default());
        s.push('\n');
    }
    s
}
