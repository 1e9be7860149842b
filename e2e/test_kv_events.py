"""Engine KV events through real ZMQ sockets: Python publishers in both event
generations (msgspec array_like structs and tagged map structs) → the sidecar's
subscribers → the index (/snapshot, /metrics) and routing decisions through Envoy.

Each replica's publisher binds like an engine with `tcp://*:port` would (PUB for
events, ROUTER for replay), on its own loopback address so every replica has its
own replay port (127.0.0.1 and 127.0.0.2).

Which bytes come from where:
- `Publisher` (below) writes the wire format from the engines' code: PUB
  `[topic, seq, payload]`, and the replay reply in both shapes (`current`: vLLM
  0.33 / SGLang 0.5.23 `[b"", topic, seq, payload]`, end `[b"", b"", 2^64-1, b""]`;
  `older`: vLLM 0.11 / SGLang 0.5.3 `[b"", seq, payload]`, end `[b"", 2^64-1, b""]`),
  with msgspec structs shaped like vLLM's events.
- The `test_real_sglang_*` tests publish with SGLang's own `ZmqEventPublisher` and
  event classes (0.5.23 and 0.5.3, from the PyPI wheels: see engines.py).
- `test_oversized_frame_*` speaks raw ZMTP over a socket.
- `test_data_parallel_*` runs one `Publisher` per rank, bound where vLLM's and
  SGLang's `offset_endpoint_port` put rank r (event and replay port + r);
  `test_cpu_tier_*` offloads as vLLM's connector reports it (GPU `BlockRemoved`,
  then `BlockStored` with `medium` "CPU" and no tokens; SGLang's "CPU_PINNED").
- The `ic-content-v2` tests send vLLM 0.33's `lora_name` / `extra_keys` (shapes
  from its `kv_cache_utils.to_event_extra_keys`: untagged, the adapter name first,
  the salt on block 0 only) and SGLang 0.5.23's own `lora_name` / `cache_salt`; the
  expected chains come from `inferencecache chain` and from `content_chain_v2`
  below, written from docs/hash-schemes.md.
"""

import hashlib
import http.client
import pathlib
import re
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from typing import Optional, Union

import msgspec
import pytest
import requests
import xxhash
import zmq

import engines
from conftest import Envoy, Upstream, free_port, sidecar_binary, wait_until

TENANT, MODEL = "acme", "llama"
BLOCK = 16
END = 0xFFFF_FFFF_FFFF_FFFF


# --- the two event generations, as engines encode them -----------------------

class ArrStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: Optional[int]
    token_ids: list
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = "GPU"
    lora_name: Optional[str] = None
    extra_keys: Optional[list] = None


class ArrRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list
    medium: Optional[str] = "GPU"


class ArrCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class ArrBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Union[ArrStored, ArrRemoved, ArrCleared]]
    data_parallel_rank: Optional[int] = None


class MapStored(msgspec.Struct, tag_field="type", tag="BlockStored", omit_defaults=True):
    block_hashes: list
    parent_block_hash: Optional[int]
    token_ids: list
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = "GPU"
    lora_name: Optional[str] = None
    extra_keys: Optional[list] = None


class MapRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved", omit_defaults=True):
    block_hashes: list
    medium: Optional[str] = "GPU"


class MapCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


class MapBatch(msgspec.Struct):
    ts: float
    events: list[Union[MapStored, MapRemoved, MapCleared]]
    data_parallel_rank: Optional[int] = None


GENERATIONS = {
    "array": (ArrBatch, ArrStored, ArrRemoved, ArrCleared),
    "map": (MapBatch, MapStored, MapRemoved, MapCleared),
}


def content_chain(tokens):
    """ic-content-v1, written from docs/hash-schemes.md."""
    out, parent = [], 0
    for i in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
        data = struct.pack(">Q", parent) + b"".join(struct.pack("<I", t) for t in tokens[i:i + BLOCK])
        parent = int.from_bytes(hashlib.sha256(data).digest()[-8:], "big")
        out.append(parent)
    return out


def _lp(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def content_chain_v2(tokens, lora="", salt=""):
    """ic-content-v2 index keys of a token-only prompt, from docs/hash-schemes.md
    (the client chain when lora and salt are empty)."""
    out, parent = [], None
    for i in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
        data = bytes([parent is not None]) + struct.pack("<Q", parent or 0)
        data += struct.pack("<I", BLOCK) + b"".join(struct.pack("<I", t) for t in tokens[i:i + BLOCK])
        data += struct.pack("<I", 0)
        parent = xxhash.xxh3_64_intdigest(data)
        out.append(parent)
    if not lora and not salt:
        return out
    d = xxhash.xxh3_64_intdigest(_lp(lora.encode()) + _lp(salt.encode())) or 1
    return [xxhash.xxh3_64_intdigest(struct.pack("<QQ", d, c)) for c in out]


class Publisher:
    """An engine's ZmqEventPublisher: PUB [topic, seq, payload] + replay ROUTER."""

    def __init__(self, host: str, generation: str, shape: str = "current", topic: bytes = b"",
                 port: Optional[int] = None):
        self.ctx = zmq.Context.instance()
        self.shape = shape
        self.topic = topic
        self.pub = self.ctx.socket(zmq.PUB)
        if port is None:
            self.port = self.pub.bind_to_random_port(f"tcp://{host}")
        else:  # a data-parallel rank: the port is rank 0's + r
            self.pub.bind(f"tcp://{host}:{port}")
            self.port = port
        self.replay_port = None
        self.router = None
        self.host = host
        self.seq = 0
        self.sent = {}  # seq -> payload (the replay buffer)
        self.cls = GENERATIONS[generation]
        self._stop = threading.Event()
        self._thread = None

    def start_replay(self, port: int):
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://{self.host}:{port}")
        self.replay_port = port
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def _serve_replay(self):
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            ident, _empty, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq in sorted(s for s in list(self.sent) if s >= first):
                self.router.send_multipart(self.reply(ident, self.topic, seq, self.sent[seq]))
            self.router.send_multipart(self.reply(ident, b"", END, b""))

    def reply(self, ident, topic, seq, payload):
        """A replay reply as the engines send it: vLLM 0.33 / SGLang 0.5.23 put the
        topic in (4 frames after the identity), vLLM 0.11 / SGLang 0.5.3 do not."""
        seq = seq.to_bytes(8, "big")
        if self.shape == "current":
            return [ident, b"", topic, seq, payload]
        return [ident, b"", seq, payload]

    def encode(self, events):
        return msgspec.msgpack.encode(self.cls[0](ts=time.time(), events=events))

    def stored(self, hashes, parent, tokens, **kw):
        return self.cls[1](block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                           block_size=BLOCK, **kw)

    def removed(self, hashes, **kw):
        return self.cls[2](block_hashes=hashes, **kw)

    def cleared(self):
        return self.cls[3]()

    def send_raw(self, payload: bytes, seq=None, deliver=True):
        seq = self.seq if seq is None else seq
        self.sent[seq] = payload
        if deliver:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        self.seq = seq + 1

    def send(self, events, seq=None, deliver=True):
        self.send_raw(self.encode(events), seq=seq, deliver=deliver)

    def close(self):
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=2)
        if self.router is not None:
            self.router.close(linger=0)
        self.pub.close(linger=0)


