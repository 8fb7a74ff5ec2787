//! Pre-tokenizers of the byte-level BPE family: they cut a text fragment into words
//! before any merge runs, and merges never cross a word boundary.
//!
//! These are hand ports of llama.cpp's `unicode_regex_split` (src/unicode.cpp), not a
//! regex engine. For `tokenizer.ggml.pre = smollm` llama.cpp applies two expressions in
//! sequence, each one only inside the pieces left by the one before:
//!
//! 1. `\p{N}`: every number code point becomes a piece of its own (llama.cpp runs this
//!    one through `std::regex` on a category-collapsed copy of the text; the result is
//!    the same as "split around every N* code point");
//! 2. the GPT-2 expression `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`,
//!    which llama.cpp implements by hand (`unicode_regex_split_custom_gpt2`). The
//!    lookahead `(?!\S)` looks at the code point after the whitespace run, and a piece
//!    boundary from step 1 counts as "end of text" there, exactly as in llama.cpp.
//!
//! For `joyai-llm` (DeepSeek V4, llama.cpp's `LLAMA_VOCAB_PRE_TYPE_JOYAI_LLM`, the
//! HF `tokenizer.json` pre-tokenizer) three expressions run in sequence as
//! "isolated" splits, each inside every piece the one before left (a piece boundary
//! is the end of the text for the next), unmatched gaps kept as pieces:
//!
//! 1. `\p{N}{1,3}`: digit groups of up to three, from the left;
//! 2. `[一-龥぀-ゟ゠-ヿ]+` (U+4E00-9FA5, U+3040-309F, U+30A0-30FF): CJK and kana runs;
//! 3. ``[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+``,
//!    ported by hand ([`split_joyai`]), leftmost-first alternation as a
//!    backtracking engine runs it.
//!
//! Character classes: `\p{L}` is general category L* (Lu Ll Lt Lm Lo), `\p{N}` is N*
//! (Nd Nl No), `\p{M}` M*, `\p{P}` P*, `\p{S}` S*, `\s` is the Unicode White_Space property (the same 25 code points as
//! llama.cpp's `unicode_set_whitespace`). Categories come from the
//! `unicode-general-category` crate (Unicode 16.0); llama.cpp's table is Unicode 15.1,
//! so the two disagree only on letters and digits first assigned in Unicode 16.0.

use std::ops::Range;

use unicode_general_category::{get_general_category, GeneralCategory};

/// The pre-tokenizer a vocabulary asks for (`tokenizer.ggml.pre`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PreType {
    /// `smollm`: split off every digit, then the GPT-2 expression.
    Smollm,
    /// `joyai-llm` (DeepSeek V4): digit groups, CJK runs, then its letter /
    /// punctuation / whitespace expression.
    JoyAi,
}

impl PreType {
    /// Maps a `tokenizer.ggml.pre` value to a supported pre-tokenizer.
    pub(crate) fn from_gguf_name(name: &str) -> Option<Self> {
        match name {
            "smollm" => Some(PreType::Smollm),
            "joyai-llm" => Some(PreType::JoyAi),
            _ => None,
        }
    }

    /// The `tokenizer.ggml.pre` values this module implements.
    pub(crate) const SUPPORTED: &'static str = "smollm, joyai-llm";
}

/// What the GPT-2 expression needs to know about a code point. White_Space code
/// points are never letters or numbers, so one class per code point suffices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Letter,
    Number,
    Whitespace,
    /// Everything else, unassigned code points included (llama.cpp gives those the
    /// `UNDEFINED` flag, which still counts as "a code point" for `[^\s\p{L}\p{N}]`).
    Other,
}

fn class_of(c: char) -> Class {
    if c.is_ascii() {
        return match c {
            'a'..='z' | 'A'..='Z' => Class::Letter,
            '0'..='9' => Class::Number,
            // White_Space in ASCII: \t \n \v \f \r and space (not the 0x1C..0x1F separators).
            '\t' | '\n' | '\u{0B}' | '\u{0C}' | '\r' | ' ' => Class::Whitespace,
            _ => Class::Other,
        };
    }
    // `char::is_whitespace` is exactly the White_Space property.
    if c.is_whitespace() {
        return Class::Whitespace;
    }
    use GeneralCategory::*;
    match get_general_category(c) {
        UppercaseLetter | LowercaseLetter | TitlecaseLetter | ModifierLetter | OtherLetter => {
            Class::Letter
        }
        DecimalNumber | LetterNumber | OtherNumber => Class::Number,
        _ => Class::Other,
    }
}

