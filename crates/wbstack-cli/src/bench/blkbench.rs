//! `wbstack bench blk`: a fio-like load generator on the block layer.
//!
//! Each job is a thread keeping `iodepth` bios in flight on one device; completions
//! come back through the bio's end_io (inline for the null device, from the device's
//! completion thread otherwise). Latency is measured per IO from submission to reap,
//! into an HDR histogram.

use crate::util::{process_cpu, si, thread_cpu};
use crossbeam_queue::ArrayQueue;
use hdrhistogram::Histogram;
use serde::Serialize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::thread::Thread;
use std::time::{Duration, Instant};
use wbstack::block::{
    Bio, BioEndIo, BlkResult, DiskStats, IoStatsMode, Op, Plug, QueueConfig, RequestQueue,
};
use wbstack::buf::IoBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Rw {
    Read,
    Write,
    RandRead,
    RandWrite,
}

impl Rw {
    pub fn parse(s: &str) -> Result<Rw, String> {
        match s {
            "read" => Ok(Rw::Read),
            "write" => Ok(Rw::Write),
            "randread" => Ok(Rw::RandRead),
            "randwrite" => Ok(Rw::RandWrite),
            _ => Err(format!(
                "unknown --rw '{s}' (expected read, write, randread or randwrite)"
            )),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Rw::Read => "read",
            Rw::Write => "write",
            Rw::RandRead => "randread",
            Rw::RandWrite => "randwrite",
        }
    }
    fn is_write(self) -> bool {
        matches!(self, Rw::Write | Rw::RandWrite)
    }
    fn is_random(self) -> bool {
        matches!(self, Rw::RandRead | Rw::RandWrite)
    }
}

#[derive(Clone, Debug)]
pub struct BlkJob {
    pub device: String,
    pub jobs: usize,
    pub rw: Rw,
    pub bs: usize,
    pub iodepth: usize,
    pub runtime: Duration,
    pub iostats: IoStatsMode,
    /// Bytes of the device the jobs range over (default: the whole device, capped so
    /// sequential jobs do not run off the end).
    pub span: Option<u64>,
    pub seed: u64,
    /// Reap completions in the job thread (polled IO) where the device supports it.
    pub poll: bool,
    /// Bios submitted under one plug, so they reach the device as one batch (fio's
    /// iodepth_batch_submit): 1 submits each bio alone, 0 the whole free depth at once.
    pub batch: usize,
}

/// Where each job's IO goes, in blocks of `bs`: job `i` ranges over `job_blocks` blocks
/// from block `i * stride_blocks`. fio's `--fio` job is made from the same numbers
/// (its size and offset_increment), so the two sides do the same IO.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Layout {
    pub bs: u64,
    pub job_blocks: u64,
    pub stride_blocks: u64,
}

impl Layout {
    /// Random jobs each range over the whole span (as fio's jobs do by default);
    /// sequential jobs each get their own 1/jobs of it and wrap around within it, so
    /// they neither merge into one stream nor write the same blocks.
    pub fn new(rw: Rw, bs: usize, span_blocks: u64, jobs: usize) -> Result<Layout, String> {
        let bs = bs as u64;
        if !rw.is_random() {
            let job_blocks = span_blocks / jobs as u64;
            if job_blocks == 0 {
                return Err(format!(
                    "the device's {span_blocks} blocks of {bs} bytes are fewer than --jobs {jobs}: each sequential job needs a region of its own"
                ));
            }
            return Ok(Layout {
                bs,
                job_blocks,
                stride_blocks: job_blocks,
            });
        }
        Ok(Layout {
            bs,
            job_blocks: span_blocks,
            stride_blocks: 0,
        })
    }

    /// (first block, blocks) of job `idx`.
    pub fn region(&self, idx: usize) -> (u64, u64) {
        (self.stride_blocks * idx as u64, self.job_blocks)
    }

