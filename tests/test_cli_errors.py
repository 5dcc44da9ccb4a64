"""Every class of user mistake through the CLI: exit status 2, one line on stderr, no traceback.

Each test runs `zipage.cli.parser.main` in-process on a bad model file, a bad path or a bad flag value,
through the simulator, the CPU engine and `zipage generate` where the mistake reaches them.
`test_cli_fuzz.py` feeds random bytes and random JSON through the same paths.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from zipage.cli.parser import main

ROOT = Path(__file__).resolve().parents[1]
TINY_TRACE = str(ROOT / "traces" / "tiny.json")
TINY_CONFIG = {
    "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
}


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line_error(status: int, err: str, *fragments: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("zipage: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def model_dir(tmp_path: Path, name: str, config_text: str) -> str:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(config_text)
    return str(directory)


@pytest.fixture
def bad_models(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """Model paths that must each be refused, with a fragment of the expected message."""
    gguf = tmp_path / "random.gguf"
    gguf.write_bytes(os.urandom(4096))
    return {
        "random-bytes gguf": (str(gguf), "not a readable GGUF file"),
        "config not JSON": (model_dir(tmp_path, "notjson", "{not json"), "not valid JSON"),
        "config a list": (model_dir(tmp_path, "alist", "[1, 2]"), "JSON object"),
        "hidden_size a string": (
            model_dir(tmp_path, "lots", json.dumps({**TINY_CONFIG, "hidden_size": "lots"})),
            "hidden_size must be a positive integer"),
        "zero heads": (
            model_dir(tmp_path, "zero", json.dumps({**TINY_CONFIG, "num_attention_heads": 0})),
            "num_attention_heads"),
        "missing field": (
            model_dir(tmp_path, "missing", json.dumps(
                {k: v for k, v in TINY_CONFIG.items() if k != "vocab_size"})), "lacks vocab_size"),
        "model_type transformers lacks": (
            model_dir(tmp_path, "foo", json.dumps({**TINY_CONFIG, "model_type": "foo"})),
            "model_type 'foo' is not supported"),
        "model_type we lack": (
            model_dir(tmp_path, "gpt2", json.dumps({**TINY_CONFIG, "model_type": "gpt2"})),
            "model_type 'gpt2' is not supported"),
    }


def test_bad_model_files_in_the_simulator(capsys, bad_models):
    for label, (model, fragment) in bad_models.items():
        status, _, err = run_cli(capsys, "replay", TINY_TRACE, "--model", model, "--no-progress")
        assert_one_line_error(status, err, fragment)


@pytest.mark.engine
def test_bad_model_files_in_the_cpu_engine_and_generate(capsys, bad_models):
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    for label, (model, fragment) in bad_models.items():
        status, _, err = run_cli(capsys, "replay", TINY_TRACE, "--engine", "cpu", "--model", model,
                                 "--no-progress")
        assert_one_line_error(status, err, fragment)
        status, _, err = run_cli(capsys, "generate", "--model", model, "--device", "cpu", "hi")
        assert_one_line_error(status, err, fragment)


@pytest.mark.engine
def test_corrupt_weights_and_tokenizer_files(capsys, tmp_path):
    pytest.importorskip("torch")
    directory = Path(model_dir(tmp_path, "weights", json.dumps(TINY_CONFIG)))
    (directory / "model.safetensors").write_bytes(os.urandom(512))
    status, _, err = run_cli(capsys, "generate", "--model", str(directory), "--device", "cpu",
                             "ids:1,2")
    assert_one_line_error(status, err, "not a safetensors checkpoint")


def test_out_pointing_at_a_file(capsys, tmp_path):
    existing = tmp_path / "a-file"
    existing.write_text("x")
    for argv in (["replay", TINY_TRACE, "--out", str(existing)],
                 ["replay", TINY_TRACE, "--out", str(existing / "below")],
                 ["report", "ablation", TINY_TRACE, "--out", str(existing), "--no-progress"]):
        status, _, err = run_cli(capsys, *argv)
        assert_one_line_error(status, err, "exists and is not a directory")
    assert existing.read_text() == "x"


def test_plan_out_pointing_at_a_file(capsys, tmp_path):
    existing = tmp_path / "a-file"
    existing.write_text("x")
    status, _, err = run_cli(capsys, "plan", TINY_TRACE, "--budget", "512", "--block-size", "64",
                             "--out", str(existing), "--no-progress")
    assert_one_line_error(status, err, str(existing))


def test_trace_make_creates_the_output_directory(capsys, tmp_path):
    output = tmp_path / "missing" / "dir" / "x.json"
    status, out, _ = run_cli(capsys, "trace", "make", "tiny", "-o", str(output))
    assert status == 0 and output.is_file() and "wrote" in out
    status, _, err = run_cli(capsys, "trace", "make", "tiny", "-o", str(tmp_path))
    assert_one_line_error(status, err, "is a directory")


def test_unwritable_output_path_is_one_line(capsys, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    status, _, err = run_cli(capsys, "trace", "make", "tiny", "-o", str(blocker / "x.json"))
    assert_one_line_error(status, err, str(blocker))


@pytest.mark.parametrize("value", ["0", "-2"])
def test_tensor_parallel_below_one(capsys, value):
    status, _, err = run_cli(capsys, "replay", TINY_TRACE, "--tensor-parallel", value,
                             "--no-progress")
    assert_one_line_error(status, err, "tensor_parallel", ">= 1")
    status, _, err = run_cli(capsys, "plan", TINY_TRACE, "--tensor-parallel", value,
                             "--no-progress")
    assert_one_line_error(status, err, "tensor_parallel", ">= 1")


@pytest.mark.parametrize("flag, value", [("--gpu-memory-utilization", "0"),
                                         ("--gpu-memory-utilization", "1.5"),
                                         ("--gpu-memory-gb", "-1"), ("--kv-memory-gb", "0")])
def test_memory_flags_out_of_range(capsys, flag, value):
    status, _, err = run_cli(capsys, "replay", TINY_TRACE, flag, value, "--no-progress")
    assert_one_line_error(status, err, flag.lstrip("-").replace("-", "_"))


@pytest.mark.engine
def test_generate_on_a_device_this_machine_lacks(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    status, _, err = run_cli(capsys, "generate", "--model", "random:smollm2-135m", "--device",
                             "cuda", "ids:1,2")
    assert_one_line_error(status, err, "no CUDA device", "--device cpu")
    status, _, err = run_cli(capsys, "generate", "--model", "random:smollm2-135m", "--device",
                             "tpu", "ids:1,2")
    assert_one_line_error(status, err, "expected cuda, cuda:N or cpu")


@pytest.mark.engine
@pytest.mark.parametrize("keyword, hint", [("budget", "kv_budget="),
                                           ("no_hybrid", "hybrid=False"),
                                           ("temperature", "SamplingParams(temperature"),
                                           ("kv_budgte", "did you mean kv_budget")])
def test_llm_names_the_keyword_meant(keyword, hint):
    pytest.importorskip("torch")
    from zipage import LLM
    from zipage.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown keyword argument") as raised:
        LLM("random:smollm2-135m", device="cpu", **{keyword: 2048})
    assert hint in str(raised.value)


@pytest.mark.parametrize("flag, value, why", [("--hardware", "h100", "a simulator flag"),
                                               ("--cost-model", "p.json", "a simulator flag"),
                                               ("--users", "8", "a trace replay's closed population")])
def test_serve_refuses_the_simulator_flags(capsys, flag, value, why):
    # Refused before the serve extra, torch or the model are looked at.
    status, _, err = run_cli(capsys, "serve", "--model", "random:smollm2-135m", flag, value)
    assert_one_line_error(status, err, f"{flag}: {why}", "drop it")


def test_serve_help_says_model_is_required_and_lists_no_simulator_flag(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "-h"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--model MODEL HF model directory, .gguf file or random:<preset> (required)" in text
    assert "qwen3-8b" not in text
    # Not flags of their own: --simulate's help names them (refused without it).
    assert "--hardware HARDWARE" not in text and "--cost-model COST_MODEL" not in text
    assert "float32 on the CPU" in text  # --dtype's default follows the device
