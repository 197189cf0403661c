//! Running fio beside our own benchmark, so both are measured in one run on the same
//! file.

use serde_json::Value;
use std::process::Command;

#[derive(Debug, Clone, serde::Serialize)]
pub struct FioResult {
    pub iops: f64,
    pub mib_s: f64,
    pub lat_p50_us: f64,
    pub lat_p99_us: f64,
    pub usr_pct: f64,
    pub sys_pct: f64,
}

/// The job shape fio runs.
#[derive(Debug, Clone)]
pub struct FioJob<'a> {
    pub path: &'a str,
    pub rw: &'a str,
    pub bs: usize,
    pub iodepth: usize,
    /// iodepth_batch_submit: IOs submitted together (0: the whole free depth).
    pub batch: usize,
    pub jobs: usize,
    pub runtime_s: f64,
    pub size: u64,
}

/// Run fio with io_uring and O_DIRECT on `path` with the same job shape.
pub fn run(j: &FioJob) -> Result<FioResult, String> {
    let FioJob {
        path,
        rw,
        bs,
        iodepth,
        batch,
        jobs,
        runtime_s,
        size,
    } = *j;
    let out = Command::new("fio")
        .args([
            "--name=wbstack-compare",
            &format!("--filename={path}"),
            &format!("--rw={rw}"),
            &format!("--bs={bs}"),
            &format!("--iodepth={iodepth}"),
            &format!("--iodepth_batch_submit={batch}"),
            &format!("--numjobs={jobs}"),
            "--ioengine=io_uring",
            "--direct=1",
            "--time_based",
            &format!("--runtime={}ms", (runtime_s * 1000.0) as u64),
            &format!("--size={size}"),
            "--group_reporting",
            "--randrepeat=0",
            "--output-format=json",
        ])
        .output()
        .map_err(|e| format!("cannot run fio ({e}); install it with: apt-get install -y fio"))?;
    if !out.status.success() {
        return Err(format!(
            "fio failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let v: Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("cannot parse fio's JSON output: {e}"))?;
    let job = &v["jobs"][0];
    let side = if rw.contains("write") {
        &job["write"]
    } else {
        &job["read"]
    };
    let pct = |p: &str| side["clat_ns"]["percentile"][p].as_f64().unwrap_or(0.0) / 1000.0;
    Ok(FioResult {
        iops: side["iops"].as_f64().unwrap_or(0.0),
        mib_s: side["bw_bytes"].as_f64().unwrap_or(0.0) / (1 << 20) as f64,
        lat_p50_us: pct("50.000000"),
        lat_p99_us: pct("99.000000"),
        usr_pct: job["usr_cpu"].as_f64().unwrap_or(0.0),
        sys_pct: job["sys_cpu"].as_f64().unwrap_or(0.0),
    })
}
