//! One job's generation: the sampler, the grammar guard (constrained decoding:
//! masks while the grammar holds the output, a trigger that starts it when the
//! model opens a tool call itself, winding down near the budget's end or in a
//! loop), stop sequences held back until they cannot match, and the UTF-8
//! stream of what is emitted. The scheduler feeds it each step's logits and
//! feeds back the token it chose.

use std::time::Instant;

use ds4_engine::sampler::LogNorm;
use ds4_engine::tokenizer::StreamDecoder;
use ds4_engine::{Sampler, Tokenizer};
use tokio::sync::mpsc;

use crate::job::{Event, FinishReason, Gate, Logprobs, TokenLimit, TokenLogprob};

/// What a generation does after a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Feed this token and continue.
    Feed(u32),
    /// Feed this token (an end of turn, or the one a stop sequence ended), then
    /// finish: the next turn's prompt renders it.
    FeedAndFinish(u32, FinishReason),
    /// Finish without feeding anything.
    Finish(FinishReason),
}

/// The state of one job's generation.
pub(crate) struct Generation {
    sampler: Sampler,
    stream: StreamDecoder,
    stops: StopMatcher,
    pub guard: Guard,
    limit: TokenLimit,
    /// The most tokens it may generate (the limit cut to the context).
    max_tokens: usize,
    pub generated: usize,
    /// Everything emitted so far.
    pub output: String,
    pub started: Instant,
    scores: Option<Scores>,
}

/// The log-probabilities a job asked for: each generated token's, held until
/// the text it makes has been emitted (stop sequences hold text back), with
/// where that text lies in the decoded stream, of which the output is a
/// prefix.
struct Scores {
    top: usize,
    held: Vec<(std::ops::Range<usize>, Logprobs)>,
    /// Bytes decoded so far (emitted or held back).
    decoded: usize,
}

/// Token `id`'s log-probability under `logits` and the `top` likeliest
/// (ranked by logit, as by log-probability; only those are normalized).
pub(crate) fn score(logits: &[f32], id: u32, top: usize, tok: &Tokenizer) -> Logprobs {
    let norm = LogNorm::of(logits);
    let entry = |id: u32| TokenLogprob {
        id,
        bytes: tok.token_piece(id, true).to_vec(),
        logprob: logits
            .get(id as usize)
            .map_or(f32::NEG_INFINITY, |&l| norm.logprob(l)),
    };
    Logprobs {
        chosen: entry(id),
        top: match top {
            0 => vec![],
            k => ds4_engine::sampler::top_k(logits, k)
                .into_iter()
                .map(|(id, _)| entry(id))
                .collect(),
        },
    }
}

impl Scores {
    /// Takes the held tokens that `emitted` bytes of output hold: wholly, or
    /// (the output is final) in part.
    fn take(&mut self, emitted: usize, last: bool) -> Vec<Logprobs> {
        let done = |r: &std::ops::Range<usize>| match last {
            true => r.start < emitted || r.is_empty() && r.start <= emitted,
            false => r.end <= emitted,
        };
        let n = self.held.iter().take_while(|(r, _)| done(r)).count();
        let out = self.held.drain(..n).map(|(_, l)| l).collect();
        if last {
            self.held.clear();
        }
        out
    }
}

impl Generation {
    pub fn new(
        sampler: Sampler,
        stop: Vec<String>,
        gate: Option<Gate>,
        limit: TokenLimit,
        max_tokens: usize,
        logprobs: Option<usize>,
    ) -> Self {
        Generation {
            sampler,
            stream: StreamDecoder::default(),
            stops: StopMatcher::new(stop),
            guard: Guard::new(gate, max_tokens),
            limit,
            max_tokens,
            generated: 0,
            output: String::new(),
            started: Instant::now(),
            scores: logprobs.map(|top| Scores {
                top,
                held: Vec::new(),
                decoded: 0,
            }),
        }
    }

    /// Chooses the next token from `logits` and emits the text it completes
    /// (a client gone is a cancellation).
    pub fn step(&mut self, logits: &[f32], tok: &Tokenizer, events: &mpsc::Sender<Event>) -> Next {
        if self.generated >= self.max_tokens {
            return Next::Finish(self.length_finish());
        }
        let next = self
            .guard
            .sample(&mut self.sampler, logits, self.max_tokens - self.generated);
        self.generated += 1;
        if tok.is_eog(next) {
            return Next::FeedAndFinish(next, FinishReason::Stop);
        }
        let piece = tok.token_piece(next, false);
        self.guard.commit(next, piece, tok);
        let text = self.stream.push(piece).to_string();
        if let Some(s) = &mut self.scores {
            let lp = score(logits, next, s.top, tok);
            s.held.push((s.decoded..s.decoded + text.len(), lp));
            s.decoded += text.len();
        }
        let (emit, stopped) = self.stops.push(&text);
        self.output.push_str(&emit);
        if !self.send(emit, stopped, events) {
            return Next::FeedAndFinish(next, FinishReason::Cancelled);
        }
        if stopped {
            return Next::FeedAndFinish(next, FinishReason::Stop);
        }
        if self.generated == self.max_tokens {
            return Next::FeedAndFinish(next, self.length_finish());
        }
        Next::Feed(next)
    }

