#!/bin/bash
# Before and after issue #15's fit changes, in the cross-trace setting of bench/fidelity_cross_trace.py
# (run that first: this script reads its traces from WORK and its profiles from RESULTS).
#   OLD_VENV  a virtual environment with zipage at d1bb791 (the commit before the changes):
#             git archive d1bb791 | tar -x -C OLD_SRC; python3 -m venv --system-site-packages OLD_VENV;
#             OLD_VENV/bin/pip install --no-deps OLD_SRC   (run from outside a checkout: cd /tmp)
#   NEW_VENV  one with this branch installed; NEW_SRC this checkout
#   RUNS      the engine runs; WORK the --work folder of fidelity_cross_trace.py;
#   RESULTS   bench/results/fidelity_cross_trace_2026-11-23
# The old `--from-run` has no --stall-factor: its fits keep the LongBench run's five compilation stalls.
# Writes compare/before-*.txt (old fit, old simulator), compare/hybrid-online-*.txt (one change at a
# time, this branch's simulator) and batches_after_their_launching_step.txt.
set -euo pipefail
OLD=$OLD_VENV/bin/zipage; NEW=$NEW_VENV/bin/zipage
DEP="--model qwen3-8b --hardware h200 --kv-memory-gb 6 --block-size 64 --budget 512"
cd /tmp
declare -A FIT=( [headline]="$RUNS/gpu7/a/zipage $RUNS/gpu7/b/zipage $RUNS/gpu4/lb/zipage"
                 [online]="$RUNS/gpu6/el/zipage $RUNS/gpu4/lb/zipage"
                 [longbench200]="$RUNS/gpu6/el/zipage $RUNS/gpu7/a/zipage $RUNS/gpu7/b/zipage" )
declare -A EVAL=( [headline]="gpu6/el/zipage gpu5/el/zipage" [online]="gpu7/a/zipage gpu7/b/zipage"
                  [longbench200]="gpu4/lb/zipage" )
declare -A TRACE=( [headline]=$WORK/headline.json [online]=$NEW_SRC/traces/online-mixture.json
                   [longbench200]=$WORK/longbench200.json )
for name in headline online longbench200; do
  $OLD calibrate --from-run ${FIT[$name]} --hardware h200 --out $WORK/old-without-$name.json > /dev/null
  $OLD replay ${TRACE[$name]} $DEP --cost-model $WORK/old-without-$name.json --out $WORK/old-sim-$name --decisions none --no-progress > /dev/null
  for run in ${EVAL[$name]}; do
    $NEW compare $WORK/old-sim-$name $RUNS/$run > $RESULTS/compare/before-$name-${run//\//-}.txt
  done
done
# Hybrids on the online mixture: one change at a time.
NEWP=$RESULTS/profiles/fitted-without-online.json.gz
$NEW_VENV/bin/python - "$WORK/old-without-online.json" "$NEWP" "$WORK" <<'PY'
import gzip, json, sys
old, new, work = json.load(open(sys.argv[1])), json.loads(gzip.decompress(open(sys.argv[2], "rb").read())), sys.argv[3]
json.dump(dict(new, compress=old["compress"], contention_factor=old["contention_factor"]), open(f"{work}/hybrid-new-prefill-old-batches.json", "w"))
json.dump(dict(old, compress=new["compress"], contention_factor=new["contention_factor"]), open(f"{work}/hybrid-old-prefill-new-batches.json", "w"))
PY
for hybrid in new-prefill-old-batches old-prefill-new-batches; do
  $NEW replay ${TRACE[online]} $DEP --cost-model $WORK/hybrid-$hybrid.json --out $WORK/sim-online-$hybrid --decisions none --no-progress > /dev/null
  for run in ${EVAL[online]}; do
    $NEW compare $WORK/sim-online-$hybrid $RUNS/$run > $RESULTS/compare/hybrid-online-$hybrid-${run//\//-}.txt
  done
done
# Async batches that a simulation reported done after the step that launched them (the engine: none).
$NEW_VENV/bin/python - "$WORK" > $RESULTS/batches_after_their_launching_step.txt <<'PY'
import sys
from pathlib import Path
import pandas as pd
work = Path(sys.argv[1])
for run in sorted(list(work.glob("old-sim-*")) + list(work.glob("sim-*-cross")) + list(work.glob("sim-online-*-batches"))):
    steps = pd.read_csv(run / "steps.csv")
    launched = steps[steps["n_compress"] > 0]
    late = int((launched["batches_done"] == 0).sum())
    print(f"{run.name}: {late} of {len(launched)} batches ({100 * late / len(launched):.0f} %) reported after their launching step")
PY
