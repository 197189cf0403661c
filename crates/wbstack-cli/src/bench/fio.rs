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
    /// Where each job's IO goes: job i over `layout.job_size_bytes()` from
    /// `i * layout.offset_increment_bytes()`, as `bench blk`'s own jobs.
    pub layout: crate::bench::blkbench::Layout,
}

/// fio's command line for `j`: io_uring and O_DIRECT on `path`, the job shape of
/// `bench blk` and its jobs' regions.
pub fn args(j: &FioJob) -> Vec<String> {
    let mut v = vec![
        "--name=wbstack-compare".to_string(),
        format!("--filename={}", j.path),
        format!("--rw={}", j.rw),
        format!("--bs={}", j.bs),
        format!("--iodepth={}", j.iodepth),
        format!("--iodepth_batch_submit={}", j.batch),
        format!("--numjobs={}", j.jobs),
        "--ioengine=io_uring".into(),
        "--direct=1".into(),
        "--time_based".into(),
        format!("--runtime={}ms", (j.runtime_s * 1000.0) as u64),
        // fio's size is per job: with offset_increment, job i ranges over
        // [i * offset_increment, i * offset_increment + size), bench blk's region i.
        format!("--size={}", j.layout.job_size_bytes()),
        format!("--offset_increment={}", j.layout.offset_increment_bytes()),
        "--group_reporting".into(),
        "--randrepeat=0".into(),
        "--output-format=json".into(),
    ];
    if j.rw.starts_with("rand") {
        // bench blk draws each random block independently; fio's default random map
        // would instead visit every block once per pass and cost fio the map's upkeep.
        v.push("--norandommap".into());
    }
    v
}

/// Run fio with io_uring and O_DIRECT on `path` with the same job shape.
pub fn run(j: &FioJob) -> Result<FioResult, String> {
    let rw = j.rw;
    let out = Command::new("fio")
        .args(args(j))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::blkbench::{Layout, Rw};

    fn job(rw: &'static str, layout: Layout) -> FioJob<'static> {
        FioJob {
            path: "/tmp/x.img",
            rw,
            bs: layout.bs as usize,
            iodepth: 8,
            batch: 1,
            jobs: 4,
            runtime_s: 2.5,
            layout,
        }
    }

    /// The value of `--name=` in `args`, or None.
    fn arg<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
        args.iter()
            .find_map(|a| a.strip_prefix(&format!("--{name}=")))
    }

    #[test]
    fn sequential_fio_jobs_range_over_bench_blks_regions() {
        // 4 jobs over 1001 blocks of 64 KiB: 250 blocks each, the last block left out.
        let layout = Layout::new(Rw::Write, 65536, 1001, 4).unwrap();
        let a = args(&job("write", layout));
        let size: u64 = arg(&a, "size").unwrap().parse().unwrap();
        let inc: u64 = arg(&a, "offset_increment").unwrap().parse().unwrap();
        assert_eq!(arg(&a, "numjobs"), Some("4"));
        for i in 0..4 {
            let (first, blocks) = layout.region(i);
            assert_eq!(
                (i as u64 * inc, size),
                (first * 65536, blocks * 65536),
                "job {i}"
            );
        }
        // The regions are disjoint and within the span.
        assert_eq!(inc, size);
        assert!(3 * inc + size <= 1001 * 65536);
        assert_eq!(arg(&a, "rw"), Some("write"));
        assert_eq!(arg(&a, "bs"), Some("65536"));
        assert_eq!(arg(&a, "iodepth"), Some("8"));
        assert_eq!(arg(&a, "iodepth_batch_submit"), Some("1"));
        assert_eq!(arg(&a, "runtime"), Some("2500ms"));
        assert!(!a.iter().any(|x| x == "--norandommap"), "{a:?}");
    }

    #[test]
    fn random_fio_jobs_each_range_over_the_whole_span_drawing_blocks_independently() {
        let layout = Layout::new(Rw::RandRead, 4096, 1 << 20, 4).unwrap();
        let a = args(&job("randread", layout));
        assert_eq!(arg(&a, "size"), Some(&*(4096u64 << 20).to_string()));
        assert_eq!(arg(&a, "offset_increment"), Some("0"));
        for i in 0..4 {
            assert_eq!(layout.region(i), (0, 1 << 20), "job {i}");
        }
        assert!(a.iter().any(|x| x == "--norandommap"), "{a:?}");
    }

    #[test]
    fn more_sequential_jobs_than_blocks_is_an_error() {
        let e = Layout::new(Rw::Read, 4096, 3, 4).unwrap_err();
        assert!(e.contains("fewer than --jobs 4"), "{e}");
    }
}
