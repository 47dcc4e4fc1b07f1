"""Publication: the learner's policy becomes the one the rollout backend serves, checked.

``Publisher.publish(version)`` saves the policy (a LoRA adapter, or full weights) with its probe file to
``policy/v<version>.tmp`` and renames it into place, loads it into the backend (``serve``), scores the probe
through the backend and compares with the learner's log-probs (``streamrl.agents.probe.check_probe``). Only a
policy that passed is counted as published: the caller advances the tracker's clock afterwards. Old versions
beyond ``keep_versions`` are deleted, except the one the last checkpoint serves (a resume loads it again).

How a backend takes a policy: an adapter through ``set_adapter(path, version)``; full weights through its own
``set_weights(path, version)`` when it has one (engines in other processes, ``RayEngines``, load the files
themselves), else into its in-process ``.model`` (``HFBackend``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from typing import Any

from streamrl.agents.probe import check_probe, write_adapter_probe
from streamrl.algorithms.run_dir import RunDir


class PublishError(RuntimeError):
    """The backend did not serve the policy the learner published."""


class Publisher:
    """Save -> load -> probe for every backend (module doc)."""

    def __init__(
        self,
        run: RunDir,
        learner: Any,
        backend: Any,
        probe: Sequence[int],
        *,
        keep_versions: int,
    ) -> None:
        """``learner``: saves the policy (``save_policy``), scores the probe (``token_logprobs``) and says how
        it fine-tunes (``finetune``: ``"lora"`` or ``"full"``) and where (``device``). ``probe``: the token
        sequence on which the served and the learner's log-probs must agree."""
        self.run = run
        self.learner = learner
        self.backend = backend
        self.probe = list(probe)
        self.keep_versions = keep_versions
        self.checkpointed = 0
        """The version the last checkpoint serves: kept on disk whatever ``keep_versions`` says."""

    @property
    def tolerance(self) -> float:
        """Largest |served - learner| probe log-prob accepted: float32 CPU arithmetic agrees closely, GPU
        kernels (other reduction orders, TF32) less."""
        return 1e-3 if self.learner.device.type == "cpu" else 5e-2

    def publish(self, version: int) -> None:
        """Save the learner's policy as ``version``, serve it and check what the backend serves; raises
        ``PublishError`` when the backend does not serve it."""
        final = self.run.policy(version)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.learner.save_policy(tmp)
        expected = self.learner.token_logprobs(self.probe)
        write_adapter_probe(tmp, self.probe, expected)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        self.serve(version)
        served = self.backend.score([self.probe], [1])[0]
        mismatch = check_probe(served, expected, atol=self.tolerance, measure="max")
        if mismatch is not None:
            raise PublishError(
                f"after publishing v{version} the backend serves log-probs {mismatch.worst:.3g} away from the "
                f"learner's on the probe (tolerance {self.tolerance}): it is not serving the published policy"
            )

    def serve(self, version: int) -> None:
        """Load published ``version`` (``policy/v<version>``) into the backend."""
        policy_dir = self.run.policy(version)
        if not policy_dir.is_dir():
            published = (
                sorted(p.name for p in self.run.policies.glob("v*")) if self.run.policies.is_dir() else []
            )
            raise PublishError(
                f"policy version v{version} is missing: no {policy_dir} (on disk: {published})"
            )
        if self.learner.finetune == "lora":
            self.backend.set_adapter(str(policy_dir), version)
            return
        set_weights = getattr(self.backend, "set_weights", None)
        if callable(set_weights):  # the backend loads the files itself (engines in other processes)
            set_weights(str(policy_dir), version)
            return
        from streamrl.agents.hf_backend import load_weights

        try:
            load_weights(self.backend.model, policy_dir)
        except ValueError as exc:
            raise PublishError(str(exc)) from exc
        self.backend.set_adapter(None, version)

    def prune(self, version: int) -> None:
        """Delete the versions ``keep_versions`` or more behind ``version``, but not the checkpointed one."""
        for old in sorted(self.run.policies.glob("v*")):
            number = old.name[1:]
            if (
                number.isdigit()
                and int(number) <= version - self.keep_versions
                and int(number) != self.checkpointed
            ):
                shutil.rmtree(old, ignore_errors=True)
