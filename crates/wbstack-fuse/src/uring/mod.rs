//! FUSE over io_uring: requests delivered to a queue per CPU, served by threads pinned
//! to that CPU.
//!
//! Why: through /dev/fuse, a request wakes whichever request thread has waited
//! longest, usually on the other CPU, and the reply wakes the caller back across. On
//! this kind of VM a wakeup of an idle vCPU is a halt exit, and that is most of a
//! round trip: one fs_mark thread through the mount ran at 6k files/s, and at 16k with
//! every thread pinned to one CPU. With io_uring (Linux 6.14+, `enable_uring` of the
//! fuse module on), the kernel queues a request on the queue of the CPU its caller runs
//! on (`fuse_uring_task_to_queue`), and the entry it picks belongs to a thread pinned
//! there, so both wakeups stay on one CPU.
//!
//! Layout: every queue has `per_queue` threads, each with its own ring
//! (SINGLE_ISSUER, DEFER_TASKRUN) and exactly one ring entry (a header buffer and a
//! payload buffer registered with FUSE_IO_URING_CMD_REGISTER). A handler may block (a
//! writer paused by dirty throttling, an fsync waiting for its commit): with one entry
//! per thread, a blocked thread holds only its own entry, and the kernel gives the
//! next request of that CPU to another thread's free entry. The kernel reuses the
//! entry committed last first, so a lone caller keeps meeting the same warm thread.
//!
//! The connection's set-up (INIT), FORGET and INTERRUPT stay on /dev/fuse, read by
//! fuser's threads; every other request comes through the rings once each CPU's queue
//! has an entry. Requests are decoded in `decode.rs` (fuser's parsing is private to it)
//! and go to the same `WbFs` handlers as fuser's, through the traits of `reply.rs`;
//! `encode.rs` lays out the replies. This file is the transport.

mod decode;
mod encode;

use crate::reply::Fail;
use crate::server::{contained, WbFs};
use crossbeam_channel::{bounded, Receiver, Sender};
use decode::{dispatch, nobodys, Body, RingCaller};
use encode::{Out, RingReply};
use fuser::{Errno, INodeNo};
use io_uring::{cqueue, opcode, squeue, types, IoUring};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Where the fuse module says whether io_uring may be used.
pub const ENABLE_PARAM: &str = "/sys/module/fuse/parameters/enable_uring";

/// Whether the running kernel lets a FUSE server use io_uring.
pub fn kernel_allows() -> bool {
    std::fs::read_to_string(ENABLE_PARAM).is_ok_and(|s| s.trim() == "Y")
}

// uapi/linux/fuse.h
const FUSE_IO_URING_CMD_REGISTER: u32 = 1;
const FUSE_IO_URING_CMD_COMMIT_AND_FETCH: u32 = 2;
/// `struct fuse_uring_req_header`: in_out[128], op_in[128], ring_ent_in_out (32 bytes).
const HEADER_BYTES: usize = 288;
const OP_IN: usize = 128;
const OP_IN_BYTES: usize = 128;
const ENT_IN_OUT: usize = 256;
const IN_HEADER: usize = 40;
const OUT_HEADER: usize = 16;

/// Which callers may use the mount: fuser's `SessionACL::Owner` rule, kept here too.
#[derive(Clone, Copy, Debug)]
pub struct Acl {
    /// Some(uid): only that uid, but for requests the kernel may send on nobody's
    /// behalf (writeback, release...).
    pub owner_only: Option<u32>,
}

/// The ring threads of one mount.
pub struct Rings {
    threads: Vec<JoinHandle<()>>,
}

