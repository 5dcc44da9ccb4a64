"""The GPU table the simulator's analytic cost model and memory planner read.

Each `GPUSpec` holds the public peak numbers of one accelerator (HBM bandwidth, dense bf16
throughput, memory), the fraction of each peak that real kernels reach, the host-side cost of one
engine step, and an hourly price for cost-per-token objectives. Peaks are datasheet figures; the
achievable fractions and the step overhead are our assumptions, grounded on measurements taken on
this project's H100/H200 machines (docs/cost_model.md lists each figure and where it comes from).
"""

from __future__ import annotations

from dataclasses import dataclass

from zipage.errors import ConfigError

GIB = 1024**3


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_gb: int  # as marketed: 80, 141
    memory_bytes: int  # total device memory CUDA reports (torch's total_memory)
    hbm_bandwidth_bytes_per_s: float  # datasheet peak
    bandwidth_fraction: float  # share of the peak a streaming kernel (a copy) reaches
    bf16_tflops: float  # datasheet dense peak (no sparsity)
    compute_fraction: float  # share of the peak a large square GEMM reaches
    step_overhead_s: float  # host cost of one step: schedule, inputs, graph replay, sampling
    price_per_hour_usd: float  # on-demand list-ish price of one GPU; an assumption
    interconnect_bytes_per_s: float  # NVLink, one direction, per GPU: tensor-parallel all-reduce
    host_link_bytes_per_s: float  # GPU <-> host memory, one direction, pinned: the host tier's copies
    streaming_multiprocessors: int  # the decode kernel's grid follows it (zipage/decode_grid.py)

    @property
    def achievable_bandwidth(self) -> float:
        """Bytes per second a memory-bound kernel moves."""
        return self.hbm_bandwidth_bytes_per_s * self.bandwidth_fraction

    @property
    def achievable_flops(self) -> float:
        """bf16 FLOP per second a compute-bound kernel sustains."""
        return self.bf16_tflops * 1e12 * self.compute_fraction


# Hopper fractions come from measurements on this project's machines: a device-to-device copy
# moved 3.0 of 3.35 TB/s (H100) and 4.3 of 4.8 TB/s (H200), both 0.896 of peak, and an 8192^3 bf16
# matmul ran at 798 (H100) and 790 (H200) of 989 TFLOP/s, 0.80. So 0.89 and 0.80: what the best
# kernels reach; the cost model scales them for kernel classes that reach less (model-shaped
# GEMMs, attention). The A100 was not measured: we assume the same fractions. The step overhead
# is the host cost of a Python engine that replays CUDA graphs (one eager kernel launch measured
# 9.4 us on the H200 host; a step issues a few dozen host operations around the graph replay,
# plus scheduling and sampling), taken equal on all three since it depends on the host. The host
# link is PCIe (Gen5 x16 on the Hopper boards: 64 GB/s a direction on paper, of which pinned
# copies reach about 50; Gen4 x16 on the A100's: 32, about 25): assumptions until measured here.
HARDWARE: dict[str, GPUSpec] = {
    spec.name: spec
    for spec in [
        GPUSpec(
            name="a100-80gb", memory_gb=80, memory_bytes=int(79.15 * GIB),
            hbm_bandwidth_bytes_per_s=2.039e12, bandwidth_fraction=0.89,
            bf16_tflops=312.0, compute_fraction=0.80, step_overhead_s=400e-6,
            price_per_hour_usd=1.80, interconnect_bytes_per_s=300e9, host_link_bytes_per_s=25e9,
            streaming_multiprocessors=108,
        ),
        GPUSpec(
            name="h100-80gb", memory_gb=80, memory_bytes=int(79.11 * GIB),
            hbm_bandwidth_bytes_per_s=3.35e12, bandwidth_fraction=0.89,
            bf16_tflops=989.0, compute_fraction=0.80, step_overhead_s=400e-6,
            price_per_hour_usd=3.00, interconnect_bytes_per_s=450e9, host_link_bytes_per_s=50e9,
            streaming_multiprocessors=132,
        ),
        GPUSpec(
            name="h200-141gb", memory_gb=141, memory_bytes=150_109_880_320,
            hbm_bandwidth_bytes_per_s=4.8e12, bandwidth_fraction=0.89,
            bf16_tflops=989.0, compute_fraction=0.80, step_overhead_s=400e-6,
            price_per_hour_usd=3.80, interconnect_bytes_per_s=450e9, host_link_bytes_per_s=50e9,
            streaming_multiprocessors=132,
        ),
    ]
}

_ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "h200": "h200-141gb"}


def get_hardware(name: str) -> GPUSpec:
    """Look a GPU up by table name or alias, case-insensitively ("H100", "h100-80gb")."""
    key = name.strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key not in HARDWARE:
        known = ", ".join(sorted(HARDWARE) + sorted(_ALIASES))
        raise ConfigError(f"gpu: unknown GPU {name!r}; known GPUs are {known}")
    return HARDWARE[key]
