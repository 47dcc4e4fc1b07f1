"""Prompt formats and action parsers, one per env: policy concerns live with the agent, not the env.

A ``PromptFormat`` says what the policy is told (a system prompt; one user message per observation) and how
its generated text becomes an env action. Parsing never raises: text that cannot be parsed becomes an action
the env will reject (``ParsedAction.valid`` is False, ``error`` says why), so a bad generation costs a turn,
not an episode.

- ``ALFWorldPrompt``: the task, the current observation and the admissible commands; the action is one
  command (the first non-empty line; a leading ``>`` or ``Action:`` is dropped; matched case-insensitively
  against the admissible commands).
- ``MathTIRPrompt``: tool-integrated reasoning (ToRL / SimpleTIR protocol): the assistant writes a
  ```python block whose printed output comes back as a ```output block in the next user message, and ends
  with the final answer in ``\\boxed{}``. The action is the assistant message itself (the env runs its code
  or checks its answer), valid exactly when the env's own parser (``streamrl.envs.math_tir.parse_turn``)
  accepts it; anything the model writes after an opened ```output fence is cut, since that output must come
  from the tool, not the model.

- ``LinePrompt``: for your own env whose action is one line of text: a fixed system prompt, the observation
  as the user message, the reply's first line as the action.

A format may also define ``action_choices(info) -> list[str]``, the actions a constrained policy picks among
(``LLMAgent(constrain_actions=True)``); ``ALFWorldPrompt`` does (the admissible commands).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from streamrl.envs.alfworld_text import go_to_frontier, task_goal
from streamrl.envs.math_tir import parse_turn


@dataclass(frozen=True)
class ParsedAction:
    """The env action parsed from generated text; ``valid`` False (with ``error``) when parsing failed."""

    action: str
    valid: bool
    error: str | None = None


@runtime_checkable
class PromptFormat(Protocol):
    """How observations become chat messages and generated text becomes actions."""

    name: str
    stop_strings: tuple[str, ...]

    def system_prompt(self, first_observation: str, info: Mapping[str, Any]) -> str:
        """The system message of an episode (fixed for the episode; survives windowing)."""
        ...

    def user_message(self, observation: str, info: Mapping[str, Any], turn: int) -> str:
        """The user message for the observation at ``turn`` (0 = the reset observation)."""
        ...

    def parse_action(self, text: str, info: Mapping[str, Any]) -> ParsedAction:
        """The env action for generated ``text``; never raises."""
        ...


@dataclass(frozen=True)
class ALFWorldPrompt:
    """ALFWorld: task + current observation + admissible commands; the action is one command."""

    name: str = "alfworld"
    stop_strings: tuple[str, ...] = ("\n",)
    """Stop at the end of the first line: an action is one command."""
    list_admissible: bool = True
    """Show ``info["admissible_commands"]`` in every user message (verl-agent's ALFWorld prompt does)."""
    list_go_to: bool | Literal["frontier"] = True
    """With ``list_admissible``, also list the ``go to ...`` commands; ``False`` leaves them out (the room
    description of the first observation names every receptacle already), ~200 tokens less per turn;
    ``"frontier"`` lists, after the other commands and under ``Left to search:``, only the receptacles left to
    search (``streamrl.envs.alfworld_text.go_to_frontier`` of ``info["visited"]``), next first: the agent's
    memory of where it has been, so that searching on is copying the first line of that list."""
    one_command_per_line: bool = False
    """List the admissible commands one per line instead of comma-separated. A command at the start of a line
    is tokenized exactly as the action the model writes (``take`` at the start of a reply is not the `` take``
    of a comma-separated list in byte-level BPE), so a small model can copy a listed command token by token
    (an induction head: find the token just written earlier in the context, copy what followed)."""

    def __post_init__(self) -> None:
        if self.list_go_to not in (True, False, "frontier"):
            raise ValueError(f"list_go_to must be True, False or 'frontier', got {self.list_go_to!r}")

    def system_prompt(self, first_observation: str, info: Mapping[str, Any]) -> str:
        goal = task_goal(first_observation)
        task = f"{goal}." if goal else "see the first observation"
        return (
            "You are an agent in a household text game. Reply with exactly one command from the "
            f"admissible commands, nothing else.\nYour task is to: {task}"
        )

    def user_message(self, observation: str, info: Mapping[str, Any], turn: int) -> str:
        text = observation.strip()
        if not self.list_admissible:
            return text
        listed = [str(c) for c in info.get("admissible_commands") or []]
        commands = listed if self.list_go_to is True else [c for c in listed if not c.startswith("go to ")]
        blocks = [("Admissible commands", commands)]
        if self.list_go_to == "frontier":
            blocks.append(
                ("Left to search", go_to_frontier(listed, [str(r) for r in info.get("visited") or []]))
            )
        for title, lines in blocks:
            if lines:
                text += f"\n{title}:" + (
                    "\n" + "\n".join(lines) if self.one_command_per_line else " " + ", ".join(lines)
                )
        return text

    def action_choices(self, info: Mapping[str, Any]) -> list[str]:
        """The commands a constrained policy chooses among (``LLMAgent(constrain_actions=True)``): the game's
        admissible commands, listed in the prompt or not."""
        return [str(c) for c in info.get("admissible_commands") or []]

    def parse_action(self, text: str, info: Mapping[str, Any]) -> ParsedAction:
        line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
        for prefix in (">", "action:", "command:"):
            if line.lower().startswith(prefix):
                line = line[len(prefix) :].strip()
        line = line.rstrip(".").strip()
        if not line:
            return ParsedAction("", False, "empty generation: no command")
        commands = [str(c) for c in info.get("admissible_commands") or []]
        if not commands:  # nothing to check against: let the env judge
            return ParsedAction(line, True)
        by_lower = {c.lower(): c for c in commands}
        if line.lower() in by_lower:
            return ParsedAction(by_lower[line.lower()], True)
        return ParsedAction(line, False, f"{line!r} is not an admissible command")


@dataclass(frozen=True)
class MathTIRPrompt:
    """Math with a Python tool: ```python blocks are run, their output returns as ```output; final \\boxed{}."""

    name: str = "math_tir"
    stop_strings: tuple[str, ...] = ("```output",)
    """The model must not write tool output itself: stop when it opens an output fence."""

    def system_prompt(self, first_observation: str, info: Mapping[str, Any]) -> str:
        return (
            "Solve the math problem. You may write Python code in a ```python block; it is run and its printed "
            "output comes back in a ```output block. Give the final answer as \\boxed{answer}."
        )

    def user_message(self, observation: str, info: Mapping[str, Any], turn: int) -> str:
        return observation.strip()

    def parse_action(self, text: str, info: Mapping[str, Any]) -> ParsedAction:
        """The text before any ```output fence, valid exactly when the env's own grammar
        (:func:`streamrl.envs.math_tir.parse_turn`) finds a final answer or a code block in it."""
        cut = text.find("```output")
        action = (text if cut < 0 else text[:cut]).strip()
        turn = parse_turn(action)
        if turn.answer is not None or turn.code is not None:
            return ParsedAction(action, True)
        if not action:
            return ParsedAction("", False, "empty generation")
        return ParsedAction(action, False, turn.problem or "neither a ```python block nor a \\boxed{} answer")


@dataclass(frozen=True)
class LinePrompt:
    """An env whose action is one line of text (a command, a word, a number): ``system`` is the system prompt,
    every observation is a user message, and the reply's first line, stripped, is the action (an empty one is
    invalid). The env judges the line; write a format of your own when the policy should see more than the
    observation or the reply needs parsing (``examples/custom_env.py``)."""

    system: str
    """The system prompt: the task and the form of a reply (e.g. "Reply with one whole number.")."""
    name: str = "line"
    stop_strings: tuple[str, ...] = ("\n",)
    """Stop at the end of the first line: the rest would not be part of the action."""

    def __post_init__(self) -> None:
        if not isinstance(self.system, str) or not self.system.strip():
            raise ValueError(f"system must be a non-empty system prompt, got {self.system!r}")

    def system_prompt(self, first_observation: str, info: Mapping[str, Any]) -> str:
        return self.system

    def user_message(self, observation: str, info: Mapping[str, Any], turn: int) -> str:
        return observation.strip()

    def parse_action(self, text: str, info: Mapping[str, Any]) -> ParsedAction:
        line = text.strip().split("\n", 1)[0].strip()
        return ParsedAction(line, True) if line else ParsedAction("", False, "empty reply: no action")


PROMPT_FORMATS: dict[str, type] = {"alfworld": ALFWorldPrompt, "math_tir": MathTIRPrompt}


def prompt_format(name: str) -> PromptFormat:
    """The prompt format registered as ``name`` (``"alfworld"`` or ``"math_tir"``)."""
    if name not in PROMPT_FORMATS:
        raise ValueError(f"unknown prompt format {name!r}; valid: {sorted(PROMPT_FORMATS)}")
    fmt: PromptFormat = PROMPT_FORMATS[name]()
    return fmt
