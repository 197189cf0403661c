//! The on-disk format: round trips, checksums catching corruption, and parsers that
//! never panic on arbitrary bytes (the fuzz targets of the superblock, journal and
//! checkpoint parsers, run as proptests).

use proptest::prelude::*;
use wbstack::fs::format::*;

fn record() -> impl Strategy<Value = Record> {
    let name = prop::collection::vec(
        prop::num::u8::ANY.prop_filter("no / or NUL", |b| *b != b'/' && *b != 0),
        1..40,
    )
    // What the decoder accepts (`valid_name`): "." and ".." are refused.
    .prop_filter("not . or ..", |n| n != b"." && n != b"..");
    prop_oneof![
        (
            any::<u64>(),
            1u8..8,
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
            any::<u64>()
        )
            .prop_map(|(ino, k, mode, uid, gid, t)| {
                let kind = InodeKind::from_u8(k).unwrap();
                Record::Create {
                    ino,
                    kind,
                    mode,
                    uid,
                    gid,
                    time_ns: t,
                }
            }),
        (any::<u64>(), name.clone(), any::<u64>()).prop_map(|(parent, name, ino)| Record::Link {
            parent,
            name,
            ino
        }),
        (any::<u64>(), name, any::<u64>()).prop_map(|(parent, name, ino)| Record::Unlink {
            parent,
            name,
            ino
        }),
        (any::<u64>(), any::<u64>()).prop_map(|(ino, size)| Record::SetSize { ino, size }),
        (any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()).prop_map(
            |(ino, file_block, start, len)| Record::MapExtent {
                ino,
                file_block,
                start,
                len
            }
        ),
        (any::<u64>(), any::<u64>()).prop_map(|(ino, size)| Record::Truncate { ino, size }),
        (any::<u64>(), prop::collection::vec(1u8..255, 1..100))
            .prop_map(|(ino, target)| Record::SetTarget { ino, target }),
        any::<u64>().prop_map(|ino| Record::Orphan { ino }),
        any::<u64>().prop_map(|ino| Record::Delete { ino }),
        (any::<u64>(), any::<u32>()).prop_map(|(ino, rdev)| Record::SetRdev { ino, rdev }),
        (
            any::<u64>(),
            xattr_name(),
            prop::collection::vec(any::<u8>(), 0..300)
        )
            .prop_map(|(ino, name, value)| Record::SetXattr { ino, name, value }),
        (any::<u64>(), xattr_name()).prop_map(|(ino, name)| Record::RemoveXattr { ino, name }),
        (any::<u64>(), any::<u8>(), any::<u64>()).prop_map(|(block, b, seed)| {
            let data: Vec<u8> = (0..BLOCK_SIZE as u64)
                .map(|i| (i.wrapping_mul(seed | 1) >> 7) as u8 ^ b)
                .collect();
            let data = std::sync::Arc::new(wbstack::buf::IoBuf::from_slice(&data));
            Record::DataBlock { block, data }
        }),
        any::<u64>().prop_map(|block| Record::Revoke { block }),
    ]
}

