//! When to save: the original system's save policy as pure functions of token counts.
//! The store does not call these itself; the engine/scheduler asks them where to stop a
//! prefill chunk so the live state is exactly the prefix to persist (a live session is
//! never rewound just to produce a checkpoint).

/// Save-policy knobs. Defaults are the original system's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SavePolicy {
    /// Store nothing shorter than this many tokens (`--kv-cache-min-tokens`).
    pub min_tokens: usize,
    /// Cold-save first prompts up to this many tokens; 0 disables cold saves.
    pub cold_max_tokens: usize,
    /// A cold save drops this many trailing tokens (the part most likely to change
    /// on the next turn) ...
    pub trim_tokens: usize,
    /// ... and aligns the rest down to a multiple of this (0: no alignment).
    pub align_tokens: usize,
    /// Continued saves every this many tokens, rounded up to a multiple of
    /// `align_tokens` (0 disables continued saves).
    pub continued_interval: usize,
}

impl Default for SavePolicy {
    fn default() -> Self {
        SavePolicy {
            min_tokens: 512,
            cold_max_tokens: 30000,
            trim_tokens: 32,
            align_tokens: 2048,
            continued_interval: 10000,
        }
    }
}

impl SavePolicy {
    /// Length of the cold save for a first prompt of `prompt_tokens` tokens (a request
    /// that reused nothing), or `None` when no cold save applies.
    ///
    /// Rule (original `store_len`): the prompt must be within
    /// `[min_tokens, cold_max_tokens]`. If it is longer than `min_tokens + trim_tokens`,
    /// take `prompt − trim` aligned down to `align_tokens` when that is still at least
    /// `min_tokens`; otherwise save the full prompt. So 11011 → 10240 and 1695 → 1695
    /// (1695 − 32 = 1663 aligns down to 0 < 512, so the full length is kept).
    pub fn cold_save_len(&self, prompt_tokens: usize) -> Option<usize> {
        if self.cold_max_tokens == 0
            || prompt_tokens < self.min_tokens.max(1)
            || prompt_tokens > self.cold_max_tokens
        {
            return None;
        }
        if prompt_tokens > self.min_tokens + self.trim_tokens {
            let s = align_down(prompt_tokens - self.trim_tokens, self.align_tokens);
            if s >= self.min_tokens && s > 0 {
                return Some(s);
            }
        }
        Some(prompt_tokens)
    }

    /// The continued-save step: `continued_interval` rounded up to a multiple of
    /// `align_tokens` (10000 → 10240 by default); 0 when continued saves are off.
    pub fn continued_step(&self) -> usize {
        if self.align_tokens == 0 {
            self.continued_interval
        } else {
            self.continued_interval.div_ceil(self.align_tokens) * self.align_tokens
        }
    }

    /// The largest multiple of [`continued_step`](Self::continued_step) in
    /// `(prev_frontier, new_len]` that is at least `min_tokens`: where a continued
    /// save is due once the live state reaches `new_len`.
    pub fn continued_frontier(&self, prev_frontier: usize, new_len: usize) -> Option<usize> {
        let step = self.continued_step();
        if step == 0 {
            return None;
        }
        let f = new_len / step * step;
        (f > prev_frontier && f >= self.min_tokens && f > 0).then_some(f)
    }

    /// The next continued-save frontier after `prev_frontier`: where to end a prefill
    /// chunk so the save needs no rewind.
    pub fn next_continued_frontier(&self, prev_frontier: usize) -> Option<usize> {
        let step = self.continued_step();
        if step == 0 {
            return None;
        }
        let mut f = (prev_frontier / step + 1) * step;
        if f < self.min_tokens {
            f = self.min_tokens.div_ceil(step) * step;
        }
        Some(f)
    }

    /// Whether a live state of `live_tokens` is worth an evict save (before the slot
    /// is taken by an unrelated request).
    pub fn should_save_evict(&self, live_tokens: usize) -> bool {
        live_tokens >= self.min_tokens.max(1)
    }

    /// Whether a live state of `live_tokens` is worth a shutdown save.
    pub fn should_save_shutdown(&self, live_tokens: usize) -> bool {
        self.should_save_evict(live_tokens)
    }
}

fn align_down(n: usize, align: usize) -> usize {
    n.checked_div(align).map_or(n, |q| q * align)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cold_examples() {
        let p = SavePolicy::default();
        assert_eq!(p.cold_save_len(11011), Some(10240));
        assert_eq!(p.cold_save_len(1695), Some(1695));
        assert_eq!(p.cold_save_len(400), None);
        assert_eq!(p.cold_save_len(511), None);
        assert_eq!(p.cold_save_len(512), Some(512));
        assert_eq!(p.cold_save_len(544), Some(544)); // not > min + trim
        assert_eq!(p.cold_save_len(2080), Some(2048)); // 2048 exactly after trim
        assert_eq!(p.cold_save_len(2079), Some(2079)); // 2047 aligns to 0
        assert_eq!(p.cold_save_len(30000), Some(28672));
        assert_eq!(p.cold_save_len(30001), None);
        let off = SavePolicy {
            cold_max_tokens: 0,
            ..p
        };
        assert_eq!(off.cold_save_len(11011), None);
        let no_align = SavePolicy {
            align_tokens: 0,
            ..p
        };
        assert_eq!(no_align.cold_save_len(11011), Some(10979));
    }

    #[test]
    fn continued_examples() {
        let p = SavePolicy::default();
        assert_eq!(p.continued_step(), 10240);
        assert_eq!(p.continued_frontier(0, 10239), None);
        assert_eq!(p.continued_frontier(0, 10240), Some(10240));
        assert_eq!(p.continued_frontier(0, 35000), Some(30720));
        assert_eq!(p.continued_frontier(10240, 20000), None);
        assert_eq!(p.continued_frontier(10240, 20480), Some(20480));
        assert_eq!(p.next_continued_frontier(0), Some(10240));
        assert_eq!(p.next_continued_frontier(10240), Some(20480));
        assert_eq!(p.next_continued_frontier(15000), Some(20480));
        // A step below min_tokens never yields a frontier under min.
        let small = SavePolicy {
            continued_interval: 100,
            align_tokens: 0,
            ..p
        };
        assert_eq!(small.continued_frontier(0, 450), None);
        assert_eq!(small.continued_frontier(0, 650), Some(600));
        assert_eq!(small.next_continued_frontier(0), Some(600));
        let off = SavePolicy {
            continued_interval: 0,
            ..p
        };
        assert_eq!(off.continued_frontier(0, 1 << 20), None);
        assert_eq!(off.next_continued_frontier(0), None);
    }

    #[test]
    fn evict_and_shutdown() {
        let p = SavePolicy::default();
        assert!(!p.should_save_evict(511));
        assert!(p.should_save_evict(512));
        assert!(p.should_save_shutdown(100_000));
        assert!(!p.should_save_shutdown(0));
    }
}
