"""The engine's fused elementwise ops of a decoder layer: RMSNorm (optionally fused with the residual add),
SiLU-and-mul, and RoPE of queries and keys (optionally after Qwen3's per-head RMSNorm).

Each call goes to the Triton kernel of ``fused_ops_triton.py`` or to the pure-torch reference of
``fused_ops_ref.py``, by the one dispatch rule (``kernels/dispatch.py``): Triton on CUDA tensors, or on the CPU
when ``TRITON_INTERPRET=1`` is set (the Triton interpreter); the reference otherwise, including on a machine
without Triton. The Triton module is imported only when first needed. Both return new tensors and leave their
inputs untouched; see the references for the exact semantics.
"""

from __future__ import annotations

from types import ModuleType

import torch

from zipage.kernels.dispatch import use_triton
from zipage.kernels.fused_ops_ref import add_rms_norm_ref, rms_norm_ref, rotary_qk_ref, silu_and_mul_ref


def _fused_triton(tensor: torch.Tensor) -> ModuleType | None:
    """The fused Triton kernels module if this call should use it, else None (use the reference)."""
    if not use_triton(tensor):
        return None
    from zipage.kernels import fused_ops_triton

    return fused_ops_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dimension; see ``rms_norm_ref``."""
    backend = _fused_triton(x)
    if backend is None:
        return rms_norm_ref(x, weight, eps)
    return backend.rms_norm_triton(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x), residual + x)`` in one pass; see ``add_rms_norm_ref``."""
    backend = _fused_triton(x)
    if backend is None:
        return add_rms_norm_ref(x, residual, weight, eps)
    return backend.add_rms_norm_triton(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused ``[gate | up]`` projection; see ``silu_and_mul_ref``."""
    backend = _fused_triton(gate_up)
    if backend is None:
        return silu_and_mul_ref(gate_up)
    return backend.silu_and_mul_triton(gate_up)


def rotary_qk(
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of ``query`` and ``key`` (each head RMS-normalised first when its norm weight is given), one launch for
    both; see ``rotary_qk_ref``."""
    backend = _fused_triton(query)
    if backend is None:
        return rotary_qk_ref(query, key, cos, sin, q_norm_weight, k_norm_weight, eps)
    return backend.rotary_qk_triton(query, key, cos, sin, q_norm_weight, k_norm_weight, eps)
