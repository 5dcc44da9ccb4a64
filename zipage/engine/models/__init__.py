"""Our own decoder implementations, looked up by `ModelShape.architecture`.

All three share the Llama layers (`llama.py`); Qwen2 adds q/k/v biases, Qwen3 per-head q/k norms.
Importing this package imports torch: only the engine does, never `zipage.core`.
"""

from __future__ import annotations

from zipage.engine.models.llama import LlamaForCausalLM
from zipage.engine.models.qwen2 import Qwen2ForCausalLM
from zipage.engine.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}
