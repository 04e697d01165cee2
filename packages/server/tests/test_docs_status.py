"""The README and the documentation say one thing about status, and it matches the code.

**One truth.** ``docs/status.md`` holds the status summary between the snippet markers
``<!-- --8<-- [start:summary] -->`` and ``<!-- --8<-- [end:summary] -->``. The home page
includes it (``--8<-- "status.md:summary"``, pymdownx.snippets), and the README's status
paragraph, between ``<!-- status:start ... -->`` and ``<!-- status:end -->``, is the same
text with its links made relative to the repository root. Run this file as a script
(``python packages/server/tests/test_docs_status.py``) to rewrite the README's copy.

**No stale claims.** Every page of ``docs/`` and the README, except the changelog (its
entries describe the state at their release), is cut into clauses: a heading, an
admonition's title, the sentences of a paragraph or list item (cut again at
semicolons), and each table cell read as "column header: first cell of the row, cell"
(so a "not run" cell under "ROCm" is about ROCm); fenced code and HTML comments are
skipped. A phrase is about the registered feature named nearest to it in its clause, at
most 8 words before it or 6 after (the one before on a tie), and about nothing when
none is that near: "EAGLE heads, ..., and what is not supported yet" says nothing
missing about EAGLE. Two rules apply.

1. *Registered means not planned.* A phrase saying that a registered feature is missing
   fails. Registered: the attention backends in
   ``tandem.scheduler.attention.BACKENDS``; the speculative algorithms of the
   ``tandem.speculative_algorithms`` entry points in ``packages/spec-eagle/pyproject.toml``
   (EAGLE3 also written EAGLE-3); CUDA graphs while ``cuda_graph.py`` exists and the
   decode trace while ``decode_trace.py`` exists. Missing: *planned* as a state ("is
   planned.", "(planned)", not the verb of an attention plan, "planned once per batch"),
   *not ... yet*, *not implemented*, *no ... support*, *for now*, *coming soon*, *in a
   future release*, *will be added*, *TODO*. A name followed by ``'s`` is about a part of
   it ("FlashInfer's custom-mask path is not wired yet" is about that path), so it does
   not count as naming the feature.

2. *Verification is checked against the evidence, not the registry.* A phrase about
   running or verifying ("not yet verified on a GPU", "has not run on a GPU yet",
   "untested") is not a claim of absence, so rule 1 leaves it alone; rule 2 checks it
   against the committed GPU logs, ``benchmarks/results/gpu/tests-{cuda,rocm}-*.log``.
   A log counts when its pytest summary says passed with no failure or error.

   a. While a passing CUDA log exists, a clause saying no GPU has been available (or that
      nothing has run on a GPU) fails; while a passing ROCm log exists, so does one
      saying that no AMD GPU has been available.
   b. A phrase that calls an attention backend unverified or untested fails when the
      backend ran on that platform: a passing log of the platform exists and none of its
      ``SKIPPED`` lines names the backend. The platform is ROCm when the clause mentions
      ROCm, AMD, HIP, MI300 or gfx, CUDA when it mentions CUDA, H100 or NVIDIA, both when
      it mentions both, and CUDA when it mentions neither ("on a GPU"). So "flashinfer is
      not yet verified on a GPU" passes while the CUDA log skips the flashinfer tests,
      and "triton is untested on a GPU" fails.
"""

from __future__ import annotations

import re
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
STATUS = DOCS / "status.md"
SCHEDULER_SRC = ROOT / "packages" / "scheduler" / "src" / "tandem" / "scheduler"
GPU_RESULTS = ROOT / "benchmarks" / "results" / "gpu"
UNCHECKED = {"changelog.md"}  # history: each entry says what was true at its release
WORDS_BEFORE = 8  # how far a feature's name may stand before the phrase about it
WORDS_AFTER = 6  # ... or after it

SUMMARY_START = "<!-- --8<-- [start:summary] -->"
SUMMARY_END = "<!-- --8<-- [end:summary] -->"
README_START = (
    "<!-- status:start (generated from the summary of docs/status.md by "
    "`python packages/server/tests/test_docs_status.py`: edit it there) -->"
)
README_END = "<!-- status:end -->"
HOME_INCLUDE = '--8<-- "status.md:summary"'

# -- what the code registers ------------------------------------------------------------------


