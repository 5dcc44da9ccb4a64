"""Generated text and `zipage generate`: the end-of-sequence token stays out of the text, chat
templates, labelled outputs for several prompts, prompts from a file or stdin, exit statuses.

The model is the tiny random Qwen3 of the engine tests with a word-level tokenizer ("w0" ...
"w255") and a small chat template saved beside it, so everything runs in seconds on the CPU.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import save_tiny_qwen3  # noqa: E402

from zipage.cli.output import EXIT_REQUESTS_FAILED  # noqa: E402
from zipage.cli.parser import main  # noqa: E402
from zipage.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.engine

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant{% endif %}")
KNOBS = ["--no-compress", "--block-size", "16", "--kv-memory-gb", "0.01", "--device", "cpu"]


def save_word_tokenizer(directory: Path, chat_template: str | None) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{index}" for index in range(250)] + ["user", "system", "assistant", "hello",
                                                      "<eos>", "<unk>"]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)},
                                         unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>",
                                        unk_token="<unk>")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-chat")
    save_tiny_qwen3(directory)
    save_word_tokenizer(directory, CHAT_TEMPLATE)
    return directory


@pytest.fixture(scope="module")
def llm(chat_model):
    from zipage import LLM

    return LLM(str(chat_model), compress=False, block_size=16, kv_memory_gb=0.01, device="cpu")


def test_the_eos_token_ends_the_output_but_not_the_text(llm):
    from zipage import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    free_run = llm.generate(["hello w1 w2"], greedy, progress=False)[0]
    assert free_run.finish_reason == "length" and len(free_run.token_ids) == 6
    tokens = free_run.token_ids
    # The last new token of the run becomes the end of sequence (a random model repeats itself).
    stop = max(index for index, token in enumerate(tokens) if token not in tokens[:index])
    eos_word = llm.tokenizer.convert_ids_to_tokens(tokens[stop])
    original_eos = llm.tokenizer.eos_token
    llm.tokenizer.eos_token = eos_word  # make the model's second token its end of sequence
    try:
        stopped = llm.generate(["hello w1 w2"], SamplingParams(temperature=0.0, max_tokens=6),
                               progress=False)[0]
    finally:
        llm.tokenizer.eos_token = original_eos
    assert stopped.token_ids == tokens[:stop + 1]  # token_ids keep the EOS, as vLLM's do
    assert stopped.finish_reason == "stop"
    assert stopped.text == llm.tokenizer.decode(tokens[:stop])
    assert eos_word not in stopped.text.split()


def test_chat_applies_the_template(llm):
    from zipage import SamplingParams

    conversation = [{"role": "system", "content": "w3"}, {"role": "user", "content": "hello"}]
    assert llm.render_chat(conversation) == "system w3 user hello assistant"
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    [reply] = llm.chat(conversation, params, progress=False)
    [same] = llm.generate([llm.tokenizer.encode("system w3 user hello assistant",
                                                add_special_tokens=False)], params,
                          progress=False)
    assert reply.prompt == "system w3 user hello assistant"
    assert reply.token_ids == same.token_ids
    assert len(llm.chat([conversation, conversation[1:]], params, progress=False)) == 2
    with pytest.raises(ConfigError, match="'role' and 'content'"):
        llm.chat([{"content": "no role"}], progress=False)


def test_chat_without_a_template_says_so(tmp_path):
    from zipage import LLM

    save_tiny_qwen3(tmp_path)
    save_word_tokenizer(tmp_path, chat_template=None)
    llm = LLM(str(tmp_path), compress=False, block_size=16, kv_memory_gb=0.01, device="cpu")
    with pytest.raises(ConfigError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hello"}])


def test_generate_labels_several_outputs(capsys, chat_model):
    status = main(["generate", "--model", str(chat_model), *KNOBS, "--max-tokens", "3",
                   "hello w1", "w7 w8"])
    out = capsys.readouterr().out.splitlines()
    assert status == 0
    assert out[0] == "[1/2] hello w1" and "[2/2] w7 w8" in out
    assert out.index("[2/2] w7 w8") == 3 and out[2] == ""  # label, answer, blank line


def test_generate_one_prompt_prints_only_the_text(capsys, chat_model):
    status = main(["generate", "--model", str(chat_model), *KNOBS, "--max-tokens", "3", "--chat",
                   "--system", "w3", "hello"])
    out = capsys.readouterr().out.splitlines()
    assert status == 0 and len(out) == 1 and not out[0].startswith("[")


def test_generate_reads_prompts_from_a_file_and_stdin(capsys, monkeypatch, chat_model, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello w1\n\nw7 w8\n")
    assert main(["generate", "--model", str(chat_model), *KNOBS, "--max-tokens", "2",
                 "--file", str(prompts)]) == 0
    from_file = capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO("hello w1\nw7 w8\n"))
    assert main(["generate", "--model", str(chat_model), *KNOBS, "--max-tokens", "2",
                 "--file", "-"]) == 0
    assert capsys.readouterr().out == from_file
    assert "[2/2] w7 w8" in from_file


def test_generate_without_prompts_or_with_a_missing_file(capsys, chat_model, tmp_path):
    assert main(["generate", "--model", str(chat_model), *KNOBS]) == 2
    assert "give at least one prompt" in capsys.readouterr().err
    assert main(["generate", "--model", str(chat_model), *KNOBS, "--file",
                 str(tmp_path / "none.txt")]) == 2
    assert "none.txt" in capsys.readouterr().err


def test_generate_exits_3_when_a_prompt_fails(capsys, chat_model):
    status = main(["generate", "--model", str(chat_model), *KNOBS, "--max-tokens", "4",
                   "--max-model-len", "6", "w1", "w1 w2 w3 w4 w5 w6 w7"])
    out = capsys.readouterr().out
    assert status == EXIT_REQUESTS_FAILED
    assert "[failed]" in out and out.count("[failed]") == 1


def test_an_empty_output_says_so_and_suggests_chat(capsys, llm, chat_model, tmp_path):
    """An instruct model prompted without its chat template may end its turn at once: stdout
    gets an empty line, stderr one line saying the output is empty and to add --chat. Generation
    worked, so the exit status stays 0. Here the tokenizer's end of sequence is the word the
    tiny model says first, so it stops at once."""
    from zipage import SamplingParams

    first = llm.generate(["hello w1"], SamplingParams(temperature=0.0, max_tokens=1,
                                                      ignore_eos=True), progress=False)[0]
    word = llm.tokenizer.convert_ids_to_tokens(first.token_ids[0])
    save_tiny_qwen3(tmp_path)
    tokenizer = llm.tokenizer.__class__.from_pretrained(chat_model)
    tokenizer.eos_token = word
    tokenizer.save_pretrained(tmp_path)
    capsys.readouterr()  # the save's progress bar
    status = main(["generate", "--model", str(tmp_path), *KNOBS, "--max-tokens", "3",
                   "hello w1"])
    out, err = capsys.readouterr()
    assert status == 0 and out == "\n"
    [line] = err.splitlines()
    assert line.startswith("warning: the output is empty") and line.endswith("add --chat")
    status = main(["generate", "--model", str(tmp_path), *KNOBS, "--max-tokens", "3",
                   "hello w1", "w7 w8"])
    out, err = capsys.readouterr()
    assert status == 0 and "[2/2] w7 w8" in out
    assert "the output of prompt 1 of 2 is empty" in err.splitlines()[0]


def test_generate_defaults_to_float32_on_the_cpu(monkeypatch, capsys, chat_model):
    """--dtype's default follows the device (zipage.cli.flags.default_dtype), as replay --engine
    cpu and serve --engine cpu do."""
    import zipage.engine.llm

    seen = {}
    real = zipage.engine.llm.LLM.__init__

    def spy(self, model, **keywords):
        seen.update(keywords)
        real(self, model, **keywords)

    monkeypatch.setattr(zipage.engine.llm.LLM, "__init__", spy)
    assert main(["generate", "--model", str(chat_model), *KNOBS, "--max-tokens", "1",
                 "hello"]) == 0
    assert seen["dtype"] == "float32"
