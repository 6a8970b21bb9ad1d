"""Rebuild the embedded training corpus from the running Python's standard library docstrings.

Why: the default training run must need no download, and the docstrings of the standard
library are a few MB of English prose and code already on every machine that runs Python.
The shipped file (``corpus/python_stdlib_docstrings.txt``) was produced by this script under
CPython 3.11; rerunning it under another version gives slightly different text, so the
trainer always reads the shipped file, never a freshly built one.

Run: ``python -m tools.build_corpus [--max-bytes N]``.
Documents (one per module) are separated by form-feed lines, which the text loader treats as
document boundaries.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import warnings
from pathlib import Path

# Prose-heavy, import-safe modules, in a fixed order (the order of the corpus).
MODULES = (
    "abc argparse array ast asyncio base64 bisect builtins bz2 calendar cmath codecs collections "
    "collections.abc concurrent.futures configparser contextlib copy csv dataclasses datetime decimal "
    "difflib dis email enum filecmp fnmatch fractions ftplib functools gc getopt gettext glob gzip hashlib "
    "heapq hmac html html.parser http.client http.server imaplib importlib inspect io ipaddress itertools "
    "json keyword linecache locale logging logging.handlers lzma mailbox math mimetypes multiprocessing "
    "numbers operator optparse os os.path pathlib pickle pkgutil platform plistlib poplib pprint profile "
    "pstats queue random re reprlib sched secrets selectors shelve shlex shutil signal smtplib socket "
    "socketserver sqlite3 ssl stat statistics string struct subprocess symtable sys sysconfig tarfile "
    "tempfile textwrap threading time timeit token tokenize tomllib trace traceback types typing "
    "unicodedata unittest unittest.mock urllib.parse urllib.request uuid warnings weakref xml.dom.minidom "
    "xml.etree.ElementTree zipfile zlib"
).split()


def _docs_of(module) -> list[str]:
    """Module docstring, then every public class/function/method docstring defined in it."""
    out = []
    doc = inspect.getdoc(module)
    if doc:
        out.append(f"Module {module.__name__}\n\n{doc}")
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj):
            d = inspect.getdoc(obj)
            if d:
                out.append(f"{module.__name__}.{name}\n\n{d}")
            if inspect.isclass(obj):
                for mname, member in sorted(vars(obj).items()):
                    if mname.startswith("_"):
                        continue
                    md = inspect.getdoc(member) if callable(member) or isinstance(member, property) else None
                    if md and md != d:
                        out.append(f"{module.__name__}.{name}.{mname}\n\n{md}")
    return out


def build(max_bytes: int = 1_500_000) -> str:
    docs, seen, total = [], set(), 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for modname in MODULES:
            try:
                module = importlib.import_module(modname)
            except Exception:  # noqa: BLE001 - a module missing from this build is skipped
                continue
            parts = [p for p in _docs_of(module) if p not in seen]
            seen.update(parts)
            text = "\n\n".join(parts).strip()
            if not text:
                continue
            size = len(text.encode("utf-8"))
            if total + size > max_bytes:
                break
            docs.append(text)
            total += size
    return "\n\f\n".join(docs) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-bytes", type=int, default=1_500_000)
    parser.add_argument(
        "--out",
        default=str(
            Path(__file__).resolve().parents[1] / "paro_fsdp" / "train" / "corpus" / "python_stdlib_docstrings.txt"
        ),
    )
    args = parser.parse_args(argv)
    text = build(args.max_bytes)
    Path(args.out).write_text(text, encoding="utf-8")
    print(f"wrote {len(text.encode('utf-8')):,} bytes, {text.count(chr(12)) + 1} documents to {args.out} "
          f"(Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