def registered_features(root: Path = ROOT) -> dict[str, re.Pattern[str]]:
    """Each registered feature's name -> the pattern of a mention of it in prose."""
    from tandem.scheduler.attention import BACKENDS

    features: dict[str, re.Pattern[str]] = {}
    for name in BACKENDS:
        quoted = rf"`[\"']?{re.escape(name)}[\"']?`"
        as_backend = rf"\b{re.escape(name)}\b(?: attention)? backends?\b"
        # "torch" alone is the library, not the backend: only `torch` or "torch backend".
        forms = [quoted, as_backend] if name == "torch" else [quoted, rf"\b{re.escape(name)}\b"]
        features[f"attention backend {name!r}"] = re.compile("|".join(forms), re.IGNORECASE)

    pyproject = root / "packages" / "spec-eagle" / "pyproject.toml"
    entry_points = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["entry-points"][
        "tandem.speculative_algorithms"
    ]
    for name in entry_points:
        base, version = re.fullmatch(r"([A-Za-z]+)(\d*)", name).groups()  # type: ignore[union-attr]
        spelled = rf"\b{base}(?:-?{version})\b" if version else rf"\b{base}\b(?!-?\d)"
        features[f"speculative algorithm {name!r}"] = re.compile(spelled)

    modules = {
        "CUDA graphs": ("runner/cuda_graph.py", r"\bCUDA graphs?\b"),
        "the decode trace": ("runner/decode_trace.py", r"\bdecode traces?\b"),
    }
    for feature, (module, pattern) in modules.items():
        if (root / SCHEDULER_SRC.relative_to(ROOT) / module).is_file():
            features[feature] = re.compile(pattern, re.IGNORECASE)
    return features


def _mentions(clause: str, pattern: re.Pattern[str]) -> list[tuple[int, int]]:
    """Where ``clause`` names the feature itself (not a part of it: ``X's ...``)."""
    return [
        m.span()
        for m in pattern.finditer(clause)
        if not re.match(r"['\u2019]s\b", clause[m.end() : m.end() + 2])
    ]


def _words(text: str) -> int:
    return len(text.split())


def _distance(clause: str, mention: tuple[int, int], phrase: tuple[int, int]) -> int | None:
    """Words between a mention and a phrase (0 when they overlap), or None when they are
    not near: the mention ends more than ``WORDS_BEFORE`` words before the phrase, or
    starts more than ``WORDS_AFTER`` words after it."""
    if mention[1] <= phrase[0]:
        words = _words(clause[mention[1] : phrase[0]])
        return words if words <= WORDS_BEFORE else None
    if mention[0] >= phrase[1]:
        words = _words(clause[phrase[1] : mention[0]])
        return words if words <= WORDS_AFTER else None
    return 0


def subject(
    clause: str, phrase: tuple[int, int], features: dict[str, re.Pattern[str]]
) -> str | None:
    """The feature a phrase is about: of the features named near it, the nearest (the
    one before it on a tie); None when none is near."""
    near = []
    for feature, pattern in features.items():
        for mention in _mentions(clause, pattern):
            words = _distance(clause, mention, phrase)
            if words is not None:
                near.append((words, mention[0] > phrase[0], feature))
    return min(near)[2] if near else None


# -- what the GPU logs show -------------------------------------------------------------------


@dataclass(frozen=True)
class GpuLog:
    platform: str  # "cuda" or "rocm"
    name: str
    passed: bool
    skipped: tuple[str, ...]  # the reasons of its SKIPPED lines


def gpu_logs(results: Path = GPU_RESULTS) -> list[GpuLog]:
    logs = []
    for path in sorted(results.glob("tests-*.log")):
        platform = path.name.removeprefix("tests-").split("-", 1)[0]
        text = path.read_text(encoding="utf-8", errors="replace")
        summary = [
            line for line in text.splitlines() if re.search(r"\b\d+ passed\b.* in [\d.]+s", line)
        ]
        passed = bool(summary) and not re.search(r"\b\d+ (failed|errors?)\b", summary[-1])
        skipped = tuple(
            line.split(":", 2)[-1] for line in text.splitlines() if line.startswith("SKIPPED")
        )
        logs.append(GpuLog(platform, path.name, passed, skipped))
    return logs


