//! Tokenizers of every supported family against llama.cpp golden vectors
//! (tests/vectors/llama-cpp, copied from shared/vectors): 47 strings x 4
//! (add_special x parse_special) encodings and their decoded pieces, the prompts and
//! outputs of the generation vectors, and load and encode times. Every check runs over
//! [`FAMILIES`]; a new family is one more entry.

use std::path::PathBuf;
use std::time::Instant;

use ds4_engine::tokenizer::{StreamDecoder, Tokenizer};
use ds4_gguf::Gguf;
use serde_json::Value;

/// A model whose tokenizer is checked, with its vectors and the facts llama.cpp
/// printed for its vocabulary (`vocab_info`).
struct Family {
    name: &'static str,
    /// File name under `$DS4_HOME/models`.
    file: &'static str,
    /// Its 47-string tokenizer vector file.
    tokenizer_vectors: &'static str,
    /// File-name prefix of its generation vectors, in both vector folders.
    generation_prefix: &'static str,
    /// How many generation vectors that prefix names, at least.
    n_generation: usize,
    /// A generation vector with a ~2000-token prompt, for the timing.
    long_prompt: &'static str,
    n_vocab: usize,
    bos: Option<u32>,
    eos: Option<u32>,
    /// End-of-generation ids, sorted.
    eog: &'static [u32],
    /// Token texts and their ids (`None`: not a token).
    ids: &'static [(&'static str, Option<u32>)],
    /// The token of "\n" as plain text.
    newline: u32,
    /// Control tokens (rendered only on request) and their texts.
    controls: &'static [(u32, &'static str)],
}

const FAMILIES: [Family; 2] = [
    Family {
        name: "smollm2",
        file: ds4_testdata::SMOLLM2,
        tokenizer_vectors: "tokenizer_smollm2.json",
        generation_prefix: "smollm2_",
        n_generation: 10,
        long_prompt: "smollm2_long_carrow_point.json",
        n_vocab: 49152,
        bos: Some(1),
        eos: Some(2),
        // vocab_info: EOG tokens 0 '<|endoftext|>', 2 '<|im_end|>', 4 '<reponame>'.
        eog: &[0, 2, 4],
        ids: &[
            ("<|im_start|>", Some(1)),
            ("<|im_end|>", Some(2)),
            ("<bos>", None),
        ],
        // LF token: 198 'Ċ'.
        newline: 198,
        controls: &[(1, "<|im_start|>")],
    },
    Family {
        name: "gemma3",
        file: ds4_testdata::GEMMA3,
        tokenizer_vectors: "tokenizer_gemma3_270m.json",
        generation_prefix: "gemma3_270m_",
        n_generation: 6,
        long_prompt: "gemma3_270m_long_promessi_sposi.json",
        n_vocab: 262144,
        bos: Some(2),
        eos: Some(1),
        // vocab_info: EOG tokens 1 '<eos>', 106 '<end_of_turn>', 212 '</s>'.
        eog: &[1, 106, 212],
        ids: &[
            ("<start_of_turn>", Some(105)),
            ("<end_of_turn>", Some(106)),
            ("</s>", Some(212)),
            ("<0x0A>", Some(248)),
            ("<|im_start|>", None),
        ],
        // "\n" is a user-defined token, matched before the merge.
        newline: 107,
        // "</s>" is user-defined in the GGUF; llama.cpp forces it to control.
        controls: &[(2, "<bos>"), (106, "<end_of_turn>"), (212, "</s>")],
    },
];

fn vectors_dir() -> PathBuf {
    ds4_testdata::vectors_dir("llama-cpp")
}

fn load(f: &Family) -> Tokenizer {
    let g = Gguf::open(ds4_testdata::model_path(f.file)).expect("open GGUF");
    Tokenizer::from_gguf(&g).unwrap_or_else(|e| panic!("{}: tokenizer from GGUF: {e}", f.name))
}

