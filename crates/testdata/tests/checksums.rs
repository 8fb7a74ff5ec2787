//! The vectors in `tests/vectors` are exactly the files their `SHA256SUMS` lists:
//! none edited, none missing, none added without a checksum.

use std::collections::BTreeSet;
use std::path::Path;

use sha2::{Digest, Sha256};

fn files_under(dir: &Path, root: &Path, out: &mut BTreeSet<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files_under(&path, root, out);
        } else {
            let rel = path
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            out.insert(rel);
        }
    }
}

#[test]
fn every_vector_matches_its_recorded_checksum() {
    let root = ds4_testdata::vectors_dir("");
    let sums = std::fs::read_to_string(root.join("SHA256SUMS")).unwrap();
    let mut listed = BTreeSet::new();
    for line in sums.lines() {
        let (want, name) = line.split_once("  ").expect("`HASH  NAME` lines");
        let bytes = std::fs::read(root.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let got: String = Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(got, want, "{name} differs from its recorded checksum");
        listed.insert(name.to_string());
    }
    let mut present = BTreeSet::new();
    for sub in ["llama-cpp", "clients", "ds4-tiny", "deepseek4-tokenizer"] {
        files_under(&root.join(sub), &root, &mut present);
    }
    assert_eq!(
        present, listed,
        "files without a checksum, or listed but missing"
    );
    assert!(listed.len() >= 20, "{} files", listed.len());
}
