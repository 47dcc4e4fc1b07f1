"""streamrl.sft: the SFT cold start -- behaviour cloning of expert agents into a model, one cached checkpoint per env.

The SPO++ paper starts Math-TIR from an SFT checkpoint; this package gives a small model (``tiny``) the same
kind of start. RL on an env starts from that env's own checkpoint (``sft_checkpoint("math_tir")``,
``sft_checkpoint("alfworld")``): a model small enough to train on CPU loses most of one env's skill when
trained on both envs' data together (docs/sft.md).

1. **Expert data** (``streamrl.agents.teacher_forcing``): expert episodes played through the ``LLMAgent``'s
   own rendering, so the training sequences have the token layout and ``action_mask`` the agent produces at
   RL time; optional DART noise, extra generated tasks and downsampling of frequent actions.
2. **Training** (``train_sft``, ``streamrl.sft.build``): ``sft_loss`` (``streamrl.sft.loss``), the action tokens'
   cross-entropy plus ``SFTConfig.context_weight`` times a language-modelling loss on the context; AdamW with
   linear warm-up and cosine decay, full fine-tuning by default (``SFTConfig.lora`` trains an adapter and
   merges it). Optional model selection keeps the best epoch by greedy success on held-out generated tasks.
   A recipe may start from another env's checkpoint (``SFTConfig.init_from``): ALFWorld starts from Math-TIR's.
3. **Cache** (``sft_checkpoint``, ``streamrl.sft.build``): the checkpoint is saved under ``$STREAMRL_CACHE/sft/<model>-sft-<key>``
   (``SFTConfig.key()``), built once under a lock, so tests, examples and RL runs reuse it.

The recipes are the ``SFTConfig`` presets (``streamrl.sft.config``); what each one reaches, and the variants tried and not kept, are in
docs/sft.md. Command line: ``streamrl sft`` (``streamrl sft --help``).
"""

from streamrl.sft.build import (
    RESTART_SEED_STRIDE,
    SHIPPED,
    restart_attempts,
    sequences_sha256,
    sft_checkpoint,
    shipped_checkpoint,
    train_sft,
    weights_sha256,
)
from streamrl.sft.config import SFT_PRESETS, SFTConfig
from streamrl.sft.loss import sft_loss

__all__ = [
    "RESTART_SEED_STRIDE",
    "SFT_PRESETS",
    "SHIPPED",
    "SFTConfig",
    "restart_attempts",
    "sequences_sha256",
    "sft_checkpoint",
    "sft_loss",
    "shipped_checkpoint",
    "train_sft",
    "weights_sha256",
]
