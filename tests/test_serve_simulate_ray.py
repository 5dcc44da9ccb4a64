"""`zipage serve --simulate --ray local --data-parallel 2`: two twins (sim/live.py) as the Ray Serve
replicas of `zipage/serve/ray_serve.py`, behind the same ingress, router and /metrics as the
engine's (docs/serve.md, 'A GPU-free twin server' and 'On a Ray cluster').

One module-scoped server over real sockets, with torch made unimportable in it and in every Ray
worker it starts (a `sitecustomize` on PYTHONPATH, which the local instance's workers inherit):
a bare preset's shape, and a word-level tokenizer directory for text prompts and the chat
template, which the ingress loads as the one-host --simulate server does (`twin_tokenizer`).
Completions and chat, streamed and not, each run to its max_tokens; round-robin routing sends
them to both replicas in turn, which /metrics counts per replica along with the twins' lag; the
twin's refusal of log-probabilities reaches the client through Ray; SIGTERM stops the server, its
twins and the local Ray instance, exit 0. Without the server: flags still wrong with --ray are
one line, exit 2, before Ray starts.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("tokenizers") is None:
    pytest.skip("the twin's tokenizer needs transformers (pip install 'zipage[serve]')",
                allow_module_level=True)
from serve_helpers import Served, free_port, one_thread_env, replica_series, wait_healthy  # noqa: E402
from test_cli_errors import assert_one_line_error, run_cli  # noqa: E402

# Ports a new local Ray instance takes for itself once started (its dashboard agent's), which a
# port found free before it started may be: the server's proxy could then not bind it.
RAY_PORTS = {52365}
MODEL = "random:smollm2-135m"  # its shape only: 49152 token ids
VOCAB = 49152
SPECIAL = ("<eos>", "<unk>")
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }} {{ message['content'] }} "
                 "{% endfor %}{% if add_generation_prompt %}assistant{% endif %}")


def save_word_tokenizer(directory: Path) -> None:
    """A tokenizer of the preset's whole vocabulary (words w0.. and two special tokens), with a
    chat template: written with `tokenizers` alone, loaded by transformers without torch."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = [f"w{index}" for index in range(VOCAB - len(SPECIAL))] + list(SPECIAL)
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)},
                                         unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    directory.mkdir()
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE}))


