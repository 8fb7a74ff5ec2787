//! Byte-level BPE tokenizers built from small synthetic GGUFs: merge order, special
//! tokens, the end-of-generation set, and every validation error. The GGUF helpers
//! serve the SPM tests in `spm` too.

use ds4_gguf::{Gguf, GgufError, GgufWriter, Value, ValueType};

use super::{Tokenizer, TokenizerError};

// `tokenizer.ggml.token_type` values.
pub(super) const NORMAL: i32 = 1;
pub(super) const UNKNOWN: i32 = 2;
pub(super) const CONTROL: i32 = 3;
pub(super) const USER: i32 = 4;
pub(super) const BYTE: i32 = 6;

/// Tokens (text, type) and merges of a tiny byte-level vocabulary. 'z' has no token.
const TOKENS: &[(&str, i32)] = &[
    ("<|endoftext|>", CONTROL),
    ("<|im_start|>", CONTROL),
    ("<|im_end|>", NORMAL), // control-looking: load forces it to control
    ("<u>", USER),
    ("<reponame>", CONTROL),
    ("a", NORMAL),
    ("b", NORMAL),
    ("c", NORMAL),
    ("Ġ", NORMAL), // space
    ("Ċ", NORMAL), // newline
    ("aa", NORMAL),
    ("ab", NORMAL),
    ("bc", NORMAL),
    ("Ġa", NORMAL),
    ("abc", NORMAL),
    ("<", NORMAL),
    (">", NORMAL),
    ("u", NORMAL),
];
const MERGES: &[&str] = &["b c", "a b", "a a", "Ġ a", "ab c"];

pub(super) fn strs(items: &[&str]) -> Value {
    Value::Array {
        elem: ValueType::String,
        items: items
            .iter()
            .map(|s| Value::String((*s).to_owned()))
            .collect(),
    }
}

pub(super) fn ints(items: &[i32]) -> Value {
    Value::Array {
        elem: ValueType::I32,
        items: items.iter().map(|&x| Value::I32(x)).collect(),
    }
}

fn base() -> Vec<(&'static str, Value)> {
    let texts: Vec<&str> = TOKENS.iter().map(|t| t.0).collect();
    let types: Vec<i32> = TOKENS.iter().map(|t| t.1).collect();
    vec![
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String("smollm".into())),
        ("tokenizer.ggml.tokens", strs(&texts)),
        ("tokenizer.ggml.token_type", ints(&types)),
        ("tokenizer.ggml.merges", strs(MERGES)),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", Value::U32(2)),
    ]
}

