#!/usr/bin/env bash
# Brings inferencecache up on a local kind cluster with a fake engine, for people
# who have kind, kubectl, docker and openssl. Not run in CI (there is no cluster).
#
#   e2e/kind/up.sh            # create cluster "inferencecache", build, load, apply
#   CLUSTER=foo e2e/kind/up.sh
#   kind delete cluster --name inferencecache    # tear down
#
# Steps: kind cluster → docker build (e2e/kind/Dockerfile) → kind load → CRDs →
# namespaces, RBAC, webhook TLS Secret (a throwaway CA made here with openssl) →
# the fleet's NATS token and NATS (manifests/nats.yaml) → Deployments, Services,
# the ValidatingWebhookConfiguration with that CA → the fake engine and the
# samples in team-a → how to curl.
#
# The router container runs `serve --kubernetes`, which watches the CRDs and the
# backends' pods into its policy.
set -euo pipefail

CLUSTER="${CLUSTER:-inferencecache}"
IMAGE="${IMAGE:-inferencecache:dev}"
ENVOY_IMAGE="${ENVOY_IMAGE:-envoyproxy/envoy:v1.40-latest}"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
NS=inferencecache-system
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

for tool in kind kubectl docker openssl; do
  command -v "$tool" >/dev/null || { echo "up.sh: $tool is required" >&2; exit 1; }
done

if ! kind get clusters | grep -qx "$CLUSTER"; then
  kind create cluster --name "$CLUSTER" --wait 120s
fi
kubectl config use-context "kind-$CLUSTER" >/dev/null

docker build -t "$IMAGE" -f "$ROOT/e2e/kind/Dockerfile" "$ROOT"
docker pull -q "$ENVOY_IMAGE" >/dev/null
kind load docker-image --name "$CLUSTER" "$IMAGE" "$ENVOY_IMAGE"

kubectl apply -f "$ROOT/manifests/crds/"
# shellcheck disable=SC2046 # one argument per CRD
kubectl wait --for=condition=Established --timeout=60s \
  $(kubectl get crd -o name | grep 'inferencecache\.io$')

kubectl apply -f "$ROOT/manifests/namespace.yaml" -f "$ROOT/manifests/rbac.yaml"

# Webhook serving certificate, signed by a CA made for this cluster only.
SVC="inferencecache-webhook.$NS.svc"
openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$WORK/ca.key" 2>/dev/null
openssl req -x509 -new -key "$WORK/ca.key" -subj "/CN=inferencecache webhook CA" -days 365 \
  -out "$WORK/ca.pem" 2>/dev/null
openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$WORK/tls.key" 2>/dev/null
openssl req -new -key "$WORK/tls.key" -subj "/CN=$SVC" -out "$WORK/tls.csr" 2>/dev/null
printf "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\nsubjectAltName=DNS:%s,DNS:%s.cluster.local\n" \
  "$SVC" "$SVC" > "$WORK/ext.cnf"
openssl x509 -req -in "$WORK/tls.csr" -CA "$WORK/ca.pem" -CAkey "$WORK/ca.key" -CAcreateserial \
  -days 365 -extfile "$WORK/ext.cnf" -out "$WORK/tls.crt" 2>/dev/null
kubectl -n "$NS" create secret tls inferencecache-webhook-tls \
  --cert="$WORK/tls.crt" --key="$WORK/tls.key" --dry-run=client -o yaml | kubectl apply -f -
# The ingest listener's bearer token (manifests/deployment.yaml mounts it).
kubectl -n "$NS" create secret generic inferencecache-ingest-tokens \
  --from-literal=tokens="kind:$(openssl rand -hex 24)" --dry-run=client -o yaml | kubectl apply -f -

# The fleet's NATS token, the same in both namespaces (manifests/nats.yaml reads it
# into its config, so it starts with a letter; the sidecars mount it). Kept on a
# second run: the running NATS read it at its start.
FLEET_TOKEN="ic$(openssl rand -hex 24)"
if kubectl -n nats get secret inferencecache-fleet-nats >/dev/null 2>&1; then
  FLEET_TOKEN="$(kubectl -n nats get secret inferencecache-fleet-nats -o jsonpath='{.data.token}' | base64 -d)"
fi
for ns in nats "$NS"; do
  kubectl -n "$ns" create secret generic inferencecache-fleet-nats \
    --from-literal=token="$FLEET_TOKEN" --dry-run=client -o yaml | kubectl apply -f -
done
kubectl apply -f "$ROOT/manifests/nats.yaml"

kubectl apply -f "$ROOT/manifests/envoy-config.yaml" -f "$ROOT/manifests/deployment.yaml" \
  -f "$ROOT/manifests/services.yaml"
kubectl -n "$NS" rollout status deploy/inferencecache-webhook --timeout=180s

CA_BUNDLE="$(base64 < "$WORK/ca.pem" | tr -d '\n')"
sed "s|^  clientConfig:|  clientConfig:\n    caBundle: $CA_BUNDLE|" "$ROOT/manifests/webhook.yaml" \
  | kubectl apply -f -

kubectl apply -f "$ROOT/manifests/samples/namespace.yaml"
kubectl apply -f "$ROOT/e2e/kind/fake-engine.yaml"
kubectl apply -f "$ROOT/manifests/samples/"

echo
echo "The webhook refuses the reserved tenant id:"
kubectl -n team-a create -f - <<'YAML' || true
apiVersion: inferencecache.io/v1alpha1
kind: CacheTenant
metadata: { name: probe, namespace: team-a }
spec: { tenantID: inferencecache.io/probe }
YAML

kubectl -n nats rollout status statefulset/nats --timeout=120s || \
  echo "NATS not ready yet (kind's default StorageClass provisions its volume); the routers route on their own views until it is"
kubectl -n "$NS" rollout status deploy/inferencecache --timeout=120s || \
  echo "router not ready yet (serve --kubernetes needs the CRD watches); see docs/kubernetes.md"

cat <<MSG

Up. Try:
  kubectl -n $NS port-forward svc/inferencecache-gateway 10000:80 &
  curl -s localhost:10000/v1/completions \\
    -H 'x-inferencecache-tenant: team-a' \\
    -H 'x-inferencecache-model: meta-llama/Llama-3.1-8B-Instruct' \\
    -H 'x-inferencecache-hash-scheme: vllm-sha256-cbor' \\
    -H 'x-inferencecache-debug: 1' -d '{"prompt":"hello"}' -i
  kubectl get cachepolicies,cachetenants,cachebackends,cacheindex -A
  kubectl -n $NS port-forward svc/inferencecache-admin 9090 &  curl -s localhost:9090/policy
Tear down: kind delete cluster --name $CLUSTER
MSG
