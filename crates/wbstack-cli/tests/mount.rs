//! The FUSE mount as a person uses it: `wbstack mount`, ordinary programs on it
//! (tar, cp, sh), outside suites (pjdfstest, fsx), the control directory, umount with
//! fsck clean, and SIGKILL of the daemon losing nothing fsynced. These need root,
//! /dev/fuse and fusermount3, pjdfstest and fsx (scripts/test installs them); a
//! missing one fails the test with what to install, never skips it.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_wbstack")
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    out
}

fn ok(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn sh(script: &str) -> String {
    ok(Command::new("sh").arg("-c").arg(script))
}

fn need(tool: &str, package: &str) {
    let found = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "{tool} is missing: run scripts/test (it installs {package})"
    );
}

fn need_root() {
    let uid = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|u| u.split_whitespace().nth(1).map(str::to_string))
        })
        .unwrap_or_default();
    assert_eq!(
        uid, "0",
        "the mount tests run as root (FUSE mounts, other uids)"
    );
    need("fusermount3", "fuse3");
}

/// A mounted volume, unmounted (and waited for) when dropped.
struct Mounted {
    dir: tempfile::TempDir,
    live: bool,
}

impl Mounted {
    fn new(source: &str, opts: &[&str]) -> Mounted {
        need_root();
        let dir = tempfile::tempdir().expect("tempdir");
        let mut args = vec!["mount".to_string(), source.to_string()];
        args.push(dir.path().to_string_lossy().into_owned());
        for o in opts {
            args.push("-o".into());
            args.push(o.to_string());
        }
        ok(Command::new(bin()).args(&args));
        Mounted { dir, live: true }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn p(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    fn umount(mut self) {
        ok(Command::new(bin()).arg("umount").arg(self.path()));
        self.live = false;
    }

    /// The daemon's pid (its `.wbstack/pid`).
    fn pid(&self) -> i32 {
        let s = std::fs::read_to_string(self.p(".wbstack/pid")).unwrap();
        s.trim()
            .parse()
            .unwrap_or_else(|e| panic!("pid {s:?}: {e}"))
    }

    /// After the daemon was killed: `wbstack umount` detaches the dead mount, so that
    /// the image can be mounted again (which replays its journal).
    fn detach_dead(mut self) {
        ok(Command::new(bin()).arg("umount").arg(self.path()));
        self.live = false;
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if self.live {
            let r = Command::new(bin()).arg("umount").arg(self.path()).output();
            if r.as_ref().map_or(true, |o| !o.status.success()) {
                // What a failed test left behind must not stay mounted.
                let _detached = Command::new("fusermount3")
                    .arg("-uz")
                    .arg(self.path())
                    .status();
            }
        }
    }
}

fn image(size: &str) -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().expect("tempdir");
    let img = d.path().join("fs.img");
    ok(Command::new(bin()).args(["mkfs", img.to_str().unwrap(), "--size", size]));
    (d, img)
}

fn fsck_clean(img: &Path) {
    let out = run(Command::new(bin()).arg("fsck").arg(img));
    assert_eq!(
        out.status.code(),
        Some(0),
        "fsck: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn mount_errors_are_one_clear_line() {
    need_root();
    let dir = tempfile::tempdir().unwrap();
    let cases: [(Vec<String>, &str); 4] = [
        (
            vec![
                "/nonexistent/fs.img".into(),
                dir.path().to_string_lossy().into(),
            ],
            "no such image",
        ),
        (
            vec!["sim:ssd".into(), "/nonexistent/dir".into()],
            "No such file",
        ),
        (
            vec![
                "sim:ssd".into(),
                dir.path().to_string_lossy().into(),
                "-o".into(),
                "dirty_ratio=300".into(),
            ],
            "percentage",
        ),
        (
            vec![
                "sim:ssd".into(),
                dir.path().to_string_lossy().into(),
                "-o".into(),
                "no_such_option=1".into(),
            ],
            "no_such_option",
        ),
    ];
    for (args, want) in cases {
        let out = run(Command::new(bin()).arg("mount").args(&args));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} mounted");
        assert!(err.contains(want), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
    }
    // A busy mount point.
    let m = Mounted::new("sim:ssd,size=256M", &[]);
    let out = run(Command::new(bin())
        .arg("mount")
        .arg("sim:ssd")
        .arg(m.path()));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("already a mount point"));
    m.umount();
}

#[test]
fn control_directory_knobs_change_behaviour_and_refuse_bad_values_and_strangers() {
    let m = Mounted::new("sim:ssd,size=512M", &["allow_other"]);
    let ctl = m.p(".wbstack");
    // Not listed in the root, but there.
    assert!(!sh(&format!("ls -a {}", m.path().display())).contains(".wbstack"));
    let stat = || sh(&format!("cat {}/stat", ctl.display()));
    let field = |s: &str, k: &str| -> i64 {
        s.lines()
            .find_map(|l| l.strip_prefix(&format!("{k} ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {k} in {s}"))
    };
    assert_eq!(field(&stat(), "wbt_enabled"), 1, "wbt is on by default");
    sh(&format!("echo 0 > {}/wbt_lat_usec", ctl.display()));
    assert_eq!(
        field(&stat(), "wbt_enabled"),
        0,
        "wbt_lat_usec=0 turns wbt off"
    );
    assert_eq!(
        sh(&format!("cat {}/wbt_lat_usec", ctl.display())).trim(),
        "0"
    );
    // A bad value: EINVAL, the old value kept.
    // bash says which errno a failed echo met (dash only says "I/O error").
    let out = run(Command::new("bash")
        .arg("-c")
        .arg(format!("echo bogus > {}/dirty_ratio", ctl.display())));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("Invalid argument"));
    assert_eq!(
        sh(&format!("cat {}/dirty_ratio", ctl.display())).trim(),
        "20"
    );
    // Another uid: EACCES.
    let out = run(Command::new("bash")
        .arg("-c")
        .arg(format!("echo 5 > {}/dirty_ratio", ctl.display()))
        .uid(65534)
        .gid(65534));
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Permission denied"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        sh(&format!("cat {}/dirty_ratio", ctl.display())).trim(),
        "20"
    );
    // wbstack ctl, by name.
    let set = ok(Command::new(bin()).args(["ctl", m.path().to_str().unwrap(), "dirty_ratio=30"]));
    assert_eq!(set.trim(), "dirty_ratio=30");
    let all = ok(Command::new(bin()).args(["ctl", m.path().to_str().unwrap()]));
    assert!(
        all.contains("dirty_ratio=30") && all.contains("wbt_lat_usec=0"),
        "{all}"
    );
    // diskstats: the kernel's 17 fields after major, minor, name.
    let ds = sh(&format!("cat {}/diskstats", ctl.display()));
    assert_eq!(ds.split_whitespace().count(), 20, "{ds}");
    // iostat: a line per interval, JSON for machines.
    let io = ok(Command::new(bin()).args([
        "iostat",
        m.path().to_str().unwrap(),
        "0.2",
        "--count",
        "2",
        "--json",
    ]));
    assert_eq!(io.lines().count(), 2, "{io}");
    let v: serde_json::Value = serde_json::from_str(io.lines().next().unwrap()).unwrap();
    for k in [
        "r_s",
        "w_s",
        "wkb_s",
        "w_await",
        "aqu_sz",
        "util_pct",
        "dirty_pages",
        "wbt_step",
    ] {
        assert!(v.get(k).is_some(), "{k} missing in {v}");
    }
    m.umount();
}

