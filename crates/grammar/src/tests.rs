//! Grammars over the real SmolLM2 vocabulary: the masks, control tokens, the end
//! of a grammar, and greedy generation held to a JSON schema.

use std::sync::{Arc, OnceLock};

use ds4_engine::{Model, Sampler, SamplerConfig, Session, SessionOptions, ThreadPool};

use super::*;

fn model() -> Arc<Model> {
    static MODEL: OnceLock<Arc<Model>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            let path = ds4_testdata::model_path(ds4_testdata::SMOLLM2);
            Arc::new(Model::load(path).expect("model loads"))
        })
        .clone()
}

fn vocab() -> (Vocab, u32) {
    let m = model();
    let im_end = m
        .tokenizer
        .token_id("<|im_end|>")
        .expect("ChatML vocabulary");
    (Vocab::new(m, im_end).expect("vocabulary"), im_end)
}

fn allowed(c: &mut Constraint) -> Vec<u32> {
    let mut logits = vec![0.0; model().tokenizer.n_vocab()];
    c.mask(&mut logits, false).unwrap();
    (0..logits.len() as u32)
        .filter(|&i| logits[i as usize].is_finite())
        .collect()
}

#[test]
fn a_finished_grammar_allows_only_the_end_of_turn() {
    let (v, im_end) = vocab();
    let mut c = v.constraint(r#"start: "yes" | "no""#).unwrap();
    let tok = &model().tokenizer;
    let first = allowed(&mut c);
    assert!(first.contains(&tok.encode("yes", false, false)[0]));
    assert!(!first.contains(&im_end), "the grammar is not complete yet");
    c.commit(&tok.encode("no", false, false)).unwrap();
    assert!(c.is_complete());
    assert_eq!(allowed(&mut c), vec![im_end]);
}

#[test]
fn control_tokens_are_never_text() {
    let (v, _) = vocab();
    let tok = &model().tokenizer;
    let mut c = v.constraint(r#"start: "say " /[^\n]*/ "\n""#).unwrap();
    c.commit(&tok.encode("say ", false, false)).unwrap();
    let ok = allowed(&mut c);
    for special in ["<|im_start|>", "<|im_end|>", "<|endoftext|>"] {
        let id = tok.token_id(special).unwrap();
        assert!(!ok.contains(&id), "{special} is allowed inside text");
    }
    // Their spelling as plain text still is (as several ordinary tokens).
    let lt = tok.encode("<", false, false)[0];
    assert!(ok.contains(&lt));
}

/// Winding down closes an open string at once, and changes nothing where no
/// closing byte can come next.
#[test]
fn winding_down_closes_what_is_open() {
    let (v, _) = vocab();
    let tok = &model().tokenizer;
    let mut c = v
        .constraint(r#"start: %json {"type":"object","properties":{"a":{"type":"string"}},"required":["a"],"additionalProperties":false}"#)
        .unwrap();
    c.commit(&tok.encode(r#"{"a": "looping"#, false, false))
        .unwrap();
    let mut logits = vec![0.0; tok.n_vocab()];
    c.mask(&mut logits, true).unwrap();
    let left: Vec<u32> = (0..logits.len() as u32)
        .filter(|&i| logits[i as usize].is_finite())
        .collect();
    assert!(!left.is_empty());
    for id in left {
        assert_eq!(tok.token_piece(id, false).first(), Some(&b'"'), "{id}");
    }
    // A number in an object that still owes a required key ends at a comma
    // (with the servers' fixed spacing: no whitespace to wander into).
    let mut owed = v
        .constraint(r#"start: %json {"type":"object","properties":{"n":{"type":"integer"},"b":{"type":"boolean"}},"required":["n","b"],"additionalProperties":false,"x-guidance":{"whitespace_flexible":false,"item_separator":", ","key_separator":": "}}"#)
        .unwrap();
    owed.commit(&tok.encode(r#"{"n": 30"#, false, false))
        .unwrap();
    let mut logits = vec![0.0; tok.n_vocab()];
    owed.mask(&mut logits, true).unwrap();
    let left: Vec<u32> = (0..logits.len() as u32)
        .filter(|&i| logits[i as usize].is_finite())
        .collect();
    assert!(!left.is_empty());
    for id in left {
        assert_eq!(tok.token_piece(id, false).first(), Some(&b','), "{id}");
    }
    // Where the grammar may end, winding down ends it.
    let mut more = v.constraint(r#"start: "a" ("\nb")*"#).unwrap();
    more.commit(&tok.encode("a", false, false)).unwrap();
    let mut logits = vec![0.0; tok.n_vocab()];
    more.mask(&mut logits, true).unwrap();
    let left: Vec<usize> = (0..logits.len())
        .filter(|&i| logits[i].is_finite())
        .collect();
    assert_eq!(left, vec![tok.token_id("<|im_end|>").unwrap() as usize]);
    let mut fresh = v.constraint(r#"start: "x" /[0-9]+/"#).unwrap();
    let mut a = vec![0.0; tok.n_vocab()];
    let mut b = a.clone();
    fresh.mask(&mut a, true).unwrap();
    fresh.mask(&mut b, false).unwrap();
    assert_eq!(a, b);
}

#[test]
fn a_refused_token_is_an_error_and_a_bad_grammar_does_not_compile() {
    let (v, _) = vocab();
    let tok = &model().tokenizer;
    let mut c = v.constraint(r#"start: "abc""#).unwrap();
    assert!(matches!(
        c.commit(&tok.encode("xyz", false, false)),
        Err(GrammarError::Refused(_))
    ));
    assert!(matches!(
        v.constraint("start: undefined_rule"),
        Err(GrammarError::Compile(_))
    ));
    assert!(matches!(
        v.constraint(r#"start: %json {"type": "object", "properties": 5}"#),
        Err(GrammarError::Compile(_))
    ));
}

/// The model answers a question with greedy decoding held to a schema; the
/// output parses and has the schema's shape whatever the model would have said.
#[test]
fn greedy_generation_follows_a_json_schema() {
    let (v, im_end) = vocab();
    let m = model();
    let schema = r#"{"type":"object","properties":{"city":{"type":"string","maxLength":40},"population":{"type":"integer"},"capital":{"type":"boolean"}},"required":["city","population","capital"],"additionalProperties":false}"#;
    let mut c = v.constraint(&format!("start: %json {schema}")).unwrap();
    let pool = Arc::new(ThreadPool::new(2));
    let mut s = Session::new(Arc::clone(&m), pool, &SessionOptions::default());
    let prompt = "<|im_start|>user\nDescribe Paris as JSON.<|im_end|>\n<|im_start|>assistant\n";
    s.prefill(&m.tokenizer.encode(prompt, false, true)).unwrap();
    let mut sampler = Sampler::new(SamplerConfig {
        temperature: 0.0,
        ..SamplerConfig::default()
    });
    let mut out = Vec::new();
    let mut ended = false;
    for _ in 0..80 {
        let mut logits = s.logits().unwrap().to_vec();
        c.mask(&mut logits, false).unwrap();
        let next = sampler.sample(&logits);
        if next == im_end {
            ended = true;
            break;
        }
        c.commit(&[next]).unwrap();
        out.push(next);
        s.decode_step(next).unwrap();
    }
    let text = String::from_utf8(m.tokenizer.decode(&out, false)).unwrap();
    assert!(ended, "no end of turn after 80 tokens: {text:?}");
    let v: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let o = v.as_object().unwrap();
    assert_eq!(o.len(), 3, "{text}");
    assert!(o["city"].is_string() && o["population"].is_i64() && o["capital"].is_boolean());
}

#[test]
fn fixed_text_is_forced_and_free_text_is_not() {
    let (v, _) = vocab();
    let tok = &model().tokenizer;
    let text = |ids: &[u32]| String::from_utf8_lossy(&tok.prompt_text(ids)).into_owned();
    let schema = r#"{"type":"object","properties":{"city":{"type":"string"},"unit":{"type":"string","enum":["celsius"]}},"required":["city","unit"],"additionalProperties":false,"x-guidance":{"whitespace_flexible":false,"item_separator":", ","key_separator":": "}}"#;
    let mut c = v.constraint(&format!("start: %json {schema}")).unwrap();
    // The opening and the first key are fixed: forced, and each forced token
    // is one the mask allows in turn.
    let forced = c.forced();
    assert!(!forced.is_empty());
    assert!(
        r#"{"city": ""#.starts_with(&text(&forced)),
        "{:?}",
        text(&forced)
    );
    for &t in &forced {
        assert!(allowed(&mut c).contains(&t));
        c.commit(&[t]).unwrap();
    }
    // The rest of the opening (a last token the tokenizer might extend is
    // left free), then inside the string value: nothing is forced.
    let opening = r#"{"city": ""#;
    let rest = &opening[text(&forced).len()..];
    c.commit(&tok.encode(rest, false, false)).unwrap();
    c.commit(&tok.encode("Paris", false, false)).unwrap();
    assert!(c.forced().is_empty());
    // Once the value closes, the rest is fixed up to the enum's only value.
    c.commit(&tok.encode("\"", false, false)).unwrap();
    let rest = text(&c.forced());
    assert!(
        !rest.is_empty() && r#", "unit": "celsius"}"#.starts_with(&rest),
        "{rest:?}"
    );
    // A grammar that has stopped forces nothing.
    let mut done = v.constraint(r#"start: "ok""#).unwrap();
    done.commit(&tok.encode("ok", false, false)).unwrap();
    assert!(done.forced().is_empty());
}
