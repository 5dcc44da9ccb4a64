"""How a model is split over tensor-parallel ranks, and each rank's weights.

Megatron's layout: rank r of N holds query heads [r Hq/N, (r+1) Hq/N) and the KV heads they
attend with, MLP columns [r I/N, (r+1) I/N), and vocabulary rows [r V', (r+1) V') with
V' = ceil(V / N) (the last slice zero-padded). When N exceeds the KV heads, each KV head is
replicated on N / Hkv consecutive ranks, each holding part of its query heads.

Valid sizes: N divides the query heads and the MLP width, and either divides the KV heads or is
a multiple of them (SmolLM2-135M, 9 query / 3 KV heads, MLP width 1536: 1 or 3; Qwen3-32B, 64
query / 8 KV heads: 1, 2, 4, 8, and 16, 32, 64 with replicated KV heads). Anything else is a
`ConfigError` naming the field and the valid sizes.

A rank loads its shard by building the full model's weights tensor by tensor and keeping its
slice: random presets generate each full tensor on the rank's device with the loader's seeded
sequence (so TP=N holds exactly the weights TP=1 holds); checkpoints are loaded whole on the CPU
by the loader, then sliced.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from zipage.engine.distributed import ShardGroup, shard_group
from zipage.engine.layers import FusedLinear
from zipage.engine.loader import RANDOM_PREFIX, RANDOM_SEED, build_model, fill_random, load_model
from zipage.errors import ConfigError
from zipage.shape import ModelShape


def valid_sizes(shape: ModelShape) -> list[int]:
    return [n for n in range(1, shape.num_heads + 1) if _divides(shape, n)]


def _divides(shape: ModelShape, n: int) -> bool:
    kv = shape.num_kv_heads
    return (shape.num_heads % n == 0 and shape.intermediate_size % n == 0
            and (kv % n == 0 or n % kv == 0))


def check_tensor_parallel(shape: ModelShape, world: int) -> None:
    """Refuse a rank count that does not split `shape` evenly."""
    if not isinstance(world, int) or world < 1:
        raise ConfigError(f"tensor_parallel: got {world!r}, expected an integer >= 1")
    if not _divides(shape, world):
        sizes = ", ".join(map(str, valid_sizes(shape)))
        raise ConfigError(
            f"tensor_parallel: {world} ranks cannot split {shape.name}'s {shape.num_heads} query / "
            f"{shape.num_kv_heads} KV heads (MLP width {shape.intermediate_size}) evenly; "
            f"use --tensor-parallel {sizes}")


@dataclass(frozen=True)
class ShardLayout:
    """Rank `rank` of `world`'s share of the full model `shape`."""

    shape: ModelShape
    rank: int
    world: int

    @property
    def kv_replicas(self) -> int:
        """Ranks holding each KV head (1 unless there are fewer KV heads than ranks)."""
        return max(1, self.world // self.shape.num_kv_heads)

    @property
    def query_heads(self) -> range:
        per_rank = self.shape.num_heads // self.world
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    @property
    def kv_heads(self) -> range:
        if self.kv_replicas > 1:
            head = self.rank // self.kv_replicas
            return range(head, head + 1)
        per_rank = self.shape.num_kv_heads // self.world
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    @property
    def mlp_columns(self) -> range:
        per_rank = self.shape.intermediate_size // self.world
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def local_shape(self) -> ModelShape:
        """The shape this rank's model is built from: its heads and MLP slice; hidden size and
        vocabulary stay whole (the vocabulary layers split themselves by `ShardGroup`)."""
        return replace(self.shape, num_heads=len(self.query_heads),
                       num_kv_heads=len(self.kv_heads),
                       intermediate_size=len(self.mlp_columns))

    def replica_groups(self) -> list[list[int]]:
        """The ranks sharing each KV head, when heads are replicated (else none)."""
        if self.kv_replicas == 1:
            return []
        r = self.kv_replicas
        return [list(range(head * r, (head + 1) * r)) for head in range(self.shape.num_kv_heads)]

    # ------------------------------------------------------------------ slicing

    def shard(self, name: str, tensor: torch.Tensor, fused: FusedLinear | None) -> torch.Tensor:
        """This rank's slice of the full model's parameter `name` (our fused names);
        `fused` is the full model's module when the parameter belongs to a fused projection."""
        d = self.shape.head_dim
        parent = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
        if fused is not None:
            pieces = []
            for shard, (start, size) in fused.shard_rows.items():
                rows = tensor.narrow(0, start, size)
                if shard == "q":
                    pieces.append(_rows(rows, self.query_heads, d))
                elif shard in ("k", "v"):
                    pieces.append(_rows(rows, self.kv_heads, d))
                else:  # gate, up
                    pieces.append(_rows(rows, self.mlp_columns, 1))
            return torch.cat(pieces)
        if parent == "o_proj" and name.endswith("weight"):
            return _rows(tensor.t(), self.query_heads, d).t()
        if parent == "down_proj" and name.endswith("weight"):
            return _rows(tensor.t(), self.mlp_columns, 1).t()
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            start, per_rank = ShardGroup(self.rank, self.world).vocab_rows(self.shape.vocab_size)
            rows = tensor[start:start + per_rank]
            if rows.shape[0] < per_rank:
                rows = torch.cat([rows, rows.new_zeros(per_rank - rows.shape[0], rows.shape[1])])
            return rows
        return tensor


def _rows(tensor: torch.Tensor, units: range, width: int) -> torch.Tensor:
    return tensor[units.start * width:units.stop * width]


# ---------------------------------------------------------------------- loading


@torch.no_grad()
def load_shard(spec: str, layout: ShardLayout, dtype: torch.dtype, device: torch.device
               ) -> tuple[torch.nn.Module, object | None]:
    """This rank's model (built from `layout.local_shape()` with the `ShardGroup` already set)
    holding its slice of the weights `spec` names, and the tokenizer (None for random weights)."""
    model = build_model(layout.local_shape(), dtype, device)
    parameters = dict(model.named_parameters())
    with shard_group(ShardGroup()):  # the full model is a one-rank model
        if spec.lower().startswith(RANDOM_PREFIX):
            skeleton = build_model(layout.shape, dtype, torch.device("meta"))
            full_tensors, tokenizer = _random_full_tensors(skeleton, dtype, device), None
        else:
            skeleton, _, tokenizer = load_model(spec, dtype, "cpu")
            full_tensors = ((name, p.data) for name, p in skeleton.named_parameters())
    fused = _fused_modules(skeleton)
    for name, tensor in full_tensors:
        module = fused.get(name.rpartition(".")[0])
        parameters.pop(name).data.copy_(layout.shard(name, tensor, module))
    assert not parameters, f"parameters left unloaded: {sorted(parameters)[:3]}"
    return model, tokenizer


def _fused_modules(model: torch.nn.Module) -> dict[str, FusedLinear]:
    return {name: module for name, module in model.named_modules()
            if isinstance(module, FusedLinear)}


def _random_full_tensors(skeleton: torch.nn.Module, dtype: torch.dtype, device: torch.device):
    """The full model's random weights one tensor at a time, exactly as `loader.initialise_random`
    fills a whole model (same order, same generator), without ever holding the whole model:
    `loader.fill_random` per tensor (`test_tensor_parallel` checks the match)."""
    generator = torch.Generator(device=device).manual_seed(RANDOM_SEED)
    for module_name, module in skeleton.named_modules():
        for name, parameter in module.named_parameters(recurse=False):
            tensor = torch.empty(parameter.shape, dtype=dtype, device=device)
            fill_random(module, name, tensor, generator)
            yield f"{module_name}.{name}" if module_name else name, tensor