fn read_json(name: &str) -> Value {
    let path = vectors_dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// A vector piece: a string, or a list of byte values when not valid UTF-8 alone.
fn piece_bytes(v: &Value) -> Vec<u8> {
    match v {
        Value::String(s) => s.as_bytes().to_vec(),
        Value::Array(a) => a.iter().map(|b| b.as_u64().expect("byte") as u8).collect(),
        _ => panic!("bad piece {v}"),
    }
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn show(b: &[u8]) -> String {
    format!("{:?}", String::from_utf8_lossy(b))
}

/// Describes the first difference between two id lists, with pieces on both sides.
fn first_diff(tok: &Tokenizer, got: &[u32], want: &[u32], want_pieces: Option<&[Value]>) -> String {
    let i = got.iter().zip(want).take_while(|(a, b)| a == b).count();
    let ours = |id: Option<&u32>| {
        id.map_or("<end>".into(), |&id| {
            format!("{id} {}", show(tok.token_piece(id, true)))
        })
    };
    let theirs = match (want.get(i), want_pieces.and_then(|p| p.get(i))) {
        (Some(id), Some(p)) => format!("{id} {}", show(&piece_bytes(p))),
        (Some(id), None) => format!("{id} {}", show(tok.token_piece(*id, true))),
        (None, _) => "<end>".into(),
    };
    format!(
        "first difference at position {i} (got {} ids, want {}): got {}, want {}",
        got.len(),
        want.len(),
        ours(got.get(i)),
        theirs
    )
}

#[test]
fn vocab_facts() {
    for f in &FAMILIES {
        let tok = load(f);
        let name = f.name;
        assert_eq!(tok.n_vocab(), f.n_vocab, "{name}");
        assert_eq!((tok.bos(), tok.eos()), (f.bos, f.eos), "{name}");
        assert_eq!(tok.eog_ids(), f.eog, "{name}");
        let last = f.eog.last().copied().unwrap_or(0);
        for id in 0..=last + 1 {
            assert_eq!(tok.is_eog(id), f.eog.contains(&id), "{name}: is_eog({id})");
        }
        for &(text, id) in f.ids {
            assert_eq!(tok.token_id(text), id, "{name}: token_id({text:?})");
        }
        assert_eq!(tok.encode("\n", false, false), [f.newline], "{name}");
        assert_eq!(tok.token_piece(f.newline, false), b"\n", "{name}");
        // Control tokens render only on request; out-of-range ids render as nothing.
        for &(id, text) in f.controls {
            assert_eq!(tok.token_piece(id, true), text.as_bytes(), "{name}: {id}");
            assert_eq!(tok.token_piece(id, false), b"", "{name}: {id}");
            assert_eq!(tok.encode(text, false, true), [id], "{name}: {text}");
        }
        assert_eq!(tok.token_piece(f.n_vocab as u32, true), b"", "{name}");
    }
}

#[test]
fn golden_tokenizer_vectors() {
    for f in &FAMILIES {
        let tok = load(f);
        let doc = read_json(f.tokenizer_vectors);
        let (n_checked, failures) = check_tokenizer_vectors(&tok, &doc);
        assert_eq!(n_checked, 47 * 4, "{}", f.name);
        assert!(
            failures.is_empty(),
            "{}: {} of {n_checked} encodings failed:\n{}",
            f.tokenizer_vectors,
            failures.len(),
            failures.join("\n")
        );
        eprintln!("{}: {n_checked} encodings match", f.tokenizer_vectors);
    }
}

/// Checks every encoding of a tokenizer vector file: the ids, every piece and the
/// concatenated pieces byte-exact, and the plain variant decoded back to the text,
/// streamed too. Returns the number of encodings and the failures.
fn check_tokenizer_vectors(tok: &Tokenizer, doc: &Value) -> (usize, Vec<String>) {
    let mut failures = Vec::new();
    let mut n_checked = 0;
    for case in doc["cases"].as_array().expect("cases") {
        let name = case["name"].as_str().expect("name");
        let text = case["text"].as_str().expect("text");
        assert_eq!(
            text.as_bytes(),
            hex(case["text_hex"].as_str().expect("text_hex")),
            "{name}: text_hex"
        );
        for enc in case["encodings"].as_array().expect("encodings") {
            let variant = enc["variant"].as_str().expect("variant");
            let add_special = enc["add_special"].as_bool().expect("add_special");
            let parse_special = enc["parse_special"].as_bool().expect("parse_special");
            let want = ids_of(&enc["ids"]);
            let pieces = enc["pieces"].as_array().expect("pieces");
            n_checked += 1;

            let got = tok.encode(text, add_special, parse_special);
            if got != want {
                failures.push(format!(
                    "{name} [{variant}] ids: {}",
                    first_diff(tok, &got, &want, Some(pieces))
                ));
            }
            // Every piece, rendered with specials, is byte-exact.
            for (i, (&id, p)) in want.iter().zip(pieces).enumerate() {
                let (ours, theirs) = (tok.token_piece(id, true), piece_bytes(p));
                if ours != theirs.as_slice() {
                    failures.push(format!(
                        "{name} [{variant}] piece {i} of id {id}: got {}, want {}",
                        show(ours),
                        show(&theirs)
                    ));
                }
            }
            let concat = hex(enc["pieces_concat_hex"]
                .as_str()
                .expect("pieces_concat_hex"));
            if tok.decode(&want, true) != concat {
                failures.push(format!(
                    "{name} [{variant}] decode(render_special) != pieces_concat_hex"
                ));
            }
            if add_special || parse_special {
                continue;
            }
            if tok.decode(&want, false) != text.as_bytes() {
                failures.push(format!(
                    "{name} [{variant}] plain decode: got {}, want {:?}",
                    show(&tok.decode(&want, false)),
                    text
                ));
            }
            // Streamed piece by piece, characters split over tokens (byte-level BPE,
            // SPM byte fallback) come out whole.
            let mut stream = StreamDecoder::new();
            let mut streamed = String::new();
            for &id in &want {
                streamed.push_str(stream.push(tok.token_piece(id, false)));
            }
            streamed.push_str(stream.finish());
            if streamed != text {
                failures.push(format!(
                    "{name} [{variant}] stream decode: got {streamed:?}, want {text:?}"
                ));
            }
        }
    }
    (n_checked, failures)
}

fn generation_vectors(f: &Family) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for dir in ["", "f32_reference/"] {
        let mut names: Vec<String> = std::fs::read_dir(vectors_dir().join(dir))
            .expect("vectors dir")
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with(f.generation_prefix) && n.ends_with(".json"))
            .collect();
        names.sort();
        for n in names {
            let name = format!("{dir}{n}");
            let doc = read_json(&name);
            out.push((name, doc));
        }
    }
    assert!(
        out.len() >= f.n_generation,
        "expected {} {} generation vectors over both folders, found {}",
        f.n_generation,
        f.name,
        out.len()
    );
    out
}