/// A tree with what tar and cp must carry: symlinks, hard links, xattrs, FIFOs, odd
/// names (spaces, UTF-8, 255 bytes), empty and multi-block files.
fn make_tree(root: &Path) {
    need("setfattr", "attr");
    let long = "n".repeat(255);
    sh(&format!(
        r#"set -e; cd {root}
        mkdir -p 'dir with spaces/sub' ünïcødé empty
        printf 'hello\n' > 'dir with spaces/a file'
        head -c 300000 /dev/urandom > big.bin
        : > zero
        printf x > {long}
        ln -s 'dir with spaces/a file' link-to-file
        ln -s /nonexistent dangling
        ln big.bin hardlink.bin
        mkfifo ünïcødé/fifo
        setfattr -n user.color -v blue big.bin
        setfattr -n user.empty zero
        chmod 0750 'dir with spaces'; chmod 4755 zero
        touch -d '2001-02-03 04:05:06' ünïcødé"#,
        root = root.display()
    ));
}

/// Contents, metadata and xattrs of a tree, as text to compare.
fn describe(root: &Path) -> String {
    sh(&format!(
        r#"set -e; cd {}
        {{ find . ! -type d -printf '%p %y %m %U %G %s %n %l %TY%Tm%Td%TH%TM\n'; find . -mindepth 1 -type d -printf '%p %y %m %U %G %n %TY%Tm%Td%TH%TM\n'; }} | sort
        find . -type f -exec md5sum {{}} + | sort -k2
        getfattr -R -d -m user. . 2>/dev/null | grep -v '^$' | sort"#,
        root.display()
    ))
}

#[test]
fn tar_and_cp_trees_round_trip_through_unmount_fsck_and_remount() {
    need("tar", "tar");
    let src = tempfile::tempdir().unwrap();
    make_tree(src.path());
    let want = describe(src.path());
    // Hard-link counts differ inside one tree only if a link was lost.
    let (_d, img) = image("1G");
    let m = Mounted::new(img.to_str().unwrap(), &[]);
    sh(&format!(
        "mkdir {0}/cp {0}/tar && cp -a {1}/. {0}/cp/ && tar -C {1} --xattrs --xattrs-include='user.*' -cf - . | tar -C {0}/tar --xattrs --xattrs-include='user.*' -xpf -",
        m.path().display(),
        src.path().display()
    ));
    for sub in ["cp", "tar"] {
        let got = describe(&m.p(sub));
        assert_eq!(got, want, "{sub} differs from the source");
    }
    m.umount();
    fsck_clean(&img);
    let m = Mounted::new(img.to_str().unwrap(), &[]);
    for sub in ["cp", "tar"] {
        assert_eq!(describe(&m.p(sub)), want, "{sub} after remount");
    }
    m.umount();
    fsck_clean(&img);
}

/// FUSE over io_uring must be switched on in the fuse module (scripts/test does).
fn need_uring() {
    let p = "/sys/module/fuse/parameters/enable_uring";
    let on = std::fs::read_to_string(p).is_ok_and(|s| s.trim() == "Y");
    assert!(
        on,
        "{p} is off: run scripts/test (it switches FUSE over io_uring on)"
    );
}

/// Both transports serve the same tree: `uring=on` sends every request after the
/// mount through the rings (a thread per CPU's queue times `ring_threads`), and
/// `uring=off` none; the tree survives unmount, fsck and a remount through the other
/// transport.
#[test]
fn io_uring_and_dev_fuse_transports_serve_the_same_tree() {
    need_root();
    need_uring();
    need("tar", "tar");
    let src = tempfile::tempdir().unwrap();
    make_tree(src.path());
    let want = describe(src.path());
    let cpus = std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap();
    let cpus: u64 = cpus
        .trim()
        .rsplit(['-', ','])
        .next()
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap()
        + 1;
    let (_d, img) = image("1G");
    for (mode, other) in [("uring=on", "uring=off"), ("uring=off", "uring=on")] {
        let m = Mounted::new(img.to_str().unwrap(), &[mode, "ring_threads=3"]);
        sh(&format!(
            "rm -rf {0}/t && mkdir {0}/t && tar -C {1} --xattrs --xattrs-include='user.*' -cf - . | tar -C {0}/t --xattrs --xattrs-include='user.*' -xpf - && sync {0}/t/big.bin",
            m.path().display(),
            src.path().display()
        ));
        assert_eq!(describe(&m.p("t")), want, "{mode}");
        // One snapshot: each read of the file is itself a few requests.
        let stat = std::fs::read_to_string(m.p(".wbstack/stat")).unwrap();
        let field = |k: &str| -> u64 {
            stat.lines()
                .find_map(|l| l.strip_prefix(&format!("{k} ")))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or_else(|| panic!("no {k} in {stat}"))
        };
        let (threads, ring, all) = (
            field("fuse_ring_threads"),
            field("fuse_ring_requests"),
            field("fuse_requests"),
        );
        if mode == "uring=on" {
            assert_eq!(threads, 3 * cpus, "{mode}");
            // Only what came before the rings were ready used /dev/fuse (the ring
            // also counts requests no handler serves, as DESTROY).
            assert!(
                ring > 100 && ring + 5 >= all,
                "{mode}: {ring} of {all}: {stat}"
            );
        } else {
            assert_eq!((threads, ring), (0, 0), "{mode}: {all} requests");
        }
        m.umount();
        fsck_clean(&img);
        let m = Mounted::new(img.to_str().unwrap(), &[other]);
        assert_eq!(describe(&m.p("t")), want, "{mode}, then {other}");
        m.umount();
    }
    // A typo is refused with the choices, before anything is mounted.
    let dir = tempfile::tempdir().unwrap();
    let out = run(Command::new(bin()).args([
        "mount",
        img.to_str().unwrap(),
        dir.path().to_str().unwrap(),
        "-o",
        "uring=yes",
    ]));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("uring=yes: expected auto, on or off"), "{err}");
}

