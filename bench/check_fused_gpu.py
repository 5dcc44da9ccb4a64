"""Check the fused elementwise Triton kernels against their torch references in bfloat16 on a GPU, then time them.

Part 1 compares ``rms_norm``, ``add_rms_norm``, ``silu_and_mul`` and ``rotary_qk`` (plain, and with Qwen3's per-head
norms) with the references of ``zipage.kernels.fused_ops_ref`` on the shapes of SmolLM2-135M, Qwen2.5-0.5B,
Qwen3-0.6B, Qwen3-8B and Llama-3.1-8B at 1, 7, 256 and 4096 tokens: queries and keys sliced out of a fused qkv
projection as the model has them, cos/sin from the model's own rotary table at random positions. The new residual
of ``add_rms_norm`` must be bit-identical (one rounded add either way); everything else within 2 bfloat16 ulps.
Part 2 times each op, Triton against the reference, for a Qwen3-8B decode token and a 4096-token prefill, and the
elementwise work of one whole Qwen3-8B decoder layer (the reference chain, which is what the layers ran before the
fusion, against the four fused kernels), all as CUDA-graph replays, the way decode runs.

Usage: ``python bench/check_fused_gpu.py`` (needs a CUDA GPU). Prints pass/fail per op and the timings; with
``$OUT`` set, also writes ``$OUT/check_fused_gpu.json``. Exits 1 if any check fails or a section crashes.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

import torch
import triton
import triton.testing

from zipage.engine.layers import RotaryEmbedding
from zipage.kernels import fused_ops_ref, fused_ops_triton
from zipage.presets import get_preset
from zipage.shape import ModelShape

DEVICE = "cuda"
DTYPE = torch.bfloat16
# Two bfloat16 ulps (8 significant bits): the kernels round where the reference rounds, so a value can only land
# on the other side of one rounding boundary.
ATOL = RTOL = 1.6e-2
CHECK_MODELS = ("smollm2-135m", "qwen2.5-0.5b", "qwen3-0.6b", "qwen3-8b", "llama-3.1-8b")
CHECK_TOKENS = (1, 7, 256, 4096)
TIMED_MODEL = "qwen3-8b"
TIMED_TOKENS = (1, 4096)
OPS = ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary_qk", "rotary_qk+qk_norm")


class LayerInputs:
    """Random activations of one decoder layer's elementwise ops for ``num_tokens`` tokens of ``shape``."""

    def __init__(self, shape: ModelShape, num_tokens: int, generator: torch.Generator) -> None:
        def random(*size: int, scale: float = 1.0) -> torch.Tensor:
            return (scale * torch.randn(size, generator=generator, device=DEVICE)).to(DTYPE)

        def norm_weight(size: int) -> torch.Tensor:
            return (1 + 0.1 * torch.randn(size, generator=generator, device=DEVICE)).to(DTYPE)

        self.eps = shape.rms_norm_eps
        self.x, self.residual = random(num_tokens, shape.hidden_size), random(num_tokens, shape.hidden_size, scale=4.0)
        self.weight = norm_weight(shape.hidden_size)
        self.gate_up = random(num_tokens, 2 * shape.intermediate_size, scale=3.0)
        query_size, key_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        qkv = random(num_tokens, query_size + 2 * key_size, scale=3.0)
        query, key, _ = qkv.split([query_size, key_size, key_size], dim=-1)
        self.query = query.reshape(num_tokens, shape.num_heads, shape.head_dim)
        self.key = key.reshape(num_tokens, shape.num_kv_heads, shape.head_dim)
        with torch.device(DEVICE):
            rotary = RotaryEmbedding(shape.head_dim, shape.max_position, shape.rope_theta, shape.rope_scaling)
        positions = torch.randint(0, shape.max_position, (num_tokens,), generator=generator, device=DEVICE)
        self.cos, self.sin = rotary(positions)
        self.q_norm_weight, self.k_norm_weight = norm_weight(shape.head_dim), norm_weight(shape.head_dim)

    def calls(self, module, suffix: str) -> dict:
        """Each op of ``OPS`` as a no-argument call into ``module`` (``fused_ops_ref`` or ``fused_ops_triton``)."""
        def op(name: str):
            return getattr(module, f"{name}{suffix}")

        rotary_arguments = (self.query, self.key, self.cos, self.sin)
        return {
            "rms_norm": lambda: op("rms_norm")(self.x, self.weight, self.eps),
            "add_rms_norm": lambda: op("add_rms_norm")(self.x, self.residual, self.weight, self.eps),
            "silu_and_mul": lambda: op("silu_and_mul")(self.gate_up),
            "rotary_qk": lambda: op("rotary_qk")(*rotary_arguments),
            "rotary_qk+qk_norm": lambda: op("rotary_qk")(
                *rotary_arguments, self.q_norm_weight, self.k_norm_weight, self.eps
            ),
        }

    def layer_chain(self, module, suffix: str):
        """The elementwise work of one decoder layer, in order: input norm with the residual add, qk norm + RoPE,
        post-attention norm with the residual add, SiLU-and-mul."""
        calls = self.calls(module, suffix)
        return lambda: (calls["add_rms_norm"](), calls["rotary_qk+qk_norm"](), calls["add_rms_norm"](),
                        calls["silu_and_mul"]())


