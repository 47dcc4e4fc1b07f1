"""Offline generator of ALFWorld games (all six task types) for the real TextWorld PDDL engine.

The official ALFWorld games are downloaded from GitHub, which many machines cannot reach. Everything
needed to *author* games ships inside the ``alfworld`` wheel: the PDDL domain and text grammar, the
receptacle/object compatibility tables (``alfworld.gen.constants``), the goal templates
(``alfworld.gen.goal_library``) and per-floor-plan object and receptacle lists for all 120 AI2-THOR
floor plans (``alfworld/gen/layouts``). This module samples rooms from those tables, writes standard
``game.tw-pddl`` + ``traj_data.json`` folders (which alfworld's own ``AlfredTWEnv`` also reads), builds a
constructive walkthrough and keeps a game only if the real engine says the goal is false at reset and the
walkthrough wins it. Design and measurements: ``docs/alfworld.md`` §2-3.

Generated games are ALFWorld-*style*: same engine, domain, grammar, task types and room contents, but
not the ALFWorld benchmark games; numbers on them are not comparable to published ALFWorld scores.

Splits (fixed for a generator version; game ``i`` of a split depends only on the version, split and ``i``,
so a larger split extends a smaller one):

* ``train`` - 128 tasks (the SPO++ paper's training-set size) in ALFRED's training floor plans;
* ``eval_seen`` - 140 other tasks in the same floor plans (as many as ALFWorld's ``valid_seen``);
* ``eval_unseen`` - 134 tasks in ALFRED's held-out test floor plans (as many as ALFWorld's ``valid_unseen``);
* ``validation`` - 128 more tasks in the training floor plans, drawn like ``train`` but apart from it: the
  held-out training games on which settings (a learning rate, a recipe) are chosen, so that ``eval_seen`` and
  ``eval_unseen`` are never looked at before the final measurement. ALFWorld has no such split.

The eval splits have ALFWorld's sizes because a paired comparison of two policies is only as sharp as the
number of distinct games it is clustered over: with 64 games a split, a pooled gain of about +.06 had a 95 %
interval of about +-.07. Generating and verifying all 530 games takes a few CPU minutes, once. Sizes are
configurable (``GenerationConfig``); a split of 64 games is the first 64 of today's.

Command line: ``streamrl alfworld-generate [--split train eval_seen eval_unseen validation] [--cache-dir D]``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, cast, get_args

import alfworld.gen.constants as C
import alfworld.gen.goal_library as glib
from streamrl.utils.cache import atomic_dir, atomic_write_text, cache_root, file_lock

__all__ = [
    "GENERATOR_VERSION",
    "SPLITS",
    "TASK_TYPES",
    "GameSpec",
    "GenerationConfig",
    "Split",
    "TaskType",
    "build_game",
    "ensure_split",
    "generate_game",
    "parse_task_id",
    "split_dir",
]

# Bump whenever a change alters any generated game: it names the cache folder.
GENERATOR_VERSION = "1"

# ALFWorld's task-type order (alfworld.agents.environment.alfred_tw_env.TASK_TYPES).
TaskType = Literal[
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
]
TASK_TYPES: tuple[TaskType, ...] = get_args(TaskType)
Split = Literal["train", "eval_seen", "eval_unseen", "validation"]
SPLITS: tuple[Split, ...] = get_args(Split)

_DATA = resources.files("alfworld") / "data"
DOMAIN: str = (_DATA / "alfred.pddl").read_text()
GRAMMAR: str = (_DATA / "alfred.twl2").read_text()
_LAYOUTS = resources.files("alfworld.gen") / "layouts"

STATIC_RECEPTACLES: tuple[str, ...] = tuple(sorted(C.RECEPTACLES - C.MOVABLE_RECEPTACLES_SET))
# Every object type is declared as a constant, as in ALFWorld's own problem files (the domain refers to
# SinkBasinType, KnifeType, ... in preconditions).
OBJECT_TYPES: tuple[str, ...] = tuple(sorted(C.OBJECTS_SET - set(STATIC_RECEPTACLES)))
LAMPS: tuple[str, ...] = ("DeskLamp", "FloorLamp")
PICKUPABLE: tuple[str, ...] = tuple(
    sorted({o for objs in C.VAL_RECEPTACLE_OBJECTS.values() for o in objs if "Sliced" not in o})
)
# Lamps are not in VAL_RECEPTACLE_OBJECTS; ALFWorld rooms put them on furniture like these.
LAMP_HOSTS: tuple[str, ...] = (
    "Desk",
    "SideTable",
    "Dresser",
    "CoffeeTable",
    "DiningTable",
    "TVStand",
    "Shelf",
)
# The tool each state-change task needs, the property its object must have, and the command verb.
TOOLS: dict[str, tuple[str, str, str]] = {
    "pick_clean_then_place_in_recep": ("SinkBasin", "Cleanable", "clean"),
    "pick_heat_then_place_in_recep": ("Microwave", "Heatable", "heat"),
    "pick_cool_then_place_in_recep": ("Fridge", "Coolable", "cool"),
}
# Instance counts for receptacle types that the floor plan's -openable.json does not enumerate.
_DEFAULT_COUNTS: dict[str, tuple[int, ...]] = {"StoveBurner": (2, 4, 4)}
# The -openable.json lists name the fixtures; the PDDL receptacle is the basin.
_FIXTURE_TO_RECEPTACLE = {"Sink": "SinkBasin", "Bathtub": "BathtubBasin"}
_PROPERTY_PREDICATES = (
    ("Cleanable", "cleanable"),
    ("Heatable", "heatable"),
    ("Coolable", "coolable"),
    ("Sliceable", "sliceable"),
    ("Toggleable", "toggleable"),
)
_MAX_ATTEMPTS = 200
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationConfig:
    """Sizes of the fixed splits and where they are cached.

    Attributes:
        train: number of training tasks (default 128, the SPO++ paper's training set).
        eval_seen: tasks in training floor plans (default 140, as ALFWorld's valid_seen).
        eval_unseen: tasks in held-out floor plans (default 134, as ALFWorld's valid_unseen).
        validation: held-out training tasks, in the training floor plans (default 128), for choosing settings.
        cache_dir: folder holding one sub-folder per generator version; ``None`` means
            ``$STREAMRL_CACHE/alfworld`` (``~/.cache/streamrl/alfworld`` when ``STREAMRL_CACHE`` is unset).
        workers: processes used to generate missing games (``None`` = ``os.cpu_count()``, capped by the
            number of missing games); 1 generates in this process.
    """

    train: int = 128
    eval_seen: int = 140
    eval_unseen: int = 134
    validation: int = 128
    cache_dir: str | None = None
    workers: int | None = None

    def __post_init__(self) -> None:
        for split in SPLITS:
            n = getattr(self, split)
            if not isinstance(n, int) or n < 0:
                raise ValueError(f"GenerationConfig.{split} must be an int >= 0, got {n!r}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"GenerationConfig.workers must be >= 1 or None, got {self.workers}")

    def size(self, split: Split) -> int:
        _check_split(split)
        return int(getattr(self, split))

    def root(self) -> Path:
        base = Path(self.cache_dir).expanduser() if self.cache_dir else cache_root() / "alfworld"
        return base / f"gen-v{GENERATOR_VERSION}"


@dataclass
class GameSpec:
    """One sampled room and task, in PDDL ids (before the engine names things "cabinet 3")."""

    task_type: TaskType
    floor_plan: int
    receptacles: list[str]  # receptacle ids, e.g. "Cabinet_bar_3", "Sink_bar_1_bar_SinkBasin"
    objects: list[tuple[str, str]]  # (object id, id of the receptacle holding it)
    params: dict[str, Any]  # ALFRED pddl_params: object_target, parent_target, toggle_target, ...
    task_desc: str
    plan: list[tuple[str, ...]] = field(default_factory=list)  # constructive plan in PDDL ids


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")


def _rtype(receptacle_id: str) -> str:
    return (
        receptacle_id.split("_bar_")[-1]
        if receptacle_id.endswith("Basin")
        else receptacle_id.split("_bar_")[0]
    )


def _otype(object_id: str) -> str:
    return object_id.split("_bar_")[0]


def _receptacle_id(rtype: str, i: int) -> str:
    # ALFRED-style ids that alfworld's Demangler turns into "sinkbasin 1", "cabinet 3", ...
    if rtype == "SinkBasin":
        return f"Sink_bar_{i}_bar_SinkBasin"
    if rtype == "BathtubBasin":
        return f"Bathtub_bar_{i}_bar_BathtubBasin"
    return f"{rtype}_bar_{i}"


def floor_plans(split: Split, task_type: TaskType) -> list[int]:
    """Floor plans a task of ``task_type`` may use in ``split``: ALFRED's training scenes for ``train``,
    ``eval_seen`` and ``validation``, its held-out test scenes for ``eval_unseen``; room types from
    ``GOALS_VALID``."""
    _check_split(split)
    scenes = C.TEST_SCENE_NUMBERS if split == "eval_unseen" else C.TRAIN_SCENE_NUMBERS
    rooms = sorted(C.GOALS_VALID[task_type])
    valid = {n for room in rooms for n in C.SCENE_TYPE[room]}
    return sorted(n for n in scenes if n in valid)


@functools.cache
def _scene(floor_plan: int) -> tuple[tuple[str, ...], dict[str, int]]:
    """Sorted object/receptacle types present in a floor plan and receptacle instance counts."""
    types = json.loads((_LAYOUTS / f"FloorPlan{floor_plan}-objects.json").read_text())
    instances = json.loads((_LAYOUTS / f"FloorPlan{floor_plan}-openable.json").read_text())
    counts: dict[str, int] = {}
    for key in sorted(instances):
        rtype = _FIXTURE_TO_RECEPTACLE.get(key.split("|")[0], key.split("|")[0])
        counts[rtype] = counts.get(rtype, 0) + 1
    present = {_FIXTURE_TO_RECEPTACLE.get(t, t) for t in types} | set(counts)
    return tuple(sorted(present)), counts


def _sample_spec(task_type: TaskType, split: Split, rng: random.Random) -> GameSpec | None:
    """Sample a room and task (docs/alfworld.md §3); ``None`` when the draw cannot host the task."""
    floor_plan = rng.choice(floor_plans(split, task_type))
    present, counts = _scene(floor_plan)
    present_set = set(present)

    receptacles: list[str] = []
    for rtype in STATIC_RECEPTACLES:
        if rtype not in present_set:
            continue
        n = counts.get(rtype) or rng.choice(_DEFAULT_COUNTS.get(rtype, (1,)))
        receptacles += [_receptacle_id(rtype, i) for i in range(1, n + 1)]
    rtypes = sorted({_rtype(r) for r in receptacles})

    def hosts(otype: str) -> list[str]:
        if otype in LAMPS:
            return [r for r in receptacles if _rtype(r) in LAMP_HOSTS]
        return [r for r in receptacles if otype in C.VAL_RECEPTACLE_OBJECTS.get(_rtype(r), ())]

    candidates = [t for t in PICKUPABLE if t in present_set and hosts(t)]
    lamps = [t for t in LAMPS if t in present_set and hosts(t)]

    # Task arguments.
    toggle, tool = "", ""
    if task_type in TOOLS:
        tool, prop, _ = TOOLS[task_type]
        if tool not in rtypes:
            return None
        candidates = [t for t in candidates if t in C.VAL_ACTION_OBJECTS[prop]]
    if task_type == "look_at_obj_in_light":
        if not lamps:
            return None
        toggle = rng.choice(lamps)
    if not candidates:
        return None
    obj = rng.choice(candidates)
    parent = ""
    if task_type != "look_at_obj_in_light":
        parents = [t for t in rtypes if obj in C.VAL_RECEPTACLE_OBJECTS.get(t, ()) and t != tool]
        # The target must start outside every parent-type receptacle, or the game may start won.
        if not parents:
            return None
        parent = rng.choice(parents)
        if not [r for r in hosts(obj) if _rtype(r) != parent]:
            return None

    # Objects: every pickupable type present gets 1-3 instances (lamps: 1) in compatible receptacles.
    objects: list[tuple[str, str]] = []
    for otype in sorted({t for t in PICKUPABLE if t in present_set} | set(lamps)):
        places = hosts(otype)
        if not places:
            continue
        n = 1 if otype in LAMPS else rng.randint(1, 3)
        if otype == obj:
            n = max(n, 2 if task_type == "pick_two_obj_and_place" else 1)
            places = [r for r in places if _rtype(r) != parent]
        for i in range(1, n + 1):
            objects.append((f"{otype}_bar_{i}", rng.choice(places)))

    template = rng.choice(glib.gdict[task_type]["templates"])
    task_desc = template.format(obj=obj.lower(), recep=parent.lower(), toggle=toggle.lower(), mrecep="")
    params = {
        "object_target": obj,
        "parent_target": parent,
        "toggle_target": toggle,
        "mrecep_target": "",
        "object_sliced": False,
    }
    spec = GameSpec(task_type, floor_plan, receptacles, objects, params, task_desc)
    spec.plan = _constructive_plan(spec)
    return spec


def _constructive_plan(spec: GameSpec) -> list[tuple[str, ...]]:
    """A winning plan from the known layout: go to the holder (open it if needed), take; visit the tool
    and use it; go to the parent (open it if needed) and move the object there. ``go to`` the current
    receptacle and re-opening are skipped (neither is admissible in ALFWorld)."""
    holder = dict(spec.objects)
    at: str | None = None
    opened: set[str] = set()
    plan: list[tuple[str, ...]] = []

    def goto(r: str, open_it: bool = True) -> None:
        nonlocal at
        if at != r:
            plan.append(("go to", r))
            at = r
        if open_it and _rtype(r) in C.OPENABLE_CLASS_SET and r not in opened:
            plan.append(("open", r))
            opened.add(r)

    obj, parent = spec.params["object_target"], spec.params["parent_target"]
    targets = [o for o, _ in spec.objects if _otype(o) == obj]
    if spec.task_type == "look_at_obj_in_light":
        lamp = next(o for o, _ in spec.objects if _otype(o) == spec.params["toggle_target"])
        goto(holder[targets[0]])
        plan.append(("take", targets[0], holder[targets[0]]))
        goto(holder[lamp])
        plan.append(("use", lamp))
        return plan
    dest = next(r for r in spec.receptacles if _rtype(r) == parent)
    for o in targets[: 2 if spec.task_type == "pick_two_obj_and_place" else 1]:
        goto(holder[o])
        plan.append(("take", o, holder[o]))
        if spec.task_type in TOOLS:
            tool_type, _, verb = TOOLS[spec.task_type]
            tool = next(r for r in spec.receptacles if _rtype(r) == tool_type)
            goto(tool, open_it=False)  # heat/cool/clean do not need the tool open
            plan.append((verb, o, tool))
        goto(dest)
        plan.append(("move", o, dest))
    return plan


def plan_to_commands(plan: Sequence[tuple[str, ...]], names: dict[str, str]) -> list[str]:
    """Render a plan in PDDL ids as ALFWorld commands; ``names`` maps lower-cased ids to engine names."""
    out = []
    for verb, *args in plan:
        a = [names[x.lower()] for x in args]
        if verb == "take":
            out.append(f"take {a[0]} from {a[1]}")
        elif verb == "move":
            out.append(f"move {a[0]} to {a[1]}")
        elif verb in ("clean", "heat", "cool"):
            out.append(f"{verb} {a[0]} with {a[1]}")
        else:  # go to, open, use
            out.append(f"{verb} {a[0]}")
    return out


def to_pddl(spec: GameSpec) -> str:
    """The PDDL problem of a spec, in the layout of ALFWorld's problem files (docs/alfworld.md §2)."""
    rec, objs = spec.receptacles, spec.objects
    loc = {r: f"loc_{k}" for k, r in enumerate(rec)}
    lines = ["(define (problem streamrl_alfworld)", "(:domain alfred)", "(:objects", "agent1 - agent"]
    lines += [f"{t}Type - otype" for t in OBJECT_TYPES] + [f"{t}Type - rtype" for t in STATIC_RECEPTACLES]
    lines += [f"{r} - receptacle" for r in rec] + [f"{o} - object" for o, _ in objs]
    lines += [f"{loc[r]} - location" for r in rec] + ["loc_start - location", ")"]
    init = ["(:init", "(atLocation agent1 loc_start)"]  # mid-room start: "You are in the middle of a room"
    for r in rec:
        init += [f"(receptacleType {r} {_rtype(r)}Type)", f"(receptacleAtLocation {r} {loc[r]})"]
        if _rtype(r) in C.OPENABLE_CLASS_SET:
            init.append(f"(openable {r})")
    for o, r in objs:
        t = _otype(o)
        init += [f"(objectType {o} {t}Type)", f"(inReceptacle {o} {r})", f"(objectAtLocation {o} {loc[r]})"]
        if t not in LAMPS:
            init.append(f"(pickupable {o})")
        init += [f"({pred} {o})" for prop, pred in _PROPERTY_PREDICATES if t in C.VAL_ACTION_OBJECTS[prop]]
        if t in C.MOVABLE_RECEPTACLES_SET:
            init.append(f"(isReceptacleObject {o})")
    otypes = sorted({_otype(o) for o, _ in objs})
    for rt in sorted({_rtype(r) for r in rec}):
        init += [
            f"(canContain {rt}Type {ot}Type)" for ot in otypes if ot in C.VAL_RECEPTACLE_OBJECTS.get(rt, ())
        ]
    init.append(")")
    p = spec.params
    goal = glib.gdict[spec.task_type]["pddl"].format(
        obj=p["object_target"], recep=p["parent_target"], toggle=p["toggle_target"], mrecep=""
    )
    return "\n".join(lines + init) + "\n" + goal.replace("#", "-").strip() + "\n"


def task_id_for(split: Split, index: int, task_type: TaskType, floor_plan: int) -> str:
    return f"alfworld/{split}/{index:04d}-{task_type}-FloorPlan{floor_plan}"


def parse_task_id(task_id: str) -> tuple[Split, int]:
    """``"alfworld/train/0007-..."`` -> ``("train", 7)``; raises ``ValueError`` naming the bad id."""
    parts = task_id.split("/")
    if len(parts) != 3 or parts[0] != "alfworld" or parts[1] not in SPLITS or not parts[2][:4].isdigit():
        raise ValueError(
            f"malformed ALFWorld task id {task_id!r}; expected 'alfworld/<split>/<NNNN>-<task_type>-FloorPlan<N>' "
            f"with split in {SPLITS}"
        )
    return cast(Split, parts[1]), int(parts[2][:4])


def build_game(spec: GameSpec, task_id: str, walkthrough: Sequence[str] = ()) -> dict[str, Any]:
    """The ``game.tw-pddl`` JSON object (``solvable`` is what ``AlfredTWEnv`` filters on)."""
    return {
        "pddl_domain": DOMAIN,
        "grammar": GRAMMAR.replace("UNKNOWN GOAL", spec.task_desc),
        "pddl_problem": to_pddl(spec),
        "solvable": True,
        "walkthrough": list(walkthrough),
        "streamrl": {
            "task_id": task_id,
            "task_type": spec.task_type,
            "floor_plan": spec.floor_plan,
            "generator_version": GENERATOR_VERSION,
        },
    }


def traj_data(spec: GameSpec, task_id: str) -> dict[str, Any]:
    """The subset of ALFRED's ``traj_data.json`` that ``AlfredTWEnv`` and its hand-coded expert read."""
    return {
        "task_id": task_id,
        "task_type": spec.task_type,
        "scene": {"floor_plan": f"FloorPlan{spec.floor_plan}", "scene_num": spec.floor_plan},
        "pddl_params": dict(spec.params),
        "turk_annotations": {"anns": [{"task_desc": spec.task_desc}]},
    }


def generate_game(split: Split, index: int) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Game ``index`` of ``split``: ``(task_id, game_json, traj_data)``, verified on the real engine.

    The task type cycles through ``TASK_TYPES``. Draws come from ``random.Random`` seeded with a string
    (hashed with sha512, so independent of ``PYTHONHASHSEED``) and every set is sorted before sampling,
    so a (version, split, index) always gives the same bytes. A draw is rejected if it cannot host the
    task, if the goal already holds at reset, or if the walkthrough does not win.
    """
    from streamrl.envs.alfworld import acquire_engine, release_engine  # the env module imports this one

    _check_split(split)
    task_type = TASK_TYPES[index % len(TASK_TYPES)]
    engine = acquire_engine()
    try:
        return _first_valid_game(engine, split, index, task_type)
    finally:
        release_engine(engine)


def _first_valid_game(
    engine: Any, split: Split, index: int, task_type: TaskType
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    for attempt in range(_MAX_ATTEMPTS):
        rng = random.Random(f"streamrl-alfworld/v{GENERATOR_VERSION}/{split}/{index}/{attempt}")
        spec = _sample_spec(task_type, split, rng)
        if spec is None:
            continue
        task_id = task_id_for(split, index, task_type, spec.floor_plan)
        game = build_game(spec, task_id)
        engine.load(game)
        _, admissible, won = engine.reset()
        if won:
            continue
        game["walkthrough"] = plan_to_commands(spec.plan, engine.entity_names())
        for command in game["walkthrough"]:
            if command not in admissible:
                break
            _, admissible, won = engine.step(command)
        if won:
            return task_id, game, traj_data(spec, task_id)
    raise RuntimeError(f"no valid {task_type} game for {split}/{index} after {_MAX_ATTEMPTS} draws")


# -- the on-disk cache ----------------------------------------------------------------------------------
def split_dir(split: Split, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Folder holding the games of ``split`` (one sub-folder per game)."""
    _check_split(split)
    return GenerationConfig(cache_dir=None if cache_dir is None else str(cache_dir)).root() / split


def _game_folder(root: Path, task_id: str) -> Path:
    split, _ = parse_task_id(task_id)
    return root / split / task_id.split("/")[2]


def _generate_into(root: Path, split: Split, index: int) -> str:
    task_id, game, traj = generate_game(split, index)
    # A folder left by an interrupted run is replaced (writers hold the split lock, so it is not in use).
    with atomic_dir(_game_folder(root, task_id), replace=True) as tmp:
        (tmp / "game.tw-pddl").write_text(json.dumps(game, indent=1, sort_keys=True) + "\n")
        (tmp / "traj_data.json").write_text(json.dumps(traj, indent=1, sort_keys=True) + "\n")
    return task_id


def _read_manifest(root: Path, split: Split, n: int) -> list[str]:
    """Task ids of the first ``n`` games of the manifest, cut before the first game whose files are gone
    (those games are then generated again)."""
    try:
        data = json.loads((root / split / "manifest.json").read_text())
    except (OSError, ValueError):
        return []
    known = []
    for task_id in map(str, data.get("task_ids", [])[:n]):
        folder = _game_folder(root, task_id)
        if not ((folder / "game.tw-pddl").is_file() and (folder / "traj_data.json").is_file()):
            break
        known.append(task_id)
    return known


def ensure_split(
    split: Split, config: GenerationConfig | None = None, *, progress: bool = False
) -> list[Path]:
    """Paths of the ``game.tw-pddl`` files of ``split`` (``config.size(split)`` games, in index order),
    generating the missing ones first. Safe under concurrent processes: an exclusive lock file serializes
    writers, every file and game folder is written under a temporary name and renamed, and the generation
    workers never take that lock (they are fresh interpreters that only write game folders, see
    :func:`_generate_in_workers`)."""
    config = config or GenerationConfig()
    n = config.size(split)
    root = config.root()
    known = _read_manifest(root, split, n)
    if len(known) < n:
        with file_lock(root / ".lock"):
            known = _read_manifest(root, split, n)  # another process may have finished meanwhile
            if len(known) < n:
                known = _generate_missing(root, split, known, n, config.workers, progress)
    return [_game_folder(root, t) / "game.tw-pddl" for t in known]


def _generate_missing(
    root: Path, split: Split, known: list[str], n: int, workers: int | None, progress: bool
) -> list[str]:
    (root / split).mkdir(parents=True, exist_ok=True)
    todo = list(range(len(known), n))
    n_workers = max(1, min(workers or os.cpu_count() or 1, len(todo)))
    _log.warning(
        "generating %d ALFWorld %s games into %s with %d process(es) (first use only; ~0.5 CPU-second per game)",
        len(todo),
        split,
        root / split,
        n_workers,
    )
    start = time.perf_counter()
    if n_workers == 1:
        new = [_generate_into(root, split, i) for i in todo]
    else:
        new = _generate_in_workers(root, split, todo, n_workers)
    task_ids = known + new
    manifest = {"generator_version": GENERATOR_VERSION, "split": split, "task_ids": task_ids}
    atomic_write_text(root / split / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    if progress:
        print(f"{split}: generated {len(todo)} games in {time.perf_counter() - start:.1f}s -> {root / split}")
    return task_ids


# A worker is a fresh interpreter started with -c. Not multiprocessing: its spawn and forkserver children
# re-run the caller's __main__ module, and a script without an ``if __name__ == "__main__"`` guard would
# call ensure_split again there and wait forever for the lock this process holds (issue 14). Nor fork:
# the caller may hold threads (torch) and a loaded planner library.
_WORKER = "import sys; from streamrl.envs.alfworld_gen import _worker_main; _worker_main(sys.argv[1:])"


def _worker_main(argv: Sequence[str]) -> None:
    """Body of a generation worker: ``argv`` = cache root, split, game indices; prints ``index task_id``
    per generated game."""
    root, split, *indices = argv
    _check_split(split)
    for index in map(int, indices):
        print(index, _generate_into(Path(root), cast(Split, split), index), flush=True)


def _generate_in_workers(root: Path, split: Split, todo: list[int], n_workers: int) -> list[str]:
    """Generate games ``todo`` in ``n_workers`` worker processes (interleaved shares); their task ids in order."""
    shares = [todo[k::n_workers] for k in range(n_workers)]
    procs: list[tuple[subprocess.Popen[bytes], Any, Any]] = []
    try:
        for share in shares:
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # no pipe to fill up
            args = [sys.executable, "-c", _WORKER, str(root), split, *map(str, share)]
            procs.append((subprocess.Popen(args, stdout=out, stderr=err, stdin=subprocess.DEVNULL), out, err))
        done: dict[int, str] = {}
        for (proc, out, err), share in zip(procs, shares, strict=True):
            if proc.wait() != 0:
                err.seek(0)
                said = err.read()[-3000:].decode(errors="replace").strip()
                raise RuntimeError(
                    f"an ALFWorld generation worker (games {share[0]}.. of {split}, every {n_workers}th) failed "
                    f"with exit code {proc.returncode}:\n{said}"
                )
            out.seek(0)
            for line in out.read().decode().splitlines():
                index, task_id = line.split(maxsplit=1)
                done[int(index)] = task_id
    finally:
        for proc, out, err in procs:
            if proc.poll() is None:  # an error or an interrupt in this process: stop the others
                proc.kill()
                proc.wait()
            out.close()
            err.close()
    return [done[i] for i in todo]
