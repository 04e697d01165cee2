"""What a user installs, run as a user runs it: the ``layers`` and ``smoke`` nox sessions.

``layer NAME`` checks one layer in an environment that holds only what that layer and
the layers below it declare (the ``layers`` session installs them one at a time,
bottom-up, without extras, and runs this after each):

1. every module of the layer imports its third-party packages from the layer's own
   declared dependencies (read from the source, imports inside functions included);
   a package declared only in an extra, or brought by GPU builds of torch, must be one
   of ``OPTIONAL`` below;
2. every module of the layer imports, with warnings turned into errors, except modules
   that need one of the ``OPTIONAL`` packages (those are listed as skipped);
3. the layer's entry points run, with warnings turned into errors.

``readme -- SERVER COMMAND`` runs README.md's own snippets (its fenced code blocks, so
README and this check cannot drift) against a real server: it starts SERVER COMMAND on
a free port, waits for its ready line, sends the README's curl request (a question to
the default model, whose answer must name Paris), runs its
``openai`` client example (with ``--client-python``, the interpreter of a separate
environment that holds the client), its offline ``Engine`` example and
``python -m tandem.futuremap``, then stops the server with SIGINT (to its process
group, as Ctrl-C in a terminal does). It fails on a
non-zero exit, a traceback or a warning in any output, or a server that takes more
than 10 s to stop or leaves a process behind. It also checks that ``.ci/run`` runs the
README's test command.

Run it through nox (``python3 -m nox -s layers``, ``python3 -m nox -s smoke``), which
sets up the environments; directly, from the repository root::

    python tools/smoke.py layer scheduler
    python tools/smoke.py readme --client-python /path/to/client/bin/python -- \\
        tandem serve --device cpu
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"

# folder under packages/: (distribution, module)
LAYERS = {
    "core-futuremap": ("tandem-core-futuremap", "tandem.futuremap"),
    "scheduler": ("tandem-scheduler", "tandem.scheduler"),
    "spec-eagle": ("tandem-spec-eagle", "tandem.spec_eagle"),
    "server": ("tandem-server", "tandem.server"),
}
# Packages a layer may import without a plain dependency on them: only in modules
# imported when the feature that needs them is asked for, never by importing the layer.
# Each is declared in the extra named here, or (None) brought by GPU builds of torch
# (CUDA: triton; ROCm: pytorch-triton-rocm).
OPTIONAL: dict[str, str | None] = {
    "triton": None,
    "flashinfer": "cuda",  # tandem-scheduler[cuda]
    "transformers": "transformers",  # tandem-server[transformers]
    "mooncake": "mooncake",  # tandem-scheduler[mooncake]
}
# Import names whose distribution is named otherwise, for packages not installed here.
DISTRIBUTION_OF = {
    "zmq": "pyzmq",
    "flashinfer": "flashinfer-python",
    "mooncake": "mooncake-transfer-engine-non-cuda",
}

# A problem in a command's output: a traceback, a Python warning or a log line at
# WARNING level or above.
PROBLEM = re.compile(
    r"Traceback \(most recent call last\)|\b\w*Warning\b|^\s*(WARNING|ERROR|CRITICAL)\b",
    re.MULTILINE,
)
READY = r"tandem is ready at (http://\S+)"
README_PORT = 30000
# The most tokens the README's first request may ask for.
ANSWER_TOKENS = 32
STOP_SECONDS = 10.0


class CheckFailed(Exception):
    pass


def _say(text: str) -> None:
    print(text, flush=True)


def _indent(text: str, prefix: str = "    | ") -> str:
    return "".join(prefix + line + "\n" for line in text.rstrip("\n").splitlines())


@dataclass
class Step:
    name: str
    seconds: float
    ok: bool


class Report:
    """The steps run so far, each timed; ``step`` runs one and records it."""

    def __init__(self) -> None:
        self.steps: list[Step] = []

    def step(self, name: str, fn: Callable[[], str | None], keep_going: bool = False) -> None:
        """Run ``fn``; on failure, raise ``CheckFailed`` again unless ``keep_going``."""
        _say(f"--- {name}")
        start = time.perf_counter()
        try:
            note = fn()
        except CheckFailed as exc:
            self.steps.append(Step(name, time.perf_counter() - start, False))
            _say(f"FAILED: {name}: {exc}")
            if keep_going:
                return
            raise
        self.steps.append(Step(name, time.perf_counter() - start, True))
        _say(f"ok ({time.perf_counter() - start:.1f} s){': ' + note if note else ''}")

    @property
    def failed(self) -> bool:
        return not all(s.ok for s in self.steps)

    def summary(self, title: str) -> None:
        _say(f"\n{title}")
        for s in self.steps:
            _say(f"  {'ok  ' if s.ok else 'FAIL'} {s.seconds:6.1f} s  {s.name}")


def _check_output(output: str) -> None:
    found = PROBLEM.search(output)
    if found:
        line = output[: found.start()].count("\n")
        raise CheckFailed(
            f"{found.group(0).strip()!r} in the output, line {line + 1}: "
            f"{output.splitlines()[line].strip()!r}"
        )


def _abridged(text: str, keep: int = 12) -> str:
    lines = text.rstrip("\n").splitlines()
    if len(lines) <= keep:
        return text
    return "\n".join([*lines[:keep], f"... ({len(lines) - keep} more lines)"])


def _run(
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 600,
    expect_exit: int = 0,
) -> str:
    """Run ``argv``, echo its output, and fail on another exit status or a problem."""
    _say("$ " + shlex.join(a if "\n" not in a else "<script>" for a in argv))
    try:
        done = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=cwd,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        raise CheckFailed(f"still running after {timeout:.0f} s") from exc
    failed = done.returncode != expect_exit or PROBLEM.search(done.stdout)
    _say(_indent(done.stdout if failed else _abridged(done.stdout)))
    if done.returncode != expect_exit:
        raise CheckFailed(f"exit status {done.returncode}, expected {expect_exit}")
    _check_output(done.stdout)
    return done.stdout


def _run_only(argv: Sequence[str], **kwargs: Any) -> None:
    _run(argv, **kwargs)


# -- layer ------------------------------------------------------------------------------------
def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(dist: str) -> list[tuple[str, str | None]]:
    """``(name, extra)`` of each requirement of ``dist``; extra is None for the core ones."""
    out = []
    for req in importlib.metadata.requires(dist) or []:
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
        if not match:
            raise CheckFailed(f"{dist}: cannot read the requirement {req!r}")
        extra = re.search(r"extra\s*==\s*[\"']([^\"']+)[\"']", req)
        out.append((_canonical(match.group(1)), extra.group(1) if extra else None))
    return out


def _tandem_closure(dist: str) -> set[str]:
    """``dist`` and every tandem layer it depends on, directly or not (no extras)."""
    seen, todo = set(), [_canonical(dist)]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += [r for r, extra in _requirements(name) if extra is None and r.startswith("tandem-")]
    return seen


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """Absolute imports (module name, line) outside ``if TYPE_CHECKING:`` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]))
            continue
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno
        yield from _imports(node)


