//! The bench front end: the workloads (`fsmark`, `tardd`, `readlat`, `blkbench`,
//! `wbbench`), what the file-level ones run on (`benchfs`: a kernel filesystem's
//! directory or `volfs`: a fresh wbstack volume), fio run beside them (`fio`), and the
//! load and counters they share (`hog`, `meter`). The lab and soak run the same
//! workloads.

pub mod benchfs;
pub mod blkbench;
pub mod fio;
pub mod fsmark;
pub mod hog;
pub mod meter;
pub mod readlat;
pub mod tardd;
pub mod volfs;
pub mod wbbench;
