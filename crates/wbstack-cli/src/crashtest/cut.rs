//! One cut: a fresh filesystem, the workload, the power cut, recovery and the checks.

use super::*;
use parking_lot::Mutex;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use wbstack::block::logwrites::LogWrites;
use wbstack::block::{QueueConfig, RequestQueue};
use wbstack::dev::DeviceSpec;
use wbstack::fs::fsck::fsck;
use wbstack::fs::{FsResult, InodeKind, MkfsOptions, MountOptions, OpenOptions, Volume};

/// What one cut did and found.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CutReport {
    pub cut: u64,
    /// Replays this cut: `--seed SEED --cuts 1` (with the same other flags).
    pub seed: u64,
    pub plan: Option<CutPlan>,
    /// The operation at which the cut was armed or made (None: after the workload).
    pub placed_at: Option<u64>,
    /// Workload operations started (all threads).
    pub ops: u64,
    pub log_entries: usize,
    pub fsyncs_acked: u64,
    pub fdatasyncs_acked: u64,
    pub syncs_acked: u64,
    pub landing: Landing,
    pub journal_commits: u64,
    pub journal_checkpoints: u64,
    /// fsyncs that journaled their data (`journal_data_kb`), and the blocks.
    pub journal_data_fsyncs: u64,
    pub journal_data_blocks: u64,
    /// Commits written while an earlier one was in flight (`logbufs`).
    pub journal_commits_overlapped: u64,
    pub device_writes: u64,
    pub device_flushes: u64,
    /// Problems of fsck before the mount, of the mounted metadata, and of fsck after
    /// the unmount.
    pub fsck_problems: Vec<String>,
    pub fsck_errors: u64,
    /// fsck's notes before the mount: the checkpoint, the transactions replayed and
    /// why the journal ended there.
    pub fsck_notes: Vec<String>,
    pub mount_error: Option<String>,
    /// Reading the recovered tree failed.
    pub recovery_error: Option<String>,
    pub unexpected_errors: Vec<String>,
    /// The cut did not finish within its time bound (threads left behind).
    pub hang: bool,
    /// A hang's every thread's stack at the moment it was reported (or why there are
    /// none): where the cut's threads wait, which no replay can show.
    #[serde(skip)]
    pub hang_stacks: Option<String>,
    pub verdict: Verdict,
    pub seconds: f64,
    /// Where a failing cut's replay file was written (`--replay FILE` rebuilds it).
    pub replay_file: Option<String>,
    /// The recovered volume's second life (`second_life`), run when the first passed.
    pub second_life: Option<SecondLife>,
}

impl CutReport {
    pub fn failed(&self) -> bool {
        self.hang
            || self.fsck_errors > 0
            || self.mount_error.is_some()
            || self.recovery_error.is_some()
            || !self.unexpected_errors.is_empty()
            || !self.verdict.clean()
            || self.second_life_failed()
    }

    /// Failed in what recovery found (fsck, the mount, reading back): what a replay
    /// file rebuilds and checks again. A hang or an error of the workload itself is
    /// not in the crash state, so no replay could show it.
    pub fn recovery_failed(&self) -> bool {
        self.fsck_errors > 0
            || self.mount_error.is_some()
            || self.recovery_error.is_some()
            || !self.verdict.clean()
    }

    pub fn second_life_failed(&self) -> bool {
        self.second_life
            .as_ref()
            .is_some_and(|l| !l.problems.is_empty())
    }

    pub fn reasons(&self) -> String {
        let mut r = Vec::new();
        let v = &self.verdict;
        if self.hang {
            r.push("hang".to_string());
        }
        if let Some(e) = &self.mount_error {
            r.push(format!("mount failed: {e}"));
        }
        if let Some(e) = &self.recovery_error {
            r.push(format!("reading back failed: {e}"));
        }
        if self.fsck_errors > 0 {
            r.push(format!("{} fsck problem(s)", self.fsck_errors));
        }
        if !self.unexpected_errors.is_empty() {
            r.push(format!(
                "{} unexpected error(s)",
                self.unexpected_errors.len()
            ));
        }
        if v.namespace_not_prefix {
            r.push("namespace is no prefix".into());
        }
        if v.fsynced_ops_lost > 0 {
            r.push(format!("{} fsynced op(s) lost", v.fsynced_ops_lost));
        }
        if v.fsynced_bytes_lost > 0 {
            r.push(format!("{} fsynced bytes lost", v.fsynced_bytes_lost));
        }
        if v.garbage_sectors > 0 {
            r.push(format!("{} garbage block(s)", v.garbage_blocks_exposed));
        }
        if v.stale_sectors_exposed > 0 {
            r.push(format!("{} stale sector(s)", v.stale_sectors_exposed));
        }
        if v.size_errors > 0 {
            r.push(format!("{} size error(s)", v.size_errors));
        }
        if v.renamed_bytes_lost > 0 {
            r.push(format!(
                "{} bytes written before a durable rename over lost",
                v.renamed_bytes_lost
            ));
        }
        if let Some(l) = self.second_life.as_ref().filter(|l| !l.problems.is_empty()) {
            r.push(format!(
                "second life: {} ({} problem(s))",
                l.problems[0],
                l.problems.len()
            ));
        }
        r.join("; ")
    }
}