def _module_files(module: str) -> list[Path]:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise CheckFailed(f"{module} is not installed here")
    return sorted(
        f for location in spec.submodule_search_locations for f in Path(location).rglob("*.py")
    )


def check_declared_imports(layer: str) -> str:
    """Every package the layer's source imports is declared by the layer."""
    dist, module = LAYERS[layer]
    declared: dict[str, str | None] = {}
    for name, extra in _requirements(dist):
        if name not in declared or extra is None:
            declared[name] = extra
    closure = _tandem_closure(dist)
    layer_of = {mod: _canonical(d) for d, mod in LAYERS.values()}
    installed = importlib.metadata.packages_distributions()
    problems, optional = [], set()
    for path in _module_files(module):
        for name, line in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            top = name.split(".")[0]
            where = f"{path.name}:{line}: import {name}"
            if top in sys.stdlib_module_names or top == "__future__":
                continue
            if top == "tandem":
                owner = layer_of.get(".".join(name.split(".")[:2]))
                if owner is None:
                    problems.append(f"{where}: no tandem layer provides it")
                elif owner not in closure:
                    problems.append(f"{where}: {dist} does not depend on {owner}")
                continue
            wanted = _canonical(
                (installed.get(top) or [DISTRIBUTION_OF.get(top, top)])[0]
            )  # fmt: skip
            extra = declared.get(wanted, "")
            if extra is None:
                continue
            if top in OPTIONAL and OPTIONAL[top] in (None, extra):
                optional.add(top)
                continue
            problems.append(
                f"{where}: {wanted} is "
                + (f"declared only in the extra {extra!r}" if extra else "not declared")
                + f" by {dist}"
                + (f" (expected in its extra {OPTIONAL[top]!r})" if OPTIONAL.get(top) else "")
            )
    if problems:
        raise CheckFailed(f"undeclared imports in {dist}:\n" + "\n".join(problems))
    return f"optional: {', '.join(sorted(optional))}" if optional else ""


