//! Mount and unmount: load and replay (`fs::journal`), delete orphans, write mount's
//! checkpoint, start the committer, the checkpointer and the flusher; unmount writes
//! everything back and checkpoints; a crash (tests) stops the threads where they are.

use super::checkpoint::{alloc_nodes, root_record};
use super::error::{FsError, FsResult};
use super::format::{Records, Superblock, SB_BLOCKS};
use super::journal::{load, mount_tid, prepare_mount, upgraded_version, MountCheckpoint};
use super::mkfs::{mkfs, sector, MkfsOptions, PAGE};
use super::volume::{Aops, JState, MountOptions, State, Vol, Volume};
use crate::block::{BioFlags, RequestQueue};
use crate::buf::IoBuf;
use crate::mm::PageCache;
use crate::trace;
use crate::writeback::Bdi;
use parking_lot::{Condvar, Mutex};
use rustc_hash::FxHashMap;
use serde_json::json;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

impl Volume {
    /// Write a new filesystem on the device (see [`mkfs`]).
    pub fn mkfs(q: &Arc<RequestQueue>, o: &MkfsOptions) -> FsResult<Superblock> {
        mkfs(q, o)
    }

    /// Open the device of `spec` and mount the filesystem on it.
    pub fn mount_spec(spec: &str, opts: MountOptions) -> FsResult<Volume> {
        let q = RequestQueue::open(spec, Default::default())
            .map_err(|e| FsError::Invalid(format!("{spec}: {e}")))?;
        Volume::mount(q, opts)
    }

