//! The model families every family-wide test runs over, in one list
//! ([`for_each_family!`]): each family's model (SmolLM2 and Gemma 3 real,
//! DeepSeek V4 the tiny synthetic one the generator writes) and the long
//! golden prompt its state tests use.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use ds4_engine::Model;
use serde_json::Value;

/// One family under test.
pub struct Family {
    pub name: &'static str,
    /// Where its model is (fetched or written before the tests).
    pub path: fn() -> PathBuf,
    /// A golden vector (under `tests/vectors/`) whose prompt is long enough
    /// to pass a sliding window, and the key of its prompt ids.
    pub long_vector: (&'static str, &'static str),
}

pub const SMOLLM2: Family = Family {
    name: "smollm2",
    path: || ds4_testdata::model_path(ds4_testdata::SMOLLM2),
    long_vector: (
        "llama-cpp/smollm2_long_carrow_point.json",
        "prompt_token_ids",
    ),
};

pub const GEMMA3: Family = Family {
    name: "gemma3",
    path: || ds4_testdata::model_path(ds4_testdata::GEMMA3),
    long_vector: (
        "llama-cpp/gemma3_270m_long_promessi_sposi.json",
        "prompt_token_ids",
    ),
};

pub const DEEPSEEK4: Family = Family {
    name: "deepseek4",
    path: ds4_testdata::tiny_ds4::tiny_ds4_path,
    long_vector: ("ds4-tiny/strict/long.meta.json", "prompt_tokens"),
};

/// Runs each named test function (`fn(&Family)`) once per family, as
/// `<family>::<test>`; the tests after `attention:` only for the families
/// whose state is per-position K/V rows (not DeepSeek V4's compressed state,
/// whose own tests cover the same ground where its premises differ).
#[macro_export]
macro_rules! for_each_family {
    ($($test:ident),* $(,)? $(; attention: $($att:ident),* $(,)?)?) => {
        mod smollm2 {
            $(#[test] fn $test() { super::$test(&super::families::SMOLLM2) })*
            $($(#[test] fn $att() { super::$att(&super::families::SMOLLM2) })*)?
        }
        mod gemma3 {
            $(#[test] fn $test() { super::$test(&super::families::GEMMA3) })*
            $($(#[test] fn $att() { super::$att(&super::families::GEMMA3) })*)?
        }
        mod deepseek4 {
            $(#[test] fn $test() { super::$test(&super::families::DEEPSEEK4) })*
        }
    };
}

/// The family's model, loaded once per test binary.
pub fn model(f: &Family) -> Arc<Model> {
    static MODELS: OnceLock<Mutex<HashMap<&'static str, Arc<Model>>>> = OnceLock::new();
    let mut m = MODELS.get_or_init(Default::default).lock().unwrap();
    Arc::clone(m.entry(f.name).or_insert_with(|| {
        Arc::new(Model::load((f.path)()).unwrap_or_else(|e| panic!("loading {}: {e}", f.name)))
    }))
}

pub fn vector(path: &str) -> Value {
    let path = ds4_testdata::vectors_dir("llama-cpp").join(path);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("vector JSON")
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// The family's long prompt.
pub fn long_prompt(f: &Family) -> Vec<u32> {
    let path = ds4_testdata::vectors_dir(f.long_vector.0);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: Value = serde_json::from_str(&text).expect("vector JSON");
    ids(&v[f.long_vector.1])
}
