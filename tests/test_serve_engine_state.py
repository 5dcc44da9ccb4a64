"""A server runs for days: the engine process must keep no state per finished request.

`EngineCore` (zipage/serve/engine_process.py) is driven here in this process, its socket replaced
by a sink: requests that finish at their length, stop at an end-of-sequence token, are aborted
while running or are rejected by the core. After 12 and after 40 such requests no container of
the engine loop, its scheduler, block manager, step recorder and its metrics, the model runner
and its compressor may be larger: what grows with the requests served is a leak. The same two
levels down (a dict of lists, a list of objects) for the paths a server also takes: output and
prompt log-probabilities, n forked samples, a seed, prefix-cache hits, aborts of waiting and of
running requests.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from zipage.core.sampling import SamplingParams  # noqa: E402
from zipage.serve.wire import Add  # noqa: E402

MODEL = "random:smollm2-135m"


class _Sink:
    """The HTTP process's end of the socket: takes every update, keeps none."""

    def send(self, message) -> None:
        pass


@pytest.fixture(scope="module")
def core():
    from zipage.engine.llm import LLM
    from zipage.serve.engine_process import EngineCore

    llm = LLM(MODEL, device="cpu", dtype="float32", kv_memory_gb=0.05, threads=1, block_size=16,
              kv_budget=64, window=4)
    core = EngineCore(llm.engine, _Sink(), llm.engine.shape.vocab_size)
    core.loop.start()
    # Every token ends a request that heeds end-of-sequence tokens.
    core.loop.eos_token_ids = frozenset(range(llm.engine.shape.vocab_size))
    return core


def _serve(core, first: int, count: int) -> None:
    """`count` requests in groups of four: one runs to its length, one stops at an
    end-of-sequence token, one is aborted after a step, one the core refuses (a budget that is not
    a multiple of the block size)."""
    for base in range(first, first + count, 4):
        names = [f"r{base + offset}" for offset in range(4)]
        core._add(Add(names[0], [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)))
        core._add(Add(names[1], [4, 5, 6], SamplingParams(max_tokens=3)))
        core._add(Add(names[2], [7, 8, 9], SamplingParams(max_tokens=50, ignore_eos=True)))
        core._add(Add(names[3], [1, 2], SamplingParams(max_tokens=3, kv_budget=20)))
        core._publish(core.loop.step())
        core._abort(names[2])
        while core.loop.scheduler.has_unfinished():
            core._publish(core.loop.step())
        core._publish(None)


def _sizes(core) -> dict[str, int]:
    """len() of every container attribute of the objects a long-running engine keeps."""
    loop = core.loop
    owners = {"core": core, "loop": loop, "scheduler": loop.scheduler,
              "block_manager": loop.scheduler.block_manager, "recorder": loop.recorder,
              "metrics": loop.recorder.metrics, "clock": loop.scheduler.steady.clock,
              "runner": loop.runner, "compressor": loop.runner.compressor}
    sizes = {}
    for owner_name, owner in owners.items():
        if owner is None:
            continue
        for name, value in _attributes(owner):
            if isinstance(value, (list, dict, set, frozenset, tuple)) or hasattr(value,
                                                                                 "maxlen"):
                if name != "eos_token_ids":
                    sizes[f"{owner_name}.{name}"] = len(value)
    return sizes


def _attributes(owner):
    if hasattr(owner, "__dict__"):
        return list(vars(owner).items())
    return [(name, getattr(owner, name)) for name in type(owner).__slots__]


def test_nothing_grows_with_the_number_of_requests_served(core):
    _serve(core, 0, 12)
    after_12 = _sizes(core)
    _serve(core, 12, 28)
    after_40 = _sizes(core)
    grown = {name: (after_12[name], size) for name, size in after_40.items()
             if size > after_12.get(name, 0)}
    assert grown == {}, f"grew with requests served (after 12, after 40): {grown}"


def _deep_sizes(owner, prefix: str, depth: int = 2) -> dict[str, int]:
    """len() of every container reachable from `owner`'s attributes through containers and
    objects, `depth` levels down (what one level hides: a dict of lists, a list of objects)."""
    sizes: dict[str, int] = {}

    def walk(value, path: str, level: int) -> None:
        if isinstance(value, (list, dict, set, frozenset, tuple)) or hasattr(value, "maxlen"):
            sizes[path] = len(value)
            if level < depth:
                items = value.values() if isinstance(value, dict) else value
                for index, item in enumerate(list(items)[:64]):
                    walk(item, f"{path}[{index}]", level + 1)
        elif level < depth and (hasattr(value, "__dict__") or hasattr(type(value), "__slots__")):
            if isinstance(value, (str, bytes, int, float)) or type(value).__module__ == "torch":
                return
            for name, item in _attributes(value):
                walk(item, f"{path}.{name}", level + 1)

    for name, value in _attributes(owner):
        walk(value, f"{prefix}.{name}", 0)
    return sizes


def _serve_with_logprobs_samples_and_aborts(core, first: int, count: int) -> None:
    """The per-request paths a server also takes: log-probabilities of the output and of the
    prompt (echo), n samples forked from one prompt, a seed, a prompt over one block (hashed by
    the prefix cache), and aborts of a request still waiting and of a request running. The same
    prompts every round: the prefix cache's index then holds the same blocks."""
    long_prompt = list(range(1, 40))
    for base in range(first, first + count, 4):
        names = [f"x{base + offset}" for offset in range(4)]
        core._add(Add(names[0], long_prompt, SamplingParams(max_tokens=3, ignore_eos=True,
                                                            logprobs=5, prompt_logprobs=5)))
        core._add(Add(names[1], [4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True, n=3,
                                                          seed=7),
                      [f"{names[1]}#1", f"{names[1]}#2"]))
        core._add(Add(names[2], long_prompt, SamplingParams(max_tokens=50, ignore_eos=True)))
        core._add(Add(names[3], [7, 8], SamplingParams(max_tokens=50, ignore_eos=True)))
        core._abort(names[3])  # still waiting
        core._publish(core.loop.step())
        core._abort(names[2])  # running
        while core.loop.scheduler.has_unfinished():
            core._publish(core.loop.step())
        core._publish(None)


def test_nothing_grows_with_logprobs_samples_or_aborts_two_levels_down(core):
    def sizes():
        loop = core.loop
        found = {}
        for name, owner in {"core": core, "loop": loop, "scheduler": loop.scheduler,
                            "block_manager": loop.scheduler.block_manager,
                            "recorder": loop.recorder, "runner": loop.runner}.items():
            found.update(_deep_sizes(owner, name))
        return found

    _serve_with_logprobs_samples_and_aborts(core, 0, 4)
    after_4 = sizes()
    _serve_with_logprobs_samples_and_aborts(core, 4, 12)
    after_16 = sizes()
    # The block manager's free queue drops the entries of blocks taken from the prefix cache
    # lazily, when they reach its front: it grows towards a bound set by the cache's hit rate,
    # never past the blocks there are times (1 + blocks reused / blocks allocated per request).
    grown = {name: (after_4.get(name, 0), size) for name, size in after_16.items()
             if size > after_4.get(name, 0) and not name.endswith("block_manager._free_queue")}
    assert grown == {}, f"grew with requests served (after 4, after 16): {grown}"
    assert core.loop.tokens == {} and not core.loop.scheduler.has_unfinished()
