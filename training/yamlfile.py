"""Reading a YAML config file and reporting its problems as one line (recipes and campaigns).

The recipe (:mod:`training.recipe`) and the campaign (:mod:`registry.campaign`) are both YAML
files validated by pydantic, and both promise errors of one line that name the file, the line or
field, and the fix. The shared pieces live here; each caller passes its own exception class and
wording. What they guarantee, whatever the bytes of the file:

- :func:`read_yaml` returns plain data — mappings, lists, strings, integers, finite or infinite
  floats, ``true``/``false`` and ``null`` — or raises ``error_cls`` with one line. Every value is
  built inside that boundary, so no other exception escapes, and nothing is expanded: a file is at
  most :data:`MAX_FILE_BYTES`, nested at most :data:`MAX_DEPTH` levels, and anchors/aliases
  (``&a`` / ``*a``, the way to a billion-laughs bomb or a cycle) are refused with their line.
  Departures from YAML 1.1 (what ``yaml.safe_load`` does): booleans only from ``true``/``false``
  (``yes``, ``no``, ``on``, ``off`` stay strings), dates stay strings (``2024-13-45`` is text, not
  a crash), integers longer than :data:`MAX_INT_CHARS` characters and tags other than the plain
  ones (``!!python/...``, ``!!binary``, ``!!set``, ``!!timestamp``, ...) are refused, a key written
  twice in a mapping is an error (:class:`StrictSafeLoader`).
- :func:`plain_copy`: a deep copy of data that admits only those plain values (no JSON round
  trip): dates, sets, bytes, cycles, too deep or too large data → :class:`PlainDataError`.
- :func:`require_mapping`: top-level data that is not a mapping → ``error_cls``.
- :func:`format_validation_error`: a pydantic :class:`~pydantic.ValidationError` → one line of
  ``field.path: message`` parts (the first three, then ``(+N more)``), in the words of the YAML
  file, never pydantic's internal type names.
- :data:`YamlInt`, :data:`YamlFloat`, :data:`YamlBool`: field types that take a boolean only
  from ``true``/``false`` and never a boolean where a number goes.
- Every message passes through :func:`escape_controls`: control characters (newlines, terminal
  escapes, bidi overrides) of keys, values or paths are written as ``\\n``, ``\\x1b``, so an error
  is one line and never drives the terminal.

This module imports yaml and pydantic only.
"""

from __future__ import annotations

import codecs
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BeforeValidator, ValidationError

__all__ = ["MAX_DEPTH", "MAX_FILE_BYTES", "MAX_INT_CHARS", "AliasError", "DuplicateKeyError",
           "PlainDataError", "RefusedError", "StrictSafeLoader", "UnionTags", "YamlBool",
           "YamlFloat", "YamlInt", "YamlOptFloat", "YamlOptInt", "describe", "error_location",
           "escape_controls", "format_validation_error", "plain_copy", "read_yaml",
           "require_mapping", "short_repr"]

# A discriminated union field's name → (its tag key, its tags), e.g.
# {"async": ("mode", ("sync", "one_step", "fully_async"))}.
UnionTags = Mapping[str, tuple[str, tuple[str, ...]]]

MAX_ERRORS = 3  # validation errors spelled out; the rest are counted as "(+N more)"
# The shipped recipes and campaigns are under 5 KB. The densest 64 KiB (a flow list of 32k
# integers) loads in ~0.2 s with libyaml on a 2-core machine, ~0.8 s when it is busy (the
# pure-Python parser is 5x slower): never a hang, and 13 times the largest shipped file.
MAX_FILE_BYTES = 64 * 1024
MAX_DEPTH = 64  # nesting levels of a file (a recipe needs 4, a campaign's overrides about 8)
MAX_NODES = 100_000  # values plain_copy copies (a bomb's expansion stops here)
# An integer of more characters is refused before int() sees it (Python refuses 4,300 digits
# with ValueError; every integer field of a recipe is bounded far below 10**30).
MAX_INT_CHARS = 100
_MAX_PART = 60  # characters of a user's key or value quoted in a message


# --- messages ------------------------------------------------------------------------------------


