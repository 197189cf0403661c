//! The BenchFs plumbing: diskstats parsing, DirFs, asynchronous flushes, targets.

use std::sync::Arc;
use wbstack::block::DiskStats;
use wbstack_cli::bench::benchfs::{self, BenchFs, DirFs};

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

#[test]
fn parse_sysfs_stat_and_proc_diskstats_lines() {
    // /sys/block/vda/stat of a 6.x kernel: 17 fields.
    let sys = "   27774     6231  2692650    16623    25315    14460  2742840     4638        0    11208    22761     4527       53   216816     1496      282        3\n";
    let d = DiskStats::parse(sys).unwrap();
    assert_eq!(d.reads(), 27774);
    assert_eq!(d.merges[0], 6231);
    assert_eq!(d.sectors[0], 2692650);
    assert_eq!(d.ticks_ms(0), 16623);
    assert_eq!(d.writes(), 25315);
    assert_eq!(d.merges[1], 14460);
    assert_eq!(d.sectors[1], 2742840);
    assert_eq!(d.ticks_ms(1), 4638);
    assert_eq!(d.io_ticks_ms, 11208);
    assert_eq!(d.time_in_queue_ms, 22761);
    assert_eq!(d.ios[2], 4527);
    assert_eq!(d.sectors[2], 216816);
    assert_eq!(d.flushes(), 282);
    assert_eq!(d.ticks_ms(3), 3);
    let fields: Vec<u64> = sys.split_whitespace().map(|t| t.parse().unwrap()).collect();
    assert_eq!(d.fields().to_vec(), fields, "fields() gives the line back");

    // A /proc/diskstats line of the same device, and our own line() round trip.
    let proc = format!(" 254       0 vda {}", sys.trim());
    assert_eq!(DiskStats::parse(&proc).unwrap(), d);
    let ours = DiskStats {
        ios: [5, 6, 7, 8],
        sectors: [40, 48, 56, 0],
        in_flight: [2, 0],
        io_ticks_ms: 9,
        ..Default::default()
    };
    assert_eq!(
        DiskStats::parse(&ours.line(7, 0, "loop0"))
            .unwrap()
            .fields(),
        ours.fields()
    );

    // An old kernel's 11 fields: the rest read as 0.
    let old = DiskStats::parse("1 2 3 4 5 6 7 8 0 10 11").unwrap();
    assert_eq!((old.writes(), old.ios[2], old.flushes()), (5, 0, 0));

    for bad in ["", "1 2 3", "1 2 3 4 5 6 7 8 9 10 x"] {
        let e = DiskStats::parse(bad).unwrap_err();
        assert!(e.contains("disk statistics"), "{bad:?}: {e}");
    }
}

#[test]
fn dirfs_files_links_and_usage() {
    let dir = tmp();
    let fs = DirFs::new(&dir.path().join("root")).unwrap();
    fs.mkdir_all("a/b").unwrap();
    let mut f = fs.create("a/b/f").unwrap();
    f.write_at(0, b"hello ").unwrap();
    f.write_at(6, b"world").unwrap();
    assert_eq!(f.size().unwrap(), 11);
    f.close().unwrap();
    let mut f = fs.open("a/b/f", false).unwrap();
    let mut buf = [0u8; 32];
    assert_eq!(f.read_at(0, &mut buf).unwrap(), 11);
    assert_eq!(&buf[..11], b"hello world");
    assert_eq!(f.read_at(11, &mut buf).unwrap(), 0);
    assert!(f.write_at(0, b"x").is_err(), "opened read-only");
    f.close().unwrap();

    // create truncates.
    fs.create("a/b/f").unwrap().close().unwrap();
    assert_eq!(
        std::fs::metadata(dir.path().join("root/a/b/f"))
            .unwrap()
            .len(),
        0
    );

    fs.symlink("f", "a/b/l").unwrap();
    assert_eq!(
        std::fs::read_link(dir.path().join("root/a/b/l")).unwrap(),
        std::path::Path::new("f")
    );
    fs.rename("a/b/f", "a/g").unwrap();
    assert!(dir.path().join("root/a/g").exists());
    fs.unlink("a/g").unwrap();
    assert!(fs.unlink("a/g").is_err());

    // A workload cannot reach outside the target.
    for p in ["../x", "a/../../x"] {
        let e = fs.create(p).err().expect("escape rejected");
        assert!(e.to_string().contains("leaves the target"), "{p}: {e}");
    }
    // A leading '/' is the target's root, not the machine's.
    fs.create("/rooted").unwrap().close().unwrap();
    assert!(dir.path().join("root/rooted").exists());

    let (total, used) = fs.usage().unwrap();
    assert!(total > 0 && used <= total);
    fs.sync().unwrap();
    // The sysfs statistics of the device under the directory, where there is one.
    if let Some(name) = fs.device_name() {
        assert!(fs.disk_stats().is_some(), "device {name} without stats");
        assert!(fs.name().contains(name));
    }
    assert!(fs.drop_cache("rooted").unwrap());
}

#[test]
fn async_flushes_complete_after_close_and_on_other_threads() {
    let dir = tmp();
    let fs: Arc<dyn BenchFs> = Arc::new(DirFs::new(dir.path()).unwrap());
    let mut waits = Vec::new();
    // More than the ring's queue depth, so submission has to make room.
    for i in 0..300 {
        let mut f = fs.create(&format!("f{i}")).unwrap();
        f.write_at(0, &[i as u8; 4096]).unwrap();
        waits.push(f.start_flush().unwrap());
        // The file is closed with its flush still in flight, as fs_mark -A does.
        f.close().unwrap();
    }
    // Half are waited on by another thread (the flush keeps its ring with it).
    let rest = waits.split_off(150);
    let h = std::thread::spawn(move || {
        for w in rest {
            w.wait().unwrap();
        }
    });
    for w in waits.into_iter().rev() {
        w.wait().unwrap();
    }
    h.join().unwrap();
    // Dropped without waiting: the drop waits, so the descriptor outlives the flush.
    let mut f = fs.create("dropped").unwrap();
    drop(f.start_flush().unwrap());
    f.close().unwrap();
    for i in 0..300 {
        assert_eq!(
            std::fs::read(dir.path().join(format!("f{i}"))).unwrap(),
            vec![i as u8; 4096]
        );
    }
    assert!(["io_uring", "threads"].contains(&benchfs::async_flush_mechanism()));
}

#[test]
fn targets_need_one_and_both_kinds_open() {
    let e = benchfs::open_targets(None, None).err().unwrap();
    assert!(e.contains("--dir-path"), "{e}");
    let e = benchfs::open_targets(Some("sim:ssd,colour=red"), None)
        .err()
        .unwrap();
    assert!(e.contains("colour"), "{e}");
    let dir = tmp();
    let t = benchfs::open_targets(Some("sim:ssd,size=64M"), Some(dir.path())).unwrap();
    assert_eq!(t.len(), 2);
    assert!(t[0].name().starts_with("wbstack:sim:ssd"));
    assert!(t[1].name().starts_with("dir:"));
    // The wbstack target is a working filesystem with device statistics.
    let mut f = t[0].create("x").unwrap();
    f.write_at(0, &[7u8; 8192]).unwrap();
    f.close().unwrap();
    let before = t[0].disk_stats().unwrap();
    t[0].sync().unwrap();
    assert!(t[0].disk_stats().unwrap().delta(&before).writes() >= 1);
    let (total, used) = t[0].usage().unwrap();
    assert!(used >= 8192 && used < total);
}
