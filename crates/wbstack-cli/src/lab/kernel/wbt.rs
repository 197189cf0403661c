//! Seed 003 (wbt) beside the kernel: our readlat (4 KiB sequential reads of a cold
//! file, 10 ms target, piped to a writer, a dd writing meanwhile) on the kernel
//! filesystem as a directory, with the loop device's writeback throttling
//! (queue/wbt_lat_usec) at its default and at 0; wbstack with wbt on and off.

use super::loopdev::{drop_caches, s};
use super::programs::command_line;
use super::{remove, step, Ctx, DirKind, DirTarget, Exp, TargetArm};
use crate::bench::benchfs::{BenchFs, DirFs};
use crate::bench::readlat::{self, ReadlatOpts, ReadlatReport};
use crate::lab::LabOpts;
use std::sync::Arc;
use std::time::Duration;

/// Why readlat and not fio's t/read-to-pipe-async (the seed's program).
const WHY_READLAT: &str = "fio's t/read-to-pipe-async has a lost-wakeup race (its reader signals without holding the lock or setting a predicate, ~10 ms lost per 4 KiB block when reads are fast), which is why readlat (wbstack's port, waiting on a predicate under the lock) is used";

/// (bytes read, bytes the dd writes, the dd's delay after the reads start). The dd is
/// larger than the kernel's background threshold on the 24 GiB development machine
/// (nr_dirty_background_threshold: ~1.7 GiB), so the kernel's writeback runs during the
/// reads; below it the kernel would write nothing back until the data expired (30 s).
fn sizes(o: &LabOpts) -> (u64, u64, Duration) {
    if o.full {
        (4 << 30, 4000 << 20, Duration::from_millis(300))
    } else if o.quick {
        (64 << 20, 3 << 30, Duration::from_millis(100))
    } else {
        (1 << 30, 4000 << 20, Duration::from_millis(300))
    }
}

fn opts(o: &LabOpts) -> ReadlatOpts {
    let (size, dd, delay) = sizes(o);
    ReadlatOpts {
        size,
        background_dd: dd,
        dd_delay: delay,
        print_max: 0,
        ..Default::default()
    }
}

fn command(target: &[&str], o: &ReadlatOpts) -> String {
    let mut v = vec!["bench".to_string(), "readlat".into()];
    v.extend(target.iter().map(|s| s.to_string()));
    v.extend([
        "--size".into(),
        format!("{}M", o.size >> 20),
        "--background-dd".into(),
        format!("{}M", o.background_dd >> 20),
        "--dd-delay".into(),
        format!("{}ms", o.dd_delay.as_millis()),
    ]);
    command_line("wbstack", &v)
}

fn figures(a: &mut TargetArm, r: &ReadlatReport) {
    let f = &r.figures;
    a.fig("read_p50_us", f.read_p50_us as f64);
    a.fig("read_p99_us", f.read_p99_us as f64);
    a.fig("read_p9999_us", f.read_p9999_us as f64);
    a.fig("read_max_us", f.read_max_us as f64);
    a.fig("read_over", f.read_over as f64);
    a.fig("write_p9999_us", f.write_p9999_us as f64);
    a.fig("read_kib_s", f.read_kib_s as f64);
    if let Some(d) = &r.dd {
        a.fig("writeback_mib_s", d.durable_mib_s);
    }
}

pub struct Wbt;

