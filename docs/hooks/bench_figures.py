"""mkdocs hook: the benchmark tables and plots, generated from the JSON results at build time.

Every ``*.json`` under ``benchmarks/results/cpu/`` (and ``benchmarks/results/gpu/`` when it
exists) is read and checked on every build; a malformed file fails the build. Two producers
are recognised, by content:

- ``tools/bench_overlap.py --output-json``: ``{"normal": {...}, "overlap": {...},
  "overlap_vs_normal_wall": float}``, each loop with ``wall_s``, ``output_throughput``,
  ``device_idle_fraction``, ``scheduler_s`` and ``overshoot_steps``;
- ``tandem bench --output-json``: one entry per run (``normal``, ``overlap``,
  ``transformers``, ...), each with ``duration_s``, ``output_throughput``, ``num_requests``,
  ``total_output_tokens``, TTFT / ITL / TPOT in ms, ``device_idle_fraction`` and
  ``overshoot_steps`` (the last two null for transformers).

Either may carry a top-level ``"command"``: the command line that produced it, a string
(or an argv list of strings); the page shows it under the table. Any other top-level key
that is not an object fails the build, so a typo cannot hide a figure.

A page asks for figures with marker lines, each replaced in ``on_page_markdown``:

- ``<!-- bench:table SET KIND -->``: a table of every KIND file of SET, then the commands
  recorded in them. SET is ``cpu`` or ``gpu``; KIND is ``bench_overlap`` or ``tandem_bench``.
- ``<!-- bench:summary SET KIND -->``: one bullet per file with the ratios that compare its
  loops (overlap / normal, overlap / transformers), computed here, never typed.
- ``<!-- bench:plot SET METRIC -->``: a bar chart (SVG, matplotlib) of METRIC per loop, for
  every file of SET: ``throughput`` (output tokens/s), ``idle`` (device idle fraction),
  ``ttft`` or ``tpot`` (p50, ms; ``tandem bench`` files only).

The SVGs are added to the site as generated files (``assets/bench/SET-METRIC.svg``), so
nothing generated is committed.
"""

from __future__ import annotations

import io
import json
import logging
import math
import posixpath
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.bench_figures")

SETS = ("cpu", "gpu")
KINDS = ("bench_overlap", "tandem_bench")
ASSET_DIR = "assets/bench"
# Known runs first, in this order; any other run name follows in file order.
LOOP_ORDER = ("normal", "overlap", "transformers")
LOOP_COLORS = {"normal": "#5b7fa6", "overlap": "#e07b39", "transformers": "#5a9e6f"}
EXTRA_COLORS = ("#9467bd", "#8c564b", "#7f7f7f", "#bcbd22")

# Fields of one run, per producer: name -> may it be null?
OVERLAP_FIELDS = {
    "wall_s": False,
    "output_throughput": False,
    "device_idle_fraction": False,
    "scheduler_s": False,
    "overshoot_steps": False,
}
BENCH_REQUIRED = {
    "duration_s": False,
    "output_throughput": False,
    "num_requests": False,
    "total_output_tokens": False,
}
BENCH_OPTIONAL = {
    "request_throughput": True,
    "input_throughput": True,
    "total_input_tokens": True,
    "device_idle_fraction": True,
    "overshoot_steps": True,
    **{
        f"{stat}_{what}_ms": True
        for stat in ("mean", "p50", "p99")
        for what in ("ttft", "itl", "tpot", "e2e")
    },
}
TOP_LEVEL = {"command", "overlap_vs_normal_wall"}

# metric -> (JSON key, axis label, value format for the bar labels, percent axis?)
METRICS = {
    "throughput": ("output_throughput", "output tokens/s (higher is better)", "{:.0f}", False),
    "idle": ("device_idle_fraction", "device idle fraction (lower is better)", "{:.1%}", True),
    "ttft": ("p50_ttft_ms", "TTFT p50, ms (lower is better)", "{:.1f}", False),
    "tpot": ("p50_tpot_ms", "TPOT p50, ms (lower is better)", "{:.2f}", False),
}

