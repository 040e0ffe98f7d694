#!/usr/bin/env bash
# The GPU check in one command (docs/gpus.md, "The GPU check"). On the device machine, with .gpu_check carried:
#   bash tests/gpu/check.sh              # installs the carried wheels, runs tests/gpu/check.py: results in $OUT
#   bash tests/gpu/check.sh --only pytest_gpu --pytest_k fsdp   # a rerun of what failed, after a fix
# Here, on the CPU, after tests/gpu/prepare.sh:
#   bash tests/gpu/check.sh --dry-run    # is everything it needs carried? (imports, wheels, data, flags, budget)
set -uo pipefail
cd "$(dirname "$0")/../.."
if [[ "${1:-}" == "--dry-run" ]]; then
    exec "${PYTHON:-python3}" tests/gpu/check.py --dry-run
fi
export GPU_CHECK_STARTED=$(date +%s)   # the 8-minute budget counts from here, the install included
site=/tmp/gpu_check_site
# --no-deps: tests/gpu/wheels.txt names every package the image lacks; the image's torch stays as it is
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    .gpu_check/wheels/*.whl || {
    echo "error: the carried wheels did not install; run tests/gpu/prepare.sh here and carry .gpu_check"; exit 1; }
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
exec python3 tests/gpu/check.py "$@"
