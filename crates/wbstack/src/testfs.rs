//! A minimal filesystem for exercising the page cache and writeback without the real
//! one: inode `i` owns the fixed region of `region_pages` pages starting at page
//! `i × region_pages`, so consecutive inodes are adjacent on the device (what seed 000's
//! plugging needs). No metadata, no allocation.

use crate::block::{BlkError, QueueConfig, RequestQueue};
use crate::mm::{AddressSpaceOps, CacheConfig, Mapping, PageCache};
use crate::writeback::{Bdi, WbConfig};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub struct TestFs {
    pub region_pages: u64,
    pub capacity_pages: u64,
    /// So many of the next `map_write` calls panic, as a filesystem's bug would.
    pub panicking_map_writes: AtomicU64,
}

impl TestFs {
    fn check(&self, ino: u64, index: u64, n: u64) -> Result<u64, BlkError> {
        if index + n > self.region_pages {
            return Err(BlkError::Invalid(format!(
                "inode {ino}: pages {index}..{} exceed its region of {} pages",
                index + n,
                self.region_pages
            )));
        }
        let first = ino * self.region_pages + index;
        if first + n > self.capacity_pages {
            return Err(BlkError::Invalid(format!(
                "inode {ino} lies past the end of the device"
            )));
        }
        Ok(first * 8)
    }
}

impl AddressSpaceOps for TestFs {
    fn map_write(&self, ino: u64, index: u64, n: u64) -> Result<Vec<(u64, u64)>, BlkError> {
        let left = &self.panicking_map_writes;
        if left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            panic!("a bug in map_write of inode {ino} (test)");
        }
        Ok(vec![(self.check(ino, index, n)?, n)])
    }
    fn map_read(&self, ino: u64, index: u64, n: u64) -> Result<Vec<(Option<u64>, u64)>, BlkError> {
        Ok(vec![(Some(self.check(ino, index, n)?), n)])
    }
}

/// No periodic writeback and thresholds out of reach: only explicit syncs write.
pub fn quiet_wb(plug: bool) -> WbConfig {
    WbConfig {
        writeback_plug: plug,
        dirty_writeback_centisecs: 0,
        dirty: crate::mm::throttle::DirtyConfig {
            dirty_bytes: 1 << 40,
            dirty_background_bytes: 1 << 39,
            ..Default::default()
        },
        ..Default::default()
    }
}

/// A volume of 64-page regions on `spec` with readahead off and `quiet_wb(true)`:
/// only the pages a test touches are read, and only explicit syncs write.
pub fn quiet_volume(spec: &str) -> Result<TestVolume, String> {
    let cache = CacheConfig {
        ra_max_pages: 0,
        ..Default::default()
    };
    TestVolume::open(spec, QueueConfig::default(), cache, quiet_wb(true), 64)
}

/// A device, its queue, a page cache, writeback, and files of the test filesystem.
pub struct TestVolume {
    pub q: Arc<RequestQueue>,
    pub cache: Arc<PageCache>,
    pub bdi: Arc<Bdi>,
    pub fs: Arc<TestFs>,
    files: Mutex<HashMap<u64, Arc<Mapping>>>,
}

impl TestVolume {
    pub fn new(
        q: Arc<RequestQueue>,
        cache: CacheConfig,
        wb: WbConfig,
        region_pages: u64,
    ) -> TestVolume {
        let capacity_pages = q.geometry().size_bytes / 4096;
        let cache = PageCache::new(cache);
        let bdi = Bdi::new(q.clone(), cache.clone(), wb);
        TestVolume {
            q,
            cache,
            bdi,
            fs: Arc::new(TestFs {
                region_pages,
                capacity_pages,
                panicking_map_writes: AtomicU64::new(0),
            }),
            files: Mutex::new(HashMap::new()),
        }
    }

    pub fn open(
        spec: &str,
        qcfg: QueueConfig,
        cache: CacheConfig,
        wb: WbConfig,
        region_pages: u64,
    ) -> Result<TestVolume, String> {
        Ok(TestVolume::new(
            RequestQueue::open(spec, qcfg)?,
            cache,
            wb,
            region_pages,
        ))
    }

    /// The file of inode `ino` (created empty on first use).
    pub fn file(&self, ino: u64) -> Arc<Mapping> {
        self.files
            .lock()
            .entry(ino)
            .or_insert_with(|| Mapping::new(ino, 0, self.bdi.clone(), self.fs.clone()))
            .clone()
    }

    /// Drop the cached pages of a clean file (as if evicted): the next `file(ino)`
    /// reads from the device, with `size` bytes.
    pub fn evict(&self, ino: u64, size: u64) -> Result<Arc<Mapping>, String> {
        let mut files = self.files.lock();
        if let Some(m) = files.get(&ino) {
            if m.nr_dirty() > 0 || m.nr_writeback() > 0 {
                return Err(format!("inode {ino} is dirty or under writeback"));
            }
            m.set_size(0);
        }
        let m = Mapping::new(ino, size, self.bdi.clone(), self.fs.clone());
        files.insert(ino, m.clone());
        Ok(m)
    }
}

/// `call`'s result, run on a thread of its own and waited for at most a minute: a call
/// that hangs (a waiter nobody will wake) fails the test with `what` instead of
/// hanging it.
pub fn within_a_minute<T: Send + 'static>(
    what: &str,
    call: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || tx.send(call()).unwrap());
    let r = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("{what} still waiting a minute later"));
    // It has sent its result: all that is left is dropping its handles.
    t.join().unwrap();
    r
}
