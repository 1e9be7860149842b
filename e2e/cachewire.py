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
    fields, i = {}, 0
    while i < len(data):
        key, shift = 0, 0
        while True:
            b = data[i]
            i += 1
            key |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        value, shift = 0, 0
        while True:
            b = data[i]
            i += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        fields[key >> 3] = value
    return fields


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