    /// fio's `size`: the bytes each job ranges over.
    pub fn job_size_bytes(&self) -> u64 {
        self.job_blocks * self.bs
    }

    /// fio's `offset_increment`: where each job's range starts after the one before.
    pub fn offset_increment_bytes(&self) -> u64 {
        self.stride_blocks * self.bs
    }
}

/// How long a polling job waits in the device before looking at its deadline again.
const POLL_WAIT_NS: u64 = 1_000_000;

#[derive(Clone, Debug, Serialize)]
pub struct BlkReport {
    pub device: String,
    pub rw: Rw,
    pub bs: usize,
    pub jobs: usize,
    pub iodepth: usize,
    /// Bios per plug (0: the whole free depth).
    pub iodepth_batch: usize,
    pub iostats: IoStatsMode,
    /// Where the jobs' IO went: job i over `layout.job_blocks` blocks from
    /// `i * layout.stride_blocks`.
    pub layout: Layout,
    pub ios: u64,
    pub wall_s: f64,
    pub iops: f64,
    pub mib_s: f64,
    /// Per job, as fio reports: the job thread's user and system CPU over the run time.
    pub usr_pct: f64,
    pub sys_pct: f64,
    /// The whole process (device threads included) as a share of all CPUs.
    pub cpu_total_pct: f64,
    pub lat_p50_us: f64,
    pub lat_p99_us: f64,
    pub lat_p999_us: f64,
    pub lat_max_us: f64,
    pub errors: u64,
    pub diskstats: DiskStats,
}

/// Where a job's completed bios come back.
struct JobSink {
    done: ArrayQueue<(Bio, bool)>,
    waiting: AtomicBool,
    thread: Thread,
}

impl BioEndIo for JobSink {
    fn end_io(&self, bio: Bio, status: BlkResult) {
        // Capacity is the iodepth, and a job never has more than that in flight.
        let _ = self.done.push((bio, status.is_ok()));
        if self.waiting.load(Ordering::SeqCst) && self.waiting.swap(false, Ordering::SeqCst) {
            self.thread.unpark();
        }
    }
}

struct JobOut {
    hist: Histogram<u64>,
    ios: u64,
    errors: u64,
    cpu: crate::util::CpuTimes,
    wall: Duration,
}

fn xorshift(s: &mut u64) -> u64 {
    let mut x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *s = x;
    x
}

