"""The ``streamrl`` command line.

streamrl demo                  play Math-TIR test problems with the scripted solver through the real sandbox
streamrl alfworld-generate     generate the offline ALFWorld game splits into the cache
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _demo(args: argparse.Namespace) -> int:
    import gymnasium as gym
    import streamrl.envs  # noqa: F401  (registers the envs)
    from streamrl.agents.math_solver import MathSolverAgent
    from streamrl.agents.rollout import play_episode

    env = gym.make("streamrl/MathTIR-v0", split=args.split)
    agent = MathSolverAgent(env.unwrapped.tasks)  # type: ignore[attr-defined]
    try:
        wins, seconds = 0, 0.0
        for i in range(args.episodes):
            result = play_episode(env, agent, seed=args.seed + i)
            wins += result.won
            seconds += result.seconds
            if i < args.show:
                print(f"=== episode {i}: task {result.task_id} ===")
                print(result.transcript())
                print(
                    f"--- reward {result.reward:.1f}, {result.steps} turns, {result.seconds * 1000:.0f} ms\n"
                )
        print(
            f"score: {wins}/{args.episodes} solved ({wins / args.episodes:.1%}) on the Math-TIR {args.split} split, "
            f"{seconds / args.episodes * 1000:.0f} ms per episode"
        )
    finally:
        env.close()
    return 0


def _alfworld_generate(args: argparse.Namespace, rest: list[str]) -> int:
    from streamrl.envs.alfworld_gen import main as generate_main

    return int(generate_main(rest) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamrl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="play Math-TIR with the scripted solver through the real sandbox")
    demo.add_argument("--episodes", type=int, default=20, help="episodes to play (default 20)")
    demo.add_argument("--show", type=int, default=2, help="transcripts to print (default 2)")
    demo.add_argument("--split", default="test", choices=["train", "test"], help="task split (default test)")
    demo.add_argument("--seed", type=int, default=0, help="first reset seed (default 0)")
    sub.add_parser(
        "alfworld-generate",
        help="generate the offline ALFWorld splits into the cache (options: see --help of the subcommand)",
        add_help=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "alfworld-generate":
        return _alfworld_generate(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "demo":
        if args.episodes < 1:
            parser.error(f"--episodes must be >= 1, got {args.episodes}")
        return _demo(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