impl Rings {
    /// Starts `per_queue` threads for each possible CPU's queue on the connection of
    /// `dev` (a /dev/fuse descriptor whose INIT granted FUSE_OVER_IO_URING), and waits
    /// until each has registered its entry. `max_payload` is the connection's largest
    /// request or reply body (max_write and max_pages). When a thread fails, the
    /// error comes with the threads started: those that registered serve until the
    /// connection ends and must be joined before the volume unmounts.
    pub fn start(
        fs: Arc<WbFs>,
        dev: OwnedFd,
        per_queue: usize,
        max_payload: usize,
        acl: Acl,
    ) -> Result<Rings, StartError> {
        let no_threads = || Rings {
            threads: Vec::new(),
        };
        let local = |error, started| StartError {
            error,
            refused: false,
            started,
        };
        let queues = possible_cpus().map_err(|e| local(e, no_threads()))?;
        let dev = Arc::new(dev);
        let mut threads = Vec::new();
        let (ready_tx, ready_rx) = bounded::<Result<(), Failed>>(queues * per_queue.max(1));
        for qid in 0..queues {
            let threads_here = if online(qid) { per_queue.max(1) } else { 1 };
            for i in 0..threads_here {
                let (fs, dev, ready) = (fs.clone(), dev.clone(), ready_tx.clone());
                let t = std::thread::Builder::new()
                    .name(format!("fuse-ring-{qid}.{i}"))
                    .spawn(move || {
                        let mut q = match Queue::new(dev.as_raw_fd(), qid as u16, max_payload) {
                            Ok(q) => q,
                            Err(e) => {
                                let _ = ready.send(Err(Failed {
                                    error: e,
                                    refused: false,
                                }));
                                return;
                            }
                        };
                        pin_to(qid);
                        if !q.serve(&fs, acl, &ready) {
                            q.leak_buffers();
                        }
                        drop(dev);
                    });
                match t {
                    Ok(t) => threads.push(t),
                    Err(e) => return Err(local(e, Rings { threads })),
                }
            }
        }
        drop(ready_tx);
        let rings = Rings { threads };
        for _ in 0..rings.threads.len() {
            match ready_rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(f)) => {
                    return Err(StartError {
                        error: f.error,
                        refused: f.refused,
                        started: rings,
                    })
                }
                Err(_) => {
                    let e = std::io::Error::other("a ring thread ended before registering");
                    return Err(local(e, rings));
                }
            }
        }
        fs.counters_ref().ring_threads.store(
            rings.threads.len() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        Ok(rings)
    }

    /// Waits for every ring thread: each ends once the connection is gone (its entry
    /// completes with ENOTCONN at unmount).
    pub fn join(self) {
        for t in self.threads {
            if t.join().is_err() {
                eprintln!("wbstack mount: a FUSE ring thread panicked");
            }
        }
    }
}

/// Why the rings did not start.
pub struct StartError {
    pub error: std::io::Error,
    /// The kernel refused a REGISTER: it has turned the connection back to /dev/fuse,
    /// which serves every request. Otherwise a ring failed before registering (no
    /// ring, no thread), the kernel still holds every request until each queue has an
    /// entry, and the mount cannot serve.
    pub refused: bool,
    /// The threads started: those that registered serve until the connection ends and
    /// must be joined before the volume unmounts.
    pub started: Rings,
}

/// A ring thread's failure to start, as it tells `Rings::start`.
struct Failed {
    error: std::io::Error,
    refused: bool,
}

/// Whether this process can set up the rings' kind of io_uring (128-byte entries, one
/// issuer, deferred task work): io_uring may be switched off (`kernel.io_uring_disabled`)
/// or filtered (a container's seccomp profile). Asked before INIT asks for FUSE over
/// io_uring, since once INIT grants it the kernel holds every request until each queue
/// has an entry, and only a REGISTER it refuses turns it back to /dev/fuse.
pub fn can_set_up() -> std::io::Result<()> {
    ring().map(drop)
}

fn ring() -> std::io::Result<IoUring<squeue::Entry128, cqueue::Entry>> {
    IoUring::<squeue::Entry128, cqueue::Entry>::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build(4)
}

/// The kernel makes one queue per possible CPU (`num_possible_cpus`) and the ring is
/// ready only when every one has an entry; only online CPUs' queues get requests, so
/// an offline CPU's queue gets one thread, not `per_queue`.
fn cpu_list(path: &str) -> std::io::Result<Vec<usize>> {
    let s = std::fs::read_to_string(path)?;
    let mut cpus = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b): (usize, usize) = (
            a.parse().map_err(std::io::Error::other)?,
            b.parse().map_err(std::io::Error::other)?,
        );
        cpus.extend(a..=b);
    }
    Ok(cpus)
}

