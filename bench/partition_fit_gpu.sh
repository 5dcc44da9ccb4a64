#!/usr/bin/env bash
# The decode fit's longest request over its partitions, measured (docs/cost_model.md, 'Decode:
# the longest request over its partitions'): calibrate the Qwen3-8B Zipage and Full-KV profiles
# through the engine loop with the fitting traces that now include fit-longctx (long
# uncompressed contexts at small batches: what pins the context slope), so that the new
# profiles carry decode_excess "per_partition"; then print each decode fit both ways on the same
# points (as written, and per entry: the field removed), so the two can be compared. Random
# weights, block 64, budget 512, 6 GB of KV, --hardware h200: the shipped profiles' setup. About
# four minutes a profile on an H200 with the defaults below (probe, warm-up, ~90 s of fitting
# runs, 15 s of validation), so both fit one 10-minute call:
#
#   . bench/env.sh && bash bench/partition_fit_gpu.sh $OUT            # both modes
#   . bench/env.sh && bash bench/partition_fit_gpu.sh $OUT fullkv     # one
#
# FIT_SECONDS / VALIDATION_SECONDS change the traffic (the default total of `zipage calibrate`,
# 120 + 30 s, takes ~5 minutes a profile). Writes OUT/8b-MODE.log, 8b-MODE-profile.json,
# 8b-MODE-fits.txt and 8b-MODE-runs.tar.gz (the engine runs: refit them offline with
# `zipage calibrate --from-run`).
set -euo pipefail
out=${1:?output folder}
shift
[ $# -gt 0 ] || set -- zipage fullkv
fit_seconds=${FIT_SECONDS:-90}
validation_seconds=${VALIDATION_SECONDS:-15}
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
for mode in "$@"; do
    case $mode in
        zipage) flags=() ;;
        fullkv) flags=(--no-compress) ;;
        *) echo "unknown mode $mode: zipage or fullkv" >&2; exit 2 ;;
    esac
    name=8b-$mode
    work=$(mktemp -d "/tmp/partition-$name-XXXX")  # a run directory refuses stray files
    start=$(date +%s)
    # From /tmp: the checkout's own zipage/ (without sim/ inside) would shadow bench/env.sh's tree.
    (cd /tmp && python -m zipage.cli calibrate --gpu --model random:qwen3-8b --kv-memory-gb 6 \
        --block-size 64 --budget 512 "${flags[@]}" --hardware h200 \
        --fit-seconds "$fit_seconds" --validation-seconds "$validation_seconds" --no-progress \
        --runs-dir "$work/runs" --out "$work/profile.json") 2>&1 | tee "$out/$name.log" \
        || echo "$name: zipage calibrate FAILED"
    echo "$name: $(( $(date +%s) - start )) s of wall time" | tee -a "$out/$name.log"
    cp "$work/profile.json" "$out/$name-profile.json" 2>/dev/null || true
    tar -czf "$out/$name-runs.tar.gz" -C "$work" --exclude='*-sim-*' runs 2>/dev/null || true
    [ -f "$work/profile.json" ] || continue
    (cd /tmp && python "$here/partition_fits.py" "$work/profile.json" "$work"/runs/fit-* \
        "$work"/runs/validate-bursts) 2>&1 | tee "$out/$name-fits.txt"
done