def policy(scheme, upstreams, publishers, replay_port, external=None, policy_spec="",
           backend_spec="", endpoint_spec=None) -> str:
    """The stack's CRDs. `policy_spec` / `backend_spec` add lines to the
    CachePolicy's / CacheBackend's spec, `endpoint_spec` (replica -> lines) to an
    endpoint's (each line without indentation)."""
    eps = []
    for u in upstreams:
        p = publishers.get(u.replica_id)
        line = f"    - id: {u.replica_id}\n      address: {u.address}"
        if p:
            line += f"\n      kvEventsEndpoint: tcp://{p.host}:{p.port}"
        elif external and u.replica_id in external:
            line += f"\n      kvEventsEndpoint: {external[u.replica_id]}"
        for extra in (endpoint_spec or {}).get(u.replica_id, ()):
            line += f"\n      {extra}"
        eps.append(line)
    endpoints = "\n".join(eps)
    policy_spec = "".join(f"\n  {x}" for x in policy_spec.splitlines() if x)
    backend_spec = "".join(f"\n  {x}" for x in backend_spec.splitlines() if x)
    return f"""apiVersion: inferencecache.io/v1alpha1
kind: CacheTenant
metadata: {{name: acme, namespace: team-a}}
spec:
  tenantID: {TENANT}
---
apiVersion: inferencecache.io/v1alpha1
kind: CachePolicy
metadata: {{name: default, namespace: team-a}}
spec:
  affinityRouting: Enabled{policy_spec}
---
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata: {{name: llama, namespace: team-a}}
spec:
  engine: vLLM
  modelID: {MODEL}
  hashScheme: {scheme}
  blockSize: {BLOCK}
  kvEvents: {{replayPort: {replay_port}}}{backend_spec}
  endpoints:
{endpoints}
"""