fn pin_to_cpu0() {
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET and sched_setaffinity
    // read and write inside it.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    assert_eq!(rc, 0, "pinning the test thread to CPU 0");
}

/// A handler that blocks holds only its own ring entry: an fsync waiting 3 s for a
/// slow device, from a thread on CPU 0, and creates from another thread on CPU 0
/// meanwhile. The kernel queues both on CPU 0's queue; with two ring threads there,
/// the creates go to the free one. (With `ring_threads=1` they wait for the fsync.)
#[test]
fn a_blocked_fsync_holds_one_ring_thread_and_its_cpus_other_requests_go_on() {
    need_root();
    need_uring();
    let m = Mounted::new("sim:ssd,size=256M", &["uring=on", "ring_threads=2"]);
    let slow = m.p("slow");
    std::fs::write(&slow, vec![1u8; 4096]).unwrap();
    // Requests by opcode are listed once there has been one.
    let fsyncs = |m: &Mounted| {
        let s = std::fs::read_to_string(m.p(".wbstack/stat")).unwrap();
        s.lines()
            .find_map(|l| l.strip_prefix("fuse_fsync "))
            .map_or(0, |v| v.trim().parse::<u64>().unwrap())
    };
    let before = fsyncs(&m);
    fault(&m, "spike 1:3s");
    let (tx, rx) = std::sync::mpsc::channel();
    let fsyncer = std::thread::spawn(move || {
        pin_to_cpu0();
        let f = std::fs::File::open(&slow).unwrap();
        let t0 = Instant::now();
        let r = f.sync_all();
        tx.send(t0.elapsed()).unwrap();
        r
    });
    // The fsync has reached its handler (counted on arrival) before the creates start.
    let t0 = Instant::now();
    while fsyncs(&m) == before {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the fsync never arrived"
        );
        std::thread::yield_now();
    }
    pin_to_cpu0();
    let t0 = Instant::now();
    for i in 0..50 {
        std::fs::write(m.p(&format!("c{i}")), b"x").unwrap();
    }
    let creates = t0.elapsed();
    assert!(
        rx.try_recv().is_err(),
        "the fsync ended before the creates did: the spike did not hold it"
    );
    assert!(
        creates < Duration::from_secs(2),
        "50 creates beside a blocked fsync on the same CPU took {creates:?}"
    );
    let fsync_took = rx.recv().unwrap();
    fsyncer.join().unwrap().unwrap();
    assert!(
        fsync_took >= Duration::from_secs(3),
        "fsync took {fsync_took:?}"
    );
    fault(&m, "clear");
    assert_eq!(stat_field(&m, "fuse_ring_threads") % 2, 0);
    m.umount();
}

/// readdir through the kernel resumes by cookie (the name hash): a walk that removes
/// each entry it is given, as `rm -r` does, while another thread creates and removes
/// names of its own, is given every original entry exactly once, and "." and ".."
/// come first.
#[test]
fn readdir_resumes_by_cookie_under_concurrent_creates_and_deletes() {
    const FILES: usize = 5000;
    let (_d, img) = image("256M");
    let m = Mounted::new(img.to_str().unwrap(), &[]);
    let dir = m.p("d");
    std::fs::create_dir(&dir).unwrap();
    for i in 0..FILES {
        std::fs::File::create(dir.join(format!("f{i}"))).unwrap();
    }
    let all = sh(&format!("ls -a -f {}", dir.display()));
    let first: Vec<&str> = all.lines().take(2).collect();
    assert_eq!(
        first,
        [".", ".."],
        "ls -a -f (directory order) begins with . and .."
    );
    assert_eq!(all.lines().count(), FILES + 2);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let mut seen = std::collections::BTreeSet::new();
    std::thread::scope(|s| {
        let churn = s.spawn(|| {
            let mut k = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let p = dir.join(format!("c{}", k % 32));
                if k % 64 < 32 {
                    std::fs::File::create(&p).unwrap();
                } else {
                    std::fs::remove_file(&p).unwrap();
                }
                k += 1;
            }
            k
        });
        for e in std::fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().into_string().unwrap();
            if name.starts_with('f') {
                assert!(seen.insert(name.clone()), "{name} given twice");
                std::fs::remove_file(e.path()).unwrap();
            } else {
                assert!(name.starts_with('c'), "a stranger: {name}");
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(
            churn.join().unwrap() > 0,
            "the walk never overlapped a change"
        );
    });
    assert_eq!(
        seen.len(),
        FILES,
        "entries present throughout were not given"
    );
    m.umount();
    fsck_clean(&img);
}

/// The pjdfstest cases known to fail on the mount, with why: the list only shrinks.
const KNOWN_FAILURES: &str =
    include_str!("../../wbstack-fuse/tests/suites/pjdfstest-known-failures.txt");

#[test]
fn pjdfstest_passes_on_the_mount_but_for_the_listed_cases() {
    need("pjdfstest", "pjdfstest (cargo install pjdfstest)");
    let conf =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../wbstack-fuse/tests/suites/pjdfstest.toml");
    let m = Mounted::new("sim:ssd,size=2G", &["allow_other"]);
    let work = tempfile::tempdir().unwrap();
    let out = run(Command::new("pjdfstest")
        .arg("-c")
        .arg(&conf)
        .arg("-p")
        .arg(m.path())
        .current_dir(work.path()));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let summary = text
        .lines()
        .find(|l| l.starts_with("Summary:"))
        .unwrap_or_else(|| panic!("pjdfstest gave no summary: {text}"));
    eprintln!("pjdfstest on the mount: {summary}");
    let known: Vec<&str> = KNOWN_FAILURES
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let failed: Vec<&str> = text
        .lines()
        .filter(|l| l.trim_end().ends_with("FAILED"))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let new: Vec<&&str> = failed.iter().filter(|f| !known.contains(f)).collect();
    assert!(
        new.is_empty(),
        "pjdfstest failures not in the known list: {new:?}\n{summary}"
    );
    let passed: u64 = summary
        .split(',')
        .find_map(|p| {
            p.trim()
                .strip_suffix(" passed")
                .and_then(|n| n.trim().parse().ok())
        })
        .unwrap_or(0);
    assert!(passed >= 300, "{summary}");
    m.umount();
}

