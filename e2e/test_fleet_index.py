"""The fleet's index through a real nats-server with JetStream: engine KV events
(an engine's real ZMQ PUB and replay sockets, as in test_kv_events.py) enter the
fleet's stream once, through the sidecar holding the engine's relay lease, and
every sidecar applies them; a sidecar started late loads the fleet's index
snapshot and answers PREFIX_MATCH without the engines' replay; a stopped relay's
engines are taken over; NATS down, every sidecar follows its engines itself;
forged and garbage batches change nothing.
"""

import pathlib
import re
import shutil
import signal
import subprocess
import tempfile
import time

import pytest
import requests

import cachewire
from conftest import Upstream, free_port, sidecar_binary, wait_until
from natsserver import NatsServer, nats_server_binary, publish
from test_kv_events import (BLOCK, MODEL, TENANT, Publisher, content_chain, free_ports,
                            policy, wait_quiet)

SCHEME = "ic-content-v1"
FLEET = "inferencecache"


class Sidecar:
    def __init__(self, workdir: pathlib.Path, name: str, policy_path: pathlib.Path, nats_url: str):
        self.name = name
        self.log_path = workdir / f"{name}.log"
        self.grpc_port, self.admin_port, self.ingest_port = free_port(), free_port(), free_port()
        self.grpc = f"127.0.0.1:{self.grpc_port}"
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        self.log = open(self.log_path, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sidecar_binary(), "serve", "--config", str(policy_path),
             "--grpc-addr", self.grpc, "--ingest-addr", f"127.0.0.1:{self.ingest_port}",
             "--admin-addr", f"127.0.0.1:{self.admin_port}", "--policy-poll-ms", "100",
             "--fleet-nats", nats_url, "--fleet-id", name,
             "--fleet-snapshot-interval", "1s"],
            stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: requests.get(f"{self.admin}/readyz", timeout=1).status_code == 200,
                       what=f"{name} /readyz")
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            self.log.close()
            raise

    def metric(self, name, labels="") -> float:
        text = requests.get(f"{self.admin}/metrics", timeout=2).text
        m = re.search(rf"^inferencecache_{name}(?:_total)?{re.escape(labels)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def prefix_count(self, replica) -> int:
        snap = requests.get(f"{self.admin}/snapshot", timeout=2).json()
        return sum(r["prefixCount"] for r in snap["replicas"] if r["replicaId"] == replica)

    def lookup(self, chain):
        return cachewire.lookup(self.grpc, TENANT, MODEL, SCHEME, chain,
                                [BLOCK] * len(chain))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self):
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=15)
        self.log.close()


