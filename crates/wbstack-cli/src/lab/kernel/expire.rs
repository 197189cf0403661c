//! Seed 001 (expire) beside the kernel: GNU tar extracting a generated tree while dd
//! writes a large file, then sync.

use super::fsmark::device_figures;
use super::loopdev::{read_stats, s};
use super::programs::{self, command_line};
use super::{remove, step, Ctx, DirTarget, Exp, TargetArm};
use crate::bench::tardd::{self, TarSource, TarddOpts};
use crate::lab::LabOpts;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// (files in the tree, dd MiB).
fn sizes(o: &LabOpts) -> (usize, u64) {
    if o.full {
        (26_000, 3072)
    } else if o.quick {
        (10_000, 1024)
    } else {
        (20_000, 2048)
    }
}

/// How often the dd's file size is sampled for its series.
const SAMPLE_EVERY: Duration = Duration::from_millis(250);

pub struct Expire;

fn tarball_path(c: &Ctx) -> std::path::PathBuf {
    c.work.join(format!("expire-{}.tar", sizes(c.o).0))
}

/// The generated tree as a tar file in the work dir (the same tree as the lab's seed),
/// made once for all targets.
fn tarball(c: &Ctx, files: usize) -> Result<std::path::PathBuf, String> {
    let p = tarball_path(c);
    if !p.exists() {
        let bytes = tardd::synthetic_tar(files, 1)?;
        std::fs::write(&p, bytes).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    Ok(p)
}

fn spawn(prog: &str, args: &[String], cwd: &Path) -> Result<std::process::Child, String> {
    Command::new(prog)
        .args(args)
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{}: {e}", command_line(prog, args)))
}

/// Wait for a child; Err with its stderr unless it succeeded.
fn finish(child: std::process::Child, cmd: &str) -> Result<(), String> {
    let out = child
        .wait_with_output()
        .map_err(|e| format!("{cmd}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cmd} exited with {}: {}",
            out.status,
            programs::tail(&out.stderr)
        ));
    }
    Ok(())
}

impl Exp for Expire {
    fn dir_arms(
        &self,
        c: &Ctx,
        t: &DirTarget,
        out: &mut Vec<TargetArm>,
        _skipped: &mut Vec<String>,
    ) -> Result<(), String> {
        programs::ensure("tar", "tar")?;
        let (files, dd_mib) = sizes(c.o);
        let tar = tarball(c, files)?;
        let base = t.dir.join("expire");
        let tree = base.join("tree");
        std::fs::create_dir_all(&tree).map_err(|e| format!("{}: {e}", tree.display()))?;
        let zero = base.join("zero");
        let tar_args = vec!["-xf".into(), s(&tar), "-C".into(), s(&tree)];
        let dd_args = vec![
            "if=/dev/zero".into(),
            format!("of={}", zero.display()),
            "bs=1M".into(),
            format!("count={dd_mib}"),
            "status=none".into(),
        ];
        let mut a = t.arm("tar+dd", "GNU tar + dd");
        let (tar_cmd, dd_cmd) = (command_line("tar", &tar_args), command_line("dd", &dd_args));
        a.commands
            .push(format!("{tar_cmd} & {dd_cmd} & wait; sync"));
        if let super::DirKind::Mount(_) = t.kind {
            a.commands.push(super::sync_command(t));
        }
        a.setup = format!(
            "{}; a generated tree of {files} files ({}), dd of {dd_mib} MiB at once",
            a.setup,
            tar.display()
        );
        let before = read_stats(&t.stat)?;
        let label = format!("lab --kernel: {}", a.name);
        let r = step(c.o.sink, &label, || -> Result<_, String> {
            let t0 = Instant::now();
            let tar_child = spawn("tar", &tar_args, &c.work)?;
            let dd_child = match spawn("dd", &dd_args, &c.work) {
                Ok(ch) => ch,
                Err(e) => {
                    // tar must not outlive the arm: wait for it, then report dd.
                    let waited = finish(tar_child, &tar_cmd);
                    return Err(match waited {
                        Ok(()) => e,
                        Err(t) => format!("{e}; {t}"),
                    });
                }
            };
            std::thread::scope(|sc| {
                let tar_h = sc.spawn(|| finish(tar_child, &tar_cmd).map(|()| t0.elapsed()));
                let dd_h = sc.spawn(|| finish(dd_child, &dd_cmd).map(|()| t0.elapsed()));
                // Sampling, not waiting on a condition: the dd's progress over time.
                let mut pts = Vec::new();
                while !dd_h.is_finished() {
                    let len = std::fs::metadata(&zero).map_or(0, |m| m.len());
                    pts.push((t0.elapsed().as_secs_f64(), len as f64 / (1 << 20) as f64));
                    std::thread::sleep(SAMPLE_EVERY);
                }
                let tar_d = tar_h
                    .join()
                    .map_err(|_| "the tar waiter panicked".to_string())?;
                let dd_d = dd_h
                    .join()
                    .map_err(|_| "the dd waiter panicked".to_string())?;
                let (tar_d, dd_d) = (tar_d?, dd_d?);
                pts.push((dd_d.as_secs_f64(), dd_mib as f64));
                programs::run("sync", &[], &c.work)?;
                // sync does not reach the mount's daemon: its own writeback too.
                if let super::DirKind::Mount(m) = t.kind {
                    m.sync()?;
                }
                Ok((tar_d, dd_d, t0.elapsed(), pts))
            })
        });
        let (tar_d, dd_d, total, pts) = r?;
        let after = read_stats(&t.stat)?;
        a.fig("files", files as f64);
        a.fig("tar_s", tar_d.as_secs_f64());
        a.fig("dd_s", dd_d.as_secs_f64());
        a.fig("total_s", total.as_secs_f64());
        a.fig("dd_mib", dd_mib as f64);
        device_figures(&mut a, &after.delta(&before), total.as_secs_f64());
        a.series.insert("dd_mib".into(), pts);
        // The next arm on this filesystem (none today) should not find a 1 GiB file.
        remove(&zero)?;
        out.push(a);
        Ok(())
    }

