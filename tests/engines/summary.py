"""Print the table of what the real-engine suites observed: `python -m tests.engines.summary DIR`.

One row per (engine, version, component, dtype, mode, fault), "unguarded -> guarded", from the
JSON lines each suite's `outcome` fixture wrote; repeated cases are listed once.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = ("engine", "version", "component", "dtype", "mode", "fault", "unguarded", "guarded")


def rows(directory: Path) -> list[dict[str, str]]:
    seen: dict[tuple[str, ...], dict[str, str]] = {}
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                seen[tuple(str(row[c]) for c in COLUMNS[:6])] = row
    return list(seen.values())


def table(records: list[dict[str, str]]) -> str:
    lines = [
        "| " + " | ".join(COLUMNS[:6]) + " | unguarded -> guarded |",
        "|" + "---|" * 7,
    ]
    for row in records:
        cells = [str(row[c]) for c in COLUMNS[:6]]
        lines.append("| " + " | ".join(cells) + f" | {row['unguarded']} -> {row['guarded']} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    directory = Path(argv[0] if argv else ".engines/results")
    records = rows(directory)
    if not records:
        print(f"no engine outcomes recorded under {directory}", file=sys.stderr)
        return 1
    print(table(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