fn possible_cpus() -> std::io::Result<usize> {
    let cpus = cpu_list("/sys/devices/system/cpu/possible")?;
    Ok(cpus.iter().max().map_or(1, |m| m + 1))
}

fn online(cpu: usize) -> bool {
    cpu_list("/sys/devices/system/cpu/online").map_or(true, |c| c.contains(&cpu))
}

fn pin_to(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET writes inside it and
    // sched_setaffinity reads it for its size. Pinning failing (a CPU offline, a
    // cpuset without it) leaves the thread free to run anywhere: slower, not wrong.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// One thread's ring and its one entry's buffers.
struct Queue {
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    fd: RawFd,
    qid: u16,
    /// `struct fuse_uring_req_header`, 8-aligned.
    header: Box<[u64; HEADER_BYTES / 8]>,
    payload: Box<[u8]>,
    /// The kernel reads these two iovecs at REGISTER; they must stay put until then.
    iov: Box<[libc::iovec; 2]>,
}

impl Queue {
    fn new(fd: RawFd, qid: u16, max_payload: usize) -> std::io::Result<Queue> {
        let ring = ring()?;
        let mut header = Box::new([0u64; HEADER_BYTES / 8]);
        let mut payload = vec![0u8; max_payload].into_boxed_slice();
        let iov = Box::new([
            libc::iovec {
                iov_base: header.as_mut_ptr().cast(),
                iov_len: HEADER_BYTES,
            },
            libc::iovec {
                iov_base: payload.as_mut_ptr().cast(),
                iov_len: payload.len(),
            },
        ]);
        Ok(Queue {
            ring,
            fd,
            qid,
            header,
            payload,
            iov,
        })
    }

    fn header_bytes(&self) -> &[u8] {
        // SAFETY: the u64 array is HEADER_BYTES long; any byte of it may be read.
        unsafe { std::slice::from_raw_parts(self.header.as_ptr().cast::<u8>(), HEADER_BYTES) }
    }

    fn header_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and the borrow is unique through &mut self.
        unsafe {
            std::slice::from_raw_parts_mut(self.header.as_mut_ptr().cast::<u8>(), HEADER_BYTES)
        }
    }

    fn cmd(&self, cmd_op: u32, commit_id: u64) -> squeue::Entry128 {
        // struct fuse_uring_cmd_req { u64 flags; u64 commit_id; u16 qid; u8 padding[6]; }
        let mut cmd = [0u8; 80];
        cmd[8..16].copy_from_slice(&commit_id.to_ne_bytes());
        cmd[16..18].copy_from_slice(&self.qid.to_ne_bytes());
        let e = opcode::UringCmd80::new(types::Fd(self.fd), cmd_op)
            .cmd(cmd)
            .addr(Some(self.iov.as_ptr() as u64))
            .build();
        with_len(e, 2)
    }

    /// Registers the entry, then serves: each completion is a request in the entry's
    /// buffers, answered by COMMIT_AND_FETCH, which also waits for the next. True
    /// once the connection ended (or REGISTER failed: the kernel holds no buffer);
    /// false if the thread stops while the connection lives on (a bug, or the kernel
    /// refusing a commit), its entry then lost to its CPU's queue.
    fn serve(&mut self, fs: &WbFs, acl: Acl, ready: &Sender<Result<(), Failed>>) -> bool {
        if let Err(f) = self.register() {
            let _ = ready.send(Err(f));
            return true;
        }
        let _ = ready.send(Ok(()));
        loop {
            if let Err(e) = self.ring.submit_and_wait(1) {
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                eprintln!("wbstack mount: FUSE ring queue {}: {e}", self.qid);
                return false;
            }
            let Some(cqe) = self.ring.completion().next() else {
                continue;
            };
            let res = cqe.result();
            if res < 0 {
                // The connection ended: unmount (ENOTCONN, ECANCELED) or an abort
                // (ECONNABORTED: through sysfs, or a request timeout).
                let ended = [libc::ENOTCONN, libc::ECANCELED, libc::ECONNABORTED];
                if ended.contains(&-res) {
                    return true;
                }
                eprintln!(
                    "wbstack mount: FUSE ring queue {}: {}; its thread stops",
                    self.qid,
                    std::io::Error::from_raw_os_error(-res)
                );
                return false;
            }
            let unique = self.handle(fs, acl);
            let next = self.cmd(FUSE_IO_URING_CMD_COMMIT_AND_FETCH, unique);
            if !self.push(&next) {
                eprintln!("wbstack mount: FUSE ring queue {}: the submission queue is full; its thread stops", self.qid);
                return false;
            }
        }
    }

    /// The entry's buffers are never freed: a thread that stopped while the connection
    /// lives on leaves them registered, and the kernel may still hold their addresses.
    fn leak_buffers(&mut self) {
        let header = std::mem::replace(&mut self.header, Box::new([0u64; HEADER_BYTES / 8]));
        let payload = std::mem::take(&mut self.payload);
        let iov = std::mem::replace(
            &mut self.iov,
            Box::new(
                [libc::iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                }; 2],
            ),
        );
        Box::leak(header);
        Box::leak(payload);
        Box::leak(iov);
    }

    /// Sends REGISTER. It completes only when a request arrives; a refusal completes
    /// at once, during the submit.
    fn register(&mut self) -> Result<(), Failed> {
        let local = |error| Failed {
            error,
            refused: false,
        };
        let reg = self.cmd(FUSE_IO_URING_CMD_REGISTER, 0);
        if !self.push(&reg) {
            let e = std::io::Error::other("the ring's submission queue is full");
            return Err(local(e));
        }
        self.ring.submit().map_err(local)?;
        if let Some(cqe) = self.ring.completion().next() {
            if cqe.result() < 0 {
                return Err(Failed {
                    error: std::io::Error::from_raw_os_error(-cqe.result()),
                    refused: true,
                });
            }
            debug_assert!(false, "REGISTER completed without a request");
        }
        Ok(())
    }

    fn push(&mut self, e: &squeue::Entry128) -> bool {
        // SAFETY: the SQE points at `self.iov`, whose iovecs point at `self.header`
        // and `self.payload`; all three are boxed (they do not move) and live as long
        // as `self`. The kernel holds the entry's buffers until the connection ends,
        // which is what ends `serve` (its last completion is ENOTCONN); the thread
        // drops `self` only after `serve` returns, and leaks the three if `serve`
        // stopped with the connection still up (`leak_buffers`).
        unsafe { self.ring.submission().push(e) }.is_ok()
    }

    /// Decodes the request in the entry, runs it, writes the reply into the entry.
    /// Returns the request's unique id (the commit id).
    fn handle(&mut self, fs: &WbFs, acl: Acl) -> u64 {
        let h = self.header_bytes();
        let len = u32_at(h, 0) as usize;
        let opcode = u32_at(h, 4);
        let unique = u64_at(h, 8);
        let nodeid = u64_at(h, 16);
        let caller = RingCaller {
            uid: u32_at(h, 24),
            gid: u32_at(h, 28),
            pid: u32_at(h, 32),
        };
        let payload_sz = (u32_at(h, ENT_IN_OUT + 16) as usize).min(self.payload.len());
        // The request's first argument went to op_in, the rest to the payload; its
        // length is what the header's total leaves.
        let arg0 = len.saturating_sub(IN_HEADER + payload_sz).min(OP_IN_BYTES);
        let (tx, rx) = bounded::<Out>(1);
        let reply = RingReply {
            tx,
            max: self.payload.len(),
        };
        fs.counters_ref()
            .ring_requests
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let denied = acl
            .owner_only
            .is_some_and(|uid| caller.uid != uid && !nobodys(opcode));
        if denied {
            reply.error(Errno::EACCES);
        } else {
            let body = Body::new(&h[OP_IN..OP_IN + arg0], &self.payload[..payload_sz]);
            let op = format_args!("opcode {opcode}");
            contained(&op, || {
                dispatch(fs, &caller, opcode, INodeNo(nodeid), body, reply)
            });
        }
        self.finish(unique, rx)
    }

    /// Waits for the handler's reply (a waiter thread may send it later: fsync) and
    /// writes it into the entry.
    fn finish(&mut self, unique: u64, rx: Receiver<Out>) -> u64 {
        let out = rx.recv().unwrap_or(Out {
            error: -libc::EIO,
            body: Vec::new(),
        });
        let n = out.body.len().min(self.payload.len());
        debug_assert_eq!(n, out.body.len(), "a reply larger than the ring's payload");
        self.payload[..n].copy_from_slice(&out.body[..n]);
        let h = self.header_bytes_mut();
        // struct fuse_out_header { u32 len; i32 error; u64 unique; }
        h[0..4].copy_from_slice(&((OUT_HEADER + n) as u32).to_ne_bytes());
        h[4..8].copy_from_slice(&out.error.to_ne_bytes());
        h[8..16].copy_from_slice(&unique.to_ne_bytes());
        // ring_ent_in_out.payload_sz
        h[ENT_IN_OUT + 16..ENT_IN_OUT + 20].copy_from_slice(&(n as u32).to_ne_bytes());
        unique
    }
}

