#!/usr/bin/env bash
# Tensor-parallel health check on a machine with >= 2 GPUs: replays traces/tiny.json on a small
# random model at TP=2, with and without CUDA graphs. If a run hangs, every zipage process is sent
# SIGABRT after TP_SMOKE_TIMEOUT seconds, so Python's faulthandler prints where each one waits.
#     bash bench/tp_smoke.sh [MODEL]        (default random:qwen3-0.6b)
set -u
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/bench/env.sh"
export PYTHONFAULTHANDLER=1 ZIPAGE_TP_TIMEOUT_S="${ZIPAGE_TP_TIMEOUT_S:-60}" NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
model="${1:-random:qwen3-0.6b}"
limit="${TP_SMOKE_TIMEOUT:-90}"
cd /tmp
for graphs in "" "--no-cuda-graphs"; do
    echo "== TP=2 $model ${graphs:-with CUDA graphs}"
    python3 - "$root/traces/tiny.json" "$model" "$graphs" <<'PY' &
import json, sys
from zipage.config import ZipageConfig
from zipage.core.deployment import ReplaySettings
from zipage.engine.replay import replay_on_engine
from zipage.trace import load_trace
settings = ReplaySettings(model=sys.argv[2], kv_memory_gb=1.0, tensor_parallel=2,
                          config=ZipageConfig(block_size=32, window=8, kv_budget=64))
summary, _ = replay_on_engine(load_trace(sys.argv[1]), settings, "cuda",
                              cuda_graphs=sys.argv[3] == "")
print(json.dumps({key: summary[key] for key in ("completed", "output_tokens", "tps")}))
PY
    main=$!
    ( sleep "$limit"; pkill -ABRT -f "[z]ipage.engine.parallel"; sleep 3; kill -ABRT "$main" ) 2>/dev/null &
    watchdog=$!
    wait "$main"; echo "== exit $? (${graphs:-graphs})"
    kill "$watchdog" 2>/dev/null; pkill -KILL -f "[z]ipage.engine.parallel" 2>/dev/null; sleep 1
done
