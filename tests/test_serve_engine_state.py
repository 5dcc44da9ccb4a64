"""A server runs for days: the engine process must keep no state per finished request.

`EngineCore` (zipage/serve/engine_process.py) is driven here in this process, its socket replaced
by a sink: requests that finish at their length, stop at an end-of-sequence token, are aborted
while running or are rejected by the core. After 12 and after 40 such requests no container of
the engine loop, its scheduler, block manager, step recorder and its metrics, the model runner
and its compressor may be larger: what grows with the requests served is a leak.
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
              "metrics": loop.recorder.metrics, "clock": loop.scheduler.clock,
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
