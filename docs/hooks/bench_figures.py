"""mkdocs hook: the benchmark tables and plots, generated from the JSON results at build time.

Every ``*.json`` under ``benchmarks/results/cpu/`` (and ``benchmarks/results/gpu/`` when it
exists) is read and checked on every build; a malformed file fails the build. Two producers
are recognised, by content:

- ``tools/bench_overlap.py --output-json``: ``{"normal": {...}, "overlap": {...},
  "overlap_vs_normal_wall": float}``, each loop with ``wall_s``, ``output_throughput``,
  ``device_idle_fraction``, ``scheduler_s`` and ``overshoot_steps``;
- ``tandem bench --output-json``: one entry per run (``normal``, ``overlap``,
  ``transformers``, ...), each with ``duration_s``, ``output_throughput``, ``num_requests``,
  ``total_output_tokens``, TTFT / ITL / TPOT in ms, ``device_idle_fraction``,
  ``overshoot_steps`` and ``host_us_per_decode_step`` (the last three null for
  transformers; older files lack the last).

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

A third producer, ``tools/bench_gpu.py``, writes one file per model config
(``bench-gpu-MODEL.json``, marked by ``"benchmark": "bench_gpu"``): copy bandwidth, decode
step time against the memory roofline per batch size, overlap / normal and tandem /
transformers output throughput, and device idle fractions. Its markers:

- ``<!-- bench:table SET bench_gpu -->``: a roofline table per model file, then one row per
  file with the loop, idle and transformers figures, then the recorded commands;
- ``<!-- bench:summary SET bench_gpu -->``: one bullet per file measured against the targets
  (the ``TARGET_*`` constants);
- ``<!-- bench:plot SET utilisation -->``: bandwidth utilisation against batch size (log2),
  one line per model.

Until such a file exists these markers render a note saying so, never an error.

A fourth, ``tools/bench_vllm_cpu.py``, writes one file per model and dtype
(``vs-vllm-MODEL-DTYPE.json``, marked by ``"benchmark": "vs_vllm_cpu"``): tandem and vLLM's
CPU build served the same checkpoint, measured by the same client (``tandem bench serve``)
at several concurrencies. Its markers:

- ``<!-- bench:table SET vs_vllm_cpu -->``: one row per file and concurrency (output
  tokens/s of each engine, their ratio, TPOT and TTFT p50 of each), then per file the
  machine, the versions and the exact commands (the script's and both servers');
- ``<!-- bench:summary SET vs_vllm_cpu -->``: one bullet per file with the ratios (and,
  for a file of several alternating rounds, the lowest and highest ratio of one round),
  and each level against the project's target where the file has one (``VS_TARGETS_*``);
- ``<!-- bench:plot SET vs_vllm_throughput -->``: output tokens/s against concurrency
  (log2), one line per engine and file.

The same script run against llama.cpp's server (``--model smollm2``, a GGUF file) writes
``vs-llamacpp-MODEL-WEIGHTS-DTYPE.json``, marked by ``"benchmark": "vs_llamacpp_cpu"``
(llama.cpp among its engines, vLLM too where it ran): the same figures, with a ratio per
peer (``tandem_vs_llamacpp_output_throughput``, ...) and the GGUF file's storage type in
``model.weights``. Its markers are the three above with ``vs_llamacpp_cpu`` and
``vs_llamacpp_throughput``.

A fifth producer, ``tools/perplexity_vs_llamacpp.py``, writes ``perplexity-llamacpp-*.json``
(``"benchmark": "perplexity_vs_llamacpp"``): llama-perplexity's estimate and tandem's on
the same tokens and positions, and ``tandem bench perplexity``'s over the same chunks.
``<!-- bench:table SET perplexity_vs_llamacpp -->`` shows one row per file, then the
setting and commands; ``<!-- bench:summary SET perplexity_vs_llamacpp -->`` a bullet per
file.

The results are read from ``benchmarks/results/`` next to ``mkdocs.yml``, or from the folder
named by the ``TANDEM_BENCH_RESULTS`` environment variable (which holds ``cpu/`` and
``gpu/`` the same way), so a test can build the site against results of its own.

The SVGs are added to the site as generated files (``assets/bench/SET-METRIC.svg``), so
nothing generated is committed.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import posixpath
import re
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.bench_figures")

SETS = ("cpu", "gpu")
KINDS = (
    "bench_overlap",
    "tandem_bench",
    "bench_gpu",
    "vs_vllm_cpu",
    "vs_llamacpp_cpu",
    "perplexity_vs_llamacpp",
)
RESULTS_ENV = "TANDEM_BENCH_RESULTS"
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
    "host_us_per_decode_step": True,
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
# Plots of tools/bench_gpu.py files (not bars per loop): metric -> axis label.
GPU_METRICS = {"utilisation": "bandwidth utilisation, roofline / measured step time"}

MARKER = re.compile(r"^[ \t]*<!--[ \t]*bench:(?P<body>[^\n]*?)[ \t]*-->[ \t]*$", re.MULTILINE)


@dataclass
class Result:
    """One results file."""

    path: Path
    kind: str
    runs: dict[str, dict[str, Any]]
    command: str | None = None
    gpu: GpuResult | None = None  # the figures of a tools/bench_gpu.py file
    vs: VsResult | None = None  # the figures of a tools/bench_vllm_cpu.py file
    perplexity: PerplexityResult | None = None  # of a tools/perplexity_vs_llamacpp.py file

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
    if data.get("benchmark") == GPU_BENCHMARK or path.name.startswith("bench-gpu-"):
        return _load_gpu(path, root, data)
    if data.get("benchmark") in VS_KINDS or path.name.startswith(("vs-vllm-", "vs-llamacpp-")):
        return _load_vs(path, root, data)
    if data.get("benchmark") == PPL or path.name.startswith("perplexity-llamacpp-"):
        return _load_perplexity(path, root, data)
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


def results_dir(root: Path) -> Path:
    """Where the results files are: ``TANDEM_BENCH_RESULTS`` or ``benchmarks/results``."""
    override = os.environ.get(RESULTS_ENV)
    return Path(override) if override else root / "benchmarks" / "results"


def _read_all(root: Path) -> dict[str, list[Result]]:
    results: dict[str, list[Result]] = {}
    for set_name in SETS:
        folder = results_dir(root) / set_name
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

    from matplotlib.ticker import PercentFormatter

    with _figure(1.0 + 0.3 * len(loops) * len(rows) + 0.3 * len(rows)) as (fig, ax):
        height = 0.26
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
        ax.grid(axis="x", alpha=0.3)
        return _svg(fig, ax)


@contextmanager
def _figure(height: float) -> Iterator[tuple[Any, Any]]:
    """A new 8-inch-wide figure and its axes, in the style every plot shares; the
    caller finishes it with ``_svg`` inside the block."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    with matplotlib.rc_context(
        {
            "svg.fonttype": "none",  # text stays text: small files, the browser's font
            "svg.hashsalt": "tandem-bench",  # stable ids, so a rebuild yields the same file
            "font.size": 10,
            "font.family": "sans-serif",
        }
    ):
        yield plt.subplots(figsize=(8, height))


