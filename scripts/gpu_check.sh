#!/usr/bin/env bash
# One-shot check of lodger's CUDA paths on a GPU machine (precision modes, memory estimate,
# determinism, exact resume), through the real `lodger` command. Writes $OUT/gpu_check.txt (the
# summary), $OUT/gpu_check_log.txt (every command's output), $OUT/env.txt and $OUT/work.tar.gz.
#
#   scripts/gpu_check.sh            # on the GPU machine (OUT set by the device tool)
#   scripts/gpu_check.sh --cpu      # test this script on a CPU (tiny model, fp16 must be refused)
# Extra arguments go to scripts/gpu_check.py (--budget SECONDS, --work DIR).
set -u
cd "$(dirname "$0")/.."
export OUT="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
# Packages the GPU image lacks travel as wheels in .whl (git-ignored); installed outside the image.
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && ! "$PY" -c "import pydantic" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed" >&2; exit 2; }
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    # lodger runs from src/ (not pip-installed): `lodger estimate` reads its version from package metadata.
    mkdir -p /tmp/site/lodger-0.1.0.dist-info
    printf 'Metadata-Version: 2.1\nName: lodger\nVersion: 0.1.0\n' > /tmp/site/lodger-0.1.0.dist-info/METADATA
fi
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
{
    echo "== date"; date -u
    echo "== nvidia-smi"; nvidia-smi 2>&1 || echo "(no nvidia-smi)"
    echo "== python / torch"
    "$PY" -c "import sys, torch, transformers, peft, pydantic; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'available', torch.cuda.is_available()); print('transformers', transformers.__version__, 'peft', peft.__version__, 'pydantic', pydantic.__version__)" 2>&1
    "$PY" -c "import lodger; print('lodger from', lodger.__file__)" 2>&1
} | tee "$OUT/env.txt"
"$PY" scripts/gpu_check.py "$@"
status=$?
# Run folders and per-command logs, without tensors (the model is rebuilt from fixtures_lib).
work=/tmp/gpu_check_work
for a in "$@"; do case "$a" in --work=*) work="${a#--work=}";; esac; done
[ -d "$work" ] && tar -czf "$OUT/work.tar.gz" -C "$work" --exclude=model --exclude=cache --exclude='*.safetensors' logs home job-bf16.toml 2>/dev/null
ls -la "$OUT"
exit $status
