//! Seeds 000 (plug) and 004 (fsync) beside the kernel: Debian's fs_mark on the kernel
//! filesystems and on the FUSE mount, our fsmark on wbstack in-process.

use super::loopdev::{read_stats, s};
use super::programs::{self, command_line};
use super::{remove, step, Ctx, DirTarget, Exp, TargetArm};
use crate::bench::benchfs::{BenchFs, DirFs};
use crate::bench::fsmark::{self as ours, FsmarkOpts, FsmarkReport, SyncMethod};
use crate::lab::LabOpts;
use std::sync::Arc;
use std::time::Instant;
use wbstack::block::DiskStats;

/// Device figures over `secs` from a counter delta.
pub fn device_figures(a: &mut TargetArm, d: &DiskStats, secs: f64) {
    let ios = d.writes();
    a.fig("write_ios", ios as f64);
    a.fig("write_iops", ios as f64 / secs.max(1e-9));
    a.fig(
        "avg_write_kib",
        if ios == 0 {
            0.0
        } else {
            d.sectors[1] as f64 / 2.0 / ios as f64
        },
    );
    a.fig("flushes", d.flushes() as f64);
}

/// One fs_mark run: `-d DIR/tag/0 ... -d DIR/tag/{ndirs-1}` and `args`, then syncfs,
/// with the device's counters read around both.
fn debian_fs_mark(
    c: &Ctx,
    t: &DirTarget,
    variant: &str,
    ndirs: usize,
    args: &[String],
) -> Result<TargetArm, String> {
    programs::ensure("fs_mark", "fsmark")?;
    let tag: String = variant
        .chars()
        .map(|ch| if ch.is_ascii_alphanumeric() { ch } else { '_' })
        .collect();
    let mut full = Vec::new();
    for i in 0..ndirs {
        // Relative to the target: fs_mark refuses -d paths of 40 bytes or more.
        let rel = format!("fsmark{tag}/{i}");
        let d = t.dir.join(&rel);
        // fs_mark makes the subdirectories but not the -d directories themselves.
        std::fs::create_dir_all(&d).map_err(|e| format!("{}: {e}", d.display()))?;
        full.push("-d".to_string());
        full.push(rel);
    }
    full.extend(args.iter().cloned());
    let mut a = t.arm(variant, "fs_mark 3.3 (Debian)");
    a.commands.push(format!(
        "cd {} && {}",
        s(&t.dir),
        command_line("fs_mark", &full)
    ));
    a.commands.push(super::sync_command(t));
    let before = read_stats(&t.stat)?;
    let t0 = Instant::now();
    let label = format!("lab --kernel: {}", a.name);
    let out = step(c.o.sink, &label, || programs::run("fs_mark", &full, &t.dir))?;
    let loops_s = t0.elapsed().as_secs_f64();
    step(c.o.sink, &format!("{label}: sync"), || {
        super::target_sync(t)
    })?;
    let wall_s = t0.elapsed().as_secs_f64();
    let after = read_stats(&t.stat)?;
    // fs_mark leaves its log in the current directory.
    remove(&t.dir.join("fs_log.txt"))?;
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    let rows = programs::parse_fsmark(&text)?;
    let files = rows.last().map_or(0, |r| r.count);
    a.fig("files", files as f64);
    a.fig("files_per_sec", programs::fsmark_average(&rows));
    a.fig("files_per_sec_incl_sync", files as f64 / wall_s.max(1e-9));
    a.fig("loops_s", loops_s);
    a.fig("sync_s", wall_s - loops_s);
    a.fig("wall_s", wall_s);
    device_figures(&mut a, &after.delta(&before), wall_s);
    // fs_mark prints no times: a loop's time is its files over its files/s (which is
    // the sum over threads of each thread's rate, so this is the threads' mean time).
    let mut at_s = 0.0;
    let mut prev = 0;
    let mut pts = Vec::new();
    for r in &rows {
        at_s += (r.count - prev) as f64 / r.files_per_sec.max(1e-9);
        prev = r.count;
        pts.push((at_s, r.files_per_sec));
    }
    a.series.insert("files_per_sec".into(), pts);
    Ok(a)
}

