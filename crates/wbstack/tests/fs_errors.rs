//! Writeback errors and durability (issue 6), after xfstests' fsync-err and
//! generic/441: errseq reporting per open file, group commit, async flush,
//! flush-on-close ordering, ENOSPC.

mod common;

use common::{fresh_with, quiet, sim};
use std::sync::Arc;
use wbstack::block::RequestQueue;
use wbstack::fs::fsck::fsck;
use wbstack::fs::{MountOptions, OpenOptions, Volume};

fn fresh(spec: &str, o: MountOptions) -> (Arc<RequestQueue>, Volume) {
    fresh_with(spec, o)
}

/// Fail every data write from now on (the metadata areas sit below the data area).
fn fail_data_writes(q: &Arc<RequestQueue>, v: &Volume) {
    let first = v.superblock().data_start * 8;
    sim(q).inject_eio(first..u64::MAX / 2, false, true);
}

/// `quiet()` with ordered data only: the tests whose subject is a data write that
/// fails under fsync, or fdatasync's flush without a commit. Journaled data (small
/// fsyncs by default) makes such data durable in the commit itself.
fn ordered() -> MountOptions {
    let mut o = quiet();
    o.journal_data_kb = 0;
    o
}

/// A volume with /f open twice (a writes 8 KiB of 1s, not yet written back), and from
/// now on every write to the data area failing.
fn two_opens_of_dirty_data_failing_home(
    o: MountOptions,
) -> (
    Arc<RequestQueue>,
    Volume,
    wbstack::fs::File,
    wbstack::fs::File,
) {
    let (q, v) = fresh("sim:ssd,size=64M", o);
    let a = v.create("/f").unwrap();
    let b = v.open("/f", &OpenOptions::read_write()).unwrap();
    a.write_at(0, &[1u8; 8192]).unwrap();
    fail_data_writes(&q, &v);
    (q, v, a, b)
}

/// /fill, written until the volume has no room for another block, and synced.
fn fill_volume(v: &Volume) -> wbstack::fs::File {
    let fill = v.create("/fill").unwrap();
    let mut off = 0;
    for chunk in [vec![7u8; 1 << 20], vec![7u8; 4096]] {
        while fill.write_at(off, &chunk).is_ok() {
            off += chunk.len() as u64;
        }
    }
    fill.fsync().unwrap();
    fill
}

/// Wait, a bounded while, for `cond`.
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = std::time::Instant::now();
    while !cond() {
        assert!(t0.elapsed().as_secs() < 10, "{what}");
        std::thread::yield_now();
    }
}

fn eio(r: Result<(), wbstack::fs::FsError>) -> i32 {
    match r {
        Ok(()) => 0,
        Err(e) => e.errno(),
    }
}

#[test]
fn every_open_file_sees_a_writeback_error_exactly_once() {
    let (_q, v, a, b) = two_opens_of_dirty_data_failing_home(ordered());
    assert_eq!(eio(a.fsync()), libc::EIO);
    assert_eq!(eio(a.fsync()), 0, "reported once to a");
    assert_eq!(eio(b.fsync()), libc::EIO, "and once to b");
    assert_eq!(eio(b.fsync()), 0);
    // Opened after the error was seen: nothing to report.
    let c = v.open("/f", &OpenOptions::read_write()).unwrap();
    assert_eq!(eio(c.fsync()), 0);
    // A new error after it was seen is a new report for everyone.
    a.write_at(0, &[2u8; 4096]).unwrap();
    assert_eq!(eio(c.fsync()), libc::EIO);
    assert_eq!(eio(a.fsync()), libc::EIO);
    assert_eq!(eio(b.fsync()), libc::EIO);
    assert_eq!(eio(b.fsync()), 0);
}

