"""ALFWorld (text) as a Gymnasium env on the real TextWorld PDDL engine, fully offline.

By default the env plays the fixed generated splits of ``streamrl.envs.alfworld_gen`` (generated into the
cache on first use); it can also play explicit ``game.tw-pddl`` files or the official ALFWorld data
(``data_path``, e.g. ``"$ALFWORLD_DATA"``), with the same text, commands and rewards as ALFWorld 0.4's
``AlfredTWEnv``: ``PddlEnv`` wrapped by alfworld's ``AlfredDemangler``.

    import gymnasium as gym
    env = gym.make("streamrl/ALFWorld-v0", split="eval_unseen")
    obs, info = env.reset(options={"task_id": "alfworld/eval_unseen/0003-pick_heat_then_place_in_recep-FloorPlan1"})
    obs, reward, terminated, truncated, info = env.step(info["walkthrough"][0])

One engine per env, reused across games with ``load`` (each new ``PddlEnv`` dlopens a private copy of
the 34 MB planner library that is never freed); engines of closed envs are reused by later envs in the
same process. The engine is not thread-safe: run parallel envs in processes.

``textworld_patches`` (applied on import) makes steps and resets many times faster than stock TextWorld's,
with the same transcripts; what each costs: ``docs/alfworld.md`` §4 (``benchmarks/bench_alfworld.py``).
"""

from __future__ import annotations

import json
import os
import string
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import textworld
from alfworld.agents.environment.alfred_tw_env import AlfredDemangler
from gymnasium import spaces
from streamrl.envs import alfworld_gen, textworld_patches
from streamrl.envs.alfworld_gen import SPLITS, TASK_TYPES, GenerationConfig, Split
from streamrl.envs.base import TextEnv
from textworld.envs.pddl import PddlEnv

textworld_patches.apply_patches()

__all__ = [
    "OFFICIAL_SPLITS",
    "TEXT_CHARSET",
    "ALFWorldEnv",
    "AlfredEngine",
    "acquire_engine",
    "release_engine",
]

# Every character the ALFWorld grammar emits (plus tab); used for both Text spaces.
TEXT_CHARSET: str = string.ascii_letters + string.digits + string.punctuation + " \n\t"
MAX_TEXT_LENGTH = 16384
# Our split names -> the folders of the official data (json_2.1.1/<folder>).
OFFICIAL_SPLITS: dict[Split, str] = {  # ``validation`` is ours only
    "train": "train",
    "eval_seen": "valid_seen",
    "eval_unseen": "valid_unseen",
}


class AlfredEngine:
    """The ALFWorld text engine: ``AlfredDemangler(PddlEnv)``, one instance reused across games."""

    def __init__(self) -> None:
        infos = textworld.EnvInfos(won=True, admissible_commands=True)
        self._env = AlfredDemangler(PddlEnv(infos), shuffle=False)
        self.loaded: str | None = None  # key of the loaded game (caller's choice, e.g. its path)

    def load(self, game: Mapping[str, Any], key: str | None = None) -> None:
        """Load a ``game.tw-pddl`` object (textworld translates PDDL->SAS here; cached on disk)."""
        argv = sys.argv
        try:
            self._env.load(dict(game))
        finally:
            sys.argv = argv  # fast_downward.pddl2sas overwrites it for good (stock engine)
        self.loaded = key

    def reset(self) -> tuple[str, list[str], bool]:
        """Start the loaded game over: ``(observation, admissible commands, won)``."""
        argv = sys.argv
        try:
            state = self._env.reset()
        finally:
            sys.argv = argv
        return state.feedback, list(state["admissible_commands"]), bool(state["won"])

    def step(self, command: str) -> tuple[str, list[str], bool]:
        """Apply ``command`` (an inadmissible one gives "Nothing happens." and changes nothing)."""
        state, _, _ = self._env.step(command)
        return state.feedback, list(state["admissible_commands"]), bool(state["won"])

    def entity_names(self) -> dict[str, str]:
        """Lower-cased PDDL id -> surface name ("cabinet_bar_3" -> "cabinet 2") of the loaded game."""
        return {k: info.name for k, info in self._env._entity_infos.items()}

    def plan(self) -> list[str]:
        """A plan from the current state by the Fast Downward planner (slow: 0.1 s to minutes)."""
        return list(self._env._pddl_state.replan(self._env._entity_infos))


