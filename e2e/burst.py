"""Where a decision's time goes under a connection burst.

Not a test (not collected by pytest, not in CI): a measurement, reproducible with

    bash e2e/burst.sh [--streams 2000] [--message-timeout 0.2s] [--concurrency 2] ...

(e2e/burst.sh builds the release sidecar and runs this in the e2e virtual environment).
It starts the held replicas (e2e/held_upstream.py), the sidecar (release build unless
--sidecar says otherwise) and Envoy on a shipped config with only the ports, and
optionally message_timeout / the ext_proc filter, changed; fires `--streams`
connections at once (or over `--ramp` seconds); and prints, as JSON and a summary:

- client side: time to the whole reply (the replicas answer at once by default);
- Envoy's access log per request: DS_RX_BEG -> US_TX_BEG (request accepted by the HCM
  until it was sent upstream: ext_proc included) and the ext_proc filter's own
  request-header call latency and status;
- Envoy's stats: http.ingress.ext_proc.* (streams, message_timeouts,
  failure_mode_allowed), cluster.inferencecache_ext_proc.* (connections and streams to
  the sidecar, HTTP/2 flow-control counters), cluster.replicas.* overflows;
- the sidecar's /metrics: decisions and the decision latency histogram.

`--no-ext-proc` removes the ext_proc filter: Envoy alone under the same burst.
"""

import argparse
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter

import requests

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import loadgen  # noqa: E402
from conftest import REPLICAS, REPO, Sidecar, envoy_binary, free_port, wait_until  # noqa: E402
from test_breakers import HeldReplica, headers_for  # noqa: E402

ACCESS_LOG = """          access_log:
          - name: envoy.access_loggers.file
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog
              path: {path}
              log_format:
                json_format:
                  code: "%RESPONSE_CODE%"
                  flags: "%RESPONSE_FLAGS%"
                  total_ms: "%DURATION%"
                  to_upstream_us: "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%"
                  ext_proc_us: "%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:request_header_latency_us)%"
                  ext_proc_status: "%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:request_header_call_status)%"
"""


def quantiles(xs, qs=(0.5, 0.9, 0.99, 1.0)):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return {}
    return {f"p{int(q * 100)}": xs[min(len(xs) - 1, int(q * len(xs)))] for q in qs}


def histogram_quantiles(metrics: str, name: str, label: str) -> dict:
    """Quantiles (upper bucket bounds) of a Prometheus histogram from /metrics text."""
    buckets = []
    for line in metrics.splitlines():
        if line.startswith(name + "_bucket") and label in line:
            le = re.search(r'le="([^"]+)"', line).group(1)
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.split()[-1])))
    buckets.sort()
    if not buckets or buckets[-1][1] == 0:
        return {}
    total = buckets[-1][1]
    out = {"count": int(total)}
    for q in (0.5, 0.9, 0.99):
        out[f"p{int(q * 100)}_le_s"] = next(le for le, c in buckets if c >= q * total)
    return out


