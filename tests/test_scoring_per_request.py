"""The eviction scoring policy chosen per request (the `scoring` request field): checked in
traces, `SamplingParams` and the server's body; the CPU engine compressing one batch with each
request's own policy (the tokens each gives alone under a deployment of that policy) and making
the simulator's decisions under step-time replay; a policy that needs a score cache the
deployment lacks refused alone; the cost models pricing each job with its request's policy."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import save_tiny_qwen3  # noqa: E402

from zipage import LLM, SamplingParams  # noqa: E402
from zipage.config import ZipageConfig  # noqa: E402
from zipage.core.admission import Admission  # noqa: E402
from zipage.core.sequence import Sequence  # noqa: E402
from zipage.errors import ConfigError, TraceError  # noqa: E402
from zipage.hardware import get_hardware  # noqa: E402
from zipage.presets import get_preset  # noqa: E402
from zipage.scoring import SCORING_POLICIES  # noqa: E402
from zipage.sim.analytic import AnalyticCostModel  # noqa: E402
from zipage.trace import Trace, TraceRequest, parse_trace, save_trace  # noqa: E402

torch.set_num_threads(1)
NEW_TOKENS = 60
KNOBS = dict(block_size=16, window=4, kv_budget=32, prefix_cache=False)
BLOCK = KNOBS["block_size"]
# One request per policy, the deployment's own (zipage, with its global score cache) among them.
POLICIES = ("zipage", "snapkv", "rkv", "keydiff", "vnorm", "random", "streaming")
# Durations are sums of a few float terms; two ways of adding them differ by rounding only.
RELATIVE = 1e-9


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-qwen3")
    save_tiny_qwen3(directory)
    return str(directory)


def greedy(scoring=None):
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                          scoring=scoring)


def prompts(count: int):
    """Prompts of one length: their compressions fall in the same steps, so every batch holds
    one request of each policy."""
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (21,), generator=generator).tolist() for _ in range(count)]


# ------------------------------------------------------------------ the field, where it arrives


def test_a_bad_name_is_one_error_naming_the_field_everywhere(tmp_path):
    from pydantic import ValidationError

    from zipage.serve.protocol import CompletionRequest, validation_message

    expected = "scoring must be one of 'zipage', 'snapkv'"
    with pytest.raises(ConfigError, match="^scoring: must be one of 'zipage', 'snapkv'"):
        SamplingParams(scoring="h2o")
    with pytest.raises(TraceError, match=f"request #0 \\(id 'a'\\): {expected}.*leave it out "
                                         "for --scoring"):
        parse_trace({"version": 1, "requests": [
            {"id": "a", "arrival_s": 0, "prompt_len": 8, "output_len": 4, "scoring": "h2o"}]})
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate({"prompt": "x", "scoring": "h2o"})
    message, field = validation_message(caught.value.errors())
    assert field == "scoring" and message.startswith("scoring: must be one of")
    assert "\n" not in message and len(message) < 200
    # Valid names and None pass each check, and a trace keeps a request's own policy.
    for name in (*SCORING_POLICIES, None):
        assert SamplingParams(scoring=name).scoring == name
        assert CompletionRequest.model_validate({"prompt": "x", "scoring": name}).scoring == name
    path = tmp_path / "t.json"
    save_trace(Trace("t", [TraceRequest("a", 0.0, 8, 4, scoring="snapkv"),
                           TraceRequest("b", 0.0, 8, 4)]), path)
    written = json.loads(path.read_text())["requests"]
    assert written[0]["scoring"] == "snapkv" and "scoring" not in written[1]
    loaded = parse_trace(json.loads(path.read_text()))
    assert [request.scoring for request in loaded.requests] == ["snapkv", None]


# ------------------------------------------------------------------ refusal


def test_a_policy_needing_an_unallocated_score_cache_is_refused_by_name():
    def reason(config, scoring):
        seq = Sequence("r", None, 8, prompt_len=8)
        seq.scoring = scoring
        return Admission(config, 1000).rejection_reason(seq)

    without_cache = ZipageConfig(scoring="snapkv")
    refused = reason(without_cache, "zipage")
    assert refused.startswith("request r: scoring 'zipage' keeps a global score")
    assert "--scoring zipage" in refused and "leave scoring out" in refused
    # Every policy that keeps no global score runs on it; the deployment's own cache serves all.
    for name in SCORING_POLICIES:
        if name != "zipage":
            assert reason(without_cache, name) is None
        assert reason(ZipageConfig(), name) is None
    # The pipeline without its global score is the deployment's own: nothing is missing.
    assert reason(ZipageConfig(global_score=False), "zipage") is None
    assert reason(without_cache, None) is None
    assert reason(without_cache, "h2o").startswith("request r: scoring must be one of")


def test_the_server_answers_a_400_naming_scoring_before_sending(tiny_model):
    pytest.importorskip("fastapi")
    from types import SimpleNamespace

    from zipage.serve.app import Server
    from zipage.serve.protocol import CompletionRequest, ServeError

    config = ZipageConfig(scoring="snapkv", **KNOBS)
    info = SimpleNamespace(capacity=SimpleNamespace(num_blocks=64), eos_token_ids=frozenset(),
                           config=config, vocab_size=256)
    sent = []
    engine = SimpleNamespace(info=info, replicas=1, admission=Admission(config, 64),
                             num_waiting=0,
                             submit=lambda *args, **kwargs: sent.append(args) or ["handle"])
    server = Server(engine, None, "m")
    body = CompletionRequest.model_validate({"prompt": [1, 2, 3], "scoring": "zipage"})
    with pytest.raises(ServeError) as caught:
        server.prepare(body, [1, 2, 3], 16)
    assert caught.value.status == 400 and caught.value.param == "scoring"
    assert str(caught.value).startswith("scoring: 'zipage' keeps a global score")
    assert not sent
    server.prepare(CompletionRequest.model_validate({"prompt": [1], "scoring": "rkv"}), [1], 16)
    assert sent[0][1].scoring == "rkv"


def test_the_engine_refuses_such_a_request_alone(tiny_model):
    llm = LLM(tiny_model, kv_memory_gb=0.01, scoring="snapkv", **KNOBS)
    bad, good = llm.generate(prompts(2), [greedy("zipage"), greedy("keydiff")], progress=False)
    assert bad.finish_reason == "error" and "scoring 'zipage' keeps a global score" in bad.error
    assert good.finish_reason == "length" and len(good.token_ids) == NEW_TOKENS


# ------------------------------------------------------------------ the engine


def recorded(compressor) -> list[tuple[str, int]]:
    """The (policy, requests) of each call `compressor` makes of its compress function, from
    now on."""
    calls, pipeline = [], compressor.compress_fn

    def recording(*positional, **arguments):
        calls.append((arguments["params"].scoring, arguments["source_tables"].shape[0]))
        pipeline(*positional, **arguments)

    compressor.compress_fn = recording
    return calls


def test_each_request_of_a_batch_is_scored_with_its_own_policy(tiny_model):
    llm = LLM(tiny_model, kv_memory_gb=0.01, async_compress=False, **KNOBS)
    calls = recorded(llm.engine.runner.compressor)
    batch = prompts(len(POLICIES))
    mixed = llm.generate(batch, [greedy(name) for name in POLICIES], progress=False)
    # One call per policy and launch group, each with that policy's one request.
    assert {name for name, _ in calls} == set(POLICIES) and {rows for _, rows in calls} == {1}
    # Each request gives the tokens it gives in the same batch on a deployment of its policy
    # (the same batch: a CPU forward of another batch size may round differently, and the
    # random policy draws from the blocks a compression reads, which the batch decides).
    for index, name in enumerate(POLICIES):
        deployment = LLM(tiny_model, kv_memory_gb=0.01, async_compress=False, scoring=name,
                         **KNOBS)
        alike = deployment.generate(batch, greedy(), progress=False)
        assert mixed[index].token_ids == alike[index].token_ids, name
    # The policies matter: the deployment's own for every request gives other tokens.
    default = llm.generate(batch, greedy(), progress=False)
    differing = [name for name, mine, theirs in zip(POLICIES, mixed, default)
                 if mine.token_ids != theirs.token_ids]
    assert len(differing) >= len(POLICIES) - 2, differing


def numbered_caches(blocks: int = 12, layers: int = 2):
    """Caches whose entry e of block n holds n * BLOCK + e in K's last element (what a
    compression kept can be read back), random elsewhere."""
    from zipage.engine.caches import KVCaches

    generator = torch.Generator().manual_seed(5)
    kv = torch.randn(2, layers, blocks, BLOCK, 2, 32, generator=generator)
    kv[0, ..., -1] = torch.arange(blocks * BLOCK, dtype=torch.float32).view(1, blocks, BLOCK, 1)
    return KVCaches(kv, torch.randn(layers, 4, 4, 4, 32, generator=generator),
                    0.03 * torch.rand(layers, blocks, BLOCK, 2, generator=generator))


def test_the_compressor_keeps_for_each_request_what_its_policy_keeps_alone():
    from dataclasses import replace

    from zipage.core.step import CompressionJob
    from zipage.engine.caches import KVCaches
    from zipage.engine.compressor import Compressor

    def job(scoring, source, targets, slot):
        seq = Sequence(f"r{slot}", None, 4, prompt_len=8)
        seq.scoring = scoring
        return CompressionJob(seq=seq, source_table=source, target_blocks=targets, new_block=-1,
                              released=[], query_slot=slot, is_first=True)

    def compressed(caches, config, jobs):
        """The caches after `jobs` on a deployment of `config`, and the compress calls."""
        caches = KVCaches(caches.kv.clone(), caches.query,
                          None if caches.score is None else caches.score.clone())
        compressor = Compressor(caches, config, 32, torch.device("cpu"))
        calls = recorded(compressor)
        compressor.run(jobs)
        return caches, calls

    def kept(caches, job):
        numbers = caches.kv[0, :, job.target_blocks, :, :, -1].long()  # [L, T, b, Hkv]
        return numbers.flatten(1, 2).sort(dim=1).values

    knobs = dict(block_size=BLOCK, window=4, kv_budget=32)
    caches = numbered_caches()
    # Two snapkv requests (one batch of their own), one with the deployment's, one keydiff.
    jobs = [job("snapkv", [0, 1, 2], [0, 1], 0), job(None, [3, 4, 5], [3, 4], 1),
            job("keydiff", [6, 7, 8], [6, 7], 2), job("snapkv", [9, 10, 11], [9, 10], 3)]
    mixed, calls = compressed(caches, ZipageConfig(**knobs), jobs)
    # One batch per policy (both layers in one launch group): the snapkv requests together.
    assert sorted(calls) == [("keydiff", 1), ("snapkv", 2), ("zipage", 1)]
    for each in jobs:
        own = each.seq.scoring or "zipage"
        alone, _ = compressed(caches, ZipageConfig(**knobs, scoring=own),
                              [replace(each, seq=Sequence("alone", None, 4, prompt_len=8))])
        assert torch.equal(kept(mixed, each), kept(alone, each)), own
    # Each policy kept something else than the pipeline would have.
    pipeline, _ = compressed(caches, ZipageConfig(**knobs),
                             [replace(each, seq=None) for each in jobs])
    assert not torch.equal(kept(mixed, jobs[0]), kept(pipeline, jobs[0]))
    assert not torch.equal(kept(mixed, jobs[2]), kept(pipeline, jobs[2]))


def test_engine_and_step_replay_make_the_same_decisions_with_mixed_policies(tiny_model,
                                                                            tmp_path,
                                                                            monkeypatch):
    from zipage.core.deployment import ReplaySettings
    from zipage.engine.compressor import Compressor
    from zipage.engine.replay import replay_on_engine
    from zipage.rundir import write_run
    from zipage.sim.step_replay import replay_step_times

    trace = Trace("mixed", [
        TraceRequest(id=f"r{i}", arrival_s=0.0, prompt_len=prompt, output_len=output,
                     scoring=scoring)
        for i, (prompt, output, scoring) in enumerate([
            (20, 60, "snapkv"), (33, 40, None), (5, 70, "keydiff"), (21, 50, "streaming")])])
    settings = ReplaySettings(model=tiny_model, dtype="float32", kv_memory_gb=0.0001,
                              config=ZipageConfig(block_size=16, window=4, kv_budget=32))
    run_policy, policies = Compressor.run_policy, set()

    def recording(compressor, jobs, params):
        policies.add(params.scoring)  # the trace's fields reached the engine's compressor
        run_policy(compressor, jobs, params)

    monkeypatch.setattr(Compressor, "run_policy", recording)
    summary, run_ = replay_on_engine(trace, settings, "cpu", log_decisions=True)
    assert summary["compressions"] > 0 and summary["completed"] == len(trace.requests)
    assert policies == {"snapkv", "zipage", "keydiff", "streaming"}
    out = write_run(tmp_path / "engine", summary, run_.steps, run_.requests, run_.decision_log)
    replayed, replay_run = replay_step_times(trace, out, check=True)
    assert replayed["decisions_match"], replayed["first_decision_difference"]
    assert replay_run.decision_log == run_.decision_log


def test_tensor_parallel_workers_learn_each_jobs_policy():
    from zipage.core.step import CompressionJob
    from zipage.engine.parallel import decode_jobs, encode_jobs
    from zipage.scoring import scoring_of

    own, default = Sequence("a", None, 4, prompt_len=8), Sequence("b", None, 4, prompt_len=8)
    own.scoring = "vnorm"
    jobs = [CompressionJob(seq=seq, source_table=[1, 2], target_blocks=[1], new_block=3,
                           released=[], query_slot=0, is_first=True) for seq in (own, default)]
    decoded = decode_jobs(encode_jobs(jobs))
    assert [scoring_of(job, "rkv") for job in decoded] == ["vnorm", "rkv"]


# ------------------------------------------------------------------ the cost models


class Job:
    """Stands in for a CompressionJob: the blocks it reads and keeps, and its request's policy."""

    def __init__(self, blocks: int, scoring: str | None = None) -> None:
        self.num_source_blocks, self.target_blocks = blocks, [0] * 8
        self.seq = Sequence("r", None, 1, prompt_len=1)
        self.seq.scoring = scoring


