#!/usr/bin/env bash
# The quantised base's CUDA paths on a GPU machine (scripts/gpu_qlora_check.py): gpu_check.sh's
# set-up (wheels from .whl, PYTHONPATH, environment report), then this check instead of its own.
#   scripts/gpu_qlora_check.sh            # on the GPU machine (OUT set by the device tool)
#   scripts/gpu_qlora_check.sh --cpu      # test this script on a CPU
set -u
cd "$(dirname "$0")/.."
export OUT="${OUT:-/tmp/gpu_qlora_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && ! "$PY" -c "import pydantic, bitsandbytes" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed" >&2; exit 2; }
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    mkdir -p /tmp/site/lodger-0.1.0.dist-info
    printf 'Metadata-Version: 2.1\nName: lodger\nVersion: 0.1.0\n' > /tmp/site/lodger-0.1.0.dist-info/METADATA
fi
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
{ echo "== date"; date -u; echo "== nvidia-smi"; nvidia-smi 2>&1 || echo "(no nvidia-smi)"
  "$PY" -c "import torch, bitsandbytes; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'bitsandbytes', bitsandbytes.__version__)" 2>&1
} | tee "$OUT/env.txt"
"$PY" scripts/gpu_qlora_check.py "$@"
