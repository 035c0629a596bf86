#!/usr/bin/env bash
# Our kohya LoCon files through diffusers 0.32.1 (the version kohya's sd-scripts pins) and through the
# project's own diffusers. The old one is installed beside the project's environment, with the
# transformers, peft and huggingface_hub of its day, into a folder that only this check puts first.
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m pip install --quiet --target "$work/old" --no-deps diffusers==0.32.1 transformers==4.47.1 \
    peft==0.14.0 tokenizers==0.21.0 huggingface_hub==0.27.0
"$python" tests/compat/locon_reader.py write "$work/files"
PYTHONPATH="$work/old" "$python" tests/compat/locon_reader.py read "$work/files"
"$python" tests/compat/locon_reader.py read "$work/files"
