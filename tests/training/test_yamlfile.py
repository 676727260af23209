"""training.yamlfile: the one-line file and validation errors shared by recipes and campaigns."""

import datetime
import errno
import os
import time
from pathlib import Path
from typing import Literal

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from training.yamlfile import (
    MAX_DEPTH,
    MAX_FILE_BYTES,
    MAX_NODES,
    DuplicateKeyError,
    PlainDataError,
    RefusedError,
    StrictSafeLoader,
    YamlBool,
    YamlFloat,
    YamlInt,
    _yaml_problem,
    error_location,
    escape_controls,
    format_validation_error,
    plain_copy,
    read_yaml,
    require_mapping,
)


class _Err(ValueError):
    pass


def _read(path):
    return read_yaml(path, "thing", "pass a thing YAML (see things/)", _Err)


def test_read_yaml_returns_the_content(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("a: 1\nb: [x, y]\n")
    assert _read(path) == {"a": 1, "b": ["x", "y"]}


@pytest.mark.parametrize("text", ["", "# only a comment\n", "\n\n  \n", "---\n", "null\n", "~\n"])
def test_an_empty_file_is_an_error_not_nothing(tmp_path, text):
    path = _write(tmp_path, text)
    assert _error(path) == (
        f"{path}: the file is empty (no YAML value, only comments or blank lines); write the "
        "thing in it, or pass a thing YAML (see things/)")


def test_missing_file_directory_and_device_each_say_what_they_are(tmp_path):
    with pytest.raises(_Err) as info:
        _read(tmp_path / "nope.yaml")
    assert str(info.value) == (f"thing file {tmp_path / 'nope.yaml'} does not exist; "
                               "pass a thing YAML (see things/)")
    assert _error(tmp_path) == (
        f"{tmp_path}: is a directory, not a thing file; pass a thing YAML (see things/)")
    if Path("/dev/zero").exists():  # endless: never read
        assert _error("/dev/zero") == ("/dev/zero: is not a regular file (a device, pipe or "
                                       "socket); pass a thing YAML (see things/)")
    fifo = tmp_path / "fifo.yaml"
    if hasattr(os, "mkfifo"):  # reading a pipe with no writer would block forever
        os.mkfifo(fifo)
        assert _error(fifo).endswith("is not a regular file (a device, pipe or socket); "
                                     "pass a thing YAML (see things/)")
    with pytest.raises(_Err) as info:
        _read(str(tmp_path / "a\x00b.yaml"))
    assert str(info.value) == (f"thing file path {tmp_path}/a\\x00b.yaml has a NUL character; "
                               "pass a thing YAML (see things/)")


def test_a_file_too_large_is_refused_before_it_is_parsed(tmp_path):
    path = _write(tmp_path, "a: [" + "1, " * (MAX_FILE_BYTES // 3) + "1]\n")
    started = time.perf_counter()
    assert _error(path) == (
        f"{path}: is larger than the {MAX_FILE_BYTES // 1024} KiB a thing file may hold; pass "
        "the thing file itself (large data goes in a file the thing names)")
    assert time.perf_counter() - started < 0.5
    path = _write(tmp_path, "a: '" + "x" * (MAX_FILE_BYTES - 10) + "'\n")  # just under: read
    assert len(_read(path)["a"]) == MAX_FILE_BYTES - 10


def _error(path) -> str:
    """read_yaml's one-line error for ``path`` (chained to nothing)."""
    with pytest.raises(_Err) as info:
        _read(path)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"{path}: ")
    assert info.value.__cause__ is None and info.value.__suppress_context__
    return msg


def _write(tmp_path, data: bytes | str) -> Path:
    path = tmp_path / "t.yaml"
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    return path


def test_syntax_error_names_the_file_line_and_column(tmp_path):
    path = _write(tmp_path, "name: x\nrollout:\n  n: [1, 2\nsteps: 3\n")
    assert _error(path) == (
        f"{path}: line 4, column 6 is not valid YAML (did not find expected ',' or ']' while "
        "parsing a flow sequence started at line 3, column 6); fix the syntax")
    path = _write(tmp_path, "a: b: c\n")
    assert _error(path) == (
        f"{path}: line 1, column 5 is not valid YAML (mapping values are not allowed in this "
        "context); fix the syntax")


def test_syntax_error_with_a_context_says_where_it_began(tmp_path):
    path = _write(tmp_path, 'a: 1\nb: "open\nc: 2\n')
    assert _error(path) == (
        f"{path}: line 4, column 1 is not valid YAML (found unexpected end of stream while "
        "scanning a quoted scalar started at line 2, column 4); fix the syntax")
    path = _write(tmp_path, "a: 1\n---\nb: 2\n")
    assert _error(path) == (
        f"{path}: line 2, column 1 is not valid YAML (expected a single document in the stream "
        "at line 1, column 1, but found another document); fix the syntax")


@pytest.mark.parametrize(("data", "where", "char"), [
    (b"a: \x07\n", "line 1, column 4", "U+0007"),         # yaml gives no mark for these
    (b"a: 1\nb: x\x1by\n", "line 2, column 5", "U+001B"),
    (b"a: 1\r\nb: \x7f\r\n", "line 2, column 4", "U+007F"),
])
def test_control_character_is_one_line_with_its_position(tmp_path, data, where, char):
    path = _write(tmp_path, data)
    assert _error(path) == (
        f"{path}: {where} is not valid YAML (character {char} is not allowed in YAML); remove it")


def test_yaml_error_uses_any_mark_and_is_always_one_line(tmp_path, monkeypatch):
    mark = yaml.Mark("x", 0, 6, 2, None, None)
    only_context = yaml.MarkedYAMLError(context="while reading\n  it", context_mark=mark,
                                        problem="something\n   broke")
    assert _yaml_problem(only_context, "") == (
        "line 7, column 3", "something broke while reading it")
    # no mark at all: the problem on one line, no position
    path = _write(tmp_path, "a: 1\n")

    def boom(self):
        raise yaml.YAMLError("first line\n  second line")

    monkeypatch.setattr(StrictSafeLoader, "get_single_data", boom)
    assert _error(path) == f"{path}: is not valid YAML (first line second line); fix the syntax"


def test_non_utf8_names_the_byte_offset_and_line(tmp_path):
    path = _write(tmp_path, b"a: 1\nname: caf\xe9\n")  # latin-1
    assert _error(path) == (
        f"{path}: line 2 is not UTF-8 text (byte 0xe9 at offset 14); save it as UTF-8")
    path = _write(tmp_path, "\ufeffname: café\n".encode())  # UTF-8, with a BOM: fine
    assert _read(path) == {"name": "café"}


@pytest.mark.parametrize(("encoding", "start"), [
    ("utf-16", "is UTF-16 text (it starts with a UTF-16 byte-order mark)"),
    ("utf-32", "is UTF-32 text (it starts with a UTF-32 byte-order mark)"),
    ("utf-16-be", "line 1 has a NUL byte (offset 0): a binary file, or UTF-16/UTF-32 text"),
    ("utf-32-le", "line 1 has a NUL byte (offset 1): a binary file, or UTF-16/UTF-32 text"),
])
def test_utf16_and_utf32_say_so(tmp_path, encoding, start):
    path = _write(tmp_path, "a: 1\nb: 2\n".encode(encoding))
    assert _error(path) == f"{path}: {start}; save it as UTF-8" + (
        " text" if "NUL" in start else "")


def test_nul_byte_names_its_line(tmp_path):
    path = _write(tmp_path, b"a: 1\nb: x\x00y\n")
    assert _error(path) == (f"{path}: line 2 has a NUL byte (offset 9): a binary file, or "
                            "UTF-16/UTF-32 text; save it as UTF-8 text")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="root reads a chmod 000 file anyway")
def test_unreadable_file_says_permission_denied(tmp_path):
    path = _write(tmp_path, "a: 1\n")
    path.chmod(0)
    try:
        assert _error(path) == (
            f"{path}: is not readable (permission denied); check its permissions")
    finally:
        path.chmod(0o644)


def test_read_errors_are_one_line(tmp_path, monkeypatch):
    path = _write(tmp_path, "a: 1\n")

    def denied(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "open", denied)
    assert _error(path) == f"{path}: is not readable (permission denied); check its permissions"

    def io_error(self, *args, **kwargs):
        raise OSError(errno.EIO, "Input/output error", str(self))

    monkeypatch.setattr(Path, "open", io_error)
    assert _error(path) == f"{path}: cannot be read (Input/output error); check the file"


@pytest.mark.parametrize(("text", "line", "key", "first"), [
    ("a: 1\nb: 2\na: 3\n", 3, "'a'", 1),
    ("x:\n  y: 1\n  z: 2\n  y: 3\n", 4, "'y'", 2),                 # nested
    ("stages:\n- name: a\n  gates: []\n  name: b\n", 4, "'name'", 2),  # in a list item
    ("a: {b: 1, b: 2}\n", 1, "'b'", 1),                             # flow mapping
    ("1: a\n0x1: b\n", 2, "1", 1),                                  # equal once loaded
])
def test_duplicate_keys_are_an_error(tmp_path, text, line, key, first):
    path = _write(tmp_path, text)
    assert _error(path) == (f"{path}: line {line}: key {key} appears twice in the same mapping "
                            f"(first at line {first}); remove one")


def test_distinct_keys_and_repeats_across_mappings_are_fine(tmp_path):
    path = _write(tmp_path, "- a: 1\n- a: 2\n")
    assert _read(path) == [{"a": 1}, {"a": 2}]
    path = _write(tmp_path, 'x: {a: 1}\ny: {a: 2}\n1: p\n"1": q\n')
    assert _read(path) == {"x": {"a": 1}, "y": {"a": 2}, 1: "p", "1": "q"}
    path = _write(tmp_path, "run:\n  <<: {lr: 1, n: 2}\n  lr: 3\n")  # a merge without an alias
    assert _read(path) == {"run": {"lr": 3, "n": 2}}


def test_strict_loader_stays_safe():
    with pytest.raises(RefusedError, match=r"tag !!python/object/apply:os.system is not allowed"):
        yaml.load("a: !!python/object/apply:os.system [echo hi]", Loader=StrictSafeLoader)
    with pytest.raises(DuplicateKeyError) as info:
        yaml.load("a: 1\na: 2\n", Loader=StrictSafeLoader)
    assert (info.value.key, info.value.line, info.value.first_line) == ("a", 2, 1)
    with pytest.raises(yaml.constructor.ConstructorError, match="unhashable key"):
        yaml.load("? [1]\n: 2\n", Loader=StrictSafeLoader)


def test_plain_scalars_booleans_only_from_true_false_and_no_dates():
    text = ("a: yes\nb: no\nc: on\nd: off\ne: true\nf: FALSE\ng: 2024-13-45\nh: 2024-01-01\n"
            "i: 0x1f\nj: 1_000\nk: 3.0e-5\nl: 1e-4\nm: ~\nn: .inf\no: =\n")
    assert yaml.load(text, Loader=StrictSafeLoader) == {
        "a": "yes", "b": "no", "c": "on", "d": "off", "e": True, "f": False,
        "g": "2024-13-45", "h": "2024-01-01", "i": 31, "j": 1000, "k": 3e-5, "l": "1e-4",
        "m": None, "n": float("inf"), "o": "="}


@pytest.mark.parametrize(("text", "where", "message"), [
    ("a: !!python/object/apply:os.system [echo hi]\n", "line 1, column 4",
     "tag !!python/object/apply:os.system is not allowed (plain YAML only: mappings, lists, "
     "strings, numbers, true/false and null); remove the tag"),
    ("a: !foo x\n", "line 1, column 4", "tag !foo is not allowed"),
    ("a: 1\nb: !!binary aGk=\n", "line 2, column 4", "tag !!binary is not allowed"),
    ("a: !!set {x}\n", "line 1, column 4", "tag !!set is not allowed"),
    ("a: !!omap [b: 1]\n", "line 1, column 4", "tag !!omap is not allowed"),
    ("a: !!timestamp 2024-13-45\n", "line 1, column 4", "tag !!timestamp is not allowed"),
    ("a: !!bool yes\n", "line 1, column 4", "'yes' is not a boolean; write true or false"),
    ("a: !!int 1x\n", "line 1, column 4", "'1x' is not an integer; write an integer"),
    ("a: !!float x\n", "line 1, column 4",
     "the value cannot be built (could not convert string to float: 'x'); write a plain "
     "string, number, true/false or null"),
    ("seed: " + "9" * 5000 + "\n", "line 1, column 7",
     "an integer of 5000 characters is too large (at most 100); use a smaller number"),
    ("a: &x {n: 1}\nb:\n  c: *x\n", "line 3, column 6",
     "an alias (*name) is not allowed; anchors (&name) and aliases are refused in asyncrl "
     "files: write the value out where it is used"),
    ("a: &x [*x]\n", "line 1, column 8", "an alias (*name) is not allowed"),  # a cycle
    ("x: " + "[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5) + "\n",
     f"line 1, column {MAX_DEPTH + 3}", f"nested more than {MAX_DEPTH} levels deep; flatten it"),
    ("a: 1\nb: " + "[" * 10_000 + "\n", "line 2, column 1003",  # libyaml stops at 1000
     f"nested more than {MAX_DEPTH} levels deep; flatten it"),
])
def test_refused_yaml_names_the_line_and_the_fix(tmp_path, text, where, message):
    path = _write(tmp_path, text)
    msg = _error(path)
    assert msg.startswith(f"{path}: {where}: {message}"), msg


def test_a_billion_laughs_bomb_is_refused_at_once(tmp_path):
    lines = ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]"
              for i in range(8)]
    path = _write(tmp_path, "\n".join(lines) + "\n")  # 9**9 strings once expanded
    started = time.perf_counter()
    assert _error(path).startswith(f"{path}: line 2, column 8: an alias (*name) is not allowed")
    assert time.perf_counter() - started < 1.0