/// A small fsync journals its data (the default): it returns once the commit holding
/// the data is durable. If the data's home write then fails, the journal holds the
/// only good copy and must not be forgotten: the journal stops (jbd2 aborts on a
/// failed checkpoint write), every open file of the inode is told, and from then on
/// every fsync fails and every change is refused, as on an ext4 whose journal aborted.
#[test]
fn a_failed_home_write_of_journaled_data_stops_the_journal_and_reaches_every_open_file() {
    let (_q, v, a, b) = two_opens_of_dirty_data_failing_home(quiet());
    assert_eq!(eio(a.fsync()), 0, "the data was durable in the journal");
    assert_eq!(v.journal_stats().data_fsyncs, 1);
    // A checkpoint sends the data home first; that write fails.
    assert!(v.checkpoint().is_err());
    assert_eq!(eio(a.fsync()), libc::EIO);
    assert_eq!(eio(b.fsync()), libc::EIO, "b is told too");
    assert_eq!(eio(a.fsync()), libc::EIO, "the journal stays stopped");
    assert_eq!(v.create("/after").err().unwrap().errno(), libc::EROFS);
    let mut back = vec![0u8; 8192];
    assert_eq!(
        a.read_at(0, &mut back).unwrap(),
        8192,
        "reads are still served"
    );
    assert!(back.iter().all(|&x| x == 1));
}

#[test]
fn an_error_nobody_saw_reaches_a_later_opener_and_survives_eviction() {
    let mut o = quiet();
    o.cache.cache_size = 4 << 20; // small: other writes evict the failed pages
    let (q, v) = fresh("sim:ssd,size=128M", o);
    let a = v.create("/f").unwrap();
    a.write_at(0, &[1u8; 16384]).unwrap();
    a.close().unwrap();
    fail_data_writes(&q, &v);
    // Writeback by the flusher, not by an fsync: nobody has seen the error yet.
    v.bdi().sync().unwrap();
    sim(&q).clear_faults();
    // Push the failed (clean) pages out of the cache: twice its size in other data.
    let filler = v.create("/filler").unwrap();
    for i in 0..128u64 {
        filler.write_at(i * 65536, &[9u8; 65536]).unwrap();
    }
    filler.fsync().unwrap();
    assert_eq!(
        v.mapping_of("/f").unwrap().nr_pages(),
        0,
        "failed pages evicted"
    );
    let d = v.open("/f", &OpenOptions::read_write()).unwrap();
    assert_eq!(
        eio(d.fsync()),
        libc::EIO,
        "opened before anyone saw it: reported"
    );
    assert_eq!(eio(d.fsync()), 0);
    let e = v.open("/f", &OpenOptions::read_write()).unwrap();
    assert_eq!(eio(e.fsync()), 0, "opened after it was seen: not reported");
}

#[test]
fn volume_sync_reports_a_volume_error_once_per_caller() {
    let (q, v) = fresh("sim:ssd,size=64M", quiet());
    let x = v.create("/x").unwrap();
    let y = v.create("/y").unwrap();
    let bad = v.create("/bad").unwrap();
    bad.write_at(0, &[3u8; 4096]).unwrap();
    bad.close().unwrap();
    fail_data_writes(&q, &v);
    assert_eq!(eio(v.sync()), libc::EIO);
    assert_eq!(eio(v.sync()), 0);
    assert_eq!(eio(x.syncfs()), libc::EIO, "x has its own cursor");
    assert_eq!(eio(x.syncfs()), 0);
    assert_eq!(eio(y.syncfs()), libc::EIO);
    // fsync of an unrelated inode is not told of another inode's error.
    y.write_at(0, b"fine").unwrap();
    sim(&q).clear_faults();
    assert_eq!(eio(y.fsync()), 0);
}

#[test]
fn legacy_write_and_wait_consumes_the_error_but_fsync_still_reports_it() {
    // Reference 6.6 scenario 7.
    let (q, v) = fresh("sim:ssd,size=64M", quiet());
    let a = v.create("/f").unwrap();
    a.write_at(0, &[1u8; 4096]).unwrap();
    fail_data_writes(&q, &v);
    let m = v.mapping_of("/f").unwrap();
    assert!(m.write_and_wait(0, u64::MAX).is_err());
    assert!(
        m.write_and_wait(0, u64::MAX).is_ok(),
        "the legacy bit is consumed"
    );
    assert_eq!(
        eio(a.fsync()),
        libc::EIO,
        "errseq still reports it to the file"
    );
}

#[test]
fn fsck_is_clean_after_failed_writeback() {
    let (q, v) = fresh("sim:ssd,size=64M", quiet());
    for i in 0..10 {
        let f = v.create(&format!("/f{i}")).unwrap();
        f.write_at(0, &[i as u8; 12288]).unwrap();
    }
    fail_data_writes(&q, &v);
    let _ = v.sync();
    sim(&q).clear_faults();
    v.sync().unwrap();
    v.unmount().unwrap();
    let r = fsck(&q);
    assert!(r.is_clean(), "{r:#?}");
}

