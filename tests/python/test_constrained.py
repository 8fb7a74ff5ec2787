"""Constrained decoding through the official SDKs: a forced tool call always
names a declared tool with arguments valid against its schema, in every dialect,
and structured output (`response_format`, `text.format`, `output_format`) is
always valid against its schema. The small default model left alone invents
tool names and keys without end; the grammar is what is tested here.

The schemas are varied on purpose (every JSON type, enums, arrays, nested and
optional properties, several tools to choose from) and drawn from a fixed seed,
so a failure names a case that can be re-run.
"""

import json
import random

import jsonschema
import pytest

CASES = 50
SEED = 20261201

# Argument schemas of the tools the cases pick from.
TOOLS = {
    "get_weather": ("Current weather for a city", {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"],
    }),
    "read_file": ("Read a file", {
        "type": "object",
        "properties": {"path": {"type": "string"}, "offset": {"type": "integer", "minimum": 0},
                       "limit": {"type": "integer", "minimum": 1, "maximum": 2000}},
        "required": ["path"],
    }),
    "run_command": ("Run a shell command", {
        "type": "object",
        "properties": {"command": {"type": "string"}, "timeout": {"type": "number"},
                       "background": {"type": "boolean"}},
        "required": ["command", "background"],
    }),
    "search": ("Search the code", {
        "type": "object",
        "properties": {"pattern": {"type": "string"},
                       "globs": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                       "case_sensitive": {"type": "boolean"}},
        "required": ["pattern"],
    }),
    "create_event": ("Create a calendar event", {
        "type": "object",
        "properties": {"title": {"type": "string"},
                       "when": {"type": "object",
                                "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 31},
                                               "month": {"type": "string", "enum": ["jan", "feb", "mar", "apr"]}},
                                "required": ["day", "month"]},
                       "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
        "required": ["title", "when"],
    }),
    "set_volume": ("Set the speaker volume", {
        "type": "object",
        "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["level"],
    }),
    "no_args": ("Take no arguments", {"type": "object", "properties": {}}),
    "tag_items": ("Tag items", {
        "type": "object",
        "properties": {"ids": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 5},
                       "tag": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
        "required": ["ids", "tag"],
    }),
}

QUESTIONS = [
    "What is the weather in Rome?", "Show me the first lines of README.md.",
    "List the files in the current directory.", "Find where main is defined.",
    "Book a meeting with Ana on the 3rd of March.", "Turn the volume down a bit.",
    "Do the thing.", "Tag items 4 and 9 as urgent.", "Hi!", "Delete everything.",
]


def cases():
    rng = random.Random(SEED)
    names = sorted(TOOLS)
    out = []
    for i in range(CASES):
        offered = rng.sample(names, rng.randint(1, 4))
        named = rng.choice(offered) if i % 2 else None
        out.append((i, offered, named, QUESTIONS[i % len(QUESTIONS)]))
    return out


def check_call(case, offered, named, name, arguments):
    assert name in offered, f"case {case}: {name!r} is not one of {offered}"
    if named:
        assert name == named, f"case {case}: {name!r} instead of the named {named!r}"
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, TOOLS[name][1])


@pytest.mark.parametrize("dialect", ["chat", "anthropic", "responses"])
def test_forced_calls_always_parse_and_validate(server, dialect):
    oai, ant = server.openai(), server.anthropic()
    for case, offered, named, question in cases():
        if dialect == "chat":
            tools = [{"type": "function", "function": {"name": n, "description": TOOLS[n][0],
                                                       "parameters": TOOLS[n][1]}} for n in offered]
            choice = {"type": "function", "function": {"name": named}} if named else "required"
            r = oai.chat.completions.create(
                model="ds4", messages=[{"role": "user", "content": question}], tools=tools,
                tool_choice=choice, temperature=0.7, seed=case, max_tokens=200)
            c = r.choices[0]
            assert c.finish_reason == "tool_calls", f"case {case}: {c}"
            for call in c.message.tool_calls:
                check_call(case, offered, named, call.function.name, call.function.arguments)
        elif dialect == "anthropic":
            tools = [{"name": n, "description": TOOLS[n][0], "input_schema": TOOLS[n][1]} for n in offered]
            choice = {"type": "tool", "name": named} if named else {"type": "any"}
            r = ant.messages.create(
                model="ds4", max_tokens=200, messages=[{"role": "user", "content": question}],
                tools=tools, tool_choice=choice, extra_body={"temperature": 0.7})
            assert r.stop_reason == "tool_use", f"case {case}: {r}"
            uses = [b for b in r.content if b.type == "tool_use"]
            assert uses, f"case {case}: {r}"
            for b in uses:
                check_call(case, offered, named, b.name, b.input)
        else:
            tools = [{"type": "function", "name": n, "description": TOOLS[n][0],
                      "parameters": TOOLS[n][1]} for n in offered]
            choice = {"type": "function", "name": named} if named else "required"
            r = oai.responses.create(
                model="ds4", input=question, tools=tools, tool_choice=choice,
                temperature=0.7, max_output_tokens=200)
            calls = [o for o in r.output if o.type == "function_call"]
            assert r.status == "completed" and calls, f"case {case}: {r}"
            for call in calls:
                check_call(case, offered, named, call.name, call.arguments)


# Output schemas of the structured-output cases.
FORMATS = [
    {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
     "required": ["answer", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"},
                                      "capital": {"type": "boolean"}},
     "required": ["city", "population", "capital"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]}},
     "required": ["sentiment"], "additionalProperties": False},
    {"type": "object", "properties": {"steps": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"n": {"type": "integer"}, "text": {"type": "string"}},
        "required": ["n", "text"], "additionalProperties": False}}},
     "required": ["steps"], "additionalProperties": False},
]
PROMPTS = ["Describe Paris.", "Is this review happy: 'great phone'?", "List three fruits.",
           "How do I boil an egg?", "What is 2+2?"]


def test_json_schema_outputs_are_always_valid(server):
    oai = server.openai()
    for i in range(CASES):
        schema = FORMATS[i % len(FORMATS)]
        r = oai.chat.completions.create(
            model="ds4", messages=[{"role": "user", "content": PROMPTS[(i // 5) % len(PROMPTS)]}],
            response_format={"type": "json_schema", "json_schema": {"name": f"f{i}", "schema": schema}},
            temperature=0.7, seed=i, max_tokens=200)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", f"case {i}: {text!r}"
        jsonschema.validate(json.loads(text), schema)


def test_every_dialect_takes_structured_output(server):
    schema = FORMATS[1]
    oai, ant = server.openai(), server.anthropic()
    r = oai.chat.completions.create(
        model="ds4", messages=[{"role": "user", "content": "Describe Rome."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=120)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = oai.responses.create(
        model="ds4", input="Describe Rome.", temperature=0, max_output_tokens=120,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    assert r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)
    r = ant.messages.create(
        model="ds4", max_tokens=120, messages=[{"role": "user", "content": "Describe Rome."}],
        extra_body={"temperature": 0, "output_format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(r.content[0].text), schema)
    # A schema the grammar engine cannot compile is the client's to fix.
    with pytest.raises(Exception) as e:
        oai.chat.completions.create(
            model="ds4", messages=[{"role": "user", "content": "x"}], max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {
                "type": "object", "properties": 5}}})
    assert "400" in str(e.value) or "schema" in str(e.value)