def close(a: float, b: float) -> bool:
    return abs(a - b) <= RELATIVE * max(abs(a), abs(b))


def test_the_analytic_model_prices_each_job_with_its_requests_policy():
    shape, gpu = get_preset("qwen3-8b"), get_hardware("h200")
    model = AnalyticCostModel(shape, gpu)
    snapkv = AnalyticCostModel(shape, gpu, scoring="snapkv")
    jobs = [Job(9), Job(12, "snapkv"), Job(10, "zipage"), Job(11, "snapkv")]
    expected = model.compress_time_for([9, 10], [8, 8]) + snapkv.compress_time_for([12, 11],
                                                                                  [8, 8])
    assert close(model.compress_time(jobs), expected)
    # Without a request's own policy it is the deployment's, priced as one batch, as before.
    assert close(model.compress_time([Job(9), Job(12)]), model.compress_time_for([9, 12], [8, 8]))
    assert model.compress_time(jobs) != model.compress_time([Job(9), Job(12), Job(10), Job(11)])


def test_a_profile_scales_another_policy_by_the_analytic_ratio():
    from zipage.sim.calibrated import CalibratedCostModel
    from zipage.sim.cost_loader import load_cost_model
    from zipage.sim.cost_model import PROFILES_DIR

    shape, gpu = get_preset("qwen3-8b"), get_hardware("h200")
    knobs = dict(block_size=64, kv_budget=512)
    shipped = "qwen3-8b-h200-b64-k512-zipage"
    profile = load_cost_model(shipped, shape, gpu, **knobs)
    analytic = AnalyticCostModel(shape, gpu, **knobs)
    blocks, kept = [9, 12], [7, 7]
    measured = profile.compress_time_for(blocks, kept)
    for name in ("snapkv", "streaming", "rkv"):
        ratio = (analytic.compress_time_for(blocks, kept, name)
                 / analytic.compress_time_for(blocks, kept))
        assert close(profile.compress_time_for(blocks, kept, name), measured * ratio)
    assert profile.compress_time_for(blocks, kept, "streaming") < measured
    # Loaded without the run's model and GPU, there is no analytic cost to scale: refused.
    alone = CalibratedCostModel.from_profile(PROFILES_DIR / f"{shipped}.json")
    assert close(alone.compress_time_for(blocks, kept), measured)
    with pytest.raises(ConfigError, match="scoring: measured with 'zipage', but a request asks "
                                          "for 'snapkv'"):
        alone.compress_time_for(blocks, kept, "snapkv")
