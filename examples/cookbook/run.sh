#!/usr/bin/env bash
# Run tinker-cookbook 0.6.1 recipes, unmodified (only their command-line flags), against a local
# `ferrule serve` on CPU, offline. Usage (from the repository root, after ./install.sh):
#
#   examples/cookbook/run.sh setup        # .venv-cookbook + tiny models, tokenizer cache, local datasets
#   examples/cookbook/run.sh serve &      # two bases: the student and a teacher of another base
#   examples/cookbook/run.sh all          # every recipe below, one after another (~3 min on 2 cores)
#   examples/cookbook/run.sh sl_basic     # or one of: sl_basic rl_basic rl_async dpo distill_on distill_off
#
# Logs: $OUT/<recipe>.log (OUT=runs/cookbook by default). The models are random (2 layers, hidden
# 64, Qwen3's vocabulary): the runs check that each recipe runs end to end, not that it learns.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$(pwd)
OUT=${OUT:-$REPO/runs/cookbook}
PORT=${PORT:-8766}
STUDENT=Qwen/Qwen3-4B-Instruct-2507   # names the recipes' model_info knows; served from $OUT/student
TEACHER=Qwen/Qwen3-8B                 # ... and from $OUT/teacher
KEY=tml-cookbook-key
URL=http://127.0.0.1:$PORT
R=qwen3_instruct

env_client() {
  . "$REPO/.venv-cookbook/bin/activate"
  # the recipes' get_tokenizer(model_name) reads this HF cache; their load_dataset(NAME) the local
  # folders of $OUT/data (the working directory)
  export HF_HOME=$OUT/hf_home HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TINKER_TELEMETRY=0 TINKER_API_KEY=$KEY
  export OMP_NUM_THREADS=1
  CB=$(python -c "import tinker_cookbook, os; print(os.path.dirname(tinker_cookbook.__file__))")
  CONVOS=$CB/example_data/conversations.jsonl
  cd "$OUT/data"
}

setup() {
  # tinker-cookbook 0.6.1 declares tml-renderers>=0.4.1 (PyPI has 0.2.1): install it without its
  # dependencies into its own venv, which sees ferrule's venv through a .pth file (so ./install.sh's
  # `pip check` in .venv stays clean), then the few it needs that ferrule's venv lacks.
  [ -x .venv-cookbook/bin/python ] || python3 -m venv .venv-cookbook
  # addsitedir (not a plain path line) so that the .pth files there, ferrule's editable install among them, apply too
  echo "import site; site.addsitedir('$REPO/.venv/lib/python3.11/site-packages')" \
    > .venv-cookbook/lib/python3.11/site-packages/ferrule-venv.pth
  .venv-cookbook/bin/pip install -q --no-deps tinker-cookbook==0.6.1
  .venv-cookbook/bin/pip install -q aiohttp blobfile chz cloudpickle datasets pyrage termcolor pylatexenc math-verify
  .venv-cookbook/bin/python examples/cookbook/make_assets.py "$OUT"
  echo "$KEY cookbook" > "$OUT/keys.txt"
}

serve() {
  . .venv/bin/activate
  OMP_NUM_THREADS=1 exec ferrule serve --base-model "$OUT/student" --model-name $STUDENT \
    --base-model "$OUT/teacher" --model-name $TEACHER --port "$PORT" --storage "$OUT/storage" --api-keys "$OUT/keys.txt"
}

sl_basic() {  # supervised basic loop; the recipe's own FromConversationFileBuilder on the wheel's example data
  python -m tinker_cookbook.recipes.sl_basic model_name=$STUDENT base_url=$URL log_path="$OUT/sl_basic" \
    lora_rank=8 max_steps=3 eval_every=0 save_every=0 \
    dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder dataset_builder.file_path="$CONVOS" \
    dataset_builder.common_config.model_name_for_tokenizer=$STUDENT dataset_builder.common_config.renderer_name=$R \
    dataset_builder.common_config.max_length=256 dataset_builder.common_config.batch_size=4
}

rl_flags() {  # the cookbook's arithmetic environment (generated, no dataset)
  echo model_name=$STUDENT base_url=$URL lora_rank=8 max_tokens=8 save_every=0 \
    dataset_builder=tinker_cookbook.recipes.math_rl.arithmetic_env:ArithmeticDatasetBuilder \
    dataset_builder.batch_size=2 dataset_builder.group_size=2 dataset_builder.n_batches=4 \
    dataset_builder.model_name_for_tokenizer=$STUDENT dataset_builder.renderer_name=$R
}

rl_basic() {  # RL basic loop, synchronous
  python -m tinker_cookbook.recipes.rl_basic $(rl_flags) log_path="$OUT/rl_basic" max_steps=2
}

rl_async() {  # RL basic loop, async mode (AsyncConfig); its default loss stable_reinforce is not served: ppo
  python -m tinker_cookbook.recipes.rl_basic $(rl_flags) log_path="$OUT/rl_async" max_steps=3 \
    async_config.max_steps_off_policy=1 async_config.groups_per_batch=2 async_config.loss_fn=ppo
}

dpo() {  # DPO on the local Anthropic/hh-rlhf folder; the reference model is a sampler of the base
  python -m tinker_cookbook.recipes.preference.dpo.train model_name=$STUDENT base_url=$URL log_path="$OUT/dpo" \
    behavior_if_log_dir_exists=delete renderer_name=$R dataset=hhh batch_size=4 max_length=256 max_steps=2
}

distill_on() {  # on-policy distillation: the teacher is a sampler of ANOTHER served base
  python -m tinker_cookbook.recipes.distillation.on_policy_distillation model_name=$STUDENT teacher_model=$TEACHER \
    base_url=$URL log_path="$OUT/distill_on" behavior_if_log_dir_exists=delete renderer_name=$R dataset=tulu3 \
    group_size=2 groups_per_batch=2 lora_rank=8 max_tokens=8 max_steps=2 eval_every=0 save_every=0
}

distill_off() {  # off-policy distillation with the teacher's top-k prompt logprobs as rank-2 targets
  local D=dataset_configs.0
  python "$REPO/examples/cookbook/off_policy_topk.py" model_name=$STUDENT recipe_name=off_policy_topk \
    learning_rate=1e-4 base_url=$URL log_path="$OUT/distill_off" renderer_name=$R lora_rank=8 n_teacher_targets=4 \
    batch_size=2 max_steps=2 save_every=0 eval_every=0 \
    $D.dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder $D.dataset_builder.file_path="$CONVOS" \
    $D.dataset_builder.common_config.model_name_for_tokenizer=$STUDENT $D.dataset_builder.common_config.renderer_name=$R \
    $D.dataset_builder.common_config.max_length=128 $D.dataset_builder.common_config.batch_size=2 \
    $D.teacher_config.base_model=$TEACHER
}

RECIPES="sl_basic rl_basic rl_async dpo distill_on distill_off"
case "${1:-}" in
  setup) setup ;;
  serve) serve ;;
  all|sl_basic|rl_basic|rl_async|dpo|distill_on|distill_off)
    env_client
    for r in $([ "$1" = all ] && echo $RECIPES || echo "$1"); do
      rm -rf "$OUT/$r"
      start=$(date +%s)
      if "$r" > "$OUT/$r.log" 2>&1; then status=ok; else status="FAILED (see $OUT/$r.log)"; fi
      echo "$r: $status in $(( $(date +%s) - start )) s"
    done ;;
  *) echo "usage: $0 setup | serve | all | one of: $RECIPES" >&2; exit 2 ;;
esac
