"""HF backend on the real tiny model: sampling log-probs vs scoring and the learner, seeds, stops, greedy oracle,
LoRA, the static-cache decoder against the transformers forward."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from streamrl.agents.base import GenerationBackend, SamplingParams
from streamrl.agents.hf_backend import (
    HFBackend,
    HFBackendConfig,
    inverse_cdf_sample,
    sampling_logprobs,
    sampling_uniforms,
    stop_string_candidates,
)
from streamrl.agents.logprobs import token_logprobs
from streamrl.agents.lora import LoRAConfig, reference_logprobs, save_adapter, wrap_lora
from streamrl.agents.models import load_model, resolve_model


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    return HFBackend("tiny")


def _prompts(backend: HFBackend) -> list[list[int]]:
    tok = backend.tokenizer
    texts = ["Hi", "You arrive at fridge 1. The fridge 1 is closed.", "What is 12 * 7? Use python."]
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for t in texts
    ]


def _maxdiff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_protocol_and_score_matches_sampled_logprobs(backend: HFBackend) -> None:
    assert isinstance(backend, GenerationBackend)
    prompts = _prompts(backend)  # different lengths: left padding and position ids matter
    gens = backend.generate(prompts, SamplingParams(max_new_tokens=24, seed=7))
    assert all(len(g.token_ids) == len(g.logprobs) >= 1 for g in gens)
    scored = backend.score(
        [p + g.token_ids for p, g in zip(prompts, gens, strict=True)], [len(p) for p in prompts]
    )
    for g, s in zip(gens, scored, strict=True):
        assert len(s) == len(g.token_ids)
        assert max(abs(a - b) for a, b in zip(g.logprobs, s, strict=True)) < 1e-4


def test_seeds_are_reproducible_and_batch_invariant(backend: HFBackend) -> None:
    prompts = _prompts(backend)
    params = SamplingParams(max_new_tokens=16, seed=123)
    a = backend.generate(prompts, params)
    b = backend.generate(prompts, params)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    # Row i samples with seed + i whatever shares its batch.
    alone = backend.generate([prompts[2]], SamplingParams(max_new_tokens=16, seed=125))
    assert alone[0].token_ids == a[2].token_ids
    c = backend.generate(prompts, SamplingParams(max_new_tokens=16, seed=124))
    assert [g.token_ids for g in c] != [g.token_ids for g in a]


def test_greedy_matches_transformers_generate(backend: HFBackend) -> None:
    prompts = _prompts(backend)
    ours = backend.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.0))
    for prompt, gen in zip(prompts, ours, strict=True):
        ref = backend.model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=backend.pad_token_id
        )[0, len(prompt) :].tolist()
        assert gen.token_ids == ref[: len(gen.token_ids)]
        assert gen.finish_reason == ("length" if len(gen.token_ids) == 12 else "stop")


def test_stop_strings_and_ids(backend: HFBackend) -> None:
    tok = backend.tokenizer
    prompts = _prompts(backend)
    free = backend.generate(prompts, SamplingParams(max_new_tokens=40, seed=1, stop_token_ids=()))
    text = tok.decode(free[1].token_ids)
    stop = text[10:12]  # two characters this seeded sample is known to contain
    stopped = backend.generate(prompts, SamplingParams(max_new_tokens=40, seed=1, stop_strings=(stop,)))[1]
    assert stopped.finish_reason == "stop" and stopped.extra["stop"] == stop
    assert stop in tok.decode(stopped.token_ids) and stop not in tok.decode(stopped.token_ids[:-1])
    assert stopped.token_ids == free[1].token_ids[: len(stopped.token_ids)]
    first = free[0].token_ids[3]
    by_id = backend.generate(prompts, SamplingParams(max_new_tokens=40, seed=1, stop_token_ids=(first,)))[0]
    assert by_id.token_ids[-1] == first and by_id.finish_reason == "stop"
    assert first not in by_id.token_ids[:-1]


def test_sampling_distribution_is_what_logprobs_report() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    lp = sampling_logprobs(logits, SamplingParams(temperature=0.5, top_k=3))
    expected = torch.log_softmax(logits[0, :3] / 0.5, -1)
    assert torch.allclose(lp[0, :3], expected) and torch.isinf(lp[0, 3:]).all()
    probs = torch.softmax(logits[0], -1)  # 0.55, 0.20, 0.12, ...: top-p 0.7 keeps the first two
    lp = sampling_logprobs(logits, SamplingParams(top_p=0.7))
    assert torch.isfinite(lp[0, :2]).all() and torch.isinf(lp[0, 2:]).all()
    assert math.isclose(float(lp[0, 0].exp()), float(probs[0] / probs[:2].sum()), rel_tol=1e-6)


def test_lora_roundtrip_reference_and_backend_versions(tmp_path: Path) -> None:
    from peft import PeftModel

    path = resolve_model("tiny")
    policy = wrap_lora(load_model(path), LoRAConfig(rank=4, alpha=8))
    assert all(("lora_" in n) == p.requires_grad for n, p in policy.named_parameters())
    ids = torch.tensor([[5, 17, 300, 42, 9, 1000, 7], [0, 0, 8, 99, 12, 13, 14]])
    mask = torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        base_lp = token_logprobs(policy, ids, mask)
    assert torch.equal(reference_logprobs(policy, ids, mask), base_lp)  # B = 0 at init: policy == reference
    with torch.no_grad():  # make the adapter do something
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
        tuned_lp = token_logprobs(policy, ids, mask)
    assert (tuned_lp - base_lp)[mask[:, 1:].bool()].abs().max() > 1e-3
    assert torch.equal(reference_logprobs(policy, ids, mask), base_lp)
    adapter = save_adapter(policy, tmp_path / "v1")

    reloaded = PeftModel.from_pretrained(load_model(path), str(adapter))
    with torch.no_grad():
        assert torch.allclose(token_logprobs(reloaded, ids, mask), tuned_lp, atol=1e-5)

    backend = HFBackend(path)
    seqs, plens = [ids[0].tolist()], [2]
    assert backend.adapter_version == 0
    backend.set_adapter(adapter, 1)
    assert backend.adapter_version == 1
    assert _maxdiff(backend.score(seqs, plens)[0], tuned_lp[0, 1:].tolist()) < 1e-5
    gen = backend.generate([ids[0].tolist()], SamplingParams(max_new_tokens=3, seed=0))[0]
    assert gen.adapter_version == 1
    backend.set_adapter(adapter, 2)  # republishing as a new version keeps serving it
    assert _maxdiff(backend.score(seqs, plens)[0], tuned_lp[0, 1:].tolist()) < 1e-5
    backend.set_adapter(None, 3)  # base weights
    assert _maxdiff(backend.score(seqs, plens)[0], base_lp[0, 1:].tolist()) < 1e-5
    backend.set_adapter(adapter, 2)  # back to the adapter still loaded under that version: served again
    assert _maxdiff(backend.score(seqs, plens)[0], tuned_lp[0, 1:].tolist()) < 1e-5
    with pytest.raises(FileNotFoundError, match=r"adapter_config\.json"):
        backend.set_adapter(tmp_path, 4)


def test_selected_token_logprobs_equal_full_ones() -> None:
    from streamrl.agents.logprobs import selected_token_logprobs

    model = wrap_lora(load_model(resolve_model("tiny")))
    ids = torch.randint(0, 4000, (2, 30), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 25:] = 0
    select = torch.rand(2, 29, generator=torch.Generator().manual_seed(1)) > 0.5
    select[1, 24:] = False
    full = token_logprobs(model, ids, mask)[select]
    assert torch.allclose(selected_token_logprobs(model, ids, mask, select), full, atol=1e-6)


def _renormalized(model: object, sequence: list[int], start: int, options: list[list[int]]) -> list[float]:
    """Oracle: log-prob of each token of ``sequence[start:]`` under the model's full softmax renormalized over
    the tokens continuing one of ``options`` there (computed from the logits, not by the code under test)."""
    from streamrl.agents.base import allowed_next_tokens

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([sequence])).logits[0].float()  # type: ignore[operator]
    out = []
    for j in range(start, len(sequence)):
        lp = torch.log_softmax(logits[j - 1], -1)
        allowed = allowed_next_tokens(options, sequence[start:j])
        out.append(float(lp[sequence[j]] - torch.logsumexp(lp[allowed], -1)))
    return out


def test_generation_constrained_to_choices_samples_the_renormalized_policy(backend: HFBackend) -> None:
    from streamrl.agents.base import allowed_next_tokens
    from streamrl.agents.batch import collate
    from streamrl.agents.logprobs import selected_token_logprobs
    from streamrl.agents.trajectory import TokenSequence

    tok = backend.tokenizer
    eos = tok.eos_token_id
    # "cabinet 1" is a prefix of "cabinet 10": only the end-of-turn token tells them apart
    texts = ["go to cabinet 1", "go to cabinet 10", "go to drawer 2", "open drawer 2", "look"]
    options = [tok(t, add_special_tokens=False)["input_ids"] + [eos] for t in texts]
    bare = [
        tok(t, add_special_tokens=False)["input_ids"] for t in texts[:2]
    ]  # no end token: stops on a whole choice
    prompts = _prompts(backend)
    seen = set()
    for temperature, seed in [(0.0, 0), *((1.0, s) for s in range(6))]:
        params = SamplingParams(max_new_tokens=24, temperature=temperature, seed=seed)
        gens = backend.generate(prompts, params, choices=[options, bare, None])
        free = backend.generate(prompts[2:], params, seeds=[seed + 2])[0]
        assert gens[2].token_ids == free.token_ids  # an unconstrained row is untouched by its neighbours
        assert gens[0].token_ids in options and gens[0].finish_reason == "stop"
        assert gens[1].token_ids in bare and gens[1].extra == {"stop": "choice"}
        seen.add(tok.decode(gens[0].token_ids, skip_special_tokens=True))
        for g, opts, prompt in zip(gens[:2], (options, bare), prompts, strict=False):
            sequence = prompt + g.token_ids
            oracle = _renormalized(backend.model, sequence, len(prompt), opts)
            assert _maxdiff(g.logprobs, oracle) < 1e-4
            # the learner's scoring of the recorded sequence (TokenBatch.allowed) is the same policy
            seq = TokenSequence()
            seq.extend_context(list(prompt))
            allowed = [allowed_next_tokens(opts, g.token_ids[:j]) for j in range(len(g.token_ids))]
            seq.extend_action(g.token_ids, g.logprobs, 0, allowed)
            seq.validate()
            batch = collate([seq], backend.pad_token_id)
            with torch.no_grad():
                scored, entropy = selected_token_logprobs(
                    backend.model,
                    batch.input_ids,
                    batch.attention_mask,
                    batch.action_mask,
                    allowed=batch.allowed(),
                    with_entropy=True,
                )
            assert _maxdiff(scored.tolist(), oracle) < 1e-4
            for j, a in enumerate(allowed):  # a forced token is certain: log-prob and entropy 0
                if len(a) == 1:
                    assert scored[j] == 0.0 and entropy[j] == 0.0
    assert len(seen) > 1  # sampled, not the same choice every time
    with pytest.raises(ValueError, match=r"choices\[1\] is empty; pass None"):
        backend.generate(prompts[:2], SamplingParams(max_new_tokens=4), choices=[options, []])
    with pytest.raises(ValueError, match="2 prompts but 1 choice lists"):
        backend.generate(prompts[:2], SamplingParams(max_new_tokens=4), choices=[options])


def _tuned_lora(seed: int) -> object:
    """``tiny`` wrapped with a LoRA adapter named "default" whose ``B`` is non-zero (it changes log-probs)."""
    model = wrap_lora(load_model(resolve_model("tiny")), LoRAConfig(rank=4, alpha=8, seed=seed))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(seed * 1000 + len(name)))
    return model


def test_a_given_peft_model_is_served_as_is_and_keeps_its_adapters(tmp_path: Path) -> None:
    """The learner's own PeftModel handed to an in-process backend: its active adapter is what is served,
    publishing adapters never deletes (or freezes, or deactivates) the caller's adapter."""
    policy = _tuned_lora(seed=1)
    other = save_adapter(_tuned_lora(seed=2), tmp_path / "other")
    ids = torch.tensor([[5, 17, 300, 42, 9, 1000, 7]])
    mask = torch.ones_like(ids)

    def own() -> list[float]:  # the caller's model, called directly
        with torch.no_grad():
            return token_logprobs(policy, ids, mask)[0, 1:].tolist()

    with torch.no_grad():
        adapted = own()
        with policy.disable_adapter():
            base = token_logprobs(policy, ids, mask)[0, 1:].tolist()
    assert _maxdiff(adapted, base) > 1e-3
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    backend = HFBackend(policy, tokenizer=HFBackend("tiny").tokenizer)
    seqs, plens = [ids[0].tolist()], [2]
    assert _maxdiff(backend.score(seqs, plens)[0], adapted) < 1e-5  # the adapter, not the base weights

    backend.set_adapter(other, 1)  # a published adapter, loaded under a backend-owned name
    reference = HFBackend(resolve_model("tiny"))
    reference.set_adapter(other, 1)
    assert _maxdiff(backend.score(seqs, plens)[0], reference.score(seqs, plens)[0]) < 1e-5
    backend.set_adapter(other, 2)  # replaces the backend's own adapter only
    backend.set_adapter(None, 3)  # base weights: every adapter disabled for the backend's passes
    assert _maxdiff(backend.score(seqs, plens)[0], base) < 1e-5
    assert "default" in policy.peft_config and policy.active_adapter == "default"
    assert len(policy.peft_config) == 2  # "default" and the backend's latest load
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == trainable
    assert _maxdiff(own(), adapted) < 1e-6