/// Sets the SQE's `len`, which FUSE's commands read as the iovec count and which the
/// io-uring crate's UringCmd80 builder has no field for.
fn with_len(e: squeue::Entry128, len: u32) -> squeue::Entry128 {
    const _: () = assert!(std::mem::size_of::<squeue::Entry128>() == 128);
    // SAFETY: Entry128 is #[repr(C)]: a plain `struct io_uring_sqe` (64 bytes) and
    // 64 bytes of command, every bit pattern of which is valid; `len` is the u32 at
    // byte 24 of io_uring_sqe (after opcode, flags, ioprio, fd, off, addr).
    unsafe {
        let mut b: [u8; 128] = std::mem::transmute(e);
        b[24..28].copy_from_slice(&len.to_ne_bytes());
        std::mem::transmute::<[u8; 128], squeue::Entry128>(b)
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .map_or(0, |x| u32::from_ne_bytes(x.try_into().unwrap_or_default()))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8)
        .map_or(0, |x| u64::from_ne_bytes(x.try_into().unwrap_or_default()))
}

#[cfg(test)]
mod tests {
    //! The decoder and the reply encoder against a volume on a simulated device,
    //! without a kernel: requests laid out as the kernel lays them into a ring entry
    //! (first argument in op_in, the rest in the payload), replies checked byte for
    //! byte against the uapi structs' layouts.
    use super::decode::op;
    use super::*;
    use crate::reply::EmptyReply;
    use crate::server::UnmountResult;
    use std::ffi::OsStr;
    use std::time::{Duration, UNIX_EPOCH};
    use wbstack::block::{QueueConfig, RequestQueue};
    use wbstack::fs::{MkfsOptions, MountOptions, Volume};

