"""`LLM(model, **knobs).generate(prompts, sampling_params)` and `.chat(messages)`: the vLLM-style
public API, around the engine `zipage.engine.builder` builds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from difflib import get_close_matches

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.core.recorder import Run
from zipage.core.sampling import SamplingParams, TokenLogprob
from zipage.core.sequence import Sequence
from zipage.engine.builder import build_engine, resolve_device
from zipage.engine.loop import EngineLoop
from zipage.engine.structured import StructuredOutputs
from zipage.engine.threads import set_cpu_threads
from zipage.errors import ConfigError
from zipage.request_fields import copy_fields


def sample_sequences(seq_id: str, prompt_token_ids: list[int],
                     sampling: SamplingParams) -> list[Sequence]:
    """The requests of one prompt with `sampling.n` samples: the first (`seq_id`), then the
    others (`seq_id#j`), forked from it when it samples its first token (docs/architecture.md,
    'Samples of one prompt'). Each has its own settings (`SamplingParams.for_sample`)."""
    group = []
    for index in range(sampling.n):
        own = sampling.for_sample(index)
        seq = Sequence(seq_id if index == 0 else f"{seq_id}#{index}", prompt_token_ids,
                       own.max_tokens, sampling=own)
        copy_fields(seq, own)
        if index == 0:
            seq.prompt_logits = own.prompt_logprobs is not None
        else:
            seq.fork_of = group[0]
        group.append(seq)
    return group


@dataclass
class CompletionOutput:
    """One sample of a prompt (`SamplingParams.n` of them)."""

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None  # one per output token, if asked for


@dataclass
class RequestOutput:
    """A prompt's result. The top-level fields are its first sample's; `outputs` holds all n.
    `prompt_logprobs`: one entry per prompt token (None for the first), if asked for."""

    prompt: str | list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "length", "stop", or "error" (the request alone failed: see `error`)
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLM:
    """Offline batched generation with Zipage's scheduler.

    `model`: a preset (`random:qwen3-0.6b`), a HF model directory or a .gguf file. Keyword
    arguments are `ZipageConfig` knobs (block_size, kv_budget, compress, hybrid, ...) plus
    dtype, device, kv_memory_gb, gpu_memory_utilization, cuda_graphs and prefill_graphs
    (`build_engine`), threads (CPU only; default: `zipage.engine.threads`) and tensor_parallel
    (ranks; docs/tensor_parallel.md).
    """

    def __init__(self, model: str, *, dtype: str = "auto", device: str | None = None,
                 kv_memory_gb: float | None = None, gpu_memory_utilization: float = 0.9,
                 cuda_graphs: bool = True, prefill_graphs: bool | None = None,
                 threads: int | None = None, host_kv_gb: float = 0.0,
                 tensor_parallel: int = 1, **knobs) -> None:
        _check_knob_names(knobs)
        resolved = resolve_device(device)
        if resolved.type == "cpu":
            set_cpu_threads(threads)  # zipage.engine.threads: why not torch's default
        if dtype == "auto":
            dtype = "bfloat16" if resolved.type == "cuda" else "float32"
        settings = ReplaySettings(model=model, dtype=dtype, kv_memory_gb=kv_memory_gb,
                                  gpu_memory_utilization=gpu_memory_utilization,
                                  host_kv_gb=host_kv_gb, tensor_parallel=tensor_parallel,
                                  config=ZipageConfig(**knobs))
        self.engine = build_engine(settings, str(resolved), cuda_graphs, prefill_graphs)
        self.tokenizer = self.engine.tokenizer
        self.last_run: Run | None = None
        # Grammar matchers and compiled grammars of `SamplingParams.structured_output`, kept
        # across `generate` calls (compiling is the costly part).
        self.structured = StructuredOutputs(self.tokenizer, self.engine.shape.vocab_size,
                                            self._eos_ids())

    def close(self) -> None:
        """Free the engine's workers (tensor parallel) now; `with LLM(...) as llm:` does it."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 progress: bool = True) -> list[RequestOutput]:
        """One output per prompt (text, or token ids), in order. A prompt that can never run
        (too long) fails alone: its output has finish_reason "error" and the reason."""
        prompts = _as_prompt_list(prompts)
        return self._run(prompts, [self._encode(prompt) for prompt in prompts], sampling_params,
                         progress)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             progress: bool = True) -> list[RequestOutput]:
        """Reply to one conversation (a list of {"role", "content"} messages) or to each of a
        list of them, through the model's chat template, as vLLM's `LLM.chat` does."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.render_chat(conversation) for conversation in conversations]
        # The template writes the special tokens itself: encode without adding any.
        token_lists = [list(self.tokenizer.encode(prompt, add_special_tokens=False))
                       for prompt in prompts]
        return self._run(prompts, token_lists, sampling_params, progress)

    def render_chat(self, conversation: list[dict]) -> str:
        """The prompt text the model's chat template makes of a conversation, ready for the
        assistant's turn."""
        if self.tokenizer is None:
            raise ConfigError("chat: this model has no tokenizer (random weights); pass token "
                              "ids to generate() instead")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError("chat: this model's tokenizer has no chat template (a base model?); "
                              "use generate() with plain prompts")
        for message in conversation:
            if not isinstance(message, dict) or not {"role", "content"} <= set(message):
                raise ConfigError(f"chat: each message must be a dict with 'role' and 'content', "
                                  f"got {message!r}")
        return self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                  add_generation_prompt=True)

    def _run(self, prompts: list, token_lists: list[list[int]],
             sampling_params: SamplingParams | list[SamplingParams] | None,
             progress: bool) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ConfigError(f"sampling_params: got {len(sampling_params)} for "
                              f"{len(prompts)} prompts; pass one or one per prompt")
        groups = [sample_sequences(str(index), tokens, sampling)
                  for index, (tokens, sampling) in enumerate(zip(token_lists, sampling_params))]
        eos_ids = self._eos_ids()
        loop = EngineLoop(self.engine.new_scheduler(), self.engine.runner,
                          eos_token_ids=eos_ids, progress=progress, structured=self.structured)
        run = loop.run([seq for group in groups for seq in group])
        self.last_run = run
        outputs = []
        for prompt, group in zip(prompts, groups):
            leader = group[0]
            if leader.error is not None:
                outputs.append(RequestOutput(prompt, [], None, "error", leader.error,
                                             prompt_token_ids=list(leader.prompt_token_ids)))
                continue
            samples = []
            for index, seq in enumerate(group):
                generated = run.tokens[seq.seq_id][seq.prompt_len:]
                stopped = (bool(generated) and generated[-1] in eos_ids
                           and not seq.sampling.ignore_eos)
                reason = "stop" if stopped or len(generated) < seq.max_output_tokens else "length"
                logprobs = None
                if seq.sampling.logprobs is not None:
                    logprobs = [TokenLogprob.of(token, entry) for token, entry
                                in zip(generated, loop.logprobs.get(seq.seq_id, []))]
                samples.append(CompletionOutput(index, generated,
                                                self._decode(generated, eos_ids, seq.sampling),
                                                reason, logprobs))
            prompt_logprobs = None
            if leader.sampling.prompt_logprobs is not None:
                prompt_logprobs = [TokenLogprob.of(token, entry) for token, entry in
                                   zip(leader.prompt_token_ids,
                                       loop.prompt_logprobs.get(leader.seq_id, []))]
            first = samples[0]
            outputs.append(RequestOutput(prompt, first.token_ids, first.text, first.finish_reason,
                                         None, first.logprobs, samples,
                                         list(leader.prompt_token_ids), prompt_logprobs))
        return outputs

    def _decode(self, generated: list[int], eos_ids: frozenset[int],
                sampling: SamplingParams) -> str | None:
        """The text of the generated tokens, without the end-of-sequence token that stopped them
        (token_ids keep it, as vLLM's do)."""
        if self.tokenizer is None:
            return None
        if generated and generated[-1] in eos_ids and not sampling.ignore_eos:
            generated = generated[:-1]
        return self.tokenizer.decode(generated,
                                     skip_special_tokens=sampling.skip_special_tokens)

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("prompts: this model has no tokenizer (random weights); pass "
                                  "token-id lists instead of strings")
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    def _eos_ids(self) -> frozenset[int]:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            return frozenset()
        return frozenset(eos if isinstance(eos, (list, tuple)) else [eos])