def as_tuple(result) -> tuple[torch.Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


def check(seed: int) -> list[dict]:
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    results = []
    for model in CHECK_MODELS:
        shape = get_preset(model)
        for num_tokens in CHECK_TOKENS:
            inputs = LayerInputs(shape, num_tokens, generator)
            references, kernels = inputs.calls(fused_ops_ref, "_ref"), inputs.calls(fused_ops_triton, "_triton")
            for op in OPS:
                expected, actual = as_tuple(references[op]()), as_tuple(kernels[op]())
                error = max((a.float() - e.float()).abs().max().item() for a, e in zip(actual, expected))
                passed = all(
                    a.dtype == e.dtype and torch.allclose(a.float(), e.float(), atol=ATOL, rtol=RTOL)
                    for a, e in zip(actual, expected)
                )
                if op == "add_rms_norm":
                    passed = passed and torch.equal(actual[1], expected[1])
                results.append(
                    {"op": op, "model": model, "tokens": num_tokens, "max_abs_error": error, "passed": bool(passed)}
                )
    for op in OPS:
        rows = [row for row in results if row["op"] == op]
        failures = [f"{row['model']} x {row['tokens']}" for row in rows if not row["passed"]]
        worst = max(row["max_abs_error"] for row in rows)
        verdict = "PASS" if not failures else "FAIL: " + ", ".join(failures)
        print(f"  {op:<18} {len(rows) - len(failures)}/{len(rows)} (largest error {worst:.2e})  {verdict}")
    return results


def graph_microseconds(function) -> float:
    return triton.testing.do_bench_cudagraph(function, rep=50, return_mode="median") * 1e3


def time_ops(seed: int) -> dict:
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    shape = get_preset(TIMED_MODEL)
    timings: dict = {"ops": [], "layer": []}
    print(f"\n{TIMED_MODEL}, bfloat16, CUDA-graph replay, median µs")
    print(f"  {'op':<18} {'tokens':>6} {'reference':>10} {'triton':>8} {'speedup':>8}")
    for num_tokens in TIMED_TOKENS:
        inputs = LayerInputs(shape, num_tokens, generator)
        references, kernels = inputs.calls(fused_ops_ref, "_ref"), inputs.calls(fused_ops_triton, "_triton")
        for op in OPS:
            reference, triton_time = graph_microseconds(references[op]), graph_microseconds(kernels[op])
            timings["ops"].append({"op": op, "tokens": num_tokens, "reference_us": reference, "triton_us": triton_time})
            print(f"  {op:<18} {num_tokens:>6} {reference:>10.1f} {triton_time:>8.1f} {reference / triton_time:>7.1f}x")
        reference = graph_microseconds(inputs.layer_chain(fused_ops_ref, "_ref"))
        fused = graph_microseconds(inputs.layer_chain(fused_ops_triton, "_triton"))
        timings["layer"].append({"tokens": num_tokens, "reference_us": reference, "triton_us": fused})
        print(f"  {'whole layer':<18} {num_tokens:>6} {reference:>10.1f} {fused:>8.1f} {reference / fused:>7.1f}x"
              f"  (x {shape.num_layers} layers: {reference * shape.num_layers / 1e3:.2f} ms -> "
              f"{fused * shape.num_layers / 1e3:.2f} ms)")
    return timings


def section(name: str, function, crashed: list[str]):
    """Run one part; a crash is printed with its traceback and counted as a failure, and the other parts still run."""
    try:
        return function()
    except Exception:  # noqa: BLE001
        crashed.append(name)
        print(f"{name} CRASHED:\n{traceback.format_exc()}")
        return None


def main() -> int:
    if not torch.cuda.is_available():
        print("check_fused_gpu.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{datetime.datetime.now().isoformat(timespec='seconds')} {torch.cuda.get_device_name(0)}, "
          f"torch {torch.__version__}, triton {triton.__version__}")
    print(f"checks: Triton vs reference, bfloat16, atol=rtol={ATOL}, {len(CHECK_MODELS)} model shapes x "
          f"{len(CHECK_TOKENS)} token counts")
    crashed: list[str] = []
    checks = section("checks", lambda: check(seed=0), crashed) or []
    timings = section("timing", lambda: time_ops(seed=0), crashed)
    passed = bool(checks) and all(row["passed"] for row in checks) and not crashed
    output_dir = os.environ.get("OUT")
    if output_dir:
        with open(os.path.join(output_dir, "check_fused_gpu.json"), "w") as json_file:
            json.dump(
                {"device": torch.cuda.get_device_name(0), "passed": passed, "checks": checks, "timings": timings,
                 "crashed": crashed},
                json_file,
                indent=1,
            )
    print(f"RESULT: {'PASS' if passed else 'FAIL'}" + (f" (crashed: {', '.join(crashed)})" if crashed else ""))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
