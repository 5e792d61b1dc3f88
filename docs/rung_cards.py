"""Rung cards: docs/rungs/<name>.md and README.md's rung table, generated from the rungs' module docstrings.

A dev tool, not part of the installed package::

    python docs/rung_cards.py           # write the cards and the README table
    python docs/rung_cards.py --check   # exit 1, naming each stale or missing file, if they differ

The docstring of every registered rung (``speedkit.rungs.names()``) has this format:

* **Title**: its first paragraph (the lines before the first blank line), ``"<name>: <what it does>"``,
  one sentence; it is the table's "what it does" cell, so it reads as one line.
* **Sections**: a section starts with its label, ``Speeds up:``, ``Does not help:``, ``Needs:``,
  ``Numerics:`` (all four required) or ``Costs:`` (optional), either at the start of a paragraph or
  right after a sentence's end (``". "`` or ``".) "``, a line break counting as a space) inside one; it runs to the
  next label or to the end of its paragraph (a blank line). Each label appears at most once; sections
  may share a paragraph or have one each, in any order.
* **The rest**: paragraphs that start with no label are prose (how the rung does it), not in the card.
* The first sentence of ``Numerics:`` (up to the first ``". "``) is the table's numerics cell: make it short
  ("unchanged.", "bf16 / fp16.").

A docstring that breaks the format is an error naming the rung and what is missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from speedkit import rungs  # noqa: E402

README = REPO / "README.md"
CARDS = REPO / "docs" / "rungs"
START, END = "<!-- rungs:start -->", "<!-- rungs:end -->"
REQUIRED = ("Speeds up", "Does not help", "Needs", "Numerics")
LABELS = ("Speeds up", "Does not help", "Costs", "Needs", "Numerics")  # in a card's order
#: where a label may start a section: a paragraph's start, or after a sentence's end
_LABEL = re.compile(r"(?:^|(?<=\. )|(?<=\.\) ))(" + "|".join(re.escape(label) for label in LABELS) + r"):\s")


class DocstringError(ValueError):
    """A rung's docstring does not follow the format above."""


@dataclasses.dataclass
class RungDoc:
    name: str
    module: str
    title: str
    sections: dict[str, str]
    options: str


def markdown(text: str) -> str:
    """reST inline markup of the docstrings as Markdown: ``x`` → `x`, :mod:`a.b` → `a.b`, :class:`~a.B` → `B`."""
    text = re.sub(
        r":(?:mod|class|func|meth|attr|data):`~?([^`]+)`",
        lambda m: "`" + (m.group(1).rsplit(".", 1)[-1] if m.group(0).count("~") else m.group(1)) + "`",
        text,
    )
    return text.replace("``", "`")


def paragraphs(doc: str) -> list[str]:
    """The docstring's paragraphs, each one line (its lines joined by single spaces)."""
    return [" ".join(line.strip() for line in block.splitlines()) for block in re.split(r"\n\s*\n", doc.strip())]


def parse(name: str, doc: str) -> tuple[str, dict[str, str]]:
    """The title and the labelled sections of rung ``name``'s docstring ``doc``."""
    title, *rest = paragraphs(doc)
    prefix = f"{name}: "
    if not title.startswith(prefix):
        raise DocstringError(f"rung {name}: the docstring's first line must start with {prefix!r}")
    sections: dict[str, str] = {}
    for paragraph in rest:
        found = list(_LABEL.finditer(paragraph))
        if not found or found[0].start() != 0:
            if found:
                raise DocstringError(
                    f"rung {name}: {found[0].group(1)!r} inside a paragraph that does not start with a label: {paragraph[:60]!r}"
                )
            continue
        for match, following in zip(found, [*found[1:], None]):
            label = match.group(1)
            if label in sections:
                raise DocstringError(f"rung {name}: the section {label!r} appears twice")
            sections[label] = paragraph[match.end() : following.start() if following else None].strip()
    missing = [label for label in REQUIRED if not sections.get(label)]
    if missing:
        raise DocstringError(f"rung {name}: the docstring has no {', '.join(repr(m + ':') for m in missing)} section")
    return title[len(prefix) :], sections


def options_line(cls: type) -> str:
    fields = dataclasses.fields(cls.Options)
    if not fields:
        return "**Options:** none."

    def default(field: dataclasses.Field) -> object:
        return field.default_factory() if field.default is dataclasses.MISSING else field.default  # type: ignore[misc]

    return f"**Options** (`{cls.Options.__name__}`): " + ", ".join(f"`{f.name}={default(f)!r}`" for f in fields) + "."


