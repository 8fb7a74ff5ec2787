"""Prompt-cache usage numbers on a long prompt, in all three dialects.

One long system prompt (over 1024 tokens) is shared by every request here, so
after the first cold prefill each dialect finds it in the live session. Each
dialect sends a first turn and then a second request that extends it (the first
prompt, the assistant's reply and a new user turn): the second must report at
least 1024 prompt tokens as cached.
"""

import pytest

from conftest import FOLLOW_UP, LONG_QUESTION, LONG_SYSTEM

MIN_CACHED = 1024
# The anthropic SDK (2.x) has no `temperature` parameter any more; ds4 still
# honours the field, so greedy decoding is asked for in the body.
T0 = {"temperature": 0}


def openai_turns(reply=None):
    m = [
        {"role": "system", "content": LONG_SYSTEM},
        {"role": "user", "content": LONG_QUESTION},
    ]
    if reply is not None:
        m += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": FOLLOW_UP},
        ]
    return m


def chat(oai, messages):
    return oai.chat.completions.create(
        model="ds4", messages=messages, temperature=0, max_tokens=16
    )


@pytest.fixture(scope="module")
def cold(oai, server):
    """The first request: prefills the long prompt from scratch."""
    r = chat(oai, openai_turns())
    assert r.usage.prompt_tokens >= MIN_CACHED + 16, r.usage
    return r


def test_openai_chat_cached_tokens(oai, cold):
    assert cold.usage.prompt_tokens_details.cached_tokens < MIN_CACHED
    r = chat(oai, openai_turns(cold.choices[0].message.content))
    u = r.usage
    assert u.prompt_tokens > cold.usage.prompt_tokens
    assert u.prompt_tokens_details.cached_tokens >= MIN_CACHED, u
    assert u.prompt_tokens_details.cached_tokens >= cold.usage.prompt_tokens, u


def anthropic_turns(reply=None):
    m = [{"role": "user", "content": LONG_QUESTION}]
    if reply is not None:
        # Not the OpenAI test's follow-up: both render the same prompt, and the
        # whole of that conversation is then held (in a slot, or its turn-end
        # checkpoint), so nothing would be new here.
        m += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": FOLLOW_UP + " Answer briefly."},
        ]
    return m


def test_anthropic_cache_read_input_tokens(ant, cold):
    def create(messages):
        return ant.messages.create(
            model="ds4", system=LONG_SYSTEM, messages=messages, max_tokens=16, extra_body=T0
        )

    first = create(anthropic_turns())
    # The system prompt is already in the live session (the chat request before).
    assert first.usage.cache_read_input_tokens >= MIN_CACHED, first.usage
    second = create(anthropic_turns(first.content[0].text))
    u = second.usage
    assert u.cache_read_input_tokens >= MIN_CACHED, u
    first_total = (
        first.usage.input_tokens
        + first.usage.cache_read_input_tokens
        + first.usage.cache_creation_input_tokens
    )
    assert u.cache_read_input_tokens >= first_total, (first.usage, u)
    assert u.input_tokens + u.cache_creation_input_tokens > 0


def test_responses_cached_tokens(oai, cold):
    def create(input):
        return oai.responses.create(
            model="ds4", instructions=LONG_SYSTEM, input=input, temperature=0, max_output_tokens=16
        )

    first = create(LONG_QUESTION)
    assert first.usage.input_tokens_details.cached_tokens >= MIN_CACHED, first.usage
    second = create(
        [
            {"role": "user", "content": LONG_QUESTION},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": FOLLOW_UP},
        ]
    )
    u = second.usage
    assert u.input_tokens_details.cached_tokens >= MIN_CACHED, u
    assert u.input_tokens_details.cached_tokens >= first.usage.input_tokens, (first.usage, u)
