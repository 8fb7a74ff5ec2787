#!/usr/bin/env python3
"""Time to first token of `ds4 serve` for the agent pattern, the way the llama.cpp
reference numbers in shared/bench were taken: a ~6000-token ChatML prompt sent cold,
repeated identically, extended by one turn, and resent after a server restart.

usage: bench/ttft.py [--tokens 6000] [--ds4 target/release/ds4] [--threads 2]
Only the standard library; talks to the server over loopback with streaming chat
completions and measures the time from sending the request to the first content
delta.
"""
import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def start(ds4, kv_dir, threads, ctx):
    p = subprocess.Popen(
        [ds4, "serve", "--port", "0", "--threads", str(threads), "--ctx", str(ctx), "--kv-disk-dir", kv_dir],
        stderr=subprocess.PIPE, text=True)
    for line in p.stderr:
        if line.startswith("ds4 serve: listening on http://"):
            return p, int(line.rsplit(":", 1)[1])
    raise SystemExit("ds4 serve did not start")


def stop(p):
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=300)


def ttft(port, messages):
    body = json.dumps({"messages": messages, "temperature": 0, "max_tokens": 8, "stream": True,
                       "stream_options": {"include_usage": True}})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    t0 = time.monotonic()
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    first, text, usage = None, "", None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for ch in chunk.get("choices", []):
            piece = ch.get("delta", {}).get("content")
            if piece:
                if first is None:
                    first = time.monotonic() - t0
                text += piece
    return first, time.monotonic() - t0, text, usage, r.getheader("x-ds4-cache")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=6000, help="approximate prompt tokens")
    ap.add_argument("--ds4", default=os.path.join(HERE, "..", "target", "release", "ds4"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    story = open(os.path.join(HERE, "carrow_point.txt")).read()
    # ~4.1 characters per token for this text.
    system = (story * (1 + args.tokens * 41 // 10 // len(story)))[: args.tokens * 41 // 10]
    turn1 = [{"role": "system", "content": system},
             {"role": "user", "content": "Who kept the light at Carrow Point?"}]
    with tempfile.TemporaryDirectory() as kv:
        p, port = start(args.ds4, kv, args.threads, 8192)
        rows = []
        first, total, answer, usage, cache = ttft(port, turn1)
        rows.append(("cold", first, total, usage, cache))
        first, total, _, usage, cache = ttft(port, turn1)
        rows.append(("identical repeat", first, total, usage, cache))
        turn2 = turn1 + [{"role": "assistant", "content": answer},
                         {"role": "user", "content": "And what did Elin find in the tin box?"}]
        first, total, ext_answer, usage, cache = ttft(port, turn2)
        rows.append(("extended by one turn", first, total, usage, cache))
        stop(p)
        p, port = start(args.ds4, kv, args.threads, 8192)
        first, total, again, usage, cache = ttft(port, turn2)
        rows.append(("after a restart (extended)", first, total, usage, cache))
        stop(p)
    print(f"{'request':<28} {'ttft s':>8} {'total s':>8} {'prompt':>7} {'cached':>7}  x-ds4-cache")
    for name, first, total, usage, cache in rows:
        print(f"{name:<28} {first:>8.2f} {total:>8.2f} {usage['prompt_tokens']:>7} "
              f"{usage['prompt_tokens_details']['cached_tokens']:>7}  {cache}")
    print("restart output equals the uninterrupted one:", again == ext_answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