class KvStack:
    """Three upstreams (a and b publish KV events), the sidecar and Envoy.

    `external` maps further replicas to event endpoints published by something
    else (a real engine's publisher, a hostile peer); `hosts` are the replicas
    with a `Publisher` of ours (none when a real engine binds the replay port)."""

    def __init__(self, scheme="ic-content-v1", generation="array", shape="current",
                 hosts=None, external=None, replay_port=None, endpoint_ranks=None,
                 backend_ranks=None, policy_spec=""):
        """`endpoint_ranks` (replica -> n) declares data-parallel ranks on those
        endpoints (`dataParallelSize`, and their own `kvReplayEndpoint`),
        `backend_ranks` on the backend (`spec.dataParallelSize`, every replica):
        rank r publishes on rank 0's port + r and replays on its replay port + r."""
        self.scheme = scheme
        self.workdir = pathlib.Path(tempfile.mkdtemp(prefix="inferencecache-kv-"))
        self.upstreams = [Upstream(r) for r in ("replica-a", "replica-b", "replica-c")]
        if hosts is None:
            hosts = {"replica-a": "127.0.0.1", "replica-b": "127.0.0.2"}
        endpoint_ranks = endpoint_ranks or {}
        count = {r: backend_ranks or endpoint_ranks.get(r, 1) for r in hosts}
        # A port found free can be taken before our bind (another socket's random
        # or ephemeral port): with ports of our own choosing, choose again.
        for attempt in range(5):
            try:
                endpoint_spec = self._publishers(hosts, generation, shape, count,
                                                 endpoint_ranks, replay_port)
                break
            except zmq.ZMQError as e:
                if e.errno != zmq.EADDRINUSE or replay_port is not None or attempt == 4:
                    raise
        self.pubs = {r: ps[0] for r, ps in self.ranks.items()}
        self.external = external or {}
        self.policy = self.workdir / "policy.yaml"
        self.policy.write_text(policy(
            scheme, self.upstreams, self.pubs, self.replay_port, self.external,
            policy_spec=policy_spec, endpoint_spec=endpoint_spec,
            backend_spec=f"dataParallelSize: {backend_ranks}" if backend_ranks else ""))
        self.proc = None
        # free_port() closes its socket before the sidecar binds, so another process
        # can take the port in between: the first start retries on fresh ports (a
        # restart keeps them: Envoy points at them).
        for attempt in range(3):
            self.grpc_port, self.admin_port = free_port(), free_port()
            self.ingest_port = free_port()
            self.admin = f"http://127.0.0.1:{self.admin_port}"
            self.log = open(self.workdir / "sidecar.log", "w")
            try:
                self.start_sidecar()
                break
            except AssertionError:
                if self.proc.poll() is None:
                    self.proc.kill()
                    self.proc.wait()
                self.log.close()
                log = (self.workdir / "sidecar.log").read_text(errors="replace")
                if attempt == 2 or "ddress already in use" not in log:
                    raise
        self.envoy = Envoy(self.workdir, "override-host.yaml", self, self.upstreams)
        for ps in self.ranks.values():
            for p in ps:
                self.warm_up(p)

    def _publishers(self, hosts, generation, shape, count, endpoint_ranks, replay_port):
        """Binds every replica's publishers (PUB and replay ROUTER, per rank) and
        returns the endpoints' extra spec lines; on a failed bind closes what it
        bound and raises."""
        self.replay_port = replay_port or free_ports(max(count.values(), default=1),
                                                     list(hosts.values()) or ["127.0.0.1"])
        self.ranks = {}  # replica -> its publishers, by rank
        endpoint_spec = {}
        try:
            for r, h in hosts.items():
                if count[r] == 1:
                    self.ranks[r] = [Publisher(h, generation, shape)]
                    replay = self.replay_port
                else:
                    base = free_ports(count[r], [h])
                    self.ranks[r] = [Publisher(h, generation, shape, port=base + i)
                                     for i in range(count[r])]
                    replay = self.replay_port
                    if r in endpoint_ranks:  # the endpoint names its own replay socket
                        replay = free_ports(count[r], [h])
                        endpoint_spec[r] = [f"dataParallelSize: {count[r]}",
                                            f"kvReplayEndpoint: tcp://{h}:{replay}"]
                for i, p in enumerate(self.ranks[r]):
                    p.start_replay(replay + i)
        except zmq.ZMQError:
            for ps in self.ranks.values():
                for p in ps:
                    p.close()
            raise
        return endpoint_spec

    def start_sidecar(self):
        self.proc = subprocess.Popen(
            [sidecar_binary(), "serve", "--config", str(self.policy),
             "--grpc-addr", f"127.0.0.1:{self.grpc_port}",
             "--ingest-addr", f"127.0.0.1:{self.ingest_port}",
             "--admin-addr", f"127.0.0.1:{self.admin_port}", "--policy-poll-ms", "100"],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_until(lambda: requests.get(f"{self.admin}/readyz", timeout=1).status_code == 200,
                   what="sidecar /readyz")

    def stop_sidecar(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=10)

    def snapshot(self):
        return requests.get(f"{self.admin}/snapshot", timeout=2).json()

    def replica(self, replica_id):
        rows = [r for r in self.snapshot()["replicas"] if r["replicaId"] == replica_id]
        assert len(rows) == 1, rows
        return rows[0]

    def metric(self, name, labels="") -> float:
        text = requests.get(f"{self.admin}/metrics", timeout=2).text
        m = re.search(rf"^inferencecache_{name}(?:_total)?{re.escape(labels)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def warm_up(self, pub):
        """PUB drops until the subscription arrives: send empty batches until one lands."""
        def landed():
            before = self.metric("kv_events_batches")
            pub.send([])
            return wait_quiet(lambda: self.metric("kv_events_batches") > before, 0.3)
        wait_until(landed, timeout=15, what="the subscriber to receive")

    def prefix_count(self, replica) -> int:
        snap = requests.get(f"{self.admin}/snapshot", timeout=2).json()
        return sum(r["prefixCount"] for r in snap["replicas"] if r["replicaId"] == replica)

    def route(self, chain, **identity):
        r = self.route_response(chain, **identity)
        return r.headers.get("x-inferencecache-reason"), r.headers.get("x-inferencecache-replica"), r.text

    def route_response(self, chain, lora="", salt=""):
        headers = {
            "x-inferencecache-tenant": TENANT,
            "x-inferencecache-model": MODEL,
            "x-inferencecache-hash-scheme": self.scheme,
            "x-inferencecache-block-hashes": ",".join(f"{x:x}" for x in chain),
            "x-inferencecache-block-token-counts": ",".join(str(BLOCK) for _ in chain),
            "x-inferencecache-debug": "1",
        }
        if lora:
            headers["x-inferencecache-lora-adapter"] = lora
        if salt:
            headers["x-inferencecache-cache-salt"] = salt
        r = self.envoy.get(headers)
        assert r.status_code == 200
        return r

    def wait_count(self, replica, n, what=""):
        wait_until(lambda: self.prefix_count(replica) == n, timeout=5,
                   what=f"{replica} to hold {n} entries {what}")

    def close(self):
        self.envoy.stop()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=10)
        self.log.close()
        for ps in self.ranks.values():
            for p in ps:
                p.close()
        for u in self.upstreams:
            u.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def free_ports(n, hosts) -> int:
    """A port p with p .. p+n-1 free on every one of `hosts` (rank r uses p + r)."""
    for _ in range(200):
        p = free_port()
        if p + n > 65536:
            continue
        held = []
        try:
            for h in hosts:
                for q in range(p, p + n):
                    sock = socket.socket()
                    held.append(sock)
                    sock.bind((h, q))
            return p
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise AssertionError(f"no {n} consecutive free ports on {hosts}")


def wait_quiet(check, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


# Event generation x replay reply shape: the old array events with the old 3-frame
# replies (vLLM 0.11), the map events with the current 4-frame replies (vLLM 0.33).
@pytest.fixture(params=[("array", "older"), ("map", "current")], ids=["array-older", "map-current"])
def stack(request):
    generation, shape = request.param
    s = KvStack(generation=generation, shape=shape)
    yield s
    s.close()


def tokens(start, blocks=6):
    return list(range(start, start + blocks * BLOCK))


def test_stored_blocks_route_to_the_publisher(stack):
    a = stack.pubs["replica-a"]
    toks = tokens(1000)
    # Two events: the second continues from the first's last engine hash.
    a.send([a.stored([11, 12, 13], None, toks[:48]), a.stored([14, 15, 16], 13, toks[48:])])
    stack.wait_count("replica-a", 6)
    reason, replica, served = stack.route(content_chain(toks))
    assert (reason, replica, served) == ("PREFIX_MATCH", "replica-a", "replica-a")
    assert stack.prefix_count("replica-b") == 0


def test_removal_duplicates_and_clear(stack):
    b = stack.pubs["replica-b"]
    toks = tokens(5000)
    chain = content_chain(toks)
    # Stored twice (engines do not deduplicate), removed twice: gone only after the second.
    b.send([b.stored(list(range(1, 7)), None, toks), b.stored(list(range(1, 7)), None, toks)])
    stack.wait_count("replica-b", 6)
    assert stack.route(chain)[:2] == ("PREFIX_MATCH", "replica-b")
    b.send([b.removed([4, 5, 6])])
    time.sleep(0.3)
    assert stack.prefix_count("replica-b") == 6, "still referenced once"
    b.send([b.removed([4, 5, 6])])
    stack.wait_count("replica-b", 3, "after the second removal")
    b.send([b.removed([4, 5, 6])])  # a third removal changes nothing
    b.send([b.cleared()])
    stack.wait_count("replica-b", 0, "after AllBlocksCleared")
    assert stack.route(chain)[0] != "PREFIX_MATCH"
    assert stack.metric("kv_events_resets", '{kind="engine"}') >= 1


def test_restart_clears_the_replica(stack):
    a = stack.pubs["replica-a"]
    a.send([a.stored([1, 2], None, tokens(1, 2))])
    stack.wait_count("replica-a", 2)
    a.seq = 0  # a new engine process starts counting again
    toks = tokens(9000, 3)
    a.send([a.stored([7, 8, 9], None, toks)])
    stack.wait_count("replica-a", 3, "after the restart")
    assert stack.metric("kv_events_resets", '{kind="restart"}') == 1


def test_gap_is_replayed(stack):
    a = stack.pubs["replica-a"]
    toks = tokens(20000)
    a.send([a.stored([31, 32], None, toks[:32])], deliver=False)  # lost on the wire
    a.send([a.stored([33, 34], 32, toks[32:64])], deliver=False)
    a.send([a.stored([35, 36], 34, toks[64:])])
    stack.wait_count("replica-a", 6, "after the replay")
    assert stack.metric("kv_events_gaps") == 1
    assert stack.metric("kv_events_replays", '{kind="ok"}') == 1
    assert stack.route(content_chain(toks))[:2] == ("PREFIX_MATCH", "replica-a")


def test_failed_replay_keeps_the_entries_and_marks_the_replica_stale(stack):
    b = stack.pubs["replica-b"]
    b.send([b.stored(list(range(41, 47)), None, tokens(3000, 6))])
    stack.wait_count("replica-b", 6)
    assert stack.replica("replica-b")["kvEventsStale"] is False
    lost = b.seq
    b.send([b.stored([47], 46, tokens(3096, 1))], deliver=False)
    del b.sent[lost]  # the engine's replay buffer no longer has it
    b.send([b.stored([51], None, tokens(7000, 1))])
    # What we knew stays (6 + the new 1), flagged as possibly stale.
    stack.wait_count("replica-b", 7, "after the failed replay")
    assert stack.metric("kv_events_replays", '{kind="failed"}') == 1
    assert stack.metric("kv_events_resets", '{kind="replay_failed"}') == 0
    assert stack.replica("replica-b")["kvEventsStale"] is True
    assert stack.replica("replica-a")["kvEventsStale"] is False
    assert stack.metric("kv_events_stale_replicas") == 1
    assert stack.route(content_chain(tokens(3000, 6)))[:2] == ("PREFIX_MATCH", "replica-b")
    # AllBlocksCleared makes it exact again.
    b.send([b.cleared()])
    stack.wait_count("replica-b", 0, "after AllBlocksCleared")
    wait_until(lambda: stack.replica("replica-b")["kvEventsStale"] is False, timeout=5,
               what="the stale mark to go")
    assert stack.metric("kv_events_stale_replicas") == 0


def test_warm_start_after_a_sidecar_restart_restores_the_index(stack):
    """The engine keeps publishing while the sidecar is down; the new sidecar
    replays the engine's buffer from seq 0 and ends with the same index."""
    a, b = stack.pubs["replica-a"], stack.pubs["replica-b"]
    a.send([a.stored([1, 2, 3], None, tokens(100, 3))])
    a.send([a.stored([4, 5], 3, tokens(148, 2))])
    b.send([b.stored([7, 8], None, tokens(900, 2)), b.stored([7, 8], None, tokens(900, 2))])
    b.send([b.removed([8])])  # still referenced once
    stack.wait_count("replica-a", 5)
    stack.wait_count("replica-b", 2)
    stack.stop_sidecar()
    # Published while nobody listens: only the replay buffer has them.
    a.send([a.stored([6], 5, tokens(180, 1))])
    b.send([b.removed([7])])
    a.send([a.stored([9], None, tokens(5000, 1))])
    stack.start_sidecar()
    stack.wait_count("replica-a", 7, "after the warm start")
    stack.wait_count("replica-b", 2, "after the warm start")
    before = {r["replicaId"]: r["prefixCount"] for r in stack.snapshot()["replicas"]}
    assert before["replica-a"] == 7 and before["replica-b"] == 2
    assert stack.snapshot()["totalEntries"] == 9
    assert stack.metric("kv_events_warm_starts", '{kind="exact"}') == 2
    assert stack.metric("kv_events_gaps") == 0
    # The rebuilt index routes, and removals of replayed stores still apply:
    # b's remaining reference to 8 goes with one more removal.
    assert stack.route(content_chain(tokens(100, 6)))[:2] == ("PREFIX_MATCH", "replica-a")
    b.send([b.removed([8])])
    stack.wait_count("replica-b", 1, "after removing 8 once more")
    # Live batches keep following, nothing applied twice.
    a.send([a.stored([10], 9, tokens(5016, 1))])
    stack.wait_count("replica-a", 8)
    assert stack.replica("replica-a")["kvEventsStale"] is False


def test_warm_start_of_10000_buffered_batches(stack):
    a = stack.pubs["replica-a"]
    payloads = []
    for i in range(10_000):
        payloads.append(a.encode([a.stored([100_000 + i], None, tokens(1_000_000 + i * 16, 1))]))
    stack.stop_sidecar()
    for p in payloads:
        a.send_raw(p, deliver=False)
    start = time.monotonic()
    stack.start_sidecar()
    ready = time.monotonic()
    wait_until(lambda: stack.prefix_count("replica-a") >= 10_000, timeout=60,
               what="10,000 buffered batches to be applied")
    done = time.monotonic()
    print(f"warm start of 10,000 buffered batches: {done - ready:.2f} s after /readyz "
          f"({done - start:.2f} s from process start)")
    assert stack.prefix_count("replica-a") == 10_000
    assert stack.metric("kv_events_warm_starts", '{kind="exact"}') >= 1
    assert stack.metric("kv_events_gaps") == 0


def test_garbage_is_counted_never_applied(stack):
    a = stack.pubs["replica-a"]
    a.send_raw(b"\xc1 definitely not msgpack")
    a.send_raw(msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1, 2], 0]], None]))
    a.send_raw(msgspec.msgpack.encode({"ts": 1.0}))
    a.pub.send_multipart([b"", b"short"])  # not [topic, seq, payload]
    a.pub.send_multipart([b"", b"\x00" * 7, b"x"])
    wait_until(lambda: stack.metric("kv_events_decode_errors", '{kind="payload"}') == 3
               and stack.metric("kv_events_decode_errors", '{kind="frame"}') == 2,
               timeout=5, what="decode errors counted")
    assert stack.prefix_count("replica-a") == 0
    # Still alive and applying.
    toks = tokens(40000)
    a.send([a.stored(list(range(60, 66)), None, toks)])
    stack.wait_count("replica-a", 6)
    assert stack.proc.poll() is None