def test_a_closed_backend_says_so(tmp_path: Path) -> None:
    backend = HFBackend("tiny")
    prompt = _prompts(backend)[0]
    backend.close()
    backend.close()  # idempotent
    for call in (
        lambda: backend.generate([prompt], SamplingParams(max_new_tokens=2)),
        lambda: backend.score([prompt], [1]),
        lambda: backend.set_adapter(None, 1),
    ):
        with pytest.raises(RuntimeError, match="HFBackend is closed"):
            call()


# -- the static-cache decoder against the transformers forward; batched sampling; stops ----------------------


def _mixed_prompts(backend: HFBackend, rows: int = 6) -> list[list[int]]:
    """``rows`` distinct prompts of 5 to 60 tokens (both paddings matter)."""
    stream = backend.tokenizer("You arrive at fridge 1. The fridge 1 is closed. What is 12 * 7? " * 12)[
        "input_ids"
    ]
    return [stream[3 * r : 3 * r + 5 + (r * 11) % 56] for r in range(rows)]


def _both_paths(model: object = "tiny", tokenizer: object = None) -> tuple[HFBackend, HFBackend]:
    static = HFBackend(model, tokenizer=tokenizer, config=HFBackendConfig(decode="static"))
    reference = HFBackend(model, tokenizer=tokenizer, config=HFBackendConfig(decode="hf"))
    return static, reference


