"""The docs site: the generated pages equal their generator's output (``python -m ui.docgen``),
and the README's relative links point at files that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ui import docgen

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("page", sorted(docgen.PAGES))
def test_the_checked_in_page_is_the_generated_one(page):
    assert (ROOT / page).read_text() == docgen.PAGES[page](), (
        f"{page} is out of date: run `python -m ui.docgen`")


def test_the_cli_reference_has_every_command():
    import typer.main

    from ui.cli import app

    text = (ROOT / "docs" / "reference" / "cli.md").read_text()

    def walk(path, cmd):
        assert f"`{path}`" in text, path
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(f"{path} {name}", sub)

    walk("asyncrl", typer.main.get_command(app))
    assert "`--checkpoint-every`" in text and "`--max-batch`" in text  # train; engine serve


def test_the_recipe_and_campaign_references_have_every_field():
    recipe = (ROOT / "docs" / "reference" / "recipe.md").read_text()
    for path in ("`seed`", "`engines.megatron.tensor_parallel`", "`async.staleness_threshold`",
                 "`algorithm.correction.staleness.method`", "`optim.vcpo.min_scale`",
                 "`eval.n`"):
        assert path in recipe, path
    campaign = (ROOT / "docs" / "reference" / "campaign.md").read_text()
    for path in ("`base`", "`stages[].rerun_reference`", "`stages[].candidates[].overrides`",
                 "`stages[].gates[].relative_to`"):
        assert path in campaign, path


def _relative_links(markdown: str) -> list[str]:
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)  # not inside code blocks
    text = re.sub(r"`[^`\n]*`", "", text)  # nor code spans
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not
            t.startswith("#")]


def test_every_relative_link_in_the_readme_exists():
    links = _relative_links((ROOT / "README.md").read_text())
    assert links, "the README links into docs/"
    missing = [t for t in links if not (ROOT / t.split("#")[0]).exists()]
    assert missing == []


def test_every_page_is_in_the_site_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    assert [p for p in pages if f": {p}\n" not in nav] == []


def test_the_link_check_sees_links():
    assert _relative_links("[a](docs/x.md#y) [b](https://e.org) [c](#z) `[d](e.md)`\n"
                           "```\n[f](g.md)\n```") == ["docs/x.md#y"]