    fn volume() -> Arc<WbFs> {
        let q = RequestQueue::open("sim:ssd,size=1G", QueueConfig::default()).unwrap();
        let o = MountOptions::default();
        Volume::mkfs(&q, &MkfsOptions::for_mount(&o)).unwrap();
        let vol = Volume::mount(q, o).unwrap();
        Arc::new(WbFs::new(vol, 0, false, UnmountResult::default(), true))
    }

    const ROOT: RingCaller = RingCaller {
        uid: 0,
        gid: 0,
        pid: 1,
    };

    /// Runs one request and returns (error, reply body).
    fn call(fs: &WbFs, opcode: u32, ino: u64, head: &[u8], tail: &[u8]) -> (i32, Vec<u8>) {
        let (tx, rx) = bounded(1);
        let r = RingReply { tx, max: 1 << 20 };
        dispatch(fs, &ROOT, opcode, INodeNo(ino), Body::new(head, tail), r);
        let out = rx.recv().expect("every request is answered");
        (out.error, out.body)
    }

    fn ne32(v: &mut Vec<u8>, x: u32) {
        v.extend_from_slice(&x.to_ne_bytes());
    }

    fn ne64(v: &mut Vec<u8>, x: u64) {
        v.extend_from_slice(&x.to_ne_bytes());
    }

    fn name(n: &str) -> Vec<u8> {
        let mut v = n.as_bytes().to_vec();
        v.push(0);
        v
    }

