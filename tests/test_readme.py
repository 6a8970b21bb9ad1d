"""README.md stays a front page and its examples stay true.

(a) README.md is at most 300 lines and names no tracker items ("issue 6") nor "the spec";
(b) the python block of its "Using it" section runs as written on 4 CPU ranks under torchrun
    and trains (the loss it prints falls);
(c) every relative link in README.md and docs/*.md points at a file that exists, and every
    #anchor into a Markdown file at one of its headings.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_LINES = 300
# docs/ARCHITECTURE.md is kept by its own author: links are checked there, wording is not
WORDING_EXEMPT = {"ARCHITECTURE.md"}

TRACKER = [
    (re.compile(r"\bissues?\s*#?\s*\d+", re.IGNORECASE), "a tracker reference (issue N)"),
    (re.compile(r"PARO_SPEC"), "PARO_SPEC"),
    (re.compile(r"\bthe spec\b", re.IGNORECASE), '"the spec"'),
]


def wording_problems(text: str, name: str) -> list[str]:
    """Tracker references and mentions of the spec, one line each."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern, what in TRACKER:
            if pattern.search(line):
                out.append(f"{name}:{number}: {what}: {line.strip()}")
    return out


def readme_problems(text: str) -> list[str]:
    lines = text.splitlines()
    out = [f"README.md has {len(lines)} lines, more than {MAX_LINES}: move details into docs/"] \
        if len(lines) > MAX_LINES else []
    return out + wording_problems(text, "README.md")


def test_readme_is_a_front_page():
    problems = readme_problems(README.read_text())
    assert not problems, "\n".join(problems)


def test_docs_name_no_tracker_items():
    problems = []
    for doc in sorted(DOCS.glob("*.md")):
        if doc.name not in WORDING_EXEMPT:
            problems += wording_problems(doc.read_text(), f"docs/{doc.name}")
    assert not problems, "\n".join(problems)


# ---- (b) the "Using it" script ------------------------------------------------------------------

def section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section, up to the next ``## ``."""
    match = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"README.md has no '## {heading}' section"
    return match.group(1)


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


LOSS = re.compile(r"step (\d+): loss ([0-9.]+)")


def test_using_it_script_runs_and_trains(tmp_path):
    blocks = python_blocks(section(README.read_text(), "Using it"))
    assert len(blocks) == 1, f"'Using it' should hold one python block, it holds {len(blocks)}"
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(script)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the 'Using it' script ran past 120 s:\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    losses = [(int(step), float(loss)) for step, loss in LOSS.findall(proc.stdout)]
    assert len(losses) >= 2, f"no loss lines ('step N: loss X') in its output:\n{proc.stdout[-4000:]}"
    assert losses[-1][1] < 0.5 * losses[0][1], f"the loss did not fall: {losses}"
    assert "CommStats" in proc.stdout and "'peak'" in proc.stdout, proc.stdout[-4000:]


# ---- (c) links ----------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"`", "", heading.strip().lower())
    heading = re.sub(r"[^\w\- ]", "", heading)
    return heading.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    for match in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.MULTILINE):
        base = slug(match.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def link_problems(path: Path) -> list[str]:
    out = []
    name = path.relative_to(ROOT)
    for target in LINK.findall(prose(path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            out.append(f"{name}: link to {target}: {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest} "
                       f"does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{name}: link to {target}: {dest.name} has no heading #{anchor}")
    return out


def test_relative_links_resolve():
    problems = []
    for path in [README, *sorted(DOCS.glob("*.md"))]:
        problems += link_problems(path)
    assert not problems, "\n".join(problems)
