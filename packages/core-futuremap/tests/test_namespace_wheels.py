"""The four layers build as wheels that share one PEP 420 namespace: no wheel ships
``tandem/__init__.py``, and together they import side by side."""

from __future__ import annotations

import email
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
LAYERS = {
    # folder: (distribution, module, sibling layers it must depend on)
    "core-futuremap": ("tandem-core-futuremap", "futuremap", []),
    "scheduler": ("tandem-scheduler", "scheduler", ["tandem-core-futuremap"]),
    "spec-eagle": (
        "tandem-spec-eagle",
        "spec_eagle",
        ["tandem-core-futuremap", "tandem-scheduler"],
    ),
    "server": ("tandem-server", "server", ["tandem-core-futuremap", "tandem-scheduler"]),
}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    folders = [str(ROOT / "packages" / name) for name in LAYERS]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--quiet", "-w", str(out), *folders],
        check=True,
    )  # fmt: skip
    found: dict[str, Path] = {}
    for name, (dist, _, _) in LAYERS.items():
        matches = list(out.glob(dist.replace("-", "_") + "-*.whl"))
        assert len(matches) == 1, f"no single wheel for {dist}: {matches}"
        found[name] = matches[0]
    return found


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return email.message_from_bytes(zf.read(meta))


@pytest.mark.parametrize("layer", list(LAYERS))
def test_no_wheel_ships_a_namespace_init(wheels: dict[str, Path], layer: str) -> None:
    names = _names(wheels[layer])
    assert "tandem/__init__.py" not in names
    module = LAYERS[layer][1]
    assert f"tandem/{module}/__init__.py" in names
    assert f"tandem/{module}/py.typed" in names
    packaged = {n.split("/")[1] for n in names if n.startswith("tandem/") and n.count("/") > 1}
    assert packaged == {module}, f"{layer} wheel carries other layers: {packaged}"


@pytest.mark.parametrize("layer", list(LAYERS))
def test_dependencies_are_declared_layer_by_layer(wheels: dict[str, Path], layer: str) -> None:
    dist, _, siblings = LAYERS[layer]
    meta = _metadata(wheels[layer])
    assert meta["Name"] == dist
    requires = [r.split(";")[0] for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
    names = {r.replace(" ", "").split("~")[0].split(">")[0].split("=")[0] for r in requires}
    layer_deps = {n for n in names if n.startswith("tandem-")}
    assert layer_deps == set(siblings)
    if layer == "core-futuremap":
        assert "torch" in names


def test_wheels_import_together_from_one_directory(wheels: dict[str, Path], tmp_path: Path) -> None:
    target = tmp_path / "site"
    for wheel in wheels.values():
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(target)
    assert not (target / "tandem" / "__init__.py").exists()
    code = (
        "import tandem, tandem.futuremap, tandem.scheduler, tandem.spec_eagle, tandem.server\n"
        "assert getattr(tandem, '__file__', None) is None, 'tandem must be a namespace'\n"
        "for m in (tandem.futuremap, tandem.scheduler, tandem.spec_eagle, tandem.server):\n"
        "    print(m.__file__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
    ).stdout.split()
    assert len(out) == 4
    assert all(Path(p).is_relative_to(target) for p in out), out