def _log2_axis(ax: Any, values: set[int]) -> None:
    """A base-2 log x axis ticked at exactly ``values`` (batch sizes, concurrencies)."""
    from matplotlib.ticker import FixedLocator

    ticks = sorted(values)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.set_xticks(ticks, [str(t) for t in ticks])


def _svg(fig: Any, ax: Any) -> bytes:
    """The shared finish of every plot (frame, legend on the right, white background,
    reproducible SVG bytes), inside the caller's ``rc_context``."""
    import matplotlib.pyplot as plt

    ax.spines[["top", "right"]].set_visible(False)
    ax.set_axisbelow(True)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.patch.set_facecolor("white")  # readable on the dark palette too
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": None})
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
    if what == "plot" and arg not in METRICS and arg not in GPU_METRICS and arg not in VS_METRICS:
        metrics = ", ".join([*METRICS, *GPU_METRICS, *VS_METRICS])
        raise PluginError(f"bench_figures: {where}: METRIC must be one of {metrics}")
    if what != "plot" and arg not in KINDS:
        raise PluginError(f"bench_figures: {where}: KIND must be one of {', '.join(KINDS)}")
    if arg == GPU_BENCHMARK or arg in GPU_METRICS:
        return _expand_gpu(what, set_name, page_uri, empty_noted)
    if arg in VS_KINDS or arg in VS_METRICS:
        return _expand_vs(what, set_name, page_uri, arg)
    if arg == PPL:
        return _expand_perplexity(what, set_name)

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


# -- tools/bench_gpu.py files ----------------------------------------------------------------------
GPU_BENCHMARK = "bench_gpu"
GPU_TOP_LEVEL = {
    "benchmark",
    "schema_version",
    "model",
    "config",
    "environment",
    "command",
    "settings",
    "bandwidth",
    "decode",
    "overlap",
    "idle",
    "transformers",
    "elapsed_s",
}
GPU_SECTIONS = ("environment", "bandwidth", "decode", "overlap", "idle", "transformers")
# The project's GPU targets (docs/benchmarks.md explains them): bandwidth utilisation at
# batch 1 with CUDA graphs for the models named, device idle with the overlap loop, and
# overlap / normal output throughput.
TARGET_UTILISATION_B1 = 0.70
TARGET_UTILISATION_MODELS = ("llama-3.1-8b",)
TARGET_IDLE = 0.02
TARGET_OVERLAP_VS_NORMAL = 1.0
MODEL_COLORS = ("#e07b39", "#5b7fa6", "#5a9e6f", "#9467bd", "#8c564b", "#7f7f7f")


@dataclass
class GpuRow:
    """One batch size of the roofline sweep."""

    batch_size: int
    cuda_graph: bool
    measured_s: float
    roofline_s: float

    @property
    def utilisation(self) -> float:
        return self.roofline_s / self.measured_s


@dataclass
class GpuResult:
    """The figures of one ``tools/bench_gpu.py`` file that the page shows."""

    model: str
    environment: dict[str, Any]
    config: dict[str, Any]
    bandwidth: float
    weight_bytes: float | None
    context: int | None
    rows: list[GpuRow]
    overlap_tps: float
    normal_tps: float
    idle_profiler: float | None
    idle_timeline: float | None
    tandem_tps: float | None
    hf_tps: float | None
    hf_skipped: str | None

    @property
    def overlap_vs_normal(self) -> float:
        return self.overlap_tps / self.normal_tps

    @property
    def tandem_vs_transformers(self) -> float | None:
        if self.tandem_tps is None or self.hf_tps is None:
            return None
        return self.tandem_tps / self.hf_tps

    def row(self, batch: int, cuda_graph: bool) -> GpuRow | None:
        return next(
            (r for r in self.rows if r.batch_size == batch and r.cuda_graph == cuda_graph), None
        )


class _Checker:
    """Reads typed values out of one file, failing the build with the value's path."""

    def __init__(self, path: Path, root: Path) -> None:
        self.path, self.root = path, root

    def fail(self, message: str) -> PluginError:
        return _fail(self.path, self.root, message)

    def producer(
        self, data: dict[str, Any], marker: str, files: str, tool: str, keys: set[str]
    ) -> None:
        """A file of ``tool``'s: its ``benchmark`` marker, and no top-level key but ``keys``."""
        if data.get("benchmark") != marker:
            raise self.fail(
                f"{files} files come from {tool} and carry "
                f"'benchmark': {marker!r}, got {data.get('benchmark')!r}"
            )
        unknown = sorted(set(data) - keys)
        if unknown:
            raise self.fail(f"unexpected top-level key(s) {', '.join(map(repr, unknown))}")

    def section(self, obj: dict[str, Any], key: str, where: str = "") -> dict[str, Any]:
        value = obj.get(key)
        if not isinstance(value, dict):
            raise self.fail(f"{where + key!r} must be an object, got {value!r}")
        return value

    def number(self, obj: dict[str, Any], key: str, where: str) -> float:
        """A positive finite number."""
        value = self.optional(obj, key, where)
        if value is None:
            raise self.fail(f"{where + key!r} is null, expected a positive number")
        return value

    def optional(
        self, obj: dict[str, Any], key: str, where: str, *, fraction: bool = False
    ) -> float | None:
        """A finite number, positive (or a fraction in [0, 1]), or null; never absent."""
        if key not in obj:
            raise self.fail(f"{where + key!r} is missing")
        value = obj[key]
        if value is None:
            return None
        if not _check_number(value, False):
            raise self.fail(f"{where + key!r} is {value!r}, expected a finite number")
        if fraction and not 0.0 <= value <= 1.0:
            raise self.fail(f"{where + key!r} is {value!r}, expected a fraction in [0, 1]")
        if not fraction and value <= 0:
            raise self.fail(f"{where + key!r} is {value!r}, expected a positive number")
        return float(value)

    def text(self, obj: dict[str, Any], key: str, where: str, *, nullable: bool = False) -> Any:
        value = obj.get(key)
        if value is None and nullable:
            return None
        if not isinstance(value, str) or not value.strip():
            raise self.fail(f"{where + key!r} must be a non-empty string, got {value!r}")
        return value

    def ratio(self, obj: dict[str, Any], key: str, where: str, computed: float) -> None:
        """A recorded ratio must agree with the one computed from its parts."""
        recorded = self.number(obj, key, where)
        if not math.isclose(recorded, computed, rel_tol=1e-6):
            raise self.fail(f"{where + key!r} is {recorded!r}, but its parts give {computed}")


