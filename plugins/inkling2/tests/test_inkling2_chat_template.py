"""Inkling-2's registered chat templates against tml-renderers' TMLv0 and transformers' Inkling2Config.

tml-renderers 0.2.1 ships one TML renderer (``v0.Renderer``, documented for Inkling); Inkling-2's ties to it are
the special ids of ``Inkling2Config`` (checked here against the renderer and its ``O200kBaseChatTokenizer``).
The text conversations of ``tests/data/tmlv0_golden.jsonl`` (system/user/assistant, multi-turn, generation
prompt, thinking, tools) are rendered under the inkling2 template names and compared with tml-renderers run now.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from tml_renderers import tokenizers, v0

from ferrule.contract import registry
from ferrule.chat import encode_rendered, render_chat, stop_token_ids
from ferrule.tmlv0 import tokenizer as inkling_tok

HERE = Path(__file__).resolve().parents[3] / "tests"  # make_tmlv0_golden.py and its data
_spec = importlib.util.spec_from_file_location("make_tmlv0_golden", HERE / "make_tmlv0_golden.py")
GEN = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(GEN)
TEXT_ROWS = [r for r in (json.loads(line) for line in GEN.GOLDEN.read_text(encoding="utf-8").splitlines() if line.strip())
             if not r["media"]]
NAMES = {"inkling2_text": "tmlv0_inkling2", "inkling2": "tmlv0_inkling2_mm", "inkling2_loop": "tmlv0_inkling2_loop"}


@pytest.fixture(scope="module")
def tok():
    return inkling_tok.load_tmlv0_tokenizer()


def test_inkling2_config_ids_are_tmlv0():
    from transformers import Inkling2Config, Inkling2LoopTextConfig, Inkling2TextConfig

    ref_tok = tokenizers.O200kBaseChatTokenizer()
    for text in (Inkling2TextConfig(), Inkling2LoopTextConfig()):
        assert [text.eos_token_id] == list(v0.Renderer(ref_tok).stop())
        assert ref_tok.decode_special(text.unpadded_vocab_size - 1) == "content_invoke_tool_text"  # TMLv0's last special
        assert ref_tok.decode_special(text.unpadded_vocab_size) is None  # the TMLv0 vocabulary ends where Inkling-2's does
    assert ref_tok.decode_special(Inkling2Config().image_token_id) == "unused_200054"


@pytest.mark.parametrize("family", sorted(NAMES))
def test_registered_and_matches_tml_renderers(family, tok):
    assert [s.name for s in registry.chat_templates_for(family)] == [NAMES[family]]
    assert "chat_template" not in registry.get_registry().missing_parts(family)
    name = NAMES[family]
    assert stop_token_ids(name, tok) == tuple(v0.Renderer(tokenizers.O200kBaseChatTokenizer()).stop())
    assert len(TEXT_ROWS) >= 12
    for row in TEXT_ROWS:
        expected, _ = GEN.reference(row["messages"], row["tools"], row["add_generation_prompt"], row["thinking_effort"])
        text = render_chat(name, row["messages"], tools=row["tools"], add_generation_prompt=row["add_generation_prompt"],
                           thinking_effort=row["thinking_effort"])
        assert encode_rendered(tok, text) == expected, (family, row["name"])
