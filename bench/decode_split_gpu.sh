#!/usr/bin/env bash
# The decode kernel's split of a step's rows, "batch" (every row alike, from the batch size) against
# "balanced" (each row by its share of the step's entries; zipage/decode_grid.py), and replays with the
# engine's rule (balanced where the longest row gets more partitions) against the batch split, in one call:
#   kernel   - bench/decode_long_row_gpu.py: one layer of Llama-3.1-8B's decode attention, long rows
#              beside short ones and uniform batches, bf16 and FP8, both splits (and their outputs
#              checked against each other)
#   row2-fp8 - a third of TensorRT-LLM's row 2 (32 x 20,000 / 2,000 at once, random Llama-3.1-8B,
#              Zipage with FP8 KV), each split
#   row2-fp8-whole - the whole row 2 (96 requests), each split
#   headline - traces/amc23-headline.json (Qwen3-8B, 6 GB, block 64, budget 512), each split (the
#              non-regression check)
#   longbench - traces/longbench.json on random Llama-3.1-8B, Zipage, each split
#
#   . bench/env.sh && bash bench/decode_split_gpu.sh $OUT [kernel] [row2-fp8] [row2-fp8-whole] [headline] [longbench]
#
# Writes OUT/*.log, OUT/decode_long_row.json, OUT/runs.tar.gz (the replays' run directories) and prints
# a makespan table last.
set -euo pipefail
out=${1:?output folder}
shift
[ $# -gt 0 ] || set -- kernel row2-fp8 headline
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
runs=/tmp/decode-split-runs
mkdir -p "$runs"
SPLITS=${SPLITS:-batch rule}  # replays: bench/replay_variant.py --decode-split; the kernel part: batch,balanced
replay() {  # LABEL ZIPAGE_REPLAY_ARGS... (run once per split)
    local label=$1 start split
    shift
    for split in $SPLITS; do
        start=$(date +%s)
        (cd /tmp && python "$here/replay_variant.py" --decode-split "$split" replay "$@" \
            --no-progress --decisions none --out "$runs/$label-$split") > "$out/$label-$split.log" 2>&1 \
            || echo "$label-$split FAILED (see $label-$split.log)" >> "$out/walls.txt"
        echo "$label-$split: $(( $(date +%s) - start )) s wall" >> "$out/walls.txt"
    done
}
row2() {  # REQUESTS PATH
    python - "$1" "$2" <<'PY'
import json, sys
count, path = int(sys.argv[1]), sys.argv[2]
requests = [{"id": f"r{i}", "arrival_s": 0.0, "prompt_len": 20000, "output_len": 2000} for i in range(count)]
json.dump({"version": 1, "name": f"trt-row2-{count}", "requests": requests}, open(path, "w"))
PY
}
for part in "$@"; do
    case $part in
        kernel)
            OUT="$out" python "$here/decode_long_row_gpu.py" --partitions auto --min-tiles 2 \
                --splits batch,balanced > "$out/kernel.log" 2>&1 || echo "kernel FAILED" >> "$out/walls.txt"
            ;;
        row2-fp8)
            row2 32 /tmp/row2-third.json
            replay row2-third-fp8 /tmp/row2-third.json --gpu --model random:llama-3.1-8b --hardware h200 \
                --kv-cache-dtype fp8
            ;;
        row2-fp8-whole)
            row2 96 /tmp/row2.json
            replay row2-fp8 /tmp/row2.json --gpu --model random:llama-3.1-8b --hardware h200 --kv-cache-dtype fp8
            ;;
        headline)
            replay headline "$here/../traces/amc23-headline.json" --gpu --model random:qwen3-8b --kv-memory-gb 6 \
                --block-size 64 --budget 512
            ;;
        longbench)
            replay longbench "$here/../traces/longbench.json" --gpu --model random:llama-3.1-8b --hardware h200
            ;;
        *) echo "unknown part $part: kernel, row2-fp8, row2-fp8-whole, headline or longbench" >&2; exit 2 ;;
    esac
done
tar -C "$runs" -czf "$out/runs.tar.gz" .
[ -f "$out/kernel.log" ] && sed -n '/one layer/,$p' "$out/kernel.log"
python - "$runs" <<'PY'
import json, pathlib, sys
for run in sorted(pathlib.Path(sys.argv[1]).iterdir()):
    if (run / "summary.json").exists():
        summary = json.loads((run / "summary.json").read_text())
        print(f"{run.name:<26} makespan {summary.get('makespan_s', float('nan')):8.2f} s  "
              f"tok/s {summary.get('tps', float('nan')):8.1f}  steps {summary.get('steps')}  "
              f"TPOT p50 {summary.get('tpot_p50_ms', float('nan')):.2f} ms")
PY
cat "$out/walls.txt" 2>/dev/null || true