/// A name in one of the namespaces an image may hold.
fn xattr_name() -> impl Strategy<Value = Vec<u8>> {
    (
        prop::sample::select(XATTR_NAMESPACES.to_vec()),
        prop::collection::vec(1u8..255, 0..60),
    )
        .prop_map(|(ns, rest)| [ns, &rest[..]].concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]

    #[test]
    fn records_keep_their_order_across_chunks(records in prop::collection::vec(record(), 0..3000), bump in any::<u64>()) {
        let mut log = Records::new();
        for (k, r) in records.iter().enumerate() {
            log.push(r.clone());
            prop_assert_eq!(log.len(), k + 1);
            prop_assert_eq!(log.last_mut().map(|l| &*l), Some(r));
        }
        prop_assert_eq!(log.iter().cloned().collect::<Vec<_>>(), records.clone());
        prop_assert_eq!((&log).into_iter().count(), records.len());
        // Chunking is invisible: built at once, equal; a change through last_mut is
        // the last record's.
        prop_assert_eq!(&log, &Records::from(records.clone()));
        if let Some(Record::SetSize { size, .. }) = log.last_mut() {
            *size ^= bump | 1;
            prop_assert_ne!(&log, &Records::from(records.clone()));
        }
        prop_assert_eq!(log.is_empty(), records.is_empty());
    }

    #[test]
    fn transactions_round_trip(fs_id in any::<u64>(), tid in any::<u64>(), records in prop::collection::vec(record(), 0..50)) {
        let t = Txn { fs_id, tid, records: records.into() };
        let enc = t.encode();
        prop_assert_eq!(enc.len() % BLOCK_SIZE, 0);
        // The committer places a transaction by this length before it encodes it.
        prop_assert_eq!(t.encoded_len(), enc.len());
        let (back, used) = Txn::decode(&enc).unwrap();
        prop_assert_eq!(used, enc.len());
        prop_assert_eq!(back, t);
    }

    #[test]
    fn a_records_encoded_len_is_what_it_encodes_to(r in record()) {
        let mut w = wbstack::fs::format::Writer::default();
        r.encode(&mut w);
        prop_assert_eq!(r.encoded_len(), w.0.len());
    }

    #[test]
    fn any_single_bit_flip_in_a_transaction_is_caught(records in prop::collection::vec(record(), 1..10), bit in any::<prop::sample::Index>()) {
        let t = Txn { fs_id: 7, tid: 3, records: records.into() };
        let mut enc = t.encode();
        let (_, used) = Txn::decode(&enc).unwrap();
        // Flip a bit in the meaningful part (header, records, checksum), not padding.
        let meaningful = enc.iter().rposition(|&b| b != 0).unwrap_or(0) + 1;
        let i = bit.index(meaningful * 8);
        enc[i / 8] ^= 1 << (i % 8);
        let r = Txn::decode(&enc);
        prop_assert!(r.is_err() || r.as_ref().unwrap().1 != used || r.unwrap().0 != t);
    }

    #[test]
    fn superblock_and_checkpoint_round_trip(nr in 1024u64..(1u64 << 36), id in any::<u64>(), seq in any::<u64>(), image in prop::collection::vec(any::<u8>(), 0..9000)) {
        let sb = Superblock::layout(nr, id, 5).unwrap();
        prop_assert_eq!(Superblock::decode(&sb.encode()).unwrap(), sb);
        let c = Checkpoint { fs_id: id, seq, tid: seq / 2, journal_pos: seq % 7, image };
        prop_assert_eq!(Checkpoint::decode(&c.encode()).unwrap(), c);
    }

    #[test]
    fn parsers_never_panic_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..5000)) {
        let _ = Superblock::decode(&bytes);
        let _ = Txn::decode(&bytes);
        let _ = Checkpoint::decode(&bytes);
        let _ = Record::decode(&mut Reader::new(&bytes, "fuzz"));
    }

    #[test]
    fn parsers_never_panic_on_corrupted_valid_images(records in prop::collection::vec(record(), 1..10), flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)) {
        // Start from valid encodings with forged checksums recomputed, so corruption
        // reaches the field decoders instead of stopping at the CRC.
        let mut enc = Txn { fs_id: 1, tid: 1, records: records.into() }.encode();
        let body_end = enc.iter().rposition(|&b| b != 0).unwrap_or(0) + 1;
        for (i, v) in &flips {
            let at = i.index(body_end.saturating_sub(4).max(1));
            enc[at] = *v;
        }
        let crc_at = body_end.saturating_sub(4);
        if crc_at >= 28 {
            let c = crc(&enc[..crc_at]);
            enc[crc_at..crc_at + 4].copy_from_slice(&c.to_le_bytes());
        }
        let _ = Txn::decode(&enc);
        let mut sb = Superblock::layout(1 << 20, 9, 9).unwrap().encode();
        for (i, v) in &flips {
            let at = i.index(SB_FIELDS);
            sb[at] = *v;
        }
        let c = crc(&sb[..SB_FIELDS]);
        sb[SB_FIELDS..SB_FIELDS + 4].copy_from_slice(&c.to_le_bytes());
        let _ = Superblock::decode(&sb);
    }
}

