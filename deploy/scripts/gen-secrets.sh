#!/usr/bin/env bash
# Generates everything secret a kvbridge fleet needs, into deploy/secrets/ (git-ignored):
#   ca.crt, ca.key        a private CA (keep ca.key offline in production)
#   tls.crt, tls.key      Envoy's server certificate, signed by that CA
#   api-keys.json         API keys -> principals (services/kvbridge_services/common/auth.py format)
#   service.env           keys the services present to each other + the hash-chain secret
#   engine.env            the engines' connector key (KVBRIDGE_API_KEY, engine role) + the same secret
#   client.env            a demo tenant key for first requests
# Usage: deploy/scripts/gen-secrets.sh [out dir] [extra DNS SAN ...]
# Existing files are kept (re-run safe); delete a file to rotate it.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$here/secrets}
shift || true
mkdir -p "$out"
chmod 700 "$out"
cd "$out"
umask 077

if [ ! -f ca.key ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 3650 \
    -subj "/CN=kvbridge-ca" -keyout ca.key -out ca.crt 2>/dev/null
fi
if [ ! -f tls.key ]; then
  sans="DNS:localhost,DNS:envoy,DNS:envoy.kvbridge.svc,DNS:envoy.kvbridge.svc.cluster.local,IP:127.0.0.1"
  for name in "$@"; do sans="$sans,DNS:$name"; done
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -subj "/CN=kvbridge-ingress" -keyout tls.key -out tls.csr 2>/dev/null
  printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\n' "$sans" > tls.ext
  openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 825 \
    -extfile tls.ext -out tls.crt 2>/dev/null
  rm -f tls.csr tls.ext ca.srl
fi

key() { echo "kvb_$(openssl rand -hex 24)"; }
if [ ! -f api-keys.json ]; then
  gateway=$(key) registry=$(key) connector=$(key) operator=$(key) demo=$(key)
  cat > api-keys.json <<JSON
{
  "$gateway": {"name": "gateway", "role": "gateway"},
  "$registry": {"name": "registry", "role": "operator"},
  "$connector": {"name": "connector", "role": "engine"},
  "$operator": {"name": "operator", "role": "operator"},
  "$demo": {"name": "demo-client", "role": "tenant", "tenant": "demo"}
}
JSON
  cat > service.env <<ENV
KVBRIDGE_GATEWAY_CONTROL_API_KEY=$gateway
KVBRIDGE_REGISTRY_LEASE_SERVICE_API_KEY=$registry
KVBRIDGE_CONNECTOR_API_KEY=$connector
KVBRIDGE_HASH_SECRET=$(openssl rand -hex 32)
ENV
  printf 'KVBRIDGE_OPERATOR_API_KEY=%s\nKVBRIDGE_DEMO_API_KEY=%s\n' "$operator" "$demo" > client.env
fi
# The engines' connector: its key (engine role) under the connector's setting name, and the same secret.
if [ ! -f engine.env ]; then
  {
    grep '^KVBRIDGE_CONNECTOR_API_KEY=' service.env | sed 's/^KVBRIDGE_CONNECTOR_API_KEY=/KVBRIDGE_API_KEY=/'
    grep '^KVBRIDGE_HASH_SECRET=' service.env
  } > engine.env
fi
# Containers run as non-root and must read the mounted files.
chmod 644 ca.crt tls.crt tls.key api-keys.json service.env engine.env
echo "secrets in $out"
