#!/usr/bin/env bash
# Before a GPU window, on a machine with the package index: download the wheels of bench/gpu_wheels.txt
# (what the GPU machine lacks) for Python 3.12 on x86-64 Linux into .whl/ (ignored by git), which
# `run` carries and bench/gpu_window.sh installs there.
#
#   bash bench/prepare_gpu_wheels.sh     # then: run(command="OUT=$OUT bash bench/gpu_window.sh", carry=[".whl"])
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
mapfile -t WANTED < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' bench/gpu_wheels.txt | grep -v '^$')
rm -rf .whl.partial
mkdir -p .whl.partial
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl.partial "${WANTED[@]}"
rm -rf .whl
mv .whl.partial .whl
du -ch .whl/*.whl | tail -n 1 | sed 's/total$/in .whl, to carry/'
ls .whl
