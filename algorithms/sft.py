"""SFT cold start: behaviour cloning of expert agents into a model, one cached checkpoint per env.

The SPO++ paper starts Math-TIR from an SFT checkpoint; this module gives a small model (``tiny``) the same
kind of start. RL on an env starts from that env's own checkpoint (``sft_checkpoint("math_tir")``,
``sft_checkpoint("alfworld")``): a model small enough to train on CPU loses most of one env's skill when
trained on both envs' data together (docs/sft.md).

1. **Expert data** (``streamrl.agents.teacher_forcing``): expert episodes played through the ``LLMAgent``'s
   own rendering, so the training sequences have the token layout and ``action_mask`` the agent produces at
   RL time; optional DART noise, extra generated tasks and downsampling of frequent actions.
2. **Training** (``train_sft``): ``sft_loss`` (``streamrl.algorithms.losses``), the action tokens'
   cross-entropy plus ``SFTConfig.context_weight`` times a language-modelling loss on the context; AdamW with
   linear warm-up and cosine decay, full fine-tuning by default (``SFTConfig.lora`` trains an adapter and
   merges it). Optional model selection keeps the best epoch by greedy success on held-out generated tasks.
   A recipe may start from another env's checkpoint (``SFTConfig.init_from``): ALFWorld starts from Math-TIR's.
3. **Cache** (``sft_checkpoint``): the checkpoint is saved under ``$STREAMRL_CACHE/sft/<model>-sft-<key>``
   (``SFTConfig.key()``), built once under a lock, so tests, examples and RL runs reuse it.

The recipes are the ``SFTConfig`` presets; what each one reaches, and the variants tried and not kept, are in
docs/sft.md. Command line: ``streamrl sft`` (``streamrl sft --help``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from streamrl.agents.base import SamplingParams
from streamrl.agents.env_specs import env_spec, play_tasks
from streamrl.agents.hf_backend import HFBackend
from streamrl.agents.lora import LoRAConfig, trainable_parameters, wrap_lora
from streamrl.agents.models import build_once, load_model, load_tokenizer, resolve_model, sha256_file
from streamrl.agents.reproducible import (
    REPRODUCIBLE_KERNELS,
    on_reproducible_kernels,
    run_in_reproducible_interpreter,
)
from streamrl.agents.teacher_forcing import downsample_turns, expert_trajectories, sequences_of
from streamrl.agents.trajectory import TokenSequence
from streamrl.algorithms.losses import sft_loss
from streamrl.envs.cache import cache_root

_RECIPE = 4  # bump when the data rendering or training loop changes


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """Behaviour-cloning recipe. Every field is part of the checkpoint's cache key.

    The defaults are generic; the presets ``SFTConfig.math_tir()`` and ``SFTConfig.alfworld()`` (by env name:
    ``SFTConfig.for_env(name)``, ``SFT_PRESETS``) are the measured recipes, one checkpoint per env
    (docs/sft.md has their measurements).

    Reproducibility: a recipe and seed rebuild the same weights bit for bit (``streamrl_sft.json`` records
    their sha256) on the same kind of CPU with the same library versions, whatever ``PYTHONHASHSEED``, the
    process's own torch thread count or the number of ALFWorld generation workers. Two things the recipe cannot
    fix change the floats, and through a chaotic training run the success rate (docs/sft.md, Reproducibility):
    the torch thread count, which the build therefore pins to ``threads``; and the CPU's vector instruction
    set, since torch (``ATEN_CPU_CAPABILITY``) and MKL (``MKL_CBWR``) pick AVX-512 or AVX2 kernels by CPU.
    A reproducible build (``sft_checkpoint``'s default) therefore runs in a fresh interpreter started with
    ``REPRODUCIBLE_KERNELS``, the AVX2 path every x86-64 CPU with AVX2 shares, so the same recipe rebuilds the
    same bytes on any such CPU.
    """

    envs: tuple[str, ...]
    """Envs whose expert data is mixed into one training set (one checkpoint plays all of them). One env per
    checkpoint is the recommended use: on ``tiny``, training on both envs together costs Math-TIR most of its
    skill (docs/sft.md)."""
    model: str = "tiny"
    """Registry name or local HF directory of the model to fine-tune."""
    max_expert_episodes: int = 0
    """Per env, the first tasks of the training split (ALFWorld has 128, Math-TIR 271 in
    ``MATH_SFT_FAMILIES``); 0 = all."""
    synthetic_episodes: int = 0
    """Per env with a task generator (``EnvSpec.synthetic_tasks``), extra expert episodes on generated training
    tasks: fresh Math-TIR problems, or ALFWorld games after the 128 of the training split."""
    expert_replays: int = 1
    """Times each training task is played: once by the expert alone, then with DART noise (below)."""
    expert_noise: float = 0.0
    """Per-turn probability of a random action in the replays (envs with ``EnvSpec.random_action``)."""
    expert_slips: float = 0.0
    """Per-turn probability, in every expert episode, of a slip (envs with ``EnvSpec.slip_action``): a near
    miss of the expert's action that the env rejects ("go to cabinet 9" in a kitchen with six), as context,
    followed by the expert's action from the unchanged state, always a target. It teaches the policy what to
    write after "Nothing happens.": greedy decoding in an unchanged state otherwise repeats the rejected
    command to the step limit (``TeacherForcedAgent``)."""
    downsample: tuple[tuple[str, float], ...] = ()
    """``(action prefix, keep probability)`` pairs: an expert turn whose action starts with the prefix is a
    training target with that probability, otherwise context only (``sequences_of``); e.g.
    ``(("go to ", 0.25),)`` keeps a quarter of ALFWorld's search steps, the most frequent of its turns."""
    context_weight: float = 0.0
    """Weight of a language-modelling loss on the context tokens (prompt, observations, tool output), added to
    the action tokens' loss as ``action NLL + context_weight * context NLL`` (each a mean over its tokens).
    The context is most of the tokens (44 times the actions on ALFWorld, 3 times on Math-TIR) and full of
    copies (ALFWorld's admissible commands repeat the objects of the observation, Math-TIR's code the numbers
    of the question), so it trains the copying a small model needs at no extra forward cost; 0 trains on the
    actions alone."""
    epochs: int = 3
    """Passes over the expert data (each in a new order of similar-length batches)."""
    batch_size: int = 4
    """Sequences per step (small batches: more updates per token, which is what a few minutes buy)."""
    lr: float = 5e-3
    """Peak AdamW learning rate (a random-init tiny model needs a high one; use ~1e-4 for pretrained ones)."""
    warmup_steps: int = 20
    """Steps of linear learning-rate warm-up, after which it decays on a cosine to 10% of ``lr``."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    max_grad_norm: float = 1.0
    """The gradient's global norm is clipped to this before every step."""
    lora: LoRAConfig | None = None
    """``None`` = full fine-tuning; otherwise train (and save) a LoRA adapter merged into the checkpoint."""
    seed: int = 0
    """Seeds the expert data (generated tasks, DART noise, downsampling), the batch order, the validation
    tasks and torch's generator while training; the starting weights are the loaded model's, the same for
    every seed."""
    select_best_of: int = 0
    """Model selection: after every epoch, play this many freshly *generated* tasks greedily (envs with
    ``EnvSpec.held_out_tasks``, i.e. Math-TIR; drawn with a seed of their own, so they may repeat a training
    problem by chance but never a test one) and keep the weights of the best epoch; 0 keeps the last epoch.
    On ``tiny`` the epoch at which copying numbers clicks, and whether later epochs undo it, varies with the
    seed."""
    restarts: int = 0
    """Model selection across training runs: when a run's best validation (``select_best_of``) stays below
    ``restart_below``, train again with another seed, up to this many more times. Attempt ``k`` is this recipe
    with seed ``seed + 1000 k`` (``RESTART_SEED_STRIDE``) and no restarts -- a checkpoint of its own, cached
    under its own key and validated on tasks drawn with its own seed -- and the first attempt that reaches
    ``restart_below`` is kept, else the best one. On ``tiny`` whether copying numbers clicks within the
    schedule depends on the seed (docs/sft.md): a run that stalls stays far behind the others to its last
    epoch (validation and loss), so a longer schedule does not rescue it, while another draw of data and batch
    order can click."""
    restart_below: float = 0.0
    """The validation success (0-1) a training run must reach for no restart to follow (``restarts``)."""
    threads: int = 1
    """torch threads while building the checkpoint (expert data, training, model selection); the build sets
    them and restores the caller's count after. Pinned because CPU float reductions split their work by thread
    count: 1 and 2 threads train different weights from the same data. More threads are faster only for a
    lone process (with a busy neighbour, two can be slower than one)."""
    init_from: str | None = None
    """An env name: start from that env's SFT checkpoint (``SFTConfig.for_env(init_from, model=model)``, its preset
    and seed, trained first if not cached) instead of the bare ``model`` -- a curriculum. ALFWorld starts from
    Math-TIR's: the copy skills learnt there (question -> program, output -> answer) are what ALFWorld's
    commands need (copy an admissible command, a receptacle name)."""

    def __post_init__(self) -> None:
        if not self.envs or isinstance(self.envs, str):
            raise ValueError(f"envs must be a non-empty tuple of env names, got {self.envs!r}")
        for name in (*self.envs, *([self.init_from] if self.init_from is not None else [])):
            env_spec(name)
        if self.init_from is not None and self.init_from in SFT_PRESETS:
            if SFT_PRESETS[self.init_from]().init_from is not None:
                raise ValueError(f"init_from={self.init_from!r}: that recipe has an init_from itself")
        if any(not 0.0 < p <= 1.0 for _, p in self.downsample):
            raise ValueError(f"downsample keep probabilities must be in (0, 1], got {self.downsample}")
        if not 0.0 <= self.expert_slips < 1.0:
            raise ValueError(f"expert_slips must be in [0, 1), got {self.expert_slips!r}")
        if self.expert_replays < 1 or not 0.0 <= self.expert_noise < 1.0:
            raise ValueError(
                f"expert_replays must be >= 1 and expert_noise in [0, 1), got {self.expert_replays}, "
                f"{self.expert_noise}"
            )
        if self.select_best_of < 0:
            raise ValueError(f"select_best_of must be >= 0, got {self.select_best_of}")
        if not isinstance(self.restarts, int) or self.restarts < 0:
            raise ValueError(f"restarts must be an int >= 0, got {self.restarts!r}")
        if not 0.0 <= self.restart_below <= 1.0:
            raise ValueError(f"restart_below must be a success rate in [0, 1], got {self.restart_below!r}")
        if self.restarts and not (self.select_best_of and self.restart_below > 0.0):
            raise ValueError(
                f"restarts={self.restarts} needs a validation to judge a run by: select_best_of > 0 and "
                f"restart_below > 0 (got select_best_of={self.select_best_of}, restart_below={self.restart_below})"
            )
        no_held_out = [n for n in self.envs if env_spec(n).held_out_tasks is None]
        if self.select_best_of and no_held_out:
            raise ValueError(
                f"select_best_of needs held-out generated tasks; {no_held_out} have none (use select_best_of=0)"
            )
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError(f"epochs and batch_size must be >= 1, got {self.epochs}, {self.batch_size}")
        if not self.context_weight >= 0.0:
            raise ValueError(f"context_weight must be >= 0, got {self.context_weight}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {self.threads!r}")

    @classmethod
    def math_tir(cls, **overrides: Any) -> SFTConfig:
        """Math-TIR's recipe: the one-line procedural families' training tasks plus 3,000 freshly generated
        ones (copying numbers is learnt from variety), lr 5e-3 and the context loss at 0.3 (the question's
        numbers recur in the program, the tool's output in the answer); 12 epochs, keeping the best epoch on 100
        generated problems, and up to 2 more training runs with other seeds while the best stays below 40 %.
        On ``tiny`` copying clicks at a seed- and CPU-dependent epoch, or not at all within the schedule: the
        longer schedule gives slow runs time, the restarts replace the ones that stall (docs/sft.md)."""
        return cls(
            **{
                "envs": ("math_tir",),
                "synthetic_episodes": 3000,
                "epochs": 12,
                "lr": 5e-3,
                "context_weight": 0.3,
                "select_best_of": 100,
                "restarts": 2,
                "restart_below": 0.4,
                **overrides,
            }
        )

    @classmethod
    def alfworld(cls, **overrides: Any) -> SFTConfig:
        """ALFWorld's recipe (its measurements and the variants not kept: docs/sft.md). 1,152 games (the 128 RL
        trains on and 1,024 more of the same floor plans), 2 epochs from Math-TIR's checkpoint (its copy skills
        are what ALFWorld's commands need), the context loss at 0.3 (the observations and admissible commands
        teach copying object names), and part of the frequent turns left as context only: 3 in 10 "go to" and
        3 in 10 "open" turns are targets. The search step ("go to" the
        receptacle after the current one in the room description) is the hard one: it needs enough of its turns
        as targets to be learnt, and enough games for the variety of objects and rooms that ``take`` and
        ``move`` need."""
        return cls(
            **{
                "envs": ("alfworld",),
                "init_from": "math_tir",
                "synthetic_episodes": 1024,
                "downsample": (("go to ", 0.3), ("open ", 0.3)),
                "epochs": 2,
                "lr": 5e-3,
                "context_weight": 0.3,
                **overrides,
            }
        )

    @classmethod
    def for_env(cls, env_name: str, **overrides: Any) -> SFTConfig:
        """The preset of env ``env_name`` (``SFT_PRESETS``) with ``overrides``: the config of its checkpoint."""
        env_spec(env_name)
        if env_name not in SFT_PRESETS:
            raise ValueError(f"env {env_name!r} has no SFT preset; presets: {sorted(SFT_PRESETS)}")
        return SFT_PRESETS[env_name](**overrides)

    def start(self) -> SFTConfig | None:
        """The config of the checkpoint this one starts from (``init_from``), or ``None`` (bare ``model``)."""
        return None if self.init_from is None else SFTConfig.for_env(self.init_from, model=self.model)

    def key(self) -> str:
        """The checkpoint's cache key: a hash of every field, the base model's directory name, the data and
        training code's version (``_RECIPE``) and, through ``init_from``, the key of the checkpoint it starts
        from (so a changed Math-TIR preset changes ALFWorld's key too). ``threads`` enters only when it is not 1."""
        model_key = resolve_model(self.model).name
        start = self.start()
        config = asdict(self)
        if config["threads"] == 1:
            del config["threads"]  # checkpoints built before the field (all on 1 thread) keep their keys
        if not config["restarts"]:
            del config["restarts"], config["restart_below"]  # so do those built before restarts
        if not config["expert_slips"]:
            del config["expert_slips"]  # and those built before slips
        blob = json.dumps(
            {
                "config": config,
                "model_dir": model_key,
                "recipe": _RECIPE,
                "start": start.key() if start is not None else None,
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


SFT_PRESETS: dict[str, Callable[..., SFTConfig]] = {
    "alfworld": SFTConfig.alfworld,
    "math_tir": SFTConfig.math_tir,
}
"""Env name -> its ``SFTConfig`` preset (called with field overrides): the envs ``streamrl sft`` trains."""


def train_sft(
    model: Any,
    sequences: Sequence[TokenSequence],
    config: SFTConfig,
    pad_token_id: int,
    log: Callable[[str], None] = print,
    validate: Callable[[Any], float] | None = None,
) -> list[float]:
    """Behaviour cloning of ``sequences`` into ``model`` (in place); returns the loss of every step.

    With ``validate`` (model -> score, higher is better), it is called after every epoch and the model ends with
    the weights of the best-scoring epoch (the earliest among ties)."""
    params = list(trainable_parameters(model))
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    # Batches of similar length waste less compute on padding: sort, chunk, then shuffle the chunks.
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    chunks = [order[i : i + config.batch_size] for i in range(0, len(order), config.batch_size)]
    total = config.epochs * len(chunks)

    def lr_at(step: int) -> float:  # linear warm-up, cosine decay to 10%
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, total - config.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    rng = random.Random(config.seed)
    losses: list[float] = []
    best: tuple[float, int, dict[str, torch.Tensor]] | None = None
    model.train()
    started = time.perf_counter()
    for epoch in range(config.epochs):
        rng.shuffle(chunks)
        for chunk in chunks:
            loss, _ = sft_loss(model, [sequences[i] for i in chunk], pad_token_id, config.context_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
            optimizer.step()
            scheduler.step()
            losses.append(float(loss.detach()))
        recent = losses[-len(chunks) :]
        message = f"epoch {epoch + 1}/{config.epochs}: loss {sum(recent) / len(recent):.3f}"
        if validate is not None:
            score = validate(model)
            model.train()
            if best is None or score > best[0]:
                best = (score, epoch + 1, {k: v.detach().clone() for k, v in model.state_dict().items()})
            message += f", validation {score:.3f} (best: epoch {best[1]})"
        log(f"{message} ({time.perf_counter() - started:.0f}s)")
    if best is not None:
        model.load_state_dict(best[2])
    model.eval()
    return losses


def _shipped_root() -> Path:
    """The folder of package ``streamrl.checkpoints`` (package data): ``checkpoints/`` in a checkout, inside
    site-packages in a wheel or ``pip install .``. An editable install made before that package existed does not
    know it; its checkout's ``checkpoints/``, beside this package's folder, is then the same folder."""
    try:
        return Path(str(resources.files("streamrl.checkpoints")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[1] / "checkpoints"


SHIPPED = _shipped_root()
"""Cold-start checkpoints shipped with streamrl, one directory per cache name (``<model>-sft-<key>``) holding
the checkpoint's files and ``SHA256SUMS``: what its own recipe built, so a fresh machine need not pay for the
build. ``streamrl sft --envs ENV --no-shipped`` rebuilds one (``docs/sft.md``: Shipped checkpoints)."""


def shipped_checkpoint(name: str, root: Path | None = None) -> Path | None:
    """The shipped copy of cache entry ``name`` under ``root`` (default ``SHIPPED``), its files checked against
    its ``SHA256SUMS``; ``None`` if there is none. A file that does not match raises ``ValueError``."""
    src = (SHIPPED if root is None else root) / name
    sums = src / "SHA256SUMS"
    if not sums.is_file():
        return None
    for line in sums.read_text().splitlines():
        digest, _, file = line.partition("  ")
        path = src / file
        if not path.is_file() or sha256_file(path) != digest:
            raise ValueError(
                f"shipped checkpoint {src}: {file} does not match its sha256 in SHA256SUMS (corrupted or "
                "changed; restore it with git, or build it with `streamrl sft --no-shipped`)"
            )
    return src


def sft_checkpoint(
    config: SFTConfig | str,
    log: Callable[[str], None] = print,
    shipped: bool = True,
    reproducible: bool = True,
) -> Path:
    """The fine-tuned model directory for ``config`` (or for env name ``config``'s preset,
    ``SFTConfig.for_env``), trained and cached on first use under ``$STREAMRL_CACHE/sft/`` (atomic, locked)::

        HFBackend(sft_checkpoint("math_tir"))   # start Math-TIR RL from its SFT checkpoint

    With ``shipped`` a checkpoint kept in the repository under the same name (``SHIPPED``) is copied into the
    cache, after its sha256 are checked, instead of being built. With ``reproducible`` a build runs in a fresh
    interpreter on the shared AVX2 kernel path (``REPRODUCIBLE_KERNELS``), so its bytes do not depend on the
    CPU model or on the caller's kernel variables; ``reproducible=False`` builds in this process with whatever
    kernels it uses (AVX-512 where the CPU has them; weights particular to the CPU model). The kernel path is
    not part of the cache key: a cached checkpoint is returned whichever path built it (``platform.kernels`` in
    its ``streamrl_sft.json`` says which).
    """
    if isinstance(config, str):
        config = SFTConfig.for_env(config)
    base = resolve_model(config.model)
    target = cache_root() / "sft" / f"{base.name}-sft-{config.key()}"
    target.parent.mkdir(parents=True, exist_ok=True)

    def build(out: Path) -> None:
        src = shipped_checkpoint(target.name) if shipped else None
        if src is not None:
            _copy_files(src, out, skip="SHA256SUMS")
            log(f"SFT checkpoint {target.name}: the shipped copy ({src}, sha256 checked)")
            return
        if config.restarts:
            _keep_an_attempt(out, config, log, shipped, reproducible)
            return
        start = config.start()  # the checkpoint to start from is built (or found) first, under its own lock
        start_dir = None if start is None else sft_checkpoint(start, log, reproducible=reproducible)
        if reproducible:
            run_in_reproducible_interpreter(
                "streamrl.algorithms.sft:_build_checkpoint",
                (out, config, base, start_dir),
                what=f"SFT checkpoint {target.name}",
                required=True,
                log=log,
            )
            return
        _build_checkpoint(out, config, base, start_dir, log)

    return build_once(target, build)


RESTART_SEED_STRIDE = 1000
"""Attempt ``k`` of a recipe with restarts trains seed ``seed + RESTART_SEED_STRIDE * k`` (``SFTConfig.restarts``)."""


def restart_attempts(config: SFTConfig) -> list[SFTConfig]:
    """The training runs a recipe with restarts may try, in order: itself with seed ``seed + 1000 k`` and no
    restarts, for ``k = 0 .. restarts`` (attempt 0 is the recipe's plain run)."""
    return [
        replace(config, seed=config.seed + RESTART_SEED_STRIDE * k, restarts=0, restart_below=0.0)
        for k in range(config.restarts + 1)
    ]


def _copy_files(src: Path, out: Path, skip: str) -> None:
    """Copy the files of checkpoint directory ``src`` into ``out``, all but the one named ``skip``."""
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name != skip:
            shutil.copyfile(f, out / f.name)


def _keep_an_attempt(
    out: Path, config: SFTConfig, log: Callable[[str], None], shipped: bool, reproducible: bool
) -> None:
    """Build (or find) ``config``'s attempts in order until one's best validation reaches ``restart_below``; copy
    that one (else the best) into ``out``, its report extended with ``restarts``: every attempt tried, its seed,
    key, best validation, weights' sha256 and build times (what the recipe cost), and which was kept."""
    tried: list[tuple[SFTConfig, Path, dict[str, Any]]] = []  # (attempt, its checkpoint, its report)
    for attempt in restart_attempts(config):
        path = sft_checkpoint(attempt, log, shipped=shipped, reproducible=reproducible)
        report = json.loads((path / "streamrl_sft.json").read_text())
        tried.append((attempt, path, report))
        best = max(report["validation_by_epoch"])
        log(f"attempt {len(tried) - 1} (seed {attempt.seed}): best validation {best:.3f}")
        if best >= config.restart_below:
            break
    scores = [max(r["validation_by_epoch"]) for _, _, r in tried]
    kept = scores.index(max(scores))  # the earliest among ties
    _copy_files(tried[kept][1], out, skip="streamrl_sft.json")
    report = {
        **tried[kept][2],
        "config": asdict(config),
        "restarts": {
            "kept": kept,
            "attempts": [
                {
                    "seed": attempt.seed,
                    "key": attempt.key(),
                    "best_validation": score,
                    "weights_sha256": r["weights_sha256"],
                    "collect_s": sum(d["collect_s"] for d in r["data"].values()),
                    "train_s": r["train_s"],
                }
                for (attempt, _, r), score in zip(tried, scores, strict=True)
            ],
        },
    }
    (out / "streamrl_sft.json").write_text(json.dumps(report, indent=2, sort_keys=True))


def _build_checkpoint(
    out: Path, config: SFTConfig, base: Path, start_dir: Path | None, log: Callable[[str], None]
) -> None:
    """Collect the expert data, train and save the checkpoint of ``config`` into ``out`` with its report
    ``streamrl_sft.json`` (the sha256 of the weights, of the starting weights and of the training data, and
    the platform facts that change the floats), on ``config.threads`` torch threads (the caller's count is
    restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        _build_checkpoint_on_threads(out, config, base, start_dir, log)
    finally:
        torch.set_num_threads(threads)


def _build_checkpoint_on_threads(
    out: Path, config: SFTConfig, base: Path, start_dir: Path | None, log: Callable[[str], None]
) -> None:
    tokenizer = load_tokenizer(base)
    sequences: list[TokenSequence] = []
    stats: dict[str, Any] = {}
    for name in config.envs:
        started = time.perf_counter()
        spec = env_spec(name)
        synthetic = config.synthetic_episodes if spec.synthetic_tasks is not None else 0
        noisy = spec.random_action is not None
        trajs = expert_trajectories(
            name,
            tokenizer,
            limit=config.max_expert_episodes or None,
            synthetic=synthetic,
            seed=config.seed,
            replays=config.expert_replays if noisy else 1,
            noise=config.expert_noise if noisy else 0.0,
            slips=config.expert_slips if spec.slip_action is not None else 0.0,
        )
        downsample_turns(trajs, config.downsample, random.Random(config.seed))
        seqs = sequences_of(trajs)
        stats[name] = {
            "episodes": len(trajs),
            "sequences": len(seqs),
            "tokens": sum(len(s) for s in seqs),
            "action_tokens": sum(s.num_action_tokens for s in seqs),
            "collect_s": round(time.perf_counter() - started, 1),
        }
        log(f"expert data {name}: {stats[name]}")
        sequences.extend(seqs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = load_model(base if start_dir is None else start_dir)
        started = time.perf_counter()
        if config.lora is not None:
            model = wrap_lora(model, config.lora)
        validation: list[float] = []
        validate = _validator(config, tokenizer, validation) if config.select_best_of else None
        losses = train_sft(model, sequences, config, int(tokenizer.pad_token_id), log, validate)
    if config.lora is not None:
        model = model.merge_and_unload()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    report = {
        "config": asdict(config),
        "base_model": str(base),
        "start": None if start_dir is None else str(start_dir),
        "data": stats,
        "steps": len(losses),
        "validation_by_epoch": validation,
        "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
        "train_s": round(time.perf_counter() - started, 1),
        "weights_sha256": weights_sha256(out),
        "tokenizer_sha256": sha256_file(out / "tokenizer.json"),
        "base_weights_sha256": weights_sha256(base),
        "start_weights_sha256": None if start_dir is None else weights_sha256(start_dir),
        "data_sha256": sequences_sha256(sequences),
        "platform": _platform(),
    }
    (out / "streamrl_sft.json").write_text(json.dumps(report, indent=2, sort_keys=True))


def weights_sha256(model_dir: str | os.PathLike[str]) -> dict[str, str]:
    """``{file name: sha256}`` of the ``*.safetensors`` files of a model directory (what ``sha256sum`` prints):
    the identity of a checkpoint's weights, which ``streamrl_sft.json`` records."""
    return {f.name: sha256_file(f) for f in sorted(Path(model_dir).glob("*.safetensors"))}


def sequences_sha256(sequences: Sequence[TokenSequence]) -> str:
    """sha256 of the training data as trained on: each sequence's token ids and action mask, in order. Two
    builds with equal data and different weights differ in training, not in data."""
    digest = hashlib.sha256()
    for seq in sequences:
        digest.update(json.dumps([list(seq.token_ids), list(seq.action_mask)]).encode())
    return digest.hexdigest()


def _platform() -> dict[str, Any]:
    """What besides the recipe changes the trained floats: library versions, torch's thread count and the
    CPU kernels torch uses, and the variables that force a kernel choice (``SFTConfig`` docstring)."""
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "env": {k: os.environ[k] for k in REPRODUCIBLE_KERNELS if k in os.environ},
        "kernels": "reproducible" if on_reproducible_kernels() else "native",
    }


def _validator(config: SFTConfig, tokenizer: Any, scores: list[float]) -> Callable[[Any], float]:
    """``model -> mean greedy success`` on ``config.select_best_of`` held-out generated tasks per env
    (``EnvSpec.held_out_tasks``); appends to ``scores``."""
    held_out = {}
    for name in config.envs:
        generate = env_spec(name).held_out_tasks
        assert generate is not None  # SFTConfig checks it
        held_out[name] = generate(config.select_best_of, config.seed)

    def validate(model: Any) -> float:
        backend = HFBackend(model, tokenizer=tokenizer)  # the model as it is, on its own device
        rates = []
        for name, env_kwargs in held_out.items():
            spec = env_spec(name)
            greedy = SamplingParams(max_new_tokens=spec.max_new_tokens, temperature=0.0)
            agent = spec.llm_agent(backend, greedy)
            played = play_tasks(agent, name, spec.train_split, config.select_best_of, env_kwargs=env_kwargs)
            rates.append(played.success_rate)
        scores.append(sum(rates) / len(rates))
        return scores[-1]

    return validate
