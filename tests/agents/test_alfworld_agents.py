"""ALFWorldSearchAgent: an expert that wins by searching, from what the agent sees, and recovers from noise."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("textworld", reason="needs the alfworld extra: pip install -e .[alfworld]")

from streamrl.agents.alfworld_agents import ALFWorldSearchAgent, ALFWorldTask
from streamrl.envs.alfworld import ALFWorldEnv

pytestmark = pytest.mark.alfworld


def _play(
    env: ALFWorldEnv, task_id: str, noise: float = 0.0, seed: int = 0, search: str = "room_order"
) -> tuple[bool, int]:
    """One episode of the search agent; the walkthrough is removed from every info so it cannot peek."""
    agent, rng = ALFWorldSearchAgent(search=search, seed=seed), random.Random(seed)
    obs, info = env.reset(options={"task_id": task_id})
    while True:
        seen: dict[str, Any] = {k: v for k, v in info.items() if k != "walkthrough"}
        (action,) = agent.act([obs], [seen], [0])
        if noise and rng.random() < noise:
            action = rng.choice([c for c in info["admissible_commands"] if c != "help"])
        obs, _, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            agent.end_episode(0)
            return bool(info["won"]), int(info["steps"])


@pytest.mark.slow
def test_search_agent_wins_every_training_game_without_the_walkthrough() -> None:
    env = ALFWorldEnv(split="train", max_steps=100)
    try:
        results = [_play(env, t) for t in env.task_ids]
    finally:
        env.close()
    assert all(won for won, _ in results), [
        t for t, (won, _) in zip(env.task_ids, results, strict=True) if not won
    ]
    # Searching costs steps: within ALFWorld's own 50-step limit it still wins most games (measured 111/128).
    assert sum(steps <= 50 for _, steps in results) >= 0.85 * len(results)


def test_search_agent_recovers_from_random_actions() -> None:
    # DART-style noise: a random admissible command at 20% of the turns (dropping, opening, wandering off);
    # the agent decides from the state it finds, so it still wins (measured 16/16 on these games).
    env = ALFWorldEnv(split="eval_unseen", max_steps=100)
    try:
        wins = [_play(env, t, noise=0.2, seed=i)[0] for i, t in enumerate(env.task_ids[:16])]
    finally:
        env.close()
    assert sum(wins) >= 14, wins


def test_random_search_wins_too() -> None:
    # Memoryless search (a random other receptacle at each search step): measured 59/64 training games within
    # ALFWorld's 50-step limit, in fewer steps on average than the room-order search.
    env = ALFWorldEnv(split="train", max_steps=50)
    try:
        results = [_play(env, t, seed=i, search="random") for i, t in enumerate(env.task_ids[:16])]
    finally:
        env.close()
    assert sum(won for won, _ in results) >= 13, results
    rooms = ["cabinet 2", "cabinet 1", "fridge 1", "microwave 1", "sinkbasin 1"]
    task, rng = ALFWorldTask("heat", "apple", "fridge"), random.Random(0)
    here = ["examine sinkbasin 1"]
    picks = {
        ALFWorldSearchAgent.decide(task, rooms, "You arrive at sinkbasin 1.", here, rng=rng)
        for _ in range(200)
    }
    assert picks == {f"go to {r}" for r in rooms if r != "sinkbasin 1"}
    with pytest.raises(ValueError, match="search must be one of"):
        ALFWorldSearchAgent(search="spiral")


def test_frontier_search_wins_by_taking_the_first_receptacle_left_to_search() -> None:
    # Its search step is the first line of the "Left to search" list of ALFWorldPrompt(list_go_to="frontier")
    # (receptacles not visited yet, in the admissible commands' order). Measured: 113/128 training games within
    # 50 steps, as many as the room-order search (111/128). Cloned by the SFT recipe it did worse than the
    # room-order expert (docs/sft.md), so the recipe keeps that one.
    env = ALFWorldEnv(split="train", max_steps=50)
    try:
        results = [_play(env, t, search="frontier") for t in env.task_ids[:16]]
    finally:
        env.close()
    assert sum(won for won, _ in results) >= 13, results
    rooms = ["cabinet 2", "cabinet 1", "fridge 1", "sinkbasin 1"]
    go = [f"go to {r}" for r in sorted(rooms)]
    task = ALFWorldTask("heat", "apple", "fridge")
    assert ALFWorldSearchAgent.decide(task, rooms, "You arrive.", go, visited=[]) == "go to cabinet 1"
    here = ["examine cabinet 1", *go]
    step = ALFWorldSearchAgent.decide(task, rooms, "You arrive.", here, visited=["cabinet 1"])
    assert step == "go to cabinet 2"  # the room description's order would go to fridge 1


@pytest.mark.parametrize(
    ("text", "task"),
    [
        ("put some pan on sinkbasin.", ALFWorldTask("place", "pan", "sinkbasin")),
        ("put a hot apple in fridge", ALFWorldTask("heat", "apple", "fridge")),
        ("cool some potato and put it in microwave", ALFWorldTask("cool", "potato", "microwave")),
        ("put a clean cloth in garbagecan", ALFWorldTask("clean", "cloth", "garbagecan")),
        ("find two remotecontrol and put them in ottoman", ALFWorldTask("two", "remotecontrol", "ottoman")),
        ("examine the keychain with the floorlamp", ALFWorldTask("light", "keychain", lamp="floorlamp")),
    ],
)
def test_task_parsing(text: str, task: ALFWorldTask) -> None:
    assert ALFWorldTask.parse(text) == task


def test_unknown_task_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="slice the bread"):
        ALFWorldTask.parse("slice the bread")


def test_decisions_follow_the_rules() -> None:
    rooms = ["cabinet 2", "cabinet 1", "fridge 1", "microwave 1", "sinkbasin 1"]
    task = ALFWorldTask("heat", "apple", "fridge")
    decide = ALFWorldSearchAgent.decide
    # From the middle of the room: the first receptacle the room description names.
    assert decide(task, rooms, "You are in the middle of a room.", ["help", "look"]) == "go to cabinet 2"
    # A closed receptacle is opened; an empty one is left for the next in room order (wrapping).
    assert decide(task, rooms, "The cabinet 1 is closed.", ["examine cabinet 1", "open cabinet 1"]) == (
        "open cabinet 1"
    )
    assert decide(task, rooms, "You arrive at sinkbasin 1.", ["examine sinkbasin 1"]) == "go to cabinet 2"
    # Target seen: take it; just taken: to the tool; there: heat; heated: to the destination, open, put.
    seen = ["examine cabinet 1", "take apple 2 from cabinet 1", "take egg 1 from cabinet 1"]
    assert decide(task, rooms, "In it, you see a apple 2.", seen) == "take apple 2 from cabinet 1"
    held = ["examine apple 2", "examine cabinet 1", "move apple 2 to cabinet 1"]
    assert decide(task, rooms, "You pick up the apple 2 from the cabinet 1.", held) == "go to microwave 1"
    at_tool = ["examine apple 2", "examine microwave 1", "heat apple 2 with microwave 1", "open microwave 1"]
    assert decide(task, rooms, "You arrive at microwave 1.", at_tool) == "heat apple 2 with microwave 1"
    assert decide(task, rooms, "You heat the apple 2 using the microwave 1.", at_tool) == "go to fridge 1"
    at_dest = ["cool apple 2 with fridge 1", "examine apple 2", "examine fridge 1", "open fridge 1"]
    assert decide(task, rooms, "The fridge 1 is closed.", at_dest) == "open fridge 1"
    assert decide(task, rooms, "You open the fridge 1.", [*at_dest, "move apple 2 to fridge 1"]) == (
        "move apple 2 to fridge 1"
    )
    # Holding something else (after a stray action): put it down first.
    wrong = ["examine cabinet 1", "examine egg 1", "move egg 1 to cabinet 1"]
    assert (
        decide(task, rooms, "You pick up the egg 1 from the cabinet 1.", wrong) == "move egg 1 to cabinet 1"
    )


def test_turn_errors_classifies_a_search_slip_by_where_it_goes() -> None:
    # benchmarks/alfworld_turn_errors.py tells apart the ways a search step fails; docs/sft.md reports them.
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "alfworld_turn_errors.py"
    module_spec = importlib.util.spec_from_file_location("alfworld_turn_errors", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    room = ["cabinet 1", "cabinet 2", "fridge 1"]
    cases = {
        "go to cabinet 2": "go to:right",
        "go to cabinet 1": "go to:where it is",
        "go to fridge 1": "go to:other receptacle",
        "go to armchair 1": "go to:not in the room",
        "open cabinet 1": "go to:no go to",
    }
    for action, expected in cases.items():
        assert module.classify("go to cabinet 2", action, room, "cabinet 1") == expected, action
    assert (
        module.classify("take egg 1 from cabinet 1", "take egg 1 from cabinet 1", room, None) == "take:right"
    )
    assert (
        module.classify("take egg 1 from cabinet 1", "take mug 1 from cabinet 1", room, None) == "take:wrong"
    )