def test_removed_replica_stops_its_subscriber(stack):
    a = stack.pubs["replica-a"]
    a.send([a.stored([1, 2], None, tokens(1, 2))])
    stack.wait_count("replica-a", 2)
    assert stack.metric("kv_events_subscribers") == 2
    others = [u for u in stack.upstreams if u.replica_id != "replica-a"]
    text = policy(stack.scheme, others, stack.pubs, stack.pubs["replica-b"].replay_port)
    stack.policy.write_text(text)
    wait_until(lambda: stack.metric("kv_events_subscribers") == 1, timeout=5,
               what="replica-a's subscriber to stop")
    stack.wait_count("replica-a", 0, "once no longer declared")
    a.send([a.stored([3], None, tokens(99, 1))])
    time.sleep(0.3)
    assert stack.prefix_count("replica-a") == 0


def run_chain(scheme, toks, seed=None, *extra):
    args = [sidecar_binary(), "chain", "--scheme", scheme, "--block-size", str(BLOCK)]
    if seed is not None:
        args += ["--hash-seed", seed]
    args += list(extra)
    out = subprocess.run(args, input=" ".join(map(str, toks)), capture_output=True,
                         text=True, check=True).stdout.strip()
    return [int(x, 16) for x in out.split(",")]


@pytest.mark.parametrize("scheme", ["ic-content-v1", "vllm-sha256-cbor"])
def test_end_to_end_with_inferencecache_chain(scheme):
    """publisher → sidecar → Envoy request carrying `inferencecache chain` output."""
    s = KvStack(scheme=scheme, generation="map")
    try:
        b = s.pubs["replica-b"]
        toks = tokens(70000, 8)
        if scheme == "vllm-sha256-cbor":
            # The engine (PYTHONHASHSEED=0) publishes its sha256_cbor values.
            engine = run_chain(scheme, toks, seed="0")
        else:
            engine = [0xE000 + i for i in range(8)]  # whatever the engine's own hashes are
        b.send([b.stored(engine, None, toks)])
        s.wait_count("replica-b", 8)
        chain = run_chain(scheme, toks, seed="0" if scheme != "ic-content-v1" else None)
        assert chain == content_chain(toks) or scheme != "ic-content-v1"
        reason, replica, served = s.route(chain)
        assert (reason, replica, served) == ("PREFIX_MATCH", "replica-b", "replica-b")
    finally:
        s.close()


