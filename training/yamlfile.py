"""Reading a YAML config file and reporting its problems as one line (recipes and campaigns).

The recipe (:mod:`training.recipe`) and the campaign (:mod:`registry.campaign`) are both YAML
files validated by pydantic, and both promise errors of one line that name the file, the line or
field, and the fix. The shared pieces live here; each caller passes its own exception class and
wording:

- :func:`read_yaml`: a missing or unreadable file, one that is not UTF-8, a YAML syntax error
  (with its line and column) or a key written twice in a mapping → ``error_cls``.
- :func:`require_mapping`: top-level data that is not a mapping → ``error_cls``.
- :func:`format_validation_error`: a pydantic :class:`~pydantic.ValidationError` → one line of
  ``field.path: message`` parts (the first three, then ``(+N more)``).

This module imports yaml and pydantic only.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

__all__ = ["DuplicateKeyError", "StrictSafeLoader", "UnionTags", "error_location",
           "format_validation_error", "read_yaml", "require_mapping"]

# A discriminated union field's name → (its tag key, its tags), e.g.
# {"async": ("mode", ("sync", "one_step", "fully_async"))}.
UnionTags = Mapping[str, tuple[str, tuple[str, ...]]]

MAX_ERRORS = 3  # validation errors spelled out; the rest are counted as "(+N more)"


class DuplicateKeyError(yaml.YAMLError):
    """A key written twice in one YAML mapping (raised by :class:`StrictSafeLoader`).

    ``line`` and ``first_line`` are 1-based: the repeat and the first occurrence.
    """

    def __init__(self, key: Any, line: int, first_line: int) -> None:
        super().__init__(f"line {line}: key {key!r} appears twice in the same mapping "
                         f"(first at line {first_line})")
        self.key, self.line, self.first_line = key, line, first_line


_MERGE_TAG = "tag:yaml.org,2002:merge"


class StrictSafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that rejects a key written twice in one mapping (at any depth).

    Plain yaml keeps the last value silently, so a second ``lr:`` further down a section would
    quietly override the first. Only the keys written in the mapping are compared: those a
    ``<<`` merge brings in may be overridden, as YAML intends. Keys are compared as loaded, so
    ``1`` and ``0x1`` clash too. Everything else is ``SafeLoader``'s (safe tags only).
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}  # key → the 1-based line it was first written on
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=deep)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise DuplicateKeyError(key, line, seen[key])
                    seen[key] = line
                except TypeError:
                    continue  # unhashable: SafeLoader reports it ("found unhashable key")
        return super().construct_mapping(node, deep=deep)


def _where(mark: Any) -> str:
    """``"line L, column C"`` (1-based) for a yaml mark."""
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _yaml_problem(err: yaml.YAMLError, text: str) -> tuple[str, str]:
    """``(where, problem)`` for a yaml error: where it is (``"line L, column C"``; ``""`` when
    yaml says nothing) and what is wrong, on one line."""
    if isinstance(err, yaml.reader.ReaderError):  # a character YAML does not allow; no mark
        pos = err.position
        line = text.count("\n", 0, pos) + 1
        column = pos - (text.rfind("\n", 0, pos) + 1) + 1
        char = err.character
        what = (f"character U+{char:04X} is not allowed in YAML" if isinstance(char, int)
                else str(err.reason))
        return f"line {line}, column {column}", what
    problem = getattr(err, "problem", None)
    context = getattr(err, "context", None)
    mark = getattr(err, "problem_mark", None)
    context_mark = getattr(err, "context_mark", None)
    text_ = str(problem or context or err)
    if problem and context:
        at = ""  # where the context began, when the problem has its own, other, position
        if context_mark is not None and mark is not None and (
                (context_mark.line, context_mark.column) != (mark.line, mark.column)):
            at = f" at {_where(context_mark)}"
        if context.startswith("while "):  # "found ... while scanning a quoted scalar started at"
            text_ = f"{problem} {context}" + (f" started{at}" if at else "")
        else:  # "expected a single document in the stream at ..., but found another document"
            text_ = f"{context}{at}, {problem}"
    mark = mark if mark is not None else context_mark
    return (_where(mark) if mark is not None else ""), " ".join(text_.split())


def read_yaml(path: str | Path, what: str, fix: str, error_cls: type[Exception]) -> Any:
    """The parsed content of the YAML file ``path`` (``None`` for an empty file).

    Loads with :class:`StrictSafeLoader` (safe tags only; a repeated key is an error). Raises
    ``error_cls`` with one line (``N``, ``C`` 1-based):

    - ``"<what> file <path> does not exist; <fix>"`` when ``path`` is not a file;
    - ``"<path>: is not readable (permission denied); check its permissions"``, or
      ``"<path>: cannot be read (<reason>); check the file"`` for another OS error;
    - ``"<path>: line <N> is not UTF-8 text (byte 0x<hh> at offset <K>); save it as UTF-8"``;
    - ``"<path>: line <N>, column <C> is not valid YAML (<problem>); <fix>"`` on a syntax error
      (``"<path>: is not valid YAML (...)"`` when yaml gives no position), the fix being
      ``fix the syntax``, or ``remove it`` for a character YAML does not allow;
    - ``"<path>: line <N>: key '<k>' appears twice in the same mapping (first at line <M>);
      remove one"``;
    - ``"<path>: is nested too deeply to read as YAML; flatten it"``.
    """
    p = Path(path)
    try:
        raw = p.read_bytes() if p.is_file() else None
    except PermissionError:
        raise error_cls(f"{p}: is not readable (permission denied); check its permissions"
                        ) from None
    except OSError as err:
        reason = " ".join(str(err.strerror or err).split())
        raise error_cls(f"{p}: cannot be read ({reason}); check the file") from None
    if raw is None:
        raise error_cls(f"{what} file {p} does not exist; {fix}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise error_cls(f"{p}: line {line} is not UTF-8 text (byte 0x{raw[err.start]:02x} at "
                        f"offset {err.start}); save it as UTF-8") from None
    loader = None
    try:
        loader = StrictSafeLoader(text)  # checks every character: may raise ReaderError
        return loader.get_single_data()
    except DuplicateKeyError as err:
        raise error_cls(f"{p}: {err}; remove one") from None
    except yaml.YAMLError as err:
        where, problem = _yaml_problem(err, text)
        fix_it = "remove it" if isinstance(err, yaml.reader.ReaderError) else "fix the syntax"
        raise error_cls(f"{p}:{' ' + where if where else ''} is not valid YAML ({problem}); "
                        f"{fix_it}") from None
    except RecursionError:
        raise error_cls(f"{p}: is nested too deeply to read as YAML; flatten it") from None
    finally:
        if loader is not None:
            loader.dispose()


def require_mapping(data: Any, expected: str, error_cls: type[Exception]) -> Mapping[str, Any]:
    """``data`` if it is a mapping; else ``error_cls("<expected>, got <type name>")``.

    ``expected`` says what the top level should be, e.g. ``"c.yaml: a campaign is a mapping
    with name, base and stages"``.
    """
    if not isinstance(data, Mapping):
        raise error_cls(f"{expected}, got {type(data).__name__}")
    return data


def error_location(loc: tuple[Any, ...], unions: UnionTags | None = None) -> str:
    """A pydantic error location as the dotted path a user writes (``stages.0.name``).

    Pydantic's internal parts are dropped: ``function-after[...]`` validator wrappers, and the
    variant tag it inserts after a discriminated union field of ``unions``
    (``async.fully_async.x`` → ``async.x``).
    """
    unions = unions or {}
    parts: list[str] = []
    for p in (str(p) for p in loc):
        if p.startswith("function-after"):
            continue
        if parts and parts[-1] in unions and p in unions[parts[-1]][1]:
            continue  # the variant tag pydantic inserts after a union field
        parts.append(p)
    return ".".join(parts)


def format_validation_error(err: ValidationError, source: str, schema_hint: str,
                            unions: UnionTags | None = None) -> str:
    """One line ``"<source>: <loc>: <msg>; ... (+N more)"`` for a pydantic validation error.

    ``source`` names the file (or ``recipe``, ``base``, ...). Messages lose pydantic's
    ``"Value error, "`` prefix (validators' messages already say the fix); an unknown field
    reads ``"unknown field; remove it or check its spelling (<schema_hint>)"``. For a
    discriminated union of ``unions``, a bad tag reads ``value '<x>' does not match ...`` and a
    missing one ``missing `<key>`; add <key>: one of <tags>``. A cross-field error (empty
    location) is the message alone.
    """
    unions = unions or {}
    errors = err.errors()
    parts = []
    for e in errors[:MAX_ERRORS]:
        loc = error_location(e["loc"], unions)
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = f"unknown field; remove it or check its spelling ({schema_hint})"
        elif e["type"] == "union_tag_invalid":
            msg = msg.replace("Input tag", "value")
        elif e["type"] == "union_tag_not_found":
            field = loc.rsplit(".", 1)[-1]
            key, tags = unions.get(field, ("kind", ()))
            msg = f"missing `{key}`; add {key}: one of {', '.join(tags)}"
        parts.append(f"{loc}: {msg}" if loc else msg)  # cross-field errors name their fields
    more = len(errors) - MAX_ERRORS
    tail = f" (+{more} more)" if more > 0 else ""
    return f"{source}: " + "; ".join(parts) + tail
