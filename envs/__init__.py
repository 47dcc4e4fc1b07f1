"""streamrl.envs: Gymnasium text environments (ALFWorld, Math-TIR), the Python tool sandbox, task sets
and streaming vector wrappers.

Importing this package registers the environments with Gymnasium::

    import gymnasium as gym
    import streamrl.envs  # noqa: F401
    env = gym.make("streamrl/MathTIR-v0")

``gym.make("streamrl.envs:MathTIR-v0")`` works with no prior import: Gymnasium imports the module named
before the colon, then looks the bare id up, so the bare ids are registered as aliases too.

Your own env: subclass :class:`streamrl.envs.base.TextEnv` and register it with plain ``gym.register`` (no
streamrl registry is involved); ``examples/custom_env.py`` is a complete example.
"""

from __future__ import annotations

from gymnasium.envs.registration import register, registry

_ENVS = {
    "MathTIR-v0": "streamrl.envs.math_tir:MathTIREnv",
    "ALFWorld-v0": "streamrl.envs.alfworld:ALFWorldEnv",
    "Latency-v0": "streamrl.envs.latency:LatencyEnv",
}


def _register_all() -> None:
    for name, entry_point in _ENVS.items():
        for env_id in (f"streamrl/{name}", name):
            if env_id not in registry:
                # Episode limits live inside each env (max_turns / max_steps), so no TimeLimit wrapper.
                register(id=env_id, entry_point=entry_point, disable_env_checker=False)


_register_all()
