//! The metadata as tree keys (issue 16, step 2's groundwork): a tree kept up to date
//! from the keys `Meta::apply` reports changed, checkpoint after checkpoint, loads back
//! as exactly the metadata; the ops cost what changed; `load` is total.

use proptest::prelude::*;
use wbstack::fs::btree::Tree;
use wbstack::fs::format::{InodeKind, Record};
use wbstack::fs::meta::{ApplyMode, Meta};
use wbstack::fs::metatree::{self, TreeOp};

const FS_ID: u64 = 0xfeed;
const NODE: usize = 4096;
const DATA_START: u64 = 10;
const NR_BLOCKS: u64 = 20_000;

mod common;
use common::MemStore;

/// A tree that holds no inode: nothing here is ever read back.
struct NoSource;

impl wbstack::fs::inodes::InodeSource for NoSource {
    fn read_inodes(&self, _inos: &[u64]) -> wbstack::fs::inodes::Read {
        wbstack::fs::inodes::Read {
            gen: 0,
            inodes: Ok(Vec::new()),
        }
    }

    fn read_all(&self) -> wbstack::fs::inodes::Read {
        self.read_inodes(&[])
    }

    fn read_dirents(
        &self,
        asked: &[wbstack::fs::inodes::DirMiss],
    ) -> wbstack::fs::inodes::DirentsRead {
        wbstack::fs::inodes::DirentsRead {
            gen: 0,
            found: Ok(wbstack::fs::inodes::DirentsFound {
                parts: vec![Default::default(); asked.len()],
                ..Default::default()
            }),
        }
    }
}

fn assert_same(a: &mut Meta, b: &mut Meta) {
    assert_eq!(a.next_ino, b.next_ino);
    assert_eq!(a.orphans, b.orphans);
    assert_eq!(a.nr_inodes(), b.nr_inodes());
    assert_eq!(*a.resident_inodes(), *b.resident_inodes());
    assert_eq!(
        a.alloc.space().extents().collect::<Vec<_>>(),
        b.alloc.space().extents().collect::<Vec<_>>()
    );
}

fn name() -> impl Strategy<Value = Vec<u8>> {
    prop::sample::select(vec![
        b"a".to_vec(),
        b"b".to_vec(),
        b"dir".to_vec(),
        vec![b'x'; 255],
    ])
}

fn ino() -> impl Strategy<Value = u64> {
    2u64..16
}

