#!/usr/bin/env python3
"""Decode speed with and without speculative decoding (prompt lookup,
`--draft-max`), on the same requests: two servers of the same binary, one
with drafts and one without (`--draft-max 0`), asked in turn, greedy. Each
answer must be the same text on both; the decode seconds come from each
server's trace (`decode_s`, so prefill is left out).

    python3 bench/speculation.py [--runs 3] [--tokens 300] [--draft-max 7] [--completions] [-- extra ds4 serve args]

`--completions` sends each request's text as a `/v1/completions` prompt (for
a base model such as `-m gemma3`, which has no chat template).

The requests: copying a file, editing one (a rename, the whole file printed
again), answering about a tool's output that it quotes, free prose (which
copies little: what drafting costs where it rarely helps), and a forced tool
call with several arguments (chat only: what its grammar forces is drafted).

Standard library only; runs target/release/ds4 (build it first)."""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def requests():
    src = open(os.path.join(ROOT, "crates/kernels/src/pool.rs")).read()[:2400]
    # A fixed commit, so the request is the same whatever was committed since.
    listing = subprocess.run(
        ["git", "-C", ROOT, "show", "--stat", "--format=%s", "5d1ed4c"],
        capture_output=True, text=True, check=True,
    ).stdout[:2400]
    user = lambda text: [{"role": "user", "content": text}]
    return {
        "copy": user("Repeat this file exactly:\n```rust\n" + src + "\n```"),
        "edit": user(
            "Here is a file:\n```rust\n" + src + "\n```\n"
            "Rename `ThreadPool` to `WorkerPool` everywhere and print the whole file."
        ),
        "tool": user(
            "The command `git show --stat 5d1ed4c` printed:\n```\n" + listing + "\n```\n"
            "List every file it names, with its line count change."
        ),
        "prose": user("Write a long story about a lighthouse keeper during a storm."),
        "call": (
            user("Book a table for 4 at Chez Marie in Lyon on March 3 at 8 pm, "
                 "by the window, and tell them it is a birthday."),
            {"tools": [CALL_TOOL], "tool_choice": "required"},
        ),
    }


CALL_TOOL = {"type": "function", "function": {
    "name": "book_table", "description": "Book a restaurant table",
    "parameters": {"type": "object", "additionalProperties": False, "properties": {
        "restaurant": {"type": "string"}, "city": {"type": "string"},
        "date": {"type": "string"}, "time": {"type": "string"},
        "guests": {"type": "integer"}, "seating": {"type": "string", "enum": ["window", "bar", "terrace"]},
        "occasion": {"type": "string"}, "notes": {"type": "string"}},
        "required": ["restaurant", "city", "date", "time", "guests", "seating", "occasion", "notes"]},
}}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(draft, extra, tmp):
    port = free_port()
    trace = os.path.join(tmp, f"trace{draft}.jsonl")
    argv = [
        os.path.join(ROOT, "target/release/ds4"), "serve", "--port", str(port),
        "--draft-max", str(draft), "--trace", trace,
        "--kv-disk-dir", os.path.join(tmp, f"kv{draft}"), *extra,
    ]
    proc = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc, port, trace
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not start")


def ask(port, request, tokens, completions):
    messages, extra = request if isinstance(request, tuple) else (request, {})
    body = {"model": "ds4", "max_tokens": tokens, "temperature": 0, **extra}
    if completions:
        body["prompt"] = messages[-1]["content"] + "\n\n"
    else:
        body["messages"] = messages
    route = "completions" if completions else "chat/completions"
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/{route}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    choice = json.load(urllib.request.urlopen(req, timeout=600))["choices"][0]
    if completions:
        return choice["text"]
    calls = choice["message"].get("tool_calls") or []
    # Call ids are fresh per answer: compare names and arguments.
    return choice["message"]["content"] or json.dumps([c["function"] for c in calls])


def last_request(trace):
    with open(trace) as f:
        rows = [json.loads(l) for l in f if '"request"' in l]
    return rows[-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--draft-max", type=int, default=7)
    ap.add_argument("--completions", action="store_true")
    ap.add_argument("extra", nargs="*", help="extra ds4 serve arguments (after --)")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="ds4-spec-")
    servers = {d: start(d, a.extra, tmp) for d in (0, a.draft_max)}
    try:
        print("request  tokens  plain t/s  drafted t/s  ratio  accepted/drafted")
        for name, messages in requests().items():
            if a.completions and isinstance(messages, tuple):
                continue
            times = {0: [], a.draft_max: []}
            texts, stats = {}, None
            for _ in range(a.runs):
                for d, (_, port, trace) in servers.items():
                    texts[d] = ask(port, messages, a.tokens, a.completions)
                    r = last_request(trace)
                    times[d].append(r["decode_s"])
                    if d:
                        stats = r
            if texts[0] != texts[a.draft_max]:
                sys.exit(f"{name}: the answers differ with and without drafts")
            n = stats["generated_tokens"]
            plain, drafted = (n / sorted(times[d])[len(times[d]) // 2] for d in times)
            print(
                f"{name:8} {n:6} {plain:10.1f} {drafted:12.1f} {drafted / plain:6.2f}  "
                f"{stats['accepted_draft_tokens']}/{stats['draft_tokens']}"
            )
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
