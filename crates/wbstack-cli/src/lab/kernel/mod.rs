//! The kernel beside us, on the same disk (`wbstack lab EXPERIMENT --kernel ext4|xfs|both`).
//!
//! Each experiment's arms run on three kinds of target, one after the other:
//! - a kernel filesystem (ext4, xfs) made on a loop device over a sparse image on this
//!   machine's disk (`loopdev`), with the seed's real program (Debian's fs_mark, GNU tar
//!   and dd, fio) or, where the program is ours (readlat), on it as a directory;
//! - "wbstack-file": wbstack in this process on a `file:` device, an image on the same
//!   disk, with our own tools;
//! - "wbstack-mount": the same real program as the kernel arms, on the FUSE mount of a
//!   wbstack image on the same disk (`wbsmount`).
//!
//! A target that cannot be set up (not root, no loop device, a tool that will not
//! install) is reported in `skipped` with the reason; the others still run.

mod expire;
mod fsmark;
mod inflight;
pub mod loopdev;
pub mod programs;
pub mod wbsmount;
mod wbt;

use crate::lab::{outln, LabOpts};
use crate::progress::{Sink, Step};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A kernel filesystem made on a loop device on this machine's disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KernelFs {
    Ext4,
    Xfs,
}

impl KernelFs {
    pub fn name(self) -> &'static str {
        match self {
            KernelFs::Ext4 => "ext4",
            KernelFs::Xfs => "xfs",
        }
    }
}

/// `--kernel ext4|xfs|both`.
pub fn parse_kernel(s: &str) -> Result<Vec<KernelFs>, String> {
    match s {
        "ext4" => Ok(vec![KernelFs::Ext4]),
        "xfs" => Ok(vec![KernelFs::Xfs]),
        "both" => Ok(vec![KernelFs::Ext4, KernelFs::Xfs]),
        other => Err(format!("--kernel: '{other}' is not ext4, xfs or both")),
    }
}

/// One arm on one target, run with a real program where the seed used one.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TargetArm {
    /// Short and unique within the experiment: "ext4 -S1 t8", "wbstack-mount -S0".
    pub name: String,
    /// "ext4", "xfs", "wbstack-file" (in-process, a file: device on the same disk) or
    /// "wbstack-mount" (the FUSE mount of an image on the same disk).
    pub target: String,
    /// What ran: "fs_mark (Debian)", "GNU tar + dd", "fio", "readlat (wbstack)".
    pub program: String,
    /// The exact commands, as a shell would take them.
    pub commands: Vec<String>,
    /// Where it ran: image path, loop device, mkfs/mount options, the queue's settings
    /// (scheduler, wbt_lat_usec, iostats) and the switch flipped for this arm.
    pub setup: String,
    /// The arm's figures in the experiment table's terms ("files_per_sec",
    /// "write_iops", "avg_write_kib", "flushes", "read_p99_us"...).
    pub figures: BTreeMap<String, f64>,
    /// Figures over time where the program reports them (fs_mark's loops, dd's
    /// progress): name → points (seconds since the arm started, value).
    pub series: BTreeMap<String, Vec<(f64, f64)>>,
}

impl TargetArm {
    fn new(name: String, target: &str, program: &str, setup: String) -> TargetArm {
        TargetArm {
            name,
            target: target.into(),
            program: program.into(),
            commands: Vec::new(),
            setup,
            figures: BTreeMap::new(),
            series: BTreeMap::new(),
        }
    }

    fn fig(&mut self, k: &str, v: f64) {
        self.figures.insert(k.into(), v);
    }

    fn get(&self, k: &str) -> Option<f64> {
        self.figures.get(k).copied()
    }
}

/// The kernel arms of one experiment, and what could not run with the reason.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct KernelRun {
    pub experiment: String,
    pub arms: Vec<TargetArm>,
    /// Printed, never silent: "xfs: mkfs.xfs missing and apt-get failed: ...".
    pub skipped: Vec<String>,
}

/// Where the lab makes its images (this machine's disk, not a tmpfs).
pub const WORK_DIR: &str = "/var/tmp/wbstack-lab-kernel";

