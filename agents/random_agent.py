"""A random-text agent for smoke tests: it exercises an env's whole action path (parsing, invalid actions,
turn limits) with no model at all. Seeded per episode, so a run is reproducible."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from streamrl.agents.base import EpisodeId

_WORDS = (
    "go", "to", "take", "from", "put", "open", "close", "look", "the", "a", "fridge", "apple", "1", "2",
    "print", "(", ")", "+", "*", "=", "x", "answer", "\\boxed{4}", "```python", "```", "\n",
)  # fmt: skip


class RandomTextAgent:
    """Emits ``min_words``..``max_words`` words drawn from a small vocabulary of env-ish tokens.

    ``admissible_prob``: with this probability, and when ``info["admissible_commands"]`` is present, the
    action is a uniformly random admissible command instead (a "random valid action" baseline).
    Keeps no token record (``end_episode`` returns ``None``).
    """

    def __init__(
        self, seed: int = 0, min_words: int = 1, max_words: int = 8, admissible_prob: float = 0.0
    ) -> None:
        if not 1 <= min_words <= max_words:
            raise ValueError(f"need 1 <= min_words <= max_words, got {min_words}, {max_words}")
        if not 0.0 <= admissible_prob <= 1.0:
            raise ValueError(f"admissible_prob must be in [0, 1], got {admissible_prob}")
        self.seed, self.min_words, self.max_words = seed, min_words, max_words
        self.admissible_prob = admissible_prob
        self._rngs: dict[EpisodeId, random.Random] = {}
        self._started = 0

    def act(
        self,
        observations: Sequence[str],
        infos: Sequence[Mapping[str, Any]],
        episode_ids: Sequence[EpisodeId],
    ) -> list[str]:
        actions = []
        for info, eid in zip(infos, episode_ids, strict=True):
            rng = self._rngs.get(eid)
            if rng is None:  # episode k of this agent draws from seed + k
                rng = self._rngs[eid] = random.Random(self.seed + self._started)
                self._started += 1
            commands = info.get("admissible_commands") or []
            if commands and rng.random() < self.admissible_prob:
                actions.append(str(rng.choice(list(commands))))
            else:
                n = rng.randint(self.min_words, self.max_words)
                actions.append(" ".join(rng.choice(_WORDS) for _ in range(n)))
        return actions

    def end_episode(self, episode_id: EpisodeId) -> None:
        self._rngs.pop(episode_id, None)
        return None
