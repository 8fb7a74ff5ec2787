//! Round trips through the writer and reader, and every class of damage a file can
//! carry: each must come back as a precise error, never a panic.

use crate::*;

fn sample() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", Value::String("llama".into()))
        .add_kv("t.u8", Value::U8(7))
        .add_kv("t.i8", Value::I8(-7))
        .add_kv("t.u16", Value::U16(65535))
        .add_kv("t.i16", Value::I16(-300))
        .add_kv("t.u32", Value::U32(4_000_000_000))
        .add_kv("t.i32", Value::I32(-2_000_000_000))
        .add_kv("t.f32", Value::F32(1.5))
        .add_kv("t.bool", Value::Bool(true))
        .add_kv("t.u64", Value::U64(u64::MAX))
        .add_kv("t.i64", Value::I64(i64::MIN))
        .add_kv("t.f64", Value::F64(-0.25))
        .add_kv(
            "t.strings",
            Value::Array {
                elem: ValueType::String,
                items: vec![Value::String("a".into()), Value::String("é✓".into())],
            },
        )
        .add_kv(
            "t.nested",
            Value::Array {
                elem: ValueType::Array,
                items: vec![
                    Value::Array {
                        elem: ValueType::I32,
                        items: vec![Value::I32(1), Value::I32(-2)],
                    },
                    Value::Array {
                        elem: ValueType::F64,
                        items: vec![],
                    },
                ],
            },
        );
    w.add_tensor("a", &[4, 2], GgmlType::F32, (0..32).collect())
        .unwrap()
        .add_tensor("b", &[32], GgmlType::Q8_0, vec![3; 34])
        .unwrap();
    w
}

#[test]
fn round_trip_every_value_type() {
    let w = sample();
    let g = Gguf::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.metadata, w.metadata);
    assert_eq!(g.get_u64("t.u64").unwrap(), u64::MAX);
    assert_eq!(g.get("t.i64").unwrap().as_i64(), Some(i64::MIN));
    assert_eq!(g.get_f64("t.f32").unwrap(), 1.5);
    assert_eq!(g.get_str_array("t.strings").unwrap(), vec!["a", "é✓"]);
    assert!(g.get_bool("t.bool").unwrap());
    let nested = g.get("t.nested").unwrap().as_array().unwrap();
    assert_eq!(nested[0].as_array().unwrap()[1], Value::I32(-2));
    assert!(matches!(
        g.get_u64("t.f32"),
        Err(GgufError::WrongValueType { ref key, .. }) if key == "t.f32"
    ));
    assert!(matches!(
        g.get_str("nope"),
        Err(GgufError::MissingKey { .. })
    ));
}

#[test]
fn tensors_are_aligned_zero_copy_views() {
    let g = Gguf::from_bytes(sample().to_bytes().unwrap()).unwrap();
    let a = g.tensor_info("a").unwrap();
    assert_eq!(
        (a.dims.clone(), a.ty, a.n_bytes),
        (vec![4, 2], GgmlType::F32, 32)
    );
    assert_eq!(g.tensor_data("a").unwrap(), (0..32).collect::<Vec<u8>>());
    assert_eq!(g.tensor_data("b").unwrap(), vec![3u8; 34]);
    for t in &g.tensors {
        assert_eq!((g.data_offset + t.offset) % 32, 0, "{}", t.name);
    }
    let bytes_ptr = g.bytes().as_ptr_range();
    assert!(bytes_ptr.contains(&g.tensor_data("b").unwrap().as_ptr()));
    assert!(matches!(
        g.tensor_data("c"),
        Err(GgufError::MissingTensor { .. })
    ));
}

#[test]
fn custom_alignment_is_honoured() {
    let mut w = sample();
    w.add_kv("general.alignment", Value::U32(64));
    let g = Gguf::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_eq!(g.alignment, 64);
    assert_eq!(g.data_offset % 64, 0);
    assert_eq!(g.tensor_data("b").unwrap(), vec![3u8; 34]);
}

#[test]
fn every_truncation_is_a_typed_error() {
    let bytes = sample().to_bytes().unwrap();
    for n in 0..bytes.len() {
        match Gguf::from_bytes(bytes[..n].to_vec()) {
            Err(GgufError::Truncated { .. })
            | Err(GgufError::CountTooLarge { .. })
            | Err(GgufError::TensorOutOfBounds { .. }) => {}
            Err(e) => panic!("cut at {n}: unexpected error {e}"),
            Ok(_) => panic!("cut at {n} of {} parsed", bytes.len()),
        }
    }
}

