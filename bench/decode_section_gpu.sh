#!/usr/bin/env bash
# The decode section of graphed mixed steps, before and after, in one call (docs/cost_model.md,
# 'Decode rows in graphed mixed steps'; zipage/prefill_buckets.py):
#   steps  - whole mixed steps eagerly and graphed three ways (folded: every decode row in the
#            prefill launch, the engine before; sectioned: always the section; on: the engine's
#            rule), Llama-3.1-8B and Qwen3-0.6B: 16 rows at 1k-20k entries beside a 496- or
#            2,032-token chunk, 32 rows at 8k (a full section), and prefill steps without decode
#            rows; each row also says whether the graphed step sampled the eager step's tokens
#   row2   - a third of TensorRT-LLM's row 2 (32 x 20,000 / 2,000 at once, random Llama-3.1-8B,
#            bf16 Zipage), folded then with the section
#   headline - traces/amc23-headline.json (Qwen3-8B, 6 GB, block 64, budget 512), folded then
#            with the section (the non-regression check)
#   longbench - traces/longbench.json on random Llama-3.1-8B, Zipage, folded then with the section
#   row2-fp8 - TensorRT-LLM's whole row 2 (96 x 20,000 / 2,000), Zipage with FP8 KV, the section
#   fullkv-profile - the shipped Qwen3-8B Full KV profile (its long decode contexts are where mixed
#            steps take the section) against the engine folded then with the section, on the same
#            four fresh built-in traces (`zipage fidelity --cost-model ... --check-seed 46`)
#   check  - bench/check_engine_gpu.py's step-exact part: each prefill graph (the decode section's
#            too) replays bit for bit what it runs eagerly, the section within 1e-4 of the fold
#
#   . bench/env.sh && bash bench/decode_section_gpu.sh $OUT [steps] [row2] [headline] [longbench] [row2-fp8] [fullkv-profile] [check]
#
# Writes OUT/steps-*.log and prefill_gpu json, OUT/runs.tar.gz (the replays' run directories, to
# compare offline with `zipage compare`) and prints a makespan table last.
set -euo pipefail
out=${1:?output folder}
shift
[ $# -gt 0 ] || set -- steps row2 headline
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
runs=/tmp/decode-section-runs
mkdir -p "$runs"
replay() {  # LABEL SECTION_RULE ZIPAGE_REPLAY_ARGS...
    local label=$1 rule=$2
    shift 2
    local start
    start=$(date +%s)
    (cd /tmp && python "$here/replay_variant.py" --decode-section "$rule" replay "$@" \
        --no-progress --decisions none --out "$runs/$label") > "$out/$label.log" 2>&1 \
        || echo "$label FAILED (see $label.log)" >> "$out/walls.txt"
    echo "$label: $(( $(date +%s) - start )) s wall" >> "$out/walls.txt"
}
for part in "$@"; do
    case $part in
        steps)
            OUT="$out/steps-16" python "$here/prefill_gpu.py" --models llama-3.1-8b,qwen3-0.6b \
                --tokens 496,2032 --decodes 16 --decode-context 1024,2048,4096,8192,20000 \
                --prefill-graphs off,folded,sectioned,on --repeats 5 > "$out/steps-16.log" 2>&1 || true
            OUT="$out/steps-32" python "$here/prefill_gpu.py" --models llama-3.1-8b --tokens 2016 \
                --decodes 32 --decode-context 8192 --prefill-graphs off,folded,sectioned --repeats 5 \
                > "$out/steps-32.log" 2>&1 || true
            OUT="$out/steps-0" python "$here/prefill_gpu.py" --models qwen3-0.6b,llama-3.1-8b \
                --tokens 128,512,2048 --prefill-graphs folded,on --repeats 10 > "$out/steps-0.log" 2>&1 || true
            ;;
        row2)
            python - <<'EOF'