def _same_generations(a: list, b: list, atol: float = 1e-5) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert (x.finish_reason, x.extra) == (y.finish_reason, y.extra)
        assert _maxdiff(x.logprobs, y.logprobs) < atol


def test_static_cache_decoder_generates_what_the_transformers_forward_does() -> None:
    """Greedy and sampled ids, finish reasons and log-probs of the static-cache path equal those of the model's own
    forward (the reference path): rows of different lengths, EOS and stop strings ending rows at different steps
    (finished rows leave the batch), more new tokens than the cache's first room (it grows), constrained rows."""
    static, reference = _both_paths()
    prompts = _mixed_prompts(static)
    for free_params in (
        SamplingParams(max_new_tokens=100, temperature=0.0),
        SamplingParams(max_new_tokens=100, seed=3),
    ):
        free = static.generate(prompts, free_params)
        _same_generations(free, reference.generate(prompts, free_params))
        # stop on tokens rows 0 and 3 write early: rows end at different steps, others run on
        params = replace(free_params, stop_token_ids=(free[0].token_ids[4], free[3].token_ids[30]))
        gens = static.generate(prompts, params)
        _same_generations(gens, reference.generate(prompts, params))
        assert len({len(g.token_ids) for g in gens}) > 2
    params = SamplingParams(
        max_new_tokens=40, seed=5, temperature=0.7, top_k=50, top_p=0.9, stop_strings=("e ", "\n")
    )
    gens = static.generate(prompts, params)
    _same_generations(gens, reference.generate(prompts, params))
    assert any(g.extra.get("stop") in ("e ", "\n") for g in gens)
    tok = static.tokenizer
    options = [
        tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in ("go to desk 1", "look")
    ]
    choices = [options, None, options, None, None, options]
    params = SamplingParams(max_new_tokens=30, seed=11)
    gens = static.generate(prompts, params, choices=choices)
    _same_generations(gens, reference.generate(prompts, params, choices=choices))
    assert all(gens[r].token_ids in options for r in (0, 2, 5))