def backend_ran_on(platform: str, backend: str, logs: list[GpuLog]) -> bool:
    word = re.compile(rf"\b{re.escape(backend)}", re.IGNORECASE)
    return any(
        log.platform == platform
        and log.passed
        and not any(word.search(reason) for reason in log.skipped)
        for log in logs
    )


# -- cutting pages into clauses ---------------------------------------------------------------


@dataclass(frozen=True)
class Clause:
    path: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


def clauses(text: str, path: str) -> Iterator[Clause]:
    """Table rows, headings, and the sentences of paragraphs and list items, cut again
    at semicolons; fenced code and HTML comments are skipped."""
    text = re.sub(r"<!--.*?-->", lambda m: "\n" * m.group().count("\n"), text, flags=re.S)
    blocks: list[tuple[int, list[str]]] = []  # (first line, lines): one unit of prose
    fence: str | None = None
    header: list[str] = []  # the header cells of the current table
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if fence is not None:
            if line.startswith(fence):
                fence = None
            continue
        if m := re.match(r"(```+|~~~+)", line):
            fence = m.group(1)
            continue
        if line.startswith("|"):
            # A cell is read with its row's first cell and its column's header:
            # "| `flashinfer` | ... | not run |" under "ROCm" is about ROCm.
            cells = [c.strip() for c in line.strip("|").split("|")]
            if all(re.fullmatch(r":?-+:?", c) for c in cells if c):
                continue
            if not header:
                header = cells
            row = [cells[0]] + [
                f"{header[i] if i < len(header) else ''}: {cells[0]} {cell}"
                for i, cell in enumerate(cells[1:], 1)
            ]
            blocks += [(number, [cell]) for cell in row]
            blocks.append((number, []))
            continue
        header = []
        if m := re.match(r'(?:!!!|\?\?\?\+?)\s+\w+\s*(?:"(.*)")?$', line):  # admonition
            blocks += [(number, [m.group(1) or ""]), (number + 1, [])]
            continue
        if not line or line.startswith("#") or re.match(r"([-*+]|\d+\.)\s", line) or not blocks:
            blocks.append((number, []))
        if line:
            blocks[-1][1].append(line)
        if line.startswith("#"):
            blocks.append((number + 1, []))
    for start, lines in blocks:
        joined = " ".join(lines)
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z`\[*(\"])", joined):
            for part in sentence.split(";"):
                if part.strip():
                    yield Clause(path, start, part.strip())


def pages(root: Path = ROOT) -> dict[str, str]:
    """The checked pages: the README and every Markdown page of docs/ but the changelog."""
    found = {"README.md": (root / "README.md").read_text(encoding="utf-8")}
    for page in sorted((root / "docs").rglob("*.md")):
        if page.name not in UNCHECKED:
            found[page.relative_to(root).as_posix()] = page.read_text(encoding="utf-8")
    return found


# -- the rules --------------------------------------------------------------------------------

VERIFYING = re.compile(r"verif|\btest|\bran\b|\brun\b|\bmeasured|\bbenchmark", re.IGNORECASE)
ABSENT = [
    re.compile(p, re.IGNORECASE)
    for p in (
        r"\bplanned\b(?=\s*(?:[.;:,)]|$))",
        r"\bplanned for (?:a |the )?(?:later|future|next)\b",
        r"\bnot\b[^.;:]{0,40}?\byet\b",
        r"\bnot (?:been |be )?implemented\b",
        r"\bunimplemented\b",
        r"\bno\b(?:\s+[\w`'\"./-]+){0,3}?\s+support\b",
        r"\bfor now\b",
        r"\bcoming soon\b",
        r"\bin a (?:future|later) (?:release|version)\b",
        r"\b(?:will|to) be added\b",
        r"\bTODO\b",
    )
]


def _no_gpu_ever(vendor: str) -> re.Pattern[str]:
    gpu = rf"{vendor}GPUs?"
    return re.compile(
        rf"\bno {gpu} (?:has|have|had|was|were) (?:ever |yet )?(?:been )?available\b"
        rf"|\bno {gpu}\b[^.;]{{0,40}}\bso far\b"
        rf"|\bnever (?:been )?(?:run|ran|tested|verified) on (?:a|any) {gpu}\b",
        re.IGNORECASE,
    )