#[test]
fn errors_say_what_is_wrong() {
    let sb = Superblock::layout(1 << 20, 42, 1).unwrap();
    let mut enc = sb.encode();
    enc[0] = b'X';
    assert!(matches!(
        Superblock::decode(&enc),
        Err(FormatError::BadMagic(_))
    ));
    assert!(Superblock::decode(&enc)
        .unwrap_err()
        .to_string()
        .contains("not a wbstack image"));
    let mut enc = sb.encode();
    enc[8] = 9;
    let e = Superblock::decode(&enc).unwrap_err().to_string();
    assert!(
        e.contains("version 9 is not supported") && e.contains("a newer wbstack made this image"),
        "{e}"
    );
    let mut enc = sb.encode();
    enc[20] ^= 1;
    let e = Superblock::decode(&enc).unwrap_err().to_string();
    assert!(e.contains("checksum mismatch") && e.contains("fsck"), "{e}");
    assert!(Superblock::decode(&sb.encode()[..40])
        .unwrap_err()
        .to_string()
        .contains("truncated"));
    assert!(Superblock::layout(100, 1, 1)
        .unwrap_err()
        .to_string()
        .contains("too small"));
    // A stale transaction of another filesystem decodes but carries its own id.
    let t = Txn {
        fs_id: 1,
        tid: 5,
        records: vec![Record::Orphan { ino: 3 }].into(),
    };
    assert_eq!(Txn::decode(&t.encode()).unwrap().0.fs_id, 1);
}

#[test]
fn newest_valid_checkpoint_wins_and_a_torn_one_is_skipped() {
    let a = Checkpoint {
        fs_id: 5,
        seq: 10,
        tid: 100,
        journal_pos: 0,
        image: vec![1; 5000],
    }
    .encode();
    let b = Checkpoint {
        fs_id: 5,
        seq: 11,
        tid: 120,
        journal_pos: 3,
        image: vec![2; 5000],
    }
    .encode();
    assert_eq!(Checkpoint::newest(5, [&a, &b]).unwrap().seq, 11);
    let mut torn = b.clone();
    torn[4096..].fill(0); // the second block never reached the disk
    assert_eq!(Checkpoint::newest(5, [&a, &torn]).unwrap().seq, 10);
    let other = Checkpoint {
        fs_id: 6,
        seq: 99,
        tid: 1,
        journal_pos: 0,
        image: vec![],
    }
    .encode();
    assert_eq!(Checkpoint::newest(5, [&a, &other]).unwrap().seq, 10);
    let e = Checkpoint::newest(5, [&torn, &other])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no valid checkpoint") && e.contains("another filesystem"),
        "{e}"
    );
}

#[test]
fn a_100_tib_layout_is_instant_and_sane() {
    let t = std::time::Instant::now();
    let sb = Superblock::layout((100u64 << 40) / 4096, 1, 1).unwrap();
    sb.check().unwrap();
    // Journal and two checkpoint slots: about 2.3 GiB of 100 TiB.
    assert!(sb.data_start < 600_000, "{}", sb.data_start);
    assert!(t.elapsed().as_millis() < 100);
}

mod common;

/// A version 1 image (superblock version 1, a checkpoint image without the v2 extras
/// section) mounts, keeps its files, and is version 3 (`WHOLE_VERSION`) on disk
/// afterwards.
#[test]
fn a_version_1_image_mounts_and_is_upgraded() {
    use wbstack::fs::{MkfsOptions, Volume};
    let q = common::queue("sim:ssd,size=64M");
    let sb = Volume::mkfs(&q, &MkfsOptions::default()).unwrap();
    wbstack::fs::fuzz::make_version_1(&q, &sb).unwrap();
    let v = Volume::mount(q.clone(), common::quiet()).unwrap();
    let f = v.create("/kept").unwrap();
    f.write_at(0, b"v1 data").unwrap();
    f.close().unwrap();
    v.unmount().unwrap();
    let on_disk = Superblock::decode(q.read_sync(0, 4096).unwrap().as_slice()).unwrap();
    assert_eq!(on_disk.version, wbstack::fs::format::WHOLE_VERSION);
    let v = Volume::mount(q, common::quiet()).unwrap();
    let mut b = [0u8; 7];
    v.open("/kept", &Default::default())
        .unwrap()
        .read_at(0, &mut b)
        .unwrap();
    assert_eq!(&b, b"v1 data");
    v.unmount().unwrap();
}

