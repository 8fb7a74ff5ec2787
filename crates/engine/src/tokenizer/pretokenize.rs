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
//! Character classes: `\p{L}` is general category L* (Lu Ll Lt Lm Lo), `\p{N}` is N*
//! (Nd Nl No), `\s` is the Unicode White_Space property (the same 25 code points as
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
}

impl PreType {
    /// Maps a `tokenizer.ggml.pre` value to a supported pre-tokenizer.
    pub(crate) fn from_gguf_name(name: &str) -> Option<Self> {
        match name {
            "smollm" => Some(PreType::Smollm),
            _ => None,
        }
    }

    /// The `tokenizer.ggml.pre` values this module implements.
    pub(crate) const SUPPORTED: &'static str = "smollm";
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
}
