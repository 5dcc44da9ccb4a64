"""Zipage: Compressed PagedAttention inference and its simulator twin.

`import zipage` stays light (no torch): `LLM` loads the engine on first use.
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from zipage.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from zipage.core.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'zipage' has no attribute {name!r}")
