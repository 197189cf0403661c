//! wbstack's own filesystem as a benchmark target: a `Volume`, freshly made on the
//! device of a spec, behind the `BenchFs` trait the file-level tools use.

use crate::bench::benchfs::{BenchFile, BenchFs, FlushWait};
use std::io;
use std::sync::Arc;
use wbstack::block::{DiskStats, QueueConfig, RequestQueue};
use wbstack::fs::{File, FlushHandle, FsError, MkfsOptions, MountOptions, OpenOptions, Volume};

/// A fresh wbstack filesystem on a device.
pub struct VolumeFs {
    vol: Volume,
    spec: String,
}

fn io(e: FsError) -> io::Error {
    e.to_io()
}

impl VolumeFs {
    /// mkfs on the device of `spec`, then mount it with `opts`.
    pub fn format(spec: &str, opts: MountOptions) -> Result<VolumeFs, String> {
        let q = RequestQueue::open(spec, QueueConfig::default())?;
        Volume::mkfs(&q, &MkfsOptions::for_mount(&opts))
            .map_err(|e| format!("mkfs {spec}: {e}"))?;
        let vol = Volume::mount(q, opts).map_err(|e| {
            let hint = if spec.split(',').any(|o| o == "data=0") {
                " (a sim device with data=0 keeps nothing, not even the filesystem's \
                 metadata: use data=meta)"
            } else {
                ""
            };
            format!("mount {spec}: {e}{hint}")
        })?;
        Ok(VolumeFs {
            vol,
            spec: spec.to_string(),
        })
    }

    pub fn volume(&self) -> &Volume {
        &self.vol
    }
}

impl BenchFs for VolumeFs {
    fn name(&self) -> String {
        format!("wbstack:{}", self.spec)
    }
    fn mkdir_all(&self, path: &str) -> io::Result<()> {
        self.vol.mkdir_all(path, 0o755).map_err(io)
    }
    fn create(&self, path: &str) -> io::Result<Box<dyn BenchFile>> {
        let f = self.vol.create(path).map_err(io)?;
        Ok(Box::new(VolFile(f)))
    }
    fn open(&self, path: &str, write: bool) -> io::Result<Box<dyn BenchFile>> {
        let o = if write {
            OpenOptions::read_write()
        } else {
            OpenOptions::read()
        };
        Ok(Box::new(VolFile(self.vol.open(path, &o).map_err(io)?)))
    }
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        self.vol.rename(from, to).map_err(io)
    }
    fn unlink(&self, path: &str) -> io::Result<()> {
        self.vol.unlink(path).map_err(io)
    }
    fn symlink(&self, target: &str, path: &str) -> io::Result<()> {
        self.vol.symlink(target, path).map(|_| ()).map_err(io)
    }
    fn sync(&self) -> io::Result<()> {
        self.vol.sync().map_err(io)
    }
    fn usage(&self) -> io::Result<(u64, u64)> {
        let s = self.vol.statfs();
        Ok((s.blocks * s.block_size, (s.blocks - s.free) * s.block_size))
    }
    fn disk_stats(&self) -> Option<DiskStats> {
        Some(self.vol.queue().diskstats())
    }
    fn drop_cache(&self, path: &str) -> io::Result<bool> {
        self.vol.drop_cache(path).map_err(io)
    }
    fn settle(&self) -> io::Result<bool> {
        let q = self.vol.queue();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            if q.in_flight() == [0, 0] && q.wbt_state().scale_step == 0 {
                return Ok(true);
            }
            if std::time::Instant::now() >= deadline {
                return Ok(false);
            }
            // wbt moves at most one step per window (100 ms): polling at a tenth of
            // that costs nothing and adds at most 10 ms.
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
    fn journal_commits(&self) -> Option<u64> {
        Some(self.vol.journal_stats().commits)
    }
    fn extra_stats(&self) -> serde_json::Value {
        let f = self.vol.bdi().fairness();
        let j = self.vol.journal_stats();
        let w = self.vol.queue().wbt_state();
        let bdi = self.vol.bdi().stats();
        let ic = self.vol.inode_cache_stats();
        serde_json::json!({
            "inodes": {
                "files": self.vol.statfs().files,
                "resident": ic.inodes_resident,
                "read_back": ic.inodes_read_back,
                "dropped": ic.inodes_dropped,
                "dirents_resident": ic.dirents_resident,
                "dirent_groups_read_back": ic.dirent_groups_read_back,
                "dirents_dropped": ic.dirents_dropped,
                "mappings_cached": ic.cached,
                "live": ic.live,
                "node_cache_bytes": ic.node_cache_bytes,
                "node_cache_misses": ic.node_cache_misses,
                "dentries": ic.dentries,
                "dentry_walk_hits": ic.dentry_walk_hits,
                "dentry_walk_misses": ic.dentry_walk_misses,
            },
            "wbt": {
                "enabled": w.enabled,
                "lat_usec": w.min_lat_nsec / 1000,
                "scale_step": w.scale_step,
                "max_depth": w.max_depth,
                "wb_background": w.wb_background,
                "windows": w.windows,
                "waits": w.waits,
                "last_status": format!("{:?}", w.last_status),
            },
            "dirty_pauses": bdi.pauses,
            "max_rounds_waited": f.max_rounds_waited,
            "max_first_write_delay_s": f.max_first_write_delay_ns as f64 / 1e9,
            "writeback_rounds": f.rounds,
            "writeback_visits": f.visits,
            "journal": j,
        })
    }
}

struct VolFile(File);

struct VolFlush(FlushHandle);

impl FlushWait for VolFlush {
    fn wait(self: Box<Self>) -> io::Result<()> {
        self.0.wait().map_err(io)
    }
}

impl BenchFile for VolFile {
    fn write_at(&mut self, off: u64, buf: &[u8]) -> io::Result<()> {
        self.0.write_all_at(off, buf).map_err(io)
    }
    fn read_at(&mut self, off: u64, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read_at(off, buf).map_err(io)
    }
    fn size(&mut self) -> io::Result<u64> {
        Ok(self.0.size())
    }
    fn set_len(&mut self, size: u64) -> io::Result<()> {
        self.0.set_len(size).map_err(io)
    }
    fn fsync(&mut self) -> io::Result<()> {
        self.0.fsync().map_err(io)
    }
    fn start_flush(&mut self) -> io::Result<Box<dyn FlushWait>> {
        Ok(Box::new(VolFlush(self.0.flush_async().map_err(io)?)))
    }
    fn close(self: Box<Self>) -> io::Result<()> {
        self.0.close().map_err(io)
    }
}

/// `--device SPEC` with mount options `opts` (comma-separated name=value).
pub fn open(spec: &str, opts: &str) -> Result<Arc<dyn BenchFs>, String> {
    Ok(open_vol(spec, opts)?)
}

/// As [`open`], keeping the concrete type (the lab samples the volume's state).
pub fn open_vol(spec: &str, opts: &str) -> Result<Arc<VolumeFs>, String> {
    let mut o = MountOptions::default();
    o.parse(opts).map_err(|e| e.to_string())?;
    Ok(Arc::new(VolumeFs::format(spec, o)?))
}

/// The simulated device's counters under a volume (None on other devices).
pub fn sim_stats(v: &VolumeFs) -> Option<wbstack::dev::sim::SimStats> {
    v.volume()
        .queue()
        .device()
        .as_any()
        .downcast_ref::<wbstack::dev::sim::SimDevice>()
        .map(|s| s.stats())
}
