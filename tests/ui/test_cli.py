import json
import subprocess
import sys

from typer.testing import CliRunner

from ui.cli import app

runner = CliRunner()


def test_version_and_help():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.stdout.startswith("asyncrl ")
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0 and "algorithms" in res.stdout


def test_help_imports_nothing_heavy():
    code = ("import sys; from ui.cli import app; "
            "from typer.testing import CliRunner; CliRunner().invoke(app, ['--help']); "
            "heavy = [m for m in ('torch', 'prefect', 'mlflow', 'ray', 'sqlalchemy') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_algorithms_list_names_every_family():
    res = runner.invoke(app, ["algorithms", "list"], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    for name in ("vanilla", "grpo", "k3+", "decoupled_token_icepop", "seq_mean_k1", "icepop"):
        assert name in res.stdout


def test_diagnose_command(tmp_path):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"mismatch/engine/probs_pearson": 0.9,
                             "mismatch/engine/kl_k1": 0.01, "mismatch/engine/exact": 1.0,
                             "rollout/response_length/mean": [100, 100, 140]}))
    res = runner.invoke(app, ["algorithms", "diagnose", str(f)])
    assert res.exit_code == 0, res.output
    assert "Cause A" in res.stdout and "Cause F" in res.stdout
    assert "mismatch/engine/probs_pearson = 0.9 < 0.95" in res.stdout


def test_diagnose_bad_input_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    res = runner.invoke(app, ["algorithms", "diagnose", str(bad)])
    assert res.exit_code == 1
    assert res.stderr.startswith("error: ") and "not valid JSON" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and res.exception.__class__ is SystemExit
    res = runner.invoke(app, ["algorithms", "diagnose", str(tmp_path / "missing.json")])
    assert res.exit_code == 1 and "is not a file" in res.stderr
    bad.write_text('{"mismatch/engine/kl_k1": "high"}')
    res = runner.invoke(app, ["algorithms", "diagnose", str(bad)])
    assert res.exit_code == 1 and "must be a number" in res.stderr
