//! `wbstack mkfs`, `fsck` and `info`: making, checking and describing images.

use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;
use wbstack::block::{QueueConfig, RequestQueue};
use wbstack::fs::fsck::{fsck, FsckReport};
use wbstack::fs::{MkfsOptions, MountOptions, Volume};

/// A bare path means a file (or block device) opened through io_uring and O_DIRECT;
/// a spec is one whose first token is a device kind ([`wbstack::dev::spec_kind`]).
pub fn spec_of(image: &str) -> String {
    if wbstack::dev::spec_kind(image).is_some() {
        image.to_string()
    } else {
        format!("file:{image}")
    }
}

fn open(spec: &str) -> Result<Arc<RequestQueue>, String> {
    RequestQueue::open(spec, QueueConfig::default())
}

#[derive(Serialize)]
pub struct MkfsReport {
    pub spec: String,
    pub size_bytes: u64,
    pub data_blocks: u64,
    pub journal_blocks: u64,
    pub checkpoint_blocks: u64,
    pub fs_id: String,
    /// The format version written (3: whole-metadata checkpoints; 5: the metadata tree; 6: and
    /// its journal a ring).
    pub format: u32,
    pub seconds: f64,
}

/// mkfs on `image`, creating (sparse) or extending a file to `size` if given.
pub fn mkfs(image: &str, size: Option<u64>, format: Option<u32>) -> Result<MkfsReport, String> {
    let mut spec = spec_of(image);
    if let Some(s) = size {
        if !spec.starts_with("file:") {
            return Err("--size is for file images (a sim device takes ,size=...)".into());
        }
        spec = format!("{spec},create=1,size={s}");
    }
    let t = Instant::now();
    let q = open(&spec).map_err(|e| {
        if e.contains("File too large") {
            format!(
                "{e}: the filesystem holding the image cannot store a file this large \
                 (ext4's limit is 16 TiB); put it on XFS, e.g. one made by scripts/kernel-loop.sh xfs"
            )
        } else {
            e
        }
    })?;
    let sb = Volume::mkfs(
        &q,
        &MkfsOptions {
            format,
            ..MkfsOptions::default()
        },
    )
    .map_err(|e| format!("mkfs: {e}"))?;
    Ok(MkfsReport {
        spec,
        size_bytes: q.geometry().size_bytes,
        data_blocks: sb.nr_blocks - sb.data_start,
        journal_blocks: sb.journal_blocks,
        checkpoint_blocks: sb.checkpoint[0].1,
        fs_id: format!("{:016x}", sb.fs_id),
        format: sb.version,
        seconds: t.elapsed().as_secs_f64(),
    })
}

pub fn print_mkfs(r: &MkfsReport) {
    println!(
        "wbstack filesystem {} (format {}) on {}: {} bytes, {} data blocks of 4 KiB, journal {} blocks, two checkpoint slots of {} blocks ({:.3} s)",
        r.fs_id, r.format, r.spec, r.size_bytes, r.data_blocks, r.journal_blocks, r.checkpoint_blocks, r.seconds
    );
}

/// fsck's exit codes, those of fsck(8): the image is a consistent filesystem.
pub const FSCK_CLEAN: u8 = 0;
/// A wbstack filesystem with problems (fsck repairs nothing, so they are left).
pub const FSCK_PROBLEMS: u8 = 4;
/// Nothing could be checked: the image cannot be opened or read, or holds no valid
/// wbstack superblock (not a wbstack filesystem).
pub const FSCK_NOT_CHECKED: u8 = 8;

/// fsck: the report, and the exit code ([`FSCK_CLEAN`], [`FSCK_PROBLEMS`],
/// [`FSCK_NOT_CHECKED`]). An error (the image cannot be opened) is also exit 8.
pub fn check(image: &str) -> Result<(FsckReport, u8), String> {
    let q = open(&spec_of(image))?;
    let r = fsck(&q);
    let code = if !r.checked {
        FSCK_NOT_CHECKED
    } else if r.is_clean() {
        FSCK_CLEAN
    } else {
        FSCK_PROBLEMS
    };
    Ok((r, code))
}

pub fn print_fsck(image: &str, r: &FsckReport) {
    for n in &r.notes {
        println!("note: {n}");
    }
    for p in &r.problems {
        println!("PROBLEM: {p}");
    }
    println!(
        "{image}: {} inodes ({} files, {} directories), {} blocks used, {} free, {} orphan(s): {}",
        r.inodes,
        r.files,
        r.directories,
        r.used_blocks,
        r.free_blocks,
        r.orphans,
        if r.is_clean() {
            "clean".to_string()
        } else {
            format!("{} problem(s)", r.problems.len())
        }
    );
}

#[derive(Serialize)]
pub struct InfoReport {
    pub spec: String,
    pub mount_s: f64,
    pub unmount_s: f64,
    pub block_size: u64,
    pub blocks: u64,
    pub free: u64,
    pub available: u64,
    pub files: u64,
    /// Resident memory of the process after mounting, in KiB (VmRSS).
    pub rss_kib_mounted: Option<u64>,
}

fn rss_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Mount the image (replaying its journal), report statfs, unmount.
pub fn info(image: &str) -> Result<InfoReport, String> {
    let spec = spec_of(image);
    let q = open(&spec)?;
    let t = Instant::now();
    let v = Volume::mount(q, MountOptions::default()).map_err(|e| format!("mount: {e}"))?;
    let mount_s = t.elapsed().as_secs_f64();
    let rss = rss_kib();
    let s = v.statfs();
    let t = Instant::now();
    v.unmount().map_err(|e| format!("unmount: {e}"))?;
    Ok(InfoReport {
        spec,
        mount_s,
        unmount_s: t.elapsed().as_secs_f64(),
        block_size: s.block_size,
        blocks: s.blocks,
        free: s.free,
        available: s.available,
        files: s.files,
        rss_kib_mounted: rss,
    })
}

pub fn print_info(r: &InfoReport) {
    println!(
        "{}: {} blocks of {} bytes, {} free, {} inodes; mount {:.3} s, unmount {:.3} s, RSS when mounted {} KiB",
        r.spec,
        r.blocks,
        r.block_size,
        r.free,
        r.files,
        r.mount_s,
        r.unmount_s,
        r.rss_kib_mounted.map_or("?".into(), |k| k.to_string())
    );
}

#[cfg(test)]
mod tests {
    use super::spec_of;

    #[test]
    fn an_image_path_is_a_spec_only_if_its_first_token_is_a_device_kind() {
        for (image, spec) in [
            ("nullimage.img", "file:nullimage.img"),
            ("null.img", "file:null.img"),
            ("simple.img", "file:simple.img"),
            ("filesystem.img", "file:filesystem.img"),
            ("/tmp/null", "file:/tmp/null"),
            ("null", "null"),
            ("null,size=1G", "null,size=1G"),
            ("sim:ssd,size=64M", "sim:ssd,size=64M"),
            ("file:null.img", "file:null.img"),
        ] {
            assert_eq!(spec_of(image), spec, "{image}");
        }
    }
}
