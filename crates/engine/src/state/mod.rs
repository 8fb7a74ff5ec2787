//! Per-sequence state behind one trait (the idea of llama.cpp's `llama_memory_i`):
//! what a family's forward pass reads and appends to for one sequence, how far it
//! can be cut back, and its payload bytes in logical order.
//!
//! Variants: [`KvState`] (`kv.rs`), per-layer K/V rows, each layer either dense
//! (a row for every position: llama, Gemma 3's global layers) or a ring of the
//! last rows of a sliding window (Gemma 3's local layers); [`CompressedState`]
//! (`compressed.rs`, DeepSeek V4): per layer a ring of the last raw rows,
//! compressed rows (one per 4 or 128 positions), indexer rows and the
//! compressors' unfinished windows. A family creates the state its layers need
//! ([`crate::models::Family::new_state`]) and downcasts it back in its forward
//! pass; `Session` only uses this trait.
//!
//! Payloads ([`Codec`]): a state either writes its part of the DS4S container
//! (`payload.rs`: header, tokens and logits written by `Session`, then
//! [`StatePart`]), or owns the whole payload in its family's original layout
//! ([`OwnPayload`]: DeepSeek V4's "DSV4", which the original engine reads and
//! writes), so that checkpoints move between the two engines.

mod compressed;
mod kv;

use std::any::Any;
use std::io::{Read, Write};

pub(crate) use compressed::{CompLayer, CompressedSpec, CompressedState};
pub(crate) use kv::{store_rows, KvLayerSpec, KvRows, KvState, LayerRows, LayerRowsRef, RowsKey};

use crate::error::Result;
use crate::kv_type::KvType;

/// One sequence's state. Positions `0..len()` have been run through it.
pub(crate) trait SeqState: Send {
    /// Tokens the state represents.
    fn len(&self) -> usize;

    /// The largest number of positions it can hold.
    fn n_ctx(&self) -> usize;

    /// The most tokens one forward call may append (a ring must keep every row
    /// an earlier token of the same call still reads).
    fn max_step(&self) -> usize;

    fn kv_type(&self) -> KvType;

    /// Whether the state can be cut back to represent exactly its first `n`
    /// tokens (`n <= len()`), so that appending from position `n` is correct.
    /// A ring that has overwritten a row the continuation would read answers
    /// false; the caller then restores a snapshot or prefills again.
    fn can_cut_to(&self, n: usize) -> bool;

    /// Whether a state of `len` tokens read from a payload (holding at most the
    /// rows this layout keeps) could be cut back to `n` tokens: asked before
    /// loading a checkpoint only to cut it, so a load that could never serve
    /// is not paid for. Optimistic: [`can_cut_to`](Self::can_cut_to) decides
    /// after the load. The default knows nothing better than `n <= len`.
    fn could_cut_loaded(&self, len: usize, n: usize) -> bool {
        n <= len
    }

    /// Cuts back to `n` tokens; the caller has checked [`can_cut_to`](Self::can_cut_to).
    fn cut_to(&mut self, n: usize);

    /// Drops the last forward step's tokens past `n` (a draft not kept): a
    /// [`cut_to`](Self::cut_to) that leaves every row below `n` as the step
    /// found it, so what is known of them stays true.
    fn drop_appended(&mut self, n: usize) {
        self.cut_to(n);
    }

    /// Forgets everything: the next forward starts at position 0.
    fn reset(&mut self);

    /// How the state becomes payload bytes.
    fn codec(&self) -> Codec<'_>;

    /// [`codec`](Self::codec), to load a payload.
    fn codec_mut(&mut self) -> CodecMut<'_>;

    /// Memory the state holds, in bytes.
    fn memory_bytes(&self) -> u64;

    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// How a session with this state is written as payload bytes.
pub(crate) enum Codec<'a> {
    /// The DS4S container, the state writing its part.
    Container(&'a dyn StatePart),
    /// The family's own layout, written whole by the state.
    Own(&'a dyn OwnPayload),
}

/// [`Codec`], mutable.
pub(crate) enum CodecMut<'a> {
    Container(&'a mut dyn StatePart),
    Own(&'a mut dyn OwnPayload),
}

/// A state's part of a DS4S payload (after the header, tokens and logits).
pub(crate) trait StatePart {
    /// Bytes [`write`](Self::write) writes.
    fn payload_bytes(&self) -> u64;

    /// Writes a descriptor of the layout, then the rows the state holds, in
    /// logical (position) order.
    fn write(&self, w: &mut dyn Write) -> Result<()>;

    /// Replaces the state with what [`write`](Self::write) wrote for `len`
    /// tokens, checking the descriptor against this state's layout. On error
    /// the state is left empty.
    fn read(&mut self, len: usize, r: &mut dyn Read) -> Result<()>;

    /// Replaces the state with a version-1 payload's rows (dense K/V of every
    /// layer, written before payloads described their state), where the
    /// layout allows it.
    fn read_v1(&mut self, len: usize, r: &mut dyn Read) -> Result<()>;
}

/// A state that writes the whole session payload (its own header, the
/// tokens, the next-token logits and the state) in its family's original
/// layout.
pub(crate) trait OwnPayload {
    /// Bytes [`write_payload`](Self::write_payload) writes for `n_vocab` logits.
    fn payload_bytes(&self, n_vocab: usize) -> u64;

    /// Writes the session whose state this is.
    fn write_payload(&self, tokens: &[u32], logits: &[f32], w: &mut dyn Write) -> Result<()>;

    /// Replaces the state with a payload, filling `tokens` and `logits`
    /// (`n_vocab` long), checking every field against this state's layout and
    /// context and that exactly the payload's bytes are consumed. On error the
    /// state is left empty.
    fn read_payload(
        &mut self,
        tokens: &mut Vec<u32>,
        logits: &mut [f32],
        r: &mut dyn Read,
    ) -> Result<()>;
}
