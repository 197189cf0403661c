//! `wbstack crashtest`: proves the filesystem keeps its promises across power cuts.
//!
//! Each cut makes a fresh filesystem on a simulated device, runs a mixed workload from
//! several threads with writeback and journal commits in the background, cuts the power
//! (torn writes on) at a seeded point, then reboots, runs fsck, mounts, runs fsck again
//! after an unmount, and compares what came back with an exact log of what the workload
//! did and what was acknowledged.
//!
//! - Every 512-byte sector the workload writes describes itself (inode, sector index,
//!   write version, and a payload derived from them), so reading it back says exactly
//!   which write put it there, or that no write of this file at this offset did.
//! - Namespace operations and truncates (everything the filesystem journals) are logged
//!   under one lock around the operation itself, so the log's order is the journal's;
//!   the recovered tree must equal the tree after some prefix of them, and that prefix
//!   must hold everything an acknowledged fsync / fdatasync / sync covered.
//! - Data writes are logged when they return (under the file's own lock, so a file's
//!   writes and truncates are in the order they happened), with the log position at
//!   which they started and a stamp (`stamp`) taken when they returned.
//!
//! The promises checked, each never stricter than the filesystem makes it:
//! - fsync / fdatasync / sync: the data of every write that returned before the call
//!   began (logged before its start, or stamped before its call: a write racing the
//!   call may or may not be there), and the namespace operations `FsyncRule` names.
//! - fsync of a directory (`commit_now`, logged as an fsync of the directory's inode):
//!   the creates, links, renames and unlinks in it.
//! - With `flush_on_close` (auto_da_alloc): a truncation to zero of a file with data
//!   on disk is journaled with the rewrite, so the file holds its old content or its
//!   new one, never a mix, and once that truncation is durable, every write before the
//!   close that resolved it is there too.
//! - With `flush_on_close`, a rename over another name (the workload's `Replace`: a
//!   new file written, renamed over an existing name without fsync, closed): once the
//!   rename is durable, the renamed file holds every sector that the first write of
//!   its block put there before the rename, if the file was created in the log and
//!   never truncated or zeroed since (its blocks are newly allocated, and a block's
//!   first copy holds its first write). Later writes to a block may have landed in
//!   place over it, which the rename does not wait for (ext4's data=ordered), and
//!   writes after or racing the rename are not covered.
//! - Always: no garbage, nothing a durable truncate cut away, no size beyond any the
//!   file had.
//!
//! The checker ([`check`]) is a pure function of the log and the recovered state, so
//! tests feed it states with known violations.
//!
//! Threads: two by default, because one thread never has a namespace operation, a
//! write and an fsync of different files in flight at once, and group commit, a
//! commit racing new records, and writeback racing a truncate only happen with several.
//! The price is ordering, paid by the log's lock (above).
//!
//! Seeds: cut i uses seed `--seed + i`. The seed fixes each thread's operations, where
//! the cut is placed, the device's timing model and which sectors a torn cut keeps of a
//! given set of writes. It does not fix how the threads interleave, nor when the
//! flusher and the committer run (real time), so rerunning a seed hits the same kind of
//! moment, not always the same one.
//!
//! Replay files ([`replay`]): a failing cut writes the device's image after the cut, the
//! operation log and the device's write log (a log-writes layer sits under the volume)
//! to `crash-seed-SEED.replay`, and `--replay FILE` rebuilds that image on a memory
//! device and runs the same checks: the same result every time. Making the workload
//! itself replay from its seed would take one scheduler stepping every thread of the
//! stack (TigerBeetle's and FoundationDB's simulators): the flusher, the committer, the
//! device's completion timer and wbt's window timer would become tasks polled by it on
//! the injected clock instead of threads sleeping on condition variables, and the
//! workload's threads would yield to it at each operation.
//!
//! `CRASHTEST_DEBUG=1` prints, for every failing cut, the whole operation log, the
//! recovered tree and fsck's notes on stderr.

use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::mpsc;
use std::time::Instant;
use wbstack::block::QueueConfig;

mod check;
mod cut;
mod probe;
mod replay;
mod second_life;
mod states;
mod workload;

