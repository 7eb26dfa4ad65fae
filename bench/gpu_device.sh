#!/usr/bin/env bash
# On an offline GPU machine whose python3 has a CUDA torch (issue #40's figures): unpack the bundle that
# bench/gpu_bundle.py made (.device/site.tar.xz), install this working tree beside it, then run the steps named:
#
#   bash bench/gpu_device.sh bench [BUDGET_S]   # bench/gpu.py, all parts, in BUDGET_S seconds (default 420)
#   bash bench/gpu_device.sh smoke              # tests/gpu (what `make gpu-smoke` runs, without make's venv)
#   bash bench/gpu_device.sh bench 420 smoke    # both, one after the other
#
# Results (bench/gpu.py's gpu_<part>.json) and each step's log go to $OUT (the device tool's folder that comes
# back; /tmp/rlt2t-gpu-out elsewhere). The unpacked site stays in /tmp/rlt2t-site while the machine is up, so a
# second call on a warm machine skips the set-up. Exit status: the first failing step's.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/rlt2t-gpu-out}
site=/tmp/rlt2t-site
py=${PYTHON:-python3}
mkdir -p "$out"

if [ ! -e "$site/.ready" ]; then
    [ -f .device/site.tar.xz ] || { echo "no .device/site.tar.xz: run bench/gpu_bundle.py here and carry .device"; exit 2; }
    t0=$(date +%s)
    rm -rf "$site" && mkdir -p "$site" && tar -xJf .device/site.tar.xz -C "$site" --strip-components=1 || exit 2
    # This tree, built by the machine's own setuptools (no index, no build isolation), beside the bundle.
    "$py" -m pip install --quiet --no-deps --no-build-isolation --no-index --target "$site" . || exit 2
    touch "$site/.ready"
    echo "set-up: $(( $(date +%s) - t0 )) s"
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH" TOKENIZERS_PARALLELISM=false
"$py" -c "import torch, transformers, rlt2t; print('torch', torch.__version__, '| transformers', transformers.__version__,
'| CUDA', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')" || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$out/nvidia-smi.txt"

status=0
while [ $# -gt 0 ]; do
    step=$1; shift
    case $step in
        bench)
            budget=420
            if [[ ${1:-} =~ ^[0-9]+$ ]]; then budget=$1; shift; fi
            PYTHONUNBUFFERED=1 "$py" bench/gpu.py --budget-s "$budget" --out "$out" 2>&1 | tee "$out/bench.log"
            rc=${PIPESTATUS[0]} ;;
        smoke)
            "$py" -m pytest tests/gpu -q -p no:cacheprovider --timeout=300 -rs 2>&1 | tee "$out/smoke.log"
            rc=${PIPESTATUS[0]} ;;
        *)
            echo "unknown step $step (bench [BUDGET_S] | smoke)"; exit 2 ;;
    esac
    echo "$step: exit $rc"
    [ "$status" -eq 0 ] && status=$rc
done
exit "$status"
