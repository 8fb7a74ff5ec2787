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
//! [`Drafter`] decides how long a draft is worth. A step's extra tokens are
//! not free (SmolLM2, Zen 5, 2 threads: 2 tokens cost 1.6x one, 4 tokens
//! 2.3x, 8 tokens 3.6x), so it weighs how often the job's draft tokens were
//! right against what longer steps cost as measured ([`StepCosts`]), and
//! drafts nothing where copying does not pay.

/// The most draft tokens a step can carry: a step that keeps every row's
/// logits takes at most 64 tokens (the session's cap on such steps).
pub const MAX_DRAFT: usize = crate::session::SCORED_STEP - 1;

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

/// What a decoding step of several tokens costs against one, as measured:
/// each step of a slot decoding alone is noted by its token count.
#[derive(Clone, Debug)]
pub struct StepCosts {
    /// Moving average of seconds per step, by tokens (index 0 unused).
    secs: Vec<Option<f64>>,
}

/// Weight of a new measurement in [`StepCosts`]' moving averages.
const COST_WEIGHT: f64 = 0.1;
/// What each token past the first is assumed to add to a step until measured
/// (SmolLM2, Zen 5: 2 tokens 1.6x one, 4 tokens 2.3x, 8 tokens 3.6x).
const PRIOR_EXTRA: f64 = 0.5;

impl StepCosts {
    /// Costs of steps of up to `max_tokens` tokens.
    pub fn new(max_tokens: usize) -> Self {
        StepCosts {
            secs: vec![None; max_tokens + 1],
        }
    }

    /// A step of `tokens` tokens took `secs`.
    pub fn note(&mut self, tokens: usize, secs: f64) {
        if let Some(c) = self.secs.get_mut(tokens) {
            *c = Some(c.map_or(secs, |c| c + COST_WEIGHT * (secs - c)));
        }
    }

    /// A step of `tokens` tokens against one of one token: measured where
    /// both are, else the prior.
    pub fn relative(&self, tokens: usize) -> f64 {
        let prior = 1.0 + PRIOR_EXTRA * tokens.saturating_sub(1) as f64;
        match (
            self.secs.get(1).copied().flatten(),
            self.secs.get(tokens).copied().flatten(),
        ) {
            (Some(one), Some(n)) if one > 0.0 => (n / one).max(1.0),
            _ => prior,
        }
    }
}

/// How long a draft is worth, from how often the job's draft tokens turned
/// out right and what longer steps cost ([`StepCosts`]): the length with the
/// most expected tokens per cost, none when no length beats a plain step.
/// Drafts it declines are still checked against the tokens that follow, so
/// a job that starts copying is noticed without paying for it.
#[derive(Clone, Debug)]
pub struct Drafter {
    max: usize,
    /// Moving average of whether a draft token was right, recent first.
    rate: f64,
    /// A declined draft, checked token by token as the output arrives.
    shadow: Vec<u32>,
    /// Whether the last draft was one a grammar forced (not a lookup: its
    /// outcome says nothing of how well lookups do).
    forced: bool,
    /// Totals over the job: tokens drafted and accepted.
    pub drafted: usize,
    pub accepted: usize,
}

/// [`Drafter`]'s starting rate: enough to try short drafts.
const PRIOR_RATE: f64 = 0.7;
/// Weight of each draft token's outcome in the rate.
const RATE_WEIGHT: f64 = 0.2;

impl Drafter {
    /// A drafter proposing at most `max` tokens (0: never).
    pub fn new(max: usize) -> Self {
        Drafter {
            max,
            rate: PRIOR_RATE,
            shadow: Vec::new(),
            forced: false,
            drafted: 0,
            accepted: 0,
        }
    }

