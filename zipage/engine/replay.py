"""`zipage replay TRACE --gpu` (or `--engine cpu`): a trace through the real engine.

Same settings, same capacity planning and same prompt tokens as the simulator (`zipage.core.deployment`),
greedy decoding with EOS ignored so every request produces exactly its trace `output_len`; the
result has the simulator's summary keys and run-directory files, so `zipage compare` can put the
two side by side.
"""

from __future__ import annotations

from zipage.core.deployment import ReplaySettings, effective_config, run_summary, trace_sequences
from zipage.core.recorder import RecordSink, Run
from zipage.core.sampling import SamplingParams
from zipage.decode_grid import programs_per_sm
from zipage.engine.builder import Engine, build_engine
from zipage.engine.loop import EngineLoop
from zipage.trace import Trace


def replay_on_engine(trace: Trace, settings: ReplaySettings, device: str | None = None, *,
                     cuda_graphs: bool = True, prefill_graphs: bool | None = None,
                     progress: bool = False, log_decisions: bool = False,
                     sink: RecordSink | None = None) -> tuple[dict, Run]:
    """`run_on_engine` on an engine built for `settings`; with a `sink` the run's records go to
    it as they are made (`zipage.rundir.RunWriter`), as the simulator's do."""
    engine = build_engine(settings, device, cuda_graphs, prefill_graphs)
    try:
        return run_on_engine(engine, trace, settings, progress=progress,
                             log_decisions=log_decisions, sink=sink)
    finally:
        engine.close()  # tensor parallel: the workers stop here, not at some later collection


def run_on_engine(engine: Engine, trace: Trace, settings: ReplaySettings, *,
                  progress: bool = False, log_decisions: bool = False,
                  sink: RecordSink | None = None) -> tuple[dict, Run]:
    """`trace` through an engine already built (one engine serves many runs: `zipage
    calibrate`). `settings` may change knobs that only the scheduler reads (chunked prefill,
    the step's token limit) from those the engine was built with; its summary records them."""
    graphs = engine.runner.graphed_steps  # now: closing a tensor-parallel engine drops its graphs
    buckets = engine.runner.prefill_buckets
    decode_graph_sizes = engine.runner.decode_graph_sizes
    config = effective_config(settings, engine.shape)
    scheduler = engine.new_scheduler(config)
    # A request the scheduler will reject gets no prompt (it may be 10^9 tokens long).
    sequences = trace_sequences(trace, engine.shape.vocab_size, need_tokens=True,
                                scheduler=scheduler)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    for seq in sequences:
        seq.sampling = greedy
    loop = EngineLoop(scheduler, engine.runner, progress=progress, log_decisions=log_decisions,
                      sink=sink)
    run = loop.run(sequences, users=settings.users)
    driver = f"engine-{engine.device.type}"
    summary = run_summary(run.summary, engine.capacity, config, settings, driver)
    # What ran, by name (settings.hardware stays the flag's value: the GPU a simulation of these
    # settings would price, which the engine ignores).
    summary["device"] = device_name(engine.device, settings.tensor_parallel)
    # Which steps were graphed: `zipage compare` sets it beside a calibrated profile's; and the
    # buckets padded steps ran at, which a profile fitted from the run prices them by.
    summary["graphs"] = graphs
    summary["prefill_buckets"] = list(buckets)
    # The batch sizes decode graphs were captured at: a decode step computes its graph's padded
    # rows, and a profile fitted from the run prices it so (docs/cost_model.md).
    summary["decode_graph_sizes"] = decode_graph_sizes
    # The decode grid's programs an SM: a profile fitted from the run counts its partitions so.
    summary["decode_programs_per_sm"] = programs_per_sm(config.kv_cache_dtype)
    summary["decode_split"] = "rule"  # balanced where `takes_balanced_split` holds
    summary["validation"] = None  # measured, not predicted: no error band (a simulation's is)
    compressor = engine.runner.compressor
    if compressor is not None and config.async_compress:
        # Where async batches started: `calibrate --from-run` reads it, and takes a run without
        # it for one whose batches were launched before their step's forward.
        summary["async_launch"] = "after-forward"
    return summary, run


def device_name(device, ranks: int = 1) -> str:
    """The device an engine ran on, as a run summary records it: "cpu", or the CUDA device's own
    name ("NVIDIA H200"; "2 x NVIDIA H200" for a model sharded over two)."""
    if device.type != "cuda":
        return device.type
    import torch

    name = torch.cuda.get_device_name(device)
    return name if ranks == 1 else f"{ranks} x {name}"