pub(super) fn build(kv: &[(&'static str, Value)]) -> Result<Tokenizer, TokenizerError> {
    let mut w = GgufWriter::new();
    for (k, v) in kv {
        w.add_kv(*k, v.clone());
    }
    let g = Gguf::from_bytes(w.to_bytes().expect("serialize")).expect("parse");
    Tokenizer::from_gguf(&g)
}

/// `kv` with `key` set to `value` (replaced or added), built.
pub(super) fn build_with(
    mut kv: Vec<(&'static str, Value)>,
    key: &'static str,
    value: Value,
) -> Result<Tokenizer, TokenizerError> {
    match kv.iter_mut().find(|(k, _)| *k == key) {
        Some(slot) => slot.1 = value,
        None => kv.push((key, value)),
    }
    build(&kv)
}

/// `kv` without `key`, built.
pub(super) fn build_without(
    kv: Vec<(&'static str, Value)>,
    key: &str,
) -> Result<Tokenizer, TokenizerError> {
    let kv: Vec<_> = kv.into_iter().filter(|(k, _)| *k != key).collect();
    build(&kv)
}

fn with(key: &'static str, value: Value) -> Result<Tokenizer, TokenizerError> {
    build_with(base(), key, value)
}

fn without(key: &str) -> Result<Tokenizer, TokenizerError> {
    build_without(base(), key)
}

fn tok() -> Tokenizer {
    build(&base()).expect("tiny tokenizer")
}

pub(super) fn err_text(r: Result<Tokenizer, TokenizerError>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn merges_go_by_rank_then_leftmost() {
    let t = tok();
    let id = |s: &str| t.token_id(s).unwrap();
    // "b c" (rank 0) beats "a b" (rank 1) although "a b" is further left, and
    // "ab c" can then no longer apply.
    assert_eq!(t.encode("abc", false, false), [id("a"), id("bc")]);
    // Equal ranks: the leftmost pair merges first.
    assert_eq!(t.encode("aaa", false, false), [id("aa"), id("a")]);
    assert_eq!(t.encode("abab", false, false), [id("ab"), id("ab")]);
    // Words never merge across a pre-tokenizer boundary; " a" is one word.
    assert_eq!(t.encode("a a", false, false), [id("a"), id("Ġa")]);
    assert_eq!(t.encode("", true, true), []);
}

#[test]
fn bytes_without_a_token_are_dropped() {
    let t = tok();
    let id = |s: &str| t.token_id(s).unwrap();
    assert_eq!(t.encode("azb", false, false), [id("a"), id("b")]);
    assert_eq!(t.encode("z", false, false), []);
}

#[test]
fn special_tokens_and_pieces() {
    let t = tok();
    let id = |s: &str| t.token_id(s).unwrap();
    // Control tokens only with parse_special; user-defined tokens always.
    assert_eq!(t.encode("<|im_start|>a", false, true), [1, id("a")]);
    assert_eq!(t.encode("a<u>b", false, false), [id("a"), 3, id("b")]);
    // As plain text it is BPE'd; here only '<', 'a' and '>' have tokens.
    assert_eq!(
        t.encode("<|im_start|>", false, false),
        [id("<"), id("a"), id(">")]
    );
    // Pieces: control renders on request, user-defined always, normal via the byte map.
    assert_eq!(t.token_piece(1, false), b"");
    assert_eq!(t.token_piece(1, true), b"<|im_start|>");
    assert_eq!(t.token_piece(3, false), b"<u>");
    assert_eq!(t.token_piece(id("Ġa"), false), b" a");
    assert_eq!(
        t.decode(&[1, id("Ġa"), 2], true),
        b"<|im_start|> a<|im_end|>"
    );
    assert_eq!(t.decode(&[1, id("Ġa"), 2], false), b" a");
}

#[test]
fn control_looking_tokens_are_forced_to_control_and_end_generation() {
    let t = tok();
    // "<|im_end|>" is typed normal in the GGUF but parses and renders as control.
    assert_eq!(t.encode("<|im_end|>", false, true), [2]);
    assert_eq!(t.token_piece(2, false), b"");
    // EOG: <|endoftext|>, <|im_end|> (also EOS), <reponame> (FIM repo).
    assert_eq!(t.eog_ids(), [0, 2, 4]);
    assert_eq!((t.bos(), t.eos()), (Some(1), Some(2)));
    assert_eq!(t.n_vocab(), TOKENS.len());
}

#[test]
fn add_special_follows_the_gguf_flags() {
    let t = with("tokenizer.ggml.add_bos_token", Value::Bool(true)).unwrap();
    let a = t.token_id("a").unwrap();
    assert_eq!(t.encode("a", true, false), [1, a]);
    assert_eq!(t.encode("a", false, false), [a]);
    let t = with("tokenizer.ggml.add_eos_token", Value::Bool(true)).unwrap();
    assert_eq!(t.encode("a", true, false), [a, 2]);
    assert_eq!(tok().encode("a", true, true), [a]);
}

#[test]
fn missing_and_unsupported_keys_are_named() {
    for key in [
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
    ] {
        match without(key) {
            Err(TokenizerError::Gguf(GgufError::MissingKey { key: k })) => assert_eq!(k, key),
            Err(e) => panic!("{key}: unexpected error {e}"),
            Ok(_) => panic!("{key}: loaded without it"),
        }
    }
    let e = err_text(with("tokenizer.ggml.model", Value::String("bert".into())));
    assert!(
        e.contains("tokenizer.ggml.model") && e.contains("\"bert\""),
        "{e}"
    );
    let e = err_text(with(
        "tokenizer.ggml.pre",
        Value::String("llama-bpe".into()),
    ));
    assert!(
        e.contains("tokenizer.ggml.pre") && e.contains("\"llama-bpe\"") && e.contains("smollm"),
        "{e}"
    );
    let e = err_text(with("tokenizer.ggml.model", Value::U32(2)));
    assert!(e.contains("tokenizer.ggml.model"), "{e}");
}

#[test]
fn token_table_errors() {
    let e = err_text(with("tokenizer.ggml.token_type", ints(&[1, 1])));
    assert!(
        e.contains("tokenizer.ggml.token_type has 2 entries")
            && e.contains(&TOKENS.len().to_string()),
        "{e}"
    );
    let mut types: Vec<i32> = TOKENS.iter().map(|t| t.1).collect();
    types[7] = 9;
    let e = err_text(with("tokenizer.ggml.token_type", ints(&types)));
    assert!(e.contains("token_type[7] = 9"), "{e}");
    let e = err_text(with("tokenizer.ggml.tokens", strs(&[])));
    assert!(e.contains("0 entries"), "{e}");
    let mut texts: Vec<&str> = TOKENS.iter().map(|t| t.0).collect();
    texts[6] = "a";
    let e = err_text(with("tokenizer.ggml.tokens", strs(&texts)));
    assert!(e.contains("\"a\" is both token 5 and token 6"), "{e}");
    // A type-6 (byte) token must look like <0xXX>.
    types = TOKENS.iter().map(|t| t.1).collect();
    types[7] = 6;
    let e = err_text(with("tokenizer.ggml.token_type", ints(&types)));
    assert!(e.contains("token 7 \"c\" has type byte"), "{e}");
}

#[test]
fn merge_errors() {
    let e = err_text(with("tokenizer.ggml.merges", strs(&["a b", "ab"])));
    assert!(
        e.contains("merges[1] = \"ab\"") && e.contains("no space"),
        "{e}"
    );
    let e = err_text(with("tokenizer.ggml.merges", strs(&["a z"])));
    assert!(
        e.contains("merges[0] = \"a z\": right half is not a token"),
        "{e}"
    );
    let e = err_text(with("tokenizer.ggml.merges", strs(&["q a"])));
    assert!(e.contains("left half is not a token"), "{e}");
    let e = err_text(with("tokenizer.ggml.merges", strs(&["c a"])));
    assert!(e.contains("merged text is not a token"), "{e}");
    // A repeated pair keeps its first rank and is not an error.
    assert!(with("tokenizer.ggml.merges", strs(&["a b", "a b"])).is_ok());
}

#[test]
fn special_id_errors() {
    let n = TOKENS.len() as u32;
    let e = err_text(with("tokenizer.ggml.eos_token_id", Value::U32(n)));
    assert!(
        e.contains(&format!(
            "tokenizer.ggml.eos_token_id = {n} is out of range"
        )),
        "{e}"
    );
    let e = err_text(with("tokenizer.ggml.fim_rep_token_id", Value::U64(1 << 40)));
    assert!(e.contains("fim_rep_token_id"), "{e}");
    let e = err_text(with("tokenizer.ggml.bos_token_id", Value::I32(-1)));
    assert!(e.contains("tokenizer.ggml.bos_token_id"), "{e}");
    // Without a BOS key the BPE default (11) is used when in range...
    let t = without("tokenizer.ggml.bos_token_id").unwrap();
    assert_eq!(t.bos(), Some(11));
    // ...and adding BOS without any BOS id fails.
    let mut kv: Vec<_> = base()
        .into_iter()
        .filter(|(k, _)| *k != "tokenizer.ggml.bos_token_id")
        .collect();
    let texts: Vec<&str> = TOKENS.iter().take(10).map(|t| t.0).collect();
    let types: Vec<i32> = TOKENS.iter().take(10).map(|t| t.1).collect();
    for (k, v) in &mut kv {
        match *k {
            "tokenizer.ggml.tokens" => *v = strs(&texts),
            "tokenizer.ggml.token_type" => *v = ints(&types),
            "tokenizer.ggml.merges" => *v = strs(&[]),
            _ => {}
        }
    }
    assert_eq!(build(&kv).unwrap().bos(), None);
    kv.push(("tokenizer.ggml.add_bos_token", Value::Bool(true)));
    let e = err_text(build(&kv));
    assert!(
        e.contains(
            "tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set"
        ),
        "{e}"
    );
}

#[test]
fn segments_make_control_tokens_only_from_markup() {
    use super::Segment::{Markup, Text};
    let t = tok();
    let text = |s: &str| t.encode(s, false, false);
    // Control texts in content are text; user-defined tokens match anywhere.
    let ids = t.encode_segments(
        &[
            Markup("<|im_start|>a"),
            Text("b<|im_start|>c<u>"),
            Markup("<|im_end|>"),
        ],
        false,
    );
    let want: Vec<u32> = [vec![1], text("ab<|im_start|>c<u>"), vec![2]].concat();
    assert_eq!(ids, want);
    assert!(text("<u>").contains(&3));
    // Without control texts in content: what `encode` with parse_special gives,
    // BOS/EOS included.
    let t = with("tokenizer.ggml.add_bos_token", Value::Bool(true)).unwrap();
    assert_eq!(
        t.encode_segments(
            &[Markup("<|im_start|>"), Text("a b"), Markup("<|im_end|>")],
            true
        ),
        t.encode("<|im_start|>a b<|im_end|>", true, true)
    );
}
