//! Benchmarks of the page cache and writeback engine over the test filesystem (each
//! inode a fixed region of the device).

use serde::Serialize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use wbstack::block::QueueConfig;
use wbstack::mm::CacheConfig;
use wbstack::testfs::TestVolume;
use wbstack::writeback::WbConfig;

#[derive(Serialize, Clone, Debug)]
pub struct SmallFilesArm {
    pub name: String,
    pub writeback_plug: bool,
    pub files: u64,
    pub write_ios: u64,
    pub write_merges: u64,
    pub avg_write_kib: f64,
    pub writeback_s: f64,
    pub write_iops: f64,
    pub write_mib_s: f64,
}

/// N adjacent small files written into the cache, then written back by one sync, with
/// writeback_plug on and off, each on a fresh device.
pub fn smallfiles(device: &str, files: u64, file_size: u64) -> Result<Vec<SmallFilesArm>, String> {
    if file_size == 0 || !file_size.is_multiple_of(4096) {
        return Err(format!(
            "--file-size {file_size} must be a positive multiple of 4096"
        ));
    }
    let region = file_size / 4096;
    let data = vec![0x5au8; file_size as usize];
    let mut arms = Vec::new();
    for plug in [true, false] {
        // Thresholds out of reach: every file is written by the one measured pass.
        let wb = WbConfig {
            writeback_plug: plug,
            dirty_writeback_centisecs: 0,
            dirty: wbstack::mm::throttle::DirtyConfig {
                dirty_bytes: 1 << 50,
                dirty_background_bytes: 1 << 49,
                ..Default::default()
            },
            ..Default::default()
        };
        let cache = CacheConfig {
            cache_size: (files * file_size * 8).max(64 << 20),
            ..Default::default()
        };
        let v = TestVolume::open(device, QueueConfig::default(), cache, wb, region)?;
        let need = files * file_size;
        if need > v.q.geometry().size_bytes {
            return Err(format!(
                "{files} files of {file_size} bytes do not fit on {device}"
            ));
        }
        for ino in 0..files {
            v.file(ino).write_at(0, &data).map_err(|e| e.to_string())?;
        }
        let before = v.q.diskstats();
        let t0 = Instant::now();
        v.bdi.sync().map_err(|e| e.to_string())?;
        let secs = t0.elapsed().as_secs_f64();
        let d = v.q.diskstats().delta(&before);
        let ios = d.writes();
        arms.push(SmallFilesArm {
            name: if plug { "on" } else { "off" }.into(),
            writeback_plug: plug,
            files,
            write_ios: ios,
            write_merges: d.merges[1],
            avg_write_kib: d.sectors[1] as f64 / 2.0 / ios.max(1) as f64,
            writeback_s: secs,
            write_iops: ios as f64 / secs,
            write_mib_s: d.sectors[1] as f64 * 512.0 / secs / (1 << 20) as f64,
        });
    }
    Ok(arms)
}

pub fn print_smallfiles(arms: &[SmallFilesArm]) {
    println!(
        "{:<5} {:>7} {:>10} {:>10} {:>12} {:>10} {:>10} {:>9}",
        "plug", "files", "write IOs", "merges", "avg KiB", "IOPS", "MiB/s", "time s"
    );
    for a in arms {
        println!(
            "{:<5} {:>7} {:>10} {:>10} {:>12.1} {:>10.0} {:>10.1} {:>9.3}",
            a.name,
            a.files,
            a.write_ios,
            a.write_merges,
            a.avg_write_kib,
            a.write_iops,
            a.write_mib_s,
            a.writeback_s
        );
    }
    if let (Some(on), Some(off)) = (
        arms.iter().find(|a| a.writeback_plug),
        arms.iter().find(|a| !a.writeback_plug),
    ) {
        println!(
            "plug on: {:.1}% of the write IOs of off, {:.2}x the bandwidth, writeback {:.2}x faster",
            on.write_ios as f64 / off.write_ios.max(1) as f64 * 100.0,
            on.write_mib_s / off.write_mib_s.max(1e-9),
            off.writeback_s / on.writeback_s.max(1e-9)
        );
    }
}