IMPORT_ALL = r"""
import importlib, pkgutil, sys
optional = set(sys.argv[2].split(","))
try:
    package = importlib.import_module(sys.argv[1])
except Exception as exc:
    sys.exit(f"cannot import {sys.argv[1]}: {exc!r}")
names = [sys.argv[1]] + [
    m.name for m in pkgutil.walk_packages(package.__path__, sys.argv[1] + ".")
    if not m.name.endswith(".__main__")  # a command: run as one below, not imported
]
failed = False
for name in sorted(names):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] in optional:
            print(f"skipped {name} (needs {exc.name})")
            continue
        failed = True
        print(f"cannot import {name}: {exc!r}")
    except Exception as exc:
        failed = True
        print(f"cannot import {name}: {exc!r}")
    else:
        print(f"imported {name}")
sys.exit(1 if failed else 0)
"""


def check_imports(layer: str, work: Path) -> str:
    _, module = LAYERS[layer]
    argv = [sys.executable, "-W", "error", "-c", IMPORT_ALL, module, ",".join(OPTIONAL)]
    out = _run(argv, cwd=work)
    imported = out.count("imported ")
    skipped = out.count("skipped ")
    return f"{imported} modules imported" + (f", {skipped} skipped" if skipped else "")


SPEC_DECODE = r"""
import sys
from importlib.metadata import entry_points
from pathlib import Path

from tandem.scheduler import Engine
from tandem.spec_eagle import write_random_head

found = {ep.name: ep.load() for ep in entry_points(group="tandem.speculative_algorithms")}
assert {"EAGLE", "EAGLE3"} <= set(found), found
target = Path(sys.argv[1])
head = write_random_head(target, Path(sys.argv[2]), algorithm="EAGLE3")
options = dict(
    speculative_algorithm="EAGLE3", speculative_draft_model_path=str(head),
    speculative_num_steps=2, speculative_eagle_topk=1, speculative_num_draft_tokens=3,
)
with Engine(model_path=str(target), device="cpu", **options) as engine:
    out = engine.generate("Hello", {"max_new_tokens": 8, "temperature": 0})
print(repr(out["text"]), out["meta_info"]["finish_reason"])
"""

TRITON_ASKED_FOR = r"""
import importlib.util, os
from tandem.scheduler import Engine
if importlib.util.find_spec("triton") is not None:
    print("triton is installed here: nothing to check")
    raise SystemExit(0)
os.environ["TRITON_INTERPRET"] = "1"  # the CPU's only way to ask for the triton backend
try:
    Engine(model_path="tandem-tiny", device="cpu", attention_backend="triton")
except ValueError as exc:
    assert "'triton' package" in str(exc), exc
    print("refused as expected:", exc)
else:
    raise SystemExit("attention_backend='triton' without Triton was not refused")
"""


