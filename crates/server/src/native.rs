//! llama.cpp's own tokenizer routes, as its server answers them, for tools
//! written against it (token counting, prompt budgeting, logit-bias lookups):
//!
//! - `POST /tokenize` `{"content": str, "add_special": false,
//!   "parse_special": true, "with_pieces": false}` -> `{"tokens": [id, ...]}`,
//!   or with pieces `[{"id": id, "piece": str | [byte, ...]}, ...]`: a piece is
//!   a string when its bytes are valid UTF-8 (a character split over tokens is
//!   not), its bytes otherwise. `add_special` puts the BOS the model asks for
//!   first; `parse_special` reads special tokens' texts as those tokens.
//! - `POST /detokenize` `{"tokens": [id, ...]}` -> `{"content": str}`: the
//!   pieces with special tokens rendered, bytes that are not UTF-8 replaced.
//! - `POST /apply-template`, a chat completion's body -> `{"prompt": str}`: the
//!   text the chat route renders it to (template, tools, thinking mode), with
//!   the chat route's refusals.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use ds4_engine::Tokenizer;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::dialect::{BadRequest, Dialect};
use crate::openai::{parse_chat, parse_json, Kind, OpenAi};
use crate::prepare::prompt_text;
use crate::state::{cpu, AppState};

#[derive(Deserialize)]
struct TokenizeBody {
    content: String,
    #[serde(default)]
    add_special: bool,
    #[serde(default = "yes")]
    parse_special: bool,
    #[serde(default)]
    with_pieces: bool,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
struct DetokenizeBody {
    tokens: Vec<u32>,
}

/// The answer to a `/tokenize` body.
fn tokenize_body(tok: &Tokenizer, body: &[u8]) -> Result<Value, BadRequest> {
    let b: TokenizeBody = parse_json(body)?;
    let ids = tok.encode(&b.content, b.add_special, b.parse_special);
    let tokens: Vec<Value> = match b.with_pieces {
        false => ids.iter().map(|&id| json!(id)).collect(),
        true => ids
            .iter()
            .map(|&id| {
                let piece = tok.token_piece(id, true);
                let piece = match std::str::from_utf8(piece) {
                    Ok(s) => json!(s),
                    Err(_) => json!(piece),
                };
                json!({ "id": id, "piece": piece })
            })
            .collect(),
    };
    Ok(json!({ "tokens": tokens }))
}

/// The answer to a `/detokenize` body.
fn detokenize_body(tok: &Tokenizer, body: &[u8]) -> Result<Value, BadRequest> {
    let b: DetokenizeBody = parse_json(body)?;
    let n_vocab = tok.n_vocab();
    if let Some(&id) = b.tokens.iter().find(|&&id| id as usize >= n_vocab) {
        return Err(BadRequest::new(
            format!("token {id} is outside the vocabulary (ids 0..{n_vocab})"),
            Some("tokens"),
        ));
    }
    let bytes = tok.decode(&b.tokens, true);
    Ok(json!({ "content": String::from_utf8_lossy(&bytes) }))
}

/// Runs `answer` on the body off the async threads (a body near the cap is
/// megabytes of text) and replies with its JSON or a 400.
async fn reply(
    st: Arc<AppState>,
    body: Bytes,
    answer: fn(&Tokenizer, &[u8]) -> Result<Value, BadRequest>,
) -> Response {
    match cpu(&st, move |st| answer(&st.model.tokenizer, &body)).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => OpenAi::new(Kind::Chat).bad_request(e),
    }
}

/// `POST /tokenize`.
pub(crate) async fn tokenize(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    reply(st, body, tokenize_body).await
}

/// `POST /detokenize`.
pub(crate) async fn detokenize(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    reply(st, body, detokenize_body).await
}

/// `POST /apply-template`.
pub(crate) async fn apply_template(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let d = OpenAi::new(Kind::Chat);
    match cpu(&st, move |st| parse_chat(&body).map(|p| prompt_text(st, p))).await {
        Ok(Ok(prompt)) => Json(json!({ "prompt": prompt })).into_response(),
        Ok(Err(r)) => crate::relay::refuse(&d, r),
        Err(e) => d.bad_request(e),
    }
}