    /// Mount: load, replay, delete orphans, write a fresh checkpoint (so the journal
    /// starts empty), start the committer and the flusher.
    pub fn mount(q: Arc<RequestQueue>, opts: MountOptions) -> FsResult<Volume> {
        let mut l = load(&q, true, opts.dir_listed_max)?;
        // A volume whose inodes are read on demand is not read whole at mount: each
        // record is checked as it is decoded, the whole by fsck.
        let problems = if l.lazy { Vec::new() } else { l.meta.check() };
        if let Some(first) = problems.first() {
            return Err(FsError::Corrupt(format!(
                "{first} ({} problem(s) in all)",
                problems.len()
            )));
        }
        let (orphans, ckpt) = prepare_mount(&mut l)?;
        // Journaled data home before the checkpoint forgets the journal (its PREFLUSH
        // makes these writes durable first). Replay checked each lies in the data area.
        for (block, data) in &l.jdata {
            debug_assert!(*block >= l.sb.data_start && *block < l.sb.nr_blocks);
            q.write_sync(
                sector(*block),
                IoBuf::from_slice(data.as_slice()),
                BioFlags::empty(),
            )?;
        }
        let tid = mount_tid(&l);
        let (slot, seq) = {
            let slot = 1 - l.ckpt_slot;
            let seq = l.ckpt_seq + 1;
            let (enc, written) = match (ckpt, l.tree.as_mut()) {
                (MountCheckpoint::Image(enc), _) => (enc, None),
                (MountCheckpoint::Tree { gen, space }, Some(tree)) => {
                    let meta = &mut l.meta;
                    let w = tree.write_nodes(seq, &mut |goal, n| alloc_nodes(meta, goal, n))?;
                    let data = l.sb.data_start..l.sb.nr_blocks;
                    (
                        root_record(l.sb.fs_id, seq, tid, 0, &w, space, data)?,
                        Some((w, gen)),
                    )
                }
                (MountCheckpoint::Tree { .. }, None) => {
                    return Err(FsError::Corrupt("a tree checkpoint without a tree".into()))
                }
            };
            q.write_sync(
                sector(l.sb.checkpoint[slot].0),
                IoBuf::from_slice(&enc),
                BioFlags::PREFLUSH | BioFlags::FUA | BioFlags::META,
            )?;
            if let (Some(t), Some((w, gen))) = (&l.tree, written) {
                t.release(&mut l.meta, &w, gen)?;
            }
            (slot, seq)
        };
        l.meta.take_changes();
        if let (Some(t), false) = (&l.tree, l.lazy) {
            // From now on inodes not in use may be dropped, and are read back from the
            // tree: everything in memory is in it.
            l.meta.set_source(t.source());
        }
        if l.sb.version < upgraded_version(&l.sb) {
            // An older image: from now on it may hold what only this version reads, so
            // an older binary must meet a version error, not a puzzling record.
            l.sb.version = upgraded_version(&l.sb);
            let enc = l.sb.encode();
            for b in SB_BLOCKS {
                q.write_sync(
                    sector(b),
                    IoBuf::from_slice(&enc),
                    BioFlags::FUA | BioFlags::META,
                )?;
            }
        }
        trace::emit(
            "fs_mount",
            || json!({"replayed": l.txns_replayed, "last_tid": l.last_tid, "mount_tid": tid, "orphans": orphans.len(), "journal_end": l.journal_end}),
        );
        if let Some(lat) = opts.wbt_lat_usec {
            q.set_wbt_lat_usec(lat);
        }
        if let Some(on) = opts.wbt_scale_up_when_limited {
            q.set_wbt_scale_up_when_limited(on);
        }
        if let Some(j) = opts.wbt_judge {
            q.set_wbt_judge(j);
        }
        let cache = PageCache::new(opts.cache.clone());
        let inode_cache = opts.inode_cache;
        let node_cache = opts.node_cache;
        let bdi = Bdi::new(q.clone(), cache.clone(), opts.wb.clone());
        let aops = Arc::new(Aops {
            vol: std::sync::OnceLock::new(),
        });
        let clock = q.clock().clone();
        let wall_offset_ns = if clock.is_manual() {
            0
        } else {
            let wall = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            wall.saturating_sub(clock.now_ns())
        };
        let jwaiter = crate::clock::Waiter::new();
        clock.register_waiter(&jwaiter);
        let txn_limit_bytes = (l.sb.journal_blocks * PAGE / 4) as usize;
        let ring = super::jspace::JournalRing::new(0, l.sb.journal_blocks);
        let dcache = Arc::new(super::dcache::Dcache::default());
        let meta_tight = Arc::new(AtomicBool::new(false));
        let icache = super::icache::InodeCache::new(inode_cache);
        let vol = Arc::new(Vol {
            q,
            cache,
            bdi,
            sb: l.sb,
            clock,
            flush_on_close: AtomicBool::new(opts.flush_on_close),
            journal_data_kb: AtomicU64::new(opts.journal_data_kb),
            commit_flush_always: AtomicBool::new(opts.commit_flush_always),
            logbufs: std::sync::atomic::AtomicUsize::new(opts.logbufs),
            home: Default::default(),
            opts,
            st: crate::spin::SpinMutex::with_on_panic(
                State {
                    meta: l.meta,
                    running_tid: tid + 1,
                    txn: Records::new(),
                    txn_inodes: Default::default(),
                    txn_first_ns: None,
                    txn_bytes: 0,
                    txn_limit_bytes,
                    meta_limit: inode_cache,
                    txn_full_waiter: jwaiter.clone(),
                    live: FxHashMap::default(),
                    inflight: FxHashMap::default(),
                    aborted: None,
                    ordered: Vec::new(),
                    truncating: FxHashMap::default(),
                    jhome: Vec::new(),
                    jblocks: FxHashMap::default(),
                    txn_jdata_pages: 0,
                    jhome_first_ns: None,
                    jclaiming: FxHashMap::default(),
                    wall_offset_ns,
                    dcache: dcache.clone(),
                    meta_tight: meta_tight.clone(),
                },
                State::panicked_holding,
            ),
            dcache,
            meta_tight,
            icache_gauge: icache.gauge(),
            icache: Mutex::new(icache),
            nodes: l.tree.as_ref().map(|t| {
                t.store.set_cache_limit(node_cache);
                t.store.clone()
            }),
            dir_listed_max: l.tree.as_ref().map(|t| t.listed_max()),
            tree: Mutex::new(l.tree),
            jn: Mutex::new(JState {
                committed: tid,
                closed: tid,
                released: tid,
                want_tid: tid,
                ckpt_seq: seq,
                ckpt_slot: slot,
                ring,
                ..Default::default()
            }),
            jcv: Condvar::new(),
            tid_cv: std::array::from_fn(|_| Condvar::new()),
            barrier_cv: Condvar::new(),
            jwaiter,
            aops: aops.clone(),
            committer: Mutex::new(None),
            bg_ckpt: Mutex::new(None),
            ckpt_tx: Mutex::new(None),
            unmounted: AtomicBool::new(false),
            barrier_started: AtomicU64::new(0),
            sb_err: crate::mm::ErrSeq::new(),
            sync_since: Mutex::new(0),
            flushq: Mutex::new(Default::default()),
            ordered_cv: Condvar::new(),
            truncate_cv: Condvar::new(),
            #[cfg(test)]
            panic_next_commit: AtomicBool::new(false),
            #[cfg(test)]
            panic_next_map_write: AtomicBool::new(false),
        });
        let bound = aops.vol.set(Arc::downgrade(&vol));
        debug_assert!(bound.is_ok(), "a volume's page-cache ops bound twice");
        vol.hear_flusher_panics();
        let weak = Arc::downgrade(&vol);
        let h = std::thread::Builder::new()
            .name("fs-commit".into())
            .spawn(move || super::commit::committer(weak))
            .map_err(|e| FsError::Invalid(format!("cannot start the commit thread: {e}")))?;
        *vol.committer.lock() = Some(h);
        let (tx, rx) = std::sync::mpsc::channel();
        let weak = Arc::downgrade(&vol);
        let h = std::thread::Builder::new()
            .name("fs-ckpt".into())
            .spawn(move || super::commit::checkpointer(weak, rx))
            .map_err(|e| FsError::Invalid(format!("cannot start the checkpoint thread: {e}")));
        let volume = Volume { vol };
        // On an error the volume is dropped here, which stops its committer.
        *volume.vol.bg_ckpt.lock() = Some(h?);
        *volume.vol.ckpt_tx.lock() = Some(tx);
        Ok(volume)
    }

