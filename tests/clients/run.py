#!/usr/bin/env python3
"""The real agent CLIs against `ds4 serve`, end to end (issue #14, item 4).

For each client (Claude Code, Codex CLI, opencode, pinned below) this installs the
pinned npm package into a project-local prefix (.cache/npm-clients, kept between
runs), makes a scratch git repository holding notes.txt, starts `ds4 serve`
behind a small recording proxy, and runs the CLI non-interactively on a task that
needs a tool (read notes.txt). The proxy keeps every request and response, and
restarts the server (SIGTERM: shutdown save; then a fresh process on the same
checkpoint store) just before the first request that carries a tool result. A run
passes when:

- every response is 2xx;
- the model called a tool, the client executed it, and a later request carries
  its result (matched by call id);
- every main-thread request from the second on (the requests that carry the
  tool list; side requests such as titles are reported apart) reused >= 90% of
  its prompt tokens (`x-ds4-cache: SOURCE; reused=N; prompt=M`), or all of the
  previous request's prompt and reply (what is left is the tool result the
  client added);
- the first request after the restart was restored from disk (`disk-*`).

The model is tiny (SmolLM2-135M): it does not always answer with a tool call, so
each client gets a few attempts (fresh client sessions against the same server;
the server samples with a clock seed when the client sends none). The report
says how many attempts each client needed. Standard library only.

`--save-fixtures` writes each passing session's requests to
tests/vectors/clients/<client>-<version>-session.json (scratch paths replaced by
/home/user/...), which crates/cli/tests/serve_clients.rs replays without npm.
"""

import argparse
import http.client
import http.server
import json
import os
import re
import shutil
import signal
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PREFIX = REPO / ".cache" / "npm-clients"
FIXTURES = REPO / "tests" / "vectors" / "clients"
DS4_BIN = Path(os.environ.get("DS4_BIN", REPO / "target" / "release" / "ds4"))
LISTENING = "ds4 serve: listening on http://"

# name -> (npm package, version, binary)
CLIENTS = {
    "claude-code": ("@anthropic-ai/claude-code", "2.1.197", "claude"),
    "codex": ("@openai/codex", "0.171.0", "codex"),
    "opencode": ("opencode-ai", "1.18.33", "opencode"),
}

NUMBER = "7491"
NOTES = f"Inventory count for the warehouse audit: {NUMBER}\n"

