//! The waits of syncfs, fsync and a directory's fsync on the journal: what each
//! writes back first, and which commit and cache flush it waits for (`fs::commit`
//! writes them).

use super::error::{FsError, FsResult};
use super::volume::Vol;
use parking_lot::Mutex;
use std::sync::atomic::Ordering;

impl Vol {
    /// syncfs: every dirty page written and waited on, then one commit and flush.
    pub(super) fn sync_all(&self) -> FsResult<()> {
        let r = self.bdi.sync();
        self.resolve_all()?;
        let tid = self.st.lock().running_tid;
        let gen = self.barrier_started.load(Ordering::Acquire);
        self.journal_wait(tid, Some(gen))?;
        r.map_err(FsError::from)
    }

    /// Every metadata change made so far durable (fsync of a directory: its
    /// entries are metadata only).
    pub(super) fn commit_now(&self) -> FsResult<()> {
        let tid = self.st.lock().running_tid;
        self.journal_wait(tid, None)
    }

    /// [`Vol::commit_now`], then wait until the blocks that commit freed are free
    /// (after the home writes of journaled data it carried).
    pub(super) fn commit_and_release(&self) -> FsResult<()> {
        let tid = self.st.lock().running_tid;
        self.journal_wait(tid, None)?;
        let mut j = self.jn.lock();
        while j.released < tid && j.error.is_none() {
            self.jcv.wait(&mut j);
        }
        Ok(())
    }

    /// fsync / fdatasync of one inode, reporting writeback errors through the file's
    /// errseq cursor `since` (file_write_and_wait_range, then the journal).
    pub(super) fn fsync_ino(
        &self,
        ino: u64,
        mapping: &crate::mm::Mapping,
        datasync: bool,
        since: &Mutex<u32>,
    ) -> FsResult<()> {
        // Small: the dirty pages go into the running transaction (fs::jdata), and
        // the commit below is their only write fsync waits for.
        let journaled = self.journal_data(ino, mapping);
        let r = if journaled {
            Ok(())
        } else {
            mapping.write_and_wait_keep_errors(0, u64::MAX)
        };
        let e = mapping.wb_err().check_and_advance(&mut since.lock());
        let res = r
            .map_err(FsError::from)
            .and_then(|()| super::volume::errno_result(e));
        // Journaled pages stay under writeback until the commit carrying them: it is
        // asked for even when an older error is reported.
        if res.is_err() && !journaled {
            return res;
        }
        {
            let mut st = self.st.lock();
            self.wait_truncations(&mut st, Some(ino));
            self.resolve_trunc(&mut st, ino)?;
        }
        let super::flush::SyncPoint { tid, gen } = self.sync_point(ino, datasync);
        let w = self.journal_wait(tid, gen);
        res.and(w)
    }

    /// Have the committer commit and checkpoint, and wait for it.
    pub(super) fn checkpoint_now(&self) -> FsResult<()> {
        let mut j = self.jn.lock();
        if j.error.is_some() {
            return Err(FsError::Io);
        }
        let before = j.sync_ckpts;
        j.force_checkpoint = true;
        drop(j);
        self.jwaiter.kick();
        let mut j = self.jn.lock();
        while j.sync_ckpts == before && j.error.is_none() {
            self.jcv.wait(&mut j);
        }
        match &j.error {
            Some(e) => Err(FsError::ReadOnly(e.clone())),
            None => Ok(()),
        }
    }
}
