"""The README's "try it": `bash examples/demo/run.sh --serve`, then its curl twice.

Runs exactly what a newcomer runs: the script (which installs and builds what it
needs) as a subprocess, the request of examples/demo/try.sh (the one place the
command lives; the README and examples/demo/TRY.md quote it verbatim), and Ctrl-C.
The second answer must be a PREFIX_MATCH on the replica that served the first, with
cached prompt tokens reported by the engine; then the script must leave nothing
running and no port bound.
"""

import json
import os
import pathlib
import queue
import signal
import socket
import subprocess
import threading
import time

import openai
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
TRY = REPO / "examples/demo/try.sh"
# Envoy, the sidecar's three listeners, the engines' HTTP, KV event and replay ports.
# How long a test waits, as a person would, between a first answer and its repeat.
KV_EVENTS_SETTLE_S = 1.0
PORTS = (10000, 9090, 18051, 18052, 18001, 18002, 18003, 18011, 18012, 18013, 18021, 18022, 18023)
READY_LINE = "Ctrl-C stops everything."
# A cold clone builds both binaries first.
START_TIMEOUT_S = 900


def try_command() -> str:
    """The curl of examples/demo/try.sh: every line that is not a comment."""
    lines = [l for l in TRY.read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert lines and lines[0].startswith("curl "), lines
    return "\n".join(lines)


def bound(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def send_try() -> tuple[dict, dict]:
    """Runs try.sh; its response's headers (lowercase names) and JSON body."""
    out = subprocess.run(["bash", str(TRY)], capture_output=True, text=True, timeout=30, check=True)
    head, _, body = out.stdout.replace("\r\n", "\n").partition("\n\n")
    status, *lines = head.splitlines()
    assert status.split()[1] == "200", out.stdout
    headers = {k.strip().lower(): v.strip() for k, _, v in (l.partition(":") for l in lines)}
    return headers, json.loads(body)


@pytest.fixture
def demo():
    busy = [p for p in PORTS if bound(p)]
    if busy:
        pytest.fail(f"ports the demo needs are taken: {busy}")
    proc = subprocess.Popen(
        ["bash", "examples/demo/run.sh", "--serve"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: leftovers are findable
        # As in a terminal: a runner started in the background (SIGINT ignored,
        # which children inherit and bash cannot trap) must not hide Ctrl-C.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines: "queue.Queue[str | None]" = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen = []
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"not ready within {START_TIMEOUT_S} s:\n{''.join(seen)}")
            if line is None:
                pytest.fail(f"the script exited ({proc.wait()}) before it was ready:\n{''.join(seen)}")
            seen.append(line)
            if line.strip() == READY_LINE:
                break
        yield proc, "".join(seen)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_readme_curl_twice_is_a_prefix_match_with_cached_tokens(demo):
    proc, printed = demo
    command = try_command()
    # The command is the README's and TRY.md's, verbatim, and what the script prints.
    for doc in ("README.md", "examples/demo/TRY.md"):
        assert command in (REPO / doc).read_text(), f"{doc} does not quote examples/demo/try.sh"
    assert command in printed, printed

    # A person sends the second request seconds after the first; the engine's KV
    # events reach the sidecar asynchronously (milliseconds later), so the test
    # leaves them that time too before asking for the cached prefix.
    first_headers, first = send_try()
    time.sleep(KV_EVENTS_SETTLE_S)
    second_headers, second = send_try()
    served_first = first_headers["x-sim-replica"]
    assert first["object"] == "chat.completion", first
    assert first["choices"][0]["message"]["role"] == "assistant", first
    # Nothing was cached before the first; the second is routed on its blocks.
    assert first_headers["x-inferencecache-reason"] != "PREFIX_MATCH", first_headers
    assert second_headers["x-inferencecache-reason"] == "PREFIX_MATCH", second_headers
    assert second_headers["x-inferencecache-replica"] == served_first, (first_headers, second_headers)
    assert second_headers["x-sim-replica"] == served_first, second_headers
    assert int(second_headers["x-inferencecache-matched-tokens"]) > 0, second_headers
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["usage"]["prompt_tokens"], second["usage"]
    assert cached == int(second_headers["x-inferencecache-matched-tokens"]), (second, second_headers)

    # The OpenAI SDK, pointed at Envoy, gets the same: a prompt of its own.
    client = openai.OpenAI(
        base_url="http://127.0.0.1:10000/v1",
        api_key="unused",
        default_headers={"x-inferencecache-debug": "1"},
        max_retries=0,
        timeout=30,
    )
    messages = [{"role": "user", "content": "Which replica holds my prompt's KV blocks, and why does it matter?"}]
    sdk_first = client.chat.completions.with_raw_response.create(model="llama-3.2", messages=messages)
    time.sleep(KV_EVENTS_SETTLE_S)
    sdk_second = client.chat.completions.with_raw_response.create(model="llama-3.2", messages=messages)
    assert sdk_second.headers["x-inferencecache-reason"] == "PREFIX_MATCH", dict(sdk_second.headers)
    assert sdk_second.headers["x-inferencecache-replica"] == sdk_first.headers["x-sim-replica"]
    completion = sdk_second.parse()
    assert completion.choices[0].message.role == "assistant"
    assert completion.usage.prompt_tokens_details.cached_tokens > 0, completion.usage

    # Ctrl-C (to the script alone: it must stop its children itself).
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("the script did not stop within 20 s of SIGINT")
    deadline = time.monotonic() + 5
    while True:
        try:
            os.killpg(proc.pid, 0)
            left = True
        except ProcessLookupError:
            left = False
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    ps = subprocess.run(["ps", "-o", "pid,args", "-g", str(proc.pid)], capture_output=True, text=True).stdout
    assert not left, f"processes left after Ctrl-C:\n{ps}"
    assert [p for p in PORTS if bound(p)] == [], "ports still bound after Ctrl-C"
