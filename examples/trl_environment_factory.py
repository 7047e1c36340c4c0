"""Two GRPO steps of TRL's own multi-turn loop on the environment, with the offline tiny model.

pip install -e ".[train]" && python examples/trl_environment_factory.py
"""

import functools
import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl import GRPOConfig, GRPOTrainer

from birdenv import load_tasks
from birdenv.integrations.trl import BirdCriticTRLEnv, suite_dataset
from birdtrain.models import resolve_model

tasks = load_tasks("gym-mini")[:4]
trainer = GRPOTrainer(
    model=resolve_model("tiny"),
    args=GRPOConfig(
        output_dir="runs/trl-example",
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=32,
        max_steps=2,
        logging_steps=1,  # TRL logs every 500 steps by default: none in a two-step run
        report_to=[],
        use_cpu=True,
        max_tool_calling_iterations=2,
    ),
    train_dataset=suite_dataset(tasks),
    environment_factory=functools.partial(BirdCriticTRLEnv, tasks=tasks),
)
trainer.train()
for entry in trainer.state.log_history:
    if "loss" in entry:
        print(f"step {entry['step']}: loss {entry['loss']:.4f}, reward {entry['reward']:.3f}")
