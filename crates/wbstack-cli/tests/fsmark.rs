//! fs_mark's semantics on a DirFs: names, sizes, subdirectory distribution, sync methods,
//! loops and the report's accounting.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use wbstack_cli::bench::benchfs::{BenchFs, DirFs};
use wbstack_cli::bench::fsmark::{self, FsmarkOpts, SyncMethod};

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

fn dirfs(p: &Path) -> Arc<dyn BenchFs> {
    Arc::new(DirFs::new(p).unwrap())
}

/// Every regular file under `dir`: path relative to it → size.
fn files_under(dir: &Path) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let t = e.file_type().unwrap();
            if t.is_dir() {
                stack.push(e.path());
            } else {
                let rel = e.path().strip_prefix(dir).unwrap().display().to_string();
                out.insert(rel, e.metadata().unwrap().len());
            }
        }
    }
    out
}

fn check_name(name: &str) {
    assert_eq!(name.len(), fsmark::NAME_LEN, "{name}");
    let (seq, rand) = name.split_at(fsmark::NAME_LEN - fsmark::RAND_LEN);
    let hex = seq.trim_end_matches('~');
    let sec = u64::from_str_radix(hex, 16).unwrap_or_else(|_| panic!("time stamp in {name}"));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(
        sec <= now && now - sec < 600,
        "{name}: stamp {sec} vs now {now}"
    );
    assert!(
        rand.bytes()
            .all(|b| b.is_ascii_digit() || b.is_ascii_uppercase()),
        "{name}"
    );
}

#[test]
fn files_have_fs_marks_names_sizes_and_counts() {
    let dir = tmp();
    let o = FsmarkOpts {
        dirs: vec!["t/0".into(), "t/1".into()],
        files: 50,
        size: 40_000,
        io_size: 16384,
        loops: 3,
        keep: true,
        sync: SyncMethod::None,
        ..Default::default()
    };
    let r = fsmark::run(&o, dirfs(dir.path())).unwrap();
    assert_eq!(r.threads, 2);
    assert_eq!(r.loops.len(), 3);
    for (i, l) in r.loops.iter().enumerate() {
        assert_eq!(l.files, 100);
        assert_eq!(l.count, 100 * (i as u64 + 1), "Count is cumulative");
        assert_eq!(l.size, 40_000);
        assert_eq!(l.fsyncs, 0);
        assert!(l.files_per_sec > 0.0 && l.wall_s > 0.0);
        assert!(l.fsuse_pct <= 100);
    }
    assert_eq!(r.totals.files, 300);
    assert!(r.totals.wall_s >= r.totals.loops_s);
    assert!(r.totals.files_per_sec_incl_sync > 0.0);
    let mut fps: Vec<f64> = r.loops.iter().map(|l| l.files_per_sec).collect();
    fps.sort_by(f64::total_cmp);
    assert!((r.totals.files_per_sec - fps.iter().sum::<f64>() / 3.0).abs() < 1e-6);
    for d in ["t/0", "t/1"] {
        let files = files_under(&dir.path().join(d));
        assert_eq!(files.len(), 150, "{d}: one thread, 50 files, 3 loops");
        for (name, size) in &files {
            assert!(!name.contains('/'), "no subdirectories without -D: {name}");
            check_name(name);
            assert_eq!(*size, 40_000);
        }
    }
    // Device figures are there exactly when the directory's device is known.
    let known = DirFs::new(dir.path()).unwrap().device_name().is_some();
    assert_eq!(r.totals.write_ios.is_some(), known);
    assert_eq!(r.totals.write_ios_per_1000_files.is_some(), known);
}

