"""Evaluating a policy: Success Rate on BIRD-CRITIC-style tasks by category, execution accuracy on
BIRD questions by difficulty, pass@k, 95 % intervals, official files.

The tasks decide the environment and the metric: debugging tasks (:class:`birdenv.tasks.Task`) run
in ``BirdCritic-SQLite-v0`` and are judged by the official judge (Success Rate, "SR"); BIRD
questions (:class:`birdenv.tasks.BirdTask`) run in ``BirdSQL-SQLite-v0`` with the same prompts'
rendering, tools and formatter, and are scored by execution accuracy ("EX"). One evaluation
holds one kind; a curriculum evaluates both side by side.

Policies behind one interface:

- a model (path, or ``tiny``/``smollm``/``qwen-coder-0.5b``/``qwen-coder-1.5b``): agent mode rolls it out through a vector environment with
  :func:`birdtrain.rollout.collect` (the prompts, tool schemas and formatter of training); single
  mode asks once for a ``<solution>``;
- ``endpoint:MODEL@URL``: any OpenAI-compatible chat endpoint
  (:class:`~birdtrain.policies.EndpointPolicy`), as an agent or single-shot, labelled ``MODEL``;
- ``oracle`` (submits the gold: 100 % on a validated suite), ``echo`` (submits the issue SQL; on
  BIRD questions, the gold with an extra column: 0 %), ``scripted`` (the offline expert of stage
  2), reference policies for sanity.

Outputs in ``out_dir``: ``predictions.jsonl`` in the official form (``instance_id``, ``pred_sqls``)
that the official evaluator accepts unchanged (for BIRD questions also ``predict.json``, BIRD's
official ``{question_id: "SQL\\t----- bird -----\\tdb_id"}`` form), ``verdicts.jsonl``,
``summary.json`` and the trajectory store (agent mode), and a table beside the paper's figures.
While it runs, each finished episode is saved in ``episodes.partial.jsonl`` (see
:class:`EvaluationProgress`): an evaluation that is interrupted resumes where it stopped when it is
run again into the same folder with the same settings.

The package, by job: :mod:`~birdtrain.evaluate.run` (:func:`evaluate_policy`, settings in
:class:`birdtrain.config.EvaluationConfig`), :mod:`~birdtrain.evaluate.progress` (the resume
file), :mod:`~birdtrain.evaluate.episodes` (the episode players), :mod:`~birdtrain.evaluate.scoring`
(judging and summaries), :mod:`~birdtrain.evaluate.files` (output files, the trajectory store),
:mod:`~birdtrain.evaluate.compare` (two evaluations task by task).
"""

from birdtrain.config import EvaluationConfig
from birdtrain.evaluate.compare import compare_evaluations
from birdtrain.evaluate.episodes import sharing_engines
from birdtrain.evaluate.files import read_verdicts
from birdtrain.evaluate.progress import PROGRESS_FILE, EvaluationProgress
from birdtrain.evaluate.run import episode_settings, evaluate_policy, policy_label
from birdtrain.evaluate.scoring import PAPER_BIRD_RESULTS, PAPER_RESULTS, describe_outcomes

__all__ = [
    "PAPER_BIRD_RESULTS",
    "PAPER_RESULTS",
    "PROGRESS_FILE",
    "EvaluationConfig",
    "EvaluationProgress",
    "compare_evaluations",
    "describe_outcomes",
    "episode_settings",
    "evaluate_policy",
    "policy_label",
    "read_verdicts",
    "sharing_engines",
]
