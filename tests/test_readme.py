import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs(capsys):
    """The README's "Calling the library" example is real code: run it."""
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README lost its python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    assert namespace["log_prob"].grad is not None
    assert "is/engine/ess" in namespace["metrics"]
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[1].startswith("(")


def test_readme_quick_start_matches_ci():
    """.ci/run must run the README's test command verbatim."""
    ci = (README.parent / ".ci" / "run").read_text()
    commands = re.findall(r"```bash\n\s*(.*?)\n\s*```", README.read_text(), flags=re.S)
    assert len(commands) >= 2
    assert commands[1].strip() in ci
