"""Command-line flags derived from the declarations of the knobs (`ZipageConfig`) and of the
deployment (`ReplaySettings`): a knob added there is a flag of `zipage replay`, `calibrate`,
`report ablation` and `plan` with no other edit.

A boolean knob that is on by default is a `--no-...` flag; one that is off by default is a
`--knob/--no-knob` pair. `zipage plan` turns the knobs it
searches over (`axes`) into comma lists: `--budget 1024,2048`, `--hybrid on,off`; `axis_values`
parses them.
"""

from __future__ import annotations

import argparse
from dataclasses import fields, replace

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.errors import ConfigError, ZipageError

_TYPES = {"int": int, "float": float, "str": str, "bool": bool}
_BOOL_WORDS = {"on": True, "off": False}
_METAVARS = {int: "N", float: "X"}


# The element type of weights and caches when --dtype is not given, for every command that runs
# the real engine (generate, serve, replay, calibrate, fidelity: `add_engine_flags` and
# `settings_from_args` give every command with those flags this one rule, from its --engine or
# --device): bfloat16 on a GPU and in the simulator (`ReplaySettings.dtype`'s default), so the
# same flags give the same capacity in the simulator, `zipage replay --gpu` and the server
# (docs/architecture.md, 'Memory planning'); float32 on the CPU, where the engine is the path
# checked token for token against HF models in float32 (docs/tensor_parallel.md) and most CPUs
# have no bfloat16 matmul to gain from (the CPU engine has no simulated twin to match: its
# --kv-memory-gb already defaults to 1 GiB). `LLM(dtype="auto")` follows the same rule.
CPU_DTYPE = "float32"
DTYPE_HELP = ("weights and KV cache element type (default: bfloat16 on a GPU and in the "
              f"simulator, {CPU_DTYPE} on the CPU)")


def default_dtype(device_type: str | None) -> str:
    """--dtype's default on `device_type` ("cpu", "cuda"/"gpu"; None or "sim": the simulator)."""
    return CPU_DTYPE if device_type == "cpu" else declared_default("dtype")


def declared_default(name: str):
    """The default `ReplaySettings` declares for a deployment field."""
    return next(f.default for f in fields(ReplaySettings) if f.name == name)


def add_engine_flags(parser: argparse.ArgumentParser, axes: frozenset[str] = frozenset()) -> None:
    """Model, memory and cost-model flags, then every knob. --dtype defaults to `default_dtype`
    of the device the command runs on (`settings_from_args` reads it from `args.engine`; the
    simulator's commands have none: bfloat16)."""
    _add(parser.add_argument_group("model and memory"), ReplaySettings, axes)
    if "dtype" not in axes:
        dtype = next(action for action in parser._actions if action.dest == "dtype")
        dtype.default, dtype.help = None, DTYPE_HELP
    add_knob_flags(parser, axes)


def add_knob_flags(parser: argparse.ArgumentParser, axes: frozenset[str] = frozenset()) -> None:
    """Every compression and scheduling knob of `ZipageConfig`."""
    _add(parser.add_argument_group("compression and scheduling"), ZipageConfig, axes)


def config_from_args(args: argparse.Namespace, axes: frozenset[str] = frozenset(),
                     **overrides) -> ZipageConfig:
    """The knobs the flags set; grid axes (`axes`) keep their defaults, `overrides` win."""
    values = {f.name: getattr(args, f.name) for f in ZipageConfig.knobs() if f.name not in axes}
    return ZipageConfig(**{**values, **overrides})


def settings_from_args(args: argparse.Namespace, axes: frozenset[str] = frozenset(),
                       **overrides) -> ReplaySettings:
    """The deployment the flags describe; grid axes (`axes`) keep their defaults, `overrides`
    replace single fields (`config` too)."""
    values = {f.name: getattr(args, f.name) for f in _declared(ReplaySettings)
              if f.name not in axes}
    if values.get("dtype", "") is None:  # not given: the device's (`add_engine_flags`)
        values["dtype"] = default_dtype(getattr(args, "engine", None))
    settings = ReplaySettings(**values, config=config_from_args(args, axes))
    return replace(settings, **overrides)


