"""Finding a rule by what ``ALGORITHM`` says, and building it with ``RULE_ARGS``.

``ALGORITHM`` is a built-in's name (``lsgd``, ``easgd``, ...), ``path/to/rule.py:Class`` (a file
of yours, loaded under a private module name) or ``package.module:Class``. ``RULE_ARGS`` is
``name=value,name=value``: each value is converted to the type its constructor parameter is
annotated with (int, float, bool, str, or an optional of one); a name the constructor does not
take, or a value of the wrong type, is a ``RuleError`` naming it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import sys
import typing
from typing import Any

from .base import Rule, RuleError

_SPEC = re.compile(r"^(?P<where>[^:]+):(?P<cls>[A-Za-z_]\w*)$")
_FLAGS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}


def is_spec(algorithm: str) -> bool:
    """True when ``algorithm`` names a class (``...:Class``) rather than a built-in."""
    return ":" in algorithm


def load_rule(algorithm: str, builtins: dict[str, type[Rule]]) -> type[Rule]:
    """The rule class ``algorithm`` names. Raises RuleError with how to fix it."""
    if not is_spec(algorithm):
        if algorithm in builtins:
            return builtins[algorithm]
        raise RuleError(f"algorithm '{algorithm}' is unknown; choose one of: "
                        f"{', '.join(sorted(builtins))}, or your own: path/to/rule.py:Class "
                        "or package.module:Class")
    m = _SPEC.match(algorithm.strip())
    if m is None:
        raise RuleError(f"algorithm '{algorithm}' must be path/to/rule.py:Class or "
                        "package.module:Class")
    where, name = m["where"], m["cls"]
    module = _load_file(where) if where.endswith(".py") else _load_module(where)
    cls = getattr(module, name, None)
    if cls is None:
        raise RuleError(f"algorithm '{algorithm}': {where} has no class {name}")
    if not (inspect.isclass(cls) and issubclass(cls, Rule)):
        raise RuleError(f"algorithm '{algorithm}': {where}: {name} is not a subclass of "
                        f"lsgd.rules.Rule (write: class {name}(lsgd.rules.Rule))")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise RuleError(f"algorithm '{algorithm}': {name} does not implement {missing}")
    return cls


def _load_file(path: str) -> Any:
    if not os.path.isfile(path):
        raise RuleError(f"rule file '{path}' not found (relative paths start in the directory "
                        f"train.sh runs in: {os.getcwd()})")
    key = "lsgd_user_rule_" + re.sub(r"\W", "_", os.path.abspath(path))
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, path)
    if spec is None or spec.loader is None:
        raise RuleError(f"rule file '{path}' cannot be loaded as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[key]
        raise RuleError(f"rule file '{path}' failed to load: {type(exc).__name__}: {exc}") from None
    return module


def _load_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception as exc:
        raise RuleError(f"rule module '{name}' failed to import: {type(exc).__name__}: {exc}") from None


def parse_args(cls: type[Rule], text: str) -> dict[str, Any]:
    """``name=value,...`` as keyword arguments of ``cls``'s constructor, typed by its
    annotations. Raises RuleError naming a wrong name or value."""
    args: dict[str, Any] = {}
    if not text.strip():
        return args
    params = inspect.signature(cls.__init__).parameters
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - unresolvable annotations: take values as text
        hints = {}
    for part in text.split(","):
        if not part.strip():
            continue
        name, eq, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if not eq or not name.isidentifier():
            raise RuleError(f"rule_args: '{part.strip()}' must be name=value")
        if name not in params or name == "self" or params[name].kind in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            takes = [p for p in params if p != "self" and params[p].kind not in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
            raise RuleError(f"rule_args: {cls.__name__} takes no argument '{name}' "
                            f"(it takes: {', '.join(takes) or 'none'})")
        if name in args:
            raise RuleError(f"rule_args: '{name}' is given twice")
        args[name] = _convert(name, value, hints.get(name))
    return args


def _convert(name: str, value: str, kind: Any) -> Any:
    options = [t for t in typing.get_args(kind) if t is not type(None)] if typing.get_args(kind) else [kind]
    if type(None) in typing.get_args(kind) and value.lower() in ("", "none"):
        return None
    for t in options:
        try:
            if t is bool:
                return _FLAGS[value.lower()]
            if t in (int, float, str):
                return t(value)
        except (KeyError, ValueError):
            continue
    if kind is None or kind is Any or not any(t in (bool, int, float, str) for t in options):
        return value
    want = " or ".join(getattr(t, "__name__", str(t)) for t in options)
    raise RuleError(f"rule_args: {name} must be {want}, got '{value}'")


def check_rule(rule: Rule, num_groups: int, workers: int = 2) -> None:
    """What a rule says it does must be doable: its pulls name buffers the node has, with
    strengths in [0, 1]; caught at start (one line, exit 2) rather than in a worker mid-job."""
    from .base import RoundKind, RoundRoles

    buffers = set(rule.node_buffers)
    multi = num_groups > 1
    total = min(num_groups * workers, 64)  # every worker of the job (of a large one, 64)
    sample = [r for w in range(total) for r in (
        RoundRoles(w, (w + 1) % total, (w + 2) % total, multi), RoundRoles(w, w, w, multi),
        RoundRoles(w, None, None, multi))]
    for kind in (RoundKind.LOCAL, RoundKind.GLOBAL, RoundKind.FINAL):
        for roles in sample:
            try:
                pulls = list(rule.pulls(kind, roles))
            except Exception as exc:  # noqa: BLE001 - the user's code: say where it failed
                raise RuleError(f"rule {rule.name or type(rule).__name__}: pulls({kind.name}, ...) "
                                f"failed: {type(exc).__name__}: {exc}") from None
            for item in pulls:
                if not (isinstance(item, tuple) and len(item) == 2):
                    raise RuleError(f"rule {rule.name or type(rule).__name__}: pulls() must return "
                                    f"(buffer, strength) pairs, got {item!r}")
                name, strength = item
                if name not in buffers:
                    raise RuleError(f"rule {rule.name or type(rule).__name__}: pulls() names "
                                    f"'{name}', which this rule's node does not have "
                                    f"({', '.join(sorted(buffers))}; see node_buffers)")
                if not (isinstance(strength, (int, float)) and 0.0 <= strength <= 1.0):
                    raise RuleError(f"rule {rule.name or type(rule).__name__}: pull strength "
                                    f"{strength!r} toward {name} is not in [0, 1]")
