#!/usr/bin/env bash
# GPU runbook (docs/gpu.md): check and start a 1P1D pair of OFFICIAL vLLM engines on one or two GPUs
# with the kvbridge connector, for operators reproducing the figures on their own hardware.
#
# UNTESTED ON A GPU: written where no GPU was available. Steps 1-2 are the same checks CI runs on CPU;
# step 3 is plain `vllm serve`. The e2e suite and bench/ttft_reuse.py still launch CPU engines
# (services/devengines/launcher.py); see docs/gpu.md for what is missing to run them on GPUs.
#
#   KVBRIDGE_GPU_MODEL=/models/Llama-3.1-8B-Instruct   model path or HF id the host already has (required)
#   KVBRIDGE_GPU_PREFILL=0  KVBRIDGE_GPU_DECODE=1       GPU ids (the same id for both = one GPU, halve memory)
#   KVBRIDGE_GPU_MEM=0.85                               --gpu-memory-utilization per engine (0.4 on one GPU)
#   KVBRIDGE_REGISTRY=host:port  KVBRIDGE_LEASE=host:port  KVBRIDGE_API_KEY=...  a running control plane
#   KVBRIDGE_GPU_LOGS=./gpu-runbook-logs
#   scripts/gpu-runbook.sh check    steps 1-2 only;   scripts/gpu-runbook.sh up    steps 1-3
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
say() { printf '\033[1m[gpu-runbook]\033[0m %s\n' "$*"; }
mode=${1:-check}
: "${KVBRIDGE_GPU_MODEL:?set KVBRIDGE_GPU_MODEL to a model the host has}"
prefill_gpu=${KVBRIDGE_GPU_PREFILL:-0}; decode_gpu=${KVBRIDGE_GPU_DECODE:-1}
mem=${KVBRIDGE_GPU_MEM:-0.85}; logs=${KVBRIDGE_GPU_LOGS:-./gpu-runbook-logs}

say "1. vLLM version and surface (static check of the installed vllm's source)"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
"$py" -c 'import vllm; print("vllm", vllm.__version__)'
"$py" -m kvbridge_connector.vllm_surface
"$py" -c 'from kvbridge_connector import compat; compat.check_vllm_version(compat.installed_vllm_version(), {})'

say "2. connector unit tests against this vllm"
"$py" -m pytest tests/unit/connector -q -x

[ "$mode" = up ] || { say "checks passed (run with 'up' to start the engines)"; exit 0; }
: "${KVBRIDGE_REGISTRY:?set KVBRIDGE_REGISTRY (and KVBRIDGE_LEASE) to a running control plane}"
mkdir -p "$logs"
engine() {  # name role gpu http_port side_channel_port
  local extra
  extra=$(printf '{"bidirectional_kv_xfer":true,"kvbridge_registry":"%s","kvbridge_lease":"%s","kvbridge_http_url":"http://127.0.0.1:%s"}' \
    "$KVBRIDGE_REGISTRY" "${KVBRIDGE_LEASE:-$KVBRIDGE_REGISTRY}" "$4")
  say "3. $1 ($2) on GPU $3, http :$4, NIXL side channel :$5 (log $logs/$1.log)"
  CUDA_VISIBLE_DEVICES=$3 VLLM_NIXL_SIDE_CHANNEL_PORT=$5 nohup "$py" -m vllm.entrypoints.openai.api_server \
    --model "$KVBRIDGE_GPU_MODEL" --port "$4" --gpu-memory-utilization "$mem" \
    --kv-transfer-config "{\"kv_connector\":\"KvbridgeConnector\",\"kv_connector_module_path\":\"kvbridge_connector.connector\",\"kv_role\":\"$2\",\"kv_connector_extra_config\":$extra}" \
    >"$logs/$1.log" 2>&1 &
  echo $! >"$logs/$1.pid"
}
engine prefill kv_producer "$prefill_gpu" 8100 5600
engine decode kv_consumer "$decode_gpu" 8200 5700
for port in 8100 8200; do
  for _ in $(seq 600); do curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break; sleep 1; done
  curl -fsS "http://127.0.0.1:$port/health" >/dev/null || { say "engine on :$port did not start; see $logs"; exit 1; }
done
say "both engines healthy; stop them with: kill \$(cat $logs/prefill.pid) \$(cat $logs/decode.pid)"
