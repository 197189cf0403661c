//! CPU (and memory) hogs: seed 003 kept the machine busy with CPU hogs holding 75% of
//! memory while it measured read latency.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Hog threads; they stop when this is dropped.
pub struct Hogs {
    stop: Arc<AtomicBool>,
    handles: Vec<JoinHandle<()>>,
}

impl Hogs {
    /// `threads` spinning threads sharing `mem` bytes, which they keep touching so the
    /// memory stays resident and hot.
    pub fn start(threads: usize, mem: u64) -> Hogs {
        let stop = Arc::new(AtomicBool::new(false));
        let per = if threads == 0 {
            0
        } else {
            (mem / threads as u64) as usize
        };
        let handles = (0..threads)
            .map(|i| {
                let stop = stop.clone();
                std::thread::Builder::new()
                    .name(format!("hog{i}"))
                    .spawn(move || hog(per, &stop))
                    .expect("spawn hog thread")
            })
            .collect();
        Hogs { stop, handles }
    }

    pub fn threads(&self) -> usize {
        self.handles.len()
    }
}

fn hog(mem: usize, stop: &AtomicBool) {
    const PAGE: usize = 4096;
    let mut m = vec![0u8; mem];
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut page = 0usize;
    while !stop.load(Ordering::Relaxed) {
        for _ in 0..10_000 {
            // xorshift: cheap work the optimiser cannot drop (the result is stored below).
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
        }
        if !m.is_empty() {
            let i = page * PAGE % m.len();
            m[i] = x as u8;
            page += 1;
        }
    }
    std::hint::black_box((&m, x));
}

impl Drop for Hogs {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}
