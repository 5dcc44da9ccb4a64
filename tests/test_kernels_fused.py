"""Fused elementwise kernels: the torch references against plain formulas (float64 maths, and HF transformers' own
modules, which they must match bit for bit in float32), and the Triton kernels against the references through the
Triton interpreter (CPU, float32 and float16), up to a whole model's forward.

As in ``test_kernels_attention.py``, Triton decides whether it interprets when it is first imported, so the Triton
tests run in a child pytest process started with ``TRITON_INTERPRET=1`` (``test_triton_kernels_under_the_interpreter``)
and are skipped in the parent, which never imports Triton. To run them directly:
``TRITON_INTERPRET=1 pytest tests/test_kernels_fused.py``. Sizes are odd on purpose (hidden 576, 7 tokens, 6 query
heads over 2 KV heads) so that every padding mask and partial tile of the kernels is exercised.
"""

from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")

from triton_interpreter import (  # noqa: E402
    HOPPER_COMMAND,
    TRITON_INSTALLED,
    UNDER_INTERPRETER,
    compile_for_hopper,
    run_hopper_compilation,
    run_test_file_under_interpreter,
    under_interpreter,
)

from zipage.kernels import fused_ops  # noqa: E402
from zipage.kernels.fused_ops_ref import add_rms_norm_ref, rms_norm_ref, rotary_qk_ref, silu_and_mul_ref  # noqa: E402

EPS = 1e-6
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=1e-3)}


@pytest.fixture(scope="module")
def triton_kernels():
    from zipage.kernels import fused_ops_triton

    return fused_ops_triton


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
@pytest.mark.skipif(UNDER_INTERPRETER, reason="this is the child process already")
def test_triton_kernels_under_the_interpreter():
    run_test_file_under_interpreter(__file__)


def hopper_launches() -> list:
    """Every fused kernel variant with the constexpr values of one bfloat16 launch."""
    from zipage.kernels import fused_ops_triton as kernels

    launches = [
        (kernels._rms_norm_kernel, dict(ADD_RESIDUAL=add_residual, BLOCK=4096)) for add_residual in (False, True)
    ]
    launches.append((kernels._silu_and_mul_kernel, dict(BLOCK=1024)))
    launches += [
        (
            kernels._rotary_qk_kernel,
            dict(HEAD_DIM=128, HALF_PADDED=64, HEADS_PER_PROGRAM=4, NORM_QUERY=norm, NORM_KEY=norm),
        )
        for norm in (False, True)
    ]
    return launches


def argument_type(name: str) -> str:
    """Triton's type of a kernel argument as the model passes it: bfloat16 tensors, float32 cos/sin tables."""
    if name in ("cos_ptr", "sin_ptr"):
        return "*fp32"
    if name.endswith("_ptr"):
        return "*bf16"
    return "fp32" if name == "eps" else "i32"


@pytest.mark.skipif(not TRITON_INSTALLED, reason="triton is not installed")
@pytest.mark.skipif(UNDER_INTERPRETER, reason="the compiler needs Triton imported without the interpreter")
def test_kernels_compile_for_hopper():
    run_hopper_compilation(__file__)


def random(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(shape, generator=generator)).to(dtype)


