"""The stages of one GRPO step, each a module with a narrow input and output; the orchestrator
(:class:`ferrule.rl.loop.GRPOTrainer`) calls them in order:

1. :mod:`.rollout`: render prompts and generate ``n`` responses each, in seeded shards
   (``generate``).
2. :mod:`.score`: decoded responses -> rewards (a failing reward function scores
   ``reward.failure_reward``).
3. :mod:`.advantages`: rollout results -> samples -> group-normalized advantages.
4. :mod:`.train`: old / reference logprobs, then ``forward_backward`` + ``optim_step`` per
   mini-batch of whole groups.
5. :mod:`.sync`: the trained weights (or the LoRA adapter) to every rollout engine.
6. :mod:`.record`: the step's metrics and logged samples; :mod:`.checkpoint`: checkpoints and
   resume.

The stages know nothing of one another; a different schedule (colocation around stages, an
asynchronous rollout, another algorithm) is a change of the orchestrator.
"""