def read_rungs() -> list[RungDoc]:
    docs = []
    for name in rungs.names():
        cls = rungs.get(name)
        module = sys.modules[cls.__module__]
        title, sections = parse(name, module.__doc__ or "")
        docs.append(RungDoc(name, module.__name__, title, sections, options_line(cls)))
    return docs


def first_sentence(text: str) -> str:
    return re.split(r"\.(?:\s|$)", text, maxsplit=1)[0]


def readme_anchor(readme: str) -> str:
    """GitHub's anchor of the README heading the table sits under."""
    heading = [line for line in readme[: readme.index(START)].splitlines() if line.startswith("#")][-1]
    slug = heading.lstrip("#").strip().lower()
    return "#" + re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", slug))


def card(doc: RungDoc, anchor: str) -> str:
    path = doc.module.replace(".", "/") + ".py"
    lines = [f"# `{doc.name}`", "", markdown(doc.title[0].upper() + doc.title[1:]), ""]
    for label in LABELS:
        if label in doc.sections:
            lines += [f"**{label}:** {markdown(doc.sections[label])}", ""]
    lines += [
        doc.options,
        "",
        f"Generated from the docstring of [`{path}`](../../{path}) by `docs/rung_cards.py`; "
        f"back to [the rung table](../../README.md{anchor}).",
        "",
    ]
    return "\n".join(lines)


def cell(text: str) -> str:
    return markdown(text).replace("|", "\\|")


def row(doc: RungDoc) -> str:
    numerics = first_sentence(doc.sections["Numerics"])
    return f"| [`{doc.name}`](docs/rungs/{doc.name}.md) | {cell(doc.title.rstrip('.'))} | {cell(numerics)} |"


def table(docs: list[RungDoc]) -> list[str]:
    return ["| rung | what it does | numerics |", "|---|---|---|", *(row(doc) for doc in docs)]


def split_readme(readme: str) -> tuple[str, list[str], str]:
    """README.md's text before the table's markers, the lines between them, and the text after."""
    if readme.count(START) != 1 or readme.count(END) != 1:
        raise SystemExit(f"README.md must hold {START} and {END} once each")
    head, rest = readme.split(START, 1)
    body, tail = rest.split(END, 1)
    return head + START, body.strip("\n").splitlines(), END + tail


def expected() -> tuple[dict[Path, str], str, list[RungDoc]]:
    """The cards' text by path, the README's text, and the rungs read, as the generator writes them."""
    docs = read_rungs()
    readme = README.read_text(encoding="utf-8")
    anchor = readme_anchor(readme)
    head, _, tail = split_readme(readme)
    cards = {CARDS / f"{doc.name}.md": card(doc, anchor) for doc in docs}
    return cards, head + "\n" + "\n".join(table(docs)) + "\n" + tail, docs


def shown(path: Path) -> str:
    return str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)


def stale() -> list[str]:
    """What differs from what the generator writes, one line each."""
    cards, readme, _ = expected()
    problems = []
    for path, text in cards.items():
        if not path.exists():
            problems.append(f"{shown(path)} is missing")
        elif path.read_text(encoding="utf-8") != text:
            problems.append(f"{shown(path)} is stale")
    problems += [f"{shown(path)} is no registered rung's card" for path in sorted(CARDS.glob("*.md")) if path not in cards]
    _, have, _ = split_readme(README.read_text(encoding="utf-8"))
    _, want, _ = split_readme(readme)
    if have != want:
        problems.append("README.md's rung table (between the rungs:start and rungs:end markers) is stale")
    return problems


def write() -> list[Path]:
    cards, readme, _ = expected()
    CARDS.mkdir(parents=True, exist_ok=True)
    written = []
    for path, text in cards.items():
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            written.append(path)
    for path in CARDS.glob("*.md"):
        if path not in cards:
            path.unlink()
            written.append(path)
    if README.read_text(encoding="utf-8") != readme:
        README.write_text(readme, encoding="utf-8")
        written.append(README)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a card or the README table is stale")
    args = parser.parse_args(argv)
    try:
        if args.check:
            problems = stale()
            for problem in problems:
                print(problem, file=sys.stderr)
            if problems:
                print("run: python docs/rung_cards.py", file=sys.stderr)
            return 1 if problems else 0
        for path in write():
            print(f"wrote {shown(path)}")
    except DocstringError as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
