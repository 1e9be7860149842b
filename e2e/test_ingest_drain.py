"""The ingest listener and the graceful drain, through a real Envoy.

- IngestEvents without the bearer token, or with a wrong one, is refused
  (UNAUTHENTICATED) and changes nothing: the same prompt still gets AFFINITY_HINT.
- The ext_proc/LookupRoute port refuses IngestEvents (UNIMPLEMENTED, naming
  --ingest-addr).
- SIGTERM: /readyz answers 503 ("draining"), the sidecar exits 0, and requests
  through Envoy keep being served (fail-open round-robin) during and after.
"""

import signal
import time

import grpc
import pytest
import requests

import cachewire
from conftest import MODEL, SCHEME, TENANT
from test_routing import chain, chain_headers


def ingest(stack, hashes, replica="replica-b", token=None, addr=None):
    return cachewire.ingest(addr or stack.sidecar.ingest_addr, TENANT, MODEL, SCHEME, replica,
                            [cachewire.stored_event(hashes)], token=token)


def test_unauthenticated_ingest_is_refused_and_changes_nothing(override_host_stack):
    s = override_host_stack
    hashes = chain()
    for token in (None, "0" * 32):
        with pytest.raises(grpc.RpcError) as e:
            ingest(s, hashes, token=token)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value.details()
        assert "token" in e.value.details()
    r = s.envoy.get(chain_headers(hashes))
    assert r.status_code == 200
    assert r.headers["x-inferencecache-reason"] == "AFFINITY_HINT"

    # The same call with the token lands.
    assert ingest(s, hashes, token=s.sidecar.ingest_token) == {"applied": 1, "rejected": 0}
    r = s.envoy.get(chain_headers(hashes))
    assert (r.headers["x-inferencecache-reason"], r.text) == ("PREFIX_MATCH", "replica-b")

    metrics = requests.get(f"{s.sidecar.admin}/metrics", timeout=2).text
    assert ('inferencecache_ingest_caller_calls_total{caller="ip:127.0.0.1",'
            'rpc="IngestEvents",outcome="unauthenticated"} 2') in metrics
    assert ('inferencecache_ingest_caller_calls_total{caller="token:e2e",'
            'rpc="IngestEvents",outcome="ok"} 1') in metrics


def test_the_ext_proc_port_refuses_ingest(override_host_stack):
    s = override_host_stack
    with pytest.raises(grpc.RpcError) as e:
        ingest(s, chain(), token=s.sidecar.ingest_token, addr=s.sidecar.grpc_addr)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "--ingest-addr" in e.value.details()


def test_sigterm_drains_and_envoy_keeps_serving(override_host_stack):
    s = override_host_stack
    hashes = chain()
    assert s.envoy.get(chain_headers(hashes)).status_code == 200
    assert requests.get(f"{s.sidecar.admin}/readyz", timeout=2).status_code == 200

    s.sidecar.proc.send_signal(signal.SIGTERM)
    saw_draining = False
    deadline = time.monotonic() + 10
    while s.sidecar.proc.poll() is None and time.monotonic() < deadline:
        try:
            r = requests.get(f"{s.sidecar.admin}/readyz", timeout=1)
            if r.status_code == 503 and r.json()["draining"] is True:
                saw_draining = True
        except requests.RequestException:
            pass  # the admin server stops last; gone means exited
        # Envoy fails open while the sidecar drains and after it has gone.
        assert s.envoy.get(chain_headers(hashes)).status_code == 200
        time.sleep(0.01)
    assert s.sidecar.proc.wait(timeout=10) == 0
    # Headers-only streams are short: the drain may end before a poll sees it.
    # The log says it happened either way.
    log = (s.workdir / "sidecar.log").read_text()
    assert "draining" in log, log
    assert "drained; exiting" in log, log
    assert "drain deadline passed" not in log, log
    for _ in range(5):
        r = s.envoy.get(chain_headers(hashes))
        assert r.status_code == 200
        assert r.text in s.by_id
    print("saw /readyz draining:", saw_draining)
