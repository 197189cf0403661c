//! A second life after recovery: the recovered volume mounted again, files made and
//! fsynced in a directory of their own while the power is cut at a seeded point among
//! their requests, then recovered again.
//!
//! What the first recovery found must come back exactly: nothing the first cut lost may
//! return and nothing it kept may go. A journal write that landed beyond one the first
//! cut lost stays in the journal, valid; if the second life's transactions took its
//! tid again, the second recovery would replay it after them (mount moves the tids on
//! for this: `TIDS_SKIPPED_AT_MOUNT`). Every file whose fsync returned must be whole,
//! and one whose fsync did not return may be absent or hold its data with holes, never
//! anything else; fsck is clean before the mount and after the unmount.
//!
//! A failing second life is reported with its cut; the cut's replay file rebuilds the
//! first life only.

use super::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;
use wbstack::block::RequestQueue;
use wbstack::fs::fsck::fsck;
use wbstack::fs::{MountOptions, Volume};

/// Files the second life makes, each created, written and fsynced in turn.
const FILES: u64 = 24;
/// Their sizes, picked by the seed: journaled (`journal_data_kb`) and ordered fsyncs.
const SIZES: [usize; 4] = [512, 4096, 20_000, 100_000];
const DIR: &str = "life2";

/// What a cut's second life did and found.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SecondLife {
    /// The power went when this many more requests had entered the device.
    pub cut_after_requests: u64,
    pub files_made: u64,
    pub fsyncs_acked: u64,
    /// Broken promises and errors, in words (empty: it passed).
    pub problems: Vec<String>,
}

/// File `i`'s content in the second life of the cut with `seed`.
fn content(seed: u64, i: u64, len: usize) -> Vec<u8> {
    let mut rng = ChaCha8Rng::seed_from_u64(mix(seed ^ (i << 20) ^ 0x11fe));
    (0..len).map(|_| rng.gen_range(1..=255u8)).collect()
}

/// Run the second life on the device behind `q` (after `check_recovery` found `first`
/// and unmounted it cleanly).
pub(crate) fn second_life(
    q: &Arc<RequestQueue>,
    probe: &Probe,
    mopts: MountOptions,
    seed: u64,
    first: &Recovered,
) -> SecondLife {
    let mut life = SecondLife::default();
    let mut rng = ChaCha8Rng::seed_from_u64(mix(seed ^ 0x2e1f));
    let sizes: Vec<usize> = (0..FILES)
        .map(|_| SIZES[rng.gen_range(0..SIZES.len())])
        .collect();
    let (acked, root) = match live(q, probe, &mopts, seed, &sizes, &mut rng, &mut life) {
        Ok(a) => a,
        Err(e) => {
            life.problems.push(e);
            return life;
        }
    };
    probe.disarm();
    probe.sim().reboot();
    for p in fsck(q).problems {
        life.problems
            .push(format!("fsck before the second mount: {p}"));
    }
    let v = match Volume::mount(q.clone(), mopts) {
        Ok(v) => v,
        Err(e) => {
            life.problems.push(format!("second mount: {e}"));
            return life;
        }
    };
    for p in v.check() {
        life.problems.push(format!("second mount: {p}"));
    }
    match recover(&v) {
        Ok(r) => compare(first, &r, root, seed, &sizes, &acked, &mut life.problems),
        Err(e) => life
            .problems
            .push(format!("reading back the second life: {e}")),
    }
    if let Err(e) = v.unmount() {
        life.problems
            .push(format!("unmount after the second life: {e}"));
    }
    for p in fsck(q).problems {
        life.problems
            .push(format!("fsck after the second life: {p}"));
    }
    life
}

