#!/usr/bin/env bash
# Set up flashkernel on this machine (once) and run one job:
#   ./run.sh check            correctness of every kernel against the float64 reference
#   ./run.sh test [pytest args]   the test suite
#   ./run.sh bench ...        benchmarks (GPU; see README)
# With a CUDA build of torch already present (the GPU machines), it uses that Python as is.
# Otherwise it makes .venv with the CPU build of torch and Triton's interpreter.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

if "$PY" -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
else
    VENV=${FLASHKERNEL_VENV:-.venv}
    if [ ! -x "$VENV/bin/python" ]; then
        "$PY" -m venv "$VENV"
    fi
    if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
        "$VENV/bin/python" -m pip install -q "torch==2.13.0"
    fi
    "$VENV/bin/python" -m pip install -q -e ".[test]"
    PY="$VENV/bin/python"
fi

job=${1:-check}
shift || true
case "$job" in
    test)  exec "$PY" -m pytest -q -n 2 -p no:cacheprovider "$@" ;;
    check) exec "$PY" -m flashkernel.cli check "$@" ;;
    bench) exec "$PY" -m flashkernel.cli bench "$@" ;;
    *) echo "usage: ./run.sh check | test [pytest args] | bench [args]" >&2; exit 2 ;;
esac
