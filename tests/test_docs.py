"""The docs are a map of the tree as it is: every module under `streamsync/` is named in docs/architecture.md's
map, and every repository path a doc names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PATH = re.compile(r"(?<![\w./-])((?:streamsync|tests|benchmarks|docs|examples|scripts|pipelines)/[\w./-]*[\w/])")


def _map_entries() -> dict[str, str]:
    """The map's entries (its lines at two spaces' indent, e.g. "plan/" or "verify.py, checksum.py") with
    their text, continuation lines included."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Where things are", 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        m = re.match(r"^  (\S.*?)(?:\s{2,}.*)?$", line)
        if m and not line.startswith("   "):
            current = m.group(1).strip()
            entries[current] = line
        elif current and line.startswith("    "):
            entries[current] += " " + line.strip()
    return entries


def test_the_architecture_map_names_every_module():
    # A top-level module has its own entry; a package's module is named in its package's entry (a package two
    # levels down, by its folder: transports/shm/).
    entries = _map_entries()
    missing = []
    for p in sorted((ROOT / "streamsync").rglob("*.py")):
        parts = p.relative_to(ROOT / "streamsync").parts
        if p.name in ("__init__.py", "__main__.py"):
            continue
        if len(parts) == 1:
            ok = any(re.search(rf"(^|[\s,]){re.escape(p.name)}(,|$)", key) for key in entries)
        else:
            want = p.name if len(parts) == 2 else parts[1] + "/"
            ok = want in entries.get(parts[0] + "/", "")
        if not ok:
            missing.append("/".join(parts))
    assert not missing, f"docs/architecture.md's map does not name {missing}"


def test_every_path_a_doc_names_exists():
    gone = []
    for doc in DOCS:
        for m in PATH.finditer(doc.read_text()):
            path = m.group(1).split("::")[0].rstrip(".")
            if "*" in path or "{" in path:
                continue
            if not (ROOT / path).exists():
                gone.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not gone, "docs name paths that do not exist:\n" + "\n".join(sorted(set(gone)))