def test_static_cache_decoder_serves_lora_adapters_as_peft_does(tmp_path: Path) -> None:
    policy = _tuned_lora(seed=3)
    tokenizer = HFBackend("tiny").tokenizer
    static, reference = _both_paths(policy, tokenizer)
    prompts = _mixed_prompts(static, rows=4)
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
    adapted = static.generate(prompts, greedy)
    _same_generations(adapted, reference.generate(prompts, greedy))
    for backend in (static, reference):
        backend.set_adapter(None, 1)  # base weights: the adapter disabled
    base = static.generate(prompts, greedy)
    _same_generations(base, reference.generate(prompts, greedy))
    assert [g.token_ids for g in base] != [g.token_ids for g in adapted]  # the adapter was served, then not
    other = save_adapter(_tuned_lora(seed=4), tmp_path / "other")
    for backend in (static, reference):
        backend.set_adapter(other, 2)  # a published adapter loaded next to the caller's
    _same_generations(static.generate(prompts, greedy), reference.generate(prompts, greedy))


def test_a_model_the_static_decoder_cannot_run_falls_back_or_is_refused() -> None:
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_pretrained(
        str(resolve_model("tiny")), attn_implementation="eager"
    ).eval()
    tokenizer = HFBackend("tiny").tokenizer
    prompt = _mixed_prompts(HFBackend("tiny"), rows=1)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    with pytest.raises(ValueError, match="attention implementation 'eager'; supported: 'sdpa'"):
        HFBackend(eager, tokenizer=tokenizer, config=HFBackendConfig(decode="static")).generate(
            prompt, params
        )
    fallback = HFBackend(eager, tokenizer=tokenizer).generate(prompt, params)[0]  # decode="auto"
    ref = eager.generate(torch.tensor(prompt), max_new_tokens=6, do_sample=False, pad_token_id=0)[
        0, len(prompt[0]) :
    ]
    assert fallback.token_ids == ref.tolist()[: len(fallback.token_ids)]
    with pytest.raises(ValueError, match="decode must be 'auto', 'static' or 'hf'"):
        HFBackendConfig(decode="fast")  # type: ignore[arg-type]


