"""Fuzzing model files: random bytes as a .gguf, random JSON as config.json, and a valid config
with one field replaced by random JSON. Through the CLI (simulator) each must run or fail with
exit status 2 and one line; through the engine's loader each must load or raise a ZipageError.
"""

from __future__ import annotations

import io
import json
import struct
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from tempfile import TemporaryDirectory

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples
from test_cli_errors import TINY_CONFIG, TINY_TRACE

from zipage.cli.output import EXIT_REQUESTS_FAILED
from zipage.cli.parser import main
from zipage.errors import ZipageError

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=8,
)
# A GGUF header (magic, version, tensor count, metadata count) before random bytes reaches the
# parser's deeper paths; bare random bytes stop at the magic.
GGUF_BYTES = st.one_of(
    st.binary(max_size=256),
    st.builds(lambda version, tensors, keys, body: b"GGUF" + struct.pack("<IQQ", version, tensors,
                                                                          keys) + body,
              st.sampled_from([1, 2, 3, 4]), st.integers(0, 4), st.integers(0, 8),
              st.binary(max_size=256)),
)
# Plausible numbers as well as random JSON, so that some mutated configs are valid and run.
MUTATED_CONFIGS = st.builds(lambda key, value: {**TINY_CONFIG, key: value},
                            st.sampled_from(sorted(TINY_CONFIG)),
                            JSON_VALUES | st.integers(-2, 4096) | st.floats(0, 1e6))


def _cli_status(model: str) -> int:
    # Redirected by hand: pytest's capsys is not reset between hypothesis examples.
    out, err_stream = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err_stream):
        status = main(["replay", TINY_TRACE, "--model", model, "--no-progress", "--block-size",
                       "16", "--budget", "64", "--window", "8", "--json"])
    err = err_stream.getvalue()
    if status == 2:
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("zipage: error: "), err
    else:
        assert status in (0, EXIT_REQUESTS_FAILED), err
    return status


def _config_dir(root: str, config_text: str) -> str:
    directory = Path(root) / "model"
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(config_text)
    return str(directory)


def _json_text(value) -> str:
    return json.dumps(value, allow_nan=True)


@settings(max_examples=examples(100))
@given(data=GGUF_BYTES)
def test_random_gguf_bytes_in_the_simulator(data):
    with TemporaryDirectory() as root:
        path = Path(root) / "model.gguf"
        path.write_bytes(data)
        assert _cli_status(str(path)) == 2


@settings(max_examples=examples(100))
@given(value=JSON_VALUES | MUTATED_CONFIGS)
def test_random_json_configs_in_the_simulator(value):
    with TemporaryDirectory() as root:
        _cli_status(_config_dir(root, _json_text(value)))


@settings(max_examples=examples(30))
@given(data=st.binary(max_size=64))
def test_random_bytes_as_config_json(data):
    with TemporaryDirectory() as root:
        directory = Path(_config_dir(root, ""))
        (directory / "config.json").write_bytes(data)
        assert _cli_status(str(directory)) == 2


@pytest.mark.engine
@settings(max_examples=examples(60))
@given(data=GGUF_BYTES, value=JSON_VALUES | MUTATED_CONFIGS)
def test_random_model_files_in_the_engine_loader(data, value):
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from zipage.engine.loader import load_model

    with TemporaryDirectory() as root:
        path = Path(root) / "model.gguf"
        path.write_bytes(data)
        with pytest.raises(ZipageError):
            load_model(str(path), device="cpu")
        # No weights beside the config: even a valid one stops at "no *.safetensors".
        with pytest.raises(ZipageError):
            load_model(_config_dir(root, _json_text(value)), device="cpu")

