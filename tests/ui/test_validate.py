"""`asyncrl validate`: every shipped recipe and campaign is accepted, and a corpus of malformed
ones — mutations of every shipped file plus hand-written hostile cases — is each rejected with exit
code 1, at most 3 lines naming the field or the line, no traceback, no raw control character,
within a 15 s hang guard (in-process; a case takes under 1 s) or under a 2 GiB address-space
limit and a timeout (real subprocesses). The command writes nothing and imports no service
library."""

from __future__ import annotations

import codecs
import copy
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
import yaml
from click.testing import CliRunner

import registry.gates  # noqa: F401  (imports torch once, before the per-case time limits)
from ui.cli import app as typer_app
from ui.validate_cli import detect_kind

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
CAMPAIGNS = sorted((ROOT / "campaigns").glob("*.yaml"))
SYNC = ROOT / "recipes" / "sync.yaml"
# typer's CliRunner rebuilds the click command on every call (~25 ms); build it once
app = typer.main.get_command(typer_app)
runner = CliRunner()


# --- the generated corpus: mutations of every shipped file ---------------------------------------


def _load(path: Path) -> dict:
    data = yaml.safe_load(path.read_text())
    if "base" in data:  # a campaign's base, absolute, so the mutated copy can live anywhere
        data["base"] = str((path.parent / data["base"]).resolve())
    return data