@pytest.mark.parametrize("generation", ["array", "map"])
def test_lora_and_salt_blocks_match_only_requests_with_the_same_identity(generation):
    """ic-content-v2: replica-a holds a prompt under LoRA adapter "sql" with cache
    salt "t7" (vLLM 0.33's events: lora_name on each, extra_keys per block with the
    salt on block 0 only, the second event continuing the first), replica-b the
    same tokens without either. Each request matches only its own identity's
    blocks; `inferencecache chain` and the documented algorithm agree."""
    s = KvStack(scheme="ic-content-v2", generation=generation)
    try:
        a, b = s.pubs["replica-a"], s.pubs["replica-b"]
        toks = tokens(90_000, 8)
        keys = [["sql", "t7"]] + [["sql"]] * 3
        a.send([a.stored([1, 2, 3, 4], None, toks[:64], lora_id=1, lora_name="sql",
                         extra_keys=keys),
                a.stored([5, 6, 7, 8], 4, toks[64:], lora_id=1, lora_name="sql",
                         extra_keys=[["sql"]] * 4)])
        b.send([b.stored([21, 22, 23, 24, 25, 26, 27, 28], None, toks)])
        s.wait_count("replica-a", 8)
        s.wait_count("replica-b", 8)

        chain = run_chain("ic-content-v2", toks)
        assert chain == content_chain_v2(toks)
        assert run_chain("ic-content-v2", toks, None, "--lora-adapter", "sql", "--cache-salt",
                         "t7", "--index-keys") == content_chain_v2(toks, "sql", "t7")
        r = s.route_response(chain, lora="sql", salt="t7")
        assert (r.headers["x-inferencecache-reason"], r.headers["x-inferencecache-replica"],
                r.headers["x-inferencecache-matched-tokens"]) == ("PREFIX_MATCH", "replica-a", "128")
        r = s.route_response(chain)
        assert (r.headers["x-inferencecache-reason"], r.headers["x-inferencecache-replica"],
                r.headers["x-inferencecache-matched-tokens"]) == ("PREFIX_MATCH", "replica-b", "128")
        # The adapter without the salt, the salt without the adapter, another
        # adapter: no replica holds those blocks.
        for identity in ({"lora": "sql"}, {"salt": "t7"}, {"lora": "chat", "salt": "t7"}):
            assert s.route(chain, **identity)[0] != "PREFIX_MATCH", identity
        # A repeated identity header is malformed: NO_HINT, and the echo says why.
        headers = {
            "x-inferencecache-tenant": TENANT, "x-inferencecache-model": MODEL,
            "x-inferencecache-hash-scheme": "ic-content-v2",
            "x-inferencecache-block-hashes": ",".join(f"{x:x}" for x in chain),
            "x-inferencecache-block-token-counts": ",".join(str(BLOCK) for _ in chain),
            "x-inferencecache-debug": "1",
        }
        conn = http.client.HTTPConnection(s.envoy.url.split("//")[1], timeout=5)
        conn.putrequest("GET", "/v1/completions")
        for k, v in list(headers.items()) + [("x-inferencecache-cache-salt", "t7"),
                                             ("x-inferencecache-cache-salt", "t8")]:
            conn.putheader(k, v)
        conn.endheaders()
        r = conn.getresponse()
        r.read()
        conn.close()
        assert r.getheader("x-inferencecache-reason") == "NO_HINT"
        assert "x-inferencecache-cache-salt appears more than once" in \
            r.getheader("x-inferencecache-detail")
    finally:
        s.close()


