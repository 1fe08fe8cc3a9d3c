#!/usr/bin/env bash
# The GPU check (issue 53): on a machine that already has torch with CUDA (and transformers, peft, onnx,
# onnxruntime, safetensors), install bdlora without touching those (--no-deps) and run tests/test_cuda.py: the
# builtin teacher's student trained with --device cuda in bf16, resumed, compressed and evaluated, each against the
# same steps on the CPU. Under 8 minutes on one GPU. Usage: bash scripts/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}, "
      f"bf16 supported: {torch.cuda.is_bf16_supported()}")
PY
python -m pip install --quiet --no-deps --no-build-isolation -e . 2>/dev/null \
    || python -m pip install --quiet --no-deps -e .
export BDLORA_CACHE="${BDLORA_CACHE:-$(mktemp -d)}"
export BDLORA_TEACHER_STEPS=60
# what the checks import beyond the preinstalled stack: name what is missing in one line instead of a traceback
python - <<'PY'
import importlib.util, sys
missing = [m for m in ("transformers", "peft", "safetensors", "tokenizers", "numpy", "typer", "rich", "yaml")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing on this machine (install them first): {', '.join(missing)}")
PY
if python -c "import pytest" 2>/dev/null; then
    # -o addopts= : pyproject's addopts ask for pytest-xdist, which a device machine may not have
    timeout 470 python -m pytest -o addopts= -p no:cacheprovider -m cuda -v tests/test_cuda.py
else
    timeout 470 python tests/test_cuda.py
fi
