"""`zipage serve` under the reliability probes of issue #44, each finding in isolation.

In process: the HTTP side's engine socket (zipage/serve/channel.py) reassembles a step update
that arrives in pieces (uvloop makes the socket non-blocking, so a read can stop half-way through
a message) and queues a request larger than the socket takes, instead of taking either for a dead
engine.
Over HTTP on localhost, one server of a tiny random model (prompts as token ids: it starts in
seconds) with small limits: echo + logprobs on long prompts complete with no engine restart; a
body that has not arrived within --body-timeout is a 408; clients past --max-connections get a
503 while the others are served; a body over --max-body-bytes is a 413 the client reads even
when it writes its whole body first; nested, UTF-16 and wrong-role bodies get their own 400.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import random
import socket
import struct
import subprocess
import time
import urllib.error
import urllib.request
from multiprocessing.connection import Connection
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from serve_helpers import healthy, serving  # noqa: E402

from zipage.config import ZipageConfig  # noqa: E402
from zipage.core.admission import Admission  # noqa: E402
from zipage.core.memory import MemoryPlan  # noqa: E402
from zipage.core.sampling import SamplingParams  # noqa: E402
from zipage.core.sequence import Sequence  # noqa: E402
from zipage.serve.channel import FrameReader, frame  # noqa: E402
from zipage.serve.engine_client import EngineClient  # noqa: E402
from zipage.serve.wire import IDLE, Add, Ready, StepUpdate  # noqa: E402

# ---------------------------------------------------------------- the engine socket, in process


def test_frames_split_anywhere_are_reassembled_in_order():
    messages = [{"n": 0}, list(range(5000)), "x" * 70000, b"", ("last", 1.5)]
    stream = b"".join(frame(message) for message in messages)
    # The long form of the length (-1, then 8 bytes), which `Connection` uses past 2 GiB.
    payload = pickle.dumps("long form")
    stream += struct.pack("!i", -1) + struct.pack("!Q", len(payload)) + payload
    expected = [*messages, "long form"]
    for seed in range(20):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(stream)), 40)) + [len(stream)]
        reader, got, start = FrameReader(), [], 0
        for cut in cuts:
            got += [pickle.loads(piece) for piece in reader.feed(stream[start:cut])]
            start = cut
        assert got == expected and reader.pending == 0
    one_byte_at_a_time = FrameReader()
    got = [pickle.loads(p) for i in range(len(stream)) for p in one_byte_at_a_time.feed(stream[i:i + 1])]
    assert got == expected


class _Process:
    """A stand-in for the engine's `Popen`: running until the test ends."""

    pid = 0

    def poll(self):
        return None

    def wait(self, timeout=None):
        raise subprocess.TimeoutExpired("engine", timeout)


def _client(connection: Connection) -> EngineClient:
    config = ZipageConfig(block_size=16, kv_budget=64, window=4)
    info = Ready("cpu", config, MemoryPlan(1024, 64, 1, 1, 1024), 256, frozenset(), 1)
    return EngineClient(_Process(), connection, info)


async def _settle(seconds: float = 0.2) -> None:
    """Let the event loop run its socket callbacks for a while."""
    for _ in range(int(seconds / 0.01)):
        await asyncio.sleep(0.01)