def _entry_points(layer: str, work: Path) -> list[tuple[str, list[str]]]:
    py = [sys.executable, "-W", "error"]
    bindir = Path(sys.executable).parent
    if layer == "core-futuremap":
        return [
            ("the tandem-futuremap-demo script", [str(bindir / "tandem-futuremap-demo")]),
            ("python -m tandem.futuremap", [*py, "-m", "tandem.futuremap"]),
        ]
    if layer == "scheduler":
        generate = ["--model-path", "tandem-tiny", "--device", "cpu", "--prompt", "Hello"]
        generate += ["--max-new-tokens", "8"]
        return [
            ("python -m tandem.scheduler --help", [*py, "-m", "tandem.scheduler", "--help"]),
            ("offline generation, the tiny model", [*py, "-m", "tandem.scheduler", *generate]),
            ("the triton backend asked for without Triton", [*py, "-c", TRITON_ASKED_FOR]),
        ]
    if layer == "spec-eagle":
        target = str(ROOT / "tools" / "eagle_pair" / "target")
        head = str(work / "eagle3-head")
        return [("EAGLE-3 decoding, a random head", [*py, "-c", SPEC_DECODE, target, head])]
    tandem = str(bindir / "tandem")
    bench = ["--model-path", "tandem-tiny", "--device", "cpu", "--num-prompts", "2"]
    bench += ["--random-input-len", "8"]
    bench += ["--random-output-len", "4", "--repeats", "1"]
    return [
        ("tandem --help", [tandem, "--help"]),
        ("tandem serve --help", [tandem, "serve", "--help"]),
        ("tandem generate --help", [tandem, "generate", "--help"]),
        ("tandem bench --help", [tandem, "bench", "--help"]),
        ("tandem bench serve --help", [tandem, "bench", "serve", "--help"]),
        ("tandem bench, a tiny workload", [tandem, "bench", *bench]),
    ]


def layer(args: argparse.Namespace) -> int:
    """Every check of the layer, each run even when an earlier one failed."""
    name = args.name
    report = Report()
    errors = {**os.environ, "PYTHONWARNINGS": "error"}
    with tempfile.TemporaryDirectory(prefix=f"tandem-layer-{name}-") as tmp:
        work = Path(tmp)
        steps: list[tuple[str, Callable[[], str | None]]] = [
            ("declared dependencies cover every import", lambda: check_declared_imports(name)),
            ("every module imports, warnings as errors", lambda: check_imports(name, work)),
        ]
        for what, argv in _entry_points(name, work):
            steps.append((what, lambda argv=argv: _run_only(argv, env=errors, cwd=work)))
        for what, fn in steps:
            report.step(what, fn, keep_going=True)
    report.summary(f"layer {name}: {'FAILED' if report.failed else 'ok'}")
    return 1 if report.failed else 0


# -- readme -----------------------------------------------------------------------------------
@dataclass
class Block:
    lang: str
    text: str
    line: int


