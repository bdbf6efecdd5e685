#!/usr/bin/env bash
# A verifiers 0.4 environment, unmodified, through `ferrule train` (docs/agents.md, "Environment libraries").
#
#   examples/verifiers/run.sh                 # 3 steps on a tiny random Qwen3 (CPU, a few minutes)
#   examples/verifiers/run.sh smollm2 [KEY=VALUE ...]   # examples/configs/smollm2_verifiers_guess_number.yaml
#                                             # on assets/smollm2 (ferrule assets smollm2 assets/smollm2)
#
# verifiers pins openai<3 and pulls ~150 packages, so it gets its own virtual environment
# ($FERRULE_VF_VENV, default /tmp/ferrule-vfenv; made once): ferrule from this checkout (extra rl),
# torch (the CPU build where the machine keeps one, as ./install.sh), verifiers==0.4.0, the example
# taskset examples/verifiers/vf_guess_number, the ferrule-llama plugin (SmolLM2) and uv.
# Network: PyPI only. verifiers' `null` harness runs its chat program as a PEP 723 script through
# `uv` (`uv sync --script` fetches openai, mcp, httpx ... from PyPI once, into uv's cache); the venv's
# bin/ goes first on PATH so verifiers finds this uv (else it would download one from astral.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${FERRULE_VF_VENV:-/tmp/ferrule-vfenv}
UV_VERSION=0.13.8
if [ ! -x "$VENV/bin/ferrule" ] || ! "$VENV/bin/python" -c "import verifiers.v1, vf_guess_number" 2>/dev/null; then
  echo "== making $VENV (once)"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "uv==$UV_VERSION"
  torch=("torch==2.13.0")
  links=${PIP_FIND_LINKS:-/opt/wheels}
  ls "$links"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1 && torch=("torch==2.13.0+cpu" --find-links "$links")
  # pip's extra indexes (uv does not read pip.conf), as ./install.sh does
  mapfile -t idx < <("$VENV/bin/python" -m pip config list 2>/dev/null | sed -n "s/.*extra-index-url='\(.*\)'/\1/p" \
                     | tr ' ' '\n' | sort -u | sed '/^$/d;s/^/--extra-index-url=/')
  "$VENV/bin/uv" pip install -q -p "$VENV/bin/python" --index-strategy unsafe-best-match "${idx[@]}" "${torch[@]}" \
    -e "$ROOT[rl]" "transformers==5.25.0" "verifiers==0.4.0" pytest pytest-timeout pytest-xdist -e "$ROOT/examples/verifiers/vf_guess_number"
  "$VENV/bin/uv" pip install -q -p "$VENV/bin/python" --no-deps -e "$ROOT/examples/ferrule-llama"
fi
export PATH="$VENV/bin:$PATH"
"$VENV/bin/python" -c "import verifiers, openai; print('verifiers', verifiers.__version__, '| openai', openai.__version__)"
CONFIG="$ROOT/examples/configs/smollm2_verifiers_guess_number.yaml"
if [ "${1:-tiny}" = smollm2 ]; then
  shift
  exec ferrule train "$CONFIG" "$@"
fi
[ "${1:-}" = tiny ] && shift
WORK=${FERRULE_VF_WORK:-$(mktemp -d /tmp/ferrule-vf-XXXX)}
# the tests' tiny random Qwen3 with a character tokenizer (tests/test_rl_e2e.py), room for 3-turn episodes
"$VENV/bin/python" -c "import sys; sys.path.insert(0, '$ROOT/tests'); from pathlib import Path; \
from test_rl_e2e import _build_model; _build_model(Path('$WORK/model'), max_position_embeddings=2048)"
exec ferrule train "$CONFIG" model.hf_dir="$WORK/model" logging.run_dir="$WORK/run" train.steps=3 \
  train.prompts_per_step=2 rollout.n_samples_per_prompt=2 rollout.max_new_tokens=8 rollout.temperature=1.0 \
  "agent.environment_kwargs={taskset: vf_guess_number, taskset_kwargs: {num_tasks: 8, high: 2}}" \
  data.max_prompt_tokens=1536 train.micro_batch_tokens=4096 checkpoint.enabled=false logging.plot_at_end=false \
  logging.progress=false "$@"
