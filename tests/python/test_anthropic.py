"""The official `anthropic` Python SDK against `ds4 serve`: Messages, plain and
streamed, and count_tokens."""

import anthropic
import pytest

from conftest import LONG_SYSTEM

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
# The anthropic SDK (2.x) has no `temperature` parameter any more; ds4 still
# honours the field, so greedy decoding is asked for in the body.
T0 = {"temperature": 0}


@pytest.fixture(scope="module")
def answer(ant):
    return ant.messages.create(
        model="ds4", max_tokens=24, messages=MESSAGES, extra_body=T0
    )


def total_input(u):
    return u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens


def test_messages_create(answer):
    m = answer
    assert m.type == "message"
    assert m.role == "assistant"
    assert m.model == "ds4"
    assert m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"]
    assert "Paris" in m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert 0 < m.usage.output_tokens <= 24
    assert total_input(m.usage) > 0


def test_messages_stream(ant, answer):
    with ant.messages.stream(
        model="ds4", max_tokens=24, messages=MESSAGES, extra_body=T0
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == answer.content[0].text
    assert final.content[0].text == text
    assert final.stop_reason == answer.stop_reason
    assert final.usage.output_tokens == answer.usage.output_tokens
    assert total_input(final.usage) == total_input(answer.usage)
    # Same prompt as the request before it: read from the live session.
    assert final.usage.cache_read_input_tokens > 0


def test_messages_stream_events(ant, answer):
    with ant.messages.stream(
        model="ds4", max_tokens=24, messages=MESSAGES, extra_body=T0
    ) as stream:
        types = [e.type for e in stream]
    # The SDK's MessageStream adds its own `text` events after each delta.
    raw = [t for t in types if t != "text"]
    collapsed = [t for i, t in enumerate(raw) if i == 0 or t != raw[i - 1]]
    assert collapsed == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ], types


def test_count_tokens(ant, answer):
    n = ant.messages.count_tokens(model="ds4", messages=MESSAGES)
    assert n.input_tokens == total_input(answer.usage)
    long = ant.messages.count_tokens(model="ds4", system=LONG_SYSTEM, messages=MESSAGES)
    assert long.input_tokens > 1024


def test_unsupported_options_are_sdk_errors(ant):
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(
            model="ds4",
            max_tokens=4,
            messages=MESSAGES,
            tools=[{"name": "f", "input_schema": {"type": "object"}}],
            tool_choice={"type": "tool", "name": "g"},
        )
    assert e.value.status_code == 400
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "unknown tool" in e.value.body["error"]["message"]