#[derive(Serialize, Clone, Debug)]
pub struct DirtyReport {
    pub device: String,
    pub size: u64,
    pub bs: u64,
    pub cache_bytes: u64,
    pub cache_write_mib_s: f64,
    pub overall_write_mib_s: f64,
    pub dirty_peak_pages: u64,
    pub dirty_limit_pages: u64,
    pub bg_thresh_pages: u64,
    pub setpoint_pages: u64,
    pub pauses: u64,
    pub pause_max_ms: f64,
    pub pause_mean_ms: f64,
    /// (upper edge in ms or "inf", count) of pause lengths.
    pub pause_hist: Vec<(String, u64)>,
    pub device_write_mib_s: f64,
    pub device_busy_pct: f64,
    pub write_bandwidth_est_mib_s: f64,
    /// Buffered rewrites of clean pages already in the cache, below the background
    /// threshold: the page cache's own write path, without fresh memory.
    pub cached_rewrite_mib_s: f64,
    /// Buffered reads of pages already in the cache, in `bs` reads, after the writer.
    pub cached_read_mib_s: f64,
    /// Bytes the timed cached read pass read from the device (0: every page was cached).
    pub cached_read_device_bytes: u64,
    /// (ms since start, dirty pages, writeback pages), every 100 ms.
    pub samples: Vec<(u64, u64, u64)>,
}