# --- data-parallel ranks and memory tiers ------------------------------------

def decision(s, chain):
    """(reason, replica, score, matched tokens) of the debug echo."""
    r = s.route_response(chain)
    h = r.headers
    assert h.get("x-served-by") == h.get("x-inferencecache-replica") or \
        h.get("x-inferencecache-reason") != "PREFIX_MATCH", dict(h)
    return (h.get("x-inferencecache-reason"), h.get("x-inferencecache-replica"),
            h.get("x-inferencecache-score"), h.get("x-inferencecache-matched-tokens"))


@pytest.mark.parametrize("level", ["endpoint", "backend"])
def test_data_parallel_ranks_feed_one_replica(level):
    """`dataParallelSize: 2` on replica-a's endpoint (with its own
    `kvReplayEndpoint`) or on the backend (every replica, `kvEvents.replayPort`):
    rank 0 publishes on the event port, rank 1 on port + 1 and replays on the
    replay port + 1. Blocks either rank stores route to replica-a; a block both
    ranks hold counts once; rank 1's AllBlocksCleared leaves rank 0's blocks; rank
    1's gap and a sidecar restart are replayed from rank 1's own replay socket."""
    if level == "endpoint":
        s = KvStack(generation="map", endpoint_ranks={"replica-a": 2})
    else:
        s = KvStack(generation="map", backend_ranks=2)
    try:
        a0, a1 = s.ranks["replica-a"]
        assert a1.port == a0.port + 1 and a1.replay_port == a0.replay_port + 1
        assert s.metric("kv_events_subscribers") == (3 if level == "endpoint" else 4)
        assert s.metric("kv_events_warm_starts", '{kind="exact"}') == \
            s.metric("kv_events_subscribers"), "every rank warm-started from its replay port"
        t1, t0, shared = tokens(200_000), tokens(210_000), tokens(220_000)
        a1.send([a1.stored(list(range(1, 7)), None, t1)])
        s.wait_count("replica-a", 6, "from rank 1")
        assert decision(s, content_chain(t1))[:2] == ("PREFIX_MATCH", "replica-a")
        a0.send([a0.stored(list(range(11, 17)), None, t0)])
        s.wait_count("replica-a", 12, "from both ranks")
        assert decision(s, content_chain(t0))[:2] == ("PREFIX_MATCH", "replica-a")
        # The same prompt on both ranks (the same engine hashes): one entry each
        # block (rank 1's extra block shows its batch was applied).
        a0.send([a0.stored(list(range(21, 27)), None, shared)])
        s.wait_count("replica-a", 18)
        a1.send([a1.stored(list(range(21, 27)), None, shared),
                 a1.stored([27], None, tokens(225_000, 1))])
        s.wait_count("replica-a", 19, "a block two ranks hold counts once")
        assert s.prefix_count("replica-b") == 0

        # Rank 1 clears: its own blocks go, rank 0's (and the shared ones) stay.
        a1.send([a1.cleared()])
        s.wait_count("replica-a", 12, "after rank 1's AllBlocksCleared")
        assert decision(s, content_chain(t1))[0] != "PREFIX_MATCH"
        assert decision(s, content_chain(t0))[:2] == ("PREFIX_MATCH", "replica-a")
        r = decision(s, content_chain(shared))
        assert (r[0], r[1], r[3]) == ("PREFIX_MATCH", "replica-a", "96")
        assert s.replica("replica-a")["prefixCount"] == 12

        # Rank 1 loses a batch on the wire: replayed from replay port + 1.
        t2 = tokens(230_000)
        a1.send([a1.stored([31, 32, 33], None, t2[:48])], deliver=False)
        a1.send([a1.stored([34, 35, 36], 33, t2[48:])])
        s.wait_count("replica-a", 18, "after rank 1's gap replay")
        assert s.metric("kv_events_gaps") == 1
        assert s.metric("kv_events_replays", '{kind="ok"}') == 1
        assert decision(s, content_chain(t2))[:2] == ("PREFIX_MATCH", "replica-a")

        # The sidecar restarts while rank 1 keeps publishing: each rank's warm start
        # reads its own buffer, and the index is what it was plus rank 1's batch.
        before = s.snapshot()
        s.stop_sidecar()
        t3 = tokens(240_000)
        a1.send([a1.stored(list(range(41, 47)), None, t3)])
        s.start_sidecar()
        s.wait_count("replica-a", 24, "after the warm start of both ranks")
        after = s.snapshot()
        assert after["totalEntries"] == before["totalEntries"] + 6
        assert decision(s, content_chain(t3))[:2] == ("PREFIX_MATCH", "replica-a")
        assert decision(s, content_chain(t0))[:2] == ("PREFIX_MATCH", "replica-a")
        assert s.replica("replica-a")["kvEventsStale"] is False
    finally:
        s.close()