#[test]
fn fsx_100k_operations_with_mmap_truncate_fallocate_and_punch_hole() {
    need("fsx", "fsx (cargo install fsx)");
    let conf = Path::new(env!("CARGO_MANIFEST_DIR")).join("../wbstack-fuse/tests/suites/fsx.toml");
    let m = Mounted::new("sim:ssd,size=1G", &[]);
    let art = tempfile::tempdir().unwrap();
    let ops = std::env::var("WBSTACK_FSX_OPS").unwrap_or_else(|_| "100000".into());
    let out = ok(Command::new("fsx")
        .arg("-f")
        .arg(&conf)
        .args(["-N", &ops, "-S", "20261124", "-P"])
        .arg(art.path())
        .arg(m.p("fsx.file")));
    assert!(out.contains("All operations completed A-OK"), "{out}");
    m.umount();
}

#[test]
fn sigkill_of_the_daemon_loses_nothing_fsynced() {
    let (_d, img) = image("1G");
    let m = Mounted::new(img.to_str().unwrap(), &[]);
    let pid = m.pid();
    // 4 writers: each file is written, fsynced, then named in its writer's log
    // (also fsynced), so every name in a log is a promise.
    let script = format!(
        r#"cd {dir} || exit 1; for t in 1 2 3 4; do (
            i=0; while [ $i -lt 400 ] && [ -e . ]; do
              f=t$t-$i; head -c $((4096 + i * 37)) /dev/urandom > $f.tmp
              python3 -c "import os,sys; fd=os.open('$f.tmp', os.O_RDWR); os.fsync(fd)"
              mv $f.tmp $f
              python3 -c "import os; fd=os.open('.', os.O_RDONLY); os.fsync(fd)"
              md5sum $f >> log$t; python3 -c "import os; fd=os.open('log$t', os.O_RDWR); os.fsync(fd)"
              i=$((i+1))
            done ) & done; wait"#,
        dir = m.path().display()
    );
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(&script)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Kill once a good number of files are promised.
    let start = Instant::now();
    loop {
        let n: usize = (1..=4)
            .map(|t| {
                std::fs::read_to_string(m.p(&format!("log{t}"))).map_or(0, |s| s.lines().count())
            })
            .sum();
        if n >= 40 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the writers made no progress"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let r = kill_9(pid);
    assert!(r, "kill -9 {pid}");
    let _writers = child.wait();
    m.detach_dead();
    let m = Mounted::new(img.to_str().unwrap(), &[]);
    let mut promised = 0;
    for t in 1..=4 {
        let log = std::fs::read_to_string(m.p(&format!("log{t}"))).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        // The last line may be torn (written, not yet fsynced): check all whole ones.
        for l in lines.iter().filter(|l| l.len() > 34) {
            let Some((sum, name)) = l.split_once("  ") else {
                continue;
            };
            let got = sh(&format!("cd {} && md5sum '{}'", m.path().display(), name));
            assert!(
                got.starts_with(sum),
                "{name}: fsynced, then lost or changed: {got}"
            );
            promised += 1;
        }
    }
    // Lines seen before the kill may not have been fsynced yet: only what the log
    // kept is a promise, and there must be a good number of them.
    assert!(promised >= 20, "only {promised} promised files checked");
    m.umount();
    fsck_clean(&img);
}

fn kill_9(pid: i32) -> bool {
    Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success())
}

/// A seeded random sequence of writes (some through O_DIRECT with aligned buffers),
/// truncates, reads and fsyncs on a few files, checked against an in-memory model at
/// every read, with an unmount and remount at a random point in the middle; after
/// it, every file equals its model.
#[test]
fn random_operations_with_o_direct_match_a_model_across_a_remount() {
    use rand::{Rng, SeedableRng};
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let seed: u64 = std::env::var("WBSTACK_MODEL_SEED").map_or(7, |s| s.parse().unwrap());
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let (_d, img) = image("512M");
    let mut m = Mounted::new(img.to_str().unwrap(), &[]);
    const FILES: usize = 4;
    let mut model: Vec<Vec<u8>> = vec![Vec::new(); FILES];
    for i in 0..FILES {
        std::fs::write(m.p(&format!("f{i}")), b"").unwrap();
    }
    let ops = 3000;
    let remount_at = rng.gen_range(ops / 4..ops * 3 / 4);
    for op in 0..ops {
        if op == remount_at {
            m.umount();
            fsck_clean(&img);
            m = Mounted::new(img.to_str().unwrap(), &[]);
        }
        let i = rng.gen_range(0..FILES);
        let path = m.p(&format!("f{i}"));
        let cur = &mut model[i];
        match rng.gen_range(0..10) {
            0..=3 => {
                let off = rng.gen_range(0..300_000u64);
                let len = rng.gen_range(1..20_000usize);
                let data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
                let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
                f.write_all_at(&data, off).unwrap();
                let end = off as usize + len;
                if cur.len() < end {
                    cur.resize(end, 0);
                }
                cur[off as usize..end].copy_from_slice(&data);
            }
            4..=5 => {
                // O_DIRECT: 4 KiB-aligned offset, length and buffer.
                let off = rng.gen_range(0..64u64) * 4096;
                let blocks = rng.gen_range(1..8usize);
                let mut buf = AlignedBuf::new(blocks * 4096);
                rng.fill(buf.as_mut());
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(&path)
                    .unwrap();
                f.write_all_at(buf.as_ref(), off).unwrap();
                let end = off as usize + buf.as_ref().len();
                if cur.len() < end {
                    cur.resize(end, 0);
                }
                cur[off as usize..end].copy_from_slice(buf.as_ref());
            }
            6 => {
                let len = rng.gen_range(0..320_000usize);
                let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
                f.set_len(len as u64).unwrap();
                cur.resize(len, 0);
            }
            7 => {
                let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
                if rng.gen() {
                    f.sync_all().unwrap()
                } else {
                    f.sync_data().unwrap()
                }
            }
            _ => {
                let direct = rng.gen_bool(0.3);
                let got = if direct {
                    let f = std::fs::OpenOptions::new()
                        .read(true)
                        .custom_flags(libc::O_DIRECT)
                        .open(&path)
                        .unwrap();
                    let mut buf = AlignedBuf::new(cur.len().next_multiple_of(4096).max(4096));
                    let mut n = 0;
                    loop {
                        let r = f.read_at(&mut buf.as_mut()[n..], n as u64).unwrap();
                        if r == 0 {
                            break;
                        }
                        n += r;
                    }
                    buf.as_ref()[..n].to_vec()
                } else {
                    std::fs::read(&path).unwrap()
                };
                assert!(
                    got == *cur,
                    "seed {seed} op {op}: f{i} differs from the model ({} vs {} bytes)",
                    got.len(),
                    cur.len()
                );
            }
        }
    }
    m.umount();
    fsck_clean(&img);
    let m = Mounted::new(img.to_str().unwrap(), &[]);
    for (i, want) in model.iter().enumerate() {
        assert!(
            std::fs::read(m.p(&format!("f{i}"))).unwrap() == *want,
            "seed {seed}: f{i} after the last remount"
        );
    }
    m.umount();
}