def _load_gpu(path: Path, root: Path, data: dict[str, Any]) -> Result:
    """Check a ``tools/bench_gpu.py`` file: every figure the page shows must be there and
    sane, and every recorded ratio must match its parts."""
    check = _Checker(path, root)
    check.producer(data, GPU_BENCHMARK, "bench-gpu-*.json", "tools/bench_gpu.py", GPU_TOP_LEVEL)
    model = check.text(data, "model", "")
    for name in GPU_SECTIONS:
        check.section(data, name)
    env = data["environment"]
    check.text(env, "device_name", "environment.")
    check.text(env, "torch", "environment.")
    bandwidth = check.number(data["bandwidth"], "bytes_per_s", "bandwidth.")
    decode = data["decode"]
    rows_data = decode.get("rows")
    if not isinstance(rows_data, list) or not rows_data:
        raise check.fail("'decode.rows' must be a non-empty list")
    rows = []
    for i, raw in enumerate(rows_data):
        where = f"decode.rows[{i}]."
        if not isinstance(raw, dict):
            raise check.fail(f"{where[:-1]!r} must be an object")
        batch = raw.get("batch_size")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise check.fail(f"{where + 'batch_size'!r} is {batch!r}, expected a positive int")
        if not isinstance(raw.get("cuda_graph"), bool):
            raise check.fail(f"{where + 'cuda_graph'!r} must be true or false")
        row = GpuRow(
            batch,
            raw["cuda_graph"],
            check.number(raw, "measured_s", where),
            check.number(raw, "roofline_s", where),
        )
        check.ratio(raw, "bandwidth_utilisation", where, row.utilisation)
        rows.append(row)
    overlap = data["overlap"]
    loops = {
        loop: check.number(check.section(overlap, loop, "overlap."), "output_throughput",
                           f"overlap.{loop}.")
        for loop in ("overlap", "normal")
    }  # fmt: skip
    result = GpuResult(
        model=model,
        environment=env,
        config=data.get("config") if isinstance(data.get("config"), dict) else {},
        bandwidth=bandwidth,
        weight_bytes=None,
        context=decode.get("context") if isinstance(decode.get("context"), int) else None,
        rows=sorted(rows, key=lambda r: (not r.cuda_graph, r.batch_size)),
        overlap_tps=loops["overlap"],
        normal_tps=loops["normal"],
        idle_profiler=check.optional(
            data["idle"], "profiler_idle_fraction", "idle.", fraction=True
        ),
        idle_timeline=check.optional(
            data["idle"], "timeline_idle_fraction_window", "idle.", fraction=True
        ),
        tandem_tps=None,
        hf_tps=None,
        hf_skipped=None,
    )
    check.ratio(overlap, "overlap_vs_normal", "overlap.", result.overlap_vs_normal)
    weights = decode.get("weights")
    if isinstance(weights, dict):
        result.weight_bytes = check.number(weights, "bytes_per_step", "decode.weights.")
    _load_gpu_peer(check, data["transformers"], result)
    command = data.get("command")
    if command is not None and (not isinstance(command, str) or not command.strip()):
        raise check.fail("'command' must be a non-empty string")
    return Result(path=path, kind=GPU_BENCHMARK, runs={}, command=command, gpu=result)


def _load_gpu_peer(check: _Checker, versus: dict[str, Any], result: GpuResult) -> None:
    """The transformers section: skipped (with the reason) or both throughputs."""
    if "skipped" in versus:
        result.hf_skipped = check.text(versus, "skipped", "transformers.")
        return
    result.tandem_tps = check.number(
        check.section(versus, "tandem", "transformers."),
        "output_throughput",
        "transformers.tandem.",
    )
    result.hf_tps = check.number(
        check.section(versus, "transformers", "transformers."),
        "output_throughput",
        "transformers.transformers.",
    )
    computed = result.tandem_vs_transformers
    assert computed is not None
    check.ratio(versus, "tandem_vs_transformers", "transformers.", computed)


def _gpu_results(results: list[Result]) -> list[GpuResult]:
    return [r.gpu for r in results if r.gpu is not None]


def _bytes(value: float) -> str:
    return f"{value / 1e9:.2f} GB" if value >= 1e8 else f"{value / 1e6:.2f} MB"


def _gpu_heading(r: Result) -> str:
    g = r.gpu
    assert g is not None
    env, cfg = g.environment, g.config
    shape = []
    if isinstance(cfg.get("hidden_size"), int) and isinstance(cfg.get("num_hidden_layers"), int):
        shape.append(f"hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers")
    if isinstance(cfg.get("parameters"), int):
        shape.append(f"{cfg['parameters'] / 1e9:.2f}B parameters")
    software = [f"torch {env['torch']}"]
    if isinstance(env.get("cuda"), str):
        software.append(f"CUDA {env['cuda']}")
    if isinstance(env.get("date"), str):
        software.append(env["date"][:10])
    facts = [f"copy bandwidth {g.bandwidth / 1e9:,.0f} GB/s"]
    if g.weight_bytes is not None:
        facts.append(f"{_bytes(g.weight_bytes)} of weights read per step")
    if g.context is not None:
        facts.append(f"{g.context} prompt tokens per request")
    model = f"{g.model} ({', '.join(shape)})" if shape else g.model
    return (
        f"**`{r.name}`**: {model} on {env['device_name']}, {', '.join(software)}; "
        f"{'; '.join(facts)}."
    )


def _gpu_table(results: list[Result]) -> str:
    """Per file, the roofline rows; then one row per file with the other sections."""
    parts = []
    for r in results:
        g = r.gpu
        assert g is not None
        rows = [["batch size", "CUDA graphs", "measured step", "roofline step", "utilisation"]]
        for row in g.rows:
            rows.append(
                [
                    str(row.batch_size),
                    "on" if row.cuda_graph else "off",
                    f"{row.measured_s * 1e3:.3f} ms",
                    f"{row.roofline_s * 1e3:.3f} ms",
                    f"{row.utilisation:.1%}",
                ]
            )
        parts.append(_gpu_heading(r) + "\n\n" + _table(rows))
    head = [
        "file",
        "output tokens/s, overlap",
        "output tokens/s, normal",
        "overlap / normal",
        "device idle, profiler",
        "device idle, timeline",
        "tandem / transformers",
    ]
    rows = [head]
    for r in results:
        g = r.gpu
        assert g is not None
        versus = g.tandem_vs_transformers
        rows.append(
            [
                f"`{r.name}`",
                f"{g.overlap_tps:.0f}",
                f"{g.normal_tps:.0f}",
                f"{g.overlap_vs_normal:.3f}",
                _fmt(g.idle_profiler, "{:.2%}"),
                _fmt(g.idle_timeline, "{:.2%}"),
                f"{versus:.2f}x" if versus is not None else f"— ({g.hf_skipped})",
            ]
        )
    parts.append(
        "The loops, the device idle fraction (overlap loop, one whole run) and the "
        "peer, one row per file:\n\n" + _table(rows)
    )
    return "\n\n".join(parts)