def offload(pub, hashes, medium="CPU"):
    """vLLM's offload of GPU blocks: BlockRemoved on GPU, then BlockStored on the
    lower medium with no tokens (SGLang names host memory "CPU_PINNED")."""
    return [pub.removed(hashes), pub.stored(hashes, None, [], medium=medium)]


def test_cpu_tier_blocks_count_with_the_policy_weight():
    """Blocks offloaded to CPU (vLLM's `medium: "CPU"`, SGLang's "CPU_PINNED")
    are a match at the policy's `tierWeights.cpu`: a CPU-only prefix on replica-a
    loses to the same prefix on replica-b's GPU, and wins when no replica has it
    on GPU; the weight comes from the CachePolicy ("0" ignores the tier)."""
    s = KvStack(generation="map", policy_spec='tierWeights: {cpu: "0.8"}')
    try:
        a, b = s.pubs["replica-a"], s.pubs["replica-b"]
        p, q = tokens(300_000), tokens(310_000)
        a.send([a.stored(list(range(1, 7)), None, p)] + offload(a, list(range(1, 7))))
        a.send([a.stored(list(range(11, 17)), None, q)]
               + offload(a, list(range(11, 17)), medium="CPU_PINNED"))
        wait_until(lambda: decision(s, content_chain(q))[0] == "PREFIX_MATCH", timeout=5,
                   what="the CPU blocks to be applied")
        # Lower tiers do not count in prefixCount.
        assert s.prefix_count("replica-a") == 0
        # CPU-only on a, nothing elsewhere: a, at 0.8 of a GPU match. 3 replicas,
        # one holder: d = 2/3 per block; 6 blocks x 2/3 x 0.8 = 3.2 (GPU: 4.0).
        assert decision(s, content_chain(p)) == ("PREFIX_MATCH", "replica-a", "3.2000", "96")
        assert decision(s, content_chain(q)) == ("PREFIX_MATCH", "replica-a", "3.2000", "96")
        # The same prefix on b's GPU: b wins (two holders: 6 x 1/3 = 2.0 against
        # a's 1.6).
        b.send([b.stored(list(range(101, 107)), None, p)])
        s.wait_count("replica-b", 6)
        assert decision(s, content_chain(p)) == ("PREFIX_MATCH", "replica-b", "2.0000", "96")
        # A run continues from GPU into CPU: a holds r's first 3 blocks on GPU and
        # the last 3 on CPU: (3 + 3 x 0.8) x 2/3 = 3.6, all 96 tokens matched.
        r = tokens(320_000)
        a.send([a.stored(list(range(31, 37)), None, r)] + offload(a, list(range(34, 37))))
        s.wait_count("replica-a", 3, "r's GPU blocks")
        assert decision(s, content_chain(r)) == ("PREFIX_MATCH", "replica-a", "3.6000", "96")
        # Evicted from CPU: a's q is gone, p stays on b.
        a.send([a.removed(list(range(11, 17)), medium="CPU_PINNED")])
        wait_until(lambda: decision(s, content_chain(q))[0] != "PREFIX_MATCH", timeout=5,
                   what="the CPU removal to be applied")

        # The weight is the policy's: 0.5 halves a's CPU-only score...
        a.send([a.stored(list(range(21, 27)), None, q)] + offload(a, list(range(21, 27))))
        wait_until(lambda: decision(s, content_chain(q))[2] == "3.2000", timeout=5,
                   what="q back on a's CPU")
        s.policy.write_text(s.policy.read_text().replace('cpu: "0.8"', 'cpu: "0.5"'))
        wait_until(lambda: decision(s, content_chain(q)) ==
                   ("PREFIX_MATCH", "replica-a", "2.0000", "96"), timeout=5,
                   what="tierWeights.cpu 0.5 to apply")
        # ... and "0" ignores the tier: no replica holds q.
        s.policy.write_text(s.policy.read_text().replace('cpu: "0.5"', 'cpu: "0"'))
        wait_until(lambda: decision(s, content_chain(q))[0] != "PREFIX_MATCH", timeout=5,
                   what="tierWeights.cpu 0 to apply")
        assert decision(s, content_chain(p))[:2] == ("PREFIX_MATCH", "replica-b")
    finally:
        s.close()


# --- SGLang's own publisher and classes (0.5.23 and 0.5.3 wheels) -------------

