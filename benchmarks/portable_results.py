"""Make asv results of an ``existing:`` environment fit to commit.

``asv run --environment existing:PYTHON`` names the environment after the absolute
path of the interpreter: the results file is ``<commit>-existing-py_<path>.json`` and
the path is stored again in ``env_name``, ``python`` and ``params.python``. That path
belongs to one checkout on one machine, so this script renames such files to
``<commit>-existing-py<X.Y>.json`` (``X.Y``: the Python version, the same value asv
records for the environments it builds) and rewrites the three fields to match.

A results file already present under the portable name (an earlier run of the same
commit) is merged the way ``asv run`` merges: per benchmark, the new result wins.

Usage: ``python benchmarks/portable_results.py [RESULTS_DIR]`` with the interpreter
that ran the benchmarks (its version is the one recorded); ``RESULTS_DIR`` defaults to
``results`` next to this script. ``nox -s bench`` runs it after ``asv run``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SKIP = {"machine.json", "benchmarks.json"}
MERGED = ("results", "durations")


def _is_path(value: object) -> bool:
    return isinstance(value, str) and ("/" in value or "\\" in value)


def make_portable(path: Path, version: str) -> Path | None:
    """Rewrite one results file if it names its interpreter by path; the new path."""
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    if not _is_path(data.get("python")):
        return None
    env_name = f"existing-py{version}"
    data["env_name"] = env_name
    data["python"] = version
    if _is_path(data.get("params", {}).get("python")):
        data["params"]["python"] = version
    target = path.with_name(f"{data['commit_hash'][:8]}-{env_name}.json")
    if target.exists() and target != path:
        old: dict[str, Any] = json.loads(target.read_text(encoding="utf-8"))
        if old.get("result_columns") == data.get("result_columns"):
            for key in MERGED:
                data[key] = {**old.get(key, {}), **data.get(key, {})}
    target.write_text(json.dumps(data), encoding="utf-8")  # compact, as asv writes it
    if target != path:
        path.unlink()
    return target


def main(argv: list[str]) -> int:
    results = Path(argv[0]) if argv else Path(__file__).parent / "results"
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for machine_json in sorted(results.glob("*/machine.json")):
        for path in sorted(machine_json.parent.glob("*.json")):
            if path.name in SKIP:
                continue
            target = make_portable(path, version)
            if target is not None:
                print(f"{path.parent.name}/{path.name} -> {target.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
