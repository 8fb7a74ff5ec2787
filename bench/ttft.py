#!/usr/bin/env python3
"""Time to first token of `ds4 serve` for the agent pattern, the way the llama.cpp
reference numbers in shared/bench were taken: a ~6000-token ChatML prompt sent cold,
repeated identically, extended by one turn, and resent after a server restart; then
the conversation's next turn after a graceful restart and after a `kill -9` (the
store as the server left it once the extended turn's end was saved in the
background), side by side.

usage: bench/ttft.py [--tokens 6000] [--ds4 target/release/ds4] [--threads 2]
Only the standard library; talks to the server over loopback with streaming chat
completions and measures the time from sending the request to the first content
delta.
"""
import argparse
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def start(ds4, kv_dir, threads, ctx):
    p = subprocess.Popen(
        [ds4, "serve", "--port", "0", "--threads", str(threads), "--ctx", str(ctx), "--kv-disk-dir", kv_dir],
        stderr=subprocess.PIPE, text=True)
    for line in p.stderr:
        if line.startswith("ds4 serve: listening on http://"):
            # Keep reading the log (a full pipe would block the server).
            p.log = []
            threading.Thread(target=lambda: p.log.extend(p.stderr), daemon=True).start()
            return p, int(line.rsplit(":", 1)[1])
    raise SystemExit("ds4 serve did not start")


def wait_for_turn_end(p, tokens, timeout=300):
    """Waits for the log line of a turn-end save of at least `tokens` tokens."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        for line in list(p.log):
            if "reason=turn-end" in line:
                n = int(line.split("tokens=")[1].split()[0])
                if n >= tokens:
                    return time.monotonic() - t0
        time.sleep(0.02)
    raise SystemExit(f"no turn-end save of {tokens} tokens in {timeout} s")


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
        saved_after = wait_for_turn_end(p, usage["prompt_tokens"] + usage["completion_tokens"] - 1)
        # What a kill -9 now leaves on disk.
        killed = kv + "-kill9"
        shutil.copytree(kv, killed)
        stop(p)
        p, port = start(args.ds4, kv, args.threads, 8192)
        first, total, again, usage, cache = ttft(port, turn2)
        rows.append(("after a restart (extended)", first, total, usage, cache))
        stop(p)
        turn3 = turn2 + [{"role": "assistant", "content": ext_answer},
                         {"role": "user", "content": "Where did she take it?"}]
        for name, store in [("next turn, graceful restart", kv), ("next turn, kill -9", killed)]:
            p, port = start(args.ds4, store, args.threads, 8192)
            first, total, _, usage, cache = ttft(port, turn3)
            rows.append((name, first, total, usage, cache))
            stop(p)
        shutil.rmtree(killed)
    print(f"{'request':<28} {'ttft s':>8} {'total s':>8} {'prompt':>7} {'cached':>7}  x-ds4-cache")
    for name, first, total, usage, cache in rows:
        print(f"{name:<28} {first:>8.2f} {total:>8.2f} {usage['prompt_tokens']:>7} "
              f"{usage['prompt_tokens_details']['cached_tokens']:>7}  {cache}")
    print("restart output equals the uninterrupted one:", again == ext_answer)
    print(f"turn-end save on disk {saved_after:.2f} s after the extended turn's response")
    print(f"next turn TTFT, kill -9 / graceful: {rows[-1][1] / rows[-2][1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
