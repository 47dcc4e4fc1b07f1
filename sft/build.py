"""The SFT cold start's build: ``train_sft`` (behaviour cloning with AdamW, warm-up and cosine decay, optional
selection of the best epoch), and ``sft_checkpoint``, the cached checkpoint per recipe -- copied from the shipped
checkpoints (``SHIPPED``) when one matches, else built once under a lock, on reproducible kernels by default.
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
from dataclasses import asdict, replace
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from streamrl.agents.base import SamplingParams
from streamrl.agents.env_specs import env_spec, play_tasks
from streamrl.agents.hf_backend import HFBackend
from streamrl.agents.lora import trainable_parameters, wrap_lora
from streamrl.agents.models import (
    build_once,
    load_model,
    load_tokenizer,
    model_dir_name,
    resolve_model,
    sha256_file,
)
from streamrl.agents.teacher_forcing import downsample_turns, expert_trajectories, sequences_of
from streamrl.agents.trajectory import TokenSequence
from streamrl.sft.config import SFTConfig
from streamrl.sft.loss import sft_loss
from streamrl.utils.cache import cache_root
from streamrl.utils.reproducible import (
    REPRODUCIBLE_KERNELS,
    on_reproducible_kernels,
    run_in_reproducible_interpreter,
)


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
    the weights of the best-scoring epoch (the earliest among ties); with ``config.stop_above`` too, training
    ends after the first epoch that scores at least that (the schedule stays the full run's)."""
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
        if validate is not None and config.stop_above and best is not None and best[0] >= config.stop_above:
            log(f"validation reached stop_above={config.stop_above}: stopping after epoch {epoch + 1}")
            break
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
    # the base model is named without being built: a shipped or cached checkpoint does not need it
    target = cache_root() / "sft" / f"{model_dir_name(config.model)}-sft-{config.key()}"
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
        base = resolve_model(config.model)
        if reproducible:
            run_in_reproducible_interpreter(
                "streamrl.sft.build:_build_checkpoint",
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
