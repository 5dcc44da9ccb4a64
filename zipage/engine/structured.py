"""Structured outputs: each constrained request's grammar matcher, and the mask of its logits.

A request's `SamplingParams.structured_output` (a plain spec from the core) is compiled once per
distinct spec (an LRU cache keyed by the spec) against the model's tokenizer, with xgrammar (the
`structured` extra; docs/BENCHMARKS.md, 'Structured outputs: grammar library cost', says why
this library). The server compiles on a thread of its own (`compile_soon`; xgrammar lets go of
the GIL while it compiles) and adds the request to the step loop once its grammar is ready, so a
slow schema holds up no other request's steps. A request gets its own matcher when it first
samples, so the samples of one prompt (n > 1, forked at that step) each get theirs; the matcher
is advanced by every token the request samples and dropped when it finishes or is aborted. A
preemption keeps the request's output tokens (they are recomputed), so it keeps the matcher too.

Before sampling, the rows of constrained requests get every token their grammar does not allow
set to -inf (on a copy: the model's logits stay as they were for log-probabilities), on the
device the logits live on (xgrammar's CPU kernel, its Triton kernel on a GPU). This runs on the
logits after the forward, outside any CUDA graph. Once a grammar is complete it allows only the
end-of-sequence tokens, so the request ends there (finish reason "stop"); one that reaches
max_tokens first ends with "length", its output cut. A step without a constrained row never
enters this module.
"""

from __future__ import annotations

import json
import queue
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future

import torch

from zipage.core.sampling import StructuredOutput
from zipage.core.sequence import Sequence
from zipage.errors import FieldError, ZipageError

EXTRA_HINT = "install it with pip install 'zipage[structured]'"
# The JSON schema of OpenAI's response_format json_object (any object), as vLLM compiles it.
ANY_OBJECT = '{"type": "object"}'
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
KIND_NAMES = {"json": "JSON object", "json_schema": "JSON schema", "regex": "regular expression",
              "choice": "choice", "grammar": "EBNF grammar"}
COMPILE_CACHE = 256  # compiled grammars kept (each holds its token-mask cache: ~100 KB - MBs)


class StructuredOutputError(ZipageError):
    """A spec that does not compile, or the library missing: the request's error, alone."""


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise StructuredOutputError(
            f"structured outputs need the xgrammar library, which is not installed; "
            f"{EXTRA_HINT}") from None
    return xgrammar


def check_spec(spec: StructuredOutput) -> None:
    """Parse `spec` without a tokenizer (no token-mask cache: milliseconds), so a bad schema,
    pattern or grammar is refused before it reaches the engine. Raises `StructuredOutputError`
    naming the kind and the library's reason."""
    xgrammar = _xgrammar()
    try:
        if spec.kind == "json_schema":
            xgrammar.Grammar.from_json_schema(spec.value)
        elif spec.kind == "regex":
            xgrammar.Grammar.from_regex(spec.value)
        elif spec.kind == "grammar":
            xgrammar.Grammar.from_ebnf(spec.value)
        elif spec.kind == "choice":
            xgrammar.Grammar.from_ebnf(_choice_grammar(spec.value))
    except Exception as failure:  # noqa: BLE001 - the library's own error types vary by kind
        raise StructuredOutputError(f"not a valid {KIND_NAMES[spec.kind]}: {_reason(failure)}"
                                    ) from None


