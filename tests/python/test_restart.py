"""The point of the product: a conversation survives a server restart. The second
server resumes the long prompt from the disk checkpoint store instead of
prefilling it again, and answers exactly as the first server did."""

from conftest import FOLLOW_UP, LONG_QUESTION, LONG_SYSTEM


def chat(client, messages):
    raw = client.chat.completions.with_raw_response.create(
        model="ds4", messages=messages, temperature=0, max_tokens=16
    )
    return raw.parse(), raw.headers.get("x-ds4-cache")


def test_restart_resumes_from_disk_with_identical_output(start_server, tmp_path):
    kv = tmp_path / "kv"
    first = [
        {"role": "system", "content": LONG_SYSTEM},
        {"role": "user", "content": LONG_QUESTION},
    ]

    srv = start_server(kv, "first")
    oai = srv.openai()
    r1, _ = chat(oai, first)
    assert r1.usage.prompt_tokens >= 1024
    extension = first + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": FOLLOW_UP},
    ]
    a, header = chat(oai, extension)
    assert header.startswith("memory-"), header
    assert a.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
    log = srv.stop()
    # Each turn's end is saved in the background (the shutdown save then finds
    # the conversation on disk already).
    assert "reason=turn-end" in log, log
    assert list(kv.glob("*.kv")), "no checkpoint files after shutdown"

    srv = start_server(kv, "second")
    b, header = chat(srv.openai(), extension)
    assert header.startswith("disk-text"), header
    cached = b.usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    assert cached >= 1024, b.usage
    assert b.usage.prompt_tokens == a.usage.prompt_tokens
    assert b.choices[0].message.content == a.choices[0].message.content, (
        "restart changed the output"
    )
    assert b.choices[0].finish_reason == a.choices[0].finish_reason

    events = srv.trace_events()
    caches = [e for e in events if e["event"] == "cache"]
    # The turn-end save holds the extension and its reply: whole (`disk-text`)
    # or cut back to the extension (`disk-text-partial`).
    disk = next((e for e in caches if e["cache_source"].startswith("disk-text")), None)
    assert disk is not None, caches
    assert disk["reused_tokens"] == cached
    assert disk["checkpoint_file"].endswith(".kv")
    req = next(e for e in events if e["event"] == "request")
    assert req["generated_text"] == a.choices[0].message.content
    srv.stop()