NO_GPU_EVER = {"cuda": _no_gpu_ever(""), "rocm": _no_gpu_ever(r"(?:AMD|ROCm) ")}
UNVERIFIED = re.compile(
    r"\bunverified\b|\buntested\b"
    r"|\bnot\b(?:\s+\w+){0,2}?\s+(?:verified|tested|run|ran)\b"
    r"|\bnever\b(?:\s+\w+){0,2}?\s+(?:verified|tested|run|ran)\b",
    re.IGNORECASE,
)
ROCM = re.compile(r"\bROCm\b|\bAMD\b|\bHIP\b|\bMI300|\bgfx\d", re.IGNORECASE)
CUDA = re.compile(r"\bCUDA\b|\bH100\b|\bNVIDIA\b", re.IGNORECASE)


def absence_claims(clause: str) -> list[re.Match[str]]:
    """The phrases by which ``clause`` says something is missing. A phrase about
    verifying or running ("not yet verified", "not been run ... yet") is not one: rule 2
    checks those; the phrase and the three words after it are read for that."""
    found = []
    for pattern in ABSENT:
        for m in pattern.finditer(clause):
            context = m.group() + " " + " ".join(clause[m.end() :].split()[:3])
            if not VERIFYING.search(context):
                found.append(m)
    return found


def stale_claims(
    texts: dict[str, str],
    features: dict[str, re.Pattern[str]],
    logs: list[GpuLog],
) -> list[str]:
    """Every clause of ``texts`` (path -> Markdown) that breaks rule 1 or rule 2."""
    backends = {
        name.split("'")[1]: pattern
        for name, pattern in features.items()
        if name.startswith("attention backend")
    }
    ran_on = {log.platform for log in logs if log.passed}
    problems = []
    for path, text in texts.items():
        for clause in clauses(text, path):
            for phrase in absence_claims(clause.text):
                feature = subject(clause.text, phrase.span(), features)
                if feature is not None:
                    problems.append(
                        f"{clause}\n    says {feature} is missing ({phrase.group()!r}), but "
                        "the code registers it"
                    )
            for platform, pattern in NO_GPU_EVER.items():
                if platform in ran_on and pattern.search(clause.text):
                    problems.append(
                        f"{clause}\n    says no GPU has been used, but a passing {platform} "
                        f"test log is in {GPU_RESULTS.relative_to(ROOT)}"
                    )
            for phrase in UNVERIFIED.finditer(clause.text):
                platforms = [
                    p for p, rx in (("cuda", CUDA), ("rocm", ROCM)) if rx.search(clause.text)
                ]
                backend = subject(clause.text, phrase.span(), backends)
                if backend is None:
                    continue
                ran = [p for p in platforms or ["cuda"] if backend_ran_on(p, backend, logs)]
                if ran:
                    problems.append(
                        f"{clause}\n    says the {backend!r} backend is unverified, but it "
                        f"ran in a passing {ran[0]} test log"
                    )
    return problems


# -- the README's copy of the summary ---------------------------------------------------------


def status_summary(status_page: str) -> str:
    """The summary block of docs/status.md, without its markers."""
    start = status_page.index(SUMMARY_START) + len(SUMMARY_START)
    return status_page[start : status_page.index(SUMMARY_END)].strip()


def readme_status(summary: str) -> str:
    """The README's status paragraph for ``summary``: links made relative to the
    repository root (``guides/gpu.md`` -> ``docs/guides/gpu.md``)."""
    body = re.sub(
        r"\]\((?![a-z][a-z0-9+.-]*:|#|/)([^)]+)\)", lambda m: f"](docs/{m.group(1)})", summary
    )
    return f"{README_START}\n**Status.**\n{body}\n{README_END}"


def _readme_block(readme: str) -> str:
    start = readme.index("<!-- status:start")
    return readme[start : readme.index(README_END, start) + len(README_END)]


def sync_readme() -> bool:
    """Rewrite the README's status paragraph from docs/status.md; whether it changed."""
    readme = README.read_text(encoding="utf-8")
    block = readme_status(status_summary(STATUS.read_text(encoding="utf-8")))
    new = readme.replace(_readme_block(readme), block)
    if new != readme:
        README.write_text(new, encoding="utf-8")
    return new != readme


# -- the tests --------------------------------------------------------------------------------


