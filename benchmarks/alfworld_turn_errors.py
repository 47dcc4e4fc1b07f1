"""Where an ALFWorld checkpoint's play goes wrong: each turn classified against the room-order expert.

Plays the first ``--games`` games of ``--split`` with the checkpoint, greedily or at ``--temperature`` (seeded;
the env's own prompt format and context policy, the 50-step limit) and, before every step, asks
``ALFWorldSearchAgent.decide`` what the expert would do in the same state. A turn is counted by the expert's command type and how the model's command relates
to it: for a search step (``go to``), the right receptacle, one the room has not got, another of the room, the
one it is at already, or no ``go to`` at all; for any other step, right or wrong. Success rates on whole splits
are ``bench_cold_start.py``'s; this says which step the policy misses::

    python benchmarks/alfworld_turn_errors.py CHECKPOINT_DIR --split eval_seen --games 8 --temperature 0 1
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path
from typing import Any


def classify(expert: str, action: str, receptacles: list[str], current: str | None) -> str:
    """The class of the model's ``action`` where the expert would issue ``expert``."""
    if not expert.startswith("go to "):
        return f"{expert.split(' ')[0]}:" + ("right" if action == expert else "wrong")
    if action == expert:
        return "go to:right"
    if not action.startswith("go to "):
        return "go to:no go to"
    target = action[len("go to ") :]
    if target == current:
        return "go to:where it is"
    return "go to:other receptacle" if target in receptacles else "go to:not in the room"


def _play(spec: Any, backend: Any, env: Any, task_ids: list[str], temperature: float) -> dict[str, Any]:
    """Play ``task_ids`` one at a time at ``temperature`` (seed 0) and count the turns by class."""
    from streamrl.agents import SamplingParams
    from streamrl.agents.alfworld_agents import ALFWorldSearchAgent

    sampling = SamplingParams(max_new_tokens=spec.max_new_tokens, temperature=temperature, seed=0)
    agent = spec.llm_agent(backend, sampling)
    counts: collections.Counter[str] = collections.Counter()
    wins = 0
    for episode, task_id in enumerate(task_ids):
        obs, info = env.reset(options={"task_id": task_id})
        task, receptacles = ALFWorldSearchAgent._read_first_observation(obs, episode)
        current, reward, done = None, 0.0, False
        while not done:
            commands = [str(c) for c in info["admissible_commands"]]
            expert = ALFWorldSearchAgent.decide(task, receptacles, obs, commands)
            action = agent.act([obs], [info], [episode])[0]
            counts[classify(expert, action, receptacles, current)] += 1
            if action.startswith("go to ") and action[len("go to ") :] in receptacles:
                current = action[len("go to ") :]
            obs, reward, terminated, truncated, info = env.step(action)
            done = terminated or truncated
        agent.end_episode(episode)
        wins += int(float(reward) > 0)
    return {"temperature": temperature, "wins": wins, "turns": dict(sorted(counts.items()))}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", type=Path, help="an ALFWorld SFT checkpoint directory")
    parser.add_argument("--split", default="eval_seen", help="eval_seen, eval_unseen or train")
    parser.add_argument("--games", type=int, default=8, help="the first this-many games of the split")
    parser.add_argument(
        "--temperature", type=float, nargs="+", default=[0.0], help="0 = greedy; one run each"
    )
    parser.add_argument("--output", type=Path, default=None, help="JSON file (default: print only)")
    args = parser.parse_args()
    if args.games < 1:
        parser.error(f"--games must be >= 1, got {args.games}")
    if any(t < 0 for t in args.temperature):
        parser.error(f"--temperature must be >= 0, got {args.temperature}")

    import torch

    torch.set_num_threads(1)
    from streamrl.agents import HFBackend
    from streamrl.agents.env_specs import env_spec, make_env, task_ids_of

    spec = env_spec("alfworld")
    backend = HFBackend(str(args.checkpoint))
    env = make_env("alfworld", args.split)
    try:
        task_ids = task_ids_of(env, "alfworld")[: args.games]
        runs = [_play(spec, backend, env, task_ids, t) for t in args.temperature]
    finally:
        env.close()
    result = {"checkpoint": str(args.checkpoint), "split": args.split, "games": len(task_ids), "runs": runs}
    print(json.dumps(result, indent=2))
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