def fenced_blocks(text: str) -> list[Block]:
    """README's fenced code blocks (```lang ... ```), with the line each starts on."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = re.match(r"^(`{3,})(\w*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        fence, start, body = opening.group(1), i + 1, []
        i += 1
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        blocks.append(Block(opening.group(2), "\n".join(body) + "\n", start))
        i += 1
    return blocks


def _one_block(blocks: list[Block], lang: str, test: Callable[[str], bool], what: str) -> Block:
    found = [b for b in blocks if b.lang == lang and test(b.text)]
    if not found:
        raise CheckFailed(f"README.md has no {lang} block with {what}")
    return found[0]


@dataclass
class Snippets:
    main_command: str
    test_command: str
    curl: Block
    offline: Block
    client: Block


def readme_snippets() -> Snippets:
    blocks = fenced_blocks(README.read_text(encoding="utf-8"))
    commands = _one_block(blocks, "bash", lambda t: "nox -s serve" in t, "the main command")
    lines = [line.strip() for line in commands.text.splitlines()]
    main = [line for line in lines if re.search(r"nox -s serve\b", line)]
    tests = [line for line in lines if re.search(r"nox -s tests\b", line)]
    if len(main) != 1 or len(tests) != 1:
        raise CheckFailed(
            f"README.md line {commands.line}: expected one serve and one test command"
        )
    return Snippets(
        main_command=main[0],
        test_command=tests[0],
        curl=_one_block(blocks, "bash", lambda t: t.lstrip().startswith("curl "), "a curl request"),
        offline=_one_block(
            blocks, "python", lambda t: "from tandem.scheduler import Engine" in t, "Engine"
        ),
        client=_one_block(blocks, "python", lambda t: "from openai import OpenAI" in t, "openai"),
    )


def _on_port(snippet: Block, port: int) -> str:
    text, count = re.subn(
        rf"\b(localhost|127\.0\.0\.1):{README_PORT}\b", rf"\1:{port}", snippet.text
    )
    if count == 0:
        raise CheckFailed(f"README.md line {snippet.line}: no localhost:{README_PORT} to point at")
    return text


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """The server under test: its merged output echoed and kept, its ready line awaited."""

    def __init__(self, argv: Sequence[str], ready: str) -> None:
        self.argv = list(argv)
        self.ready = re.compile(ready)
        self.lines: list[str] = []
        self.url: str | None = None
        self._seen = threading.Event()
        _say(f"$ {shlex.join(self.argv)}")
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: stopped and checked as one
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            print("    server| " + line, end="", flush=True)
            found = self.ready.search(line)
            if found and self.url is None:
                self.url = found.group(1)
                self._seen.set()
        self._seen.set()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float) -> str:
        if not self._seen.wait(timeout):
            raise CheckFailed(f"no line matching {self.ready.pattern!r} within {timeout:.0f} s")
        if self.url is None:
            raise CheckFailed(
                f"the server exited (status {self.proc.wait()}) before its ready line"
            )
        return self.url

    def _others_alive(self) -> bool:
        """Whether a process of the server's group other than the server itself still
        runs (zombies waiting for a parent that may never reap them do not count)."""
        proc = Path("/proc")
        if not proc.is_dir():
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return False
            return self.proc.poll() is not None
        for stat in proc.glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            pid = int(stat.parent.name)
            if pid != self.proc.pid and int(fields[2]) == self.proc.pid and fields[0] != "Z":
                return True
        return False

    def stop(self, limit: float) -> str:
        """SIGINT to the server's process group, as Ctrl-C in its terminal sends it; the
        server and its children must be gone within ``limit`` s."""
        start = time.perf_counter()
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            status = self.proc.wait(timeout=limit)
        except subprocess.TimeoutExpired as exc:
            self.kill()
            raise CheckFailed(f"still running {limit:.0f} s after SIGINT") from exc
        while self._others_alive():
            if time.perf_counter() - start > limit:
                self.kill()
                raise CheckFailed(f"left processes behind {limit:.0f} s after SIGINT")
            time.sleep(0.1)
        took = time.perf_counter() - start
        self._reader.join(timeout=5)
        if status != 0:
            raise CheckFailed(f"exit status {status} after SIGINT")
        _check_output(self.output)
        return f"stopped in {took:.1f} s"

    def kill(self) -> None:
        if self.proc.poll() is None or self._others_alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _curl(snippet: str, work: Path) -> str:
    """The README's curl command: with curl when there is one, else its request over
    urllib."""
    if shutil.which("curl"):
        return _run(["bash", "-c", snippet], cwd=work, timeout=120)
    words = shlex.split(snippet.replace("\\\n", " "))
    url, headers, data = None, {}, None
    it = iter(words[1:])
    for word in it:
        if word == "-H":
            key, _, value = next(it).partition(":")
            headers[key.strip()] = value.strip()
        elif word == "-d":
            data = next(it).encode()
        elif not word.startswith("-"):
            url = word if "://" in word else "http://" + word
    if url is None or data is None:
        raise CheckFailed(f"cannot read the README's curl command: {snippet!r}")
    _say(f"(no curl here: POST {url} over urllib)")
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        body = response.read().decode()
    _say(_indent(body))
    return body


def _check_answer(body: str) -> str:
    """The README's request asks the default model for the capital of France (a chat or
    a plain completion): the answer must name Paris."""
    try:
        reply = json.loads(body)
        choice = reply["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        tokens = reply["usage"]["completion_tokens"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise CheckFailed(f"not a completion: {body[:500]!r}") from exc
    if not isinstance(text, str) or not 0 < tokens <= ANSWER_TOKENS:
        raise CheckFailed(f"unexpected completion: {body[:500]!r}")
    if "Paris" not in text:
        raise CheckFailed(f"the answer does not name Paris: {text!r}")
    return f"{tokens} tokens: {text!r}"


def _check_ci_runs(test_command: str) -> str:
    lines = [
        line.strip()
        for line in CI_RUN.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if test_command not in lines:
        raise CheckFailed(f".ci/run does not run the README's test command: {test_command!r}")
    return f"`{test_command}`"


def readme(args: argparse.Namespace) -> int:
    if not args.server:
        raise SystemExit("readme: give the server command after --")
    report = Report()
    server: Server | None = None
    client_python = os.path.abspath(args.client_python) if args.client_python else sys.executable
    try:
        snippets = readme_snippets()
        _say(f"README.md's main command: `{snippets.main_command}` (what this session installs)")
        report.step(
            ".ci/run runs the README's test command", lambda: _check_ci_runs(snippets.test_command)
        )
        with tempfile.TemporaryDirectory(prefix="tandem-smoke-") as tmp:
            work = Path(tmp)
            port = _free_port()
            argv = [*args.server, "--port", str(port)]

            def start() -> str:
                nonlocal server
                server = Server(argv, args.ready)
                url = server.wait_ready(args.start_timeout)
                if not url.endswith(f":{port}"):
                    raise CheckFailed(f"ready at {url}, but it was asked for port {port}")
                return url

            report.step(f"start `{shlex.join(argv)}`", start)
            report.step(
                f"the README's curl request (README.md line {snippets.curl.line})",
                lambda: _check_answer(_curl(_on_port(snippets.curl, port), work)),
            )
            client = _on_port(snippets.client, port)
            report.step(
                f"the README's openai client (README.md line {snippets.client.line})",
                lambda: _run_only([client_python, "-c", client], cwd=work),
            )

            def offline() -> str:
                out = _run([sys.executable, "-c", snippets.offline.text], cwd=work)
                if not re.search(r"'type': '(length|stop)'", out):
                    raise CheckFailed("the offline example printed no finish reason")
                return out.strip().splitlines()[-1]

            report.step(
                f"the README's offline example (README.md line {snippets.offline.line})", offline
            )

            def futuremap() -> str:
                argv = [sys.executable, "-m", "tandem.futuremap"]
                out = _run(argv, cwd=work)
                if "identical tokens: True" not in out:
                    raise CheckFailed("the FutureMap demo's loops disagree")
                return ""

            report.step("python -m tandem.futuremap", futuremap)
            assert server is not None
            running: Server = server
            report.step("stop the server with SIGINT", lambda: running.stop(STOP_SECONDS))
    except CheckFailed:
        report.summary("smoke: FAILED")
        return 1
    finally:
        if server is not None:
            server.kill()  # a no-op once it stopped
    report.summary("smoke: ok")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("layer", help="check one layer alone")
    one.add_argument("name", choices=list(LAYERS))
    smoke = sub.add_parser("readme", help="run README.md's snippets against a real server")
    smoke.add_argument("--client-python", help="interpreter with the openai package")
    smoke.add_argument("--ready", default=READY, help="regex of the server's ready line")
    smoke.add_argument("--start-timeout", type=float, default=300.0)
    smoke.add_argument("server", nargs=argparse.REMAINDER, help="-- the server command")
    args = parser.parse_args(argv)
    if args.command == "layer":
        return layer(args)
    if args.server[:1] == ["--"]:
        args.server = args.server[1:]
    return readme(args)


if __name__ == "__main__":
    sys.exit(main())
