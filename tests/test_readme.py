import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ALGORITHMS = ROOT / "docs" / "algorithms.md"  # the "Calling the library" example lives here


def test_docs_python_example_runs(capsys):
    """The "Calling the library" example of docs/algorithms.md is real code: run it."""
    text = ALGORITHMS.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "docs/algorithms.md lost its python example"
    namespace: dict = {}
    exec(compile(blocks[0], "docs/algorithms.md", "exec"), namespace)
    assert namespace["log_prob"].grad is not None
    assert "is/engine/ess" in namespace["metrics"]
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[1].startswith("(")


def test_readme_quick_start_matches_ci():
    """.ci/run must run the README's test command and its slow-test command verbatim, and the
    two together select every test (one deselects ``slow``, the other selects only it)."""
    ci = (README.parent / ".ci" / "run").read_text()
    commands = re.findall(r"```bash\n\s*(.*?)\n\s*```", README.read_text(), flags=re.S)
    assert len(commands) >= 3
    test, slow = commands[1].strip(), commands[2].strip()
    assert test in ci and slow in ci
    assert ci.index(test) < ci.index(slow)
    assert test.endswith('pytest -q -m "not slow"') and slow.endswith("pytest -q -m slow")


def test_readme_test_command_builds_the_docs_strictly():
    """The test command builds the docs site in strict mode, so a broken link fails CI."""
    commands = re.findall(r"```bash\n\s*(.*?)\n\s*```", README.read_text(), flags=re.S)
    assert "mkdocs build --strict" in commands[1]
