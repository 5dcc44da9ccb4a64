"""Which cost model a run uses: `--cost-model analytic` (the default), a profile file, or the
name of a profile shipped in sim/profiles/. A module of its own because it names both models,
and both import the interface in `sim/cost_model.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zipage.errors import ConfigError
from zipage.hardware import GPUSpec
from zipage.profile import check_knob_names
from zipage.shape import ModelShape
from zipage.sim.analytic import AnalyticCostModel
from zipage.sim.calibrated import CalibratedCostModel
from zipage.sim.cost_model import ANALYTIC, PROFILES_DIR, CostModel


def load_cost_model(spec: str, shape: ModelShape, gpu: GPUSpec, **knobs: Any) -> CostModel:
    """"analytic", a profile JSON path, or the name of a profile shipped in sim/profiles/."""
    if spec == ANALYTIC:
        check_knob_names(knobs)
        return AnalyticCostModel(shape, gpu, **knobs)
    path = Path(spec)
    if not path.exists() and (PROFILES_DIR / f"{spec}.json").exists():
        path = PROFILES_DIR / f"{spec}.json"
    if not path.exists():
        shipped = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.json")))
        raise ConfigError(f"cost model: {spec!r} is neither \"analytic\" nor a profile file; "
                          f"shipped profiles: {shipped or 'none'}")
    return CalibratedCostModel.from_profile(path, shape=shape, gpu=gpu, **knobs)