/// What version 2 added survives a checkpoint (unmount, remount) and a crash (journal
/// replay): device nodes with their numbers, FIFOs, sockets, extended attributes.
#[test]
fn device_nodes_and_xattrs_survive_remount_and_crash() {
    use wbstack::fs::{Cred, InodeKind, Volume, XattrMode};
    let root = Cred::root();
    for crash in [false, true] {
        let q = common::queue("sim:ssd,size=64M");
        Volume::mkfs(&q, &Default::default()).unwrap();
        let v = Volume::mount(q.clone(), common::quiet()).unwrap();
        let dev = v.mknod_as(&root, 1, b"sda", 0o060660, 0x0801).unwrap();
        let fifo = v.mknod_as(&root, 1, b"fifo", 0o010644, 0).unwrap();
        let sock = v.mknod_as(&root, 1, b"sock", 0o140755, 0).unwrap();
        let (f, st) = v
            .create_as(
                &root,
                1,
                b"file",
                0o644,
                &wbstack::fs::OpenOptions::create(),
            )
            .unwrap();
        v.setxattr_as(&root, st.ino, b"user.a", b"1", XattrMode::Create)
            .unwrap();
        v.setxattr_as(&root, st.ino, b"user.b", &[7u8; 3000], XattrMode::Any)
            .unwrap();
        v.setxattr_as(&root, st.ino, b"user.gone", b"x", XattrMode::Any)
            .unwrap();
        v.removexattr_as(&root, st.ino, b"user.gone").unwrap();
        assert_eq!(
            v.setxattr_as(&root, st.ino, b"user.a", b"2", XattrMode::Create)
                .unwrap_err()
                .errno(),
            libc::EEXIST
        );
        assert_eq!(
            v.getxattr_as(&root, st.ino, b"user.nope")
                .unwrap_err()
                .errno(),
            libc::ENODATA
        );
        f.fsync().unwrap();
        f.close().unwrap();
        let v = if crash {
            common::sim(&q).power_cut(false);
            v.crash();
            common::sim(&q).reboot();
            Volume::mount(q.clone(), common::quiet()).unwrap()
        } else {
            v.unmount().unwrap();
            Volume::mount(q.clone(), common::quiet()).unwrap()
        };
        let s = v.getattr(dev.ino).unwrap();
        assert_eq!(
            (s.kind, s.rdev, s.mode),
            (InodeKind::BlockDev, 0x0801, 0o660)
        );
        assert_eq!(v.getattr(fifo.ino).unwrap().kind, InodeKind::Fifo);
        assert_eq!(v.getattr(sock.ino).unwrap().kind, InodeKind::Socket);
        assert_eq!(v.getxattr_as(&root, st.ino, b"user.a").unwrap(), b"1");
        assert_eq!(
            v.getxattr_as(&root, st.ino, b"user.b").unwrap(),
            vec![7u8; 3000]
        );
        let names = v.listxattr_as(&root, st.ino).unwrap();
        assert_eq!(
            names,
            vec![b"user.a".to_vec(), b"user.b".to_vec()],
            "crash={crash}"
        );
        assert!(v.check().is_empty(), "{:?}", v.check());
        v.unmount().unwrap();
    }
}

/// mkfs on a file device writes the whole journal once: a commit into a hole of a
/// sparse image would allocate in the host filesystem (and with FUA wait for the
/// host's journal). On a simulated device, where first writes cost nothing extra, it
/// writes only its few metadata blocks.
#[test]
fn mkfs_writes_the_journal_of_a_file_device_once_and_not_of_a_sim() {
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::io::AsRawFd;
    use wbstack::fs::{MkfsOptions, Volume};
    let dir = tempfile::Builder::new()
        .prefix("mkfs-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap();
    let path = dir.path().join("disk.img");
    let q = common::queue(&format!("file:{},create=1,size=64M", path.display()));
    let sb = Volume::mkfs(&q, &MkfsOptions::default()).unwrap();
    let (start, end) = (
        sb.journal_start * 4096,
        (sb.journal_start + sb.journal_blocks) * 4096,
    );
    let f = std::fs::File::open(&path).unwrap();
    assert!(
        f.metadata().unwrap().blocks() * 512 >= end - start,
        "the image holds fewer bytes than the journal"
    );
    // SAFETY: lseek on a descriptor this test owns; it moves only its offset.
    let hole = unsafe { libc::lseek(f.as_raw_fd(), start as libc::off_t, libc::SEEK_HOLE) };
    assert!(
        hole >= end as libc::off_t,
        "a hole at {hole} inside the journal {start}..{end}"
    );
    drop(q);
    Volume::mount(
        common::queue(&format!("file:{}", path.display())),
        Default::default(),
    )
    .unwrap()
    .unmount()
    .unwrap();

    let q = common::queue("sim:ssd,size=64M");
    let sb = Volume::mkfs(&q, &MkfsOptions::default()).unwrap();
    let written_bytes = q.diskstats().sectors[1] * 512;
    assert!(
        written_bytes < sb.journal_blocks * 4096 / 4,
        "{written_bytes} bytes written by mkfs on a sim device"
    );
}
