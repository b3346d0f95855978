#!/usr/bin/env bash
# Installs pcgspec (editable, with test extras) on a machine with only Python and pip.
# torch==2.13.0 first when torch is missing: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[test]"
