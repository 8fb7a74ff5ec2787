"""A tool round trip with the official SDKs: the request forces a call (the small
default model answers poorly on its own, the machinery is what is tested), the
client runs the tool and sends the result back, and the server answers the
second turn reusing the live prefix, with the resent call rendered from the
exact sampled text."""

import json

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
QUESTION = "What is the weather in Paris?"


def test_openai_tool_round_trip(oai):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather for a city",
        "parameters": WEATHER_SCHEMA}}]
    messages = [{"role": "user", "content": QUESTION}]
    first = oai.chat.completions.create(
        model="ds4", messages=messages, tools=tools, temperature=0, max_tokens=48,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_") and len(call.id) == 37
    assert isinstance(json.loads(call.function.arguments), dict)

    # The SDK's own message object goes back, as agents send it.
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"})
    second = oai.chat.completions.with_raw_response.create(
        model="ds4", messages=messages, tools=tools, temperature=0, max_tokens=8)
    assert second.headers["x-ds4-cache"].startswith("memory-")
    body = second.parse()
    assert body.usage.prompt_tokens_details.cached_tokens >= first.usage.total_tokens


def test_openai_streamed_tool_call_deltas(oai):
    stream = oai.chat.completions.create(
        model="ds4", messages=[{"role": "user", "content": QUESTION}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}],
        tool_choice="required", temperature=0, max_tokens=48, stream=True)
    calls, finish = {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    if finish == "tool_calls":
        assert calls[0]["id"].startswith("call_")
        assert isinstance(json.loads(calls[0]["arguments"]), dict)
    else:
        # "required" lets the model pick the name; a garbled call is returned as
        # text, never as an error.
        assert finish in ("stop", "length")


def test_anthropic_tool_round_trip(ant):
    tools = [{"name": "get_weather", "description": "Get the current weather for a city",
              "input_schema": WEATHER_SCHEMA}]
    messages = [{"role": "user", "content": QUESTION}]
    # SDK 2.x has no `temperature` parameter any more; the server still reads it.
    greedy = {"temperature": 0}
    first = ant.messages.create(
        model="ds4", max_tokens=48, messages=messages, tools=tools, extra_body=greedy,
        tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use"
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    assert isinstance(use.input, dict)

    messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]})
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use.id, "content": "18 C and sunny"}]})
    with ant.messages.stream(model="ds4", max_tokens=8, extra_body=greedy,
                             messages=messages, tools=tools) as stream:
        final = stream.get_final_message()
    assert final.usage.cache_read_input_tokens >= first.usage.input_tokens + first.usage.output_tokens
