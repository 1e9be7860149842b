#!/usr/bin/env python3
"""Writes the committed seed corpus of the fuzz targets (fuzz/seeds/<target>/).

The msgpack payloads are encoded by msgspec with the engines' own struct shapes
(vLLM's and SGLang's `kv_events` classes: array_like structs in the older
generation, tagged maps in the current one).
The policy seeds are the shipped examples. Rerun after changing a shape:

    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install msgspec
    /tmp/venv/bin/python fuzz/seeds/generate.py
"""

import pathlib
import struct
from typing import Optional, Union

import msgspec

ROOT = pathlib.Path(__file__).resolve().parent
REPO = ROOT.parent.parent
END = 0xFFFF_FFFF_FFFF_FFFF


# --- vLLM's classes, older generation: array_like, every slot ---------------

class ArrStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: Optional[int]
    token_ids: list
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = "GPU"
    lora_name: Optional[str] = None
    extra_keys: Optional[list] = None
    group_idx: int = 0
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class ArrRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list
    medium: Optional[str] = "GPU"
    group_idx: int = 0


class ArrCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class ArrBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Union[ArrStored, ArrRemoved, ArrCleared]]
    data_parallel_rank: Optional[int] = None


# --- current generation: tagged maps, defaults omitted ----------------------

class MapStored(msgspec.Struct, tag_field="type", tag="BlockStored", omit_defaults=True):
    block_hashes: list
    parent_block_hash: Optional[int]
    token_ids: list
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = "GPU"
    lora_name: Optional[str] = None
    extra_keys: Optional[list] = None


class MapRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved", omit_defaults=True):
    block_hashes: list
    medium: Optional[str] = "GPU"


class MapCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


class MapBatch(msgspec.Struct):
    ts: float
    events: list[Union[MapStored, MapRemoved, MapCleared]]
    data_parallel_rank: Optional[int] = None


enc = msgspec.msgpack.encode
TS = 1764581400.25
# Golden vLLM sha256_cbor event values (computed by vLLM's own hashing).
H0, H1 = 3236607068019569386, 1206300911754328078
DIGEST0 = bytes.fromhex("202da172482d928bbc42ab25b0151e2b895f13f41002e27b2ceabcfae6d332ea")


def payloads():
    t0 = list(range(1, 17))
    t1 = [100, 1000, 70000, 128000] + list(range(200, 212))
    yield "vllm_array_stored_removed", enc(ArrBatch(TS, [
        ArrStored([H0, H1], None, t0 + t1, 16, kv_cache_spec_kind="full_attention"),
        ArrRemoved([H1]),
    ], 0))
    yield "vllm_array_cleared", enc(ArrBatch(TS, [ArrCleared()]))
    yield "vllm_array_old_slots", enc([TS, [["BlockStored", [H0], None, t0, 16]], None])
    yield "vllm_map_stored", enc(MapBatch(TS, [
        MapStored([H0, H1], None, t0 + t1, 16, lora_name="adapter",
                  extra_keys=[["adapter"], ["adapter", ["img", 0], "salt"]]),
    ]))
    yield "vllm_map_cpu_and_removed", enc(MapBatch(TS, [
        MapStored([H1], H0, t1, 16, medium="CPU"),
        MapRemoved([H0, H1], medium=None),
        MapCleared(),
    ], 1))
    # A batch written as a map too (some builds), with an event type from the future.
    yield "map_batch_unknown_event", enc({"ts": TS, "events": [
        {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
         "token_ids": list(range(4)), "block_size": 4},
        {"type": "KVCacheSpecChanged", "spec": "sliding"},
    ], "data_parallel_rank": None})
    # SGLang: one BlockStored per page, parent = the previous page.
    pages = [0x5A5A0000 + i for i in range(4)]
    yield "sglang_pages", enc(ArrBatch(TS, [
        ArrStored([h], pages[i - 1] if i else None, list(range(16 * i, 16 * i + 16)), 16)
        for i, h in enumerate(pages)
    ]))
    # Raw digests as bytes, and the signed integers of very old builds.
    yield "hashes_bytes_and_signed", enc(ArrBatch(TS, [
        ArrStored([DIGEST0, b"\x01\x02", -2], None, list(range(48)), 16),
        ArrRemoved([-1, DIGEST0]),
    ]))
    # The literal minimal batch of the decoder's tests.
    yield "minimal_literal", bytes([0x93, 0xcb]) + struct.pack(">d", 2.0) + \
        bytes([0x91, 0x91, 0xb0]) + b"AllBlocksCleared" + bytes([0xc0])


