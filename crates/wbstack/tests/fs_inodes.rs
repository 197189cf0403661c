//! Metadata on demand (issue 16): on a format 5 volume an inode not in use and unchanged
//! since the durable checkpoint leaves memory past `inode_cache`, and comes back from
//! the metadata tree exactly as it was; a deleted one never comes back.

mod common;

use common::{queue, quiet};
use std::collections::BTreeMap;
use std::sync::Arc;
use wbstack::block::RequestQueue;
use wbstack::fs::ops::XattrMode;
use wbstack::fs::perm::Cred;
use wbstack::fs::{FsError, MkfsOptions, MountOptions, Stat, Volume};

const LIMIT: usize = 8;

fn mount(q: &Arc<RequestQueue>) -> Volume {
    let mut o: MountOptions = quiet();
    o.inode_cache = LIMIT;
    Volume::mount(q.clone(), o).unwrap()
}

/// Everything a file shows: its stat, data, target and attribute.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    stat: Stat,
    data: Vec<u8>,
    target: Option<String>,
    xattr: Option<Vec<u8>>,
}

fn look(v: &Volume, path: &str) -> Seen {
    let stat = v.lstat(path).unwrap();
    let target = v.readlink(path).ok();
    let data = if target.is_none() {
        let f = v.open(path, &wbstack::fs::OpenOptions::read()).unwrap();
        let mut buf = vec![0u8; f.size() as usize];
        assert_eq!(f.read_at(0, &mut buf).unwrap(), buf.len());
        f.close().unwrap();
        buf
    } else {
        Vec::new()
    };
    let xattr = v.getxattr_as(&Cred::root(), stat.ino, b"user.k").ok();
    Seen {
        stat,
        data,
        target,
        xattr,
    }
}

fn look_all(v: &Volume, paths: &[String]) -> BTreeMap<String, Seen> {
    paths.iter().map(|p| (p.clone(), look(v, p))).collect()
}

/// Drop the files' pages (an inode with pages stays, as the kernel's does while its
/// pages are cached), checkpoint (reads changed atimes), then open and close a file
/// until at most `bound` inodes are in memory: each open and close prunes a batch of
/// mappings, then the inodes they held.
fn prune_until(v: &Volume, paths: &[String], bound: u64) -> usize {
    for p in paths {
        v.drop_cache(p).unwrap();
    }
    v.checkpoint().unwrap();
    for n in 0..1000 {
        if v.inode_cache_stats().inodes_resident <= bound {
            return n;
        }
        v.create("/d/churn").unwrap().close().unwrap();
    }
    panic!("inodes stayed in memory: {:?}", v.inode_cache_stats());
}

#[test]
fn clean_inodes_leave_memory_and_come_back_as_they_were() {
    let q = queue("sim:ssd,size=256M");
    let mk = MkfsOptions {
        format: Some(5),
        ..Default::default()
    };
    Volume::mkfs(&q, &mk).unwrap();
    let v = mount(&q);
    v.mkdir("/d", 0o755).unwrap();
    let mut paths = Vec::new();
    for i in 0..300u32 {
        let p = format!("/d/f{i}");
        let f = v.create(&p).unwrap();
        let len = (i as usize * 37) % 9000;
        let data: Vec<u8> = (0..len).map(|b| (b as u32 ^ i) as u8).collect();
        f.write_at(0, &data).unwrap();
        f.close().unwrap();
        if i % 7 == 0 {
            let ino = v.stat(&p).unwrap().ino;
            v.setxattr_as(
                &Cred::root(),
                ino,
                b"user.k",
                &i.to_le_bytes(),
                XattrMode::Create,
            )
            .unwrap();
        }
        if i % 10 == 0 {
            v.symlink(&format!("f{i}"), &format!("/d/s{i}")).unwrap();
            paths.push(format!("/d/s{i}"));
        }
        if i % 13 == 0 {
            v.link(&p, &format!("/d/h{i}")).unwrap();
            paths.push(format!("/d/h{i}"));
        }
        paths.push(p);
    }
    let before = look_all(&v, &paths);
    // Nothing leaves memory before a checkpoint holds it.
    for p in &paths {
        v.drop_cache(p).unwrap();
    }
    v.sync().unwrap();
    v.create("/d/churn").unwrap().close().unwrap();
    assert_eq!(v.inode_cache_stats().inodes_dropped, 0);
    // The root, /d, churn and the limit's worth of clean ones, at most.
    prune_until(&v, &paths, LIMIT as u64 + 3);
    let s = v.inode_cache_stats();
    assert!(s.inodes_dropped >= 300, "{s:?}");
    assert_eq!(look_all(&v, &paths), before, "inodes read back differ");
    let s = v.inode_cache_stats();
    assert!(s.inodes_read_back >= 300, "{s:?}");
    assert!(v.check().is_empty(), "{:?}", v.check());

    // A deleted inode does not come back from the tree, which still holds it until
    // the next checkpoint.
    prune_until(&v, &paths, LIMIT as u64 + 3);
    let gone = v.stat("/d/f1").unwrap().ino;
    v.unlink("/d/f1").unwrap();
    v.create("/d/churn").unwrap().close().unwrap();
    assert!(v.inode_cache_stats().inodes_resident <= LIMIT as u64 + 3);
    assert!(matches!(v.stat_ino(gone), Err(FsError::NotFound(_))));
    paths.retain(|p| p != "/d/f1");
    prune_until(&v, &paths, LIMIT as u64 + 3);
    assert!(matches!(v.stat_ino(gone), Err(FsError::NotFound(_))));
    let before = look_all(&v, &paths);
    // A change to a dropped inode sticks: it stays in memory until a checkpoint holds
    // it, then comes back changed.
    prune_until(&v, &paths, LIMIT as u64 + 3);
    let f = v
        .open("/d/f2", &wbstack::fs::OpenOptions::read_write())
        .unwrap();
    f.set_len(77).unwrap();
    f.close().unwrap();
    let f2 = look(&v, "/d/f2");
    assert_eq!(f2.stat.size, 77);
    // Changed and committed, but not yet in a checkpoint: kept while prunes drop the
    // others, where a read back would find the tree's old size.
    v.sync().unwrap();
    for p in &paths {
        v.drop_cache(p).unwrap();
    }
    for _ in 0..10 {
        v.create("/d/churn").unwrap().close().unwrap();
    }
    let s = v.inode_cache_stats();
    assert!(s.inodes_resident <= LIMIT as u64 + 4, "{s:?}");
    assert_eq!(look(&v, "/d/f2").stat.size, 77);
    assert_eq!(v.inode_cache_stats().inodes_read_back, s.inodes_read_back);
    prune_until(&v, &paths, LIMIT as u64 + 3);
    assert_eq!(look(&v, "/d/f2"), f2);
    let mut before = before;
    before.insert("/d/f2".into(), f2);
    v.unmount().unwrap();

    let v = mount(&q);
    assert_eq!(look_all(&v, &paths), before, "after a remount");
    assert!(v.check().is_empty(), "{:?}", v.check());
    v.unmount().unwrap();
    let r = wbstack::fs::fsck::fsck(&q);
    assert!(r.is_clean(), "{:?}", r.problems);
}