import json
requests = [{"id": f"r{i}", "arrival_s": 0.0, "prompt_len": 20000, "output_len": 2000} for i in range(32)]
json.dump({"version": 1, "name": "trt-row2-third", "requests": requests}, open("/tmp/row2-third.json", "w"))
EOF
            for variant in folded:never section:rule; do
                replay "row2-${variant%%:*}" "${variant##*:}" /tmp/row2-third.json --gpu \
                    --model random:llama-3.1-8b --hardware h200
            done
            ;;
        headline)
            for variant in folded:never section:rule; do
                replay "headline-${variant%%:*}" "${variant##*:}" "$here/../traces/amc23-headline.json" \
                    --gpu --model random:qwen3-8b --kv-memory-gb 6 --block-size 64 --budget 512
            done
            ;;
        longbench)
            for variant in folded:never section:rule; do
                replay "longbench-${variant%%:*}" "${variant##*:}" "$here/../traces/longbench.json" --gpu \
                    --model random:llama-3.1-8b --hardware h200
            done
            ;;
        row2-fp8)
            python - <<'EOF'
import json
requests = [{"id": f"r{i}", "arrival_s": 0.0, "prompt_len": 20000, "output_len": 2000} for i in range(96)]
json.dump({"version": 1, "name": "trt-row2", "requests": requests}, open("/tmp/row2.json", "w"))
EOF
            replay row2-fp8-section rule /tmp/row2.json --gpu --model random:llama-3.1-8b --hardware h200 \
                --kv-cache-dtype fp8
            ;;
        fullkv-profile)
            for variant in folded:never section:rule; do
                label="fullkv-profile-${variant%%:*}"
                (cd /tmp && python "$here/replay_variant.py" --decode-section "${variant##*:}" fidelity --gpu \
                    --model random:qwen3-8b --kv-memory-gb 6 --block-size 64 --budget 512 --no-compress \
                    --hardware h200 --cost-model "$here/../sim/profiles/qwen3-8b-h200-b64-k512-fullkv.json" \
                    --traces 4 --trace-seconds "${TRACE_SECONDS:-25}" --check-seed 46 --no-progress \
                    --out "$runs/$label") > "$out/$label.log" 2>&1 || echo "$label FAILED" >> "$out/walls.txt"
            done
            ;;
        check)
            (cd "$here" && python -c "import check_engine_gpu as c; failures = c.prefill_graph_steps_exact('qwen3-0.6b'); \
print('CHECK', 'PASS' if not failures else f'FAIL {failures}')") > "$out/check.log" 2>&1 || true
            ;;
        *) echo "unknown part $part: steps, row2, headline, longbench, row2-fp8, fullkv-profile or check" >&2; exit 2 ;;
    esac
done
tar -C "$runs" -czf "$out/runs.tar.gz" .
if [ -f "$out/check.log" ]; then cat "$out/check.log"; fi
for log in "$out"/steps-*.log; do
    [ -f "$log" ] && { echo "== $(basename "$log")"; sed -n '/copy .* TB\/s/,$p' "$log"; }
done
python - "$runs" <<'EOF'
import json, pathlib, sys
for run in sorted(pathlib.Path(sys.argv[1]).iterdir()):
    if not (run / "summary.json").exists():
        continue  # (a fidelity directory: its table is in its log)
    summary = json.loads((run / "summary.json").read_text())
    print(f"{run.name:<20} makespan {summary.get('makespan_s', float('nan')):8.2f} s  "
          f"tok/s {summary.get('tps', float('nan')):8.1f}  steps {summary.get('steps')}  TTFT p50 {summary.get('ttft_p50_s', float('nan')):.3f} s  TPOT p50 {summary.get('tpot_p50_ms', float('nan')):.2f} ms")
EOF
cat "$out/walls.txt" 2>/dev/null || true
for log in "$out"/fullkv-profile-*.log; do
    if [ -f "$log" ]; then echo "== $(basename "$log")"; tail -40 "$log"; fi
done
