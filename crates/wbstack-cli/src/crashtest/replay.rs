//! Replay files: a failing cut written down so that its crash state can be rebuilt
//! and checked again, the same way every time, whatever the thread schedule was.
//!
//! A cut's workload runs on several threads and the stack's own (flusher, committer,
//! device), so its seed fixes the kind of moment the cut hits, not the moment. What the
//! checks need is only the device's image after the cut and the log of acknowledged
//! operations; the file holds both, and the device's write log up to the cut for the
//! reader (every write and flush in the order dm-log-writes keeps, and for the writes
//! after the last flush, how many of their sectors the cut kept).
//!
//! Layout: `WBREPLAY`, a little-endian u32 version, a u64 length and that many bytes of
//! JSON ([`Header`]), then a u64 count of 4 KiB chunks of the image, each a u64 chunk
//! index and its 4096 bytes (chunks not listed read as zeros).

use super::*;
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use wbstack::block::logwrites::{LogKind, WriteLog};
use wbstack::block::{QueueConfig, RequestQueue};
use wbstack::dev::null::NullDevice;
use wbstack::dev::store::{SparseStore, CHUNK};
use wbstack::dev::DeviceSpec;

const MAGIC: &[u8; 8] = b"WBREPLAY";
const VERSION: u32 = 1;
/// Refuse headers beyond this: a damaged length field must not allocate the machine.
const MAX_HEADER_BYTES: u64 = 1 << 30;

/// One request of the device's write log.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct WriteRec {
    /// write, discard or flush (a cache flush submitted; the writes before it were
    /// durable once it completed).
    pub kind: String,
    pub sector: u64,
    pub sectors: u64,
    pub fua: bool,
    /// For a write after the last flush: sectors of it the cut left on the media.
    pub kept_sectors: Option<u64>,
}

/// Everything but the image.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Header {
    pub wbstack_version: String,
    /// The device of the cut (its timing and size; the replay only needs the size).
    pub device_spec: String,
    pub device_bytes: u64,
    /// crashtest's mount options as given (`-o`) and its commit interval.
    pub mount_opts: String,
    pub commit_ms: u64,
    pub rule: FsyncRule,
    pub seed: u64,
    pub plan: Option<CutPlan>,
    pub landing: Landing,
    /// Why the cut failed when it ran.
    pub failure: String,
    pub deferred_zero_truncates: bool,
    /// The operation log: what the workload did and what was acknowledged.
    pub ops: Vec<Entry>,
    pub write_log: Vec<WriteRec>,
}

pub struct ReplayFile {
    pub header: Header,
    pub image: SparseStore,
}

/// Sectors of `e`'s data that `image` holds, counting each sector once: for the last
/// write to it (`claimed` holds the sectors a later write already answered for).
fn kept_sectors(
    image: &SparseStore,
    sector: u64,
    data: &[u8],
    claimed: &mut std::collections::HashSet<u64>,
) -> u64 {
    let mut kept = 0;
    let mut buf = [0u8; SECTOR as usize];
    for (i, want) in data.chunks(SECTOR as usize).enumerate() {
        let s = sector + i as u64;
        if !claimed.insert(s) {
            continue;
        }
        image.read(s, &mut buf);
        kept += (buf[..] == *want) as u64;
    }
    kept
}

fn write_records(log: &WriteLog, image: &SparseStore) -> Vec<WriteRec> {
    let entries = log.entries();
    let last_flush = entries
        .iter()
        .rposition(|e| e.kind == LogKind::Flush)
        .map_or(0, |i| i + 1);
    let mut claimed = std::collections::HashSet::new();
    let mut recs: Vec<WriteRec> = entries
        .iter()
        .enumerate()
        .rev()
        .map(|(i, e)| WriteRec {
            kind: match e.kind {
                LogKind::Write => "write",
                LogKind::Discard => "discard",
                LogKind::Flush => "flush",
            }
            .into(),
            sector: e.sector,
            sectors: e.nr_sectors,
            fua: e.fua,
            kept_sectors: (i >= last_flush && e.kind == LogKind::Write)
                .then(|| kept_sectors(image, e.sector, &e.data, &mut claimed)),
        })
        .collect();
    recs.reverse();
    recs
}