def test_a_rows_sample_is_a_function_of_its_own_seed(backend: HFBackend) -> None:
    """Same seed, any batch position or company, any budget: the same tokens; another seed: other tokens."""
    prompts = _mixed_prompts(backend)
    params = SamplingParams(max_new_tokens=16)
    seeds = [101, 102, 103, 104, 105, 106]
    together = backend.generate(prompts, params, seeds=seeds)
    reordered = backend.generate(prompts[::-1], params, seeds=seeds[::-1])[::-1]
    alone = [backend.generate([p], params, seeds=[s])[0] for p, s in zip(prompts, seeds, strict=True)]
    duplicated = backend.generate([prompts[4]] * 3, params, seeds=[105, 7, 105])
    shorter = backend.generate(prompts, SamplingParams(max_new_tokens=8), seeds=seeds)
    for r, gen in enumerate(together):
        assert reordered[r].token_ids == alone[r].token_ids == gen.token_ids
        assert shorter[r].token_ids == gen.token_ids[: len(shorter[r].token_ids)]
    assert duplicated[0].token_ids == duplicated[2].token_ids == together[4].token_ids
    assert duplicated[1].token_ids != duplicated[0].token_ids
    reseeded = backend.generate(prompts, params, seeds=[s + 1000 for s in seeds])
    assert sum(a.token_ids != b.token_ids for a, b in zip(together, reseeded, strict=True)) >= 5


