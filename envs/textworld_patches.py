"""Speed patches for TextWorld's PDDL engine (byte-identical transcripts; the speed-ups on ALFWorld rooms:
``docs/alfworld.md`` §4, ``benchmarks/results/envs/alfworld.json``) and a disk cache of the PDDL->SAS translation.

TextWorld 1.7's ``PddlEnv`` spends almost all of its time re-doing pure work:

1. TatSu-parsing the same grammar snippets for every admissible command at every step
   (``textgen._parse_and_convert``) -> memoized, a deep copy is returned because derivation mutates symbols;
2. parsing the same conjunctive queries (``Rule.parse_conjunctive_query``) -> memoized;
3. deep-copying derivation contexts whose values are never mutated in place (``textgen.copy_context``)
   -> the two dicts that *are* updated are copied shallowly;
4. translating PDDL->SAS with Fast Downward's Python translator twice per ``load`` and twice per
   ``reset`` (most of a stock reset) -> memoized in memory and on disk (zlib-compressed pickled
   ``(task, sas)`` under ``translation_cache_dir()``, keyed by the sha1 of the inputs and translator
   version);
5. ``EvalSymbol.derive`` relies on ``locals().update`` feeding ``eval``, which Python 3.13 (PEP 667) broke
   -> the variables are passed to ``eval`` explicitly (no change on 3.11/3.12);
6. sorting a signature's facts with Python-level ``Proposition.__lt__`` on every rule match
   (``State._all_applicable_assignments``) -> sorted once with an equivalent key and cached on the state
   until a fact of that signature is added or removed;
7. asking the planner library for the initial state (``get_state``) and parsing
   it into propositions on every reset (``PddlState.__init__``) -> memoized per SAS task, since the initial
   state after ``load_sas`` is a function of the SAS text; and translating the *optimized* SAS task, which
   only the planner uses (``replan``: ``policy_commands``, walkthroughs of official games), at every
   load -> done on the first ``replan`` of an episode instead (the planner searches from the current
   state, so the plans are the same; this halves the cost of a first load);
8. TatSu-parsing the whole game grammar (``alfred.twl2`` + task line) on every ``load``, also
   when an env switches back to a game it played before -> memoized by text (the parsed actions and
   production rules are only read: ``GameLogic`` copies them into its own containers and derivation
   deep-copies rules before use).

The translation wrapper also restores ``sys.argv``, which ``fast_downward.pddl2sas`` overwrites for good.
Where the time goes: ``docs/alfworld.md`` §4; measurements: ``benchmarks/results/envs/alfworld.json``. The
golden-transcript test in ``tests/envs/test_alfworld_env.py`` checks that transcripts are byte-identical with and
without the patches.

Usage::

    from streamrl.envs import textworld_patches
    textworld_patches.apply_patches()          # idempotent; done on import of streamrl.envs.alfworld
    with textworld_patches.unpatched():        # stock engine, e.g. for benchmarks and golden tests
        ...
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.metadata
import pickle
import sys
import zlib
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fast_downward
import textworld.envs.pddl.logic as _pddl_logic
import textworld.envs.pddl.textgen as _textgen
import textworld.logic as _tw_logic
from streamrl.utils.cache import atomic_write_bytes, cache_root
from textworld.utils import check_flag

__all__ = [
    "apply_patches",
    "patches_applied",
    "translation_cache_dir",
    "unpatched",
]

# Bump when the pickled format changes; part of every cache key, together with the translator version.
_CACHE_FORMAT = 1
_FD_VERSION = importlib.metadata.version("fast-downward-textworld")
# Games whose translation, initial state and parsed grammar stay in memory per process (LRU). 128 covers
# the training split; evicted games come back from the disk cache (the costs: docs/alfworld.md §4).
_MEMORY_CACHE_SIZE = 128

_ORIGINAL: dict[str, Any] = {
    "parse_and_convert": _textgen._parse_and_convert,
    "copy_context": _textgen.copy_context,
    "parse_conjunctive_query": _tw_logic.Rule.__dict__["parse_conjunctive_query"],
    "eval_derive": _textgen.EvalSymbol.derive,
    "pddl2sas": fast_downward.pddl2sas,
    "all_applicable_assignments": _tw_logic.State._all_applicable_assignments,
    "add_fact": _tw_logic.State.add_fact,
    "remove_fact": _tw_logic.State.remove_fact,
    "pddl_state_init": _pddl_logic.PddlState.__init__,
    "replan": _pddl_logic.PddlState.replan,
    "parse_game_logic": _pddl_logic._parse_and_convert,
}
_applied = False


def translation_cache_dir() -> Path:
    """Folder of the on-disk PDDL->SAS translation cache (``<cache root>/alfworld/sas``)."""
    return cache_root() / "alfworld" / "sas"


# -- patch 1: memoized grammar-snippet parsing --------------------------------------------------------
@functools.lru_cache(maxsize=8192)
def _parse_symbols_cached(text: str, rule_name: str) -> Any:
    return _ORIGINAL["parse_and_convert"](text, rule_name=rule_name)


def _parse_and_convert(text: str, rule_name: str = "symbols", **kwargs: Any) -> Any:
    if kwargs.get("trace"):  # TW_CSG_TRACE debugging wants TatSu's trace: parse for real
        return _ORIGINAL["parse_and_convert"](text, rule_name=rule_name, **kwargs)
    # Derivation assigns .context on the returned symbols, so every caller gets its own copy.
    return copy.deepcopy(_parse_symbols_cached(text, rule_name))


# -- patch 2: memoized conjunctive-query parsing --------------------------------------------------------
@functools.lru_cache(maxsize=8192)
def _parse_conjunctive_query_cached(cls: type, expr: str) -> Any:
    return _ORIGINAL["parse_conjunctive_query"].__func__(cls, expr)


def _parse_conjunctive_query(cls: type, expr: str) -> Any:
    return _parse_conjunctive_query_cached(cls, expr)


# -- patch 3: shallow context copies --------------------------------------------------------------------
def _copy_context(context: dict[str, Any]) -> dict[str, Any]:
    # Only "variables" and "mapping" are ever updated (textgen.query); their values are never mutated.
    return {
        "state": context["state"],
        "facts": context["facts"],
        "variables": dict(context["variables"]),
        "mapping": dict(context["mapping"]),
        "entity_infos": context["entity_infos"],
    }


# -- patch 5: eval without locals().update (PEP 667) ----------------------------------------------------
def _eval_derive(self: Any, context: dict[str, Any] | None = None) -> list[Any]:
    context = context or self.context
    return [_textgen.TerminalSymbol(eval(self.expression, {}, dict(context["variables"])))]


# -- patch 4: translation cache (memory + disk) ---------------------------------------------------------
def _translation_key(domain: str, problem: str, optimize: bool) -> str:
    h = hashlib.sha1()
    for part in (f"v{_CACHE_FORMAT}", _FD_VERSION, "opt" if optimize else "plain", domain, problem):
        h.update(part.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=_MEMORY_CACHE_SIZE)
def _translate_cached(domain: str, problem: str, optimize: bool) -> tuple[Any, str]:
    path = translation_cache_dir() / f"{_translation_key(domain, problem, optimize)}.pkl"
    try:
        # The cache is the user's own folder, written by this function only.
        task, sas = pickle.loads(zlib.decompress(path.read_bytes()))
        return task, sas
    except (OSError, EOFError, zlib.error, pickle.UnpicklingError, ValueError, AttributeError, ImportError):
        pass  # missing or unreadable (e.g. another translator version): translate and overwrite
    argv = sys.argv
    try:
        task, sas = _ORIGINAL["pddl2sas"](domain, problem, verbose=False, optimize=optimize)
    finally:
        sys.argv = argv  # pddl2sas sets sys.argv = ["translate.py", "domain", "task"] for good
    with contextlib.suppress(OSError):  # a read-only cache only costs speed
        # zlib level 1: SAS text compresses well at a small cost per load (docs/alfworld.md §4).
        atomic_write_bytes(
            path, zlib.compress(pickle.dumps((task, sas), protocol=pickle.HIGHEST_PROTOCOL), 1)
        )
    return task, sas


def _pddl2sas(domain: str, problem: str, verbose: bool = False, optimize: bool = False) -> tuple[Any, str]:
    if verbose:  # TW_PDDL_DEBUG wants the translator's log: translate for real
        argv = sys.argv
        try:
            return _ORIGINAL["pddl2sas"](domain, problem, verbose=True, optimize=optimize)
        finally:
            sys.argv = argv
    # The task object is shared between callers; PddlState only reads it.
    return _translate_cached(domain, problem, bool(optimize))


# -- patch 8: memoized game-grammar parsing -------------------------------------------------------------
@functools.lru_cache(maxsize=_MEMORY_CACHE_SIZE)
def _parse_game_logic_cached(text: str, rule_name: str) -> Any:
    return _ORIGINAL["parse_game_logic"](text, rule_name=rule_name)


def _parse_game_logic(text: str, rule_name: str = "pddlStart", **kwargs: Any) -> Any:
    if kwargs:
        return _ORIGINAL["parse_game_logic"](text, rule_name=rule_name, **kwargs)
    return _parse_game_logic_cached(text, rule_name)


# -- patch 6: sorted facts cached per state and signature ---------------------------------------------
def _proposition_key(prop: Any) -> tuple[str, tuple[tuple[str, str], ...]]:
    # Same order as Proposition.__lt__: (name, arguments), arguments by Variable.__lt__: (name, type).
    return prop.name, tuple((v.name, v.type) for v in prop.arguments)


def _sorted_facts(state: Any, signature: Any) -> list[Any]:
    cache = state.__dict__.setdefault("_streamrl_sorted_facts", {})
    facts = cache.get(signature)
    if facts is None:
        facts = cache[signature] = sorted(state.facts_with_signature(signature), key=_proposition_key)
    return facts  # type: ignore[no-any-return]


def _add_fact(self: Any, prop: Any) -> None:
    _ORIGINAL["add_fact"](self, prop)
    self.__dict__.get("_streamrl_sorted_facts", {}).pop(prop.signature, None)


def _remove_fact(self: Any, prop: Any) -> None:
    _ORIGINAL["remove_fact"](self, prop)
    self.__dict__.get("_streamrl_sorted_facts", {}).pop(prop.signature, None)


def _all_applicable_assignments(
    self: Any,
    rule: Any,
    mapping: dict[Any, Any],
    used_vars: set[Any],
    new_phs_by_depth: list[list[Any]],
    depth: int,
) -> Iterator[dict[Any, Any]]:
    # textworld.logic.State._all_applicable_assignments (MIT, Microsoft) with the sort cached (marked).
    new_phs = new_phs_by_depth[depth]
    if depth >= len(rule.preconditions):
        yield from self._all_assignments(new_phs, mapping, used_vars, False)
        return
    pred = rule.preconditions[depth]
    types = [self._logic.types.get(t) for t in pred.signature.types]
    for subtypes in self._logic.types.multi_subtypes(types):
        signature = _tw_logic.Signature(pred.signature.name, [t.name for t in subtypes])
        for prop in _sorted_facts(self, signature):  # was: sorted(self.facts_with_signature(signature))
            for ph, var in zip(pred.parameters, prop.arguments, strict=False):  # as the original
                existing = mapping.get(ph)
                if existing is None:
                    if var in used_vars:
                        break
                    mapping[ph] = var
                    used_vars.add(var)
                elif existing != var:
                    break
            else:
                yield from self._all_applicable_assignments(
                    rule, mapping, used_vars, new_phs_by_depth, depth + 1
                )
            for ph in new_phs:
                var = mapping.pop(ph, None)
                used_vars.discard(var)


# -- patch 7: memoized initial state per SAS task -------------------------------------------------------
_INITIAL_FACTS: OrderedDict[str, list[Any]] = OrderedDict()


def _pddl_state_init(self: Any, downward_lib: Any, pddl_problem: str, logic: Any) -> None:
    # textworld.envs.pddl.logic.PddlState.__init__ (MIT, Microsoft); the initial facts are memoized.
    self._facts = defaultdict(set)
    self._vars_by_name = {}
    self._vars_by_type = defaultdict(set)
    self._var_counts = Counter()
    self._logic = logic
    self.downward_lib = downward_lib
    self.pddl_problem = pddl_problem
    verbose = check_flag("TW_PDDL_DEBUG")
    self.task, self.sas = fast_downward.pddl2sas(logic.domain, pddl_problem, verbose=verbose)
    self.sas_replan = None  # translated and loaded by the first replan() (see _replan)
    self._actions = {a.name: a for a in self.task.actions}
    for type_ in self.task.types:
        with contextlib.suppress(ValueError):
            logic.types.add(_tw_logic.Type(type_.name, type_.supertype_names))
    self.downward_lib.load_sas(self.sas.encode("utf-8"))
    self.name2type = {o.name: o.type_name for o in self.task.objects}

    facts = _INITIAL_FACTS.get(self.sas)
    if facts is None:
        facts = _initial_facts(self)
        _INITIAL_FACTS[self.sas] = facts
        if len(_INITIAL_FACTS) > _MEMORY_CACHE_SIZE:
            _INITIAL_FACTS.popitem(last=False)
    else:
        _INITIAL_FACTS.move_to_end(self.sas)
    self.add_facts(facts)  # same facts in the same order as the original's two add_facts calls


def _replan(self: Any, infos: Any) -> list[str]:
    if self.sas_replan is None:
        verbose = check_flag("TW_PDDL_DEBUG")
        _, self.sas_replan = fast_downward.pddl2sas(
            self._logic.domain, self.pddl_problem, verbose=verbose, optimize=True
        )
        self.downward_lib.load_sas_replan(self.sas_replan.encode("utf-8"))
    return _ORIGINAL["replan"](self, infos)  # type: ignore[no-any-return]


def _initial_facts(self: Any) -> list[Any]:
    Proposition, Variable = _tw_logic.Proposition, _tw_logic.Variable

    def atom2proposition(atom: Any) -> Any:
        if isinstance(atom, fast_downward.translate.pddl.conditions.Atom):
            if atom.predicate == "=":
                return None
            return Proposition(atom.predicate, [Variable(arg, self.name2type[arg]) for arg in atom.args])
        if isinstance(atom, fast_downward.translate.pddl.f_expression.Assign):
            if atom.fluent.symbol == "total-cost":
                return None
            name = f"{atom.expression.value}"
            if str.isdigit(name):  # distance relations
                return None
            return Proposition(name, [Variable(arg, self.name2type[arg]) for arg in atom.fluent.args])
        return None

    facts = [f for f in map(atom2proposition, self.task.init) if f]
    atoms = (_pddl_logic.Atom * self.downward_lib.get_state_size())()
    self.downward_lib.get_state(atoms)
    state_facts = [atom.get_fact(self.name2type) for atom in atoms]
    return facts + [fact for fact in state_facts if not fact.is_negation]


_PATCHES: tuple[tuple[Any, str, str, Any], ...] = (
    # (owner, attribute, key in _ORIGINAL, replacement)
    (_textgen, "_parse_and_convert", "parse_and_convert", _parse_and_convert),
    (_textgen, "copy_context", "copy_context", _copy_context),
    (
        _tw_logic.Rule,
        "parse_conjunctive_query",
        "parse_conjunctive_query",
        classmethod(_parse_conjunctive_query),
    ),
    (_textgen.EvalSymbol, "derive", "eval_derive", _eval_derive),
    # textworld.envs.pddl.logic calls fast_downward.pddl2sas(...) through the package attribute.
    (fast_downward, "pddl2sas", "pddl2sas", _pddl2sas),
    (
        _tw_logic.State,
        "_all_applicable_assignments",
        "all_applicable_assignments",
        _all_applicable_assignments,
    ),
    (_tw_logic.State, "add_fact", "add_fact", _add_fact),
    (_tw_logic.State, "remove_fact", "remove_fact", _remove_fact),
    (_pddl_logic.PddlState, "__init__", "pddl_state_init", _pddl_state_init),
    (_pddl_logic.PddlState, "replan", "replan", _replan),
    (_pddl_logic, "_parse_and_convert", "parse_game_logic", _parse_game_logic),
)


def apply_patches() -> None:
    """Install the patches (idempotent)."""
    global _applied
    for owner, attr, _, replacement in _PATCHES:
        setattr(owner, attr, replacement)
    _applied = True


def _remove_patches() -> None:
    global _applied
    for owner, attr, key, _ in _PATCHES:
        setattr(owner, attr, _ORIGINAL[key])
    _applied = False


def patches_applied() -> bool:
    """Whether the patches are installed right now."""
    return _applied


@contextlib.contextmanager
def unpatched() -> Iterator[None]:
    """Run the stock TextWorld engine inside the block (for benchmarks and the golden-transcript test);
    the previous patch state is restored on exit. Not thread-safe (the engine never is)."""
    was_applied = _applied
    _remove_patches()
    try:
        yield
    finally:
        if was_applied:
            apply_patches()
