#!/usr/bin/env bash
# Install the four tandem layers, editable, into the current Python environment on a
# CPU machine, without nox. torch goes first and is pinned: an unpinned torch (or one
# a dependency asks for) would pull a multi-GB CUDA build from the registry.
#
#   python3 -m venv .venv && . .venv/bin/activate && tools/install-cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_PIN="${TANDEM_TORCH_PIN:-torch==2.13.0}"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "$TORCH_PIN" > "$constraints"
python -m pip install "$TORCH_PIN"
python -m pip install -c "$constraints" \
    -e packages/core-futuremap \
    -e packages/scheduler \
    -e packages/spec-eagle \
    -e packages/server \
    "$@"