_FREE_ENGINES: list[AlfredEngine] = []


def acquire_engine() -> AlfredEngine:
    """An engine for this process: a released one if any, else a new one."""
    return _FREE_ENGINES.pop() if _FREE_ENGINES else AlfredEngine()


def release_engine(engine: AlfredEngine) -> None:
    """Hand an engine back for reuse (never closed: ``close_lib`` segfaults at interpreter exit)."""
    if engine not in _FREE_ENGINES:
        _FREE_ENGINES.append(engine)


def _task_type(path: Path, game: Mapping[str, Any] | None = None) -> str:
    """The task type of the game at ``path``: its ``traj_data.json`` (official and generated games have one), else
    the game's own ``streamrl`` record (``game``, or read from ``path``); ``"unknown"`` when neither names one."""
    traj_path = path.parent / "traj_data.json"
    traj = json.loads(traj_path.read_text()) if traj_path.is_file() else {}
    task_type = traj.get("task_type")
    if not task_type:
        if game is None:
            with open(path) as f:
                game = json.load(f)
        task_type = (game.get("streamrl") or {}).get("task_type", "")
    return task_type if task_type in TASK_TYPES else str(task_type or "unknown")


def _find_official_games(data_path: str, split: Split) -> tuple[Path, list[Path]]:
    """The split folder and game files of an official ALFWorld split, filtered as
    ``AlfredTWEnv.collect_game_files`` does (no movable-receptacle or sliced tasks, only solvable games)."""
    if split not in OFFICIAL_SPLITS:
        raise ValueError(
            f"split {split!r} is generated only; the official ALFWorld data has {sorted(OFFICIAL_SPLITS)} "
            "(pass one of them with data_path, or drop data_path to play the generated games)"
        )
    root = Path(os.path.expandvars(data_path)).expanduser()
    folder = OFFICIAL_SPLITS[split]
    candidates = [root / folder, root / "json_2.1.1" / folder]
    base = next((c for c in candidates if c.is_dir()), None)
    if base is None:
        raise FileNotFoundError(
            f"no official ALFWorld split {folder!r} under data_path={data_path!r} (looked for "
            f"{', '.join(str(c) for c in candidates)}); run `alfworld-download` or pass split in {SPLITS} "
            "without data_path to play the generated games"
        )
    games = []
    for dirpath, _, files in sorted(os.walk(base)):
        if "traj_data.json" not in files or "game.tw-pddl" not in files:
            continue
        if "movable" in dirpath or "Sliced" in dirpath:  # unsupported in ALFWorld too
            continue
        path = Path(dirpath) / "game.tw-pddl"
        with open(path) as f:
            if not json.load(f).get("solvable", False):
                continue
        games.append(path)
    if not games:
        raise FileNotFoundError(f"no solvable games (game.tw-pddl + traj_data.json) under {base}")
    return base, games


