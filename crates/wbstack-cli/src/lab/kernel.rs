//! The kernel beside us, on the same disk (`wbstack lab EXPERIMENT --kernel ext4|xfs|both`).
//!
//! SKELETON: the interface the lab and its report use; the body is being written.

use crate::lab::LabOpts;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

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

/// The kernel arms of one experiment, and what could not run with the reason.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct KernelRun {
    pub experiment: String,
    pub arms: Vec<TargetArm>,
    /// Printed, never silent: "xfs: mkfs.xfs missing and apt-get failed: ...".
    pub skipped: Vec<String>,
}

/// Run `experiment`'s arms on each kernel filesystem, on wbstack on a `file:` device on
/// the same disk, and on wbstack through the mount.
pub fn run(experiment: &str, kernels: &[KernelFs], o: &LabOpts) -> Result<KernelRun, String> {
    let _ = (kernels, o);
    Err(format!("lab {experiment} --kernel: not built yet"))
}

/// The table of a kernel run, printed after the experiment's own table.
pub fn print(r: &KernelRun) {
    print!("{}", table(r));
}

/// The table as text (the report shows it too).
pub fn table(r: &KernelRun) -> String {
    let mut out = String::new();
    for s in &r.skipped {
        out.push_str(&format!("skipped: {s}\n"));
    }
    out
}