def _verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def _gpu_summary(results: list[Result]) -> str:
    """One bullet per file: each figure that has a target, against it."""
    bullets = []
    for r in results:
        g = r.gpu
        assert g is not None
        parts = []
        graph, eager = g.row(1, True), g.row(1, False)
        if graph is not None:
            text = f"batch 1 uses {graph.utilisation:.1%} of the bandwidth with CUDA graphs"
            if g.model in TARGET_UTILISATION_MODELS:
                ok = graph.utilisation >= TARGET_UTILISATION_B1
                text += f" (target {TARGET_UTILISATION_B1:.0%}: {_verdict(ok)})"
            parts.append(text)
        if eager is not None and graph is not None:
            parts.append(f"{eager.utilisation:.1%} without")
        elif eager is not None:
            parts.append(f"batch 1 uses {eager.utilisation:.1%} of the bandwidth, no CUDA graphs")
        idle = g.idle_profiler if g.idle_profiler is not None else g.idle_timeline
        if idle is not None:
            source = "profiler" if g.idle_profiler is not None else "engine timeline"
            parts.append(
                f"device idle {idle:.2%} with the overlap loop ({source}; target at most "
                f"{TARGET_IDLE:.0%}: {_verdict(idle <= TARGET_IDLE)})"
            )
        ratio = g.overlap_vs_normal
        parts.append(
            f"overlap / normal output throughput {ratio:.3f} (target at least 1: "
            f"{_verdict(ratio >= TARGET_OVERLAP_VS_NORMAL)})"
        )
        versus = g.tandem_vs_transformers
        if versus is not None:
            parts.append(f"tandem makes {versus:.2f}x the output tokens/s of transformers")
        bullets.append(f"- `{r.name}` ({g.model}): " + "; ".join(parts) + ".")
    return "\n".join(bullets)


def _gpu_plot(results: list[Result], set_name: str) -> bytes | None:
    """Utilisation against batch size (log2 axis): a line per model with CUDA graphs, a
    hollow marker per batch measured without, and the 70 % target."""
    found = _gpu_results(results)
    if not found:
        return None
    from matplotlib.ticker import PercentFormatter

    with _figure(4.2) as (fig, ax):
        batches: set[int] = set()
        top = 0.0
        for index, g in enumerate(found):
            color = MODEL_COLORS[index % len(MODEL_COLORS)]
            for graph in (True, False):
                rows = [r for r in g.rows if r.cuda_graph == graph]
                if not rows:
                    continue
                xs = [r.batch_size for r in rows]
                ys = [r.utilisation for r in rows]
                batches.update(xs)
                top = max(top, *ys)
                label = g.model + ("" if graph else ", no CUDA graphs")
                if graph:
                    ax.plot(xs, ys, marker="o", color=color, label=label)
                else:
                    ax.plot(
                        xs, ys, marker="s", linestyle="none", markerfacecolor="none",
                        color=color, label=label,
                    )  # fmt: skip
        threshold = TARGET_UTILISATION_B1
        ax.axhline(threshold, color="#7f7f7f", linestyle="--", linewidth=1)
        ax.annotate(
            f"target at batch 1: {threshold:.0%}",
            (min(batches), threshold),
            xytext=(4, 4),
            textcoords="offset points",
            fontsize=8,
            color="#555555",
        )
        _log2_axis(ax, batches)
        ax.set_ylim(0, max(1.0, top * 1.1))
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set_xlabel("decode batch size (requests)")
        ax.set_ylabel("roofline / measured step time")
        ax.set_title(f"{set_name.upper()}: decode step, share of the memory roofline", fontsize=11)
        ax.grid(alpha=0.3)
        return _svg(fig, ax)


def _expand_gpu(what: str, set_name: str, page_uri: str, noted: set[str]) -> str:
    """A bench_gpu table or summary, or the utilisation plot; a note while no file exists."""
    results = [r for r in _state.results.get(set_name, []) if r.kind == GPU_BENCHMARK]
    if not results:
        key = f"{set_name}:{GPU_BENCHMARK}"
        if key in noted:
            return ""
        noted.add(key)
        return (
            f"*No {set_name.upper()} results committed yet: `benchmarks/results/{set_name}/` "
            "holds no `bench-gpu-*.json` file from `tools/bench_gpu.py`. The tables, the "
            "targets and the plot appear here once one is committed.*"
        )
    if what == "plot":
        src_uri = _state.plots.get((set_name, "utilisation"))
        if src_uri is None:
            return ""
        rel = posixpath.relpath(src_uri, posixpath.dirname(page_uri) or ".")
        return f"![{set_name.upper()}: {GPU_METRICS['utilisation']}]({rel})"
    if what == "summary":
        return "Each file against the targets:\n\n" + _gpu_summary(results)
    return "\n\n".join(filter(None, (_gpu_table(results), _commands(results))))


# -- tools/bench_vllm_cpu.py files ---------------------------------------------------------------
VS_VLLM = "vs_vllm_cpu"
VS_LLAMACPP = "vs_llamacpp_cpu"
# kind -> (its files' name pattern, the peer each of its files has, the engines it may hold)
VS_KINDS = {
    VS_VLLM: ("vs-vllm-*.json", "vllm", ("tandem", "vllm")),
    VS_LLAMACPP: ("vs-llamacpp-*.json", "llamacpp", ("tandem", "vllm", "llamacpp")),
}
VS_TOP_LEVEL = {
    "benchmark",
    "schema_version",
    "command",
    "date",
    "model",
    "dtype",
    "workload",
    "machine",
    "versions",
    "caller_env",
    "engines",
    "results",
}
VS_ENGINES = {"tandem": "tandem", "vllm": "vLLM", "llamacpp": "llama.cpp"}  # key -> shown
VS_TITLES = {"vllm": "vLLM's CPU build", "llamacpp": "llama.cpp"}  # a peer in a plot's title
VS_COLORS = {"tandem": "#e07b39", "vllm": "#5b7fa6", "llamacpp": "#5a9e6f"}
VS_STYLES = (("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."))
VS_DTYPES = ("float32", "bfloat16")
# Figures of ``tandem bench serve`` every engine's row must carry: output tokens/s, and
# mean, median and p99 of TTFT, TPOT and ITL in ms (null where bench serve had no sample).
VS_FIGURES = tuple(
    f"{stat}_{what}_ms" for what in ("ttft", "tpot", "itl") for stat in ("mean", "median", "p99")
)
VS_RATIO = "tandem_vs_{}_output_throughput"  # one per peer in the file
# The project's output throughput targets, tandem over a peer (the Benchmarks page says
# where each comes from): over vLLM's CPU build per dtype, at every level; over
# llama.cpp's server with tandem on a Q4_1 file's blocks, at one stream and above one.
VS_TARGETS_VLLM = {"float32": 1.2, "bfloat16": 1.0}
VS_TARGETS_LLAMACPP_Q4_1 = (1.5, 3.0)
VS_ROUNDS = "output_throughput_runs"
# plot metric -> (the kind of file it plots, its label)
VS_METRICS = {
    "vs_vllm_throughput": (VS_VLLM, "output tokens/s against concurrency"),
    "vs_llamacpp_throughput": (VS_LLAMACPP, "output tokens/s against concurrency"),
}