def no_torch_env(directory: Path) -> dict[str, str]:
    """The test servers' environment, in which no Python process can import torch."""
    directory.mkdir()
    (directory / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    env = one_thread_env()
    env["PYTHONPATH"] = ":".join([str(directory), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _ok(response: httpx.Response) -> bool:
    """Both Ray replicas running (the app answers 200 "degraded" before)."""
    return response.status_code == 200 and response.json().get("status") == "ok"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = tmp_path_factory.mktemp("simulate_ray")
    save_word_tokenizer(directory / "tokenizer")
    port = next(port for port in iter(free_port, None) if port not in RAY_PORTS)
    log = directory / "server.log"
    with log.open("w") as handle:  # a file, not a pipe nobody reads (serve_helpers.py)
        process = subprocess.Popen(
            [sys.executable, "-m", "zipage.cli", "serve", "--simulate", "--ray", "local",
             "--data-parallel", "2", "--routing", "round-robin", "--model", MODEL, "--tokenizer",
             str(directory / "tokenizer"), "--hardware", "a100", "--kv-memory-gb", "1", "--port",
             str(port)], stdout=handle, stderr=subprocess.STDOUT,
            env=no_torch_env(directory / "no_torch"))
    served = Served(process, port, log)
    started = time.monotonic()
    try:
        wait_healthy(served, 120, poll_s=0.5, ok=_ok)
        served.startup_s = time.monotonic() - started
        yield served
    finally:
        if served.process.poll() is None:  # the last test stops it; this, if it did not run
            served.process.terminate()  # (it stops the local Ray instance too)
            try:
                served.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                served.process.kill()
                served.process.wait()


def _post(url: str, route: str, body: dict) -> tuple[list[int], str, str, dict]:
    """(token ids (completions only), text, finish reason, usage) of one request's only choice,
    streamed or not."""
    chat = route == "/v1/chat/completions"
    reply = httpx.post(url + route, json=body if chat else {**body, "return_token_ids": True},
                       timeout=60)
    assert reply.status_code == 200, reply.text
    if not body.get("stream"):
        data = reply.json()
        (choice,) = data["choices"]
        text = choice["message"]["content"] if chat else choice["text"]
        return choice.get("token_ids", []), text, choice["finish_reason"], data["usage"]
    events = [line.removeprefix("data: ") for line in reply.text.splitlines() if line]
    assert events[-1] == "[DONE]", events
    ids, text, finish, usage = [], "", None, None
    for event in map(json.loads, events[:-1]):
        usage = event.get("usage") or usage
        for choice in event["choices"]:
            ids += choice.get("token_ids") or []
            text += (choice["delta"].get("content") or "") if chat else choice["text"]
            finish = choice["finish_reason"] or finish
    return ids, text, finish, usage


def test_twins_on_ray_serve_completions_and_chat(served):
    url, tokens = served.url, 6
    assert httpx.get(url + "/health").json()["replicas"][0]["replica_states"] == {"RUNNING": 2}
    requests = [("/v1/completions", {"prompt": "w5 w6 w7"}),
                ("/v1/completions", {"prompt": "w8 w9", "stream": True,
                                     "stream_options": {"include_usage": True}}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1 w2"}]}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w3"}],
                                          "stream": True,
                                          "stream_options": {"include_usage": True}})]
    before = {name: replica_series(url, name) for name in ("requests_routed_total",
                                                     "generation_tokens_total")}
    for route, body in requests:
        ids, text, finish, usage = _post(url, route, {**body, "max_tokens": tokens})
        # The twin's tokens: its max_tokens of them, never a special one (every other id is a
        # word), detokenized by the ingress with the twin's tokenizer.
        assert finish == "length" and usage["completion_tokens"] == tokens, (route, body)
        assert re.fullmatch(r"\s*w\d+( w\d+)*", text) and len(text.split()) == tokens, text
        assert usage["prompt_tokens"] > 0
        if route == "/v1/completions":
            assert len(ids) == tokens and max(ids) < VOCAB - len(SPECIAL), ids
    # Round-robin: the four requests went two to each replica, whose twins made their tokens.
    routed, generated = (replica_series(url, name) for name in ("requests_routed_total",
                                                          "generation_tokens_total"))
    for replica in ("0", "1"):
        assert routed[replica] - before["requests_routed_total"].get(replica, 0) == 2, routed
        assert (generated[replica] - before["generation_tokens_total"].get(replica, 0)
                == 2 * tokens), generated
    # The engine's /metrics, the twin's lag among them: each rank's, from its replica's reports.
    assert set(replica_series(url, "twin_lag_seconds_total")) == {"0", "1"}
    assert replica_series(url, "replica_healthy") == {"0": 1.0, "1": 1.0}


def test_the_twin_refuses_logprobs_through_ray(served):
    reply = httpx.post(served.url + "/v1/completions", timeout=60,
                       json={"prompt": "w1", "max_tokens": 2, "logprobs": 1})
    assert reply.status_code == 400, reply.text
    assert "logprobs: a simulated server" in reply.json()["error"]["message"]


def test_sigterm_stops_the_server_and_its_twins(served):
    """Last: SIGTERM removes both applications, stops the local Ray instance, exit 0."""
    print(f"\nhealthy {served.startup_s:.1f} s after start", end="")
    started = time.monotonic()
    served.process.terminate()
    try:
        status = served.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("zipage serve did not stop within 60 s of SIGTERM:\n" + served.log_tail())
    print(f"; stopped {time.monotonic() - started:.1f} s after SIGTERM", end="")
    assert status == 0, served.log_tail()
    with pytest.raises(httpx.TransportError):  # Ray's proxy is gone with the instance
        httpx.get(served.url + "/health", timeout=2)
    assert "zipage serve: random:smollm2-135m on Ray (local), 2 replicas routed round-robin, " \
           "each a simulated a100-80gb" in served.log.read_text()


@pytest.mark.parametrize("argv, fragments", [
    (["--engine", "cpu"], ["--engine: an engine flag; --simulate runs no engine"]),
    (["--tokenizer", "{missing}"], ["--tokenizer: ", "is neither a HF model directory"]),
    (["--ray", "127.0.0.1:{port}"], ["--ray: nothing answers at 127.0.0.1:", "--ray local"]),
])
def test_wrong_flags_with_ray_are_one_line_before_ray_starts(capsys, tmp_path, argv, fragments):
    """A flag --simulate refuses, a tokenizer that is not there, an address where nothing
    answers: one line naming the flag, exit 2, in seconds."""
    argv = [arg.format(missing=tmp_path / "missing", port=free_port()) for arg in argv]
    if "--ray" not in argv:
        argv += ["--ray", "local"]
    started = time.monotonic()
    status, _, err = run_cli(capsys, "serve", "--simulate", "--model", MODEL, *argv)
    assert_one_line_error(status, err, *fragments)
    assert time.monotonic() - started < 15
