"""``BirdCritic-SQLite-v0``: debug a user's SQL on a live database, over several turns."""

from __future__ import annotations

from typing import ClassVar

from birdenv.envs.base import CHARSET, MAX_TEXT, ToolEnv, UnicodeText, render_prompt
from birdenv.tasks import Task

__all__ = ["CHARSET", "MAX_TEXT", "BirdCriticEnv", "UnicodeText", "render_prompt"]


class BirdCriticEnv(ToolEnv):
    """
    ## Description
    A user posts an issue and the SQL that misbehaves; the agent explores their SQLite database with
    ``execute_sql`` over several turns and ends with ``submit_solution``. The reward is the verdict
    of the official BIRD-CRITIC-SQLite evaluator on the submitted statements. Every episode owns one
    persistent database session, isolated from every other episode (copy-on-write replicas): writes,
    TEMP tables and pragmas persist across its turns and nobody else sees them.

    ```python
    >>> import gymnasium as gym, birdenv
    >>> env = gym.make("BirdCritic-SQLite-v0")
    >>> obs, info = env.reset(seed=0)
    >>> sorted(info)
    ['category', 'db_id', 'messages', 'task_id', 'tools']

    ```

    ## Action Space
    ``Text``: the model's turn, free text holding exactly one tool call in the format chat
    templates and TRL use, e.g.
    ``<tool_call>{"name": "execute_sql", "arguments": {"sql": "SELECT 1"}}</tool_call>``;
    :func:`birdenv.tools.format_tool_call` builds one.

    ## Observation Space
    ``Text``: after ``reset``, the user prompt (schema with three rows per table, the issue, the
    problematic SQL, the tool instructions); after a step, the tool's response, formatted by
    :func:`birdenv.tools.format_observation` (status, columns, first rows, row count, notices or the
    SQLite error) or the verdict.

    ## Rewards
    ``reward="binary"`` (default): 1.0 when the judge accepts the submission, else 0.0.
    ``reward="fraction"``: tests passed ÷ tests run. Exploration steps and malformed calls give 0.

    ## Starting State
    A task drawn with ``self.np_random`` (or ``options={"task_id": ...}``), on a fresh state of its
    database with ``preprocess_sql`` applied.

    ## Episode End
    Terminated after ``submit_solution``. Truncated after ``max_episode_steps`` turns (5 by
    default, the TimeLimit wrapper) with reward 0 and no verdict. A turn with no call, two calls,
    malformed JSON or an unknown tool gets an error observation and still counts.

    ## Arguments
    - ``suite``: a bundled suite name (default ``"critic-mini"``), or
    - ``tasks`` (a JSONL path or a list of :class:`~birdenv.tasks.Task`) with ``db_dir``, the
      folder holding ``{db_id}/{db_id}_template.sqlite``;
    - ``reward``: ``"binary"`` or ``"fraction"``;
    - ``pool``: a :class:`~birdenv.replicas.ReplicaPool` to share (default: the process's pool),
      or ``pool_options`` to build one;
    - ``statement_timeout``, ``max_rows``, ``max_result_bytes``: bounds of every ``execute_sql``;
    - ``prompt_options``: how the prompt shows the database, a
      :class:`~birdenv.schema.PromptOptions` or a mapping of its fields: ``schema="full"``
      (default, every table), ``"linked"`` (the tables the issue SQL names and their
      foreign-key neighbours) or ``"named"`` (those tables alone), ``sample_rows=True``
      (default) or ``False``.

    The number of turns is Gymnasium's ``max_episode_steps``
    (``gym.make("BirdCritic-SQLite-v0", max_episode_steps=10)``); ``max_turns=`` is refused with a
    message that says so.

    ## Version History
    - v0: initial release.
    """

    task_type: ClassVar[type[Task]] = Task
