"""streamrl.utils: what every layer shares -- the on-disk cache with its locks and atomic writes
(``streamrl.utils.cache``), builds on reproducible CPU kernels (``streamrl.utils.reproducible``), the Ray
connection (``streamrl.utils.ray``) and the statistics of evaluation reports (``streamrl.utils.stats``). It imports nothing else of streamrl, so every layer may import it."""
