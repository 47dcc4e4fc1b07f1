"""SFT cold start: per-env presets and their chained cache keys, model selection, it helps, and a recipe
rebuilds bit for bit."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from streamrl.agents.base import SamplingParams
from streamrl.agents.env_specs import env_spec
from streamrl.agents.hf_backend import HFBackend
from streamrl.agents.models import load_tokenizer, resolve_model
from streamrl.agents.teacher_forcing import expert_trajectories, sequences_of
from streamrl.cli.demo import DEMO_COLD_START
from streamrl.evaluation.harness import evaluate
from streamrl.sft import SFT_PRESETS, SFTConfig, sequences_sha256, sft_checkpoint, weights_sha256
from streamrl.sft import build as sft_module


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return load_tokenizer(resolve_model("tiny"))


def test_per_env_recipes_chain_their_cache_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    # ALFWorld starts from Math-TIR's checkpoint: its key must change whenever the Math-TIR recipe does.
    alfworld, math = SFTConfig.for_env("alfworld"), SFTConfig.for_env("math_tir")
    assert alfworld == SFTConfig.alfworld() and math == SFTConfig.math_tir()
    assert alfworld.envs == ("alfworld",) and alfworld.start() == math and math.start() is None
    before = alfworld.key()
    math_tir = SFT_PRESETS["math_tir"]
    monkeypatch.setitem(SFT_PRESETS, "math_tir", lambda **kw: math_tir(**{"epochs": 1, **kw}))
    assert SFTConfig.for_env("alfworld").key() != before
    with pytest.raises(ValueError, match="non-empty tuple"):
        SFTConfig(envs="alfworld")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown env 'minecraft'"):
        SFTConfig.for_env("alfworld", init_from="minecraft")
    with pytest.raises(ValueError, match="unknown env 'minecraft'"):
        SFTConfig.for_env("minecraft")
    with pytest.raises(ValueError, match="keep probabilities"):
        SFTConfig.for_env("alfworld", downsample=(("go to ", 0.0),))


def test_preset_cache_keys_are_pinned() -> None:
    # Cached checkpoints are found by these keys (and the model they start from): a change to a preset, to a
    # field's default or to the data and training code (``_RECIPE``) must be deliberate, and update them here.
    assert SFTConfig.math_tir().key() == "d41789ea3afb"
    assert SFTConfig.alfworld().key() == "c3b551642be1"
    assert SFTConfig.math_tir(seed=1).key() == "f279cf049b6e"
    assert SFTConfig.math_tir(threads=2).key() == "469cdca2611e"  # 2 threads train other weights
    # the demo's start: the preset's run stopped at the first epoch with validation >= .25 (epoch 3 at seed 0)
    assert SFTConfig.math_tir(**DEMO_COLD_START).key() == "36ea415127a2"
    # the one before it, 3 epochs without selection (built on an AVX-512 Xeon's own kernels, no longer shipped)
    assert SFTConfig.math_tir(epochs=3, select_best_of=0, restarts=0).key() == "732c15efd455"
    # the preset has restarts: its first training run is a plain checkpoint of its own (restarts enter no key
    # when there are none), the seed-0 run of the 12-epoch schedule measured in docs/sft.md
    preset = SFTConfig.math_tir()
    first = sft_module.restart_attempts(preset)[0]
    assert first.key() == SFTConfig.math_tir(restarts=0).key() == "fe531e048aa5"
    assert [a.seed for a in sft_module.restart_attempts(replace(preset, seed=2))] == [2, 1002, 2002]


def test_model_selection_keeps_the_best_epoch(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from streamrl.agents.models import load_model
    from streamrl.sft import train_sft

    seqs = sequences_of(expert_trajectories("math_tir", tokenizer, limit=4))
    model = load_model(resolve_model("tiny"))
    snapshots: list[dict[str, torch.Tensor]] = []
    scores = iter([0.25, 0.5, 0.5, 0.125])  # epoch 2 is best (epoch 3 only ties it)

    def validate(m: torch.nn.Module) -> float:
        snapshots.append({k: v.clone() for k, v in m.state_dict().items()})
        return next(scores)

    config = SFTConfig(envs=("math_tir",), epochs=4, batch_size=2, lr=5e-3)
    train_sft(model, seqs, config, tokenizer.pad_token_id, log=lambda _: None, validate=validate)
    final = model.state_dict()
    assert not all(torch.equal(final[k], snapshots[3][k]) for k in final)  # the last epoch was undone
    assert all(torch.equal(final[k], snapshots[1][k]) for k in final)
    with pytest.raises(ValueError, match="select_best_of"):
        SFTConfig(envs=("alfworld",), select_best_of=8)  # ALFWorld has no held-out generated tasks


def test_early_stopping_keeps_the_first_epoch_that_reaches_the_target(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from streamrl.agents.models import load_model
    from streamrl.sft import train_sft

    seqs = sequences_of(expert_trajectories("math_tir", tokenizer, limit=4))

    def run(stop_above: float) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor], list[float]]:
        model = load_model(resolve_model("tiny"))
        snapshots: list[dict[str, torch.Tensor]] = []
        scores = iter([0.25, 0.5, 0.75, 0.125])

        def validate(m: torch.nn.Module) -> float:
            snapshots.append({k: v.clone() for k, v in m.state_dict().items()})
            return next(scores)

        config = SFTConfig(
            envs=("math_tir",), epochs=4, batch_size=2, lr=5e-3, select_best_of=1, stop_above=stop_above
        )
        losses = train_sft(model, seqs, config, tokenizer.pad_token_id, log=lambda _: None, validate=validate)
        return snapshots, model.state_dict(), losses

    full, _, full_losses = run(0.0)
    stopped, final, losses = run(0.5)
    assert len(full) == 4 and len(stopped) == 2  # validation .5 at epoch 2 reached the target: no epoch 3
    # a stopped run is the full run's first epochs exactly (the schedule is the full run's), ending at epoch 2
    assert losses == full_losses[: len(losses)] and len(losses) == len(full_losses) // 2
    assert all(torch.equal(final[k], full[1][k]) for k in final)
    with pytest.raises(ValueError, match=r"stop_above=0\.5 needs a validation"):
        SFTConfig(envs=("math_tir",), stop_above=0.5)
    with pytest.raises(ValueError, match=r"restart_below=0\.4 > stop_above=0\.3"):
        SFTConfig.math_tir(stop_above=0.3)  # the preset restarts below .4
    assert SFTConfig.math_tir(stop_above=0.0).key() == SFTConfig.math_tir().key()  # 0: the key of before


def test_restarts_keep_the_first_attempt_that_validates_else_the_best(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each attempt is a real (small) build; only its validation score is scripted, by the attempt's seed.
    monkeypatch.setattr(sft_module, "cache_root", lambda: tmp_path)
    best_by_seed = {0: 0.1, 1000: 0.3, 2000: 0.2}

    def scripted(config: SFTConfig, tokenizer: object, scores: list[float]):  # type: ignore[no-untyped-def]
        def validate(model: object) -> float:
            scores.append(best_by_seed[config.seed])
            return scores[-1]

        return validate

    monkeypatch.setattr(sft_module, "_validator", scripted)
    small = dict(
        max_expert_episodes=4, synthetic_episodes=4, epochs=1, batch_size=4, select_best_of=1, restarts=0
    )
    # In this process (reproducible=False), where the scripted validator is patched in.
    build = functools.partial(sft_checkpoint, log=lambda _: None, reproducible=False)
    path = build(SFTConfig.math_tir(**{**small, "restarts": 2, "restart_below": 0.5}))
    restarts = json.loads((path / "streamrl_sft.json").read_text())["restarts"]
    assert [a["seed"] for a in restarts["attempts"]] == [0, 1000, 2000]  # none reached 0.5: all were tried
    assert restarts["kept"] == 1  # ... and the best was kept
    attempts = [build(SFTConfig.math_tir(**small, seed=s)) for s in (0, 1000)]
    assert [a["key"] for a in restarts["attempts"][:2]] == [p.name.rsplit("-", 1)[1] for p in attempts]
    assert weights_sha256(path) == weights_sha256(attempts[1]) != weights_sha256(attempts[0])
    # the first attempt that reaches the bar ends the search (attempts 0 and 1 are cached by now)
    path = build(SFTConfig.math_tir(**{**small, "restarts": 2, "restart_below": 0.25}))
    restarts = json.loads((path / "streamrl_sft.json").read_text())["restarts"]
    assert [a["seed"] for a in restarts["attempts"]] == [0, 1000] and restarts["kept"] == 1
    with pytest.raises(ValueError, match="restarts=1 needs a validation"):
        SFTConfig.math_tir(restarts=1, restart_below=0.3, select_best_of=0)  # nothing to judge a run by


def _clone_and_play(config: SFTConfig, max_loss: float) -> tuple[dict, dict]:
    """Build ``config`` (its one env's first ``max_expert_episodes`` training tasks), check it fit them, and play
    those tasks greedily with the SFT'd model and with the untrained one: (trained, untrained) results."""
    (env,), episodes = config.envs, config.max_expert_episodes
    path = sft_checkpoint(config)
    report = json.loads((path / "streamrl_sft.json").read_text())
    assert report["data"][env]["episodes"] == episodes and report["final_loss"] < max_loss, report
    greedy = SamplingParams(max_new_tokens=env_spec(env).max_new_tokens, temperature=0.0)
    trained = evaluate(HFBackend(path), env, "train", episodes=episodes, sampling=greedy, batch_size=episodes)
    untrained = evaluate(
        HFBackend("tiny"), env, "train", episodes=episodes, sampling=greedy, batch_size=episodes
    )
    return trained, untrained


@pytest.mark.slow
def test_sft_improves_over_untrained_model() -> None:
    # CI-sized: 16 Math-TIR expert episodes (no synthetic ones), trained long enough to clone them; success is
    # measured on those training tasks (greedy), which the untrained model never solves. The full recipes' rates
    # on held-out splits are in docs/sft.md (streamrl sft).
    config = SFTConfig(
        envs=("math_tir",), max_expert_episodes=16, synthetic_episodes=0, epochs=30, batch_size=4, lr=5e-3
    )
    trained, untrained = _clone_and_play(config, max_loss=0.5)
    assert untrained["success_rate"] == 0.0
    assert trained["valid_action_rate"] > untrained["valid_action_rate"] + 0.3
    assert trained["success_rate"] >= 0.25, trained


@pytest.mark.slow
def test_alfworld_sft_improves_over_untrained_model() -> None:
    # CI-sized, as above: the expert's episodes on 8 training games (TextWorld games, played through the agent's
    # own rendering), 20 epochs from Math-TIR's checkpoint as the ALFWorld recipe starts; then greedy play of
    # those 8 games within the env's 50-step limit. The untrained model never issues an admissible command. The
    # full recipe's rates on eval_seen / eval_unseen are in docs/sft.md (benchmarks/bench_cold_start.py).
    config = SFTConfig(
        envs=("alfworld",), init_from="math_tir", max_expert_episodes=8, epochs=20, context_weight=0.3
    )
    trained, untrained = _clone_and_play(config, max_loss=0.3)
    assert untrained["success_rate"] == 0.0 and untrained["valid_action_rate"] < 0.05, untrained
    assert trained["valid_action_rate"] > 0.4, trained
    # At least 3 of the 8 games; measured: 6 of 8 (5 of 8 from the 8-epoch Math-TIR lever, docs/sft.md).
    assert trained["success_rate"] >= 0.375, trained


# One process of the rebuild test: sets its own torch thread count (argv[1]), which the build must not depend on,
# builds a small Math-TIR recipe (and the tiny base model) into the fresh $STREAMRL_CACHE, prints the paths.
_REBUILD = """
import json, sys
import torch
torch.set_num_threads(int(sys.argv[1]))
from streamrl.agents.models import resolve_model
from streamrl.sft import SFTConfig, sft_checkpoint
config = SFTConfig.math_tir(max_expert_episodes=16, synthetic_episodes=32, epochs=1, select_best_of=0, restarts=0)
path = sft_checkpoint(config, log=lambda _: None)
print(json.dumps({"sft": str(path), "base": str(resolve_model("tiny")), "threads": torch.get_num_threads()}))
"""


def _files(directory: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.iterdir())}


