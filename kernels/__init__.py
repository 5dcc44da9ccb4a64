"""Triton kernels of the engine, each with a pure-torch reference of the same signature (the CPU path and the
test oracle). Importing this package needs torch; ``zipage`` and ``zipage.core`` never import it."""

from zipage.kernels.attention import paged_decode_attention, paged_prefill_attention, store_kv, store_queries

__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kv", "store_queries"]
