#!/usr/bin/env bash
# A baseline run, then the same job killed with SIGKILL three times (once inside a checkpoint
# write) and resumed each time, then `lodger compare`. See docs/power-cut.md.
#
#   bash examples/power-cut.sh            # uses .venv/bin/lodger and a fresh $LODGER_HOME
set -euo pipefail
cd "$(dirname "$0")/.."
LODGER=${LODGER:-$PWD/.venv/bin/lodger}
export LODGER_HOME=${LODGER_HOME:-$(mktemp -d /tmp/lodger-power-cut.XXXX)}
export HF_HUB_OFFLINE=1
JOB=examples/power-cut.toml
echo "LODGER_HOME=$LODGER_HOME"

run_id_of() { sed -n 's/^run \([^ ]*\).*/\1/p' "$1" | head -n 1; }
step_of() { # the newest step in a run's metrics.jsonl (0 if none yet)
  local file="$LODGER_HOME/runs/$1/metrics.jsonl"
  [ -f "$file" ] && python3 -c "import json,sys; print(max([json.loads(l)['step'] for l in open(sys.argv[1]) if l.strip()] or [0]))" "$file" || echo 0
}
wait_for_step() { # run id, step, pid: wait until the run has logged that step (or the process ended)
  while kill -0 "$3" 2>/dev/null && [ "$(step_of "$1")" -lt "$2" ]; do sleep 0.2; done
}

echo "== 1. baseline: the job uninterrupted"
$LODGER run $JOB --quiet | tee /tmp/power-cut-baseline.out
BASELINE=$(run_id_of /tmp/power-cut-baseline.out)

echo "== 2. the same job, with power cuts"
pick() { python3 -c "import random,sys; print(random.Random(int(sys.argv[3])).randint(int(sys.argv[1]), int(sys.argv[2])))" "$@"; }
SEED=${SEED:-$RANDOM}
echo "random kill points from seed $SEED"
K1=$(pick 3 10 "$SEED"); K3=$(pick 22 33 "$((SEED + 1))")

$LODGER run $JOB --quiet > /tmp/power-cut-twin.out & PID=$!
while [ -z "$(run_id_of /tmp/power-cut-twin.out)" ]; do sleep 0.2; done
TWIN=$(run_id_of /tmp/power-cut-twin.out)
wait_for_step "$TWIN" "$K1" $PID
kill -9 $PID; wait $PID || true
echo "-- cut 1: SIGKILL at step $(step_of "$TWIN") (random)"

# Cut 2 lands inside a checkpoint write: lodger's fault point sends SIGKILL to itself after the
# tensors are written and before the manifest, so the kill is certain to hit the write path.
LODGER_FAULT=before_manifest@2 $LODGER resume "$TWIN" --quiet || true
echo "-- cut 2: SIGKILL inside the checkpoint write at step $(step_of "$TWIN")"

$LODGER resume "$TWIN" --quiet & PID=$!
wait_for_step "$TWIN" "$K3" $PID
kill -9 $PID; wait $PID || true
echo "-- cut 3: SIGKILL at step $(step_of "$TWIN") (random)"

echo "== 3. power is back: resume to the end"
$LODGER ls
$LODGER resume "$TWIN" --quiet

echo "== 4. the verdict"
$LODGER compare "$TWIN" "$BASELINE" --plot "${PLOT:-power-cut.png}"