def escape_controls(text: str) -> str:
    """``text`` with every non-printable character written as Python writes it in a repr
    (``\\n``, ``\\t``, ``\\x1b``, ``\\u202e``): a message stays one line and a key made of
    terminal escape codes is shown, not obeyed."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def short_repr(value: Any, limit: int = _MAX_PART) -> str:
    """``repr(value)`` with control characters escaped, cut to about ``limit`` characters."""
    text = escape_controls(repr(value))
    return text if len(text) <= limit else text[:limit - 1] + "…"


def describe(value: Any) -> str:
    """What a YAML value is, in the words of the file (``a string 'x'``, ``a list``, ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return f"the number {short_repr(value)}"
    if isinstance(value, str):
        return f"the string {short_repr(value)}"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return f"a {type(value).__name__} value"


# --- the loader ----------------------------------------------------------------------------------


class DuplicateKeyError(yaml.YAMLError):
    """A key written twice in one YAML mapping (raised by :class:`StrictSafeLoader`).

    ``line`` and ``first_line`` are 1-based: the repeat and the first occurrence.
    """

    def __init__(self, key: Any, line: int, first_line: int) -> None:
        super().__init__(f"line {line}: key {short_repr(key)} appears twice in the same mapping "
                         f"(first at line {first_line})")
        self.key, self.line, self.first_line = key, line, first_line


class RefusedError(yaml.MarkedYAMLError):
    """Valid YAML that asyncrl refuses (an alias, a tag, an integer too large, nesting too deep):
    ``problem`` at ``problem_mark``, and ``fix``."""

    def __init__(self, problem: str, fix: str, mark: Any) -> None:
        super().__init__(problem=problem, problem_mark=mark)
        self.fix = fix


_MERGE_TAG = "tag:yaml.org,2002:merge"
_BOOL_TAG = "tag:yaml.org,2002:bool"
_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"
_VALUE_TAG = "tag:yaml.org,2002:value"  # YAML 1.1's "=": SafeLoader has no constructor for it
_PLAIN_TAGS = "plain YAML only: mappings, lists, strings, numbers, true/false and null"

if yaml.__with_libyaml__:  # libyaml parses ~5x faster and stops nesting at 1000 levels itself
    class _Parse(yaml.cyaml.CParser):
        pass
else:  # pragma: no cover - PyYAML built without libyaml
    class _Parse(yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser,
                 yaml.composer.Composer):
        def __init__(self, stream: str) -> None:
            yaml.reader.Reader.__init__(self, stream)
            yaml.scanner.Scanner.__init__(self)
            yaml.parser.Parser.__init__(self)
            yaml.composer.Composer.__init__(self)


class StrictSafeLoader(_Parse, yaml.constructor.SafeConstructor, yaml.resolver.Resolver):
    """``yaml.SafeLoader`` (libyaml's parser when present) that builds plain data only.

    - A key written twice in one mapping (at any depth) → :class:`DuplicateKeyError`. Plain yaml
      keeps the last value silently. Only the keys written in the mapping are compared (those a
      ``<<`` merge brings in may be overridden, as YAML intends); keys are compared as loaded, so
      ``1`` and ``0x1`` clash too.
    - An alias, nesting deeper than :data:`MAX_DEPTH`, an integer longer than
      :data:`MAX_INT_CHARS`, a boolean other than true/false under ``!!bool``, or any tag but the
      plain ones → :class:`RefusedError` at the node's line.
    - Booleans resolve from ``true``/``false`` only, and dates are not resolved (strings).
    """

    def __init__(self, stream: str) -> None:
        _Parse.__init__(self, stream)
        yaml.constructor.SafeConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        _check_graph(node)
        return self.construct_document(node)

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

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, TypeError, KeyError, OverflowError) as err:  # a scalar's constructor
            raise RefusedError(f"the value cannot be built ({' '.join(str(err).split())})",
                               "write a plain string, number, true/false or null",
                               node.start_mark) from None

    def _construct_int(self, node: yaml.ScalarNode) -> int:
        text = self.construct_scalar(node)
        if len(text) > MAX_INT_CHARS:
            raise RefusedError(f"an integer of {len(text)} characters is too large (at most "
                               f"{MAX_INT_CHARS})", "use a smaller number", node.start_mark)
        try:
            return yaml.constructor.SafeConstructor.construct_yaml_int(self, node)
        except ValueError:
            raise RefusedError(f"{short_repr(text)} is not an integer", "write an integer",
                               node.start_mark) from None

    def _construct_bool(self, node: yaml.ScalarNode) -> bool:
        text = self.construct_scalar(node)
        if text not in ("true", "True", "TRUE", "false", "False", "FALSE"):
            raise RefusedError(f"{short_repr(text)} is not a boolean",
                               "write true or false", node.start_mark)
        return text.lower() == "true"

    def _refuse_tag(self, node: yaml.Node) -> Any:
        tag = str(node.tag).replace("tag:yaml.org,2002:", "!!")
        raise RefusedError(f"tag {short_repr(tag)[1:-1]} is not allowed ({_PLAIN_TAGS})",
                           "remove the tag", node.start_mark)


