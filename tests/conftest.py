"""Shared test setup: one torch thread (a busy neighbour makes 2 threads 5-40x slower), offline hub; ``tests/``
on ``sys.path`` (for ``helpers``, ``vector_testenvs``); the fixtures several test modules use: the ``primed``
policy of the trainer tests and the ``episodes`` of the learner tests."""

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent
"""This folder: its ``helpers`` module and ``vector_testenvs`` are imported by test modules in its sub-folders."""
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover - torch is a core dependency
    pass


# ---------------------------------------------------------------------------------------------------------
# The ``primed`` policy of the trainer tests (test_train, test_ray, test_train_vllm)
# ---------------------------------------------------------------------------------------------------------

PRIMED_TASKS = 8
"""The ``primed`` policy knows the answers of the first this-many Math-TIR training tasks."""


@pytest.fixture(scope="session")
def math_tasks() -> list[str]:
    """The Math-TIR training split's task ids, in order."""
    from streamrl.agents.env_specs import env_spec, make_env, task_ids_of

    env = make_env("math_tir", env_spec("math_tir").train_split)
    try:
        return task_ids_of(env, "math_tir")
    finally:
        env.close()


class _Expert:
    """Writes the task's ground truth as ``\\boxed{}`` on its first turn, or (``answer=False``) never answers."""

    def __init__(self, answer: bool) -> None:
        self.answer = answer

    def act(self, observations: Sequence[str], infos: Sequence[Mapping[str, Any]], ids: Any) -> list[str]:
        return [f"\\boxed{{{info['ground_truth']}}}" if self.answer else "Let me think." for info in infos]

    def end_episode(self, episode_id: Any) -> None:
        return None


def _first_turn(record: Any) -> Any:
    """``record``'s prompt and first turn: its sequence cut where the first action ends (``action_span``)."""
    from streamrl.agents.trajectory import TokenSequence

    turn = record.turns[0]
    seq, end = record.sequences[turn.sequence], turn.action_span[1]
    return TokenSequence(
        seq.token_ids[:end], seq.action_mask[:end], seq.rollout_logprobs[:end], seq.token_versions[:end]
    )


def _answer_probabilities(model: Any, answers: Sequence[Any], pad_token_id: int) -> list[tuple[float, float]]:
    """Per answer sequence, teacher-forced: (P(its first action token), P(the rest of the answer | that token))
    -- how often the model answers at once, and how often such an answer is right."""
    from streamrl.agents.batch import collate
    from streamrl.agents.logprobs import selected_token_logprobs

    model.eval()
    with torch.no_grad():
        batch = collate(answers, pad_token_id)
        lp = selected_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask)
    model.train()
    out, i = [], 0
    for seq in answers:
        n = sum(seq.action_mask)
        out.append((float(lp[i].exp()), float(lp[i + 1 : i + n].sum().exp())))
        i += n
    return out