pub use check::*;
pub use cut::*;
pub use probe::*;
pub use replay::*;
pub use second_life::*;
pub use states::*;
pub use workload::*;

/// Cuts by what was inside the device when the power went.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Landed {
    pub journal: u64,
    pub checkpoint: u64,
    pub data: u64,
    pub flush: u64,
    pub superblock: u64,
    /// Nothing inside the device.
    pub idle: u64,
    /// A commit, checkpoint or flush (PREFLUSH/FUA) inside the device.
    pub preflush_fua: u64,
    /// Completed writes not yet flushed from the device's cache.
    pub unflushed: u64,
    /// By how the cut was placed.
    pub mode_io: u64,
    pub mode_now: u64,
    pub mode_fsync: u64,
    pub mode_journal: u64,
    pub mode_checkpoint: u64,
    pub mode_end: u64,
}

/// One line per cut in the JSON: what it did, where it landed, what it found.
#[derive(Clone, Debug, Serialize)]
pub struct CutLine {
    pub cut: u64,
    pub seed: u64,
    pub mode: Option<Mode>,
    pub placed_at: Option<u64>,
    pub landed_at_op: u64,
    pub in_flight: String,
    pub ops: u64,
    pub fsyncs_acked: u64,
    pub commits: u64,
    pub checkpoints: u64,
    pub fsynced_bytes_lost: u64,
    pub garbage_blocks_exposed: u64,
    pub fsck_errors: u64,
    pub ok: bool,
    pub seconds: f64,
}