    /// `Length`, or `ContextFull` when the default limit was cut to the context
    /// and the context is what ended the answer.
    fn length_finish(&self) -> FinishReason {
        if self.max_tokens < self.limit.tokens() {
            FinishReason::ContextFull
        } else {
            FinishReason::Length
        }
    }

    /// Sends `emit` (newly emitted text), after the log-probabilities of the
    /// tokens it completes (with `last`, the output is final: those it holds a
    /// part of); false when the client is gone.
    fn send(&mut self, emit: String, last: bool, events: &mpsc::Sender<Event>) -> bool {
        if let Some(s) = &mut self.scores {
            let done = s.take(self.output.len(), last);
            if !done.is_empty() && events.blocking_send(Event::Logprobs(done)).is_err() {
                return false;
            }
        }
        emit.is_empty() || events.blocking_send(Event::Text(emit)).is_ok()
    }

    /// Emits what was held back (unless `finish` is a cancellation) and
    /// returns the whole output.
    pub fn finish(&mut self, finish: FinishReason, events: &mpsc::Sender<Event>) {
        let tail = self.stops.finish(self.stream.finish());
        self.output.push_str(&tail);
        if finish != FinishReason::Cancelled {
            self.send(tail, true, events);
        }
    }
}

/// The constrained part of a generation.
pub(crate) struct Guard {
    pub gate: Option<Gate>,
    /// Whether the grammar is holding the output now.
    pub active: bool,
    /// Generated bytes, searched for the trigger while inactive.
    raw: Vec<u8>,
    /// The logits with the grammar's mask applied.
    masked: Vec<f32>,
    /// Time spent computing masks.
    pub mask_s: f64,
    /// Why the grammar was let go (it refused the output), if it was.
    pub dropped: Option<String>,
    /// Tokens generated while the grammar held the output, for loop detection.
    held: Vec<u32>,
    /// Winding down: the grammar closes what is open (see `Constraint::mask`).
    pub winding_down: bool,
    /// The budget left when winding down starts.
    wind_down: usize,
}

/// Tokens left in the budget when a held output starts winding down: a quarter
/// of the budget, at least 32 (a few nested values, the required keys still to
/// come and the call's closing tag) and at most 256 (long answers that would
/// have ended in time are not cut short).
fn wind_down_at(budget: usize) -> usize {
    (budget / 4).clamp(32, 256)
}

/// A held output whose last this many tokens repeat a unit of at most
/// `LOOP_MAX_PERIOD` tokens is looping (a small model's `.json.json.json`
/// inside a string): it winds down at once.
const LOOP_WINDOW: usize = 12;
const LOOP_MAX_PERIOD: usize = 4;

fn is_looping(tokens: &[u32]) -> bool {
    let Some(tail) = tokens.get(tokens.len().saturating_sub(LOOP_WINDOW)..) else {
        return false;
    };
    tail.len() == LOOP_WINDOW
        && (1..=LOOP_MAX_PERIOD).any(|p| (p..tail.len()).all(|i| tail[i] == tail[i - p]))
}

impl Guard {
    fn new(gate: Option<Gate>, budget: usize) -> Self {
        Guard {
            wind_down: wind_down_at(budget),
            active: gate.as_ref().is_some_and(|g| g.trigger.is_none()),
            gate,
            raw: Vec::new(),
            masked: Vec::new(),
            mask_s: 0.0,
            dropped: None,
            held: Vec::new(),
            winding_down: false,
        }
    }

    /// The tokens the grammar forces next while it holds the output
    /// (`Constraint::forced`; timed with the masks).
    pub fn forced(&mut self) -> Vec<u32> {
        let active = self.active;
        let Some(g) = self.gate.as_mut().filter(|_| active) else {
            return vec![];
        };
        let t = Instant::now();
        let forced = g.constraint.forced();
        self.mask_s += t.elapsed().as_secs_f64();
        forced
    }

    fn drop_gate(&mut self, why: String) {
        self.gate = None;
        self.active = false;
        self.dropped.get_or_insert(why);
    }

    /// The next token: drawn from the masked logits while the grammar holds
    /// the output; `remaining` is the token budget left, this one included.
    fn sample(&mut self, sampler: &mut Sampler, logits: &[f32], remaining: usize) -> u32 {
        let Some(g) = self.gate.as_mut().filter(|_| self.active) else {
            return sampler.sample(logits);
        };
        self.winding_down |= remaining <= self.wind_down || is_looping(&self.held);
        let t = Instant::now();
        self.masked.clear();
        self.masked.extend_from_slice(logits);
        let masked = g.constraint.mask(&mut self.masked, self.winding_down);
        self.mask_s += t.elapsed().as_secs_f64();
        match masked {
            Ok(()) => sampler.sample(&self.masked),
            Err(e) => {
                self.drop_gate(e.to_string());
                sampler.sample(logits)
            }
        }
    }