def test_require_mapping():
    data = {"a": 1}
    assert require_mapping(data, "x", _Err) is data
    with pytest.raises(_Err) as info:
        require_mapping([1, 2], "c.yaml: a thing is a mapping with a and b", _Err)
    assert str(info.value) == "c.yaml: a thing is a mapping with a and b, got a list"
    with pytest.raises(_Err) as info:
        require_mapping("x\x1b[2J", "x", _Err)
    assert str(info.value) == "x, got the string 'x\\x1b[2J'"


def test_escape_controls_writes_every_control_character_as_a_repr_does():
    assert escape_controls("plain: ok · ≤ é") == "plain: ok · ≤ é"
    assert escape_controls("a\nb\tc\x1b[31md\x00\u202ee\u2028") == (
        "a\\nb\\tc\\x1b[31md\\x00\\u202ee\\u2028")


def test_plain_copy_copies_plain_data_and_names_what_is_not():
    data = {"a": [1, 2.5, "x", None, True, {"b": (1, 2)}], 4: {"c": {}}}
    out = plain_copy(data)
    assert out == {"a": [1, 2.5, "x", None, True, {"b": [1, 2]}], 4: {"c": {}}}
    assert out["a"] is not data["a"] and out[4]["c"] is not data[4]["c"]
    assert plain_copy(data, str_keys=True)["4"] == {"c": {}}
    with pytest.raises(PlainDataError) as info:
        plain_copy({"task": {"args": [1, datetime.date(2024, 1, 1)]}})
    assert str(info.value) == ("task.args.1: a date value is not allowed (only strings, numbers, "
                               "true/false, null, lists and mappings)")
    with pytest.raises(PlainDataError, match=r"^x: key true is not allowed"):
        plain_copy({"x": {True: 1}})
    with pytest.raises(PlainDataError, match=r"^x: key null is not allowed"):
        plain_copy({"x": {None: 1}})
    cycle: dict = {"a": []}
    cycle["a"].append(cycle)
    with pytest.raises(PlainDataError, match=r"^a\.0: contains itself \(a cycle\)"):
        plain_copy(cycle)
    deep: list = []
    node = deep
    for _ in range(MAX_DEPTH + 1):
        node.append([])
        node = node[0]
    with pytest.raises(PlainDataError, match=f"is nested more than {MAX_DEPTH} levels deep"):
        plain_copy(deep)


