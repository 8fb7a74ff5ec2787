#!/usr/bin/env python3
"""Seconds from starting `ds4 agent` to its first prompt, in a pseudo-terminal:
cold (an empty agent dir: the system prompt and tool list are prefilled and
saved as agent-system) and warm (the same dir again: restored from disk).

    python3 bench/agent_startup.py [--runs N] [-- extra ds4 agent args]

Standard library only; runs target/release/ds4 (build it first)."""

import argparse
import os
import pty
import select
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def to_prompt(argv):
    """Seconds until the agent prints its prompt; then /exit."""
    t = time.time()
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(argv[0], argv)
    buf = b""
    while b"> " not in buf:
        r, _, _ = select.select([fd], [], [], 60)
        if not r:
            raise SystemExit("no prompt within 60 s:\n" + buf.decode(errors="replace"))
        buf += os.read(fd, 4096)
    dt = time.time() - t
    os.write(fd, b"/exit\n")
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass
    os.waitpid(pid, 0)
    return dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("extra", nargs="*")
    a = ap.parse_args()
    ds4 = os.path.join(ROOT, "target", "release", "ds4")
    cold, warm = [], []
    for _ in range(a.runs):
        home = tempfile.mkdtemp(prefix="ds4-agent-startup-")
        argv = [ds4, "agent", "--agent-dir", home, *a.extra]
        cold.append(to_prompt(argv))
        warm.append(to_prompt(argv))
        shutil.rmtree(home)
    fmt = lambda xs: ", ".join(f"{x:.3f}" for x in xs)
    print(f"cold (prefill + save agent-system): {fmt(cold)} s")
    print(f"warm (agent-system restored):       {fmt(warm)} s")


if __name__ == "__main__":
    sys.exit(main())