#[test]
fn every_flipped_header_byte_is_an_error_or_a_consistent_parse() {
    let bytes = sample().to_bytes().unwrap();
    let g = Gguf::from_bytes(bytes.clone()).unwrap();
    for i in 0..g.data_offset as usize {
        for flip in [0x01u8, 0x80, 0xff] {
            let mut b = bytes.clone();
            b[i] ^= flip;
            // Any outcome but a panic is acceptable; a parse must still hand out
            // in-bounds views.
            if let Ok(g) = Gguf::from_bytes(b) {
                for t in &g.tensors {
                    assert_eq!(g.data_of(t).len() as u64, t.n_bytes);
                }
            }
        }
    }
}

fn header(version: u32, n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&version.to_le_bytes());
    b.extend_from_slice(&n_tensors.to_le_bytes());
    b.extend_from_slice(&n_kv.to_le_bytes());
    b
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

#[test]
fn header_damage_is_named() {
    let e = Gguf::from_bytes(b"GGML\x03\0\0\0".to_vec()).err().unwrap();
    assert!(matches!(e, GgufError::BadMagic { found } if &found == b"GGML"));
    let e = Gguf::from_bytes(header(1, 0, 0)).err().unwrap();
    assert!(matches!(e, GgufError::UnsupportedVersion(1)));
    // Big-endian files read as a huge version number.
    let e = Gguf::from_bytes(header(3u32.swap_bytes(), 0, 0))
        .err()
        .unwrap();
    assert!(matches!(e, GgufError::UnsupportedVersion(_)));
    let e = Gguf::from_bytes(header(3, 0, u64::MAX)).err().unwrap();
    assert!(e.to_string().contains("metadata count"), "{e}");
    let e = Gguf::from_bytes(header(2, 1 << 40, 0)).err().unwrap();
    assert!(e.to_string().contains("tensor count"), "{e}");
    assert!(
        Gguf::from_bytes(header(2, 0, 0)).is_ok(),
        "empty v2 file is valid"
    );
}

#[test]
fn metadata_damage_is_named() {
    let mut b = header(3, 0, 1);
    put_str(&mut b, "bad.type");
    b.extend_from_slice(&13u32.to_le_bytes());
    let e = Gguf::from_bytes(b).err().unwrap();
    assert!(
        matches!(e, GgufError::InvalidValueType { ref what, type_id: 13 } if what.contains("bad.type"))
    );

    let mut b = header(3, 0, 1);
    put_str(&mut b, "huge.array");
    b.extend_from_slice(&9u32.to_le_bytes());
    b.extend_from_slice(&4u32.to_le_bytes());
    b.extend_from_slice(&(u64::MAX / 2).to_le_bytes());
    let e = Gguf::from_bytes(b).err().unwrap();
    assert!(matches!(e, GgufError::CountTooLarge { ref what, .. } if what.contains("huge.array")));

    let mut b = header(3, 0, 1);
    put_str(&mut b, "bad.utf8");
    b.extend_from_slice(&8u32.to_le_bytes());
    b.extend_from_slice(&2u64.to_le_bytes());
    b.extend_from_slice(&[0xc3, 0x28]);
    let e = Gguf::from_bytes(b).err().unwrap();
    assert!(matches!(e, GgufError::InvalidUtf8 { ref what } if what.contains("bad.utf8")));

    let mut b = header(3, 0, 2);
    for _ in 0..2 {
        put_str(&mut b, "twice");
        b.extend_from_slice(&0u32.to_le_bytes());
        b.push(1);
    }
    assert!(matches!(
        Gguf::from_bytes(b),
        Err(GgufError::DuplicateKey { .. })
    ));

    let mut deep = Vec::new();
    deep.extend_from_slice(&header(3, 0, 1));
    put_str(&mut deep, "deep");
    deep.extend_from_slice(&9u32.to_le_bytes());
    for _ in 0..20 {
        deep.extend_from_slice(&9u32.to_le_bytes());
        deep.extend_from_slice(&1u64.to_le_bytes());
    }
    assert!(Gguf::from_bytes(deep).is_err());
}

