"""SFT cold start: per-env presets and their chained cache keys, model selection, and it helps."""

from __future__ import annotations

import json

import pytest
import torch
from streamrl.agents.base import SamplingParams
from streamrl.agents.hf_backend import HFBackend
from streamrl.agents.models import load_tokenizer, resolve_model
from streamrl.agents.teacher_forcing import expert_trajectories, sequences_of
from streamrl.algorithms import sft as sft_module
from streamrl.algorithms.sft import SFTConfig, sft_checkpoint
from streamrl.evaluation.harness import evaluate


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return load_tokenizer(resolve_model("tiny"))


def test_per_env_recipes_chain_their_cache_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    # ALFWorld starts from Math-TIR's checkpoint: its key must change whenever the Math-TIR recipe does.
    alfworld, math = SFTConfig.for_env("alfworld"), SFTConfig.for_env("math_tir")
    assert alfworld == SFTConfig.alfworld() and math == SFTConfig.math_tir()
    assert alfworld.envs == ("alfworld",) and alfworld.start() == math and math.start() is None
    before = alfworld.key()
    math_tir = sft_module.SFT_PRESETS["math_tir"]
    monkeypatch.setitem(sft_module.SFT_PRESETS, "math_tir", lambda **kw: math_tir(**{"epochs": 1, **kw}))
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
    assert SFTConfig.math_tir().key() == "732c15efd455"
    assert SFTConfig.alfworld().key() == "ed35fc86e5d6"
    assert SFTConfig.math_tir(seed=1).key() == "159166c0a131"


def test_model_selection_keeps_the_best_epoch(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from streamrl.agents.models import load_model
    from streamrl.algorithms.sft import train_sft

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


@pytest.mark.slow
def test_sft_improves_over_untrained_model() -> None:
    # CI-sized: 16 Math-TIR expert episodes (no synthetic ones), trained long enough to clone them; success is
    # measured on those training tasks (greedy), which the untrained model never solves. The full recipes' rates
    # on held-out splits are in docs/sft.md (streamrl sft).
    config = SFTConfig(
        envs=("math_tir",), max_expert_episodes=16, synthetic_episodes=0, epochs=30, batch_size=4, lr=5e-3
    )
    path = sft_checkpoint(config)
    report = json.loads((path / "streamrl_sft.json").read_text())
    assert report["data"]["math_tir"]["episodes"] == 16 and report["final_loss"] < 0.5
    greedy = SamplingParams(max_new_tokens=160, temperature=0.0)
    trained = evaluate(HFBackend(path), "math_tir", "train", episodes=16, sampling=greedy, batch_size=16)
    untrained = evaluate(HFBackend("tiny"), "math_tir", "train", episodes=16, sampling=greedy, batch_size=16)
    assert untrained["success_rate"] == 0.0
    assert trained["valid_action_rate"] > untrained["valid_action_rate"] + 0.3
    assert trained["success_rate"] >= 0.25, trained
