"""A real nats-server for the fleet tests, and a raw NATS client (the text
protocol over a socket) that publishes whatever bytes a test wants.

The binary comes from $INFERENCECACHE_NATS_SERVER (e2e/run.sh sets it from
e2e/nats/install.sh). Missing, it fails the tests, never skips them.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess

from conftest import free_port, wait_until


def nats_server_binary() -> str:
    path = os.environ.get("INFERENCECACHE_NATS_SERVER", "")
    if not path:
        raise RuntimeError("INFERENCECACHE_NATS_SERVER is not set: run the suite through "
                           "e2e/run.sh (it installs nats-server with e2e/nats/install.sh)")
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"INFERENCECACHE_NATS_SERVER={path} is not executable")
    return path


class NatsServer:
    """nats-server with JetStream on a loopback port; restartable on the same
    port and store directory."""

    def __init__(self, workdir: pathlib.Path):
        self.store = workdir / "nats-store"
        self.log_path = workdir / "nats.log"
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc = None
        self.start()

    def start(self):
        self.log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js",
             "-sd", str(self.store)],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_until(self._listening, timeout=20, what="nats-server listening")

    def _listening(self):
        if self.proc.poll() is not None:
            raise RuntimeError(f"nats-server exited with {self.proc.returncode}: "
                               + self.log_path.read_text(errors="replace")[-2000:])
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
            return s.recv(4096).startswith(b"INFO ")

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.log.close()

    def stop(self):
        self.kill()


def publish(port: int, messages):
    """Publishes each (subject, payload bytes) on the server at `port`, then
    waits for the server's PONG (everything before it was processed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        f = s.makefile("rb")
        assert f.readline().startswith(b"INFO ")
        out = b"CONNECT " + json.dumps({"verbose": False, "pedantic": False}).encode() + b"\r\n"
        for subject, payload in messages:
            out += b"PUB %s %d\r\n%s\r\n" % (subject.encode(), len(payload), payload)
        s.sendall(out + b"PING\r\n")
        while True:
            line = f.readline()
            assert line, "nats-server closed the connection"
            assert not line.startswith(b"-ERR"), line
            if line.startswith(b"PONG"):
                return
