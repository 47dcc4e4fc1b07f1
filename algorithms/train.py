"""``streamrl train``: the single-stream trainer that runs every algorithm (SPO, SPO++, GRPO, SAO, yours).

One loop, in the order the data flows::

    dispatch   the tracker samples tasks (prioritized for SPO/SPO++), freezes baselines on tickets; admission
               keeps dispatched - dropped <= (max_staleness + k + 1) * B * P at version k (AReaL's rule);
               ``dispatch="trainable"``: no more than the batch rule can still train at version k, and freed
               slots are refilled as soon as their episodes finish
    roll out   Rollouts: episodes on the streaming vector env, their turns batched through the backend
    file       the algorithm files outcomes in the tracker when episodes return (SPO++) or after the update (SPO)
    batch      the algorithm's batch rule forms an update batch of B episodes; before a publication, episodes
               that would exceed max_staleness are trained first and in-flight ones are waited for
    learn      advantages -> Learner.update (micro-batched, global token count) -> publish every P updates
    publish    save the policy (adapter or weights) + probe, load it into the backend, check the served
               log-probs on the probe against the learner's, then advance the tracker's clock

Generation and learning alternate with the in-process HF backend (one process, and the CPU is shared); with
a backend in another process (vLLM) generation goes on while the learner updates (``overlap``).

The trainer is the loop; each job beside it is an object with one job, built in ``_build``:

    TrainConfig.validate    (``train_config``)  refuses a config that cannot run, before any work
    make_learner, make_backend, env_workers
                            (``placement``)     where the learner, the rollout engines and the env workers run
    BatchStrategy, EpisodeBuffer (``batching``) the algorithm's batch rule: what is trained, drained, waited for
    Ledger                  (``ledger``)        every dispatched trajectory and generated token accounted for
    Publisher               (``publish``)       save -> load -> probe check of every published version
    SideRollouts            (``side_rollouts``) offline values and held-out evaluations, on kept rollout sessions
    Checkpoints             (``checkpoint``)    a complete checkpoint whenever the process dies; resume
    TrainingLog             (``run_log``)       metrics.jsonl, TensorBoard, the progress bar
    RunDir                  (``run_dir``)       where each file of the run lies

``resume=True`` continues a killed run from its last complete checkpoint: every ticket that was in flight is
played again, finished-but-untrained episodes are kept.
"""

from __future__ import annotations

import functools
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from streamrl.agents.base import GenerationBackend, SamplingParams, derive_seed
from streamrl.algorithms.base import Algorithm, Episode, SetupContext
from streamrl.algorithms.batching import EpisodeBuffer
from streamrl.algorithms.checkpoint import Checkpoints
from streamrl.algorithms.ledger import Ledger
from streamrl.algorithms.placement import make_backend, make_learner
from streamrl.algorithms.publish import Publisher, PublishError
from streamrl.algorithms.run_dir import RunDir
from streamrl.algorithms.run_log import TrainingLog
from streamrl.algorithms.runtime import Finished, Job, Rollouts
from streamrl.algorithms.side_rollouts import SideRollouts
from streamrl.algorithms.tracker import EventTracker, Ticket
from streamrl.algorithms.train_config import (
    PLACEMENT,
    ConfigError,
    TrainConfig,
    initial_model_dir,
    resolve_algorithm,
    sft_recipe,
)

__all__ = [
    "PLACEMENT",
    "ConfigError",
    "Ledger",
    "PublishError",
    "TrainConfig",
    "Trainer",
    "initial_model_dir",
    "sft_recipe",
    "train",
]

# ---------------------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------------------