/// What an experiment's arms need to know.
pub struct Ctx<'a> {
    pub o: &'a LabOpts,
    pub work: PathBuf,
}

impl Ctx<'_> {
    /// The in-process arms' device: an image on the same disk as the kernel's.
    fn file_spec(&self, name: &str, size: &str) -> (PathBuf, String) {
        let img = self.work.join(name);
        let spec = format!("file:{},create=1,size={size}", img.display());
        (img, spec)
    }
}

/// A directory target the real programs run on: a kernel filesystem or the FUSE mount.
pub struct DirTarget<'a> {
    /// "ext4", "xfs" or "wbstack-mount".
    pub target: String,
    pub dir: PathBuf,
    /// Where the device's counters are (/sys/block/loopN/stat, .wbstack/diskstats).
    pub stat: PathBuf,
    pub setup: String,
    pub setup_commands: Vec<String>,
    pub kind: DirKind<'a>,
}

pub enum DirKind<'a> {
    Kernel(&'a loopdev::LoopFs),
    Mount(&'a wbsmount::WbsMount),
}

impl DirTarget<'_> {
    fn arm(&self, variant: &str, program: &str) -> TargetArm {
        let mut a = TargetArm::new(
            format!("{} {variant}", self.target),
            &self.target,
            program,
            self.setup.clone(),
        );
        a.commands = self.setup_commands.clone();
        a
    }
}

/// The per-experiment arms on each kind of target.
trait Exp {
    fn dir_arms(
        &self,
        c: &Ctx,
        t: &DirTarget,
        out: &mut Vec<TargetArm>,
        skipped: &mut Vec<String>,
    ) -> Result<(), String>;
    /// The arms that ran are in `out` even when a later one fails.
    fn file_arms(
        &self,
        c: &Ctx,
        out: &mut Vec<TargetArm>,
        skipped: &mut Vec<String>,
    ) -> Result<(), String>;
    /// Bytes of this disk one target's arms may fill at most (images are sparse).
    fn disk_bytes(&self, c: &Ctx) -> u64;
    /// Remove what the arms shared (a generated archive) once every target ran.
    fn cleanup(&self, _c: &Ctx) -> Result<(), String> {
        Ok(())
    }
}

fn experiment(name: &str) -> Result<Box<dyn Exp>, String> {
    Ok(match name {
        "plug" => Box::new(fsmark::Plug),
        "fsync" => Box::new(fsmark::Fsync),
        "expire" => Box::new(expire::Expire),
        "inflight" => Box::new(inflight::Inflight),
        "wbt" => Box::new(wbt::Wbt),
        other => {
            return Err(format!(
                "lab {other} --kernel: no kernel arms for '{other}' (known: {})",
                crate::lab::EXPERIMENTS.join(", ")
            ))
        }
    })
}