impl CutLine {
    fn of(r: &CutReport) -> CutLine {
        CutLine {
            cut: r.cut,
            seed: r.seed,
            mode: r.plan.map(|p| p.mode),
            placed_at: r.placed_at,
            landed_at_op: r.landing.op,
            in_flight: r.landing.describe(),
            ops: r.ops,
            fsyncs_acked: r.fsyncs_acked + r.fdatasyncs_acked + r.syncs_acked,
            commits: r.journal_commits,
            checkpoints: r.journal_checkpoints,
            fsynced_bytes_lost: r.verdict.fsynced_bytes_lost,
            garbage_blocks_exposed: r.verdict.garbage_blocks_exposed,
            fsck_errors: r.fsck_errors,
            ok: !r.failed(),
            seconds: r.seconds,
        }
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Summary {
    pub device: String,
    pub seed: u64,
    pub threads: usize,
    pub ops_per_cut: u64,
    pub fsync_rule: Option<FsyncRule>,
    pub cuts: u64,
    pub failed_cuts: u64,
    pub ops: u64,
    pub fsyncs_acked: u64,
    pub fdatasyncs_acked: u64,
    pub syncs_acked: u64,
    pub fsynced_bytes_lost: u64,
    pub garbage_blocks_exposed: u64,
    pub stale_sectors_exposed: u64,
    pub size_errors: u64,
    /// flush_on_close's replace promise: see `Verdict::renamed_bytes_lost`.
    pub renamed_bytes_lost: u64,
    pub fsck_errors: u64,
    pub mount_failures: u64,
    pub recovery_errors: u64,
    pub namespace_not_prefix: u64,
    pub fsynced_ops_lost: u64,
    pub fsynced_ops_lost_inode_rule: u64,
    pub unexpected_errors: u64,
    pub hangs: u64,
    pub journal_commits: u64,
    pub journal_checkpoints: u64,
    pub journal_data_fsyncs: u64,
    pub journal_data_blocks: u64,
    pub journal_commits_overlapped: u64,
    /// Second lives run (`second_life`), the fsyncs they acknowledged, and those that
    /// failed.
    pub second_lives: u64,
    pub second_life_fsyncs_acked: u64,
    pub second_life_failures: u64,
    pub landed: Landed,
    pub seconds: f64,
    /// Every cut, in one line.
    pub per_cut: Vec<CutLine>,
    /// Every failed cut, in full.
    pub failures: Vec<CutReport>,
}

impl Summary {
    fn add(&mut self, r: &CutReport) {
        self.cuts += 1;
        self.ops += r.ops;
        self.fsyncs_acked += r.fsyncs_acked;
        self.fdatasyncs_acked += r.fdatasyncs_acked;
        self.syncs_acked += r.syncs_acked;
        let v = &r.verdict;
        self.fsynced_bytes_lost += v.fsynced_bytes_lost;
        self.garbage_blocks_exposed += v.garbage_blocks_exposed;
        self.stale_sectors_exposed += v.stale_sectors_exposed;
        self.size_errors += v.size_errors;
        self.renamed_bytes_lost += v.renamed_bytes_lost;
        self.fsck_errors += r.fsck_errors;
        self.mount_failures += r.mount_error.is_some() as u64;
        self.recovery_errors += r.recovery_error.is_some() as u64;
        self.namespace_not_prefix += v.namespace_not_prefix as u64;
        self.fsynced_ops_lost += v.fsynced_ops_lost as u64;
        self.fsynced_ops_lost_inode_rule += v.fsynced_ops_lost_inode_rule as u64;
        self.unexpected_errors += r.unexpected_errors.len() as u64;
        self.hangs += r.hang as u64;
        self.journal_commits += r.journal_commits;
        self.journal_checkpoints += r.journal_checkpoints;
        self.journal_data_fsyncs += r.journal_data_fsyncs;
        self.journal_data_blocks += r.journal_data_blocks;
        self.journal_commits_overlapped += r.journal_commits_overlapped;
        if let Some(l) = &r.second_life {
            self.second_lives += 1;
            self.second_life_fsyncs_acked += l.fsyncs_acked;
            self.second_life_failures += r.second_life_failed() as u64;
        }
        let l = &r.landing;
        let has = |a: &str| l.in_flight.contains_key(a) as u64;
        let d = &mut self.landed;
        d.journal += has("journal");
        d.checkpoint += has("checkpoint");
        d.data += has("data");
        d.flush += has("flush");
        d.superblock += has("superblock");
        d.idle += l.in_flight.is_empty() as u64;
        d.preflush_fua += (l.in_flight_preflush_fua > 0) as u64;
        d.unflushed += (l.unflushed_writes > 0) as u64;
        match r.plan.map(|p| p.mode) {
            Some(Mode::Io) => d.mode_io += 1,
            Some(Mode::Now) => d.mode_now += 1,
            Some(Mode::Fsync) => d.mode_fsync += 1,
            Some(Mode::Journal) => d.mode_journal += 1,
            Some(Mode::Checkpoint) => d.mode_checkpoint += 1,
            Some(Mode::End) => d.mode_end += 1,
            None => {}
        }
        self.per_cut.push(CutLine::of(r));
        if r.failed() {
            self.failed_cuts += 1;
            self.failures.push(r.clone());
        }
    }
}

pub(crate) fn validate(o: &CrashOpts) -> Result<(), String> {
    if o.cuts == 0 {
        return Err("--cuts must be at least 1".into());
    }
    if o.ops == 0 || o.ops > 1_000_000 {
        return Err(format!("--ops {}: must be from 1 to 1000000", o.ops));
    }
    if o.threads == 0 || o.threads > 64 {
        return Err(format!("--threads {}: must be from 1 to 64", o.threads));
    }
    if o.commit_ms == 0 {
        return Err("--commit-ms must be at least 1".into());
    }
    if o.jobs == 0 || o.jobs > 64 {
        return Err(format!("--jobs {}: must be from 1 to 64", o.jobs));
    }
    mount_options(o)?;
    let spec = cut_spec(&o.device, o.seed)?;
    // Every option of the spec is checked by opening it once.
    wbstack::dev::open(&spec, QueueConfig::default().clock).map_err(|e| e.to_string())?;
    Ok(())
}

pub(crate) fn progress_line(r: &CutReport, total: u64) -> String {
    let at = r.placed_at.map_or("end".to_string(), |a| a.to_string());
    let plan = match r.plan {
        Some(p) => match p.mode {
            Mode::Io => format!("io@{at}+{}", p.n),
            Mode::Now => format!("now@{at}"),
            Mode::Fsync => format!("fsync@{at}+{}", p.n),
            Mode::Journal => format!("commit@{at}"),
            Mode::Checkpoint => format!("ckpt@{at}"),
            Mode::End => format!("end+{}", p.n),
        },
        None => "-".into(),
    };
    format!(
        "[{:>4}/{total}] seed {:<6} {:<13} at op {:>4}: {}; {} ops, {} fsyncs, {} commits, {} ckpt  {} ({:.2}s)",
        r.cut + 1,
        r.seed,
        plan,
        r.landing.op,
        r.landing.describe(),
        r.ops,
        r.fsyncs_acked + r.fdatasyncs_acked + r.syncs_acked,
        r.journal_commits,
        r.journal_checkpoints,
        if r.failed() {
            match &r.replay_file {
                Some(f) => format!("FAIL: {} (replay: --replay {f})", r.reasons()),
                None => format!("FAIL: {}", r.reasons()),
            }
        } else {
            "ok".into()
        },
        r.seconds
    )
}

/// Run every cut; cut i uses seed `o.seed + i`.
pub fn run(o: &CrashOpts) -> Result<Summary, String> {
    validate(o)?;
    let t0 = Instant::now();
    let mut s = Summary {
        device: cut_spec(&o.device, o.seed)?
            .rsplit_once(",seed=")
            .map(|x| x.0.to_string())
            .unwrap_or_default(),
        seed: o.seed,
        threads: o.threads,
        ops_per_cut: o.ops,
        fsync_rule: Some(o.rule),
        ..Summary::default()
    };
    // Up to `jobs` cuts at once (a simulated disk's cuts mostly wait on its clock).
    // Each runs on its own thread, so a hang (a thread of the filesystem or the workload
    // that never returns after the power went) is reported, not waited on.
    let (tx, rx) = mpsc::channel::<CutReport>();
    let mut started: BTreeMap<u64, Instant> = BTreeMap::new();
    let mut next = 0u64;
    let mut reports = Vec::new();
    while next < o.cuts || !started.is_empty() {
        while next < o.cuts && started.len() < o.jobs.max(1) {
            let i = next;
            let seed = o.seed.wrapping_add(i);
            let (tx, oc) = (tx.clone(), o.clone());
            std::thread::Builder::new()
                .name(format!("crash-cut{i}"))
                .spawn(move || {
                    // The receiver is gone only when this cut was already reported hung.
                    tx.send(run_cut(&oc, i, seed)).ok();
                })
                .map_err(|e| format!("cannot start a cut thread: {e}"))?;
            started.insert(i, Instant::now());
            next += 1;
        }
        let (&oldest, &at) = started
            .iter()
            .min_by_key(|(_, t)| **t)
            .expect("a cut is in flight");
        let left = CUT_LIMIT.saturating_sub(at.elapsed());
        let r = match rx.recv_timeout(left) {
            Ok(r) if started.remove(&r.cut).is_some() => r,
            // A late report of a cut already counted as hung.
            Ok(_) => continue,
            Err(_) => {
                started.remove(&oldest);
                let seed = o.seed.wrapping_add(oldest);
                // Taken now, while the hung cut's threads still wait where they hang
                // (the other cuts' too; `crash-cut<N>` names a cut's own thread).
                let stacks = crate::util::thread_stacks().unwrap_or_else(|e| e);
                eprintln!(
                    "crashtest: cut {oldest} (seed {seed}) hung; every thread's stack:\n{stacks}"
                );
                CutReport {
                    cut: oldest,
                    seed,
                    plan: Some(CutPlan::new(seed, o.ops)),
                    hang: true,
                    hang_stacks: Some(stacks),
                    seconds: CUT_LIMIT.as_secs_f64(),
                    ..CutReport::default()
                }
            }
        };
        if o.progress {
            eprintln!("{}", progress_line(&r, o.cuts));
        }
        reports.push(r);
    }
    // The summary in cut order, whatever order they finished in.
    reports.sort_by_key(|r| r.cut);
    for r in &reports {
        s.add(r);
    }
    s.seconds = t0.elapsed().as_secs_f64();
    Ok(s)
}

pub fn print_human(s: &Summary) {
    println!(
        "crashtest: {} cut(s) on {}, {} thread(s), {} operations per cut, seeds {}..{}, fsync rule {}",
        s.cuts,
        s.device,
        s.threads,
        s.ops_per_cut,
        s.seed,
        s.seed + s.cuts.saturating_sub(1),
        match s.fsync_rule {
            Some(FsyncRule::Inode) => "inode",
            _ => "global",
        }
    );
    println!(
        "  workload: {} ops, {} fsyncs + {} fdatasyncs + {} syncs acknowledged, {} commits ({} written beside an earlier one in flight), {} checkpoints; {} fsyncs journaled their data ({} blocks)",
        s.ops,
        s.fsyncs_acked,
        s.fdatasyncs_acked,
        s.syncs_acked,
        s.journal_commits,
        s.journal_commits_overlapped,
        s.journal_checkpoints,
        s.journal_data_fsyncs,
        s.journal_data_blocks
    );
    println!(
        "  second lives (the recovered volume mounted again, files fsynced, cut again, recovered again): {}, {} fsyncs acknowledged",
        s.second_lives, s.second_life_fsyncs_acked
    );
    let l = &s.landed;
    println!(
        "  placed: after n requests {} / now {} / in an fsync {} / on a commit {} / on a checkpoint {} / at the end {}",
        l.mode_io, l.mode_now, l.mode_fsync, l.mode_journal, l.mode_checkpoint, l.mode_end
    );
    println!(
        "  landed with in flight: journal {}, checkpoint {}, data {}, flush {}, superblock {}; a commit/flush (PREFLUSH|FUA) {}; nothing {}; unflushed writes in the cache {}",
        l.journal, l.checkpoint, l.data, l.flush, l.superblock, l.preflush_fua, l.idle, l.unflushed
    );
    let rows: [(&str, u64); 14] = [
        ("fsynced_bytes_lost", s.fsynced_bytes_lost),
        ("garbage_blocks_exposed", s.garbage_blocks_exposed),
        ("stale_sectors_exposed", s.stale_sectors_exposed),
        ("size_errors", s.size_errors),
        ("renamed_bytes_lost", s.renamed_bytes_lost),
        ("fsck_errors", s.fsck_errors),
        ("mount_failures", s.mount_failures),
        ("recovery_errors", s.recovery_errors),
        ("namespace_not_prefix", s.namespace_not_prefix),
        ("fsynced_ops_lost", s.fsynced_ops_lost),
        ("fsynced_ops_lost_inode_rule", s.fsynced_ops_lost_inode_rule),
        ("unexpected_errors", s.unexpected_errors),
        ("hangs", s.hangs),
        ("second_life_failures", s.second_life_failures),
    ];
    for (k, v) in rows {
        println!("  {k:<28} {v}");
    }
    println!(
        "  failed cuts                  {} of {}   ({:.1}s)",
        s.failed_cuts, s.cuts, s.seconds
    );
    for f in &s.failures {
        println!();
        let replay = match &f.replay_file {
            Some(file) => format!("--replay {file} rebuilds its crash state"),
            None => format!("--seed {} --cuts 1 reruns its schedule", f.seed),
        };
        println!("cut {} FAILED ({replay}): {}", f.cut, f.reasons());
        if let Some(p) = f.plan {
            println!(
                "  placed {:?} at op {} (n={}); landed at op {}: {}",
                p.mode,
                f.placed_at.map_or("end".to_string(), |a| a.to_string()),
                p.n,
                f.landing.op,
                f.landing.describe()
            );
        }
        println!(
            "  prefix {:?} of {} journaled ops (candidates {:?}; required {}, inode rule {})",
            f.verdict.prefix,
            f.verdict.journaled_ops,
            f.verdict.prefix_candidates,
            f.verdict.required_prefix,
            f.verdict.required_prefix_inode_rule
        );
        for n in &f.fsck_notes {
            println!("  fsck: {n}");
        }
        for p in f
            .verdict
            .problems
            .iter()
            .chain(&f.fsck_problems)
            .chain(&f.unexpected_errors)
        {
            println!("  - {p}");
        }
    }
}

/// `wbstack crashtest`: run, print, and return the exit code (0 every cut passed, 1 some
/// failed).
pub fn cli(o: &CrashOpts, json: bool) -> Result<u8, String> {
    let s = run(o)?;
    if json {
        println!("{}", serde_json::to_string(&s).map_err(|e| e.to_string())?);
    } else {
        print_human(&s);
    }
    Ok(if s.failed_cuts > 0 { 1 } else { 0 })
}