class Trainer:
    """Builds everything a ``TrainConfig`` names and runs it (``Trainer(config).run()``)."""

    def __init__(
        self,
        config: TrainConfig,
        *,
        algorithm: Algorithm | None = None,
        backend: GenerationBackend | None = None,
        on_update: Callable[[int, Sequence[Episode]], None] | None = None,
        resume: bool = False,
        log: Callable[[str], None] = print,
        progress: bool = True,
    ) -> None:
        """``backend``: serve rollouts with this backend (e.g. ``streamrl.agents.latency.LatencyBackend``)
        instead of the one ``config.backend`` names; it must serve the model's tokenizer and accept the
        published policy (``set_adapter``, ``score``, and ``.model`` for fully fine-tuned weights). The trainer
        closes it. ``on_update(version, batch)``: called before each update with the policy version the update
        starts from and the episodes it trains (tests, benchmarks, custom logging)."""
        self.log = log
        self.show_progress = progress
        self._given_backend = backend
        self.on_update = on_update
        self.algorithm = resolve_algorithm(config, algorithm)
        self.config = config
        self.run_dir = Path(config.out)
        self.files = RunDir(self.run_dir)
        config.validate(self.algorithm, resume=resume)
        torch.set_num_threads(config.threads)
        self._stop = threading.Event()
        self._resumed = False
        self.checkpoints = Checkpoints(self.files)
        try:
            self._build()
            checkpoint = self.checkpoints.last() if resume else None
            if checkpoint is not None:
                self._load_checkpoint(checkpoint)
                self._resumed = True
            elif resume:  # killed before its first checkpoint: it starts over
                self.files.truncate_metrics(-1)
        except BaseException:
            self.close()  # what was built before the error: learner ranks, engines, env workers, Ray
            raise

    # -- construction ----------------------------------------------------------------------------------------
    def _build(self) -> None:
        from streamrl.agents.env_specs import env_spec
        from streamrl.agents.models import load_model, load_tokenizer

        c = self.config
        self.spec = env_spec(c.env)
        self.model_dir = initial_model_dir(c.model, c.init, c.env, log=self.log, sft=c.sft)
        self.tokenizer = load_tokenizer(self.model_dir)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(c.seed, "learner"))
            policy = load_model(self.model_dir)
        self._ray_connected = False
        if c.cluster == "ray":  # before the learner: its ranks may be Ray actors
            from streamrl.utils.ray import connect

            self._ray_connected = connect(c.address)  # and so this trainer disconnects at close()
        self.learner = make_learner(c, policy, self.model_dir, int(self.tokenizer.pad_token_id))
        if c.average_last and self.learner.finetune == "lora":  # finetune="auto" chose LoRA for this model
            raise ConfigError(
                f"average_last={c.average_last} averages full weights, and finetune={c.learner.finetune!r} "
                f"trains {c.model} with LoRA (adapters do not average): use finetune='full' or average_last=0"
            )
        context = SetupContext(
            model_dir=self.model_dir,
            device=self.learner.device,
            pad_token_id=int(self.tokenizer.pad_token_id),
            tokenizer=self.tokenizer,
            micro_batch_tokens=c.learner.micro_batch_tokens,
            seed=derive_seed(c.seed, "algorithm"),
            log=self.log,
        )
        try:
            self.algorithm.setup(context)
        except ValueError as exc:  # e.g. SAO's critic_init does not fit the starting model
            raise ConfigError(f"{self.algorithm.name}: {exc}") from exc
        self.rule = self.algorithm.batch_rule
        self.backend = self._given_backend if self._given_backend is not None else self._make_backend()
        max_new = c.max_new_tokens or self.spec.max_new_tokens
        self.sampling = SamplingParams(
            temperature=c.temperature, max_new_tokens=max_new, seed=derive_seed(c.seed, "sampling")
        )
        self.agent = self.spec.llm_agent(
            self.backend,
            self.sampling,
            constrain_actions=c.constrain_actions,
            avoid_repeats=c.avoid_repeats,
            tokenizer=self.tokenizer,
        )

        self.side = SideRollouts(
            c,
            self.spec,
            backend=self.backend,
            sampling=self.sampling,
            tokenizer=self.tokenizer,
            files=self.files,
            progress=self.show_progress,
            log=self.log,
        )
        try:
            task_ids = self.side.session("train").task_ids
        except TypeError as exc:
            raise ConfigError(f"env_kwargs={dict(c.env_kwargs)} do not fit the {c.env} env: {exc}") from exc
        if c.tasks is not None:
            if c.tasks < 1 or c.tasks > len(task_ids):
                raise ConfigError(
                    f"tasks={c.tasks} must be in [1, {len(task_ids)}] (the {c.env} training tasks)"
                )
            task_ids = task_ids[: c.tasks]
        if self.rule.one_per_task and c.batch > len(task_ids):
            raise ConfigError(
                f"batch={c.batch} is larger than the task set ({len(task_ids)} tasks): with one request in flight "
                "per task a batch could never fill; lower batch or raise tasks"
            )
        self.task_ids = task_ids
        self.tracker = EventTracker(
            task_ids,
            self.algorithm.tracker_config(derive_seed(c.seed, "tracker")),
            strata=self._strata(task_ids) if c.balance_by is not None else None,
        )
        self.venv = self.side.session("train").venv
        lockstep = c.max_staleness == 0
        self.rollouts = Rollouts(
            self.venv, self.agent, seed=derive_seed(c.seed, "rollouts"), lockstep=lockstep
        )
        self.overlap = c.overlap if c.overlap is not None else (c.backend == "vllm" or c.cluster == "ray")
        self.eval_tasks = self.side.eval_tasks
        # state
        self.updates = 0
        self.ledger = Ledger()
        self.pending = EpisodeBuffer(self.rule, self.algorithm.keep_group)
        self.queued: list[Job] = []  # tickets to (re)start before sampling new ones (resume)
        self.training = 0  # episodes of the batch taken and not yet trained (dispatch="trainable")
        self.generator_busy = 0.0
        self.learner_busy = 0.0
        self.started = time.perf_counter()
        self._slots_at_row = (self.started, 0.0)  # (time, occupied slot-seconds) at the previous row
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.probe = self._probe_sequence()
        self.publisher = Publisher(
            self.files, self.learner, self.backend, self.probe, keep_versions=c.keep_versions
        )

    def _make_backend(self) -> Any:
        """The rollout backend of ``config`` (a subclass may serve another)."""
        return make_backend(self.config, self.model_dir, self.tokenizer)

    def _probe_sequence(self) -> list[int]:
        """A fixed token sequence on which the served and the learner's log-probs must agree after publication."""
        prompt = self.agent.chat.render([{"role": "user", "content": "What is 6 times 7? Use the tool."}])
        tail = self.tokenizer.encode(" The answer is \\boxed{42}.", add_special_tokens=False)
        return list(prompt) + list(tail)

    # -- the loop -----------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train for ``config.updates`` updates (from where a resumed run left off); returns a summary."""
        c = self.config
        self.files.write_config(c.to_dict())
        previous_handlers = self._install_signals()
        log = TrainingLog(
            self.files,
            total=c.updates,
            initial=self.updates,
            desc=f"{self.algorithm.name} {c.env}",
            progress=self.show_progress,
        )
        try:
            if not self._resumed:
                if c.offline_rollouts and self.tracker.config.mode != "bookkeeping":
                    self.tracker.init_offline(self.side.offline_values(self.model_dir, self.task_ids))
                if self.eval_tasks:
                    log.write({"update": 0, **self.side.evaluate(self.updates, self.tracker.version)})
            pool = ThreadPoolExecutor(1) if self.overlap else None
            while self.updates < c.updates and not self._stop.is_set():
                batch = self._next_batch()
                if batch is None:
                    break
                row = self._train_on(batch, pool)
                if (
                    c.eval_every
                    and self.eval_tasks
                    and (self.updates % c.eval_every == 0 or self.updates == c.updates)
                ):
                    final = self.updates == c.updates
                    row.update(self.side.evaluate(self.updates, self.tracker.version, final=final))
                log.write(row)
                if c.checkpoint_every and self.updates % c.checkpoint_every == 0:
                    self._save_checkpoint()
            self._save_checkpoint()
            if c.average_last and self.updates >= c.updates:
                self._write_average()
        finally:
            for sig, handler in previous_handlers.items():  # a finished run no longer owns Ctrl-C
                signal.signal(sig, handler)
            log.close()
            self.close()
        return {"updates": self.updates, "run_dir": str(self.run_dir), "interrupted": self._stop.is_set()}

    def _write_average(self) -> None:
        """The run's averaged policy (``TrainConfig.average_last``): the mean of its last K published versions
        (all of them when it published fewer), written to ``policy/average`` once the last update is done (again,
        identically, when a finished run is resumed)."""
        from streamrl.algorithms.averaging import AVERAGE_DIR, average_policies

        versions = self.files.policy_versions()[-self.config.average_last :]
        if not versions:  # e.g. one update of an algorithm that publishes every second
            self.log(
                f"average_last={self.config.average_last}: the run published no version; no average written"
            )
            return
        average_policies(self.run_dir, versions, self.files.policies / AVERAGE_DIR)

    def close(self) -> None:
        """Release the env workers, the backend, the learner (and its ranks) and a Ray connection this trainer
        made; also what a build that failed part-way had started."""
        side = getattr(self, "side", None)
        if side is not None:  # the sessions' env workers (the training ones too)
            side.close()
        for name in ("venv", "backend", "learner"):
            part = getattr(self, name, None)
            if part is not None:
                part.close()
        if getattr(self, "_ray_connected", False):
            import ray

            ray.shutdown()

    @property
    def buffer(self) -> list[Episode]:
        """Finished episodes waiting for a batch (not those of open groups)."""
        return self.pending.episodes

    # -- dispatch and rollout ----------------------------------------------------------------------------------
    def _strata(self, task_ids: Sequence[str]) -> dict[str, str]:
        """Each training task's value of ``config.balance_by`` (``RolloutSession.task_attributes``);
        ``ConfigError`` naming the attributes every task has when a task lacks it."""
        c = self.config
        attrs = self.side.session("train").task_attributes
        missing = [t for t in task_ids if c.balance_by not in attrs.get(t, {})]
        if missing:
            common = set.intersection(*(set(attrs.get(t, {})) for t in task_ids))
            raise ConfigError(
                f"balance_by={c.balance_by!r} is not an attribute of every {c.env} training task "
                f"({len(missing)} of {len(task_ids)} lack it, e.g. {missing[0]!r}); valid: "
                f"{sorted(common) or 'none (this env labels no tasks)'}"
            )
        return {t: attrs[t][c.balance_by] for t in task_ids}

    def _capacity(self) -> int:
        """How many more trajectories admission allows now (AReaL's rule, in trajectories); with
        ``dispatch="trainable"`` also no more than the batch rule can still train at the current version."""
        c = self.config
        every = self.algorithm.config.publish_every
        dropped = self.ledger.dropped_stale + self.ledger.dropped_group + self.ledger.failed
        allowed = (c.max_staleness + self.tracker.version + 1) * c.batch * every + dropped
        room = allowed - self.ledger.dispatched
        if c.dispatch == "trainable":
            # still to train before the next publication, less the batch taken for the update under way
            left = (every - self.updates % every) * c.batch - self.training
            in_flight = [*self.rollouts.running, *self.queued]
            trainable = self.rule.trainable_room(left, self.pending.episodes, in_flight, self.tracker.version)
            if trainable is not None:
                room = min(room, trainable)
        return room

    def _dispatch(self) -> None:
        free = self.rollouts.free_slots
        if self.queued:  # requeued tickets (resume) first
            again, self.queued = self.queued[:free], self.queued[free:]
            self.rollouts.start(again)
            free -= len(again)
        g = self.rule.group_size
        room = min(free, self._capacity())
        room -= room % g
        if room <= 0:
            return
        busy = {t.task_id for t in self.tracker.in_flight} if self.rule.one_per_task else set()
        candidates = [t for t in self.task_ids if t not in busy]
        jobs: list[Job] = []
        for task in self.tracker.sample(room // g, candidates=candidates, strict=False):
            group = self.pending.new_group() if g > 1 else None
            for _ in range(g):
                ticket = self.tracker.dispatch(task)
                jobs.append(Job(task, ticket.dispatch_index, ticket, group))
        self.ledger.dispatched += len(jobs)
        if jobs:
            self.rollouts.start(jobs)

    def _poll(self, timeout: float | None) -> None:
        before = self.rollouts.generated_tokens
        refill = self._refill if self.config.dispatch == "trainable" else None
        finished = self.rollouts.poll(timeout=timeout, on_finished=refill)
        self.ledger.generated_tokens += self.rollouts.generated_tokens - before
        self._receive_finished(finished)

    def _refill(self, finished: Sequence[Finished]) -> None:
        """``dispatch="trainable"``: file the episodes that just finished and start what may be started in
        their slots before the backend generates for the others (``Rollouts.poll``'s ``on_finished``)."""
        self._receive_finished(finished)
        self._dispatch()

    def _receive_finished(self, finished: Sequence[Finished]) -> None:
        for item in finished:
            self._receive(Episode(item.trajectory, item.job.ticket, item.job.group))

    def _receive(self, episode: Episode) -> None:
        """File a returned episode: failed (cancelled), stale (filed, dropped) or waiting for a batch."""
        self.ledger.finished += 1
        if episode.failed:
            self.tracker.cancel(episode.ticket)
            self.ledger.failed += 1
            self.ledger.failed_tokens += episode.num_action_tokens
            self.ledger.drop(self.pending.fail(episode), "group")
            return
        self.algorithm.on_complete(self.tracker, episode)
        if not self.rule.admits(episode, self.tracker.version):
            self.ledger.drop([episode], "stale")
            return
        self.ledger.drop(self.pending.add(episode), "group")

    def _next_batch(self) -> list[Episode] | None:
        """Roll out until the batch rule forms a batch; before a publication, the episodes that would exceed
        max_staleness are in it and in-flight work that would is waited for."""
        publishing = (self.updates + 1) % self.algorithm.config.publish_every == 0
        limit = self.tracker.version - self.config.max_staleness
        while not self._stop.is_set():
            in_flight = [*self.rollouts.running, *self.queued]
            if not self.rule.must_wait(publishing, in_flight, limit):
                batch = self.pending.take(self.config.batch, publishing=publishing, limit=limit)
                if batch is not None:
                    if self.config.max_staleness == 0:
                        batch.sort(key=lambda e: e.ticket.dispatch_index)  # arrival order is not reproducible
                    self.training = len(batch)
                    if self.config.dispatch == "trainable" and not publishing:
                        self._dispatch()  # the slots this batch freed start their next episodes meanwhile
                    return batch
            self._dispatch()
            if not self.rollouts.running:
                raise RuntimeError(
                    f"no episode in flight and no batch ready ({len(self.buffer)} buffered, capacity "
                    f"{self._capacity()}): the batch rule cannot fill a batch of {self.config.batch}"
                )
            started = time.perf_counter()
            self._poll(timeout=None)
            self.generator_busy += time.perf_counter() - started
        return None

    # -- learning and publication ---------------------------------------------------------------------------------
    def _train_on(self, batch: list[Episode], pool: ThreadPoolExecutor | None) -> dict[str, Any]:
        version = self.tracker.version
        staleness = Counter(version - e.min_version for e in batch)
        if self.on_update is not None:
            self.on_update(version, batch)
        started = time.perf_counter()
        trains_policy = self.algorithm.train_policy(self.updates)  # False: e.g. SAO's critic-only warm-up
        advantages = self.algorithm.advantages(batch) if trains_policy else []
        if not trains_policy:
            metrics: dict[str, float] = {}
        elif pool is None:
            metrics = self.learner.update(batch, advantages, self.algorithm)
        else:  # keep generating (at the old version) while the learner works
            future = pool.submit(self.learner.update, batch, advantages, self.algorithm)
            while not future.done():
                self._dispatch()
                if self.rollouts.running:
                    self._poll(timeout=0.05)
                else:
                    time.sleep(0.01)
            metrics = future.result()
        metrics["policy_trained"] = float(trains_policy)
        metrics.update(self.algorithm.after_update(self.tracker, batch, self.learner))
        self.updates += 1
        self.training = 0
        self.ledger.trained += len(batch)
        self.ledger.trained_tokens += sum(e.num_action_tokens for e in batch)
        published = None
        if self.updates % self.algorithm.config.publish_every == 0:
            published = self._publish()
        self.learner_busy += time.perf_counter() - started
        return self._row(batch, metrics, staleness, published)

    def _publish(self) -> int:
        """Publish the next version (save, serve, check: ``Publisher``), then advance the tracker's clock; the
        batch rule drains what the new version makes untrainable."""
        version = self.tracker.version + 1
        self.publisher.publish(version)
        self.tracker.publish()
        self.ledger.drop(self.pending.drain(self.tracker.version), "stale")
        self.publisher.prune(version)
        return version

    # -- metrics ----------------------------------------------------------------------------------------------------
    def _row(
        self,
        batch: Sequence[Episode],
        metrics: Mapping[str, float],
        staleness: Counter[int],
        published: int | None,
    ) -> dict[str, Any]:
        trajs = [e.trajectory for e in batch]
        elapsed = time.perf_counter() - self.started
        turns = [len(t.turns) for t in trajs]
        invalid = sum(sum(1 for turn in t.turns if turn.action_valid is False) for t in trajs)
        row: dict[str, Any] = {
            "update": self.updates,
            "version": self.tracker.version,
            "published": published,
            "batch/success": sum(t.won for t in trajs) / len(trajs),
            "batch/reward": sum(t.reward for t in trajs) / len(trajs),
            "batch/turns": sum(turns) / len(turns),
            "batch/action_tokens": sum(t.num_action_tokens for t in trajs) / len(trajs),
            "batch/tool_calls": sum(sum(turn.tool_calls for turn in t.turns) for t in trajs) / len(trajs),
            "batch/invalid_action_rate": invalid / max(1, sum(turns)),
            "staleness": {str(k): v for k, v in sorted(staleness.items())},
            "batch/task_ids": [e.task_id for e in batch],
            "batch/dispatch_indices": [e.ticket.dispatch_index for e in batch],
            **{f"learner/{k}": v for k, v in metrics.items()},
            "time/elapsed_s": elapsed,
            "time/generator_busy_s": self.generator_busy,
            "time/learner_busy_s": self.learner_busy,
            "time/generation_s": self.rollouts.generation_seconds,
            "throughput/trajectories_per_s": self.ledger.trained / elapsed,
            "throughput/action_tokens_per_s": self.rollouts.generated_tokens / elapsed,
            **self._slot_utilization(),
        }
        row.update(self._ledger_row())
        # HFBackend's prefix cache counters; other backends have none
        stats = getattr(self.backend, "cache_stats", None)
        if callable(stats):
            row.update({f"generation/{k}": v for k, v in stats().items()})
        return row

    def _slot_utilization(self) -> dict[str, float]:
        """Occupied rollout slot-seconds so far, and the fraction of the slots that held a running episode
        since the previous row (the generator's utilization; learner and evaluation time included)."""
        now, occupied = time.perf_counter(), self.rollouts.occupied_slot_seconds()
        then, before = self._slots_at_row
        self._slots_at_row = (now, occupied)
        window = self.config.num_envs * (now - then)
        return {
            "time/rollout_slot_s": occupied,
            "throughput/slot_utilization": (occupied - before) / window if window > 0 else 0.0,
        }

    def _ledger_row(self) -> dict[str, int]:
        buffered = self.pending.waiting()
        return self.ledger.row(
            buffered=len(buffered),
            buffered_tokens=sum(e.num_action_tokens for e in buffered),
            in_flight=len(self.rollouts.running) + len(self.queued),
            in_flight_tokens=self.rollouts.running_tokens(),
        )

    # -- checkpoints -------------------------------------------------------------------------------------------
    def _install_signals(self) -> dict[int, Any]:
        """SIGINT/SIGTERM stop the run after the current step (and checkpoint); returns the handlers replaced."""
        if threading.current_thread() is not threading.main_thread():
            return {}

        def stop(signum: int, frame: Any) -> None:
            self.log(f"signal {signum}: checkpointing after the current step")
            self._stop.set()

        previous: dict[int, Any] = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.getsignal(sig)
            signal.signal(sig, stop)
        return previous

    def _save_checkpoint(self) -> None:
        """Checkpoint everything a resume needs (``Checkpoints.save`` makes it complete or absent)."""
        in_flight = [job for job in self.queued] + self.rollouts.running
        state = {
            "updates": self.updates,
            "start": self._start_identity,
            "tracker": self.tracker.state_dict(),
            "ledger": {
                **asdict(self.ledger),
                "generated_tokens": self.ledger.generated_tokens - self.rollouts.running_tokens(),
            },
            **self.pending.state_dict(),
            "in_flight": [
                {"task_id": j.task_id, "key": j.key, "ticket": asdict(j.ticket), "group": j.group}
                for j in in_flight
            ],
            "time": {"generator_busy": self.generator_busy, "learner_busy": self.learner_busy},
            "backend_version": self.tracker.version,
        }
        tensors = {
            "learner": self.learner.state_dict(),
            "algorithm": self.algorithm.state_dict(),
            "torch_rng": torch.get_rng_state(),
        }
        self.checkpoints.save(tensors, state)
        self.publisher.checkpointed = self.tracker.version

    @functools.cached_property
    def _start_identity(self) -> dict[str, str]:
        """The starting model a checkpoint belongs to: its directory's name (an SFT checkpoint's name holds its
        recipe's key) and a fingerprint of its weights (read once: the start does not change during a run)."""
        from streamrl.agents.models import weights_fingerprint

        return {"model_dir": self.model_dir.name, "weights": weights_fingerprint(self.model_dir)}

    def _load_checkpoint(self, path: Path) -> None:
        state = self.checkpoints.read_state(path)
        started = state.get("start")  # absent in checkpoints written before the check
        now = self._start_identity
        if started is not None and started != now:
            if started["model_dir"] != now["model_dir"]:
                what = f"its config now resolves to {now['model_dir']} (the env's SFT preset changed?)"
            else:
                what = f"the weights of {now['model_dir']} changed ({started['weights']} -> {now['weights']})"
            raise ConfigError(
                f"cannot resume {self.run_dir}: it started from {started['model_dir']}, but {what}; resume it "
                "from the model it started from (for an SFT start, sft= the overrides of its recipe), or start "
                "a new run"
            )
        tensors = self.checkpoints.read_tensors(path)
        self.learner.load_state_dict(tensors["learner"])
        self.algorithm.load_state_dict(tensors["algorithm"])
        torch.set_rng_state(tensors["torch_rng"])
        self.tracker.load_state_dict(state["tracker"])
        self.updates = int(state["updates"])
        self.ledger = Ledger(**state["ledger"])
        self.pending.load_state_dict(state)
        self.queued = [
            Job(j["task_id"], j["key"], Ticket(**j["ticket"]), j["group"]) for j in state["in_flight"]
        ]
        self.generator_busy = state["time"]["generator_busy"]
        self.learner_busy = state["time"]["learner_busy"]
        self.files.truncate_metrics(self.updates)
        version = int(state["backend_version"])
        self.publisher.checkpointed = version
        if version > 0:  # serve the published policy of the checkpointed version, not the learner's weights
            self.publisher.serve(version)
        self.log(
            f"resumed {self.run_dir} at update {self.updates} (version {version}, from {path.name}/), "
            f"{len(self.queued)} tickets requeued, {len(self.buffer)} episodes buffered"
        )


def train(
    config: TrainConfig,
    *,
    algorithm: Algorithm | None = None,
    backend: GenerationBackend | None = None,
    resume: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Run ``config`` to completion (or resume it) and return the trainer's summary (``backend``: see
    ``Trainer``)."""
    trainer = Trainer(config, algorithm=algorithm, backend=backend, resume=resume, progress=progress)
    return trainer.run()