MARKER = re.compile(r"^[ \t]*<!--[ \t]*bench:(?P<body>[^\n]*?)[ \t]*-->[ \t]*$", re.MULTILINE)


@dataclass
class Result:
    """One results file."""

    path: Path
    kind: str
    runs: dict[str, dict[str, Any]]
    command: str | None = None

    @property
    def name(self) -> str:
        return self.path.name

    def value(self, loop: str, key: str) -> float | None:
        run = self.runs.get(loop)
        return None if run is None else run.get(key)

    def ratio(self, key: str, top: str, bottom: str) -> float | None:
        a, b = self.value(top, key), self.value(bottom, key)
        if a is None or b is None or b == 0:
            return None
        return a / b


@dataclass
class State:
    root: Path = field(default_factory=Path)
    results: dict[str, list[Result]] = field(default_factory=dict)
    plots: dict[tuple[str, str], str | None] = field(default_factory=dict)  # -> src_uri


_state = State()


# -- reading and checking ------------------------------------------------------------------------
def _fail(path: Path, root: Path, message: str) -> PluginError:
    try:
        shown = path.relative_to(root).as_posix()
    except ValueError:
        shown = str(path)
    return PluginError(f"bench_figures: malformed benchmark results file {shown}: {message}")


def _check_number(value: Any, nullable: bool) -> bool:
    if value is None:
        return nullable
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value)


def _order(names: list[str]) -> list[str]:
    known = [n for n in LOOP_ORDER if n in names]
    return known + [n for n in names if n not in LOOP_ORDER]


