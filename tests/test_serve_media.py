"""``ferrule serve`` with image and audio chunks, driven by the unmodified ``tinker`` 0.38 SDK.

Base: a tiny random ``InklingForConditionalGeneration`` with the released vision patch (40 px), so
that tml-renderers' token counts apply. The media chunks are made by tml-renderers itself
(``tml_renderers.tinker.token_spans_to_tinker_model_input`` of a TMLv0 rendering: an ``ImageChunk``
with tml-renderers' ``expected_tokens`` and a ``DmelChunk`` of its dMel ids). Referees: HF
``InklingForConditionalGeneration`` log-softmax on the same media (``forward``), the train engine's
``forward`` on prompt + sample (``sample``'s logprobs and prompt logprobs), tml-renderers' image
token counts.
"""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import pytest
import torch
from transformers import InklingForConditionalGeneration  # before ferrule's CPU patches

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "dist"))
tinker = pytest.importorskip("tinker", reason="the tinker SDK (serve extra) is not installed")
from inkling_fixtures import MM_AUDIO_TOKEN, MM_IMAGE_TOKEN, tiny_inkling_mm_dir  # noqa: E402
from serve_helpers import MODEL_NAME, RunningServer  # noqa: E402
from tinker import types  # noqa: E402

ATOL = 1e-5
#: tight enough that the refusal test can cross them with small media, loose enough for the rest
LIMIT_PIXELS, LIMIT_FRAMES = 64 * 48 * 2, 8


def _png(w: int, h: int, seed: int = 0) -> bytes:
    import numpy as np
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def _wav(seconds: float) -> bytes:
    import numpy as np
    from scipy.io import wavfile

    out = io.BytesIO()
    wave = (np.sin(np.arange(int(16000 * seconds)) * 0.07) * 8000).astype(np.int16)
    wavfile.write(out, 16000, wave)
    return out.getvalue()


def _tml_chunks(png: bytes | None = None, wav: bytes | None = None) -> list:
    """The media chunks tml-renderers makes for one image / audio part (TMLv0 rendering -> tinker chunks)."""
    import importlib.util

    from tml_renderers import chat, tokenizers, v0
    from tml_renderers.tinker import token_spans_to_tinker_model_input

    spec = importlib.util.spec_from_file_location("make_tmlv0_golden", REPO / "tests" / "make_tmlv0_golden.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    parts = []
    if png is not None:
        parts.append({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}})
    if wav is not None:
        parts.append({"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}})
    oa = chat.OpenAIMessage.from_oss_messages(gen.to_tml_messages([{"role": "user", "content": parts}], None))
    spans, _ = v0.Renderer(tokenizers.O200kBaseChatTokenizer()).render_for_completion(oa)
    return [c for c in token_spans_to_tinker_model_input(spans).chunks if c.type != "encoded_text"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_inkling_mm_dir(tmp_path_factory.mktemp("mm") / "tiny-inkling-mm",
                               vision={"num_hidden_layers": 2, "patch_size": 40})


@pytest.fixture(scope="module")
def server(base, tmp_path_factory):
    from ferrule.serve.limits import ServeLimits

    srv = RunningServer(base, tmp_path_factory.mktemp("storage"),
                        limits=ServeLimits(max_image_pixels=LIMIT_PIXELS, max_audio_frames=LIMIT_FRAMES))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def media():
    """``(image chunk, dmel chunk)`` by tml-renderers for a 64 x 48 PNG and a 0.2 s clip."""
    (image,) = _tml_chunks(png=_png(64, 48))
    (dmel,) = _tml_chunks(wav=_wav(0.2))
    assert image.type == "image" and dmel.type == "dmel"
    return image, dmel


def _prompt(image, dmel) -> types.ModelInput:
    return types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2, 3]), image,
                                    types.EncodedTextChunk(tokens=[4, 5]), dmel, types.EncodedTextChunk(tokens=[6, 7, 8])])


def _hf_logprobs(base, ids: list[int], image, dmel) -> torch.Tensor:
    """HF log p(ids[i + 1] | ids[:i + 1]) with the image's pixel values and tml-renderers' dMel ids."""
    from ferrule.plugins.inkling.towers import image_to_pixel_values
    from ferrule.serve.media_chunks import parse_tensor_container

    hf = InklingForConditionalGeneration.from_pretrained(base, dtype=torch.float32, attn_implementation="eager").eval()
    dm = parse_tensor_container(dmel.dmel, "dmel")
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids]), pixel_values=image_to_pixel_values(image.data, 40),
                    audio_input_ids=dm[None], audio_input_ids_mask=torch.ones(1, dm.shape[0], dtype=torch.bool)).logits
    lp = torch.log_softmax(logits[0].double(), -1)
    return lp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_forward_with_image_and_audio_chunks_equals_hf(server, base, media):
    image, dmel = media
    prompt = _prompt(image, dmel)
    ids = [1, 2, 3] + [MM_IMAGE_TOKEN] * image.expected_tokens + [4, 5] + [MM_AUDIO_TOKEN] * dmel.length + [6, 7, 8]
    assert prompt.length == len(ids) == 16   # tml-renderers' counts: 4 patches, 4 dMel frames
    targets = ids[1:] + [9]
    datum = types.Datum(model_input=prompt, loss_fn_inputs={"target_tokens": targets, "weights": [1.0] * len(ids)})
    tc = server.client().create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    out = tc.forward([datum], "cross_entropy").result()
    got = torch.tensor(out.loss_fn_outputs[0]["logprobs"].tolist(), dtype=torch.float64)
    assert got.shape == (16,)
    ref = _hf_logprobs(base, ids + [9], image, dmel)
    assert float((got - ref).abs().max()) <= ATOL
    # the media matter: the same ids with other media give other logprobs at the text after them
    (other,) = _tml_chunks(png=_png(64, 48, seed=1))
    out2 = tc.forward([types.Datum(model_input=_prompt(other, dmel), loss_fn_inputs=datum.loss_fn_inputs)],
                      "cross_entropy").result()
    assert float((torch.tensor(out2.loss_fn_outputs[0]["logprobs"].tolist()) - got).abs()[7:].max()) > 1e-3
    # forward_backward + optim_step run on the media too (the towers stay frozen, the adapters move)
    fb = tc.forward_backward([datum], "cross_entropy").result()
    assert fb.metrics["loss:sum"] == pytest.approx(-float(got.sum()), rel=1e-5)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert sum(after) > float(got.sum())