class FleetIndex:
    """Three upstreams (a and b publish KV events), one nats-server, two
    sidecars in one fleet; more can be started."""

    def __init__(self):
        self.workdir = pathlib.Path(tempfile.mkdtemp(prefix="inferencecache-fleet-index-"))
        self.nats, self.upstreams, self.pubs, self.sidecars = None, [], {}, []
        try:
            self._up()
        except BaseException:
            self.close()  # nothing left running when the set-up fails
            raise

    def _up(self):
        self.nats = NatsServer(self.workdir)
        self.upstreams = [Upstream(r) for r in ("replica-a", "replica-b", "replica-c")]
        hosts = {"replica-a": "127.0.0.1", "replica-b": "127.0.0.2"}
        replay_port = free_ports(1, list(hosts.values()))
        self.pubs = {r: Publisher(h, "array") for r, h in hosts.items()}
        for p in self.pubs.values():
            p.start_replay(replay_port)
        self.policy = self.workdir / "policy.yaml"
        self.policy.write_text(policy(SCHEME, self.upstreams, self.pubs, replay_port))
        # The same fleet, but the engines' replay sockets unreachable.
        self.no_replay = self.workdir / "policy-no-replay.yaml"
        self.no_replay.write_text(policy(SCHEME, self.upstreams, self.pubs,
                                         free_ports(1, list(hosts.values()))))
        for name in ("s1", "s2"):
            self.start(name)
        wait_until(lambda: self.relayed() == 2, timeout=20,
                   what="each engine relayed by one sidecar")
        for p in self.pubs.values():
            self.warm_up(p)

    def start(self, name, policy_path=None) -> Sidecar:
        s = Sidecar(self.workdir, name, policy_path or self.policy, self.nats.url)
        self.sidecars.append(s)
        return s

    def live(self):
        return [s for s in self.sidecars if s.alive()]

    def relayed(self) -> int:
        return int(sum(s.metric("fleet_kv_relayed_engines") for s in self.live()))

    def published(self) -> int:
        return int(sum(s.metric("fleet_kv_batches_published") for s in self.live()))

    def settled(self) -> int:
        """Batches published, once a takeover's replay is done publishing."""
        last = [-1]

        def still():
            n = self.published()
            same = n == last[0]
            last[0] = n
            return same
        wait_until(lambda: still() or (time.sleep(0.5) or False), timeout=20,
                   what="the relays to finish publishing")
        return last[0]

    def warm_up(self, pub):
        """PUB drops until the subscriptions arrive: send empty batches until
        every live sidecar receives one."""
        def landed():
            before = [s.metric("kv_events_batches") for s in self.live()]
            pub.send([])
            return wait_quiet(lambda: all(s.metric("kv_events_batches") > b
                                          for s, b in zip(self.live(), before)), 0.3)
        wait_until(landed, timeout=15, what="the subscribers to receive")

    def wait_count(self, sidecars, replica, n, timeout=10):
        for s in sidecars:
            wait_until(lambda: s.prefix_count(replica) == n, timeout=timeout,
                       what=f"{s.name}: {replica} to hold {n} entries")

    def close(self):
        for s in self.sidecars:
            s.stop()
        for p in self.pubs.values():
            p.close()
        for u in self.upstreams:
            u.close()
        if self.nats is not None:
            self.nats.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture
def fleet():
    nats_server_binary()  # fail, never skip, without it
    f = FleetIndex()
    yield f
    f.close()


def tokens(start, blocks=6):
    return list(range(start, start + blocks * BLOCK))


def test_events_enter_once_and_every_sidecar_applies_them(fleet):
    a = fleet.pubs["replica-a"]
    toks = tokens(1000)
    before = fleet.settled()
    a.send([a.stored([11, 12, 13], None, toks[:48]), a.stored([14, 15, 16], 13, toks[48:])])
    fleet.wait_count(fleet.sidecars, "replica-a", 6)
    # One batch from the engine, one published batch for the whole fleet.
    assert fleet.published() == before + 1
    for s in fleet.sidecars:
        assert s.lookup(content_chain(toks)) == ("PREFIX_MATCH", "replica-a")
        assert s.prefix_count("replica-b") == 0
    # Removals travel the same way.
    a.send([a.removed([14, 15, 16])])
    fleet.wait_count(fleet.sidecars, "replica-a", 3)
    applied = sum(s.metric("fleet_kv_batches_applied") for s in fleet.sidecars)
    assert applied >= 4, "each sidecar read both batches from the stream"


def test_a_late_sidecar_warm_starts_from_the_snapshot(fleet):
    a, b = fleet.pubs["replica-a"], fleet.pubs["replica-b"]
    ta, tb = tokens(2000), tokens(3000, 4)
    a.send([a.stored([21, 22, 23, 24, 25, 26], None, ta)])
    b.send([b.stored([31, 32, 33, 34], None, tb)])
    fleet.wait_count(fleet.sidecars, "replica-a", 6)
    fleet.wait_count(fleet.sidecars, "replica-b", 4)
    written = sum(s.metric("fleet_index_snapshots_written") for s in fleet.sidecars)
    wait_until(lambda: sum(s.metric("fleet_index_snapshots_written")
                           for s in fleet.sidecars) > written,
               timeout=10, what="a snapshot holding both engines' blocks")
    # The late sidecar cannot reach the engines' replay sockets.
    late = fleet.start("s3", fleet.no_replay)
    wait_until(lambda: late.lookup(content_chain(ta)) == ("PREFIX_MATCH", "replica-a")
               and late.lookup(content_chain(tb)) == ("PREFIX_MATCH", "replica-b"),
               timeout=10, what="the late sidecar to route on the fleet's index")
    assert late.metric("fleet_index_snapshot_loaded_blocks") >= 10
    assert late.metric("kv_events_replays", '{kind="ok"}') == 0
    # It follows the stream on from the snapshot.
    t2 = tokens(4000, 4)
    a.send([a.stored([41, 42, 43, 44], None, t2)])
    fleet.wait_count([late], "replica-a", 10)
    assert late.lookup(content_chain(t2)) == ("PREFIX_MATCH", "replica-a")


