//! An OpenAI request with several choices (`n`, a legacy completion's batch
//! of prompts): each choice is its own job, all prepared before any runs (one
//! refused refuses the request), submitted as the queue takes them — a request
//! with more choices than the queue holds waits for its own to finish, never
//! for another client's — and their events merged: one body with every
//! choice, or one stream whose chunks carry each choice's `index`, then one
//! usage chunk and `[DONE]`. Choices run side by side on free slots (batched
//! decode); choice `j` of a prompt samples with the request's seed plus `j`.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::http::StatusCode;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use ds4_chat::turn::{Piece, Shaper, Turn};
use futures_util::stream::{self, BoxStream, SelectAll, StreamExt};
use serde_json::{json, Value};

use super::{piece_delta, usage_json, Kind, OpenAi};
use crate::dialect::{data, Dialect, ErrorKind, Gen, Input, Request};
use crate::relay::{
    cache_header, cut_short, end_turn, identity, job_error, not_queued, queue, sse, Queued,
};
use crate::state::AppState;
use ds4_runtime::{Event, Job, RuntimeHandle, SubmitError, Usage};

/// One choice: how its output is read and worded.
struct Choice {
    d: OpenAi,
    /// Until its end.
    shaper: Option<Shaper>,
    /// Its prompt's first choice: the one whose prompt tokens count.
    first: bool,
}

impl Choice {
    /// The pieces of the turn that `text` completes.
    fn pieces(&mut self, text: &str) -> Vec<Piece> {
        self.shaper
            .as_mut()
            .map(|s| s.push(text))
            .unwrap_or_default()
    }

    /// The pieces held back and the whole turn, at its end.
    fn finish(&mut self) -> (Vec<Piece>, Turn) {
        self.shaper.take().map(Shaper::finish).unwrap_or_default()
    }
}

/// The choices' jobs: those not yet taken by the queue, and every choice's
/// events tagged with its index.
struct Fanout {
    runtime: RuntimeHandle,
    waiting: VecDeque<Job>,
    events: SelectAll<BoxStream<'static, (usize, Event)>>,
    /// Jobs submitted and not yet done.
    running: usize,
}

impl Fanout {
    /// Submits the waiting jobs the queue takes now. A full queue is an
    /// error only when none of this request's jobs runs (none will free a
    /// place for the rest).
    fn submit(&mut self) -> Result<(), SubmitError> {
        while let Some(job) = self.waiting.pop_front() {
            match self.runtime.try_submit(job) {
                Ok(()) => self.running += 1,
                Err((SubmitError::QueueFull, job)) if self.running > 0 => {
                    self.waiting.push_front(*job);
                    break;
                }
                Err((e, _)) => return Err(e),
            }
        }
        Ok(())
    }

    /// The next event of any choice (`None` once all are done), submitting
    /// waiting jobs as running ones end.
    async fn next(&mut self) -> Option<Result<(usize, Event), SubmitError>> {
        if let Err(e) = self.submit() {
            return Some(Err(e));
        }
        let (k, ev) = self.events.next().await?;
        if matches!(ev, Event::Done { .. } | Event::Failed(_)) {
            self.running -= 1;
        }
        Some(Ok((k, ev)))
    }
}

/// Runs `p`'s choices (see the module doc) on the `kind` endpoint.
pub(crate) async fn run(st: Arc<AppState>, mut p: Request, kind: Kind) -> Response {
    let d0 = OpenAi::new(kind);
    let g = Arc::new(identity(&st, &d0, &p));
    let prompts: Vec<Input> = std::iter::once(p.input.clone())
        .chain(std::mem::take(&mut p.batch))
        .collect();
    let (mut choices, mut jobs, mut events) = (Vec::new(), VecDeque::new(), SelectAll::new());
    for input in prompts {
        for j in 0..p.n {
            let mut one = p.clone();
            one.input = input.clone();
            one.sampling.seed = p.sampling.seed.wrapping_add(j as u64);
            let k = choices.len();
            let mut d = OpenAi::new(kind);
            let (_, Queued { job, rx, shaper }) =
                match queue(&st, one, &mut d, &format!("{}-{k}", g.id)).await {
                    Ok(q) => q,
                    Err(r) => return r,
                };
            choices.push(Choice {
                d,
                shaper: Some(shaper),
                first: j == 0,
            });
            jobs.push_back(job);
            let rx = events_of(rx).map(move |ev| (k, ev));
            events.push(rx.boxed());
        }
    }
    let fan = Fanout {
        runtime: st.runtime.clone(),
        waiting: jobs,
        events,
        running: 0,
    };
    match p.stream {
        false => whole(st, g, fan, choices).await,
        true => streamed(st, g, fan, choices, p.include_usage, kind).await,
    }
}