@dataclass
class VsRow:
    """One concurrency level: engine -> its figures."""

    concurrency: int
    num_prompts: int
    figures: dict[str, dict[str, float | None]]
    # engine -> every round's output tokens/s in run order (files made with --repeats)
    rounds: dict[str, list[float]] = field(default_factory=dict)

    def get(self, engine: str, key: str) -> float | None:
        return self.figures.get(engine, {}).get(key)

    def ratio(self, peer: str) -> float | None:
        """tandem / ``peer`` output throughput, if the row has both."""
        tandem = self.get("tandem", "output_throughput")
        other = self.get(peer, "output_throughput")
        return None if tandem is None or other is None else tandem / other

    def round_ratios(self, peer: str) -> list[float]:
        """tandem / ``peer`` of each round (the runs made back to back), if both have
        more than one round."""
        tandem, other = self.rounds.get("tandem", []), self.rounds.get(peer, [])
        if len(tandem) < 2 or len(tandem) != len(other):
            return []
        return [t / v for t, v in zip(tandem, other, strict=True)]


@dataclass
class VsResult:
    """The figures of one ``tools/bench_vllm_cpu.py`` file that the page shows."""

    kind: str  # VS_VLLM or VS_LLAMACPP
    model: str
    parameters: int
    dtype: str
    weights: str | None  # a GGUF file's storage type (Q4_1, ...); None for a folder
    workload: dict[str, Any]
    machine: dict[str, Any]
    versions: dict[str, Any]
    engines: dict[str, dict[str, Any]]  # engine -> {"command": [...], "env": {...}}
    rows: list[VsRow]

    @property
    def peers(self) -> list[str]:
        return [e for e in VS_ENGINES if e != "tandem" and e in self.engines]

    @property
    def vectors(self) -> str:
        """The widest vector instructions of the machine's record: the CPU kernels
        tandem builds, and its peers', differ between AVX2 and AVX-512."""
        return _vectors(self.machine)

    @property
    def model_label(self) -> str:
        return f"{self.model} {self.weights}" if self.weights else self.model

    @property
    def tandem_held(self) -> dict[str, Any]:
        """The record tandem's server gave of how it held the weights (files from
        before quantized weights have none: empty)."""
        return self.engines.get("tandem", {}).get("weights") or {}

    @property
    def tandem_weights(self) -> str:
        """How tandem held a GGUF file's weights: the record its server gave (files
        from before quantized weights have none: dequantized to the dtype)."""
        held = self.tandem_held
        if held.get("quantization") == "gguf":
            parts = "one 8-bit part" if held.get("cpu_int8_activations") else "two 8-bit parts"
            return f"tandem on the {self.weights} blocks (x in {parts} where int8)"
        if held.get("quantization") == "int8":
            return "tandem in weight-only int8"
        return f"tandem in {self.dtype}"

    def target(self, peer: str, concurrency: int) -> float | None:
        """The least tandem / ``peer`` output throughput the project aims at on this
        level, if it has a target for such a file (``VS_TARGETS_*``)."""
        if peer == "vllm":
            return VS_TARGETS_VLLM.get(self.dtype)
        on_blocks = self.tandem_held.get("quantization") == "gguf"
        if peer == "llamacpp" and self.weights == "Q4_1" and on_blocks:
            one, more = VS_TARGETS_LLAMACPP_Q4_1
            return one if concurrency == 1 else more
        return None

    @property
    def label(self) -> str:
        dtype = f", {self.tandem_weights}" if self.weights else f" {self.dtype}"
        return f"{self.model_label}{dtype}" + (f", {self.vectors}" if self.vectors else "")


def _vectors(machine: dict[str, Any]) -> str:
    isa = machine.get("isa") or []
    return "AVX-512" if "avx512f" in isa else ("AVX2" if "avx2" in isa else "")


def _positive_int(check: _Checker, obj: dict[str, Any], key: str, where: str) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise check.fail(f"{where + key!r} is {value!r}, expected a positive integer")
    return value