def test_a_stopped_relays_engines_are_taken_over(fleet):
    s1, s2 = fleet.sidecars
    late = fleet.start("s3")
    a = fleet.pubs["replica-a"]
    fleet.warm_up(a)
    s1.stop()
    # s1 handed its leases back: the others relay both engines at once.
    wait_until(lambda: fleet.relayed() == 2, timeout=10, what="both engines relayed again")
    toks = tokens(5000)
    a.send([a.stored([51, 52, 53, 54, 55, 56], None, toks)])
    fleet.wait_count([s2, late], "replica-a", 6)
    for s in (s2, late):
        assert s.lookup(content_chain(toks)) == ("PREFIX_MATCH", "replica-a")


def test_nats_down_every_sidecar_follows_its_engines_itself(fleet):
    a = fleet.pubs["replica-a"]
    fleet.nats.kill()
    wait_until(lambda: all(s.metric("fleet_connected") == 0 for s in fleet.sidecars),
               timeout=10, what="the sidecars to see NATS gone")
    toks = tokens(6000)
    a.send([a.stored([61, 62, 63, 64, 65, 66], None, toks)])
    fleet.wait_count(fleet.sidecars, "replica-a", 6)
    # Long enough for every relay lease to age out: the relays are chosen anew,
    # and the new ones replay their engines to the stream.
    time.sleep(6)
    fleet.nats.start()
    wait_until(lambda: fleet.relayed() == 2, timeout=20, what="the relays back")
    # Back on the stream: one relay per engine again, and no batch counted twice.
    t2 = tokens(7000, 4)
    before = fleet.settled()
    a.send([a.stored([71, 72, 73, 74], None, t2)])
    fleet.wait_count(fleet.sidecars, "replica-a", 10)
    assert fleet.published() == before + 1
    for s in fleet.sidecars:
        assert s.lookup(content_chain(toks)) == ("PREFIX_MATCH", "replica-a")


def test_forged_and_garbage_batches_change_nothing(fleet):
    s1, s2 = fleet.sidecars
    a = fleet.pubs["replica-a"]
    a.send([a.stored([81, 82, 83, 84], None, tokens(8000, 4))])
    fleet.wait_count(fleet.sidecars, "replica-a", 4)
    dropped = {r: sum(s.metric("fleet_kv_batches_dropped", f'{{reason="{r}"}}')
                      for s in fleet.sidecars)
               for r in ("malformed", "foreign_version", "engine_mismatch", "oversized")}
    # A future format's version (field 1 = 99), garbage, and JSON.
    publish(fleet.nats.port, [
        (f"{FLEET}.kv.0011223344556677", b"\x08\x63"),
        (f"{FLEET}.kv.0011223344556677", b"\xff\xfe garbage"),
        (f"{FLEET}.kv.0011223344556677", b'{"v": 1}'),
    ])
    wait_until(lambda: sum(s.metric("fleet_kv_batches_dropped", '{reason="foreign_version"}')
                           for s in fleet.sidecars) >= dropped["foreign_version"] + 2,
               timeout=10, what="the foreign version dropped by both sidecars")
    wait_until(lambda: sum(s.metric("fleet_kv_batches_dropped", '{reason="malformed"}')
                           for s in fleet.sidecars) >= dropped["malformed"] + 4,
               timeout=10, what="the garbage and JSON dropped by both sidecars")
    for s in fleet.sidecars:
        assert s.prefix_count("replica-a") == 4
        assert s.prefix_count("replica-b") == 0
