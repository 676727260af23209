"""docs/gates.md is generated from the gates' code and must not drift from it."""

from pathlib import Path

from registry.gates import gate_names
from registry.gates.reference import markdown

DOC = Path(__file__).resolve().parents[3] / "docs" / "gates.md"


def test_the_checked_in_page_is_the_generated_one():
    assert DOC.read_text() == markdown(), (
        "docs/gates.md is out of date: run `python -m registry.gates.reference > docs/gates.md`")


def test_every_gate_and_parameter_is_documented():
    text = markdown()
    for name in gate_names():
        assert f"### `{name}`" in text
    assert "Bonferroni" in text and "`eval/n`" in text


def test_the_evidence_page_is_generated_from_the_real_histories():
    import importlib.util

    root = DOC.parents[1]
    spec = importlib.util.spec_from_file_location("gate_evidence",
                                                  root / "benchmarks" / "gate_evidence.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (root / "docs" / "gate-evidence.md").read_text() == module.markdown(), (
        "docs/gate-evidence.md is out of date: run "
        "`python benchmarks/gate_evidence.py > docs/gate-evidence.md`")
