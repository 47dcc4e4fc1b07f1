"""Command-line flags and config files from documented config dataclasses: one source of truth.

A config is a dataclass whose fields are typed and documented by an attribute docstring (the string right
under the field, as in ``SFTConfig``). ``add_dataclass_arguments`` turns each field into an argparse flag:

- the flag is ``--field-name``; its type comes from the annotation: ``int``, ``float``, ``str``, ``Path``,
  ``bool`` (``--flag`` / ``--no-flag``), ``Literal[...]`` (the literals are the choices), ``tuple[X, ...]``
  (one or more values), ``tuple[X, X]`` (exactly two), and ``X | None`` (the word ``none`` gives ``None``);
- its help is the field's docstring, read from the class source with ``ast`` (a Google-style
  ``Attributes:`` section of the class docstring is read too), followed by the field's default.

Flags are only set when given (their argparse default is ``SUPPRESS``; each class's flags are stored apart), so ``dataclass_from_args`` can lay
them over a base mapping -- a YAML file (``load_config_file``) or a preset -- and the dataclass's own defaults
fill the rest: ``config file < command line``. Keys that are not fields are an error that names the valid
ones; values are checked against the field types (YAML lists become tuples, mappings nested dataclasses).

    parser.add_argument("--config", type=Path)
    add_dataclass_arguments(parser, TrainConfig)
    args = parser.parse_args()
    config = dataclass_from_args(TrainConfig, args, load_config_file(args.config) if args.config else None)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

T = TypeVar("T")

_NONE_WORD = "none"


def field_docs(cls: type) -> dict[str, str]:
    """The documentation of each field of dataclass ``cls`` (and of its dataclass bases), whitespace
    collapsed: the attribute docstring under the field, else its entry in an ``Attributes:`` section of the
    class docstring; fields without either are left out."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        docs.update(_attributes_section(inspect.getdoc(klass) or ""))
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):  # defined where the source is not available (e.g. interactively)
            continue
        node = ast.parse(source).body[0]
        assert isinstance(node, ast.ClassDef)
        for stmt, following in zip(node.body, node.body[1:], strict=False):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(following.value.value.split())
    return docs


def _attributes_section(docstring: str) -> dict[str, str]:
    """``name: text`` entries of a Google-style ``Attributes:`` section (continuation lines indented)."""
    match = re.search(r"^Attributes:\n((?:[ \t]+.*\n?|\n)+)", docstring, re.MULTILINE)
    if match is None:
        return {}
    entries: dict[str, str] = {}
    name = None
    block = textwrap.dedent(match.group(1))
    for line in block.splitlines():
        head = re.match(r"^(\w+)(?: \([^)]*\))?: (.*)$", line)
        if head is not None:
            name = head.group(1)
            entries[name] = head.group(2)
        elif name is not None and line.strip():
            entries[name] += " " + line.strip()
    return {k: " ".join(v.split()) for k, v in entries.items()}


def _split_optional(tp: Any) -> tuple[Any, bool]:
    """``(X, True)`` for ``X | None`` / ``Optional[X]``, else ``(tp, False)``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _scalar_parser(tp: Any, where: str) -> tuple[Any, list[Any] | None]:
    """argparse ``type`` and ``choices`` of one value of type ``tp``."""
    if typing.get_origin(tp) is Literal:
        choices = list(typing.get_args(tp))
        kinds = {type(c) for c in choices}
        if len(kinds) != 1 or kinds.pop() not in (str, int, float):
            raise TypeError(
                f"{where}: a Literal flag needs literals of one type (str, int or float), got {tp}"
            )
        return type(choices[0]), choices
    if tp in (int, float, str, Path):
        return tp, None
    raise TypeError(
        f"{where}: type {tp!r} has no command-line form; leave the field out (exclude=) "
        "and set it in Python or a config file"
    )


def _none_or(parse: Any) -> Any:
    def convert(text: str) -> Any:
        return None if text.lower() == _NONE_WORD else parse(text)

    convert.__name__ = getattr(parse, "__name__", "value")  # argparse names the type in its errors
    return convert


def _default_text(field: dataclasses.Field[Any]) -> str | None:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return None
    if isinstance(value, tuple):
        return " ".join(str(v) for v in value) if value else "()"
    return _NONE_WORD if value is None else str(value)


def add_dataclass_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    include: Collection[str] | None = None,
    exclude: Collection[str] = (),
    default_help: str | None = None,
) -> None:
    """Add one ``--field-name`` flag per field of dataclass ``cls`` (those in ``include`` if given, minus
    ``exclude``), typed from the annotation and documented by the field's docstring (module doc).

    A flag is set in the parsed namespace only when given (``dataclass_from_args`` reads it). The help ends
    with ``default: <the field's default>``, or with ``default_help`` formatted with ``{default}`` when the
    caller fills unset fields from elsewhere (``"default: {default}, unless the preset sets it"``). A field
    whose type has no flag form raises ``TypeError``.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"add_dataclass_arguments needs a dataclass, got {cls!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted({*(include or ()), *exclude} - set(fields))
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {unknown}; fields: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for name, field in fields.items():
        if (include is not None and name not in include) or name in exclude or not field.init:
            continue
        where = f"{cls.__name__}.{name}"
        tp, optional = _split_optional(hints[name])
        kwargs: dict[str, Any] = {"dest": _dest(cls, name), "default": argparse.SUPPRESS}
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(tp) is tuple:
            args = typing.get_args(tp)
            if len(args) == 2 and args[1] is Ellipsis:
                kwargs["nargs"] = "+"
                item = args[0]
            elif args and all(a == args[0] for a in args):
                kwargs["nargs"] = len(args)
                item = args[0]
            else:
                raise TypeError(
                    f"{where}: only tuple[X, ...] and tuple[X, X, ...] have a flag form, got {tp}"
                )
            kwargs["type"], kwargs["choices"] = _scalar_parser(item, where)
            optional = False  # a tuple field is set from the command line, never to None
        else:
            kwargs["type"], kwargs["choices"] = _scalar_parser(tp, where)
            if optional:
                kwargs["type"] = _none_or(kwargs["type"])
                if kwargs["choices"] is not None:
                    kwargs["choices"] = [*kwargs["choices"], None]
        if kwargs.get("choices", ...) is None:
            del kwargs["choices"]
            kwargs["metavar"] = name.upper()
        help_text = docs.get(name, "")
        if optional and tp is not bool:
            help_text += f" ('{_NONE_WORD}': None)"
        default = _default_text(field)
        if default is None:
            note = "required"
        elif default_help is not None:
            note = default_help.format(default=default)
        else:
            note = f"default: {default}"
        help_text = f"{help_text} ({note})".strip()
        kwargs["help"] = help_text.replace("%", "%%")  # argparse formats help with %-style
        parser.add_argument("--" + name.replace("_", "-"), **kwargs)