def _nodes(data, path=()):
    yield path, data
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _nodes(v, (*path, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _nodes(v, (*path, i))


def _wrong(value) -> list:
    """Values of another kind that a field holding ``value`` cannot take."""
    if isinstance(value, bool):
        return ["maybe", 2]
    if isinstance(value, int | float):
        return ["many", True]
    if isinstance(value, str):
        return [[1, 2], {"x": 1}]
    if isinstance(value, dict):
        return [5, ["x"]]
    return [5, {"x": 1}]


def _set(data, path, value):
    out = copy.deepcopy(data)
    node = out
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return out


def _rename(data, path, new):
    out = copy.deepcopy(data)
    node = out
    for p in path[:-1]:
        node = node[p]
    node[new] = node.pop(path[-1])
    return out


def _drop(data, path):
    out = copy.deepcopy(data)
    node = out
    for p in path[:-1]:
        node = node[p]
    del node[path[-1]]
    return out


def _needles(path, extra=()) -> tuple[str, ...]:
    """What the error must name: the nearest key written in the file on the mutated path."""
    keys = [p for p in path if isinstance(p, str)]
    return (*extra, keys[-1]) if keys else (*extra, "a recipe is a mapping",
                                            "a campaign is a mapping")


def _required(path, kind: str) -> bool:
    """Keys without a default where they are written (dropping them must fail)."""
    if "overrides" in path or "params" in path:
        return False  # an override left out falls back to the base recipe
    if kind == "recipe":
        return path[-1] in ("kind", "mode")  # the variant tag of a section that is written
    return path[-1] in ("name", "base", "stages") and (len(path) == 1 or path[-1] == "name")


def _mutations():
    for source in [*RECIPES, *CAMPAIGNS]:
        data = _load(source)
        kind = "campaign" if source in CAMPAIGNS else "recipe"
        for n, (path, value) in enumerate(_nodes(data)):
            where = ".".join(map(str, path)) or "<top>"
            bad = _wrong(value)[n % 2]  # every node once, the two wrong kinds in turn
            yield (f"{source.stem}:{where}:retype", _set(data, path, bad) if path else bad,
                   _needles(path))
            if path and isinstance(path[-1], str):
                renamed = f"{path[-1]}_typo"
                yield (f"{source.stem}:{where}:rename", _rename(data, path, renamed),
                       _needles(path, (renamed,)))
                if _required(path, kind):
                    yield f"{source.stem}:{where}:drop", _drop(data, path), _needles(path)


MUTATIONS = list(_mutations())


# --- hand-written hostile cases ------------------------------------------------------------------

_SYNC_TEXT = SYNC.read_text()
_CAMPAIGN = f"name: c\nbase: {SYNC}\nstages:\n  - name: a\n"


def _bomb(anchor_under: str) -> str:
    lines = [f"{anchor_under}a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"{anchor_under}{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]"
              for i in range(8)]
    return "\n".join(lines) + "\n"


# (label, file content (str → UTF-8, bytes as they are), what the message must contain)
HAND: list[tuple[str, str | bytes, tuple[str, ...]]] = [
    # anchors, aliases, bombs, cycles
    ("alias", "rollout: &r {n: 4}\neval: *r\n", ("line 2, column 7", "alias")),
    ("merge key alias", "base_: &b {n: 4}\nrollout:\n  <<: *b\n", ("line 3, column 7",)),
    ("bomb in task.args", "task:\n  name: sum_digits\n  args:\n" + _bomb("    "),
     ("line 5, column 13", "alias")),
    ("cycle in task.args", "task:\n  args: &a {self: *a}\n", ("line 2, column 19", "alias")),
    ("bomb in overrides", _CAMPAIGN + "    overrides:\n      task:\n        args:\n"
     + _bomb("          "), ("line 9, column 19", "alias")),
    ("cycle in overrides", _CAMPAIGN + "    overrides: &o {x: *o}\n", ("line 5, column 23",)),
    ("alias for a stage", _CAMPAIGN.replace("  - name: a\n", "  - &s {name: a}\n  - *s\n"),
     ("line 5, column 5",)),
    # dates
    ("impossible date", "seed: 2024-13-45\n", ("seed",)),
    ("date as a number", "rollout:\n  n: 2024-01-01\n", ("rollout.n",)),
    ("date in overrides", _CAMPAIGN + "    overrides: {rollout: {n: 2024-13-45}}\n",
     ("rollout.n",)),
    ("timestamp tag", "seed: !!timestamp 2024-01-01\n", ("line 1, column 7", "!!timestamp")),
    # numbers
    ("integer of 5000 digits", "seed: " + "7" * 5000 + "\n", ("line 1, column 7",)),
    ("integer of 20 digits", "seed: 12345678901234567890\n", ("seed",)),
    ("seed 2**63", f"seed: {2**63}\n", ("seed",)),
    ("float overflow to inf for an int", "steps: 1.0e+400\n", ("steps",)),
    ("inf for a float", "optim:\n  lr: .inf\n", ("optim.lr",)),
    ("nan for a float", "rollout:\n  temperature: .nan\n", ("rollout.temperature",)),
    ("-inf for a float", "engines:\n  logit_noise: -.inf\n", ("engines.logit_noise",)),
    ("1e400 string for an int", "rollout:\n  n: 1e400\n", ("rollout.n",)),
    ("fraction for an int", "rollout:\n  n: 8.5\n", ("rollout.n",)),
    ("huge eval cadence", "eval:\n  every: 1000000000000\n", ("eval.every",)),
    ("huge difficulty bucket", "task:\n  difficulty_weights: {99999999999: 1}\n",
     ("task.difficulty_weights",)),
    ("huge stage steps", _CAMPAIGN + f"    steps: {10**30}\n", ("stages.0.steps",)),
    ("negative hex", "rollout:\n  n: -0x10\n", ("rollout.n",)),
    # booleans
    ("yes for an int", "rollout:\n  n: yes\n", ("rollout.n",)),
    ("true for an int", "rollout:\n  n: true\n", ("rollout.n", "got true")),
    ("yes for a bool", "async:\n  mode: fully_async\n  partial_rollout: yes\n",
     ("async.partial_rollout", "got the string 'yes'")),
    ("1 for a bool", "algorithm:\n  advantage:\n    norm_by_std: 1\n",
     ("algorithm.advantage.norm_by_std",)),
    ("on for stage steps", _CAMPAIGN + "    steps: on\n", ("stages.0.steps",)),
    ("bool tag maybe", "engines:\n  sglang:\n    deterministic: !!bool maybe\n",
     ("line 3, column 20", "not a boolean")),
    # control characters and terminal escapes
    ("newline in a key", '"rol\\nlout": {n: 4}\n', ("rol\\nlout", "unknown field")),
    ("escape codes in a key", 'rollout:\n  "\\e[31mred\\e[0m": 1\n',
     ("rollout.\\x1b[31mred\\x1b[0m", "unknown field")),
    ("escape codes in the name", 'name: "\\e]0;pwned\\a"\n', ("name", "\\x1b]0;pwned\\x07")),
    ("bidi override in a key", 'eval:\n  "ev\\u202eery": 1\n', ("eval.ev\\u202eery",)),
    ("newline in a campaign name", 'name: "c\\nd"\nbase: x\nstages: [{name: a}]\n',
     ("name", "c\\nd")),
    ("escape codes in a stage name", _CAMPAIGN.replace("name: a", 'name: "\\e[2J"'),
     ("stages.0.name",)),
    ("escape codes in a gate name", _CAMPAIGN + '    gates: [{name: "\\e[2Jx"}]\n',
     ("stages.0.gates.0",)),
    ("raw BEL byte", b"name: x\x07\n", ("line 1, column 8", "U+0007")),
    ("raw ESC byte", b"name: sync\ndescription: \x1b[31mred\n", ("line 2, column 14", "U+001B")),
    ("NUL byte", b"name: sync\x00\n", ("line 1 has a NUL byte",)),
    ("NUL escape in the checkpoint path", 'model: {kind: checkpoint, path: "ckpt\\0"}\n',
     ("model.path", "ckpt\\x00")),
    ("lone surrogate escape", 'name: "\\ud800"\n', ("line 1", "not valid YAML")),
    # encodings
    ("UTF-16 with BOM", _SYNC_TEXT.encode("utf-16"), ("UTF-16",)),
    ("UTF-16-BE without BOM", _SYNC_TEXT.encode("utf-16-be"), ("NUL byte",)),
    ("UTF-32 with BOM", _SYNC_TEXT.encode("utf-32"), ("UTF-32",)),
    ("latin-1", "name: café\n".encode("latin-1"), ("line 1 is not UTF-8",)),
    ("cp1252 quotes", b"description: \x93quoted\x94\n", ("line 1 is not UTF-8", "0x93")),
    ("broken UTF-8 sequence", b"name: x\n\xe2\x28\xa1\n", ("line 2 is not UTF-8",)),
    ("UTF-8 BOM then a bad field", codecs.BOM_UTF8 + b"rollout: {n: 0}\n", ("rollout.n",)),
    # tabs
    ("tab indentation", "rollout:\n\tn: 4\n", ("line 2",)),
    ("tab before a list item", _CAMPAIGN.replace("  - name: a", "\t- name: a"), ("line 4",)),
    # tags
    ("python object tag", "name: !!python/object/apply:os.system [echo hi]\n",
     ("line 1, column 7", "tag !!python/object/apply:os.system is not allowed")),
    ("python name tag", "seed: !!python/name:os.system\n", ("line 1, column 7", "is not allowed")),
    ("binary tag", "name: !!binary aGk=\n", ("line 1, column 7", "!!binary")),
    ("set tag", "task:\n  args: !!set {a, b}\n", ("line 2, column 9", "!!set")),
    ("custom tag", "rollout: !cfg {n: 4}\n", ("line 1, column 10", "!cfg")),
    ("python tag in a campaign", "name: c\nbase: !!python/object/new:os.system [id]\n"
     "stages: [{name: a}]\n", ("line 2, column 7", "not allowed")),
    # nesting
    ("10k flow levels", "task:\n  args:\n    x: " + "[" * 10_000 + "\n", ("line 3",)),
    ("70 mapping levels", "task:\n  args: " + "{a: " * 70 + "1" + "}" * 70 + "\n",
     ("line 2", "nested more than 64 levels")),
    ("80 block levels", "task:\n  args:\n" + "".join(" " * (4 + 2 * i) + f"k{i}:\n"
                                                      for i in range(80)) + " " * 170 + "x\n",
     ("nested more than 64 levels",)),
    ("10k levels in overrides", _CAMPAIGN + "    overrides: " + "[" * 10_000 + "\n",
     ("line 5",)),
    # duplicate keys
    ("duplicate top key", "seed: 1\nsteps: 2\nseed: 3\n", ("line 3", "'seed' appears twice")),
    ("duplicate nested key", "rollout:\n  n: 4\n  n: 8\n", ("line 3", "'n' appears twice")),
    ("duplicate stage key", _CAMPAIGN + "    name: b\n", ("line 5", "'name' appears twice")),
    # empty and not a mapping
    ("empty file", "", ("the file is empty",)),
    ("comment only", "# nothing here\n# at all\n", ("the file is empty",)),
    ("document marker only", "---\n", ("the file is empty",)),
    ("null document", "null\n", ("the file is empty",)),
    ("blank lines", "\n\n   \n", ("the file is empty",)),
    ("a list", "- rollout\n- async\n", ("a recipe is a mapping", "got a list")),
    ("a string", "just some text\n", ("a recipe is a mapping", "got the string")),
    ("a number", "42\n", ("a recipe is a mapping", "got the number 42")),
    ("two documents", "name: a\n---\nname: b\n", ("line 2", "single document")),
    ("unhashable key", "? [1, 2]\n: x\n", ("line 1", "unhashable key")),
    ("null key", "~: 1\n", ("key null is not a field name",)),
    ("integer key", "rollout:\n  1: x\n", ("rollout: key the number 1 is not a field name",)),
    ("boolean key", "true: 1\n", ("key true is not a field name",)),
    # base recipes
    ("base is a directory", "name: c\nbase: /tmp\nstages: [{name: a}]\n",
     ("base: /tmp: is a directory",)),
    ("base is /dev/zero", "name: c\nbase: /dev/zero\nstages: [{name: a}]\n",
     ("base: /dev/zero: is not a regular file",)),
    ("base is a number", "name: c\nbase: 42\nstages: [{name: a}]\n",
     ("base: must be the path of a recipe file", "got the number 42")),
    ("base is a list", "name: c\nbase: [a.yaml]\nstages: [{name: a}]\n", ("base: must be",)),
    ("base is empty", "name: c\nbase: ''\nstages: [{name: a}]\n", ("base: must be",)),
    ("base does not exist", "name: c\nbase: no/such.yaml\nstages: [{name: a}]\n",
     ("base: recipe file", "does not exist")),
    ("base is a campaign", f"name: c\nbase: {ROOT / 'campaigns' / 'quick.yaml'}\n"
     "stages: [{name: a}]\n", ("base:", "stages: unknown field")),
    ("base is the campaign itself", "name: c\nbase: c.yaml\nstages: [{name: a}]\n",
     ("base:", "unknown field")),
    ("inline base with a bad field", "name: c\nbase: {rollout: {n: 0}}\nstages: [{name: a}]\n",
     ("rollout.n",)),
    # names that become paths
    ("recipe name traversal", "name: ../../../escaped/run\n", ("name", "run directory")),
    ("recipe name absolute", "name: /etc/cron.d/x\n", ("name",)),
    ("recipe name four parts", "name: a/b/c/d\n", ("name",)),
    ("recipe name dot-dot part", "name: quick/../x\n", ("name",)),
    ("campaign name traversal", "name: ../x\nbase: x.yaml\nstages: [{name: a}]\n",
     ("name", "campaign name")),
    ("stage name with a slash", _CAMPAIGN.replace("name: a", "name: a/b"),
     ("stages.0.name",)),
    ("candidate name dot-dot", _CAMPAIGN + "    candidates: [{name: '..'}]\n",
     ("stages.0.candidates.0.name",)),
    # sizes and shapes
    ("file of 100 KiB", "description: '" + "x" * 100_000 + "'\n", ("64 KiB",)),
    ("file of 2 MiB", "task:\n  args:\n    x: [" + "1, " * 700_000 + "1]\n", ("64 KiB",)),
    ("densest file under the limit", "rollout: {n: 0}\ntask:\n  args:\n    x: ["
     + "1," * 32_000 + "1]\n", ("rollout.n",)),  # 32k values: the time limit is the test
    ("150 stages", f"name: c\nbase: {SYNC}\nstages:\n"
     + "".join(f"  - name: s{i}\n" for i in range(150)), ("stages", "at most 100")),
    ("overrides not a mapping", _CAMPAIGN + "    overrides: [1, 2]\n",
     ("stages.0.overrides", "must be a mapping")),
    ("dotted override to a bad loss", _CAMPAIGN + "    overrides: {algorithm.loss.name: ppo2}\n",
     ("algorithm.loss.name", "ppo2")),
    ("empty override key", _CAMPAIGN + "    overrides: {'': 1}\n", ('"": unknown field',)),
    ("numeric string for steps", "steps: 1e5\n", ("steps",)),
    ("gate params a list", _CAMPAIGN + "    gates: [{name: is_health, params: [1]}]\n",
     ("stages.0.gates.0.params",)),
]


def _write(tmp_path: Path, content: str | bytes, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def _check_rejected(path: Path, needles: tuple[str, ...], *args: str) -> str:
    """Run `asyncrl validate` in-process and check the promises; returns the output."""
    started = time.perf_counter()
    res = runner.invoke(app, ["validate", *args, str(path)])
    elapsed = time.perf_counter() - started
    out = res.output
    lines = out.splitlines()
    assert res.exit_code == 1, (res.exit_code, out)
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert 1 <= len(lines) <= 3, out
    assert all(line.isprintable() for line in lines), out  # nothing drives the terminal
    assert "Traceback" not in out and "internal error" not in out, out
    assert lines[0].startswith(f"error: {path}"), out
    assert any(n in out for n in needles), (needles, out)
    # a hang guard, not a speed target (a case takes < 1 s; a busy 2-core machine doubles it)
    assert elapsed < 15.0, f"{elapsed:.2f} s"
    return out


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """One directory for the corpus (a fresh tmp_path per case costs more than the case)."""
    return tmp_path_factory.mktemp("corpus")


@pytest.mark.parametrize(("label", "data", "needles"), MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_every_mutation_of_a_shipped_file_is_rejected(corpus_dir, label, data, needles):
    path = _write(corpus_dir, yaml.dump(data, Dumper=yaml.CSafeDumper, sort_keys=False),
                  "mutated.yaml")
    _check_rejected(path, needles)


@pytest.mark.parametrize(("label", "content", "needles"), HAND, ids=[h[0] for h in HAND])
def test_every_hostile_file_is_rejected_in_one_line(corpus_dir, label, content, needles):
    _check_rejected(_write(corpus_dir, content), needles)


def test_the_corpus_is_large_and_covers_every_shipped_file():
    sources = {label.split(":")[0] for label, _, _ in MUTATIONS}
    assert sources == {p.stem for p in [*RECIPES, *CAMPAIGNS]}
    assert len(MUTATIONS) + len(HAND) >= 200 and len(HAND) >= 90


# --- shipped files, output formats, --kind -------------------------------------------------------


def test_every_shipped_file_is_valid():
    files = [*RECIPES, *CAMPAIGNS]
    res = runner.invoke(app, ["validate", *map(str, files)])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert [line.split(" (")[0] for line in lines] == [f"ok: {p}" for p in files]
    assert f"ok: {SYNC} (recipe sync, hash d4380df48cc2e5a5, mode sync)" in lines
    assert f"ok: {ROOT / 'campaigns' / 'quick.yaml'} (campaign quick: 4 stages, 4 candidates)" \
        in lines


def test_json_lists_every_file_and_exit_code_says_if_any_failed(tmp_path):
    bad = _write(tmp_path, "rollout: {n: 0}\n", "bad.yaml")
    missing = tmp_path / "missing.yaml"
    res = runner.invoke(app, ["validate", "--json", str(SYNC), str(bad), str(missing)])
    assert res.exit_code == 1
    assert json.loads(res.stdout) == [
        {"path": str(SYNC), "kind": "recipe", "valid": True, "error": None},
        {"path": str(bad), "kind": "recipe", "valid": False,
         "error": f"{bad}: rollout.n: Input should be greater than or equal to 1"},
        {"path": str(missing), "kind": None, "valid": False,
         "error": f"recipe or campaign file {missing} does not exist; pass a recipe or campaign "
                  "YAML file"}]
    res = runner.invoke(app, ["validate", "--json", *map(str, CAMPAIGNS)])
    assert res.exit_code == 0
    assert [e["kind"] for e in json.loads(res.stdout)] == ["campaign"] * len(CAMPAIGNS)


def test_kind_is_detected_by_content_or_forced(tmp_path):
    assert detect_kind({"stages": []}) == "campaign" and detect_kind({"base": "x"}) == "campaign"
    assert detect_kind({"rollout": {}}) == "recipe" and detect_kind([1]) == "recipe"
    res = runner.invoke(app, ["validate", "--kind", "campaign", str(SYNC)])
    assert res.exit_code == 1
    assert res.stderr.startswith(f"error: {SYNC}: base: missing; add it; stages: missing; add "
                                 "it; seed: unknown field")
    res = runner.invoke(app, ["validate", "--kind", "recipe", str(CAMPAIGNS[0])])
    assert res.exit_code == 1 and "stages: unknown field" in res.stderr
    res = runner.invoke(app, ["validate", "--kind", "module", str(SYNC)])
    assert res.exit_code == 2  # typer's own usage error


def test_a_campaign_error_names_the_campaign_file_and_the_candidate(tmp_path):
    path = _write(tmp_path, _CAMPAIGN + "    candidates:\n      - name: ok\n      - name: bad\n"
                  "        overrides: {rollout: {top_p: 2}}\n")
    out = _check_rejected(path, ("rollout.top_p",))
    assert out == (f"error: {path}: stage 'a' candidate 'bad': rollout.top_p: Input should be "
                   "less than or equal to 1\n")


def test_a_date_is_a_string_so_a_label_may_be_one(tmp_path):
    path = _write(tmp_path, _SYNC_TEXT.replace("\ndescription: ", "\ndescription: 2024-13-45 "),
                  "r.yaml")
    assert runner.invoke(app, ["validate", str(path)]).exit_code == 0
    path = _write(tmp_path, _CAMPAIGN.replace("name: c\n", "name: c\ndescription: 2024-01-01\n"))
    assert runner.invoke(app, ["validate", str(path)]).exit_code == 0


# --- real subprocesses: memory and time limits, nothing written, nothing imported ---------------


def _command() -> list[str]:
    script = Path(sys.executable).with_name("asyncrl")
    return [str(script)] if script.exists() else [sys.executable, "-m", "ui.cli"]


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # 2 GiB of address space


def _run(args: list[str], cwd: Path, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ASYNCRL_HOME": str(home)}
    return subprocess.run([*_command(), "validate", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=60, preexec_fn=_limited)


_SUBPROCESS_CASES = ["bomb in task.args", "bomb in overrides", "integer of 5000 digits",
                     "10k flow levels", "base is /dev/zero", "file of 2 MiB",
                     "escape codes in a key", "UTF-16 with BOM"]


@pytest.mark.slow
def test_hostile_files_in_a_real_process_under_memory_and_time_limits(tmp_path):
    cases = {label: (content, needles) for label, content, needles in HAND
             if label in _SUBPROCESS_CASES}
    assert len(cases) == len(_SUBPROCESS_CASES)
    for i, (label, (content, needles)) in enumerate(cases.items()):
        path = _write(tmp_path, content, f"case{i}.yaml")
        started = time.perf_counter()
        res = _run([str(path)], tmp_path, tmp_path / "home")
        elapsed = time.perf_counter() - started
        assert res.returncode == 1, (label, res.stdout, res.stderr)
        lines = res.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {path}"), (label, res.stderr)
        assert "Traceback" not in res.stderr and lines[0].isprintable(), label
        assert any(n in lines[0] for n in needles), (label, lines[0])
        assert elapsed < 20, (label, elapsed)
    assert not (tmp_path / "home").exists()


def test_validate_writes_nothing_and_imports_no_service(tmp_path):
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    env = {**os.environ, "ASYNCRL_HOME": str(home)}
    code = ("import sys; from ui.cli import app\n"
            "try:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n    assert e.code == 0, e\n"
            "print(sorted(m for m in ('torch', 'prefect', 'mlflow', 'ray', 'sqlalchemy') "
            "if m in sys.modules))")

    def imported(files: list[Path]) -> str:
        res = subprocess.run([sys.executable, "-c", code, "validate", *map(str, files)], cwd=cwd,
                             env=env, capture_output=True, text=True, timeout=60,
                             preexec_fn=_limited)
        assert res.returncode == 0, res.stderr
        lines = res.stdout.splitlines()
        assert len(lines) == len(files) + 1 and all(x.startswith("ok: ") for x in lines[:-1])
        return lines[-1]

    assert imported(RECIPES) == "[]"  # a recipe needs no torch
    # a campaign's gates read the decision tree, which needs no torch either
    assert imported([*RECIPES, *CAMPAIGNS]) == "[]"
    assert list(cwd.iterdir()) == [] and not home.exists()  # no $ASYNCRL_HOME, no .asyncrl


def test_train_refuses_a_name_that_would_leave_the_runs_directory(tmp_path, monkeypatch):
    """Issue 13 item 7: `name: ../../../escaped/run` made the run directory
    $ASYNCRL_HOME/runs/../../../escaped/run-<time>; now the recipe is refused before anything is
    created."""
    home = tmp_path / "home"
    monkeypatch.setenv("ASYNCRL_HOME", str(home))
    recipe = _write(tmp_path, _SYNC_TEXT.replace("name: sync", "name: ../../../escaped/run"),
                    "r.yaml")
    res = runner.invoke(app, ["train", str(recipe), "--steps", "1"])
    assert res.exit_code == 1
    assert res.stderr == (f"error: {recipe}: name: '../../../escaped/run' must be 1-3 parts "
                          "joined by '/', each 1-64 letters, digits, '_', '.' or '-', starting "
                          "with a letter or digit (it names the run directory)\n")
    assert not home.exists() and not (tmp_path / "escaped").exists()