def page_hash(data: bytes) -> int:
    """An engine-style page hash: a signed 64-bit value (the i64 path)."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big", signed=True)


def sglang_pages(kv, version, pages, **identity):
    """One BlockStored per page, as SGLang's radix cache publishes them. 0.5.3
    names a page by a hash of its own tokens only (so a page repeated under
    another prefix repeats its hash, with another parent); 0.5.23 chains."""
    events, parent = [], None
    for page in pages:
        tok = b"".join(struct.pack("<I", t) for t in page)
        if version == "0.5.3":
            h = page_hash(tok)
        else:
            h = page_hash((parent or 0).to_bytes(8, "big", signed=True) + tok)
        events.append(kv.BlockStored(block_hashes=[h], parent_block_hash=parent,
                                     token_ids=list(page), block_size=BLOCK, lora_id=None,
                                     **identity))
        parent = h
    return events


def sglang_publish(kv, publisher, events):
    publisher.publish(kv.KVEventBatch(ts=time.time(), events=events))


@pytest.mark.parametrize("version", ["0.5.23", "0.5.3"])
def test_real_sglang_publisher_warm_start_shared_pages_and_restart(version):
    """SGLang's ZmqEventPublisher (PUB + replay ROUTER, its own reply shape) and
    event classes: the batch published before the sidecar exists is fetched by the
    warm start; a second prompt sharing seven of the first prompt's pages behind
    another first page matches all 128 tokens (0.5.3 repeats the engine hashes
    under new parents); a sidecar restart ends with the same index."""
    kv = engines.sglang_kv_events(version)
    port, replay = free_port(), free_port()
    publisher = kv.ZmqEventPublisher(0, endpoint=f"tcp://*:{port}",
                                     replay_endpoint=f"tcp://*:{replay}", topic="kv")
    s = None
    try:
        p1 = [list(range(10_000 + i * BLOCK, 10_000 + (i + 1) * BLOCK)) for i in range(8)]
        p2 = [list(range(50_000, 50_000 + BLOCK))] + p1[1:]
        sglang_publish(kv, publisher, sglang_pages(kv, version, p1))  # nobody listens yet
        time.sleep(0.2)
        s = KvStack(hosts={}, external={"replica-a": f"tcp://127.0.0.1:{port}"},
                    replay_port=replay)
        s.wait_count("replica-a", 8, "after the warm start")
        assert s.metric("kv_events_warm_starts", '{kind="exact"}') == 1
        chain1 = content_chain(sum(p1, []))
        assert s.route(chain1)[:2] == ("PREFIX_MATCH", "replica-a")

        sglang_publish(kv, publisher, sglang_pages(kv, version, p2))
        s.wait_count("replica-a", 16, "after the second prompt")
        r = s.route_response(content_chain(sum(p2, [])))
        assert r.headers["x-inferencecache-reason"] == "PREFIX_MATCH"
        assert r.headers["x-inferencecache-matched-tokens"] == "128"

        before = s.snapshot()
        s.stop_sidecar()
        p3 = p2 + [list(range(60_000, 60_000 + BLOCK))]
        sglang_publish(kv, publisher, sglang_pages(kv, version, p3)[-1:])  # while down
        time.sleep(0.2)
        s.start_sidecar()
        s.wait_count("replica-a", 17, "after the restart")
        after = s.snapshot()
        assert after["totalEntries"] == before["totalEntries"] + 1
        r = s.route_response(content_chain(sum(p3, [])))
        assert r.headers["x-inferencecache-matched-tokens"] == str(9 * BLOCK)
        assert s.replica("replica-a")["kvEventsStale"] is False
    finally:
        if s:
            s.close()
        publisher.shutdown()


def test_real_sglang_0523_lora_name_and_cache_salt():
    """SGLang 0.5.23's own BlockStored carries lora_name and cache_salt on every
    page event: under ic-content-v2 its pages match only requests naming both."""
    kv = engines.sglang_kv_events("0.5.23")
    port, replay = free_port(), free_port()
    publisher = kv.ZmqEventPublisher(0, endpoint=f"tcp://*:{port}",
                                     replay_endpoint=f"tcp://*:{replay}", topic="kv")
    s = None
    try:
        pages = [list(range(30_000 + i * BLOCK, 30_000 + (i + 1) * BLOCK)) for i in range(8)]
        sglang_publish(kv, publisher, sglang_pages(kv, "0.5.23", pages, lora_name="sql",
                                                   cache_salt="t7"))
        time.sleep(0.2)
        s = KvStack(scheme="ic-content-v2", hosts={},
                    external={"replica-a": f"tcp://127.0.0.1:{port}"}, replay_port=replay)
        s.wait_count("replica-a", 8, "after the warm start")
        chain = content_chain_v2(sum(pages, []))
        r = s.route_response(chain, lora="sql", salt="t7")
        assert (r.headers["x-inferencecache-reason"], r.headers["x-inferencecache-replica"],
                r.headers["x-inferencecache-matched-tokens"]) == ("PREFIX_MATCH", "replica-a", "128")
        for identity in ({}, {"lora": "sql"}, {"salt": "t7"}):
            assert s.route(chain, **identity)[0] != "PREFIX_MATCH", identity
    finally:
        if s:
            s.close()
        publisher.shutdown()


# --- a hostile peer -----------------------------------------------------------

class OversizedPeer:
    """Listens like an engine's PUB, completes the ZMTP 3 handshake (greeting +
    READY, written by hand from RFC 23), then announces a 1 TiB frame."""

    def __init__(self, host):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.handshakes = 0
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                try:
                    conn.settimeout(5)
                    conn.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL"
                                 + b"\x00" * 16 + b"\x00" + b"\x00" * 31)
                    got = b""
                    while len(got) < 64:
                        chunk = conn.recv(64 - len(got))
                        if not chunk:
                            raise OSError("closed")
                        got += chunk
                    ready = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 3) + b"PUB"
                    conn.sendall(bytes([0x04, len(ready)]) + ready)
                    self.handshakes += 1
                    conn.sendall(b"\x02" + struct.pack(">Q", 1 << 40) + b"x" * 1024)
                    while conn.recv(65536):  # until the sidecar hangs up
                        pass
                except OSError:
                    pass

    def close(self):
        self._stop.set()
        self.sock.close()


def test_oversized_frame_drops_the_connection_and_the_sidecar_keeps_serving():
    peer = OversizedPeer("127.0.0.3")
    s = KvStack(external={"replica-c": f"tcp://127.0.0.3:{peer.port}"})
    try:
        wait_until(lambda: s.metric("kv_events_oversized_frames") >= 2, timeout=15,
                   what="oversized frames to be counted (and the peer reconnected to)")
        assert s.proc.poll() is None, "the sidecar died"
        assert s.metric("kv_events_dropped_connections", '{kind="oversized"}') >= 2
        assert peer.handshakes >= 2
        # Still serving decisions and following the other engines.
        a = s.pubs["replica-a"]
        toks = tokens(123_000)
        a.send([a.stored(list(range(900, 906)), None, toks)])
        s.wait_count("replica-a", 6)
        assert s.route(content_chain(toks))[:2] == ("PREFIX_MATCH", "replica-a")
        assert s.proc.poll() is None
    finally:
        s.close()
        peer.close()
