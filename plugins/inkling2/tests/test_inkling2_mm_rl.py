"""``ferrule train`` multimodal GRPO on a tiny random Inkling-2 (vision tower) with the shipped example config (CPU).

Config: ``examples/configs/inkling2_mm_tiny.yaml`` (family inkling2, TMLv0 prompts holding a
PIL-drawn picture and "how many squares?", exact-answer reward
:func:`ferrule_examples.inkling_shapes.square_count_reward`; the task and a random
``Inkling2ForConditionalGeneration`` from :func:`ferrule_examples.inkling2_shapes.build_inkling2_shapes_task`). Independent checks (tests/mm_grpo_helpers.py, shared
with the Inkling test): the picture's square count is re-counted from the PNG (the answer is right),
rewards are recomputed from the logged responses, the rollout weights are verified equal to the
trained weights after every sync (``check_weight_update_equal``, the tower included), train vs rollout
logprobs of the sampled tokens agree to 1e-5, and a resumed run equals an uninterrupted one metric by metric. The 20-step run is
recorded in docs/families/inkling2.md; this test runs 4 steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# transformers' modeling code must be imported before ferrule's megatron CPU patches
from transformers import GenerationMixin, Inkling2ForConditionalGeneration  # noqa: F401

from mm_grpo_helpers import check_grpo_runs_and_resumes, check_task_answers  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "examples" / "configs" / "inkling2_mm_tiny.yaml"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from ferrule_examples.inkling2_shapes import build_inkling2_shapes_task

    return build_inkling2_shapes_task(tmp_path_factory.mktemp("inkling2_mm_rl"), prompts=8)


def test_task_answers_count_the_drawn_squares(assets):
    check_task_answers(assets)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_multimodal_grpo_runs_and_resumes_bit_identical(assets, tmp_path):
    check_grpo_runs_and_resumes(CONFIG, assets, tmp_path, image_tokens=16)