/// Records on a few inodes and names, so that many of them apply.
fn record() -> impl Strategy<Value = Record> {
    prop_oneof![
        3 => (ino(), prop::sample::select(vec![InodeKind::File, InodeKind::Dir, InodeKind::Symlink]))
            .prop_map(|(ino, kind)| Record::Create { ino, kind, mode: 0o644, uid: 1, gid: 2, time_ns: 7 }),
        4 => (0u64..16, name(), ino()).prop_map(|(p, name, ino)| Record::Link { parent: p.max(1), name, ino }),
        2 => (0u64..16, name(), ino()).prop_map(|(p, name, ino)| Record::Unlink { parent: p.max(1), name, ino }),
        1 => (ino(), 0u64..100_000).prop_map(|(ino, size)| Record::SetSize { ino, size }),
        1 => (ino(), any::<u32>()).prop_map(|(ino, mode)| Record::SetAttr { ino, mode, uid: 3, gid: 4, atime_ns: 5, mtime_ns: 6, ctime_ns: 8 }),
        // Device blocks follow file blocks, so runs mapped one after the other merge.
        6 => (ino(), 0u64..24, 1u64..4)
            .prop_map(|(ino, file_block, len)| Record::MapExtent { ino, file_block, start: 100 + ino * 100 + file_block, len }),
        1 => (ino(), 0u64..100_000).prop_map(|(ino, size)| Record::Truncate { ino, size }),
        1 => (ino(), prop::collection::vec(any::<u8>(), 1..2000)).prop_map(|(ino, target)| Record::SetTarget { ino, target }),
        1 => ino().prop_map(|ino| Record::Orphan { ino }),
        1 => ino().prop_map(|ino| Record::Delete { ino }),
        1 => (ino(), prop::sample::select(vec![b"user.a".to_vec(), b"user.b".to_vec()]), prop::collection::vec(any::<u8>(), 0..3000))
            .prop_map(|(ino, name, value)| Record::SetXattr { ino, name, value }),
        1 => (ino(), prop::sample::select(vec![b"user.a".to_vec(), b"user.b".to_vec()]))
            .prop_map(|(ino, name)| Record::RemoveXattr { ino, name }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, .. ProptestConfig::default() })]

    #[test]
    fn a_tree_kept_up_to_date_loads_back_as_the_metadata(
        batches in prop::collection::vec(prop::collection::vec(record(), 1..40), 1..8),
        seed in any::<u64>(),
        chunk in 1..8usize,
    ) {
        let mut meta = Meta::mkfs(DATA_START, NR_BLOCKS, 1, seed);
        let store = MemStore::default();
        let mut tree = Tree::new(FS_ID, NODE);
        // The first checkpoint writes everything there is.
        let changes = metatree::all_changes(&mut meta);
        let all = metatree::ops(&meta, changes);
        metatree::apply(&mut tree, &store, &all).unwrap();
        meta.track_changes(true);
        for (n, batch) in batches.into_iter().enumerate() {
            for r in batch {
                // Records that do not apply (no such inode...) change nothing.
                let _ = meta.apply(&r, ApplyMode::Replay);
            }
            // As a checkpoint applies them: made and applied a chunk at a time, chunks
            // small enough to hold several kinds of keys.
            let ch = meta.take_changes();
            let captured = metatree::capture(&meta, ch);
            metatree::apply_captured_by(&mut tree, &store, captured, chunk).unwrap();
            store.write(&mut tree, n as u64 + 1);
            let mut loaded = metatree::load(&tree, &store, seed, &[], DATA_START, NR_BLOCKS).unwrap();
            assert_same(&mut loaded, &mut meta);
            prop_assert!(loaded.check().is_empty() == meta.check().is_empty());
        }
        // A tree built from scratch holds the same.
        let mut fresh = Tree::new(FS_ID, NODE);
        let changes = metatree::all_changes(&mut meta);
        let all = metatree::ops(&meta, changes);
        metatree::apply(&mut fresh, &store, &all).unwrap();
        let a = tree.range(&store, std::ops::Bound::Unbounded, std::ops::Bound::Unbounded).unwrap();
        let b = fresh.range(&store, std::ops::Bound::Unbounded, std::ops::Bound::Unbounded).unwrap();
        prop_assert_eq!(a, b);
    }

    /// A checkpoint's capture taken copy-on-write (`fs::cowcapture`: the committer
    /// copies batches while operations go on, and an inode about to change is copied
    /// first) holds the values at the close, whatever changed since and in whatever
    /// interleaving.
    #[test]
    fn a_copy_on_write_capture_holds_the_values_at_the_close(
        before in prop::collection::vec(record(), 1..60),
        after in prop::collection::vec(record(), 0..60),
        seed in any::<u64>(),
        batch in 1..5usize,
        every in 1..6usize,
        list_apart in any::<bool>(),
    ) {
        let mut meta = Meta::mkfs(DATA_START, NR_BLOCKS, 1, seed);
        // Stamps are kept (what the copy on write goes by) once inodes are a cache.
        meta.set_source(std::sync::Arc::new(NoSource));
        meta.track_changes(true);
        for r in &before {
            let _ = meta.apply(r, ApplyMode::Replay);
        }
        let ch = meta.take_changes();
        let at_close = metatree::capture(&meta, ch.clone()).ops();
        prop_assert!(meta.begin_capture(ch).is_none(), "a lazy volume captures copy-on-write");
        // The committer's list of the inodes to copy, made without `st` from the keys
        // (`Meta::capture_changes`) and given back after some changes went on.
        let apart = list_apart.then(|| meta.capture_changes().expect("the list not made yet"));
        let mut apart = apart.map(|(gen, ch)| (gen, metatree::changed_inodes(&ch)));
        let mut done = false;
        for (k, r) in after.iter().enumerate() {
            let _ = meta.apply(r, ApplyMode::Replay);
            if let Some((gen, list)) = apart.take() {
                meta.capture_set_inodes(gen, list);
            }
            if k % every == 0 && !done {
                done = meta.capture_step(batch);
            }
        }
        if let Some((gen, list)) = apart.take() {
            meta.capture_set_inodes(gen, list);
        }
        while !meta.capture_step(batch) {}
        let got = meta.take_capture().expect("the capture pending").finish().ops();
        prop_assert_eq!(got, at_close);
    }

    /// Any keys and values in a tree load as metadata or an error, never a panic.
    #[test]
    fn loading_any_tree_is_total(entries in prop::collection::vec(
        (prop::collection::vec(prop::sample::select(vec![0u8, 1, 2, 3, 4, 0xff]), 1..24),
         prop::collection::vec(any::<u8>(), 0..60)), 0..60)) {
        let store = MemStore::default();
        let mut tree = Tree::new(FS_ID, NODE);
        for (k, v) in &entries {
            tree.insert(&store, k, v).unwrap();
        }
        let _ = metatree::load(&tree, &store, 1, &[], DATA_START, NR_BLOCKS);
    }
}

