//! A least-recently-used order kept lazily, as the inode cache and the tree's node
//! cache both need it: an entry is (key, gen), and the holder keeps each key's current
//! gen. A key dropped or queued again leaves its old entry behind, stale, so removal
//! costs nothing here; the holder skips stale entries as they come out, and the queue
//! is compacted once they could outnumber the live keys.

use std::collections::VecDeque;

#[derive(Debug, Default)]
pub(super) struct LazyLru {
    /// Oldest first.
    queue: VecDeque<(u64, u64)>,
    next_gen: u64,
}

impl LazyLru {
    pub fn new() -> LazyLru {
        LazyLru::default()
    }

    /// Queue `key` at the young end; the gen that tells this entry from older ones.
    pub fn push(&mut self, key: u64) -> u64 {
        let gen = self.next_gen;
        self.next_gen += 1;
        self.queue.push_back((key, gen));
        gen
    }

    /// Put an entry taken by `pop_oldest` back at the young end, as it was (a second
    /// chance).
    pub fn requeue(&mut self, key: u64, gen: u64) {
        debug_assert!(gen < self.next_gen, "an entry this queue never made");
        self.queue.push_back((key, gen));
    }

    /// The oldest entry, current or stale: `(key, gen)`.
    pub fn pop_oldest(&mut self) -> Option<(u64, u64)> {
        self.queue.pop_front()
    }

    /// Drop the stale entries once the queue is past twice `live` keys (and some
    /// slack), `current(key, gen)` telling which entries are not, so churn cannot grow
    /// it without bound.
    pub fn compact(&mut self, live: usize, current: impl Fn(u64, u64) -> bool) {
        if self.queue.len() > 2 * live + 64 {
            self.queue.retain(|&(k, g)| current(k, g));
        }
    }

    pub fn clear(&mut self) {
        self.queue.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stale entries (of keys requeued under a new gen) are dropped by a compaction
    /// once they pass the bound, and the current ones keep their order.
    #[test]
    fn compaction_keeps_current_entries_in_order() {
        let mut q = LazyLru::new();
        let mut gens = std::collections::HashMap::new();
        for round in 0..100u64 {
            for k in 0..4u64 {
                gens.insert(k, q.push(k));
            }
            q.compact(gens.len(), |k, g| gens.get(&k) == Some(&g));
            assert!(
                q.queue.len() <= 2 * 4 + 64 + 4,
                "round {round}: {}",
                q.queue.len()
            );
        }
        let current: Vec<(u64, u64)> = std::iter::from_fn(|| q.pop_oldest())
            .filter(|(k, g)| gens.get(k) == Some(g))
            .collect();
        assert_eq!(
            current.iter().map(|e| e.0).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
    }
}
