"""A real Kubernetes control plane on loopback for the e2e suite: etcd and
kube-apiserver built by e2e/kube/build.sh (pinned, cached), in a temporary
directory, on free ports, with certificates made by openssl.

No kubelet, scheduler or controller-manager: objects are stored, validated
(schema, CEL, admission webhooks), watched and authorized for real, but no pod
ever runs. Beyond ports, storage and the serving certificate, the apiserver
needs only:

- a static token file (the administrator's token, group system:masters) and
  RBAC authorization, so the sidecar runs with exactly manifests/rbac.yaml;
- a service-account issuer and key pair, so `kubectl create token` mints
  tokens for the ServiceAccounts the manifests create;
- `--advertise-address 127.0.0.1`, for hosts whose only interface is loopback;
- an audit log of status and Lease writes (what the failover test reads).

Neither `--endpoint-reconciler-type=none` nor disabling the ServiceAccount
admission plugin is needed while the suite creates no pods, and the default
service CIDR will do.
"""

import os
import pathlib
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading

import requests

from conftest import REPO, free_port, wait_until


AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: Metadata
  resources:
  - group: inferencecache.io
  - group: coordination.k8s.io
    resources: ["leases"]
- level: None
"""


def build_binaries() -> pathlib.Path:
    """The bin directory of e2e/kube/build.sh (built once, then cached; e2e/run.sh
    builds first and passes it in $INFERENCECACHE_KUBE_BIN). Fails, never skips,
    when the binaries cannot be built."""
    given = os.environ.get("INFERENCECACHE_KUBE_BIN")
    if given:
        bin_dir = pathlib.Path(given)
        for name in ("etcd", "kube-apiserver", "kubectl", "helm"):
            assert (bin_dir / name).is_file(), f"{bin_dir / name} missing ($INFERENCECACHE_KUBE_BIN)"
        return bin_dir
    out = subprocess.run(["bash", str(REPO / "e2e" / "kube" / "build.sh")],
                         capture_output=True, text=True, timeout=3600)
    assert out.returncode == 0, f"e2e/kube/build.sh failed:\n{out.stderr[-4000:]}"
    bin_dir = pathlib.Path(out.stdout.strip().splitlines()[-1])
    for name in ("etcd", "kube-apiserver", "kubectl", "helm"):
        assert (bin_dir / name).is_file(), f"{bin_dir / name} missing after build.sh"
    return bin_dir


def openssl(*args, cwd):
    assert shutil.which("openssl"), "openssl is required for the real-apiserver tests"
    out = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"openssl {' '.join(args)}: {out.stderr}"


def make_ca(d: pathlib.Path, name: str):
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout", f"{name}.key", "-out", f"{name}.crt", cwd=d)


def make_cert(d: pathlib.Path, ca: str, name: str, cn: str, sans: str):
    """A serving certificate signed by `ca`, for the subjectAltNames `sans`."""
    (d / f"{name}.ext").write_text(
        f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment\n"
        "basicConstraints=CA:FALSE\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=d)


class ControlPlane:
    """etcd + kube-apiserver, and kubectl / helm pointed at them as administrator."""

    def __init__(self, bin_dir: pathlib.Path):
        self.bin = bin_dir
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="inferencecache-kube-"))
        self.procs = []
        self.logs = []
        d = self.dir
        make_ca(d, "ca")
        make_cert(d, "ca", "apiserver", "kube-apiserver", "IP:127.0.0.1,DNS:localhost")
        openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
        openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
        # Status and Lease writes, with the token that made them (credential-id).
        (d / "audit-policy.yaml").write_text(AUDIT_POLICY)
        self.admin_token = secrets.token_hex(16)
        (d / "tokens.csv").write_text(f'{self.admin_token},admin,admin,"system:masters"\n')
        self._start_etcd()
        self._start_apiserver()
        self.kubeconfig = self.write_kubeconfig("admin.kubeconfig", self.url, self.admin_token)

    # --- processes -----------------------------------------------------------

    def _spawn(self, name, args):
        log = open(self.dir / f"{name}.log", "w")
        self.logs.append(log)
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir)
        self.procs.append(proc)
        return proc

    def log(self, name) -> str:
        return (self.dir / f"{name}.log").read_text(errors="replace")

    def _start_etcd(self):
        for attempt in range(3):
            client, peer = free_port(), free_port()
            self.etcd_url = f"http://127.0.0.1:{client}"
            proc = self._spawn("etcd", [
                str(self.bin / "etcd"), "--name", "e2e", "--data-dir", str(self.dir / "etcd"),
                "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
                "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", f"e2e=http://127.0.0.1:{peer}",
                "--listen-metrics-urls", f"http://127.0.0.1:{free_port()}",
                "--unsafe-no-fsync", "--log-level", "warn"])

            def healthy():
                if proc.poll() is not None:
                    raise RuntimeError("etcd exited")
                try:
                    return requests.get(f"{self.etcd_url}/health", timeout=1).json().get("health") == "true"
                except requests.RequestException:
                    return False
            try:
                wait_until(healthy, timeout=30, what="etcd healthy")
                return
            except (AssertionError, RuntimeError):
                proc.kill()
                proc.wait()
                if attempt == 2 or "address already in use" not in self.log("etcd"):
                    raise AssertionError(f"etcd did not start:\n{self.log('etcd')[-3000:]}")
                shutil.rmtree(self.dir / "etcd", ignore_errors=True)

    def _start_apiserver(self):
        d = self.dir
        for attempt in range(3):
            self.port = free_port()
            self.url = f"https://127.0.0.1:{self.port}"
            proc = self._spawn("kube-apiserver", [
                str(self.bin / "kube-apiserver"),
                "--etcd-servers", self.etcd_url,
                "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
                "--secure-port", str(self.port),
                "--tls-cert-file", str(d / "apiserver.crt"),
                "--tls-private-key-file", str(d / "apiserver.key"),
                "--token-auth-file", str(d / "tokens.csv"),
                "--authorization-mode", "RBAC",
                "--service-account-issuer", "https://kubernetes.default.svc",
                "--service-account-key-file", str(d / "sa.pub"),
                "--service-account-signing-key-file", str(d / "sa.key"),
                "--audit-policy-file", str(d / "audit-policy.yaml"),
                "--audit-log-path", str(d / "audit.log"),
                "--audit-log-format", "json",
            ])
            # verify= on each request: a session's is overridden by $REQUESTS_CA_BUNDLE.
            auth = {"Authorization": f"Bearer {self.admin_token}"}

            def ready():
                if proc.poll() is not None:
                    raise RuntimeError("kube-apiserver exited")
                try:
                    return requests.get(f"{self.url}/readyz", headers=auth, timeout=2,
                                        verify=str(d / "ca.crt")).status_code == 200
                except requests.RequestException:
                    return False
            try:
                wait_until(ready, timeout=120, what="kube-apiserver /readyz")
                return
            except (AssertionError, RuntimeError):
                proc.kill()
                proc.wait()
                if attempt == 2 or "address already in use" not in self.log("kube-apiserver"):
                    raise AssertionError(
                        f"kube-apiserver did not start:\n{self.log('kube-apiserver')[-4000:]}")

    def close(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for log in self.logs:
            log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # --- clients -------------------------------------------------------------

    def write_kubeconfig(self, name: str, server: str, token: str) -> pathlib.Path:
        path = self.dir / name
        path.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster:
    server: {server}
    certificate-authority: {self.dir / 'ca.crt'}
users:
- name: e2e
  user:
    token: {token}
contexts:
- name: e2e
  context: {{cluster: e2e, user: e2e}}
current-context: e2e
""")
        return path

    def env(self, kubeconfig=None) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env["KUBECONFIG"] = str(kubeconfig or self.kubeconfig)
        return env

    def kubectl(self, *args, stdin=None, check=True, kubeconfig=None, timeout=60):
        out = subprocess.run([str(self.bin / "kubectl"), *args], input=stdin,
                             capture_output=True, text=True, timeout=timeout,
                             env=self.env(kubeconfig))
        if check:
            assert out.returncode == 0, f"kubectl {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
        return out

    def helm(self, *args, check=True, timeout=120):
        env = self.env()
        env["HELM_CACHE_HOME"] = str(self.dir / "helm-cache")
        env["HELM_CONFIG_HOME"] = str(self.dir / "helm-config")
        env["HELM_DATA_HOME"] = str(self.dir / "helm-data")
        out = subprocess.run([str(self.bin / "helm"), *args], capture_output=True, text=True,
                             timeout=timeout, env=env)
        if check:
            assert out.returncode == 0, f"helm {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
        return out


class CuttableProxy:
    """A loopback TCP proxy to the apiserver that a test can cut: while cut,
    every byte is dropped in both directions and new connections get no answer,
    as behind a dead network path (nothing is closed or refused). Restoring
    closes the connections that lived through the cut (their streams lost
    bytes), so nothing sent during the cut ever arrives late."""

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.is_cut = threading.Event()
        self.closed = threading.Event()
        self.lock = threading.Lock()
        self.conns = []
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self):
        self.is_cut.set()

    def restore(self):
        with self.lock:
            stale, self.conns = self.conns, []
        for s in stale:
            _close(s)
        self.is_cut.clear()

    def _accept(self):
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src, dst):
        while not self.closed.is_set():
            try:
                data = src.recv(65536)
            except OSError:
                break
            if not data:
                break
            if self.is_cut.is_set():
                continue  # dropped on the dead path
            try:
                dst.sendall(data)
            except OSError:
                break
        _close(src)
        _close(dst)

    def close(self):
        self.closed.set()
        self.listener.close()
        self.restore()


def _close(s):
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
