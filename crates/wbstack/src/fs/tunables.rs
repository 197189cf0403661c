//! The knobs a mounted volume changes at run time (the FUSE mount's control
//! directory, `wbstack ctl`), by the kernel's names. Values are parsed and checked by
//! `MountOptions::set`, the one parser of every option, so a value the mount refuses
//! is refused here the same way; what cannot change after mount is said so.

use super::error::{FsError, FsResult};
use super::volume::{MountOptions, Volume};
use crate::block::stats::IoStatsMode;
use std::sync::atomic::Ordering;

/// Every knob `tunable` reads and `set_tunable` writes.
pub const TUNABLES: &[&str] = &[
    "wbt_lat_usec",
    "wbt_judge",
    "wbt_scale_up_when_limited",
    "dirty_ratio",
    "dirty_bytes",
    "dirty_background_ratio",
    "dirty_background_bytes",
    "dirty_expire_centisecs",
    "dirty_writeback_centisecs",
    "read_ahead_kb",
    "writeback_plug",
    "expire_first",
    "flush_on_close",
    "journal_data_kb",
    "commit_flush",
    "logbufs",
    "iostats",
    "inode_cache",
    "node_cache",
    "dir_listed_max",
];

fn flag(b: bool) -> String {
    u8::from(b).to_string()
}

impl Volume {
    /// The current value of knob `key`, as its control file shows it.
    pub fn tunable(&self, key: &str) -> FsResult<String> {
        let wb = self.bdi().config();
        let q = self.queue();
        Ok(match key {
            "wbt_lat_usec" => q.wbt_lat_usec().to_string(),
            "wbt_judge" => format!("{:?}", q.wbt_state().judge).to_lowercase(),
            "wbt_scale_up_when_limited" => flag(q.wbt_state().scale_up_when_limited),
            "dirty_ratio" => wb.dirty.dirty_ratio.to_string(),
            "dirty_bytes" => wb.dirty.dirty_bytes.to_string(),
            "dirty_background_ratio" => wb.dirty.dirty_background_ratio.to_string(),
            "dirty_background_bytes" => wb.dirty.dirty_background_bytes.to_string(),
            "dirty_expire_centisecs" => wb.dirty_expire_centisecs.to_string(),
            "dirty_writeback_centisecs" => wb.dirty_writeback_centisecs.to_string(),
            "read_ahead_kb" => (self.cache().ra_max_pages() * 4).to_string(),
            "writeback_plug" => flag(wb.writeback_plug),
            "expire_first" => flag(wb.expire_first),
            "flush_on_close" => flag(self.vol.flush_on_close.load(Ordering::Relaxed)),
            "journal_data_kb" => self.vol.journal_data_kb.load(Ordering::Relaxed).to_string(),
            "commit_flush" => match self.vol.commit_flush_always.load(Ordering::Relaxed) {
                true => "always".into(),
                false => "needed".into(),
            },
            "logbufs" => self.vol.logbufs.load(Ordering::Relaxed).to_string(),
            "iostats" => q.iostats().to_string(),
            "inode_cache" => self.vol.icache.lock().limit().to_string(),
            // Format 3 keeps no tree, and so no node cache.
            "node_cache" => (self.vol.nodes.as_ref())
                .map_or(0, |s| s.cache_limit())
                .to_string(),
            "dir_listed_max" => (self.vol.dir_listed_max.as_ref())
                .map_or(0, |m| m.load(Ordering::Relaxed))
                .to_string(),
            _ => return Err(unknown(key)),
        })
    }

    /// Set knob `key` now. A bad value is an `Invalid` error and changes nothing.
    pub fn set_tunable(&self, key: &str, value: &str) -> FsResult<()> {
        let value = value.trim();
        if key == "iostats" {
            let m = IoStatsMode::parse(value).map_err(FsError::Invalid)?;
            self.queue().set_iostats(m);
            return Ok(());
        }
        if !TUNABLES.contains(&key) {
            return Err(unknown(key));
        }
        let mut o = MountOptions {
            wb: self.bdi().config(),
            ..MountOptions::default()
        };
        o.cache.ra_max_pages = self.cache().ra_max_pages();
        o.set(key, value)?;
        let q = self.queue();
        match key {
            "wbt_lat_usec" => q.set_wbt_lat_usec(o.wbt_lat_usec.expect("set above")),
            "wbt_judge" => q.set_wbt_judge(o.wbt_judge.expect("set above")),
            "wbt_scale_up_when_limited" => {
                q.set_wbt_scale_up_when_limited(o.wbt_scale_up_when_limited.expect("set above"))
            }
            "read_ahead_kb" => self.cache().set_ra_max_pages(o.cache.ra_max_pages),
            "flush_on_close" => self
                .vol
                .flush_on_close
                .store(o.flush_on_close, Ordering::Relaxed),
            "journal_data_kb" => self
                .vol
                .journal_data_kb
                .store(o.journal_data_kb, Ordering::Relaxed),
            "commit_flush" => self
                .vol
                .commit_flush_always
                .store(o.commit_flush_always, Ordering::Relaxed),
            // The committer reads it before each commit.
            "logbufs" => self.vol.logbufs.store(o.logbufs, Ordering::Relaxed),
            // Takes effect at the next open or last close.
            "inode_cache" => {
                self.vol.icache.lock().set_limit(o.inode_cache);
                self.vol.st.lock().meta_limit = o.inode_cache;
            }
            "node_cache" => match &self.vol.nodes {
                Some(s) => s.set_cache_limit(o.node_cache),
                None => {
                    return Err(FsError::Invalid(
                        "node_cache: a format 3 volume keeps no metadata tree".into(),
                    ))
                }
            },
            // Directories read back from now on; those in memory stay as they are.
            "dir_listed_max" => match &self.vol.dir_listed_max {
                Some(m) => m.store(o.dir_listed_max, Ordering::Relaxed),
                None => {
                    return Err(FsError::Invalid(
                        "dir_listed_max: a format 3 volume keeps no metadata tree".into(),
                    ))
                }
            },
            _ => self.bdi().set_config(o.wb),
        }
        Ok(())
    }
}

fn unknown(key: &str) -> FsError {
    FsError::Invalid(format!(
        "{key}: no such knob (run-time knobs: {})",
        TUNABLES.join(", ")
    ))
}
