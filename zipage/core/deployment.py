"""Replaying a trace: from settings to a finished run directory, for either twin.

`ReplaySettings` carries what `zipage replay` accepts (model, memory, knobs, cost model). Both
drivers size their caches with the same function (`plan_capacity`) and turn trace requests into
`Sequence`s the same way (`trace_sequences`), so the same flags give the same blocks, slots and
prompt tokens in the simulator and in the real engine. What a finished run writes is
`zipage.rundir`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace

from zipage.config import ZipageConfig, knob
from zipage.core.block_manager import prompt_block_hashes
from zipage.core.memory import GIB, MemoryPlan, available_kv_bytes, plan_memory, weight_bytes
from zipage.core.scheduler import Scheduler
from zipage.core.sequence import Sequence, Turn
from zipage.dtypes import DTYPE_BYTES
from zipage.errors import ConfigError, MemoryPlanError
from zipage.request_fields import copy_fields
from zipage.sessions import SessionKeys, own_tokens
from zipage.shape import ModelShape
from zipage.trace import Trace, TraceRequest, prompt_block_keys, prompt_token_ids
from zipage.trace_stream import TraceStream


@dataclass
class ReplaySettings:
    """A deployment: model, GPU, memory and cost model, plus the knobs (`config`). Each field is
    declared once with its flag (`knob`, as `ZipageConfig`'s are); `zipage.cli.flags` derives the
    command line from these declarations."""

    model: str = knob("qwen3-8b", "--model", "preset name (e.g. qwen3-8b, random:qwen3-0.6b), HF "
                      "model directory or .gguf file; the simulator reads only its shapes")
    hardware: str = knob("a100-80gb", "--hardware", "GPU of the simulated deployment: a100-80gb, "
                         "h100-80gb, h200-141gb (aliases a100, h100, h200)")
    dtype: str = knob("bfloat16", "--dtype", "weights and KV cache element type",
                      choices=tuple(DTYPE_BYTES))
    gpu_memory_gb: float | None = knob(None, "--gpu-memory-gb", "GPU memory to plan with "
                                       "(default: the hardware's)")
    gpu_memory_utilization: float = knob(0.9, "--gpu-memory-utilization", "share of GPU memory "
                                         "Zipage may use")
    kv_memory_gb: float | None = knob(None, "--kv-memory-gb", "exact memory for KV blocks + "
                                      "query slots; overrides the two above")
    host_kv_gb: float = knob(0.0, "--host-kv-gb", "host memory (GiB, per GPU) that keeps prompt "
                             "blocks the GPU's prefix cache drops (reused, or rewritten by a "
                             "compression): a later prompt with that prefix copies them back "
                             "instead of computing them (0: no host tier)")
    tensor_parallel: int = knob(1, "--tensor-parallel", "GPUs (or CPU processes) one engine's model "
                                "is sharded over; --kv-memory-gb is per GPU")
    cost_model: str = knob("analytic", "--cost-model", "'analytic' (roofline) or a profile JSON "
                           "written by `zipage calibrate`")
    seed: int = knob(0, "--seed", "sampling seed of the real engine; the simulator is "
                     "deterministic and only records it")
    users: int | None = knob(None, "--users", "closed population: at most this many sessions "
                             "run at once, each user starting the next session (in trace order) "
                             "when its last one ended; a request in no session is a session of "
                             "one turn (default: every session at its arrival_s)")
    config: ZipageConfig = field(default_factory=ZipageConfig)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Refuse values no deployment can have, naming the flag, before anything divides by
        them (replay, plan and calibrate all build their settings here)."""
        if isinstance(self.tensor_parallel, bool) or not isinstance(self.tensor_parallel, int) \
                or self.tensor_parallel < 1:
            raise ConfigError(f"tensor_parallel: got {self.tensor_parallel!r}, expected an "
                              "integer >= 1 (--tensor-parallel 1 is one GPU)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization: got {self.gpu_memory_utilization}, "
                              "expected a fraction in (0, 1], e.g. --gpu-memory-utilization 0.9")
        for name in ("gpu_memory_gb", "kv_memory_gb"):
            value = getattr(self, name)
            if value is not None and not 0.0 < value < float("inf"):
                raise ConfigError(f"{name}: got {value}, expected a positive number of GiB "
                                  f"(--{name.replace('_', '-')})")
        if not (isinstance(self.host_kv_gb, (int, float)) and not isinstance(self.host_kv_gb, bool)
                and 0.0 <= self.host_kv_gb < float("inf")):
            raise ConfigError(f"host_kv_gb: got {self.host_kv_gb!r}, expected a number of GiB "
                              ">= 0 (--host-kv-gb 8; 0 turns the host tier off)")
        if self.users is not None and (isinstance(self.users, bool)
                                       or not isinstance(self.users, int) or self.users < 1):
            raise ConfigError(f"users: got {self.users!r}, expected an integer >= 1 (--users 64: "
                              "64 sessions at once), or leave it out")
        dtype_bytes(self.dtype)

    def to_dict(self) -> dict:
        values = asdict(self)
        values["config"] = self.config.to_dict()
        return values

    @classmethod
    def from_dict(cls, values: dict) -> "ReplaySettings":
        """The settings a run recorded (`summary.json` "settings", written by `to_dict`)."""
        values = dict(values)
        config = ZipageConfig.from_dict(values.pop("config"))
        return cls(**values, config=config)


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype: got {dtype!r}, expected one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def plan_capacity(settings: ReplaySettings, shape: ModelShape, gpu_memory_bytes: int | None,
                  device: str = "the GPU") -> MemoryPlan:
    """Blocks and query slots for these settings (docs/architecture.md, 'Memory planning').

    `--kv-memory-gb` fixes the cache memory exactly (what makes a simulated and a real run plan
    the same capacity); otherwise the caches get what the GPU has left after weights and
    activations at the given utilisation. `gpu_memory_bytes` is the memory of one GPU (the
    hardware table's in the simulator, the device's in the engine; `--gpu-memory-gb` replaces
    it) or None where there is none to check against; `device` names it in errors.
    """
    element = dtype_bytes(settings.dtype)
    if settings.gpu_memory_gb is not None:
        gpu_memory_bytes = int(settings.gpu_memory_gb * GIB)
    if settings.kv_memory_gb is not None:
        available = int(settings.kv_memory_gb * GIB)
        if gpu_memory_bytes is not None:
            check_kv_memory(settings, shape, gpu_memory_bytes, device)
    else:
        available = available_kv_bytes(shape, gpu_memory_bytes, settings.gpu_memory_utilization,
                                       element, settings.tensor_parallel)
    plan = plan_memory(shape, settings.config, available, element, settings.tensor_parallel)
    if not settings.host_kv_gb:
        return plan
    if not settings.config.prefix_cache:
        raise ConfigError("host_kv_gb: the host tier keeps the prefix cache's blocks, but "
                          "--no-prefix-cache turns that off; drop one of the two")
    host_blocks = int(settings.host_kv_gb * GIB) // plan.block_bytes
    if host_blocks < 1:
        raise ConfigError(f"host_kv_gb: {settings.host_kv_gb} GiB cannot hold one KV block of "
                          f"{plan.block_bytes / GIB:.4f} GiB; give the host tier more "
                          "(--host-kv-gb 8), or 0 for none")
    return replace(plan, num_host_blocks=host_blocks)


def check_kv_memory(settings: ReplaySettings, shape: ModelShape, gpu_memory_bytes: int,
                    device: str = "the GPU") -> None:
    """Refuse a `--kv-memory-gb` that cannot exist next to the weights on one GPU, before the
    planner turns it into a block count nothing could allocate (10^9 GiB would be 10^11 blocks).
    Activations are not counted: the check refuses the impossible, the engine's own allocation
    refuses the merely too tight."""
    weights = weight_bytes(shape, dtype_bytes(settings.dtype), settings.tensor_parallel)
    wanted = settings.kv_memory_gb * GIB
    per_gpu = " per GPU" if settings.tensor_parallel > 1 else ""
    if weights >= gpu_memory_bytes:  # no --kv-memory-gb could help: name the real cause
        raise MemoryPlanError(
            f"--model: {shape.name}'s weights take {weights / GIB:.1f} GiB{per_gpu} in "
            f"{settings.dtype}, more than {device}'s {gpu_memory_bytes / GIB:.1f} GiB; use a "
            "smaller model, a smaller --dtype, or more --tensor-parallel")
    if wanted + weights > gpu_memory_bytes:
        room = (gpu_memory_bytes - weights) / GIB
        raise MemoryPlanError(
            f"--kv-memory-gb: got {settings.kv_memory_gb:g}, but {device} has "
            f"{gpu_memory_bytes / GIB:.1f} GiB and {shape.name}'s weights take "
            f"{weights / GIB:.1f} GiB{per_gpu}; give at most {room:.1f} (less what activations "
            "need), or leave it out for the default")


def effective_config(settings: ReplaySettings, shape: ModelShape) -> ZipageConfig:
    """The knobs with the model's context length as the default request-length limit."""
    config = settings.config
    if config.max_model_len is None:
        return ZipageConfig.from_dict({**config.to_dict(), "max_model_len": shape.max_position})
    return config


def trace_sequences(trace: Trace, vocab_size: int, need_tokens: bool,
                    scheduler: Scheduler | None = None,
                    block_keys: bool = False) -> list[Sequence]:
    return list(iter_trace_sequences(trace, vocab_size, need_tokens, scheduler, block_keys))


def iter_trace_sequences(trace: Trace | TraceStream, vocab_size: int, need_tokens: bool,
                         scheduler: Scheduler | None = None, block_keys: bool = False,
                         in_arrival_order: bool = False) -> Iterator[Sequence]:
    """One Sequence per trace request; prompt tokens are synthesised only when needed (the
    engine feeds them to the model), and never for a request that `scheduler` will reject: a
    prompt that can never fit (10^9 tokens) then fails alone at admission with its reason,
    without O(prompt_len) time and memory spent on it first.

    `block_keys`: a driver that needs only which prompt blocks are equal (the simulator) gives
    each request, when `scheduler`'s prefix cache is on, its blocks' keys instead of tokens
    (`prompt_block_keys`), equal exactly where the tokens would be, so the core makes the same
    decisions as on the engine's token hashes, without a token in memory.

    `in_arrival_order`: yield them by arrival time (the trace order among equal times), each
    built only when asked for, so a lazy driver holds only the requests that have arrived. A
    `TraceStream` (a JSON Lines or production file read as it is replayed) is always in arrival
    order, and its requests are made only when asked for too.

    A session's turns carry their `Turn`; a follow-up's arrival is decided as the run goes
    (zipage/core/arrivals.py), and its prompt begins with its predecessor's history: keys that
    say so (`SessionKeys`), or, with tokens, only its own tokens until the driver prepends the
    history its predecessor produced (`follow_up_tokens`)."""
    key_block_size = (scheduler.block_size if block_keys and scheduler is not None
                      and scheduler.config.prefix_cache else None)
    if isinstance(trace, TraceStream):
        requests = iter(trace)  # made as asked for, in arrival order
    else:
        requests = trace.requests
        if in_arrival_order:
            requests = sorted(requests, key=lambda request: request.arrival_s)

    def block_keys_of(request: TraceRequest) -> list[int]:
        keys = prompt_block_keys(request, key_block_size)
        if keys is None:  # only the tokens tell
            keys = prompt_block_hashes(prompt_token_ids(request, vocab_size=vocab_size),
                                       key_block_size)
        return keys

    # A session's turns: their prompts begin with their predecessors' (zipage/sessions.py).
    sessions = SessionKeys(key_block_size, block_keys_of) if key_block_size else None
    # Bound once, and the keys made in the loop: both run once a request.
    rejection_reason = scheduler.admission.rejection_reason if scheduler is not None else None
    for request in requests:
        seq = Sequence(request.id, None, request.output_len, request.arrival_s,
                       request.prompt_len)  # arrival, length
        copy_fields(seq, request)
        session_turn = None
        if request.session is not None or request.after is not None:  # (a loaded follow-up
            # has its predecessor's session; one built by hand may not)
            seq.turn = Turn(request.session or "", request.after, request.after_s,
                            request.prefix_len if request.after is not None else 0,
                            request.reasoning_len)
            if sessions is not None:
                session_turn = sessions.note(request)
        if rejection_reason is None or rejection_reason(seq) is None:
            if need_tokens:
                # A follow-up's history is added when it is released (`follow_up_tokens`).
                seq.prompt_token_ids = (own_tokens(request, vocab_size)
                                        if request.after is not None
                                        else prompt_token_ids(request, vocab_size=vocab_size))
            elif session_turn is not None:
                seq.prompt_block_hashes = sessions.keys(session_turn)
            elif key_block_size is not None:
                seq.prompt_block_hashes = block_keys_of(request)
        yield seq


def run_summary(summary: dict, capacity: MemoryPlan, config: ZipageConfig,
                settings: ReplaySettings, driver: str) -> dict:
    """The `--json` object: the metrics summary plus the capacity the run was planned with and
    the device it ran on (the simulated GPU's table name, or the engine's device type)."""
    return {
        **summary,
        # A maximum over the requests that compressed: none under Full KV, or when no
        # request grew long enough to compress.
        "max_blocks_after_compress": (summary["max_blocks_after_compress"]
                                      if config.compress and summary["compressions"] else None),
        "device": run_device(settings, driver),
        "n_max": config.n_max if config.compress else None,
        "max_concurrency": capacity.num_query_slots if config.compress else None,
        "num_blocks": capacity.num_blocks,
        "num_host_blocks": capacity.num_host_blocks,
        "driver": driver,
        "settings": settings.to_dict(),
    }


def run_device(settings: ReplaySettings, driver: str) -> str:
    """What the run ran on: the hardware table's name of the simulated GPU ("h100" ->
    "h100-80gb"), or "cpu" / "cuda" for the real engine (which ignores --hardware)."""
    if driver.startswith("engine-"):
        return driver.removeprefix("engine-")
    from zipage.hardware import get_hardware

    return get_hardware(settings.hardware).name

