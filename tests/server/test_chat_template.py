"""``--chat-template FILE``: a Jinja file replaces the tokenizer's template; a tokenizer
with no template and no flag answers chat with a 400 naming the flag; a name that is not
a file is refused at start-up."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess

from kvflow.runtime.server.args import parse_args

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}\\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}"
)
CHAT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def bare_tokenizer(embedded_ready: Path, tmp_path_factory) -> Path:
    """The embedded model's tokenizer without its chat template."""
    folder = tmp_path_factory.mktemp("bare-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_ready / name, folder / name)
    assert "chat_template" not in (folder / "tokenizer_config.json").read_text()
    return folder


def test_no_template_is_a_400_naming_the_flag(bare_tokenizer, tmp_path):
    proc = ServerProcess("--tokenizer-path", str(bare_tokenizer), log=tmp_path / "server.log")
    try:
        response = httpx.post(f"{proc.url}/v1/chat/completions", json=CHAT, timeout=60)
        assert response.status_code == 400
        assert "--chat-template" in response.json()["error"]["message"]
        ok = httpx.post(f"{proc.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        proc.stop()


def test_template_file_renders_chat(bare_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE + "\n")
    proc = ServerProcess(
        "--tokenizer-path",
        str(bare_tokenizer),
        "--chat-template",
        str(template),
        log=tmp_path / "server.log",
    )
    try:
        response = httpx.post(f"{proc.url}/v1/chat/completions", json=CHAT, timeout=60)
        assert response.status_code == 200, response.text
        tokenizer = AutoTokenizer.from_pretrained(str(bare_tokenizer))
        expected = tokenizer.encode("<|im_start|>user: Say hi\n<|im_start|>assistant: ")
        assert response.json()["usage"]["prompt_tokens"] == len(expected)
    finally:
        proc.stop()


@pytest.mark.parametrize("value", ["chatml", "missing/template.jinja"])
def test_unknown_template_is_refused_at_start(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--chat-template", value])
    assert exit_info.value.code == 2
    assert "Jinja template file" in capsys.readouterr().err


def test_json_template_is_refused(tmp_path, capsys):
    (tmp_path / "conv.json").write_text("{}")
    with pytest.raises(SystemExit):
        parse_args(["--chat-template", str(tmp_path / "conv.json")])
    assert "JSON conversation templates" in capsys.readouterr().err