def test_sample_with_media_matches_the_train_engine(server, media):
    image, dmel = media
    prompt = _prompt(image, dmel)
    sc = server.client()
    sampler = sc.create_sampling_client(base_model=MODEL_NAME).result()
    res = sampler.sample(prompt, num_samples=2, include_prompt_logprobs=True,
                         sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0, seed=7)).result()
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()   # B = 0: the base model
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == prompt.length
    for seq in res.sequences:
        assert len(seq.tokens) == 5 and not {MM_IMAGE_TOKEN, MM_AUDIO_TOKEN} & set(seq.tokens)
        full = prompt.append(types.EncodedTextChunk(tokens=seq.tokens[:-1]))
        ids = [1, 2, 3] + [MM_IMAGE_TOKEN] * 4 + [4, 5] + [MM_AUDIO_TOKEN] * 4 + [6, 7, 8] + seq.tokens
        d = types.Datum(model_input=full, loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
        lp = tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        assert max(abs(a - b) for a, b in zip(lp[-5:], seq.logprobs)) <= 1e-4
        assert max(abs(a - b) for a, b in zip(lp[:prompt.length - 1], res.prompt_logprobs[1:])) <= 1e-4


def test_image_token_counts_equal_tml_renderers(server):
    """The server's count for an image chunk (its patches) is tml-renderers' ``expected_tokens``, over sizes
    that are and are not multiples of the 40 px patch (the decoder the server uses, without HTTP)."""
    from ferrule.serve.media_chunks import MediaPart, decoder

    dec = decoder(server.backend, server.app.state.service.limits)
    for w, h in ((64, 48), (40, 40), (41, 39), (1, 1), (120, 51)):
        (chunk,) = _tml_chunks(png=_png(w, h))
        assert dec.image(MediaPart("image", chunk.data, "t", "png")).shape[0] == chunk.expected_tokens, (w, h)


def _refused(call, match: str):
    with pytest.raises(tinker.BadRequestError, match=match):
        call().result()


def test_bad_media_refused_up_front_naming_the_offender(server, media):
    image, dmel = media
    sc = server.client()
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    sampler = sc.create_sampling_client(base_model=MODEL_NAME).result()

    def fwd(chunks, n):
        d = types.Datum(model_input=types.ModelInput(chunks=chunks),
                        loss_fn_inputs={"target_tokens": [1] * n, "weights": [1.0] * n})
        return lambda: tc.forward([d], "cross_entropy")

    def smp(chunks):
        return lambda: sampler.sample(types.ModelInput(chunks=chunks), 1, types.SamplingParams(max_tokens=2))

    wrong = types.ImageChunk(data=image.data, format="png", expected_tokens=5)
    _refused(fwd([types.EncodedTextChunk(tokens=[1]), wrong], 6),
             r"datum 0 chunk 1: expected_tokens = 5 but this image is 4 tokens")
    _refused(smp([types.ImageChunk(data=image.data, format="jpeg", expected_tokens=4)]),
             r"prompt chunk 0: format 'jpeg' but the data is a PNG file")
    big = types.ImageChunk(data=_png(100, 100), format="png", expected_tokens=9)
    _refused(fwd([big], 9), rf"image pixels \(100 x 100\) = 10000 exceeds the server's limit max_image_pixels = "
                            rf"{LIMIT_PIXELS}")
    (long_clip,) = _tml_chunks(wav=_wav(0.5))   # 10 frames
    _refused(smp([long_clip]), rf"10 dMel frames exceeds the server's limit max_audio_frames = {LIMIT_FRAMES}")
    _refused(fwd([types.DmelChunk(dmel=b"\x07\x02")], 1), r"dtype byte 7 is not an integer kind")
    _refused(smp([types.ImageAssetPointerChunk(format="png", location="/etc/passwd", expected_tokens=1)]),
             r"image_asset_pointer chunks .* are not read by this server")
    _refused(fwd([types.ImageChunk(data=b"not an image", format="png", expected_tokens=1)], 1),
             r"datum 0 chunk 0: the image data does not decode as PNG or JPEG")
    # every refusal consumed its seq_id: the client is not wedged, the next request runs
    ok = types.Datum(model_input=_prompt(image, dmel), loss_fn_inputs={"target_tokens": [1] * 16, "weights": [1.0] * 16})
    assert len(tc.forward([ok], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()) == 16
