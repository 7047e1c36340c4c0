"""Eight trajectories at once in worker processes, each on its own database session.

Every copy runs the problematic SQL of its task, then submits it unchanged (reward 0 on a valid
task): a template for plugging in a model's turns.

    python examples/vector_rollouts.py
"""

import numpy as np

from birdenv.tools import format_tool_call
from birdenv.vector import make_vec

envs = make_vec(8, seed=0)
prompts, infos = envs.reset(seed=0)
tasks = {i: envs.call("get_wrapper_attr", "task")[i] for i in range(envs.num_envs)}
turns = [format_tool_call("execute_sql", sql=tasks[i].issue_sql[0]) for i in range(envs.num_envs)]
observations, rewards, terminated, truncated, infos = envs.step(turns)
for i, observation in enumerate(observations):
    print(f"[{infos['task_id'][i]}] {observation.splitlines()[0]}")
turns = [
    format_tool_call("submit_solution", sql_list=tasks[i].issue_sql) for i in range(envs.num_envs)
]
observations, rewards, terminated, truncated, infos = envs.step(turns)
print("rewards:", rewards, "all terminated:", bool(np.all(terminated)))
envs.close()
