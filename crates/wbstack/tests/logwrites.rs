//! The log-writes device: what it logs, in which order, and the crash states it names.

use std::sync::Arc;
use wbstack::block::logwrites::{Kept, LogKind, LogWrites};
use wbstack::block::{Bio, BioFlags, BioWait, QueueConfig, RequestQueue};
use wbstack::buf::IoBuf;
use wbstack::clock::RealClock;
use wbstack::dev::{self, store::SparseStore};

fn block(byte: u8) -> IoBuf {
    let mut b = IoBuf::zeroed(4096);
    b.as_mut_slice().fill(byte);
    b
}

fn setup() -> (Arc<LogWrites>, Arc<RequestQueue>) {
    let d = dev::open(
        "null,memory_backed=1,wc=1,lbs=4096,size=1M,hw_queues=1",
        RealClock::new(),
    )
    .unwrap();
    let lw = Arc::new(LogWrites::new(d));
    let q = RequestQueue::new(lw.clone(), QueueConfig::default()).unwrap();
    (lw, q)
}

fn submit(q: &Arc<RequestQueue>, bio: Bio) {
    let w = BioWait::new();
    q.submit_bio(bio.with_end_io(w.clone())).unwrap();
    w.wait_one().1.unwrap();
}

#[test]
fn writes_flushes_and_fua_make_windows_and_cutoffs() {
    let (lw, q) = setup();
    submit(&q, Bio::write(0, block(1)));
    submit(&q, Bio::write(8, block(2)));
    submit(&q, Bio::flush());
    let after_flush = lw.position();
    submit(&q, Bio::write(16, block(3)));
    submit(&q, Bio::write(24, block(4)).with_flags(BioFlags::FUA));
    let fua_acked = lw.position();
    submit(&q, Bio::write(32, block(5)));
    let log = lw.take_log();
    let kinds: Vec<LogKind> = log.entries().iter().map(|e| e.kind).collect();
    use LogKind::*;
    assert_eq!(kinds, [Write, Write, Flush, Write, Write, Write]);
    assert!(log.entries()[4].fua && !log.entries()[3].fua);
    assert_eq!(after_flush, 3);

    let w = log.windows();
    assert_eq!(w.len(), 2, "the start, and after the one flush");
    assert_eq!(
        (w[0].prefix_end, w[0].pending.clone(), w[0].next_mark),
        (0, vec![0, 1], 2)
    );
    assert_eq!(
        (w[1].prefix_end, w[1].pending.clone(), w[1].next_mark),
        (3, vec![3, 4, 5], 6)
    );

    // Losing the FUA write: the crash came before it completed, so what was
    // acknowledged after it does not bind, and the write sent after it cannot be there.
    let lost_fua = [(3, Kept::Whole), (5, Kept::Whole)];
    assert_eq!(log.ack_cutoff(&w[1], &lost_fua), 4);
    assert!(fua_acked > 4);
    assert!(!log.possible(&w[1], &lost_fua));
    assert!(log.possible(&w[1], &[(3, Kept::Whole)]));
    let kept_fua = [(4, Kept::Whole), (5, Kept::Whole)];
    assert_eq!(log.ack_cutoff(&w[1], &kept_fua), 6);
    assert!(log.possible(&w[1], &kept_fua));

    // Images: the prefix is durable, the state adds what it kept, torn by sector.
    let mut prefix = SparseStore::new();
    log.apply_prefix(&mut prefix, 0, w[1].prefix_end);
    let img = log.image(&prefix, &[(4, Kept::Sectors(vec![0, 7]))]);
    let mut buf = vec![0u8; 4096];
    img.read(0, &mut buf);
    assert!(buf.iter().all(|&b| b == 1));
    img.read(16, &mut buf);
    assert!(buf.iter().all(|&b| b == 0), "write 3 was not kept");
    img.read(24, &mut buf);
    assert!(buf[..512].iter().all(|&b| b == 4) && buf[7 * 512..].iter().all(|&b| b == 4));
    assert!(
        buf[512..7 * 512].iter().all(|&b| b == 0),
        "torn: sectors 1..7 lost"
    );
}

#[test]
fn a_preflush_write_logs_its_mark_before_it() {
    let (lw, q) = setup();
    submit(&q, Bio::write(0, block(1)));
    submit(
        &q,
        Bio::write(8, block(2)).with_flags(BioFlags::PREFLUSH | BioFlags::FUA),
    );
    let log = lw.take_log();
    let kinds: Vec<LogKind> = log.entries().iter().map(|e| e.kind).collect();
    assert_eq!(kinds, [LogKind::Write, LogKind::Flush, LogKind::Write]);
    assert_eq!(log.entries()[2].submitted_at, 2);
}