@pytest.fixture(scope="session")
def primed(tmp_path_factory: pytest.TempPathFactory, math_tasks: list[str]) -> Path:
    """``tiny`` behaviour-cloned on a mixture, for each of the first ``PRIMED_TASKS`` Math-TIR training tasks:
    the prompt followed by the right ``\\boxed{}`` answer, and the prompt followed by "Let me think.". The
    first action token's likelihood is maximal at one half, and full-batch training converges to it, so the
    policy answers at once, and right, about half the time on every known task and otherwise rambles, mostly to
    the turn limit (test_train's module doc).

    Two phases, full-batch: the answers alone until they are bound to their prompts, then the mixture, which
    brings answering at once down from 1 to 1/2 (training on both from the start binds slowly, at a speed that
    depends on the CPU's float rounding). Both properties are checked teacher-forced, and a fixture that misses
    them fails here, naming the tasks, rather than the trainer tests later on "no reward"."""
    from streamrl.agents.env_specs import env_spec, make_env
    from streamrl.agents.models import load_model, load_tokenizer, resolve_model
    from streamrl.agents.rollout import play_episode
    from streamrl.agents.teacher_forcing import TeacherForcedAgent, sequences_of
    from streamrl.sft import SFTConfig, train_sft

    tokenizer = load_tokenizer(resolve_model("tiny"))
    spec = env_spec("math_tir")
    env = make_env("math_tir", spec.train_split)
    try:
        records = {
            answer: [
                play_episode(
                    env,
                    TeacherForcedAgent(_Expert(answer), tokenizer, spec.prompt(), spec.context),
                    options={"task_id": t},
                ).record
                for t in math_tasks[:PRIMED_TASKS]
            ]
            for answer in (True, False)
        }
    finally:
        env.close()
    assert all(r is not None and r.won for r in records[True]) and not any(r.won for r in records[False])
    answers = sequences_of(records[True])
    mixture = answers + [_first_turn(r) for r in records[False]]
    model = load_model(resolve_model("tiny"))
    pad = tokenizer.pad_token_id

    def fit(sequences: Sequence[Any], epochs: int) -> list[tuple[float, float]]:
        config = SFTConfig(
            envs=("math_tir",), epochs=epochs, batch_size=len(sequences), lr=3e-3, warmup_steps=2
        )
        train_sft(model, sequences, config, pad, log=lambda _: None)
        return _answer_probabilities(model, answers, pad)

    for _ in range(3):  # bind the answers to their prompts: 200 epochs do it here (probabilities 0.99+)
        if all(right >= 0.9 for _, right in fit(answers, 200)):
            break
    probabilities = fit(mixture, 50)  # then balance the first turn (answering at once falls from 1 to 1/2)
    at_once = [round(p, 2) for p, _ in probabilities]
    right = {t: round(r, 2) for t, (_, r) in zip(math_tasks[:PRIMED_TASKS], probabilities, strict=True)}
    assert all(0.3 <= p <= 0.7 for p in at_once), (
        f"primed: P(answer at once) per task {at_once}, not about 1/2"
    )
    assert all(r >= 0.8 for r in right.values()), f"primed: P(right | answered) per task {right}, below 0.8"
    out = tmp_path_factory.mktemp("primed")
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


# ---------------------------------------------------------------------------------------------------------
# The ``episodes`` of the learner tests (test_learner_ddp, test_ray): five Math-TIR episodes of ``tiny``
# ---------------------------------------------------------------------------------------------------------

BASELINES = [0.9, 0.1, 0.6, 0.3, 0.75]
"""Frozen task values on the tickets: ``tiny`` never wins, so SPO++'s advantages vary through these."""


@pytest.fixture(scope="module")
def episodes() -> list[Any]:
    """Five Math-TIR training episodes of ``tiny`` (16 new tokens a turn), with the baselines above."""
    from streamrl.agents.base import SamplingParams
    from streamrl.agents.env_specs import env_spec, make_env, task_ids_of
    from streamrl.agents.hf_backend import HFBackend, HFBackendConfig
    from streamrl.algorithms.base import Episode
    from streamrl.algorithms.runtime import Job, Rollouts, collect
    from streamrl.algorithms.tracker import Ticket
    from streamrl.envs.vector import StreamingVectorEnv, VectorEnvConfig

    spec = env_spec("math_tir")
    probe = make_env("math_tir", spec.train_split)
    tasks = task_ids_of(probe, "math_tir")[: len(BASELINES)]
    probe.close()
    backend = HFBackend("tiny", config=HFBackendConfig(device="cpu", seed=0))
    venv = StreamingVectorEnv.from_env(
        spec.gym_id, len(tasks), config=VectorEnvConfig(backend="inprocess"), split=spec.train_split
    )
    agent = spec.llm_agent(backend, SamplingParams(max_new_tokens=16, seed=3))
    jobs = [Job(t, i, Ticket(t, 0, b, i, 0.0)) for i, (t, b) in enumerate(zip(tasks, BASELINES, strict=True))]
    try:
        done = collect(Rollouts(venv, agent, seed=3, lockstep=True), jobs)
    finally:
        venv.close()
        backend.close()
    done.sort(key=lambda f: f.job.key)
    return [Episode(f.trajectory, f.job.ticket) for f in done]
