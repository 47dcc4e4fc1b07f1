"""Policy and value losses, importance weights, KL estimators and loss aggregation.

All per-token tensors are (B, T) and aligned with the action mask ``mask`` (1 = policy-generated token).
Losses are *minimized* (loss = -objective). Every loss returns its scalar together with the standard
diagnostics, computed over the mask tokens of that call and detached.

Sections (§), test oracles (T1-T13) and project decisions (D1-D18) cited below are those of
``docs/reference.md``: §1.1 PPO-clip + Dual-Clip (verl ``compute_policy_loss_vanilla``; Ye et al. 2020),
§1.2 aggregation (verl ``agg_loss``, TRL ``loss_type``), §1.3 KL estimators (Schulman; verl ``kl_penalty``),
§4.4 and §6 rollout importance weights (SPO++; verl ``rollout_is``; AReaL decoupled PPO), §5.1 SAO's DIS,
§5.2 clipped value loss (verl). The behaviour-cloning loss of the SFT cold start is ``streamrl.sft.loss``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal, get_args

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0
"""verl clamps log-ratios to [-20, 20] before ``exp``."""
K3_CLAMP = 10.0
"""verl clamps the k3 (low_var_kl) estimate to [-10, 10]."""

AggMode = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "dr-grpo"
]
KLKind = Literal["k1", "k2", "k3", "abs", "kl", "mse", "low_var_kl"]
ISMode = Literal["truncate", "mask"]
ISLevel = Literal["token", "sequence"]
DISForm = Literal["ratio", "logp"]

_AGG_MODES: tuple[str, ...] = get_args(AggMode)
_KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def _check_same_shape(mask: Tensor, **tensors: Tensor) -> None:
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D (B, T), got shape {tuple(mask.shape)}")
    for name, t in tensors.items():
        if t.shape != mask.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, expected the mask shape {tuple(mask.shape)}"
            )


def _token_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """Accept one scalar per trajectory (B,) or per-token advantages (B, T)."""
    if advantages.dim() == 1:
        if advantages.shape[0] != mask.shape[0]:
            raise ValueError(f"{advantages.shape[0]} advantages for {mask.shape[0]} trajectories")
        return advantages[:, None].expand(mask.shape)
    _check_same_shape(mask, advantages=advantages)
    return advantages


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over mask tokens (a diagnostic; 0 when the mask is empty)."""
    m = mask.to(x.dtype)
    return ((x * m).sum() / m.sum().clamp(min=1)).detach()


