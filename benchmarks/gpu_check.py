"""GPU check of the training path: bf16 learner updates with LoRA, then a vLLM rollout with the published adapter.

    python benchmarks/gpu_check.py                  # on a CUDA machine; without one it says so and exits 0
    python benchmarks/gpu_check.py --device cpu     # the same checks on the CPU (fp32): a dry run of the script

For when a GPU machine is at hand (CI has none). What it does and records:

1. **Learner.** Plays ``--episodes`` Math-TIR training episodes with ``HFBackend`` on the device through the
   runtime (``bench_learner.play_batch``), then runs ``--updates`` SPO++ updates with LoRA
   (``LearnerConfig(finetune="lora")``; on CUDA the learner computes under bf16 autocast with fp32 weights).
   Checks: every loss finite; the layers computed in bf16 on CUDA (a forward hook reads the dtype of the first
   LoRA layer's output during the update); the PPO ratio is 1 before the first optimizer step (``ppo_kl`` of
   update 1 ~ 0: the old log-probs are recomputed with the training forward's code and precision); the adapter
   moved. Records tokens/s, seconds and peak GPU memory per update.
2. **Publish**, as the trainer does: ``Learner.save_policy`` (peft adapter) and ``write_adapter_probe`` with
   the learner's fp32 log-probs on a fixed probe.
3. **vLLM.** ``VLLMBackend`` on the base model, ``set_adapter(published, 1)`` (its own check: the served probe
   log-probs must match the probe file, else ``AdapterMismatchError``), then one Math-TIR episode through the
   runtime. Checks: every generated token carries version 1; the served probe is within the trainer's publish
   tolerance of the learner's (max |diff| <= 5e-2 on CUDA, 1e-3 on CPU, as ``Publisher.publish``), and the
   base model served instead would have failed that (else the check proves nothing: at bf16 the backend's own
   check resolves only ~0.2 nats/token, which is why ``--lr`` is high). Records the rollout's log-probs
   against the learner's on the same tokens (trainer/inference mismatch). Skipped, with a note, where vLLM is
   not installed.

Exit status 0 when every check passed or there is no GPU; 1 when a check failed. Writes
``benchmarks/results/gpu/gpu_check.json`` (``gpu_check_cpu.json`` for ``--device cpu``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
PUBLISH_TOLERANCE = {"cuda": 5e-2, "cpu": 1e-3}
"""Max |served - learner| probe log-prob the trainer accepts after a publish (``Publisher.tolerance``)."""


def learner_part(
    args: argparse.Namespace, device: str, workdir: Path, report: dict[str, Any]
) -> tuple[Any, list[int], list[float]]:
    """Learner updates and the published adapter (module doc, 1 and 2): the learner, probe ids, expected."""
    from bench_learner import alternating_advantages, batch_shape, play_batch
    from streamrl.agents.hf_backend import HFBackend, HFBackendConfig
    from streamrl.agents.logprobs import token_logprobs
    from streamrl.agents.models import load_model, resolve_model
    from streamrl.agents.probe import probe_token_ids, write_adapter_probe
    from streamrl.algorithms.base import make_algorithm
    from streamrl.algorithms.learner import Learner, LearnerConfig

    model_dir = resolve_model(args.model)
    backend = HFBackend(model_dir, config=HFBackendConfig(device=device, seed=0))
    started = time.perf_counter()
    episodes = play_batch(backend, args.episodes)
    report["batch"] = {**batch_shape(episodes), "generation_s": round(time.perf_counter() - started, 1)}
    report["batch"]["rollout_dtype"] = str(backend.dtype).removeprefix("torch.")
    pad = int(backend.tokenizer.pad_token_id)
    backend.close()

    config = LearnerConfig(finetune="lora", lr=args.lr, device=device)
    learner = Learner(load_model(model_dir), config, pad_token_id=pad, total_steps=args.updates)
    seen: set[str] = set()
    lora_layer = next(m for n, m in learner.model.named_modules() if n.endswith("lora_A.default"))
    hook = lora_layer.register_forward_hook(lambda mod, inp, out: seen.add(str(out.dtype)))
    algorithm = make_algorithm("spo++")
    updates = []
    for _ in range(args.updates):
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        m = learner.update(episodes, alternating_advantages(episodes), algorithm)
        row = {k: m[k] for k in ("loss", "ppo_kl", "grad_norm", "learner_seconds", "learner_tokens_per_s")}
        if device == "cuda":
            row["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        updates.append(row)
        print(f"update {len(updates)}: {json.dumps(row)}", flush=True)
    hook.remove()
    lora_b = max(float(p.abs().max()) for n, p in learner.model.named_parameters() if "lora_B" in n)
    report["learner"] = {"finetune": learner.finetune, "lr": learner.lr, "updates": updates}
    report["learner"].update(lora_layer_output_dtypes=sorted(seen), lora_b_max_abs=lora_b)
    checks = report["checks"]
    checks["losses_finite"] = all(math.isfinite(u["loss"]) for u in updates)
    checks["ratio_one_before_first_step"] = abs(updates[0]["ppo_kl"]) < 1e-3
    checks["adapter_moved"] = lora_b > 0
    if device == "cuda":
        checks["learner_bf16_autocast"] = seen == {"torch.bfloat16"}

    policy = learner.save_policy(workdir / "v1")
    probe = probe_token_ids(int(learner.model.config.vocab_size), 64)
    ids = torch.tensor([probe], device=learner.device)
    with torch.no_grad():  # fp32, outside autocast, as the trainer's publish computes the expected values
        expected = token_logprobs(learner.model, ids, torch.ones_like(ids))[0].float().cpu().tolist()
        with learner.model.disable_adapter():
            base = token_logprobs(learner.model, ids, torch.ones_like(ids))[0].float().cpu().tolist()
    shift = sum(abs(a - b) for a, b in zip(expected, base, strict=True)) / len(base)
    report["learner"]["probe_shift_from_base_mean"] = shift
    write_adapter_probe(policy, probe, expected)
    report["published"] = str(policy)
    return learner, probe, expected


def vllm_part(
    args: argparse.Namespace,
    device: str,
    learner: Any,
    probe: list[int],
    expected: list[float],
    report: dict[str, Any],
) -> None:
    """One rollout on vLLM with the published adapter (module doc, 3)."""
    from bench_learner import play_batch
    from streamrl.agents.vllm_backend import VLLMBackend, VLLMBackendConfig

    started = time.perf_counter()
    backend = VLLMBackend(args.model, config=VLLMBackendConfig(max_lora_rank=learner.config.lora_rank))
    out: dict[str, Any] = {"dtype": backend.dtype, "init_s": round(time.perf_counter() - started, 1)}
    report["vllm"] = out
    try:
        base = backend.score([probe], [1])[0]
        started = time.perf_counter()
        backend.set_adapter(report["published"], 1)
        out["set_adapter_s"] = round(time.perf_counter() - started, 2)
        served = backend.score([probe], [1])[0]
        started = time.perf_counter()
        (episode,) = play_batch(backend, 1)
        out["rollout_s"] = round(time.perf_counter() - started, 2)
    finally:
        backend.close()
    diffs = [abs(a - b) for a, b in zip(served, expected, strict=True)]
    moved = [abs(a - b) for a, b in zip(base, expected, strict=True)]
    traj = episode.trajectory
    versions = {v for s in traj.sequences for v, m in zip(s.token_versions, s.action_mask, strict=True) if m}
    rollout = torch.tensor(
        [lp for s in traj.sequences for lp, m in zip(s.rollout_logprobs, s.action_mask, strict=True) if m]
    )
    mine = learner.episode_logprobs([traj])[0]
    log_w = mine - rollout  # log pi_learner / pi_rollout on the same tokens
    out.update(
        probe_max_abs_diff=max(diffs),
        probe_mean_abs_diff=sum(diffs) / len(diffs),
        base_vs_learner_probe_max=max(moved),
        base_vs_learner_probe_mean=sum(moved) / len(moved),
        backend_check_atol=backend.adapter_atol,
        rollout_action_tokens=traj.num_action_tokens,
        rollout_versions=sorted(versions),
        rollout_vs_learner_mean_abs=float(log_w.abs().mean()),
        rollout_vs_learner_k3=float((torch.expm1(-log_w) + log_w).mean()),
    )
    report["checks"]["rollout_served_by_version_1"] = versions == {1}
    report["checks"]["probe_within_trainer_tolerance"] = max(diffs) <= PUBLISH_TOLERANCE[device]
    # the check means something only if serving the base model instead would have failed it
    report["checks"]["trainer_check_would_catch_base_model"] = max(moved) > PUBLISH_TOLERANCE[device]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--model", default="tiny", help="registry name or local HF directory")
    parser.add_argument("--episodes", type=int, default=16, help="episodes of the learner's batch")
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument(
        "--lr", type=float, default=1e-2, help="high enough for the adapter to move the probe"
    )
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.device == "auto" and not torch.cuda.is_available():
        print(
            f"gpu_check: no GPU present (torch {torch.__version__}: torch.cuda.is_available() is False); "
            "nothing checked. `--device cpu` runs the same checks on the CPU as a dry run."
        )
        return 0
    device = "cpu" if args.device == "cpu" else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: --device cuda but torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 2
    if device == "cpu":
        torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    out = args.out or HERE / "results" / "gpu" / (
        "gpu_check.json" if device == "cuda" else "gpu_check_cpu.json"
    )
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.machine()})",
        "torch": torch.__version__,
        "model": args.model,
        "checks": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        learner, probe, expected = learner_part(args, device, Path(tmp), report)
        try:
            import vllm  # noqa: F401
        except ImportError:
            report["vllm"] = "skipped: vLLM is not installed (`pip install vllm` on a CUDA machine)"
        else:
            if args.skip_vllm:
                report["vllm"] = "skipped: --skip-vllm"
            else:
                vllm_part(args, device, learner, probe, expected, report)
    failed = sorted(k for k, ok in report["checks"].items() if not ok)
    report["passed"] = not failed
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "learner"}, indent=2))
    print(f"gpu_check: {'all checks passed' if not failed else 'FAILED: ' + ', '.join(failed)}; wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":  # the vLLM engine's processes are spawned: keep the guard
    sys.exit(main())
