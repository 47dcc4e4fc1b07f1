"""Model registry: byte-identical tiny builds, tokenizer round trips, atomic builds, clear errors."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from streamrl.agents import models
from streamrl.agents.models import (
    TinyModelConfig,
    build_once,
    build_tiny,
    load_tokenizer,
    model_dir_name,
    resolve_model,
)
from tokenizers import Tokenizer

ENV_TEXT = (
    "You arrive at countertop 1. On the countertop 1, you see a apple 2, and a mug 1.\n"
    "Your task is to: put a clean mug in coffeemachine.\n"
    "```python\nprint(37 * 12 - 5 / 2)\n```\n```output\n441.5\n```\nSo the answer is \\boxed{441.5}. é ✓ 😀"
)


def test_tiny_build_is_byte_identical_and_loads(tmp_path: Path) -> None:
    small = TinyModelConfig(stdlib_corpus_bytes=300_000, env_corpus_items=400, vocab_size=1024)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        build_tiny(tmp_path / name, small)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert "model.safetensors" in files and "tokenizer.json" in files and "chat_template.jinja" in files
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f

    # AutoTokenizer (Qwen2Tokenizer, which re-imposes Qwen2's regex) must split exactly like the trained file.
    tok = load_tokenizer(tmp_path / "a")
    raw = Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json"))
    assert tok(ENV_TEXT)["input_ids"] == raw.encode(ENV_TEXT).ids
    assert tok.decode(tok(ENV_TEXT)["input_ids"]) == ENV_TEXT
    assert tok.padding_side == "left"


def test_registered_tiny_model_shape() -> None:
    from transformers import AutoConfig

    path = resolve_model("tiny")
    assert resolve_model("tiny") == path  # cached, not rebuilt
    assert model_dir_name("tiny") == path.name  # what names tiny's checkpoints, known before any build
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.model_type == "qwen2"
    tok = load_tokenizer(path)
    msgs = [{"role": "user", "content": ENV_TEXT}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text)["input_ids"]
    # Trained partly on env-shaped text: well under one token per 2 characters on it.
    assert len(ids) < len(text) / 2.5
    assert tok.convert_ids_to_tokens(ids[-2]) == "assistant"
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == cfg.eos_token_id
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as fh:
        n = sum(fh.get_tensor(k).numel() for k in fh.keys())
    assert 1_000_000 <= n <= 10_000_000


def test_unknown_model_error_lists_valid_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'tiny'.*'smollm2-135m'"):
        resolve_model("no-such-model")
    with pytest.raises(ValueError, match=r"'tiny'.*'smollm2-135m'"):
        model_dir_name("no-such-model")
    with pytest.raises(ValueError, match=r"no config\.json"):
        resolve_model(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(tmp_path) == tmp_path
    assert model_dir_name(tmp_path) == tmp_path.name


def test_build_once_is_atomic_and_locked(tmp_path: Path) -> None:
    calls: list[int] = []
    barrier = threading.Barrier(4)

    def build(out: Path) -> None:
        calls.append(1)
        (out / "weights").write_text("ok")

    def worker() -> None:
        barrier.wait()
        build_once(tmp_path / "m", build)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and (tmp_path / "m" / "weights").read_text() == "ok"

    def failing(out: Path) -> None:
        (out / "partial").write_text("x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        build_once(tmp_path / "bad", failing)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["m"]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_smollm2_sha256_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "SMOLLM2_GGUF_SHA256", "0" * 64)
    with pytest.raises(ValueError, match="expected 0000"):
        models.convert_smollm2(tmp_path)
    assert list(tmp_path.iterdir()) == []
