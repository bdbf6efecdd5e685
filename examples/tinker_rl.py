"""Cookbook-style RL through `ferrule serve`, using only the tinker SDK (plus a tokenizer and the task).

GRPO-style loop on reasoning-gym `basic_arithmetic` (two 1-digit terms, + and -), as in the
tinker-cookbook's rl_loop: sample a group per prompt, reward = the task's score of the last
number in the answer, advantage = reward - group mean, `importance_sampling` loss, `optim_step`,
then sample with the new weights.

    ferrule assets smollm2 assets/smollm2 --no-torch-dist --dtype float32
    FERRULE_SERVE_API_KEYS=tml-local-key ferrule serve --base-model assets/smollm2/hf --model-name smollm2 &
    python examples/tinker_rl.py --base-url http://127.0.0.1:8000 --tokenizer assets/smollm2/hf
"""

import argparse
import json
import re
import time

import reasoning_gym
import tinker
from reasoning_gym.utils import SYSTEM_PROMPTS
from tinker import types
from transformers import AutoTokenizer

p = argparse.ArgumentParser()
p.add_argument("--base-url", default="http://127.0.0.1:8000")
p.add_argument("--api-key", default="tml-local-key")
p.add_argument("--model", default="smollm2")
p.add_argument("--tokenizer", required=True, help="HF tokenizer dir of the served model")
p.add_argument("--steps", type=int, default=20)
p.add_argument("--prompts", type=int, default=4)
p.add_argument("--group", type=int, default=8)
p.add_argument("--lr", type=float, default=1e-5)
p.add_argument("--rank", type=int, default=16)
p.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts scored greedily before and after")
args = p.parse_args()

tok = AutoTokenizer.from_pretrained(args.tokenizer)
task = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=["+", "-"], allow_parentheses=False,
            allow_negation=False)
data = reasoning_gym.create_dataset("basic_arithmetic", size=10000, seed=1, **task)
held_out = reasoning_gym.create_dataset("basic_arithmetic", size=args.eval_prompts, seed=1000003, **task)


def encode(question):
    return tok.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPTS["direct"]},
                                    {"role": "user", "content": question}],
                                   add_generation_prompt=True, tokenize=True, return_dict=False)


def score(dataset, entry, tokens):
    numbers = re.findall(r"-?\d+", tok.decode(tokens, skip_special_tokens=True))
    return float(dataset.score_answer(numbers[-1] if numbers else None, entry))


def evaluate(sampler):  # greedy accuracy on the held-out prompts
    greedy = types.SamplingParams(max_tokens=32, temperature=0.0)
    futs = [sampler.sample(types.ModelInput.from_ints(encode(e["question"])), 1, greedy) for e in held_out]
    return sum(score(held_out, e, f.result().sequences[0].tokens) == 1.0 for e, f in zip(held_out, futs)) / len(futs)


service = tinker.ServiceClient(base_url=args.base_url, api_key=args.api_key)
trainer = service.create_lora_training_client(base_model=args.model, rank=args.rank).result()
params = types.SamplingParams(max_tokens=32, temperature=0.8)

for step in range(args.steps):
    t0 = time.time()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    entries = [data[(step * args.prompts + i) % len(data)] for i in range(args.prompts)]
    if step == 0:
        print(json.dumps({"step": 0, "eval_accuracy": evaluate(sampler)}), flush=True)
    prompts = [encode(e["question"]) for e in entries]
    futures = [sampler.sample(types.ModelInput.from_ints(list(pr)), args.group, params) for pr in prompts]
    batch, rewards = [], []
    for entry, prompt, fut in zip(entries, prompts, futures):
        seqs = fut.result().sequences
        scores = [score(data, entry, s.tokens) for s in seqs]
        mean = sum(scores) / len(scores)
        rewards += scores
        for s, r in zip(seqs, scores):
            if r == mean:
                continue  # zero advantage: no signal
            toks = list(prompt) + list(s.tokens)
            n = len(prompt) - 1
            batch.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={
                "target_tokens": toks[1:], "logprobs": [0.0] * n + list(s.logprobs),
                "advantages": [0.0] * n + [r - mean] * len(s.tokens)}))
    if batch:
        trainer.forward_backward(batch, "importance_sampling").result()
        trainer.optim_step(types.AdamParams(learning_rate=args.lr, beta1=0.9, beta2=0.98, eps=1e-8)).result()
    print(json.dumps({"step": step, "reward": round(sum(rewards) / len(rewards), 4), "data": len(batch),
                      "seconds": round(time.time() - t0, 1)}), flush=True)
print(json.dumps({"step": args.steps, "eval_accuracy": evaluate(trainer.save_weights_and_get_sampling_client().result())}))
