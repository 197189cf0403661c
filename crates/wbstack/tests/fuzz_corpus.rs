//! The fuzz targets' regression corpus, run as an ordinary test: every file under
//! `tests/fuzz-corpus/<target>/` goes through the harness function its fuzz target calls
//! (`wbstack::fs::fuzz`), so an input the fuzzer once crashed on stays fixed.
//!
//! Files named `seed-*` come from real images made here (mkfs, a tree of every kind of
//! inode with xattrs, unmounted or crashed with transactions in the journal, a version 1
//! image) and must be accepted; `crash-*` are inputs the fuzzer crashed on and
//! `regress-*` inputs written for a bug found by reading, each kept with its fix (they
//! must run through without a panic; accepted or refused). To rewrite the seeds after a
//! format change:
//! `WBSTACK_WRITE_FUZZ_SEEDS=1 cargo test --release -p wbstack --test fuzz_corpus`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use wbstack::block::RequestQueue;
use wbstack::fs::format::{Checkpoint, Superblock, Txn, CKPT_HEADER, SB_FIELDS, TXN_HEADER};
use wbstack::fs::fuzz::{self, Outcome, SparseImage, FIX_CHECKSUMS, SEED_BLOCKS};
use wbstack::fs::{Cred, MkfsOptions, OpenOptions, Volume, XattrMode};

type Harness = fn(&[u8]) -> Outcome;

const TARGETS: [(&str, Harness); 4] = [
    ("superblock", fuzz::superblock),
    ("journal_txn", fuzz::journal_txn),
    ("checkpoint", fuzz::checkpoint),
    ("image", fuzz::image),
];

/// Far more than any input takes (milliseconds); a hang the fuzzer missed fails here.
const PER_INPUT: Duration = Duration::from_secs(20);

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz-corpus")
}

fn run(target: &str, h: Harness, name: &str, data: &[u8]) -> Outcome {
    let t0 = Instant::now();
    let out = h(data);
    assert!(
        t0.elapsed() < PER_INPUT,
        "{target}/{name} took {:?}",
        t0.elapsed()
    );
    out
}

#[test]
fn every_corpus_file_passes_its_harness() {
    for (target, h) in TARGETS {
        let dir = corpus().join(target);
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        assert!(
            files.iter().any(|f| name_of(f).starts_with("seed-")),
            "{target}: no seeds"
        );
        for f in files {
            let name = name_of(&f);
            let data = std::fs::read(&f).unwrap();
            let out = run(target, h, &name, &data);
            if name.starts_with("seed-") {
                assert_eq!(out, Outcome::Accepted, "{target}/{name}");
            }
        }
    }
}

fn name_of(p: &Path) -> String {
    p.file_name().unwrap().to_string_lossy().into_owned()
}

/// The seeds are made afresh from real images and must be accepted, so the harness's
/// deepest paths (mount, use, remount) stay covered as the code changes.
#[test]
fn seeds_from_real_images_are_accepted() {
    let seeds = seeds();
    for (target, name, data) in &seeds {
        let h = TARGETS.iter().find(|t| t.0 == *target).unwrap().1;
        assert_eq!(
            run(target, h, name, data),
            Outcome::Accepted,
            "{target}/{name}"
        );
    }
    for (target, _) in TARGETS {
        assert!(seeds.iter().any(|s| s.0 == target), "no seed for {target}");
    }
    if std::env::var("WBSTACK_WRITE_FUZZ_SEEDS").as_deref() == Ok("1") {
        for (target, name, data) in &seeds {
            let dir = corpus().join(target);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join(name), data).unwrap();
        }
    }
}

// ---- seeds ---------------------------------------------------------------------------

fn empty_device() -> Arc<RequestQueue> {
    fuzz::device(&SparseImage {
        blocks: SEED_BLOCKS,
        map: Default::default(),
    })
    .unwrap()
}

fn bytes_of(q: &Arc<RequestQueue>) -> Vec<u8> {
    q.read_sync(0, SEED_BLOCKS as usize * 4096)
        .unwrap()
        .as_slice()
        .to_vec()
}

fn mkfs(q: &Arc<RequestQueue>) -> Superblock {
    mkfs_format(q, None)
}