    /// The draft after `history` and `next` (the token the next step
    /// feeds), at most `room` tokens (what the context and the step allow),
    /// as long as it is worth by `costs`. Empty when nothing matches or no
    /// draft is worth a step.
    pub fn propose(
        &mut self,
        history: &[u32],
        next: u32,
        room: usize,
        costs: &StepCosts,
    ) -> Vec<u32> {
        self.observe(next);
        self.forced = false;
        if self.max == 0 || room == 0 {
            return vec![];
        }
        let mut draft = lookup(history, next, self.max.min(room));
        // Token k is kept only if all before it are: expected tokens of a
        // step with k drafted are 1 + r + ... + r^k.
        let (mut expected, mut p, mut best) = (1.0, 1.0, (1.0, 0));
        for k in 1..=draft.len() {
            p *= self.rate;
            expected += p;
            let worth = expected / costs.relative(k + 1);
            if worth > best.0 {
                best = (worth, k);
            }
        }
        if best.1 == 0 {
            if self.shadow.is_empty() {
                self.shadow = draft;
            }
            return vec![];
        }
        self.shadow.clear();
        draft.truncate(best.1);
        draft
    }

    /// The draft after `next` when a grammar forces `tokens` next (see
    /// `Constraint::forced` in the grammar crate): the model keeps them
    /// unless it spells them otherwise, so they are worth any step; at most
    /// `room` of them.
    pub fn propose_forced(&mut self, next: u32, mut tokens: Vec<u32>, room: usize) -> Vec<u32> {
        self.observe(next);
        self.shadow.clear();
        self.forced = true;
        tokens.truncate(self.max.min(room));
        tokens
    }

    /// Checks the declined draft against the token just chosen.
    fn observe(&mut self, next: u32) {
        if let Some(&want) = self.shadow.first() {
            self.learn(next == want);
            match next == want {
                true => drop(self.shadow.remove(0)),
                false => self.shadow.clear(),
            }
        }
    }

    /// Notes a verified draft: `accepted` of its `drafted` tokens were kept
    /// (the first one not kept, if any, was checked too).
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        self.drafted += drafted;
        self.accepted += accepted;
        if self.forced {
            return;
        }
        for _ in 0..accepted {
            self.learn(true);
        }
        if accepted < drafted {
            self.learn(false);
        }
    }

    fn learn(&mut self, right: bool) {
        let x = if right { 1.0 } else { 0.0 };
        self.rate += RATE_WEIGHT * (x - self.rate);
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
    fn drafts_are_as_long_as_they_are_worth() {
        let h: Vec<u32> = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2].to_vec();
        let costs = StepCosts::new(8);
        let mut d = Drafter::new(7);
        // At the prior rate, a few tokens are worth a step.
        let first = d.propose(&h, 3, 100, &costs).len();
        assert!((1..7).contains(&first), "{first}");
        // Whole drafts kept: the longest there is; the room caps it.
        d.record(first, first);
        for _ in 0..4 {
            d.record(7, 7);
        }
        assert_eq!(d.propose(&h, 3, 100, &costs), [4, 5, 6, 7, 8, 9, 10]);
        assert_eq!(d.propose(&h, 3, 3, &costs), [4, 5, 6]);
        assert!(Drafter::new(0).propose(&h, 3, 100, &costs).is_empty());
        // Drafts that miss: none is worth a step; what was declined is
        // still checked against the output, which raises the rate again.
        for _ in 0..6 {
            d.record(2, 0);
        }
        assert!(d.propose(&h, 3, 100, &costs).is_empty());
        assert!(!d.shadow.is_empty());
        let mut fed = h.clone();
        fed.push(3);
        let mut next = 4;
        while d.propose(&fed, next, 100, &costs).is_empty() {
            fed.push(next);
            next += 1;
            assert!(next < 12, "the shadow never raised the rate");
        }
        assert_eq!((d.drafted, d.accepted), (first + 28 + 12, first + 28));
        // Measured costs rule: steps of two tokens as dear as two steps make
        // every draft a loss whatever the rate.
        let mut dear = StepCosts::new(8);
        dear.note(1, 1.0);
        (2..=8).for_each(|n| dear.note(n, n as f64));
        let mut d = Drafter::new(7);
        d.record(7, 7);
        assert!(d.propose(&h, 3, 100, &dear).is_empty());
        assert_eq!(dear.relative(4), 4.0);
        assert_eq!(StepCosts::new(8).relative(3), 1.0 + 2.0 * PRIOR_EXTRA);
    }
}
