#!/usr/bin/env bash
# Builds the FileDescriptorSet Envoy's gRPC-JSON transcoder loads (deploy/envoy/kvbridge.pb).
# It holds the gateway API and everything it imports (google/protobuf WKTs included),
# without source info so the file stays small and byte-stable across machines.
# Usage: deploy/envoy/build-descriptor.sh [output path]   (default: deploy/envoy/kvbridge.pb)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$root/deploy/envoy/kvbridge.pb}
buf=${BUF:-$root/.venv/bin/buf}
cd "$root"
"$buf" build \
  --path proto/kvbridge/gateway/v1/gateway.proto \
  --as-file-descriptor-set \
  --exclude-source-info \
  -o "$out"
echo "wrote $out"
