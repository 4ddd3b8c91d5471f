#!/usr/bin/env bash
# GPU runbook (docs/gpu.md): check, start, test and bench a 1P1D pair of OFFICIAL vLLM engines on one or two
# GPUs with the kvbridge connector, for operators reproducing the figures on their own hardware.
#
# UNTESTED ON A GPU: written where no GPU was available. Steps 1-2 are the same checks CI runs on CPU;
# `up` is plain `vllm serve`-style api_server; `e2e` and `bench` start their engines through
# services/kvbridge_services/devengines/launcher.py in its GPU mode (KVBRIDGE_ENGINE_DEVICE=cuda, set here).
#
#   KVBRIDGE_ENGINE_MODEL=/models/Llama-3.1-8B-Instruct  local model directory the host has (required)
#   KVBRIDGE_PREFILL_GPUS=0  KVBRIDGE_DECODE_GPUS=1       one GPU index per engine (the same index = one GPU)
#   KVBRIDGE_ENGINE_GPU_MEMORY_UTILIZATION               per engine (default 0.85; 0.4 when both share a GPU)
#   KVBRIDGE_ENGINE_DTYPE=auto                           auto | bfloat16 | float16 | float32
#   KVBRIDGE_REGISTRY=host:port  KVBRIDGE_LEASE=host:port  KVBRIDGE_API_KEY=...  a control plane (`up` only)
#   KVBRIDGE_GPU_LOGS=./gpu-runbook-logs                 engine logs, pid files, e2e/bench engine logs
#   PYTHON=python                                        the interpreter of the vLLM environment
#
#   scripts/gpu-runbook.sh check            steps 1-2 only
#   scripts/gpu-runbook.sh up               steps 1-2, then a prefill (:8100) and a decode (:8200) engine
#   scripts/gpu-runbook.sh e2e [PYTEST...]  steps 1-2, then pytest tests/e2e on the GPUs
#   scripts/gpu-runbook.sh bench [ARGS...]  steps 1-2, then bench/ttft_reuse.py -> bench/results/gpu-<date>/
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
say() { printf '\033[1m[gpu-runbook]\033[0m %s\n' "$*"; }
mode=${1:-check}
[ $# -gt 0 ] && shift
case "$mode" in
  check|up|e2e|bench) ;;
  *) echo "usage: scripts/gpu-runbook.sh check|up|e2e|bench [args] (see docs/gpu.md)" >&2; exit 2 ;;
esac
: "${KVBRIDGE_ENGINE_MODEL:?set KVBRIDGE_ENGINE_MODEL to a local model directory the host has}"
export KVBRIDGE_ENGINE_DEVICE=cuda KVBRIDGE_ENGINE_MODEL
export KVBRIDGE_PREFILL_GPUS=${KVBRIDGE_PREFILL_GPUS:-0} KVBRIDGE_DECODE_GPUS=${KVBRIDGE_DECODE_GPUS:-1}
logs=${KVBRIDGE_GPU_LOGS:-./gpu-runbook-logs}

say "0. settings (services/kvbridge_services/devengines/launcher.py engine_mode_from_env: a bad one stops here, by name)"
mem=$("$py" -c 'import sys
from kvbridge_services.devengines.launcher import EngineModeError, engine_mode_from_env
try:
    m = engine_mode_from_env()
except EngineModeError as e:
    sys.exit(f"invalid setting: {e}")
print(m, file=sys.stderr); print(m.gpu_memory_utilization)')

say "1. vLLM version and surface (static check of the installed vllm's source)"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
"$py" -c 'import vllm; print("vllm", vllm.__version__)'
"$py" -m kvbridge_connector.vllm_surface
"$py" -c 'from kvbridge_connector import compat; compat.check_vllm_version(compat.installed_vllm_version(), {})'

say "2. connector unit tests against this vllm"
"$py" -m pytest tests/unit/connector -q -x

case "$mode" in
  check) say "checks passed (up, e2e or bench next)"; exit 0 ;;
  e2e)
    # The `kvbridge up --engines` / demo tests start engines through services/kvbridge_services/devengines/local.py, which
    # stays CPU-only: left out here (docs/gpu.md).
    say "3. e2e suite on GPUs $KVBRIDGE_PREFILL_GPUS (prefill) / $KVBRIDGE_DECODE_GPUS (decode), logs under pytest's basetemp"
    exec "$py" -m pytest tests/e2e -q -rA \
      --ignore=tests/e2e/test_cli_up_engines.py \
      --ignore=tests/e2e/test_demo_agent.py "$@" ;;
  bench)
    out=${KVBRIDGE_GPU_BENCH_OUT:-bench/results/gpu-$(date -u +%Y-%m-%d)}
    mkdir -p "$out" "$logs"
    nvidia-smi >"$out/nvidia-smi.txt"
    "$py" -m pip freeze 2>/dev/null | grep -iE '^(vllm|nixl|torch|kvbridge)' >"$out/versions.txt" || true
    say "3. TTFT bench -> $out/ttft.md, ttft.png (engine logs $logs/ttft-logs)"
    exec "$py" bench/ttft_reuse.py --out "$out/ttft" --log-dir "$logs/ttft-logs" "$@" ;;
esac

: "${KVBRIDGE_REGISTRY:?set KVBRIDGE_REGISTRY (and KVBRIDGE_LEASE) to a running control plane}"
mkdir -p "$logs"
engine() {  # name role gpu http_port side_channel_port
  local extra
  extra=$(printf '{"bidirectional_kv_xfer":true,"kvbridge_registry":"%s","kvbridge_lease":"%s","kvbridge_http_url":"http://127.0.0.1:%s"}' \
    "$KVBRIDGE_REGISTRY" "${KVBRIDGE_LEASE:-$KVBRIDGE_REGISTRY}" "$4")
  say "3. $1 ($2) on GPU $3, http :$4, NIXL side channel :$5 (log $logs/$1.log)"
  CUDA_VISIBLE_DEVICES=$3 VLLM_NIXL_SIDE_CHANNEL_PORT=$5 nohup "$py" -m vllm.entrypoints.openai.api_server \
    --model "$KVBRIDGE_ENGINE_MODEL" --port "$4" --gpu-memory-utilization "$mem" \
    --dtype "${KVBRIDGE_ENGINE_DTYPE:-auto}" --block-size 16 \
    --kv-transfer-config "{\"kv_connector\":\"KvbridgeConnector\",\"kv_connector_module_path\":\"kvbridge_connector.connector\",\"kv_role\":\"$2\",\"kv_buffer_device\":\"cuda\",\"kv_connector_extra_config\":$extra}" \
    >"$logs/$1.log" 2>&1 &
  echo $! >"$logs/$1.pid"
}
engine prefill kv_producer "$KVBRIDGE_PREFILL_GPUS" 8100 5600
engine decode kv_consumer "$KVBRIDGE_DECODE_GPUS" 8200 5700
for port in 8100 8200; do
  for _ in $(seq 600); do curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break; sleep 1; done
  curl -fsS "http://127.0.0.1:$port/health" >/dev/null || { say "engine on :$port did not start; see $logs"; exit 1; }
done
say "both engines healthy; stop them with: kill \$(cat $logs/prefill.pid) \$(cat $logs/decode.pid)"