impl Exp for Wbt {
    fn dir_arms(
        &self,
        c: &Ctx,
        t: &DirTarget,
        out: &mut Vec<TargetArm>,
        skipped: &mut Vec<String>,
    ) -> Result<(), String> {
        let o = opts(c.o);
        // The switch: (arm's wbt label, how to set it, the command that sets it).
        let default = match t.kind {
            DirKind::Kernel(l) => l.queue("wbt_lat_usec"),
            DirKind::Mount(m) => crate::mount::ctl::ctl(&m.mnt, Some("wbt_lat_usec"))
                .ok()
                .map(|v| v.trim().to_string()),
        };
        let values: Vec<String> = match &default {
            Some(d) if d == "0" => {
                skipped.push(format!(
                    "{}: wbt_lat_usec is 0 (wbt off) by default: only the off arm ran",
                    t.target
                ));
                vec![d.clone()]
            }
            Some(d) => vec![d.clone(), "0".into()],
            None => {
                skipped.push(format!(
                    "{}: no wbt_lat_usec to switch (the loop device's queue has no such file): only the default ran",
                    t.target
                ));
                Vec::new()
            }
        };
        let runs: Vec<Option<String>> = if values.is_empty() {
            vec![None]
        } else {
            values.into_iter().map(Some).collect()
        };
        let result = (|| -> Result<(), String> {
            for v in &runs {
                // "on" is the device's default target, named in the setup, so the arms
                // pair with wbstack's by name.
                let variant = match v {
                    Some(v) if v == "0" => "wbt off",
                    _ => "wbt on",
                };
                let mut a = t.arm(variant, "readlat (wbstack) on the directory");
                a.setup = format!("{}; {WHY_READLAT}", a.setup);
                if let Some(v) = v {
                    match t.kind {
                        DirKind::Kernel(l) => {
                            l.set_queue("wbt_lat_usec", v)?;
                            a.commands.push(format!(
                                "echo {v} > {}",
                                l.queue_path("wbt_lat_usec").display()
                            ));
                        }
                        DirKind::Mount(m) => a.commands.push(m.ctl("wbt_lat_usec", v)?),
                    }
                    a.setup = format!("{}; switch: wbt_lat_usec={v}", a.setup);
                }
                drop_caches()?;
                a.commands
                    .push("sync; echo 3 > /proc/sys/vm/drop_caches".into());
                a.commands.push(command(&["--dir-path", &s(&t.dir)], &o));
                let fs: Arc<dyn BenchFs> = Arc::new(DirFs::new(&t.dir)?);
                let label = format!("lab --kernel: {}", a.name);
                let r = step(c.o.sink, &label, || readlat::run(&o, fs))?;
                figures(&mut a, &r);
                out.push(a);
            }
            Ok(())
        })();
        if let Some(d) = &default {
            match t.kind {
                DirKind::Kernel(l) => l.set_queue("wbt_lat_usec", d)?,
                DirKind::Mount(m) => {
                    m.ctl("wbt_lat_usec", d)?;
                }
            }
        }
        result
    }

    fn disk_bytes(&self, c: &Ctx) -> u64 {
        let (read, dd, _) = sizes(c.o);
        // The input, its copy through the pipe, the dd's file.
        2 * read + dd + (1 << 30)
    }

    fn file_arms(
        &self,
        c: &Ctx,
        out: &mut Vec<TargetArm>,
        _skipped: &mut Vec<String>,
    ) -> Result<(), String> {
        let o = opts(c.o);
        for (variant, mount) in [("wbt on", ""), ("wbt off", "wbt_lat_usec=0")] {
            let (img, spec) = c.file_spec("wbs-file.img", super::loopdev::IMAGE_SIZE);
            remove(&img)?;
            let mut a = TargetArm::new(
                format!("wbstack-file {variant}"),
                "wbstack-file",
                "readlat (wbstack, in-process)",
                format!(
                    "wbstack in this process on {spec}, mount options '{mount}'; {WHY_READLAT}"
                ),
            );
            let mut target = vec!["--device", &spec];
            if !mount.is_empty() {
                target.extend(["-o", mount]);
            }
            a.commands.push(command(&target, &o));
            let r = {
                let fs = crate::bench::volfs::open(&spec, mount)?;
                let label = format!("lab --kernel: {}", a.name);
                step(c.o.sink, &label, || readlat::run(&o, fs))
            };
            remove(&img)?;
            figures(&mut a, &r?);
            out.push(a);
        }
        Ok(())
    }
}