/// One writer faster than the device, writing one file on wbstack's filesystem: cache
/// throughput below the background threshold, then dirty pages against the thresholds
/// while IO-less throttling paces it.
pub fn dirty(device: &str, size: u64, bs: u64, cache_bytes: u64) -> Result<DirtyReport, String> {
    use wbstack::writeback::wb::PAUSE_BUCKETS_MS;
    if bs == 0 || bs > 1 << 30 {
        return Err("--bs must be from 1 byte to 1 GiB".into());
    }
    let fs = crate::bench::volfs::VolumeFs::format(
        device,
        wbstack::fs::MountOptions {
            cache: CacheConfig {
                cache_size: cache_bytes,
                ..Default::default()
            },
            ..Default::default()
        },
    )?;
    let v = fs.volume();
    if size > v.statfs().available * 4096 {
        return Err(format!(
            "--size {size} is larger than the filesystem's free space ({} bytes)",
            v.statfs().available * 4096
        ));
    }
    let bdi = v.bdi().clone();
    let cache = v.cache().clone();
    let q = v.queue().clone();
    let (thresh, bg) = bdi.thresholds();
    let freerun = (thresh + bg) / 2;
    let setpoint = (freerun + thresh) / 2;
    let stop = Arc::new(AtomicBool::new(false));
    let (c2, s2) = (cache.clone(), stop.clone());
    let t0 = Instant::now();
    let sampler = std::thread::spawn(move || {
        let mut samples = Vec::new();
        let mut peak = 0u64;
        let mut next = 0u64;
        while !s2.load(Ordering::Relaxed) {
            let d = c2.nr_dirty();
            peak = peak.max(d);
            let ms = t0.elapsed().as_millis() as u64;
            if ms >= next {
                samples.push((ms, d, c2.nr_writeback()));
                next = ms + 100;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        (samples, peak)
    });
    let f = v.create("/dirty").map_err(|e| e.to_string())?;
    let buf = vec![0xa5u8; bs as usize];
    let mut off = 0u64;
    // Phase 1: below the background threshold, the cache alone sets the pace.
    let below = bg * 4096 * 9 / 10;
    let t1 = Instant::now();
    while off + bs <= below.min(size) {
        f.write_all_at(off, &buf).map_err(|e| e.to_string())?;
        off += bs;
    }
    let cache_secs = t1.elapsed().as_secs_f64();
    let cache_bytes_written = off;
    let t2 = Instant::now();
    let dev_before = q.diskstats();
    let mut last_progress = Instant::now();
    while off < size {
        let n = bs.min(size - off) as usize;
        f.write_all_at(off, &buf[..n]).map_err(|e| e.to_string())?;
        off += n as u64;
        if last_progress.elapsed().as_secs() >= 1 {
            crate::util::status(&format!("  dirty: {} of {} MiB", off >> 20, size >> 20));
            last_progress = Instant::now();
        }
    }
    crate::util::status_done();
    let throttled_secs = t2.elapsed().as_secs_f64();
    let dev = q.diskstats().delta(&dev_before);
    stop.store(true, Ordering::Relaxed);
    let (samples, peak) = sampler.join().map_err(|_| "sampler thread failed")?;
    let total_secs = t0.elapsed().as_secs_f64();
    let s = bdi.stats();
    v.sync().map_err(|e| e.to_string())?;
    let read = cached_read(&f, &q, size.min(cache_bytes / 2), bs)?;
    let rewrite = cached_rewrite(&f, size.min(cache_bytes / 2).min(below), &buf)?;
    f.close().map_err(|e| e.to_string())?;
    let mib = (1u64 << 20) as f64;
    let mut pause_hist: Vec<(String, u64)> = PAUSE_BUCKETS_MS
        .iter()
        .map(|e| format!("<{e}ms"))
        .zip(s.pause_hist.iter().copied())
        .collect();
    pause_hist.push((
        format!(">={}ms", PAUSE_BUCKETS_MS[PAUSE_BUCKETS_MS.len() - 1]),
        s.pause_hist[PAUSE_BUCKETS_MS.len()],
    ));
    Ok(DirtyReport {
        device: device.into(),
        size,
        bs,
        cache_bytes,
        cache_write_mib_s: cache_bytes_written as f64 / cache_secs.max(1e-9) / mib,
        overall_write_mib_s: size as f64 / total_secs / mib,
        dirty_peak_pages: peak,
        dirty_limit_pages: thresh,
        bg_thresh_pages: bg,
        setpoint_pages: setpoint,
        pauses: s.pauses,
        pause_max_ms: s.pause_ns_max as f64 / 1e6,
        pause_mean_ms: s.pause_ns_total as f64 / s.pauses.max(1) as f64 / 1e6,
        pause_hist,
        device_write_mib_s: dev.sectors[1] as f64 * 512.0 / throttled_secs.max(1e-9) / mib,
        device_busy_pct: dev.io_ticks_ms as f64 / (throttled_secs * 1000.0).max(1e-9) * 100.0,
        write_bandwidth_est_mib_s: s.avg_write_bandwidth as f64 * 4096.0 / mib,
        cached_rewrite_mib_s: rewrite,
        cached_read_mib_s: read.bytes as f64 / read.secs.max(1e-9) / mib,
        cached_read_device_bytes: read.device_bytes,
        samples,
    })
}

/// Run `io(off, n)` over [0, len) in chunks of at most `bs` bytes; `io` returns the
/// bytes it moved, and 0 (end of file) ends the walk. Returns the bytes moved.
fn in_chunks(
    len: u64,
    bs: u64,
    mut io: impl FnMut(u64, usize) -> wbstack::fs::FsResult<usize>,
) -> Result<u64, String> {
    let mut off = 0u64;
    while off < len {
        match io(off, bs.min(len - off) as usize).map_err(|e| e.to_string())? {
            0 => break,
            got => off += got as u64,
        }
    }
    Ok(off)
}

/// Rewrite the first `len` bytes of `f` (clean and cached after the read pass) in
/// writes of `buf`; MiB/s.
fn cached_rewrite(f: &wbstack::fs::File, len: u64, buf: &[u8]) -> Result<f64, String> {
    let t = Instant::now();
    let bytes = in_chunks(len, buf.len() as u64, |off, n| f.write_at(off, &buf[..n]))?;
    Ok(bytes as f64 / t.elapsed().as_secs_f64().max(1e-9) / (1u64 << 20) as f64)
}

struct CachedRead {
    bytes: u64,
    secs: f64,
    device_bytes: u64,
}

/// Read the first `len` bytes of `f` in `bs` reads: once to bring every page into the
/// cache, then timed, counting what the timed pass still took from the device.
fn cached_read(
    f: &wbstack::fs::File,
    q: &wbstack::block::queue::RequestQueue,
    len: u64,
    bs: u64,
) -> Result<CachedRead, String> {
    let mut buf = vec![0u8; bs as usize];
    let pass = |buf: &mut [u8]| in_chunks(len, bs, |off, n| f.read_at(off, &mut buf[..n]));
    pass(&mut buf)?;
    let before = q.diskstats();
    let t = Instant::now();
    let bytes = pass(&mut buf)?;
    let secs = t.elapsed().as_secs_f64();
    let dev = q.diskstats().delta(&before);
    Ok(CachedRead {
        bytes,
        secs,
        device_bytes: dev.sectors[0] * 512,
    })
}

pub fn print_dirty(r: &DirtyReport) {
    println!(
        "dirty: one writer on wbstack's filesystem on {}: {} MiB in {} KiB writes, page cache {} MiB",
        r.device,
        r.size >> 20,
        r.bs >> 10,
        r.cache_bytes >> 20
    );
    println!(
        "  buffered write below the background threshold (into fresh memory): {:.0} MiB/s",
        r.cache_write_mib_s
    );
    println!(
        "  buffered rewrite of cached pages, below the background threshold: {:.0} MiB/s",
        r.cached_rewrite_mib_s
    );
    println!(
        "  buffered read of cached pages: {:.0} MiB/s ({} bytes from the device)",
        r.cached_read_mib_s, r.cached_read_device_bytes
    );
    println!(
        "  thresholds (pages): background {}  setpoint {}  limit {}   dirty peak {} ({:.1}% of limit)",
        r.bg_thresh_pages,
        r.setpoint_pages,
        r.dirty_limit_pages,
        r.dirty_peak_pages,
        r.dirty_peak_pages as f64 / r.dirty_limit_pages.max(1) as f64 * 100.0
    );
    println!(
        "  pauses: {}  mean {:.1} ms  max {:.1} ms",
        r.pauses, r.pause_mean_ms, r.pause_max_ms
    );
    let hist: Vec<String> = r
        .pause_hist
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(e, n)| format!("{e}: {n}"))
        .collect();
    println!("  pause lengths: {}", hist.join("  "));
    println!(
        "  device: {:.1} MiB/s while throttled, busy {:.1}%  (estimated write bandwidth {:.1} MiB/s)",
        r.device_write_mib_s, r.device_busy_pct, r.write_bandwidth_est_mib_s
    );
    println!("  dirty pages over time (ms: dirty / writeback; | marks bg, setpoint, limit):");
    let step = (r.samples.len() / 20).max(1);
    let scale = |p: u64| (p * 50 / r.dirty_limit_pages.max(1)) as usize;
    for (t, d, w) in r.samples.iter().step_by(step) {
        let mut bar: Vec<char> = std::iter::repeat_n('#', scale(*d).min(60))
            .chain(std::iter::repeat(' '))
            .take(52)
            .collect();
        for m in [r.bg_thresh_pages, r.setpoint_pages, r.dirty_limit_pages] {
            let i = scale(m).min(51);
            if bar[i] == ' ' {
                bar[i] = '|';
            }
        }
        println!(
            "  {t:>7} {d:>8} {w:>8} {}",
            bar.into_iter().collect::<String>()
        );
    }
}
