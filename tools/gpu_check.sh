#!/bin/bash
# The GPU validation (tools/gpu_check.py), as run on a lent GPU machine:
#   bash tools/gpu_check.sh OUT [--dry-run] [--cpu] [--stages 1,2,3,4,5]
# megatron-core and psutil are not in that machine's image and it has no
# network: their wheels travel in .whl/ (`make gpu-wheels` puts them there)
# and are installed here first. Writes OUT/summary.json, OUT/summary.md and
# OUT/logs.tar.gz; the runs write under OUT/../gpu-check-work.
set -u
OUT=${1:?usage: bash tools/gpu_check.sh OUT [--dry-run] [--cpu] [--stages LIST]}
shift
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
case " $* " in
  *" --dry-run "*) ;;
  *) if ls .whl/*.whl >/dev/null 2>&1; then
       "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
         --target /tmp/site .whl/*.whl || exit 1
       export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
     fi ;;
esac
command -v nvidia-smi >/dev/null && nvidia-smi -q > "$OUT/nvidia-smi.txt" 2>&1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONWARNINGS=ignore
exec "$PYTHON" -m tools.gpu_check "$OUT" "$@"
