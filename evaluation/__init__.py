"""streamrl.evaluation: what was achieved — the evaluation harness, learning-curve metrics and run
comparisons with their reports (the ``streamrl`` command line that runs them is ``streamrl.cli``; the statistics they
report are ``streamrl.utils.stats``)."""