def frames(*parts):
    return b"".join(struct.pack(">H", len(p)) + p for p in parts)


def seq(n):
    return n.to_bytes(8, "big")


def write(target, name, data):
    d = ROOT / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


def main():
    ps = dict(payloads())
    for name, data in ps.items():
        write("kv_payload", name, data)

    stored = ps["vllm_array_stored_removed"]
    write("kv_frames", "pub_default_topic", frames(b"", seq(0), stored))
    write("kv_frames", "pub_topic_map", frames(b"kv-events", seq(41), ps["vllm_map_stored"]))
    write("kv_frames", "replay_old", frames(b"", seq(7), ps["sglang_pages"]))
    write("kv_frames", "replay_old_end", frames(b"", seq(END), b""))
    write("kv_frames", "replay_current", frames(b"", b"kv-events", seq(7), stored))
    write("kv_frames", "replay_current_end", frames(b"", b"", seq(END), b""))
    write("kv_frames", "short_seq", frames(b"kv-events", b"\x00\x07", stored))

    hashes = "1a2b3c4d5e6f7a8b,2b3c4d5e6f7a8b9c,3c4d5e6f7a8b9cad,4d5e6f7a8b9cadbe"
    scope = [
        "x-inferencecache-tenant: demo",
        "x-inferencecache-model: demo-model",
        "x-inferencecache-hash-scheme: ic-content-v1",
    ]
    headers = {
        "readme_example": scope + [
            f"x-inferencecache-block-hashes: {hashes}",
            "x-inferencecache-block-token-counts: 16,16,16,16",
            "x-inferencecache-debug: 1",
        ],
        "envoy_request": [
            ":method:POST", ":path:/v1/completions", "content-type: application/json",
            "X-InferenceCache-Tenant: demo", "x-inferencecache-model:  demo-model ",
            "x-inferencecache-hash-scheme: ic-content-v1",
            "x-inferencecache-block-hashes: 1a2b3c4d5e6f7a8b , 2b3c4d5e6f7a8b9c",
            "x-inferencecache-block-token-counts: 16, 7",
            "x-gateway-destination-endpoint: 10.0.0.9:8000",
        ],
        "legacy_prefix": scope + [
            "x-inferencecache-prefix-hash: sha256:9f86d081884c7d65",
            "x-inferencecache-prefix-tokens: 512",
        ],
        "unequal_chain": scope + [
            f"x-inferencecache-block-hashes: {hashes}",
            "x-inferencecache-block-token-counts: 16,16",
            "x-inferencecache-debug: 1",
        ],
        "malformed_hash": scope + [
            "x-inferencecache-block-hashes: 0x1a2b,FFFF,,12345678901234567",
            "x-inferencecache-block-token-counts: 16,-1,4294967296",
        ],
        "repeated": scope + ["x-inferencecache-tenant: other", "x-inferencecache-debug: 1"],
        "shortcodes": ["0:demo", "1:demo-model", "2:vllm-sha256-cbor",
                       "3:ffffffffffffffff,0", "4:16,16", "7:1"],
    }
    for name, lines in headers.items():
        write("routing_headers", name, "\n".join(lines).encode())
    write("routing_headers", "not_utf8", b"x-inferencecache-tenant:\xff\xfe\nx-inferencecache-debug:1")

    policies = [REPO / "examples/standalone/policy.yaml"] + sorted((REPO / "manifests/samples").glob("*.yaml"))
    for p in policies:
        write("policy_yaml", p.parent.name + "_" + p.stem, p.read_bytes())
    # Two files: the example, then a second copy of its tenant (a duplicate).
    example = policies[0].read_text()
    write("policy_yaml", "two_files_duplicate", (example + "\0" + example.split("---")[0]).encode())


if __name__ == "__main__":
    main()
