"""The engines' own KV event code, from their PyPI wheels.

SGLang ships its KV event classes and `ZmqEventPublisher` (the PUB socket, the
replay ROUTER and its reply shape) in `sglang/srt/disaggregation/kv_events.py`.
That one module runs with msgspec, pyzmq and pydantic; its two imports from the
rest of SGLang (used only for DP-rank and endpoint helpers we never call) are
stubbed. The wheel is fetched once with `pip download --no-deps` (0.5.23: 39 MB,
0.5.3: 2.5 MB; a few seconds) and only the module is kept, in
$INFERENCECACHE_E2E_CACHE (default ~/.cache/inferencecache-e2e).

vLLM is not loaded the same way: its wheel is 336 MB (too heavy for every CI
run), so the vLLM shapes are written from its code instead (tests in
test_kv_events.py say which). SGLang's publisher is a copy of vLLM's, down to the
replay reply: 0.5.23 answers like vLLM 0.33 (`[b"", topic, seq, payload]`, end
`[b"", b"", -1, b""]`), 0.5.3 like vLLM 0.11 (`[b"", seq, payload]`, end
`[b"", -1, b""]`).

A download that fails fails the test: nothing is skipped.
"""

import importlib.util
import os
import pathlib
import subprocess
import sys
import types
import zipfile

CACHE = pathlib.Path(os.environ.get("INFERENCECACHE_E2E_CACHE",
                                    pathlib.Path.home() / ".cache" / "inferencecache-e2e"))
MODULE = "sglang/srt/disaggregation/kv_events.py"
_loaded = {}


def _stub_sglang_imports():
    """sglang.srt.runtime_context.get_parallel and sglang.srt.utils.network.NetworkAddress."""
    if "sglang.srt.runtime_context" in sys.modules:
        return
    for name in ("sglang", "sglang.srt", "sglang.srt.utils"):
        sys.modules.setdefault(name, types.ModuleType(name))
    rc = types.ModuleType("sglang.srt.runtime_context")

    def get_parallel():
        raise RuntimeError("not used by the publisher")

    rc.get_parallel = get_parallel
    net = types.ModuleType("sglang.srt.utils.network")

    class NetworkAddress:  # only describe_local_source and the load helpers use it
        @staticmethod
        def parse(_):
            raise ValueError("stub")

    net.NetworkAddress = NetworkAddress
    sys.modules["sglang.srt.runtime_context"] = rc
    sys.modules["sglang.srt.utils.network"] = net


def sglang_kv_events(version: str):
    """SGLang `version`'s kv_events module (its real classes and publisher)."""
    if version in _loaded:
        return _loaded[version]
    where = CACHE / f"sglang-{version}"
    source = where / "kv_events.py"
    if not source.exists():
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--disable-pip-version-check", "-d", str(where), f"sglang=={version}"],
                       check=True)
        wheels = list(where.glob(f"sglang-{version}-*.whl"))
        assert len(wheels) == 1, f"expected one sglang {version} wheel, got {wheels}"
        with zipfile.ZipFile(wheels[0]) as z:
            source.write_bytes(z.read(MODULE))
        wheels[0].unlink()
    _stub_sglang_imports()
    name = "sglang_kv_events_" + version.replace(".", "_")
    spec = importlib.util.spec_from_file_location(name, source)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    _loaded[version] = module
    return module