def _dest(cls: type, name: str) -> str:
    """Where a field's flag is stored in the namespace: per class, so that two configs parsed by one parser
    never read each other's flags (``--envs`` of the run options is not ``SFTConfig.envs``)."""
    return f"{cls.__module__}.{cls.__qualname__}:{name}"


def given_arguments(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of dataclass ``cls`` set on the command line (flags of ``add_dataclass_arguments``)."""
    given = {f.name: getattr(args, _dest(cls, f.name), argparse.SUPPRESS) for f in dataclasses.fields(cls)}
    return {name: value for name, value in given.items() if value is not argparse.SUPPRESS}


def dataclass_from_args(cls: type[T], args: argparse.Namespace, base: Mapping[str, Any] | None = None) -> T:
    """``cls`` from ``base`` (e.g. a config file's mapping) with the command line's flags laid over it;
    fields in neither keep their defaults. Errors as in ``dataclass_from_dict``."""
    return dataclass_from_dict(cls, {**(base or {}), **given_arguments(cls, args)})


def dataclass_from_dict(cls: type[T], values: Mapping[str, Any], where: str | None = None) -> T:
    """``cls(**values)`` with every value checked against its field's type (lists become tuples, mappings
    nested dataclasses, ints floats where a float is expected).

    A key that is not a field raises ``ValueError`` naming it and the valid keys; a value of the wrong type
    raises ``TypeError`` naming the field, the expected type and the value. ``where`` names the source in
    errors (default: the class name).
    """
    where = where or cls.__name__
    if not isinstance(values, Mapping):
        raise TypeError(f"{where}: expected a mapping of field names to values, got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(str(k) for k in values if k not in fields)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {where}; valid keys: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    checked = {name: _coerce(value, hints[name], f"{where}.{name}") for name, value in values.items()}
    return cls(**checked)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """``value`` as type ``tp``, or a ``TypeError`` that says what was expected."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        for option in (a for a in typing.get_args(tp) if a is not type(None)):
            try:
                return _coerce(value, option, where)
            except TypeError:
                continue
        raise TypeError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in typing.get_args(tp) and not isinstance(value, bool):
            return value
        raise TypeError(f"{where}: expected one of {list(typing.get_args(tp))}, got {value!r}")
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, list | tuple):
            raise TypeError(f"{where}: expected a list ({_type_name(tp)}), got {value!r}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise TypeError(f"{where}: expected {len(args)} values ({_type_name(tp)}), got {value!r}")
        return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):
            return dataclass_from_dict(tp, value, where)
        raise TypeError(f"{where}: expected a mapping of {tp.__name__} fields, got {value!r}")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is Path and isinstance(value, str):
        return Path(value)
    if isinstance(tp, type) and isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    raise TypeError(f"{where}: expected {_type_name(tp)}, got {value!r}")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is None and isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "").replace("pathlib.", "")


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping at the top of YAML file ``path`` (an empty file gives ``{}``)."""
    text = Path(path).read_text()
    data = yaml.safe_load(text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of field names to values, got {data!r}")
    return data