impl ReplayFile {
    pub fn new(
        o: &CrashOpts,
        seed: u64,
        rep: &CutReport,
        device_spec: &str,
        log: &Log,
        write_log: &WriteLog,
        image: SparseStore,
    ) -> ReplayFile {
        let device_bytes = DeviceSpec::parse(device_spec)
            .ok()
            .and_then(|s| s.str_opt("size"))
            .and_then(|v| wbstack::dev::parse_size(&v).ok())
            .unwrap_or(64 << 20);
        ReplayFile {
            header: Header {
                wbstack_version: env!("CARGO_PKG_VERSION").into(),
                device_spec: device_spec.into(),
                device_bytes,
                mount_opts: o.mount_opts.clone(),
                commit_ms: o.commit_ms,
                rule: o.rule,
                seed,
                plan: rep.plan,
                landing: rep.landing.clone(),
                failure: rep.reasons(),
                deferred_zero_truncates: log.deferred_zero_truncates,
                ops: log.entries.clone(),
                write_log: write_records(write_log, &image),
            },
            image,
        }
    }

    /// Write the file as `DIR/crash-seed-SEED.replay`.
    pub fn save_in(&self, dir: &Path) -> Result<PathBuf, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let path = dir.join(format!("crash-seed-{}.replay", self.header.seed));
        self.save(&path)?;
        Ok(path)
    }

    pub fn save(&self, path: &Path) -> Result<(), String> {
        let err = |e: std::io::Error| format!("{}: {e}", path.display());
        let json = serde_json::to_vec(&self.header).map_err(|e| e.to_string())?;
        let mut chunks: Vec<(u64, &[u8; CHUNK])> =
            self.image.chunks().map(|(i, c)| (i, &**c)).collect();
        chunks.sort_unstable_by_key(|(i, _)| *i);
        let mut out = Vec::with_capacity(32 + json.len() + chunks.len() * (8 + CHUNK));
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(json.len() as u64).to_le_bytes());
        out.extend_from_slice(&json);
        out.extend_from_slice(&(chunks.len() as u64).to_le_bytes());
        for (i, c) in chunks {
            out.extend_from_slice(&i.to_le_bytes());
            out.extend_from_slice(c);
        }
        let tmp = path.with_extension("replay.tmp");
        let mut f = std::fs::File::create(&tmp).map_err(err)?;
        f.write_all(&out).map_err(err)?;
        f.sync_all().map_err(err)?;
        std::fs::rename(&tmp, path).map_err(err)
    }

    pub fn load(path: &Path) -> Result<ReplayFile, String> {
        let name = path.display();
        let mut f = std::fs::File::open(path).map_err(|e| format!("{name}: {e}"))?;
        let file_bytes = f.metadata().map_err(|e| format!("{name}: {e}"))?.len();
        let bad = |why: &str| format!("{name}: not a crashtest replay file: {why}");
        let mut read = |buf: &mut [u8], what: &str| {
            f.read_exact(buf)
                .map_err(|_| bad(&format!("it ends inside the {what}")))
        };
        let mut magic = [0u8; 8];
        read(&mut magic, "magic")?;
        if &magic != MAGIC {
            return Err(bad("wrong magic"));
        }
        let mut b4 = [0u8; 4];
        read(&mut b4, "version")?;
        let version = u32::from_le_bytes(b4);
        if version != VERSION {
            return Err(format!(
                "{name}: replay file version {version} (this build reads version {VERSION})"
            ));
        }
        let mut b8 = [0u8; 8];
        read(&mut b8, "header length")?;
        let len = u64::from_le_bytes(b8);
        if len > MAX_HEADER_BYTES || len > file_bytes {
            return Err(bad(&format!(
                "a header of {len} bytes is longer than the file"
            )));
        }
        let mut json = vec![0u8; len as usize];
        read(&mut json, "header")?;
        let header: Header = serde_json::from_slice(&json)
            .map_err(|e| bad(&format!("its header does not parse: {e}")))?;
        read(&mut b8, "image chunk count")?;
        let n = u64::from_le_bytes(b8);
        let max_chunks = header.device_bytes / CHUNK as u64;
        if n > max_chunks {
            return Err(bad(&format!(
                "{n} image chunks do not fit a device of {} bytes",
                header.device_bytes
            )));
        }
        let mut image = SparseStore::new();
        let mut chunk = vec![0u8; CHUNK];
        for _ in 0..n {
            read(&mut b8, "image")?;
            let idx = u64::from_le_bytes(b8);
            if idx >= max_chunks {
                return Err(bad(&format!("image chunk {idx} lies beyond the device")));
            }
            read(&mut chunk, "image")?;
            image.write(idx * (CHUNK as u64 / SECTOR), &chunk);
        }
        Ok(ReplayFile { header, image })
    }

    /// The operation log of the cut.
    pub fn log(&self) -> Log {
        let mut log = Log::deferring_zero_truncates(self.header.deferred_zero_truncates);
        for e in &self.header.ops {
            log.push(e.clone());
        }
        log
    }

    /// Rebuild the crash state on a memory device and run the cut's checks on it.
    pub fn check(&self) -> Result<CutReport, String> {
        let h = &self.header;
        let spec = format!("null,memory_backed=1,lbs=4096,size={}", h.device_bytes);
        let dev = NullDevice::from_spec(
            &DeviceSpec::parse(&spec).map_err(|e| e.to_string())?,
            QueueConfig::default().clock,
        )
        .map_err(|e| e.to_string())?;
        dev.set_image(self.image.clone())?;
        let q =
            RequestQueue::new(Arc::new(dev), QueueConfig::default()).map_err(|e| e.to_string())?;
        let o = CrashOpts {
            mount_opts: h.mount_opts.clone(),
            commit_ms: h.commit_ms,
            rule: h.rule,
            ..CrashOpts::default()
        };
        let mut rep = CutReport {
            seed: h.seed,
            plan: h.plan,
            landing: h.landing.clone(),
            ..CutReport::default()
        };
        let log = self.log();
        rep.log_entries = log.len();
        check_recovery(&q, mount_options(&o)?, &log, h.rule, &mut rep);
        Ok(rep)
    }
}

