"""Loopback stand-ins for LLM replicas that hold every response, as a generation does.

Run as a process of its own (it must not share the client's event loop or CPU):

    python3 e2e/held_upstream.py --hold 3 replica-a replica-b replica-c

prints one JSON line `{"replica-a": port, ...}` once listening, then serves until
killed. Every request is answered after `--hold` seconds with its replica id as the
body and, as response headers, what the replica saw of the routing headers:
`x-upstream-saw-destination` (the request's x-gateway-destination-endpoint, `-` when
absent) and `x-upstream-saw-reason`. Only paths under `/v1/` are held: any other path is
answered at once (Envoy start-up probes), and `GET /_peak` with
`{"peak": most requests held at the same time over all replicas, "served": held
requests answered}`. HTTP/1.1 keep-alive.
"""

import argparse
import asyncio
import json
import resource
import sys


def raise_fd_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Counts:
    active = 0
    peak = 0
    served = 0


class Replica:
    def __init__(self, replica_id: str, hold: float):
        self.replica_id = replica_id
        self.hold = hold

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split(" ")[1] if len(lines[0].split(" ")) > 1 else "/"
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers.setdefault(k.strip().lower(), []).append(v.strip())
                length = int(headers.get("content-length", ["0"])[0])
                if length:
                    await reader.readexactly(length)
                if path == "/_peak":
                    body = json.dumps({"peak": Counts.peak, "served": Counts.served}).encode()
                    extra = ""
                elif not path.startswith("/v1/"):
                    body, extra = self.replica_id.encode(), ""
                else:
                    Counts.active += 1
                    Counts.peak = max(Counts.peak, Counts.active)
                    try:
                        await asyncio.sleep(self.hold)
                    finally:
                        Counts.active -= 1
                    Counts.served += 1
                    body = self.replica_id.encode()
                    dest = ",".join(headers.get("x-gateway-destination-endpoint", [])) or "-"
                    reason = ",".join(headers.get("x-inferencecache-reason", [])) or "-"
                    extra = (f"x-served-by: {self.replica_id}\r\n"
                             f"x-upstream-saw-destination: {dest}\r\n"
                             f"x-upstream-saw-reason: {reason}\r\n")
                writer.write((f"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n"
                              f"content-length: {len(body)}\r\n{extra}\r\n").encode() + body)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


async def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hold", type=float, default=2.0)
    parser.add_argument("replicas", nargs="+")
    args = parser.parse_args()
    raise_fd_limit()
    ports = {}
    servers = []
    for rid in args.replicas:
        replica = Replica(rid, args.hold)
        server = await asyncio.start_server(replica.handle, "127.0.0.1", 0, backlog=4096)
        servers.append(server)
        ports[rid] = server.sockets[0].getsockname()[1]
    print(json.dumps(ports), flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(0)