/// The options of a run.
#[derive(Clone, Debug)]
pub struct CrashOpts {
    /// sim:ssd or sim:hdd with options; crashtest adds the seed (and size=64M if none).
    pub device: String,
    pub cuts: u64,
    pub seed: u64,
    pub ops: u64,
    pub threads: usize,
    pub rule: FsyncRule,
    /// Mount options on top of crashtest's own (name=value,...).
    pub mount_opts: String,
    pub commit_ms: u64,
    /// Cuts run at once (each on its own fresh filesystem and device).
    pub jobs: usize,
    pub progress: bool,
    /// Where a failing cut writes its replay file (None: nowhere).
    pub save_dir: Option<std::path::PathBuf>,
    /// Testing the tool itself: the device ignores PREFLUSH (commits no longer make the
    /// data before them durable), so cuts fail.
    pub drop_preflush: bool,
}

impl Default for CrashOpts {
    fn default() -> Self {
        CrashOpts {
            device: "sim:ssd".into(),
            cuts: 20,
            seed: 1,
            ops: 3000,
            threads: 2,
            rule: FsyncRule::Inode,
            mount_opts: String::new(),
            commit_ms: 20,
            jobs: 1,
            progress: false,
            save_dir: None,
            drop_preflush: false,
        }
    }
}

/// The device spec of the cut with `seed`.
pub fn cut_spec(device: &str, seed: u64) -> Result<String, String> {
    let s = DeviceSpec::parse(device).map_err(|e| e.to_string())?;
    if !matches!(s.kind.as_str(), "sim:ssd" | "sim:hdd") {
        return Err(format!(
            "--device {device}: crashtest cuts the power of a simulated device: use sim:ssd or sim:hdd[,options]"
        ));
    }
    for k in ["seed", "cut_after", "torn"] {
        if s.has(k) {
            return Err(format!(
                "--device {device}: crashtest sets '{k}' itself for every cut (from --seed)"
            ));
        }
    }
    if let Some(d) = s.str_opt("data") {
        if !matches!(d.as_str(), "1" | "on" | "yes" | "true") {
            return Err(format!(
                "--device {device}: crashtest reads every byte back, so the device must keep its data (data=1)"
            ));
        }
    }
    let mut spec = s.raw.clone();
    if !s.has("size") {
        // Small enough that the journal (its minimum, 1 MiB) fills and checkpoints
        // happen during a cut's workload.
        spec.push_str(",size=64M");
    }
    spec.push_str(&format!(",seed={seed}"));
    Ok(spec)
}

/// crashtest's mount options: writeback and commits every few tens of milliseconds and
/// small dirty thresholds, so the cuts find them in flight; then the user's.
pub fn mount_options(o: &CrashOpts) -> Result<MountOptions, String> {
    let mut m = MountOptions {
        commit_interval_ms: o.commit_ms,
        ..MountOptions::default()
    };
    m.wb.dirty_writeback_centisecs = 1;
    m.wb.dirty_expire_centisecs = 3;
    m.wb.dirty.dirty_background_bytes = 256 << 10;
    m.wb.dirty.dirty_bytes = 4 << 20;
    // Small fsyncs take the journaled-data path (fs::jdata), larger ones the ordered
    // one: the workload exercises both (`-o journal_data_kb=0` for ordered only).
    m.journal_data_kb = 64;
    m.parse(&o.mount_opts).map_err(|e| format!("-o: {e}"))?;
    Ok(m)
}

/// Walk the tree from the root and read every regular file.
pub fn recover(v: &Volume) -> FsResult<Recovered> {
    let mut r = Recovered::default();
    let root = v.stat("/")?.ino;
    let mut stack = vec![(String::new(), root)];
    while let Some((path, dino)) = stack.pop() {
        let list = v.readdir(if path.is_empty() { "/" } else { &path })?;
        for e in list {
            let p = format!("{path}/{}", e.name);
            let is_dir = e.kind == InodeKind::Dir;
            r.entries.insert((dino, e.name.clone(), e.ino, is_dir));
            if is_dir {
                stack.push((p, e.ino));
            } else if let std::collections::btree_map::Entry::Vacant(slot) = r.files.entry(e.ino) {
                let f = v.open(&p, &OpenOptions::read())?;
                let mut buf = vec![0u8; f.size() as usize];
                let mut off = 0;
                while off < buf.len() {
                    let n = f.read_at(off as u64, &mut buf[off..])?;
                    if n == 0 {
                        buf.truncate(off);
                        break;
                    }
                    off += n;
                }
                slot.insert(buf);
            }
        }
    }
    Ok(r)
}