    fn disk_bytes(&self, c: &Ctx) -> u64 {
        let (files, dd_mib) = sizes(c.o);
        // The tree's mean file is ~12 KiB; the tarball itself sits beside the images.
        2 * files as u64 * (16 << 10) + (dd_mib << 20) + (1 << 30)
    }

    fn cleanup(&self, c: &Ctx) -> Result<(), String> {
        remove(&tarball_path(c))
    }

    fn file_arms(
        &self,
        c: &Ctx,
        out: &mut Vec<TargetArm>,
        _skipped: &mut Vec<String>,
    ) -> Result<(), String> {
        let (files, dd_mib) = sizes(c.o);
        let (img, spec) = c.file_spec("wbs-file.img", super::loopdev::IMAGE_SIZE);
        remove(&img)?;
        let mut a = TargetArm::new(
            "wbstack-file tar+dd".into(),
            "wbstack-file",
            "tardd (wbstack, in-process)",
            format!(
                "wbstack in this process on {spec}, default mount options; the same generated tree of {files} files, dd of {dd_mib} MiB"
            ),
        );
        a.commands.push(command_line(
            "wbstack",
            &[
                "bench".into(),
                "tardd".into(),
                "--device".into(),
                spec.clone(),
                "--files".into(),
                files.to_string(),
                "--dd-size".into(),
                format!("{dd_mib}M"),
            ],
        ));
        let opts = TarddOpts {
            source: TarSource::Synthetic { files, seed: 1 },
            dd_size: dd_mib << 20,
            ..Default::default()
        };
        let r = {
            let fs = crate::bench::volfs::open(&spec, "")?;
            step(c.o.sink, "lab --kernel: wbstack-file tar+dd", || {
                tardd::run(&opts, fs)
            })
        };
        remove(&img)?;
        let r = r?;
        a.fig("files", r.files as f64);
        a.fig("tar_s", r.tar_s);
        a.fig("dd_s", r.dd_s);
        a.fig("total_s", r.total_s);
        a.fig("dd_mib", r.dd_bytes as f64 / (1 << 20) as f64);
        if let Some(d) = &r.device {
            a.fig("write_ios", d.write_ios as f64);
            a.fig("write_iops", d.write_iops);
            a.fig("avg_write_kib", d.avg_write_kib);
            a.fig("flushes", d.flushes as f64);
        }
        out.push(a);
        Ok(())
    }
}
