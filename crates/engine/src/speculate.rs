//! Speculative decoding by prompt lookup: the tokens that followed the latest
//! earlier occurrence of the sequence's last few tokens are proposed as a
//! draft, and one forward step over the chosen token and the draft scores them
//! all ([`Session::keep_step_logits`](crate::Session::keep_step_logits), then
//! [`Session::keep_verified`](crate::Session::keep_verified)). Agents' answers
//! copy long spans of their context (a file being edited, a tool's output, the
//! previous version of a message), and on a memory-bound CPU a step of a few
//! tokens costs far less than that many steps.
//!
//! The caller samples each row as it would have sampled that token alone and
//! keeps the draft only while the sampled token is the drafted one, so the
//! output is exactly the output without speculation (the rows of a step equal
//! token-by-token decoding bit for bit, and the sampler draws once per token
//! either way). A draft token is accepted with exactly the probability the
//! model gives it: speculative sampling with a draft that is a point mass.
//!
//! [`Drafter`] decides how long a draft is worth: a step's extra tokens cost
//! about half a decode step each (SmolLM2, Zen 5: 2 tokens 1.6x one, 4 tokens
//! 2.3x, 8 tokens 4.1x), so it drafts more while drafts are accepted and falls
//! back to single tokens when they are not.

/// The shortest suffix of the sequence a draft is looked up by: a match of
/// one or two tokens says too little about what follows.
pub const MIN_MATCH: usize = 3;
/// The longest suffix tried first: the longest match that still occurs is the
/// best evidence.
pub const MAX_MATCH: usize = 8;

/// The draft after `history` followed by `next`: the tokens that followed the
/// occurrence of the longest suffix of that sequence (up to [`MAX_MATCH`]
/// tokens, at least [`MIN_MATCH`]) that occurs earlier in it, the latest of
/// the longest, at most `max` of them. Empty when no such suffix occurs.
pub fn lookup(history: &[u32], next: u32, max: usize) -> Vec<u32> {
    let len = history.len() + 1;
    let at = |i: usize| history.get(i).copied().unwrap_or(next);
    // One pass from the latest candidate end backwards; most candidates fail
    // at their first comparison (with `next`), so a long history costs about
    // one comparison per token.
    let mut best = (0, 0);
    for end in (1..len).rev() {
        let mut n = 0;
        while n < MAX_MATCH.min(end) && at(end - 1 - n) == at(len - 1 - n) {
            n += 1;
        }
        if n > best.0 {
            best = (n, end);
            if n == MAX_MATCH {
                break;
            }
        }
    }
    match best {
        (n, end) if n >= MIN_MATCH && max > 0 => (end..(end + max).min(len)).map(at).collect(),
        _ => vec![],
    }
}

/// How long a draft is worth, from how the job's drafts fared: grows while
/// whole drafts are accepted, shrinks to what was accepted when one is not.
#[derive(Clone, Debug)]
pub struct Drafter {
    max: usize,
    /// The current draft length (1..=max).
    len: usize,
    /// Drafts since the last accepted token, for backing off.
    misses: u32,
    /// Steps to skip before drafting again.
    skip: u32,
    /// Totals over the job: tokens drafted and accepted.
    pub drafted: usize,
    pub accepted: usize,
}

/// Misses in a row after which drafting pauses, and for how many steps (then
/// doubling): a stretch of output that copies nothing costs nothing more.
const MISSES_BEFORE_PAUSE: u32 = 2;
const PAUSE_STEPS: u32 = 8;

impl Drafter {
    /// A drafter proposing at most `max` tokens (0: never).
    pub fn new(max: usize) -> Self {
        Drafter {
            max,
            len: max.min(2),
            misses: 0,
            skip: 0,
            drafted: 0,
            accepted: 0,
        }
    }

    /// The draft after `history` and `next` (the token the next step
    /// feeds), at most `room` tokens (what the context and the step allow).
    /// Empty while drafting is paused or nothing matches.
    pub fn propose(&mut self, history: &[u32], next: u32, room: usize) -> Vec<u32> {
        if self.max == 0 || room == 0 {
            return vec![];
        }
        if self.skip > 0 {
            self.skip -= 1;
            return vec![];
        }
        lookup(history, next, self.len.min(room))
    }

