"""Routing through a real Envoy with the sidecar."""

import itertools
import subprocess

import pytest
import requests

import cachewire
from conftest import MODEL, REPO, SCHEME, TENANT, envoy_binary, policy_yaml, wait_until

_fresh = itertools.count(1)


def chain(n=6):
    """A chain nobody has seen yet: distinct hashes per call."""
    base = next(_fresh) << 32
    return [base + i for i in range(n)]


def chain_headers(hashes, tenant=TENANT, model=MODEL, scheme=SCHEME, debug=True):
    h = {
        "x-inferencecache-tenant": tenant,
        "x-inferencecache-model": model,
        "x-inferencecache-hash-scheme": scheme,
        "x-inferencecache-block-hashes": ",".join(f"{x:x}" for x in hashes),
        "x-inferencecache-block-token-counts": ",".join("16" for _ in hashes),
    }
    if debug:
        h["x-inferencecache-debug"] = "1"
    return h


def hold(stack, replica, hashes):
    out = cachewire.ingest(stack.sidecar.ingest_addr, TENANT, MODEL, SCHEME, replica,
                           [cachewire.stored_event(hashes)], token=stack.sidecar.ingest_token)
    assert out == {"applied": 1, "rejected": 0}


@pytest.mark.parametrize("template", ["override-host.yaml", "original-dst.yaml"])
def test_envoy_configs_validate(template):
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(REPO / "envoy" / template)],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_chain_held_by_one_replica_routes_there(override_host_stack):
    s = override_host_stack
    hashes = chain()
    hold(s, "replica-b", hashes)
    for _ in range(3):
        r = s.envoy.get(chain_headers(hashes))
        assert r.status_code == 200
        assert r.text == "replica-b"
        assert r.headers["x-inferencecache-reason"] == "PREFIX_MATCH"
        assert r.headers["x-inferencecache-replica"] == "replica-b"
        assert r.headers["x-inferencecache-matched-tokens"] == "96"
        # The upstream saw the decision too.
        assert r.headers["x-upstream-saw-reason"] == "PREFIX_MATCH"


@pytest.mark.parametrize("field,value,code", [
    ("tenant", "nobody", "UNKNOWN_TENANT"),
    ("model", "other-model", "UNKNOWN_MODEL"),
    ("scheme", "sglang", "UNKNOWN_HASH_SCHEME"),
])
def test_unknown_scope_keys_get_their_code(override_host_stack, field, value, code):
    r = override_host_stack.envoy.get(chain_headers(chain(), **{field: value}))
    assert r.status_code == 200
    assert r.headers["x-inferencecache-reason"] == code
    assert "x-inferencecache-replica" not in r.headers


def test_affinity_pins_a_repeated_cold_prompt(override_host_stack):
    hashes = chain()
    served = set()
    for _ in range(6):
        r = override_host_stack.envoy.get(chain_headers(hashes))
        assert r.headers["x-inferencecache-reason"] == "AFFINITY_HINT"
        served.add(r.text)
    assert len(served) == 1


def test_malformed_header_is_no_hint_with_the_reason(override_host_stack):
    h = chain_headers(chain())
    h["x-inferencecache-block-hashes"] = "0xab,zz"
    h["x-inferencecache-block-token-counts"] = "16,16"
    r = override_host_stack.envoy.get(h)
    assert r.status_code == 200
    assert r.headers["x-inferencecache-reason"] == "NO_HINT"
    assert "x-inferencecache-block-hashes" in r.headers["x-inferencecache-detail"]


def test_no_debug_headers_unless_asked(override_host_stack):
    r = override_host_stack.envoy.get(chain_headers(chain(), debug=False))
    assert r.status_code == 200
    assert "x-inferencecache-reason" not in r.headers
    assert r.headers["x-upstream-saw-reason"] == "AFFINITY_HINT"


def test_spoofed_destination_header_is_ignored(override_host_stack):
    s = override_host_stack
    hashes = chain()
    hold(s, "replica-a", hashes)
    spoof = {"x-gateway-destination-endpoint": s.by_id["replica-c"].address,
             "x-inferencecache-reason": "PREFIX_MATCH", "x-inferencecache-replica": "replica-c"}
    r = s.envoy.get({**chain_headers(hashes), **spoof})
    assert r.text == "replica-a"
    # With no hint at all, the spoofed header is dropped and Envoy round-robins.
    served = {s.envoy.get({**chain_headers(chain(), tenant="nobody"), **spoof}).text
              for _ in range(9)}
    assert served != {"replica-c"}, served
    r = s.envoy.get({**chain_headers(chain(), tenant="nobody"), **spoof})
    assert r.headers["x-upstream-saw-reason"] == "UNKNOWN_TENANT"


