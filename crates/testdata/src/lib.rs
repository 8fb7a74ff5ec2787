//! Test-only locations: the real models under `$DS4_HOME/models` (the layout
//! `ds4 model pull` writes; `scripts/test.sh` pulls before testing) and the golden
//! vectors copied into the repository (`tests/vectors/`, with their provenance and
//! checksums), so a clone tests itself.

use std::path::PathBuf;

/// File name of the default model (SmolLM2-135M-Instruct, Q4_1).
pub const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// File name of Gemma 3 270M (base, Q4_K_M).
pub const GEMMA3: &str = "gemma-3-270m-q4_k_m.gguf";

/// `$DS4_HOME/models/<file>`, panicking with the command that fetches it when absent.
pub fn model_path(file: &str) -> PathBuf {
    let home = std::env::var_os("DS4_HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME or DS4_HOME must be set"))
                .join(".cache/ds4")
        });
    let path = home.join("models").join(file);
    assert!(
        path.is_file(),
        "model missing at {}: run `cargo run --release -p ds4-cli -- model pull {}` (or ./scripts/test.sh)",
        path.display(),
        pull_name(file)
    );
    path
}

/// The `ds4 model pull` name that fetches `file`.
fn pull_name(file: &str) -> &'static str {
    match file {
        SMOLLM2 => "smollm2",
        GEMMA3 => "gemma3",
        _ => "<name>",
    }
}

/// `tests/vectors/<sub>` in the repository.
pub fn vectors_dir(sub: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/vectors")
        .join(sub)
}
