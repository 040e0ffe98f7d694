#!/usr/bin/env bash
# Fills .gpu_check/ (ignored by .gitignore) with what the GPU check reads on the device machine, which reaches
# nothing: the wheels of tests/gpu/wheels.txt for its Python 3.12 on x86-64, and the real data sets beside the
# checkout (../shared/data, or $GPU_CHECK_DATA). Run it in the checkout the device tool sends, then
#   bash tests/gpu/check.sh --dry-run
set -euo pipefail
cd "$(dirname "$0")/../.."
data=${GPU_CHECK_DATA:-../shared/data}
rm -rf .gpu_check
mkdir -p .gpu_check/wheels .gpu_check/data
# The device README's flags: the manylinux tags pip must accept for that machine, not this one's.
sed 's/#.*//' tests/gpu/wheels.txt | xargs python3 -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .gpu_check/wheels
# DeepSpeed (requirements-deepspeed.txt) has only a source release on PyPI: its pure-Python wheel, built here (its ops
# compile at run time), at constraints.txt's version
python3 -m pip wheel -q --no-deps --no-build-isolation -w .gpu_check/wheels "$(grep '^deepspeed==' constraints.txt)"
cp -r "$data/mnist-10k" "$data/photos-jpeg" .gpu_check/data/
du -sh .gpu_check
