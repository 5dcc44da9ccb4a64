"""GPU benchmark of the Full-KV engine (run on a GPU; results go to docs/BENCHMARKS.md).

Part A — decode step vs the memory roofline: for random:qwen3-0.6b and random:qwen3-8b at batch
1/32/128/256 with 2k-token contexts, time one decode step (CUDA graphs on and off) and compare it
with (weight bytes + KV bytes read) / measured copy bandwidth.

Part B — Full-KV engine vs HF transformers' continuous batching (`generate_batch`): the same
model shapes (random weights), the same requests (fixed prompt and output lengths, EOS ignored),
output tokens per second of each, in one run.

    python bench/engine_gpu.py [--models qwen3-0.6b,qwen3-8b] [--requests 256] [--parts A,B]

Prints a table last and writes engine_gpu.json under $OUT (or runs/<script>/ of the repository).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import traceback
from pathlib import Path

import torch

from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.core.memory import GIB, kv_token_bytes
from zipage.core.sampling import SamplingParams
from zipage.core.sequence import Sequence
from zipage.core.step import DECODE, StepPlan
from zipage.engine.builder import build_engine
from zipage.engine.llm import LLM
from zipage.presets import get_preset

CONTEXT = 2048


def copy_bandwidth(fill: bool = False) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted); with `fill`, of random
    bytes rather than a fresh allocation's (on an H200 both copy alike, 2026-12-01)."""
    source = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    if fill:
        source.random_(0, 256)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        target.copy_(source)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000 / 10
    del source, target
    torch.cuda.empty_cache()
    return 2 * 2 * GIB / seconds


def weight_bytes_read(model: str) -> int:
    """Bytes a decode step streams: every weight except the input embedding rows (a gather);
    a tied embedding is read once, as the LM head."""
    shape = get_preset(model)
    embedding = shape.vocab_size * shape.hidden_size
    return 2 * (shape.num_params - (0 if shape.tie_embeddings else embedding))


