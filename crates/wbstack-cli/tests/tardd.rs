//! tar + dd on a DirFs: the extracted tree is the archive, byte for byte.

use std::io::Read;
use std::path::Path;
use std::sync::Arc;
use wbstack_cli::bench::benchfs::{BenchFs, DirFs};
use wbstack_cli::bench::tardd::{self, TarSource, TarddOpts};

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

fn dirfs(p: &Path) -> Arc<dyn BenchFs> {
    Arc::new(DirFs::new(p).unwrap())
}

/// Every entry of `archive` matches what is under `root`; returns (files, dirs, links,
/// bytes of the files).
fn compare(archive: &[u8], root: &Path) -> (u64, u64, u64, u64) {
    let mut ar = tar::Archive::new(archive);
    let (mut files, mut dirs, mut links, mut bytes) = (0, 0, 0, 0);
    for e in ar.entries().unwrap() {
        let mut e = e.unwrap();
        let p = root.join(e.path().unwrap());
        match e.header().entry_type() {
            tar::EntryType::Regular => {
                let mut want = Vec::new();
                e.read_to_end(&mut want).unwrap();
                let got = std::fs::read(&p).unwrap_or_else(|err| panic!("{}: {err}", p.display()));
                assert!(got == want, "{} differs", p.display());
                files += 1;
                bytes += want.len() as u64;
            }
            tar::EntryType::Directory => {
                assert!(p.is_dir(), "{}", p.display());
                dirs += 1;
            }
            tar::EntryType::Symlink => {
                assert_eq!(
                    std::fs::read_link(&p).unwrap(),
                    e.link_name().unwrap().unwrap()
                );
                links += 1;
            }
            t => panic!("unexpected {t:?} in the archive"),
        }
    }
    (files, dirs, links, bytes)
}

#[test]
fn synthetic_tree_is_extracted_byte_identical_while_dd_runs() {
    let dir = tmp();
    let archive = tardd::synthetic_tar(900, 7).unwrap();
    let o = TarddOpts {
        source: TarSource::Synthetic {
            files: 900,
            seed: 7,
        },
        dd_size: (8 << 20) + 12345,
        dir: "run".into(),
        ..Default::default()
    };
    let r = tardd::run(&o, dirfs(dir.path())).unwrap();
    let (files, dirs, links, bytes) = compare(&archive, &dir.path().join("run/tree"));
    assert_eq!(r.bytes, bytes);
    assert_eq!(
        (r.files, r.dirs, r.symlinks, r.skipped),
        (files, dirs, links, 0)
    );
    assert_eq!(
        files + links,
        900,
        "every generated file is a file or a symlink"
    );
    assert_eq!(links, 2, "one in 400 is a symlink");
    assert!(
        dirs > 900 / 40 && dirs < 900 / 6,
        "~15 files per directory: {dirs}"
    );
    let zero = std::fs::read(dir.path().join("run/zero")).unwrap();
    assert_eq!(
        zero.len() as u64,
        o.dd_size,
        "dd wrote a partial last block too"
    );
    assert!(zero.iter().all(|&b| b == 0));
    assert_eq!(r.dd_bytes, o.dd_size);
    assert!(r.tar_s > 0.0 && r.dd_s > 0.0 && r.total_s >= r.tar_s.max(r.dd_s));
}

#[test]
fn synthetic_tree_is_deterministic_and_source_tree_sized() {
    let a = tardd::synthetic_tar(3000, 1).unwrap();
    assert_eq!(a, tardd::synthetic_tar(3000, 1).unwrap());
    assert_ne!(a, tardd::synthetic_tar(3000, 2).unwrap());
    let mut sizes = Vec::new();
    let mut max_depth = 0;
    for e in tar::Archive::new(&a[..]).entries().unwrap() {
        let e = e.unwrap();
        if e.header().entry_type() == tar::EntryType::Regular {
            sizes.push(e.header().size().unwrap());
            max_depth = max_depth.max(e.path().unwrap().components().count());
        }
    }
    sizes.sort();
    let median = sizes[sizes.len() / 2];
    let mean = sizes.iter().sum::<u64>() / sizes.len() as u64;
    assert!((4 << 10..9 << 10).contains(&median), "median {median}");
    assert!((8 << 10..18 << 10).contains(&mean), "mean {mean}");
    assert!(*sizes.last().unwrap() <= 2 << 20);
    assert!(
        max_depth >= 4,
        "a hierarchy, not a flat directory: depth {max_depth}"
    );
}