/// A receiver as a stream of its events.
fn events_of(
    mut rx: tokio::sync::mpsc::Receiver<Event>,
) -> impl futures_util::Stream<Item = Event> {
    stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// The usage of several choices: each prompt's tokens once (its first
/// choice's), every choice's completion.
fn add_usage(total: &mut Option<Usage>, u: &Usage, first: bool) {
    let t = total.get_or_insert_with(|| Usage {
        prompt_tokens: 0,
        cached_tokens: 0,
        completion_tokens: 0,
        ..u.clone()
    });
    if first {
        t.prompt_tokens += u.prompt_tokens;
        t.cached_tokens += u.cached_tokens;
    }
    t.completion_tokens += u.completion_tokens;
}

/// One JSON body with every choice in order.
async fn whole(
    st: Arc<AppState>,
    g: Arc<Gen>,
    mut fan: Fanout,
    mut choices: Vec<Choice>,
) -> Response {
    let d0 = OpenAi::new(Kind::Chat);
    let mut done: Vec<Option<Value>> = vec![None; choices.len()];
    let (mut usage, mut head_usage, mut body) = (None, None, Value::Null);
    while let Some(next) = fan.next().await {
        let (k, ev) = match next {
            Ok(e) => e,
            Err(e) => return not_queued(&d0, e),
        };
        let c = &mut choices[k];
        match ev {
            Event::Started(_) | Event::Progress { .. } => {}
            Event::Logprobs(l) | Event::PromptLogprobs(l) => c.d.logprobs(l),
            Event::Text(t) => {
                c.pieces(&t);
            }
            Event::Done { finish, usage: u } => {
                let (_, turn) = c.finish();
                let finish = end_turn(&st, &g, &turn, cut_short(finish), &u);
                let mut b = c.d.complete(&g, &turn, finish, &u);
                let mut choice = b["choices"][0].take();
                choice["index"] = json!(k);
                done[k] = Some(choice);
                add_usage(&mut usage, &u, c.first);
                if k == 0 {
                    head_usage = Some(u);
                    body = b;
                }
            }
            Event::Failed(e) => return job_error(&c.d, &e),
        }
    }
    let (Some(usage), Some(choices)) = (usage, done.into_iter().collect::<Option<Vec<Value>>>())
    else {
        return d0.error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the engine stopped",
            ErrorKind::Server,
        );
    };
    body["choices"] = Value::Array(choices);
    body["usage"] = usage_json(&usage);
    let mut r = Json(body).into_response();
    if let Some(u) = head_usage {
        cache_header(&mut r, &u);
    }
    r
}

/// One SSE stream: each choice's chunks as they come (its `index` set), then
/// the usage chunk (with `include_usage`) and `[DONE]`.
async fn streamed(
    st: Arc<AppState>,
    g: Arc<Gen>,
    fan: Fanout,
    choices: Vec<Choice>,
    include_usage: bool,
    kind: Kind,
) -> Response {
    struct State {
        st: Arc<AppState>,
        g: Arc<Gen>,
        fan: Fanout,
        choices: Vec<Choice>,
        usage: Option<Usage>,
    }
    let indexed = |mut v: Value, k: usize| {
        v["choices"][0]["index"] = json!(k);
        data(&v)
    };
    let state = State {
        st,
        g,
        fan,
        choices,
        usage: None,
    };
    let body = stream::unfold(Some(state), move |state| async move {
        let mut s = state?;
        let Some(next) = s.fan.next().await else {
            // Every choice is done.
            let mut out = Vec::new();
            if let (true, Some(u)) = (include_usage, &s.usage) {
                out.push(data(&OpenAi::new(kind).usage_chunk(&s.g, u)));
            }
            out.push(SseEvent::default().data("[DONE]"));
            return Some((out, None));
        };
        let (k, ev) = match next {
            Ok(e) => e,
            Err(e) => return Some((failed(&s.g, &e.to_string()), None)),
        };
        let c = &mut s.choices[k];
        let out = match ev {
            Event::Started(_) if kind == Kind::Chat => {
                let role = json!({ "role": "assistant", "content": "" });
                vec![indexed(c.d.chunk(&s.g, role, None), k)]
            }
            Event::Started(_) | Event::Progress { .. } => vec![],
            Event::Logprobs(l) | Event::PromptLogprobs(l) => {
                c.d.logprobs(l);
                vec![]
            }
            Event::Text(t) => c
                .pieces(&t)
                .iter()
                .map(|piece| indexed(c.d.chunk(&s.g, piece_delta(piece), None), k))
                .collect(),
            Event::Done { finish, usage } => {
                let (pieces, turn) = c.finish();
                let finish = end_turn(&s.st, &s.g, &turn, cut_short(finish), &usage);
                let mut out: Vec<SseEvent> = pieces
                    .iter()
                    .map(|piece| indexed(c.d.chunk(&s.g, piece_delta(piece), None), k))
                    .collect();
                out.push(indexed(c.d.chunk(&s.g, json!({}), Some(finish)), k));
                add_usage(&mut s.usage, &usage, c.first);
                out
            }
            Event::Failed(e) => return Some((failed(&s.g, &e.to_string()), None)),
        };
        Some((out, Some(s)))
    })
    .flat_map(stream::iter);
    sse(body.map(Ok::<_, Infallible>)).into_response()
}

/// The error event that ends a stream, then `[DONE]`.
fn failed(g: &Gen, message: &str) -> Vec<SseEvent> {
    OpenAi::new(Kind::Chat).stream_error(g, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_counts_each_prompt_once_and_every_completion() {
        let u = |prompt, completion| Usage {
            prompt_tokens: prompt,
            cached_tokens: 1,
            checkpointed_tokens: 0,
            completion_tokens: completion,
            cache_source: ds4_runtime::CacheSource::None,
            cut_tokens: 0,
            miss: None,
            slot: 0,
            queue_s: 0.0,
        };
        let mut total = None;
        // A second choice of prompt A done first, then A's first, then B's.
        add_usage(&mut total, &u(10, 3), false);
        add_usage(&mut total, &u(10, 4), true);
        add_usage(&mut total, &u(7, 5), true);
        let t = total.unwrap();
        assert_eq!(
            (t.prompt_tokens, t.cached_tokens, t.completion_tokens),
            (17, 2, 12)
        );
    }
}
