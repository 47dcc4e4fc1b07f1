"""streamrl.envs."""
