"""The learner: one optimizer step per (mini-)batch of finished episodes, shared by every algorithm.

What it does for an update (``Learner.update``):

1. Splits each episode into its training rows (``TokenSequence``s with action tokens) and spreads the
   algorithm's advantages over the rows' action tokens.
2. Recomputes the old log-probs -- the policy at the start of the update, the PPO ratio's denominator --
   with the same code, temperature and precision as the training forward (``streamrl.agents.logprobs``), so
   the ratio is 1 before the first step and the rollout importance weight pi_old / pi_rollout measures only
   the trainer/inference mismatch and staleness. The first step's forwards run at those weights, so its rows
   take their old log-probs from their own training forward (detached; the ratio is exactly 1) and only the
   later steps' rows are scored beforehand, without grad, in the micro-batches they will train in.
3. For each of ``epochs`` x ``mini_batches`` optimizer steps: builds the step's loss aggregation once from
   the whole step's action mask (``Algorithm.aggregation``: batch-global token count, so micro-batch losses
   sum to the full-batch loss and SPO++'s zero-mean token measure holds across micro-batches), runs
   length-sorted micro-batches of at most ``micro_batch_tokens`` padded tokens (split further where a longer
   row would pad the others by more than ``PASS_TOKENS``; the rows of a windowed episode that share a long
   opening in micro-batches of their own, ``prefix_grouped_chunks``) with gradient accumulation, clips the
   gradient norm, steps AdamW and the warm-up + cosine schedule.

Every forward computes the micro-batch's common prefix (the system prompt; a windowed episode's system prompt,
task and first observation) once and the logits only at action tokens, and skips the last layer's MLP elsewhere
(``selected_token_logprobs(skip_unread=True, share_prefix=True)``): the same log-probs and gradients up to
float rounding, for less arithmetic.

Data-parallel ranks (``streamrl.algorithms.distributed``): ``shard_batch`` deals the batch to R ranks and each
rank runs ``update_shard`` on its shard. The ranks gather every step's row lengths, so the loss aggregation
(N_tok, B, T_max) is the whole batch's on every rank, sum their gradients (not average: each rank's loss is
already divided by the global counts) before clipping, and take identical AdamW steps: the update is the
single-rank update up to float rounding. With ``sharding="fsdp"`` each rank holds a shard of the model, every
forward is a collective and the ranks run equally many (filler forwards pad the lighter ones); the full state
is gathered to rank 0 for saves (``streamrl.algorithms.distributed``).

A KL term against the start (``LearnerConfig.kl_coef`` = beta > 0; GRPO's ``- beta D_KL[pi_theta || pi_ref]``):
each micro-batch's action tokens are scored, without grad, by the reference -- a frozen copy of the weights the
learner was built with, or with LoRA the base model under disabled adapters -- and ``beta x`` the per-token
estimate (``kl_estimator``, k3 by default), aggregated as the algorithm aggregates its policy loss, joins the
loss; ``ref_kl`` reports the estimate's mean per action token. It costs one forward per micro-batch, and a
copy of the model when fully fine-tuned.

Constrained actions (``LLMAgent(constrain_actions=True)``): tokens sampled among an allowed set
(``TokenSequence.choice_ids``) are scored under the model's distribution renormalized over that set, the
distribution they were sampled from, in the old log-probs and in the training forward alike.

Precision: fp32 on CPU; bf16 autocast on CUDA (log-probs and losses in fp32). Parameters: LoRA adapters
(peft) or the full model (``LearnerConfig.finetune``; "auto" picks full fine-tuning below
``full_finetune_max_params`` parameters, where an adapter's rank limits a tiny model more than it saves).
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from streamrl.agents.batch import TokenBatch, collate
from streamrl.agents.logprobs import selected_token_logprobs
from streamrl.agents.lora import LoRAConfig, save_adapter, trainable_parameters, wrap_lora
from streamrl.agents.trajectory import TokenSequence, Trajectory
from streamrl.algorithms.base import PolicyInputs
from streamrl.algorithms.losses import KLKind, aggregate_loss, kl_penalty

if TYPE_CHECKING:
    from streamrl.algorithms.base import Episode, PolicyObjective
    from streamrl.algorithms.distributed import RankGroup

Finetune = Literal["auto", "full", "lora"]
Schedule = Literal["cosine", "constant"]
Sharding = Literal["replicate", "fsdp"]


@dataclass(frozen=True)
class LearnerConfig:
    """Optimizer, parameters and batching of the learner."""

    finetune: Finetune = "auto"
    """``"lora"`` (peft adapters; right for models of billions of parameters), ``"full"``, or ``"auto"``: full
    below ``full_finetune_max_params`` parameters, LoRA above."""
    full_finetune_max_params: int = 50_000_000
    """The ``"auto"`` threshold."""
    lr: float = 1e-4
    """AdamW peak learning rate (1e-4 to 2e-4 suits ``tiny`` fully fine-tuned -- the demo uses 2e-4 --, 1e-3 its
    LoRA adapters: docs/training.md; the SPO++ paper uses 1e-6 on 0.8B-2B models)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (SPO++ App. A uses 0.1 at lr 1e-6)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0."""
    schedule: Schedule = "cosine"
    """After warm-up: ``"cosine"`` decay to ``min_lr_ratio`` x lr over the run, or ``"constant"``."""
    min_lr_ratio: float = 0.1
    """Where the cosine decay ends, as a fraction of the peak."""
    max_grad_norm: float = 1.0
    """Gradient-norm clipping per optimizer step."""
    kl_coef: float = 0.0
    """beta of a ``beta * KL(pi_theta || pi_ref)`` loss term against the run's start policy (GRPO's D_KL, verl's
    ``kl_loss_coef``, TRL's ``beta``), aggregated like the policy loss. 0 = none, as SPO, SPO++, SAO and DAPO
    publish; the GRPO paper used 0.04. The reference is the weights the learner starts from (a frozen copy
    when fully fine-tuned; the base model under disabled adapters with LoRA), also after a resume."""
    kl_estimator: KLKind = "k3"
    """The per-token KL estimate (``streamrl.algorithms.losses.kl_penalty``): ``k3`` (GRPO's), ``k1``, ``k2``,
    ``abs``."""
    mini_batches: int = 1
    """Optimizer steps per update (PPO mini-batches, split by episode); SPO++ App. A: 1."""
    epochs: int = 1
    """Passes over the update batch (PPO epochs); SPO++: 1."""
    micro_batch_tokens: int = 16384
    """Padded tokens per forward pass (rows x longest row); gradient accumulation makes it a memory knob only."""
    lora_rank: int = 16
    lora_alpha: int = 32
    lora_target_modules: str | tuple[str, ...] = "all-linear"
    device: str = "auto"
    """``"auto"`` = CUDA when available, else CPU."""
    sharding: Sharding = "replicate"
    """How learner ranks (``TrainConfig.learner_ranks`` >= 2) hold the policy: ``"replicate"``, a whole copy on
    every rank (gradients summed in one all-reduce per step), or ``"fsdp"``, FSDP2 ``fully_shard``: each rank
    holds 1/R of the weights, gradients and optimizer state, for full fine-tuning of models one device cannot
    hold with their optimizer (LoRA is refused; ``finetune="auto"`` means full). See
    ``streamrl.algorithms.distributed``."""

    def __post_init__(self) -> None:
        if self.finetune not in ("auto", "full", "lora"):
            raise ValueError(f"finetune must be 'auto', 'full' or 'lora', got {self.finetune!r}")
        if self.sharding not in ("replicate", "fsdp"):
            raise ValueError(f"sharding must be 'replicate' or 'fsdp', got {self.sharding!r}")
        if self.sharding == "fsdp" and self.finetune == "lora":
            raise ValueError(
                "sharding='fsdp' shards a fully fine-tuned model; LoRA adapters are not sharded: use "
                "finetune='full' with fsdp, or sharding='replicate' with LoRA"
            )
        if self.schedule not in ("cosine", "constant"):
            raise ValueError(f"schedule must be 'cosine' or 'constant', got {self.schedule!r}")
        if self.lr < 0:
            raise ValueError(f"lr must be >= 0, got {self.lr}")
        for name in ("mini_batches", "epochs", "micro_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0):
            raise ValueError(f"kl_coef must be a finite number >= 0, got {self.kl_coef}")
        if self.kl_estimator not in get_args(KLKind):
            raise ValueError(
                f"kl_estimator must be one of {list(get_args(KLKind))}, got {self.kl_estimator!r}"
            )
        if self.kl_coef > 0 and self.sharding == "fsdp":
            raise ValueError(
                "kl_coef > 0 needs a reference copy of the policy, which fsdp does not shard: use "
                "sharding='replicate', LoRA (its reference is the base model, no copy), or kl_coef=0"
            )

    def resolved_finetune(self, num_params: int) -> Literal["full", "lora"]:
        if self.finetune != "auto":
            return self.finetune
        if self.sharding == "fsdp":
            return "full"
        return "full" if num_params < self.full_finetune_max_params else "lora"


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class TrainingRow:
    """One row of a training batch: a token sequence with action tokens, and the index of its episode."""

    episode: int
    sequence: TokenSequence


def training_rows(trajectories: Sequence[Trajectory]) -> list[TrainingRow]:
    """The rows of ``trajectories`` in order: every sequence that holds action tokens (one per episode with
    the full context, one per turn with a window)."""
    return [
        TrainingRow(i, seq)
        for i, traj in enumerate(trajectories)
        for seq in traj.sequences
        if seq.num_action_tokens
    ]


PASS_TOKENS = 256
"""What the learner counts one forward and backward pass as, in tokens, when it splits a micro-batch to save
padding (``length_sorted_chunks(pass_tokens=)``)."""


def length_sorted_chunks(
    rows: Sequence[TrainingRow], max_tokens: int, pass_tokens: int = 0
) -> list[list[int]]:
    """Row indices grouped by length: sorted (stable), chunked so rows x longest <= ``max_tokens`` padded
    tokens per forward pass (a row longer than that is a chunk of its own).

    ``pass_tokens`` > 0 also starts a new chunk where the next (longer) row would pad the chunk's rows by more
    tokens than that: a pass's fixed cost against the padding it saves, so one long row does not pad a chunk
    of short ones to its length."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i].sequence))
    chunks: list[list[int]] = []
    for i in order:
        if chunks:
            width = len(rows[i].sequence)  # the longest so far: order is ascending
            rows_so_far = len(chunks[-1])
            padding = rows_so_far * (width - len(rows[chunks[-1][-1]].sequence))
            if (rows_so_far + 1) * width <= max_tokens and (pass_tokens <= 0 or padding <= pass_tokens):
                chunks[-1].append(i)
                continue
        chunks.append([i])
    return chunks


def common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    """How many leading token ids all ``sequences`` have in common."""
    shortest = min(len(s) for s in sequences)
    first = sequences[0]
    for n in range(shortest):
        token = first[n]
        if any(s[n] != token for s in sequences[1:]):
            return n
    return shortest


def prefix_grouped_chunks(
    rows: Sequence[TrainingRow], max_tokens: int, pass_tokens: int = PASS_TOKENS
) -> list[list[int]]:
    """The learner's micro-batches: ``length_sorted_chunks``, with the rows of an episode kept apart where they
    share a long prefix.

    An episode played with a windowed context has a row per turn, and every one of them opens with the episode's
    system prompt, task and first observation. A forward with ``share_prefix`` computes a micro-batch's common
    prefix once, so a micro-batch of one such episode's rows computes that prefix once instead of once per row;
    mixed with other episodes' rows (sorted by length) it would share the system prompt only. An episode whose
    rows save at least ``pass_tokens`` tokens that way ((rows - 1) x their common prefix: what one more forward
    pass costs, ``PASS_TOKENS``) is chunked on its own; the other rows (a full-context episode has one) are
    chunked together, as ``length_sorted_chunks`` does."""
    by_episode: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        by_episode.setdefault(row.episode, []).append(i)
    chunks: list[list[int]] = []
    rest: list[int] = []
    for members in by_episode.values():
        saved = (len(members) - 1) * common_prefix_length([rows[i].sequence.token_ids for i in members])
        if len(members) > 1 and saved >= pass_tokens:
            part = [rows[i] for i in members]
            chunks += [[members[j] for j in c] for c in length_sorted_chunks(part, max_tokens, pass_tokens)]
        else:
            rest += members
    part = [rows[i] for i in rest]
    return chunks + [[rest[j] for j in c] for c in length_sorted_chunks(part, max_tokens, pass_tokens)]


@torch.no_grad()
def score_rows(
    rows: Sequence[TrainingRow],
    score: Callable[[TokenBatch], torch.Tensor],
    *,
    pad_token_id: int,
    max_tokens: int,
    device: torch.device,
    pass_tokens: int = 0,
    chunks: Sequence[Sequence[int]] | None = None,
) -> list[torch.Tensor]:
    """Per row, the values ``score(batch)`` gives its action tokens (flat, fp32, on CPU), without grad.

    ``score`` maps a collated micro-batch (``chunks`` of row indices; ``None``: ``length_sorted_chunks(rows,
    max_tokens, pass_tokens)``), on ``device``) to one value per action token in ``batch.action_mask`` order:
    the learner's log-probs, a critic's values.
    """
    out: list[torch.Tensor] = [torch.empty(0)] * len(rows)
    for chunk in length_sorted_chunks(rows, max_tokens, pass_tokens) if chunks is None else chunks:
        batch = collate([rows[i].sequence for i in chunk], pad_token_id).to(device)
        flat = score(batch).float().cpu()
        for i, part in zip(chunk, flat.split(batch.lengths.tolist()), strict=True):
            out[i] = part
    return out


def per_episode(
    rows: Sequence[TrainingRow], per_row: Sequence[torch.Tensor], episodes: int
) -> list[torch.Tensor]:
    """Concatenate per-row action-token values into one 1-D tensor per episode (sequence order; empty for an
    episode without action tokens): the inverse of splitting an episode into ``training_rows``."""
    out: list[list[torch.Tensor]] = [[] for _ in range(episodes)]
    for row, values in zip(rows, per_row, strict=True):
        out[row.episode].append(values)
    return [torch.cat(parts) if parts else torch.empty(0) for parts in out]


@dataclass
class Shard:
    """One rank's part of an update batch (``shard_batch``); picklable, so a launcher can ship it to its rank."""

    episodes: list[Episode]
    advantages: list[float | torch.Tensor]
    positions: list[int]
    """Each episode's index in the whole batch (ascending)."""
    mini_batch: list[int]
    """Each episode's mini-batch, 0 .. ``mini_batches`` - 1 (-1: no action tokens, nothing to train)."""
    mini_batches: int
    """Optimizer steps per epoch: the same on every rank, which all step together."""


def shard_batch(
    episodes: Sequence[Episode],
    advantages: Sequence[float | torch.Tensor],
    ranks: int,
    mini_batches: int = 1,
) -> list[Shard]:
    """Deal an update batch to ``ranks`` learner ranks, deterministically.

    Mini-batches are formed first, as one rank forms them (the k-th episode with action tokens goes to
    mini-batch k mod M, M = min(``mini_batches``, such episodes)), so each optimizer step trains the same
    episodes whatever the number of ranks. Then each mini-batch is dealt longest first, every episode to the
    rank holding the fewest action tokens of that mini-batch so far (ties: fewest of the whole batch, then
    the lowest rank): every step waits for its slowest rank. Episodes without action tokens go to rank 0
    with mini-batch -1, so their advantages are still checked.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if len(advantages) != len(episodes):
        raise ValueError(f"{len(advantages)} advantages for {len(episodes)} episodes")
    tokens = [e.num_action_tokens for e in episodes]
    trained = [i for i, n in enumerate(tokens) if n]
    if not trained:
        raise ValueError("the update batch has no action tokens")
    if ranks > len(trained):
        raise ValueError(
            f"{ranks} learner ranks for an update batch of {len(trained)} trajectories with action tokens: "
            f"every rank needs at least one (use at most {len(trained)} ranks, or a larger batch)"
        )
    parts = max(1, min(mini_batches, len(trained)))
    mini = [-1] * len(episodes)
    for k, i in enumerate(trained):
        mini[i] = k % parts
    owner = [0] * len(episodes)
    total = [0] * ranks
    for m in range(parts):
        load = [0] * ranks
        for i in sorted((i for i in trained if mini[i] == m), key=lambda i: (-tokens[i], i)):
            r = min(range(ranks), key=lambda r: (load[r], total[r], r))
            owner[i] = r
            load[r] += tokens[i]
            total[r] += tokens[i]
    return [
        Shard(
            episodes=[episodes[i] for i in mine],
            advantages=[advantages[i] for i in mine],
            positions=mine,
            mini_batch=[mini[i] for i in mine],
            mini_batches=parts,
        )
        for mine in ([i for i in range(len(episodes)) if owner[i] == r] for r in range(ranks))
    ]


class Learner:
    """Trains a policy model on batches of episodes (see module doc)."""

    def __init__(
        self,
        model: Any,
        config: LearnerConfig | None = None,
        *,
        pad_token_id: int,
        total_steps: int,
        temperature: float = 1.0,
        group: RankGroup | None = None,
    ) -> None:
        """``group``: the data-parallel ranks this learner is one of (``streamrl.algorithms.distributed``);
        ``None``: a single rank. Every rank constructs its learner together: rank 0's trainable weights are
        broadcast to the others (with ``sharding="fsdp"``, rank 0's whole state, then each rank keeps its
        shard)."""
        self.config = config or LearnerConfig()
        self.group = group
        self.sharded = self.config.sharding == "fsdp"
        if self.sharded and group is None:
            raise ValueError(
                "sharding='fsdp' shards the policy over learner ranks and needs their group "
                "(streamrl.algorithms.distributed); a single learner holds the whole model: use 'replicate'"
            )
        self.device = _device(self.config.device)
        self.pad_token_id = pad_token_id
        self.temperature = temperature
        num_params = sum(p.numel() for p in model.parameters())
        self.finetune = self.config.resolved_finetune(num_params)
        if self.finetune == "lora":
            model = wrap_lora(
                model,
                LoRAConfig(
                    rank=self.config.lora_rank,
                    alpha=self.config.lora_alpha,
                    target_modules=self.config.lora_target_modules,
                ),
            )
        else:
            for p in model.parameters():
                p.requires_grad_(True)
        self._root: Any = None
        if self.sharded:
            from streamrl.algorithms.distributed import fully_shard_policy

            assert group is not None
            self._root = fully_shard_policy(model, group, self.device)  # moves the shards to the device
            self.model = model
        else:
            self.model = model.to(self.device)
        self.model.eval()  # no dropout in rollouts or scoring; the loss is the same function in training
        self.params = list(trainable_parameters(self.model))
        if self.group is not None and not self.sharded:  # replicas start equal (a LoRA's init, a rank's load)
            self.group.broadcast_([p.data for p in self.params])
        # KL(pi_theta || pi_ref)'s reference: the start, frozen. A LoRA policy's is its base model (adapters
        # disabled for the forward), so it costs no copy; a resumed run loads its weights after this.
        self.reference: Any = None
        if self.config.kl_coef > 0 and self.finetune == "full":
            self.reference = copy.deepcopy(self.model).requires_grad_(False).eval()
        self.lr = self.config.lr
        self.optimizer = torch.optim.AdamW(self.params, lr=self.lr, weight_decay=self.config.weight_decay)
        self.total_steps = max(1, total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.steps = 0
        self._autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else nullcontext()
        )

    def _lr_factor(self, step: int) -> float:
        c = self.config
        if step < c.warmup_steps:
            return (step + 1) / c.warmup_steps
        if c.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - c.warmup_steps) / max(1, self.total_steps - c.warmup_steps))
        return c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    # -- rows and micro-batches ----------------------------------------------------------------------------
    def _micro_batches(self, rows: Sequence[TrainingRow]) -> list[list[int]]:
        return prefix_grouped_chunks(rows, self.config.micro_batch_tokens, PASS_TOKENS)

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(self.model, *args, **kwargs)``; with FSDP through the root unit, whose forward hooks gather the
        root's shards (embeddings, final norm, head) and arrange their gradients' reduction."""
        if self._root is not None:
            return self._root(fn, *args, **kwargs)
        return fn(self.model, *args, **kwargs)

    def _forward(self, batch: TokenBatch, with_entropy: bool) -> Any:
        with self._autocast:
            return self._call(self._logprobs, batch, with_entropy)

    @torch.no_grad()
    def _reference_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """The action tokens' log-probs under the reference policy (``LearnerConfig.kl_coef``), scored exactly as
        the policy's are (temperature, constraint, precision)."""
        with self._autocast:
            if self.reference is not None:
                return self._logprobs(self.reference, batch, False)
            with self.model.disable_adapter():  # LoRA: the base model
                return self._logprobs(self.model, batch, False)

    def _logprobs(self, model: Any, batch: TokenBatch, with_entropy: bool) -> Any:
        return selected_token_logprobs(
            model,
            batch.input_ids,
            batch.attention_mask,
            batch.action_mask,
            with_entropy=with_entropy,
            temperature=self.temperature,
            allowed=batch.allowed(),  # tokens sampled under a constraint: scored as they were sampled
            skip_unread=True,
            share_prefix=not self.sharded,  # (FSDP: the ranks' forwards are collectives, one call each)
        )

    def _matching_forwards(self, forwards: int) -> int:
        """How many forwards this rank runs in a phase where it has ``forwards`` of its own: with FSDP every
        forward (and backward) is a collective over the ranks (it gathers each unit's shards), so every rank
        runs as many as the busiest one; otherwise ``forwards``."""
        if not self.sharded:
            return forwards
        assert self.group is not None
        return max(self.group.all_gather_object(forwards))

    def _filler_forwards(self, count: int, *, backward: bool) -> None:
        """``count`` forwards on one two-token row (and with ``backward`` a backward of 0 x its log-prob): they
        take part in FSDP's gathers and reductions and add nothing to any gradient or metric."""
        ids = torch.full((1, 2), self.pad_token_id, device=self.device)
        select = torch.ones((1, 1), dtype=torch.bool, device=self.device)
        for _ in range(count):
            with nullcontext() if backward else torch.no_grad(), self._autocast:
                out = self._call(selected_token_logprobs, ids, torch.ones_like(ids), select)
            if backward:
                (out.float().sum() * 0.0).backward()

    def _row_logprobs(self, rows: Sequence[TrainingRow]) -> list[torch.Tensor]:
        """Log-probs of each row's action tokens under the current weights (flat, fp32, on CPU)."""
        chunks = self._micro_batches(rows)  # those the rows will train in
        fillers = self._matching_forwards(len(chunks)) - len(chunks)  # FSDP: as many forwards as every rank
        out = score_rows(
            rows,
            lambda batch: self._forward(batch, with_entropy=False),
            pad_token_id=self.pad_token_id,
            max_tokens=self.config.micro_batch_tokens,
            device=self.device,
            chunks=chunks,
        )
        self._filler_forwards(fillers, backward=False)
        return out

    def episode_logprobs(self, trajectories: Sequence[Trajectory]) -> list[torch.Tensor]:
        """Per trajectory, the log-probs of all its action tokens (sequence order) under the current weights.
        With FSDP every rank calls it at once, each with its own trajectories (``DistributedLearner`` deals
        them)."""
        rows = training_rows(trajectories)
        return per_episode(rows, self._row_logprobs(rows), len(trajectories))

    @torch.no_grad()
    def token_logprobs(self, sequence: Sequence[int]) -> list[float]:
        """``log p(sequence[t+1] | sequence[:t+1])`` for every t under the current weights, at temperature 1 and
        without autocast: what a backend serving the published policy must score (the trainer's publication
        probe). With FSDP every rank calls it at once."""
        from streamrl.agents.logprobs import token_logprobs

        ids = torch.tensor([list(sequence)], device=self.device)
        out = self._call(token_logprobs, ids, torch.ones_like(ids))
        return [float(x) for x in out[0].float().cpu()]

    # -- the update ------------------------------------------------------------------------------------------
    def update(
        self,
        episodes: Sequence[Episode],
        advantages: Sequence[float | torch.Tensor],
        objective: PolicyObjective,
    ) -> dict[str, float]:
        """Train on ``episodes`` with one advantage entry per episode (``Algorithm.advantages``) on the loss of
        ``objective`` (the algorithm: ``aggregation`` and ``policy_loss`` are all the learner asks of it)."""
        (shard,) = shard_batch(episodes, advantages, 1, self.config.mini_batches)
        return self.update_shard(shard, objective)

    def update_shard(self, shard: Shard, objective: PolicyObjective) -> dict[str, float]:
        """Train on this rank's ``shard`` of an update batch (``shard_batch``); every rank of ``self.group``
        calls it at once with its own shard, and all return the metrics of the whole batch."""
        started = time.perf_counter()
        rows = training_rows([e.trajectory for e in shard.episodes])
        if not rows and self.group is None:
            raise ValueError("the update batch has no action tokens")
        row_adv = self._spread(shard.episodes, shard.advantages, rows)
        sums: dict[str, float] = {}
        weight = 0.0
        grad_norms: list[float] = []
        parts = shard.mini_batches
        steps = [
            [i for i, row in enumerate(rows) if shard.mini_batch[row.episode] == m] for m in range(parts)
        ]
        aggs = [objective.aggregation(mask) for mask in self._step_masks(shard, rows, steps)]
        # pi_old, the policy before the first step: the first step's own forwards run at those weights, so its
        # rows' old log-probs are their training log-probs (detached); the later steps' rows are scored now, in
        # the micro-batches they will train in
        old: dict[int, torch.Tensor] = {}
        for mini in steps[1:]:
            for i, values in zip(mini, self._row_logprobs([rows[i] for i in mini]), strict=True):
                old[i] = values
        for _ in range(self.config.epochs):
            for mini, agg in zip(steps, aggs, strict=True):
                chunks = self._micro_batches([rows[i] for i in mini])
                fillers = self._matching_forwards(len(chunks)) - len(chunks)
                for chunk in chunks:
                    idx = [mini[j] for j in chunk]
                    batch = collate([rows[i].sequence for i in idx], self.pad_token_id).to(self.device)
                    flat, entropy = self._forward(batch, with_entropy=True)
                    if idx[0] not in old:  # the first step of the first epoch: still the old weights
                        for i, values in zip(
                            idx, flat.detach().float().split(batch.lengths.tolist()), strict=True
                        ):
                            old[i] = values
                    inputs = PolicyInputs(
                        logp=batch.scatter(flat.float()),
                        old_logp=batch.scatter(torch.cat([old[i] for i in idx]).to(self.device)),
                        rollout_logp=batch.rollout_logprobs,
                        advantages=batch.scatter(torch.cat([row_adv[i] for i in idx]).to(self.device)),
                        mask=batch.action_mask.float(),
                        agg=agg,
                        entropy=batch.scatter(entropy.float()),
                    )
                    out = objective.policy_loss(inputs)
                    loss = out.loss
                    if self.config.kl_coef > 0:
                        ref_logp = batch.scatter(self._reference_logprobs(batch).float())
                        kl = kl_penalty(inputs.logp, ref_logp, self.config.kl_estimator) * inputs.mask
                        loss = loss + self.config.kl_coef * aggregate_loss(kl, inputs.mask, agg)
                        sums["ref_kl"] = sums.get("ref_kl", 0.0) + float(kl.detach().sum())
                    loss.backward()
                    tokens = float(batch.num_action_tokens)
                    weight += tokens
                    for key, value in out.metrics().items():
                        if key != "loss" and key != "num_tokens" and math.isfinite(value):
                            sums[key] = sums.get(key, 0.0) + value * tokens
                    sums["entropy"] = sums.get("entropy", 0.0) + float(entropy.sum())
                    sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
                    self._mismatch(inputs, sums)
                self._filler_forwards(fillers, backward=True)
                grad_norms.append(self._step())
        action_tokens = float(sum(len(a) for a in row_adv))
        row_tokens = float(sum(len(r.sequence) for r in rows))
        if self.group is not None:  # the whole batch's sums: each rank's diagnostics cover its own tokens
            gathered = self.group.all_gather_object((sums, weight, action_tokens, row_tokens))
            sums = {}
            for rank_sums, *_ in gathered:
                for key, value in rank_sums.items():
                    sums[key] = sums.get(key, 0.0) + value
            weight, action_tokens, row_tokens = (sum(g[k] for g in gathered) for k in (1, 2, 3))
        seconds = time.perf_counter() - started
        metrics = {k: (v if k == "loss" else v / max(weight, 1.0)) for k, v in sums.items()}
        metrics["loss"] = sums.get("loss", 0.0) / (self.config.epochs * parts)
        metrics.update(
            grad_norm=sum(grad_norms) / len(grad_norms),
            lr=self.optimizer.param_groups[0]["lr"],
            action_tokens=action_tokens,
            learner_seconds=seconds,
            learner_tokens_per_s=row_tokens * self.config.epochs / seconds,
        )
        return metrics

    def _step_masks(
        self, shard: Shard, rows: Sequence[TrainingRow], steps: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        """Each optimizer step's action mask over the whole batch (rows in batch order, one row per
        sequence): what ``Algorithm.aggregation`` takes its counts from. With ranks, the ranks gather each
        other's row lengths, so every rank divides by the batch's counts, never by its shard's."""
        local = [
            [(shard.positions[rows[i].episode], rows[i].sequence.num_action_tokens) for i in mini]
            for mini in steps
        ]
        if self.group is not None:
            gathered = self.group.all_gather_object(local)
            # batch order: by episode (a stable sort keeps an episode's rows in sequence order)
            local = [
                sorted((row for g in gathered for row in g[m]), key=lambda r: r[0]) for m in range(len(steps))
            ]
        masks = []
        for step in local:
            lengths = torch.tensor([n for _, n in step])
            masks.append(torch.arange(int(lengths.max()))[None, :] < lengths[:, None])
        return masks

    @staticmethod
    def _mismatch(inputs: Any, sums: dict[str, float]) -> None:
        """Trainer/inference mismatch diagnostics: k3 KL(rollout || old) and the IS weight's tail."""
        with torch.no_grad():
            m = inputs.mask
            log_w = (inputs.old_logp - inputs.rollout_logp) * m
            k3 = (torch.expm1(-log_w) + log_w) * m
            sums["rollout_kl"] = sums.get("rollout_kl", 0.0) + float(k3.sum())
            sums["is_weight_above_2"] = sums.get("is_weight_above_2", 0.0) + float(
                ((log_w > math.log(2)) * m).sum()
            )
            sums["is_log_weight_abs"] = sums.get("is_log_weight_abs", 0.0) + float(log_w.abs().sum())

    def _step(self) -> float:
        if self.group is not None and not self.sharded:  # FSDP reduce-scatters (sums) in every backward
            self._reduce_gradients()
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
        if self.sharded:  # the norm of the sharded gradient: a DTensor, its full value a collective
            norm = norm.full_tensor()  # type: ignore[attr-defined]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return float(norm)

    def _reduce_gradients(self) -> None:
        """Sum the ranks' gradients (each rank's loss is already divided by the batch's counts, so the sum is
        the whole batch's gradient). A parameter no rank's loss reached keeps no gradient, as with one rank;
        one that only other ranks' shards reached gets theirs."""
        assert self.group is not None
        reached = torch.tensor([float(p.grad is not None) for p in self.params], device=self.device)
        self.group.all_reduce_sum_([reached])
        grads = []
        for p, r in zip(self.params, reached.tolist(), strict=True):
            if r:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        self.group.all_reduce_sum_(grads)

    @staticmethod
    def _spread(
        episodes: Sequence[Episode], advantages: Sequence[float | torch.Tensor], rows: Sequence[TrainingRow]
    ) -> list[torch.Tensor]:
        """Each row's advantage per action token, from one scalar or one value per action token per episode."""
        per_episode: list[list[torch.Tensor]] = []
        for episode, adv in zip(episodes, advantages, strict=True):
            lengths = [s.num_action_tokens for s in episode.trajectory.sequences if s.num_action_tokens]
            if isinstance(adv, torch.Tensor) and adv.dim() == 1:
                if adv.numel() != sum(lengths):
                    raise ValueError(
                        f"episode of task {episode.task_id!r} has {sum(lengths)} action tokens but "
                        f"{adv.numel()} token advantages"
                    )
                per_episode.append(list(adv.float().split(lengths)))
            else:
                value = float(adv)
                if not math.isfinite(value):
                    raise ValueError(f"advantage of task {episode.task_id!r} is {value}")
                per_episode.append([torch.full((n,), value) for n in lengths])
        cursor = [0] * len(episodes)
        out = []
        for row in rows:
            out.append(per_episode[row.episode][cursor[row.episode]])
            cursor[row.episode] += 1
        return out

    # -- publication and checkpoints -------------------------------------------------------------------------
    def save_policy(self, directory: str | os.PathLike[str]) -> Path:
        """Write the trained policy: the peft adapter (LoRA) or the full model (safetensors). With FSDP every
        rank calls it at once: the full weights are gathered to rank 0 (on its CPU), which alone writes them."""
        path = Path(directory)
        if self.finetune == "lora":
            return save_adapter(self.model, path)
        if self.sharded:
            weights = self._full_weights()
            if self._first_rank:
                # one entry per tensor, as the model would save itself: a tied weight (the output head's)
                # shares its tensor on the model, but the gathered copies are separate tensors
                names: dict[int, str] = {}
                for k, v in self.model.state_dict(keep_vars=True).items():
                    names.setdefault(id(v), k)
                path.mkdir(parents=True, exist_ok=True)
                self.model.save_pretrained(str(path), state_dict={k: weights[k] for k in names.values()})
            return path
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(str(path))
        return path

    def state_dict(self) -> dict[str, Any]:
        """Trainable weights, optimizer and scheduler state, step count (``torch.save``-able). With FSDP every
        rank calls it at once and rank 0 gets the full (unsharded) state, the same a single rank would hold
        (the other ranks get ``{}``), so a checkpoint loads whatever the ranks and sharding of the next run."""
        names = self._trainable_names()  # the optimizer's order
        trainable = set(names)
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            weights = self._full_weights()
            # before the first step there are no moments to gather (and DCP would take a step to make some)
            optimizer = (
                get_optimizer_state_dict(self.model, self.optimizer, options=_full_state_options())
                if self.optimizer.state
                else self.optimizer.state_dict()  # in index form already
            )
            if not self._first_rank:
                return {}
            if self.optimizer.state:
                optimizer = optimizer_state_by_index(optimizer, names)
            return {
                "weights": {k: v for k, v in weights.items() if k in trainable},
                "optimizer": optimizer,
                "scheduler": self.scheduler.state_dict(),
                "steps": self.steps,
                "finetune": self.finetune,
            }
        return {
            "weights": {
                k: v.detach().cpu().clone() for k, v in self.model.state_dict().items() if k in trainable
            },
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "steps": self.steps,
            "finetune": self.finetune,
        }

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """Raise ``ValueError`` if ``state`` (``state_dict``) cannot load into this learner."""
        if state["finetune"] != self.finetune:
            raise ValueError(
                f"checkpoint trained {state['finetune']!r} parameters, this learner {self.finetune!r}"
            )
        missing = set(state["weights"]) - set(self.model.state_dict())
        if missing:
            raise ValueError(f"checkpoint has weights this model lacks: {sorted(missing)[:5]}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a ``state_dict``. With FSDP every rank calls it at once; rank 0's weights and optimizer state
        are broadcast and each rank keeps its shard (the other ranks' ``weights`` and ``optimizer`` may be
        empty)."""
        self.check_state_dict(state)
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
            first = self._first_rank  # (the setters replace the values of the dicts they are given)
            set_model_state_dict(self.model, dict(state["weights"]) if first else {}, options=options)
            if state["steps"]:
                names = self._trainable_names()
                optimizer = optimizer_state_by_name(state["optimizer"], names) if first else {}
                set_optimizer_state_dict(self.model, self.optimizer, optimizer, options=options)
            else:  # no moments yet, only hyper-parameters: every rank has them (DCP would take a step first)
                self.optimizer.load_state_dict(state["optimizer"])
        else:
            self.model.load_state_dict(state["weights"], strict=False)
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = int(state["steps"])

    @property
    def _first_rank(self) -> bool:
        return self.group is None or self.group.rank == 0

    def _trainable_names(self) -> list[str]:
        """The names of ``self.params``, in their order (the optimizer's parameter indices)."""
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    def _full_weights(self) -> dict[str, torch.Tensor]:
        """FSDP: the model's full state dict on rank 0's CPU (a collective: every rank calls it); ``{}`` on
        the other ranks."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        weights = get_model_state_dict(self.model, options=_full_state_options())
        return {k: v for k, v in weights.items() if isinstance(v, torch.Tensor)}

    def close(self) -> None:
        """Release what the learner holds besides its own weights: nothing on one rank
        (``streamrl.algorithms.distributed.DistributedLearner`` stops its other ranks)."""


def _full_state_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def optimizer_state_by_index(state: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A full optimizer state keyed by parameter name (``torch.distributed.checkpoint``'s form) in
    ``Optimizer.state_dict``'s form, keyed by the index of each parameter in ``names`` (the optimizer's
    order): a checkpoint's optimizer state is the same whether one rank or FSDP ranks saved it."""
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: dict(values) for name, values in state["state"].items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]} for group in state["param_groups"]
        ],
    }


def optimizer_state_by_name(state: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The inverse of ``optimizer_state_by_index``."""
    return {
        "state": {names[i]: dict(values) for i, values in state["state"].items()},
        "param_groups": [
            {**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]
        ],
    }
