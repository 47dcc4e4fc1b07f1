"""``EnvSpec`` needs only a gym id and a prompt format; the rest has defaults, bad values are named, and env names
of the form ``"module:name"`` / ``"file.py:name"`` import the module that registers them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from streamrl.agents.env_specs import (
    ENV_SPECS,
    EnvSpec,
    env_spec,
    expert_factory,
    make_env,
    register_env_spec,
)
from streamrl.agents.latency import LatencyPrompt
from streamrl.agents.llm_agent import ContextPolicy
from streamrl.agents.prompts import ALFWorldPrompt, LinePrompt, MathTIRPrompt, ParsedAction

MODULE = """
import gymnasium as gym
from streamrl.agents.env_specs import EnvSpec, register_env_spec
from streamrl.agents.latency import LatencyPrompt

register_env_spec("{name}", EnvSpec(gym_id="streamrl/Latency-v0", prompt=LatencyPrompt, split_keyword="split"))
"""


@pytest.fixture
def specs():
    """``ENV_SPECS`` as it was before the test (a test's registrations are undone)."""
    saved = dict(ENV_SPECS)
    yield ENV_SPECS
    ENV_SPECS.clear()
    ENV_SPECS.update(saved)


def test_a_gym_id_and_a_prompt_format_are_a_whole_spec() -> None:
    spec = EnvSpec(gym_id="streamrl/Latency-v0", prompt=LatencyPrompt)
    assert isinstance(spec.prompt(), LatencyPrompt)
    assert (spec.train_split, spec.eval_splits, spec.split_keyword) == ("train", ("train",), None)
    assert spec.context == ContextPolicy(mode="full", max_context_tokens=4096)
    assert spec.max_new_tokens == 64 and spec.expert is None
    # an instance serves as well as a factory, and every agent shares it
    fmt = LatencyPrompt(stop_strings=("\n",))
    assert EnvSpec(gym_id="streamrl/Latency-v0", prompt=fmt).prompt() is fmt


def test_the_built_in_specs_keep_their_explicit_values() -> None:
    alfworld, math = ENV_SPECS["alfworld"], ENV_SPECS["math_tir"]
    assert (alfworld.split_keyword, alfworld.train_split, alfworld.eval_splits) == (
        "split",
        "train",
        ("eval_seen", "eval_unseen"),
    )
    assert alfworld.context == ContextPolicy(mode="window", window_turns=1, max_context_tokens=1024)
    assert alfworld.max_new_tokens == 24 and isinstance(alfworld.prompt(), ALFWorldPrompt)
    assert (math.split_keyword, math.eval_splits, math.max_new_tokens) == ("split", ("test",), 160)
    assert isinstance(math.prompt(), MathTIRPrompt) and math.expert is not None
    assert math.make_kwargs("test", max_turns=2) == {
        "split": "test",
        "source": "procedural",
        "max_tool_calls": 2,
        "max_turns": 2,
    }


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"prompt": "alfworld"}, TypeError, "prompt must be a PromptFormat or a zero-argument callable"),
        ({"prompt": lambda: "alfworld"}, TypeError, "made 'alfworld', not a PromptFormat"),
        ({"gym_id": ""}, ValueError, "gym_id must be a registered gymnasium id"),
        ({"eval_splits": "test"}, ValueError, "eval_splits must be a non-empty tuple of split names"),
        ({"eval_splits": ("test",)}, ValueError, "split_keyword is None: the env takes no split"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be >= 1, got 0"),
        ({"context": "full"}, TypeError, "context must be a ContextPolicy"),
    ],
)
def test_a_bad_spec_is_named(fields: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        EnvSpec(**{"gym_id": "streamrl/Latency-v0", "prompt": LatencyPrompt, **fields})


def test_an_env_without_splits_gets_no_split_keyword() -> None:
    spec = EnvSpec(gym_id="streamrl/Latency-v0", prompt=LatencyPrompt, env_kwargs={"turns": 2})
    assert spec.make_kwargs("train", num_tasks=3) == {"turns": 2, "num_tasks": 3}
    with pytest.raises(
        ValueError, match=r"split 'test': .* one task set and takes no split; valid: \['train'\]"
    ):
        spec.make_kwargs("test")
    with_splits = replace(spec, split_keyword="split", eval_splits=("test",))
    assert with_splits.make_kwargs("test") == {"split": "test", "turns": 2}


def test_an_env_name_can_name_the_module_that_registers_it(specs: dict, tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "my_latency_env.py").write_text(MODULE.format(name="my_latency"))
    (tmp_path / "file_env.py").write_text(MODULE.format(name="from_a_file"))
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = env_spec("my_latency_env:my_latency")  # imports the module, which registers the name
    assert spec is env_spec("my_latency") and spec.gym_id == "streamrl/Latency-v0"
    assert env_spec(f"{tmp_path / 'file_env.py'}:from_a_file") is specs["from_a_file"]
    env = make_env(f"{tmp_path / 'file_env.py'}:from_a_file", "test", num_tasks=2)
    assert env.unwrapped.task_ids == ["latency/test/0000", "latency/test/0001"]
    env.close()
    with pytest.raises(ValueError, match=r"importing 'my_latency_env' registered no env named 'other'"):
        env_spec("my_latency_env:other")
    with pytest.raises(ValueError, match=r"cannot import 'no_such_module_x'"):
        env_spec("no_such_module_x:thing")
    with pytest.raises(ValueError, match=r"cannot import 'missing.py': no file 'missing.py'"):
        env_spec("missing.py:thing")
    with pytest.raises(
        ValueError, match=r"unknown env 'chess'; valid: .*, or 'module:name' / 'file.py:name'"
    ):
        env_spec("chess")
    with pytest.raises(ValueError, match="without ':'"):
        register_env_spec("a:b", spec)


def test_an_env_without_an_expert_says_so(specs: dict) -> None:
    register_env_spec("no_expert", EnvSpec(gym_id="streamrl/Latency-v0", prompt=LatencyPrompt))
    with pytest.raises(
        ValueError, match=r"env 'no_expert' has no expert .*; envs with one: \['alfworld', 'math_tir'"
    ):
        expert_factory("no_expert")
    assert expert_factory("math_tir") is ENV_SPECS["math_tir"].expert
    from streamrl.sft import SFTConfig

    with pytest.raises(ValueError, match=r"no SFT preset and no expert to clone .* init='base'"):
        SFTConfig.for_env("no_expert")


def test_line_prompt_takes_the_first_line_of_the_reply() -> None:
    fmt = LinePrompt("Reply with one word.")
    assert fmt.system_prompt("Say hi.", {}) == "Reply with one word."
    assert fmt.user_message("  Say hi.\n", {}, 0) == "Say hi."
    assert fmt.parse_action("  hi there \nand more", {}) == ParsedAction("hi there", True)
    assert fmt.parse_action(" \n", {}) == ParsedAction("", False, "empty reply: no action")
    assert EnvSpec(gym_id="streamrl/Latency-v0", prompt=fmt).prompt() is fmt
    with pytest.raises(ValueError, match="system must be a non-empty system prompt, got ' '"):
        LinePrompt(" ")
