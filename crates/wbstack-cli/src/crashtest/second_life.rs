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
//! anything else; fsck is clean before the mount and after the unmount. With
//! `flush_on_close`, some files are instead written as `t<i>` and renamed over an
//! fsynced one without fsync, then closed (flush-on-close's replace): that name then
//! holds its fsynced content or the whole new one, never a part of it.
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
    /// Files renamed over an fsynced one instead of fsynced.
    pub replaces: u64,
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
    let (acked, replaced, root) = match live(q, probe, &mopts, seed, &sizes, &mut rng, &mut life) {
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
        Ok(r) => {
            let made = Made {
                seed,
                sizes: &sizes,
                acked: &acked,
                replaced: &replaced,
            };
            compare(first, &r, root, &made, &mut life.problems)
        }
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

/// `live`'s outcome: which fsyncs returned, which file replaced which (by index),
/// and the root's inode.
type Lived = (Vec<bool>, Vec<Option<usize>>, u64);

/// Mount, make the files with the cut armed, cut if it did not come: which fsyncs
/// returned, which files replaced which (by index), and the root's inode.
fn live(
    q: &Arc<RequestQueue>,
    probe: &Probe,
    mopts: &MountOptions,
    seed: u64,
    sizes: &[usize],
    rng: &mut ChaCha8Rng,
    life: &mut SecondLife,
) -> Result<Lived, String> {
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
    let mut replaced: Vec<Option<usize>> = vec![None; sizes.len()];
    for (i, &len) in sizes.iter().enumerate() {
        let data = content(seed, i as u64, len);
        let mut fsynced = false;
        // An fsynced file made as itself (a replaced one's name now holds another).
        let targets: Vec<usize> = (0..i)
            .filter(|&j| acked[j] && replaced[j].is_none())
            .collect();
        let target = (mopts.flush_on_close && !targets.is_empty() && rng.gen_ratio(1, 4))
            .then(|| targets[rng.gen_range(0..targets.len())]);
        let r = match target {
            Some(j) => {
                replaced[i] = Some(j);
                life.replaces += 1;
                (|| {
                    let tmp = format!("/{DIR}/t{i}");
                    let f = v.create(&tmp)?;
                    f.write_all_at(0, &data)?;
                    v.rename(&tmp, &format!("/{DIR}/f{j}"))?;
                    f.close()
                })()
            }
            None => (|| {
                let f = v.create(&format!("/{DIR}/f{i}"))?;
                f.write_all_at(0, &data)?;
                f.fsync()?;
                fsynced = true;
                f.close()
            })(),
        };
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
    Ok((acked, replaced, root))
}

/// What the second life made: file i's content is `content(seed, i, sizes[i])`; it
/// was fsynced as `f<i>` (`acked[i]`: the fsync returned), or written as `t<i>` and
/// renamed over `f<j>` (`replaced[i] == Some(j)`).
struct Made<'a> {
    seed: u64,
    sizes: &'a [usize],
    acked: &'a [bool],
    replaced: &'a [Option<usize>],
}

impl Made<'_> {
    fn want(&self, i: usize) -> Vec<u8> {
        content(self.seed, i as u64, self.sizes[i])
    }
}

/// The second recovery `now` against the first `first`: the same outside the second
/// life's directory, and in it every acknowledged file whole (or a replacement of it
/// whole), the rest absent or their data with holes.
fn compare(first: &Recovered, now: &Recovered, root: u64, made: &Made, problems: &mut Vec<String>) {
    let acked = made.acked;
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
    for (i, &len) in made.sizes.iter().enumerate() {
        if made.replaced[i].is_some() {
            // Its temporary name: the rename is not durable, and the file, never
            // fsynced, may have holes.
            let name = format!("t{i}");
            if let Some(g) = in_dir.get(name.as_str()).and_then(|ino| now.files.get(ino)) {
                if !holes_of(g, &made.want(i)) {
                    problems.push(format!("/{DIR}/{name} holds bytes nobody wrote"));
                }
            }
            continue;
        }
        let name = format!("f{i}");
        let got = in_dir.get(name.as_str()).and_then(|ino| now.files.get(ino));
        let want = made.want(i);
        // A durable rename over it brought a replacement, which must be whole: its
        // data had no blocks before the rename, so the rename's commit waited for it.
        let replacements: Vec<usize> = (0..made.sizes.len())
            .filter(|&k| made.replaced[k] == Some(i))
            .collect();
        if got.is_some_and(|g| replacements.iter().any(|&k| *g == made.want(k))) {
            continue;
        }
        if !replacements.is_empty() && got.is_some_and(|g| *g != want) {
            let by: Vec<String> = replacements.iter().map(|k| format!("t{k}")).collect();
            problems.push(format!(
                "/{DIR}/{name}: {} bytes back, neither its fsynced {len} nor a whole replacement ({}, renamed over it without fsync)",
                got.map_or(0, |g| g.len()),
                by.join(", ")
            ));
            continue;
        }
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
        let index = |p: char| {
            name.strip_prefix(p)
                .and_then(|n| n.parse::<usize>().ok())
                .filter(|&n| n < made.sizes.len())
        };
        let known = index('f').is_some_and(|n| made.replaced[n].is_none())
            || index('t').is_some_and(|n| made.replaced[n].is_some());
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

#[cfg(test)]
mod tests {
    use super::*;

    /// f0 fsynced, then t1 written and renamed over f0 without fsync: what the
    /// second recovery may show under each name.
    #[test]
    fn a_replaced_file_holds_its_fsynced_content_or_the_whole_replacement() {
        let (seed, root, dir) = (9, 1, 50);
        let sizes = [4096, 20_000];
        let made = Made {
            seed,
            sizes: &sizes,
            acked: &[true, false],
            replaced: &[None, Some(0)],
        };
        let problems = |f0: Option<Vec<u8>>, t1: Option<Vec<u8>>| {
            let mut now = Recovered::default();
            now.entries.insert((root, DIR.to_string(), dir, true));
            for (name, ino, data) in [("f0", 10, f0), ("t1", 11, t1)] {
                if let Some(d) = data {
                    now.entries.insert((dir, name.to_string(), ino, false));
                    now.files.insert(ino, d);
                }
            }
            let mut p = Vec::new();
            compare(&Recovered::default(), &now, root, &made, &mut p);
            p
        };
        let (old, new) = (made.want(0), made.want(1));
        let mut new_with_hole = new.clone();
        new_with_hole[4096..8192].fill(0);
        // The rename not durable: the old content, the new file under its temporary
        // name with holes (never fsynced), or not there at all.
        assert_eq!(problems(Some(old.clone()), None), Vec::<String>::new());
        assert_eq!(
            problems(Some(old.clone()), Some(new_with_hole.clone())),
            Vec::<String>::new()
        );
        // Durable: the whole new file.
        assert_eq!(problems(Some(new.clone()), None), Vec::<String>::new());
        // Durable with a part of the new file: the broken promise.
        for bad in [Vec::new(), new[..4096].to_vec(), new_with_hole] {
            let p = problems(Some(bad.clone()), None);
            assert_eq!(p.len(), 1, "{} bytes: {p:?}", bad.len());
            assert!(p[0].contains("whole replacement"), "{p:?}");
        }
    }
}
