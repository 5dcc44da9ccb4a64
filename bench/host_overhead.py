"""Host cost of one engine step, with the model and the kernels taken out (CPU only, no GPU).

On the GPU a decode step is a CUDA-graph replay of a few milliseconds; everything else in the step
is Python on the host: scheduling, building the step's input tensors, applying the result. This
script runs the real `EngineLoop`, `Scheduler` and `ModelRunner` input path on a trace, with a stub
model (returns zero logits at once), a no-op compression function and a fake CUDA-graph ladder (so
the graph path's input staging runs, exactly as on the GPU, minus the copies to the device). The
capacity is planned for the named model and KV memory, so batch sizes and block tables are the
GPU run's. It prints the host milliseconds per step and the functions that take the time.

    python bench/host_overhead.py --model qwen3-8b --kv-memory-gb 6 --budget 512 --block-size 64
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings, effective_config, plan_capacity, trace_sequences
from zipage.core.sampling import SamplingParams
from zipage.core.scheduler import Scheduler
from zipage.decode_grid import GRAPH_BATCH_SIZES
from zipage.engine.host_tables import HostTables
from zipage.engine.loop import EngineLoop
from zipage.engine.runner import ModelRunner
from zipage.presets import get_preset
from zipage.workloads import make_trace


class StubModel(torch.nn.Module):
    """The model interface the runner calls, doing no work: zero hidden states, zero logits."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], 1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        from zipage.engine.context import get_context

        context = get_context()
        rows = len(context.cu_seqlens_q) - 1 if context.is_prefill else hidden.shape[0]
        return torch.zeros(rows, self.vocab_size)

    def attention_layers(self) -> list:
        return []


# The parts of a step timed by --sections, nested as listed: the whole step, the runner's part
# of it, a decode step's input tensors, the block tables within those, and a prefill or mixed
# step's input tensors.
SECTIONS = (("step", EngineLoop, "step"), ("runner", ModelRunner, "_execute"),
            ("decode inputs", ModelRunner, "_decode_inputs"), ("block tables", HostTables, "fill"),
            ("prefill inputs", ModelRunner, "step_inputs"))


def time_sections() -> tuple[dict[str, float], dict[str, int]]:
    """Wrap each function of SECTIONS to add its wall time (seconds) and its calls to the
    returned dicts."""
    spent = dict.fromkeys([name for name, _, _ in SECTIONS], 0.0)
    calls = dict.fromkeys(spent, 0)
    for name, owner, attribute in SECTIONS:
        function = getattr(owner, attribute)

        def timed(*args, _function=function, _name=name, **kwargs):
            started = time.perf_counter()
            try:
                return _function(*args, **kwargs)
            finally:
                spent[_name] += time.perf_counter() - started
                calls[_name] += 1

        setattr(owner, attribute, timed)
    return spent, calls


class FakeGraph:
    def replay(self) -> None:
        pass


def stub_runner(settings: ReplaySettings, shape, config, capacity) -> ModelRunner:
    """A real ModelRunner over tiny caches whose decode steps take the CUDA-graph input path."""
    tiny = shape.scaled(num_layers=1, num_kv_heads=1, num_heads=1, head_dim=8, vocab_size=8)
    runner = ModelRunner(StubModel(8), tiny, config, capacity, torch.float32,
                         torch.device("cpu"), cuda_graphs=False)
    if runner.compressor is not None:
        runner.compressor.compress_fn = lambda *args, **kwargs: None
    largest = min(config.max_num_seqs, GRAPH_BATCH_SIZES[-1])
    runner.allocate_graph_inputs(largest)
    runner.graphs = {size: FakeGraph() for size in GRAPH_BATCH_SIZES if size <= largest}
    return runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-output", type=int, default=2048)
    parser.add_argument("--kv-memory-gb", type=float, default=6.0)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--full-kv", action="store_true", help="compression off")
    parser.add_argument("--profile", type=int, default=15, help="functions to list (0: no profiler, plain timing)")
    parser.add_argument("--sections", action="store_true",
                        help="with --profile 0: also the ms a step of each part (step, runner, decode inputs, "
                             "block tables), timed without a profiler")
    args = parser.parse_args()
    shape = get_preset(args.model)
    config = ZipageConfig(block_size=args.block_size, kv_budget=args.budget,
                          compress=not args.full_kv)
    settings = ReplaySettings(model=f"random:{args.model}", kv_memory_gb=args.kv_memory_gb,
                              config=config)
    config = effective_config(settings, shape)
    capacity = plan_capacity(settings, shape, None)
    scheduler = Scheduler(config, capacity.num_blocks, capacity.num_query_slots)
    runner = stub_runner(settings, shape, config, capacity)
    trace = make_trace("amc23", 0, num_questions=args.questions, samples_per_question=args.samples,
                       max_output_len=args.max_output)
    sequences = trace_sequences(trace, shape.vocab_size, need_tokens=True)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    for seq in sequences:
        seq.sampling = greedy
    loop = EngineLoop(scheduler, runner)
    spent, calls = time_sections() if args.sections and not args.profile else (None, None)
    profiler = cProfile.Profile() if args.profile else None
    started = time.perf_counter()
    if profiler:
        profiler.enable()
    run = loop.run(sequences)
    wall = time.perf_counter() - started
    steps = run.summary["steps"]
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    print(f"{'compression' if config.compress else 'full KV'}: {steps} steps, mean batch "
          f"{run.summary['mean_running']:.1f}, {wall:.2f} s host{' (profiled)' if profiler else ''} = "
          f"{1000 * wall / steps:.2f} ms per step")
    if spent is not None:
        print("ms a step: " + ", ".join(f"{name} {1000 * seconds / steps:.3f}" for name, seconds in spent.items()))
        print("ms a call: " + ", ".join(f"{name} {1000 * seconds / max(calls[name], 1):.3f} ({calls[name]} calls)"
                                        for name, seconds in spent.items()))


if __name__ == "__main__":
    main()
