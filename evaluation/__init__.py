"""streamrl.evaluation: what was achieved — the evaluation harness, learning-curve metrics, reports and
the ``streamrl`` command line."""
