//! Sparse, memory-backed block storage shared by the null and sim devices.
//!
//! Data lives in 4 KiB chunks created on first write, so a 100 TiB device costs what
//! it holds. Chunks are reference-counted: a snapshot (the sim device's durable image)
//! shares unchanged chunks with the live image, and a write copies only the chunk it
//! touches.

use rustc_hash::FxHashMap;
use std::sync::Arc;

pub const CHUNK: usize = 4096;
const CHUNK_SECTORS: u64 = (CHUNK / 512) as u64;

pub type Chunk = Arc<[u8; CHUNK]>;

#[derive(Clone, Default)]
pub struct SparseStore {
    chunks: FxHashMap<u64, Chunk>,
}

impl SparseStore {
    pub fn new() -> SparseStore {
        SparseStore::default()
    }

    /// Bytes of data held (chunks allocated × 4 KiB).
    pub fn bytes_held(&self) -> u64 {
        (self.chunks.len() * CHUNK) as u64
    }

    /// Read `out.len()` bytes starting at `sector`; unwritten ranges read as zeros.
    pub fn read(&self, sector: u64, out: &mut [u8]) {
        let mut pos = sector * 512;
        let mut done = 0;
        while done < out.len() {
            let idx = pos / CHUNK as u64;
            let off = (pos % CHUNK as u64) as usize;
            let n = (CHUNK - off).min(out.len() - done);
            match self.chunks.get(&idx) {
                Some(c) => out[done..done + n].copy_from_slice(&c[off..off + n]),
                None => out[done..done + n].fill(0),
            }
            done += n;
            pos += n as u64;
        }
    }

    /// Write `data` starting at `sector`.
    pub fn write(&mut self, sector: u64, data: &[u8]) {
        let mut pos = sector * 512;
        let mut done = 0;
        while done < data.len() {
            let idx = pos / CHUNK as u64;
            let off = (pos % CHUNK as u64) as usize;
            let n = (CHUNK - off).min(data.len() - done);
            if n == CHUNK {
                // A whole chunk: a new one made from the data, copied once (not zeroed,
                // then copied, nor a snapshot's copy cloned to be overwritten).
                let whole: Arc<[u8]> = Arc::from(&data[done..done + CHUNK]);
                let whole: Chunk = whole.try_into().expect("a chunk's length");
                self.chunks.insert(idx, whole);
            } else {
                let c = self
                    .chunks
                    .entry(idx)
                    .or_insert_with(|| Arc::new([0u8; CHUNK]));
                Arc::make_mut(c)[off..off + n].copy_from_slice(&data[done..done + n]);
            }
            done += n;
            pos += n as u64;
        }
    }

    /// Forget `nr_sectors` from `sector` (they read back as zeros).
    pub fn discard(&mut self, sector: u64, nr_sectors: u64) {
        let end = sector + nr_sectors;
        let mut s = sector;
        while s < end {
            let idx = s / CHUNK_SECTORS;
            let chunk_start = idx * CHUNK_SECTORS;
            let chunk_end = chunk_start + CHUNK_SECTORS;
            if s == chunk_start && end >= chunk_end {
                self.chunks.remove(&idx);
                s = chunk_end;
            } else {
                let stop = end.min(chunk_end);
                let zeros = vec![0u8; ((stop - s) * 512) as usize];
                if self.chunks.contains_key(&idx) {
                    self.write(s, &zeros);
                }
                s = stop;
            }
        }
    }

    /// Copy the chunks with the given indices from `src` (sharing them, no data copy).
    pub fn copy_chunks_from(&mut self, src: &SparseStore, idxs: impl IntoIterator<Item = u64>) {
        for idx in idxs {
            match src.chunks.get(&idx) {
                Some(c) => {
                    self.chunks.insert(idx, c.clone());
                }
                None => {
                    self.chunks.remove(&idx);
                }
            }
        }
    }

    /// The chunk `idx` as it is now (shared, no copy); None when it was never written
    /// or was discarded.
    pub fn chunk(&self, idx: u64) -> Option<Chunk> {
        self.chunks.get(&idx).cloned()
    }

    /// Put back a chunk returned by [`chunk`](Self::chunk).
    pub fn set_chunk(&mut self, idx: u64, c: Option<Chunk>) {
        match c {
            Some(c) => {
                self.chunks.insert(idx, c);
            }
            None => {
                self.chunks.remove(&idx);
            }
        }
    }

    /// Every chunk held, in no particular order (unwritten chunks read as zeros).
    pub fn chunks(&self) -> impl Iterator<Item = (u64, &Chunk)> {
        self.chunks.iter().map(|(&i, c)| (i, c))
    }

    /// Chunk indices touched by a sector range.
    pub fn chunk_range(sector: u64, nr_sectors: u64) -> std::ops::Range<u64> {
        if nr_sectors == 0 {
            return 0..0;
        }
        sector / CHUNK_SECTORS..(sector + nr_sectors - 1) / CHUNK_SECTORS + 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_write_discard_snapshot() {
        let mut s = SparseStore::new();
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        s.write(3, &data); // unaligned to chunks, spans three
        let mut out = vec![0xffu8; 10_000];
        s.read(3, &mut out);
        assert_eq!(out, data);
        let mut hole = vec![0xffu8; 512];
        s.read(1 << 30, &mut hole);
        assert!(hole.iter().all(|&b| b == 0));

        let snap = s.clone();
        s.write(3, &[9u8; 512]);
        let mut a = vec![0u8; 512];
        snap.read(3, &mut a);
        assert_eq!(&a[..], &data[..512], "snapshot unaffected by later writes");
        // A whole chunk written over one a snapshot shares: a new chunk, the snapshot's
        // left as it was.
        s.write(8, &[5u8; CHUNK]);
        let (mut live, mut old) = (vec![0u8; CHUNK], vec![0u8; CHUNK]);
        s.read(8, &mut live);
        snap.read(8, &mut old);
        assert!(live.iter().all(|&b| b == 5));
        assert_eq!(&old[..], &data[4096 - 1536..2 * 4096 - 1536]);

        s.discard(3, 2);
        let mut z = vec![1u8; 1024];
        s.read(3, &mut z);
        assert!(z.iter().all(|&b| b == 0));
        assert_eq!(SparseStore::chunk_range(7, 2), 0..2);
        assert_eq!(SparseStore::chunk_range(8, 8), 1..2);
    }

    #[test]
    fn huge_offsets_cost_what_they_hold() {
        let mut s = SparseStore::new();
        let far = (100u64 << 40) / 512 - 8;
        s.write(far, &[1u8; 4096]);
        assert_eq!(s.bytes_held(), 4096);
    }
}
