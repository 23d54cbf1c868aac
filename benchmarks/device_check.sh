#!/usr/bin/env bash
# The GPU check: benchmarks/run.py's realistic rows (mlp_realistic, cnn_realistic: eager and compiled,
# with stacked_fraction and padding_waste), ResNet-18 on CIFAR-shaped synthetic images and a
# GPT-2-small-shaped LoRA round (random weights), in under 8 minutes, written as one JSON file.
#
#   benchmarks/device_check.sh [OUT]              # OUT: a .json file or a folder; default $OUT/device_check.json
#   benchmarks/device_check.sh --cpu-smoke [OUT]  # the same steps shrunk, on the CPU (or DEVICE_CHECK_CPU_SMOKE=1)
#
# Needs torch (with CUDA), lightning, numpy and scikit-learn (the digits data); the LoRA step also
# transformers, peft, tokenizers and pandas with pyarrow (missing: that step records the error, the rest run).
# Not needed: jsonargparse, dp-accounting, torchvision, network access.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"

smoke="${DEVICE_CHECK_CPU_SMOKE:-}"
target=""
for arg in "$@"; do
  case "$arg" in
    --cpu-smoke) smoke=1 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) target="$arg" ;;
  esac
done
target="${target:-${OUT:-benchmarks/results}}"
case "$target" in *.json) ;; *) target="$target/device_check${smoke:+_cpu_smoke}.json" ;; esac

"$PY" - "$smoke" <<'EOF' || exit 3
import importlib, sys

smoke = bool(sys.argv[1])
missing = []
for name, why in [("torch", "everything"), ("lightning", "Trainer.fit"), ("numpy", "the data"), ("sklearn", "the digits data of cnn_realistic")]:
    try:
        importlib.import_module(name)
    except Exception as error:
        missing.append(f"{name} (for {why}: {type(error).__name__}: {error})")
if missing:
    sys.exit("device_check: missing required Python packages: " + "; ".join(missing))
try:
    from fl_lightning import FederatedModule  # noqa: F401
    import datamodules, models  # noqa: F401
except Exception as error:
    sys.exit(f"device_check: fl_lightning does not import here: {type(error).__name__}: {error}")
import torch

if not smoke and not torch.cuda.is_available():
    sys.exit(f"device_check: torch {torch.__version__} sees no CUDA device (use --cpu-smoke to try the steps on the CPU)")
optional = []
for name in ("transformers", "peft", "tokenizers", "pandas", "pyarrow"):
    try:
        importlib.import_module(name)
    except Exception:
        optional.append(name)
if optional:
    print(f"device_check: the LoRA step will fail, missing: {', '.join(optional)}", file=sys.stderr)
EOF

exec "$PY" benchmarks/device_check.py --out "$target" ${smoke:+--cpu-smoke}
