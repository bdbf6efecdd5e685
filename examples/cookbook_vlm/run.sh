#!/usr/bin/env bash
# tinker-cookbook 0.6.1's vlm_classifier recipe, unmodified (CLI flags only), against `ferrule serve`
# over a tiny random Inkling, offline (docs/serve.md, "A multimodal recipe"). Needs the cookbook
# installed as docs/serve.md says (pip install --no-deps tinker-cookbook==0.6.1 + its missing deps).
# Usage: examples/cookbook_vlm/run.sh [WORK_DIR]   (default: a new temporary directory)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="${1:-$(mktemp -d)}"
port="${PORT:-8765}"
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_DATASETS_CACHE="$work/hf_datasets"
export TINKER_API_KEY=tml-local-key-0001 TINKER_TELEMETRY=0
python "$here/make_assets.py" "$work/tiny-inkling" "$work/hf_datasets"
echo "$TINKER_API_KEY me" > "$work/keys.txt"
ferrule serve --base-model "$work/tiny-inkling" --model-name thinkingmachines/Inkling --api-keys "$work/keys.txt" \
    --port "$port" --storage "$work/storage" > "$work/server.log" 2>&1 &
server=$!
trap 'kill "$server"' EXIT
until grep -q "ready on" "$work/server.log"; do kill -0 "$server"; sleep 1; done
# run_sampling_evaluator=False: the recipe's sampling evaluator prefills the assistant turn, which the
# cookbook's own tml_v0 renderer refuses (NotImplementedError), whatever the server
python -m tinker_cookbook.recipes.vlm_classifier.train experiment_dir="$work/runs" base_url="http://127.0.0.1:$port" \
    model_name=thinkingmachines/Inkling renderer_name=tml_v0 dataset=caltech101 batch_size=4 num_epochs=2 \
    lora_rank=4 learning_rate=1e-3 run_sampling_evaluator=False eval_every=2 save_every=2 \
    behavior_if_log_dir_exists=delete 2>&1 | tee "$work/recipe.log"
echo "metrics: $(ls "$work"/runs/*/metrics.jsonl)"
