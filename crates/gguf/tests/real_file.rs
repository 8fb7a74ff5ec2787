//! The reader on the real default model, and on copies of it that are cut short or
//! have bytes flipped: every damaged copy must fail with a typed error naming what
//! broke (or parse consistently), never panic.

use std::path::PathBuf;

use ds4_gguf::{GgmlType, Gguf, GgufError};

fn model_path() -> PathBuf {
    ds4_testdata::model_path(ds4_testdata::SMOLLM2)
}

#[test]
fn reads_the_default_model() {
    let g = Gguf::open(model_path()).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(g.get_u64("llama.block_count").unwrap(), 30);
    assert_eq!(
        g.get_str_array("tokenizer.ggml.tokens").unwrap().len(),
        49152
    );
    assert_eq!(
        g.get_str_array("tokenizer.ggml.merges").unwrap().len(),
        48900
    );
    assert_eq!(g.tensors.len(), 272);
    let emb = g.tensor_info("token_embd.weight").unwrap();
    assert_eq!(
        (emb.ty, emb.dims.clone()),
        (GgmlType::Q8_0, vec![576, 49152])
    );
    let q = g.tensor_info("blk.0.attn_q.weight").unwrap();
    assert_eq!((q.ty, q.dims.clone()), (GgmlType::Q4_1, vec![576, 576]));
    // The last tensor ends at most one alignment unit before the end of the file.
    let end = g
        .tensors
        .iter()
        .map(|t| g.data_offset + t.offset + t.n_bytes)
        .max()
        .unwrap();
    assert!(end <= g.bytes().len() as u64 && g.bytes().len() as u64 - end < g.alignment);
}

#[test]
fn every_cut_is_a_typed_error() {
    let bytes = std::fs::read(model_path()).unwrap();
    let g = Gguf::from_bytes(bytes.clone()).unwrap();
    let header_end = g.data_offset as usize;
    // Every cut inside the first 4 KiB, then a sweep through the metadata and the
    // tensor directory, then cuts through the tensor data.
    let mut cuts: Vec<usize> = (0..4096).collect();
    cuts.extend((4096..header_end).step_by(2999));
    cuts.extend((header_end..bytes.len()).step_by(bytes.len() / 12));
    cuts.push(bytes.len() - 1);
    for n in cuts {
        match Gguf::from_bytes(bytes[..n].to_vec()) {
            Err(GgufError::TensorOutOfBounds { ref name, .. }) => {
                assert!(n >= header_end, "cut at {n} reported tensor {name}");
            }
            Err(GgufError::Truncated { .. } | GgufError::CountTooLarge { .. }) => {
                assert!(n < header_end, "cut at {n} is past the header");
            }
            Err(e) => panic!("cut at {n}: unexpected error {e}"),
            Ok(_) => panic!("cut at {n} of {} parsed", bytes.len()),
        }
    }
}

#[test]
fn damaged_headers_name_the_field() {
    let bytes = std::fs::read(model_path()).unwrap();
    let g = Gguf::from_bytes(bytes.clone()).unwrap();
    let header_end = g.data_offset as usize;
    let mut b = bytes.clone();
    b[0] = b'X';
    assert!(matches!(
        Gguf::from_bytes(b),
        Err(GgufError::BadMagic { .. })
    ));

    // The first metadata key's length: a huge length is a truncation of that key.
    let mut b = bytes.clone();
    b[24 + 7] = 0x7f;
    let e = Gguf::from_bytes(b).err().unwrap();
    assert!(e.to_string().contains("metadata key #0"), "{e}");

    // The first tensor's type id.
    let name = b"token_embd.weight";
    let pos = bytes[..header_end]
        .windows(name.len())
        .position(|w| w == name)
        .unwrap();
    let type_at = pos + name.len() + 4 + 2 * 8;
    let mut b = bytes.clone();
    b[type_at..type_at + 4].copy_from_slice(&77u32.to_le_bytes());
    let e = Gguf::from_bytes(b).err().unwrap();
    assert!(
        matches!(e, GgufError::UnknownTensorType { ref name, type_id: 77 } if name == "token_embd.weight"),
        "{e}"
    );

    // Flip bytes all over the header: errors or consistent parses, never a panic.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..3000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let i = (state % header_end as u64) as usize;
        let mut b = bytes[..header_end + 64].to_vec();
        b[i] ^= (state >> 32) as u8 | 1;
        if let Ok(g) = Gguf::from_bytes(b) {
            for t in &g.tensors {
                assert_eq!(g.data_of(t).len() as u64, t.n_bytes);
            }
        }
    }
}
