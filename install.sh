#!/usr/bin/env bash
# Install ferrule and everything its tests need into ./.venv (CPU machines: Python 3.11).
#
# torch is pinned: on these machines `torch==2.13.0` is a cached CPU build, while an unpinned torch
# would let the installer pull a multi-GB CUDA build. On a GPU machine with torch already installed,
# set FERRULE_TORCH=skip.
#
# The installer is uv (astral-sh/uv, pinned below; it resolves the same versions as pip here, in about
# a minute instead of two and a half on a 2-core machine), driven by pip's own configuration (index,
# extra indexes, find-links, constraints: `pip config list`), since uv does not read pip.conf. Where uv
# cannot be installed, or FERRULE_INSTALLER=pip, pip does the same install.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
UV_VERSION=0.13.8
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate

torch_req=()
if [ "${FERRULE_TORCH:-}" != "skip" ]; then
  ver=${FERRULE_TORCH:-2.13.0}
  # CPU machines of this project keep the CPU build on disk (pip's find-links, /opt/wheels): ask for
  # it by its local version, so that the installer cannot prefer PyPI's CUDA build of the same version
  links=${PIP_FIND_LINKS:-/opt/wheels}
  if ls "$links"/torch-"$ver"+cpu-*.whl >/dev/null 2>&1; then
    torch_req=("torch==$ver+cpu")
  else
    echo "note: no CPU build of torch $ver in $links; installing torch==$ver from the index" >&2
    torch_req=("torch==$ver")
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
reqs=("pip>=24" "setuptools>=77" "${torch_req[@]}" -e ".[rl,serve,metrics,dev,agents]"
      "transformers==${FERRULE_TRANSFORMERS:-5.25.0}")

if [ "${FERRULE_INSTALLER:-uv}" = uv ] && python -m pip install -q "uv==$UV_VERSION" 2>/dev/null; then
  # pip's configuration as uv arguments; "unsafe-best-match" takes the best version over all indexes, as pip does
  mapfile -t uv_args < <(python - <<'PY'
import subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
seen = set()
for line in out.splitlines():
    key, _, value = line.partition("=")
    name = key.rsplit(".", 1)[-1]
    if name in flags:
        for v in value.strip().strip("'\"").split():
            if (name, v) not in seen:
                seen.add((name, v))
                print(flags[name]); print(v)
PY
)
  # --compile-bytecode: every installed module's .pyc written now (uv writes none by default). Where
  # PYTHONDONTWRITEBYTECODE=1 (these machines set it) Python never writes one either, so every interpreter
  # compiled torch, transformers and megatron-core from source: measured on the 2-core machine, importing
  # ferrule's engine, megatron's GPT model and transformers' Qwen2 took 16.5 s CPU without .pyc files and
  # 7.1 s with them, in each of the ~120 interpreters a CI run starts; compiling them all once: ~60 s CPU
  uv pip install -q -p .venv/bin/python --index-strategy unsafe-best-match "${uv_args[@]}" "${reqs[@]}" \
    -C editable_mode=strict --compile-bytecode
  # the worked example of an out-of-tree model-family plugin (llama / SmolLM2; its tests run with ours) and
  # the example runs' asset builders and rewards (ferrule-examples: not in the ferrule wheel)
  uv pip install -q -p .venv/bin/python -e examples/ferrule-llama -e examples/ferrule-examples --no-deps
else
  python -m pip install -q --upgrade "pip>=24" "setuptools>=77"
  python -m pip install -q "${reqs[@]}" --config-settings editable_mode=strict --compile
  python -m pip install -q -e examples/ferrule-llama -e examples/ferrule-examples --no-deps
fi
# ferrule's own modules too (the strict editable install's link tree under build/): ~1 s CPU of each
# interpreter's start (7.0 s instead of 8.0 s for the imports above); a .pyc whose source changed is not used
python -m compileall -q -j 0 build > /dev/null || true
python -m pip check
echo "ferrule installed in $(pwd)/.venv — activate with: . .venv/bin/activate"
