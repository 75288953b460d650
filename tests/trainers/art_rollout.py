"""OpenPipe ART's rollout shape against an OpenEnv server: run by the trainer venv's Python.

``python art_rollout.py ENV_URL POLICY_URL SEEDS_JSON GROUP_SIZE`` gathers one
``art.TrajectoryGroup`` per seed with ``art.gather_trajectory_groups``; each rollout asks
the policy through ``art.Model.openai_client()`` and steps the env with OpenEnv's
``GenericEnvClient(base_url=...)``. Prints one JSON line: the rewards, per group.
"""

import asyncio
import json
import sys

import art
from openenv import GenericEnvClient


async def rollout(model: art.Model, env_url: str, seed: int) -> art.Trajectory:
    client = model.openai_client()
    messages: list[dict] = [{"role": "system", "content": "Play wordguess: reply with one word."}]
    trajectory = art.Trajectory(messages_and_choices=list(messages), reward=0.0)
    async with GenericEnvClient(base_url=env_url) as env:
        result = await env.reset(seed=seed)
        while not result.done:
            messages.append({"role": "user", "content": json.dumps(result.observation)})
            trajectory.messages_and_choices.append(messages[-1])
            completion = await client.chat.completions.create(
                model=model.get_inference_name(), messages=messages
            )
            choice = completion.choices[0]
            trajectory.messages_and_choices.append(choice)
            messages.append({"role": "assistant", "content": choice.message.content or ""})
            result = await env.step({"word": choice.message.content})
            trajectory.reward += result.reward or 0.0
    return trajectory


async def main() -> None:
    env_url, policy_url, seeds, group_size = (
        sys.argv[1],
        sys.argv[2],
        json.loads(sys.argv[3]),
        int(sys.argv[4]),
    )
    model = art.Model(
        name="stand-in", project="stadium-trainers",
        inference_base_url=policy_url, inference_api_key="unused", inference_model_name="stand-in",
    )  # fmt: skip
    groups = await art.gather_trajectory_groups(
        (
            art.TrajectoryGroup(rollout(model, env_url, seed) for _ in range(group_size))
            for seed in seeds
        ),
        pbar_desc=None,
    )
    print(json.dumps({"rewards": [[t.reward for t in g.trajectories] for g in groups]}))


asyncio.run(main())
