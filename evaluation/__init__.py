"""streamrl.evaluation."""
