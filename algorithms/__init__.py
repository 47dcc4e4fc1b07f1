"""streamrl.algorithms."""
