#!/usr/bin/env bash
# `zipage fidelity` on a GPU for one model and mode (issue #33; docs/BENCHMARKS.md, 'Twin
# fidelity'): calibrate through the engine loop (the profile to ship), then check the twin on
# fresh built-in traces and any production windows given with --trace. Random Qwen3 weights,
# block 64, budget 512, the headline's memory (Qwen3-8B 6 GB of KV, Qwen3-0.6B 3 GB; Qwen3-32B at
# tensor parallel 2, 6 GB a GPU, on nvidia-h200-x2). One call per model and mode fits the
# 10-minute limit on an H200:
#
#   . bench/env.sh && bash bench/fidelity_gpu.sh 8b zipage $OUT --trace $PWD/.gpu/azure-conv.jsonl
#
# Writes OUT/NAME.log, NAME-profile.json, NAME-fidelity.json and NAME-runs.tar.gz (every engine
# run's and profile simulation's steps and requests, for bench/fidelity_attribution.py).
set -euo pipefail
model=${1:?model: 8b, 06 or 32b-tp2}
mode=${2:?mode: zipage or fullkv}
out=${3:?output folder}
shift 3
case $model in
    8b) flags=(--model random:qwen3-8b --kv-memory-gb 6) ;;
    06) flags=(--model random:qwen3-0.6b --kv-memory-gb 3) ;;
    32b-tp2) flags=(--model random:qwen3-32b --kv-memory-gb 6 --tensor-parallel 2) ;;
    *) echo "unknown model $model: 8b, 06 or 32b-tp2" >&2; exit 2 ;;
esac
case $mode in
    zipage) ;;
    fullkv) flags+=(--no-compress) ;;
    *) echo "unknown mode $mode: zipage or fullkv" >&2; exit 2 ;;
esac
name=$model-$mode
work=$(mktemp -d "/tmp/fidelity-$name-XXXX")  # a fresh one per call: a run directory refuses stray files
mkdir -p "$out"
# FIDELITY_LIMIT_S: seconds `zipage fidelity` may run (default 0: no limit). Set it below the
# call's limit: past it the profile and the runs written so far are still copied out below (a
# call killed from outside loses them all, as a 32B TP=2 call did at its fourth check trace).
limit=${FIDELITY_LIMIT_S:-0}
# From /tmp: the checkout's own zipage/ (without sim/ inside) would shadow bench/env.sh's tree.
(cd /tmp && timeout "$limit" python -m zipage.cli fidelity --gpu "${flags[@]}" --block-size 64 \
    --budget 512 --out "$work" "$@") 2>&1 | tee "$out/$name.log" \
    || echo "$name: zipage fidelity FAILED or ran past FIDELITY_LIMIT_S=$limit"
cp "$work/profile.json" "$out/$name-profile.json" 2>/dev/null || true
cp "$work/fidelity.json" "$out/$name-fidelity.json" 2>/dev/null || true
tar -czf "$out/$name-runs.tar.gz" -C "$work" --exclude='*-sim-analytic' --exclude='*.log' \
    calibration runs 2>/dev/null || true
