//! `wbstack bench fsmark|tardd|readlat` as a user runs them on a directory.

use serde_json::Value;
use std::process::{Command, Output};

fn wbstack(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_wbstack"))
        .args(args)
        .output()
        .expect("run wbstack")
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

/// The one JSON object a --json run on one target prints.
fn json(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = String::from_utf8_lossy(&out.stdout);
    assert_eq!(s.lines().count(), 1, "one line per target: {s}");
    serde_json::from_str(&s).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"))
}

#[test]
fn fsmark_json_and_table() {
    let dir = tmp();
    let d = dir.path().to_str().unwrap();
    let v = json(&wbstack(&[
        "bench",
        "fsmark",
        "--dir-path",
        d,
        "-d",
        "a",
        "-d",
        "b",
        "-D",
        "4",
        "-N",
        "5",
        "-n",
        "40",
        "-s",
        "4k",
        "-L",
        "2",
        "-S",
        "0",
        "--json",
    ]));
    assert_eq!(v["tool"], "fsmark");
    assert_eq!(v["threads"], 2);
    let loops = v["loops"].as_array().unwrap();
    assert_eq!(loops.len(), 2);
    assert_eq!(loops[1]["count"], 160);
    for k in [
        "files_per_sec",
        "app_overhead_us",
        "wall_s",
        "cpu_s",
        "fsyncs",
        "fsuse_pct",
    ] {
        assert!(loops[0][k].is_number(), "{k}: {}", loops[0]);
    }
    for k in [
        "write_ios",
        "write_iops",
        "write_mib_s",
        "avg_write_kib",
        "flushes",
    ] {
        assert!(
            loops[0].get(k).is_some(),
            "{k} (null if no device): {}",
            loops[0]
        );
    }
    let t = &v["totals"];
    assert_eq!(t["files"], 160);
    for k in [
        "files_per_sec",
        "files_per_sec_incl_sync",
        "wall_s",
        "sync_s",
        "cpu_s",
    ] {
        assert!(t[k].as_f64().unwrap() >= 0.0, "{k}: {t}");
    }
    assert!(t.get("write_ios_per_1000_files").is_some());
    // -L keeps the files: 4 subdirectories of each directory, 5 files per turn.
    for sub in ["a", "b"] {
        let n: usize = std::fs::read_dir(dir.path().join(sub))
            .unwrap()
            .map(|e| std::fs::read_dir(e.unwrap().path()).unwrap().count())
            .sum();
        assert_eq!(n, 80);
    }

    let out = wbstack(&[
        "bench",
        "fsmark",
        "--dir-path",
        d,
        "-d",
        "c",
        "-n",
        "30",
        "-s",
        "512",
        "-S",
        "A",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = String::from_utf8_lossy(&out.stdout);
    for want in [
        "#\tSync method: ASYNC_FLUSH_BEFORE_CLOSE",
        "#\tFiles info: size 512 bytes, written with an IO size of 16384 bytes per write",
        "FSUse%        Count         Size    Files/sec     App Overhead",
        "Average Files/sec:",
        "Including final sync: 30 files",
    ] {
        assert!(s.contains(want), "'{want}' missing in:\n{s}");
    }
}

#[test]
fn fsmark_async_flush_through_io_uring_or_the_thread_fallback() {
    let dir = tmp();
    let d = dir.path().to_str().unwrap();
    for (env, want) in [(None, "io_uring"), (Some("threads"), "threads")] {
        let mut c = Command::new(env!("CARGO_BIN_EXE_wbstack"));
        c.args([
            "bench",
            "fsmark",
            "--dir-path",
            d,
            "-d",
            "f",
            "-n",
            "50",
            "-s",
            "4k",
            "-S",
            "A",
            "--async-depth",
            "8",
            "--json",
        ]);
        if let Some(v) = env {
            c.env("WBSTACK_ASYNC_FLUSH", v);
        }
        let v = json(&c.output().unwrap());
        assert_eq!(v["async_mechanism"], want);
        assert_eq!(v["totals"]["fsyncs"], 50);
        assert_eq!(v["totals"]["files"], 50);
    }
}

#[test]
fn tardd_json() {
    let dir = tmp();
    let v = json(&wbstack(&[
        "bench",
        "tardd",
        "--dir-path",
        dir.path().to_str().unwrap(),
        "--files",
        "300",
        "--dd-size",
        "3M",
        "--json",
    ]));
    assert_eq!(v["tool"], "tardd");
    assert_eq!(
        v["files"].as_u64().unwrap() + v["symlinks"].as_u64().unwrap(),
        300
    );
    assert_eq!(v["dd_bytes"], 3 << 20);
    for k in ["tar_s", "dd_s", "total_s", "bytes"] {
        assert!(v[k].as_f64().unwrap() > 0.0, "{k}: {v}");
    }
    assert!(v.get("extra").is_some());
    assert_eq!(
        std::fs::metadata(dir.path().join("tardd/zero"))
            .unwrap()
            .len(),
        3 << 20
    );
}

#[test]
fn readlat_json_and_the_seeds_shape() {
    let dir = tmp();
    let d = dir.path().to_str().unwrap();
    let v = json(&wbstack(&[
        "bench",
        "readlat",
        "--dir-path",
        d,
        "--size",
        "512k",
        "--background-dd",
        "2M",
        "--json",
    ]));
    assert_eq!(v["tool"], "readlat");
    assert_eq!(v["blocks"], 128);
    for k in [
        "read_p50_us",
        "read_p99_us",
        "read_p9999_us",
        "read_max_us",
        "read_over",
        "write_p9999_us",
        "read_kib_s",
        "write_kib_s",
    ] {
        assert!(v[k].is_u64(), "{k}: {v}");
    }
    assert_eq!(v["read"]["percentiles"].as_array().unwrap().len(), 10);
    assert_eq!(v["write"]["samples"], 128);
    assert!(v["dd"]["bytes"].as_u64().unwrap() > 0);

    let out = wbstack(&["bench", "readlat", "--dir-path", d, "--size", "256k"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = s.lines().collect();
    let i = lines
        .iter()
        .position(|l| *l == "Latency percentiles (usec) (READERS)")
        .unwrap_or_else(|| panic!("no READERS header in:\n{s}"));
    assert!(lines[i + 1].starts_with("\t50.0000th: "));
    assert!(lines[i + 10].starts_with("\t99.9999th: "));
    assert!(lines[i + 11].starts_with("\tOver="));
    assert_eq!(lines[i + 12], "Latency percentiles (usec) (WRITERS)");
    assert!(lines[i + 24].starts_with("Read rate (KB/sec) : "));
    assert!(lines[i + 25].starts_with("Write rate (KB/sec): "));
}

#[test]
fn bad_input_is_a_clear_error() {
    let dir = tmp();
    let d = dir.path().to_str().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["bench", "fsmark", "-d", "x"], "--dir-path"),
        (
            &["bench", "fsmark", "--device", "sim:ssd,bogus=1", "-d", "x"],
            "bogus",
        ),
        (
            &["bench", "fsmark", "--device", "sim:ssd,size=4k", "-d", "x"],
            "too small",
        ),
        (&["bench", "fsmark", "--dir-path", d], "-d"),
        // --crash leaves the image for another process to replay: a device whose
        // contents end with this process is refused, naming why.
        (
            &["bench", "fsmark", "--device", "null", "-d", "x", "--crash"],
            "the null device keeps no data past this process",
        ),
        (
            &[
                "bench",
                "fsmark",
                "--device",
                "null,memory_backed=1",
                "-d",
                "x",
                "--crash",
            ],
            "the null device keeps no data past this process",
        ),
        (
            &["bench", "fsmark", "--dir-path", d, "-d", "x", "--crash"],
            "--crash needs one wbstack target on a file or block device",
        ),
        (
            &["bench", "fsmark", "--dir-path", d, "-d", "x", "-S", "2"],
            "sync method",
        ),
        (
            &["bench", "fsmark", "--dir-path", d, "-d", "x", "-D", "1"],
            "-D",
        ),
        (
            &["bench", "fsmark", "--dir-path", d, "-d", "x", "-s", "lots"],
            "size",
        ),
        (
            &[
                "bench",
                "tardd",
                "--dir-path",
                d,
                "--tar",
                "/nonexistent.tar",
            ],
            "nonexistent.tar",
        ),
        (&["bench", "readlat", "--dir-path", d, "--bs", "0"], "--bs"),
        (
            &["bench", "readlat", "--dir-path", d, "--target", "soon"],
            "target",
        ),
        (
            &["bench", "readlat", "--dir-path", d, "--file", "nope"],
            "nope",
        ),
    ];
    for (args, want) in cases {
        let out = wbstack(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.to_lowercase().contains(&want.to_lowercase()),
            "{args:?}: expected '{want}' in: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
}
