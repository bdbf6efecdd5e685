#!/usr/bin/env bash
# tinker-cookbook 0.6.1's multimodal recipes, unmodified (CLI flags only), against `ferrule serve` over a
# tiny random Inkling, offline (docs/serve.md, "Multimodal recipes"). The server runs from ferrule's
# .venv, the recipes from .venv-cookbook (made by `examples/cookbook/run.sh setup`; jiwer, the audio
# recipes' WER grader, is added to it here).
# Usage (from anywhere): examples/cookbook_multimodal/run.sh vlm|vlm2|audio [WORK_DIR]   (default: a new temp dir)
# (vlm2: vlm_classifier on a tiny Inkling-2 instead of Inkling)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
recipe="${1:?vlm, vlm2 or audio}"
work="${2:-$(mktemp -d)}"
mkdir -p "$work" && work="$(cd "$work" && pwd)"
cb="$repo/.venv-cookbook/bin/python"
[ -x "$cb" ] || { echo "no $cb: run examples/cookbook/run.sh setup first" >&2; exit 2; }
port="${PORT:-$("$cb" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_DATASETS_CACHE="$work/hf_datasets"
export TINKER_API_KEY=tml-local-key-0001 TINKER_TELEMETRY=0
[ "$recipe" != audio ] || "$cb" -c "import jiwer" 2>/dev/null || "$repo/.venv-cookbook/bin/pip" install -q jiwer
# vlm2: the same recipe on a tiny Inkling-2, served as thinkingmachines/Inkling-2-Tiny: tinker-cookbook 0.6.1 maps
# the name Inkling-2-Small to tml-renderers' H200kBaseChatTokenizer, which tml-renderers 0.2.1 (what PyPI has)
# lacks; any other Inkling* name gets tml_v0 with O200kBaseChatTokenizer (docs/serve.md, "Inkling-2 bases")
model=tiny-inkling name=thinkingmachines/Inkling
[ "$recipe" != vlm2 ] || { model=tiny-inkling2 name=thinkingmachines/Inkling-2-Tiny; export INKLING2=1; }
[ -d "$work/$model" ] || "$cb" "$here/make_assets.py" "$work/$model" "$work/hf_datasets" "$work/audio"
echo "$TINKER_API_KEY me" > "$work/keys.txt"
"$repo/.venv/bin/ferrule" serve --base-model "$work/$model" --model-name "$name" \
    --api-keys "$work/keys.txt" --port "$port" --storage "$work/storage-$recipe" > "$work/server-$recipe.log" 2>&1 &
server=$!
trap 'kill "$server"' EXIT
until grep -q "ready on" "$work/server-$recipe.log"; do kill -0 "$server"; sleep 1; done
common=(base_url="http://127.0.0.1:$port" batch_size=4 num_epochs=2 lora_rank=4 learning_rate=1e-3 eval_every=2
        save_every=2 behavior_if_log_dir_exists=delete)
case "$recipe" in
  # run_sampling_evaluator=False: that evaluator prefills the assistant turn, which the cookbook's own tml_v0
  # renderer refuses (NotImplementedError) before anything reaches a server
  vlm|vlm2) "$cb" -m tinker_cookbook.recipes.vlm_classifier.train experiment_dir="$work/runs-$recipe" \
           model_name="$name" renderer_name=tml_v0 dataset=caltech101 run_sampling_evaluator=False \
           "${common[@]}" 2>&1 | tee "$work/recipe-$recipe.log" ;;
  audio) "$cb" -m tinker_cookbook.recipes.audio.emotion.sl_train log_path="$work/runs-audio" \
           data_dir="$work/audio" n_eval=4 max_tokens=8 "${common[@]}" 2>&1 | tee "$work/recipe-audio.log" ;;
  *) echo "recipe: vlm, vlm2 or audio" >&2; exit 2 ;;
esac
grep -o 'op=[a-z_]* .*status=[a-z]*' "$work/server-$recipe.log" | sed 's/op=\([a-z_]*\) .*status=\(.*\)/\1 \2/' | sort | uniq -c