def test_sampled_logprobs_are_what_the_learner_recomputes(backend: HFBackend) -> None:
    from streamrl.agents.batch import collate
    from streamrl.agents.logprobs import selected_token_logprobs
    from streamrl.agents.trajectory import TokenSequence

    prompts = _mixed_prompts(backend)
    gens = backend.generate(prompts, SamplingParams(max_new_tokens=48, seed=9))
    sequences = []
    for prompt, gen in zip(prompts, gens, strict=True):
        seq = TokenSequence()
        seq.extend_context(list(prompt))
        seq.extend_action(gen.token_ids, gen.logprobs, 0)
        sequences.append(seq)
    batch = collate(sequences, backend.pad_token_id)
    rollout = torch.tensor([lp for g in gens for lp in g.logprobs])
    for skip_unread in (False, True):  # the plain masked forward, and the learner's own
        with torch.no_grad():
            learner = selected_token_logprobs(
                backend.model,
                batch.input_ids,
                batch.attention_mask,
                batch.action_mask,
                skip_unread=skip_unread,
            )
        assert learner.shape == rollout.shape
        assert (learner - rollout).abs().max() < 1e-5


def test_inverse_cdf_sample_draws_exactly_the_distribution() -> None:
    """With N stratified uniforms ``(k + 0.5) / N`` inverting the CDF gives every token ``N p_t`` draws to within
    one (an exact oracle, no statistics); tokens of probability 0 are never drawn, whatever the uniform."""
    gen = torch.Generator().manual_seed(0)
    for vocab in (5, 64, 150, 4096):  # a vocabulary that is and is not a multiple of the CDF's block
        logits = torch.randn(2, vocab, generator=gen) * 3
        logits[:, ::7] = float("-inf")
        lp = torch.log_softmax(logits, -1)
        n = 20000
        u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
        for row in lp:
            drawn = inverse_cdf_sample(row.expand(n, vocab).contiguous(), u)
            counts = torch.bincount(drawn, minlength=vocab).double()
            expected = row.double().exp() / row.double().exp().sum() * n
            assert (counts - expected).abs().max() <= 1.0 + 1e-9
        extremes = inverse_cdf_sample(lp, torch.tensor([0.0, 1.0 - 2.0**-53], dtype=torch.float64))
        assert torch.isfinite(lp[torch.arange(2), extremes]).all()
    uniforms = sampling_uniforms([5, 6, 5], 10)
    assert torch.equal(uniforms[0], uniforms[2]) and not torch.equal(uniforms[0], uniforms[1])
    assert torch.equal(sampling_uniforms([5], 4)[0], uniforms[0, :4])


