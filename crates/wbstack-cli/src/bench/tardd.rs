//! `wbstack bench tardd`: seed 001's tar + dd. A tar archive is extracted while a dd-like
//! writer streams one large file (bs 1 MiB), each in its own thread, started together;
//! then the filesystem is synced. Reports each one's time, the total including the sync,
//! and the filesystem's extra statistics (wbstack: writeback fairness).

use crate::bench::benchfs::{err, BenchFs, DeviceWrites};
use crate::progress::Progress;
use rand::{Rng, RngCore, SeedableRng};
use rand_distr::{Distribution, LogNormal};
use serde::Serialize;
use std::collections::HashSet;
use std::io::Read;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub enum TarSource {
    /// A real (uncompressed) tar file.
    File(PathBuf),
    /// A source tree generated in memory (see `synthetic_tar`).
    Synthetic { files: usize, seed: u64 },
}

#[derive(Clone, Debug)]
pub struct TarddOpts {
    pub source: TarSource,
    /// Bytes the dd writes.
    pub dd_size: u64,
    /// dd's block size.
    pub dd_bs: usize,
    /// Directory inside the target: the tree goes to DIR/tree, dd writes DIR/zero.
    pub dir: String,
    pub progress: bool,
    /// Counters to bump as the run goes (a sampler reads them); None: a private one.
    pub meter: Option<std::sync::Arc<crate::bench::meter::Meter>>,
}