@pytest.mark.slow
def test_a_recipe_rebuilds_bit_for_bit_in_fresh_caches(tmp_path: Path) -> None:
    # Issue 14: the same recipe and seed gave different models. Two processes, each with a fresh cache (the tiny
    # model and its tokenizer are trained again), another PYTHONHASHSEED and another torch thread count of its
    # own (1 and 2 threads train different weights unless the build pins them), must write the same bytes.
    # Issue 36: one is started on torch's scalar kernels and one on its AVX2 kernels (without the reproducible
    # build's own interpreter they train different weights on an AVX-512 CPU).
    builds = []
    for k, (threads, kernels) in enumerate(((1, "default"), (2, "avx2"))):
        env = {
            **os.environ,
            "STREAMRL_CACHE": str(tmp_path / f"cache{k}"),
            "PYTHONHASHSEED": str(k + 1),
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "ATEN_CPU_CAPABILITY": kernels,
        }
        env.pop("MKL_CBWR", None)
        run = subprocess.run(
            [sys.executable, "-c", _REBUILD, str(threads)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        out = json.loads(run.stdout.strip().splitlines()[-1])
        assert out["threads"] == threads  # the caller's thread count is restored after the build
        builds.append((Path(out["base"]), Path(out["sft"])))
    (base_a, sft_a), (base_b, sft_b) = builds
    assert sft_a.name == sft_b.name  # the same cache key
    assert _files(base_a) == _files(base_b)
    report_a, report_b = (json.loads((d / "streamrl_sft.json").read_text()) for d in (sft_a, sft_b))
    files_a, files_b = _files(sft_a), _files(sft_b)
    files_a.pop("streamrl_sft.json"), files_b.pop("streamrl_sft.json")  # paths and timings differ
    assert files_a == files_b
    # The report names the weights, the weights it started from, and the data.
    assert (
        report_a["weights_sha256"]
        == weights_sha256(sft_a)
        == {"model.safetensors": files_a["model.safetensors"]}
    )
    assert report_a["tokenizer_sha256"] == files_a["tokenizer.json"]
    assert (
        report_a["base_weights_sha256"] == weights_sha256(base_a) and report_a["start_weights_sha256"] is None
    )
    assert report_a["data_sha256"] == report_b["data_sha256"]
    assert report_a["platform"]["threads"] == report_b["platform"]["threads"] == 1
    for report in (report_a, report_b):
        assert report["platform"]["kernels"] == "reproducible"
        assert report["platform"]["cpu_capability"] == "AVX2"


def test_a_reproducible_build_refuses_a_cpu_off_the_avx2_path(tmp_path: Path) -> None:
    # The build's interpreter checks the kernel path torch took before any work. An interpreter on torch's
    # scalar kernels stands in for a CPU without AVX2: it must refuse by name and point at the opt-out.
    job = tmp_path / "job.pkl"
    args = (tmp_path / "out", SFTConfig.math_tir(), tmp_path / "base", None)
    job.write_bytes(pickle.dumps(("streamrl.sft.build:_build_checkpoint", args, "a checkpoint", True)))
    run = subprocess.run(
        [sys.executable, "-c", "from streamrl.utils.reproducible import _child; _child()", str(job)],
        env={**os.environ, "ATEN_CPU_CAPABILITY": "default"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "reproducible build of a checkpoint refused" in run.stdout, run.stdout
    assert "torch runs its DEFAULT kernels" in run.stdout and "--native-kernels" in run.stdout
    assert not (tmp_path / "out").exists()


def test_data_fingerprint_covers_tokens_and_masks(tokenizer) -> None:  # type: ignore[no-untyped-def]
    seqs = sequences_of(expert_trajectories("math_tir", tokenizer, limit=2))
    digest = sequences_sha256(seqs)
    assert digest == sequences_sha256(list(seqs)) and len(digest) == 64
    seqs[0].action_mask[-1] = 1 - seqs[0].action_mask[-1]
    assert sequences_sha256(seqs) != digest
    assert sequences_sha256(seqs[::-1]) != sequences_sha256(seqs)


# ---------------------------------------------------------------------------------------------------------
# Shipped checkpoints (package streamrl.checkpoints: checkpoints/ in the repository)


def test_the_shipped_checkpoints_are_the_current_recipes_and_intact() -> None:
    from streamrl.sft import SHIPPED, shipped_checkpoint

    # Both presets (what `streamrl train --init sft` starts from) and the demo's start. A recipe change moves a
    # key: its shipped copy would no longer be used, so this fails until it is rebuilt.
    names = {
        f"{resolve_model('tiny').name}-sft-{config.key()}"
        for config in (SFTConfig.math_tir(), SFTConfig.alfworld(), SFTConfig.math_tir(**DEMO_COLD_START))
    }
    # SHIPPED is package streamrl.checkpoints: beside the checkpoints, its __init__.py and __pycache__/
    assert {d.name for d in SHIPPED.iterdir() if d.is_dir() and d.name != "__pycache__"} == names
    for name in names:
        assert shipped_checkpoint(name) == SHIPPED / name


def test_a_shipped_checkpoint_is_copied_after_its_sha256_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamrl.sft import SHIPPED, sft_checkpoint
    from streamrl.sft import build as sft

    real = next(SHIPPED.glob("tiny-*-sft-*"))
    config = SFTConfig.math_tir(seed=12345)  # never built: only a shipped copy can answer without training
    name = f"{resolve_model('tiny').name}-sft-{config.key()}"
    shipped = tmp_path / "shipped"
    shutil.copytree(real, shipped / name)
    monkeypatch.setattr(sft, "SHIPPED", shipped)
    monkeypatch.setattr(sft, "cache_root", lambda: tmp_path / "cache")

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("built instead of using the shipped copy")

    monkeypatch.setattr(sft, "_build_checkpoint", no_build)
    monkeypatch.setattr(sft, "run_in_reproducible_interpreter", no_build)
    bases: list[str] = []  # the base model is resolved (built, on a fresh machine) only for a build
    monkeypatch.setattr(sft, "resolve_model", lambda model: bases.append(model) or resolve_model(model))
    out = sft_checkpoint(config, log=lambda _: None)
    assert out == tmp_path / "cache" / "sft" / name and bases == []
    assert (out / "model.safetensors").read_bytes() == (real / "model.safetensors").read_bytes()
    assert not (out / "SHA256SUMS").exists()
    # a changed file is refused, naming it
    tampered = SFTConfig.math_tir(seed=54321)
    tname = f"{resolve_model('tiny').name}-sft-{tampered.key()}"
    shutil.copytree(real, shipped / tname)
    with (shipped / tname / "tokenizer.json").open("a") as f:
        f.write(" ")
    with pytest.raises(ValueError, match=r"tokenizer.json does not match its sha256"):
        sft_checkpoint(tampered, log=lambda _: None)
    monkeypatch.setattr(sft, "cache_root", lambda: tmp_path / "empty-cache")
    with pytest.raises(AssertionError, match="built instead"):  # --no-shipped builds
        sft_checkpoint(config, log=lambda _: None, shipped=False)
    assert bases == ["tiny"]