/// A 4 KiB-aligned buffer for O_DIRECT, from an over-allocated Vec (no unsafe).
struct AlignedBuf {
    raw: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> AlignedBuf {
        let raw = vec![0u8; len + 4096];
        let start = raw.as_ptr().align_offset(4096);
        AlignedBuf { raw, start, len }
    }
    fn as_ref(&self) -> &[u8] {
        &self.raw[self.start..self.start + self.len]
    }
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.raw[self.start..self.start + self.len]
    }
}

/// SIGTERM to the daemon: final writeback and checkpoint, exit 0, fsck clean, and
/// the data there at the next mount without any fsync.
#[test]
fn sigterm_unmounts_cleanly_with_everything_written() {
    let (_d, img) = image("256M");
    let mut m = Mounted::new(img.to_str().unwrap(), &[]);
    let pid = m.pid().to_string();
    sh(&format!(
        "head -c 5000000 /dev/zero | tr '\\0' 'w' > {}/unsynced",
        m.path().display()
    ));
    ok(Command::new("kill").args(["-TERM", &pid]));
    let start = Instant::now();
    while Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z")
    {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the daemon did not exit on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        !wbstack_fuse::is_mountpoint(m.path()),
        "still mounted after SIGTERM"
    );
    m.live = false;
    fsck_clean(&img);
    let m2 = Mounted::new(img.to_str().unwrap(), &[]);
    let data = std::fs::read(m2.p("unsynced")).unwrap();
    assert_eq!(data.len(), 5_000_000);
    assert!(data.iter().all(|&b| b == b'w'));
    m2.umount();
    drop(m);
}

