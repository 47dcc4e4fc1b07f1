"""streamrl.cli: the ``streamrl`` command line (``streamrl.cli.main``), its flags derived from the config
dataclasses (``streamrl.cli.args``), and ``streamrl demo``, the toolkit's main job end to end with a report
(``streamrl.cli.demo``). The top of the import order: it uses every other layer, and none uses it."""