def test_override_host_fails_open_without_the_sidecar(override_host_stack):
    s = override_host_stack
    s.sidecar.stop()
    served = set()
    for _ in range(6):
        r = s.envoy.get(chain_headers(chain()))
        assert r.status_code == 200, r.text
        served.add(r.text)
    assert served <= {"replica-a", "replica-b", "replica-c"}
    assert len(served) > 1, "expected round-robin without the sidecar"


def test_original_dst_routes_the_hint_and_falls_back(original_dst_stack):
    s = original_dst_stack
    hashes = chain()
    hold(s, "replica-c", hashes)
    r = s.envoy.get(chain_headers(hashes))
    assert (r.status_code, r.text) == (200, "replica-c")
    h = chain_headers(chain())
    h["x-inferencecache-block-hashes"] = "zz"
    h["x-inferencecache-block-token-counts"] = "16"
    r = s.envoy.get(h)  # malformed: NO_HINT, yet exactly one serving replica
    assert r.status_code == 200
    assert r.text in s.by_id


def test_original_dst_without_serving_replica_is_503_with_reason(original_dst_stack):
    r = original_dst_stack.envoy.get(chain_headers(chain(), model="other-model"))
    assert r.status_code == 503
    assert "no serving replica" in r.text
    assert "UNKNOWN_MODEL" in r.text


def test_policy_edit_changes_the_next_decision(override_host_stack):
    s = override_host_stack
    hashes = chain()
    assert s.envoy.get(chain_headers(hashes)).headers["x-inferencecache-reason"] == "AFFINITY_HINT"
    s.sidecar.policy.write_text(policy_yaml(s.upstreams, affinity="Disabled"))
    wait_until(lambda: s.envoy.get(chain_headers(hashes)).headers["x-inferencecache-reason"]
               == "NO_HINT", timeout=10, what="the edited policy to apply")


def test_broken_policy_file_keeps_routing(override_host_stack):
    s = override_host_stack
    hashes = chain()
    hold(s, "replica-b", hashes)
    before = requests.get(f"{s.sidecar.admin}/policy", timeout=5).json()["revision"]
    s.sidecar.policy.write_text("kind: CachePolicy\nspec: [not, a, mapping\n")
    wait_until(lambda: requests.get(f"{s.sidecar.admin}/readyz", timeout=5).json()
               ["policyLastError"], timeout=10, what="the reload error to show")
    r = s.envoy.get(chain_headers(hashes))
    assert (r.text, r.headers["x-inferencecache-reason"]) == ("replica-b", "PREFIX_MATCH")
    policy = requests.get(f"{s.sidecar.admin}/policy", timeout=5).json()
    assert policy["revision"] == before
    assert policy["source"]["lastError"]
    # The last good policy still decides new requests too.
    cold = s.envoy.get(chain_headers(chain()))
    assert (cold.text, cold.headers["x-inferencecache-reason"]) == ("replica-b", "TENANT_HOT")


def test_admin_snapshot_and_metrics(override_host_stack):
    s = override_host_stack
    hashes = chain()
    hold(s, "replica-a", hashes)
    s.envoy.get(chain_headers(hashes))
    snap = requests.get(f"{s.sidecar.admin}/snapshot", timeout=5).json()
    assert set(snap) == {"generatedAt", "totalEntries", "orphanEntries", "replicas", "tenants"}
    row = next(r for r in snap["replicas"] if r["replicaId"] == "replica-a")
    assert row["prefixCount"] == len(hashes)
    assert row["endpoint"] == s.by_id["replica-a"].address
    assert row["hitRate"] is None and row["statsReported"] is False
    tenant = next(t for t in snap["tenants"] if t["tenant"] == TENANT)
    assert (tenant["namespace"], tenant["memoryUsed"]) == ("team-a", 0)
    assert all("probe" not in r["tenant"] for r in snap["replicas"])
    metrics = requests.get(f"{s.sidecar.admin}/metrics", timeout=5).text
    assert 'inferencecache_decisions_total{reason="PREFIX_MATCH",path="ext_proc"}' in metrics
    assert "inferencecache_decision_latency_seconds_bucket" in metrics
    assert 'inferencecache_index_entries{tenant="acme"}' in metrics
    # Every run was stored from block 0: nothing waits in an orphan shard.
    assert snap["orphanEntries"] == 0
    assert "\ninferencecache_index_orphan_entries 0\n" in metrics