    /// CREATE of `n` (0644, O_RDWR) in the root: its (inode, file handle).
    fn create_in_root(fs: &WbFs, n: &str) -> (u64, u64) {
        let mut head = Vec::new();
        for x in [libc::O_RDWR as u32, 0o100644, 0, 0] {
            ne32(&mut head, x);
        }
        let (err, body) = call(fs, op::CREATE, 1, &head, &name(n));
        assert_eq!(err, 0, "create {n}");
        (u64_at(&body, 0), u64_at(&body, 128))
    }

    #[test]
    fn create_write_read_lookup_readdir_and_unlink_decode_and_encode_as_the_kernel_expects() {
        let fs = volume();
        // CREATE: fuse_create_in { flags, mode, umask, open_flags } + name.
        let mut head = Vec::new();
        for x in [libc::O_RDWR as u32, 0o100644, 0o022, 0] {
            ne32(&mut head, x);
        }
        let (err, body) = call(&fs, op::CREATE, 1, &head, &name("a"));
        assert_eq!(err, 0);
        // fuse_entry_out (128) + fuse_open_out (16).
        assert_eq!(body.len(), 144);
        let ino = u64_at(&body, 0);
        assert!(ino > 1);
        assert_eq!(u64_at(&body, 40), ino, "fuse_attr.ino");
        let mode = u32_at(&body, 40 + 60);
        assert_eq!(mode, libc::S_IFREG | 0o644, "fuse_attr.mode");
        let fh = u64_at(&body, 128);

        // WRITE: fuse_write_in (40 bytes) in op_in, the data in the payload.
        let mut w = Vec::new();
        ne64(&mut w, fh);
        ne64(&mut w, 0);
        ne32(&mut w, 5);
        ne32(&mut w, 0);
        ne64(&mut w, 0);
        ne32(&mut w, 0);
        ne32(&mut w, 0);
        let (err, body) = call(&fs, op::WRITE, ino, &w, b"hello");
        assert_eq!((err, body.len(), u32_at(&body, 0)), (0, 8, 5));

        // READ: fuse_read_in (40 bytes).
        let mut rd = Vec::new();
        ne64(&mut rd, fh);
        ne64(&mut rd, 1);
        ne32(&mut rd, 100);
        ne32(&mut rd, 0);
        ne64(&mut rd, 0);
        ne32(&mut rd, 0);
        ne32(&mut rd, 0);
        assert_eq!(call(&fs, op::READ, ino, &rd, &[]), (0, b"ello".to_vec()));

        // LOOKUP: a zero-sized first argument, the name in the payload.
        let (err, body) = call(&fs, op::LOOKUP, 1, &[], &name("a"));
        assert_eq!((err, u64_at(&body, 0), u64_at(&body, 40 + 8)), (0, ino, 5));
        // A missing name: a negative entry (inode 0) the kernel may cache.
        let (err, body) = call(&fs, op::LOOKUP, 1, &[], &name("nope"));
        assert_eq!((err, body.len(), u64_at(&body, 0)), (0, 128, 0));

        // GETATTR: fuse_attr_out (104).
        let mut g = Vec::new();
        ne32(&mut g, 0);
        ne32(&mut g, 0);
        ne64(&mut g, 0);
        let (err, body) = call(&fs, op::GETATTR, ino, &g, &[]);
        assert_eq!((err, body.len(), u64_at(&body, 16 + 8)), (0, 104, 5));

        // OPENDIR then READDIR: fuse_dirent records padded to 8 bytes.
        let mut o = Vec::new();
        ne32(&mut o, libc::O_RDONLY as u32);
        ne32(&mut o, 0);
        let (err, body) = call(&fs, op::OPENDIR, 1, &o, &[]);
        assert_eq!(err, 0);
        let dfh = u64_at(&body, 0);
        let mut rd = Vec::new();
        ne64(&mut rd, dfh);
        ne64(&mut rd, 0);
        ne32(&mut rd, 4096);
        ne32(&mut rd, 0);
        ne64(&mut rd, 0);
        ne32(&mut rd, 0);
        ne32(&mut rd, 0);
        let (err, body) = call(&fs, op::READDIR, 1, &rd, &[]);
        assert_eq!(err, 0);
        let mut names = Vec::new();
        let mut at = 0;
        while at < body.len() {
            let namelen = u32_at(&body, at + 16) as usize;
            names.push(String::from_utf8(body[at + 24..at + 24 + namelen].to_vec()).unwrap());
            at += (24 + namelen).next_multiple_of(8);
        }
        assert_eq!(at, body.len(), "records padded to 8 bytes, nothing after");
        assert!(names.contains(&"a".to_string()) && names.contains(&".".to_string()));
        // A buffer too small for the first record: an empty reply, not an error.
        let mut small = rd.clone();
        small[16..20].copy_from_slice(&8u32.to_ne_bytes());
        assert_eq!(call(&fs, op::READDIR, 1, &small, &[]), (0, Vec::new()));

        // STATFS: fuse_statfs_out (80).
        let (err, body) = call(&fs, op::STATFS, 1, &[], &[]);
        assert_eq!((err, body.len(), u32_at(&body, 40)), (0, 80, 4096));

        // RELEASE, then UNLINK, then the name is gone.
        let mut rel = Vec::new();
        ne64(&mut rel, fh);
        ne32(&mut rel, 0);
        ne32(&mut rel, 0);
        ne64(&mut rel, 0);
        assert_eq!(call(&fs, op::RELEASE, ino, &rel, &[]), (0, Vec::new()));
        assert_eq!(call(&fs, op::UNLINK, 1, &[], &name("a")), (0, Vec::new()));
        let (_, body) = call(&fs, op::LOOKUP, 1, &[], &name("a"));
        assert_eq!(u64_at(&body, 0), 0);
    }