fn run_job(
    q: Arc<RequestQueue>,
    job: BlkJob,
    idx: usize,
    layout: Layout,
    start: Arc<Barrier>,
) -> JobOut {
    let sink = Arc::new(JobSink {
        done: ArrayQueue::new(job.iodepth),
        waiting: AtomicBool::new(false),
        thread: std::thread::current(),
    });
    let end_io: Arc<dyn BioEndIo> = sink.clone();
    let mut free: Vec<Bio> = (0..job.iodepth)
        .map(|i| {
            let mut buf = IoBuf::zeroed(job.bs);
            if job.rw.is_write() {
                buf.as_mut_slice()
                    .iter_mut()
                    .enumerate()
                    .for_each(|(j, b)| *b = (i + j + idx) as u8);
            }
            let mut b = Bio::write(0, buf);
            b.op = if job.rw.is_write() {
                Op::Write
            } else {
                Op::Read
            };
            b.end_io = Some(end_io.clone());
            b
        })
        .collect();
    let mut hist =
        Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3).expect("histogram bounds");
    let mut rng = job
        .seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(idx as u64 * 7919 + 1)
        | 1;
    let (first_block, blocks) = layout.region(idx);
    let mut next_seq = 0u64;
    let sectors_per_block = (job.bs / 512) as u64;
    let base = Instant::now();
    let mut inflight = 0usize;
    let (mut ios, mut errors) = (0u64, 0u64);
    start.wait();
    let cpu0 = thread_cpu();
    let t0 = Instant::now();
    let deadline = t0 + job.runtime;
    let mut stop = false;
    let mut checks = 0u32;
    let can_poll = job.poll && q.can_poll();
    loop {
        // Fill the queue depth, `batch` bios to a plug so each group reaches the device
        // as one batch.
        if !stop && inflight < job.iodepth {
            let mut plug = None;
            let mut plugged = 0;
            while inflight < job.iodepth {
                if job.batch != 1 && plug.is_none() {
                    plug = Some(Plug::start());
                }
                let Some(mut bio) = free.pop() else { break };
                let blk = first_block
                    + if job.rw.is_random() {
                        xorshift(&mut rng) % blocks
                    } else {
                        let b = next_seq % blocks;
                        next_seq += 1;
                        b
                    };
                bio.sector = blk * sectors_per_block;
                bio.private = base.elapsed().as_nanos() as u64;
                if let Err(e) = q.submit_bio(bio) {
                    eprintln!("bench blk: submit failed: {e}");
                    stop = true;
                    break;
                }
                inflight += 1;
                plugged += 1;
                if plugged == job.batch {
                    plug = None;
                    plugged = 0;
                }
            }
            drop(plug);
        }
        if inflight == 0 {
            break;
        }
        // Reap.
        let mut got = 0;
        while let Some((bio, ok)) = sink.done.pop() {
            let lat = (base.elapsed().as_nanos() as u64)
                .saturating_sub(bio.private)
                .max(1);
            let _ = hist.record(lat);
            if ok {
                ios += 1;
            } else {
                errors += 1;
            }
            free.push(bio);
            inflight -= 1;
            got += 1;
        }
        // Reap our own completions where the device can (io_uring: they arrive as
        // task work of this thread anyway), as fio does; park otherwise.
        if got == 0 && can_poll {
            if q.poll(POLL_WAIT_NS) > 0 || !sink.done.is_empty() {
                continue;
            }
            if Instant::now() >= deadline {
                stop = true;
            }
            continue;
        }
        if got == 0 {
            sink.waiting.store(true, Ordering::SeqCst);
            if sink.done.is_empty() {
                std::thread::park_timeout(Duration::from_millis(100));
            }
            sink.waiting.store(false, Ordering::SeqCst);
        }
        checks += got;
        if checks >= 128 || got == 0 {
            checks = 0;
            if !stop && Instant::now() >= deadline {
                stop = true;
            }
        }
    }
    let wall = t0.elapsed();
    JobOut {
        hist,
        ios,
        errors,
        cpu: thread_cpu() - cpu0,
        wall,
    }
}

/// The device opened for `job`, and where its jobs' IO goes.
fn open(job: &BlkJob) -> Result<(Arc<RequestQueue>, Layout), String> {
    if job.jobs == 0 || job.iodepth == 0 {
        return Err("--jobs and --iodepth must be at least 1".into());
    }
    if job.bs == 0 || !job.bs.is_multiple_of(512) {
        return Err(format!("--bs {} is not a multiple of 512 bytes", job.bs));
    }
    let q = RequestQueue::open(
        &job.device,
        QueueConfig {
            iostats: job.iostats,
            ..Default::default()
        },
    )?;
    let lbs = q.geometry().logical_block_size as usize;
    if !job.bs.is_multiple_of(lbs) {
        return Err(format!(
            "--bs {} is not a multiple of the device's logical block size {lbs}",
            job.bs
        ));
    }
    let dev_bytes = q.geometry().size_bytes;
    let span = job.span.unwrap_or(dev_bytes).min(dev_bytes);
    let span_blocks = span / job.bs as u64;
    if span_blocks == 0 {
        return Err(format!(
            "the device ({dev_bytes} bytes) is smaller than one block of {} bytes",
            job.bs
        ));
    }
    let layout = Layout::new(job.rw, job.bs, span_blocks, job.jobs)?;
    Ok((q, layout))
}

/// Where `job`'s IO would go on its device (opened, then closed again), for a tool that
/// runs the same job elsewhere first (`--fio --fio-first`).
pub fn layout(job: &BlkJob) -> Result<Layout, String> {
    Ok(open(job)?.1)
}