#[test]
fn round_robin_subdirectories_get_n_files_each() {
    let dir = tmp();
    let o = FsmarkOpts {
        dirs: vec!["rr".into()],
        subdirs: 4,
        per_subdir: 3,
        files: 24,
        size: 100,
        keep: true,
        sync: SyncMethod::None,
        ..Default::default()
    };
    fsmark::run(&o, dirfs(dir.path())).unwrap();
    let files = files_under(&dir.path().join("rr"));
    assert_eq!(files.len(), 24);
    let mut per: BTreeMap<String, usize> = BTreeMap::new();
    for name in files.keys() {
        let (sub, file) = name.split_once('/').expect("in a subdirectory");
        check_name(file);
        *per.entry(sub.to_string()).or_default() += 1;
    }
    assert_eq!(
        per.keys().cloned().collect::<Vec<_>>(),
        ["00", "01", "02", "03"],
        "%02x names, all four used"
    );
    assert!(
        per.values().all(|&n| n == 6),
        "3 files per turn, 2 turns: {per:?}"
    );
}

#[test]
fn time_hash_keeps_a_thread_in_one_subdirectory_within_the_interval() {
    let dir = tmp();
    let o = FsmarkOpts {
        dirs: vec!["th".into()],
        subdirs: 16,
        files: 200,
        size: 0,
        keep: true,
        sync: SyncMethod::None,
        ..Default::default()
    };
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    fsmark::run(&o, dirfs(dir.path())).unwrap();
    let files = files_under(&dir.path().join("th"));
    assert_eq!(files.len(), 200);
    let subs: std::collections::BTreeSet<&str> =
        files.keys().map(|n| n.split_once('/').unwrap().0).collect();
    assert_eq!(subs.len(), 1, "180 s per subdirectory: {subs:?}");
    // The starting subdirectory is the time modulo the count, as in fs_mark.
    let sub = u64::from_str_radix(subs.first().unwrap(), 16).unwrap();
    assert!(sub < 16);
    assert!(
        (before..before + 5).any(|t| t % 16 == sub),
        "started at {sub}, time {before}"
    );
    assert!(files.values().all(|&s| s == 0));
}

#[test]
fn sync_methods_count_fsyncs_and_unlink_without_keep() {
    let dir = tmp();
    for (sync, depth) in [(SyncMethod::Fsync, 1), (SyncMethod::Async, 4)] {
        let o = FsmarkOpts {
            dirs: vec!["s".into()],
            threads: 2,
            files: 20,
            size: 4096,
            loops: 2,
            keep: false,
            sync,
            async_depth: depth,
            ..Default::default()
        };
        let r = fsmark::run(&o, dirfs(dir.path())).unwrap();
        assert_eq!(r.threads, 2, "two threads in one directory");
        assert_eq!(r.totals.fsyncs, 80, "{sync:?}: one per file");
        assert_eq!(r.loops[1].count, 80);
        assert_eq!(
            r.async_mechanism.is_some(),
            sync == SyncMethod::Async,
            "{sync:?}"
        );
        assert!(
            files_under(&dir.path().join("s")).is_empty(),
            "without -k/-L each loop's files are removed"
        );
    }
}

#[test]
fn bad_options_are_errors() {
    let dir = tmp();
    let fs = dirfs(dir.path());
    let base = FsmarkOpts {
        files: 1,
        ..Default::default()
    };
    let cases: Vec<(FsmarkOpts, &str)> = vec![
        (
            FsmarkOpts {
                dirs: vec![],
                ..base.clone()
            },
            "-d",
        ),
        (
            FsmarkOpts {
                subdirs: 1,
                ..base.clone()
            },
            "-D",
        ),
        (
            FsmarkOpts {
                per_subdir: 3,
                ..base.clone()
            },
            "-N",
        ),
        (
            FsmarkOpts {
                dirs: vec!["a".into(), "b".into()],
                threads: 3,
                ..base.clone()
            },
            "multiple",
        ),
        (
            FsmarkOpts {
                size: u64::MAX / 4,
                ..base.clone()
            },
            "insufficient free space",
        ),
    ];
    for (o, want) in cases {
        let e = fsmark::run(&o, fs.clone()).err().unwrap();
        assert!(e.contains(want), "expected '{want}' in: {e}");
    }
    assert!(SyncMethod::parse("2").is_err());
    assert_eq!(SyncMethod::parse("A").unwrap(), SyncMethod::Async);
}