/// A cut that has not finished after this long is reported as a hang.
pub(crate) const CUT_LIMIT: Duration = Duration::from_secs(180);

/// Run cut number `index` with `seed` (a fresh filesystem, workload, cut, recovery,
/// checks).
pub fn run_cut(o: &CrashOpts, index: u64, seed: u64) -> CutReport {
    let t0 = Instant::now();
    let mut rep = CutReport {
        cut: index,
        seed,
        ..CutReport::default()
    };
    if let Err(e) = cut_inner(o, seed, &mut rep) {
        rep.mount_error.get_or_insert(e);
    }
    rep.seconds = t0.elapsed().as_secs_f64();
    rep
}

pub(crate) fn cut_inner(o: &CrashOpts, seed: u64, rep: &mut CutReport) -> Result<(), String> {
    let spec = cut_spec(&o.device, seed)?;
    let mopts = mount_options(o)?;
    let plan = CutPlan::new(seed, o.ops);
    rep.plan = Some(plan);
    let cfg = QueueConfig::default();
    let dev = wbstack::dev::open(&spec, cfg.clock.clone()).map_err(|e| e.to_string())?;
    let next_op = Arc::new(AtomicU64::new(0));
    let probe = Arc::new(Probe::new(dev, next_op.clone(), o.drop_preflush)?);
    // Above the probe: the log sees what the probe passes on, in the order it does.
    let logw = Arc::new(LogWrites::new(probe.clone()));
    let q = RequestQueue::new(logw.clone(), cfg).map_err(|e| e.to_string())?;
    let sb = Volume::mkfs(
        &q,
        &MkfsOptions {
            fs_id: Some(mix(seed)),
            ..MkfsOptions::for_mount(&mopts)
        },
    )
    .map_err(|e| format!("mkfs: {e}"))?;
    probe.set_layout(&sb);
    let vol = Volume::mount(q.clone(), mopts.clone()).map_err(|e| format!("first mount: {e}"))?;
    let root = vol.stat("/").map_err(|e| e.to_string())?.ino;
    let budget = (sb.nr_blocks - sb.data_start) * BLOCK / 3;
    let mut dirs = BTreeMap::new();
    dirs.insert(root, BTreeMap::new());
    let ctx = Arc::new(Ctx {
        vol,
        probe: probe.clone(),
        ckpt_at: wbstack::fs::jspace::checkpoint_due_blocks(sb.journal_blocks),
        placed_at: AtomicU64::new(u64::MAX),
        model: Mutex::new(Model {
            log: Log::deferring_zero_truncates(mopts.flush_on_close),
            root,
            dirs,
            parent: HashMap::new(),
            files: BTreeMap::new(),
            names: 0,
            budget,
            unexpected: Vec::new(),
        }),
        next_op: next_op.clone(),
        versions: AtomicU64::new(0),
        ops: o.ops,
        plan,
    });
    let handles: Vec<_> = (0..o.threads.max(1) as u64)
        .map(|t| {
            let c = ctx.clone();
            std::thread::Builder::new()
                .name(format!("crash-w{t}"))
                .spawn(move || worker(c, t, seed))
                .map_err(|e| format!("cannot start a workload thread: {e}"))
        })
        .collect::<Result<_, _>>()?;
    for h in handles {
        h.join()
            .map_err(|_| "a workload thread panicked".to_string())?;
    }
    if probe.powered() {
        // End mode, or an armed cut that the workload did not send enough requests to
        // reach: sync, with the cut armed, so it lands inside the sync's IO.
        if ctx.placed_at.load(Ordering::SeqCst) == u64::MAX {
            match plan.mode {
                Mode::Journal => probe.arm_on(Area::Journal),
                Mode::Checkpoint => {}
                _ => probe.arm(plan.n),
            }
        }
        let mut rng = ChaCha8Rng::seed_from_u64(mix(seed ^ 0xe4d));
        if let Err(e) = do_op(&ctx, &mut rng, Kind::Sync, &mut None) {
            if probe.powered() {
                ctx.model.lock().unexpected.push(format!("final sync: {e}"));
            }
        }
        if probe.powered() {
            probe.cut_now();
        }
    }
    rep.ops = next_op.load(Ordering::SeqCst).min(o.ops);
    let placed = ctx.placed_at.load(Ordering::SeqCst);
    rep.placed_at = (placed != u64::MAX).then_some(placed);
    let js = ctx.vol.journal_stats();
    rep.journal_commits = js.commits;
    rep.journal_checkpoints = js.checkpoints;
    rep.journal_data_fsyncs = js.data_fsyncs;
    rep.journal_data_blocks = js.data_blocks;
    rep.journal_commits_overlapped = js.commits_overlapped;
    let ds = probe.sim().stats();
    rep.device_writes = ds.writes;
    rep.device_flushes = ds.flushes;
    rep.landing = probe.landing();
    let Ok(ctx) = Arc::try_unwrap(ctx) else {
        return Err("the workload context is still shared after its threads ended".into());
    };
    // The machine stops with files still open: nothing is closed or written back.
    ctx.vol.crash();
    let model = ctx.model.into_inner();
    drop(model.files);
    let log = model.log;
    rep.unexpected_errors = model.unexpected;
    rep.log_entries = log.len();
    let kinds: HashMap<u64, Barrier> = log
        .entries
        .iter()
        .filter_map(|e| match e {
            Entry::BarrierStart { id, kind, .. } => Some((*id, *kind)),
            _ => None,
        })
        .collect();
    for e in &log.entries {
        if let Entry::BarrierAck { id } = e {
            match kinds[id] {
                Barrier::Fsync(_) => rep.fsyncs_acked += 1,
                Barrier::Fdatasync(_) => rep.fdatasyncs_acked += 1,
                Barrier::Sync => rep.syncs_acked += 1,
            }
        }
    }
    probe.disarm();
    probe.sim().reboot();
    let image = probe.sim().image();
    let write_log = logw.take_log();
    let first = check_recovery(&q, mopts.clone(), &log, o.rule, rep);
    // A replay file rebuilds the first life's crash state: written for a failure of
    // its recovery, not for one of the workload or of the second life alone (their
    // reasons say so), which a replay would report passing without checking them.
    let first_failed = rep.failed();
    if let (false, Some(first)) = (first_failed, first) {
        rep.second_life = Some(second_life(&q, &probe, mopts, seed, &first));
    }
    if rep.recovery_failed() {
        if let Some(dir) = &o.save_dir {
            let file = ReplayFile::new(o, seed, rep, &spec, &log, &write_log, image);
            match file.save_in(dir) {
                Ok(path) => rep.replay_file = Some(path.display().to_string()),
                Err(e) => rep
                    .unexpected_errors
                    .push(format!("cannot write the replay file: {e}")),
            }
        }
    }
    Ok(())
}

