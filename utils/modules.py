"""User code named on the command line: ``"package.module"`` or ``"path/to/file.py"``, the part before the colon of
``--algo file.py:Class`` and ``--env my_pkg.my_env:name``."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import cloudpickle

__all__ = ["import_user_module"]


def import_user_module(where: str) -> ModuleType:
    """The module ``where`` names: a dotted module path (``importlib.import_module``; an ``ImportError`` when it
    cannot be imported) or a ``.py`` file (a ``FileNotFoundError`` when there is none), run once per resolved path
    however often it is named, as ``streamrl_user_<stem>_<hash of the path>``.

    A file's module is also pickled by value (``cloudpickle.register_pickle_by_value``): subprocess and Ray
    workers cannot import it by that name, so the classes it defines (an env, an algorithm) travel whole.
    """
    if not where.endswith(".py"):
        return importlib.import_module(where)
    path = Path(where)
    if not path.is_file():
        raise FileNotFoundError(f"no file {where!r} (working directory: {Path.cwd()})")
    resolved = str(path.resolve())
    name = f"streamrl_user_{path.stem}_{hashlib.sha1(resolved.encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]  # a failed import is not cached: fixing the file and naming it again works
        raise
    cloudpickle.register_pickle_by_value(module)
    return module
