"""`build_engine`: from a deployment's settings to a ready `Engine`, on one GPU or over
tensor-parallel ranks, in one sequence.

The model is resolved as the simulator resolves it (`zipage.model_spec`), and the caches are
sized by the core's memory planner (`plan_capacity`, the simulator's function), so equal flags
give equal blocks and slots in both twins. The capacity is checked before any weight is loaded or
any cache allocated; then rank 0 builds its `ModelRunner`, or a `TensorParallelExecutor` with the
same interface that starts a worker per further rank (`zipage.engine.parallel`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings, effective_config, plan_capacity
from zipage.core.memory import GIB, MemoryPlan
from zipage.core.scheduler import Scheduler, check_pool
from zipage.engine.loader import load_model, loadable_model
from zipage.engine.parallel import TensorParallelExecutor, rank_devices, start_ranks
from zipage.engine.runner import ModelRunner
from zipage.engine.sharding import check_tensor_parallel
from zipage.engine.warmup import warm_up
from zipage.errors import ConfigError, MemoryPlanError
from zipage.shape import ModelShape

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CPU_KV_MEMORY_GB = 1.0  # cache size on the CPU when none is given (small models only)


@dataclass
class Engine:
    model: torch.nn.Module  # rank 0's: the whole model, or its shard
    shape: ModelShape  # the whole model's
    tokenizer: object | None
    config: ZipageConfig
    capacity: MemoryPlan
    runner: ModelRunner | TensorParallelExecutor
    device: torch.device  # rank 0's

    def new_scheduler(self, config: ZipageConfig | None = None) -> Scheduler:
        """A fresh scheduler over the same caches (one per run: the caches hold no state a run
        leaves behind that a new run could read); `config`: knobs only the scheduler reads,
        changed from the engine's (`replay_on_engine`)."""
        return Scheduler(config or self.config, self.capacity.num_blocks,
                         self.capacity.num_query_slots, self.capacity.num_host_blocks)

    def close(self) -> None:
        """Stop the tensor-parallel workers and leave the process group, now. Left to the
        garbage collector, an NCCL teardown runs at an arbitrary moment or at interpreter exit,
        where it can wait forever on a peer; a one-GPU engine has nothing to stop."""
        if isinstance(self.runner, TensorParallelExecutor):
            self.runner.shutdown()


def build_engine(settings: ReplaySettings, device: str | None = None,
                 cuda_graphs: bool = True, prefill_graphs: bool | None = None) -> Engine:
    """The engine of `settings` on `device`, over `settings.tensor_parallel` ranks (one process
    per rank: docs/tensor_parallel.md). `cuda_graphs`: capture CUDA graphs on a GPU (off: every
    step eager). `prefill_graphs`: run prefill and mixed steps of up to 4,096 tokens through the
    padded layout, graphed where `cuda_graphs` captures (`zipage.engine.runner`); None (the
    default) turns them on exactly where they are captured: on a GPU with `cuda_graphs`."""
    device = resolve_device(device)
    prefill_graphs = default_prefill_graphs(prefill_graphs, cuda_graphs, device)
    dtype = torch_dtype(settings.dtype)
    model = loadable_model(settings.model)
    shape = model.shape
    check_tensor_parallel(shape, settings.tensor_parallel)
    devices = rank_devices(device, settings.tensor_parallel)
    config = effective_config(settings, shape)
    settings, total, name = device_memory(settings, devices[0])
    capacity = plan_capacity(settings, shape, total, name)  # per GPU: heads divided by the ranks
    check_capacity(config, capacity, devices[0])
    if len(devices) == 1:
        weights, _, tokenizer = load_model(model, dtype, device)
        runner = ModelRunner(weights, shape, config, capacity, dtype, device,
                             cuda_graphs=cuda_graphs, prefill_graphs=prefill_graphs)
    else:
        runner = start_ranks(settings.model, shape, config, capacity, dtype, devices,
                             cuda_graphs, prefill_graphs)
        weights, tokenizer = runner.runner.model, runner.tokenizer
    engine = Engine(weights, shape, tokenizer, config, capacity, runner, devices[0])
    if device.type == "cuda":
        # Compile and allocate now, on every rank, not inside the first requests' time to first
        # token (or in the first compression of a run: 3.9 s on Qwen3-32B at TP=2).
        try:
            warm_up(runner, capacity.num_blocks)
        except BaseException:
            engine.close()  # the workers go with the failed build
            raise
    return engine


def resolve_device(device: str | None) -> torch.device:
    """`device` as a torch device: None / "auto" pick CUDA when present; a device this machine
    lacks is refused here, before torch asserts on it deep in the first allocation."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        resolved = None
    if resolved is None or resolved.type not in ("cuda", "cpu"):
        raise ConfigError(f"device: got {device!r}, expected cuda, cuda:N or cpu")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device: {device!r} asked for, but torch {torch.__version__} sees no "
                              "CUDA device; use --device cpu (small models) or a CUDA machine")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ConfigError(f"device: {device!r} asked for, but only "
                              f"{torch.cuda.device_count()} CUDA device(s) are visible")
    return resolved


def torch_dtype(dtype: str) -> torch.dtype:
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"dtype: got {dtype!r}, expected one of {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[dtype]


def default_prefill_graphs(prefill_graphs: bool | None, cuda_graphs: bool,
                           device: torch.device) -> bool:
    """Prefill graphs unless asked otherwise where graphs are captured: they are faster at every
    step size measured (docs/BENCHMARKS.md, 'Prefill'). Elsewhere the padded layout would only
    compute padding rows eagerly, so it is off unless asked for (the CPU tests ask for it)."""
    if prefill_graphs is None:
        return cuda_graphs and device.type == "cuda"
    return prefill_graphs


def device_memory(settings: ReplaySettings, device: torch.device
                  ) -> tuple[ReplaySettings, int | None, str]:
    """The memory `plan_capacity` plans and checks `--kv-memory-gb` against, and its name: the
    GPU's total memory (what the simulator's hardware table holds), or on the CPU this host's
    physical memory, with the CPU engine's default cache size where none was given."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return settings, total, f"the GPU ({torch.cuda.get_device_name(device)})"
    if settings.kv_memory_gb is None:
        settings = replace(settings, kv_memory_gb=CPU_KV_MEMORY_GB)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # not a POSIX host: nothing to check against
        total = None
    return settings, total, "this host's memory"


def check_capacity(config: ZipageConfig, capacity: MemoryPlan, device: torch.device) -> None:
    """Refuse, in one line naming the fix, a capacity the core cannot run with
    (`zipage.core.scheduler.check_pool`) or caches the GPU has no room for. The planner works
    from the GPU's total memory (so the simulator plans the same capacity for the same flags);
    other processes may have left less than that free. Checked on rank 0's GPU: every rank's
    caches are the same size."""
    check_pool(config, capacity.num_blocks, capacity.num_query_slots)
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    needed = capacity.kv_bytes + capacity.query_bytes
    if needed > free:
        raise MemoryPlanError(
            f"gpu memory: the caches need {needed / GIB:.1f} GiB but only {free / GIB:.1f} GiB "
            "are free on the GPU (another process?); lower --gpu-memory-utilization or set "
            "--kv-memory-gb")