def _load(path: Path, root: Path) -> Result:
    try:
        data = json.loads(path.read_text(encoding="utf-8"), parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _fail(path, root, f"not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise _fail(path, root, "the top level must be a JSON object")
    runs = {k: v for k, v in data.items() if isinstance(v, dict)}
    other = {k: v for k, v in data.items() if not isinstance(v, dict)}
    unknown = sorted(set(other) - TOP_LEVEL)
    if unknown:
        raise _fail(
            path,
            root,
            f"unexpected top-level key(s) {', '.join(map(repr, unknown))}: the top level holds "
            f"one object per run and, optionally, {' and '.join(map(repr, sorted(TOP_LEVEL)))}",
        )
    if not runs:
        raise _fail(path, root, "no runs: expected at least one of 'normal', 'overlap', ...")
    command = data.get("command")
    if isinstance(command, list) and command and all(isinstance(a, str) for a in command):
        command = shlex.join(command)  # an argv list is fine too
    if command is not None and (not isinstance(command, str) or not command.strip()):
        raise _fail(path, root, "'command' must be a non-empty string (or list of strings)")

    overlap_script = "overlap_vs_normal_wall" in data or any("wall_s" in r for r in runs.values())
    kind = "bench_overlap" if overlap_script else "tandem_bench"
    required = OVERLAP_FIELDS if overlap_script else BENCH_REQUIRED
    optional = {} if overlap_script else BENCH_OPTIONAL
    for name, run in runs.items():
        missing = [k for k in required if k not in run]
        if missing:
            producer = "tools/bench_overlap.py" if overlap_script else "tandem bench --output-json"
            raise _fail(
                path,
                root,
                f"run {name!r} lacks {', '.join(map(repr, missing))} "
                f"(read as output of {producer})",
            )
        for key, nullable in {**required, **optional}.items():
            if key in run and not _check_number(run[key], nullable):
                expected = "a finite number" + (" or null" if nullable else "")
                raise _fail(
                    path, root, f"run {name!r}: {key!r} is {run[key]!r}, expected {expected}"
                )
        for key in ("wall_s", "duration_s"):
            if key in run and run[key] <= 0:
                raise _fail(path, root, f"run {name!r}: {key!r} is {run[key]!r}, not positive")
        idle = run.get("device_idle_fraction")
        if idle is not None and not 0.0 <= idle <= 1.0:
            raise _fail(path, root, f"run {name!r}: 'device_idle_fraction' {idle} is not in [0, 1]")

    if overlap_script:
        if set(runs) != {"normal", "overlap"}:
            raise _fail(
                path, root, "tools/bench_overlap.py output has exactly 'normal' and 'overlap'"
            )
        recorded = data.get("overlap_vs_normal_wall")
        computed = runs["overlap"]["wall_s"] / runs["normal"]["wall_s"]
        if recorded is not None and (
            not _check_number(recorded, False) or not math.isclose(recorded, computed, rel_tol=1e-6)
        ):
            raise _fail(
                path,
                root,
                f"'overlap_vs_normal_wall' is {recorded!r}, "
                f"but overlap / normal 'wall_s' is {computed}",
            )

    ordered = {name: runs[name] for name in _order(list(runs))}
    return Result(path=path, kind=kind, runs=ordered, command=command)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _read_all(root: Path) -> dict[str, list[Result]]:
    results: dict[str, list[Result]] = {}
    for set_name in SETS:
        folder = root / "benchmarks" / "results" / set_name
        files = sorted(folder.glob("*.json")) if folder.is_dir() else []
        results[set_name] = [_load(path, root) for path in files]
    return results


# -- plots ---------------------------------------------------------------------------------------
def _plot(results: list[Result], metric: str, set_name: str) -> bytes | None:
    """A horizontal grouped bar chart: one group per file, one bar per run. None: no data."""
    key, label, fmt, percent = METRICS[metric]
    rows = [r for r in results if any(r.value(loop, key) is not None for loop in r.runs)]
    if not rows:
        return None
    # only the runs that have this figure: transformers has no device idle fraction
    loops = _order(
        list(dict.fromkeys(loop for r in rows for loop in r.runs if r.value(loop, key) is not None))
    )
    extra = iter(EXTRA_COLORS * 4)
    colors = {loop: LOOP_COLORS.get(loop) or next(extra) for loop in loops}

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import PercentFormatter

    with matplotlib.rc_context(
        {
            "svg.fonttype": "none",  # text stays text: small files, the browser's font
            "svg.hashsalt": "tandem-bench",  # stable ids, so a rebuild yields the same file
            "font.size": 10,
            "font.family": "sans-serif",
        }
    ):
        height = 0.26
        fig, ax = plt.subplots(figsize=(8, 1.0 + 0.3 * len(loops) * len(rows) + 0.3 * len(rows)))
        top = 0.0
        for loop_index, loop in enumerate(loops):
            ys, xs = [], []
            for row_index, r in enumerate(rows):
                v = r.value(loop, key)
                if v is not None:
                    ys.append(row_index + (loop_index - (len(loops) - 1) / 2) * height)
                    xs.append(v)
                    top = max(top, v)
            bars = ax.barh(ys, xs, height=height * 0.92, label=loop, color=colors[loop])
            ax.bar_label(bars, labels=[fmt.format(x) for x in xs], padding=3, fontsize=8)
        ax.set_yticks(range(len(rows)), [r.path.stem for r in rows])
        ax.invert_yaxis()
        ax.set_xlim(0, top * 1.18 if top > 0 else 1)
        if percent:
            ax.xaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set_xlabel(label)
        ax.set_title(f"{set_name.upper()}: {label.split(' (')[0]} per loop", fontsize=11)
        ax.spines[["top", "right"]].set_visible(False)
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
        fig.patch.set_facecolor("white")  # readable on the dark palette too
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(
            buf, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": None}
        )
        plt.close(fig)
    return buf.getvalue()


# -- markdown ------------------------------------------------------------------------------------
def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else spec.format(value)


def _table(lines: list[list[str]]) -> str:
    head, *body = lines
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(out)


def _commands(results: list[Result]) -> str:
    """The commands recorded in the files (the page's prose covers files without one)."""
    recorded = [r for r in results if r.command]
    if not recorded:
        return ""
    body = "\n".join(f"# {r.name}\n{r.command.strip()}" for r in recorded)
    return f"The commands recorded in the files:\n\n```bash\n{body}\n```"


def _overlap_table(results: list[Result]) -> str:
    head = [
        "file",
        "wall time, normal",
        "wall time, overlap",
        "overlap / normal wall time",
        "device idle, normal",
        "device idle, overlap",
        "output tokens/s, normal",
        "output tokens/s, overlap",
        "scheduler time, normal",
        "scheduler time, overlap",
    ]
    rows = [head]
    for r in results:
        rows.append(
            [
                f"`{r.name}`",
                _fmt(r.value("normal", "wall_s"), "{:.3f} s"),
                _fmt(r.value("overlap", "wall_s"), "{:.3f} s"),
                _fmt(r.ratio("wall_s", "overlap", "normal"), "{:.3f}"),
                _fmt(r.value("normal", "device_idle_fraction"), "{:.2%}"),
                _fmt(r.value("overlap", "device_idle_fraction"), "{:.2%}"),
                _fmt(r.value("normal", "output_throughput"), "{:.0f}"),
                _fmt(r.value("overlap", "output_throughput"), "{:.0f}"),
                _fmt(r.value("normal", "scheduler_s"), "{:.3f} s"),
                _fmt(r.value("overlap", "scheduler_s"), "{:.3f} s"),
            ]
        )
    return _table(rows)


def _bench_table(results: list[Result]) -> str:
    columns = [
        ("requests", "num_requests", "{}"),
        ("output tokens", "total_output_tokens", "{}"),
        ("duration", "duration_s", "{:.3f} s"),
        ("output tokens/s", "output_throughput", "{:.1f}"),
        ("requests/s", "request_throughput", "{:.2f}"),
        ("TTFT p50", "p50_ttft_ms", "{:.1f} ms"),
        ("TTFT p99", "p99_ttft_ms", "{:.1f} ms"),
        ("ITL p50", "p50_itl_ms", "{:.2f} ms"),
        ("TPOT p50", "p50_tpot_ms", "{:.2f} ms"),
        ("TPOT p99", "p99_tpot_ms", "{:.2f} ms"),
        ("device idle", "device_idle_fraction", "{:.2%}"),
        ("overshoot steps", "overshoot_steps", "{}"),
    ]
    rows = [["file", "run"] + [c[0] for c in columns]]
    for r in results:
        for loop in r.runs:
            rows.append(
                [f"`{r.name}`", loop] + [_fmt(r.value(loop, key), spec) for _, key, spec in columns]
            )
    return _table(rows)


def _change(ratio: float, higher_is: str, lower_is: str) -> str:
    pct = abs(ratio - 1) * 100
    if pct < 0.05:
        return "no difference"
    return f"{pct:.1f}% **{higher_is if ratio > 1 else lower_is}**"


def _summary(results: list[Result], kind: str) -> str:
    bullets = []
    for r in results:
        parts = []
        if kind == "bench_overlap":
            idle_n = r.value("normal", "device_idle_fraction")
            idle_o = r.value("overlap", "device_idle_fraction")
            parts.append(f"device idle {idle_n:.2%} (normal) against {idle_o:.2%} (overlap)")
            wall = r.ratio("wall_s", "overlap", "normal")
            if wall is not None:
                parts.append(
                    f"overlap / normal wall time {wall:.3f}, "
                    f"the overlap loop {_change(wall, 'slower', 'faster')}"
                )
            sched_n = r.value("normal", "scheduler_s")
            sched_o = r.value("overlap", "scheduler_s")
            parts.append(
                f"scheduler time {sched_n:.3f} s (normal) against {sched_o:.3f} s (overlap)"
            )
        else:
            for peer in ("normal", "transformers"):
                ratio = r.ratio("output_throughput", "overlap", peer)
                if ratio is not None:
                    parts.append(
                        f"overlap / {peer} output throughput {ratio:.2f}, "
                        f"the overlap loop {_change(ratio, 'higher', 'lower')}"
                    )
            idle = [
                f"{r.value(loop, 'device_idle_fraction'):.2%} ({loop})"
                for loop in r.runs
                if r.value(loop, "device_idle_fraction") is not None
            ]
            if idle:
                parts.append("device idle " + " against ".join(idle))
            if len(parts) == (1 if idle else 0):
                parts.insert(0, "a single engine run, nothing to compare it with")
        bullets.append(f"- `{r.name}`: " + "; ".join(parts) + ".")
    return "\n".join(bullets)


PRODUCERS = {"bench_overlap": "`tools/bench_overlap.py`", "tandem_bench": "`tandem bench`"}
LEADS = {
    ("table", "bench_overlap"): "Medians over the repeats of each loop, one row per file "
    "(values rounded; the ratio is computed from the two median wall times):",
    ("table", "tandem_bench"): "One row per run of each file (values rounded):",
    ("summary", "bench_overlap"): "What each file says, overlap loop against normal loop:",
    ("summary", "tandem_bench"): "What each file says, overlap loop against the other runs "
    "(output throughput ratios above 1 favour the overlap loop):",
}


def _expand(match: re.Match[str], page_uri: str, empty_noted: set[str]) -> str:
    words = match.group("body").split()
    where = f"{page_uri}: marker {match.group(0).strip()!r}"
    if len(words) != 3 or words[0] not in ("table", "summary", "plot"):
        raise PluginError(
            f"bench_figures: {where}: expected 'bench:table SET KIND', 'bench:summary SET KIND' "
            "or 'bench:plot SET METRIC'"
        )
    what, set_name, arg = words
    if set_name not in SETS:
        raise PluginError(f"bench_figures: {where}: SET must be one of {', '.join(SETS)}")
    if what == "plot" and arg not in METRICS:
        raise PluginError(f"bench_figures: {where}: METRIC must be one of {', '.join(METRICS)}")
    if what != "plot" and arg not in KINDS:
        raise PluginError(f"bench_figures: {where}: KIND must be one of {', '.join(KINDS)}")

    every = _state.results.get(set_name, [])
    if not every:  # say it once per page, not under every marker
        if set_name in empty_noted:
            return ""
        empty_noted.add(set_name)
        return (
            f"*No {set_name.upper()} results have been recorded yet: "
            f"`benchmarks/results/{set_name}/` holds no JSON file.*"
        )
    if what == "plot":
        src_uri = _state.plots.get((set_name, arg))
        if src_uri is None:
            return f"*No {set_name.upper()} results hold the figures of this plot yet.*"
        rel = posixpath.relpath(src_uri, posixpath.dirname(page_uri) or ".")
        label = METRICS[arg][1]
        return f"![{set_name.upper()}: {label}, from benchmarks/results/{set_name}/]({rel})"
    results = [r for r in every if r.kind == arg]
    if not results:
        if what == "summary":
            return ""
        return f"*No {set_name.upper()} results from {PRODUCERS[arg]} have been recorded yet.*"
    if what == "summary":
        body = _summary(results, arg)
    else:
        table = _overlap_table(results) if arg == "bench_overlap" else _bench_table(results)
        body = "\n\n".join(filter(None, (table, _commands(results))))
    return LEADS[(what, arg)] + "\n\n" + body


# -- mkdocs events -------------------------------------------------------------------------------
def on_config(config: Any) -> None:
    global _state
    root = Path(config.config_file_path).resolve().parent
    _state = State(root=root, results=_read_all(root))
    count = sum(len(v) for v in _state.results.values())
    log.debug("bench_figures: read %d results files", count)


def on_files(files: Files, config: Any) -> Files:
    wanted: set[tuple[str, str]] = set()
    for page in files.documentation_pages():
        for match in MARKER.finditer(page.content_string):
            words = match.group("body").split()
            if len(words) == 3 and words[0] == "plot" and words[1] in SETS and words[2] in METRICS:
                wanted.add((words[1], words[2]))
    for set_name, metric in sorted(wanted):
        svg = _plot(_state.results.get(set_name, []), metric, set_name)
        if svg is None:
            _state.plots[(set_name, metric)] = None
            continue
        src_uri = f"{ASSET_DIR}/{set_name}-{metric}.svg"
        files.append(File.generated(config, src_uri, content=svg))
        _state.plots[(set_name, metric)] = src_uri
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    empty_noted: set[str] = set()
    return MARKER.sub(lambda m: _expand(m, page.file.src_uri, empty_noted), markdown)


def on_serve(server: Any, config: Any, builder: Any) -> None:
    for set_name in SETS:
        folder = _state.root / "benchmarks" / "results" / set_name
        if folder.is_dir():
            server.watch(str(folder))