/// `wbstack crashtest --replay FILE`: 0 when the rebuilt state passes, 1 when it fails.
pub fn replay_cli(path: &Path, json: bool) -> Result<u8, String> {
    let file = ReplayFile::load(path)?;
    let t0 = std::time::Instant::now();
    let mut rep = file.check()?;
    rep.seconds = t0.elapsed().as_secs_f64();
    let h = &file.header;
    if json {
        let out = serde_json::json!({
            "file": path.display().to_string(),
            "seed": h.seed,
            "recorded_failure": h.failure,
            "failed": rep.failed(),
            "failure": rep.reasons(),
            "report": rep,
        });
        println!("{out}");
    } else {
        let pending: Vec<&WriteRec> = h
            .write_log
            .iter()
            .filter(|w| w.kept_sectors.is_some())
            .collect();
        let kept: u64 = pending.iter().filter_map(|w| w.kept_sectors).sum();
        let of: u64 = pending.iter().map(|w| w.sectors).sum();
        println!(
            "replay of seed {} ({}): {} operations logged, {} device requests logged, {} writes after the last flush ({kept} of their {of} sectors kept)",
            h.seed,
            h.device_spec,
            h.ops.len(),
            h.write_log.len(),
            pending.len()
        );
        println!("recorded: FAIL: {}", h.failure);
        if rep.failed() {
            println!("replayed: FAIL: {}", rep.reasons());
        } else {
            println!("replayed: ok (the recorded failure did not recur)");
        }
        for p in &rep.fsck_problems {
            println!("  {p}");
        }
        for d in &rep.verdict.problems {
            println!("  {d}");
        }
    }
    Ok(if rep.failed() { 1 } else { 0 })
}