def _strict_resolvers() -> dict[Any, list[tuple[str, re.Pattern[str]]]]:
    """SafeLoader's implicit resolvers without YAML 1.1's booleans (yes/no/on/off), dates and the
    ``=`` value tag; booleans come back from true/false only."""
    skip = {_BOOL_TAG, _TIMESTAMP_TAG, _VALUE_TAG}
    out = {first: [(tag, rx) for tag, rx in resolvers if tag not in skip]
           for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    for first in "tTfF":
        out.setdefault(first, []).insert(
            0, (_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")))
    return out


StrictSafeLoader.yaml_implicit_resolvers = _strict_resolvers()
StrictSafeLoader.add_constructor("tag:yaml.org,2002:int", StrictSafeLoader._construct_int)
StrictSafeLoader.add_constructor(_BOOL_TAG, StrictSafeLoader._construct_bool)
for _tag in (_TIMESTAMP_TAG, "tag:yaml.org,2002:binary", "tag:yaml.org,2002:set",
             "tag:yaml.org,2002:omap", "tag:yaml.org,2002:pairs", None):  # None: any other tag
    StrictSafeLoader.add_constructor(_tag, StrictSafeLoader._refuse_tag)


_ALIAS_FIX = ("anchors (&name) and aliases are refused in asyncrl files: write the value out "
              "where it is used")


class AliasError(RefusedError):
    """An alias (``*name``): :func:`read_yaml` reports the alias's own line."""

    def __init__(self, mark: Any) -> None:
        super().__init__("an alias (*name) is not allowed", _ALIAS_FIX, mark)


def _check_graph(root: yaml.Node) -> None:
    """Refuse aliases and nesting deeper than MAX_DEPTH, before anything is constructed.

    The composer shares one node between an anchor and its aliases, so a node met twice is an
    alias (a cycle is one too); walking the graph is linear in the file, whatever an alias bomb
    would expand to."""
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if id(node) in seen:
            raise AliasError(node.start_mark)
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            continue
        if depth > MAX_DEPTH:
            raise RefusedError(f"nested more than {MAX_DEPTH} levels deep", "flatten it",
                               node.start_mark)
        if isinstance(node, yaml.MappingNode):
            stack.extend((n, depth + 1) for pair in node.value for n in pair)
        else:
            stack.extend((n, depth + 1) for n in node.value)


def _alias_mark(text: str, fallback: Any) -> Any:
    """Where the first alias (``*name``) of ``text`` is: the composer kept only the anchor's
    node. Reads events only (linear, nothing expanded)."""
    loader = yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader
    try:
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, yaml.AliasEvent):
                return event.start_mark
    except yaml.YAMLError:
        pass
    return fallback


# --- reading a file ------------------------------------------------------------------------------


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


_UTF16_32 = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
             (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))


def _read_bytes(p: Path, what: str, fix: str, error_cls: type[Exception]) -> bytes:
    """The bytes of the regular file ``p`` (at most MAX_FILE_BYTES); else ``error_cls``."""
    try:
        mode = p.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise error_cls(f"{what} file {p} does not exist; {fix}") from None
    except PermissionError:
        raise error_cls(f"{p}: is not readable (permission denied); check its permissions"
                        ) from None
    except OSError as err:
        raise error_cls(f"{p}: cannot be read ({_reason(err)}); check the file") from None
    except ValueError:  # a NUL character in the path
        raise error_cls(f"{what} file path {escape_controls(str(p))} has a NUL character; {fix}"
                        ) from None
    if stat.S_ISDIR(mode):
        raise error_cls(f"{p}: is a directory, not a {what} file; {fix}")
    if not stat.S_ISREG(mode):  # /dev/zero, a pipe, a socket: never read them
        raise error_cls(f"{p}: is not a regular file (a device, pipe or socket); {fix}")
    try:
        with p.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except PermissionError:
        raise error_cls(f"{p}: is not readable (permission denied); check its permissions"
                        ) from None
    except OSError as err:
        raise error_cls(f"{p}: cannot be read ({_reason(err)}); check the file") from None
    if len(raw) > MAX_FILE_BYTES:
        raise error_cls(f"{p}: is larger than the {MAX_FILE_BYTES // 1024} KiB a {what} file may "
                        f"hold; pass the {what} file itself (large data goes in a file the "
                        f"{what} names)")
    return raw


def _reason(err: OSError) -> str:
    return " ".join(str(err.strerror or err).split())


def _decode(p: Path, raw: bytes, error_cls: type[Exception]) -> str:
    for bom, name in _UTF16_32:
        if raw.startswith(bom):
            raise error_cls(f"{p}: is {name} text (it starts with a {name} byte-order mark); "
                            "save it as UTF-8")
    nul = raw.find(b"\x00")
    if nul >= 0:
        line = raw.count(b"\n", 0, nul) + 1
        raise error_cls(f"{p}: line {line} has a NUL byte (offset {nul}): a binary file, or "
                        "UTF-16/UTF-32 text; save it as UTF-8 text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise error_cls(f"{p}: line {line} is not UTF-8 text (byte 0x{raw[err.start]:02x} at "
                        f"offset {err.start}); save it as UTF-8") from None


def read_yaml(path: str | Path, what: str, fix: str, error_cls: type[Exception]) -> Any:
    """The parsed content of the YAML file ``path``: plain data, never ``None``.

    Loads with :class:`StrictSafeLoader`. Raises ``error_cls`` with one line (``N``, ``C``
    1-based; control characters escaped):

    - ``"<what> file <path> does not exist; <fix>"``; ``"<path>: is a directory, not a <what>
      file; <fix>"``; ``"<path>: is not a regular file (...); <fix>"`` (a device such as
      /dev/zero or a pipe is never read); ``"<path>: is larger than the 64 KiB ..."``;
    - ``"<path>: is not readable (permission denied); check its permissions"``, or
      ``"<path>: cannot be read (<reason>); check the file"`` for another OS error;
    - ``"<path>: line <N> is not UTF-8 text (byte 0x<hh> at offset <K>); save it as UTF-8"``,
      ``"<path>: is UTF-16 text (...); save it as UTF-8"``, ``"<path>: line <N> has a NUL byte
      ..."``;
    - ``"<path>: line <N>, column <C> is not valid YAML (<problem>); <fix>"`` on a syntax error
      (``"<path>: is not valid YAML (...)"`` when yaml gives no position), the fix being
      ``fix the syntax``, or ``remove it`` for a character YAML does not allow;
    - ``"<path>: line <N>: key '<k>' appears twice in the same mapping (first at line <M>);
      remove one"``;
    - ``"<path>: line <N>, column <C>: <problem>; <fix>"`` for an alias, a tag, an integer too
      large, a bad ``!!bool`` or nesting deeper than :data:`MAX_DEPTH`;
    - ``"<path>: the file is empty (...); ..."`` when it holds no YAML value (or only ``null``).
    """
    p = Path(path)
    try:
        return _read_yaml(p, what, fix, error_cls)
    except error_cls as err:
        raise error_cls(escape_controls(str(err))) from None


def _read_yaml(p: Path, what: str, fix: str, error_cls: type[Exception]) -> Any:
    text = _decode(p, _read_bytes(p, what, fix, error_cls), error_cls)
    loader = None
    try:
        yaml.reader.Reader(text)  # PyYAML's check of every character: the exact position
        loader = StrictSafeLoader(text)
        data = loader.get_single_data()
    except DuplicateKeyError as err:
        raise error_cls(f"{p}: {err}; remove one") from None
    except RefusedError as err:
        mark = (_alias_mark(text, err.problem_mark) if isinstance(err, AliasError)
                else err.problem_mark)
        raise error_cls(f"{p}: {_where(mark)}: {err.problem}; {err.fix}") from None
    except yaml.YAMLError as err:
        where, problem = _yaml_problem(err, text)
        if "maximum nesting depth" in problem:  # libyaml's own limit (1000 levels)
            raise error_cls(f"{p}: {where}: nested more than {MAX_DEPTH} levels deep; flatten it"
                            ) from None
        fix_it = "remove it" if isinstance(err, yaml.reader.ReaderError) else "fix the syntax"
        raise error_cls(f"{p}:{' ' + where if where else ''} is not valid YAML ({problem}); "
                        f"{fix_it}") from None
    except RecursionError:  # pragma: no cover - the pure-Python composer only
        raise error_cls(f"{p}: is nested too deeply to read as YAML; flatten it") from None
    finally:
        if loader is not None:
            loader.dispose()
    if data is None:
        raise error_cls(f"{p}: the file is empty (no YAML value, only comments or blank lines); "
                        f"write the {what} in it, or {fix}")
    return data


def require_mapping(data: Any, expected: str, error_cls: type[Exception]) -> Mapping[str, Any]:
    """``data`` if it is a mapping; else ``error_cls("<expected>, got <what it is>")``.

    ``expected`` says what the top level should be, e.g. ``"c.yaml: a campaign is a mapping
    with name, base and stages"``.
    """
    if not isinstance(data, Mapping):
        raise error_cls(escape_controls(f"{expected}, got {describe(data)}"))
    return data


# --- plain data ----------------------------------------------------------------------------------


class PlainDataError(ValueError):
    """Data that is not plain YAML data: ``path`` (the keys and indices to it) and ``problem``."""

    def __init__(self, path: tuple[Any, ...], problem: str) -> None:
        self.path, self.problem = path, problem
        where = ".".join(escape_controls(str(p))[:_MAX_PART] for p in path)
        super().__init__(f"{where}: {problem}" if where else problem)


def plain_copy(value: Any, *, str_keys: bool = False) -> Any:
    """A deep copy of ``value`` that admits only plain YAML data: ``None``, ``bool``, ``int``,
    ``float``, ``str``, lists (tuples become lists) and mappings whose keys are strings or
    integers (``str_keys``: integer keys become strings, as a JSON round trip made them).

    Raises :class:`PlainDataError` naming the path for anything else (a date, a set, bytes, a
    boolean or null key), a container that contains itself, nesting deeper than
    :data:`MAX_DEPTH`, or more than :data:`MAX_NODES` values (what an alias bomb expands to).
    """
    budget = [MAX_NODES]
    active: set[int] = set()  # containers on the path being copied (a cycle returns to one)

    def copy(v: Any, path: tuple[Any, ...]) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise PlainDataError(path, f"holds more than {MAX_NODES:,} values; make it smaller")
        if v is None or isinstance(v, bool | int | float | str):
            return v
        if not isinstance(v, Mapping | list | tuple):
            raise PlainDataError(path, f"{describe(v)} is not allowed (only strings, numbers, "
                                 "true/false, null, lists and mappings)")
        if len(path) >= MAX_DEPTH:
            raise PlainDataError(path, f"is nested more than {MAX_DEPTH} levels deep; flatten it")
        if id(v) in active:
            raise PlainDataError(path, "contains itself (a cycle); write the value out")
        active.add(id(v))
        try:
            if not isinstance(v, Mapping):
                return [copy(x, (*path, i)) for i, x in enumerate(v)]
            out: dict[Any, Any] = {}
            for k, x in v.items():
                if isinstance(k, bool) or not isinstance(k, str | int):
                    raise PlainDataError(path, f"key {describe(k)} is not allowed (keys are "
                                         "strings or integers)")
                out[str(k) if str_keys else k] = copy(x, (*path, k))
            return out
        finally:
            active.discard(id(v))

    return copy(value, ())


# --- pydantic ------------------------------------------------------------------------------------


def _number(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"must be a number, got {describe(value)}")
    return value


def _boolean(value: Any) -> Any:
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {describe(value)}")
    return value


# Field types of the YAML files' models. Pydantic's lax mode turns True into 1 and 'yes', 'on'
# or 1 into True; these take a number only from a number and a boolean only from true/false.
YamlInt = Annotated[int, BeforeValidator(_number)]
YamlFloat = Annotated[float, BeforeValidator(_number)]
YamlBool = Annotated[bool, BeforeValidator(_boolean)]
# Optional ones carry the validator outside the union, so that a field's bounds still export as
# JSON-schema minimum/maximum (`YamlInt | None` would export them as unknown "ge"/"le" keys).
YamlOptInt = Annotated[int | None, BeforeValidator(_number)]
YamlOptFloat = Annotated[float | None, BeforeValidator(_number)]


# Pydantic's location parts that are not a user's keys: validator wrappers, union members.
_INTERNAL_LOC = re.compile(r"^(function-(after|before|wrap|plain)|tagged-union|union|"
                           r"json-or-python|lax-or-strict|nullable)\[")
_TYPE_WORDS = {"model_type": "a mapping", "model_attributes_type": "a mapping",
               "dict_type": "a mapping", "list_type": "a list", "string_type": "a string",
               "tuple_type": "a list"}


def error_location(loc: tuple[Any, ...], unions: UnionTags | None = None) -> str:
    """A pydantic error location as the dotted path a user writes (``stages.0.name``).

    Pydantic's internal parts are dropped: validator wrappers (``function-after[...]``), and the
    variant tag it inserts after a discriminated union field of ``unions``
    (``async.fully_async.x`` → ``async.x``). A user's key is cut to 60 characters, its control
    characters escaped.
    """
    unions = unions or {}
    parts: list[str] = []
    for p in (str(p) for p in loc):
        if _INTERNAL_LOC.match(p):
            continue
        if parts and parts[-1] in unions and p in unions[parts[-1]][1]:
            continue  # the variant tag pydantic inserts after a union field
        p = escape_controls(p) or '""'  # an empty key is still a key
        parts.append(p if len(p) <= _MAX_PART else p[:_MAX_PART - 1] + "…")
    return ".".join(parts)


def _message(e: Any, loc: str, unions: UnionTags, schema_hint: str) -> str:
    msg = str(e["msg"]).removeprefix("Value error, ")
    kind = e["type"]
    if kind == "extra_forbidden":
        return f"unknown field; remove it or check its spelling ({schema_hint})"
    if kind == "union_tag_invalid":
        return msg.replace("Input tag", "value")
    if kind == "union_tag_not_found":
        field = loc.rsplit(".", 1)[-1]
        key, tags = unions.get(field, ("kind", ()))
        return f"missing `{key}`; add {key}: one of {', '.join(tags)}"
    if kind in _TYPE_WORDS:  # never pydantic's class names ("instance of RolloutConfig")
        return f"must be {_TYPE_WORDS[kind]}, got {describe(e.get('input'))}"
    if kind == "missing":
        return "missing; add it"
    if kind == "finite_number":
        return "must be a finite number (not .inf or .nan)"
    return msg


def format_validation_error(err: ValidationError, source: str, schema_hint: str,
                            unions: UnionTags | None = None) -> str:
    """One line ``"<source>: <loc>: <msg>; ... (+N more)"`` for a pydantic validation error.

    ``source`` names the file (or ``recipe``, ``base``, ...). Messages lose pydantic's
    ``"Value error, "`` prefix (validators' messages already say the fix); an unknown field
    reads ``"unknown field; remove it or check its spelling (<schema_hint>)"``; a value of the
    wrong kind ``"must be a mapping, got the number 5"``. For a discriminated union of
    ``unions``, a bad tag reads ``value '<x>' does not match ...`` and a missing one ``missing
    `<key>`; add <key>: one of <tags>``. A cross-field error (empty location) is the message
    alone. Repeated parts are given once; control characters are escaped.
    """
    unions = unions or {}
    parts: list[str] = []
    for e in err.errors():
        key_error = e["loc"][-1:] == ("[key]",)  # a mapping's key, not its value, is wrong
        loc = error_location(e["loc"][:-2] if key_error else e["loc"], unions)
        msg = _message(e, loc, unions, schema_hint)
        if key_error:
            msg = f"key: {msg}"
        elif e["type"] == "invalid_key":  # the location is the key itself (null, true, 1)
            loc = error_location(e["loc"][:-1], unions)
            msg = f"key {describe(e.get('input'))} is not a field name (keys are strings)"
        part = f"{loc}: {msg}" if loc else msg  # cross-field errors name their fields
        if part not in parts:
            parts.append(part)
    more = len(parts) - MAX_ERRORS
    tail = f" (+{more} more)" if more > 0 else ""
    return escape_controls(f"{source}: " + "; ".join(parts[:MAX_ERRORS]) + tail)

