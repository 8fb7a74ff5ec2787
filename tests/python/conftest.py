"""Shared fixtures: a `ds4 serve` process per test module (or per test, for the
restart test), started on a free port with its own disk checkpoint store and
trace file, and SDK clients pointed at it.

The binary is $DS4_BIN, or target/release/ds4 of this checkout. The model is the
default one (`ds4 model pull smollm2`, under $DS4_HOME, default ~/.cache/ds4).
"""

import ctypes
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import anthropic
import openai
import pytest

REPO = Path(__file__).resolve().parents[2]
DS4_BIN = Path(os.environ.get("DS4_BIN", REPO / "target" / "release" / "ds4"))
LISTENING = "ds4 serve: listening on http://"

# Seconds allowed for one request: a cold 1.2k-token prefill takes 10-30 s on a
# 2-core machine; this only guards against a hung server.
REQUEST_TIMEOUT = 300.0

# The long prompt of the cache and restart tests: the first 14 paragraphs of the
# benchmark story, about 1100 tokens (the tests assert the prompt is over 1024).
_STORY = (REPO / "bench" / "carrow_point.txt").read_text()
LONG_SYSTEM = "\n\n".join(_STORY.split("\n\n")[:14])
LONG_QUESTION = "Who was the keeper of the light when Elin Marsh arrived?"
FOLLOW_UP = "In which year was the lighthouse built?"


try:
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None


def _die_with_parent():
    """Child side of fork: get SIGTERM if pytest dies without tearing down."""
    if _prctl is not None:
        _prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Server:
    """One `ds4 serve` process: port, stderr log, trace file."""

    def __init__(self, workdir: Path, kv_dir: Path, name: str = "server", extra=()):
        self.trace = workdir / f"{name}.trace.jsonl"
        self.kv_dir = kv_dir
        if not DS4_BIN.is_file():
            pytest.fail(f"{DS4_BIN} is missing: build it first (cargo build --release)")
        args = [
            str(DS4_BIN), "serve", "--port", "0", "--threads", "2",
            "--kv-disk-dir", str(kv_dir), "--kv-cache-min-tokens", "16",
            "--trace", str(self.trace), *extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_die_with_parent,
        )
        self._lines = []
        self._lock = threading.Lock()
        self._port_ready = threading.Event()
        self.port = None
        threading.Thread(target=self._drain, daemon=True).start()
        if not self._port_ready.wait(60) or self.port is None:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"ds4 serve did not start:\n{self.log()}")

    def _drain(self):
        for line in self.proc.stderr:
            with self._lock:
                self._lines.append(line)
            if self.port is None and line.startswith(LISTENING):
                self.port = int(line.strip().rsplit(":", 1)[1])
                self._port_ready.set()
        self._port_ready.set()  # exited before listening: let __init__ fail

    def log(self) -> str:
        with self._lock:
            return "".join(self._lines)

    def trace_events(self):
        return [json.loads(line) for line in self.trace.read_text().splitlines() if line]

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1",
            api_key="x",
            max_retries=0,
            timeout=REQUEST_TIMEOUT,
        )

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=f"http://127.0.0.1:{self.port}",
            api_key="x",
            max_retries=0,
            timeout=REQUEST_TIMEOUT,
        )

    def stop(self) -> str:
        """SIGTERM, wait, assert a clean exit; returns the stderr log."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"ds4 serve ignored SIGTERM for 120 s:\n{self.log()}")
        deadline = time.monotonic() + 5
        while "ds4 serve: stopped" not in self.log() and time.monotonic() < deadline:
            time.sleep(0.05)  # the drain thread may still hold the last lines
        assert code == 0, f"ds4 serve exited with {code}:\n{self.log()}"
        return self.log()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def start_server(tmp_path):
    """Factory: start_server(kv_dir, name) -> Server; leftovers are killed."""
    started = []

    def start(kv_dir: Path, name: str = "server") -> Server:
        s = Server(tmp_path, kv_dir, name)
        started.append(s)
        return s

    yield start
    for s in started:
        s.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server shared by the tests of one module, stopped cleanly at its end."""
    d = tmp_path_factory.mktemp("ds4")
    s = Server(d, d / "kv")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def oai(server):
    return server.openai()


@pytest.fixture(scope="module")
def ant(server):
    return server.anthropic()
