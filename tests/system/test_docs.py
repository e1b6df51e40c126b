"""README.md and docs/ stay in step: the README is a short newcomer's page, the reference lives
in docs/, and every link between them lands.

Checked: every relative link of README.md and docs/*.md names an existing file and, with a
`#anchor` into a Markdown file, one of its headings (GitHub's slugs: lower case, punctuation
but `-` and `_` dropped, spaces to `-`, `-1`, `-2` for repeats); the README is at most
MAX_README_LINES lines and links every docs page; every `make <target>` they name is a Makefile
target; the README's engines table starts each real server under its profile.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
MAX_README_LINES = 260

# Each real server of `make e2e`: the profile and the command its README row starts it with.
ENGINE_STARTS = {
    "vLLM": ("vllm.toml", "python -m vllm.entrypoints.openai.api_server --model M"),
    "SGLang": ("sglang.toml", "python -m sglang.launch_server --model-path M"),
    "transformers serve": ("transformers-serve.toml", "transformers serve M`"),
    "transformers serve --continuous-batching": (
        "transformers-serve.toml",
        "transformers serve M --continuous-batching",
    ),
}

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`]*`")
LINK = re.compile(r"\]\(([^()\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.IGNORECASE)
MAKE = re.compile(r"\bmake ([A-Za-z0-9][\w.-]*)")
MAKE_TARGET = re.compile(r"^([A-Za-z0-9][\w.-]*)\s*:(?!=)", re.MULTILINE)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in HEADING.findall(FENCE.sub("", text)):
        slug = _slug(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(text: str) -> list[str]:
    """Every link target outside code, external ones (`https:`, `mailto:`) left out."""
    prose = CODE_SPAN.sub("", FENCE.sub("", text))
    return [target for target in LINK.findall(prose) if not EXTERNAL.match(target)]


def _broken_links(page: Path) -> list[str]:
    broken = []
    for target in dict.fromkeys(_links(page.read_text(encoding="utf-8"))):
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif (
            anchor
            and dest.suffix == ".md"
            and anchor not in _anchors(dest.read_text(encoding="utf-8"))
        ):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    return broken


def _code(text: str) -> str:
    """Fenced blocks and inline code spans: where commands are written."""
    return "\n".join(
        [m.group(0) for m in FENCE.finditer(text)] + CODE_SPAN.findall(FENCE.sub("", text))
    )


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_relative_link_lands_on_a_file_and_heading(page: Path) -> None:
    assert not _broken_links(page), _broken_links(page)


def test_a_broken_link_or_anchor_is_reported(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## It's here: `[x]`\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#its-here-x) [ok](#page) [web](https://example.com/x#y)\n"
        "[gone](missing.md) [bad anchor](other.md#nowhere) [self](#nothing)\n"
        "`[in code](missing.md)`\n\n```\n[in a block](missing.md)\n```\n",
        encoding="utf-8",
    )
    assert _broken_links(page) == [
        "missing.md: no such file",
        "other.md#nowhere: no heading #nowhere in other.md",
        "#nothing: no heading #nothing in page.md",
    ]


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        (
            "Is it on the path the engine runs? The heartbeat",
            "is-it-on-the-path-the-engine-runs-the-heartbeat",
        ),
        ("Attach points: `[[attach]]`", "attach-points-attach"),
        (
            "A poisoned request's KV never reaches another request",
            "a-poisoned-requests-kv-never-reaches-another-request",
        ),
        ("What a guarded call does (per logits row)", "what-a-guarded-call-does-per-logits-row"),
        ("guardrails' own server", "guardrails-own-server"),
    ],
)
def test_slugs_follow_githubs_rules(heading: str, slug: str) -> None:
    assert _slug(heading) == slug


def test_repeated_headings_get_numbered_anchors() -> None:
    assert _anchors("# A\n## B\n## B\n```\n# C\n```\n") == {"a", "b", "b-1"}


def test_readme_is_short() -> None:
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines: move reference to docs/"


def test_readme_links_every_docs_page() -> None:
    linked = {
        (ROOT / target.partition("#")[0]).resolve()
        for target in _links(README.read_text(encoding="utf-8"))
    }
    assert [_rel(page) for page in DOCS if page.resolve() not in linked] == []


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_make_target_named_exists(page: Path) -> None:
    targets = set(MAKE_TARGET.findall((ROOT / "Makefile").read_text(encoding="utf-8")))
    named = set(MAKE.findall(_code(page.read_text(encoding="utf-8"))))
    assert named - targets == set()


def test_readme_names_the_two_commands() -> None:
    code = _code(README.read_text(encoding="utf-8"))
    assert {"demo", "test"} <= set(MAKE.findall(code))


@pytest.mark.parametrize("server", ENGINE_STARTS)
def test_readme_engines_table_starts_each_real_server(server: str) -> None:
    profile, command = ENGINE_STARTS[server]
    assert (ROOT / "config" / "profiles" / profile).is_file()
    rows = [
        line
        for line in _section(README.read_text(encoding="utf-8"), "Engines").splitlines()
        if line.startswith("|")
    ]
    start = f"guardrails run --config config/profiles/{profile} -- {command}"
    assert any(start in row for row in rows), f"{server}: no row starts it with `{start}`"