def axis_values(args: argparse.Namespace, name: str) -> list | None:
    """The values of a grid axis given as a comma list, or None when the flag was not given."""
    text = getattr(args, name)
    if text is None:
        return None
    declared = next(f for f in (*_declared(ReplaySettings), *ZipageConfig.knobs()) if f.name == name)
    kind, flag = _type(declared), _axis_flag(declared)
    values = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            raise ConfigError(f"{flag}: empty item in {text!r}; give a comma list")
        if kind is bool:
            if item.lower() not in _BOOL_WORDS:
                raise ConfigError(f"{flag}: got {item!r}; give on, off or on,off")
            values.append(_BOOL_WORDS[item.lower()])
            continue
        choices = declared.metadata.get("choices")
        if choices and item not in choices:
            raise ConfigError(f"{flag}: got {item!r} in {text!r}; give some of "
                              f"{', '.join(choices)}, e.g. {flag} {','.join(choices)}")
        try:
            values.append(kind(item))
        except ValueError:
            example = "1024,2048" if kind is int else "0.8,0.9"
            raise ConfigError(f"{flag}: {item!r} in {text!r} is not "
                              f"{'an integer' if kind is int else 'a number'}; give a comma "
                              f"list, e.g. {flag} {example}") from None
    return list(dict.fromkeys(values))


# ---------------------------------------------------------------- derivation

def _declared(cls) -> list:
    return [f for f in fields(cls) if "flag" in f.metadata]


def _type(declared) -> type:
    # Annotations are strings here (`from __future__ import annotations`): "int", "float | None".
    return _TYPES[str(declared.type).split("|")[0].strip()]


def _axis_flag(declared) -> str:
    return declared.metadata["flag"].replace("--no-", "--")


def _add(group, cls, axes: frozenset[str]) -> None:
    for declared in _declared(cls):
        meta, default, kind = declared.metadata, declared.default, _type(declared)
        if declared.name in axes:
            shown = ("on" if default else "off") if kind is bool else default
            group.add_argument(_axis_flag(declared), dest=declared.name, default=None,
                               metavar="LIST", help=f"{meta['help']}; a comma list searches "
                                                    f"each (default {shown})")
        elif kind is bool and meta["flag"].startswith("--no-"):
            # A knob that is on by default: its flag turns it off.
            group.add_argument(meta["flag"], dest=declared.name, action="store_false",
                               help=meta["help"])
        elif kind is bool:
            # A --knob/--no-knob pair (a knob whose default may change keeps both spellings).
            group.add_argument(meta["flag"], dest=declared.name, default=default,
                               action=argparse.BooleanOptionalAction,
                               help=meta["help"] + f" (default: {'on' if default else 'off'})")
        else:
            shown = "" if default is None else f" (default: {default})"
            group.add_argument(meta["flag"], dest=declared.name, type=kind, default=default,
                               choices=meta["choices"], metavar=_METAVARS.get(kind),
                               help=meta["help"] + shown)


def add_graph_flags(parser: argparse.ArgumentParser) -> None:
    """The real engine's CUDA graph flags (replay, calibrate, serve)."""
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="real engine: capture no CUDA graphs (every step eager)")
    parser.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="real engine: replay prefill and mixed steps of up to 4,096 tokens "
                             "as CUDA graphs too, padded to a token bucket (default: on where "
                             "CUDA graphs are captured; docs/engine.md, 'CUDA graphs')")


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU engine: torch threads (default: $ZIPAGE_CPU_THREADS, else "
                             "$OMP_NUM_THREADS, else half the cores; see docs/engine.md)")


NO_CUDA_FIX = "use --engine cpu for the CPU path (small models) or run the simulator (no flag)"


def require_torch(engine: str, given: str = "--gpu", fix: str = NO_CUDA_FIX) -> None:
    """torch, and a CUDA device for `engine` "gpu"; `given` names how the user asked for the
    GPU and `fix` what to do instead, in the error."""
    try:
        import torch
    except ImportError as error:
        raise ZipageError("the real engine needs torch: pip install 'zipage[engine]' (on a "
                          "machine without a GPU first: pip install torch==2.13.0 --index-url "
                          "https://download.pytorch.org/whl/cpu; docs/engine.md)") from error
    if engine == "gpu" and not torch.cuda.is_available():
        raise ZipageError(f"{given}: no CUDA device is visible; {fix}")


def engine_given(args: argparse.Namespace) -> str:
    """How --engine got its value, for an error: the user's flag, or the default."""
    if args.engine is None:
        args.engine = "gpu"
        return "--engine gpu (the default)"
    return f"--engine {args.engine}"


def require_serve_extra() -> None:
    """The `serve` extra: `zipage serve` and `zipage bench serve` need it."""
    try:
        import aiohttp  # noqa: F401
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as error:
        raise ZipageError(f"serving needs the serve extra ({error.name} is missing): "
                          "pip install 'zipage[serve]'") from error