pub fn run(job: &BlkJob) -> Result<BlkReport, String> {
    let (q, layout) = open(job)?;
    let before = q.diskstats();
    let start = Arc::new(Barrier::new(job.jobs + 1));
    let pcpu0 = process_cpu();
    let threads: Vec<_> = (0..job.jobs)
        .map(|i| {
            let (q, job, start) = (q.clone(), job.clone(), start.clone());
            std::thread::Builder::new()
                .name(format!("blk-job{i}"))
                .spawn(move || run_job(q, job, i, layout, start))
                .map_err(|e| format!("cannot start job thread: {e}"))
        })
        .collect::<Result<_, _>>()?;
    start.wait();
    let t0 = Instant::now();
    let outs: Vec<JobOut> = threads
        .into_iter()
        .map(|t| t.join().expect("job thread"))
        .collect();
    let wall = t0.elapsed().as_secs_f64();
    let pcpu = process_cpu() - pcpu0;
    let delta = q.diskstats().delta(&before);
    let mut hist =
        Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3).expect("histogram bounds");
    let (mut ios, mut errors, mut usr, mut sys) = (0, 0, 0.0, 0.0);
    for o in &outs {
        hist.add(&o.hist).expect("same bounds");
        ios += o.ios;
        errors += o.errors;
        let w = o.wall.as_secs_f64().max(1e-9);
        usr += o.cpu.user.as_secs_f64() / w * 100.0;
        sys += o.cpu.sys.as_secs_f64() / w * 100.0;
    }
    let n = outs.len() as f64;
    let us = |v: u64| v as f64 / 1000.0;
    let ncpu = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1) as f64;
    Ok(BlkReport {
        device: job.device.clone(),
        rw: job.rw,
        bs: job.bs,
        jobs: job.jobs,
        iodepth: job.iodepth,
        iodepth_batch: job.batch,
        iostats: job.iostats,
        layout,
        ios,
        wall_s: wall,
        iops: ios as f64 / wall,
        mib_s: ios as f64 * job.bs as f64 / wall / (1 << 20) as f64,
        usr_pct: usr / n,
        sys_pct: sys / n,
        cpu_total_pct: (pcpu.user + pcpu.sys).as_secs_f64() / (wall * ncpu) * 100.0,
        lat_p50_us: us(hist.value_at_quantile(0.50)),
        lat_p99_us: us(hist.value_at_quantile(0.99)),
        lat_p999_us: us(hist.value_at_quantile(0.999)),
        lat_max_us: us(hist.max()),
        errors,
        diskstats: delta,
    })
}

pub fn print_human(r: &BlkReport) {
    println!(
        "blk: {} rw={} bs={} jobs={} iodepth={} batch={} iostats={} ({:.1} s)",
        r.device,
        r.rw.name(),
        r.bs,
        r.jobs,
        r.iodepth,
        r.iodepth_batch,
        r.iostats,
        r.wall_s
    );
    println!(
        "  each job over {} bytes, job i from i x {} bytes",
        r.layout.job_size_bytes(),
        r.layout.offset_increment_bytes()
    );
    println!(
        "  IOPS={}, BW={:.1}MiB/s, usr={:.1}%, sys={:.1}% (per job; process {:.1}% of all CPUs)",
        si(r.iops),
        r.mib_s,
        r.usr_pct,
        r.sys_pct,
        r.cpu_total_pct
    );
    println!(
        "  clat (usec): p50={:.2}, p99={:.2}, p99.9={:.2}, max={:.2}",
        r.lat_p50_us, r.lat_p99_us, r.lat_p999_us, r.lat_max_us
    );
    if r.errors > 0 {
        println!("  errors: {}", r.errors);
    }
    println!("  diskstats delta (iostats={}):", r.iostats);
    for l in r.diskstats.pretty().lines() {
        println!("    {l}");
    }
}
