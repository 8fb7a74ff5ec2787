//! The generator writes the tiny DeepSeek V4 model the reference vectors were
//! made with, byte for byte.

use ds4_testdata::tiny_ds4::{tiny_ds4_bytes, DEFAULT_SEED, TINY_DS4_SHA256, TINY_DS4_SIZE};
use sha2::{Digest, Sha256};

#[test]
fn the_generated_model_has_the_recorded_checksum() {
    let bytes = tiny_ds4_bytes(DEFAULT_SEED).expect("model image");
    assert_eq!(bytes.len() as u64, TINY_DS4_SIZE);
    let got: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(got, TINY_DS4_SHA256);
    let readme = std::fs::read_to_string(ds4_testdata::vectors_dir("ds4-tiny").join("README.md"))
        .expect("ds4-tiny README");
    assert!(
        readme.contains(TINY_DS4_SHA256),
        "the vectors' README records another model"
    );
}
