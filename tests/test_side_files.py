"""Side files (every non-weight file of an HF folder) survive conversion, ``TrainEngine.save`` and
``ferrule export`` (issue 28 item 6).

Referee: transformers' own loaders on the exported folder of a tiny multimodal Inkling checkpoint
that carries its processor files (``AutoFeatureExtractor`` reads ``preprocessor_config.json``,
``AutoTokenizer`` the tokenizer, ``AutoProcessor`` the whole ``InklingProcessor``), and the source
files' bytes. ``InklingImageProcessor`` needs torchvision, which these CPU machines cannot install
(PyPI's torchvision 0.28.0 is a CUDA build: ``operator torchvision::nms does not exist`` with torch
2.13.0+cpu); without it the folder gets the processor's other files and a ``processor_config.json``
naming the class, and the ``AutoProcessor`` load is skipped.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
# HF modeling modules must be imported before ferrule's CPU patches replace torch.cuda.Stream.
from transformers import AutoProcessor, InklingForConditionalGeneration  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from inkling_fixtures import tiny_inkling_mm_dir  # noqa: E402

from ferrule.megatron.checkpoint import hf_side_files  # noqa: E402

#: the tokens InklingProcessor looks up in its tokenizer (processing_inkling.py defaults)
PROCESSOR_TOKENS = ("<|unused_200054|>", "<|unused_200053|>", "<|content_image|>", "<|content_audio_input|>")
EXTRA = {"README.md": "# tiny\n", "additional_chat_templates/tool_use.jinja": "{{ messages }}\n"}


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, **{t: 3 + i for i, t in enumerate(PROCESSOR_TOKENS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                                   additional_special_tokens=list(PROCESSOR_TOKENS))


def _have_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 (missing, or a build that does not fit this torch)
        return False
    return True


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    from transformers.models.inkling.feature_extraction_inkling import InklingFeatureExtractor

    path = tiny_inkling_mm_dir(tmp_path_factory.mktemp("side") / "mm")
    if _have_torchvision():
        from transformers import InklingProcessor
        from transformers.models.inkling.image_processing_inkling import InklingImageProcessor

        InklingProcessor(feature_extractor=InklingFeatureExtractor(), image_processor=InklingImageProcessor(),
                         tokenizer=_tokenizer()).save_pretrained(path)
    else:
        InklingFeatureExtractor(sampling_rate=16000).save_pretrained(path)
        _tokenizer().save_pretrained(path)
        (path / "processor_config.json").write_text('{"processor_class": "InklingProcessor"}\n')
    for name, text in EXTRA.items():
        (path / name).parent.mkdir(exist_ok=True)
        (path / name).write_text(text)
    names = hf_side_files(path)
    assert {"processor_config.json", "tokenizer.json"} <= set(names), names
    assert not any(n.endswith(".safetensors") for n in names)
    return path


def _same_side_files(src: Path, out: Path) -> None:
    """Every side file of ``src`` is in ``out`` with the same bytes (config.json: ferrule writes it)."""
    names = [n for n in hf_side_files(src) if n != "config.json"]
    assert set(names) <= set(hf_side_files(out)), sorted(set(names) - set(hf_side_files(out)))
    assert all((src / n).read_bytes() == (out / n).read_bytes() for n in names)


def _loads(src: Path, out: Path) -> None:
    from transformers import AutoFeatureExtractor, AutoTokenizer

    if (src / "preprocessor_config.json").is_file():  # the feature extractor's own file (a full processor may keep it in processor_config.json)
        assert AutoFeatureExtractor.from_pretrained(out).to_dict() == AutoFeatureExtractor.from_pretrained(src).to_dict()
    assert AutoTokenizer.from_pretrained(out)("hello <|content_image|> world")["input_ids"] == [1, 5, 2]
    if not _have_torchvision():
        return
    ref, got = AutoProcessor.from_pretrained(src), AutoProcessor.from_pretrained(out)
    assert type(got).__name__ == "InklingProcessor"
    assert type(got.image_processor) is type(ref.image_processor)
    assert type(got.feature_extractor) is type(ref.feature_extractor)
    assert got.image_processor.to_dict() == ref.image_processor.to_dict()
    assert got.feature_extractor.to_dict() == ref.feature_extractor.to_dict()
    assert got.tokenizer("hello <|content_image|> world")["input_ids"] == [1, 5, 2]


def test_conversion_round_trip_carries_processor_files(src, tmp_path):
    from ferrule.converters import hf_to_torch_dist, torch_dist_to_hf

    hf_to_torch_dist(src, tmp_path / "ckpt")
    _same_side_files(src, tmp_path / "ckpt" / "hf")
    assert not (tmp_path / "ckpt" / "hf" / "model.safetensors").exists()  # weights stay out of hf/
    torch_dist_to_hf(tmp_path / "ckpt", tmp_path / "out")
    _same_side_files(src, tmp_path / "out")
    _loads(src, tmp_path / "out")


def test_engine_save_and_ferrule_export_carry_processor_files(src, tmp_path):
    from ferrule.converters.export import export_run
    from ferrule.megatron.engine import TrainEngine
    from ferrule.megatron.parallel import destroy_distributed

    step = tmp_path / "run" / "checkpoints" / "step_000001"
    TrainEngine.from_hf(src).save(step / "engine")
    # the export runs as `ferrule export` does, in a process without a process group: with the engine's still
    # up, a 1-rank conversion spawns an interpreter of its own (measured: 24.6 s of this test's 26.6 s)
    destroy_distributed()
    (step / "loop_state.json").write_text("{}\n")
    _same_side_files(src, step / "engine" / "hf")
    _, out, _ = export_run(tmp_path / "run", tmp_path / "exported")
    _same_side_files(src, out)
    _loads(src, out)