/// Our fsmark's report as an arm's figures.
fn ours_figures(a: &mut TargetArm, r: &FsmarkReport) {
    let t = &r.totals;
    a.fig("files", t.files as f64);
    a.fig("files_per_sec", t.files_per_sec);
    a.fig("files_per_sec_incl_sync", t.files_per_sec_incl_sync);
    a.fig("loops_s", t.loops_s);
    a.fig("sync_s", t.sync_s);
    a.fig("wall_s", t.wall_s);
    a.fig("fsyncs", t.fsyncs as f64);
    if let Some(v) = t.write_ios {
        a.fig("write_ios", v as f64);
    }
    if let Some(v) = t.write_iops {
        a.fig("write_iops", v);
    }
    if let Some(v) = t.avg_write_kib {
        a.fig("avg_write_kib", v);
    }
    if let Some(v) = t.flushes {
        a.fig("flushes", v as f64);
    }
    let mut at_s = 0.0;
    let pts = r
        .loops
        .iter()
        .map(|l| {
            at_s += l.wall_s;
            (at_s, l.files_per_sec)
        })
        .collect();
    a.series.insert("files_per_sec".into(), pts);
}

/// fs_mark's command line for `opts` (what our fsmark does, in fs_mark's terms).
fn ours_command(target: [&str; 2], o: &FsmarkOpts) -> String {
    let mut v = vec!["bench".to_string(), "fsmark".into()];
    v.extend(target.iter().map(|s| s.to_string()));
    for d in &o.dirs {
        v.push("-d".into());
        v.push(d.clone());
    }
    v.extend([
        "-D".into(),
        o.subdirs.to_string(),
        "-S".into(),
        match o.sync {
            SyncMethod::None => "0",
            SyncMethod::Fsync => "1",
            SyncMethod::Async => "A",
        }
        .into(),
        "-n".into(),
        o.files.to_string(),
        "-s".into(),
        o.size.to_string(),
        "-L".into(),
        o.loops.to_string(),
    ]);
    if o.threads > 0 {
        v.extend(["-t".into(), o.threads.to_string()]);
    }
    if o.keep {
        v.push("-k".into());
    }
    if o.sync == SyncMethod::Async {
        v.extend(["--async-depth".into(), o.async_depth.to_string()]);
    }
    command_line("wbstack", &v)
}

/// Our fsmark on wbstack in-process, on a fresh `file:` image on the same disk.
fn file_arm(c: &Ctx, variant: &str, opts: &FsmarkOpts) -> Result<TargetArm, String> {
    let (img, spec) = c.file_spec("wbs-file.img", super::loopdev::IMAGE_SIZE);
    remove(&img)?;
    let mut a = TargetArm::new(
        format!("wbstack-file {variant}"),
        "wbstack-file",
        "fsmark (wbstack, in-process)",
        format!("wbstack in this process on {spec}, default mount options; device figures from the volume's disk stats (flushes: empty flushes and the flush of each PREFLUSH write, as the kernel counts them)"),
    );
    a.commands.push(ours_command(["--device", &spec], opts));
    let r = {
        let fs = crate::bench::volfs::open(&spec, "")?;
        let label = format!("lab --kernel: {}", a.name);
        step(c.o.sink, &label, || ours::run(opts, fs))
    };
    remove(&img)?;
    ours_figures(&mut a, &r?);
    Ok(a)
}