def decode_roofline(model: str, batches: list[int], bandwidth: float,
                    tensor_parallel: int = 1, eager: bool = True) -> list[dict]:
    """Seconds of one whole decode step (inputs, forward, sampling, tokens on the host) at each
    batch of 2,048-token contexts, with CUDA graphs (`graphs`) and, if `eager`, without, against
    the bandwidth roofline of `tensor_parallel` GPUs (each reads its shard of weights and KV)."""
    shape = get_preset(model)
    kv_per_token = kv_token_bytes(shape, "auto", 2)
    largest = max(batches)
    kv_gb = largest * (CONTEXT + 256) * kv_per_token / tensor_parallel / GIB + 0.5
    settings = ReplaySettings(model=f"random:{model}", dtype="bfloat16", kv_memory_gb=kv_gb,
                              tensor_parallel=tensor_parallel,
                              config=ZipageConfig(compress=False, max_num_seqs=largest,
                                                  max_model_len=CONTEXT + 256))
    engine = build_engine(settings, "cuda", cuda_graphs=True)
    runner = engine.runner
    scheduler = engine.new_scheduler()
    manager = scheduler.block_manager
    rows = []
    greedy = SamplingParams(temperature=0.0)
    try:
        for batch in batches:
            sequences, tokens = [], {}
            blocks = -(-CONTEXT // scheduler.block_size)
            for index in range(batch):
                seq = Sequence(f"s{index}", None, 16, prompt_len=CONTEXT - 1, sampling=greedy)
                seq.block_table = [manager.allocate() for _ in range(blocks)]
                seq.set_counters(CONTEXT - 1, 1)  # decodes the token at KV index 2047
                sequences.append(seq)
                tokens[seq.seq_id] = [index % shape.vocab_size]
            row = {"model": model, "tp": tensor_parallel, "batch": batch}
            plan = StepPlan(step_id=0, kind=DECODE, decode=sequences)
            for graphs in (True, False) if eager else (True,):
                # A tensor-parallel executor has no graphs of its own to switch off (eager=False).
                saved = getattr(runner, "graphs", None)
                if not graphs:
                    runner.graphs = {}
                for _ in range(3):
                    runner.execute(plan, tokens)
                torch.cuda.synchronize()
                iterations = 20
                started = time.perf_counter()
                for _ in range(iterations):
                    runner.execute(plan, tokens)
                torch.cuda.synchronize()
                row["graphs" if graphs else "eager"] = (time.perf_counter() - started) / iterations
                if saved is not None:
                    runner.graphs = saved
            bytes_read = weight_bytes_read(model) + batch * CONTEXT * kv_per_token
            # The copy bandwidth counts bytes read plus bytes written: the rate at which memory
            # traffic moves, which is what a decode step's reads are bounded by.
            row["roofline_s"] = bytes_read / tensor_parallel / bandwidth
            row["bandwidth_share"] = row["roofline_s"] / row["graphs"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            for seq in sequences:
                manager.release_all(seq.block_table)
    finally:
        engine.close()  # tensor parallel: the workers stop now
        del engine, runner
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def engine_vs_hf(model: str, requests: int, prompt_len: int, output_len: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    shape = get_preset(model)
    prompts = [torch.randint(100, 30000, (prompt_len,), generator=generator).tolist()
               for _ in range(requests)]
    result = {"model": model, "requests": requests, "prompt_len": prompt_len,
              "output_len": output_len}
    # Our Full-KV engine, caches sized like HF's default (share of free memory).
    llm = LLM(f"random:{model}", compress=False, dtype="bfloat16", gpu_memory_utilization=0.9)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                 progress=False)  # warm-up: Triton compilation
    torch.cuda.synchronize()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, progress=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    tokens = sum(len(output.token_ids) for output in outputs)
    result["zipage_tps"] = tokens / seconds
    result["zipage_s"] = seconds
    result["zipage_blocks"] = llm.engine.capacity.num_blocks
    result["zipage_peak_running"] = llm.last_run.summary["peak_running"]
    del llm
    torch.cuda.empty_cache()

    import transformers
    from transformers.generation import ContinuousBatchingConfig, GenerationConfig

    config = transformers.Qwen3Config(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size, max_position_embeddings=shape.max_position,
        tie_word_embeddings=shape.tie_embeddings, rms_norm_eps=shape.rms_norm_eps,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)
    errors = []
    for implementation in ("paged|sdpa", "sdpa_paged", "paged_attention"):
        try:
            hf_model = transformers.AutoModelForCausalLM.from_config(
                config, dtype=torch.bfloat16, attn_implementation=implementation).cuda().eval()
            generation = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)
            hf_model.generate_batch(prompts[:8], generation_config=GenerationConfig(
                max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0),
                continuous_batching_config=ContinuousBatchingConfig())
            torch.cuda.synchronize()
            started = time.perf_counter()
            outputs = hf_model.generate_batch(
                prompts, generation_config=generation,
                continuous_batching_config=ContinuousBatchingConfig())
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            tokens = sum(len(output.generated_tokens) for output in outputs.values())
            result.update(hf_tps=tokens / seconds, hf_s=seconds, hf_attention=implementation,
                          hf_tokens=tokens)
            break
        except Exception as error:  # try the next attention name of this transformers version
            errors.append(f"{implementation}: {type(error).__name__}: {error}")
            torch.cuda.empty_cache()
    if errors:
        result["hf_errors"] = errors
    if "hf_tps" in result:
        result["speedup"] = result["zipage_tps"] / result["hf_tps"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    parser.add_argument("--batches", default="1,32,128,256")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--parts", default="A,B")
    parser.add_argument("--hf-models", default="qwen3-0.6b")
    args = parser.parse_args()
    # $OUT when set (the GPU harness collects it), else the ignored runs/ of the repository.
    out = Path(os.environ.get("OUT")
               or Path(__file__).resolve().parents[1] / "runs" / "engine_gpu")
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    report["copy_bandwidth"] = bandwidth = copy_bandwidth()
    print(f"device {report['device']}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    batches = [int(value) for value in args.batches.split(",")]
    if "A" in args.parts:
        report["decode"] = []
        for model in args.models.split(","):
            try:
                report["decode"].extend(decode_roofline(model, batches, bandwidth))
            except Exception:
                report.setdefault("errors", []).append(traceback.format_exc())
                print(traceback.format_exc(), flush=True)
            (out / "engine_gpu.json").write_text(json.dumps(report, indent=2))
    if "B" in args.parts:
        report["vs_hf"] = []
        for model in args.hf_models.split(","):
            try:
                report["vs_hf"].append(engine_vs_hf(model, args.requests, args.prompt_len,
                                                    args.output_len))
            except Exception:
                report.setdefault("errors", []).append(traceback.format_exc())
                print(traceback.format_exc(), flush=True)
            (out / "engine_gpu.json").write_text(json.dumps(report, indent=2))
    print("\nA. decode step vs memory roofline (2k-token contexts)")
    print(f"{'model':<12} {'batch':>5} {'graphs ms':>10} {'eager ms':>9} {'roofline ms':>12} "
          f"{'% of bw':>8}")
    for row in report.get("decode", []):
        print(f"{row['model']:<12} {row['batch']:>5} {row['graphs'] * 1e3:>10.2f} "
              f"{row['eager'] * 1e3:>9.2f} {row['roofline_s'] * 1e3:>12.2f} "
              f"{100 * row['bandwidth_share']:>7.1f}%")
    print("\nB. Full-KV engine vs HF generate_batch")
    for row in report.get("vs_hf", []):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