    /// Notes a verified draft: `accepted` of its `drafted` tokens were kept.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        self.drafted += drafted;
        self.accepted += accepted;
        if accepted == drafted {
            self.len = (self.len * 2).min(self.max);
            self.misses = 0;
            return;
        }
        self.len = (accepted + 1).min(self.max);
        if accepted > 0 {
            self.misses = 0;
            return;
        }
        self.misses += 1;
        if self.misses >= MISSES_BEFORE_PAUSE {
            let doublings = (self.misses - MISSES_BEFORE_PAUSE).min(4);
            self.skip = PAUSE_STEPS << doublings;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`lookup`] on a whole sequence (its last token is `next`).
    fn look(seq: &[u32], max: usize) -> Vec<u32> {
        let (next, history) = seq.split_last().map_or((0, &[][..]), |(n, h)| (*n, h));
        lookup(history, next, max)
    }

    #[test]
    fn lookup_takes_the_latest_occurrence_of_the_longest_suffix() {
        // "1 2 3 4" occurs twice; the latest is followed by 9 9.
        let h = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 9, 9, 7, 1, 2, 3, 4];
        assert_eq!(look(&h, 2), [9, 9]);
        assert_eq!(look(&h, 10), [9, 9, 7, 1, 2, 3, 4]);
        // The longest suffix wins over a later shorter one: "7 3 4 5"
        // matches at the start though "3 4 5" is later.
        let h = [7, 3, 4, 5, 8, 0, 3, 4, 5, 6, 7, 3, 4, 5];
        assert_eq!(look(&h, 1), [8]);
        // Too short a match, no match, nothing asked.
        assert!(look(&[1, 2, 9, 1, 2], 4).is_empty());
        assert!(look(&[1, 2, 3, 4, 5], 4).is_empty());
        assert!(look(&h, 0).is_empty());
        assert!(look(&[], 3).is_empty());
        // Overlapping runs: a repeated token continues itself, and a draft
        // may run into the token being fed.
        assert_eq!(look(&[5, 5, 5, 5], 3), [5]);
        assert_eq!(look(&[1, 2, 3, 1, 2, 3], 5), [1, 2, 3]);
        // Matches as long as MAX_MATCH: the latest wins.
        let long: Vec<u32> = (0..20).chain(0..20).chain(0..12).collect();
        assert_eq!(look(&long, 2), [12, 13]);
        let long: Vec<u32> = (0..20).chain(0..20).collect();
        assert_eq!(look(&long, 2), [0, 1]);
    }

    #[test]
    fn the_draft_grows_while_accepted_and_pauses_after_misses() {
        let h: Vec<u32> = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2].to_vec();
        let mut d = Drafter::new(8);
        assert_eq!(d.propose(&h, 3, 100), [4, 5]);
        d.record(2, 2);
        assert_eq!(d.propose(&h, 3, 100), [4, 5, 6, 7]);
        // The room left caps it.
        assert_eq!(d.propose(&h, 3, 3), [4, 5, 6]);
        d.record(4, 4);
        d.record(8, 8);
        assert_eq!(d.propose(&h, 3, 100).len(), 8);
        d.record(8, 3);
        assert_eq!(d.propose(&h, 3, 100), [4, 5, 6, 7]);
        // Two drafts with nothing accepted pause drafting for a while.
        d.record(4, 0);
        assert_eq!(d.propose(&h, 3, 100), [4]);
        d.record(1, 0);
        for _ in 0..PAUSE_STEPS {
            assert!(d.propose(&h, 3, 100).is_empty());
        }
        assert_eq!(d.propose(&h, 3, 100), [4]);
        assert_eq!((d.drafted, d.accepted), (27, 17));
        assert!(Drafter::new(0).propose(&h, 3, 100).is_empty());
    }
}
