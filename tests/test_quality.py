"""`zipage quality` (`zipage.analysis.quality`) on the SmolLM2 GGUF, at a small size: forcing
feeds the reference tokens whatever the compressed model predicts, Full KV forced along its own
continuation agrees everywhere, a budget that evicts the pass key loses it, and the command's
mistakes are one line naming the flag.

Prompts of 192 tokens, block 16, window 4, budget 32 (2 blocks): the whole file loads the model
once and runs one small study through the command, well under a minute on a CPU."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from smollm2 import GGUF, needs_smollm2  # noqa: E402

from zipage.cli.parser import main  # noqa: E402

pytestmark = pytest.mark.engine




SMALL = dict(block_size=16, window=4, prompt_tokens=192, prompts=1, continuation_len=12,
             needles=2, budgets=(32,), policies=("zipage", "streaming"))
# Full KV forced along its own greedy continuation computes the same logits again (same engine,
# same batch): KL in nats within float32 rounding of the log-softmax.
KL_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def smollm2(one_cpu_thread):
    from zipage.engine.loader import load_model

    return load_model(str(GGUF), torch.float32, "cpu")


@pytest.fixture(scope="module")
def study(smollm2, tmp_path_factory):
    """The small study through `zipage quality --out x.json`, on the model loaded once."""
    from zipage.engine import loader

    out = tmp_path_factory.mktemp("quality") / "quality.json"
    argv = ["quality", "--policies", ",".join(SMALL["policies"]),
            "--budgets", ",".join(map(str, SMALL["budgets"])), "--out", str(out),
            "--no-progress", "--threads", "1"]
    for name in ("block_size", "window", "prompt_tokens", "prompts", "continuation_len",
                 "needles"):
        argv += [f"--{name.replace('_', '-')}", str(SMALL[name])]
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(loader, "load_model", lambda *args, **kwargs: smollm2)
        status = main(argv)
    result = json.loads(out.read_text())
    return status, printed.getvalue(), {(row["policy"], row["budget"]): row
                                        for row in result["rows"]}, result


@needs_smollm2
def test_forcing_feeds_the_reference_tokens(smollm2):
    """The compressed requests' inputs are exactly the reference tokens, although the
    compressed model's own argmax differs from them somewhere (so forcing did something)."""
    from zipage.analysis import quality
    from zipage.analysis.fidelity import generate_reference

    model, shape, tokenizer = smollm2
    settings = quality.QualitySettings(**{**SMALL, "policies": ("streaming",)})
    prompts = quality.retell_prompts(tokenizer, settings)
    assert [len(prompt) for prompt in prompts] == [192]
    full = quality.full_engine(model, shape, tokenizer, str(GGUF), settings, 1)
    reference = generate_reference(full, prompts, settings.continuation_len, 0.0, 0)
    policies = quality.policies_engine(model, shape, tokenizer, str(GGUF), settings, 1)
    forced = policies.force(reference)
    assert forced.run.tokens["0/0"] == prompts[0] + reference.outputs[0]
    assert forced.first_compression == [[1]]  # the aligned prompt compresses at the first decode
    assert not bool(forced.agreement[0, 0, 1:].all())


@needs_smollm2
def test_full_kv_forced_on_itself_agrees_everywhere(study):
    status, printed, rows, result = study
    assert status == 0
    full = rows[("Full KV", None)]
    # Outputs 1 on (output 0 comes from the prefill), up to the first end-of-sequence.
    eos = result["reference_eos"][0]
    assert full["positions"] == (SMALL["continuation_len"] - 1 if eos is None else eos) > 0
    assert math.isclose(full["agreement"], 1.0)
    assert 0 <= full["kl"] < KL_TOLERANCE
    assert full["compressions"] == 0
    assert "| Full KV | - | 100.0 |" in printed


@needs_smollm2
def test_evicting_the_pass_key_loses_it(study):
    """Full KV retrieves every pass key; StreamingLLM at 2 blocks keeps 4 sinks and the recent
    entries, never the key (~60 tokens in), so it answers something else, and it agrees less
    with Full KV along the forced continuation."""
    _, _, rows, result = study
    full, streaming = rows[("Full KV", None)], rows[("streaming", 32)]
    assert full["needle_hits"] == SMALL["needles"]
    assert streaming["needle_hits"] == 0
    assert streaming["compressions"] >= 1 + SMALL["needles"]  # compressed in both runs
    assert streaming["agreement"] < full["agreement"] - 0.05
    assert streaming["kl"] > 100 * KL_TOLERANCE
    assert all(case_key not in text for case_key, text in zip(
        result["needle_keys"], result["needle_answers"]["streaming@32"]))


@needs_smollm2
def test_prompts_are_exact_and_the_needle_is_early(smollm2):
    from zipage.analysis import quality

    _, _, tokenizer = smollm2
    settings = quality.QualitySettings(**SMALL)
    for case in quality.needle_cases(tokenizer, settings):
        assert len(case.prompt) == settings.prompt_tokens
        text = tokenizer.decode(case.prompt + case.forced)
        assert text.endswith(quality.ANSWER_PREFIX)
        assert text.index(case.key) < len(text) // 3  # 192 tokens: past the system prompt
    assert quality.needle_hit(" 48213.", "48213")
    assert not quality.needle_hit(" 4821.", "48213")
    assert not quality.needle_hit(" 482135", "48213")
    assert not quality.needle_hit(" given at the start", "48213")


@pytest.mark.parametrize("flags, named", [
    (["--policies", "zipage,h2o"], "--policies: unknown policy 'h2o'"),
    (["--budgets", "128,100"], "--budgets: 100 is not a positive multiple of the block size 32"),
    (["--budgets", "128,x"], "--budgets:"),
    (["--budgets", "1024"], "--budgets: 1024 would never evict"),
    (["--block-size", "48"], "--block-size:"),
    (["--window", "32"], "--window:"),
    (["--prompt-tokens", "700"], "--prompt-tokens: 700 is not a multiple"),
    (["--continuation-len", "0"], "--continuation-len:"),
    (["--out", "table.txt"], "--out: table.txt must end in .csv or .json"),
    (["--out", "no/such/folder/t.csv"], "--out: the folder no/such/folder does not exist"),
])
def test_mistakes_are_one_line_naming_the_flag(capsys, flags, named):
    """Refused before any model loads (no GGUF needed), exit 2."""
    assert main(["quality", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"zipage: error: {named}")
    assert len(err.strip().splitlines()) == 1