def test_plain_copy_stops_an_expanding_bomb():
    level: list = ["lol"] * 10
    for _ in range(9):  # shared lists: 10**10 values once expanded
        level = [level] * 10
    started = time.perf_counter()
    with pytest.raises(PlainDataError, match=f"holds more than {MAX_NODES:,} values"):
        plain_copy({"x": level})
    assert time.perf_counter() - started < 15.0  # a hang guard: expanded, it would never end
    shared = [1, 2]
    assert plain_copy({"a": shared, "b": shared}) == {"a": [1, 2], "b": [1, 2]}  # no cycle


class _A(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["a"] = "a"
    x: int = Field(0, ge=0)


class _B(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["b"] = "b"


class _Top(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sub: _A | _B = Field(default_factory=_A, discriminator="mode")
    items: list[int] = []


_UNIONS = {"sub": ("mode", ("a", "b"))}


def _format(data) -> str:
    with pytest.raises(ValidationError) as info:
        _Top.model_validate(data)
    return format_validation_error(info.value, "f.yaml", "see the schema", _UNIONS)


def test_format_names_the_field_path_without_the_union_tag():
    assert _format({"sub": {"mode": "a", "x": -1}}) == (
        "f.yaml: sub.x: Input should be greater than or equal to 0")
    assert _format({"items": [1, "z"]}).startswith("f.yaml: items.1: ")
    assert _format({"subb": 1}) == (
        "f.yaml: subb: unknown field; remove it or check its spelling (see the schema)")


def test_format_union_tags():
    assert _format({"sub": {"x": 1}}) == "f.yaml: sub: missing `mode`; add mode: one of a, b"
    assert _format({"sub": {"mode": "c"}}) == (
        "f.yaml: sub: value 'c' found using 'mode' does not match any of the expected tags: "
        "'a', 'b'")


def test_format_keeps_three_errors_and_counts_the_rest():
    msg = _format({"p": 1, "q": 2, "r": 3, "s": 4, "t": 5})
    assert msg.startswith("f.yaml: p: unknown field") and "; q: " in msg and "; r: " in msg
    assert "s:" not in msg and msg.endswith(" (+2 more)") and "\n" not in msg


class _Scalars(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    n: YamlInt = 1
    x: YamlFloat = 1.0
    flag: YamlBool = False
    weights: dict[YamlInt, YamlFloat] = {}


@pytest.mark.parametrize(("data", "message"), [
    ({"n": True}, "n: must be a number, got true"),
    ({"x": False}, "x: must be a number, got false"),
    ({"flag": "yes"}, "flag: must be true or false, got the string 'yes'"),
    ({"flag": 1}, "flag: must be true or false, got the number 1"),
    ({"weights": {1: True}}, "weights.1: must be a number, got true"),
    ({"weights": {True: 1.0}}, "weights: key: must be a number, got true"),
    ({"x": float("nan")}, "x: must be a finite number (not .inf or .nan)"),
])
def test_yaml_scalars_take_booleans_only_as_booleans(data, message):
    with pytest.raises(ValidationError) as info:
        _Scalars.model_validate(data)
    assert format_validation_error(info.value, "f.yaml", "h") == f"f.yaml: {message}"


def test_yaml_scalars_keep_numbers_and_true_false():
    ok = _Scalars.model_validate({"n": 3, "x": "1e-4", "flag": True, "weights": {"2": 1}})
    assert (ok.n, ok.x, ok.flag, ok.weights) == (3, 1e-4, True, {2: 1.0})


def test_format_escapes_control_characters_and_speaks_yaml():
    assert _format({"a\nb\x1b[31m": 1}) == (
        "f.yaml: a\\nb\\x1b[31m: unknown field; remove it or check its spelling (see the "
        "schema)")
    assert _format({"sub": 5}) == "f.yaml: sub: must be a mapping, got the number 5"
    assert _format({"items": "x"}) == "f.yaml: items: must be a list, got the string 'x'"
    long = "k" * 500
    msg = _format({long: 1})
    assert msg.startswith("f.yaml: " + "k" * 59 + "…: unknown field") and len(msg) < 200


def test_error_location():
    assert error_location(("stages", 0, "name")) == "stages.0.name"
    assert error_location(("async", "fully_async", "x"),
                          {"async": ("mode", ("sync", "fully_async"))}) == "async.x"
    assert error_location(("async", "fully_async", "x")) == "async.fully_async.x"
    assert error_location(("model", "function-after[_top_k(), M]", "k")) == "model.k"