# Output limit each client is configured with (a client option in each), so a
# small model cannot fill the context with one answer.
OUTPUT_TOKENS = 768
CTX = 32768
HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def log(msg):
    print(f"[clients {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------- npm


def installed_version(pkg):
    f = PREFIX / "node_modules" / pkg / "package.json"
    try:
        return json.loads(f.read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None


def install(names):
    missing = [
        f"{CLIENTS[n][0]}@{CLIENTS[n][1]}"
        for n in names
        if installed_version(CLIENTS[n][0]) != CLIENTS[n][1]
    ]
    if missing:
        log(f"npm install {' '.join(missing)} into {PREFIX}")
        PREFIX.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["npm", "install", "--prefix", str(PREFIX), "--save-exact", "--no-audit",
             "--no-fund", "--loglevel", "error", *missing],
            check=True,
        )  # fmt: skip
    for n in names:
        pkg, ver, _ = CLIENTS[n]
        got = installed_version(pkg)
        if got != ver:
            sys.exit(f"{pkg}: installed {got}, pinned {ver}")


# ------------------------------------------------------------------ server


class Server:
    """One `ds4 serve` process on a free port; restart() keeps the store."""

    def __init__(self, work, args):
        self.work = work
        self.args = args
        self.generation = 0
        self.proc = None
        self.port = None
        self.logs = []
        self.start()

    def start(self):
        self.generation += 1
        trace = self.work / f"trace-{self.generation}.jsonl"
        errlog = open(self.work / f"serve-{self.generation}.log", "w")
        cmd = [str(DS4_BIN), "serve", "--port", "0", "--trace", str(trace), *self.args]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        ready = threading.Event()
        self.port = None

        def drain(proc=self.proc):
            for line in proc.stderr:
                errlog.write(line)
                errlog.flush()
                if self.port is None and line.startswith(LISTENING):
                    self.port = int(line.strip().rsplit(":", 1)[1])
                    ready.set()
            ready.set()
            errlog.close()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(120) or self.port is None:
            self.proc.kill()
            raise RuntimeError(f"ds4 serve did not start: {' '.join(cmd)}")
        log(f"ds4 serve #{self.generation} on port {self.port}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                raise RuntimeError("ds4 serve ignored SIGTERM for 300 s") from None
            if code != 0:
                raise RuntimeError(f"ds4 serve exited with {code}")

    def restart(self):
        t = time.monotonic()
        self.stop()
        self.start()
        log(f"restarted ds4 serve in {time.monotonic() - t:.1f} s")

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------------- proxy


def tool_results(body):
    """Call ids whose results the request body carries, in any dialect."""
    ids = []
    for m in body.get("messages") or []:
        if m.get("role") == "tool" and m.get("tool_call_id"):
            ids.append(m["tool_call_id"])
        if isinstance(m.get("content"), list):
            for b in m["content"]:
                if isinstance(b, dict) and b.get("type") == "tool_result":
                    ids.append(b.get("tool_use_id"))
    inp = body.get("input")
    if isinstance(inp, list):
        for it in inp:
            if isinstance(it, dict) and it.get("type") == "function_call_output" and it.get("call_id"):
                ids.append(it.get("call_id"))
    return ids


def tool_calls(path, text):
    """(id, name, arguments) of the tool calls in a response body (SSE or JSON)."""
    calls = {}
    payloads = []
    if text.lstrip().startswith("{"):
        try:
            payloads = [json.loads(text)]
        except ValueError:
            payloads = []
    else:
        for line in text.splitlines():
            if line.startswith("data: ") and line[6:].strip() != "[DONE]":
                try:
                    payloads.append(json.loads(line[6:]))
                except ValueError:
                    pass
    for p in payloads:
        # Anthropic
        cb = p.get("content_block") or {}
        if cb.get("type") == "tool_use":
            calls[cb["id"]] = [cb["name"], ""]
        if p.get("type") == "content_block_delta":
            d = p.get("delta") or {}
            if d.get("type") == "input_json_delta":
                last = list(calls)[-1]
                calls[last][1] += d.get("partial_json", "")
        for b in p.get("content") or []:
            if isinstance(b, dict) and b.get("type") == "tool_use":
                calls[b["id"]] = [b["name"], json.dumps(b.get("input"))]
        # Responses
        item = p.get("item") or {}
        if p.get("type") == "response.output_item.done" and item.get("type") == "function_call":
            calls[item["call_id"]] = [item["name"], item.get("arguments", "")]
        # Chat completions
        for ch in p.get("choices") or []:
            for tc in (ch.get("delta") or ch.get("message") or {}).get("tool_calls") or []:
                if tc.get("id"):
                    calls[tc["id"]] = [tc["function"]["name"], ""]
                    key = tc["id"]
                else:
                    key = list(calls)[-1]
                calls[key][1] += (tc.get("function") or {}).get("arguments") or ""
    return [(k, v[0], v[1]) for k, v in calls.items()]


class Recorder:
    """The proxy's state: the upstream server, the records, the restart hook."""

    def __init__(self, server):
        self.server = server
        self.records = []
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.in_flight = 0
        self.restart_pending = False
        self.restarted_before = None  # index of the first request after the restart

    def before(self, rec):
        """Restart the server before the first request carrying a tool result."""
        with self.lock:
            if not (self.restart_pending and rec["tool_results"]):
                self.in_flight += 1
                return
            self.restart_pending = False
            while self.in_flight:
                self.idle.wait()
            self.in_flight += 1
            self.restarted_before = rec["index"]
            rec["after_restart"] = True
        log(f"request {rec['index']} carries a tool result: restarting the server first")
        self.server.restart()

    def after(self):
        with self.lock:
            self.in_flight -= 1
            self.idle.notify_all()


def make_handler(recorder):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def handle(self):
            try:
                super().handle()
            except ConnectionError:
                pass  # a client closing an idle keep-alive connection

        def _body(self):
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        self.rfile.readline()
                        return out
                    out += self.rfile.read(size)
                    self.rfile.readline()
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _proxy(self):
            raw = self._body()
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = None
            with recorder.lock:
                index = len(recorder.records)
                rec = {
                    "index": index,
                    "method": self.command,
                    "path": self.path,
                    "headers": {k.lower(): v for k, v in self.headers.items()},
                    "body": body if body is not None else raw.decode("utf-8", "replace"),
                    "tool_results": tool_results(body) if isinstance(body, dict) else [],
                    "t0": time.time(),
                }
                recorder.records.append(rec)
            recorder.before(rec)
            try:
                self._forward(rec, raw)
            finally:
                rec["seconds"] = round(time.time() - rec["t0"], 2)
                recorder.after()

        def _forward(self, rec, raw):
            conn = http.client.HTTPConnection("127.0.0.1", recorder.server.port, timeout=3600)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
            headers["Host"] = f"127.0.0.1:{recorder.server.port}"
            headers["Content-Length"] = str(len(raw))
            try:
                conn.request(self.command, self.path, body=raw or None, headers=headers)
                resp = conn.getresponse()
            except OSError as e:
                rec["status"] = 502
                rec["response"] = f"proxy: {e}"
                self.send_response(502)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            rec["status"] = resp.status
            rec["x_ds4_cache"] = resp.getheader("x-ds4-cache")
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in HOP:
                    self.send_header(k, v)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            got = []
            while True:
                chunk = resp.read1(65536) if self.command != "HEAD" else b""
                if not chunk:
                    break
                got.append(chunk)
                try:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                except OSError:
                    rec["client_gone"] = True
                    break
            try:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                pass
            conn.close()
            rec["response"] = b"".join(got).decode("utf-8", "replace")
            rec["tool_calls"] = tool_calls(self.path, rec["response"])

        do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = _proxy

    return Handler


class Proxy(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


# ----------------------------------------------------------------- clients


def scratch_repo(d):
    d.mkdir(parents=True, exist_ok=True)
    (d / "notes.txt").write_text(NOTES)
    (d / "README.md").write_text("# audit\n\nScratch project for the ds4 client tests.\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "ds4", "GIT_AUTHOR_EMAIL": "ds4@localhost",
           "GIT_COMMITTER_NAME": "ds4", "GIT_COMMITTER_EMAIL": "ds4@localhost",
           "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
           "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}  # fmt: skip
    if not (d / ".git").exists():
        subprocess.run(["git", "init", "-q", "-b", "main"], cwd=d, check=True, env=env)
        subprocess.run(["git", "add", "."], cwd=d, check=True, env=env)
        subprocess.run(["git", "commit", "-qm", "notes"], cwd=d, check=True, env=env)
    # Undo what an earlier attempt changed, so every attempt sends the same prompt.
    subprocess.run(["git", "checkout", "-q", "--", "."], cwd=d, check=True, env=env)
    subprocess.run(["git", "clean", "-qfdx"], cwd=d, check=True, env=env)


def client_command(name, url, home, repo):
    """(argv, env) running client `name` non-interactively against `url`."""
    bin_ = PREFIX / "node_modules" / ".bin" / CLIENTS[name][2]
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "TERM": "dumb",
        "NO_COLOR": "1",
        "LANG": "C.UTF-8",
    }
    if name == "claude-code":
        env.update({
            "ANTHROPIC_BASE_URL": url,
            "ANTHROPIC_API_KEY": "ds4-test",
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(OUTPUT_TOKENS),
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "API_TIMEOUT_MS": "3600000",
            # Its stream watchdogs count events, not the server's keep-alive
            # comments: without these it drops a 21k-token cold prefill after
            # ~300 s and retries (the retry resumes from the continued save).
            "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "3600000",
            "CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": "3600000",
        })  # fmt: skip
        task = "Use the Read tool to read notes.txt, then tell me the number in it."
        # Two turns: the forced call and the answer to its result (each later
        # turn is another 768 tokens at ~22k tokens of context, ~100 s here).
        argv = [str(bin_), "-p", task, "--max-turns", "2", "--output-format", "text"]
        return argv, env
    if name == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(
            'model = "ds4"\n'
            'model_provider = "ds4"\n'
            "model_context_window = %d\n"
            'approval_policy = "never"\n'
            'sandbox_mode = "danger-full-access"\n'
            "[model_providers.ds4]\n"
            'name = "ds4"\n'
            f'base_url = "{url}/v1"\n'
            'wire_api = "responses"\n'
            'env_key = "DS4_API_KEY"\n'
            "request_max_retries = 0\n"
            "stream_max_retries = 0\n"
            "stream_idle_timeout_ms = 3600000\n" % CTX
        )
        env.update({"CODEX_HOME": str(codex_home), "DS4_API_KEY": "ds4-test"})
        task = "Run `cat notes.txt` in the shell, then tell me the number in it."
        argv = [str(bin_), "exec", "--skip-git-repo-check", task]
        return argv, env
    if name == "opencode":
        cfg = {
            "$schema": "https://opencode.ai/config.json",
            "model": "ds4/ds4",
            "small_model": "ds4/ds4",
            "autoupdate": False,
            "share": "disabled",
            "provider": {
                "ds4": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "ds4",
                    "options": {"baseURL": f"{url}/v1", "apiKey": "ds4-test"},
                    "models": {
                        "ds4": {"name": "ds4", "limit": {"context": CTX, "output": OUTPUT_TOKENS}}
                    },
                }
            },
        }
        f = home / "opencode.json"
        f.write_text(json.dumps(cfg, indent=1))
        env.update({
            "OPENCODE_CONFIG": str(f),
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
        })  # fmt: skip
        task = "Use the read tool to read notes.txt, then tell me the number in it."
        argv = [str(bin_), "run", task]
        return argv, env
    raise ValueError(name)


def reuse(rec):
    """(source, reused, prompt) from the x-ds4-cache header, or None."""
    h = rec.get("x_ds4_cache")
    if not h:
        return None
    m = re.match(r"\s*([\w-]+);\s*reused=(\d+);\s*prompt=(\d+)", h)
    return (m.group(1), int(m.group(2)), int(m.group(3))) if m else None


def output_tokens(rec):
    """Tokens the server generated for `rec` (its usage: the last count in the
    response, whichever dialect), 0 if none is found."""
    counts = re.findall(r'"(?:output_tokens|completion_tokens)":\s*(\d+)', rec.get("response") or "")
    return int(counts[-1]) if counts else 0


def judge(records, restarted_before):
    """Failures of one attempt's records, and its summary lines."""
    fails, lines = [], []
    main = [r for r in records if isinstance(r["body"], dict) and r["body"].get("tools")]
    for r in records:
        u = reuse(r)
        kind = "main" if r in main else "side"
        calls = ", ".join(f"{n}({a})" for _, n, a in r.get("tool_calls") or [])
        lines.append(
            f"  #{r['index']} {r['method']} {r['path']} {kind} -> {r.get('status')} "
            + (f"{u[0]} reused {u[1]}/{u[2]} " if u else "")
            + f"{r.get('seconds', '?')} s"
            + (f" results={r['tool_results']}" if r["tool_results"] else "")
            + (f" calls: {calls}" if calls else "")
            + (" [after restart]" if r["index"] == restarted_before else "")
        )
        if not 200 <= (r.get("status") or 0) < 300:
            fails.append(f"request #{r['index']} {r['path']} answered {r.get('status')}: "
                         f"{str(r.get('response'))[:300]}")  # fmt: skip
    called = {i: n for r in records for i, n, _ in r.get("tool_calls") or []}
    answered = {i for r in records for i in r["tool_results"] if i in called}
    if not called:
        fails.append("the model called no tool")
    elif not answered:
        fails.append(f"tool calls {sorted(called)} but no later request carries a result")
    for k, (prev, r) in enumerate(zip(main, main[1:]), 2):
        u, held = reuse(r), reuse(prev)
        # All of the previous turn (its prompt and the reply) counts as well as
        # 90%: a long tool result is a new tail the client adds (Codex's
        # create_goal answers with ~1,300 tokens), not a miss of the cache.
        whole = held is not None and u is not None and u[1] + 2 >= held[2] + output_tokens(prev)
        if u is None or u[2] == 0 or (u[1] < 0.9 * u[2] and not whole):
            fails.append(f"main turn {k} (request #{r['index']}) reused {u} (< 90%, "
                         f"and less than the previous turn's {held} + its reply)")  # fmt: skip
    if restarted_before is None:
        fails.append("no restart happened (no request carried a tool result)")
    else:
        r = next(r for r in records if r["index"] == restarted_before)
        u = reuse(r)
        if u is None or not u[0].startswith("disk"):
            fails.append(f"request #{r['index']} after the restart came from {u}, not disk")
    return fails, lines


def cut_at_output_limit(records):
    """Whether the last response was incomplete for its output limit."""
    last = records[-1].get("response") if records else None
    return isinstance(last, str) and '"incomplete_details":{"reason":"max_output_tokens"}' in last


def run_client(name, work, serve_args, attempts, timeout):
    """Attempts until one passes; returns (passed, attempt records, report lines)."""
    home = work / "home"
    repo = home / "project"
    home.mkdir(parents=True, exist_ok=True)
    server = Server(work, ["--kv-disk-dir", str(work / "kv"), *serve_args])
    recorder = Recorder(server)
    proxy = Proxy(("127.0.0.1", 0), make_handler(recorder))
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{proxy.server_address[1]}"
    report, best = [], None
    try:
        for attempt in range(1, attempts + 1):
            scratch_repo(repo)
            argv, env = client_command(name, url, home, repo)
            start = len(recorder.records)
            recorder.restart_pending = True
            recorder.restarted_before = None
            t = time.monotonic()
            log(f"{name} attempt {attempt}: {' '.join(argv[:2])} ...")
            try:
                p = subprocess.run(argv, cwd=repo, env=env, stdin=subprocess.DEVNULL,
                                   capture_output=True, text=True, timeout=timeout)  # fmt: skip
                out, code = (p.stdout + p.stderr).strip(), p.returncode
            except subprocess.TimeoutExpired as e:
                out, code = f"timed out after {timeout} s: {e.stdout or ''}", "timeout"
            took = time.monotonic() - t
            with recorder.lock:
                records = recorder.records[start:]
            (work / f"requests-{attempt}.json").write_text(json.dumps(records, indent=1))
            fails, lines = judge(records, recorder.restarted_before)
            # The driver's own caps end a run with exit 1 after every request was
            # checked above: Claude Code's --max-turns (a model that keeps calling
            # tools), and Codex's answer to an incomplete response, which is
            # what an answer cut at the server's --tokens is.
            capped = (name == "claude-code" and "Reached max turns" in out) or (
                name == "codex" and cut_at_output_limit(records)
            )
            if code != 0 and not capped:
                fails.append(f"client exit {code}")
            report.append(f"{name} attempt {attempt}: {len(records)} requests, {took:.0f} s, "
                          f"exit {code}, {'PASS' if not fails else 'FAIL'}")  # fmt: skip
            report += lines
            report += [f"  fail: {f}" for f in fails]
            report.append("  client said: " + " | ".join(out.splitlines()[-6:])[:600])
            log("\n".join(report[-(len(lines) + len(fails) + 2):]))
            best = (not fails, records, home)
            if not fails:
                break
    finally:
        proxy.shutdown()
        server.stop()
    return best[0], best[1], best[2], report


def sanitize(obj, home):
    s = json.dumps(obj, ensure_ascii=False)
    s = s.replace(str(home / "project"), "/home/user/project").replace(str(home), "/home/user")
    return json.loads(s)


def save_fixture(name, records, home):
    pkg, ver, _ = CLIENTS[name]
    keep = ("content-type", "anthropic-version", "anthropic-beta", "x-session-affinity",
            "x-session-id", "session_id", "originator", "openai-beta", "user-agent")  # fmt: skip
    out = {
        "client": f"{pkg}@{ver}",
        "recorded": time.strftime("%Y-%m-%d"),
        "requests": [],
    }
    for r in records:
        if r["method"] != "POST":
            continue
        out["requests"].append({
            "method": r["method"],
            "path": r["path"],
            "headers": {k: v for k, v in r["headers"].items() if k in keep},
            "body": r["body"],
            "status": r.get("status"),
            "x_ds4_cache": r.get("x_ds4_cache"),
            "tool_calls": [{"id": i, "name": n, "arguments": a}
                           for i, n, a in r.get("tool_calls") or []],
            "tool_results": r["tool_results"],
            "after_restart": r.get("after_restart", False),
        })  # fmt: skip
    f = FIXTURES / f"{name}-{ver}-session.json"
    f.write_text(json.dumps(sanitize(out, home), indent=1, ensure_ascii=False) + "\n")
    log(f"wrote {f.relative_to(REPO)} ({f.stat().st_size} bytes)")


# Every client on the README's serve command (SmolLM2 at --ctx 32768: Claude
# Code's default prompt is ~21k tokens), plus: --tokens for Codex, which sends no
# output limit; --tool-first, because the 135M model does not open a tool call on
# its own (0 of 20 tries on these prompts): the first request of a user turn is
# answered with a call, the model choosing the tool and its arguments under the
# call grammar, and the request bringing the result back is answered freely.
SERVE = ["--ctx", str(CTX), "--tokens", str(OUTPUT_TOKENS), "--tool-first"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default=",".join(CLIENTS))
    ap.add_argument("--attempts", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per client run")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--save-fixtures", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    a = ap.parse_args()
    names = [n for n in a.clients.split(",") if n]
    for n in names:
        if n not in CLIENTS:
            sys.exit(f"unknown client {n}; known: {', '.join(CLIENTS)}")
    if not DS4_BIN.is_file():
        sys.exit(f"{DS4_BIN} is missing: cargo build --release -p ds4-cli")
    install(names)
    # Under the repository, not /tmp: Codex refuses to set up its helpers in a
    # temporary directory.
    (REPO / ".cache").mkdir(exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="clients-", dir=REPO / ".cache"))
    summary, ok = [], True
    try:
        for n in names:
            t = time.monotonic()
            passed, records, home, report = run_client(
                n, root / n, ["--threads", a.threads, *SERVE], a.attempts, a.timeout
            )
            summary += report
            summary.append(f"{n}: {'PASS' if passed else 'FAIL'} in {time.monotonic() - t:.0f} s")
            ok &= passed
            if passed and a.save_fixtures:
                save_fixture(n, records, home)
    finally:
        print("\n".join(summary), flush=True)
        if a.keep or not ok:
            print(f"scratch kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