impl Default for TarddOpts {
    fn default() -> Self {
        TarddOpts {
            source: TarSource::Synthetic {
                files: 20_000,
                seed: 1,
            },
            dd_size: 2 << 30,
            dd_bs: 1 << 20,
            dir: "tardd".into(),
            progress: false,
            meter: None,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct TarddReport {
    pub tool: &'static str,
    pub target: String,
    pub archive: String,
    pub archive_bytes: u64,
    /// Regular files extracted and their bytes.
    pub files: u64,
    pub bytes: u64,
    pub dirs: u64,
    pub symlinks: u64,
    /// Entries of other kinds (hard links, devices, fifos...), not extracted.
    pub skipped: u64,
    pub dd_bytes: u64,
    pub tar_s: f64,
    pub dd_s: f64,
    pub dd_mib_s: f64,
    pub sync_s: f64,
    /// From the start of both to the end of the final sync.
    pub total_s: f64,
    pub device: Option<DeviceWrites>,
    pub extra: serde_json::Value,
}

/// A synthetic source tree as an uncompressed tar, deterministic for a seed.
///
/// File sizes are log-normal with a median of 6 KiB and sigma 1.2 (mean ~12.3 KiB,
/// 95th percentile ~43 KiB), cut at 2 MiB, ~2% empty files: close to a kernel source
/// tree, whose ~70k files have a median near 6 KiB and a mean near 14 KiB. Directories
/// hold ~15 files on average: each new file opens a new directory with probability 1/15,
/// under a random existing directory at most 6 deep. One file in 400 is a relative
/// symlink to a sibling. Entries are in path order, as `git archive` writes them.
pub fn synthetic_tar(files: usize, seed: u64) -> Result<Vec<u8>, String> {
    const MAX_DEPTH: usize = 6;
    const WORDS: &[&str] = &[
        "arch", "block", "core", "drivers", "fs", "include", "kernel", "lib", "mm", "net", "sound",
        "tools", "crypto", "security", "virt", "usb", "gpu", "media", "scsi", "phy",
    ];
    const EXTS: &[&str] = &[
        ".c", ".c", ".c", ".h", ".h", ".S", ".rst", ".txt", ".yaml", "",
    ];
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let sizes = LogNormal::new((6.0f64 * 1024.0).ln(), 1.2).map_err(|e| e.to_string())?;
    // (path, depth)
    let mut dirs: Vec<(String, usize)> = vec![("src".into(), 1)];
    let mut entries: Vec<(String, Entry)> = vec![("src".into(), Entry::Dir)];
    let mut in_dir: Vec<usize> = vec![0];
    for i in 0..files {
        let d = if rng.gen_ratio(1, 15) || dirs.len() == 1 && in_dir[0] >= 15 {
            let parents: Vec<usize> = (0..dirs.len()).filter(|&k| dirs[k].1 < MAX_DEPTH).collect();
            let p = parents[rng.gen_range(0..parents.len())];
            let name = format!("{}{}", WORDS[rng.gen_range(0..WORDS.len())], dirs.len());
            let path = format!("{}/{name}", dirs[p].0);
            let depth = dirs[p].1 + 1;
            entries.push((path.clone(), Entry::Dir));
            dirs.push((path, depth));
            in_dir.push(0);
            dirs.len() - 1
        } else {
            rng.gen_range(0..dirs.len())
        };
        in_dir[d] += 1;
        let ext = EXTS[rng.gen_range(0..EXTS.len())];
        let path = format!("{}/f{i:06}{ext}", dirs[d].0);
        if i % 400 == 399 {
            entries.push((path, Entry::Symlink(format!("f{:06}{ext}", i - 1))));
            continue;
        }
        let size = if rng.gen_ratio(1, 50) {
            0
        } else {
            (sizes.sample(&mut rng) as u64).min(2 << 20)
        };
        entries.push((path, Entry::File(size, rng.next_u64())));
    }
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    let mut b = tar::Builder::new(Vec::new());
    let mut data = Vec::new();
    for (path, e) in &entries {
        let mut h = tar::Header::new_gnu();
        h.set_mtime(1_300_000_000);
        h.set_uid(0);
        h.set_gid(0);
        let res = match e {
            Entry::Dir => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(0o755);
                h.set_size(0);
                b.append_data(&mut h, format!("{path}/"), std::io::empty())
            }
            Entry::File(size, fseed) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(0o644);
                h.set_size(*size);
                data.resize(*size as usize, 0);
                rand_chacha::ChaCha8Rng::seed_from_u64(*fseed).fill_bytes(&mut data);
                b.append_data(&mut h, path, &data[..])
            }
            Entry::Symlink(target) => {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_mode(0o777);
                h.set_size(0);
                b.append_link(&mut h, path, target)
            }
        };
        res.map_err(|e| format!("tardd: building the archive: {e}"))?;
    }
    b.into_inner()
        .map_err(|e| format!("tardd: building the archive: {e}"))
}

enum Entry {
    Dir,
    /// size, content seed
    File(u64, u64),
    Symlink(String),
}

#[derive(Default)]
struct TarCounts {
    files: u64,
    bytes: u64,
    dirs: u64,
    symlinks: u64,
    skipped: u64,
}

/// The path of an entry inside the destination: relative, without '.', never '..'.
fn entry_path(p: &std::path::Path) -> Result<String, String> {
    let mut parts = Vec::new();
    for c in p.components() {
        match c {
            std::path::Component::Normal(s) => parts.push(
                s.to_str()
                    .ok_or_else(|| format!("tardd: entry name is not UTF-8: {}", p.display()))?,
            ),
            std::path::Component::CurDir => {}
            _ => {
                return Err(format!(
                    "tardd: archive entry '{}' leaves the destination",
                    p.display()
                ))
            }
        }
    }
    Ok(parts.join("/"))
}

fn extract(
    fs: &dyn BenchFs,
    archive: impl Read,
    dest: &str,
    files_done: &AtomicU64,
) -> Result<TarCounts, String> {
    let mut c = TarCounts::default();
    let mut made: HashSet<String> = HashSet::new();
    let mut ensure_dir = |fs: &dyn BenchFs, d: &str| -> Result<(), String> {
        if !made.contains(d) {
            fs.mkdir_all(d).map_err(err("tardd: mkdir"))?;
            made.insert(d.to_string());
        }
        Ok(())
    };
    ensure_dir(fs, dest)?;
    let mut ar = tar::Archive::new(archive);
    // GNU tar writes in 10 KiB records; 64 KiB is what it ends up using per write(2) with
    // its default blocking on large files, and keeps small files to one write.
    let mut buf = vec![0u8; 64 << 10];
    for e in ar.entries().map_err(err("tardd: reading the archive"))? {
        let mut e = e.map_err(err("tardd: reading the archive"))?;
        let rel = entry_path(&e.path().map_err(err("tardd: entry path"))?)?;
        if rel.is_empty() {
            continue;
        }
        let path = format!("{dest}/{rel}");
        let parent = path.rsplit_once('/').map_or(dest, |(p, _)| p).to_string();
        match e.header().entry_type() {
            tar::EntryType::Directory => {
                ensure_dir(fs, &path)?;
                c.dirs += 1;
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                ensure_dir(fs, &parent)?;
                let mut f = fs.create(&path).map_err(err("tardd: create"))?;
                let mut off = 0u64;
                loop {
                    let n = e
                        .read(&mut buf)
                        .map_err(err("tardd: reading the archive"))?;
                    if n == 0 {
                        break;
                    }
                    f.write_at(off, &buf[..n]).map_err(err("tardd: write"))?;
                    off += n as u64;
                }
                f.close().map_err(err("tardd: close"))?;
                c.files += 1;
                c.bytes += off;
                files_done.fetch_add(1, Ordering::Relaxed);
            }
            tar::EntryType::Symlink => {
                ensure_dir(fs, &parent)?;
                let target = e
                    .link_name()
                    .map_err(err("tardd: link name"))?
                    .ok_or_else(|| format!("tardd: symlink {rel} has no target"))?;
                let target = target
                    .to_str()
                    .ok_or_else(|| format!("tardd: symlink target of {rel} is not UTF-8"))?
                    .to_string();
                if let Err(first) = fs.symlink(&target, &path) {
                    // As tar does over an earlier extraction: replace what is there.
                    if fs.unlink(&path).is_err() {
                        return Err(format!("tardd: {first}"));
                    }
                    fs.symlink(&target, &path).map_err(err("tardd: symlink"))?;
                }
                c.symlinks += 1;
            }
            // pax/GNU long-name headers are consumed by the tar crate; anything else
            // (hard links, devices, fifos, sparse files) is not part of this workload.
            _ => c.skipped += 1,
        }
    }
    Ok(c)
}

/// dd if=/dev/zero of=PATH bs=BS: writes `size` bytes, adding each write to `done`.
pub fn dd(
    fs: &dyn BenchFs,
    path: &str,
    size: u64,
    bs: usize,
    done: &AtomicU64,
) -> Result<(), String> {
    let buf = vec![0u8; bs];
    let mut f = fs.create(path).map_err(err("tardd: dd create"))?;
    let mut off = 0;
    while off < size {
        let n = (size - off).min(bs as u64) as usize;
        f.write_at(off, &buf[..n]).map_err(err("tardd: dd write"))?;
        off += n as u64;
        done.fetch_add(n as u64, Ordering::Relaxed);
    }
    f.close().map_err(err("tardd: dd close"))
}

pub fn run(o: &TarddOpts, fs: Arc<dyn BenchFs>) -> Result<TarddReport, String> {
    if o.dd_bs == 0 {
        return Err("tardd: dd block size must be at least 1".into());
    }
    let (archive, name, archive_bytes): (Box<dyn Read + Send>, String, u64) = match &o.source {
        TarSource::File(p) => {
            let mut f =
                std::fs::File::open(p).map_err(|e| format!("tardd: --tar {}: {e}", p.display()))?;
            let mut magic = [0u8; 6];
            let n = f.read(&mut magic).map_err(err("tardd: --tar"))?;
            let m = &magic[..n];
            if m.starts_with(&[0x1f, 0x8b])
                || m.starts_with(b"BZh")
                || m.starts_with(&[0xfd, b'7', b'z', b'X', b'Z'])
                || m.starts_with(&[0x28, 0xb5, 0x2f, 0xfd])
            {
                return Err(format!(
                    "tardd: --tar {} is compressed; give an uncompressed tar (decompress it first)",
                    p.display()
                ));
            }
            let f = std::fs::File::open(p).map_err(err("tardd: --tar"))?;
            let len = f.metadata().map(|m| m.len()).unwrap_or(0);
            (
                Box::new(std::io::BufReader::new(f)),
                p.display().to_string(),
                len,
            )
        }
        TarSource::Synthetic { files, seed } => {
            if o.progress {
                eprintln!("tardd: generating a synthetic tree of {files} files (seed {seed})");
            }
            let v = synthetic_tar(*files, *seed)?;
            let len = v.len() as u64;
            (
                Box::new(std::io::Cursor::new(v)),
                format!("synthetic:{files} files,seed={seed}"),
                len,
            )
        }
    };
    let dir = o.dir.trim_matches('/').to_string();
    let tree = if dir.is_empty() {
        "tree".to_string()
    } else {
        format!("{dir}/tree")
    };
    let zero = if dir.is_empty() {
        "zero".to_string()
    } else {
        format!("{dir}/zero")
    };
    if !dir.is_empty() {
        fs.mkdir_all(&dir).map_err(err("tardd: mkdir"))?;
    }
    let meter = o.meter.clone().unwrap_or_default();
    let (files_done, dd_done) = (&meter.ops, &meter.bytes);
    let _progress = {
        let (m, total) = (meter.clone(), o.dd_size);
        Progress::start(o.progress, Duration::from_secs(2), move || {
            format!(
                "tardd: {} files extracted, dd {} of {} MiB",
                m.ops(),
                m.bytes() >> 20,
                total >> 20
            )
        })
    };
    let disk0 = fs.disk_stats();
    let barrier = Barrier::new(3);
    let (tar_res, dd_res, t0) = std::thread::scope(|s| {
        let tar_h = s.spawn(|| {
            barrier.wait();
            let t = Instant::now();
            let r = extract(&*fs, archive, &tree, files_done);
            (r, t.elapsed().as_secs_f64())
        });
        let dd_h = s.spawn(|| {
            barrier.wait();
            let t = Instant::now();
            let r = dd(&*fs, &zero, o.dd_size, o.dd_bs, dd_done);
            (r, t.elapsed().as_secs_f64())
        });
        barrier.wait();
        let t0 = Instant::now();
        let tar_res = tar_h
            .join()
            .unwrap_or_else(|_| (Err("tardd: the tar thread panicked".into()), 0.0));
        let dd_res = dd_h
            .join()
            .unwrap_or_else(|_| (Err("tardd: the dd thread panicked".into()), 0.0));
        (tar_res, dd_res, t0)
    });
    let (counts, tar_s) = (tar_res.0?, tar_res.1);
    let dd_s = {
        dd_res.0?;
        dd_res.1
    };
    let ts = Instant::now();
    fs.sync().map_err(err("tardd: sync"))?;
    let sync_s = ts.elapsed().as_secs_f64();
    let total_s = t0.elapsed().as_secs_f64();
    let device = DeviceWrites::between(&disk0, &fs.disk_stats(), total_s);
    Ok(TarddReport {
        tool: "tardd",
        target: fs.name(),
        archive: name,
        archive_bytes,
        files: counts.files,
        bytes: counts.bytes,
        dirs: counts.dirs,
        symlinks: counts.symlinks,
        skipped: counts.skipped,
        dd_bytes: o.dd_size,
        tar_s,
        dd_s,
        dd_mib_s: o.dd_size as f64 / (1u64 << 20) as f64 / dd_s.max(1e-9),
        sync_s,
        total_s,
        device,
        extra: fs.extra_stats(),
    })
}

/// The report as lines, in the seed's terms.
pub fn human_lines(r: &TarddReport) -> Vec<String> {
    let mut v = vec![
        format!(
            "tar: {} files ({:.1} MiB), {} dirs, {} symlinks, {} skipped from {}: {:.2}s",
            r.files,
            r.bytes as f64 / (1u64 << 20) as f64,
            r.dirs,
            r.symlinks,
            r.skipped,
            r.archive,
            r.tar_s
        ),
        format!(
            "dd: {} MiB, bs 1 MiB: {:.2}s, {:.1} MiB/s",
            r.dd_bytes >> 20,
            r.dd_s,
            r.dd_mib_s
        ),
        format!(
            "total including sync: {:.2}s (sync {:.2}s)",
            r.total_s, r.sync_s
        ),
    ];
    if let Some(d) = &r.device {
        v.push(format!(
            "device: {} writes ({:.1} KiB avg, {:.1} MiB/s), {} flushes, {} reads",
            d.write_ios, d.avg_write_kib, d.write_mib_s, d.flushes, d.read_ios
        ));
    }
    if !r.extra.is_null() {
        v.push(format!("filesystem: {}", r.extra));
    }
    v
}