fn mkfs_format(q: &Arc<RequestQueue>, format: Option<u32>) -> Superblock {
    Volume::mkfs(
        q,
        &MkfsOptions {
            fs_id: Some(0x5eed_f00d),
            format,
        },
    )
    .unwrap()
}

fn write(v: &Volume, path: &str, off: u64, data: &[u8], fsync: bool) {
    let f = v.open(path, &OpenOptions::create()).unwrap();
    f.write_at(off, data).unwrap();
    if fsync {
        f.fsync().unwrap();
    }
    f.close().unwrap();
}

/// A small tree holding every kind of inode and record: directories, files (one with
/// a hole, one truncated), a symlink, a hard link, a FIFO, a socket, a device node,
/// xattrs set and removed, a rename, an unlink, and (open when the volume stops) an
/// orphan. With `fsync`, each step is committed on its own, so a crash leaves one
/// journal transaction per step.
fn tree(v: &Volume, fsync: bool) -> wbstack::fs::File {
    let root = Cred::root();
    let sync = |v: &Volume| {
        if fsync {
            v.commit_now().unwrap();
        }
    };
    v.mkdir_all("/a/b", 0o755).unwrap();
    sync(v);
    write(v, "/a/small", 0, b"hello, fuzzer", fsync);
    write(v, "/a/b/holey", 2 * 4096, b"after a hole", fsync);
    write(v, "/cut", 0, &[7u8; 5000], fsync);
    let cut = v.open("/cut", &OpenOptions::read_write()).unwrap();
    cut.set_len(100).unwrap();
    cut.close().unwrap();
    sync(v);
    v.symlink("a/small", "/link").unwrap();
    v.link("/a/small", "/a/b/hard").unwrap();
    sync(v);
    v.mknod_as(&root, 1, b"fifo", 0o010644, 0).unwrap();
    v.mknod_as(&root, 1, b"sock", 0o140755, 0).unwrap();
    let dev = v.mknod_as(&root, 1, b"sda", 0o060660, 0x0801).unwrap();
    sync(v);
    let small = v.lookup_path("/a/small").unwrap();
    v.setxattr_as(&root, small, b"user.color", b"blue", XattrMode::Any)
        .unwrap();
    v.setxattr_as(&root, dev.ino, b"trusted.kept", b"y", XattrMode::Any)
        .unwrap();
    v.setxattr_as(&root, dev.ino, b"trusted.gone", b"x", XattrMode::Any)
        .unwrap();
    v.removexattr_as(&root, dev.ino, b"trusted.gone").unwrap();
    sync(v);
    v.rename("/a/b/holey", "/a/moved").unwrap();
    write(v, "/doomed", 0, b"unlinked", fsync);
    v.unlink("/doomed").unwrap();
    sync(v);
    // Open and unlinked: an orphan the next mount deletes.
    write(v, "/open", 0, b"still open", fsync);
    let f = v.open("/open", &OpenOptions::read()).unwrap();
    v.unlink("/open").unwrap();
    sync(v);
    f
}

/// Real images: (name, device bytes).
fn images() -> Vec<(&'static str, Vec<u8>)> {
    let mut out = Vec::new();

    let q = empty_device();
    mkfs(&q);
    out.push(("fresh", bytes_of(&q)));

    let q = empty_device();
    mkfs(&q);
    let v = Volume::mount(q.clone(), fuzz::mount_options()).unwrap();
    tree(&v, false).close().unwrap();
    v.unmount().unwrap();
    out.push(("tree-unmounted", bytes_of(&q)));

    // Format 5 (the metadata tree, read on demand): unmounted, and crashed after
    // checkpoints. (The seed-v4-* files, made by an earlier build, keep format 4's
    // records and its upgrade at mount covered.)
    let q = empty_device();
    mkfs_format(&q, Some(5));
    let v = Volume::mount(q.clone(), fuzz::mount_options()).unwrap();
    tree(&v, false).close().unwrap();
    v.unmount().unwrap();
    out.push(("v5-tree-unmounted", bytes_of(&q)));
    let q = empty_device();
    mkfs_format(&q, Some(5));
    let v = Volume::mount(q.clone(), fuzz::mount_options()).unwrap();
    let open = tree(&v, true);
    v.crash();
    drop(open);
    out.push(("v5-tree-crashed", bytes_of(&q)));

    // Crashed: every step in its own journal transaction after the mount's checkpoint,
    // the orphan still open (ordered data only).
    let q = empty_device();
    mkfs(&q);
    let mut ordered = fuzz::mount_options();
    ordered.journal_data_kb = 0;
    let v = Volume::mount(q.clone(), ordered).unwrap();
    let open = tree(&v, true);
    v.crash();
    drop(open);
    out.push(("tree-crashed", bytes_of(&q)));

    // Crashed with journaled data (format v3): each small fsync's data in its commit
    // (fuzz::mount_options' journal_data_kb), its home write lost with the cut.
    let q = empty_device();
    mkfs(&q);
    let v = Volume::mount(q.clone(), fuzz::mount_options()).unwrap();
    let open = tree(&v, true);
    assert!(v.journal_stats().data_fsyncs > 0);
    v.crash();
    drop(open);
    out.push(("tree-jdata-crashed", bytes_of(&q)));

    // Version 1: no extras section in the checkpoint, superblock version 1.
    let q = empty_device();
    let sb = mkfs(&q);
    fuzz::make_version_1(&q, &sb).unwrap();
    out.push(("v1", bytes_of(&q)));
    out
}

