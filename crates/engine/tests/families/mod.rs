//! The model families every family-wide test runs over, in one list
//! ([`for_each_family!`]): each family's real model and the long golden
//! prompt its state tests use.

#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use ds4_engine::Model;
use serde_json::Value;

/// One family under test.
pub struct Family {
    pub name: &'static str,
    /// The model file under `$DS4_HOME/models`.
    pub file: &'static str,
    /// A golden vector (`tests/vectors/llama-cpp/`) whose prompt is long enough
    /// to pass a sliding window.
    pub long_vector: &'static str,
}

pub const SMOLLM2: Family = Family {
    name: "smollm2",
    file: ds4_testdata::SMOLLM2,
    long_vector: "smollm2_long_carrow_point.json",
};

pub const GEMMA3: Family = Family {
    name: "gemma3",
    file: ds4_testdata::GEMMA3,
    long_vector: "gemma3_270m_long_promessi_sposi.json",
};

/// Runs each named test function (`fn(&Family)`) once per family, as
/// `<family>::<test>`.
#[macro_export]
macro_rules! for_each_family {
    ($($test:ident),* $(,)?) => {
        mod smollm2 {
            $(#[test] fn $test() { super::$test(&super::families::SMOLLM2) })*
        }
        mod gemma3 {
            $(#[test] fn $test() { super::$test(&super::families::GEMMA3) })*
        }
    };
}

/// The family's model, loaded once per test binary.
pub fn model(f: &Family) -> Arc<Model> {
    static MODELS: OnceLock<Mutex<HashMap<&'static str, Arc<Model>>>> = OnceLock::new();
    let mut m = MODELS.get_or_init(Default::default).lock().unwrap();
    Arc::clone(m.entry(f.file).or_insert_with(|| {
        Arc::new(
            Model::load(ds4_testdata::model_path(f.file))
                .unwrap_or_else(|e| panic!("loading {}: {e}", f.name)),
        )
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

/// The family's long real prompt.
pub fn long_prompt(f: &Family) -> Vec<u32> {
    ids(&vector(f.long_vector)["prompt_token_ids"])
}
