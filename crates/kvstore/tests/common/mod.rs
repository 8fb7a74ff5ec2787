//! Shared test helpers: a deterministic PRNG, self-removing temp directories, and
//! shortcuts for saving and patching checkpoint files.
#![allow(dead_code)]

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use ds4_kvstore::{
    Header, ModelId, Payload, SaveOutcome, SaveReason, SaveRequest, Section, Store, StoreConfig,
    HEADER_LEN,
};

/// SplitMix64: small, deterministic, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
    /// Printable text, so excerpts are readable.
    pub fn text(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| b'a' + self.below(26) as u8).collect()
    }
}

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static N: AtomicU64 = AtomicU64::new(0);
        let p = std::env::temp_dir().join(format!(
            "ds4-kvstore-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    /// A not-yet-existing store directory inside this temp dir.
    pub fn store_dir(&self) -> PathBuf {
        self.0.join("kv")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

pub const MODEL_A: ModelId = ModelId {
    model_fp: [0xa1; 16],
    quant_fp: [0x04; 8],
    weights_fp: [0x1a; 16],
};
/// Same model as A, other quantization (so other weights).
pub const MODEL_A_Q2: ModelId = ModelId {
    model_fp: [0xa1; 16],
    quant_fp: [0x02; 8],
    weights_fp: [0x2a; 16],
};
/// Same layout and quantization as A, other tensor data.
pub const MODEL_A_TAMPERED: ModelId = ModelId {
    weights_fp: [0x3a; 16],
    ..MODEL_A
};
pub const MODEL_B: ModelId = ModelId {
    model_fp: [0xb2; 16],
    quant_fp: [0x04; 8],
    weights_fp: [0x1b; 16],
};

pub fn big_config() -> StoreConfig {
    StoreConfig {
        budget_bytes: 1 << 30,
        ..StoreConfig::default()
    }
}

pub struct Spec<'a> {
    pub text: &'a [u8],
    pub payload: &'a [u8],
    pub reason: SaveReason,
    pub tokens: u32,
    pub n_ctx: u32,
    pub model: ModelId,
    pub sections: &'a [Section],
}

impl<'a> Spec<'a> {
    pub fn new(text: &'a [u8], payload: &'a [u8]) -> Spec<'a> {
        Spec {
            text,
            payload,
            reason: SaveReason::Cold,
            tokens: (text.len() as u32 / 4).max(1),
            n_ctx: 8192,
            model: MODEL_A,
            sections: &[],
        }
    }
}

pub fn save(store: &Store, s: &Spec<'_>) -> SaveOutcome {
    store
        .save(SaveRequest {
            text: s.text,
            payload: Payload::Bytes(s.payload),
            reason: s.reason,
            tokens: s.tokens,
            n_ctx: s.n_ctx,
            model: s.model,
            ext_flags: if s.sections.is_empty() { 0 } else { 1 },
            sections: s.sections,
        })
        .expect("save")
}

pub fn saved_path(o: &SaveOutcome) -> PathBuf {
    match o {
        SaveOutcome::Saved { path, .. } | SaveOutcome::Kept { path } => path.clone(),
        other => panic!("expected a saved file, got {other:?}"),
    }
}

pub fn read_header(path: &Path) -> Header {
    let b = fs::read(path).unwrap();
    Header::decode(&b[..HEADER_LEN.min(b.len())]).unwrap()
}

/// Rewrite a file's header through `f` (checksum recomputed).
pub fn patch_header(path: &Path, f: impl FnOnce(&mut Header)) {
    let mut h = read_header(path);
    f(&mut h);
    let file = fs::OpenOptions::new().write(true).open(path).unwrap();
    file.write_all_at(&h.encode(), 0).unwrap();
}

/// Create a private (0700) directory, as the store would.
pub fn make_dir(p: &Path) {
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(p)
        .unwrap();
}

/// Names (file names) of the entries in a directory, sorted.
pub fn dir_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}
