"""inferencecache against a real kube-apiserver and etcd on loopback (e2e/kubeapi.py):
the CRDs, their defaults and validation, the manifests, `serve --kubernetes` as
the RBAC ServiceAccount, status, the Lease and failover, the webhook, and the
Helm chart. No kubelet: pods never run, so routing to engines is covered by the
other e2e tests, not here."""

import base64
import copy
import json
import pathlib
import signal
import subprocess
import time
from datetime import datetime

import pytest
import requests
import yaml

from conftest import REPO, envoy_binary, free_port, sidecar_binary, wait_until
from kubeapi import ControlPlane, CuttableProxy, build_binaries, make_cert

SYSTEM_NS = "inferencecache-system"
LEASE = "inferencecache-status"
GROUP = "inferencecache.io"
KINDS = ("cachepolicies", "cachetenants", "cachebackends", "prompttemplates", "pdtopologies",
         "cacheindexes")


@pytest.fixture(scope="module")
def kube():
    plane = ControlPlane(build_binaries())
    yield plane
    plane.close()


def docs(path: pathlib.Path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def apply(kube, text: str, *extra, check=True):
    return kube.kubectl("apply", "--server-side", "--validate=strict", "-f", "-",
                        *extra, stdin=text, check=check)


def get(kube, *args):
    return json.loads(kube.kubectl("get", *args, "-o", "json").stdout)


def crds_installed(kube):
    kube.kubectl("apply", "--server-side", "-f", str(REPO / "manifests" / "crds"))
    for kind in KINDS:
        kube.kubectl("wait", "--for=condition=Established", f"crd/{kind}.{GROUP}", "--timeout=60s")


def crd_schema(kind: str) -> dict:
    for d in docs(REPO / "manifests" / "crds" / "inferencecache.io.yaml"):
        if d["spec"]["names"]["plural"] == kind:
            return d["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    raise AssertionError(f"no CRD for {kind}")


# --- the CRDs ---------------------------------------------------------------------


def test_the_apiserver_and_kubectl_are_the_pinned_release(kube):
    versions = json.loads(kube.kubectl("version", "-o", "json").stdout)
    assert versions["serverVersion"]["gitVersion"] == "v1.36.3", versions
    assert versions["clientVersion"]["gitVersion"] == "v1.36.3", versions


def test_the_crds_establish_and_equal_the_generated_output(kube):
    generated = subprocess.run([sidecar_binary(), "crds"], capture_output=True, text=True,
                               timeout=60, check=True).stdout
    assert generated == (REPO / "manifests" / "crds" / "inferencecache.io.yaml").read_text(), \
        "manifests/crds/ is out of date: cargo run -- crds > manifests/crds/inferencecache.io.yaml"
    crds_installed(kube)
    for kind in KINDS:
        crd = get(kube, f"crd/{kind}.{GROUP}")
        conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
        assert conditions.get("Established") == "True", crd["status"]
        assert conditions.get("NonStructuralSchema") is None, crd["status"]


def missing_defaults(schema: dict, value, path="") -> list:
    """Every schema default that should have materialized in `value` but did not."""
    out = []
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            here = f"{path}.{key}"
            if key in value:
                out += missing_defaults(sub, value[key], here)
            elif "default" in sub:
                out.append(here)
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            out += missing_defaults(schema["items"], item, f"{path}[{i}]")
    return out


def test_samples_come_back_with_every_default(kube):
    crds_installed(kube)
    samples = REPO / "manifests" / "samples"
    kube.kubectl("apply", "--server-side", "-f", str(samples / "namespace.yaml"))
    for f in sorted(samples.glob("*.yaml")):
        if f.name == "namespace.yaml":
            continue
        for d in docs(f):
            apply(kube, yaml.safe_dump(d))
            plural = {"CachePolicy": "cachepolicies", "CacheTenant": "cachetenants",
                      "CacheBackend": "cachebackends", "PromptTemplate": "prompttemplates",
                      "PDTopology": "pdtopologies", "CacheIndex": "cacheindexes"}[d["kind"]]
            ns = ["-n", d["metadata"]["namespace"]] if "namespace" in d["metadata"] else []
            stored = get(kube, f"{plural}.{GROUP}/{d['metadata']['name']}", *ns)
            schema = crd_schema(plural)
            assert missing_defaults(schema["properties"]["spec"], stored.get("spec", {}), "spec") == []
    policy = get(kube, f"cachepolicies.{GROUP}", "-n", "team-a")["items"][0]["spec"]
    # The documented defaults (docs/kubernetes.md), as the apiserver stores them.
    assert policy["minimumMatchedTokens"] == 64
    assert policy["routingFloorScore"] == "0.1"
    assert policy["affinityRouting"] == "Enabled"
    assert policy["eviction"] == "LRU"
    assert policy["evictionTTL"] == "10m"


def refusal(kube, doc: dict) -> str:
    out = apply(kube, yaml.safe_dump(doc), check=False)
    assert out.returncode != 0, f"admitted: {doc}"
    return out.stderr


def team_a(kind, name, spec):
    return {"apiVersion": f"{GROUP}/v1alpha1", "kind": kind,
            "metadata": {"name": name, "namespace": "team-a"}, "spec": spec}


# What users read when the apiserver refuses an object (schema and CEL run before
# any webhook); docs/kubernetes.md quotes these.
REFUSALS = [
    (team_a("CachePolicy", "bad-chain", {"strategy": {"requireChain": True,
                                                      "enableChainMatching": False}}),
     ["spec.strategy.requireChain: Invalid value: strategy.requireChain: true needs "
      "strategy.enableChainMatching: true"]),
    (team_a("CacheTenant", "bad-probe", {"tenantID": "inferencecache.io/probe"}),
     ['spec.tenantID: Invalid value: "inferencecache.io/probe": tenantID inferencecache.io/probe '
      "is reserved for the server's self-test"]),
    (team_a("CacheTenant", "bad-empty", {"tenantID": ""}),
     ["spec.tenantID", "tenantID must be non-empty"]),
    (team_a("CacheTenant", "bad-mode", {"tenantID": "t", "isolationMode": "Strict"}),
     ['spec.isolationMode: Unsupported value: "Strict": supported values: "Fairness"\n']),
    (team_a("CachePolicy", "bad-eviction", {"eviction": "FIFO"}),
     ["spec.eviction", 'supported values: "LRU"']),
    (team_a("CachePolicy", "bad-ttl", {"evictionTTL": "ten minutes"}),
     ["spec.evictionTTL", "should match"]),
    (team_a("CacheBackend", "bad-pool", {"engine": "vLLM", "modelID": "m", "hashScheme": "vllm",
                                         "blockSize": 16, "inferencePoolRef": {"name": "p"},
                                         "targetPort": 8000}),
     ["spec.inferencePoolRef: Invalid value: inferencePoolRef excludes selector, targetPort and "
      "endpoints (the pool is the replica set)"]),
    (team_a("PDTopology", "bad-acc", {"acceleratorTypes": [{"name": "h100"}],
                                      "decodePools": [{"name": "d", "acceleratorType": "mi300"}]}),
     ["every decodePools[].acceleratorType must name a declared acceleratorTypes[].name"]),
]


@pytest.mark.parametrize("doc,words", REFUSALS, ids=[d["metadata"]["name"] for d, _ in REFUSALS])
def test_invalid_objects_are_refused_with_the_documented_messages(kube, doc, words):
    crds_installed(kube)
    kube.kubectl("apply", "--server-side", "-f", str(REPO / "manifests" / "samples" / "namespace.yaml"))
    text = refusal(kube, doc)
    for w in words:
        assert w in text, text
    assert '"null"' not in text, text


def example(schema: dict, path: str):
    """A value for every field of `schema`: its default, its first enum member, or
    a value of its type; strings are all the same word, so a reference between
    two fields (acceleratorType → acceleratorTypes[].name) holds."""
    if "default" in schema:
        return copy.deepcopy(schema["default"])
    if "enum" in schema:
        return next(v for v in schema["enum"] if v is not None)
    t = schema.get("type")
    if schema.get("x-kubernetes-preserve-unknown-fields") and t == "object" and not schema.get("properties"):
        return {"kept": {"as": ["given"]}}
    if t == "object":
        props = schema.get("properties") or {}
        if not props and isinstance(schema.get("additionalProperties"), dict):
            return {"k8s.io/key": example(schema["additionalProperties"], path + ".*")}
        return {k: example(v, f"{path}.{k}") for k, v in props.items()}
    if t == "array":
        return [example(schema["items"], path + "[]")]
    if t == "integer":
        return max(int(schema.get("minimum", 1)), 1)
    if t == "number":
        return 1.5
    if t == "boolean":
        return True
    if t == "string":
        return "word"
    if schema.get("x-kubernetes-int-or-string"):
        return 1
    raise AssertionError(f"no example for {path}: {schema}")


def contains(stored, applied, path="") -> list:
    """Where `stored` lost or changed something of `applied`."""
    if isinstance(applied, dict):
        if not isinstance(stored, dict):
            return [path]
        return [p for k, v in applied.items() for p in contains(stored.get(k), v, f"{path}.{k}")]
    if isinstance(applied, list):
        if not isinstance(stored, list) or len(stored) != len(applied):
            return [path]
        return [p for i, (s, a) in enumerate(zip(stored, applied)) for p in contains(s, a, f"{path}[{i}]")]
    return [] if stored == applied else [f"{path}: {applied!r} came back as {stored!r}"]


def full_specs():
    """One object per kind with every spec field set (CacheBackend twice: its
    inferencePoolRef excludes the selector, the targetPort and the endpoints)."""
    out = []
    for plural, kind in (("cachepolicies", "CachePolicy"), ("cachetenants", "CacheTenant"),
                         ("cachebackends", "CacheBackend"), ("prompttemplates", "PromptTemplate"),
                         ("pdtopologies", "PDTopology")):
        spec = example(crd_schema(plural)["properties"]["spec"], "spec")
        if kind == "CacheTenant":
            spec["tenantID"] = "full-tenant"
        if kind == "CacheBackend":
            pooled = {k: v for k, v in spec.items() if k not in ("selector", "targetPort", "endpoints")}
            out.append(team_a(kind, "full-pooled", pooled))
            spec.pop("inferencePoolRef")
        out.append(team_a(kind, f"full-{plural}", spec))
    return out


def test_every_spec_field_round_trips_under_a_strict_apply(kube):
    crds_installed(kube)
    kube.kubectl("apply", "--server-side", "-f", str(REPO / "manifests" / "samples" / "namespace.yaml"))
    for doc in full_specs():
        apply(kube, yaml.safe_dump(doc))
        plural = doc["kind"].lower() + ("es" if doc["kind"].endswith("x") else "s")
        plural = {"cachepolicys": "cachepolicies", "pdtopologys": "pdtopologies"}.get(plural, plural)
        stored = get(kube, f"{plural}.{GROUP}/{doc['metadata']['name']}", "-n", "team-a")
        assert contains(stored["spec"], doc["spec"], "spec") == [], (doc, stored["spec"])
        # An unknown field is an error under Strict, not silently dropped.
        typo = copy.deepcopy(doc)
        typo["spec"]["unknownFieldTypo"] = 1
        assert "unknownFieldTypo" in refusal(kube, typo)


def test_every_manifest_passes_a_server_side_dry_run(kube):
    crds_installed(kube)
    m = REPO / "manifests"
    # Namespaced objects need their namespace to exist, even in a dry run.
    kube.kubectl("apply", "--server-side", "-f", str(m / "namespace.yaml"),
                 "-f", str(m / "samples" / "namespace.yaml"))
    files = sorted(p for p in m.rglob("*.yaml") if "crds" not in p.parts)
    assert len(files) >= 10, files
    for f in files:
        out = kube.kubectl("apply", "--dry-run=server", "--server-side", "--validate=strict",
                           "-f", str(f), check=False)
        assert out.returncode == 0, f"{f.relative_to(REPO)}:\n{out.stderr}"


# --- serve --kubernetes ----------------------------------------------------------


class Replica:
    """`serve --kubernetes` as the ServiceAccount of manifests/rbac.yaml."""

    def __init__(self, kube, identity, server=None, lease_duration="15s"):
        self.identity = identity
        self.token = kube.kubectl("create", "token", "inferencecache", "-n", SYSTEM_NS,
                                  "--duration=1h").stdout.strip()
        self.kubeconfig = kube.write_kubeconfig(f"{identity}.kubeconfig", server or kube.url, self.token)
        self.admin_port = free_port()
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        self.log_path = kube.dir / f"{identity}.log"
        self.log = open(self.log_path, "w")
        env = kube.env(self.kubeconfig)
        env["POD_NAMESPACE"] = SYSTEM_NS
        env["RUST_LOG"] = "info"
        self.proc = subprocess.Popen(
            [sidecar_binary(), "serve", "--kubernetes", "--lease-identity", identity,
             "--lease-duration", lease_duration,
             "--grpc-addr", f"127.0.0.1:{free_port()}", "--ingest-addr", f"127.0.0.1:{free_port()}",
             "--admin-addr", f"127.0.0.1:{self.admin_port}", "--drain-timeout", "2s"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        wait_until(self._ready, timeout=30, what=f"{identity} /readyz")

    def _ready(self):
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.identity} exited:\n{self.log_path.read_text()[-3000:]}")
        try:
            return requests.get(f"{self.admin}/readyz", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def policy(self):
        return requests.get(f"{self.admin}/policy", timeout=5).json()

    def jti(self) -> str:
        payload = self.token.split(".")[1]
        return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))["jti"]

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture
def cluster(kube):
    """CRDs, namespaces, RBAC and the samples applied; replicas stopped after."""
    crds_installed(kube)
    m = REPO / "manifests"
    kube.kubectl("apply", "--server-side", "-f", str(m / "namespace.yaml"), "-f", str(m / "rbac.yaml"),
                 "-f", str(m / "samples" / "namespace.yaml"))
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(m / "samples"))
    kube.kubectl("delete", "lease", LEASE, "-n", SYSTEM_NS, "--ignore-not-found")
    started = []

    def replica(identity, **kw):
        r = Replica(kube, identity, **kw)
        started.append(r)
        return r
    yield replica
    for r in started:
        r.stop()


def holder(kube):
    out = kube.kubectl("get", "lease", LEASE, "-n", SYSTEM_NS, "-o", "json", check=False)
    if out.returncode != 0:
        return None
    return json.loads(out.stdout)["spec"].get("holderIdentity")


def condition(obj, kind):
    for c in obj.get("status", {}).get("conditions", []):
        if c["type"] == kind:
            return c
    return None


def test_serve_follows_edits_fills_status_and_holds_the_lease(kube, cluster):
    a = cluster("replica-a")
    wait_until(lambda: holder(kube) == "replica-a", timeout=10, what="replica-a holds the Lease")
    assert "team-a" in json.dumps(a.policy()), a.policy()

    # An edit reaches the snapshot.
    assert '"minimumMatchedTokens": 96' not in json.dumps(a.policy())
    kube.kubectl("patch", f"cachepolicies.{GROUP}", "-n", "team-a", "default",
                 "--type=merge", "-p", '{"spec": {"minimumMatchedTokens": 96}}')
    wait_until(lambda: '"minimumMatchedTokens": 96' in json.dumps(a.policy()), timeout=10,
               what="the edit in /policy")

    # The status columns: Ready on the policy (other tests may have left younger
    # policies in team-a: the sample is the oldest, so the effective one), Entries
    # on the tenant, the CacheIndex.
    def ready():
        p = get(kube, f"cachepolicies.{GROUP}/default", "-n", "team-a")
        c = condition(p, "Ready")
        return c and c["status"] == "True" and p["status"].get("observedGeneration") == p["metadata"]["generation"]
    wait_until(ready, timeout=15, what="CachePolicy Ready=True at its generation")
    wait_until(lambda: get(kube, f"cachetenants.{GROUP}/team-a", "-n", "team-a")
               .get("status", {}).get("indexEntries") == 0, timeout=15,
               what="CacheTenant status.indexEntries")
    columns = kube.kubectl("get", f"cachetenants.{GROUP}/team-a", "-n", "team-a").stdout.splitlines()
    assert "ENTRIES" in columns[0], columns
    assert columns[1].split()[columns[0].split().index("ENTRIES")] == "0", columns
    index = get(kube, f"cacheindexes.{GROUP}/cluster")
    assert "tenants" in index.get("status", {}), index


def test_two_replicas_fail_over_within_3s_of_a_sigterm(kube, cluster):
    a = cluster("replica-a")
    wait_until(lambda: holder(kube) == "replica-a", timeout=10, what="replica-a holds the Lease")
    b = cluster("replica-b")
    time.sleep(2)
    assert holder(kube) == "replica-a", "a live holder's Lease is not taken"
    started = time.monotonic()
    a.stop(signal.SIGTERM)
    assert "Lease released" in a.log_path.read_text(), a.log_path.read_text()[-2000:]
    wait_until(lambda: holder(kube) == "replica-b", timeout=5,
               what="replica-b holds the Lease")
    assert time.monotonic() - started < 3.0, time.monotonic() - started
    assert b.proc.poll() is None


def status_writes(kube, jti: str, since: float) -> list:
    """Audit events of status writes made with the token `jti` after `since` (epoch s)."""
    out = []
    for line in (kube.dir / "audit.log").read_text().splitlines():
        e = json.loads(line)
        if e.get("stage") != "ResponseComplete" or e.get("objectRef", {}).get("subresource") != "status":
            continue
        if e["verb"] not in ("patch", "update"):
            continue
        ids = e.get("user", {}).get("extra", {}).get("authentication.kubernetes.io/credential-id", [])
        if f"JTI={jti}" not in ids:
            continue
        if e.get("responseStatus", {}).get("code", 0) >= 300:
            continue
        if _epoch(e["stageTimestamp"]) > since:
            out.append(e)
    return out


def _epoch(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def test_a_cut_off_leader_stops_and_the_other_takes_over_within_the_lease_duration(kube, cluster):
    duration = 6
    proxy = CuttableProxy(kube.port)
    try:
        a = cluster("replica-a", server=f"https://127.0.0.1:{proxy.port}", lease_duration=f"{duration}s")
        wait_until(lambda: holder(kube) == "replica-a", timeout=10, what="replica-a holds the Lease")
        b = cluster("replica-b", lease_duration=f"{duration}s")
        # a writes status while it leads (the audit log sees its token).
        wait_until(lambda: status_writes(kube, a.jti(), 0), timeout=15, what="a status write by replica-a")
        cut_at = time.time()
        proxy.cut()
        wait_until(lambda: holder(kube) == "replica-b", timeout=duration + 4,
                   what="replica-b holds the Lease")
        took_over = time.time() - cut_at
        assert took_over <= duration + 2, took_over
        # a stopped on its own clock before b started, the apiserver unreachable.
        wait_until(lambda: "leadership ended locally" in a.log_path.read_text(), timeout=5,
                   what="replica-a ends its leadership locally")
        # Back on the network, a finds b holding the Lease and writes nothing.
        proxy.restore()
        restored = time.time()
        wait_until(lambda: status_writes(kube, b.jti(), restored), timeout=15,
                   what="replica-b writes status")
        time.sleep(3)
        assert status_writes(kube, a.jti(), cut_at) == [], "replica-a wrote status after the cut"
        assert holder(kube) == "replica-b"
    finally:
        proxy.close()


GIE_CRD = """apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: inferencepools.inference.networking.k8s.io
  annotations:
    api-approved.kubernetes.io: "unapproved, a stand-in of the Gateway API Inference Extension's CRD"
spec:
  group: inference.networking.k8s.io
  scope: Namespaced
  names: {plural: inferencepools, singular: inferencepool, kind: InferencePool, listKind: InferencePoolList}
  versions:
  - name: v1
    served: true
    storage: true
    subresources: {status: {}}
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec: {type: object, x-kubernetes-preserve-unknown-fields: true}
          status: {type: object, x-kubernetes-preserve-unknown-fields: true}
"""


def test_an_inference_pool_crd_installed_later_is_picked_up(kube, cluster):
    kube.kubectl("delete", "crd", "inferencepools.inference.networking.k8s.io", "--ignore-not-found",
                 "--wait=true")
    apply(kube, yaml.safe_dump(team_a("CacheBackend", "pooled", {
        "engine": "vLLM", "modelID": "pooled-model", "hashScheme": "vllm", "blockSize": 16,
        "inferencePoolRef": {"name": "llama-pool"}})))
    cluster("replica-a")

    def pool_condition():
        b = get(kube, f"cachebackends.{GROUP}/pooled", "-n", "team-a")
        return condition(b, "InferencePoolResolved")
    wait_until(lambda: pool_condition() is not None, timeout=15, what="InferencePoolResolved")
    c = pool_condition()
    assert c["status"] == "False" and c["reason"] == "Unavailable", c
    assert "is not installed" in c["message"] and "Status {" not in c["message"], c

    apply(kube, GIE_CRD)
    kube.kubectl("wait", "--for=condition=Established", "crd/inferencepools.inference.networking.k8s.io",
                 "--timeout=60s")
    apply(kube, yaml.safe_dump({
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": "llama-pool", "namespace": "team-a"},
        "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}],
                 "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}}))
    wait_until(lambda: pool_condition()["status"] == "True", timeout=45,
               what="the pool resolved once its CRD exists")
    assert pool_condition()["reason"] == "Resolved", pool_condition()


# --- the webhook -----------------------------------------------------------------


def test_the_webhook_reached_by_url_over_tls_denies_what_its_rules_refuse(kube):
    crds_installed(kube)
    kube.kubectl("apply", "--server-side", "-f", str(REPO / "manifests" / "samples" / "namespace.yaml"))
    make_cert(kube.dir, "ca", "webhook", "inferencecache-webhook", "IP:127.0.0.1")
    port = free_port()
    log = open(kube.dir / "webhook.log", "w")
    proc = subprocess.Popen([sidecar_binary(), "webhook", "--addr", f"127.0.0.1:{port}",
                             "--tls-cert", str(kube.dir / "webhook.crt"),
                             "--tls-key", str(kube.dir / "webhook.key")],
                            stdout=log, stderr=subprocess.STDOUT)
    config = docs(REPO / "manifests" / "webhook.yaml")[0]
    hook = config["webhooks"][0]
    hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}/validate",
                            "caBundle": base64.b64encode((kube.dir / "ca.crt").read_bytes()).decode()}
    try:
        wait_until(lambda: requests.get(f"https://127.0.0.1:{port}/healthz",
                                        verify=str(kube.dir / "ca.crt"), timeout=1).ok,
                   timeout=15, what="the webhook's /healthz")
        apply(kube, yaml.safe_dump(config))
        # Rules only the webhook knows (no schema or CEL rule covers them): its
        # words reach the user. "0.5" matches the schema's decimal pattern.
        bad_factor = team_a("CachePolicy", "hook-factor", {"loadBalancing": {"factor": "0.5"}})
        text = wait_for_denial(kube, bad_factor)
        assert 'admission webhook "validate.inferencecache.io" denied the request' in text, text
        assert "spec.loadBalancing.factor" in text, text
        wide = team_a("CacheBackend", "hook-ranks", {
            "engine": "vLLM", "modelID": "m", "hashScheme": "vllm", "blockSize": 16,
            "selector": {"matchLabels": {"app": "x"}}, "targetPort": 8000, "dataParallelSize": 8,
            "kvEvents": {"port": 65530, "replayPort": 5558, "topic": ""}})
        text = refusal(kube, wide)
        assert "validate.inferencecache.io" in text and "spec.kvEvents.port" in text, text
        # What CEL refuses is refused by the apiserver first, in the CRD's words.
        text = refusal(kube, REFUSALS[0][0])
        assert "strategy.requireChain: true needs strategy.enableChainMatching: true" in text, text
        assert "validate.inferencecache.io" not in text, text
        # A good object passes through the webhook.
        apply(kube, yaml.safe_dump(team_a("CachePolicy", "hook-good", {"minimumMatchedTokens": 32})))
    finally:
        kube.kubectl("delete", "validatingwebhookconfiguration", config["metadata"]["name"],
                     "--ignore-not-found")
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def wait_for_denial(kube, doc) -> str:
    """The first refusal (a new webhook configuration takes a moment to be used)."""
    deadline = time.monotonic() + 15
    while True:
        out = apply(kube, yaml.safe_dump(doc), check=False)
        if out.returncode != 0:
            return out.stderr
        kube.kubectl("delete", f"{doc['kind'].lower()}.{GROUP}", doc["metadata"]["name"], "-n",
                     doc["metadata"]["namespace"], "--ignore-not-found")
        assert time.monotonic() < deadline, "the webhook never refused"
        time.sleep(0.5)


# --- the Helm chart ----------------------------------------------------------------

CHART = REPO / "charts" / "inferencecache"
FLEET = ["--set", "fleet.enabled=true", "--set", "fleet.nats=nats://nats.nats.svc:4222",
         "--set", "fleet.name=prod", "--set", "fleet.credsSecret=nats-creds",
         "--set", "fleet.tokenSecret=nats-token", "--set", "fleet.tlsCaSecret=nats-ca"]


def test_the_chart_carries_the_generated_crds_and_the_shipped_envoy_configs():
    assert (CHART / "crds" / "inferencecache.io.yaml").read_text() == \
        (REPO / "manifests" / "crds" / "inferencecache.io.yaml").read_text(), \
        "cp manifests/crds/inferencecache.io.yaml charts/inferencecache/crds/"
    for mode in ("override-host", "original-dst"):
        assert (CHART / "files" / f"envoy-{mode}.yaml").read_text() == \
            (REPO / "envoy" / f"{mode}.yaml").read_text(), \
            f"cp envoy/{mode}.yaml charts/inferencecache/files/envoy-{mode}.yaml"


@pytest.mark.parametrize("values", [[], FLEET], ids=["defaults", "fleet"])
def test_helm_lint(kube, values):
    out = kube.helm("lint", str(CHART), "--strict", *values)
    assert "0 chart(s) failed" in out.stdout, out.stdout


def render(kube, *values) -> list:
    out = kube.helm("template", "ic", str(CHART), "--namespace", SYSTEM_NS, *values)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize("values", [[], FLEET, ["--set", "envoy.destinationMode=original-dst",
                                                "--set", "webhook.tls.caBundle=Zm9v"]],
                         ids=["defaults", "fleet", "original-dst"])
def test_the_rendered_chart_passes_a_server_side_dry_run(kube, values):
    crds_installed(kube)
    kube.kubectl("apply", "--server-side", "-f", str(REPO / "manifests" / "namespace.yaml"))
    objects = render(kube, *values)
    kinds = sorted({o["kind"] for o in objects})
    assert {"Deployment", "Service", "ConfigMap", "ValidatingWebhookConfiguration", "ClusterRole",
            "Role"} <= set(kinds), kinds
    out = kube.kubectl("apply", "--dry-run=server", "--server-side", "--validate=strict", "-f", "-",
                       stdin=yaml.safe_dump_all(objects), check=False)
    assert out.returncode == 0, out.stderr
    args = next(c for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "ic"
                for c in o["spec"]["template"]["spec"]["containers"] if c["name"] == "inferencecache")["args"]
    if values is FLEET:
        for flag in ("--fleet-nats=nats://nats.nats.svc:4222", "--fleet-id=$(POD_NAME)",
                     "--fleet-name=prod", "--fleet-nats-creds=/etc/inferencecache/fleet/creds/nats.creds",
                     "--fleet-nats-token-file=/etc/inferencecache/fleet/token/token",
                     "--fleet-nats-tls-ca=/etc/inferencecache/fleet/ca/ca.crt",
                     "--fleet-kv-events=stream", "--fleet-snapshot-interval=30s"):
            assert flag in args, args
    else:
        assert not [a for a in args if a.startswith("--fleet")], args


def test_the_charts_envoy_config_is_the_manifests_one_and_validates(kube, tmp_path):
    rendered = {o["metadata"]["name"]: o for o in render(kube) if o["kind"] == "ConfigMap"}
    chart_envoy = yaml.safe_load(rendered["ic-envoy-config"]["data"]["envoy.yaml"])
    manifest = docs(REPO / "manifests" / "envoy-config.yaml")[0]
    assert chart_envoy == yaml.safe_load(manifest["data"]["envoy.yaml"])
    for values in ([], ["--set", "envoy.destinationMode=original-dst"]):
        config = [o for o in render(kube, *values) if o["kind"] == "ConfigMap"][0]["data"]["envoy.yaml"]
        path = tmp_path / "envoy.yaml"
        path.write_text(config)
        out = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr


def test_the_chart_refuses_values_it_cannot_render(kube):
    for values, words in ((["--set", "fleet.enabled=true"], "fleet.nats"),
                          (["--set", "envoy.destinationMode=direct"], "override-host or original-dst"),
                          (["--set", "webhook.certManager.enabled=true"], "issuerRef.name")):
        out = kube.helm("template", "ic", str(CHART), *values, check=False)
        assert out.returncode != 0 and words in out.stderr, out.stderr
