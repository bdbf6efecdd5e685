#!/usr/bin/env bash
# Install ferrule and everything its tests need into ./.venv (CPU machines: Python 3.11).
#
# torch is installed first and pinned: on these machines `torch==2.13.0` is a cached CPU build,
# while an unpinned torch would let pip pull a multi-GB CUDA build. On a GPU machine with torch
# already installed, set FERRULE_TORCH=skip.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade "pip>=24" "setuptools>=77"
if [ "${FERRULE_TORCH:-}" != "skip" ]; then
  ver=${FERRULE_TORCH:-2.13.0}
  # CPU machines of this project keep the CPU build on disk (pip's find-links, /opt/wheels): ask for
  # it by its local version, so that pip cannot prefer PyPI's CUDA build of the same version
  links=${PIP_FIND_LINKS:-/opt/wheels}
  if ls "$links"/torch-"$ver"+cpu-*.whl >/dev/null 2>&1; then
    python -m pip install -q --find-links "$links" "torch==$ver+cpu"
  else
    echo "note: no CPU build of torch $ver in $links; installing torch==$ver from the index" >&2
    python -m pip install -q "torch==$ver"
  fi
fi
# strict editable mode: setuptools links every source file into build/__editable__.*/ferrule/ and puts
# that folder on sys.path, so `import ferrule` finds a regular package whatever the working directory
# holds (the default mode's import hook loses to a `ferrule/` folder in the cwd, which Python takes
# for a namespace package). Edits to existing files are live; after adding or removing a module,
# run this script again.
# transformers is pinned to the release the suite is checked against (pyproject allows >=5.23,<6 for
# users; the reference models, config keys and weight layouts the tests compare with are this release's);
# FERRULE_TRANSFORMERS=VERSION tries another
python -m pip install -q -e ".[rl,serve,metrics,dev,agents]" "transformers==${FERRULE_TRANSFORMERS:-5.25.0}" \
  --config-settings editable_mode=strict
# the worked example of an out-of-tree model-family plugin (llama / SmolLM2); its tests run with ours
python -m pip install -q -e examples/ferrule-llama --no-deps
python -m pip check
echo "ferrule installed in $(pwd)/.venv — activate with: . .venv/bin/activate"
