"""`zipage replay` in the simulator: settings in, a simulated run out.

Resolves the model's shape (preset, HF directory or GGUF file: only the shapes are read), the GPU
from the hardware table, the capacity from the shared memory planner and the cost model, then
drives the core with the SimPy simulator.
"""

from __future__ import annotations

from dataclasses import dataclass

from zipage.config import ZipageConfig
from zipage.core.deployment import (
    ReplaySettings,
    dtype_bytes,
    effective_config,
    iter_trace_sequences,
    plan_capacity,
    run_summary,
)
from zipage.core.memory import MemoryPlan
from zipage.core.recorder import RecordSink, Run
from zipage.core.scheduler import Scheduler
from zipage.hardware import get_hardware
from zipage.model_spec import resolve_shape
from zipage.shape import ModelShape
from zipage.sim.cost_loader import load_cost_model
from zipage.sim.cost_model import CostModel
from zipage.sim.simulator import Simulator
from zipage.trace import Trace
from zipage.trace_stream import TraceStream


@dataclass
class SimulatedDeployment:
    """What one simulated engine is built from: the model's shape, the effective knobs, the
    planned capacity and the cost model."""

    shape: ModelShape
    config: ZipageConfig
    capacity: MemoryPlan
    cost_model: CostModel

    def new_scheduler(self) -> Scheduler:
        return Scheduler(self.config, self.capacity.num_blocks, self.capacity.num_query_slots,
                         self.capacity.num_host_blocks)

    def summary(self, metrics: dict, settings: ReplaySettings) -> dict:
        """The run summary of a simulation of this deployment; a profile that says which engine
        steps it timed graphed passes that on (`zipage compare` sets it beside the engine's), and
        a validated one its errors on the held-out workload (`validation`: how far to trust the
        figures; None for the analytic model and an unvalidated profile)."""
        summary = run_summary(metrics, self.capacity, self.config, settings, "simulator")
        summary["graphs"] = self.cost_model.measured_graphs  # None: the analytic model's
        summary["prefill_buckets"] = list(self.cost_model.prefill_buckets)
        summary["decode_graph_sizes"] = list(self.cost_model.decode_graph_sizes)
        summary["decode_programs_per_sm"] = self.cost_model.decode_programs_per_sm
        summary["decode_split"] = self.cost_model.decode_split
        validation = self.cost_model.validation
        summary["validation"] = None if validation is None else validation.summary()
        return summary


def plan_deployment(settings: ReplaySettings,
                    contention_factor: float | None = None) -> SimulatedDeployment:
    """`contention_factor`: the cost model's, instead of its default or its profile's (a what-if:
    bench/budgets_sim.py --contention)."""
    shape = resolve_shape(settings.model)
    gpu = get_hardware(settings.hardware)
    config = effective_config(settings, shape)
    capacity = plan_capacity(settings, shape, gpu.memory_bytes, f"the {gpu.name}")
    knobs = {} if contention_factor is None else {"contention_factor": contention_factor}
    cost_model = load_cost_model(
        settings.cost_model, shape, gpu, dtype_bytes=dtype_bytes(settings.dtype),
        tensor_parallel=settings.tensor_parallel, **config.cost_knobs(), **knobs)
    if capacity.num_host_blocks:
        cost_model.price_host_copies(capacity.block_bytes, gpu.host_link_bytes_per_s)
    return SimulatedDeployment(shape, config, capacity, cost_model)


def simulate(trace: Trace | TraceStream, settings: ReplaySettings, *, progress: bool = False,
             log_decisions: bool = False, check: bool = False,
             contention_factor: float | None = None,
             sink: RecordSink | None = None) -> tuple[dict, Run]:
    """Simulate `trace`; with a `sink` the run is streamed: its records go to the sink as they
    are made (`zipage.rundir.RunWriter`) and the returned `Run` keeps none but the failed
    requests. A `TraceStream` (a JSON Lines or production file) is read as the simulated clock
    reaches its requests."""
    deployment = plan_deployment(settings, contention_factor)
    scheduler = deployment.new_scheduler()
    sequences = iter_trace_sequences(
        trace, deployment.shape.vocab_size, need_tokens=False, scheduler=scheduler,
        block_keys=True, in_arrival_order=True)
    simulator = Simulator(scheduler, deployment.cost_model, check=check,
                          log_decisions=log_decisions, progress=progress,
                          total=None if isinstance(trace, TraceStream) else len(trace.requests),
                          sink=sink)
    run = simulator.run(sequences, in_arrival_order=True, users=settings.users)
    return deployment.summary(run.summary, settings), run
