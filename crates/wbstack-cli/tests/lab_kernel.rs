//! `wbstack lab plug --quick --kernel ext4`: the kernel arms beside wbstack on this
//! machine's disk. As root: an ext4 arm (loop device) and a wbstack-mount arm (FUSE)
//! with files written and device writes counted, and nothing left behind. Not root: the
//! run must still succeed and name why the kernel arms were skipped.

use std::path::PathBuf;
use std::process::Command;

fn is_root() -> bool {
    // SAFETY: geteuid takes no arguments and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The lab's work dir for this test: on the disk (/var/tmp), apart from a person's runs.
fn work_dir() -> PathBuf {
    PathBuf::from(format!(
        "/var/tmp/wbstack-lab-kernel-test-{}",
        std::process::id()
    ))
}

fn kernel_run(stdout: &str) -> serde_json::Value {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v.get("skipped").is_some() && v["experiment"] == "plug")
        .unwrap_or_else(|| panic!("no kernel run in the output:\n{stdout}"))
}

fn arm<'a>(run: &'a serde_json::Value, target: &str) -> &'a serde_json::Value {
    run["arms"]
        .as_array()
        .and_then(|arms| arms.iter().find(|a| a["target"] == target))
        .unwrap_or_else(|| panic!("no {target} arm in {run}"))
}

#[test]
fn lab_plug_runs_beside_ext4_and_through_the_mount() {
    let work = work_dir();
    let report = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_wbstack"))
        .args([
            "lab", "plug", "--quick", "--kernel", "ext4", "--json", "--report",
        ])
        .arg(report.path())
        .env("WBSTACK_LAB_DIR", &work)
        .output()
        .expect("run wbstack lab");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "wbstack lab failed:\n{stdout}\n{stderr}"
    );
    let run = kernel_run(&stdout);
    let skipped: Vec<String> = run["skipped"]
        .as_array()
        .map(|v| {
            v.iter()
                .map(|s| s.as_str().unwrap_or("").to_string())
                .collect()
        })
        .unwrap_or_default();
    if !is_root() {
        eprintln!("lab_kernel: not root, so the ext4 arm cannot run; the lab said: {skipped:?}");
        assert!(
            skipped.iter().any(|s| s.starts_with("ext4: not root")),
            "the skip of ext4 is not named: {skipped:?}"
        );
        return;
    }
    assert!(skipped.is_empty(), "arms were skipped as root: {skipped:?}");
    for target in ["ext4", "wbstack-mount", "wbstack-file"] {
        let a = arm(&run, target);
        let f = &a["figures"];
        assert!(
            f["files_per_sec"].as_f64().unwrap_or(0.0) > 0.0,
            "{target}: no files/s: {a}"
        );
        assert!(
            f["write_ios"].as_f64().unwrap_or(0.0) > 0.0,
            "{target}: no device writes: {a}"
        );
        // 2 directories × 10,000 files × 2 loops, all kept as fs_mark keeps them.
        assert_eq!(f["files"].as_f64(), Some(40_000.0), "{target}: {a}");
        assert!(
            !a["commands"].as_array().unwrap().is_empty(),
            "{target}: {a}"
        );
        assert!(
            !a["series"]["files_per_sec"].as_array().unwrap().is_empty(),
            "{target}: no per-loop series: {a}"
        );
    }
    assert!(arm(&run, "ext4")["setup"]
        .as_str()
        .unwrap()
        .contains("/dev/loop"));
    // The report shows the kernel table and a plot of every target's files/s.
    let html = std::fs::read_to_string(report.path().join("index.html")).unwrap();
    assert!(html.contains("Beside the kernel") && html.contains("<figure id=\"plug-kernel\">"));
    let plot: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(report.path().join("plug-kernel.json")).unwrap(),
    )
    .unwrap();
    let names: Vec<&str> = plot["series"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["ext4", "wbstack-file", "wbstack-mount"], "{plot}");
    // Torn down: no image, no mount point, no loop device on our image.
    let left: Vec<_> = std::fs::read_dir(&work)
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name()).collect())
        .unwrap_or_default();
    let losetup = Command::new("losetup")
        .arg("-a")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let cleaned = std::fs::remove_dir_all(&work);
    assert!(
        left.is_empty(),
        "left behind in {}: {left:?}",
        work.display()
    );
    assert!(
        !losetup.contains(&work.display().to_string()),
        "a loop device is still attached: {losetup}"
    );
    cleaned.expect("remove the work dir");
}

/// The path a person without root takes, exercised from root too: as user nobody the
/// kernel arms are skipped with the reason, and the lab still succeeds.
#[test]
fn without_root_the_kernel_arms_are_skipped_with_the_reason() {
    if !is_root() {
        eprintln!("lab_kernel: not root; the other test covers this path as this user");
        return;
    }
    let work = PathBuf::from(format!(
        "/var/tmp/wbstack-lab-kernel-nobody-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&work).expect("make the work dir");
    // Nobody must be able to make its images there.
    let chmod = Command::new("chmod")
        .arg("0777")
        .arg(&work)
        .status()
        .expect("chmod");
    assert!(chmod.success());
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(env!("CARGO_BIN_EXE_wbstack"))
        .args(["lab", "plug", "--quick", "--kernel", "ext4", "--json"])
        .env("WBSTACK_LAB_DIR", &work)
        .output()
        .expect("run wbstack lab as nobody with setpriv (util-linux)");
    let cleaned = std::fs::remove_dir_all(&work);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "wbstack lab as nobody failed:\n{stdout}\n{stderr}"
    );
    let run = kernel_run(&stdout);
    let skipped = run["skipped"].to_string();
    eprintln!("lab_kernel: as nobody the lab said: {skipped}");
    assert!(skipped.contains("ext4: not root (euid 65534)"), "{skipped}");
    cleaned.expect("remove the work dir");
}
