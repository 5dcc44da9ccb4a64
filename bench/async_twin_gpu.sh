#!/usr/bin/env bash
# The twin under async scheduling (docs/BENCHMARKS.md, 'Async scheduling in the twin'): measure a
# Qwen3-8B Zipage profile on the async engine through the engine loop (`zipage calibrate --gpu
# --async-scheduling`), then replay the 8B headline on the engine with and without async
# scheduling, each run written out, so that offline the step-time replay checks the async run's
# decisions and the simulator predicts both runs (the synchronous one with the shipped profile,
# the async one with the profile measured here). Random weights, block 64, budget 512, 6 GB of KV,
# the shipped profiles' setup. About eight minutes on an H200:
#
#   . bench/env.sh && bash bench/async_twin_gpu.sh $OUT
#
# Writes OUT/calibrate.log, 8b-zipage-async-profile.json, headline.log and headline-runs.tar.gz
# (the two headline run directories).
set -euo pipefail
out=${1:?output folder}
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
trace="$here/../traces/amc23-headline.json"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work=$(mktemp -d /tmp/async-twin-XXXX)
knobs=(--model random:qwen3-8b --kv-memory-gb 6 --block-size 64 --budget 512 --hardware h200)
nvidia-smi --query-gpu=serial --format=csv,noheader | sha256sum | cut -c1-8 | sed 's/^/host /' \
    | tee "$out/headline.log"
start=$(date +%s)
# From /tmp: the checkout's own zipage/ (without sim/ inside) would shadow bench/env.sh's tree.
(cd /tmp && python -m zipage.cli calibrate --gpu "${knobs[@]}" --async-scheduling \
    --fit-seconds "${FIT_SECONDS:-90}" --validation-seconds "${VALIDATION_SECONDS:-15}" \
    --no-progress --runs-dir "$work/calibrate-runs" --out "$work/profile.json") 2>&1 \
    | tee "$out/calibrate.log" || echo "zipage calibrate FAILED"
echo "calibrate: $(( $(date +%s) - start )) s of wall time" | tee -a "$out/calibrate.log"
cp "$work/profile.json" "$out/8b-zipage-async-profile.json" 2>/dev/null || true
for variant in async sync; do
    flags=()
    [ "$variant" = async ] && flags=(--async-scheduling)
    start=$(date +%s)
    (cd /tmp && python -m zipage.cli replay "$trace" --gpu "${knobs[@]}" "${flags[@]}" \
        --no-progress --out "$work/headline-$variant") 2>&1 | tee -a "$out/headline.log" \
        || echo "headline $variant FAILED"
    echo "headline $variant: $(( $(date +%s) - start )) s of wall time" | tee -a "$out/headline.log"
done
tar -czf "$out/headline-runs.tar.gz" -C "$work" headline-async headline-sync
