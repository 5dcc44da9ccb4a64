"""Pure-torch fused elementwise ops of the decoder layers: the CPU path of the engine and the oracle of the Triton
kernels in ``fused_ops_triton.py``.

Each function is exactly the maths the layers did before these ops were fused, which is HF transformers' order of
operations: statistics and rotation in float32, results cast back to the activation dtype, the RMSNorm weight
applied after that cast. On the CPU the engine therefore stays bit-identical to HF in float32. The functions are
functional: they return new tensors and never write their inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (any leading shape): float32 statistics, the normalised value cast
    back to ``x``'s dtype, then multiplied by ``weight`` ``[x.shape[-1]]`` (result in their promoted dtype)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold a sublayer's output ``x`` into the residual stream and normalise the result for the next sublayer.

    Returns ``(rms_norm(residual + x), residual + x)``. The sum is rounded to the stream's dtype before it is
    normalised, as HF computes ``hidden = residual + hidden`` and then runs the next norm on it.
    """
    residual = residual + x
    return rms_norm_ref(residual, weight, eps), residual


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation of a fused ``[..., 2 * intermediate]`` projection ``[gate | up]``: ``silu(gate) * up``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_qk_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of ``query`` ``[num_tokens, num_heads, head_dim]`` and ``key``
    ``[num_tokens, num_kv_heads, head_dim]``, each head first RMS-normalised with its norm weight ``[head_dim]``
    when one is given (Qwen3's qk_norm; ``eps`` is used only then).

    ``cos`` and ``sin`` ``[num_tokens, head_dim / 2]`` are the angles of each token's position. Dimensions pair up in
    HF's half-split layout (``i`` with ``i + head_dim / 2``) and rotate in float32; each result is cast back to its
    input's dtype (after the norm: the norm's output dtype).
    """
    if q_norm_weight is not None:
        query = rms_norm_ref(query, q_norm_weight, eps)
    if k_norm_weight is not None:
        key = rms_norm_ref(key, k_norm_weight, eps)
    return _rotate_half_split(query, cos, sin), _rotate_half_split(key, cos, sin)


def _rotate_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return rotated.to(x.dtype)
