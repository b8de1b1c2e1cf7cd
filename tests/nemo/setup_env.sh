#!/usr/bin/env bash
# Create .venv-nemo/ at the repo root: NeMo Curator 1.4.0 on a CPU torch, plus the Tally client with
# its tally command (./client[cli]), for tests/nemo/: what docs/nemo-curator.md's section 2 installs,
# in its order (tests/nemo/test_guide_walk.py checks). Idempotent: a stamp file records a finished
# install (about 95 s and 1.9 GB the first time); it is redone when client/pyproject.toml or this
# script is newer than the stamp.
#   tests/nemo/setup_env.sh            ./dev test runs it when CI or TALLY_NEMO_TESTS=1 is set
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=.venv-nemo
STAMP="$VENV/.installed-nemo-curator-1.4.0"
PIP=("$VENV/bin/python" -m pip install --quiet)

if [ -f "$STAMP" ] && [ -z "$(find client/pyproject.toml tests/nemo/setup_env.sh -newer "$STAMP")" ]; then
    exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
start=$SECONDS
# torch first and alone: the CPU wheel lies on this machine's disk (pip's find-links); installing
# NeMo Curator first would let pip choose a CUDA build from the index.
"${PIP[@]}" "torch==2.13.0"
if ! "$VENV/bin/python" -W ignore -c 'import sys, torch; sys.exit(torch.version.cuda is not None)'; then
    echo "error: $VENV got a CUDA torch; a CPU torch==2.13.0 wheel must be reachable by pip" >&2
    exit 1
fi
"${PIP[@]}" "nemo-curator==1.4.0"
"${PIP[@]}" -e './client[cli]'
# The stamp holds the install time, which the test quotes in its duration breakdown.
echo "$((SECONDS - start))" >"$STAMP"
echo "$VENV ready in $((SECONDS - start)) s" >&2