/// One code point of the text being split.
#[derive(Clone, Copy)]
struct Cp {
    /// Byte offset in the text.
    off: usize,
    ch: char,
    class: Class,
}

/// Splits `text` into words; returns byte ranges of `text` that tile it exactly.
pub(crate) fn split(pre: PreType, text: &str) -> Vec<Range<usize>> {
    let cps: Vec<Cp> = text
        .char_indices()
        .map(|(off, ch)| Cp {
            off,
            ch,
            class: class_of(ch),
        })
        .collect();
    // Word ends, as code point indices.
    let mut ends: Vec<usize> = Vec::with_capacity(cps.len() / 3 + 1);
    match pre {
        PreType::Smollm => {
            // Pass 1, `\p{N}`: pieces are the single number code points and the runs
            // between them. Pass 2 runs GPT-2 inside each piece.
            let mut ini = 0;
            for i in 0..cps.len() {
                if cps[i].class == Class::Number {
                    split_gpt2(&cps, ini, i, &mut ends);
                    split_gpt2(&cps, i, i + 1, &mut ends);
                    ini = i + 1;
                }
            }
            split_gpt2(&cps, ini, cps.len(), &mut ends);
        }
        PreType::JoyAi => {
            let jc: Vec<Joy> = cps.iter().map(|c| Joy::of(c.ch)).collect();
            // Pass 1: digit groups of up to three; pass 2 (CJK runs) and 3 in the gaps.
            let mut ini = 0;
            let mut i = 0;
            while i < jc.len() {
                if jc[i].number {
                    split_cjk(&jc, ini, i, &mut ends);
                    let mut j = i;
                    while j < jc.len() && j - i < 3 && jc[j].number {
                        j += 1;
                    }
                    ends.push(j);
                    i = j;
                    ini = j;
                } else {
                    i += 1;
                }
            }
            split_cjk(&jc, ini, jc.len(), &mut ends);
        }
    }
    let byte_at = |i: usize| {
        if i < cps.len() {
            cps[i].off
        } else {
            text.len()
        }
    };
    let mut words = Vec::with_capacity(ends.len());
    let mut start = 0;
    for end in ends {
        words.push(byte_at(start)..byte_at(end));
        start = end;
    }
    words
}

/// What the `joyai-llm` expressions ask of a code point.
#[derive(Clone, Copy, Debug, Default)]
struct Joy {
    /// `\p{N}`.
    number: bool,
    /// U+4E00-9FA5, U+3040-309F, U+30A0-30FF.
    cjk: bool,
    /// `\p{L}`.
    letter: bool,
    /// `\p{M}`.
    mark: bool,
    /// `\p{P}` or `\p{S}`.
    punct: bool,
    /// `\s` (White_Space).
    space: bool,
    /// `\r` or `\n`.
    newline: bool,
    /// U+0020, the optional prefix of the punctuation alternative.
    blank: bool,
    /// ASCII letter.
    ascii_alpha: bool,
    /// One of the ASCII punctuation characters of the first alternative.
    ascii_punct: bool,
}

impl Joy {
    fn of(c: char) -> Self {
        use GeneralCategory::*;
        let cat = get_general_category(c);
        Joy {
            number: matches!(cat, DecimalNumber | LetterNumber | OtherNumber),
            cjk: matches!(c, '\u{4E00}'..='\u{9FA5}' | '\u{3040}'..='\u{309F}' | '\u{30A0}'..='\u{30FF}'),
            letter: matches!(
                cat,
                UppercaseLetter | LowercaseLetter | TitlecaseLetter | ModifierLetter | OtherLetter
            ),
            mark: matches!(cat, NonspacingMark | SpacingMark | EnclosingMark),
            punct: matches!(
                cat,
                ConnectorPunctuation
                    | DashPunctuation
                    | OpenPunctuation
                    | ClosePunctuation
                    | InitialPunctuation
                    | FinalPunctuation
                    | OtherPunctuation
                    | MathSymbol
                    | CurrencySymbol
                    | ModifierSymbol
                    | OtherSymbol
            ),
            space: c.is_whitespace(),
            newline: c == '\r' || c == '\n',
            blank: c == ' ',
            ascii_alpha: c.is_ascii_alphabetic(),
            ascii_punct: c.is_ascii_punctuation(),
        }
    }
}

