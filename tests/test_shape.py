"""The engine's shape: what a strategy's levels decide, and how a global collective splits into
phases, are each written once (``paro_fsdp/plan.py`` / ``strategy.py``, ``collectives.HIER``);
a collective's kind is ``collectives.Kind``, not a string matched in many places. An AST scan, so
a second copy fails here rather than drifting silently from the first."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("paro_fsdp", "passes", "tests")
#: where the per-level rules live
PLAN = {"paro_fsdp/plan.py", "paro_fsdp/strategy.py"}
#: level comparisons that stay, and why
ALLOWED = {
    # the geometry of a level (where a tensor's rows live at N / I / G): layout's arguments are
    # levels and it answers for any of them, it decides no strategy's buffers
    ("paro_fsdp/layout.py", "local_slice"), ("paro_fsdp/layout.py", "local_view"),
    # being rewritten by the memory-budget work at the same time; to be moved to the plan after it
    ("paro_fsdp/cost/budget.py", "*"), ("paro_fsdp/cost/ledger.py", "peak_terms"),
}
KINDS = {"all_gather", "reduce_scatter", "all_reduce"}
DIMS = {"intra", "inter", "global"}
_LEVEL_NAMES = {"_N", "_I", "_G"}
_COMPARE = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)


def _files():
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel != "tests/test_shape.py":
                yield rel, ast.parse(path.read_text(), rel)


def _functions(tree: ast.AST):
    """(node, name of the innermost function around it) for every node."""
    def walk(node, fn):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            yield child, name
            yield from walk(child, name)
    yield from walk(tree, "<module>")


def _is_level(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id == "Level" and node.attr in ("N", "I", "G")
    if isinstance(node, ast.Name):
        return node.id in _LEVEL_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_level(e) for e in node.elts)
    return False


def _named(node: ast.AST, enum: str, strings: set[str]) -> bool:
    """``node`` names a kind (``Kind.X`` / a kind's string) or a dimension."""
    if isinstance(node, ast.Constant):
        return node.value in strings
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == enum


def level_comparisons() -> list[str]:
    out = []
    for rel, tree in _files():
        if rel in PLAN or not rel.startswith("paro_fsdp/") and not rel.startswith("passes/"):
            continue
        for node, fn in _functions(tree):
            if (isinstance(node, ast.Compare) and any(isinstance(op, _COMPARE) for op in node.ops)
                    and any(_is_level(x) for x in (node.left, *node.comparators))
                    and (rel, fn) not in ALLOWED and (rel, "*") not in ALLOWED):
                out.append(f"{rel}:{node.lineno} ({fn})")
    return out


def phase_splits() -> list[str]:
    """(kind, dimension) pairs written as literals: a global collective's phases, or a table of
    them, outside ``collectives.py``."""
    out = []
    for rel, tree in _files():
        if rel == "paro_fsdp/collectives.py":
            continue
        for node, _ in _functions(tree):
            if (isinstance(node, (ast.Tuple, ast.List)) and len(node.elts) == 2
                    and _named(node.elts[0], "Kind", KINDS) and _named(node.elts[1], "Dim", DIMS)):
                out.append(f"{rel}:{node.lineno}")
    return out


def kind_strings_matched() -> list[str]:
    """A kind's name compared as a string in the package or the passes (``Kind`` is the type)."""
    out = []
    for rel, tree in _files():
        if rel == "paro_fsdp/collectives.py" or rel.startswith("tests/"):
            continue
        for node, _ in _functions(tree):
            if isinstance(node, ast.Compare) and any(
                    isinstance(x, ast.Constant) and x.value in KINDS for x in (node.left, *node.comparators)):
                out.append(f"{rel}:{node.lineno}")
    return out


def test_levels_are_compared_only_in_the_plan():
    """What P / G / OS levels decide about buffers, storage and memory is asked of ``Plan``."""
    assert level_comparisons() == []


def test_the_phase_split_is_written_once():
    assert phase_splits() == []


def test_kinds_are_one_type():
    assert kind_strings_matched() == []


if __name__ == "__main__":
    print("\n".join(level_comparisons() + phase_splits() + kind_strings_matched()))