#[test]
fn table_lines_have_fs_marks_columns() {
    let o = FsmarkOpts::default();
    let h = fsmark::header(&o, 2);
    assert!(h.iter().any(|l| l.contains("2 thread(s)")));
    assert!(h
        .iter()
        .any(|l| l.contains("40 bytes long, (16 initial bytes")));
    assert!(h
        .last()
        .unwrap()
        .starts_with("FSUse%        Count         Size    Files/sec     App Overhead"));
    let l = fsmark::FsmarkLoop {
        fsuse_pct: 3,
        count: 80000,
        size: 4096,
        files_per_sec: 99066.04,
        app_overhead_us: 545242,
        files: 80000,
        wall_s: 1.0,
        cpu_s: 1.0,
        fsyncs: 0,
        write_ios: None,
        write_iops: None,
        write_mib_s: None,
        avg_write_kib: None,
        flushes: None,
        journal_commits: None,
    };
    assert!(
        fsmark::loop_line(&l)
            .starts_with("     3        80000         4096      99066.0           545242"),
        "{}",
        fsmark::loop_line(&l)
    );
}

/// Without -k the last loop's files are deleted only after the final sync, so the
/// sync that "including final sync" times writes them: deleted first, their dirty
/// pages died with them and the sync had nothing to write.
#[test]
fn the_final_sync_writes_the_last_loops_files_before_they_are_deleted() {
    let vol = wbstack_cli::bench::volfs::open_vol("sim:ssd,size=256M", "").unwrap();
    let fs: Arc<dyn BenchFs> = vol.clone();
    let o = FsmarkOpts {
        dirs: vec!["s".into()],
        files: 300,
        size: 4096,
        loops: 2,
        keep: false,
        ..Default::default()
    };
    let r = fsmark::run(&o, fs).unwrap();
    let written_kib = r.totals.write_ios.unwrap() as f64 * r.totals.avg_write_kib.unwrap();
    assert!(
        written_kib >= 300.0 * 4.0,
        "the final sync wrote {written_kib} KiB for 300 files of 4 KiB"
    );
    let left = vol.volume().readdir("/s").unwrap();
    assert!(left.is_empty(), "{} files left after the run", left.len());
}

/// The totals' counts cover the loops and the final sync and nothing else: without a
/// final sync they are exactly the loops' sums, and the unlinks between loops (untimed)
/// are left out, as fs_mark leaves them out of its times.
#[test]
fn the_totals_count_the_loops_and_the_final_sync_only() {
    let vol = wbstack_cli::bench::volfs::open_vol("sim:ssd,size=256M", "").unwrap();
    let fs: Arc<dyn BenchFs> = vol.clone();
    let o = FsmarkOpts {
        dirs: vec!["w".into()],
        files: 60,
        size: 4096,
        loops: 3,
        keep: false,
        sync: SyncMethod::Fsync,
        final_sync: false,
        ..Default::default()
    };
    let commits0 = vol.volume().journal_stats().commits;
    let r = fsmark::run(&o, fs.clone()).unwrap();
    let commits_whole_run = vol.volume().journal_stats().commits - commits0;
    let t = &r.totals;
    let sum = |f: fn(&fsmark::FsmarkLoop) -> Option<u64>| -> u64 {
        r.loops.iter().map(|l| f(l).unwrap()).sum()
    };
    assert_eq!(t.fsyncs, 180);
    assert_eq!(t.write_ios.unwrap(), sum(|l| l.write_ios));
    assert_eq!(t.flushes.unwrap(), sum(|l| l.flushes));
    assert_eq!(t.journal_commits.unwrap(), sum(|l| l.journal_commits));
    for l in &r.loops {
        // One thread: each fsync has new data of its own to write.
        assert!(l.write_ios.unwrap() >= l.fsyncs, "{l:?}");
        assert!(l.journal_commits.unwrap() >= 1, "{l:?}");
    }
    // The window lies within the run.
    assert!(
        commits_whole_run >= t.journal_commits.unwrap(),
        "{commits_whole_run} commits in the whole run, {} in the loops",
        t.journal_commits.unwrap()
    );
}
