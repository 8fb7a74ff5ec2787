#!/usr/bin/env python3
"""Two agent-style turns against a running `ds4 serve`: a ~3800-token prompt with a
30-tool list forces a call; the second turn resends the call with its argument keys
reordered and re-indented (as clients re-serialise it) plus a tool result.

Run it against `ds4 serve --ctx 8192` and against `ds4 serve --ctx 8192
--disable-exact-tool-replay` to compare what turn 2 reuses:

    python3 bench/tool_replay.py --port 8000
"""

import argparse
import json
import time
import urllib.request

WORDS = "reads writes lists searches edits moves copies deletes renames inspects".split()


def post(port, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json.dumps(body).encode(),
        {"content-type": "application/json"},
    )
    t = time.time()
    with urllib.request.urlopen(req, timeout=1800) as r:
        return json.load(r), r.headers["x-ds4-cache"], time.time() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8000)
    a = ap.parse_args()
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}_{WORDS[i % 10]}",
        "description": f"This tool {WORDS[i % 10]} files in the workspace. "
        + "It accepts a path and options, validates them carefully, and returns a "
          "structured result describing what happened. " * 3,
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
        for i in range(30)]
    user = {"role": "user", "content": 'Call tool_2_lists with arguments {"path": "/tmp"}.'}
    r1, h1, t1 = post(a.port, {
        "messages": [user], "tools": tools, "temperature": 0, "max_tokens": 96,
        "tool_choice": {"type": "function", "function": {"name": "tool_2_lists"}}})
    calls = r1["choices"][0]["message"].get("tool_calls")
    if not calls:
        raise SystemExit(f"turn 1 made no call: {r1['choices'][0]['message']}")
    c = calls[0]
    print(f"turn 1: {t1:.1f} s, prompt {r1['usage']['prompt_tokens']}, "
          f"total {r1['usage']['total_tokens']}, x-ds4-cache: {h1}")
    args = json.loads(c["function"]["arguments"])
    echoed = dict(c, function=dict(c["function"], arguments=json.dumps(
        dict(reversed(list(args.items()))), indent=1)))
    r2, h2, t2 = post(a.port, {
        "messages": [user, {"role": "assistant", "content": None, "tool_calls": [echoed]},
                     {"role": "tool", "tool_call_id": c["id"], "content": "a.txt\nb.txt"}],
        "tools": tools, "temperature": 0, "max_tokens": 8})
    print(f"turn 2: {t2:.1f} s, prompt {r2['usage']['prompt_tokens']}, "
          f"reused {r2['usage']['prompt_tokens_details']['cached_tokens']}, x-ds4-cache: {h2}")


if __name__ == "__main__":
    main()