/// `.wbstack/trace` streams trace events as JSON lines while it is read.
#[test]
fn the_trace_file_streams_events_while_the_volume_works() {
    let m = Mounted::new("sim:ssd,size=256M", &[]);
    let mut reader = Command::new("head")
        .args(["-n", "3"])
        .arg(m.p(".wbstack/trace"))
        .stdout(Stdio::piped())
        // head tries to seek back over what it read past its lines: a stream says no.
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Work that emits events (writeback, journal commits), until the reader has
    // its three lines.
    let start = Instant::now();
    let mut i = 0;
    let out = loop {
        sh(&format!(
            "echo {i} > {0}/f{i} && sync -f {0}/f{i}",
            m.path().display()
        ));
        i += 1;
        if let Ok(Some(_)) = reader.try_wait() {
            break reader.wait_with_output().unwrap();
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no trace events streamed"
        );
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let events: Vec<serde_json::Value> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    assert!(!events.is_empty(), "{text}");
    assert!(events
        .iter()
        .all(|e| e["event"].is_string() && e["ts_ns"].is_u64()));
    m.umount();
}

fn stat_field(m: &Mounted, k: &str) -> u64 {
    let s = std::fs::read_to_string(m.p(".wbstack/stat")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(&format!("{k} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {k} in {s}"))
}

fn fault(m: &Mounted, cmd: &str) {
    std::fs::write(m.p(".wbstack/faults"), format!("{cmd}\n")).unwrap();
}

fn fsync_errno(f: &std::fs::File) -> i32 {
    f.sync_all()
        .err()
        .and_then(|e| e.raw_os_error())
        .unwrap_or(0)
}

/// xfstests generic/441 through the mount: a data write that fails reaches fsync of
/// every descriptor open at the time, once each, and none opened later; then a
/// failed journal write shuts the volume down: changes get EROFS, reads still work.
/// Ordered data, so the fsync writes the data itself (a journaled small fsync would
/// make it durable in the commit; fs_errors covers its failed home write).
#[test]
fn eio_reaches_each_descriptor_once_and_a_dead_journal_gives_erofs() {
    use std::io::{Read, Write};
    let m = Mounted::new("sim:ssd,size=256M", &["journal_data_kb=0"]);
    let data_start = stat_field(&m, "data_start_sector");
    let p = m.p("f");
    let mut fd1 = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .unwrap();
    let fd2 = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .unwrap();
    fd1.write_all(&[b'x'; 8192]).unwrap();
    fault(&m, &format!("eio {data_start}-{} w", u64::MAX / 2));
    assert_eq!(fsync_errno(&fd1), libc::EIO, "fd1 hears of the error");
    assert_eq!(fsync_errno(&fd1), 0, "once");
    assert_eq!(fsync_errno(&fd2), libc::EIO, "fd2 hears of it too");
    assert_eq!(fsync_errno(&fd2), 0, "once");
    let fd3 = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    assert_eq!(fsync_errno(&fd3), 0, "a later opener was not there");
    fault(&m, "clear");
    fd1.write_all(&[b'y'; 4096]).unwrap();
    assert_eq!(fsync_errno(&fd1), 0, "the device works again");
    // The journal's area fails: the volume stops taking changes.
    fault(&m, &format!("eio 0-{data_start} w"));
    let mut g = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(m.p("g"))
        .unwrap();
    g.write_all(b"z").unwrap();
    assert_eq!(fsync_errno(&g), libc::EIO);
    let e = std::fs::File::create(m.p("h")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");
    let mut back = Vec::new();
    std::fs::File::open(&p)
        .unwrap()
        .read_to_end(&mut back)
        .unwrap();
    assert_eq!(back.len(), 12288, "reads still served");
    assert!(back[8192..].iter().all(|&b| b == b'y'));
    drop((fd1, fd2, fd3, g));
    m.umount();
}

/// Parallel writers fill the device: write(2) fails with ENOSPC, what was fsynced is
/// intact, and after deletions the volume takes writes again.
#[test]
fn enospc_under_parallel_writers_is_clean_and_recoverable() {
    use std::io::Write;
    let (_d, img) = image("96M");
    let m = Mounted::new(img.to_str().unwrap(), &[]);
    let dir = m.path().to_path_buf();
    let writers: Vec<_> = (0..4)
        .map(|t| {
            let dir = dir.clone();
            std::thread::spawn(move || {
                let chunk = vec![t as u8 + 1; 1 << 20];
                let mut synced = Vec::new();
                for n in 0.. {
                    let p = dir.join(format!("w{t}-{n}"));
                    let mut f = match std::fs::File::create(&p) {
                        Ok(f) => f,
                        Err(e) => return (synced, e.raw_os_error()),
                    };
                    if let Err(e) = f.write_all(&chunk).and_then(|_| f.sync_all()) {
                        return (synced, e.raw_os_error());
                    }
                    synced.push(p);
                }
                unreachable!()
            })
        })
        .collect();
    let mut all = Vec::new();
    for w in writers {
        let (synced, err) = w.join().unwrap();
        assert_eq!(err, Some(libc::ENOSPC), "each writer ends on ENOSPC");
        all.extend(synced);
    }
    assert!(
        all.len() >= 40,
        "only {} MiB written before ENOSPC",
        all.len()
    );
    for p in &all {
        let d = std::fs::read(p).unwrap();
        let t = d[0];
        assert!(
            d.len() == 1 << 20 && d.iter().all(|&b| b == t),
            "{}",
            p.display()
        );
    }
    for p in all.iter().take(10) {
        std::fs::remove_file(p).unwrap();
    }
    let mut f = std::fs::File::create(m.p("after")).unwrap();
    f.write_all(&vec![9u8; 4 << 20]).unwrap();
    f.sync_all().unwrap();
    drop(f);
    m.umount();
    fsck_clean(&img);
}

/// Latency spikes on the device never wedge the mount: a create-write-fsync
/// workload finishes within a bound.
#[test]
fn latency_spikes_do_not_deadlock_the_mount() {
    let m = Mounted::new("sim:ssd,size=256M", &[]);
    fault(&m, "spike 0.2:30ms");
    let dir = m.path().to_path_buf();
    let t0 = Instant::now();
    let workers: Vec<_> = (0..4)
        .map(|t| {
            let dir = dir.clone();
            std::thread::spawn(move || {
                for i in 0..40 {
                    let p = dir.join(format!("s{t}-{i}"));
                    std::fs::write(&p, vec![t as u8; 10_000]).unwrap();
                    std::fs::File::open(&p).unwrap().sync_all().unwrap();
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    assert!(
        t0.elapsed() < Duration::from_secs(120),
        "took {:?}",
        t0.elapsed()
    );
    // A bad fault command is refused.
    let e = std::fs::write(m.p(".wbstack/faults"), "spike 2:1ms\n").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
    m.umount();
}

/// Issue 15's soak, CI-sized: 16 threads of mixed self-checking load through the
/// mount for 2 minutes; no wrong read, no stall over 30 s, the daemon's memory under
/// its bound; then umount and fsck clean.
#[test]
fn a_two_minute_soak_through_the_mount_is_clean() {
    let (_d, img) = image("2G");
    let m = Mounted::new(img.to_str().unwrap(), &["cache_size=256M"]);
    let out = run(Command::new(bin()).args([
        "soak",
        m.path().to_str().unwrap(),
        "--threads",
        "16",
        "--duration",
        "120",
        "--stall",
        "30s",
        "--json",
    ]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
    assert!(v["ops"].as_u64().unwrap() > 10_000, "{v}");
    assert!(v["failures"].as_array().unwrap().is_empty(), "{v}");
    eprintln!("soak through the mount: {v}");
    m.umount();
    fsck_clean(&img);
}

/// The same on the library (a volume in this process): it found a commit waiting
/// forever for ordered data nobody was writing. A small page cache and inode cache keep
/// inodes being evicted and rebuilt under the load (issue 16).
#[test]
fn a_library_soak_is_clean() {
    library_soak("cache_size=4M,inode_cache=8");
}

/// The same with every directory read back unlisted (`dir_listed_max=0`): creates,
/// renames and deletes from 16 threads each read back their own names' groups.
#[test]
fn a_library_soak_on_unlisted_directories_is_clean() {
    library_soak("cache_size=4M,inode_cache=8,dir_listed_max=0");
}

fn library_soak(options: &str) {
    let out = run(Command::new(bin()).args([
        "soak",
        "sim:ssd,size=2G",
        "--threads",
        "16",
        "--duration",
        "20",
        "--stall",
        "10s",
        "-o",
        options,
        "--json",
    ]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
    assert!(v["failures"].as_array().unwrap().is_empty(), "{v}");
    assert!(v["check_problems"].as_array().unwrap().is_empty(), "{v}");
    assert!(v["fsyncs"].as_u64().unwrap() > 100, "{v}");
    assert!(v["inodes_evicted"].as_u64().unwrap() > 1000, "{v}");
    // The slowest operation is named, one of the kinds the soak runs.
    let slowest = v["slowest_op"].as_str().unwrap();
    assert!(
        [
            "create",
            "append",
            "overwrite",
            "truncate",
            "fsync",
            "rename",
            "delete",
            "read"
        ]
        .contains(&slowest),
        "{v}"
    );
}

/// O_APPEND writes land at the end, but a shared mmap's pages written back through an
/// append-mode descriptor land at their own offsets; O_RDONLY|O_TRUNC truncates, as on
/// Linux's own filesystems. Both survive a remount.
#[test]
fn append_mode_mmap_and_read_only_truncating_opens_behave_as_on_ext4() {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let (_d, img) = image("64M");
    let mut m = Mounted::new(img.to_str().unwrap(), &[]);
    std::fs::write(m.p("a"), b"hello world").unwrap();
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .append(true)
        .open(m.p("a"))
        .unwrap();
    f.write_all(b"!!").unwrap();
    let len = 13;
    // SAFETY: a shared mapping of `len` bytes of a file that long, written through the
    // pointer only within them, unmapped before the descriptor closes.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        );
        assert_ne!(p, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        *(p as *mut u8) = b'J';
        assert_eq!(libc::msync(p, len, libc::MS_SYNC), 0);
        assert_eq!(libc::munmap(p, len), 0);
    }
    drop(f);
    assert_eq!(std::fs::read(m.p("a")).unwrap(), b"Jello world!!");
    std::fs::write(m.p("t"), b"to be cut").unwrap();
    drop(
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_TRUNC)
            .open(m.p("t"))
            .unwrap(),
    );
    assert_eq!(std::fs::metadata(m.p("t")).unwrap().len(), 0);
    m.umount();
    fsck_clean(&img);
    m = Mounted::new(img.to_str().unwrap(), &[]);
    assert_eq!(std::fs::read(m.p("a")).unwrap(), b"Jello world!!");
    assert_eq!(std::fs::metadata(m.p("t")).unwrap().len(), 0);
    m.umount();
}

/// A write by another user clears a file's set-id bits, and the kernel learns of it
/// at once (the server tells it): the mode it caches, which exec reads, is not the
/// old one until the attribute TTL runs out, so that user cannot then run the
/// changed program with the owner's privileges.
#[test]
fn a_write_that_clears_set_id_bits_is_seen_by_the_kernel_at_once() {
    need("setpriv", "util-linux");
    let m = Mounted::new("sim:ssd,size=256M", &["allow_other"]);
    let f = m.p("id");
    let f = f.display();
    sh(&format!(
        "cp /usr/bin/id {f} && chmod 4755 {f} && chmod o+w {f}"
    ));
    let nobody = "setpriv --reuid=65534 --regid=65534 --clear-groups";
    // Set-uid root as long as nobody has changed it; the kernel caches that mode.
    assert_eq!(sh(&format!("{nobody} {f} -u")).trim(), "0");
    // Appending to an ELF file leaves it runnable.
    sh(&format!("{nobody} sh -c 'printf x >> {f}'"));
    assert_eq!(
        sh(&format!("{nobody} {f} -u")).trim(),
        "65534",
        "run with the owner's uid after a write that cleared its set-uid bit"
    );
    assert_eq!(sh(&format!("stat -c %a {f}")).trim(), "757");
    m.umount();
}

/// An open with O_TRUNC by another user clears a file's set-id bits, as the
/// truncation it is: with FUSE_ATOMIC_O_TRUNC (which the server asks for) the kernel
/// passes O_TRUNC in the OPEN and sends no SETATTR for it, dropping the mode it
/// would have set, so only the server clears them; an OPEN's reply carries no mode,
/// so the server tells the kernel too. Root puts the program back (root's writes keep
/// the mode and tell the kernel nothing), so what it then runs as is the mode the
/// kernel kept from the truncation. (The kernel fetches the mode itself before a
/// truncation it strips set-id bits for; only the caller with CAP_FSETID below, for
/// whom it strips none, depends on the server telling it.)
#[test]
fn a_truncating_open_clears_set_id_bits_and_the_kernel_sees_it_at_once() {
    need("setpriv", "util-linux");
    need("python3", "python3");
    let (_d, img) = image("64M");
    let mut m = Mounted::new(img.to_str().unwrap(), &["allow_other"]);
    let (u, g, c) = (m.p("u"), m.p("g"), m.p("c"));
    let (u, g, c) = (u.display(), g.display(), c.display());
    // Set-uid root, set-gid root (group-executable) and set-uid root again, each
    // writable by others.
    sh(&format!(
        "for f in {u} {g} {c}; do cp /usr/bin/id $f; done && chmod 4757 {u} {c} && chmod 2777 {g}"
    ));
    // A PATH of its own: root's may lead to directories nobody may not enter.
    let path = "env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
    let nobody = format!("setpriv --reuid=65534 --regid=65534 --clear-groups {path}");
    // Set-id root as long as nobody has changed them; the kernel caches those modes.
    assert_eq!(sh(&format!("{nobody} {u} -u")).trim(), "0");
    assert_eq!(sh(&format!("{nobody} {g} -g")).trim(), "0");
    assert_eq!(sh(&format!("{nobody} {c} -u")).trim(), "0");
    // The shell's `: >` (O_WRONLY|O_CREAT|O_TRUNC of an existing file), and
    // O_RDONLY|O_TRUNC, which truncates all the same.
    sh(&format!("{nobody} sh -c ': > {u}'"));
    sh(&format!(
        "{nobody} python3 -c \"import os; os.close(os.open('{g}', os.O_RDONLY | os.O_TRUNC))\""
    ));
    // A caller with CAP_FSETID: the kernel strips nothing for it, nor fetches the
    // mode, while the server, which sees a uid and no capabilities, clears the bits
    // for anyone but root; the kernel must run it by the server's mode all the same.
    sh(&format!(
        "setpriv --reuid=65534 --regid=65534 --clear-groups --inh-caps +fsetid \
         --ambient-caps +fsetid sh -c ': > {c}'"
    ));
    // Written in place, not appended: an O_APPEND write has the kernel fetch the size,
    // and with it the mode, from the server, which would hide a stale one.
    sh(&format!(
        "for f in {u} {g} {c}; do dd if=/usr/bin/id of=$f conv=notrunc status=none; done"
    ));
    // Run before any stat: a stat after a truncating open fetches the server's mode.
    assert_eq!(
        sh(&format!("{nobody} {u} -u")).trim(),
        "65534",
        "run set-uid root after a truncating open by another user"
    );
    assert_eq!(
        sh(&format!("{nobody} {g} -g")).trim(),
        "65534",
        "run set-gid root after an O_RDONLY|O_TRUNC open by another user"
    );
    let ran_as = sh(&format!("{nobody} {c} -u"));
    m.umount();
    fsck_clean(&img);
    // The server's modes, in a kernel that has cached none.
    m = Mounted::new(img.to_str().unwrap(), &[]);
    let modes = sh(&format!(
        "stat -c %a {} {} {}",
        m.p("u").display(),
        m.p("g").display(),
        m.p("c").display()
    ));
    let modes: Vec<&str> = modes.lines().collect();
    assert_eq!(modes[..2], ["757", "777"]);
    let suid = modes[2].len() == 4 && modes[2].starts_with('4');
    assert_eq!(
        ran_as.trim(),
        if suid { "0" } else { "65534" },
        "the kernel ran it by another mode than the server's ({})",
        modes[2]
    );
    m.umount();
}

/// fallocate and copy_file_range change a file's data, and by another user who may
/// write it they clear its set-id bits and succeed, as on ext4. The kernel strips them
/// itself first (file_modified), with a SETATTR carrying the mode less the bits from
/// the caller, who does not own the file: the server takes it as the kernel's own
/// stripping (ATTR_FORCE), not as a chmod, which only the owner may do. Its reply
/// carries the mode, so the kernel runs the programs by it at once.
#[test]
fn fallocate_and_copy_file_range_by_another_user_clear_set_id_bits() {
    need("setpriv", "util-linux");
    need("python3", "python3");
    let m = Mounted::new("sim:ssd,size=256M", &["allow_other"]);
    let (u, g, c, s) = (m.p("u"), m.p("g"), m.p("c"), m.p("s"));
    let (u, g, c, s) = (u.display(), g.display(), c.display(), s.display());
    // Set-uid root, set-gid root (group-executable), set-uid root, writable by others;
    // and something to copy from.
    sh(&format!(
        "for f in {u} {g} {c}; do cp /usr/bin/id $f; done && chmod 4757 {u} {c} \
         && chmod 2777 {g} && echo 0123456789abcdef > {s}"
    ));
    // A PATH of its own: root's may lead to directories nobody may not enter.
    let path = "env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
    let nobody = format!("setpriv --reuid=65534 --regid=65534 --clear-groups {path}");
    assert_eq!(sh(&format!("{nobody} {u} -u")).trim(), "0");
    assert_eq!(sh(&format!("{nobody} {g} -g")).trim(), "0");
    assert_eq!(sh(&format!("{nobody} {c} -u")).trim(), "0");
    // Past the end of each ELF file, which leaves it runnable: an extension, a
    // preallocation that keeps the size, and 16 bytes copied after the end.
    sh(&format!("{nobody} fallocate -l 1M {u}"));
    sh(&format!("{nobody} fallocate -n -o 1M -l 4096 {g}"));
    sh(&format!(
        "{nobody} python3 -c \"import os; i = os.open('{s}', os.O_RDONLY); \
         o = os.open('{c}', os.O_WRONLY); \
         n = os.copy_file_range(i, o, 16, 0, os.fstat(o).st_size); assert n == 16, n\""
    ));
    assert_eq!(
        sh(&format!("{nobody} {u} -u")).trim(),
        "65534",
        "run set-uid root after another user's fallocate"
    );
    assert_eq!(
        sh(&format!("{nobody} {g} -g")).trim(),
        "65534",
        "run set-gid root after another user's fallocate (KEEP_SIZE)"
    );
    assert_eq!(
        sh(&format!("{nobody} {c} -u")).trim(),
        "65534",
        "run set-uid root after another user's copy_file_range"
    );
    assert_eq!(sh(&format!("stat -c %a {u} {g} {c}")), "757\n777\n757\n");
    assert_eq!(sh(&format!("tail -c 16 {c}")), "0123456789abcdef");
    m.umount();
}

/// sync(1) does not reach a FUSE daemon; `wbstack sync DIR` is the mount's syncfs. With
/// the flusher and the committer held off, files written without fsync are dirty; after
/// `wbstack sync` no page is dirty or under writeback and a commit ran, and a SIGKILL
/// of the daemon then loses none of them. A write error since the last sync is its
/// error, once; a read-only mount syncs as a no-op; a directory that is no wbstack
/// mount is a clear error.
#[test]
fn wbstack_sync_makes_what_was_written_durable_and_reports_a_write_error() {
    let (_d, img) = image("512M");
    let lazy = [
        "commit=3600",
        "dirty_expire_centisecs=360000",
        "dirty_writeback_centisecs=0",
        "flush_on_close=0",
    ];
    let m = Mounted::new(img.to_str().unwrap(), &lazy);
    std::fs::create_dir(m.p("d")).unwrap();
    let files: Vec<(String, Vec<u8>)> = (0..8)
        .map(|i| {
            let body: Vec<u8> = (0..4096 * (i + 1) + 17 * i)
                .map(|b| (b * 7 + i) as u8)
                .collect();
            (format!("d/f{i}"), body)
        })
        .collect();
    for (name, body) in &files {
        std::fs::write(m.p(name), body).unwrap();
    }
    assert!(stat_field(&m, "nr_dirty") > 0, "the writes are still dirty");
    let commits = stat_field(&m, "journal_commits");
    ok(Command::new(bin()).arg("sync").arg(m.path()));
    assert_eq!(stat_field(&m, "nr_dirty"), 0);
    assert_eq!(stat_field(&m, "nr_writeback"), 0);
    assert!(stat_field(&m, "journal_commits") > commits, "no commit");
    let pid = m.pid();
    assert!(kill_9(pid), "kill -9 {pid}");
    m.detach_dead();
    let m = Mounted::new(img.to_str().unwrap(), &[]);
    for (name, body) in &files {
        let back = std::fs::read(m.p(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(back == *body, "{name}: synced, then lost or changed");
    }
    m.umount();
    fsck_clean(&img);
    // A read-only mount has nothing to write back: a success, not EROFS.
    let m = Mounted::new(img.to_str().unwrap(), &["ro"]);
    ok(Command::new(bin()).arg("sync").arg(m.path()));
    m.umount();

    let m = Mounted::new("sim:ssd,size=256M", &lazy);
    let data_start = stat_field(&m, "data_start_sector");
    std::fs::write(m.p("f"), [b'x'; 8192]).unwrap();
    fault(&m, &format!("eio {data_start}-{} w", u64::MAX / 2));
    let out = run(Command::new(bin()).arg("sync").arg(m.path()));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a failed writeback: {err}");
    assert!(err.contains("Input/output error"), "{err}");
    fault(&m, "clear");
    ok(Command::new(bin()).arg("sync").arg(m.path()));
    m.umount();

    let plain = tempfile::tempdir().unwrap();
    let out = run(Command::new(bin()).arg("sync").arg(plain.path()));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("not a wbstack mount"),
        "{err}"
    );
}
