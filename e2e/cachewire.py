"""A minimal client for inferencecache.v1.CacheService.IngestEvents.

The messages are hand-encoded protobuf (a handful of fields), sent through
grpcio's generic unary call, so the harness needs no generated stubs. Ingest goes
to the sidecar's ingest listener (`serve --ingest-addr`), with a bearer token when
the sidecar runs with `--ingest-token-file`.
"""

import grpc


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint((number << 3) | wire) + payload


def _bytes_field(number: int, data: bytes) -> bytes:
    return _field(number, 2, _varint(len(data)) + data)


def _string(number: int, s: str) -> bytes:
    return _bytes_field(number, s.encode()) if s else b""


def _packed(number: int, values) -> bytes:
    body = b"".join(_varint(v) for v in values)
    return _bytes_field(number, body) if body else b""


def _decode_varints(data: bytes) -> dict:
    """Top-level varint fields of a message: {field_number: value}."""
    return {n: v for n, v in _fields(data) if isinstance(v, int)}

def stored_event(hashes, token_counts=()) -> bytes:
    """A KvEvent holding one BlocksStored run starting at block 0."""
    stored = _packed(2, hashes) + _packed(3, token_counts)
    return _bytes_field(1, stored)


def cleared_event() -> bytes:
    """A KvEvent holding AllBlocksCleared."""
    return _bytes_field(3, b"")


def ingest(ingest_addr: str, tenant: str, model: str, scheme: str, replica: str,
           events, endpoint: str = "", token: str | None = None) -> dict:
    """Sends one IngestEvents call; returns {"applied": n, "rejected": n}.

    Raises grpc.RpcError when the sidecar refuses the call."""
    req = (_string(1, tenant) + _string(2, model) + _string(3, scheme)
           + _string(4, replica) + _string(5, endpoint)
           + b"".join(_bytes_field(6, e) for e in events))
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(ingest_addr) as channel:
        call = channel.unary_unary("/inferencecache.v1.CacheService/IngestEvents")
        raw = call(req, timeout=5, metadata=metadata)
    fields = _decode_varints(raw)
    return {"applied": fields.get(1, 0), "rejected": fields.get(2, 0)}


def report_stats(ingest_addr: str, tenant: str, model: str, scheme: str, replica: str,
                 waiting: int = 0, running: int = 0, token: str | None = None) -> None:
    """Sends one ReportStats call: the replica's engine queue (waiting + running),
    as a metrics scrape would read it. Raises grpc.RpcError when refused."""
    stats = _field(3, 0, _varint(waiting)) + _field(4, 0, _varint(running))
    req = (_string(1, tenant) + _string(2, model) + _string(3, scheme)
           + _string(4, replica) + _bytes_field(6, stats))
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(ingest_addr) as channel:
        call = channel.unary_unary("/inferencecache.v1.CacheService/ReportStats")
        call(req, timeout=5, metadata=metadata)


def _fields(data: bytes) -> list:
    """Top-level fields of a message: [(number, value)], a varint's value as an
    int, any other as its bytes (groups are not used)."""
    out, i = [], 0

    def varint():
        nonlocal i
        value, shift = 0, 0
        while True:
            b = data[i]
            i += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value

    while i < len(data):
        key = varint()
        if key & 7 == 0:
            out.append((key >> 3, varint()))
        elif key & 7 == 2:
            n = varint()
            out.append((key >> 3, data[i:i + n]))
            i += n
        elif key & 7 == 1:  # 64-bit (a double), as bytes
            out.append((key >> 3, data[i:i + 8]))
            i += 8
        elif key & 7 == 5:  # 32-bit, as bytes
            out.append((key >> 3, data[i:i + 4]))
            i += 4
        else:
            raise ValueError(f"wire type {key & 7} not expected")
    return out


REASONS = {1: "PREFIX_MATCH", 2: "TENANT_HOT", 3: "AFFINITY_HINT", 4: "NO_HINT",
           5: "UNKNOWN_TENANT", 6: "UNKNOWN_MODEL", 7: "UNKNOWN_HASH_SCHEME",
           8: "TIMEOUT", 9: "POLICY_REQUIRES_CHAIN"}


def lookup(grpc_addr: str, tenant: str, model: str, scheme: str, hashes,
           token_counts=()) -> tuple:
    """One LookupRoute call: (reason name, the best replica's id or None)."""
    req = (_string(1, tenant) + _string(2, model) + _string(3, scheme)
           + _packed(6, hashes) + _packed(7, token_counts))
    with grpc.insecure_channel(grpc_addr) as channel:
        call = channel.unary_unary("/inferencecache.v1.CacheService/LookupRoute")
        raw = call(req, timeout=5)
    fields = _fields(raw)
    reason = next((v for n, v in fields if n == 3), 0)
    best = next((v for n, v in fields if n == 1), None)
    replica = None
    if best is not None:
        replica = next((v for n, v in _fields(best) if n == 1), b"").decode() or None
    return REASONS.get(reason, str(reason)), replica
