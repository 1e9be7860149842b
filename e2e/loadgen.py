"""Many concurrent HTTP/1.1 requests from one asyncio loop, raw sockets, no dependency.

Used by the breaker test (test_breakers.py) and the burst measurement (burst.py).
One connection per request (`connection: close`), as thousands of independent LLM
clients would open.
"""

import asyncio
import resource
import time
from dataclasses import dataclass, field


def raise_fd_limit(needed: int):
    """Raise the soft open-files limit to the hard one; fail if that is not enough."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    if soft != resource.RLIM_INFINITY and soft < needed:
        raise RuntimeError(f"open-files limit {soft} < {needed} needed (raise `ulimit -n`)")


@dataclass
class Reply:
    status: int = 0
    headers: dict = field(default_factory=dict)
    body: bytes = b""
    started: float = 0.0  # monotonic seconds when the connection was opened
    seconds: float = 0.0  # until the whole response was read
    error: str = ""


async def request(port: int, path: str, headers: dict, timeout: float) -> Reply:
    reply = Reply(started=time.monotonic())
    writer = None
    try:
        async def go():
            nonlocal writer
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            head = f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n"
            head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
            writer.write(head.encode())
            await writer.drain()
            return await reader.read(-1)

        data = await asyncio.wait_for(go(), timeout)
        raw, _, reply.body = data.partition(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        reply.status = int(lines[0].split(" ")[1])
        for line in lines[1:]:
            k, _, v = line.partition(":")
            reply.headers[k.strip().lower()] = v.strip()
    except Exception as e:  # counted, never raised: the caller asserts on them
        reply.error = f"{type(e).__name__}: {e}"
    finally:
        if writer is not None:
            writer.close()
    reply.seconds = time.monotonic() - reply.started
    return reply


async def _burst(port, path, headers_for, n, ramp, timeout):
    async def one(i):
        if ramp > 0:
            await asyncio.sleep(ramp * i / n)
        return await request(port, path, headers_for(i), timeout)

    return await asyncio.gather(*(one(i) for i in range(n)))


def burst(port: int, n: int, headers_for, path: str = "/v1/completions",
          ramp: float = 0.0, timeout: float = 60.0) -> list:
    """`n` requests, the i-th with headers `headers_for(i)`, started evenly over `ramp`
    seconds (0: all at once); returns their Replies in order."""
    return asyncio.run(_burst(port, path, headers_for, n, ramp, timeout))
