"""A request field the server refuses, over real HTTP: one shape whoever refuses it.

The field's own bounds (zipage/request_fields.py, checked as the body is validated) and the core's
admission rule for this deployment (`Admission.rejection_reason`, asked before the request is
sent: `zipage.serve.app.admission_error`) answer alike: a 400 with OpenAI's error body, `param`
the field, a message "<field>: <what is wrong> ...; <the fix>" that names the field once. A
`zipage serve --simulate` twin (no model to load, no torch) on a real socket is the server; it
runs `--scoring snapkv`, so a request asking for `zipage` scoring needs a score cache it lacks.
Sent at once with the refused ones, a good request completes: a refusal touches no other request.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
from serve_helpers import start_server, stop_server, wait_healthy  # noqa: E402

from zipage.request_fields import MAX_FIELD_INT, MAX_PRIORITY  # noqa: E402

FLAGS = ["--simulate", "--model", "random:qwen3-8b", "--hardware", "h200", "--kv-memory-gb", "6",
         "--block-size", "64", "--budget", "512", "--scoring", "snapkv"]
PROMPT = [1, 2, 3]

# field, the value sent, the start of the message after "<field>: ", a fix it must name.
REFUSALS = [
    # The field's own bounds, as the body is validated.
    ("kv_budget", 0, f"must be an integer between 1 and {MAX_FIELD_INT}",
     "leave it out for --budget"),
    ("kv_budget", "512", "must be an integer between", "leave it out for --budget"),
    ("priority", MAX_PRIORITY + 1, f"must be an integer between {-MAX_PRIORITY} and",
     "leave it out for 0"),
    ("scoring", "h2o", "must be one of 'zipage', 'snapkv'", "leave it out for --scoring"),
    ("compress_scope", "prompt", "must be one of 'all', 'output'",
     "leave it out for --compress-scope"),
    # The core's admission rule for this deployment.
    ("kv_budget", 100, "100 must be a positive multiple of block_size 64",
     "use e.g. 64, or leave it out for the default 512"),
    ("priority", 3, "3 needs --scheduling-policy priority",
     "leave priority out, or serve with --scheduling-policy priority"),
    ("scoring", "zipage", "'zipage' keeps a global score per KV entry",
     "leave scoring out, or serve with --scoring zipage"),
]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    served = start_server(FLAGS, tmp_path_factory.mktemp("refusals") / "server.log")
    try:
        wait_healthy(served, 120)
        yield served.url
    finally:
        stop_server(served)


def _assert_refused(response: httpx.Response, field: str, start: str, fix: str) -> None:
    assert response.status_code == 400, response.text
    body = response.json()
    assert list(body) == ["error"]
    error = body["error"]
    assert {key: error[key] for key in ("type", "param", "code")} == {
        "type": "invalid_request_error", "param": field, "code": 400}
    assert set(error) == {"message", "type", "param", "code"}
    message = error["message"]
    assert message.startswith(f"{field}: {start}"), message
    assert fix in message, message
    assert not message.startswith(f"{field}: {field}"), message  # the field named once


@pytest.mark.parametrize(("field", "value", "start", "fix"), REFUSALS,
                         ids=[f"{field}={value!r}" for field, value, _, _ in REFUSALS])
def test_a_refused_field_is_a_400_naming_it_and_its_fix(url, field, value, start, fix):
    response = httpx.post(url + "/v1/completions", timeout=30,
                          json={"prompt": PROMPT, "max_tokens": 4, field: value})
    _assert_refused(response, field, start, fix)


def test_refusals_touch_no_other_request(url):
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            good = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8,
                                                         "ignore_eos": True})
            bad = [client.post("/v1/completions",
                               json={"prompt": PROMPT, "max_tokens": 4, field: value})
                   for field, value, _, _ in REFUSALS]
            return await asyncio.gather(good, *bad)

    good, *bad = asyncio.run(main())
    assert good.status_code == 200, good.text
    assert good.json()["usage"]["completion_tokens"] == 8
    for response, (field, _, start, fix) in zip(bad, REFUSALS):
        _assert_refused(response, field, start, fix)
    assert httpx.get(url + "/health", timeout=10).status_code == 200
