"""The source says what and why; measurements live in the docs.

Every module docstring under ``packages/*/src`` is at most 10 lines, and no docstring or
comment there (Python or C++) carries a timing figure (``40 us``, ``1.2 ms``, ``72
tokens/s``): those belong to docs/benchmarks.md ("Measurements behind the code"), where
the machine they were taken on is named. Run as a script, it prints every offence.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MAX_MODULE_DOCSTRING_LINES = 10
TIMING = re.compile(
    r"\d(?:[\d.,]*\d)?\s?(?:µs|us|ms|ns|GB/s|MB/s|tok/s|tokens/s|tokens a second)(?![\w/])"
)
_CPP_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)


def sources() -> list[Path]:
    return sorted(p for p in ROOT.glob("packages/*/src/**/*") if p.suffix in (".py", ".cpp", ".h"))


def _docstrings(tree: ast.AST) -> Iterator[ast.Constant]:
    kinds = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
    for node in ast.walk(tree):
        first = node.body[0] if isinstance(node, kinds) and node.body else None
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            yield first.value


def prose(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of each comment and docstring of ``path``."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        for match in _CPP_COMMENT.finditer(text):
            yield text.count("\n", 0, match.start()) + 1, match.group(0)
        return
    for doc in _docstrings(ast.parse(text)):
        yield doc.lineno, str(doc.value)
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def long_module_docstrings() -> list[str]:
    out = []
    for path in sources():
        if path.suffix != ".py":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
        lines = len(doc.splitlines()) if doc else 0
        if lines > MAX_MODULE_DOCSTRING_LINES:
            out.append(f"{path.relative_to(ROOT)}: a module docstring of {lines} lines")
    return out


def timing_figures() -> list[str]:
    out = []
    for path in sources():
        for line, text in prose(path):
            for match in TIMING.finditer(text):
                at = line + text.count("\n", 0, match.start())
                out.append(f"{path.relative_to(ROOT)}:{at}: {match.group(0)!r}")
    return out


def test_module_docstrings_are_short() -> None:
    assert long_module_docstrings() == []


def test_no_timing_figure_in_the_source() -> None:
    assert timing_figures() == []


def test_the_check_finds_what_it_looks_for() -> None:
    found = [m.group(0) for m in TIMING.finditer("40 us, 1.2 ms and 72 tokens/s; 3 users")]
    assert found == ["40 us", "1.2 ms", "72 tokens/s"]
    assert not TIMING.search("admission_window_ms, 4 msgs, max_new_tokens/step")


if __name__ == "__main__":
    offences = long_module_docstrings() + timing_figures()
    print("\n".join(offences) or "none")
    sys.exit(1 if offences else 0)