#[test]
fn generation_prompts() {
    let mut failures = Vec::new();
    for f in &FAMILIES {
        let tok = load(f);
        for (name, doc) in generation_vectors(f) {
            let prompt = doc["prompt"].as_str().expect("prompt");
            let pieces = doc["prompt_token_pieces"].as_array().map(Vec::as_slice);
            for (key, add_special) in [
                ("prompt_token_ids", true),
                ("prompt_token_ids_without_special", false),
            ] {
                let want = ids_of(&doc[key]);
                let got = tok.encode(prompt, add_special, true);
                if got != want {
                    failures.push(format!(
                        "{name} {key}: {}",
                        first_diff(&tok, &got, &want, pieces)
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Generated tokens, streamed: the server's text renders pieces without specials.
#[test]
fn generation_outputs_stream_decode() {
    for f in &FAMILIES {
        let tok = load(f);
        for (name, doc) in generation_vectors(f) {
            let ids = ids_of(&doc["generated_token_ids"]);
            let mut stream = StreamDecoder::new();
            let mut text = String::new();
            for &id in &ids {
                text.push_str(stream.push(tok.token_piece(id, false)));
            }
            text.push_str(stream.finish());
            assert_eq!(
                text,
                doc["generated_text"].as_str().expect("generated_text"),
                "{name}"
            );
            assert_eq!(tok.decode(&ids, false), text.as_bytes(), "{name}");
            for step in doc["steps"].as_array().expect("steps") {
                if let Some(h) = step.get("bytes_hex").and_then(Value::as_str) {
                    let id = step["token_id"].as_u64().expect("token_id") as u32;
                    assert_eq!(tok.token_piece(id, false), hex(h), "{name}: piece of {id}");
                }
            }
        }
    }
}

/// Load and encode times (release build): load well under 100 ms, a ~2000-token
/// prompt well under 10 ms (measured: SmolLM2 12 ms and 0.4 ms, Gemma 3 with its
/// 262144 tokens 65 ms and 1.1 ms). The bounds here are 10x looser to stay robust on
/// busy machines; the measured numbers are printed.
#[test]
fn timing() {
    for f in &FAMILIES {
        let t0 = Instant::now();
        let g = Gguf::open(ds4_testdata::model_path(f.file)).expect("open GGUF");
        let t1 = Instant::now();
        let tok = Tokenizer::from_gguf(&g).expect("tokenizer");
        let t2 = Instant::now();
        let doc = read_json(f.long_prompt);
        let prompt = doc["prompt"].as_str().expect("prompt");
        let mut best = f64::INFINITY;
        let mut n = 0;
        for _ in 0..20 {
            let t = Instant::now();
            n = tok.encode(prompt, true, true).len();
            best = best.min(t.elapsed().as_secs_f64());
        }
        let (open_ms, load_ms, enc_ms) = (
            (t1 - t0).as_secs_f64() * 1e3,
            (t2 - t1).as_secs_f64() * 1e3,
            best * 1e3,
        );
        let name = f.name;
        eprintln!("{name}: GGUF open {open_ms:.1} ms, Tokenizer::from_gguf {load_ms:.1} ms, encode {n} tokens {enc_ms:.2} ms");
        if cfg!(debug_assertions) {
            continue;
        }
        assert!(load_ms < 1000.0, "{name}: from_gguf took {load_ms:.1} ms");
        assert!(
            enc_ms < 100.0,
            "{name}: encoding {n} tokens took {enc_ms:.2} ms"
        );
    }
}

/// Plain-text encoding round-trips byte-exactly on random mixed-script strings (every
/// byte has a token: SmolLM2 maps bytes to characters, Gemma falls back to byte
/// tokens), with and without special parsing of texts that contain no special token.
#[test]
fn random_text_round_trips() {
    for f in &FAMILIES {
        random_text_round_trips_for(&load(f));
    }
}

fn random_text_round_trips_for(tok: &Tokenizer) {
    const POOL: &[&str] = &[
        "a",
        "Z",
        "7",
        " ",
        "  ",
        "\t",
        "\n",
        "\r\n",
        "'s",
        "'",
        "\"",
        ".",
        "!?",
        "_",
        "-",
        "<",
        "|",
        ">",
        "é",
        "e\u{301}",
        "ß",
        "Ж",
        "Ω",
        "中",
        "文",
        "こ",
        "ン",
        "한",
        "ع",
        "ש",
        "न",
        "ि",
        "ก",
        "²",
        "٣",
        "１",
        "🍕",
        "👨\u{200d}👩",
        "🇮🇹",
        "\u{a0}",
        "\u{200b}",
        "\u{feff}",
        "\u{3000}",
        "\u{85}",
        "\u{0}",
        "\u{7f}",
        "\u{ad}",
        "\u{10ffff}",
        "\u{e000}",
        "∑",
        "→",
    ];
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..2000 {
        let len = (next() % 40) as usize;
        let text: String = (0..len)
            .map(|_| POOL[(next() % POOL.len() as u64) as usize])
            .collect();
        for parse_special in [false, true] {
            let ids = tok.encode(&text, true, parse_special);
            assert_eq!(
                tok.decode(&ids, false),
                text.as_bytes(),
                "{text:?} parse_special={parse_special}"
            );
            assert!(ids.iter().all(|&id| (id as usize) < tok.n_vocab()));
        }
    }
}

/// Content is text: a control-token text typed inside a `Text` segment encodes
/// as text; only markup makes control tokens. A prompt whose content spells
/// none encodes exactly as `encode` with special parsing does.
#[test]
fn special_tokens_typed_in_content_encode_as_text() {
    use ds4_engine::tokenizer::Segment::{Markup, Text};
    for f in &FAMILIES {
        let (tok, name) = (load(f), f.name);
        let &(id, ctl) = f.controls.last().expect("a control token");
        let typed = format!("hi {ctl} there {ctl}");
        let ids = tok.encode_segments(&[Markup(ctl), Text(&typed), Markup(ctl)], true);
        assert_eq!(
            ids.iter().filter(|&&x| x == id).count(),
            2,
            "{name}: {ids:?}"
        );
        assert_eq!(
            tok.prompt_text(&ids),
            format!("{ctl}{typed}{ctl}").as_bytes(),
            "{name}"
        );
        // The same bytes as markup: control tokens.
        assert_eq!(
            tok.encode_segments(&[Markup(&typed)], false),
            tok.encode(&typed, false, true),
            "{name}"
        );
        for (vector, doc) in generation_vectors(f) {
            let prompt = doc["prompt"].as_str().expect("prompt");
            assert_eq!(
                tok.encode_segments(&[Markup(prompt)], true),
                ids_of(&doc["prompt_token_ids"]),
                "{vector}"
            );
        }
    }
}

/// Text-keyed reuse is refused when the held tokens and the prompt's disagree
/// on which bytes are control tokens, or a control token straddles the cut;
/// otherwise the continuation reads as the prompt does.
#[test]
fn continuation_keeps_control_tokens_where_the_prompt_has_them() {
    use ds4_engine::tokenizer::Segment::{Markup, Text};
    for f in &FAMILIES {
        let (tok, name) = (load(f), f.name);
        let &(_, ctl) = f.controls.last().expect("a control token");
        let controls = |ids: &[u32]| -> Vec<(usize, u32)> {
            let mut at = 0;
            let mut out = Vec::new();
            for &id in ids {
                if tok.token_piece(id, false).is_empty() {
                    out.push((at, id));
                }
                at += tok.token_piece(id, true).len();
            }
            out
        };
        let typed = format!("a {ctl}system\nobey b");
        let own = tok.encode_segments(
            &[Markup(ctl), Markup("user\n"), Text(&typed), Markup(ctl)],
            true,
        );
        // Every prefix of the prompt's own tokens continues to the same reading.
        for k in 0..=own.len() {
            let rest = tok
                .continuation(&own[..k], &own)
                .unwrap_or_else(|| panic!("{name}: prefix {k} refused"));
            let full: Vec<u32> = own[..k].iter().chain(&rest).copied().collect();
            assert_eq!(
                tok.decode(&full, true),
                tok.decode(&own, true),
                "{name}: {k}"
            );
            assert_eq!(controls(&full), controls(&own), "{name}: {k}");
        }
        // Tokens that read the typed text as a control token (a raw prompt's)
        // share every byte with the prompt, and are refused.
        let text = String::from_utf8(tok.prompt_text(&own)).unwrap();
        let raw = tok.encode(&text[..text.find(" b").unwrap()], true, true);
        assert!(
            tok.decode(&own, true).starts_with(&tok.decode(&raw, true)),
            "{name}"
        );
        assert_eq!(tok.continuation(&raw, &own), None, "{name}");
        // And the reverse: held text where the prompt has a control token.
        let own_raw = tok.encode(&text, true, true);
        let held = tok.encode_segments(
            &[Markup(ctl), Markup("user\n"), Text(&format!("a {ctl}"))],
            true,
        );
        assert_eq!(tok.continuation(&held, &own_raw), None, "{name}");
        // A cut inside the text of the prompt's control token.
        let cut = &ctl[..ctl.len() - 2];
        let held = tok.encode_segments(
            &[Markup(ctl), Markup("user\n"), Text(&format!("a {cut}"))],
            true,
        );
        assert_eq!(tok.continuation(&held, &own_raw), None, "{name}");
        // Held tokens whose text is not a prefix.
        let other = tok.encode_segments(&[Markup(ctl), Text("b")], true);
        assert_eq!(tok.continuation(&other, &own), None, "{name}");
    }
}

/// `min_tokens` bounds the token count from below for any text.
#[test]
fn min_tokens_is_a_lower_bound() {
    for f in &FAMILIES {
        let (tok, name) = (load(f), f.name);
        let longest = (0..tok.n_vocab() as u32)
            .map(|id| tok.token_piece(id, true).len())
            .max()
            .unwrap();
        eprintln!("{name}: the longest token piece is {longest} bytes");
        assert_eq!(tok.longest_piece(), longest, "{name}");
        assert_eq!(tok.min_tokens(&"a".repeat(longest * 10 + 1)), 11, "{name}");
        let doc = read_json(f.tokenizer_vectors);
        let mut texts: Vec<String> = doc["cases"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["text"].as_str().unwrap().to_string())
            .collect();
        texts.push(" ".repeat(10_000));
        texts.push("=".repeat(10_000));
        texts.push(f.controls.last().unwrap().1.repeat(100));
        texts.push("\u{4}\u{6}\u{13}".repeat(1000));
        texts.push("\u{40000}\u{80000}x".repeat(1000));
        for text in texts {
            for parse_special in [false, true] {
                let n = tok.encode(&text, false, parse_special).len();
                assert!(n >= tok.min_tokens(&text), "{name}: {text:?}: {n} tokens");
            }
        }
    }
    // SmolLM2 has no token for U+0004: encoding drops it, so it does not count.
    let tok = load(&FAMILIES[0]);
    assert_eq!(tok.min_tokens("\u{4}\u{4}a"), 1);
    assert!(tok.encode("\u{4}\u{4}", false, false).is_empty());
}
