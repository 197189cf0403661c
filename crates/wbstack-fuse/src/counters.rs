//! The daemon's own counters: FUSE requests by opcode, so the cost of the crossing
//! can be stated per file (requests per file created, in the control directory's
//! `stat`).

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! ops {
    ($($name:ident),* $(,)?) => {
        /// FUSE opcodes the daemon serves.
        #[derive(Clone, Copy, Debug)]
        #[allow(non_camel_case_types)]
        pub enum Op { $($name),* }
        const NAMES: &[&str] = &[$(stringify!($name)),*];
    };
}

ops!(
    lookup,
    forget,
    getattr,
    setattr,
    readlink,
    mknod,
    mkdir,
    unlink,
    rmdir,
    symlink,
    rename,
    link,
    open,
    read,
    write,
    flush,
    release,
    fsync,
    opendir,
    readdir,
    releasedir,
    fsyncdir,
    statfs,
    setxattr,
    getxattr,
    listxattr,
    removexattr,
    access,
    create,
    fallocate,
    lseek,
);

#[derive(Default)]
pub struct Counters {
    by_op: [AtomicU64; NAMES.len()],
    /// Requests that came through FUSE over io_uring, not /dev/fuse.
    pub ring_requests: AtomicU64,
    /// Threads serving the rings (0: /dev/fuse only).
    pub ring_threads: AtomicU64,
}

impl Counters {
    #[inline]
    pub fn count(&self, op: Op) {
        self.by_op[op as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(&self, op: Op) -> u64 {
        self.by_op[op as usize].load(Ordering::Relaxed)
    }

    /// Every opcode seen at least once, with its count.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        NAMES
            .iter()
            .zip(&self.by_op)
            .map(|(n, c)| (*n, c.load(Ordering::Relaxed)))
            .filter(|(_, c)| *c > 0)
            .collect()
    }

    pub fn total(&self) -> u64 {
        self.by_op.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }
}