/// Recovery and its checks on the device behind `q` after a cut: fsck, mount, fsck
/// of the mounted volume, reading every file back against `log`, unmount, fsck again.
/// The same for a cut and for its replay. The tree read back, when there was one.
pub fn check_recovery(
    q: &Arc<RequestQueue>,
    mopts: MountOptions,
    log: &Log,
    rule: FsyncRule,
    rep: &mut CutReport,
) -> Option<Recovered> {
    let before = fsck(q);
    rep.fsck_notes = before.notes.clone();
    rep.fsck_problems.extend(
        before
            .problems
            .iter()
            .map(|p| format!("fsck before mount: {p}")),
    );
    let v = match Volume::mount(q.clone(), mopts) {
        Ok(v) => v,
        Err(e) => {
            rep.mount_error = Some(e.to_string());
            rep.fsck_errors = rep.fsck_problems.len() as u64;
            return None;
        }
    };
    rep.fsck_problems
        .extend(v.check().into_iter().map(|p| format!("mounted: {p}")));
    let recovered = match recover(&v) {
        Ok(r) => {
            rep.verdict = check(log, &r, rule);
            if std::env::var_os("CRASHTEST_DEBUG").is_some() && !rep.verdict.clean() {
                for (i, e) in log.entries.iter().enumerate() {
                    eprintln!("log {i}: {e:?}");
                }
                for d in &r.entries {
                    eprintln!("recovered: {d:?}");
                }
                for (i, c) in &r.files {
                    eprintln!("recovered inode {i}: {} bytes", c.len());
                }
                for n in &rep.fsck_notes {
                    eprintln!("fsck: {n}");
                }
            }
            Some(r)
        }
        Err(e) => {
            rep.recovery_error = Some(e.to_string());
            None
        }
    };
    if let Err(e) = v.unmount() {
        rep.fsck_problems
            .push(format!("unmount after recovery: {e}"));
    }
    let after = fsck(q);
    rep.fsck_problems.extend(
        after
            .problems
            .iter()
            .map(|p| format!("fsck after unmount: {p}")),
    );
    rep.fsck_errors = rep.fsck_problems.len() as u64;
    recovered
}
