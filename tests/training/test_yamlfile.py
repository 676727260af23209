"""training.yamlfile: the one-line file and validation errors shared by recipes and campaigns."""

import errno
import os
from pathlib import Path
from typing import Literal

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from training.yamlfile import (
    DuplicateKeyError,
    StrictSafeLoader,
    _yaml_problem,
    error_location,
    format_validation_error,
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
    path.write_text("# only a comment\n")
    assert _read(str(path)) is None


def test_missing_file_and_directory_name_the_path_and_the_fix(tmp_path):
    with pytest.raises(_Err) as info:
        _read(tmp_path / "nope.yaml")
    assert str(info.value) == (f"thing file {tmp_path / 'nope.yaml'} does not exist; "
                               "pass a thing YAML (see things/)")
    with pytest.raises(_Err, match="does not exist"):
        _read(tmp_path)  # a directory is not a file


def _error(path) -> str:
    """read_yaml's one-line error for ``path`` (chained to nothing)."""
    with pytest.raises(_Err) as info:
        _read(path)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"{path}: ")
    assert info.value.__cause__ is None and info.value.__suppress_context__
    return msg


def _write(tmp_path, data: bytes | str):
    path = tmp_path / "t.yaml"
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    return path


def test_syntax_error_names_the_file_line_and_column(tmp_path):
    path = _write(tmp_path, "name: x\nrollout:\n  n: [1, 2\nsteps: 3\n")
    assert _error(path) == (
        f"{path}: line 4, column 6 is not valid YAML (expected ',' or ']', but got ':' while "
        "parsing a flow sequence started at line 3, column 6); fix the syntax")
    path = _write(tmp_path, "a: b: c\n")
    assert _error(path) == (
        f"{path}: line 1, column 5 is not valid YAML (mapping values are not allowed here); "
        "fix the syntax")


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
    path = _write(tmp_path, "a: 1\n".encode("utf-16"))
    assert _error(path) == (
        f"{path}: line 1 is not UTF-8 text (byte 0xff at offset 0); save it as UTF-8")
    path = _write(tmp_path, "\ufeffname: café\n".encode())  # UTF-8, with a BOM: fine
    assert _read(path) == {"name": "café"}


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

    def denied(self):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)
    assert _error(path) == f"{path}: is not readable (permission denied); check its permissions"

    def io_error(self):
        raise OSError(errno.EIO, "Input/output error", str(self))

    monkeypatch.setattr(Path, "read_bytes", io_error)
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


def test_distinct_keys_merges_and_repeats_across_mappings_are_fine(tmp_path):
    path = _write(tmp_path, "- a: 1\n- a: 2\n")
    assert _read(path) == [{"a": 1}, {"a": 2}]
    path = _write(tmp_path, 'x: {a: 1}\ny: {a: 2}\n1: p\n"1": q\n')
    assert _read(path) == {"x": {"a": 1}, "y": {"a": 2}, 1: "p", "1": "q"}
    path = _write(tmp_path, "base: &b {lr: 1, n: 2}\nrun:\n  <<: *b\n  lr: 3\n")
    assert _read(path) == {"base": {"lr": 1, "n": 2}, "run": {"lr": 3, "n": 2}}


def test_strict_loader_stays_safe():
    with pytest.raises(yaml.constructor.ConstructorError, match="could not determine"):
        yaml.load("a: !!python/object/apply:os.system [echo hi]", Loader=StrictSafeLoader)
    with pytest.raises(DuplicateKeyError) as info:
        yaml.load("a: 1\na: 2\n", Loader=StrictSafeLoader)
    assert (info.value.key, info.value.line, info.value.first_line) == ("a", 2, 1)
    with pytest.raises(yaml.constructor.ConstructorError, match="unhashable key"):
        yaml.load("? [1]\n: 2\n", Loader=StrictSafeLoader)


def test_unsafe_tag_and_deep_nesting_are_one_line(tmp_path):
    path = _write(tmp_path, "a: !!python/object/apply:os.system [echo hi]\n")
    assert _error(path).startswith(
        f"{path}: line 1, column 4 is not valid YAML (could not determine a constructor")
    path = _write(tmp_path, "[" * 5000)
    assert _error(path) == f"{path}: is nested too deeply to read as YAML; flatten it"


def test_require_mapping():
    data = {"a": 1}
    assert require_mapping(data, "x", _Err) is data
    with pytest.raises(_Err) as info:
        require_mapping([1, 2], "c.yaml: a thing is a mapping with a and b", _Err)
    assert str(info.value) == "c.yaml: a thing is a mapping with a and b, got list"
    with pytest.raises(_Err) as info:
        require_mapping(None, "x", _Err)
    assert str(info.value) == "x, got NoneType"


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


def test_error_location():
    assert error_location(("stages", 0, "name")) == "stages.0.name"
    assert error_location(("async", "fully_async", "x"),
                          {"async": ("mode", ("sync", "fully_async"))}) == "async.x"
    assert error_location(("async", "fully_async", "x")) == "async.fully_async.x"
    assert error_location(("model", "function-after[_top_k(), M]", "k")) == "model.k"
