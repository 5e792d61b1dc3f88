"""The rung cards (docs/rungs/<name>.md) and README.md's rung table are what ``docs/rung_cards.py`` writes
from the rungs' docstrings, every rung has both, and every docstring follows the card format."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from speedkit import rungs

REPO = Path(__file__).resolve().parents[1]
#: the most words a card may hold (the longest, explicit_mask's, has 248)
MAX_CARD_WORDS = 250


def _load_generator():
    spec = importlib.util.spec_from_file_location("rung_cards", REPO / "docs" / "rung_cards.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


cards = _load_generator()
CHECKED = rungs.names()


def test_cards_and_readme_table_are_what_the_generator_writes():
    assert cards.stale() == [], "run: python docs/rung_cards.py"


def test_every_rung_has_a_card_and_a_table_line():
    _, table, _ = cards.split_readme((REPO / "README.md").read_text(encoding="utf-8"))
    for name in rungs.names():
        assert (REPO / "docs" / "rungs" / f"{name}.md").exists(), f"rung {name} has no card"
        lines = [line for line in table if line.startswith(f"| [`{name}`](docs/rungs/{name}.md) |")]
        assert len(lines) == 1, f"rung {name} has {len(lines)} lines in README.md's rung table"
    assert len(table) == 2 + len(rungs.names()), "README.md's rung table has lines for no registered rung"


@pytest.mark.parametrize("name", CHECKED)
def test_docstring_has_every_section(name):
    module = sys.modules[rungs.get(name).__module__]
    _, sections = cards.parse(name, module.__doc__ or "")
    assert set(cards.REQUIRED) <= set(sections)
    assert len(cards.first_sentence(sections["Numerics"]).split()) <= 15, "the table's numerics cell is not short"


@pytest.mark.parametrize("name", CHECKED)
def test_card_is_short(name):
    words = len((REPO / "docs" / "rungs" / f"{name}.md").read_text(encoding="utf-8").split())
    assert words <= MAX_CARD_WORDS, f"the card of {name} has {words} words (at most {MAX_CARD_WORDS})"


def test_a_docstring_without_a_section_is_an_error_naming_the_rung_and_the_section():
    doc = "demo: a title.\n\nSpeeds up: x.\nDoes not help: y.\nNumerics: unchanged.\n"
    with pytest.raises(cards.DocstringError, match=r"rung demo: .*'Needs:'"):
        cards.parse("demo", doc)
    title, sections = cards.parse("demo", doc.replace("Numerics:", "Needs: z. Numerics:"))
    assert title == "a title." and sections["Needs"] == "z." and sections["Numerics"] == "unchanged."


def test_check_exits_1_naming_what_is_stale(tmp_path, monkeypatch, capsys):
    card = tmp_path / f"{CHECKED[0]}.md"
    card.write_text("stale\n", encoding="utf-8")
    for name in rungs.names():
        if name != CHECKED[0]:
            (tmp_path / f"{name}.md").write_text((cards.CARDS / f"{name}.md").read_text(encoding="utf-8"), encoding="utf-8")
    monkeypatch.setattr(cards, "CARDS", tmp_path)
    assert cards.main(["--check"]) == 1
    assert f"{CHECKED[0]}.md is stale" in capsys.readouterr().err
