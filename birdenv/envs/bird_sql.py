"""``BirdSQL-SQLite-v0``: answer a question about a live database with one SQL query (BIRD)."""

from __future__ import annotations

from typing import ClassVar

from birdenv.envs.base import ToolEnv, render_prompt
from birdenv.tasks import BirdTask

__all__ = ["BirdSQLEnv", "render_prompt"]


class BirdSQLEnv(ToolEnv):
    """
    ## Description
    Text-to-SQL in the style of BIRD: the agent gets a database schema, a question in natural
    language and its external knowledge ("evidence"), explores the SQLite database with
    ``execute_sql`` over several turns and ends with ``submit_solution``. The reward is BIRD's
    execution accuracy (:func:`birdenv.judge.ex.execution_accuracy`): the submitted query and the gold
    query run on the same fresh state and their rows are compared as sets. Every episode owns one
    persistent database session, isolated from every other episode; nothing it writes reaches the
    state the submission is judged on.

    ```python
    >>> import gymnasium as gym, birdenv
    >>> env = gym.make("BirdSQL-SQLite-v0")
    >>> obs, info = env.reset(seed=0)
    >>> sorted(info)
    ['category', 'db_id', 'messages', 'task_id', 'tools']

    ```

    ## Action Space
    ``Text``: the model's turn holding exactly one tool call, as in ``BirdCritic-SQLite-v0``, e.g.
    ``<tool_call>{"name": "submit_solution", "arguments": {"sql_list": ["SELECT ..."]}}</tool_call>``.

    ## Observation Space
    ``Text``: after ``reset``, the user prompt (schema with three rows per table, the question, the
    evidence, the tool instructions); after a step, the tool's response formatted by
    :func:`birdenv.tools.format_observation`, or the verdict by :func:`birdenv.tools.format_verdict`.

    ## Rewards
    1.0 when the submission is correct under BIRD's execution-accuracy rule, else 0.0 (``reward=
    "binary"`` and ``"fraction"`` are the same here: EX is one test). Exploration steps and
    malformed calls give 0. ``sql_list`` should hold one statement; when it holds more, **only the
    last one is the answer** and the others are ignored (not run); an empty list scores 0.

    The gold query runs on a pristine state of its own (``official=False``, its result cached
    per question), not after the submission on the same state as the official script does: there
    a submission that writes (``DELETE FROM t``) can empty the gold's result and then equal it, a
    reward hack. Here writes only reach the submission's own result. On every submission that
    does not write, the reward is the official EX.

    ## Starting State
    A question drawn with ``self.np_random`` (or ``options={"task_id": ...}``, the question id as
    an int or a string), on a fresh state of its database.

    ## Episode End
    Terminated after ``submit_solution``. Truncated after ``max_episode_steps`` turns (5 by default,
    the TimeLimit wrapper) with reward 0 and no verdict. A turn with no call, two calls, malformed
    JSON or an unknown tool gets an error observation and still counts.

    ## Info
    The keys of ``BirdCritic-SQLite-v0``: ``task_id`` (the question id as a string), ``db_id``,
    ``category`` (the difficulty), ``messages``, ``tools``; ``verdict`` after a submission.

    ## Arguments
    - ``suite``: a bundled suite name (default ``"bird-mini-eval"``; also ``"bird-mini-train"``), or
    - ``tasks`` (a BIRD JSONL/JSON path or a list of :class:`~birdenv.tasks.BirdTask`) with
      ``db_dir``, the folder holding ``{db_id}/{db_id}.sqlite`` (BIRD's official layout) or
      ``{db_id}/{db_id}_template.sqlite``; ``db_root``, its old name, still works and warns;
    - ``reward``: ``"binary"`` or ``"fraction"`` (equal here);
    - ``pool`` / ``pool_options``, ``statement_timeout``, ``max_rows``, ``max_result_bytes``: as in
      ``BirdCritic-SQLite-v0``;
    - ``prompt_options``: as in ``BirdCritic-SQLite-v0``; here a table is named when its name
      or a column's name is mentioned by the question or its evidence.

    The number of turns is Gymnasium's ``max_episode_steps``
    (``gym.make("BirdSQL-SQLite-v0", max_episode_steps=10)``); ``max_turns=`` is refused with a
    message that says so.

    ## Version History
    - v0: initial release.
    """

    task_type: ClassVar[type[BirdTask]] = BirdTask