#[test]
fn a_small_change_makes_few_operations() {
    let mut meta = Meta::mkfs(DATA_START, NR_BLOCKS, 1, 9);
    for ino in 2..2002 {
        meta.apply(
            &Record::Create {
                ino,
                kind: InodeKind::File,
                mode: 0o644,
                uid: 0,
                gid: 0,
                time_ns: 1,
            },
            ApplyMode::Replay,
        )
        .unwrap();
        meta.apply(
            &Record::Link {
                parent: 1,
                name: format!("f{ino}").into_bytes(),
                ino,
            },
            ApplyMode::Replay,
        )
        .unwrap();
    }
    meta.track_changes(true);
    meta.apply(&Record::SetSize { ino: 77, size: 5 }, ApplyMode::Replay)
        .unwrap();
    let ops = metatree::ops(&meta, meta.clone().take_changes());
    let ch = meta.take_changes();
    assert_eq!(ch.inodes.len(), 1);
    // The filesystem record and the one inode: not the 2000 others.
    assert_eq!(ops.len(), 2, "{ops:?}");
    assert!(matches!(&ops[1], TreeOp::Put(k, _) if k[1..9] == 77u64.to_be_bytes()));
}

/// A step of a copy-on-write capture stops once it copied its batch of keys, not only
/// its batch of inodes: 100 directories of 10 entries each (11 keys and more per
/// directory) take a step each, then 1,000 files (a key each) 10 per step. By inodes
/// alone the 1,102 inodes took 111 steps, the directories' ten to a step (the hold of
/// `st` of fs_mark's directories was 36-56 ms).
#[test]
fn a_capture_step_stops_at_its_batch_of_keys() {
    let mut meta = Meta::mkfs(DATA_START, NR_BLOCKS, 1, 3);
    meta.set_source(std::sync::Arc::new(NoSource));
    meta.track_changes(true);
    let create = |meta: &mut Meta, ino: u64, kind: InodeKind, parent: u64| {
        let r = Record::Create {
            ino,
            kind,
            mode: 0o755,
            uid: 0,
            gid: 0,
            time_ns: 1,
        };
        meta.apply(&r, ApplyMode::Replay).unwrap();
        let name = format!("n{ino}").into_bytes();
        meta.apply(&Record::Link { parent, name, ino }, ApplyMode::Replay)
            .unwrap();
    };
    for d in 0..100u64 {
        create(&mut meta, 2 + d, InodeKind::Dir, 1);
    }
    for f in 0..1000u64 {
        create(&mut meta, 102 + f, InodeKind::File, 2 + f / 10);
    }
    let ch = meta.take_changes();
    assert!(meta.begin_capture(ch).is_none());
    let mut steps = 1;
    while !meta.capture_step(10) {
        steps += 1;
    }
    // The root (101 keys: its core and 100 entries), each directory alone, the files
    // ten to a step.
    assert_eq!(steps, 1 + 100 + 100);
    assert!(meta.take_capture().is_some());
}