#[test]
fn real_tar_files_other_kinds_are_skipped_and_counted() {
    let dir = tmp();
    let mut b = tar::Builder::new(Vec::new());
    let add = |b: &mut tar::Builder<Vec<u8>>, path: &str, t: tar::EntryType, data: &[u8]| {
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(t);
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        b.append_data(&mut h, path, data).unwrap();
    };
    // No directory entries: parents are made as needed.
    add(&mut b, "./a/b/c.txt", tar::EntryType::Regular, b"contents");
    add(&mut b, "a/empty", tar::EntryType::Regular, b"");
    add(&mut b, "a/fifo", tar::EntryType::Fifo, b"");
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(tar::EntryType::Link);
    h.set_size(0);
    b.append_link(&mut h, "a/hard", "a/empty").unwrap();
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(tar::EntryType::Symlink);
    h.set_size(0);
    b.append_link(&mut h, "a/b/sym", "c.txt").unwrap();
    let path = dir.path().join("in.tar");
    std::fs::write(&path, b.into_inner().unwrap()).unwrap();

    let o = TarddOpts {
        source: TarSource::File(path.clone()),
        dd_size: 1 << 20,
        dir: "x".into(),
        ..Default::default()
    };
    let root = dir.path().join("fs");
    let r = tardd::run(&o, dirfs(&root)).unwrap();
    assert_eq!((r.files, r.symlinks, r.skipped), (2, 1, 2));
    assert_eq!(r.bytes, 8);
    assert_eq!(
        std::fs::read(root.join("x/tree/a/b/c.txt")).unwrap(),
        b"contents"
    );
    assert_eq!(
        std::fs::read(root.join("x/tree/a/b/sym")).unwrap(),
        b"contents"
    );
    assert!(!root.join("x/tree/a/fifo").exists());
    assert!(r.archive_bytes > 0);

    // A second extraction over the first replaces it, symlinks included.
    let r2 = tardd::run(&o, dirfs(&root)).unwrap();
    assert_eq!((r2.files, r2.symlinks, r2.skipped), (2, 1, 2));
    assert_eq!(
        std::fs::read(root.join("x/tree/a/b/sym")).unwrap(),
        b"contents"
    );
}

#[test]
fn bad_archives_are_clear_errors() {
    let dir = tmp();
    let fs = dirfs(&dir.path().join("fs"));
    let run = |p: &Path| {
        let o = TarddOpts {
            source: TarSource::File(p.to_path_buf()),
            dd_size: 4096,
            ..Default::default()
        };
        tardd::run(&o, fs.clone()).err().unwrap()
    };
    let e = run(&dir.path().join("missing.tar"));
    assert!(e.contains("missing.tar"), "{e}");

    let gz = dir.path().join("x.tar.gz");
    std::fs::write(&gz, [0x1f, 0x8b, 8, 0, 0, 0, 0, 0]).unwrap();
    assert!(run(&gz).contains("compressed"));

    // An entry climbing out of the destination (the tar crate refuses to write one, so
    // the name goes into the header by hand).
    let mut h = tar::Header::new_old();
    h.as_old_mut().name[..9].copy_from_slice(b"../escape");
    h.set_entry_type(tar::EntryType::Regular);
    h.set_size(1);
    h.set_mode(0o644);
    h.set_cksum();
    let mut b = tar::Builder::new(Vec::new());
    b.append(&h, &b"x"[..]).unwrap();
    let evil = dir.path().join("evil.tar");
    std::fs::write(&evil, b.into_inner().unwrap()).unwrap();
    let e = run(&evil);
    assert!(e.contains("leaves the destination"), "{e}");
    assert!(!dir.path().join("fs/tardd/escape").exists());
    assert!(!dir.path().join("fs/escape").exists());
}
