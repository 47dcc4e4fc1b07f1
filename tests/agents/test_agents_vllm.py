"""vLLM backend on the real tiny model and a real (CPU) engine: generation, scoring, LoRA hot-loading and its
check, agreement with the Hugging Face backend, an LLMAgent episode. One engine serves the whole module
(starting one takes ~30 s on CPU).

HF-vs-vLLM tolerance: both run the tiny model in float32 on CPU; greedy tokens must be identical and log-probs
agree within ``LOGPROB_ATOL`` (measured max |difference| ~1.5e-6 on the base model and on adapters).
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (install the `vllm` extra: pip install 'streamrl[vllm]')",
    ),
]

import gymnasium as gym  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
from helpers import adapter_logprobs, make_adapter  # noqa: E402
from streamrl.agents.base import GenerationBackend, SamplingParams  # noqa: E402
from streamrl.agents.hf_backend import HFBackend, sampling_logprobs  # noqa: E402

LOGPROB_ATOL = 1e-4
"""HF vs vLLM, float32 on CPU (measured ~1.5e-6)."""


def _maxdiff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("adapters")
    models = {name: make_adapter(root / name, seed) for name, seed in (("a", 1), ("b", 2))}
    return {"root": root, "a": root / "a", "b": root / "b", "models": models}


@pytest.fixture(scope="module")
def vllm_backend() -> Any:
    """The module's engine. Teardown checks a clean shutdown: a call still running in another thread is
    released with a clear error, and no engine process outlives ``close()``."""
    from streamrl.agents.vllm_backend import VLLMBackend

    backend = VLLMBackend("tiny")
    engine_processes = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM")]
    assert engine_processes, "expected vLLM's EngineCore / Worker processes"
    yield backend
    outcome: dict[str, BaseException] = {}

    def long_call() -> None:
        try:
            backend.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4000, temperature=0))
        except BaseException as exc:
            outcome["error"] = exc

    caller = threading.Thread(target=long_call)
    caller.start()
    while backend._engine.get_num_unfinished_requests() == 0 and caller.is_alive():
        time.sleep(0.05)  # wait until the request is in the engine
    backend.close()
    backend.close()  # idempotent
    caller.join(timeout=60)
    assert not caller.is_alive() and "closed while this call was running" in str(outcome.get("error"))
    for late_call in (  # every entry point says the backend is closed, the coroutines too
        lambda: backend.generate([[1, 2, 3]], GREEDY),
        lambda: backend.score([[1, 2, 3]], [1]),
        lambda: backend.set_adapter(None, 1),
        lambda: backend.served_loras(),
        lambda: asyncio.run(backend.agenerate([[1, 2, 3]], GREEDY)),
        lambda: asyncio.run(backend.ascore([[1, 2, 3]], [1])),
        lambda: asyncio.run(backend.aset_adapter(None, 1)),
    ):
        with pytest.raises(RuntimeError, match="VLLMBackend is closed"):
            late_call()
    _gone, alive = psutil.wait_procs(engine_processes, timeout=30)
    assert not alive, f"engine processes left after close(): {alive}"


@pytest.fixture(scope="module")
def hf_backend() -> HFBackend:
    return HFBackend("tiny")


@pytest.fixture
def base(vllm_backend: Any, hf_backend: HFBackend) -> Any:
    """Each test starts (and the module ends) with both backends serving the base model."""
    vllm_backend.set_adapter(None, 0)
    hf_backend.set_adapter(None, 0)
    return vllm_backend


def _prompts(backend: Any) -> list[list[int]]:
    texts = ["Hi", "You arrive at fridge 1. The fridge 1 is closed.", "What is 12 * 7? Use python."]
    return [
        backend.tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for t in texts
    ]


GREEDY = SamplingParams(max_new_tokens=32, temperature=0)


def test_generate_on_token_ids_with_logprobs_that_score_recomputes(base: Any) -> None:
    assert isinstance(base, GenerationBackend)
    prompts = _prompts(base)
    gens = base.generate(prompts, SamplingParams(max_new_tokens=24, seed=7))
    assert all(len(g.token_ids) == len(g.logprobs) >= 1 and g.adapter_version == 0 for g in gens)
    assert all(g.finish_reason == "length" for g in gens if len(g.token_ids) == 24)
    scored = base.score(
        [p + g.token_ids for p, g in zip(prompts, gens, strict=True)], [len(p) for p in prompts]
    )
    for g, s in zip(gens, scored, strict=True):  # temperature 1, no filtering: sampled = model log-probs
        assert _maxdiff(g.logprobs, s) < 1e-5
    # Seeds: reproducible, and prompt i samples with seed + i whatever shares its batch.
    again = base.generate(prompts, SamplingParams(max_new_tokens=24, seed=7))
    assert [g.token_ids for g in again] == [g.token_ids for g in gens]
    alone = base.generate([prompts[2]], SamplingParams(max_new_tokens=24, seed=9))
    assert alone[0].token_ids == gens[2].token_ids
    # score: empty continuation and prompt-length validation
    assert base.score([prompts[0]], [len(prompts[0])]) == [[]]
    with pytest.raises(ValueError, match="prompt_lengths"):
        base.score([prompts[0]], [0])
    # constrained generation is the HF backend's: refused by name, unconstrained entries are fine
    assert len(base.generate(prompts[:1], SamplingParams(max_new_tokens=2, seed=1), choices=[None])) == 1
    with pytest.raises(ValueError, match=r"VLLMBackend cannot constrain generation.*use the HF backend"):
        base.generate(prompts[:1], SamplingParams(max_new_tokens=2), choices=[[[1, 2]]])


def test_sampling_controls_give_the_processed_distribution(base: Any, hf_backend: HFBackend) -> None:
    """Log-probs are those of the distribution sampled from (temperature, top-k, top-p), checked against
    HFBackend's ``sampling_logprobs`` applied to the same model's logits: an oracle for the mapping."""
    prompt = _prompts(base)[1]
    params = SamplingParams(max_new_tokens=16, temperature=0.7, top_k=50, top_p=0.9, seed=3)
    gen = base.generate([prompt], params)[0]
    ids = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        logits = hf_backend.model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    expected = sampling_logprobs(logits, params).gather(-1, torch.tensor(gen.token_ids)[:, None])[:, 0]
    assert _maxdiff(gen.logprobs, expected.tolist()) < LOGPROB_ATOL
    # top-k = 1 leaves one token: the greedy one, with probability 1; top_k = 0 means "off", not "1".
    greedy = base.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0))[0]
    top1 = base.generate([prompt], SamplingParams(max_new_tokens=8, temperature=1.0, top_k=1, seed=5))[0]
    assert top1.token_ids == greedy.token_ids and all(lp == 0.0 for lp in top1.logprobs)
    off = base.generate([prompt], SamplingParams(max_new_tokens=8, temperature=1.0, top_k=0, seed=5))[0]
    assert all(lp < 0 for lp in off.logprobs)


def test_stop_ids_and_strings_end_the_completion_and_are_kept(base: Any, hf_backend: HFBackend) -> None:
    prompt = _prompts(base)[0]
    free = base.generate([prompt], GREEDY)[0].token_ids
    stop_id = free[3]
    cut = free.index(stop_id) + 1
    by_id = base.generate(
        [prompt], SamplingParams(max_new_tokens=32, temperature=0, stop_token_ids=(stop_id,))
    )[0]
    assert by_id.token_ids == free[:cut] and by_id.finish_reason == "stop" and by_id.extra["stop"] == stop_id
    text = base.tokenizer.decode(free[4:6])
    params = SamplingParams(max_new_tokens=32, temperature=0, stop_strings=(text,))
    by_text, hf_text = base.generate([prompt], params)[0], hf_backend.generate([prompt], params)[0]
    assert by_text.finish_reason == "stop" and by_text.extra["stop"] == text
    assert text in base.tokenizer.decode(by_text.token_ids) and len(by_text.token_ids) < len(free)
    assert by_text.token_ids == hf_text.token_ids  # the token completing the stop string is kept by both


def test_backends_agree_on_greedy_tokens_and_logprobs(
    base: Any, hf_backend: HFBackend, adapters: dict
) -> None:
    """Same model, same adapter, greedy: identical tokens; log-probs within LOGPROB_ATOL (generate and score)."""
    prompts = _prompts(base)
    for version, path in ((0, None), (1, adapters["a"])):
        base.set_adapter(path, version)
        hf_backend.set_adapter(path, version)
        ours, theirs = base.generate(prompts, GREEDY), hf_backend.generate(prompts, GREEDY)
        for o, t in zip(ours, theirs, strict=True):
            assert o.token_ids == t.token_ids
            assert _maxdiff(o.logprobs, t.logprobs) < LOGPROB_ATOL
            assert o.adapter_version == t.adapter_version == version
        seqs = [p + o.token_ids for p, o in zip(prompts, ours, strict=True)]
        lengths = [len(p) // 2 for p in prompts]  # score part of the prompt too
        for s_ours, s_theirs in zip(base.score(seqs, lengths), hf_backend.score(seqs, lengths), strict=True):
            assert _maxdiff(s_ours, s_theirs) < LOGPROB_ATOL


def test_adapters_hot_load_by_version_with_fresh_lora_ids(base: Any, adapters: dict) -> None:
    prompts = _prompts(base)
    plain = [g.token_ids for g in base.generate(prompts, GREEDY)]
    base.set_adapter(adapters["a"], 1)  # no probe file: checked against a CPU HFBackend
    ids_a = base.served_loras()
    out_a = base.generate(prompts, GREEDY)
    assert len(ids_a) == 1 and base.adapter_version == 1 and all(g.adapter_version == 1 for g in out_a)
    assert [g.token_ids for g in out_a] != plain
    base.set_adapter(adapters["b"], 2)
    ids_b = base.served_loras()
    out_b = base.generate(prompts, GREEDY)
    assert len(ids_b) == 1 and ids_b.isdisjoint(ids_a)  # new id; the old adapter is removed
    assert [g.token_ids for g in out_b] not in ([g.token_ids for g in out_a], plain)
    base.set_adapter(adapters["a"], 3)  # the same files again: a new id, the same outputs as version 1
    assert base.served_loras().isdisjoint(ids_a | ids_b)
    assert [g.token_ids for g in base.generate(prompts, GREEDY)] == [g.token_ids for g in out_a]
    base.set_adapter(None, 4)
    assert base.served_loras() == set() and [g.token_ids for g in base.generate(prompts, GREEDY)] == plain


def test_adapter_check_catches_a_wrong_adapter(base: Any, adapters: dict) -> None:
    from safetensors.torch import load_file, save_file
    from streamrl.agents.probe import AdapterMismatchError, probe_token_ids, write_adapter_probe

    root, models = adapters["root"], adapters["models"]
    ids = probe_token_ids(base.vocab_size, 24, seed=11)
    good = root / "a_with_probe"
    shutil.copytree(adapters["a"], good)
    write_adapter_probe(good, ids, adapter_logprobs(models["a"], ids))
    base.set_adapter(good, 1)  # the publisher's probe matches what vLLM serves
    prompts = _prompts(base)
    served, loras = [g.token_ids for g in base.generate(prompts, GREEDY)], base.served_loras()

    # A publish that silently carries a no-op adapter (B = 0) while the learner's policy is adapter a:
    # vLLM then samples the base model -- the failure the check exists for.
    noop = root / "a_zeroed"
    shutil.copytree(good, noop)
    weights = load_file(str(noop / "adapter_model.safetensors"))
    save_file(
        {k: torch.zeros_like(v) if "lora_B" in k else v for k, v in weights.items()},
        str(noop / "adapter_model.safetensors"),
    )
    with pytest.raises(AdapterMismatchError, match="BASE MODEL"):
        base.set_adapter(noop, 2)
    # Weights of adapter a published as if they were b (the probe says b): neither base nor expected.
    swapped = root / "a_claims_b"
    shutil.copytree(adapters["a"], swapped)
    write_adapter_probe(swapped, ids, adapter_logprobs(models["b"], ids))
    with pytest.raises(AdapterMismatchError, match="neither"):
        base.set_adapter(swapped, 2)
    # The previous adapter stays in service, and the rejected ones were unloaded.
    assert base.adapter_version == 1 and base.served_loras() == loras
    assert [g.token_ids for g in base.generate(prompts, GREEDY)] == served


def test_inflight_request_keeps_its_adapter_across_a_publish(
    base: Any, hf_backend: HFBackend, adapters: dict
) -> None:
    """A publish mid-generation: the running request finishes on the old adapter (and says so), the old
    adapter is removed only after it; the async API is driven from another event loop."""
    prompt = _prompts(base)[2]
    base.set_adapter(adapters["a"], 1)
    old_ids = base.served_loras()

    async def scenario() -> tuple[Any, set[int], set[int]]:
        long = asyncio.ensure_future(
            base.agenerate([prompt], SamplingParams(max_new_tokens=1500, temperature=0, top_k=0))
        )
        await base.aset_adapter(adapters["b"], 2)
        during = set(base.served_loras()) if not long.done() else set()
        short = await base.agenerate([prompt], SamplingParams(max_new_tokens=4, temperature=0))
        assert short[0].adapter_version == 2
        (gen,) = await long
        return gen, during, set(base.served_loras())

    gen, during, after = asyncio.run(scenario())
    assert gen.adapter_version == 1 and len(gen.token_ids) > 100
    assert during > old_ids, "the old adapter must stay loaded while its request runs"
    assert len(after) == 1 and after.isdisjoint(old_ids)
    hf_backend.set_adapter(adapters["a"], 11)  # every token came from adapter a, not b
    expected = hf_backend.score([prompt + gen.token_ids], [len(prompt)])[0]
    assert _maxdiff(gen.logprobs, expected) < LOGPROB_ATOL


def test_bad_inputs_raise_clear_errors(base: Any, tmp_path: Path, adapters: dict) -> None:
    with pytest.raises(ValueError, match="empty"):
        base.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        base.generate([[1] * base.max_model_len], GREEDY)
    with pytest.raises(ValueError, match="outside"):
        base.generate([[base.vocab_size + 3]], GREEDY)
    with pytest.raises(FileNotFoundError, match=r"adapter_config\.json"):
        base.set_adapter(tmp_path, 1)
    with pytest.raises(ValueError, match="version"):
        base.set_adapter(None, -1)
    big = tmp_path / "rank64"
    big.mkdir()
    (big / "adapter_config.json").write_text('{"r": 64}')
    with pytest.raises(ValueError, match="max_lora_rank"):
        base.set_adapter(big, 1)
    assert base.adapter_version == 0


def test_llm_agent_episode_through_vllm_matches_hf(base: Any, hf_backend: HFBackend) -> None:
    """A full Math-TIR episode of LLMAgent on tiny, greedy, through each backend: the same token record."""
    from streamrl.agents.llm_agent import LLMAgent
    from streamrl.agents.prompts import MathTIRPrompt
    from streamrl.agents.rollout import play_episode

    records = []
    for backend in (base, hf_backend):
        agent = LLMAgent(
            backend, prompt_format=MathTIRPrompt(), sampling=SamplingParams(max_new_tokens=48, temperature=0)
        )
        env = gym.make("streamrl.envs:MathTIR-v0", size=4, max_turns=3, max_tool_calls=2)
        try:
            result = play_episode(env, agent, seed=0)
        finally:
            env.close()
        assert result.terminated or result.truncated
        records.append(result.record)
    ours, theirs = records
    assert [s.token_ids for s in ours.sequences] == [s.token_ids for s in theirs.sequences]
    for s_ours, s_theirs in zip(ours.sequences, theirs.sequences, strict=True):
        assert s_ours.action_mask == s_theirs.action_mask and sum(s_ours.action_mask) > 0
        assert _maxdiff(s_ours.rollout_logprobs, s_theirs.rollout_logprobs) < LOGPROB_ATOL
        assert all(math.isfinite(x) for x in s_ours.rollout_logprobs)
