"""Engine KV events through real ZMQ sockets: Python publishers in both event
generations (msgspec array_like structs and tagged map structs) → the sidecar's
subscribers → the index (/snapshot, /metrics) and routing decisions through Envoy.

Each replica's publisher binds like an engine with `tcp://*:port` would (PUB for
events, ROUTER for replay), on its own loopback address so every replica has its
own replay port (127.0.0.1 and 127.0.0.2).
"""

import hashlib
import pathlib
import re
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time
from typing import Optional, Union

import msgspec
import pytest
import requests
import zmq

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


class Publisher:
    """An engine's ZmqEventPublisher: PUB [topic, seq, payload] + replay ROUTER."""

    def __init__(self, host: str, generation: str):
        self.ctx = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.port = self.pub.bind_to_random_port(f"tcp://{host}")
        self.replay_port = None
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
            for seq in sorted(s for s in self.sent if s >= first):
                self.router.send_multipart([ident, b"", seq.to_bytes(8, "big"), self.sent[seq]])
            self.router.send_multipart([ident, b"", END.to_bytes(8, "big"), b""])

    def encode(self, events):
        return msgspec.msgpack.encode(self.cls[0](ts=time.time(), events=events))

    def stored(self, hashes, parent, tokens, **kw):
        return self.cls[1](block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                           block_size=BLOCK, **kw)

    def removed(self, hashes):
        return self.cls[2](block_hashes=hashes)

    def cleared(self):
        return self.cls[3]()

    def send_raw(self, payload: bytes, seq=None, deliver=True):
        seq = self.seq if seq is None else seq
        self.sent[seq] = payload
        if deliver:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        self.seq = seq + 1

    def send(self, events, seq=None, deliver=True):
        self.send_raw(self.encode(events), seq=seq, deliver=deliver)

    def close(self):
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=2)
            self.router.close(linger=0)
        self.pub.close(linger=0)


def policy(scheme, upstreams, publishers, replay_port) -> str:
    eps = []
    for u in upstreams:
        p = publishers.get(u.replica_id)
        line = f"    - id: {u.replica_id}\n      address: {u.address}"
        if p:
            line += f"\n      kvEventsEndpoint: tcp://{p.host}:{p.port}"
        eps.append(line)
    endpoints = "\n".join(eps)
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
  affinityRouting: Enabled
---
apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata: {{name: llama, namespace: team-a}}
spec:
  engine: vLLM
  modelID: {MODEL}
  hashScheme: {scheme}
  blockSize: {BLOCK}
  kvEvents: {{replayPort: {replay_port}}}
  endpoints:
{endpoints}
"""


class KvStack:
    """Three upstreams (a and b publish KV events), the sidecar and Envoy."""

    def __init__(self, scheme="ic-content-v1", generation="array"):
        self.scheme = scheme
        self.workdir = pathlib.Path(tempfile.mkdtemp(prefix="inferencecache-kv-"))
        self.upstreams = [Upstream(r) for r in ("replica-a", "replica-b", "replica-c")]
        replay_port = free_port()
        self.pubs = {
            "replica-a": Publisher("127.0.0.1", generation),
            "replica-b": Publisher("127.0.0.2", generation),
        }
        for p in self.pubs.values():
            p.start_replay(replay_port)
        self.policy = self.workdir / "policy.yaml"
        self.policy.write_text(policy(scheme, self.upstreams, self.pubs, replay_port))
        self.grpc_port, admin_port = free_port(), free_port()
        self.admin = f"http://127.0.0.1:{admin_port}"
        self.log = open(self.workdir / "sidecar.log", "w")
        self.proc = subprocess.Popen(
            [sidecar_binary(), "serve", "--config", str(self.policy),
             "--grpc-addr", f"127.0.0.1:{self.grpc_port}",
             "--ingest-addr", f"127.0.0.1:{free_port()}",
             "--admin-addr", f"127.0.0.1:{admin_port}", "--policy-poll-ms", "100"],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_until(lambda: requests.get(f"{self.admin}/readyz", timeout=1).status_code == 200,
                   what="sidecar /readyz")
        self.envoy = Envoy(self.workdir, "override-host.yaml", self, self.upstreams)
        for p in self.pubs.values():
            self.warm_up(p)

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

    def route(self, chain):
        headers = {
            "x-inferencecache-tenant": TENANT,
            "x-inferencecache-model": MODEL,
            "x-inferencecache-hash-scheme": self.scheme,
            "x-inferencecache-block-hashes": ",".join(f"{x:x}" for x in chain),
            "x-inferencecache-block-token-counts": ",".join(str(BLOCK) for _ in chain),
            "x-inferencecache-debug": "1",
        }
        r = self.envoy.get(headers)
        assert r.status_code == 200
        return r.headers.get("x-inferencecache-reason"), r.headers.get("x-inferencecache-replica"), r.text

    def wait_count(self, replica, n, what=""):
        wait_until(lambda: self.prefix_count(replica) == n, timeout=5,
                   what=f"{replica} to hold {n} entries {what}")

    def close(self):
        self.envoy.stop()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=10)
        self.log.close()
        for p in self.pubs.values():
            p.close()
        for u in self.upstreams:
            u.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def wait_quiet(check, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture(params=["array", "map"])
def stack(request):
    s = KvStack(generation=request.param)
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


def test_failed_replay_clears_rather_than_guess(stack):
    b = stack.pubs["replica-b"]
    b.send([b.stored([41, 42], None, tokens(3000, 2))])
    stack.wait_count("replica-b", 2)
    lost = b.seq
    b.send([b.stored([43], 42, tokens(3032, 1))], deliver=False)
    del b.sent[lost]  # the engine's replay buffer no longer has it
    b.send([b.stored([51], None, tokens(7000, 1))])
    stack.wait_count("replica-b", 1, "after the failed replay")
    assert stack.metric("kv_events_replays", '{kind="failed"}') == 1
    assert stack.metric("kv_events_resets", '{kind="replay_failed"}') == 1


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


def run_chain(scheme, toks, seed=None):
    args = [sidecar_binary(), "chain", "--scheme", scheme, "--block-size", str(BLOCK)]
    if seed is not None:
        args += ["--hash-seed", seed]
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
