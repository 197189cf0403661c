//! An open file: reads, writes, fsync and its asynchronous flush, flush-on-close,
//! each reporting writeback errors through the file's own errseq cursors.

use super::*;

/// An open file. Usable from many threads at once (`&self` methods); `close` (or drop)
/// releases it.
pub struct File {
    pub(super) vol: Arc<Vol>,
    pub(super) ino: u64,
    pub(super) mapping: Arc<Mapping>,
    pub(super) read: bool,
    pub(super) write: bool,
    pub(super) append: bool,
    pub(super) closed: AtomicBool,
    /// errseq cursors sampled at open (f_wb_err, f_sb_err); shared with this file's
    /// asynchronous flushes, which report through them too.
    pub(super) wb_since: Arc<Mutex<u32>>,
    pub(super) sb_since: Arc<Mutex<u32>>,
}

impl File {
    pub fn ino(&self) -> u64 {
        self.ino
    }

    fn usable(&self) -> FsResult<()> {
        if self.closed.load(Ordering::Relaxed) {
            return Err(FsError::BadFd("the file is closed".into()));
        }
        Ok(())
    }

    pub fn read_at(&self, off: u64, buf: &mut [u8]) -> FsResult<usize> {
        self.usable()?;
        if !self.read {
            return Err(FsError::BadFd("not open for reading".into()));
        }
        Ok(self.mapping.read_at(off, buf)?)
    }

    /// Buffered write at `off` (at the end, for a file opened to append). Returns the
    /// bytes written: all of `data`, or fewer when a page after them failed (a partial
    /// page's read; the call for the rest meets the error), or an error with nothing
    /// written. `write_all_at` retries for the caller.
    pub fn write_at(&self, off: u64, data: &[u8]) -> FsResult<usize> {
        self.usable()?;
        if !self.write {
            return Err(FsError::BadFd("not open for writing".into()));
        }
        let _i_rwsem = self.mapping.lock_for_write();
        let off = if self.append {
            self.mapping.size()
        } else {
            off
        };
        if off
            .checked_add(data.len() as u64)
            .is_none_or(|e| e > i64::MAX as u64)
        {
            return Err(FsError::Invalid("write past the largest file size".into()));
        }
        Ok(self.mapping.write_at(off, data)?)
    }

    /// `write_at` until all of `data` is written or an error says why not (as
    /// `std::os::unix::fs::FileExt::write_all_at`).
    pub fn write_all_at(&self, mut off: u64, mut data: &[u8]) -> FsResult<()> {
        while !data.is_empty() {
            let n = self.write_at(off, data)?;
            if n == 0 {
                debug_assert!(false, "a write of {} bytes wrote none", data.len());
                return Err(FsError::Io);
            }
            off += n as u64;
            data = &data[n..];
        }
        Ok(())
    }

    /// write_at at exactly `off`, even for a file opened to append (fallocate's
    /// zeroing).
    pub(in crate::fs) fn write_at_raw(&self, off: u64, data: &[u8]) -> FsResult<usize> {
        self.usable()?;
        if !self.write {
            return Err(FsError::BadFd("not open for writing".into()));
        }
        let _i_rwsem = self.mapping.lock_for_write();
        Ok(self.mapping.write_at(off, data)?)
    }

    /// Free blocks not reserved by delayed allocation (fallocate's space check).
    pub(in crate::fs) fn volume_available_blocks(&self) -> u64 {
        self.vol.st.lock().meta.alloc.statfs().2
    }

    pub fn size(&self) -> u64 {
        self.mapping.size()
    }

    /// Truncations of this file waiting for writes in progress.
    pub fn truncations_waiting(&self) -> u32 {
        self.mapping.truncations_waiting()
    }

    pub fn stat(&self) -> FsResult<Stat> {
        let st = self.vol.st.lock();
        self.vol.stat_of(&st, self.ino)
    }

    /// ftruncate.
    pub fn set_len(&self, size: u64) -> FsResult<()> {
        self.usable()?;
        if !self.write {
            return Err(FsError::BadFd("not open for writing".into()));
        }
        if size > i64::MAX as u64 {
            return Err(FsError::Invalid("size past the largest file size".into()));
        }
        self.vol.truncate(self.ino, &self.mapping, size)
    }

    /// fsync: the file's data and all of its metadata (and the names that lead to it
    /// from transactions it took part in) are durable when this returns Ok.
    pub fn fsync(&self) -> FsResult<()> {
        self.usable()?;
        self.vol
            .fsync_ino(self.ino, &self.mapping, false, &self.wb_since)
    }

    /// fdatasync: like fsync but does not wait for a commit that changes only
    /// timestamps.
    pub fn fdatasync(&self) -> FsResult<()> {
        self.usable()?;
        self.vol
            .fsync_ino(self.ino, &self.mapping, true, &self.wb_since)
    }

    /// Start the same data-integrity writeback and commit as fsync without waiting
    /// (seed 004's `fs_mark -A`). The handle reports what fsync would have: the
    /// error goes through this file's errseq cursor. Flushes started together share
    /// writeback passes, journal commits and cache flushes.
    pub fn flush_async(&self) -> FsResult<crate::fs::flush::FlushHandle> {
        self.usable()?;
        let state = Arc::new(crate::fs::flush::FlushState::default());
        self.vol.queue_flush(crate::fs::flush::FlushReq {
            ino: self.ino,
            mapping: self.mapping.clone(),
            since: Some(self.wb_since.clone()),
            state: Some(state.clone()),
            resolve: true,
        });
        Ok(crate::fs::flush::FlushHandle(state))
    }

    /// syncfs(2) on this file's volume: everything durable, then any writeback error
    /// of the volume since this file last checked (or was opened), once.
    pub fn syncfs(&self) -> FsResult<()> {
        self.usable()?;
        let r = self.vol.sync_all();
        let e = self.vol.sb_err.check_and_advance(&mut self.sb_since.lock());
        r?;
        errno_result(e)
    }

    /// What close(2) of one descriptor does when others stay open (FUSE's FLUSH):
    /// auto_da_alloc's writeback of a file truncated to zero starts now rather than
    /// at the last close.
    pub fn flush_on_close(&self) -> FsResult<()> {
        self.usable()?;
        let kick = {
            let mut st = self.vol.st.lock();
            st.live
                .get_mut(&self.ino)
                .is_some_and(|l| std::mem::take(&mut l.da_alloc_close))
                && self.vol.flush_on_close.load(Ordering::Relaxed)
        };
        if kick {
            self.vol.queue_flush(crate::fs::flush::FlushReq {
                ino: self.ino,
                mapping: self.mapping.clone(),
                since: None,
                state: None,
                resolve: true,
            });
        }
        Ok(())
    }

    /// close(2). Dropping the file does the same, ignoring errors.
    pub fn close(self) -> FsResult<()> {
        self.do_close()
    }

    fn do_close(&self) -> FsResult<()> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        self.vol.release(self.ino, &self.mapping)
    }
}

impl Drop for File {
    fn drop(&mut self) {
        let _ = self.do_close();
    }
}