/// Pass 2 of `joyai-llm` over `jc[ini..end]`: CJK runs are pieces, the
/// expression of pass 3 runs in the gaps.
fn split_cjk(jc: &[Joy], ini: usize, end: usize, ends: &mut Vec<usize>) {
    let mut gap = ini;
    let mut i = ini;
    while i < end {
        if jc[i].cjk {
            split_joyai(jc, gap, i, ends);
            while i < end && jc[i].cjk {
                i += 1;
            }
            ends.push(i);
            gap = i;
        } else {
            i += 1;
        }
    }
    split_joyai(jc, gap, end, ends);
}

/// Pass 3 of `joyai-llm` over `jc[ini..end]`, pushing piece ends: at each
/// position the first alternative that matches (as a backtracking engine
/// matches it) makes a piece; positions where none does gather into gap pieces.
fn split_joyai(jc: &[Joy], ini: usize, end: usize, ends: &mut Vec<usize>) {
    let at = |pos: usize| (pos < end).then(|| jc[pos]);
    let run = |mut pos: usize, f: &dyn Fn(Joy) -> bool| {
        while pos < end && f(jc[pos]) {
            pos += 1;
        }
        pos
    };
    let mut in_gap = false;
    let mut pos = ini;
    while pos < end {
        let c = jc[pos];
        let next = at(pos + 1);
        let m = if c.ascii_punct && next.is_some_and(|n| n.ascii_alpha) {
            // [!"#...~][A-Za-z]+
            Some(run(pos + 1, &|j| j.ascii_alpha))
        } else if !(c.newline || c.letter || c.punct) && next.is_some_and(|n| n.letter || n.mark) {
            // [^\r\n\p{L}\p{P}\p{S}][\p{L}\p{M}]+
            Some(run(pos + 1, &|j| j.letter || j.mark))
        } else if c.letter || c.mark {
            // [\p{L}\p{M}]+
            Some(run(pos, &|j| j.letter || j.mark))
        } else if c.punct || (c.blank && next.is_some_and(|n| n.punct)) {
            // ` ?[\p{P}\p{S}]+[\r\n]*`
            let p = run(if c.punct { pos } else { pos + 1 }, &|j| j.punct);
            Some(run(p, &|j| j.newline))
        } else if c.space {
            let ws_end = run(pos, &|j| j.space);
            let last_newline = (pos..ws_end).rev().find(|&i| jc[i].newline);
            Some(match last_newline {
                // \s*[\r\n]+
                Some(i) => i + 1,
                // \s+(?!\S), else \s+
                None if ws_end < end && ws_end - pos > 1 => ws_end - 1,
                None => ws_end,
            })
        } else {
            None
        };
        match m {
            Some(m) => {
                if in_gap {
                    ends.push(pos);
                    in_gap = false;
                }
                ends.push(m);
                pos = m;
            }
            None => {
                in_gap = true;
                pos += 1;
            }
        }
    }
    if in_gap {
        ends.push(end);
    }
}

/// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+` over the
/// code points `cps[ini..end]`, pushing the end index of each word. A line-by-line port
/// of `unicode_regex_split_custom_gpt2`: positions outside `ini..end` read as "no code
/// point", which is what makes a piece boundary behave like the end of the text.
fn split_gpt2(cps: &[Cp], ini: usize, end: usize, ends: &mut Vec<usize>) {
    let cpt = |pos: usize| (ini <= pos && pos < end).then(|| cps[pos].ch);
    let class = |pos: usize| (ini <= pos && pos < end).then(|| cps[pos].class);
    let is = |pos: usize, c: Class| class(pos) == Some(c);

    let mut pos = ini;
    while pos < end {
        let c = cps[pos].ch;

        // 's|'t|'re|'ve|'m|'ll|'d (case-sensitive, only at the start of a word)
        if c == '\'' && pos + 1 < end {
            let next = cps[pos + 1].ch;
            if matches!(next, 's' | 't' | 'm' | 'd') {
                pos += 2;
                ends.push(pos);
                continue;
            }
            if pos + 2 < end {
                let next2 = cps[pos + 2].ch;
                if matches!((next, next2), ('r', 'e') | ('v', 'e') | ('l', 'l')) {
                    pos += 3;
                    ends.push(pos);
                    continue;
                }
            }
        }

        // The class that decides the word kind: for a space, the code point after it.
        let lead = if c == ' ' { class(pos + 1) } else { class(pos) };
        let skip_space = usize::from(c == ' ');
        match lead {
            // ` ?\p{L}+`, ` ?\p{N}+`
            Some(k @ (Class::Letter | Class::Number)) => {
                pos += skip_space;
                while is(pos, k) {
                    pos += 1;
                }
                ends.push(pos);
                continue;
            }
            // ` ?[^\s\p{L}\p{N}]+`
            Some(Class::Other) => {
                pos += skip_space;
                while is(pos, Class::Other) {
                    pos += 1;
                }
                ends.push(pos);
                continue;
            }
            Some(Class::Whitespace) | None => {}
        }

        let mut n_ws = 0;
        while is(pos + n_ws, Class::Whitespace) {
            n_ws += 1;
        }
        if n_ws > 1 && cpt(pos + n_ws).is_some() {
            // \s+(?!\S): leave the last whitespace to start the next word.
            pos += n_ws - 1;
        } else if n_ws > 0 {
            // \s+ (the run reaches the end of the piece, or is a single code point)
            pos += n_ws;
        } else {
            // No alternative matched (unreachable for valid input, kept as in llama.cpp).
            pos += 1;
        }
        ends.push(pos);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(text: &str) -> Vec<&str> {
        split(PreType::Smollm, text)
            .into_iter()
            .map(|r| &text[r])
            .collect()
    }

    #[test]
    fn words_and_leading_spaces() {
        assert_eq!(words("Hello world"), ["Hello", " world"]);
        assert_eq!(words(" Hello"), [" Hello"]);
        assert_eq!(words("   Hello"), ["  ", " Hello"]);
        assert_eq!(words("Hello "), ["Hello", " "]);
        assert_eq!(words("a  b"), ["a", " ", " b"]);
        assert_eq!(words(""), Vec::<&str>::new());
    }

    #[test]
    fn whitespace_lookahead() {
        // \s+(?!\S): the last whitespace before a word starts the next word.
        assert_eq!(words("a \n b"), ["a", " \n", " b"]);
        assert_eq!(words("x\n\ny"), ["x", "\n", "\n", "y"]);
        // At the end of the text the whole run is one word.
        assert_eq!(words("end   "), ["end", "   "]);
        assert_eq!(words("\t\tend"), ["\t", "\t", "end"]);
        // A single non-space whitespace before a word is a word of its own.
        assert_eq!(words("a\tb"), ["a", "\t", "b"]);
    }

    #[test]
    fn contractions_and_punctuation() {
        assert_eq!(words("don't"), ["don", "'t"]);
        assert_eq!(words("we'll they've"), ["we", "'ll", " they", "'ve"]);
        // Upper case is not a contraction in the GPT-2 expression.
        assert_eq!(words("DON'T"), ["DON", "'", "T"]);
        assert_eq!(
            words("'quoted' \"x\""),
            ["'", "quoted", "'", " \"", "x", "\""]
        );
        // Inside a punctuation run an apostrophe is just punctuation.
        assert_eq!(words("!!'s"), ["!!'", "s"]);
        assert_eq!(words("a...b"), ["a", "...", "b"]);
        assert_eq!(words("(x)"), ["(", "x", ")"]);
    }

    #[test]
    fn digits_are_single_and_isolate_their_space() {
        assert_eq!(words("1234"), ["1", "2", "3", "4"]);
        // The digit pass runs first, so " 7" is never one word.
        assert_eq!(words("a 7"), ["a", " ", "7"]);
        // ...and the space run before a digit ends at the piece boundary.
        assert_eq!(words("x   42"), ["x", "   ", "4", "2"]);
        assert_eq!(words("+7 -4"), ["+", "7", " -", "4"]);
        // Non-ASCII numbers too: superscript two (No), Arabic-Indic digit (Nd).
        assert_eq!(words("i²=1"), ["i", "²", "=", "1"]);
        assert_eq!(words("\u{663}\u{664}"), ["\u{663}", "\u{664}"]);
        // Fullwidth digits are Nd.
        assert_eq!(words("ＡＢＣ１２"), ["ＡＢＣ", "１", "２"]);
    }

    #[test]
    fn unicode_letters_and_others() {
        assert_eq!(words("café naïve"), ["café", " naïve"]);
        // Combining marks (Mn) are not letters: NFD "é" splits.
        assert_eq!(words("e\u{301}x"), ["e", "\u{301}", "x"]);
        // U+200B ZERO WIDTH SPACE is Cf (not White_Space); U+00A0 is White_Space.
        assert_eq!(words("a\u{200b}b"), ["a", "\u{200b}", "b"]);
        assert_eq!(words("a\u{a0}b"), ["a", "\u{a0}", "b"]);
        // CJK ideographs are Lo; fullwidth punctuation is Other.
        assert_eq!(words("你好，世界"), ["你好", "，", "世界"]);
        // Emoji are symbols: a run of them with a leading space is one word.
        assert_eq!(words("x 🍕🍕!"), ["x", " 🍕🍕!"]);
    }

    #[test]
    fn classes_follow_general_category_not_is_alphabetic() {
        // U+2160 ROMAN NUMERAL ONE is Nl: numeric, while char::is_alphabetic says true.
        assert!('\u{2160}'.is_alphabetic());
        assert_eq!(class_of('\u{2160}'), Class::Number);
        // U+0345 COMBINING GREEK YPOGEGRAMMENI is Mn but Alphabetic.
        assert!('\u{345}'.is_alphabetic());
        assert_eq!(class_of('\u{345}'), Class::Other);
        assert_eq!(class_of('\u{0B}'), Class::Whitespace);
        assert_eq!(class_of('\u{1C}'), Class::Other);
        assert_eq!(class_of('\u{3000}'), Class::Whitespace);
    }

    #[test]
    fn words_tile_the_text() {
        let text = "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x);\n}\n\t \n";
        let ranges = split(PreType::Smollm, text);
        let mut at = 0;
        for r in &ranges {
            assert_eq!(r.start, at);
            assert!(r.end > r.start);
            at = r.end;
        }
        assert_eq!(at, text.len());
    }

    fn joy(text: &str) -> Vec<&str> {
        split(PreType::JoyAi, text)
            .into_iter()
            .map(|r| &text[r])
            .collect()
    }

    #[test]
    fn joyai_digit_groups_cjk_runs_and_whitespace() {
        assert_eq!(joy("1234567"), ["123", "456", "7"]);
        assert_eq!(joy("ab 12c"), ["ab", " ", "12", "c"]);
        // A whitespace run before CJK ends its piece, so it stays whole.
        assert_eq!(joy("b  中文x"), ["b", "  ", "中文", "x"]);
        assert_eq!(joy("Hello world"), ["Hello", " world"]);
        assert_eq!(joy("a   b"), ["a", "  ", " b"]);
        assert_eq!(joy("x \n\n y"), ["x", " \n\n", " y"]);
        assert_eq!(joy("end  "), ["end", "  "]);
    }

    #[test]
    fn joyai_punctuation_and_gaps() {
        // ASCII punctuation glued to the letters after it.
        assert_eq!(joy("don't"), ["don", "'t"]);
        assert_eq!(joy("a.b"), ["a", ".b"]);
        assert_eq!(joy("x = (y);\n"), ["x", " =", " (", "y", ");\n"]);
        // Typographic punctuation is \p{P}: its own piece.
        assert_eq!(joy("«ciao»"), ["«", "ciao", "»"]);
        // Control characters before a letter prefix it; a run of them is a gap.
        assert_eq!(joy("\u{1}\u{7}\u{1b}"), ["\u{1}\u{7}\u{1b}"]);
        assert_eq!(joy("\u{1}ab"), ["\u{1}ab"]);
    }
}
