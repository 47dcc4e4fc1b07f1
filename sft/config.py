"""The SFT cold start's recipe: ``SFTConfig`` (every field part of the checkpoint's cache key) and its presets,
one per env (``SFT_PRESETS``)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from streamrl.agents.env_specs import env_spec
from streamrl.agents.lora import LoRAConfig
from streamrl.agents.models import model_dir_name

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
    stop_above: float = 0.0
    """Early stopping at a target (needs ``select_best_of``): end training after the first epoch whose
    validation reaches this success (0-1), keeping that epoch; 0 trains every epoch. The learning-rate schedule
    stays the one of ``epochs``, so a stopped run is exactly the first epochs of the full run. For a start that
    RL should still have room to improve (the demo's: docs/sft.md) rather than the strongest one."""
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
        if not 0.0 <= self.stop_above <= 1.0:
            raise ValueError(f"stop_above must be a success rate in [0, 1], got {self.stop_above!r}")
        if self.stop_above and not self.select_best_of:
            raise ValueError(
                f"stop_above={self.stop_above} needs a validation to stop on: select_best_of > 0 (got 0)"
            )
        if self.stop_above and self.restarts and self.restart_below > self.stop_above:
            raise ValueError(
                f"restart_below={self.restart_below} > stop_above={self.stop_above}: every run would stop below "
                "the validation its restart asks for; use restart_below <= stop_above"
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
        spec = env_spec(env_name)
        if env_name not in SFT_PRESETS:
            why = " and no expert to clone (EnvSpec.expert is None)" if spec.expert is None else ""
            raise ValueError(
                f"env {env_name!r} has no SFT preset{why}; presets: {sorted(SFT_PRESETS)}. An SFT cold start "
                "clones an expert's episodes: start from the model as it is with init='base' (--init base)"
            )
        return SFT_PRESETS[env_name](**overrides)

    def start(self) -> SFTConfig | None:
        """The config of the checkpoint this one starts from (``init_from``), or ``None`` (bare ``model``)."""
        return None if self.init_from is None else SFTConfig.for_env(self.init_from, model=self.model)

    def key(self) -> str:
        """The checkpoint's cache key: a hash of every field, the base model's directory name, the data and
        training code's version (``_RECIPE``) and, through ``init_from``, the key of the checkpoint it starts
        from (so a changed Math-TIR preset changes ALFWorld's key too). ``threads`` enters only when it is not 1."""
        model_key = model_dir_name(self.model)
        start = self.start()
        config = asdict(self)
        if config["threads"] == 1:
            del config["threads"]  # checkpoints built before the field (all on 1 thread) keep their keys
        if not config["restarts"]:
            del config["restarts"], config["restart_below"]  # so do those built before restarts
        if not config["expert_slips"]:
            del config["expert_slips"]  # and those built before slips
        if not config["stop_above"]:
            del config["stop_above"]  # and those built before early stopping
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