    /// Make every metadata change made so far durable (what fsync of a directory
    /// promises); data still in the cache is not written.
    pub fn commit_now(&self) -> FsResult<()> {
        self.vol.commit_now()
    }

    /// Unmount: write back everything, write a final checkpoint, stop the threads.
    pub fn unmount(self) -> FsResult<()> {
        self.vol.unmount()
    }

    /// Stop at once, as if the machine stopped: no writeback, no commit (for crash
    /// tests, after cutting the device's power).
    pub fn crash(self) {
        self.vol.stop_threads("the volume was crashed");
    }
}

impl Drop for Volume {
    fn drop(&mut self) {
        let _ = self.vol.unmount();
    }
}

impl Vol {
    pub(super) fn unmount(&self) -> FsResult<()> {
        if self.unmounted.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let r = self.sync_all();
        let ck = self.checkpoint_now();
        self.stop_threads("the volume was unmounted");
        r.and(ck)
    }

    pub(super) fn stop_threads(&self, why: &str) {
        self.unmounted.store(true, Ordering::Release);
        {
            let mut j = self.jn.lock();
            j.stop = true;
            if j.error.is_none() {
                j.error = Some(why.to_string());
            }
        }
        {
            let mut st = self.st.lock();
            if st.aborted.is_none() {
                st.aborted = Some(why.to_string());
            }
            // A checkpoint copying out its changes will not be written.
            drop(st.meta.take_capture());
        }
        self.wake_journal_all();
        self.settle_async();
        self.fail_home();
        self.jwaiter.kick();
        let committer = super::commit::join_thread(&self.committer);
        // After the journal's error is set: a checkpoint in flight writes no root.
        // Dropping the sender ends the checkpoint thread once its job is done.
        drop(self.ckpt_tx.lock().take());
        let checkpointer = super::commit::join_thread(&self.bg_ckpt);
        if committer.is_err() || checkpointer.is_err() {
            // Its panic message is on stderr; what it may have left unwritten is
            // reported as a writeback error to the next syncfs.
            self.sb_err.set(libc::EIO);
        }
        self.bdi.shutdown();
        // Break the cycle mapping -> bdi -> mapping of inodes still on the lists.
        let inos: Vec<u64> = self.icache.lock().drain();
        for ino in inos {
            self.bdi.forget_inode(ino);
        }
    }
}
