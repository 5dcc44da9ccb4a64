"""Every scheduling and compression knob, validated, with the paper's defaults.

`ZipageConfig` is what users set (flags of `zipage replay`, keyword arguments of `LLM(...)`). The
capacity the scheduler works with — number of KV blocks and query slots — is not a knob: it comes
from the memory planner (`zipage.core.memory`) or, in tests, is given directly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from zipage.errors import ConfigError

POOLING_MODES = ("first", "always", "off")
REDUNDANCY_MODES = ("lightning", "flash", "off")


@dataclass(frozen=True)
class ZipageConfig:
    block_size: int = 256
    window: int = 16
    kv_budget: int = 2048
    compress: bool = True
    hybrid: bool = True
    prefix_cache: bool = True
    async_compress: bool = True
    global_score: bool = True
    alpha: float = 0.8  # decay of the global score
    pooling: str = "first"
    redundancy: str = "lightning"
    lambda_weight: float = 0.2  # final score = lambda * attention - (1 - lambda) * redundancy
    tau: float = 0.4  # softmax temperature of the redundancy score
    similarity_threshold: float = 0.5  # p: near-duplicate keys above this cosine similarity
    layer_stride: int = 8
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16384
    # Cap on the source blocks of one compression batch (scratch memory and latency of a batch).
    max_compress_batch_blocks: int = 4096
    # Longest prompt + output a request may have (model context); None means no limit.
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def n_max(self) -> int:
        """Most blocks a request holds while decoding: the budget plus one block for new tokens."""
        return self.kv_budget // self.block_size + 1

    def validate(self) -> None:
        b = self.block_size
        if not isinstance(b, int) or b < 16 or b > 1024 or b & (b - 1):
            _bad("block_size", b, "a power of two between 16 and 1024 (e.g. --block-size 256)")
        # The window only exists for compression; Full KV may use blocks smaller than 2 * window.
        if self.compress and (
                not isinstance(self.window, int) or self.window < 1 or 2 * self.window > b):
            _bad("window", self.window, f"an integer with 1 <= window <= block_size/2 = {b // 2}")
        if not isinstance(self.kv_budget, int) or self.kv_budget < b or self.kv_budget % b:
            _bad("kv_budget", self.kv_budget,
                 f"a positive multiple of block_size {b} (e.g. --budget {max(b, 2048 // b * b)})")
        if self.pooling not in POOLING_MODES:
            _bad("pooling", self.pooling, f"one of {', '.join(POOLING_MODES)}")
        if self.redundancy not in REDUNDANCY_MODES:
            _bad("redundancy", self.redundancy, f"one of {', '.join(REDUNDANCY_MODES)}")
        for name in ("alpha", "lambda_weight"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                _bad(name, value, "a number between 0 and 1")
        if not self.tau > 0:
            _bad("tau", self.tau, "a positive number")
        if not -1.0 <= self.similarity_threshold <= 1.0:
            _bad("similarity_threshold", self.similarity_threshold, "a cosine similarity in [-1, 1]")
        for name in ("layer_stride", "max_num_seqs", "max_num_batched_tokens",
                     "max_compress_batch_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                _bad(name, value, "a positive integer")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            _bad("max_model_len", self.max_model_len, "an integer >= 2, or None for no limit")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "ZipageConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s) {', '.join(unknown)}; known: "
                              f"{', '.join(sorted(known))}")
        return cls(**values)


def _bad(field_name: str, value, expected: str) -> None:
    raise ConfigError(f"{field_name}: got {value!r}, expected {expected}")