    /// Takes a generated (not end-of-turn) token with its text; starts the
    /// grammar when the text completes its trigger (feeding it what followed).
    fn commit(&mut self, token: u32, piece: &[u8], tok: &Tokenizer) {
        let Some(g) = self.gate.as_mut() else { return };
        if self.active {
            self.held.push(token);
            if let Err(e) = g.constraint.commit(&[token]) {
                self.drop_gate(e.to_string());
            }
            return;
        }
        let Some(trigger) = g.trigger else { return };
        self.raw.extend_from_slice(piece);
        let from = self
            .raw
            .len()
            .saturating_sub(piece.len() + trigger.len() - 1);
        let Some(at) = self.raw[from..]
            .windows(trigger.len())
            .position(|w| w == trigger.as_bytes())
        else {
            return;
        };
        let tail = String::from_utf8_lossy(&self.raw[from + at + trigger.len()..]).into_owned();
        match g.constraint.commit(&tok.encode(&tail, false, false)) {
            Ok(()) => self.active = true,
            Err(e) => self.drop_gate(format!("after {trigger}: {e}")),
        }
    }
}

/// Holds back text that might be the start of a stop sequence, and cuts the output
/// at the first complete one.
struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

impl StopMatcher {
    fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops,
            pending: String::new(),
        }
    }

    /// Adds generated text; returns what can be emitted and whether a stop sequence
    /// was hit (the stop itself and anything after it are dropped).
    fn push(&mut self, text: &str) -> (String, bool) {
        self.pending.push_str(text);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // Keep the longest suffix that is a proper prefix of some stop sequence.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(|&k| s.is_char_boundary(k))
                    .map(move |k| &s[..k])
            })
            .filter(|p| self.pending.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    fn finish(&mut self, tail: &str) -> String {
        let (mut out, stopped) = self.push(tail);
        if !stopped {
            out.push_str(&std::mem::take(&mut self.pending));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Held tokens go out once the output holds their text: wholly while
    /// more may come, and at the end those it holds any of (a token whose
    /// text is empty, a piece of a character, goes with what precedes it).
    #[test]
    fn log_probabilities_go_out_with_the_text_they_make() {
        let entry = |id: u32| Logprobs {
            chosen: TokenLogprob {
                id,
                bytes: vec![],
                logprob: -1.0,
            },
            top: vec![],
        };
        let mut s = Scores {
            top: 0,
            held: [0..3, 3..3, 3..7, 7..9, 9..12]
                .into_iter()
                .zip(0..)
                .map(|(r, id)| (r, entry(id)))
                .collect(),
            decoded: 12,
        };
        let ids = |v: Vec<Logprobs>| v.iter().map(|l| l.chosen.id).collect::<Vec<_>>();
        assert_eq!(ids(s.take(2, false)), Vec::<u32>::new());
        assert_eq!(ids(s.take(5, false)), [0, 1]);
        assert_eq!(ids(s.take(7, false)), [2]);
        // A stop sequence from byte 8 on: the token it cuts stays, the rest go.
        assert_eq!(ids(s.take(8, true)), [3]);
        assert!(s.held.is_empty());
    }

    #[test]
    fn winding_down_starts_at_a_bounded_quarter_of_the_budget() {
        assert_eq!(wind_down_at(48), 32);
        assert_eq!(wind_down_at(200), 50);
        assert_eq!(wind_down_at(32000), 256);
    }

    #[test]
    fn loops_are_short_units_repeated_over_the_window() {
        let unit = [5, 6, 7];
        let looping: Vec<u32> = unit.iter().copied().cycle().take(LOOP_WINDOW).collect();
        assert!(is_looping(&looping));
        assert!(is_looping(&[1; LOOP_WINDOW]));
        assert!(!is_looping(&[1; LOOP_WINDOW - 1]));
        let mut varied = looping.clone();
        varied[0] = 9;
        assert!(!is_looping(&varied));
        let five: Vec<u32> = [1, 2, 3, 4, 5]
            .iter()
            .copied()
            .cycle()
            .take(LOOP_WINDOW)
            .collect();
        assert!(!is_looping(&five), "a period of 5 is not counted");
    }

    #[test]
    fn stop_sequences_cut_and_hold_back() {
        let stops = vec!["END".to_string(), "\n\n".to_string()];
        let mut m = StopMatcher::new(stops.clone());
        assert_eq!(m.push("Hello E"), ("Hello ".to_string(), false));
        assert_eq!(m.push("N"), (String::new(), false));
        assert_eq!(m.push("Dx"), (String::new(), true));
        let mut m = StopMatcher::new(stops.clone());
        assert_eq!(m.push("a\n"), ("a".to_string(), false));
        assert_eq!(m.finish("b"), "\nb");
        let none: Vec<String> = vec![];
        let mut m = StopMatcher::new(none);
        assert_eq!(m.push("xyz"), ("xyz".to_string(), false));
    }
}