    #[test]
    fn short_bodies_unknown_opcodes_and_strangers_get_errors_not_panics() {
        let fs = volume();
        // A CREATE cut inside its fixed part, and one without its name's NUL.
        assert_eq!(call(&fs, op::CREATE, 1, &[0; 6], &[]).0, -libc::EINVAL);
        assert_eq!(call(&fs, op::CREATE, 1, &[0; 16], b"abc").0, -libc::EINVAL);
        // A WRITE whose size says more than the payload holds.
        let mut w = vec![0u8; 40];
        w[16..20].copy_from_slice(&100u32.to_ne_bytes());
        assert_eq!(call(&fs, op::WRITE, 1, &w, b"xy").0, -libc::EINVAL);
        // An opcode not served (GETLK) and one unknown.
        assert_eq!(call(&fs, 31, 1, &[0; 64], &[]).0, -libc::ENOSYS);
        assert_eq!(call(&fs, 9999, 1, &[], &[]).0, -libc::ENOSYS);
        // FORGET never reaches a ring; a stray one is refused, not served.
        assert_eq!(call(&fs, 2, 1, &[0; 8], &[]).0, -libc::ENOSYS);
    }

    #[test]
    fn an_fsync_is_answered_on_the_ring_thread_itself() {
        let fs = volume();
        let (ino, fh) = create_in_root(&fs, "f");
        let mut f = Vec::new();
        ne64(&mut f, fh);
        ne32(&mut f, 0);
        ne32(&mut f, 0);
        // The reply is there when dispatch returns: no waiter thread took it (the
        // ring thread's one entry waits for it anyway).
        let (tx, rx) = bounded(1);
        let r = RingReply { tx, max: 1 << 20 };
        dispatch(&fs, &ROOT, op::FSYNC, INodeNo(ino), Body::new(&f, &[]), r);
        let out = rx.try_recv().expect("answered inline");
        assert_eq!((out.error, out.body.len()), (0, 0));
    }

    #[test]
    fn a_handler_that_panics_answers_eio_and_the_thread_goes_on() {
        let (tx, rx) = bounded::<Out>(1);
        let r = RingReply { tx, max: 16 };
        contained(&1, move || {
            let _owned = r;
            panic!("a bug (test)");
        });
        // No reply was sent and none can be: finish answers EIO.
        assert!(rx.recv().is_err());
        let (tx, rx) = bounded::<Out>(1);
        let r = RingReply { tx, max: 16 };
        contained(&1, move || EmptyReply::ok(r));
        assert_eq!(rx.recv().unwrap().error, 0);
    }