/// Our fsmark on a directory target (the -A arms: Debian's fs_mark has no -A), with the
/// device's counters read around it.
fn ours_on_dir(
    c: &Ctx,
    t: &DirTarget,
    variant: &str,
    opts: &FsmarkOpts,
) -> Result<TargetArm, String> {
    let mut a = t.arm(variant, "fsmark (wbstack): fs_mark lacks -A");
    a.setup = format!(
        "{}; Debian's fs_mark has no -A (its usage lists none), so wbstack's fsmark ran on the directory: an asynchronous fsync per file ({}), reaped later",
        a.setup,
        crate::bench::benchfs::async_flush_mechanism()
    );
    a.commands
        .push(ours_command(["--dir-path", &s(&t.dir)], opts));
    let fs: Arc<dyn BenchFs> = Arc::new(DirFs::new(&t.dir)?);
    let before = read_stats(&t.stat)?;
    let label = format!("lab --kernel: {}", a.name);
    let r = step(c.o.sink, &label, || ours::run(opts, fs))?;
    // Our fsmark's final sync is a syncfs, which does not reach the mount's daemon:
    // its writeback is timed here and added to the figures with sync in them.
    let t_sync = Instant::now();
    if let super::DirKind::Mount(m) = t.kind {
        step(c.o.sink, &format!("{label}: sync"), || m.sync())?;
        a.commands.push(super::sync_command(t));
    }
    let extra_sync_s = t_sync.elapsed().as_secs_f64();
    let after = read_stats(&t.stat)?;
    ours_figures(&mut a, &r);
    let wall_s = r.totals.wall_s + extra_sync_s;
    a.fig("sync_s", r.totals.sync_s + extra_sync_s);
    a.fig("wall_s", wall_s);
    a.fig(
        "files_per_sec_incl_sync",
        r.totals.files as f64 / wall_s.max(1e-9),
    );
    // DirFs finds no device under a FUSE mount: the counters read here serve both.
    // Their window is said, as it is wider than `wall_s` by fsmark's mkdirs.
    a.setup = format!(
        "{}; device counts: from before fsmark made its directories to after the final sync (wall_s: its loops and syncs)",
        a.setup
    );
    device_figures(&mut a, &after.delta(&before), wall_s);
    Ok(a)
}

fn fsync_figures(a: &mut TargetArm) {
    let fsyncs = a.get("fsyncs").unwrap_or(0.0);
    let flushes = a.get("flushes").unwrap_or(0.0);
    a.fig("fsyncs_per_flush", fsyncs / flushes.max(1.0));
}

/// What `files` 4 KiB files take on a filesystem: the data, an inode, a directory entry
/// and the journal's share, rounded up generously (1 KiB each), plus 1 GiB of slack for
/// the journal and logs.
fn fsmark_bytes(files: u64) -> u64 {
    files * (4096 + 1024) + (1 << 30)
}

/// Seed 000's fs_mark: files per directory per loop and loops.
pub fn plug_sizes(o: &LabOpts) -> (u64, u32) {
    if o.full {
        // 800,000 4 KiB files: ~3.3 GiB with metadata, in a 16 GiB image.
        (100_000, 4)
    } else if o.quick {
        (10_000, 2)
    } else {
        (25_000, 4)
    }
}