def norm_weight(size: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    return (1 + 0.1 * torch.randn(size, generator=generator)).to(dtype)


def rotary_angles(num_tokens: int, head_dim: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [num_tokens, head_dim / 2] (float32, like the model's tables) of random angles."""
    angles = 100 * torch.rand((num_tokens, head_dim // 2), generator=generator)
    return angles.cos(), angles.sin()


def fused_query_key(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Query and key as the model has them: views into one fused [q | k | v] projection (token stride > heads x dim)."""
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    query, key, _ = random((num_tokens, sum(sizes)), dtype, generator).split(sizes, dim=-1)
    return query.reshape(num_tokens, num_heads, head_dim), key.reshape(num_tokens, num_kv_heads, head_dim)


# ------------------------------------------------------------------ references against plain formulas
# (run in the parent only: the interpreter child has nothing to add to them)

in_parent = pytest.mark.skipif(UNDER_INTERPRETER, reason="reference test: runs in the parent process")


@in_parent
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_reference_is_the_rms_norm_formula(dtype):
    generator = torch.Generator().manual_seed(0)
    x, weight = random((7, 576), dtype, generator, scale=3.0), norm_weight(576, dtype, generator)
    x64 = x.double()
    expected = x64 / torch.sqrt(x64.pow(2).mean(dim=-1, keepdim=True) + EPS) * weight.double()
    out = rms_norm_ref(x, weight, EPS)
    assert out.dtype == dtype
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(out.double(), expected, **tolerance)


@in_parent
def test_add_rms_norm_reference_adds_then_normalises():
    generator = torch.Generator().manual_seed(1)
    x, residual = random((7, 64), torch.bfloat16, generator), random((7, 64), torch.bfloat16, generator)
    weight = norm_weight(64, torch.bfloat16, generator)
    out, new_residual = add_rms_norm_ref(x, residual, weight, EPS)
    assert torch.equal(new_residual, residual + x)
    assert torch.equal(out, rms_norm_ref(residual + x, weight, EPS))


@in_parent
def test_silu_and_mul_reference_is_swiglu():
    generator = torch.Generator().manual_seed(2)
    gate_up = random((7, 2 * 576), torch.float32, generator, scale=3.0)
    gate, up = gate_up.double().chunk(2, dim=-1)
    expected = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(silu_and_mul_ref(gate_up).double(), expected, atol=1e-5, rtol=1e-5)


@in_parent
@pytest.mark.parametrize("with_norm", [False, True])
def test_rotary_reference_rotates_half_split_pairs(with_norm):
    """Pair (i, i + head_dim / 2) of a head is the complex number x_i + j x_(i + head_dim / 2), turned by
    e^(j angle)."""
    generator = torch.Generator().manual_seed(3)
    head_dim = 64
    query, key = fused_query_key(7, 6, 2, head_dim, torch.float32, generator)
    cos, sin = rotary_angles(7, head_dim, generator)
    weights = (norm_weight(head_dim, torch.float32, generator), norm_weight(head_dim, torch.float32, generator))
    out_query, out_key = rotary_qk_ref(query, key, cos, sin, *(weights if with_norm else (None, None)), eps=EPS)
    turn = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos)).to(torch.complex128)[:, None, :]
    for x, out, weight in zip((query, key), (out_query, out_key), weights):
        x = x.double()
        if with_norm:
            x = x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + EPS) * weight.double()
        first, second = x.chunk(2, dim=-1)
        turned = torch.complex(first, second) * turn
        torch.testing.assert_close(out.double(), torch.cat((turned.real, turned.imag), dim=-1), atol=1e-5, rtol=1e-5)


@in_parent
def test_references_match_hf_transformers_bit_for_bit_in_float32():
    """The engine's CPU path stays token-identical to HF because the references compute exactly what HF does."""
    pytest.importorskip("transformers")
    from transformers.activations import ACT2FN
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    generator = torch.Generator().manual_seed(4)
    head_dim, num_tokens = 128, 7
    hf_norm = LlamaRMSNorm(576, eps=EPS)
    hf_norm.weight.data = norm_weight(576, torch.float32, generator)
    x, residual = (random((num_tokens, 576), torch.float32, generator) for _ in range(2))
    assert torch.equal(rms_norm_ref(x, hf_norm.weight, EPS), hf_norm(x))
    out, new_residual = add_rms_norm_ref(x, residual, hf_norm.weight, EPS)
    assert torch.equal(new_residual, residual + x) and torch.equal(out, hf_norm(residual + x))

    gate_up = random((num_tokens, 2 * 576), torch.float32, generator, scale=3.0)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(silu_and_mul_ref(gate_up), ACT2FN["silu"](gate) * up)

    query, key = fused_query_key(num_tokens, 6, 2, head_dim, torch.float32, generator)
    cos, sin = rotary_angles(num_tokens, head_dim, generator)
    q_norm, k_norm = LlamaRMSNorm(head_dim, eps=EPS), LlamaRMSNorm(head_dim, eps=EPS)  # Qwen3's q_norm / k_norm
    q_norm.weight.data, k_norm.weight.data = (norm_weight(head_dim, torch.float32, generator) for _ in range(2))
    # HF: heads before tokens, and cos/sin repeated over both halves of head_dim.
    hf_query, hf_key = apply_rotary_pos_emb(
        q_norm(query).transpose(0, 1), k_norm(key).transpose(0, 1), cos.repeat(1, 2), sin.repeat(1, 2),
        unsqueeze_dim=0,
    )
    out_query, out_key = rotary_qk_ref(query, key, cos, sin, q_norm.weight, k_norm.weight, EPS)
    assert torch.equal(out_query, hf_query.transpose(0, 1)) and torch.equal(out_key, hf_key.transpose(0, 1))


# ------------------------------------------------------------------ Triton against the references


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **TOLERANCES[expected.dtype])


@under_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden_size", [64, 576, 1024])
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_rms_norms_match_reference(triton_kernels, dtype, hidden_size, num_tokens):
    generator = torch.Generator().manual_seed(hidden_size + num_tokens)
    # x is a column slice of a wider tensor: rows are read through their stride.
    x = random((num_tokens, hidden_size + 8), dtype, generator, scale=3.0)[:, 8:]
    residual = random((num_tokens, hidden_size), dtype, generator)
    weight = norm_weight(hidden_size, dtype, generator)
    assert_matches(triton_kernels.rms_norm_triton(x, weight, EPS), rms_norm_ref(x, weight, EPS))
    out, new_residual = triton_kernels.add_rms_norm_triton(x, residual, weight, EPS)
    expected_out, expected_residual = add_rms_norm_ref(x, residual, weight, EPS)
    assert torch.equal(new_residual, expected_residual)  # one correctly rounded add either way
    assert_matches(out, expected_out)


@under_interpreter
def test_rms_norm_keeps_leading_dimensions_and_promotes_like_torch(triton_kernels):
    generator = torch.Generator().manual_seed(5)
    x = random((2, 3, 64), torch.float16, generator)
    weight = norm_weight(64, torch.float32, generator)  # a float32 weight promotes the output, as in torch
    assert_matches(triton_kernels.rms_norm_triton(x, weight, EPS), rms_norm_ref(x, weight, EPS))
    empty = torch.empty((0, 64), dtype=torch.float16)
    assert triton_kernels.add_rms_norm_triton(empty, empty, weight, EPS)[0].shape == (0, 64)


@under_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("intermediate_size", [64, 576, 1536])  # 1536: a full 1024-column tile and a partial one
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_silu_and_mul_matches_reference(triton_kernels, dtype, intermediate_size, num_tokens):
    generator = torch.Generator().manual_seed(intermediate_size + num_tokens)
    gate_up = random((num_tokens, 2 * intermediate_size), dtype, generator, scale=3.0)
    assert_matches(triton_kernels.silu_and_mul_triton(gate_up), silu_and_mul_ref(gate_up))


ROTARY_CASES = [
    # (dtype, head_dim, num_tokens, norm: None / "both" / "query")
    (dtype, head_dim, num_tokens, norm)
    for dtype in (torch.float32, torch.float16)
    for head_dim in (64, 128)
    for num_tokens in (1, 7)
    for norm in (None, "both")
] + [(torch.float16, 128, 7, "query"), (torch.float32, 80, 7, "both")]  # 80: 40 pairs padded to 64


@under_interpreter
@pytest.mark.parametrize("dtype,head_dim,num_tokens,norm", ROTARY_CASES)
def test_rotary_qk_matches_reference(triton_kernels, dtype, head_dim, num_tokens, norm):
    generator = torch.Generator().manual_seed(head_dim + num_tokens)
    # 6 query heads over 2 KV heads: the second program of a token has a partial query tile and no key heads.
    query, key = fused_query_key(num_tokens, 6, 2, head_dim, dtype, generator)
    cos, sin = rotary_angles(num_tokens, head_dim, generator)
    q_norm_weight = norm_weight(head_dim, dtype, generator) if norm else None
    k_norm_weight = norm_weight(head_dim, dtype, generator) if norm == "both" else None
    arguments = (query, key, cos, sin, q_norm_weight, k_norm_weight, EPS)
    query_before, key_before = query.clone(), key.clone()
    for actual, expected in zip(triton_kernels.rotary_qk_triton(*arguments), rotary_qk_ref(*arguments)):
        assert actual.is_contiguous()
        assert_matches(actual, expected)
    assert torch.equal(query, query_before) and torch.equal(key, key_before)  # inputs are not written


@under_interpreter
def test_dispatch_uses_reference_for_cpu_tensors_unless_interpreted(triton_kernels, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    generator = torch.Generator().manual_seed(6)
    gate_up = random((3, 128), torch.float32, generator)
    calls = []
    monkeypatch.setattr(triton_kernels, "silu_and_mul_triton", lambda *arguments: calls.append(arguments))
    torch.testing.assert_close(fused_ops.silu_and_mul(gate_up), silu_and_mul_ref(gate_up))
    assert not calls
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # forces Triton on CPU tensors
    fused_ops.silu_and_mul(gate_up)
    assert len(calls) == 1


@under_interpreter
def test_model_forward_with_triton_kernels_matches_references(monkeypatch):
    """A Qwen3-shaped model (qk_norm, GQA) prefilling 7 tokens: every kernel through Triton vs every reference."""
    from zipage.engine.context import ForwardContext, forward_context
    from zipage.engine.loader import build_model, initialise_random
    from zipage.presets import get_preset

    shape = get_preset("qwen3-0.6b").scaled(
        num_layers=2, hidden_size=64, num_heads=6, num_kv_heads=2, head_dim=32, intermediate_size=96,
        vocab_size=128, max_position=64,
    )
    model = build_model(shape, torch.float32, torch.device("cpu"))
    initialise_random(model, seed=0)
    for layer in model.attention_layers():
        layer.k_cache, layer.v_cache = (torch.zeros((2, 16, 2, 32)) for _ in range(2))
    context = ForwardContext(
        is_prefill=True,
        slot_mapping=torch.arange(7) + 16,
        cu_seqlens_q=torch.tensor([0, 7], dtype=torch.int32),
        context_lens=torch.tensor([7], dtype=torch.int32),
        block_tables=torch.tensor([[1]], dtype=torch.int32),
    )
    input_ids, positions = torch.randint(0, 128, (7,), generator=torch.Generator().manual_seed(7)), torch.arange(7)
    with torch.no_grad(), forward_context(context):
        with_triton = model(input_ids, positions)
        monkeypatch.delenv("TRITON_INTERPRET")  # the dispatch now picks every reference
        with_references = model(input_ids, positions)
    torch.testing.assert_close(with_triton, with_references, atol=1e-4, rtol=1e-4)


if __name__ == "__main__" and sys.argv[1:] == [HOPPER_COMMAND]:
    sys.exit(compile_for_hopper(hopper_launches, argument_type))