async def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_step_update_split_across_reads_is_reassembled_not_taken_for_a_death():
    async def main():
        ours, theirs = socket.socketpair()
        client = _client(Connection(ours.detach()))
        client.attach()
        os.set_blocking(client.connection.fileno(), False)  # as uvloop, uvicorn's loop, sets it
        engine = Connection(os.dup(theirs.fileno()))
        handle = client.submit([1, 2, 3], SamplingParams(max_tokens=1, logprobs=20,
                                                         prompt_logprobs=20))[0]
        add = engine.recv()
        assert isinstance(add, Add) and add.prompt_token_ids == [1, 2, 3]
        # An echo + logprobs update: the prompt's log-probabilities make it ~1 MB.
        prompt = [None] + [(-0.5 - index, list(range(index, index + 20)), [-1.5 - index] * 20)
                           for index in range(4000)]
        update = StepUpdate([add.seq_id], [7], {add.seq_id: "length"}, {}, IDLE,
                            [(-0.25, list(range(20)), [-1.5] * 20)], {add.seq_id: (0, prompt)})
        data = frame(update)
        assert len(data) > 500_000
        # From a thread: the socket holds less than half, so the loop reads while it is written.
        await asyncio.to_thread(theirs.sendall, data[:len(data) // 2])
        await _settle()
        assert client.alive, f"half a message was taken for a dead engine: {client.error}"
        assert handle.deltas.empty()
        await asyncio.to_thread(theirs.sendall, data[len(data) // 2:])
        await _until(lambda: not handle.deltas.empty())
        delta = handle.deltas.get_nowait()
        assert delta.token_ids == [7] and delta.finish_reason == "length" and delta.error is None
        assert len(handle.prompt_logprobs) == 4001 and client.alive
        client.close()
        engine.close()
        theirs.close()

    asyncio.run(main())


def test_a_request_larger_than_the_socket_takes_waits_for_the_engine_to_read_it():
    async def main():
        ours, theirs = socket.socketpair()
        client = _client(Connection(ours.detach()))
        client.attach()
        os.set_blocking(client.connection.fileno(), False)  # as uvloop, uvicorn's loop, sets it
        prompt = [index % 256 for index in range(1_000_000)]  # megabytes: the socket takes less
        handle = client.submit(prompt, SamplingParams(max_tokens=1))[0]
        assert client.alive and not handle.done, client.error
        engine = Connection(os.dup(theirs.fileno()))
        add = await asyncio.to_thread(engine.recv)  # the loop writes the rest meanwhile
        assert add.seq_id == handle.seq_id and add.prompt_token_ids == prompt
        client.abort(handle)  # a message sent after the large one arrives after it, whole
        abort = await asyncio.to_thread(engine.recv)
        assert abort.seq_id == handle.seq_id
        client.close()
        engine.close()
        theirs.close()

    asyncio.run(main())


def test_the_http_side_keeps_no_handle_of_a_request_that_ended_or_was_aborted():
    async def main():
        ours, theirs = socket.socketpair()
        client = _client(Connection(ours.detach()))
        client.attach()
        engine = Connection(os.dup(theirs.fileno()))
        finished = client.submit([1, 2], SamplingParams(max_tokens=1, n=2))
        aborted = client.submit([3, 4], SamplingParams(max_tokens=5))
        rejected = client.submit([5, 6], SamplingParams(max_tokens=5))
        assert len(client._handles) == 4 and client.num_waiting == 4
        client.abort(aborted[0])
        ids = [handle.seq_id for handle in finished]
        update = StepUpdate(ids, [9, 9], {seq_id: "length" for seq_id in ids},
                            {rejected[0].seq_id: ("refused", None)}, IDLE)
        await asyncio.to_thread(theirs.sendall, frame(update))
        await _until(lambda: all(handle.done for handle in finished + rejected))
        assert client._handles == {} and client.num_waiting == 0
        client.close()
        engine.close()
        theirs.close()

    asyncio.run(main())


# ---------------------------------------------------------------- one server over HTTP

MAX_BODY = 2**20
MAX_CONNECTIONS = 24
FLAGS = ["--engine", "cpu", "--dtype", "float32", "--kv-memory-gb", "0.1", "--block-size", "16",
         "--budget", "64", "--window", "4", "--max-model-len", "4096", "--threads", "1",
         "--body-timeout", "1", "--header-timeout", "60", "--max-connections",
         str(MAX_CONNECTIONS), "--max-body-bytes", str(MAX_BODY)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`zipage serve` of a tiny random Qwen3 (4,096 positions) with small limits."""
    from tiny_models import save_tiny_qwen3

    directory = tmp_path_factory.mktemp("hardening")
    model = directory / "model"
    save_tiny_qwen3(model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 4096  # long prompts: echo + logprobs of 1,500 tokens
    (model / "config.json").write_text(json.dumps(config))
    with serving(["--model", str(model), *FLAGS], directory / "server.log", 180) as served:
        yield served


def _engine_pid(url: str) -> int:
    return httpx.get(url + "/health", timeout=10).json()["replicas"][0]["pid"]


def _restarts(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("zipage:engine_restarts_total"))


def test_echo_logprobs_on_long_prompts_complete_with_no_engine_restart(served):
    pid = _engine_pid(served.url)
    length = 1500

    async def main():
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as http:
            echo = [{"prompt": [(index * 7 + position) % 250 + 1 for position in range(length)],
                     "max_tokens": 0, "echo": True, "logprobs": 20} for index in range(4)]
            plain = [{"prompt": [index + 1] * 8, "max_tokens": 4, "logprobs": 20,
                      "ignore_eos": True} for index in range(8)]
            return await asyncio.gather(*(http.post("/v1/completions", json=body)
                                          for body in echo + plain))

    replies = asyncio.run(main())
    assert [reply.status_code for reply in replies] == [200] * 12, [
        reply.text[:200] for reply in replies if reply.status_code != 200]
    for reply in replies[:4]:
        logprobs = reply.json()["choices"][0]["logprobs"]
        assert len(logprobs["token_logprobs"]) == length and logprobs["token_logprobs"][0] is None
        assert all(len(top) == 20 for top in logprobs["top_logprobs"][1:])
    assert _engine_pid(served.url) == pid and _restarts(served.url) == 0


async def _open(port: int, head: bytes, body: bytes = b""):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + body)
    await writer.drain()
    return reader, writer


def _post_head(length: int, path: str = "/v1/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def _status_and_body(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_a_body_late_past_the_body_timeout_is_a_408_while_others_are_served(served):
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()

    async def trickle(writer, data: bytes) -> None:
        for index in range(len(data)):
            writer.write(data[index:index + 1])
            await writer.drain()
            await asyncio.sleep(0.1)

    async def main():
        silent = [await _open(served.port, _post_head(len(body)), body[:10]) for _ in range(4)]
        slow = [await _open(served.port, _post_head(len(body))) for _ in range(4)]
        trickles = [asyncio.ensure_future(trickle(writer, body)) for _, writer in slow]
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
            served_meanwhile = await http.post("/v1/completions", json={"prompt": [1, 2],
                                                                        "max_tokens": 2})
        responses = await asyncio.wait_for(asyncio.gather(*(
            reader.read() for reader, _ in silent + slow)), timeout=30)
        for task in trickles:
            task.cancel()
        for _, writer in silent + slow:
            writer.close()
        return served_meanwhile, responses

    served_meanwhile, responses = asyncio.run(main())
    assert served_meanwhile.status_code == 200
    for response in responses:
        status, error = _status_and_body(response)
        assert status == 408 and error["error"]["code"] == 408
        assert error["error"]["message"].startswith("body: not complete 1 s after")
        assert "--body-timeout" in error["error"]["message"]


def test_connections_past_the_cap_get_a_503_and_the_others_are_served(served):
    async def main():
        idle = []
        for _ in range(MAX_CONNECTIONS):  # the cap, and more with the test's own connections
            idle.append(await asyncio.open_connection("127.0.0.1", served.port))
        reader, writer = await _open(served.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        over = await asyncio.wait_for(reader.read(), timeout=30)  # answered, then closed
        writer.close()
        first_reader, first_writer = idle[0]  # opened under the cap: served
        first_writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        under = await asyncio.wait_for(first_reader.read(), timeout=30)
        for _, idle_writer in idle:
            idle_writer.close()
        return over, under

    over, under = asyncio.run(main())
    status, error = _status_and_body(over)
    assert status == 503 and error["error"]["code"] == 503
    assert "--max-connections" in error["error"]["message"]
    assert under.startswith(b"HTTP/1.1 200")
    deadline = time.monotonic() + 30
    while not healthy(served.url):  # the closed connections leave; new ones are served
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_body_over_the_limit_is_a_413_the_client_reads_after_sending_it_all(served):
    body = json.dumps({"prompt": "x" * (4 * MAX_BODY)}).encode()
    request = urllib.request.Request(served.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:  # not ConnectionResetError
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 413
    error = json.loads(refused.value.read())["error"]
    assert error["code"] == 413 and "--max-body-bytes" in error["message"]
    # A raw client that writes the whole body, then reads: the 413, then the end.
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as sock:
        sock.sendall(_post_head(len(body)) + body)
        response = b""
        while chunk := sock.recv(65536):
            response += chunk
    assert _status_and_body(response)[0] == 413
    assert healthy(served.url)


def _post_raw(url: str, data: bytes) -> httpx.Response:
    return httpx.post(url + "/v1/completions", content=data, timeout=60,
                      headers={"Content-Type": "application/json"})


def test_a_body_nested_too_deeply_is_a_400_that_says_so(served):
    nested = _post_raw(served.url, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert nested.status_code == 400
    assert nested.json()["error"]["message"].startswith("body: arrays or objects nested too deeply")
    assert healthy(served.url)


def test_a_utf16_or_utf32_body_is_a_400_naming_utf8(served):
    for encoding in ("utf-16", "utf-16-le", "utf-32"):
        reply = _post_raw(served.url, json.dumps({"prompt": [1, 2], "max_tokens": 1}).encode(encoding))
        assert reply.status_code == 400, encoding
        message = reply.json()["error"]["message"]
        assert message.startswith(f"body: {encoding.split('-')[0].upper()}") and "UTF-8" in message
    with_bom = _post_raw(served.url, b"\xef\xbb\xbf" + json.dumps({"prompt": [1, 2], "max_tokens": 1}).encode())
    assert with_bom.status_code == 200  # a UTF-8 byte-order mark is still UTF-8


def test_an_unknown_chat_role_is_a_400_listing_the_roles(served):
    wizard = httpx.post(served.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 1})
    assert wizard.status_code == 400
    error = wizard.json()["error"]
    assert error["param"] == "messages"
    assert error["message"] == ("messages.0.role: 'wizard' is not a chat role; use one of system, "
                                "developer, user, assistant, tool, function")


# ---------------------------------------------------------------- data parallel: a restart


def test_a_restarted_replica_is_forgotten_by_prefix_affinity():
    from zipage.serve.replicas import ReplicaSet

    async def main():
        pairs = [socket.socketpair() for _ in range(2)]
        clients = [_client(Connection(ours.detach())) for ours, _ in pairs]
        for index, client in enumerate(clients):
            client.index = index
        replicas = ReplicaSet(clients, "prefix-affinity")
        for client in clients:
            client.attach()
        prompt = list(range(1, 49))  # three blocks of 16
        index, keys = replicas.choose(prompt)
        assert index == 0  # nothing shared, nothing running: the lowest index
        replicas.policy.routed(1, keys)  # the prefix went to replica 1 (0 was busy then)
        assert replicas.choose(prompt)[0] == 1
        # Replica 1's engine process died and a new one is ready: its prefix cache is empty.
        ours, theirs = socket.socketpair()
        clients[1]._swap(_Process(), Connection(ours.detach()), clients[1].info)
        assert replicas.choose(prompt)[0] == 0, "routed to the restarted replica's empty cache"
        for client in clients:
            client.close()
        for _, other in [*pairs, (ours, theirs)]:
            other.close()

    asyncio.run(main())


# ---------------------------------------------------------------- too long before tokenizing


def _byte_level_tokenizer(lowercase: bool = False):
    """A small byte-level BPE (GPT-2's scheme, SmolLM2's), trained here in a fraction of a
    second; with `lowercase`, a normalizer that folds text (no bound then)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    if lowercase:
        backend.normalizer = normalizers.Lowercase()
    corpus = ["the quick brown fox jumps " * 40, " " * 300 + "x", "hello\n\n    world\t\t"] * 10
    backend.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=backend)


class _Counting:
    """A tokenizer that counts the texts it was asked to encode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.encoded = 0

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def encode(self, text, **kwargs):
        self.encoded += 1
        return self.tokenizer.encode(text, **kwargs)


def _server(tokenizer, max_model_len: int = 256):
    from zipage.serve.app import Server

    config = ZipageConfig(block_size=16, kv_budget=64, window=4, max_model_len=max_model_len)
    info = Ready("cpu", config, MemoryPlan(1024, 64, 1, 1, 1024), 400, frozenset(), 1)
    admission = Admission(config, info.capacity.num_blocks)
    engine = SimpleNamespace(info=info, replicas=1, admission=admission)
    return Server(engine, tokenizer, "tiny")


def test_the_token_bound_holds_and_needs_a_tokenizer_that_keeps_every_byte():
    from zipage.serve.text_bound import max_token_bytes

    tokenizer = _byte_level_tokenizer()
    bound = max_token_bytes(tokenizer)
    assert bound == max(len(text.encode()) for text in tokenizer.convert_ids_to_tokens(
        list(range(len(tokenizer)))))
    rng = random.Random(0)
    pieces = [" " * 300, "the quick brown fox jumps ", "\n\n    ", "é\u6f22\U0001f600", "x"]
    for _ in range(50):  # dense texts (long runs its longest tokens cover) and mixed ones
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 40)))
        assert len(tokenizer.encode(text)) * bound >= len(text.encode())
    assert max_token_bytes(_byte_level_tokenizer(lowercase=True)) is None  # folds "A" to "a"
    assert max_token_bytes(None) is None


def test_a_text_that_cannot_fit_is_refused_before_it_is_tokenized():
    from zipage.serve.protocol import ServeError
    from zipage.serve.text_bound import max_token_bytes

    tokenizer = _Counting(_byte_level_tokenizer())
    server = _server(tokenizer, max_model_len=256)
    tokenizer.encoded = 0  # the server's probe of the tokenizer at startup
    bound = max_token_bytes(tokenizer.tokenizer)
    huge = "the quick brown fox jumps " * (bound * 256 // 26 + 10)
    with pytest.raises(ServeError) as refused:
        server.encode(huge)
    assert tokenizer.encoded == 0, "the text was tokenized before it was refused"
    assert refused.value.status == 400 and refused.value.param == "prompt"
    assert refused.value.message == (
        f"prompt: too long for this server: {len(huge)} bytes of text are at least "
        f"{-(-len(huge) // bound)} tokens (no token of this model stands for more than {bound} "
        "bytes), and a prompt here has at most 255 tokens; shorten it")
    # A text that might fit is tokenized (and its true length judged by the core's rule).
    assert len(server.encode("the quick brown fox")) > 0 and tokenizer.encoded == 1
    server.tokenize_pool.shutdown()


def test_the_longest_prompt_is_the_core_rules_own():
    """The length bound asks the core's admission rule (no copy of it that could drift): the
    longest prompt it finds is accepted with one output token, one token more is refused."""
    from zipage.serve.text_bound import max_prompt_tokens

    for chunked, max_model_len, num_blocks in ((True, 256, 1024), (False, 100_000, 1024),
                                               (True, None, 30), (True, 300, 25)):
        config = ZipageConfig(block_size=16, kv_budget=64, window=4, max_model_len=max_model_len,
                              chunked_prefill=chunked)
        admission = Admission(config, num_blocks)
        longest = max_prompt_tokens(admission)

        def refused(prompt_len):
            return admission.rejection_reason(Sequence("r", None, 1, prompt_len=prompt_len))

        assert longest >= 1 and refused(longest) is None and refused(longest + 1) is not None