#[test]
fn the_name_hash_is_part_of_the_format() {
    // Directory keys on disk are ordered by it: it must never change.
    assert_eq!(metatree::name_hash(0, b"a"), 8_287_239_715_489_839_318);
    assert!(metatree::name_hash(1, b"") >= 2);
}

/// A file's mapping notes the keys it changes and no other: a new file's first run is
/// one put, a run that grows the one before it rewrites that one, and a run that joins
/// the next deletes the next's key. A key noted that never held a value cost every
/// new small file a deletion's descent of the tree at its checkpoint.
#[test]
fn mapping_a_file_notes_only_the_extent_keys_it_changes() {
    let mut meta = Meta::mkfs(DATA_START, NR_BLOCKS, 1, 9);
    let create = Record::Create {
        ino: 2,
        kind: InodeKind::File,
        mode: 0o644,
        uid: 0,
        gid: 0,
        time_ns: 1,
    };
    meta.apply(&create, ApplyMode::Replay).unwrap();
    meta.track_changes(true);
    let map = |file_block: u64| Record::MapExtent {
        ino: 2,
        file_block,
        start: 500 + file_block,
        len: 1,
    };
    let extent_ops = |meta: &mut Meta| -> Vec<(&'static str, u64)> {
        let ch = meta.take_changes();
        metatree::ops(meta, ch)
            .into_iter()
            .filter_map(|op| match op {
                TreeOp::Put(k, _) if k.len() == 18 && k[9] == 2 => {
                    Some(("put", u64::from_be_bytes(k[10..18].try_into().unwrap())))
                }
                TreeOp::Del(k) if k.len() == 18 && k[9] == 2 => {
                    Some(("del", u64::from_be_bytes(k[10..18].try_into().unwrap())))
                }
                _ => None,
            })
            .collect()
    };
    meta.apply(&map(0), ApplyMode::Replay).unwrap();
    assert_eq!(extent_ops(&mut meta), [("put", 0)]);
    // Grows the run at 0.
    meta.apply(&map(1), ApplyMode::Replay).unwrap();
    assert_eq!(extent_ops(&mut meta), [("put", 0)]);
    // A run of its own at 3, then 2 joins 0..2 and 3.
    meta.apply(&map(3), ApplyMode::Replay).unwrap();
    assert_eq!(extent_ops(&mut meta), [("put", 3)]);
    meta.apply(&map(2), ApplyMode::Replay).unwrap();
    assert_eq!(extent_ops(&mut meta), [("put", 0), ("del", 3)]);
}

