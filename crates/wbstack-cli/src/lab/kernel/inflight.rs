//! Seed 002 (inflight) beside the kernel: fio's 4 KiB O_DIRECT random reads at
//! iodepth 1 with 2 and 32 jobs, the loop device's in-flight accounting
//! (queue/iostats) off and on; wbstack's block layer with iostats off and tags.

use super::loopdev::s;
use super::programs::{self, command_line};
use super::{remove, step, Ctx, DirKind, DirTarget, Exp, TargetArm};
use crate::bench::blkbench::{self, BlkJob, Rw};
use crate::lab::LabOpts;
use std::time::Duration;
use wbstack::block::IoStatsMode;

const JOBS: [usize; 2] = [2, 32];
/// The file the reads range over: larger than the loop device's read-ahead, small
/// enough to lay out in a second or two.
const FILE_MIB: u64 = 256;

fn runtime(o: &LabOpts) -> Duration {
    o.runtime.unwrap_or(Duration::from_secs(if o.quick {
        1
    } else if o.full {
        10
    } else {
        3
    }))
}

fn fio_args(file: &str, jobs: usize, runtime: Duration) -> Vec<String> {
    vec![
        "--name=randread".into(),
        format!("--filename={file}"),
        format!("--size={FILE_MIB}M"),
        "--rw=randread".into(),
        "--bs=4k".into(),
        "--direct=1".into(),
        "--iodepth=1".into(),
        "--ioengine=psync".into(),
        format!("--numjobs={jobs}"),
        "--thread".into(),
        "--time_based".into(),
        format!("--runtime={}ms", runtime.as_millis()),
        "--group_reporting".into(),
        "--output-format=json".into(),
    ]
}

pub struct Inflight;

impl Exp for Inflight {
    fn dir_arms(
        &self,
        c: &Ctx,
        t: &DirTarget,
        out: &mut Vec<TargetArm>,
        skipped: &mut Vec<String>,
    ) -> Result<(), String> {
        programs::ensure("fio", "fio")?;
        let file = t.dir.join("fio-randread.dat");
        let rt = runtime(c.o);
        // (label, value of queue/iostats) — only the kernel has the switch.
        let switches: Vec<Option<&str>> = match t.kind {
            DirKind::Kernel(l) if l.queue("iostats").is_some() => vec![Some("0"), Some("1")],
            DirKind::Kernel(l) => {
                skipped.push(format!(
                    "{}: {} has no queue/iostats: in-flight accounting cannot be switched off",
                    t.target, l.dev
                ));
                vec![None]
            }
            DirKind::Mount(_) => vec![None],
        };
        let original = match t.kind {
            DirKind::Kernel(l) => l.queue("iostats"),
            DirKind::Mount(_) => None,
        };
        let result = (|| -> Result<(), String> {
            for jobs in JOBS {
                for sw in &switches {
                    let variant = match sw {
                        Some(v) => format!("j{jobs} iostats={v}"),
                        None => format!("j{jobs}"),
                    };
                    let mut a = t.arm(&variant, "fio (psync, O_DIRECT)");
                    if let (Some(v), DirKind::Kernel(l)) = (sw, &t.kind) {
                        l.set_queue("iostats", v)?;
                        a.commands
                            .push(format!("echo {v} > {}", l.queue_path("iostats").display()));
                        a.setup = format!("{}; switch: queue/iostats={v}", a.setup);
                    }
                    let args = fio_args(&s(&file), jobs, rt);
                    a.commands.push(command_line("fio", &args));
                    let label = format!("lab --kernel: {}", a.name);
                    let fio = step(c.o.sink, &label, || programs::run("fio", &args, &c.work))?;
                    let r = programs::parse_fio_json(&String::from_utf8_lossy(&fio.stdout))?;
                    a.fig("iops", r.read_iops);
                    a.fig("usr_pct", r.usr_cpu_pct);
                    a.fig("sys_pct", r.sys_cpu_pct);
                    a.fig("lat_p50_us", r.read_clat_p50_us);
                    a.fig("lat_p99_us", r.read_clat_p99_us);
                    a.fig("jobs", jobs as f64);
                    out.push(a);
                }
            }
            Ok(())
        })();
        // The loop device goes away with the lab's filesystem, but put it back anyway:
        // a failed teardown must not leave accounting off.
        if let (Some(v), DirKind::Kernel(l)) = (original, &t.kind) {
            l.set_queue("iostats", &v)?;
        }
        remove(&file)?;
        result
    }

    fn disk_bytes(&self, _c: &Ctx) -> u64 {
        (FILE_MIB << 20) + (1 << 30)
    }

    fn file_arms(
        &self,
        c: &Ctx,
        out: &mut Vec<TargetArm>,
        _skipped: &mut Vec<String>,
    ) -> Result<(), String> {
        let img = c.work.join("wbs-blk.img");
        // Written, not sparse: reads of holes would never reach the disk.
        {
            use std::io::Write;
            let mut f = std::io::BufWriter::new(
                std::fs::File::create(&img).map_err(|e| format!("{}: {e}", img.display()))?,
            );
            let chunk = vec![0x5au8; 1 << 20];
            for _ in 0..FILE_MIB {
                f.write_all(&chunk)
                    .map_err(|e| format!("{}: {e}", img.display()))?;
            }
            f.flush().map_err(|e| format!("{}: {e}", img.display()))?;
        }
        let spec = format!("file:{}", img.display());
        let rt = runtime(c.o);
        let result = (|| -> Result<(), String> {
            for jobs in JOBS {
                for (mode, v) in [(IoStatsMode::Off, "0"), (IoStatsMode::Tags, "1")] {
                    let mut a = TargetArm::new(
                        format!("wbstack-file j{jobs} iostats={v}"),
                        "wbstack-file",
                        "blkbench (wbstack, in-process)",
                        format!(
                            "wbstack's block layer on {spec} ({FILE_MIB} MiB, written), iostats={}",
                            mode.name()
                        ),
                    );
                    a.commands.push(command_line(
                        "wbstack",
                        &[
                            "bench".into(),
                            "blk".into(),
                            "--device".into(),
                            spec.clone(),
                            "--rw".into(),
                            "randread".into(),
                            "--bs".into(),
                            "4096".into(),
                            "--iodepth".into(),
                            "1".into(),
                            "--jobs".into(),
                            jobs.to_string(),
                            "--iostats".into(),
                            mode.name().into(),
                            "--runtime".into(),
                            format!("{}ms", rt.as_millis()),
                        ],
                    ));
                    let job = BlkJob {
                        device: spec.clone(),
                        jobs,
                        rw: Rw::RandRead,
                        bs: 4096,
                        iodepth: 1,
                        runtime: rt,
                        iostats: mode,
                        span: None,
                        seed: 1,
                        poll: true,
                        batch: 1,
                    };
                    let label = format!("lab --kernel: {}", a.name);
                    let r = step(c.o.sink, &label, || blkbench::run(&job))?;
                    a.fig("iops", r.iops);
                    a.fig("usr_pct", r.usr_pct);
                    a.fig("sys_pct", r.sys_pct);
                    a.fig("lat_p50_us", r.lat_p50_us);
                    a.fig("lat_p99_us", r.lat_p99_us);
                    a.fig("jobs", jobs as f64);
                    out.push(a);
                }
            }
            Ok(())
        })();
        remove(&img)?;
        result
    }
}
