"""`zipage`: the paper's pipeline, the default (docs/architecture.md, 'Compression pipeline').

Attention of the window queries, the decayed global score, max pooling and the redundancy score,
each shaped by its knob; the reference is `kernels/compress_ref.py`'s `final_scores`, the fast
path the batched Triton kernels of `kernels/compress_triton.py`.
"""

from __future__ import annotations

from zipage.kernels.compress_ref import pipeline_scorer
from zipage.kernels.scoring.base import ScoringPolicy


def _triton(*args, **kwargs) -> None:
    from zipage.kernels.compress_triton import compress_triton

    compress_triton(*args, **kwargs)


POLICY = ScoringPolicy("zipage", pipeline_scorer, triton=_triton)