/// (target, file name, bytes) for every seed.
fn seeds() -> Vec<(&'static str, String, Vec<u8>)> {
    let mut out = Vec::new();
    for (name, bytes) in images() {
        out.push((
            "image",
            format!("seed-{name}"),
            fuzz::pack_image(FIX_CHECKSUMS, &bytes),
        ));
        if name == "tree-crashed" {
            out.push((
                "image",
                format!("seed-{name}-raw"),
                fuzz::pack_image(0, &bytes),
            ));
        }
        let sb = Superblock::decode(&bytes[..4096]).unwrap();
        out.push((
            "superblock",
            format!("seed-{name}"),
            bytes[..SB_FIELDS + 4].to_vec(),
        ));
        // The newest checkpoint, trimmed to its CRC.
        let newest = sb
            .checkpoint
            .iter()
            .filter_map(|&(s, _)| {
                let at = &bytes[s as usize * 4096..];
                Checkpoint::decode(at).ok().map(|c| (c, at))
            })
            .max_by_key(|(c, _)| c.seq)
            .unwrap();
        let (c, at) = newest;
        out.push((
            "checkpoint",
            format!("seed-{name}"),
            at[..CKPT_HEADER + c.image.len() + 4].to_vec(),
        ));
        // The same metadata as a whole-image (format 3) checkpoint, the decoder an
        // older image's upgrade runs.
        if sb.version >= 4 {
            let map = bytes
                .chunks(4096)
                .enumerate()
                .filter(|(_, b)| b.iter().any(|&x| x != 0))
                .map(|(i, b)| (i as u64, b.to_vec()))
                .collect();
            let q = fuzz::device(&SparseImage {
                blocks: SEED_BLOCKS,
                map,
            })
            .unwrap();
            // Read whole (fsck's load): a mount reads a format 5 tree on demand.
            let mut l =
                wbstack::fs::journal::load(&q, false, wbstack::fs::metatree::LISTED_MAX).unwrap();
            // Format 3 had no tree: its blocks are free there.
            l.meta.tree_blocks.clear();
            out.push((
                "checkpoint",
                format!("seed-{name}-v3"),
                Checkpoint {
                    fs_id: c.fs_id,
                    seq: c.seq,
                    tid: l.last_tid,
                    journal_pos: 0,
                    image: l.meta.encode_image(),
                }
                .encode(),
            ));
        }
        // The journal after it, each transaction trimmed to its CRC.
        let journal =
            &bytes[sb.journal_start as usize * 4096..][..sb.journal_blocks as usize * 4096];
        let mut pos = c.journal_pos as usize * 4096;
        let mut expect = c.tid + 1;
        while let Ok((t, len)) = Txn::decode(&journal[pos..]) {
            if t.tid != expect {
                break;
            }
            let body = len_of_body(&journal[pos..]);
            out.push((
                "journal_txn",
                format!("seed-{name}-{}", t.tid),
                journal[pos..pos + TXN_HEADER + body + 4].to_vec(),
            ));
            pos += len;
            expect += 1;
        }
    }
    out
}

fn len_of_body(txn: &[u8]) -> usize {
    u32::from_le_bytes(txn[TXN_HEADER - 4..TXN_HEADER].try_into().unwrap()) as usize
}