class StructuredOutputs:
    """The engine's matchers: one per running constrained request, keyed by request id."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None  # built on the first constrained request (~0.3 s for 49k tokens)
        self._compiled: OrderedDict[StructuredOutput, object] = OrderedDict()
        # The compile thread (`compile_soon`) and the step loop share the cache and the compiler.
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()
        self._soon: dict[StructuredOutput, Future] = {}  # specs queued or compiling there
        self._jobs: queue.SimpleQueue | None = None
        self.matchers: dict[str, object] = {}
        self.done: set[str] = set()  # requests whose grammar is complete (or broke)

    # ------------------------------------------------------------------ compiling

    def compile(self, spec: StructuredOutput):
        """The compiled grammar of `spec`, from the cache when it was compiled before."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled
        compiler = self._grammar_compiler()
        try:
            if spec.kind in ("json", "json_schema"):
                compiled = compiler.compile_json_schema(
                    ANY_OBJECT if spec.kind == "json" else spec.value, any_whitespace=True)
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.value)
            elif spec.kind == "choice":
                compiled = compiler.compile_grammar(_choice_grammar(spec.value))
            else:
                compiled = compiler.compile_grammar(spec.value)
        except Exception as failure:  # noqa: BLE001 - the library's own error types vary
            raise StructuredOutputError(f"not a valid {KIND_NAMES[spec.kind]}: "
                                        f"{_reason(failure)}") from None
        with self._lock:
            self._compiled[spec] = compiled
            if len(self._compiled) > COMPILE_CACHE:
                self._compiled.popitem(last=False)
        return compiled

    def _grammar_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                xgrammar = _xgrammar()
                if self.tokenizer is None:
                    raise StructuredOutputError("structured outputs need the model's tokenizer, "
                                                "and this model has none (random weights)")
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids or None)
                # One thread: compiling runs beside torch's threads (the step loop's, or the
                # compile thread's while steps run).
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def prepare(self, seq: Sequence) -> None:
        """Compile a request's spec as it is added (a bad one fails there, alone)."""
        spec = seq.sampling.structured_output
        if spec is not None:
            self._compile_named(spec)

    def _compile_named(self, spec: StructuredOutput):
        """`compile`, its error naming the request's field (a server's `param`)."""
        try:
            return self.compile(spec)
        except StructuredOutputError as error:
            raise FieldError("structured_output", str(error)) from None

    def ready(self, spec: StructuredOutput) -> bool:
        """`spec` is compiled: `prepare` finds it in the cache at once."""
        with self._lock:
            return spec in self._compiled

    def compile_soon(self, spec: StructuredOutput) -> Future:
        """Compile `spec` on the compile thread; the future ends with the compiled grammar or
        with `prepare`'s error. Requests waiting on one spec share its future (and its one
        compile). One thread, in order: compiling a grammar is CPU work beside the steps'."""
        with self._lock:
            future = self._soon.get(spec)
            if future is not None:
                return future
            future = self._soon[spec] = Future()
            if self._jobs is None:
                self._jobs = queue.SimpleQueue()
                # A daemon: an exiting engine does not wait for a long compile to end.
                threading.Thread(target=self._compile_jobs, args=(self._jobs,),
                                 name="zipage-grammar", daemon=True).start()
        self._jobs.put((spec, future))
        return future

    def _compile_jobs(self, jobs: queue.SimpleQueue) -> None:
        while True:
            spec, future = jobs.get()
            try:
                compiled = self._compile_named(spec)
            except Exception as failure:  # noqa: BLE001 - the request's error, alone
                outcome, failed = failure, True
            else:
                outcome, failed = compiled, False
            with self._lock:  # a later request for it compiles again, or finds it cached
                del self._soon[spec]
            if failed:
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

    # ------------------------------------------------------------------ each step

    def mask(self, logits: torch.Tensor, sequences: list[Sequence]) -> torch.Tensor:
        """`logits` [rows, vocab] with every token the grammar of a constrained row does not
        allow at -inf: a float32 copy (the caller's stay the model's), or `logits` itself when
        no row is constrained."""
        rows = [row for row, seq in enumerate(sequences)
                if seq.sampling.structured_output is not None]
        if not rows:
            return logits
        xgrammar = _xgrammar()
        bitmask = xgrammar.allocate_token_bitmask(len(sequences), self.vocab_size)
        for row in rows:
            seq = sequences[row]
            matcher = self.matchers.get(seq.seq_id)
            if matcher is None:  # its first token: a fresh matcher (forks get their own)
                matcher = self.matchers[seq.seq_id] = xgrammar.GrammarMatcher(
                    self.compile(seq.sampling.structured_output))
            matcher.fill_next_token_bitmask(bitmask, row)
        masked = logits.to(torch.float32, copy=True)
        xgrammar.apply_token_bitmask_inplace(
            masked, bitmask.to(masked.device, non_blocking=True), vocab_size=self.vocab_size,
            indices=rows)
        return masked

    def advance(self, sampled: Iterable[tuple[Sequence, int]]) -> None:
        """Feed each constrained request its sampled token; one whose grammar is complete
        (it accepted an end-of-sequence token) is `done`."""
        for seq, token in sampled:
            matcher = self.matchers.get(seq.seq_id)
            if matcher is None:
                continue
            # A token the mask allowed is always accepted; a refusal (the grammar broke)
            # ends the request rather than let it run on unconstrained.
            if not matcher.accept_token(token) or matcher.is_terminated():
                self.done.add(seq.seq_id)

    def finished(self, seq_id: str) -> bool:
        return seq_id in self.done

    def release(self, seq_id: str) -> None:
        """Drop a request's matcher (it finished or was aborted)."""
        self.matchers.pop(seq_id, None)
        self.done.discard(seq_id)


def _choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar matching exactly one of `choices` (JSON string literals are valid
    xgrammar EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _reason(failure: Exception) -> str:
    """The library's message on one line, cut (it may quote the whole input back)."""
    text = " ".join(str(failure).split())
    # xgrammar prefixes its C++ logger's time and source line, and an assertion's condition.
    text = _LOG_PREFIX.sub("", text).replace("Check failed: (error.empty()) is false: ", "")
    text = text or type(failure).__name__
    return text if len(text) <= 300 else text[:300] + "..."