/// A directory read back lazily (`load_inode`, `load_files`) keeps its groups of
/// entries cold, their names dropped as the scan passes them, with the counts the
/// names would give; a group with an entry whose kind was not recorded (format 4)
/// comes back resident, every name of it; an entry of a directory that has no core
/// record is corruption, not a panic.
#[test]
fn a_directory_read_back_lazily_keeps_its_groups_cold_with_their_counts() {
    const SEED: u64 = 5;
    let mut meta = Meta::mkfs(DATA_START, NR_BLOCKS, 1, SEED);
    let mut apply = |r: Record| meta.apply(&r, ApplyMode::Replay).unwrap();
    apply(Record::Create {
        ino: 2,
        kind: InodeKind::Dir,
        mode: 0o755,
        uid: 0,
        gid: 0,
        time_ns: 1,
    });
    apply(Record::Link {
        parent: 1,
        name: b"d".to_vec(),
        ino: 2,
    });
    for (ino, kind, name) in [
        (3, InodeKind::File, "a"),
        (4, InodeKind::Dir, "sub"),
        (5, InodeKind::File, "b"),
        (6, InodeKind::Symlink, "c"),
    ] {
        apply(Record::Create {
            ino,
            kind,
            mode: 0o644,
            uid: 0,
            gid: 0,
            time_ns: 1,
        });
        apply(Record::Link {
            parent: 2,
            name: name.as_bytes().to_vec(),
            ino,
        });
    }
    let store = MemStore::default();
    let mut tree = Tree::new(FS_ID, NODE);
    let changes = metatree::all_changes(&mut meta);
    metatree::apply(&mut tree, &store, &metatree::ops(&meta, changes)).unwrap();

    let d = metatree::load_inode(&tree, &store, SEED, 2, metatree::LISTED_MAX)
        .unwrap()
        .unwrap();
    assert_eq!(d.entries.len(), 4);
    assert_eq!(d.entries.resident_len(), 0, "every group cold");
    assert_eq!(d.entries.subdirs(), Some(1));
    let all = metatree::load_files(&tree, &store, SEED).unwrap();
    let d = &all.iter().find(|(ino, _)| *ino == 2).unwrap().1;
    assert_eq!((d.entries.len(), d.entries.resident_len()), (4, 0));

    // The key of "b" in directory 2, as the format lays it out: the inode space, the
    // directory, the entries' space, the name's hash, the name.
    let key = |dir: u64, name: &[u8]| {
        let mut k = vec![0x01];
        k.extend_from_slice(&dir.to_be_bytes());
        k.push(0x03);
        k.extend_from_slice(&metatree::name_hash(SEED, name).to_be_bytes());
        k.extend_from_slice(name);
        k
    };
    // "b" without its kind, as format 4 wrote entries: its group stays resident.
    let ops = [TreeOp::Put(key(2, b"b"), 5u64.to_le_bytes().to_vec())];
    metatree::apply(&mut tree, &store, &ops).unwrap();
    let d = metatree::load_inode(&tree, &store, SEED, 2, metatree::LISTED_MAX)
        .unwrap()
        .unwrap();
    assert_eq!((d.entries.len(), d.entries.resident_len()), (4, 1));
    assert_eq!(d.entries.iter().collect::<Vec<_>>(), vec![(&b"b"[..], 5)]);
    // A listing (an unlisted directory's) counts the groups whose kinds are recorded,
    // in hash order, and reads "b"'s whole.
    let l = metatree::load_listing(&tree, &store, SEED, 2).unwrap();
    let names: Vec<&[u8]> = l.entries.iter().map(|e| &e.name[..]).collect();
    assert_eq!(names, vec![&b"b"[..]]);
    assert_eq!(l.entries[0].kind, None);
    let mut want: Vec<(u64, u32, u32)> = [("a", 0), ("sub", 1), ("c", 0)]
        .iter()
        .map(|&(n, s)| (metatree::name_hash(SEED, n.as_bytes()), 1, s))
        .collect();
    want.sort_unstable();
    let got: Vec<(u64, u32, u32)> = (l.groups.iter())
        .inspect(|g| assert_eq!(g.dir, 2))
        .map(|g| (g.hash, g.names, g.subdirs))
        .collect();
    assert_eq!(got, want);
    let empty = metatree::load_listing(&tree, &store, SEED, 3).unwrap();
    assert!(empty.entries.is_empty() && empty.groups.is_empty());

    // An entry of inode 9, which has no core record.
    let ops = [TreeOp::Put(
        key(9, b"x"),
        [3u64.to_le_bytes().as_slice(), &[1]].concat(),
    )];
    metatree::apply(&mut tree, &store, &ops).unwrap();
    let e = metatree::load_inode(&tree, &store, SEED, 9, metatree::LISTED_MAX).unwrap_err();
    assert!(
        e.to_string().contains("inode 9, which does not exist"),
        "{e}"
    );
    assert!(metatree::load_files(&tree, &store, SEED).is_err());
}