    /// A time before 1970 is a negative `time_t` in fuse_setattr_in's u64: set as
    /// fuser sets it through /dev/fuse (the volume clamps it to 0), not a panic that
    /// answers EIO.
    #[test]
    fn a_setattr_time_before_1970_is_set_not_a_panic() {
        let fs = volume();
        let (ino, _) = create_in_root(&fs, "old");
        // fuse_setattr_in: valid (FATTR_ATIME), padding, fh, size, lock_owner, atime,
        // mtime, ctime, three nsecs, mode, unused4, uid, gid, unused5: 88 bytes.
        let mut s = Vec::new();
        ne32(&mut s, 16);
        ne32(&mut s, 0);
        for x in [0, 0, 0, (-86_400i64) as u64, 0, 0] {
            ne64(&mut s, x);
        }
        for x in [500_000_000, 0, 0, 0, 0, 0, 0, 0] {
            ne32(&mut s, x);
        }
        assert_eq!(s.len(), 88);
        let (err, body) = call(&fs, op::SETATTR, ino, &s, &[]);
        assert_eq!(err, 0);
        // fuse_attr_out: attr_valid, attr_valid_nsec, dummy, then fuse_attr (ino,
        // size, blocks, atime).
        assert_eq!(u64_at(&body, 16), ino);
        assert_eq!(u64_at(&body, 16 + 24), 0, "atime clamped to the epoch");
        let day_before = UNIX_EPOCH - Duration::from_secs(86_400);
        assert_eq!(
            decode::time_of((-86_400i64) as u64, 7),
            day_before.checked_add(Duration::from_nanos(7))
        );
        assert_eq!(
            decode::time_of(5, 0),
            UNIX_EPOCH.checked_add(Duration::from_secs(5))
        );
    }

    /// A request answered twice (a bug) keeps its first answer, and the second does
    /// not block the thread that sends it.
    #[test]
    fn a_second_answer_is_dropped_not_waited_on() {
        let (tx, rx) = bounded::<Out>(1);
        let r = RingReply { tx, max: 16 };
        EmptyReply::ok(r.clone());
        r.error(Errno::EIO);
        assert_eq!(rx.recv().unwrap().error, 0);
        assert!(rx.try_recv().is_err());
    }

    #[test]
    fn cpu_lists_parse_as_the_kernel_prints_them() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("l");
        for (text, want) in [
            ("0-1\n", vec![0, 1]),
            ("0\n", vec![0]),
            ("0-2,5,7-8\n", vec![0, 1, 2, 5, 7, 8]),
        ] {
            std::fs::write(&p, text).unwrap();
            assert_eq!(cpu_list(p.to_str().unwrap()).unwrap(), want, "{text}");
        }
        std::fs::write(&p, "x-1").unwrap();
        assert!(cpu_list(p.to_str().unwrap()).is_err());
    }

    #[test]
    fn a_body_is_read_across_op_in_and_the_payload() {
        let head = 7u32.to_ne_bytes();
        let mut tail = 9u64.to_ne_bytes().to_vec();
        tail.extend_from_slice(b"n\0rest");
        let mut b = Body::new(&head, &tail);
        assert_eq!(b.u32(), Some(7));
        assert_eq!(b.u64(), Some(9));
        assert_eq!(b.name(), Some(OsStr::new("n")));
        assert_eq!(b.rest(), Some(&b"rest"[..]));
        assert_eq!(b.u32(), None);
    }

    #[test]
    fn the_sqe_carries_the_iovec_count() {
        let e = opcode::UringCmd80::new(types::Fd(3), 1).build();
        let e = with_len(e, 2);
        // SAFETY: as in with_len: the entry is 128 bytes of plain data.
        let b: [u8; 128] = unsafe { std::mem::transmute(e) };
        assert_eq!(u32::from_ne_bytes(b[24..28].try_into().unwrap()), 2);
        assert_eq!(b[0], io_uring::opcode::UringCmd80::CODE);
        assert_eq!(i32::from_ne_bytes(b[4..8].try_into().unwrap()), 3);
    }
}