/// Run `f` on the flusher after everything queued before it, and wait for it: the
/// flusher has then handled every kick queued so far.
fn flusher_barrier(v: &Volume) {
    let (tx, rx) = std::sync::mpsc::channel();
    v.bdi().queue_job(Box::new(move || {
        let _ = tx.send(());
    }));
    rx.recv_timeout(std::time::Duration::from_secs(30))
        .expect("the flusher ran the barrier job");
}

#[test]
fn concurrent_fsyncs_share_commits_and_flushes() {
    let (q, v) = fresh("sim:ssd,size=256M", quiet());
    let v = Arc::new(v);
    let flushes0 = sim(&q).stats().flushes;
    let threads = 8;
    let per = 40;
    let hs: Vec<_> = (0..threads)
        .map(|t| {
            let v = v.clone();
            std::thread::spawn(move || {
                for i in 0..per {
                    let f = v.create(&format!("/t{t}-{i}")).unwrap();
                    f.write_at(0, &[t as u8; 4096]).unwrap();
                    f.fsync().unwrap();
                    f.close().unwrap();
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    let fsyncs = (threads * per) as u64;
    let flushes = sim(&q).stats().flushes - flushes0;
    let js = v.journal_stats();
    assert!(
        flushes * 2 < fsyncs,
        "{fsyncs} fsyncs cost {flushes} device flushes ({js:?})"
    );
    assert!(js.commits < fsyncs, "{js:?}");
    // Everything acknowledged survives a power cut right now.
    sim(&q).power_cut(true);
    let v = Arc::into_inner(v).unwrap();
    v.crash();
    sim(&q).reboot();
    let v = Volume::mount(q.clone(), quiet()).unwrap();
    for t in 0..threads {
        for i in 0..per {
            let f = v.open(&format!("/t{t}-{i}"), &OpenOptions::read()).unwrap();
            let mut b = vec![0u8; 4096];
            f.read_at(0, &mut b).unwrap();
            assert_eq!(b, vec![t as u8; 4096]);
        }
    }
}

#[test]
fn an_eio_during_the_shared_commit_reaches_every_waiter() {
    let (q, v) = fresh("sim:ssd,size=64M", quiet());
    let v = Arc::new(v);
    // Hold the device so every fsync below joins the same pending commit...
    let files: Vec<_> = (0..6)
        .map(|i| {
            let f = v.create(&format!("/f{i}")).unwrap();
            f.write_at(0, &[i as u8; 4096]).unwrap();
            f
        })
        .collect();
    for f in &files {
        // Data durable first, so the failure below is the journal's alone.
        f.fdatasync().unwrap();
    }
    for f in &files {
        f.write_at(4096, b"more").unwrap();
    }
    // ...then fail every journal write (the journal area is below the data area).
    let sb = v.superblock().clone();
    sim(&q).inject_eio(
        sb.journal_start * 8..(sb.journal_start + sb.journal_blocks) * 8,
        false,
        true,
    );
    let hs: Vec<_> = files
        .into_iter()
        .map(|f| std::thread::spawn(move || f.fsync()))
        .collect();
    for h in hs {
        assert_eq!(h.join().unwrap().unwrap_err().errno(), libc::EIO);
    }
    // The filesystem stopped taking changes rather than half-apply them.
    assert_eq!(v.create("/after").err().unwrap().errno(), libc::EROFS);
}

#[test]
fn fdatasync_skips_a_commit_for_timestamps_only() {
    let (q, v) = fresh("sim:ssd,size=64M", ordered());
    let f = v.create("/f").unwrap();
    f.write_at(0, &[1u8; 8192]).unwrap();
    f.fsync().unwrap();
    let c0 = v.journal_stats().commits;
    let fl0 = sim(&q).stats().flushes;
    f.write_at(0, &[2u8; 4096]).unwrap(); // in place: only mtime changes
    f.fdatasync().unwrap();
    assert_eq!(v.journal_stats().commits, c0, "no commit for a timestamp");
    assert_eq!(sim(&q).stats().flushes, fl0 + 1, "but the data is flushed");
    f.write_at(0, &[3u8; 4096]).unwrap();
    f.fsync().unwrap();
    assert_eq!(v.journal_stats().commits, c0 + 1, "fsync commits the mtime");
}

#[test]
fn async_flushes_share_commits_and_report_like_fsync() {
    let (q, v) = fresh("sim:ssd,size=256M", quiet());
    let fl0 = sim(&q).stats().flushes;
    let w0 = q.diskstats().writes();
    let mut handles = Vec::new();
    // Started while the device is busy (held), as when flushes outpace it: they pile
    // up behind the first batch and share the next one.
    sim(&q).hold(true);
    for i in 0..200 {
        let f = v.create(&format!("/a{i}")).unwrap();
        f.write_at(0, &[i as u8; 4096]).unwrap();
        handles.push(f.flush_async().unwrap());
        f.close().unwrap(); // closing does not cancel the flush
    }
    assert!(handles.iter().filter(|h| h.is_done()).count() < 200);
    sim(&q).hold(false);
    for h in &handles {
        h.wait().unwrap();
        assert!(h.is_done());
    }
    let flushes = sim(&q).stats().flushes - fl0;
    let writes = q.diskstats().writes() - w0;
    assert!(
        flushes * 10 <= 200,
        "200 async flushes cost {flushes} device flushes"
    );
    assert!(writes < 100, "200 files' data in {writes} writes (merged)");
    // Durable: a power cut now loses none of them.
    sim(&q).power_cut(true);
    v.crash();
    sim(&q).reboot();
    let v = Volume::mount(q.clone(), quiet()).unwrap();
    for i in 0..200 {
        assert_eq!(v.stat(&format!("/a{i}")).unwrap().size, 4096);
    }
    // Errors: through the handle, once, like fsync.
    let f = v.create("/bad").unwrap();
    f.write_at(0, &[9u8; 4096]).unwrap();
    fail_data_writes(&q, &v);
    assert_eq!(
        f.flush_async().unwrap().wait().unwrap_err().errno(),
        libc::EIO
    );
    assert_eq!(eio(f.fsync()), 0, "already reported by the async flush");
}

#[test]
fn close_after_truncate_and_rename_over_start_writeback() {
    for on in [true, false] {
        let mut o = quiet();
        o.flush_on_close = on;
        let (_q, v) = fresh("sim:ssd,size=64M", o);
        let f = v.create("/t").unwrap();
        f.write_at(0, &[1u8; 65536]).unwrap();
        f.fsync().unwrap();
        f.close().unwrap();
        // O_TRUNC, rewrite, close: the writeback starts at close, without waiting.
        let f = v.create("/t").unwrap();
        f.write_at(0, &[2u8; 8192]).unwrap();
        f.close().unwrap();
        let m = v.mapping_of("/t").unwrap();
        flusher_barrier(&v);
        assert_eq!(
            m.nr_dirty() == 0,
            on,
            "truncate+close (flush_on_close={on})"
        );
        // A new file renamed over an existing one: its writeback starts at the rename.
        let g = v.create("/tmp").unwrap();
        g.write_at(0, &[3u8; 8192]).unwrap();
        g.close().unwrap();
        let mg = v.mapping_of("/tmp").unwrap();
        v.rename("/tmp", "/t").unwrap();
        flusher_barrier(&v);
        assert_eq!(mg.nr_dirty() == 0, on, "rename over (flush_on_close={on})");
        // Renamed to a fresh name: nothing to protect, no writeback.
        let h = v.create("/x").unwrap();
        h.write_at(0, &[4u8; 4096]).unwrap();
        h.close().unwrap();
        let mh = v.mapping_of("/x").unwrap();
        v.rename("/x", "/fresh").unwrap();
        flusher_barrier(&v);
        assert_eq!(mh.nr_dirty(), 1, "rename to a new name");
        // A new file created with O_TRUNC is not a truncation.
        let n = v.create("/new").unwrap();
        n.write_at(0, &[5u8; 4096]).unwrap();
        n.close().unwrap();
        flusher_barrier(&v);
        assert_eq!(v.mapping_of("/new").unwrap().nr_dirty(), 1, "new file");
    }
}

/// Old content of the file under test and the new one the pattern writes.
fn old_new() -> (Vec<u8>, Vec<u8>) {
    (vec![0x0au8; 20000], vec![0x0bu8; 30000])
}

/// Run `pattern` on a fresh volume holding the old content at /target (fsynced), with
/// the power cut after `cut` more device IOs; remount; return /target's content.
fn cut_during(cut: u64, seed: u64, pattern: &dyn Fn(&Volume)) -> (Vec<u8>, bool) {
    let (q, v) = fresh(&format!("sim:ssd,size=64M,seed={seed}"), quiet());
    let (old, _) = old_new();
    let f = v.create("/target").unwrap();
    f.write_at(0, &old).unwrap();
    f.fsync().unwrap();
    f.close().unwrap();
    let other = v.create("/other").unwrap();
    other.fsync().unwrap();
    drop(other);
    let before = sim(&q).stats();
    let ios0 = before.reads + before.writes + before.flushes;
    sim(&q).power_cut_after(cut, true);
    pattern(&v);
    let s = sim(&q).stats();
    let finished = s.power_cuts == 0;
    let _ = ios0;
    sim(&q).power_cut(true);
    v.crash();
    sim(&q).reboot();
    let r = fsck(&q);
    assert!(r.is_clean(), "cut {cut}: {r:#?}");
    let v = Volume::mount(q.clone(), quiet()).unwrap();
    let got = match v.open("/target", &OpenOptions::read()) {
        Ok(f) => {
            let mut b = vec![0u8; f.size() as usize];
            f.read_at(0, &mut b).unwrap();
            b
        }
        Err(e) => panic!("cut {cut}: /target is gone: {e}"),
    };
    v.unmount().unwrap();
    (got, finished)
}

fn assert_old_or_new(pattern_name: &str, pattern: &dyn Fn(&Volume)) {
    let (old, new) = old_new();
    let mut saw_new = false;
    for cut in 0..200 {
        let (got, finished) = cut_during(cut, cut + 1, pattern);
        assert!(
            got == old || got == new,
            "{pattern_name}, cut after {cut} IOs: /target has {} bytes, neither old nor new",
            got.len()
        );
        saw_new |= got == new;
        if finished {
            assert!(
                saw_new,
                "{pattern_name}: the pattern completed but never showed new"
            );
            return;
        }
    }
    panic!("{pattern_name}: still cutting after 200 IOs");
}

#[test]
fn rename_over_is_old_or_new_at_every_cut() {
    assert_old_or_new("write-new-then-rename-over", &|v| {
        let (_, new) = old_new();
        let Ok(t) = v.create("/target.tmp") else {
            return;
        };
        let _ = t.write_at(0, &new);
        let _ = t.close();
        let _ = v.rename("/target.tmp", "/target");
        // An unrelated fsync commits the running transaction, rename included.
        if let Ok(o) = v.open("/other", &OpenOptions::read_write()) {
            let _ = o.write_at(0, b"x");
            let _ = o.fsync();
        }
        let _ = v.sync();
    });
}

#[test]
fn truncate_then_rewrite_is_old_or_new_at_every_cut() {
    assert_old_or_new("truncate-then-rewrite", &|v| {
        let (_, new) = old_new();
        let Ok(t) = v.create("/target") else { return };
        // A commit while the file is truncated and half rewritten.
        let _ = t.write_at(0, &new[..10000]);
        if let Ok(o) = v.open("/other", &OpenOptions::read_write()) {
            let _ = o.write_at(0, b"x");
            let _ = o.fsync();
        }
        let _ = t.write_at(10000, &new[10000..]);
        let _ = t.close();
        let _ = v.sync();
    });
}

/// A write that fails reading the partial page it starts in (EIO) never dirties the
/// pages after it, so what it reserved for them is released: the space comes back,
/// and a rename of the file over another (flush-on-close: the rename's commit waits
/// for the renamed file's reserved pages) still commits. Before, the reservations
/// stayed with no page to write them, and no commit ever happened again.
#[test]
fn a_write_failing_its_partial_page_read_releases_its_reservations() {
    let mut o = ordered();
    o.flush_on_close = true;
    let (q, v) = fresh("sim:ssd,size=64M", o);
    let f = v.create("/a").unwrap();
    f.write_at(0, &[1u8; 8192]).unwrap();
    f.fsync().unwrap();
    f.close().unwrap();
    v.create("/victim").unwrap().close().unwrap();
    assert!(v.drop_cache("/a").unwrap());
    let free = v.statfs().free;
    let f = v.open("/a", &OpenOptions::read_write()).unwrap();
    sim(&q).inject_eio(v.superblock().data_start * 8..u64::MAX / 2, true, false);
    // Page 1 is on disk and written in part: its read fails. Pages 2..=4 have no
    // block: the write reserved them before it began.
    let r = f.write_at(4096 + 100, &[2u8; 4 * 4096]);
    assert_eq!(r.map_err(|e| e.errno()), Err(libc::EIO));
    sim(&q).clear_faults();
    assert_eq!(v.statfs().free, free, "reservations of the failed write");
    assert_eq!(v.stat("/a").unwrap().size, 8192);
    f.close().unwrap();
    v.rename("/a", "/victim").unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let committer = std::thread::spawn(move || {
        tx.send(v.commit_now()).unwrap();
        v
    });
    let r = rx.recv_timeout(std::time::Duration::from_secs(30));
    assert!(matches!(r, Ok(Ok(()))), "the rename's commit: {r:?}");
    let v = committer.join().unwrap();
    let f = v.open("/victim", &OpenOptions::read()).unwrap();
    let mut b = vec![0u8; 8192];
    assert_eq!(f.read_at(0, &mut b).unwrap(), 8192);
    assert!(b.iter().all(|&x| x == 1));
    f.close().unwrap();
    v.unmount().unwrap();
    assert!(fsck(&q).is_clean());
}

/// A truncation whose new end falls in a hole rewrites nothing there: on a full
/// volume the rewrite's reservation failed, and its retry (commit what is freed, try
/// again) waited for a commit that waited for the truncation, because the file's
/// rename over another had ordered the commit behind the file's data.
#[test]
fn a_truncation_into_a_hole_on_a_full_volume_neither_hangs_nor_allocates() {
    let mut o = ordered();
    o.flush_on_close = true;
    let (q, v) = fresh("sim:ssd,size=64M", o);
    // /a: pages 0..=2 a hole, page 3 on disk.
    let f = v.create("/a").unwrap();
    f.write_at(3 * 4096, &[1u8; 4096]).unwrap();
    f.fsync().unwrap();
    v.create("/victim").unwrap().close().unwrap();
    // A page to write (the rename's commit will wait for it), then fill the volume.
    f.write_at(5 * 4096, &[2u8; 4096]).unwrap();
    let fill = fill_volume(&v);
    v.rename("/a", "/victim").unwrap();
    // The rename started page 5's writeback: allocated, its reservation is spent, and
    // the truncation that frees it frees it only at the next commit.
    flusher_barrier(&v);
    assert_eq!(v.statfs().available, 0, "not full");
    let (tx, rx) = std::sync::mpsc::channel();
    let truncater = std::thread::spawn(move || {
        tx.send(f.set_len(4096 + 100)).unwrap();
        f
    });
    let r = rx.recv_timeout(std::time::Duration::from_secs(30));
    assert!(matches!(r, Ok(Ok(()))), "the truncation: {r:?}");
    let f = truncater.join().unwrap();
    f.fsync().unwrap();
    let mut b = vec![9u8; 4196];
    assert_eq!(f.read_at(0, &mut b).unwrap(), 4196);
    assert!(b.iter().all(|&x| x == 0));
    f.close().unwrap();
    fill.close().unwrap();
    v.unmount().unwrap();
    assert!(fsck(&q).is_clean());
}

/// A write whose later partial page fails to read returns what it copied before
/// (generic_perform_write's short count), not an error over data it did change; the
/// caller's retry of the rest meets the error.
#[test]
fn a_write_failing_on_a_later_page_returns_the_short_count() {
    let (q, v) = fresh("sim:ssd,size=64M", ordered());
    let f = v.create("/a").unwrap();
    f.write_at(0, &[1u8; 3 * 4096]).unwrap();
    f.fsync().unwrap();
    f.close().unwrap();
    assert!(v.drop_cache("/a").unwrap());
    let f = v.open("/a", &OpenOptions::read_write()).unwrap();
    sim(&q).inject_eio(v.superblock().data_start * 8..u64::MAX / 2, true, false);
    // Pages 0 and 1 are overwritten whole (no read); page 2 in part, which reads it.
    assert_eq!(f.write_at(0, &[2u8; 2 * 4096 + 100]).unwrap(), 2 * 4096);
    let rest = f.write_at(2 * 4096, &[2u8; 100]);
    assert_eq!(rest.map_err(|e| e.errno()), Err(libc::EIO));
    sim(&q).clear_faults();
    let mut b = vec![0u8; 3 * 4096];
    assert_eq!(f.read_at(0, &mut b).unwrap(), 3 * 4096);
    assert!(b[..2 * 4096].iter().all(|&x| x == 2));
    assert!(b[2 * 4096..].iter().all(|&x| x == 1));
    f.fsync().unwrap();
    f.close().unwrap();
    v.unmount().unwrap();
    assert!(fsck(&q).is_clean());
}

/// A page written again while its first write was in flight found a block (the
/// write's allocation) and reserved nothing; when that write failed, its block was
/// freed, and the page's next writeback allocated with no reservation behind it: on a
/// volume filled meanwhile, data a successful write() had accepted was lost to ENOSPC.
#[test]
fn a_page_rewritten_while_its_write_fails_keeps_room_for_its_next_write() {
    let (q, v) = fresh("sim:ssd,size=64M", ordered());
    // A failed write whose page nobody wrote again leaves no reservation behind.
    let b = v.create("/b").unwrap();
    let free = v.statfs().free;
    b.write_at(0, &[1u8; 4096]).unwrap();
    fail_data_writes(&q, &v);
    assert_eq!(eio(b.fsync()), libc::EIO);
    assert_eq!(
        v.statfs().free,
        free,
        "the failed write's block and reservation"
    );
    b.close().unwrap();

    let f = v.create("/a").unwrap();
    f.write_at(0, &[1u8; 4096]).unwrap();
    sim(&q).hold(true);
    let first = f.flush_async().unwrap();
    wait_until("the page's write never reached the device", || {
        sim(&q).pending() > 0
    });
    f.write_at(0, &[2u8; 4096]).unwrap();
    sim(&q).hold(false);
    assert_eq!(eio(first.wait()), libc::EIO);
    sim(&q).clear_faults();
    let fill = fill_volume(&v);
    // The rewrite's data is written: the failed write's error was reported already.
    f.fsync().unwrap();
    f.close().unwrap();
    fill.close().unwrap();
    v.unmount().unwrap();
    assert!(fsck(&q).is_clean());
    let v = Volume::mount(q.clone(), ordered()).unwrap();
    let f = v.open("/a", &OpenOptions::read()).unwrap();
    let mut b = vec![0u8; 4096];
    assert_eq!(f.read_at(0, &mut b).unwrap(), 4096);
    assert!(b.iter().all(|&x| x == 2), "the rewrite's data");
    f.close().unwrap();
    v.unmount().unwrap();
}

/// A write over a page with a block on disk reserves nothing; a truncation between its
/// reservation and its copy (here: while it reads the partial page) freed that block,
/// and the write then dirtied the page with neither block nor reservation: on a full
/// volume its writeback failed with ENOSPC after write() had returned success. A
/// truncation waits for writes in progress (the inode's i_rwsem), as in the kernel.
#[test]
fn a_write_racing_a_truncation_keeps_room_for_its_page() {
    let (q, v) = fresh("sim:ssd,size=64M", ordered());
    let f = v.create("/a").unwrap();
    f.write_at(0, &[1u8; 4096]).unwrap();
    f.fsync().unwrap();
    f.close().unwrap();
    assert!(v.drop_cache("/a").unwrap());
    let f = Arc::new(v.open("/a", &OpenOptions::read_write()).unwrap());
    let reads = q.diskstats().ios[0];
    sim(&q).hold(true);
    let writer = {
        let f = f.clone();
        std::thread::spawn(move || f.write_at(100, &[2u8; 100]))
    };
    wait_until("the partial page's read never came", || {
        q.diskstats().ios[0] > reads || sim(&q).pending() > 0
    });
    let truncater = {
        let f = f.clone();
        std::thread::spawn(move || f.set_len(0))
    };
    wait_until("the truncation neither ran nor waited", || {
        truncater.is_finished() || f.truncations_waiting() > 0
    });
    sim(&q).hold(false);
    assert_eq!(writer.join().unwrap().unwrap(), 100);
    truncater.join().unwrap().unwrap();
    assert_eq!(f.size(), 0, "the truncation came after the write");
    let fill = fill_volume(&v);
    f.fsync().unwrap();
    fill.close().unwrap();
    Arc::try_unwrap(f)
        .ok()
        .expect("threads joined")
        .close()
        .unwrap();
    v.unmount().unwrap();
    assert!(fsck(&q).is_clean());
}
