"""Play one episode of BirdCritic-SQLite-v0 with hand-written turns: explore, then submit the fix.

python examples/quickstart.py
"""

import gymnasium as gym

import birdenv  # noqa: F401  (registers the environments)
from birdenv.tools import format_tool_call

env = gym.make("BirdCritic-SQLite-v0")
obs, info = env.reset(seed=0)
task = env.unwrapped.task
print(f"task {info['task_id']} ({info['category']}): {task.query[:200]}\n")

obs, reward, terminated, truncated, info = env.step(
    format_tool_call("execute_sql", sql=task.issue_sql[0])
)
print(obs, "\n")
obs, reward, terminated, truncated, info = env.step(
    format_tool_call("submit_solution", sql_list=task.sol_sql)
)
print(obs, f"\nreward {reward}, terminated {terminated}")
env.close()