/// Mount, make the files with the cut armed, cut if it did not come: which fsyncs
/// returned, and the root's inode.
fn live(
    q: &Arc<RequestQueue>,
    probe: &Probe,
    mopts: &MountOptions,
    seed: u64,
    sizes: &[usize],
    rng: &mut ChaCha8Rng,
    life: &mut SecondLife,
) -> Result<(Vec<bool>, u64), String> {
    let v = Volume::mount(q.clone(), mopts.clone())
        .map_err(|e| format!("mount for the second life: {e}"))?;
    let root = v.stat("/").map_err(|e| format!("stat /: {e}"))?.ino;
    v.mkdir(&format!("/{DIR}"), 0o755)
        .map_err(|e| format!("mkdir /{DIR}: {e}"))?;
    // About three requests a file (a commit, a data or home write, a flush): the cut
    // falls anywhere in the run, or after it.
    life.cut_after_requests = rng.gen_range(1..=FILES * 4);
    probe.arm(life.cut_after_requests);
    let mut acked = vec![false; sizes.len()];
    for (i, &len) in sizes.iter().enumerate() {
        let data = content(seed, i as u64, len);
        let mut fsynced = false;
        let r = (|| {
            let f = v.create(&format!("/{DIR}/f{i}"))?;
            f.write_all_at(0, &data)?;
            f.fsync()?;
            fsynced = true;
            f.close()
        })();
        life.files_made += 1;
        // The fsync's success is the promise, whatever the close says after it.
        acked[i] = fsynced;
        life.fsyncs_acked += fsynced as u64;
        match r {
            Ok(()) => {}
            Err(_) if !probe.powered() => break,
            Err(e) => life.problems.push(format!("f{i} with the power on: {e}")),
        }
    }
    if probe.powered() {
        probe.cut_now();
    }
    v.crash();
    Ok((acked, root))
}

/// The second recovery `now` against the first `first`: the same outside the second
/// life's directory, and in it every acknowledged file whole, the rest absent or their
/// data with holes.
fn compare(
    first: &Recovered,
    now: &Recovered,
    root: u64,
    seed: u64,
    sizes: &[usize],
    acked: &[bool],
    problems: &mut Vec<String>,
) {
    let dir = now
        .entries
        .iter()
        .find(|d| d.0 == root && d.1 == DIR && d.3)
        .map(|d| d.2);
    let outside: std::collections::BTreeSet<_> = now
        .entries
        .iter()
        .filter(|d| Some(d.0) != dir && !(d.0 == root && d.1 == DIR))
        .cloned()
        .collect();
    for d in first.entries.difference(&outside) {
        problems.push(format!("the first recovery's entry {d:?} is gone"));
    }
    for d in outside.difference(&first.entries) {
        problems.push(format!("entry {d:?} came back after the second cut"));
    }
    for (ino, data) in &first.files {
        if now.files.get(ino).is_some_and(|d| d != data) {
            problems.push(format!(
                "inode {ino} of the first recovery changed ({} bytes, was {})",
                now.files[ino].len(),
                data.len()
            ));
        }
    }
    let in_dir: BTreeMap<&str, u64> = now
        .entries
        .iter()
        .filter(|d| Some(d.0) == dir)
        .map(|d| (d.1.as_str(), d.2))
        .collect();
    if dir.is_none() && acked.iter().any(|a| *a) {
        problems.push(format!("/{DIR} is gone, with fsynced files in it"));
    }
    for (i, &len) in sizes.iter().enumerate() {
        let name = format!("f{i}");
        let got = in_dir.get(name.as_str()).and_then(|ino| now.files.get(ino));
        let want = content(seed, i as u64, len);
        match got {
            None if acked[i] => problems.push(format!("fsynced /{DIR}/{name} is gone")),
            None => {}
            Some(g) if acked[i] && *g != want => problems.push(format!(
                "fsynced /{DIR}/{name}: {} bytes back, not its {len}",
                g.len()
            )),
            Some(g) if !holes_of(g, &want) => {
                problems.push(format!("/{DIR}/{name} holds bytes nobody wrote"))
            }
            Some(_) => {}
        }
    }
    for (name, _) in in_dir {
        let known = name
            .strip_prefix('f')
            .and_then(|n| n.parse::<usize>().ok())
            .is_some_and(|n| n < sizes.len());
        if !known {
            problems.push(format!("/{DIR}/{name}: a name the second life never made"));
        }
    }
}

/// `got` is `want`'s start with some 4 KiB blocks read as holes (zeros): a file whose
/// fsync did not return, caught between its extents and its size.
fn holes_of(got: &[u8], want: &[u8]) -> bool {
    got.len() <= want.len()
        && got
            .chunks(4096)
            .zip(want.chunks(4096))
            .all(|(g, w)| g == &w[..g.len()] || g.iter().all(|&b| b == 0))
}