fn is_root() -> bool {
    // SAFETY: geteuid takes no arguments and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Run `experiment`'s arms on each kernel filesystem, on wbstack on a `file:` device on
/// the same disk, and on wbstack through the mount.
pub fn run(experiment_name: &str, kernels: &[KernelFs], o: &LabOpts) -> Result<KernelRun, String> {
    if experiment_name == "dirty" {
        // Said, not silent: the lab's other experiments keep their kernel arms.
        return Ok(KernelRun {
            experiment: experiment_name.into(),
            skipped: vec![
                "dirty: no kernel arms yet (the kernel's own dirty throttling has no seed program to run beside ours)".into(),
            ],
            ..Default::default()
        });
    }
    let exp = experiment(experiment_name)?;
    let work = std::env::var_os("WBSTACK_LAB_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(WORK_DIR));
    let mut r = KernelRun {
        experiment: experiment_name.into(),
        ..Default::default()
    };
    // Without a work dir no target can run: the lab's own table still stands.
    let free = std::fs::create_dir_all(&work)
        .map_err(|e| format!("{}: {e}", work.display()))
        .and_then(|()| free_bytes(&work));
    let c = Ctx { o, work };
    // One target at a time holds an image, but each image fills up to this.
    let need = exp.disk_bytes(&c);
    let free = match free {
        Ok(f) => f,
        Err(e) => {
            r.skipped.push(format!("every target: no work dir: {e}"));
            return Ok(r);
        }
    };
    if free < need {
        r.skipped.push(format!(
            "every target: {} has {} MiB free, the arms of {experiment_name} need up to {} MiB",
            c.work.display(),
            free >> 20,
            need >> 20
        ));
        return Ok(r);
    }
    for &k in kernels {
        if !is_root() {
            r.skipped.push(format!(
                "{}: not root (euid {}): losetup, mkfs and mount need root",
                k.name(),
                // SAFETY: as in is_root.
                unsafe { libc::geteuid() }
            ));
            continue;
        }
        let l = match loopdev::LoopFs::make(k, &c.work) {
            Ok(l) => l,
            Err(e) => {
                r.skipped.push(format!("{}: setup failed: {e}", k.name()));
                continue;
            }
        };
        let t = DirTarget {
            target: k.name().into(),
            dir: l.mnt.clone(),
            stat: l.stat_path(),
            setup: l.setup(),
            setup_commands: l.commands.clone(),
            kind: DirKind::Kernel(&l),
        };
        if let Err(e) = exp.dir_arms(&c, &t, &mut r.arms, &mut r.skipped) {
            r.skipped.push(format!("{}: {e}", k.name()));
        }
        drop(t);
        if let Err(e) = l.finish() {
            r.skipped.push(format!("{}: teardown: {e}", k.name()));
        }
    }
    if let Err(e) = exp.file_arms(&c, &mut r.arms, &mut r.skipped) {
        r.skipped.push(format!("wbstack-file: {e}"));
    }
    match wbsmount::WbsMount::make(&c.work, "") {
        Err(e) => r.skipped.push(format!("wbstack-mount: setup failed: {e}")),
        Ok(m) => {
            let t = DirTarget {
                target: "wbstack-mount".into(),
                dir: m.mnt.clone(),
                stat: m.stat_path(),
                setup: m.setup(),
                setup_commands: m.commands.clone(),
                kind: DirKind::Mount(&m),
            };
            if let Err(e) = exp.dir_arms(&c, &t, &mut r.arms, &mut r.skipped) {
                r.skipped.push(format!("wbstack-mount: {e}"));
            }
            drop(t);
            if let Err(e) = m.finish() {
                r.skipped.push(format!("wbstack-mount: unmount: {e}"));
            }
        }
    }
    exp.cleanup(&c)?;
    Ok(r)
}

/// Run `f` (a program, an in-process tool) as one progress step, ticking seconds while
/// it runs, since neither tells us how far it is.
pub fn step<T: Send>(sink: Sink, label: &str, f: impl FnOnce() -> T + Send) -> T {
    let step = Step::start(sink, label, None, "s");
    let start = Instant::now();
    std::thread::scope(|s| {
        let (tx, rx) = mpsc::channel();
        s.spawn(move || {
            // The receiver outlives this thread: it waits for exactly this message.
            let sent = tx.send(f());
            debug_assert!(sent.is_ok());
        });
        loop {
            match rx.recv_timeout(Duration::from_millis(250)) {
                Ok(v) => return v,
                Err(mpsc::RecvTimeoutError::Timeout) => step.set(start.elapsed().as_secs()),
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    // Only a panic in `f` gets here: hand it on as the panic it was.
                    panic!("lab --kernel: the step '{label}' panicked")
                }
            }
        }
    })
}

/// syncfs(2) on the filesystem holding `dir`.
pub fn syncfs(dir: &Path) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let d = std::fs::File::open(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    // SAFETY: syncfs takes a descriptor we own for the duration of the call.
    let rc = unsafe { libc::syncfs(d.as_raw_fd()) };
    if rc != 0 {
        return Err(format!(
            "syncfs {}: {}",
            dir.display(),
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

/// Bytes available to us on the filesystem holding `dir`.
fn free_bytes(dir: &Path) -> Result<u64, String> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    // SAFETY: statvfs fills the struct we pass; the path is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(format!(
            "statvfs {}: {}",
            dir.display(),
            std::io::Error::last_os_error()
        ));
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// `sync` of a directory target: syncfs on a kernel filesystem; on the mount, also the
/// daemon's writeback and commit (see `WbsMount::sync`).
pub fn target_sync(t: &DirTarget) -> Result<(), String> {
    match t.kind {
        DirKind::Kernel(_) => syncfs(&t.dir),
        DirKind::Mount(m) => m.sync(),
    }
}

/// The command line a target's sync amounts to, for `commands`.
fn sync_command(t: &DirTarget) -> String {
    match t.kind {
        DirKind::Kernel(_) => format!("syncfs({})", t.dir.display()),
        DirKind::Mount(_) => format!(
            "syncfs({d}); wbstack ctl {d} dirty_background_bytes=1 dirty_expire_centisecs=0 dirty_writeback_centisecs=1; wait for nr_dirty 0 and nr_writeback 0 in {d}/.wbstack/stat; put the knobs back; fsync({d})",
            d = t.dir.display()
        ),
    }
}

/// Remove a file the lab made; a missing one is fine.
fn remove(p: &Path) -> Result<(), String> {
    match std::fs::remove_file(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("rm {}: {e}", p.display())),
    }
}

/// The columns of an experiment's table and its headline figure for the ratios.
fn columns(experiment: &str) -> (&'static [(&'static str, &'static str)], &'static str) {
    match experiment {
        "plug" => (
            &[
                ("files_per_sec", "files/s"),
                ("files_per_sec_incl_sync", "incl sync"),
                ("write_ios", "writes"),
                ("write_iops", "write IOPS"),
                ("avg_write_kib", "avg KiB"),
                ("flushes", "flushes"),
            ],
            "files_per_sec_incl_sync",
        ),
        "fsync" => (
            &[
                ("files_per_sec", "files/s"),
                ("files_per_sec_incl_sync", "incl sync"),
                ("write_iops", "write IOPS"),
                ("fsyncs", "fsyncs"),
                ("flushes", "flushes"),
                ("fsyncs_per_flush", "fsyncs/flush"),
            ],
            "files_per_sec",
        ),
        "expire" => (
            &[
                ("tar_s", "tar s"),
                ("dd_s", "dd s"),
                ("total_s", "total s"),
                ("write_ios", "writes"),
                ("avg_write_kib", "avg KiB"),
            ],
            "total_s",
        ),
        "inflight" => (
            &[
                ("iops", "IOPS"),
                ("usr_pct", "usr %"),
                ("sys_pct", "sys %"),
                ("lat_p50_us", "p50 us"),
                ("lat_p99_us", "p99 us"),
            ],
            "iops",
        ),
        "wbt" => (
            &[
                ("read_p50_us", "p50 us"),
                ("read_p99_us", "p99 us"),
                ("read_p9999_us", "p99.99 us"),
                ("read_max_us", "max us"),
                ("read_over", "Over"),
            ],
            "read_p9999_us",
        ),
        _ => (&[], ""),
    }
}

/// The report's plot of a kernel run: the experiment's headline figure for every arm,
/// kernel and wbstack side by side (None when no arm has it).
pub fn headline_plot(r: &KernelRun) -> Option<crate::lab::plots::Plot> {
    use crate::lab::plots::{Plot, PlotKind};
    let (cols, headline) = columns(&r.experiment);
    let label = cols.iter().find(|c| c.0 == headline)?.1;
    let arms: Vec<&TargetArm> = r
        .arms
        .iter()
        .filter(|a| a.get(headline).is_some())
        .collect();
    if arms.is_empty() {
        return None;
    }
    // Grouped by variant (-S0, -S1 t8, ...), one bar per target within it.
    let mut variants: Vec<&str> = Vec::new();
    let mut targets: Vec<&str> = Vec::new();
    for a in &arms {
        if !variants.contains(&variant(a)) {
            variants.push(variant(a));
        }
        if !targets.contains(&a.target.as_str()) {
            targets.push(&a.target);
        }
    }
    let mut p = Plot::new(
        &format!("{}-kernel", r.experiment),
        &format!("{}: {label} beside the kernel, on this disk", r.experiment),
        PlotKind::Bars,
        "variant",
        label,
    )
    .categories(
        variants
            .iter()
            .map(|v| {
                if v.is_empty() {
                    r.experiment.clone()
                } else {
                    v.to_string()
                }
            })
            .collect(),
    );
    for t in targets {
        p = p.series(
            t,
            arms.iter()
                .filter(|a| a.target == t)
                .filter_map(|a| {
                    let i = variants.iter().position(|v| *v == variant(a))?;
                    a.get(headline).map(|v| (i as f64, v))
                })
                .collect(),
        );
    }
    Some(p)
}

fn cell(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(v) if v.abs() >= 100.0 || v.fract() == 0.0 => crate::lab::fmt_int(v),
        Some(v) => format!("{v:.2}"),
    }
}

/// The variant of an arm: its name without the target ("-S1 t8").
fn variant(a: &TargetArm) -> &str {
    a.name
        .strip_prefix(a.target.as_str())
        .unwrap_or(&a.name)
        .trim()
}

/// The table of a kernel run, printed after the experiment's own table.
pub fn print(r: &KernelRun) {
    print!("{}", table(r));
}

/// The table as text (the report shows it too).
pub fn table(r: &KernelRun) -> String {
    let mut out = String::new();
    let (cols, headline) = columns(&r.experiment);
    outln!(
        out,
        "{} beside the kernel, on this machine's disk (loop device / file: image / FUSE mount)",
        r.experiment
    );
    let name_w = r
        .arms
        .iter()
        .map(|a| a.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    let prog_w = r
        .arms
        .iter()
        .map(|a| a.program.len())
        .max()
        .unwrap_or(7)
        .clamp(7, 34);
    let mut head = format!(
        "{:<name_w$}  {:<14} {:<prog_w$}",
        "arm", "target", "program"
    );
    for (_, h) in cols {
        head.push_str(&format!(" {h:>12}"));
    }
    outln!(out, "{head}");
    outln!(out, "{}", "-".repeat(head.len()));
    for a in &r.arms {
        let mut line = format!(
            "{:<name_w$}  {:<14} {:<prog_w$}",
            a.name, a.target, a.program
        );
        for (k, _) in cols {
            line.push_str(&format!(" {:>12}", cell(a.get(k))));
        }
        outln!(out, "{line}");
    }
    // Ratios: each wbstack arm against each kernel arm of the same variant.
    if !headline.is_empty() {
        let kernel: Vec<&TargetArm> = r
            .arms
            .iter()
            .filter(|a| !a.target.starts_with("wbstack"))
            .collect();
        let mut lines = Vec::new();
        for w in r.arms.iter().filter(|a| a.target.starts_with("wbstack")) {
            for k in kernel.iter().filter(|k| variant(k) == variant(w)) {
                if let (Some(wv), Some(kv)) = (w.get(headline), k.get(headline)) {
                    if kv != 0.0 {
                        lines.push(format!(
                            "{} vs {}: {headline} {:.2}x",
                            w.name,
                            k.name,
                            wv / kv
                        ));
                    }
                }
            }
        }
        if !lines.is_empty() {
            outln!(out, "ratios (wbstack / kernel):");
            for l in &lines {
                outln!(out, "  {l}");
            }
        }
    }
    // Where each target ran, once (the arms of a target share it up to their switch).
    let mut seen: Vec<&str> = Vec::new();
    for a in &r.arms {
        if !seen.contains(&a.target.as_str()) {
            seen.push(&a.target);
            outln!(out, "{}: {}", a.target, a.setup);
        }
    }
    for s in &r.skipped {
        outln!(out, "skipped: {s}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_names_parse() {
        assert_eq!(
            parse_kernel("both").unwrap(),
            vec![KernelFs::Ext4, KernelFs::Xfs]
        );
        assert!(parse_kernel("btrfs").unwrap_err().contains("btrfs"));
    }

    #[test]
    fn an_unknown_experiment_is_an_error() {
        assert!(experiment("nope").is_err());
    }

    #[test]
    fn variants_pair_arms_across_targets() {
        let a = TargetArm::new(
            "wbstack-mount -S1 t8".into(),
            "wbstack-mount",
            "x",
            String::new(),
        );
        assert_eq!(variant(&a), "-S1 t8");
    }
}