class ALFWorldEnv(TextEnv):
    """ALFWorld text env (standard ALFWorld 0.4 text) on the real TextWorld engine.

    Args:
        split: ``"train"`` (128 tasks), ``"eval_seen"``, ``"eval_unseen"`` or ``"validation"`` (held-out training
            games for choosing settings; see ``alfworld_gen``).
        game_files: play these ``game.tw-pddl`` files instead of a split.
        data_path: play the official ALFWorld data instead: a folder holding ``json_2.1.1/`` (or the
            ``json_2.1.1`` folder itself); ``"$ALFWORLD_DATA"`` is expanded. ``split`` picks
            train / valid_seen / valid_unseen.
        max_steps: episode limit; ``truncated`` is set on the step that reaches it (ALFWorld uses 50).
        generation: split sizes and cache folder of the generated games: a ``GenerationConfig``, or a mapping
            of its fields (a run's ``env_kwargs``, e.g. ``{"train": 512}``: the first 512 generated training
            games instead of 128; the other splits keep their sizes).
        planner_walkthrough: for games without a stored walkthrough (official data), compute one with the
            Fast Downward planner at reset (slow, seconds to minutes); otherwise ``walkthrough`` is ``[]``.
        render_mode: ``None`` or ``"ansi"`` (``render()`` returns the last observation).

    ``reset(seed, options={"task_id": ...})``: without a task id the task is drawn uniformly with the
    env's ``np_random``. ``step(command)``: reward 1.0 and ``terminated`` on a win, otherwise 0.0; an
    inadmissible command returns "Nothing happens." and counts as a step. ``info``: ``task_id``,
    ``task_type``, ``won``, ``admissible_commands``, ``action_valid``, ``walkthrough``, ``gamefile``,
    ``steps``, ``visited`` (the receptacles the agent has walked to this episode with an admissible ``go to``,
    least recently arrived at first, so the last is where it stands: what an agent that remembers its own moves
    knows, kept by the env so that a prompt can show it without per-episode agent state;
    ``alfworld_text.go_to_frontier`` turns it into the receptacles left to search).
    """

    metadata = {"render_modes": ["ansi"]}  # noqa: RUF012 (gymnasium declares it as a plain attribute)

    def __init__(
        self,
        split: Split = "train",
        *,
        game_files: Sequence[str | os.PathLike[str]] | None = None,
        data_path: str | os.PathLike[str] | None = None,
        max_steps: int = 50,
        generation: GenerationConfig | Mapping[str, Any] | None = None,
        planner_walkthrough: bool = False,
        render_mode: str | None = None,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
        if isinstance(generation, Mapping):
            valid = list(GenerationConfig.__dataclass_fields__)
            unknown = sorted(set(generation) - set(valid))
            if unknown:
                raise ValueError(f"unknown generation field(s) {unknown}; valid: {valid}")
            generation = GenerationConfig(**generation)
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
        if game_files is not None and data_path is not None:
            raise ValueError("pass either game_files or data_path, not both")
        self.split, self.max_steps = split, max_steps
        self.planner_walkthrough = planner_walkthrough
        self.observation_space = spaces.Text(MAX_TEXT_LENGTH, min_length=0, charset=TEXT_CHARSET)
        self.action_space = spaces.Text(256, min_length=0, charset=TEXT_CHARSET)

        if game_files is not None:
            paths = [Path(p) for p in game_files]
            missing = [str(p) for p in paths if not p.is_file()]
            if not paths or missing:
                raise FileNotFoundError(
                    f"game_files must be existing game.tw-pddl files; missing: {missing or '[]'}"
                )
            task_ids = [self._task_id_of(p) for p in paths]
        elif data_path is not None:
            base, paths = _find_official_games(str(data_path), split)
            # json_2.1.1/<split>/<task>/<trial>/game.tw-pddl -> "alfworld-official/<split>/<task>/<trial>"
            task_ids = ["alfworld-official/" + p.parent.relative_to(base.parent).as_posix() for p in paths]
        else:
            paths = alfworld_gen.ensure_split(split, generation or GenerationConfig())
            task_ids = [f"alfworld/{split}/{p.parent.name}" for p in paths]
        if len(set(task_ids)) != len(task_ids):
            raise ValueError("two games share a task id; pass distinct game files")
        super().__init__(task_ids, render_mode=render_mode)
        self._paths = dict(zip(task_ids, paths, strict=True))

        self._engine: AlfredEngine | None = acquire_engine()
        self._meta: dict[str, Any] = {}
        self._admissible: list[str] = []
        self._steps = 0
        self._visited: list[str] = []
        self._last_obs = ""

    @staticmethod
    def prepare_data(
        split: Split = "train",
        *,
        game_files: Sequence[str | os.PathLike[str]] | None = None,
        data_path: str | os.PathLike[str] | None = None,
        generation: GenerationConfig | Mapping[str, Any] | None = None,
        **_: Any,
    ) -> None:
        """Generate ``split``'s games now if they are not cached yet (what the constructor would do on first
        use): ``StreamingVectorEnv`` calls it in the parent before starting its workers (``EnvFactory.prepare``).
        Nothing to do for given ``game_files`` or ``data_path``; an unknown split or generation field is left to
        the constructor to refuse (in the worker, with its message)."""
        if game_files is not None or data_path is not None or split not in SPLITS:
            return
        if isinstance(generation, Mapping):
            try:
                generation = GenerationConfig(**generation)
            except TypeError:
                return
        alfworld_gen.ensure_split(split, generation or GenerationConfig())

    @staticmethod
    def _task_id_of(path: Path) -> str:
        try:  # a generated game names itself
            with open(path) as f:
                return str(json.load(f)["streamrl"]["task_id"])
        except (KeyError, TypeError, ValueError):
            return path.resolve().as_posix()

    def _load(self, task_id: str) -> None:
        assert self._engine is not None
        path = self._paths[task_id]
        with open(path) as f:
            game = json.load(f)
        if self._engine.loaded != str(path):  # an engine handed back by a closed env may hold it already
            self._engine.load(game, key=str(path))
        self._meta = {
            "task_type": _task_type(path, game),
            "walkthrough": list(game.get("walkthrough") or []),
            "gamefile": str(path),
        }

    def task_attributes(self) -> dict[str, dict[str, str]]:
        """Each game's ``task_type`` (one of ``TASK_TYPES``, or ``"unknown"``), read from its files without loading
        it: what evaluation breaks success down by and what ``TrainConfig.balance_by`` may balance over."""
        return {task_id: {"task_type": _task_type(path)} for task_id, path in self._paths.items()}

    # ---- TextEnv hooks ---------------------------------------------------------------------------
    def _describe_tasks(self) -> str:
        return f"split={self.split!r}"

    def _reset_task(self, task_id: str) -> tuple[str, dict[str, Any]]:
        assert self._engine is not None
        path = str(self._paths[task_id])
        if self._engine.loaded != path or self._meta.get("gamefile") != path:
            self._load(task_id)
        obs, self._admissible, won = self._engine.reset()
        if self.planner_walkthrough and not self._meta["walkthrough"]:
            self._meta["walkthrough"] = self._engine.plan()
        self._steps, self._last_obs, self._visited = 0, obs, []
        return obs, self._info(task_id, won, action_valid=True)

    def _step_task(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        assert self._engine is not None and self._task_id is not None
        if not isinstance(action, str):
            raise TypeError(f"action must be a str command, got {type(action).__name__}: {action!r}")
        command = action.strip()
        valid = command in self._admissible
        obs, self._admissible, won = self._engine.step(action)
        if valid and command.startswith("go to "):
            target = command[len("go to ") :]
            self._visited = [r for r in self._visited if r != target] + [target]
        self._steps += 1
        terminated = won
        truncated = not terminated and self._steps >= self.max_steps
        self._last_obs = obs
        info = self._info(self._task_id, won, action_valid=valid)
        return obs, 1.0 if won else 0.0, terminated, truncated, info

    def _info(self, task_id: str, won: bool, action_valid: bool) -> dict[str, Any]:
        return {
            "task_id": task_id,
            "task_type": self._meta["task_type"],
            "won": won,
            "admissible_commands": list(self._admissible),
            "action_valid": action_valid,
            "walkthrough": list(self._meta["walkthrough"]),
            "gamefile": self._meta["gamefile"],
            "steps": self._steps,
            "visited": list(self._visited),
        }

    def render(self) -> str | None:  # type: ignore[override]
        return self._last_obs if self.render_mode == "ansi" else None

    def close(self) -> None:
        if self._engine is not None:
            release_engine(self._engine)
            self._engine = None
        super().close()
