"""The eviction scoring policies, one module each, registered by name (`--scoring`).

The contract is `base.ScoringPolicy`; the facts the layers without torch need (flags, cost
terms) are in `zipage/scoring.py` under the same names. Adding a policy: docs/architecture.md,
'Adding a scoring policy'.
"""

from __future__ import annotations

from zipage.kernels.scoring import keydiff, random_choice, rkv, snapkv, streaming, vnorm, zipage_pipeline
from zipage.kernels.scoring.base import ScoringPolicy

SCORERS: dict[str, ScoringPolicy] = {
    module.POLICY.name: module.POLICY
    for module in (zipage_pipeline, snapkv, rkv, streaming, random_choice, keydiff, vnorm)
}


def scoring_policy(name: str) -> ScoringPolicy:
    try:
        return SCORERS[name]
    except KeyError:
        raise ValueError(f"scoring: got {name!r}, expected one of {', '.join(SCORERS)}") from None
