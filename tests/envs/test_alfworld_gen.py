"""The offline ALFWorld game generator: determinism, the fixed splits, verified walkthroughs, the cache.

These run the real TextWorld engine. Splits are generated into the streamrl cache on first use
($STREAMRL_CACHE or ~/.cache/streamrl), so a CI machine pays generation once.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import pytest

pytest.importorskip("textworld", reason="needs the alfworld extra: pip install -e .[alfworld]")

import alfworld.gen.constants as C
from streamrl.envs import alfworld_gen as gen

pytestmark = pytest.mark.alfworld

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def split_files() -> dict[str, list[Path]]:
    config = gen.GenerationConfig()
    return {split: gen.ensure_split(split, config) for split in gen.SPLITS}


_DIGEST_SCRIPT = """
import hashlib, json, sys
from streamrl.envs import alfworld_gen as gen
for i in range(6):
    task_id, game, traj = gen.generate_game("eval_unseen", i)
    blob = json.dumps([task_id, game, traj], sort_keys=True).encode()
    print(task_id, hashlib.sha1(blob).hexdigest())
print("argv", sys.argv)
"""


def test_generation_is_byte_identical_across_processes_and_hash_seeds(
    split_files: dict[str, list[Path]],
) -> None:
    outputs = []
    for hash_seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", _DIGEST_SCRIPT, "keep-me"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        outputs.append(out)
    assert outputs[0] == outputs[1]
    lines = outputs[0].splitlines()
    # One game of each task type, in ALFWorld's task-type order; sys.argv survived six engine loads.
    assert [line.split()[0].split("-")[1] for line in lines[:6]] == list(gen.TASK_TYPES)
    assert lines[6] == "argv ['-c', 'keep-me']"
    # The files in the cache are exactly what the generator produces.
    for i, path in enumerate(split_files["eval_unseen"][:2]):
        task_id, game, traj = gen.generate_game("eval_unseen", i)
        assert json.loads(path.read_text()) == game
        assert json.loads((path.parent / "traj_data.json").read_text()) == traj
        assert task_id.endswith(path.parent.name)


def test_splits_sizes_task_types_and_floor_plans(split_files: dict[str, list[Path]]) -> None:
    assert {s: len(p) for s, p in split_files.items()} == {
        "train": 128,
        "eval_seen": 140,
        "eval_unseen": 134,
        "validation": 128,
    }
    problems: dict[str, set[str]] = {}
    for split, paths in split_files.items():
        problems[split] = set()
        for i, path in enumerate(paths):
            game = json.loads(path.read_text())
            traj = json.loads((path.parent / "traj_data.json").read_text())
            meta = game["streamrl"]
            assert meta["task_id"] == f"alfworld/{split}/{path.parent.name}"
            assert gen.parse_task_id(meta["task_id"]) == (split, i)
            assert meta["task_type"] == traj["task_type"] == gen.TASK_TYPES[i % 6]
            scenes = C.TEST_SCENE_NUMBERS if split == "eval_unseen" else C.TRAIN_SCENE_NUMBERS
            assert meta["floor_plan"] in scenes
            room = next(r for r, ns in C.SCENE_TYPE.items() if meta["floor_plan"] in ns)
            assert room in C.GOALS_VALID[meta["task_type"]]
            assert game["solvable"] is True and game["walkthrough"]
            assert "UNKNOWN GOAL" not in game["grammar"]
            assert traj["turk_annotations"]["anns"][0]["task_desc"] in game["grammar"]
            problems[split].add(game["pddl_problem"])
        assert len(problems[split]) == len(paths)  # no duplicate games within a split
    # the training floor plans host train, eval_seen and validation: three sets of different games
    assert not problems["train"] & problems["eval_seen"]
    assert not problems["validation"] & (problems["train"] | problems["eval_seen"])


def _play_all(paths: list[str]) -> list[tuple[str, bool, int, int, bool]]:
    """Play each game with the expert; (task id, won, steps, walkthrough length, won before the end)."""
    from streamrl.agents.alfworld_agents import ALFWorldExpertAgent
    from streamrl.agents.rollout import play_episode
    from streamrl.envs.alfworld import ALFWorldEnv

    env = ALFWorldEnv(game_files=paths)
    agent = ALFWorldExpertAgent()
    results = []
    for task_id in env.task_ids:
        episode = play_episode(env, agent, options={"task_id": task_id})
        early = any(t.reward > 0 for t in episode.turns[:-1])
        results.append((task_id, episode.won, episode.steps, len(episode.final_info["walkthrough"]), early))
    env.close()
    return results


@pytest.mark.slow
def test_every_game_is_won_by_its_walkthrough(split_files: dict[str, list[Path]]) -> None:
    """Acceptance: all 530 games of the four splits are won by the expert replaying the stored walkthrough,
    exactly on its last command, every command admissible. Processes, not threads (the engine is not
    thread-safe)."""
    paths = [str(p) for split in gen.SPLITS for p in split_files[split]]
    chunks = [paths[k::2] for k in range(2)]
    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
        results = [r for chunk in pool.map(_play_all, chunks) for r in chunk]
    assert len(results) == 530
    failures = [r for r in results if not (r[1] and r[2] == r[3] and not r[4])]
    assert not failures, failures
    lengths = {t: [r[2] for r in results if t in r[0]] for t in gen.TASK_TYPES}
    print({t: round(sum(v) / len(v), 1) for t, v in lengths.items()})


def _ensure_tiny(cache_dir: str) -> list[str]:
    config = gen.GenerationConfig(train=0, eval_seen=0, eval_unseen=3, cache_dir=cache_dir, workers=1)
    return [str(p) for p in gen.ensure_split("eval_unseen", config)]


def test_concurrent_processes_share_the_cache_safely(tmp_path: Path) -> None:
    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
        a, b = pool.map(_ensure_tiny, [str(tmp_path)] * 2)
    assert a == b and len(a) == 3
    split_root = Path(a[0]).parents[1]
    manifest = json.loads((split_root / "manifest.json").read_text())
    assert manifest["task_ids"] == [f"alfworld/eval_unseen/{Path(p).parent.name}" for p in a]
    # Only finished game folders and the manifest: no temporary leftovers.
    assert sorted(p.name for p in split_root.iterdir()) == sorted(
        [*(Path(p).parent.name for p in a), "manifest.json"]
    )
    # A larger request extends the split; the first games do not change. A deleted game comes back.
    before = Path(a[1]).read_bytes()
    shutil.rmtree(Path(a[1]).parent)
    config = gen.GenerationConfig(train=0, eval_seen=0, eval_unseen=4, cache_dir=str(tmp_path), workers=1)
    assert [str(p) for p in gen.ensure_split("eval_unseen", config)][:3] == a
    assert Path(a[1]).read_bytes() == before


# A new user's script, as written without an ``if __name__ == "__main__":`` guard: every multiprocessing
# spawn child re-runs it. Issue 14: the parent held the cache lock while its spawned generation workers,
# re-running this script, waited for that lock -- forever.
_USER_SCRIPT = """
from streamrl.envs.alfworld_gen import GenerationConfig, ensure_split
first = ensure_split("train", GenerationConfig(train=2, workers=1))
extra = ensure_split("train", GenerationConfig(train=6, workers=2))
assert extra[:2] == first, (first, extra)
print("games", len(extra))
"""


def test_extra_games_on_a_fresh_cache_with_two_workers_do_not_deadlock(tmp_path: Path) -> None:
    script = tmp_path / "user_script.py"
    script.write_text(_USER_SCRIPT)
    env = {**os.environ, "STREAMRL_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so that a hang is cleaned up with every worker
    )
    try:
        out, err = proc.communicate(timeout=240)  # ~15 s on a loaded 2-core machine
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("generating 4 extra games with 2 workers on a fresh cache hung (issue 14)")
    assert proc.returncode == 0, err
    assert out.split() == ["games", "6"]
    split_root = tmp_path / "cache" / "alfworld" / f"gen-v{gen.GENERATOR_VERSION}" / "train"
    manifest = json.loads((split_root / "manifest.json").read_text())
    assert len(manifest["task_ids"]) == 6
    assert sorted(p.name for p in split_root.iterdir() if p.name != "manifest.json") == sorted(
        t.split("/")[2] for t in manifest["task_ids"]
    )  # only finished game folders, no temporary ones
    # The games the workers wrote are the games this process generates.
    task_id, game, _ = gen.generate_game("train", 5)
    assert json.loads((split_root / task_id.split("/")[2] / "game.tw-pddl").read_text()) == game


def test_alfworlds_own_env_reads_the_generated_games(split_files: dict[str, list[Path]]) -> None:
    """alfworld's AlfredTWEnv (with its hand-coded expert) loads our folder tree as it would the official data."""
    from alfworld.agents.environment import get_environment

    root = str(split_files["eval_unseen"][0].parents[1])
    config = {
        "env": {
            "type": "AlfredTWEnv",
            "goal_desc_human_anns_prob": 0.0,
            "task_types": [1, 2, 3, 4, 5, 6],
            "domain_randomization": False,
            "expert_type": "handcoded",
        },
        "dataset": {
            "data_path": root,
            "eval_id_data_path": root,
            "eval_ood_data_path": root,
            "num_train_games": -1,
            "num_eval_games": -1,
        },
        "general": {"training_method": "dagger"},
        "dagger": {"training": {"max_nb_steps_per_episode": 50}},
        "rl": {"training": {"max_nb_steps_per_episode": 50}},
    }
    tw_env = get_environment("AlfredTWEnv")(config, train_eval="train")
    assert tw_env.num_games == len(split_files["eval_unseen"]) == 134
    env = tw_env.init_env(batch_size=1)
    obs, infos = env.reset()
    assert "Your task is to:" in obs[0] and infos["admissible_commands"][0]
    env.close()


def test_bad_arguments_are_explained() -> None:
    with pytest.raises(ValueError, match="train must be an int >= 0"):
        gen.GenerationConfig(train=-1)
    with pytest.raises(ValueError, match="unknown split 'test'"):
        gen.ensure_split("test")
    with pytest.raises(ValueError, match="malformed ALFWorld task id 'alfworld/dev/1'"):
        gen.parse_task_id("alfworld/dev/1")
    from streamrl.envs.alfworld import ALFWorldEnv

    with pytest.raises(
        ValueError, match="split 'validation' is generated only; the official ALFWorld data has"
    ):
        ALFWorldEnv("validation", data_path="/nonexistent")
