//! The on-disk checkpoint store of ds4: file format, header index, lookup by
//! rendered-text prefix, verified load, atomic save, byte budget, eviction by value, and
//! the save policy. Model-agnostic: the payload is opaque bytes from the engine, the
//! model is identified only by two fingerprints. Unix only (file modes, positioned I/O,
//! `/proc`). Derived from the original C system's `ds4_kvstore.c` (system spec §10);
//! where they differ, `docs/DESIGN.md` wins and the differences are listed below.
//!
//! # File format (version 2)
//!
//! `<dir>/<40 lowercase hex SHA-1 of the rendered text>.kv`, little-endian:
//! a 128-byte header, the rendered text, the payload, then the section area.
//!
//! | offset | size | field |
//! |---:|---:|---|
//! | 0 | 3 | magic `KVC` |
//! | 3 | 1 | format version = 2 (1 was the C system's 52-byte header: rejected) |
//! | 4 | 1 | save reason: 0 unknown, 1 cold, 2 continued, 3 evict, 4 shutdown, 5 agent-system, 6 agent-session, 7 client-hint, 8 turn-end (others: invalid) |
//! | 5 | 3 | reserved, 0 |
//! | 8 | 4 | u32 extension flags (bit 0: a tool-id map section is present); opaque to the store |
//! | 12 | 4 | u32 token count (0: invalid) |
//! | 16 | 4 | u32 context size of the writing session (`n_ctx`; < tokens: invalid) |
//! | 20 | 4 | reserved, 0 |
//! | 24 | 8 | u64 created, Unix seconds |
//! | 32 | 8 | u64 text byte count |
//! | 40 | 8 | u64 payload byte count |
//! | 48 | 8 | u64 section-area byte count |
//! | 56 | 16 | model fingerprint (family + shape) |
//! | 72 | 8 | quant fingerprint (quantization mix) |
//! | 80 | 8 | u64 body checksum: XXH3-64 of text ‖ payload ‖ section area |
//! | 88 | 16 | weights fingerprint (the tensor data); zeros in files written before it was recorded, which were reserved bytes |
//! | 104 | 4 | reserved, 0 |
//! | 108 | 4 | u32 hit count (updated in place) |
//! | 112 | 8 | u64 last used, Unix seconds (updated in place) |
//! | 120 | 8 | u64 header checksum: XXH3-64 of bytes 0..120 |
//! | 128 | text | rendered text |
//! | … | payload | engine payload |
//! | … | sections | records `u32 kind, u64 len, len bytes`, filling the area exactly |
//!
//! A file is valid only if its size is exactly `128 + text + payload + sections`.
//! The in-place usage update rewrites bytes 108..128 (hits, last-used, header checksum)
//! with one positioned write; nothing else in a file ever changes after the rename.
//! Every header byte is covered by the header checksum, every body byte by the body
//! checksum, and the text also by its SHA-1 (the name).
//!
//! # Index, lookup, load
//!
//! [`Store::open`] builds an index from headers only. Files that are not usable are
//! reported once each as [`Notice::Skipped`] with a precise [`Defect`] (empty, shorter
//! than a header, bad magic, wrong version, header checksum, invalid field, size
//! disagreeing with the header, not a regular file, a name that is not
//! `<40 lowercase hex>.kv`) and never loaded, counted or deleted by eviction. The index is
//! refreshed (new or changed files only, by size/inode/mtime/ctime) before each lookup,
//! eviction, `entries` and `verify`, so several processes can share a directory.
//!
//! [`Store::lookup`] considers entries whose text is no longer than the prompt, whose
//! model fingerprint matches, whose quant fingerprint matches when
//! `reject_different_quant`, whose weights fingerprint matches when the quant
//! fingerprint does (one quantization, other tensor data: another or a modified
//! file; zeros, from before it was recorded, match nothing), and whose `n_ctx` is at
//! most the session's (a file saved at context C loads only into a context ≥ C);
//! [`Mismatch::of`] is that rule. [`Store::lookup_refused`] names the longest
//! checkpoint the rule turned away, so a miss can say why. It hashes the prompt once, incrementally,
//! at each candidate length and returns the longest match. [`Store::load`] reads the
//! whole file in 8 MiB chunks (no mmap) and checks size, SHA-1(text) = name, text = the
//! prompt prefix, body checksum and sections; a damaged file is marked skipped and
//! returned as [`KvError::Corrupt`]. Then hits+1 and last-used = now are written in place.
//! Lookup does not filter by `min_tokens`, and the store never deletes a file after
//! loading it; both are the caller's policy.
//!
//! # Saving
//!
//! [`Store::save`] estimates `128 + text + payload + sections` and skips
//! ([`SkipReason::OverBudget`]) if it exceeds the whole budget (eviction can free
//! everything else, so nothing more is needed); the actual size of a streamed payload is
//! checked again before the rename. A same-name file that is sound, of the same model
//! (and quant when rejecting), written at a context no larger than this session's, with
//! identical text, flags and sections, is kept ([`SaveOutcome::Kept`], last-used
//! updated). Otherwise the file is written to `<name>.tmp.<pid>` (mode 0600), fsynced,
//! renamed over the final name, and the directory fsynced (a failed directory fsync is
//! ignored: the file is complete either way). Any error removes the temp file and is
//! returned; the store stays usable. Then eviction runs with the new file protected.
//!
//! # Eviction
//!
//! While the valid files exceed the budget, delete the lowest
//! [`eviction_score`]: `(effective_hits + 1) * tokens / file_bytes` with
//! `effective_hits = hits * 2^(-(now - used_at)/21600)` (`used_at` = last-used, or created
//! when 0; below 0.01 → 0), ×2 for cold/evict/shutdown, ×0.5 for a `continued`
//! checkpoint whose text is a strict prefix of another checkpoint of the same model
//! created no earlier (re-evaluated as files go). Ties: older `used_at` first, then name.
//!
//! # Directory and temp files
//!
//! A missing directory is created (recursively) with mode 0700. An existing one is left
//! as it is; if group or others have any access a [`Notice::InsecureDir`] is queued
//! (changing a user's directory silently could break their setup). Temp files
//! `<40 hex>.kv.tmp.<pid>` are never indexed; one is removed (with a notice) when
//! `/proc/<pid>` does not exist (Linux; elsewhere only age counts) or it is older than an
//! hour; a live process's fresh temp file is left alone silently. Other names, including
//! other `*.tmp.*` files, are reported once as unrecognized and never deleted.
//!
//! # Concurrency
//!
//! Readers never see a half-written file (temp + rename). Two processes never corrupt
//! each other's files: the only in-place write is the 20-byte usage tail, written whole
//! and consistent; concurrent updates may lose a hit count or last-used time (benign:
//! eviction order only). A header read that races such a write and fails its checksum
//! is re-read once. A reader holding an open file keeps reading it if another process
//! evicts or replaces it. An index may briefly hold stale hits/last-used values on file
//! systems with coarse timestamps; every load re-validates the header.

#![forbid(unsafe_code)]

mod error;
mod format;
mod policy;
mod score;
mod store;

pub use error::{Defect, KvError};
pub use format::{
    decode_sections, encode_sections, file_name_for, sections_len, text_hash, Header, Mismatch,
    ModelId, SaveReason, Section, EXT_TOOL_ID_MAP, FORMAT_VERSION, HEADER_LEN, MAGIC,
};
pub use policy::SavePolicy;
pub use score::{
    effective_hits, eviction_score, ANCHOR_FACTOR, HIT_HALF_LIFE_S, MIN_EFFECTIVE_HITS,
    SUPERSEDED_FACTOR,
};
pub use store::{
    now_unix, Candidate, EntryInfo, Evicted, Loaded, NearMiss, Notice, Payload, SaveOutcome,
    SaveRequest, Shared, SkipReason, Store, StoreConfig, VerifyReport, EXCERPT_CHARS,
    STALE_TEMP_AGE_S,
};