# ---------------------------------------------------------------------------------------------------------
# Aggregation (reference §1.2)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossAggregation:
    """How a per-token loss becomes a scalar: the mode and the counts it divides by (reference §1.2, oracle T12).

    ===========================  =============================================================
    ``token-mean``               sum m l / N_tok   (DAPO token-level; TRL ``bnpo``/``dapo``; SPO, SPO++)
    ``seq-mean-token-mean``      (1/B) sum_i [sum_t m l / sum_t m]   (original GRPO; TRL ``grpo``)
    ``seq-mean-token-sum``       (1/B) sum_i sum_t m l
    ``seq-mean-token-sum-norm``  sum m l / T_max   (verl's Dr. GRPO mode; no division by B)
    ``dr-grpo``                  sum m l / (B T_max)   (TRL ``loss_type="dr_grpo"``)
    ===========================  =============================================================

    Built once per update with :meth:`of_batch` from the *whole update batch's* mask, it carries N_tok, B and
    T_max to every micro-batch, so the micro-batch losses sum to the full-batch loss and no micro-batch can
    silently divide by its own token count (SPO++'s zero-mean guarantee needs the global count, decision D5).
    With no counts (``LossAggregation("token-mean")``) the local counts of each call are used -- verl's
    per-micro-batch behaviour, right only when the call sees the whole batch.
    """

    mode: AggMode = "token-mean"
    num_tokens: float | None = None
    """N_tok: mask tokens of the whole update batch (``token-mean``)."""
    num_sequences: int | None = None
    """B: sequences of the whole update batch (the ``seq-mean-*`` and ``dr-grpo`` modes)."""
    max_tokens: int | None = None
    """T_max: e.g. the max response length (``seq-mean-token-sum-norm``, ``dr-grpo``)."""

    def __post_init__(self) -> None:
        if self.mode not in _AGG_MODES:
            raise ValueError(f"unknown aggregation mode {self.mode!r}; valid: {', '.join(_AGG_MODES)}")
        if self.num_tokens is not None and self.num_tokens <= 0:
            raise ValueError(f"num_tokens must be > 0, got {self.num_tokens}")
        for name in ("num_sequences", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    @classmethod
    def of_batch(
        cls, mask: Tensor, mode: AggMode = "token-mean", *, max_tokens: int | None = None
    ) -> LossAggregation:
        """The counts of a whole update batch with loss mask ``mask`` (B, T); ``max_tokens`` defaults to T."""
        return cls(
            mode,
            num_tokens=max(float(mask.sum()), 1.0),
            num_sequences=int(mask.shape[0]),
            max_tokens=int(mask.shape[1]) if max_tokens is None else max_tokens,
        )


def aggregate_loss(token_loss: Tensor, mask: Tensor, agg: LossAggregation | None = None) -> Tensor:
    """Reduce a per-token loss (B, T) to a scalar over ``mask`` as ``agg`` says (default: local token-mean).

    A trajectory with no mask tokens contributes 0 to ``seq-mean-token-mean`` (it still counts in B).
    """
    _check_same_shape(mask, token_loss=token_loss)
    agg = agg or LossAggregation()
    m = mask.to(token_loss.dtype)
    masked = token_loss * m
    batch = agg.num_sequences if agg.num_sequences is not None else mask.shape[0]
    t_max = agg.max_tokens if agg.max_tokens is not None else mask.shape[1]
    if batch < 1 or t_max < 1:
        raise ValueError(f"num_sequences and max_tokens must be >= 1, got {batch} and {t_max}")
    if agg.mode == "token-mean":
        if agg.num_tokens is None:
            return masked.sum() / m.sum().clamp(min=1)
        return masked.sum() / agg.num_tokens
    if agg.mode == "seq-mean-token-mean":
        return (masked.sum(dim=-1) / m.sum(dim=-1).clamp(min=1)).sum() / batch
    if agg.mode == "seq-mean-token-sum":
        return masked.sum() / batch
    if agg.mode == "seq-mean-token-sum-norm":
        return masked.sum() / t_max
    return masked.sum() / (batch * t_max)  # dr-grpo


# ---------------------------------------------------------------------------------------------------------
# Diagnostics
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyLoss:
    """A policy loss to back-propagate, with its diagnostics (detached 0-d tensors, local to this call).

    - ``ppo_kl``: mean of (behaviour logp - logp) over mask tokens (verl ``ppo_kl``, k1).
    - ``approx_kl``: mean k3 estimate of KL(behaviour || current) (CleanRL's ``approx_kl``).
    - ``clip_frac_high`` / ``clip_frac_low``: tokens whose ratio was clipped (PPO: A > 0 above 1 + eps_high,
      A < 0 below 1 - eps_low) or rejected (DIS: r >= 1 + eps_h, r <= 1 - eps_l).
    - ``clip_frac_dual``: tokens whose loss the Dual-Clip bound capped (verl ``pg_clipfrac_lower``).
    - ``masked_frac``: mask tokens that contribute nothing (IS weight 0, DIS rejection).
    - ``entropy``: mean token entropy when logits were given.
    - ``num_tokens``: mask tokens in this call, to weight diagnostics across micro-batches.
    """

    loss: Tensor
    ppo_kl: Tensor
    approx_kl: Tensor
    clip_frac_high: Tensor
    clip_frac_low: Tensor
    clip_frac_dual: Tensor
    masked_frac: Tensor
    entropy: Tensor | None
    num_tokens: int

    @property
    def clip_frac(self) -> Tensor:
        """All clipped tokens (verl ``pg_clipfrac``)."""
        return self.clip_frac_high + self.clip_frac_low

    @classmethod
    def unclipped(cls, loss: Tensor, logp: Tensor, behaviour_logp: Tensor, mask: Tensor) -> PolicyLoss:
        """A loss that clips and masks no token (REINFORCE, a user's own objective): the KL diagnostics
        against ``behaviour_logp`` as for PPO, every clip and masked fraction 0."""
        _check_same_shape(mask, logp=logp, behaviour_logp=behaviour_logp)
        none = torch.zeros_like(mask, dtype=torch.bool)
        return _policy_diagnostics(logp, behaviour_logp, mask, loss, none, none, none, none, None)

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """Plain floats for logging (one host sync)."""
        out: dict[str, float] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[prefix + f.name] = float(value.detach()) if isinstance(value, Tensor) else float(value)
        out[prefix + "clip_frac"] = float(self.clip_frac)
        return out


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution at each position: logsumexp(z) - sum softmax(z) z."""
    log_probs = torch.log_softmax(logits, dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def _policy_diagnostics(
    logp: Tensor,
    behaviour_logp: Tensor,
    mask: Tensor,
    loss: Tensor,
    clipped_high: Tensor,
    clipped_low: Tensor,
    dual_clipped: Tensor,
    zero_weight: Tensor,
    logits: Tensor | None,
) -> PolicyLoss:
    neg_log_ratio = (behaviour_logp - logp).detach()
    k3 = torch.expm1(neg_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) - neg_log_ratio
    entropy = None
    if logits is not None:
        if logits.shape[:2] != mask.shape:
            raise ValueError(f"logits shape {tuple(logits.shape)} must be (B, T, V) with (B, T) = mask shape")
        with torch.no_grad():
            entropy = _masked_mean(entropy_from_logits(logits), mask)
    dtype = logp.dtype
    return PolicyLoss(
        loss=loss,
        ppo_kl=_masked_mean(neg_log_ratio, mask),
        approx_kl=_masked_mean(k3, mask),
        clip_frac_high=_masked_mean(clipped_high.to(dtype), mask),
        clip_frac_low=_masked_mean(clipped_low.to(dtype), mask),
        clip_frac_dual=_masked_mean(dual_clipped.to(dtype), mask),
        masked_frac=_masked_mean(zero_weight.to(dtype), mask),
        entropy=entropy,
        num_tokens=int(mask.sum()),
    )


# ---------------------------------------------------------------------------------------------------------
# PPO-clip with asymmetric bounds and Dual-Clip (reference §1.1, oracle T8)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PPOTokenTerms:
    """Per-token PPO terms (B, T): the loss and which bound acted on each token."""

    loss: Tensor
    ratio: Tensor
    clipped_high: Tensor
    clipped_low: Tensor
    dual_clipped: Tensor


def ppo_clip_token_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip_c: float | None = None,
) -> PPOTokenTerms:
    """Per-token PPO-clip loss with decoupled bounds and optional Dual-Clip (reference §1.1; verl
    ``compute_policy_loss_vanilla``; Ye et al. 2020 arXiv 1912.09729)::

        r      = exp(clamp(logp - old_logp, -20, 20))
        l_clip = max(-A r, -A clamp(r, 1 - eps_low, 1 + eps_high))
        l_dual = min(l_clip, -A c)                       # c > 1
        loss   = where(A < 0, l_dual, l_clip)            # Dual-Clip only acts on negative advantages

    Defaults eps_low 0.2 / eps_high 0.28 are DAPO's clip-higher (SPO, SPO++). Dual-Clip c: SPO 10, SPO++ 2,
    verl 3; ``None`` disables it. ``advantages`` broadcast against ``logp``.
    """
    if not (0 < eps_low < 1 and eps_high > 0):
        raise ValueError(f"need 0 < eps_low < 1 and eps_high > 0, got eps_low={eps_low}, eps_high={eps_high}")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (verl asserts this), got {dual_clip_c}")
    ratio = torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    l1 = -advantages * ratio
    l2 = -advantages * ratio.clamp(1 - eps_low, 1 + eps_high)
    l_clip = torch.maximum(l1, l2)
    clipped = (l2 > l1).detach()
    negative = advantages < 0
    if dual_clip_c is None:
        loss, dual_clipped = l_clip, torch.zeros_like(clipped)
    else:
        cap = -advantages * dual_clip_c
        loss = torch.where(negative, torch.minimum(l_clip, cap), l_clip)
        dual_clipped = (negative & (l_clip > cap)).detach()
    return PPOTokenTerms(
        loss=loss,
        ratio=ratio,
        clipped_high=clipped & ~negative,
        clipped_low=clipped & negative,
        dual_clipped=dual_clipped,
    )


def ppo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip_c: float | None = None,
    is_weights: Tensor | None = None,
    agg: LossAggregation | None = None,
    logits: Tensor | None = None,
) -> PolicyLoss:
    """PPO-clip policy loss (:func:`ppo_clip_token_loss`) aggregated over ``mask`` (:func:`aggregate_loss`).

    ``advantages``: (B,) trajectory scalars (SPO, SPO++, GRPO) or (B, T) token advantages (GAE).
    ``is_weights``: detached per-token factors multiplied into the loss, e.g. the SPO++ rollout correction
    min(exp(old_logp - rollout_logp), 2) from :func:`rollout_importance_weights`, or AReaL's behaviour
    weight with the PPO ratio taken against the proximal policy (reference §6, oracle T13). Tokens with weight 0
    stay in the token-mean denominator (AReaL); to drop them from it, aggregate over the IS mask instead.
    SPO: c=10; SPO++: c=2 plus IS truncated at 2; both token-mean.
    """
    _check_same_shape(mask, logp=logp, old_logp=old_logp)
    adv = _token_advantages(advantages, mask)
    terms = ppo_clip_token_loss(
        logp, old_logp, adv, eps_low=eps_low, eps_high=eps_high, dual_clip_c=dual_clip_c
    )
    token_loss = terms.loss
    zero_weight = torch.zeros_like(terms.clipped_high)
    if is_weights is not None:
        _check_same_shape(mask, is_weights=is_weights)
        token_loss = token_loss * is_weights.detach()
        zero_weight = is_weights.detach() == 0
    loss = aggregate_loss(token_loss, mask, agg)
    return _policy_diagnostics(
        logp,
        old_logp,
        mask,
        loss,
        terms.clipped_high,
        terms.clipped_low,
        terms.dual_clipped,
        zero_weight,
        logits,
    )


# ---------------------------------------------------------------------------------------------------------
# Rollout importance weights (reference §4.4, §6: SPO++; verl rollout_is; AReaL decoupled PPO)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutIS:
    """Detached importance weights (B, T) and the mask after rejection.

    In ``truncate`` mode ``mask`` is the input mask. In ``mask`` mode rejected tokens have weight 0 and are
    removed from ``mask``: aggregate over the returned mask to drop them from the denominator (verl), or over
    the input mask to keep them there (AReaL) (decision D17). SPO++: take L_i for Eq. 6 from the mask the
    loss uses (decision D4).
    """

    weights: Tensor
    mask: Tensor
    truncated_frac: Tensor
    rejected_frac: Tensor


def rollout_importance_weights(
    old_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    *,
    threshold: float = 2.0,
    mode: ISMode = "truncate",
    lower_threshold: float | None = None,
    level: ISLevel = "token",
) -> RolloutIS:
    """Correct for the trainer/inference mismatch with w = pi_old / pi_rollout (reference §4.4, §6).

    - ``truncate`` (SPO++: token level, threshold 2; verl's form, decision D6): w = min(w, threshold).
    - ``mask`` (verl mask mode; AReaL ``behav_imp_weight_cap``): tokens with w > threshold (or
      w < ``lower_threshold`` when given) are rejected: weight 0, removed from the returned mask.
    - ``level="sequence"``: one weight per trajectory, exp(sum_t m (old_logp - rollout_logp)), broadcast.

    ``old_logp`` is the trainer's recompute (AReaL: the proximal policy); ``rollout_logp`` the inference
    engine's log-probs. Log-ratios are clamped to [-20, 20] before ``exp`` (verl).
    """
    _check_same_shape(mask, old_logp=old_logp, rollout_logp=rollout_logp)
    if threshold <= 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    if lower_threshold is not None and not 0 <= lower_threshold < threshold:
        raise ValueError(f"lower_threshold must be in [0, threshold={threshold}), got {lower_threshold}")
    if mode not in get_args(ISMode):
        raise ValueError(f"mode must be one of {get_args(ISMode)}, got {mode!r}")
    if level not in get_args(ISLevel):
        raise ValueError(f"level must be one of {get_args(ISLevel)}, got {level!r}")
    m = mask.to(old_logp.dtype)
    with torch.no_grad():
        log_w = (old_logp - rollout_logp) * m
        if level == "sequence":
            log_w = log_w.sum(dim=-1, keepdim=True).expand_as(log_w)
        w = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        above = w > threshold
        if mode == "truncate":
            weights = w.clamp(max=threshold) * m
            out_mask = mask
            truncated, rejected = above, torch.zeros_like(above)
        else:
            rejected = above if lower_threshold is None else above | (w < lower_threshold)
            weights = w * m * (~rejected)
            out_mask = mask * (~rejected).to(mask.dtype)
            truncated = torch.zeros_like(above)
    return RolloutIS(
        weights=weights,
        mask=out_mask,
        truncated_frac=_masked_mean(truncated.to(m.dtype), mask),
        rejected_frac=_masked_mean(rejected.to(m.dtype), mask),
    )


# ---------------------------------------------------------------------------------------------------------
# SAO: direct double-sided importance sampling (reference §5.1, oracle T9)
# ---------------------------------------------------------------------------------------------------------


def dis_policy_loss(
    logp: Tensor,
    rollout_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.3,
    eps_high: float = 5.0,
    form: DISForm = "ratio",
    renormalize: bool = False,
    agg: LossAggregation | None = None,
    logits: Tensor | None = None,
) -> PolicyLoss:
    """SAO's DIS loss (SAO Eq. 1-3): maximize E_t[f(r_t) A_t log pi_theta], r_t = pi_theta / pi_rollout,
    f(x) = x on 1 - eps_l < x < 1 + eps_h (strict) and 0 outside. No pi_old, no PPO clip, sign-independent.

    Gradient-correct forms (decision D8), with the acceptance mask computed under no_grad in log space
    (log r > log(1 - eps_l) and log r < log(1 + eps_h)):

    - ``form="ratio"`` (default): loss_t = -mask_t r_t A_t, whose gradient is -mask_t A_t r_t grad log pi.
    - ``form="logp"``: loss_t = -(mask_t r_t A_t).detach() log pi_t: the same gradient.

    Rejected tokens get exactly zero gradient. Aggregation (decision D9): token-mean keeping rejected tokens in
    the denominator (more rejection = weaker update); ``renormalize=True`` averages over accepted tokens only.
    eps: math/TIR 0.3 / 5.0 (accept 0.7 < r < 6), SWE 0.8 / 3.0.
    """
    _check_same_shape(mask, logp=logp, rollout_logp=rollout_logp)
    if not 0 < eps_low <= 1 or eps_high <= 0:
        raise ValueError(
            f"need 0 < eps_low <= 1 and eps_high > 0, got eps_low={eps_low}, eps_high={eps_high}"
        )
    if form not in get_args(DISForm):
        raise ValueError(f"form must be one of {get_args(DISForm)}, got {form!r}")
    adv = _token_advantages(advantages, mask)
    log_ratio = logp - rollout_logp
    with torch.no_grad():
        lower = math.log(1 - eps_low) if eps_low < 1 else -math.inf
        too_low = log_ratio <= lower
        too_high = log_ratio >= math.log(1 + eps_high)
        accept = (~too_low & ~too_high).to(logp.dtype)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if form == "ratio":
        token_loss = -accept * ratio * adv
    else:
        token_loss = -(accept * ratio * adv).detach() * logp
    agg_mask = mask * accept.to(mask.dtype) if renormalize else mask
    loss = aggregate_loss(token_loss, agg_mask, agg)
    return _policy_diagnostics(
        logp,
        rollout_logp,
        mask,
        loss,
        too_high,
        too_low,
        torch.zeros_like(too_high),
        too_low | too_high,
        logits,
    )


# ---------------------------------------------------------------------------------------------------------
# KL estimators (reference §1.3, oracle T11)
# ---------------------------------------------------------------------------------------------------------


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: KLKind = "k3") -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta (Schulman; verl ``kl_penalty``).

    With l = logp - ref_logp: ``k1``/``kl`` = l (unbiased, can be negative); ``abs`` = |l|;
    ``k2``/``mse`` = l^2 / 2; ``k3``/``low_var_kl`` = exp(-l) - 1 + l (>= 0, unbiased, low variance; the
    GRPO paper's D_KL), with verl's clamps: inner log-ratio to [-20, 20], result to [-10, 10].
    Use as a loss term via ``beta * aggregate_loss(kl_penalty(...), mask)`` (GRPO beta 0.04, verl 0.001);
    SPO, SPO++ and SAO use none.
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} must match")
    name = _KL_ALIASES.get(kind, kind)
    diff = logp - ref_logp
    if name == "k1":
        return diff
    if name == "abs":
        return diff.abs()
    if name == "k2":
        return 0.5 * diff.square()
    if name == "k3":
        neg = (-diff).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (torch.exp(neg) - neg - 1).clamp(-K3_CLAMP, K3_CLAMP)
    raise ValueError(f"unknown KL estimator {kind!r}; valid: k1 (kl), k2 (mse), k3 (low_var_kl), abs")


# ---------------------------------------------------------------------------------------------------------
# Clipped value loss (verl; SAO's form is decision D12, reference §5.2)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ValueLoss:
    """Critic loss with diagnostics: fraction of tokens where the clipped branch was taken, explained
    variance of the returns by the values (1 = perfect, 0 = no better than the mean), mask tokens."""

    loss: Tensor
    clip_frac: Tensor
    explained_variance: Tensor
    num_tokens: int

    def metrics(self, prefix: str = "") -> dict[str, float]:
        return {
            prefix + "value_loss": float(self.loss.detach()),
            prefix + "value_clip_frac": float(self.clip_frac),
            prefix + "explained_variance": float(self.explained_variance),
            prefix + "num_tokens": float(self.num_tokens),
        }


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip_range: float | None = 0.5,
    agg: LossAggregation | None = None,
) -> ValueLoss:
    """verl's clipped value loss 1/2 agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)).

    SAO does not state its value loss; this is the project's choice, decision D12 (c = 0.5). ``clip_range=None``
    gives the plain 1/2 (V - R)^2. Only mask (action) tokens are trained, as SAO's skip-observation critic.
    """
    _check_same_shape(mask, values=values, old_values=old_values, returns=returns)
    returns = returns.detach()
    unclipped = (values - returns).square()
    if clip_range is None:
        token_loss, clipped = unclipped, torch.zeros_like(mask, dtype=torch.bool)
    else:
        if clip_range <= 0:
            raise ValueError(f"clip_range must be > 0 or None, got {clip_range}")
        v_clipped = old_values.detach() + (values - old_values.detach()).clamp(-clip_range, clip_range)
        clipped_sq = (v_clipped - returns).square()
        token_loss = torch.maximum(unclipped, clipped_sq)
        clipped = (clipped_sq > unclipped).detach()
    loss = 0.5 * aggregate_loss(token_loss, mask, agg)
    with torch.no_grad():
        m = mask.to(values.dtype)
        ret_mean = _masked_mean(returns, mask)
        var_ret = _masked_mean((returns - ret_mean).square(), mask)
        residual = returns - values.detach()
        var_res = _masked_mean((residual - _masked_mean(residual, mask)).square(), mask)
        explained = (
            1 - var_res / var_ret
            if float(var_ret) > 0
            else torch.full((), math.nan, dtype=m.dtype, device=m.device)
        )
    return ValueLoss(
        loss=loss,
        clip_frac=_masked_mean(clipped.to(values.dtype), mask),
        explained_variance=explained,
        num_tokens=int(mask.sum()),
    )