# Names people bring from the CLI or from SamplingParams, and what LLM(...) calls them. One name per
# knob: a wrong one is refused with the right one, never silently accepted.
_CLI_NAMES = {"budget": "kv_budget=", "lambda_": "lambda_weight=", "no_compress": "compress=False",
              "no_hybrid": "hybrid=False", "no_prefix_cache": "prefix_cache=False",
              "no_async": "async_compress=False", "no_global_score": "global_score=False",
              "tp": "tensor_parallel=", "tensor_parallel_size": "tensor_parallel="}
_LLM_KEYWORDS = ("dtype", "device", "kv_memory_gb", "gpu_memory_utilization", "cuda_graphs",
                 "prefill_graphs", "threads", "host_kv_gb", "tensor_parallel")


def _check_knob_names(knobs: dict) -> None:
    known = {field.name for field in fields(ZipageConfig)}
    for name in knobs:
        if name in known:
            continue
        if name in _CLI_NAMES:
            hint = f"use {_CLI_NAMES[name]}"
        elif name in {field.name for field in fields(SamplingParams)}:
            hint = f"it is a sampling setting: llm.generate(prompts, SamplingParams({name}=...))"
        else:
            close = get_close_matches(name, [*known, *_LLM_KEYWORDS], n=1)
            hint = f"did you mean {close[0]}=?" if close else (
                f"knobs are {', '.join(sorted(known))}; plus {', '.join(_LLM_KEYWORDS)}")
        raise ConfigError(f"LLM: unknown keyword argument {name!r}; {hint}")


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [list(prompts)]
    return list(prompts)