def envoy_config(template, envoy_port, admin_port, grpc_port, upstreams, log_path, args):
    # A shipped config's name (envoy/NAME), or a path to another version of one.
    text = (pathlib.Path(template) if "/" in template else REPO / "envoy" / template).read_text()
    text = text.replace("port_value: 10000", f"port_value: {envoy_port}")
    text = text.replace("port_value: 50051", f"port_value: {grpc_port}")
    for default, u in zip((18001, 18002, 18003), upstreams):
        text = text.replace(f"port_value: {default}", f"port_value: {u.port}")
    text = text.replace("          stat_prefix: ingress\n",
                        "          stat_prefix: ingress\n" + ACCESS_LOG.format(path=log_path), 1)
    if args.message_timeout:
        text = re.sub(r"message_timeout: \S+", f"message_timeout: {args.message_timeout}", text)
    if args.grpc_timeout:
        text = re.sub(r"(envoy_grpc: \{ cluster_name: inferencecache_ext_proc \}\n\s+timeout:) \S+",
                      rf"\1 {args.grpc_timeout}", text)
    if args.streams_per_sidecar_cx:
        text = text.replace("http2_protocol_options: {}",
                            f"http2_protocol_options: {{ max_concurrent_streams: {args.streams_per_sidecar_cx} }}")
    if args.no_ext_proc:
        text = re.sub(r"          - name: envoy.filters.http.ext_proc\n(?:            .*\n|              .*\n)+",
                      "", text)
        assert "ext_proc.v3.ExternalProcessor" not in text
    text += ("\nadmin:\n  address:\n    socket_address: "
             f"{{ address: 127.0.0.1, port_value: {admin_port} }}\n")
    return text


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--template", default="override-host.yaml")
    p.add_argument("--streams", type=int, default=2000)
    p.add_argument("--ramp", type=float, default=0.0, help="seconds to open the streams over")
    p.add_argument("--hold", type=float, default=0.0, help="seconds each replica holds a reply")
    p.add_argument("--concurrency", type=int, default=os.cpu_count(), help="Envoy worker threads")
    p.add_argument("--message-timeout", help="override message_timeout, e.g. 1s")
    p.add_argument("--grpc-timeout", help="override the ext_proc grpc_service timeout")
    p.add_argument("--streams-per-sidecar-cx", type=int,
                   help="cap the ext_proc streams per HTTP/2 connection to the sidecar "
                        "(http2_protocol_options.max_concurrent_streams): more connections")
    p.add_argument("--no-ext-proc", action="store_true", help="Envoy without the ext_proc filter")
    p.add_argument("--sidecar", default=os.environ.get("INFERENCECACHE_BIN"),
                   help="sidecar binary (default $INFERENCECACHE_BIN)")
    p.add_argument("--warmup", type=int, default=50, help="sequential requests first")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    p.add_argument("--envoy-log", default="warning",
                   help="Envoy's -l level, or component levels for --component-log-level "
                        "(e.g. http2:debug)")
    args = p.parse_args()
    if args.sidecar:
        os.environ["INFERENCECACHE_BIN"] = args.sidecar
    # h2 warns when it sends GOAWAY (e.g. too many streams reset before accept).
    os.environ.setdefault("RUST_LOG", "info,h2=warn")
    mode = "original-dst" if "original-dst" in args.template else "override-host"

    loadgen.raise_fd_limit(2 * args.streams + 512)
    work = pathlib.Path(tempfile.mkdtemp(prefix="inferencecache-burst-"))
    procs = []
    try:
        up = subprocess.Popen([sys.executable, str(HERE / "held_upstream.py"), "--hold",
                               str(args.hold), *REPLICAS], stdout=subprocess.PIPE, text=True)
        procs.append(up)
        ports = json.loads(up.stdout.readline())
        upstreams = [HeldReplica(r, ports[r]) for r in REPLICAS]
        sidecar = Sidecar(work, upstreams, mode)
        envoy_port, admin_port = free_port(), free_port()
        log_path = work / "access.log"
        cfg = work / "envoy.yaml"
        cfg.write_text(envoy_config(args.template, envoy_port, admin_port, sidecar.grpc_port,
                                    upstreams, log_path, args))
        envoy = subprocess.Popen([envoy_binary(), "-c", str(cfg), "--disable-hot-restart",
                                  "--concurrency", str(args.concurrency),
                                  *(["--component-log-level", args.envoy_log] if ":" in args.envoy_log
                                    else ["-l", args.envoy_log]),
                                  "--file-flush-interval-msec", "100"],
                                 stdout=open(work / "envoy.log", "w"), stderr=subprocess.STDOUT)
        procs.append(envoy)
        admin = f"http://127.0.0.1:{admin_port}"
        wait_until(lambda: requests.get(f"http://127.0.0.1:{envoy_port}/", timeout=1).status_code,
                   what="Envoy")
        for i in range(args.warmup):  # connections to the sidecar and replicas exist
            requests.get(f"http://127.0.0.1:{envoy_port}/warmup",  # not held
                         headers=headers_for(900_000 + i), timeout=5)
        before = stat_dict(admin)
        metrics_before = requests.get(f"{sidecar.admin}/metrics", timeout=5).text
        log_skip = sum(1 for _ in open(log_path)) if log_path.exists() else 0

        pids = {"envoy": envoy.pid, "sidecar": sidecar.proc.pid, "replicas": up.pid,
                "client": os.getpid()}
        cpu0 = {k: cpu_seconds(v) for k, v in pids.items()}
        t0 = time.monotonic()
        replies = loadgen.burst(envoy_port, args.streams, headers_for, ramp=args.ramp,
                                timeout=args.hold + 60)
        wall = time.monotonic() - t0
        cpu = {k: round(cpu_seconds(v) - cpu0[k], 2) for k, v in pids.items()}
        load = os.getloadavg()[0]
        time.sleep(1.0)  # the access log is flushed every 100 ms
        after = stat_dict(admin)
        metrics = requests.get(f"{sidecar.admin}/metrics", timeout=5).text
        rows = [json.loads(line) for line in open(log_path)][log_skip:]
        rows = [r for r in rows if r.get("to_upstream_us") not in (None, "-") or r["code"] != 200]
        sidecar.stop()
        sidecar_warnings = [line for line in (work / "sidecar.log").read_text().splitlines()
                            if "WARN" in line or "ERROR" in line]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    delta = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}

    def num(v):
        try:
            return int(v)
        except (TypeError, ValueError):
            return None

    result = {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "wall_s": round(wall, 2),
        "cpu_s_during_burst": cpu,
        "loadavg_1m": round(load, 1),
        "client": {
            "codes": dict(Counter(r.status or r.error for r in replies)),
            "reply_s": {k: round(v, 3) for k, v in
                        quantiles([r.seconds - args.hold for r in replies if not r.error]).items()},
            "decided": sum(1 for r in replies if r.headers.get("x-upstream-saw-reason", "-") != "-"),
        },
        "envoy_access_log": {
            "requests": len(rows),
            "accepted_to_upstream_ms": {k: round(v / 1000, 1) for k, v in
                                        quantiles([num(r["to_upstream_us"]) for r in rows]).items()},
            "ext_proc_call_ms": {k: round(v / 1000, 1) for k, v in
                                 quantiles([num(r["ext_proc_us"]) for r in rows]).items()},
            "ext_proc_status": dict(Counter(r["ext_proc_status"] for r in rows)),
            "flags": dict(Counter(r["flags"] for r in rows)),
        },
        "envoy_stats": {k: v for k, v in sorted(delta.items())
                        if k.startswith(("http.ingress.ext_proc.", "cluster.inferencecache_ext_proc.",
                                         "cluster.replicas.upstream_cx_overflow",
                                         "cluster.replicas.upstream_rq_pending_overflow",
                                         "cluster.replicas.upstream_cx_total",
                                         "http.ingress.downstream_cx_total",
                                         "http.ingress.downstream_rq_5xx",
                                         "listener."))
                        and "_bucket" not in k},
        "sidecar_decision_latency": histogram_quantiles(
            metrics, "inferencecache_decision_latency_seconds", 'path="ext_proc"'),
        "sidecar_decisions_in_burst": decisions(metrics) - decisions(metrics_before),
        "sidecar_warnings": sidecar_warnings[:5],
        "sidecar_warning_count": len(sidecar_warnings),
    }
    print(json.dumps(result, indent=2))
    s, c = result["envoy_stats"], result["client"]
    print(f"SUMMARY {args.template} streams={args.streams} ramp={args.ramp}s "
          f"concurrency={args.concurrency} streams_per_cx={args.streams_per_sidecar_cx} message_timeout={args.message_timeout or 'shipped'}"
          f"{' no-ext-proc' if args.no_ext_proc else ''}: codes={c['codes']} "
          f"decided={c['decided']}/{args.streams} "
          f"message_timeouts={s.get('http.ingress.ext_proc.message_timeouts', 0)} "
          f"reply_s={c['reply_s']} "
          f"accepted_to_upstream_ms={result['envoy_access_log']['accepted_to_upstream_ms']} "
          f"ext_proc_call_ms={result['envoy_access_log']['ext_proc_call_ms']} "
          f"sidecar_cx_new={s.get('cluster.inferencecache_ext_proc.upstream_cx_total', 0)} "
          f"sidecar_goaway={s.get('cluster.inferencecache_ext_proc.upstream_cx_close_notify', 0)} "
          f"sidecar_warnings={result['sidecar_warning_count']} "
          f"sidecar_decision={result['sidecar_decision_latency']} "
          f"cpu_s={cpu} wall_s={result['wall_s']} load={result['loadavg_1m']}", file=sys.stderr)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2))
    if args.keep:
        print(f"logs in {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)


def cpu_seconds(pid) -> float:
    """user + system CPU time of a process so far (Linux /proc)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def decisions(metrics: str) -> int:
    return int(sum(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("inferencecache_decisions_total{") and 'path="ext_proc"' in line))


def stat_dict(admin: str) -> dict:
    out = {}
    for line in requests.get(f"{admin}/stats", timeout=10).text.splitlines():
        name, _, value = line.partition(": ")
        if value.strip().isdigit():
            out[name] = int(value)
    return out


if __name__ == "__main__":
    main()
