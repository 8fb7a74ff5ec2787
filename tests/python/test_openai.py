"""The official `openai` Python SDK against `ds4 serve`: chat completions,
legacy completions and the Responses API, each plain and streamed."""

import json
import urllib.request

import openai
import pytest

QUESTION = "What is the capital of France?"


def chat(oai, **kw):
    return oai.chat.completions.create(
        model="ds4",
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=24,
        **kw,
    )


@pytest.fixture(scope="module")
def chat_answer(oai):
    return chat(oai)


def test_chat_completion(chat_answer):
    r = chat_answer
    assert r.object == "chat.completion"
    assert r.model == "ds4"
    assert len(r.choices) == 1
    msg = r.choices[0].message
    assert msg.role == "assistant"
    assert "Paris" in msg.content
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 0 and u.completion_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert 0 <= u.prompt_tokens_details.cached_tokens <= u.prompt_tokens


def test_chat_completion_stream(oai, chat_answer):
    # The same request again, so the whole prompt is reused from the live session.
    chat(oai)
    stream = chat(oai, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks, "no chunks"
    ids = {c.id for c in chunks}
    assert len(ids) == 1, ids
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_answer.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [chat_answer.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == []
    u = last.usage
    assert u is not None
    assert u.prompt_tokens == chat_answer.usage.prompt_tokens
    assert u.completion_tokens == chat_answer.usage.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == u.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_legacy_completion(oai):
    r = oai.completions.create(
        model="ds4", prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert r.object == "text_completion"
    assert "Paris" in r.choices[0].text
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0
    assert 0 < r.usage.completion_tokens <= 8


def responses_create(oai, **kw):
    return oai.responses.create(
        model="ds4", input=QUESTION, temperature=0, max_output_tokens=24, **kw
    )


@pytest.fixture(scope="module")
def responses_answer(oai):
    return responses_create(oai)


def test_responses(responses_answer):
    r = responses_answer
    assert r.object == "response"
    assert r.status in ("completed", "incomplete")
    assert "Paris" in r.output_text
    assert r.output[0].type == "message"
    assert r.output[0].role == "assistant"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert 0 <= r.usage.input_tokens_details.cached_tokens <= r.usage.input_tokens


def test_responses_previous_response_id_continues_the_conversation(oai, responses_answer):
    """The SDK's stateful flow: only the new input, the rest from the stored
    response; the prompt is the first response's whole conversation plus the
    new turn, and the live state serves all of it."""
    first = responses_answer
    assert first.store is True
    nxt = oai.responses.create(
        model="ds4", input="And of Italy?", previous_response_id=first.id,
        temperature=0, max_output_tokens=16,
    )
    assert nxt.previous_response_id == first.id
    assert nxt.usage.input_tokens > first.usage.total_tokens
    assert nxt.usage.input_tokens_details.cached_tokens >= first.usage.total_tokens - 1
    assert nxt.output_text


EVENT_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def test_responses_stream_helper(oai, responses_answer):
    # openai-python's get_final_response() only accepts a stream that ends in
    # `response.completed` (a `response.incomplete` stream raises RuntimeError in
    # the SDK, openai/openai-python#3538), so this needs an answer that ends.
    assert responses_answer.status == "completed", responses_answer
    with oai.responses.stream(
        model="ds4", input=QUESTION, temperature=0, max_output_tokens=24
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    terminal = "response.completed"
    # Collapse the deltas and check the order of the rest.
    collapsed = [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]
    assert collapsed == EVENT_ORDER + [terminal], types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == responses_answer.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == deltas
    assert final.output_text == responses_answer.output_text
    assert final.status == responses_answer.status
    assert final.usage.output_tokens == responses_answer.usage.output_tokens


def test_responses_create_stream(oai, responses_answer):
    events = list(responses_create(oai, stream=True))
    assert events[0].type == "response.created"
    assert events[0].response.status == "in_progress"
    assert events[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == responses_answer.output_text
    assert events[-1].response.output_text == responses_answer.output_text


def test_responses_stream_cut_by_max_output_tokens(oai):
    events = list(
        oai.responses.create(
            model="ds4", input="Tell me a long story.", temperature=0, max_output_tokens=3, stream=True
        )
    )
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.usage.output_tokens == 3
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert last.response.output_text == text


def test_chat_stream_splits_no_multibyte_character(oai):
    # Emoji are several byte-level tokens each: a delta must never carry half of one.
    messages = [{"role": "user", "content": "Répète: « Ça coûte 5 € à Zürich » 😀🎉"}]
    plain = oai.chat.completions.create(
        model="ds4", messages=messages, temperature=0, max_tokens=16
    ).choices[0].message.content
    deltas = [
        c.choices[0].delta.content or ""
        for c in oai.chat.completions.create(
            model="ds4", messages=messages, temperature=0, max_tokens=16, stream=True
        )
        if c.choices
    ]
    assert "".join(deltas) == plain
    assert any(ord(ch) > 0xFFFF for ch in plain), plain  # the test means something
    # Only the very end may hold a U+FFFD: the bytes of a character that
    # max_tokens cut in half (the server flushes them as one replacement char).
    texts = [d for d in deltas if d]
    assert not any("\ufffd" in d for d in texts[:-1]), deltas


def test_unsupported_options_are_sdk_errors(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model="ds4", messages=[{"role": "user", "content": "hi"}], n=17
        )
    assert e.value.status_code == 400
    assert e.value.body["param"] == "n"
    assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model="ds4", input="hi", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"
    assert e.value.body["code"] == "previous_response_not_found"


def _native(oai, path, body):
    """POST to one of the server's llama.cpp routes (outside /v1)."""
    root = str(oai.base_url).rstrip("/").removesuffix("/v1")
    req = urllib.request.Request(
        root + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def test_logit_bias(oai):
    """The SDK's `logit_bias` (ids as strings): -100 bans the greedy answer's
    first token, +100 makes every step one token, 101 is refused by name."""

    def complete(**kw):
        kw.setdefault("max_tokens", 6)
        r = oai.completions.create(
            model="ds4", prompt="The capital of France is", temperature=0, **kw
        )
        return r.choices[0].text

    def first_token(text):
        return _native(oai, "/tokenize", {"content": text})["tokens"][0]

    t0 = first_token(complete())
    assert first_token(complete(logit_bias={str(t0): -100})) != t0
    forced = next(t for t in map(first_token, [" Berlin", " Rome"]) if t != t0)
    piece = _native(oai, "/detokenize", {"tokens": [forced]})["content"]
    assert complete(logit_bias={str(forced): 100}, max_tokens=3) == piece * 3
    with pytest.raises(openai.BadRequestError) as e:
        complete(logit_bias={"5": 101})
    assert e.value.body["param"] == "logit_bias"


def test_logprobs(oai):
    """Log-probabilities as the SDK reads them: chat's content tokens (their
    bytes make the answer, the best alternative is greedy's choice) and the
    legacy completion's lists, streamed alike."""
    r = chat(oai, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert b"".join(bytes(t.bytes) for t in content).decode() == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob == t.logprob <= 0
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
    assert chat(oai).choices[0].logprobs is None
    streamed = [
        t.logprob
        for c in chat(oai, logprobs=True, stream=True)
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert streamed == [t.logprob for t in content]

    c = oai.completions.create(
        model="ds4", prompt="The capital of France is", temperature=0, max_tokens=6, logprobs=3
    ).choices[0]
    assert "".join(c.logprobs.tokens) == c.text
    assert len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) == len(c.logprobs.text_offset)
    assert all(max(top.values()) == lp for top, lp in zip(c.logprobs.top_logprobs, c.logprobs.token_logprobs))
    with pytest.raises(openai.BadRequestError) as e:
        chat(oai, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"


def test_echo_scores_a_continuation_as_lm_eval_does(oai):
    """lm-eval's `local-completions` loglikelihood request through the SDK:
    the context and continuation as token ids, `echo` with `logprobs=1` and
    one generated token; it sums the continuation's log-probabilities
    (`token_logprobs[ctxlen:-1]`) and calls it greedy when each is the best of
    its alternatives. The greedy continuation is greedy and likelier than a
    wrong one."""
    ctx = _native(oai, "/tokenize", {"content": "The capital of France is"})["tokens"]
    greedy = oai.completions.create(model="ds4", prompt=ctx, temperature=0, max_tokens=3)
    answer = _native(oai, "/tokenize", {"content": greedy.choices[0].text})["tokens"]
    wrong = _native(oai, "/tokenize", {"content": " a small green frog"})["tokens"]

    def loglikelihood(cont):
        c = oai.completions.create(
            model="ds4", prompt=[ctx + cont], temperature=0, max_tokens=1, logprobs=1, echo=True, seed=1234
        ).choices[0]
        assert c.text.startswith("The capital of France is")
        assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) == len(ctx) + len(cont) + 1
        scored = c.logprobs.token_logprobs[len(ctx) : -1]
        tops = c.logprobs.top_logprobs[len(ctx) : -1]
        return sum(scored), all(lp == max(top.values()) for lp, top in zip(scored, tops))

    likely, is_greedy = loglikelihood(answer)
    unlikely, wrong_is_greedy = loglikelihood(wrong)
    assert is_greedy and not wrong_is_greedy
    assert likely > unlikely


def test_several_choices(oai):
    """`n` and a batch of prompts as the SDK sends them: the choices in order,
    each what its prompt (choice j: the seed plus j) gives alone, streamed
    alike by index."""
    prompts = ["The capital of France is", "Once upon a time"]
    batch = oai.completions.create(model="ds4", prompt=prompts, temperature=0, max_tokens=5)
    assert [c.index for c in batch.choices] == [0, 1]
    for p, c in zip(prompts, batch.choices):
        alone = oai.completions.create(model="ds4", prompt=p, temperature=0, max_tokens=5)
        assert c.text == alone.choices[0].text

    def sample(**kw):
        return oai.chat.completions.create(
            model="ds4",
            messages=[{"role": "user", "content": "Name an animal."}],
            temperature=1.0,
            max_tokens=8,
            **kw,
        )

    r = sample(n=2, seed=5)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[1].message.content == sample(seed=6).choices[0].message.content
    texts = ["", ""]
    for chunk in sample(n=2, seed=5, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in r.choices]


def test_responses_logprobs(oai):
    """The Responses API's `include` / `top_logprobs`, as the SDK reads them:
    the same tokens as the chat answer to the same question."""
    r = oai.responses.create(
        model="ds4",
        input=QUESTION,
        temperature=0,
        max_output_tokens=24,
        top_logprobs=2,
        include=["message.output_text.logprobs"],
    )
    part = r.output[0].content[0]
    assert "".join(t.token for t in part.logprobs) == part.text
    assert all(len(t.top_logprobs) == 2 for t in part.logprobs)
    assert [t.logprob for t in part.logprobs] == [
        t.logprob for t in chat(oai, logprobs=True).choices[0].logprobs.content
    ]