fn plug_args(n: u64, loops: u32) -> Vec<String> {
    [
        "-D",
        "100",
        "-S0",
        "-n",
        &n.to_string(),
        "-s",
        "4096",
        "-L",
        &loops.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Seed 000: fs_mark -d D/0 -d D/1 -D 100 -S0 -n N -s 4096 -L L, then syncfs.
pub struct Plug;

impl Exp for Plug {
    fn dir_arms(
        &self,
        c: &Ctx,
        t: &DirTarget,
        out: &mut Vec<TargetArm>,
        _skipped: &mut Vec<String>,
    ) -> Result<(), String> {
        let (n, loops) = plug_sizes(c.o);
        out.push(debian_fs_mark(c, t, "-S0", 2, &plug_args(n, loops))?);
        Ok(())
    }

    fn disk_bytes(&self, c: &Ctx) -> u64 {
        let (n, loops) = plug_sizes(c.o);
        fsmark_bytes(2 * n * loops as u64)
    }

    fn file_arms(
        &self,
        c: &Ctx,
        out: &mut Vec<TargetArm>,
        _skipped: &mut Vec<String>,
    ) -> Result<(), String> {
        let (n, loops) = plug_sizes(c.o);
        out.push(file_arm(c, "-S0", &s0_opts(n, loops))?);
        Ok(())
    }
}

/// Seed 004's arms: (files per dir per loop, loops) at -S0 on 2 dirs, and files per
/// thread at -S1 / -A with 8 threads.
fn fsync_sizes(o: &LabOpts) -> ((u64, u32), u64) {
    if o.full {
        ((50_000, 2), 2_000)
    } else if o.quick {
        ((2_000, 2), 100)
    } else {
        ((10_000, 2), 500)
    }
}

/// The -A arm's threads keep this many flushes in flight each (the lab's fsync seed).
const ASYNC_DEPTH: usize = crate::lab::fsync::FSYNC_ASYNC_DEPTH;

/// Our fsmark as `fs_mark -d 0 -d 1 -D 100 -S0 -n N -s 4096 -L LOOPS` (plug's arm and
/// fsync's -S0 arm).
fn s0_opts(n: u64, loops: u32) -> FsmarkOpts {
    FsmarkOpts {
        dirs: vec!["0".into(), "1".into()],
        subdirs: 100,
        files: n,
        size: 4096,
        loops,
        sync: SyncMethod::None,
        final_sync: true,
        // Debian's fs_mark keeps every loop's files (-L implies -k).
        keep: true,
        ..Default::default()
    }
}

fn async_opts(per_thread: u64) -> FsmarkOpts {
    FsmarkOpts {
        dirs: (0..8).map(|i| format!("fsmarkA/{i}")).collect(),
        subdirs: 100,
        files: per_thread,
        size: 4096,
        loops: 1,
        sync: SyncMethod::Async,
        async_depth: ASYNC_DEPTH,
        final_sync: true,
        keep: true,
        ..Default::default()
    }
}

/// Seed 004: fs_mark -S0 (2 threads), -S1 with 8 threads (-t 8 over 2 dirs), and -A
/// with 8 threads (ours: Debian's fs_mark has no -A).
pub struct Fsync;

impl Exp for Fsync {
    fn dir_arms(
        &self,
        c: &Ctx,
        t: &DirTarget,
        out: &mut Vec<TargetArm>,
        skipped: &mut Vec<String>,
    ) -> Result<(), String> {
        let ((n, loops), per_thread) = fsync_sizes(c.o);
        // Each arm is complete when pushed: a later arm's failure keeps the earlier ones.
        let done = |mut a: TargetArm, out: &mut Vec<TargetArm>| {
            a.figures.entry("fsyncs".into()).or_insert(0.0);
            fsync_figures(&mut a);
            a.setup = format!(
                "{}; the three arms run in turn on this filesystem, each keeping its files",
                a.setup
            );
            out.push(a);
        };
        done(debian_fs_mark(c, t, "-S0", 2, &plug_args(n, loops))?, out);
        let s1: Vec<String> = [
            "-D",
            "100",
            "-S1",
            "-n",
            &per_thread.to_string(),
            "-s",
            "4096",
            "-L",
            "1",
            "-t",
            "8",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut a = debian_fs_mark(c, t, "-S1 t8", 2, &s1)?;
        // -S1: one fsync per file.
        a.fig("fsyncs", a.get("files").unwrap_or(0.0));
        done(a, out);
        if programs::fs_mark_has_async()? {
            // One meaning of -A on every target (ours: an async fsync reaped later)
            // rather than a patched fs_mark's on some.
            skipped.push(format!(
                "{}: this fs_mark has -A, but the -A arm runs wbstack's fsmark as on every target",
                t.target
            ));
        }
        done(ours_on_dir(c, t, "-A t8", &async_opts(per_thread))?, out);
        Ok(())
    }

    fn disk_bytes(&self, c: &Ctx) -> u64 {
        let ((n, loops), per_thread) = fsync_sizes(c.o);
        // The three arms run on one filesystem, each keeping its files.
        fsmark_bytes(2 * n * loops as u64 + 2 * 8 * per_thread)
    }

    fn file_arms(
        &self,
        c: &Ctx,
        out: &mut Vec<TargetArm>,
        _skipped: &mut Vec<String>,
    ) -> Result<(), String> {
        let ((n, loops), per_thread) = fsync_sizes(c.o);
        let s0 = s0_opts(n, loops);
        let s1 = FsmarkOpts {
            threads: 8,
            files: per_thread,
            loops: 1,
            sync: SyncMethod::Fsync,
            ..s0.clone()
        };
        for (variant, opts) in [
            ("-S0", &s0),
            ("-S1 t8", &s1),
            ("-A t8", &async_opts(per_thread)),
        ] {
            let mut a = file_arm(c, variant, opts)?;
            fsync_figures(&mut a);
            out.push(a);
        }
        Ok(())
    }
}