def _strings(check: _Checker, value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
        raise check.fail(f"{where!r} must be a non-empty list of strings")
    return value


def _vs_rounds(check: _Checker, figures: dict[str, Any], at: str) -> list[float]:
    """Every round's output tokens/s; the figures shown must be the median round's."""
    rounds = figures[VS_ROUNDS]
    if (
        not isinstance(rounds, list)
        or not rounds
        or not all(_check_number(value, False) and value > 0 for value in rounds)
    ):
        raise check.fail(f"{at + VS_ROUNDS!r} must be a non-empty list of positive numbers")
    median = sorted(rounds)[(len(rounds) - 1) // 2]
    if figures["output_throughput"] != median:
        raise check.fail(
            f"{at + 'output_throughput'!r} is {figures['output_throughput']!r}, not the "
            f"median of its rounds ({median!r})"
        )
    return [float(value) for value in rounds]


def _common(check: _Checker, data: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """What every file of tools/bench_vllm_cpu.py and tools/perplexity_vs_llamacpp.py
    holds: schema 1, its command, a dtype, the machine; the command, model and machine."""
    if data.get("schema_version") != 1:
        raise check.fail(f"'schema_version' is {data.get('schema_version')!r}, expected 1")
    command = check.text(data, "command", "")
    model = check.section(data, "model")
    if data.get("dtype") not in VS_DTYPES:
        raise check.fail(f"'dtype' is {data.get('dtype')!r}, expected one of {VS_DTYPES}")
    machine = check.section(data, "machine")
    check.text(machine, "cpu_model", "machine.")
    return command, model, machine


def _vs_kind(path: Path, data: dict[str, Any]) -> str:
    """The kind a ``tools/bench_vllm_cpu.py`` file claims, else the one its name says."""
    if data.get("benchmark") in VS_KINDS:
        return str(data["benchmark"])
    return VS_LLAMACPP if path.name.startswith("vs-llamacpp-") else VS_VLLM


def _load_vs(path: Path, root: Path, data: dict[str, Any]) -> Result:
    """Check a ``tools/bench_vllm_cpu.py`` file: every figure the page shows is there and
    sane, no request failed, and each recorded ratio matches its parts."""
    check = _Checker(path, root)
    kind = _vs_kind(path, data)
    pattern, peer, allowed = VS_KINDS[kind]
    check.producer(data, kind, pattern, "tools/bench_vllm_cpu.py", VS_TOP_LEVEL)
    command, model, machine = _common(check, data)
    _positive_int(check, machine, "cores", "machine.")
    versions = check.section(data, "versions")
    check.text(versions, "torch", "versions.")
    engines = check.section(data, "engines")
    if not engines or set(engines) - set(allowed) or (kind == VS_LLAMACPP and peer not in engines):
        names = ", ".join(allowed)
        needed = f", {VS_ENGINES[peer]} among them" if kind == VS_LLAMACPP else ""
        raise check.fail(f"'engines' must name one or more of {names}{needed}")
    for engine, info in engines.items():
        if not isinstance(info, dict):
            raise check.fail(f"'engines.{engine}' must be an object")
        _strings(check, info.get("command"), f"engines.{engine}.command")
        env = info.get("env")
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise check.fail(f"'engines.{engine}.env' must be an object of strings")
        if engine != "tandem":
            check.text(versions, engine, "versions.")
    raw_rows = data.get("results")
    if not isinstance(raw_rows, list) or not raw_rows:
        raise check.fail("'results' must be a non-empty list")
    peers = [e for e in VS_ENGINES if e != "tandem" and e in engines]
    rows: list[VsRow] = []
    for i, raw in enumerate(raw_rows):
        where = f"results[{i}]."
        if not isinstance(raw, dict):
            raise check.fail(f"{where[:-1]!r} must be an object")
        row = VsRow(
            _positive_int(check, raw, "concurrency", where),
            _positive_int(check, raw, "num_prompts", where),
            {},
        )
        if rows and row.concurrency <= rows[-1].concurrency:
            raise check.fail(f"{where + 'concurrency'!r}: the levels must increase")
        for engine in engines:
            figures = check.section(raw, engine, where)
            at = f"{where}{engine}."
            if figures.get("failed") != 0:
                raise check.fail(f"{at + 'failed'!r} is {figures.get('failed')!r}: a run with "
                                 "failed requests is no measurement")  # fmt: skip
            row.figures[engine] = {
                "output_throughput": check.number(figures, "output_throughput", at),
                **{key: check.optional(figures, key, at) for key in VS_FIGURES},
            }
            if VS_ROUNDS in figures:
                row.rounds[engine] = _vs_rounds(check, figures, at)
        for other in VS_ENGINES:
            key = VS_RATIO.format(other)
            computed = row.ratio(other) if other in peers else None
            if computed is not None:
                check.ratio(raw, key, where, computed)
            elif key in raw:
                raise check.fail(f"{where + key!r} needs both engines' figures")
        rows.append(row)
    weights = model.get("weights")
    if weights is not None and (not isinstance(weights, str) or not weights.strip()):
        raise check.fail(f"'model.weights' is {weights!r}, expected a non-empty string")
    result = VsResult(
        kind=kind,
        model=check.text(model, "name", "model."),
        parameters=_positive_int(check, model, "parameters", "model."),
        dtype=data["dtype"],
        weights=weights,
        workload=workload if isinstance(workload := data.get("workload"), dict) else {},
        machine=machine,
        versions=versions,
        engines=engines,
        rows=rows,
    )
    return Result(path=path, kind=kind, runs={}, command=command, vs=result)


def _vs_results(results: list[Result]) -> list[tuple[Result, VsResult]]:
    return [(r, r.vs) for r in results if r.vs is not None]


def _vs_table(results: list[Result]) -> str:
    """One row per file and concurrency, then per file its setting and commands. The
    columns: every engine of the files shown, tandem first, and tandem / each peer."""
    found = _vs_results(results)
    engines = [e for e in VS_ENGINES if any(e in v.engines for _, v in found)]
    peers = [e for e in engines if e != "tandem"]
    names = [VS_ENGINES[e] for e in engines]
    head = ["model", "dtype", "CPU", "concurrency", *(f"{n} tok/s" for n in names)]
    head += [f"tandem / {VS_ENGINES[p]}" for p in peers]
    head += [f"TPOT p50, {n}" for n in names] + [f"TTFT p50, {n}" for n in names]
    rows = [head]
    for _, v in found:
        for row in v.rows:
            cells = [v.model_label, v.dtype, v.vectors, str(row.concurrency)]
            cells += [_fmt(row.get(e, "output_throughput"), "{:.1f}") for e in engines]
            cells += [_fmt(row.ratio(p), "{:.2f}") for p in peers]
            cells += [_fmt(row.get(e, "median_tpot_ms"), "{:.1f} ms") for e in engines]
            cells += [_fmt(row.get(e, "median_ttft_ms"), "{:.0f} ms") for e in engines]
            rows.append(cells)
    parts = [_table(rows)]
    for r, v in found:
        parts.append(_vs_setting(r, v))
    return "\n\n".join(parts)


def _vs_setting(r: Result, v: VsResult) -> str:
    """What one file ran on and how: the machine, the versions, the exact commands."""
    vectors = f", {v.vectors}" if v.vectors else ""
    machine, versions = v.machine, v.versions
    software = [f"torch {versions['torch']}"]
    if isinstance(versions.get("vllm"), str):
        software.append(f"vLLM {versions['vllm']}")
    if isinstance(versions.get("llamacpp"), str):
        software.append(f"llama.cpp from {versions['llamacpp']}{_cmake(v.engines)}")
    commit = versions.get("tandem_commit")
    if isinstance(commit, str) and commit:
        modified = " with local changes" if versions.get("tandem_tree_modified") else ""
        software.append(f"tandem at `{commit[:10]}`{modified}")
    work = v.workload
    shape = ""
    if all(isinstance(work.get(k), int) for k in ("input_len", "output_len")):
        shape = (
            f"; {work['input_len']} prompt tokens and {work['output_len']} output tokens "
            "per request"
        )
    prompts = ", ".join(f"{row.num_prompts} at {row.concurrency}" for row in v.rows)
    lines = [
        f"# {r.name}",
        r.command or "",
        *(_vs_server(engine, info) for engine, info in v.engines.items()),
    ]
    size = f"{v.parameters / 1e6:.1f}M parameters"
    what = (
        f"({size}, {v.weights} weights, {v.tandem_weights})"
        if v.weights
        else f"({size}), {v.dtype}"
    )
    return (
        f"**`{r.name}`**: {v.model} {what}, on "
        f"{machine['cpu_model']} ({machine['cores']} cores{vectors}); "
        f"{', '.join(software)}{shape}; "
        f"requests per concurrency level: {prompts}. The commands (the script's, then each "
        f"server's with the environment it was given):\n\n```bash\n" + "\n".join(lines) + "\n```"
    )


def _cmake(engines: dict[str, dict[str, Any]]) -> str:
    """`` (Release, GGML_NATIVE=ON)`` from a llama.cpp build's recorded options."""
    build = engines.get("llamacpp", {}).get("build")
    options = build.get("cmake") if isinstance(build, dict) else None
    if not isinstance(options, dict):
        return ""
    shown = [str(options["CMAKE_BUILD_TYPE"])] if "CMAKE_BUILD_TYPE" in options else []
    shown += [f"{k}={v}" for k, v in options.items() if k.startswith("GGML_")]
    return f" ({', '.join(shown)})" if shown else ""


def _vs_server(engine: str, info: dict[str, Any]) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(info["env"].items()))
    command = " ".join(filter(None, (env, shlex.join(info["command"]))))
    return f"# {VS_ENGINES[engine]} server\n{command}"


def _vs_summary(results: list[Result]) -> str:
    bullets = []
    for r, v in _vs_results(results):
        parts = []
        for peer in v.peers:
            ratios = [
                f"{ratio:.2f} at {row.concurrency}{_vs_spread(row, peer)}"
                for row in v.rows
                if (ratio := row.ratio(peer)) is not None
            ]
            if ratios:
                parts.append(f"tandem / {VS_ENGINES[peer]} output throughput " + ", ".join(ratios))
        if parts:
            text = "; ".join(parts)
            rounds = max((len(r) for row in v.rows for r in row.rounds.values()), default=1)
            if rounds > 1:
                text += (
                    f" (each engine's median of {rounds} rounds, the engines alternating; "
                    "in brackets the lowest and highest ratio of one round's pair)"
                )
        else:
            text = f"{', '.join(VS_ENGINES[e] for e in v.engines)} only, nothing to compare"
        verdicts = "".join(_vs_verdict(v, peer) for peer in v.peers)
        bullets.append(f"- `{r.name}` ({v.label}): {text}.{verdicts}")
    return "\n".join(bullets)


def _vs_verdict(v: VsResult, peer: str) -> str:
    """A sentence: each level against its target, if the file has one. A level reaches
    it where the ratio as shown (two decimals) is at least the target."""
    targets: dict[float, list[str]] = {}
    reached, missed = [], []
    for row in v.rows:
        target, ratio = v.target(peer, row.concurrency), row.ratio(peer)
        if target is None or ratio is None:
            continue
        targets.setdefault(target, []).append(str(row.concurrency))
        shown = round(ratio, 2)
        if shown >= target:
            reached.append(str(row.concurrency))
        else:
            missed.append(f"{row.concurrency} by {target - shown:.2f}")
    if not targets:
        return ""
    if len(targets) == 1:
        wanted = f"{next(iter(targets)):.1f} at every level"
    else:
        wanted = ", ".join(f"{t:.1f} at {_and(levels)}" for t, levels in targets.items())
    if not missed:
        verdicts = ["reached at every level"]
    else:
        verdicts = [f"reached at {_and(reached)}"] if reached else []
        verdicts.append(f"missed at {_and(missed, 'at ')}")
    return f" Against the target over {VS_ENGINES[peer]} ({wanted}): {'; '.join(verdicts)}."


def _and(items: list[str], each: str = "") -> str:
    """``a, b and c``; ``each`` goes before every item but the first."""
    items = items[:1] + [each + item for item in items[1:]]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _vs_spread(row: VsRow, peer: str) -> str:
    ratios = row.round_ratios(peer)
    return f" [{min(ratios):.2f}-{max(ratios):.2f}]" if ratios else ""


def _vs_plot(results: list[Result], set_name: str) -> bytes | None:
    """Output tokens/s against concurrency (log2 axis): a line per engine and file, the
    engine by colour, the file by marker and line style."""
    found = _vs_results(results)
    if not found:
        return None
    with _figure(4.2) as (fig, ax):
        levels: set[int] = set()
        top = 0.0
        for index, (_, v) in enumerate(found):
            marker, style = VS_STYLES[index % len(VS_STYLES)]
            for engine in VS_ENGINES:
                xs, ys = [], []
                for row in v.rows:
                    value = row.get(engine, "output_throughput")
                    if value is not None:
                        xs.append(row.concurrency)
                        ys.append(value)
                if not xs:
                    continue
                levels.update(xs)
                top = max(top, *ys)
                ax.plot(
                    xs, ys, marker=marker, linestyle=style, color=VS_COLORS[engine],
                    label=f"{VS_ENGINES[engine]}, {v.label}",
                )  # fmt: skip
        _log2_axis(ax, levels)
        ax.set_ylim(0, top * 1.1 if top > 0 else 1)
        ax.set_xlabel("concurrency (requests in flight at most)")
        ax.set_ylabel("output tokens/s (higher is better)")
        peers = [VS_TITLES[p] for p in VS_TITLES if any(p in v.engines for _, v in found)]
        ax.set_title(
            f"{set_name.upper()}: tandem and {' and '.join(peers)}, output tokens/s", fontsize=11
        )
        ax.grid(alpha=0.3)
        return _svg(fig, ax)


def _expand_vs(what: str, set_name: str, page_uri: str, arg: str) -> str:
    """A vs_vllm_cpu or vs_llamacpp_cpu table or summary, or its plot; a note while no
    file of the kind exists."""
    kind = VS_METRICS[arg][0] if arg in VS_METRICS else arg
    results = [r for r in _state.results.get(set_name, []) if r.kind == kind]
    pattern, peer, _ = VS_KINDS[kind]
    if not results:
        if what != "table":
            return ""
        return (
            f"*No {set_name.upper()} results from `tools/bench_vllm_cpu.py` have been "
            f"recorded yet: `benchmarks/results/{set_name}/` holds no `{pattern}` file.*"
        )
    if what == "plot":
        src_uri = _state.plots.get((set_name, arg))
        if src_uri is None:
            return ""
        rel = posixpath.relpath(src_uri, posixpath.dirname(page_uri) or ".")
        label = VS_METRICS[arg][1]
        return f"![{set_name.upper()}: {label}, tandem and {VS_ENGINES[peer]}]({rel})"
    if what == "summary":
        peers = [VS_ENGINES[p] for p in VS_TITLES if any(p in v.engines for _, v in
                                                         _vs_results(results))]  # fmt: skip
        over = " and ".join(f"{p}'s" for p in peers)
        return (
            f"Output throughput of tandem over {over}, per file and concurrency (above 1 "
            "favours tandem):\n\n" + _vs_summary(results)
        )
    return _vs_table(results)


# -- tools/perplexity_vs_llamacpp.py files -------------------------------------------------------
PPL = "perplexity_vs_llamacpp"
PPL_TOP_LEVEL = {
    "benchmark",
    "schema_version",
    "command",
    "date",
    "model",
    "dtype",
    "text",
    "context",
    "chunks",
    "machine",
    "versions",
    "engines",
    "results",
    "tandem_vs_llamacpp_perplexity",
}
PPL_RATIO = "tandem_vs_llamacpp_perplexity"


@dataclass
class PerplexityResult:
    """The figures of one ``tools/perplexity_vs_llamacpp.py`` file that the page shows."""

    model: str
    weights: str | None
    dtype: str
    text: dict[str, Any]
    context: int
    chunks: int
    machine: dict[str, Any]
    versions: dict[str, Any]
    engines: dict[str, dict[str, Any]]
    llamacpp: dict[str, float]  # perplexity, error, scored_tokens
    tandem: dict[str, float]  # the same, on llama.cpp's tokens and positions
    bench: dict[str, float]  # tandem bench perplexity: perplexity, scored_tokens, window, stride

    @property
    def ratio(self) -> float:
        return self.tandem["perplexity"] / self.llamacpp["perplexity"]

    @property
    def one_part(self) -> bool:
        """Whether tandem's quantized products rounded x to one 8-bit part."""
        options = self.engines["tandem"].get("options")
        return isinstance(options, dict) and options.get("cpu_int8_activations") is True

    @property
    def label(self) -> str:
        weights = f" {self.weights}" if self.weights else ""
        parts = ", x in one 8-bit part" if self.one_part else ""
        return f"{self.model}{weights}, tandem in {self.dtype}{parts}"


def _ppl_estimate(check: _Checker, results: dict[str, Any], key: str) -> dict[str, float]:
    section = check.section(results, key, "results.")
    at = f"results.{key}."
    return {
        "perplexity": check.number(section, "perplexity", at),
        "error": check.number(section, "error", at),
        "scored_tokens": _positive_int(check, section, "scored_tokens", at),
    }


def _load_perplexity(path: Path, root: Path, data: dict[str, Any]) -> Result:
    """Check a ``tools/perplexity_vs_llamacpp.py`` file: both estimates over the tokens
    llama-perplexity scores (N/2 - 1 per chunk of N), the ratio matching its parts."""
    check = _Checker(path, root)
    check.producer(
        data, PPL, "perplexity-llamacpp-*.json", "tools/perplexity_vs_llamacpp.py", PPL_TOP_LEVEL
    )
    command, model, machine = _common(check, data)
    text = check.section(data, "text")
    check.text(text, "file", "text.")
    context = _positive_int(check, data, "context", "")
    chunks = _positive_int(check, data, "chunks", "")
    versions = check.section(data, "versions")
    check.text(versions, "llamacpp", "versions.")
    engines = check.section(data, "engines")
    for engine in ("llamacpp", "tandem"):
        _strings(check, check.section(engines, engine, "engines.").get("command"),
                 f"engines.{engine}.command")  # fmt: skip
    results = check.section(data, "results")
    llamacpp = _ppl_estimate(check, results, "llamacpp")
    tandem = _ppl_estimate(check, results, "tandem")
    expected = chunks * (context - context // 2 - 1)
    for key, estimate in (("llamacpp", llamacpp), ("tandem", tandem)):
        if estimate["scored_tokens"] != expected:
            raise check.fail(
                f"'results.{key}.scored_tokens' is {estimate['scored_tokens']}, but "
                f"{chunks} chunks of {context} score {expected}"
            )
    section = check.section(results, "tandem_bench_perplexity", "results.")
    at = "results.tandem_bench_perplexity."
    bench = {
        "perplexity": check.number(section, "perplexity", at),
        **{k: _positive_int(check, section, k, at) for k in ("scored_tokens", "window", "stride")},
    }
    check.ratio(data, PPL_RATIO, "", tandem["perplexity"] / llamacpp["perplexity"])
    weights = model.get("weights")
    result = PerplexityResult(
        model=check.text(model, "name", "model."),
        weights=weights if isinstance(weights, str) else None,
        dtype=data["dtype"],
        text=text,
        context=context,
        chunks=chunks,
        machine=machine,
        versions=versions,
        engines=engines,
        llamacpp=llamacpp,
        tandem=tandem,
        bench=bench,
    )
    return Result(path=path, kind=PPL, runs={}, command=command, perplexity=result)


def _ppl_results(results: list[Result]) -> list[tuple[Result, PerplexityResult]]:
    return [(r, r.perplexity) for r in results if r.perplexity is not None]


def _ppl_table(results: list[Result]) -> str:
    """One row per file, then per file its setting and commands."""
    head = ["model", "dtype", "text", "chunks x tokens", "llama.cpp", "tandem, same tokens"]
    head += ["tandem / llama.cpp", "scored", "`tandem bench perplexity`", "scored"]
    rows = [head]
    for _, p in _ppl_results(results):
        same = p.text.get("same_tokens_in_chunks")
        rows.append(
            [
                p.model
                + (f" {p.weights}" if p.weights else "")
                + (" (x in one 8-bit part)" if p.one_part else ""),
                p.dtype,
                f"`{p.text['file']}`",
                f"{p.chunks} x {p.context}",
                f"{p.llamacpp['perplexity']:.4f} ± {p.llamacpp['error']:.4f}",
                f"{p.tandem['perplexity']:.4f} ± {p.tandem['error']:.4f}",
                f"{p.ratio:.4f}",
                f"{p.llamacpp['scored_tokens']}",
                f"{p.bench['perplexity']:.4f} (window {p.bench['window']}, stride "
                f"{p.bench['stride']})",
                f"{p.bench['scored_tokens']}",
            ]
        )
        if same is False:
            rows[-1][2] += " (tokenized differently)"
    parts = [_table(rows)]
    for r, p in _ppl_results(results):
        lines = [f"# {r.name}", r.command or ""]
        lines += [f"# {VS_ENGINES[e]}\n{shlex.join(p.engines[e]['command'])}"
                  for e in ("llamacpp", "tandem")]  # fmt: skip
        vectors = _vectors(p.machine)
        same = p.text.get("same_tokens_in_chunks")
        tokens = (
            " tandem's tokenizer and llama.cpp's give the same tokens over the chunks;"
            if same is True
            else " the two tokenizers differ over the chunks;"
            if same is False
            else ""
        )
        parts.append(
            f"**`{r.name}`**: {p.label}, on {p.machine['cpu_model']}"
            f"{f' ({vectors})' if vectors else ''}; llama.cpp from {p.versions['llamacpp']}"
            f"{_cmake(p.engines)}.{tokens} the commands:\n\n```bash\n" + "\n".join(lines) + "\n```"
        )
    return "\n\n".join(parts)


def _ppl_summary(results: list[Result]) -> str:
    bullets = []
    for r, p in _ppl_results(results):
        bullets.append(
            f"- `{r.name}` ({p.label}): on the tokens llama-perplexity scores ({p.chunks} "
            f"chunks of {p.context}, the second half of each), tandem "
            f"{p.tandem['perplexity']:.4f} and llama.cpp {p.llamacpp['perplexity']:.4f} "
            f"(tandem / llama.cpp {p.ratio:.4f}); `tandem bench perplexity` over the same "
            f"chunks, every token after each chunk's first: {p.bench['perplexity']:.4f}."
        )
    return "\n".join(bullets)


def _expand_perplexity(what: str, set_name: str) -> str:
    results = [r for r in _state.results.get(set_name, []) if r.kind == PPL]
    if not results:
        if what != "table":
            return ""
        return (
            f"*No {set_name.upper()} results from `tools/perplexity_vs_llamacpp.py` have been "
            f"recorded yet: `benchmarks/results/{set_name}/` holds no "
            "`perplexity-llamacpp-*.json` file.*"
        )
    if what == "summary":
        return "Perplexity, tandem and llama.cpp on the same file and text:\n\n" + _ppl_summary(
            results
        )
    return _ppl_table(results)


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
            plottable = len(words) == 3 and (
                words[2] in METRICS or words[2] in GPU_METRICS or words[2] in VS_METRICS
            )
            if plottable and words[0] == "plot" and words[1] in SETS:
                wanted.add((words[1], words[2]))
    for set_name, metric in sorted(wanted):
        results = _state.results.get(set_name, [])
        if metric in GPU_METRICS:
            svg = _gpu_plot(results, set_name)
        elif metric in VS_METRICS:
            kind = VS_METRICS[metric][0]
            svg = _vs_plot([r for r in results if r.kind == kind], set_name)
        else:
            svg = _plot(results, metric, set_name)
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
        folder = results_dir(_state.root) / set_name
        if folder.is_dir():
            server.watch(str(folder))
