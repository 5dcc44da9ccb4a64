#!/usr/bin/env bash
# Engine runs for the twin-fidelity study across traces, models and modes (issue #15;
# docs/BENCHMARKS.md, 'Twin fidelity'): the inputs of bench/fidelity_matrix.py. Random Qwen3
# weights, block 64, budget 512, async compression, decode CUDA graphs; Qwen3-8B with 6 GB of
# KV, Qwen3-0.6B with 3 GB (the headline's settings). Each trace and model is replayed twice
# (a, b: the engine's run-to-run spread), Zipage and Full KV. One part per device call (each fits
# the 10-minute limit on an H200):
#
#   . bench/env.sh && bash bench/fidelity_runs.sh 8b-headline $OUT
#   . bench/env.sh && bash bench/fidelity_runs.sh 8b-online $OUT
#   . bench/env.sh && bash bench/fidelity_runs.sh 8b-longbench $OUT
#   . bench/env.sh && bash bench/fidelity_runs.sh 06-headline $OUT
#   . bench/env.sh && bash bench/fidelity_runs.sh 06 $OUT
#
# Every finished replay is packed at once into OUT/<name>.tar.gz (its run directories, the
# script's JSON report and log), so a call cut short still returns what it finished.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
part=${1:?part: 8b-headline, 8b-online, 8b-longbench, 06-headline or 06}
out=${2:?output folder}
mkdir -p "$out"

replay() {  # NAME ARGS...: one bench/headline_gpu.py invocation, packed when it ends
    local name=$1; shift
    local dir="$out/$name"
    mkdir -p "$dir"
    (cd "$dir" && OUT="$dir" python "$root/bench/headline_gpu.py" --no-simulate \
        --runs-dir "$dir/runs" "$@" > "$dir/log.txt" 2>&1) || echo "$name FAILED (log in $name.tar.gz)"
    tail -4 "$dir/log.txt" | sed "s/^/$name: /"
    tar -czf "$out/$name.tar.gz" -C "$out" "$name" && rm -rf "$dir"
}

online=(--trace "$root/traces/online-mixture.json")
longbench=(--trace "$root/traces/longbench.json" --head 200)
b8=(--model qwen3-8b --kv-memory-gb 6)
b06=(--model qwen3-0.6b --kv-memory-gb 3)
case $part in
    8b-headline)
        replay 8b-headline-a "${b8[@]}" --variants zipage,full-kv
        replay 8b-headline-b "${b8[@]}" --variants zipage ;;
    06-headline)
        replay 06-headline-a "${b06[@]}" --variants zipage,full-kv
        replay 06-headline-b "${b06[@]}" --variants zipage ;;
    8b-online)
        for run in a b; do replay "8b-online-$run" "${b8[@]}" "${online[@]}" --variants zipage,full-kv; done ;;
    8b-longbench)
        for run in a b; do replay "8b-lb-$run" "${b8[@]}" "${longbench[@]}" --variants zipage,full-kv; done
        replay 8b-headline-fullkv "${b8[@]}" --variants full-kv ;;
    06)
        for run in a b; do replay "06-online-$run" "${b06[@]}" "${online[@]}" --variants zipage,full-kv; done
        for run in a b; do replay "06-lb-$run" "${b06[@]}" "${longbench[@]}" --variants zipage,full-kv; done
        replay 06-headline-fullkv "${b06[@]}" --variants full-kv ;;
    *) echo "unknown part $part: 8b-headline, 8b-online, 8b-longbench, 06-headline or 06" >&2; exit 2 ;;
esac
