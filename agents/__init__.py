"""streamrl.agents."""
