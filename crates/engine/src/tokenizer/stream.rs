//! Streaming UTF-8 assembly of generated pieces. A byte-level token can end in the
//! middle of a character (emoji and CJK are often split over 2-4 tokens), so text is
//! released only up to the last complete character; an incomplete tail waits for the
//! next piece. Bytes that can never become valid UTF-8 are released as U+FFFD, one per
//! maximal invalid sequence (the rule of `String::from_utf8_lossy`), so the decoder
//! never stalls on a bad byte.

/// Turns a stream of piece bytes into printable text.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    /// Bytes not yet released: at most an incomplete UTF-8 sequence (< 4 bytes)
    /// between calls.
    pending: Vec<u8>,
    /// Text released by the last call.
    out: String,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `piece` and returns the text that became complete (possibly empty).
    pub fn push(&mut self, piece: &[u8]) -> &str {
        self.out.clear();
        self.pending.extend_from_slice(piece);
        let kept = drain_valid(&self.pending, &mut self.out, false);
        let n = self.pending.len();
        self.pending.drain(..n - kept);
        &self.out
    }

    /// Releases whatever is left at the end of the stream, an incomplete tail as U+FFFD.
    pub fn finish(&mut self) -> &str {
        self.out.clear();
        drain_valid(&self.pending, &mut self.out, true);
        self.pending.clear();
        &self.out
    }

    /// Bytes held back, waiting for the rest of their character.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }
}

/// Appends the decodable part of `bytes` to `out`; returns how many trailing bytes
/// were held back (an incomplete sequence, unless `flush`).
fn drain_valid(mut bytes: &[u8], out: &mut String, flush: bool) -> usize {
    loop {
        match std::str::from_utf8(bytes) {
            Ok(s) => {
                out.push_str(s);
                return 0;
            }
            Err(e) => {
                let (valid, rest) = bytes.split_at(e.valid_up_to());
                // `valid` is valid UTF-8 by construction: the lossy call never copies.
                out.push_str(&String::from_utf8_lossy(valid));
                match e.error_len() {
                    None if !flush => return rest.len(),
                    None => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        return 0;
                    }
                    Some(n) => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        bytes = &rest[n..];
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_split_characters() {
        let pizza = "🍕".as_bytes(); // f0 9f 8d 95
        let mut d = StreamDecoder::new();
        assert_eq!(d.push(b"I love "), "I love ");
        assert_eq!(d.push(&pizza[..1]), "");
        assert_eq!(d.push(&pizza[1..3]), "");
        assert_eq!(d.pending(), &pizza[..3]);
        assert_eq!(d.push(&pizza[3..]), "🍕");
        assert_eq!(d.pending(), b"");
        // A piece that completes one character and starts the next.
        let cafe = "é中".as_bytes(); // c3 a9 e4 b8 ad
        assert_eq!(d.push(&cafe[..1]), "");
        assert_eq!(d.push(&cafe[1..3]), "é");
        assert_eq!(d.push(&cafe[3..]), "中");
        assert_eq!(d.finish(), "");
    }

    #[test]
    fn invalid_bytes_do_not_stall() {
        let mut d = StreamDecoder::new();
        // A lone continuation byte is invalid at once.
        assert_eq!(d.push(b"a\x80b"), "a\u{FFFD}b");
        // An incomplete sequence followed by a non-continuation byte.
        assert_eq!(d.push(b"\xe4\xb8"), "");
        assert_eq!(d.push(b"x"), "\u{FFFD}x");
        // An incomplete tail at the end of the stream.
        assert_eq!(d.push(b"\xf0\x9f"), "");
        assert_eq!(d.finish(), "\u{FFFD}");
        assert_eq!(d.pending(), b"");
    }

    #[test]
    fn empty_pieces() {
        let mut d = StreamDecoder::new();
        assert_eq!(d.push(b""), "");
        assert_eq!(d.finish(), "");
    }
}