def test_stop_string_candidates_contain_every_token_that_completes_a_stop(backend: HFBackend) -> None:
    """Brute force on random token sequences: whenever a stop string first appears in the decoded tail, the token
    just written is a candidate; and the candidates are few enough to be worth it."""
    tok = backend.tokenizer
    stops = ("\n", "```output", "e ", " is", "é")
    vocab = backend.model.get_output_embeddings().weight.shape[0]
    candidates = stop_string_candidates(tok, vocab, stops)
    gen = torch.Generator().manual_seed(0)
    words = tok("x = 1\n```output\nthe cafe is open é è\n", add_special_tokens=False)["input_ids"]
    pool = torch.tensor(words * 20 + list(range(vocab)))
    completions = 0
    for _ in range(300):
        seq = pool[torch.randint(0, len(pool), (24,), generator=gen)].tolist()
        for j in range(1, len(seq) + 1):
            now, before = tok.decode(seq[:j]), tok.decode(seq[: j - 1])
            if any(s in now and s not in before for s in stops):
                completions += 1
                assert seq[j - 1] in candidates, (seq[:j], now)
                break
    assert completions > 50
    assert len(stop_string_candidates(tok, vocab, ("\n",))) < vocab / 4


def test_a_next_turn_reuses_the_kept_history_and_generates_what_a_whole_prompt_does() -> None:
    """Turn 2 and 3 prompts that continue turn 1's rows (prompt + generated + an observation) run only their new
    tokens: the same ids, finish reasons and log-probs (to float rounding) as without the prefix cache and as the
    transformers forward, in a batch that mixes continuing rows with new ones; a weight change empties it."""
    on = HFBackend("tiny", config=HFBackendConfig(decode="static"))
    off = HFBackend("tiny", config=HFBackendConfig(decode="static", prefix_cache_bytes=0))
    reference = HFBackend("tiny", config=HFBackendConfig(decode="hf"))
    tok = on.tokenizer
    observation = tok(" You arrive at desk 1. On the desk 1, you see a pen 2.", add_special_tokens=False)
    fresh = [tok("What is 3 + 4? Use python.")["input_ids"], tok("Go to the fridge 1.")["input_ids"]]
    for params in (
        SamplingParams(max_new_tokens=80, temperature=0.0),
        SamplingParams(max_new_tokens=40, seed=3),
    ):
        prompts = _mixed_prompts(on)
        seeds = list(range(len(prompts)))
        kept: list[list[int]] = []
        for turn in range(3):
            hits, reused = on.prefix_cache.hits, on.prefix_cache.reused_tokens
            gens = on.generate(prompts, params, seeds=seeds)
            _same_generations(gens, off.generate(prompts, params, seeds=seeds))
            _same_generations(gens, reference.generate(prompts, params, seeds=seeds))
            if turn > 0:  # rows 0-3 continue their own history (its last generated token never ran)
                assert on.prefix_cache.hits - hits == 4
                assert on.prefix_cache.reused_tokens - reused == sum(map(len, kept[:4]))
            kept = [p + g.token_ids[:-1] for p, g in zip(prompts, gens, strict=True)]
            prompts = [
                *(
                    p + g.token_ids + observation["input_ids"]
                    for p, g in zip(prompts[:4], gens, strict=False)
                ),
                *fresh,
            ]
        assert off.prefix_cache.hits == 0
    hits = on.prefix_cache.hits
    assert hits > 0 and on.prefix_cache.bytes > 0
    with torch.no_grad():  # an in-place write to the weights (here a no-op) bumps their version counters
        next(on.model.parameters()).mul_(1.0)
    on.generate(prompts[:4], SamplingParams(max_new_tokens=4, temperature=0.0))
    assert on.prefix_cache.hits == hits
    on.set_adapter(None, 1)
    assert on.prefix_cache.bytes == 0
    with pytest.raises(ValueError, match="prefix_cache_bytes must be >= 0"):
        HFBackendConfig(prefix_cache_bytes=-1)