def test_readme_status_is_the_status_page_summary() -> None:
    readme = README.read_text(encoding="utf-8")
    assert "<!-- status:start" in readme, "the README has no generated status paragraph"
    expected = readme_status(status_summary(STATUS.read_text(encoding="utf-8")))
    assert _readme_block(readme) == expected, (
        "the README's status paragraph differs from the summary of docs/status.md: run "
        "`python packages/server/tests/test_docs_status.py` to regenerate it"
    )


def test_home_page_includes_the_summary_and_getting_started_links_the_status_page() -> None:
    assert HOME_INCLUDE in (DOCS / "index.md").read_text(encoding="utf-8")
    assert "(status.md" in (DOCS / "getting-started.md").read_text(encoding="utf-8")


def test_the_registry_is_read() -> None:
    """The rules are only as good as what they find registered."""
    features = registered_features()
    for name in ("'torch'", "'triton'", "'flashinfer'", "'EAGLE'", "'EAGLE3'", "CUDA graphs"):
        assert any(name in feature for feature in features), name
    assert features["speculative algorithm 'EAGLE3'"].search("EAGLE-3 heads")
    assert not features["speculative algorithm 'EAGLE'"].search("EAGLE-3 heads")
    assert not features["attention backend 'torch'"].search("torch 2.11 or newer")


def test_no_page_calls_a_registered_feature_planned_or_missing() -> None:
    problems = stale_claims(pages(), registered_features(), gpu_logs())
    assert not problems, "stale claims:\n" + "\n".join(problems)


# The rules on sentences of the docs as they stood before this test, and on honest ones.
STALE = [
    "Decode does not use CUDA graphs yet.",
    "FlashInfer has no ROCm build, so ROCm uses the `torch` attention backend. "
    "A Triton backend is planned.",
    "No GPU has been available to the project so far, so the CUDA and ROCm install "
    "paths, the `flashinfer` backend and the GPU-marked tests are unverified.",
    "spec-eagle holds the draft heads; it runs on the `torch` attention backend only for now.",
    '- `default_backend(device)`, which returns `"torch"` everywhere for now.',
    "The `triton` backend has not been verified on a GPU yet.",
    "EAGLE-3 is not implemented.",
    "There is no CUDA graph support.",
]
HONEST = [
    "The `flashinfer` backend has not been verified on a GPU yet.",
    "| `flashinfer` | Not yet verified on a GPU. |",
    "FlashInfer's custom-mask path is not wired yet; choosing "
    '`attention_backend="flashinfer"` with a head is refused.',
    "Its index tensors and mask are planned once per batch and reused by every layer.",
    "The Triton kernels were compiled for `gfx942` (MI300) during development, but no "
    "AMD GPU has been available to the project: the ROCm path is untested on hardware.",
    "Speculative steps are not captured in CUDA graphs: they run eagerly.",
    "Not yet supported with speculative decoding: penalties and logprobs.",
    "```text\nA Triton backend is planned.\n```",
]


@pytest.mark.parametrize("text", STALE)
def test_the_rules_catch_stale_claims(text: str) -> None:
    assert stale_claims({"page.md": text}, registered_features(), gpu_logs())


@pytest.mark.parametrize("text", HONEST)
def test_the_rules_pass_honest_statements(text: str) -> None:
    assert not stale_claims({"page.md": text}, registered_features(), gpu_logs())


def test_a_rocm_log_would_make_the_rocm_claims_stale() -> None:
    amd = "No AMD GPU has been available to the project: the ROCm path is untested."
    triton = "The `triton` backend is untested on ROCm."
    logs = [*gpu_logs(), GpuLog("rocm", "tests-rocm-x.log", passed=True, skipped=())]
    assert not stale_claims({"a.md": amd, "b.md": triton}, registered_features(), gpu_logs())
    problems = stale_claims({"a.md": amd, "b.md": triton}, registered_features(), logs)
    assert [p.split(":")[0] for p in problems] == ["a.md", "b.md"]


def test_the_cuda_log_is_read() -> None:
    logs = gpu_logs()
    assert backend_ran_on("cuda", "triton", logs)
    assert not backend_ran_on("cuda", "flashinfer", logs)
    assert not backend_ran_on("rocm", "triton", logs)


if __name__ == "__main__":
    changed = sync_readme()
    print("README.md: status paragraph " + ("rewritten" if changed else "already up to date"))
    sys.exit(0)