fn one_tensor(dims: &[u64], type_id: u32, offset: u64, data_len: usize) -> Vec<u8> {
    let mut b = header(3, 1, 0);
    put_str(&mut b, "w");
    b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
    for d in dims {
        b.extend_from_slice(&d.to_le_bytes());
    }
    b.extend_from_slice(&type_id.to_le_bytes());
    b.extend_from_slice(&offset.to_le_bytes());
    b.resize(b.len().div_ceil(32) * 32 + data_len, 0);
    b
}

#[test]
fn tensor_directory_damage_is_named() {
    assert!(Gguf::from_bytes(one_tensor(&[32], 8, 0, 34)).is_ok());
    let e = Gguf::from_bytes(one_tensor(&[32], 8, 0, 33)).err().unwrap();
    assert!(matches!(e, GgufError::TensorOutOfBounds { ref name, len: 34, .. } if name == "w"));
    let e = Gguf::from_bytes(one_tensor(&[32], 99, 0, 34))
        .err()
        .unwrap();
    assert!(matches!(
        e,
        GgufError::UnknownTensorType { type_id: 99, .. }
    ));
    let e = Gguf::from_bytes(one_tensor(&[31], 8, 0, 34)).err().unwrap();
    assert!(matches!(e, GgufError::BadShape { .. }));
    let e = Gguf::from_bytes(one_tensor(&[32], 8, 16, 64))
        .err()
        .unwrap();
    assert!(matches!(e, GgufError::MisalignedTensor { offset: 16, .. }));
    let e = Gguf::from_bytes(one_tensor(&[1 << 40, 1 << 40], 0, 0, 4))
        .err()
        .unwrap();
    assert!(matches!(e, GgufError::BadShape { .. }));
    let e = Gguf::from_bytes(one_tensor(&[1, 1, 1, 1, 1], 0, 0, 4))
        .err()
        .unwrap();
    assert!(matches!(e, GgufError::TooManyDims { n_dims: 5, .. }));
    let e = Gguf::from_bytes(one_tensor(&[32], 8, u64::MAX - 31, 34))
        .err()
        .unwrap();
    assert!(matches!(e, GgufError::TensorOutOfBounds { .. }));
}

#[test]
fn writer_rejects_inconsistent_input() {
    let mut w = GgufWriter::new();
    assert!(w
        .add_tensor("x", &[32], GgmlType::Q8_0, vec![0; 33])
        .is_err());
    assert!(w
        .add_tensor("x", &[33], GgmlType::Q8_0, vec![0; 34])
        .is_err());
    w.add_tensor("x", &[1], GgmlType::F32, vec![0; 4]).unwrap();
    assert!(w.add_tensor("x", &[1], GgmlType::F32, vec![0; 4]).is_err());
    w.add_kv(
        "mixed",
        Value::Array {
            elem: ValueType::U8,
            items: vec![Value::I8(1)],
        },
    );
    assert!(w.to_bytes().is_err());
}

#[test]
fn open_reports_the_path() {
    let e = Gguf::open("/nonexistent/model.gguf").err().unwrap();
    assert!(e.to_string().contains("/nonexistent/model.gguf"), "{e}");
}

#[test]
fn evicted_pages_read_back_the_same_bytes() {
    let dir = std::env::temp_dir().join(format!("ds4-gguf-evict-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sample.gguf");
    let mut w = sample();
    let big: Vec<u8> = (0..3 * 4096 + 100).map(|i| (i * 7 % 251) as u8).collect();
    w.add_tensor("big", &[big.len() as u64], GgmlType::I8, big.clone())
        .unwrap();
    std::fs::write(&path, w.to_bytes().unwrap()).unwrap();
    let g = Gguf::open(&path).unwrap();
    let whole = g.bytes().to_vec();
    let t = g.tensor_info("big").unwrap();
    let start = (g.data_offset + t.offset) as usize;
    g.evict(start + 10..start + big.len());
    g.evict(0..whole.len() + 1); // outside the image: left as is
    assert_eq!(g.tensor_data("big").unwrap(), big);
    assert_eq!(g.bytes(), whole);
    Gguf::from_bytes(whole.clone())
        .unwrap()
        .evict(0..whole.len());
    std::fs::remove_dir_all(&dir).unwrap();
}