def test_a_kept_head_serves_every_later_prompt_that_starts_with_it() -> None:
    """``keep=[n]`` keeps a prompt's first ``n`` tokens only (not the prompt and its generation): prompts that
    start with that head but do not continue the earlier prompt (a windowed episode's later turns) run only the
    rest, generate what they do without the cache, and keep nothing new; a head the prompt already started
    from is not stored twice. ``keep`` out of range is refused, naming it."""
    on = HFBackend("tiny", config=HFBackendConfig(decode="static"))
    off = HFBackend("tiny", config=HFBackendConfig(decode="static", prefix_cache_bytes=0))
    tok = on.tokenizer
    head = tok("You are in the middle of a room. Your task is to: put a pen in desk.")["input_ids"]
    turns = [
        tok(t, add_special_tokens=False)["input_ids"] for t in (" > look", " > go to desk 1", " > inventory")
    ]
    params = SamplingParams(max_new_tokens=12, seed=5)
    first = on.generate([head], params, seeds=[0], keep=[len(head)])
    _same_generations(first, off.generate([head], params, seeds=[0]))
    assert len(on.prefix_cache) == 1 and on.prefix_cache.bytes > 0
    size = on.prefix_cache.bytes
    for t, tail in enumerate(turns):  # each later prompt: the head, then something no earlier prompt had
        hits, reused = on.prefix_cache.hits, on.prefix_cache.reused_tokens
        prompts = [head + tail, head[:5] + tail]  # the second shares 5 tokens: whole at first, then from them
        gens = on.generate(prompts, params, seeds=[t, t], keep=[len(head), 5])
        _same_generations(gens, off.generate(prompts, params, seeds=[t, t]))
        found = (1, len(head)) if t == 0 else (2, len(head) + 5)
        assert (on.prefix_cache.hits - hits, on.prefix_cache.reused_tokens - reused) == found
    assert len(on.prefix_cache) == 2  # the head and the 5-token head (stored once, then found)
    assert on.prefix_cache.bytes == size * (len(head) + 5) // len(head)
    for keep in ([len(head) + 5], [-1]):
        with pytest.raises(ValueError, match=r"keep\[0\]=-?\d+ is outside \[0, "):
            on.generate([head + turns[0]], params, keep=keep)
    with pytest.raises(ValueError, match="keep has 2 entries for 1 prompts"):
        on.generate([head], params, keep=[1, 2])


def test_the_prefix_cache_finds_the_longest_kept_prefix_and_evicts_superseded_entries_first() -> None:
    from streamrl.agents.prefix_cache import CachedPrefix, PrefixCache

    def entry(tokens: list[int]) -> CachedPrefix:  # one layer, one head of size 1: 8 bytes a token
        kv = torch.arange(len(tokens), dtype=torch.float32).view(1, -1, 1)
        return CachedPrefix(tuple(tokens), (kv,), (kv.clone(),))

    a = list(range(40))  # longer than a hash block
    b = a + [7] * 30
    c = list(range(100, 140))
    cache = PrefixCache(max_bytes=8 * (40 + 70 + 40))
    cache.store(entry(a))
    cache.store(entry(c))
    assert cache.lookup(a) is None  # a whole prompt is never its own prefix: its last token must run
    assert cache.lookup([*a, 1]).tokens == tuple(a)  # type: ignore[union-attr]
    assert cache.lookup([*a[:39], 99, 5]) is None  # diverges inside the kept sequence
    cache.store(entry(b), continues=entry(a))  # the next turn: a is superseded by b
    assert cache.lookup([*b, 3]).tokens == tuple(b)  # type: ignore[union-attr]
    assert cache.lookup([*a, 1]).tokens == tuple(a)  # type: ignore[union-attr]  # superseded, still kept
    cache.store(entry(list(range(200, 210))))  # over budget: the superseded entry goes, not the older c
    assert cache.evicted == 1 and cache.lookup([*a, 1]) is None
    assert cache.lookup([*c, 1]) is not None and cache.lookup([*b, 1]) is not None
    assert cache.bytes == 8 * (70 + 40 + 10)
    cache.sync("other weights")
    assert len(cache) == 0 and cache.bytes == 0
