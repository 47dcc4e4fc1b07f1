"""ALFWorldEnv on the real TextWorld engine: Gymnasium contract, episode rules, golden transcripts with and
without the engine patches, the official-data layout, agents and errors.

Regenerate the golden file (after a deliberate generator or engine change) with
``python tests/envs/test_alfworld_env.py --regenerate-golden``.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("textworld", reason="needs the alfworld extra: pip install -e .[alfworld]")

import gymnasium as gym
from gymnasium.utils.env_checker import check_env
from streamrl.agents.alfworld_agents import ALFWorldExpertAgent, ALFWorldRandomAgent
from streamrl.agents.base import Agent
from streamrl.agents.rollout import play_episode
from streamrl.envs import alfworld_gen as gen
from streamrl.envs import textworld_patches
from streamrl.envs.alfworld import ALFWorldEnv

pytestmark = pytest.mark.alfworld

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "alfworld_golden.json"


@pytest.fixture(scope="module")
def env() -> Any:
    e = ALFWorldEnv(split="eval_unseen")
    yield e
    e.close()


def test_passes_gymnasium_check_env(env: ALFWorldEnv) -> None:
    check_env(env, skip_render_check=True)
    obs, info = env.reset(seed=3)
    assert env.observation_space.contains(obs)
    for command in info["admissible_commands"]:
        assert env.action_space.contains(command)


def test_gym_make_works_without_prior_import() -> None:
    script = (
        "import gymnasium as gym\n"
        "env = gym.make('streamrl.envs:ALFWorld-v0', split='eval_unseen', max_steps=7)\n"
        "obs, info = env.reset(seed=0)\n"
        "print(info['task_id'], env.unwrapped.max_steps, 'Your task is to:' in obs)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    task_id, max_steps, has_task = out.split()
    assert task_id.startswith("alfworld/eval_unseen/") and max_steps == "7" and has_task == "True"
    assert gym.spec("streamrl/ALFWorld-v0").entry_point == "streamrl.envs.alfworld:ALFWorldEnv"


def test_episode_rules(env: ALFWorldEnv) -> None:
    task_id = env.task_ids[3]
    obs, info = env.reset(options={"task_id": task_id})
    assert info["task_id"] == task_id and info["task_type"] == "pick_heat_then_place_in_recep"
    assert obs.startswith("-= Welcome to TextWorld, ALFRED! =-") and not info["won"]
    assert info["gamefile"].endswith("game.tw-pddl") and info["steps"] == 0
    admissible = info["admissible_commands"]
    assert admissible == sorted(admissible) and "look" in admissible

    # An inadmissible command changes nothing but costs a step.
    obs, reward, terminated, truncated, info = env.step("dance with the fridge")
    assert (obs, reward, terminated, truncated) == ("Nothing happens.", 0.0, False, False)
    assert not info["action_valid"] and info["steps"] == 1 and info["admissible_commands"] == admissible

    # The walkthrough wins on its last command with reward 1.0; nothing before that is rewarded. Each admissible
    # "go to" moves its receptacle to the end of "visited" (least recently arrived at first).
    walkthrough = info["walkthrough"]
    assert info["visited"] == [] and any(c.startswith("go to ") for c in walkthrough)
    visited: list[str] = []
    for k, command in enumerate(walkthrough):
        obs, reward, terminated, truncated, info = env.step(command)
        assert info["action_valid"] and info["won"] == terminated == (k == len(walkthrough) - 1)
        assert reward == (1.0 if terminated else 0.0) and not truncated
        if command.startswith("go to "):
            visited = [r for r in visited if r != command[6:]] + [command[6:]]
        assert info["visited"] == visited
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("look")
    # An inadmissible "go to" moves nowhere and is not a visit; going back moves a receptacle to the end.
    info = env.reset(options={"task_id": task_id})[1]
    first, other = [c[6:] for c in info["admissible_commands"] if c.startswith("go to ")][:2]
    for command in (f"go to {first}", "go to the moon", f"go to {other}", f"go to {first}"):
        info = env.step(command)[4]
    assert info["visited"] == [other, first]

    # Truncation at max_steps (configurable), not termination.
    short = ALFWorldEnv(split="eval_unseen", max_steps=3)
    short.reset(options={"task_id": task_id})
    flags = [short.step("look")[2:4] for _ in range(3)]
    assert flags == [(False, False), (False, False), (False, True)]
    short.close()

    # reset(seed) draws the task from the env's generator: reproducible.
    ids = [env.reset(seed=s)[1]["task_id"] for s in (11, 12, 11)]
    assert ids[0] == ids[2] and ids[0] in env.task_ids


def test_sys_argv_survives_loads_patched_and_stock(env: ALFWorldEnv) -> None:
    argv = list(sys.argv)
    env.reset(options={"task_id": env.task_ids[10]})
    with textworld_patches.unpatched():
        env.reset(options={"task_id": env.task_ids[11]})
    assert sys.argv == argv and textworld_patches.patches_applied()


def _golden_games() -> list[Path]:
    """The smallest game of each task type among the first 24 of eval_unseen (the stock engine is slow)."""
    paths = gen.ensure_split("eval_unseen")[:24]
    chosen = []
    for task_type in gen.TASK_TYPES:
        of_type = [p for p in paths if task_type in p.parent.name]
        chosen.append(min(of_type, key=lambda p: (p.stat().st_size, p.parent.name)))
    return chosen


def _transcript(env: ALFWorldEnv, task_id: str) -> str:
    """One scripted episode: an unknown command, look/inventory, then the walkthrough with a look and a
    seeded admissible examine after every step, recording observations and admissible commands."""
    rng = random.Random(task_id)
    obs, info = env.reset(options={"task_id": task_id})
    lines = [obs, repr(info["admissible_commands"])]
    script = ["xyzzy", "look", "inventory"]
    for command in info["walkthrough"]:
        script += [command, "look"]
    for command in script:
        obs, reward, terminated, _, info = env.step(command)
        lines += [f"> {command}", obs, repr(info["admissible_commands"]), f"{reward} {info['won']}"]
        examines = [c for c in info["admissible_commands"] if c.startswith("examine")]
        if examines and not terminated:
            probe = rng.choice(examines)
            obs, *_ = env.step(probe)
            lines += [f"> {probe}", obs]
        if terminated:
            break
    return "\n".join(lines)


def _golden_digests(stock: bool) -> dict[str, str]:
    paths = _golden_games()
    env = ALFWorldEnv(game_files=[str(p) for p in paths], max_steps=200)
    out = {}
    for task_id in env.task_ids:
        if stock:
            with textworld_patches.unpatched():
                env.unwrapped._engine.loaded = None  # force a stock load + translation
                text = _transcript(env, task_id)
        else:
            text = _transcript(env, task_id)
        out[task_id] = hashlib.md5(text.encode()).hexdigest()
    env.close()
    return out


@pytest.mark.slow
def test_golden_transcripts_identical_with_and_without_patches() -> None:
    patched = _golden_digests(stock=False)
    stock = _golden_digests(stock=True)
    assert patched == stock
    golden = json.loads(GOLDEN.read_text())
    assert golden["generator_version"] == gen.GENERATOR_VERSION
    assert patched == golden["transcript_md5"]


def test_agents_follow_the_protocol_expert_wins_random_is_valid(env: ALFWorldEnv) -> None:
    expert, rand = ALFWorldExpertAgent(), ALFWorldRandomAgent(seed=0)
    assert isinstance(expert, Agent) and isinstance(rand, Agent)
    wins = []
    for task_id in env.task_ids[:12]:
        episode = play_episode(env, expert, options={"task_id": task_id})
        assert (
            episode.won and episode.reward == 1.0 and episode.steps == len(episode.final_info["walkthrough"])
        )
        episode = play_episode(env, rand, options={"task_id": task_id})
        assert all(t.action_valid for t in episode.turns)
        assert episode.won != episode.truncated and (episode.won or episode.steps == 50)
        wins.append(episode.won)
    print(f"random agent won {sum(wins)}/{len(wins)} eval_unseen games (50 steps)")
    # Same seed, same game -> same actions.
    a = play_episode(env, ALFWorldRandomAgent(seed=5), options={"task_id": env.task_ids[0]}).transcript()
    b = play_episode(env, ALFWorldRandomAgent(seed=5), options={"task_id": env.task_ids[0]}).transcript()
    assert a == b


def _write_official_tree(root: Path, sources: list[Path]) -> None:
    """Lay generated games out as the official data (json_2.1.1/<split>/<task>/<trial>/), without the
    walkthrough the official files lack; plus a movable-receptacle and an unsolvable game to be skipped."""
    for k, src in enumerate(sources):
        game = json.loads(src.read_text())
        traj = json.loads((src.parent / "traj_data.json").read_text())
        p = traj["pddl_params"]
        task = f"{traj['task_type']}-{p['object_target']}-None-{p['parent_target'] or p['toggle_target']}-{k}"
        for suffix, solvable in (("", True), ("-movable", True), ("-broken", False)):
            folder = root / "json_2.1.1" / "valid_unseen" / f"{task}{suffix}" / "trial_T2019_000"
            folder.mkdir(parents=True)
            official = {key: game[key] for key in ("pddl_domain", "grammar", "pddl_problem")}
            (folder / "game.tw-pddl").write_text(json.dumps({**official, "solvable": solvable}))
            shutil.copy(src.parent / "traj_data.json", folder / "traj_data.json")


def test_task_attributes_name_each_game_s_type_without_loading_it(env: ALFWorldEnv) -> None:
    """What evaluation breaks down by and ``TrainConfig.balance_by`` balances over: every game's type, as a reset
    of that game reports it, for all six types (``RolloutSession.task_attributes`` passes them through)."""
    from streamrl.algorithms.session import task_attributes

    attrs = task_attributes(env)
    assert sorted(attrs) == sorted(env.task_ids)
    assert {a["task_type"] for a in attrs.values()} == set(gen.TASK_TYPES)
    for task_id in env.task_ids[:6]:
        _, info = env.reset(options={"task_id": task_id})
        assert attrs[task_id] == {"task_type": info["task_type"]}


def test_official_data_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sources = [
        p for p in _golden_games() if "pick_and_place_simple" in p.parent.name or "look_at" in p.parent.name
    ]
    _write_official_tree(tmp_path, sources)
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    env = ALFWorldEnv(split="eval_unseen", data_path="$ALFWORLD_DATA")
    assert len(env.task_ids) == 2 and all(
        t.startswith("alfworld-official/valid_unseen/") for t in env.task_ids
    )
    assert not any("movable" in t or "broken" in t for t in env.task_ids)
    _, info = env.reset(options={"task_id": env.task_ids[0]})
    assert info["walkthrough"] == [] and info["task_type"] in gen.TASK_TYPES
    assert env.task_attributes()[env.task_ids[0]] == {"task_type": info["task_type"]}
    with pytest.raises(ValueError, match="has no walkthrough"):
        play_episode(env, ALFWorldExpertAgent(), options={"task_id": env.task_ids[0]})
    env.close()
    # With the planner the expert wins the official-layout games too.
    env = ALFWorldEnv(split="eval_unseen", data_path=tmp_path / "json_2.1.1", planner_walkthrough=True)
    for task_id in env.task_ids:
        assert play_episode(env, ALFWorldExpertAgent(), options={"task_id": task_id}).won
    env.close()


def test_explicit_game_files_and_two_envs_are_independent(env: ALFWorldEnv) -> None:
    paths = gen.ensure_split("eval_unseen")[:2]
    other = ALFWorldEnv(game_files=[str(p) for p in paths])
    assert other.task_ids == env.task_ids[:2]  # a generated game keeps its id when passed as a file
    # Interleaved walkthroughs of two different games in one process: each env has its own engine.
    _, info_a = other.reset(options={"task_id": other.task_ids[0]})
    _, info_b = env.reset(options={"task_id": env.task_ids[1]})
    plans = [info_a["walkthrough"], info_b["walkthrough"]]
    won = [False, False]
    for k in range(max(map(len, plans))):
        for i, e in enumerate((other, env)):
            if k < len(plans[i]):
                _, _, terminated, _, info = e.step(plans[i][k])
                assert info["action_valid"]
                won[i] = terminated
    assert won == [True, True]
    other.close()


def test_a_run_s_env_kwargs_size_the_training_split() -> None:
    # A config's env_kwargs reach every split as plain data: {"train": n} takes the first n generated training
    # games (the first 128 are the default split's) and leaves the other splits as they are.
    small = ALFWorldEnv(split="train", generation={"train": 130})
    first, default = ALFWorldEnv(split="train"), ALFWorldEnv(split="eval_unseen", generation={"train": 130})
    try:
        assert len(small.task_ids) == 130 and small.task_ids[:128] == first.task_ids
        assert len(default.task_ids) == gen.GenerationConfig().eval_unseen
    finally:
        for e in (small, first, default):
            e.close()


def test_bad_arguments_are_explained(env: ALFWorldEnv, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown split 'valid_seen'"):
        ALFWorldEnv(split="valid_seen")
    with pytest.raises(ValueError, match="max_steps must be an int >= 1, got 0"):
        ALFWorldEnv(split="eval_unseen", max_steps=0)
    with pytest.raises(FileNotFoundError, match="missing"):
        ALFWorldEnv(game_files=[str(tmp_path / "nope.tw-pddl")])
    with pytest.raises(ValueError, match=r"unknown generation field\(s\) \['games'\]; valid: \['train', "):
        ALFWorldEnv(split="train", generation={"games": 512})
    with pytest.raises(FileNotFoundError, match="no official ALFWorld split 'valid_seen'"):
        ALFWorldEnv(split="eval_seen", data_path=tmp_path)
    with pytest.raises(ValueError, match="unknown task_id 'alfworld/eval_unseen/9999"):
        env.reset(options={"task_id": "alfworld/eval_unseen/9999-pick_two_obj_and_place-FloorPlan1"})
    with pytest.raises(ValueError, match=r"unknown reset option\(s\) \['game'\]"):
        env.reset(options={"game": "x"})
    env.reset(seed=0)
    with pytest.raises(TypeError, match="action must be a str command, got int"):
        env.step(3)  # type: ignore[arg-type]
    closed = ALFWorldEnv(split="eval_unseen")
    closed.close()
    with pytest.raises(RuntimeError, match="closed"):
        closed.reset()


if __name__ == "__main__":
    if sys.argv[1:] == ["--regenerate-golden"]:
        digests = _golden_digests(stock=False)
        assert digests == _golden_digests(stock=True), "patched and stock transcripts differ"
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(
            json.dumps({"generator_version": gen.GENERATOR_VERSION, "transcript_md5": digests}, indent=1)
            + "\n"
        )
        print(f"wrote {GOLDEN}")


def test_prepare_generates_the_split_that_the_env_would_on_first_use(tmp_path: Path) -> None:
    """``ALFWorldEnv.prepare_data`` (what ``StreamingVectorEnv`` calls in the parent before its workers start) makes the
    games a later env reads without generating; with ``game_files`` or ``data_path`` there is nothing to make."""
    generation = {"train": 0, "eval_seen": 0, "eval_unseen": 2, "cache_dir": str(tmp_path), "workers": 1}
    ALFWorldEnv.prepare_data("eval_unseen", generation=generation)
    manifest = tmp_path / f"gen-v{gen.GENERATOR_VERSION}" / "eval_unseen" / "manifest.json"
    made = manifest.stat().st_mtime_ns
    env = ALFWorldEnv("eval_unseen", generation=generation)
    assert len(env.task_ids) == 2 and manifest.stat().st_mtime_ns == made  # read, not generated again
    env.close()
    ALFWorldEnv.prepare_data("eval_seen", game_files=["nowhere/game.tw-pddl"], generation=generation)
    assert not (tmp_path / f"gen-v{gen.GENERATOR_VERSION}" / "eval_seen").exists()
