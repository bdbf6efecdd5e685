"""``ferrule serve --base-model`` on Inkling-2 bases, driven by the unmodified ``tinker`` 0.38 SDK.

One server process (uvicorn in a thread, tests/serve_helpers.py) serves five tiny random bases at
once (:class:`~ferrule.serve.registry.BaseRegistry`):

- ``ink2``: ``Inkling2ForCausalLM`` (plugins/inkling2/tests/test_inkling2.py's ``mqa_full_first_softcaps``: a full
  layer first, one KV head, soft-caps and clips that bite, an unembedding padded from 90 to 100 rows);
- ``ink2-loop``: ``Inkling2LoopForCausalLM`` (``loop_2_6_x3``: layers 2..5 run three times);
- ``ink2-vision``: ``Inkling2ForConditionalGeneration`` (tests/inkling2_vision_fixtures.py, with the
  released 20 px patch x 2 merge, so that tml-renderers' image token counts apply);
- ``ink2-mxfp8``: the ``ink2`` weights with MXFP8 routed experts in the released layout
  (``mlp.experts.{w13,w2}_weight`` ``float8_e4m3fn`` + ``uint8`` E8M0 ``..._weight_scale``), and
  ``ink2-mxfp8-td``, that folder converted to a torch_dist checkpoint (``hf_to_torch_dist``).

Referees: HF transformers' fp32 log-softmax of the same checkpoint (of the dequantized folder for
MXFP8, made with transformers' own ``Fp8Quantize`` / ``Fp8Dequantize`` as tests/test_convert_mxfp8.py
does), over HF's ``lm_head`` rows (the real vocabulary); an HF model trained by hand with torch's Adam
on the same data for ``optim_step``; tml-renderers' ``expected_tokens`` for image token counts.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Inkling2ForConditionalGeneration  # before ferrule's CPU patches

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "dist"))
tinker = pytest.importorskip("tinker", reason="the tinker SDK (serve extra) is not installed")
import inkling2_vision_fixtures as vf  # noqa: E402
from serve_helpers import ALICE, RunningServer, poll_done, raw, sampler_weights  # noqa: E402
from inkling2_fixtures import CONFIGS, tiny_inkling2_dir  # noqa: E402
from tinker import types  # noqa: E402

ATOL = 1e-5
PROMPT = [3, 17, 42, 5, 60, 11, 29, 88, 2]
REAL_VOCAB, PADDED_VOCAB = 90, 100   # unpadded_vocab_size, vocab_size of the text bases
#: the released geometry: 20 px patches merged 2 x 2, one token per 40 x 40 square
VISION = dict(vf.VISION, patch_size=20, posemb_grid_size=4)


# ---------------------------------------------------------------------------- bases and the server

def _mxfp8_pair(src: Path, root: Path) -> tuple[Path, Path]:
    """``(mxfp8 folder, its dequantized bf16 reference folder)`` of ``src``'s routed experts
    (transformers' quantizer and dequantizer, as tests/test_convert_mxfp8.py)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    class _Quantizer:
        quantization_config = FineGrainedFP8Config(quant_method="mxfp8", weight_block_size=(1, 32), scale_fmt="ue8m0")

    quantized, dequantized = {}, {}
    for k, v in load_file(src / "model.safetensors").items():
        v = v.to(torch.bfloat16)
        quantized[k] = dequantized[k] = v
        if k.endswith(("mlp.experts.w13_weight", "mlp.experts.w2_weight")):
            out = Fp8Quantize(_Quantizer())._quantize_one(k, v)
            quantized[k], quantized[k + "_scale"] = out[k], out[k + "_scale_inv"].view(torch.uint8)
            dequantized[k] = Fp8Dequantize(_Quantizer())._dequantize_one(out[k], quantized[k + "_scale"], torch.bfloat16)
    mx, ref = root / "ink2-mxfp8", root / "ink2-mxfp8-dequantized"
    for folder, tensors, qc in ((mx, quantized, _Quantizer.quantization_config.to_dict()), (ref, dequantized, None)):
        shutil.copytree(src, folder)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((folder / "config.json").read_text())
        config["dtype"] = "bfloat16"
        if qc is not None:
            config["quantization_config"] = qc
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    assert sum(k.endswith("_weight_scale") for k in quantized) == 2 * 4   # 4 MoE layers, w13 and w2
    return mx, ref


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("ink2_bases")
    # experts of 32 columns: both expert matrices hold whole 32-wide MXFP8 blocks
    text = tiny_inkling2_dir(root / "ink2", dict(CONFIGS["mqa_full_first_softcaps"], moe_intermediate_size=32))
    loop = tiny_inkling2_dir(root / "ink2-loop", CONFIGS["loop_2_6_x3"], seed=1)
    vision = root / "ink2-vision"
    vf.hf_model(vf.config_dict(VISION), seed=2).save_pretrained(vision)
    mx, mx_ref = _mxfp8_pair(text, root)
    from ferrule.converters import hf_to_torch_dist

    return {"ink2": text, "ink2-loop": loop, "ink2-vision": vision, "ink2-mxfp8": mx, "mxfp8-reference": mx_ref,
            "ink2-mxfp8-td": hf_to_torch_dist(mx, root / "ink2-mxfp8-td")}


@pytest.fixture(scope="module")
def server(bases, tmp_path_factory):
    from ferrule.serve.registry import BaseRegistry

    names = ("ink2", "ink2-loop", "ink2-vision", "ink2-mxfp8", "ink2-mxfp8-td")
    srv = RunningServer(BaseRegistry([(n, bases[n]) for n in names], max_loaded=len(names)),
                        tmp_path_factory.mktemp("ink2_storage"))
    yield srv
    srv.stop()


# ---------------------------------------------------------------------------- referees

def _hf(directory: Path, overrides: dict | None = None):
    """The HF model of ``directory`` in fp32 (``overrides``: HF-named tensors loaded over it through a copy
    of the folder, so that transformers' own conversion mapping renames them)."""
    if overrides is not None:
        from safetensors.torch import save_file

        tmp = directory.with_name(directory.name + "-overridden")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(directory, tmp)
        save_file(overrides, tmp / "model.safetensors", metadata={"format": "pt"})
        directory = tmp
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def hf_logprobs(model, tokens: list[int], **media) -> torch.Tensor:
    """``[len(tokens) - 1]`` float64: HF log p(tokens[i + 1] | tokens[:i + 1]) over HF's lm_head rows."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens]), **media).logits[0].double()
    assert logits.shape[-1] == REAL_VOCAB or "pixel_values" in media   # HF's lm_head: the unpadded rows
    return torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


def full_parameter_client(srv: RunningServer, sc, base_model: str):
    """A full-parameter training client (``create_model`` without ``lora_config``: the SDK only sends LoRA
    ones) wrapped in the SDK's own ``TrainingClient``, so every later call goes through the SDK."""
    from tinker.lib.public_interfaces.training_client import TrainingClient

    session, seq = sc.holder.get_session_id(), sc.holder.get_training_client_id()
    rid = raw(srv, "/api/v1/create_model", ALICE, json={"session_id": session, "model_seq_id": seq,
                                                          "base_model": base_model}).json()["request_id"]
    model_id = poll_done(srv, rid).json()["model_id"]
    info = types.GetInfoResponse.model_validate(raw(srv, "/api/v1/get_info", ALICE, json={"model_id": model_id}).json())
    assert not info.is_lora
    return TrainingClient(sc.holder, model_seq_id=seq, model_id=model_id, info=info)


def _datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights or [1.0] * (len(tokens) - 1)})


def _lp(out, i: int = 0) -> torch.Tensor:
    return torch.tensor(out.loss_fn_outputs[i]["logprobs"].tolist(), dtype=torch.float64)


# ---------------------------------------------------------------------------- sampling the bases

@pytest.mark.parametrize("name", ["ink2", "ink2-loop"])
def test_base_sampler_equals_hf(server, bases, name):
    """compute_logprobs, prompt logprobs, top-k prompt logprobs and sampled tokens' logprobs of a base's sampler
    equal HF's log-softmax over the real vocabulary; no sampled id is a padded row."""
    hf = _hf(bases[name])
    sampler = server.client().create_sampling_client(base_model=name).result(timeout=120)
    got = torch.tensor(sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result(timeout=120)[1:],
                       dtype=torch.float64)
    ref = hf_logprobs(hf, PROMPT)
    print(f"{name} sampler compute_logprobs: max |served - HF| = {float((got - ref).abs().max()):.2e}")
    assert float((got - ref).abs().max()) < ATOL
    res = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=2, include_prompt_logprobs=True,
                         topk_prompt_logprobs=3,
                         sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)).result(timeout=120)
    assert float((torch.tensor(res.prompt_logprobs[1:]).double() - ref).abs().max()) < ATOL
    with torch.no_grad():
        full = torch.log_softmax(hf(input_ids=torch.tensor([PROMPT])).logits[0].double(), -1)
    for i in range(1, len(PROMPT)):
        want_lp, want_ids = torch.topk(full[i - 1], 3)
        assert [t for t, _ in res.topk_prompt_logprobs[i]] == want_ids.tolist()
        assert max(abs(lp - w) for (_, lp), w in zip(res.topk_prompt_logprobs[i], want_lp.tolist())) < ATOL
    for seq in res.sequences:
        assert len(seq.tokens) == 6 and max(seq.tokens) < REAL_VOCAB
        want = hf_logprobs(hf, PROMPT + seq.tokens)[len(PROMPT) - 1:]
        print(f"{name} sampled logprobs: max |served - HF| = {float((torch.tensor(seq.logprobs).double() - want).abs().max()):.2e}")
        assert float((torch.tensor(seq.logprobs).double() - want).abs().max()) < ATOL


def test_padded_vocabulary_rows_are_refused_naming_the_real_vocabulary(server):
    """Ids in [unpadded_vocab_size, vocab_size) are embedding padding, not tokens: HF's logits have no column
    for them, so a target or prompt id there is refused (before: the forward answered ~-3.4e38)."""
    sc = server.client()
    sampler = sc.create_sampling_client(base_model="ink2").result(timeout=120)
    with pytest.raises(tinker.BadRequestError, match=rf"outside \[0, {REAL_VOCAB}\)"):
        sampler.sample(types.ModelInput.from_ints([3, 95]), 1, types.SamplingParams(max_tokens=1)).result(timeout=60)
    tc = full_parameter_client(server, sc, "ink2")
    with pytest.raises(tinker.BadRequestError, match=rf"id 95 >= the vocabulary size {REAL_VOCAB}"):
        tc.forward([_datum([3, 4, 95])], "cross_entropy").result(timeout=120)
    assert len(_lp(tc.forward([_datum([3, 4, 89])], "cross_entropy").result(timeout=120))) == 2


# ---------------------------------------------------------------------------- training clients

def _hf_adam_step(hf, data: list[list[int]], lr: float, eps: float) -> None:
    """One cross-entropy (summed) step of ``hf`` with torch's Adam (the referee of the served optim_step)."""
    params = [p for p in hf.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr, betas=(0.9, 0.95), eps=eps, weight_decay=0.0)
    loss = sum(-hf_logprobs_grad(hf, toks).sum() for toks in data)
    loss.backward()
    opt.step()


def hf_logprobs_grad(model, tokens: list[int]) -> torch.Tensor:
    logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


@pytest.mark.timeout(600)
def test_full_parameter_client_trains_like_hf_and_saves_and_loads(server, bases):
    """forward == HF; forward_backward + optim_step == HF + torch Adam on the same data (logprobs after the
    step); the sampler weights sample what HF holding them computes; save_state / load_state round trip."""
    sc = server.client()
    tc = full_parameter_client(server, sc, "ink2")
    data = [PROMPT, [7, 1, 64, 30, 2, 81], [50, 49, 48, 47, 46, 45, 44, 43, 42, 41, 40]]
    sdk = [_datum(t) for t in data]
    hf = _hf(bases["ink2"])
    out = tc.forward(sdk, "cross_entropy").result(timeout=120)
    for i, toks in enumerate(data):
        assert float((_lp(out, i) - hf_logprobs(hf, toks)).abs().max()) < ATOL
    lr, eps = 1e-3, 1e-6
    fb = tc.forward_backward(sdk, "cross_entropy").result(timeout=300)
    assert fb.metrics["loss:sum"] == pytest.approx(-sum(float(_lp(out, i).sum()) for i in range(3)), rel=1e-6)
    tc.optim_step(types.AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95, eps=eps)).result(timeout=300)
    _hf_adam_step(hf, data, lr, eps)
    hf.eval()
    after = tc.forward(sdk, "cross_entropy").result(timeout=120)
    deltas = [float((_lp(after, i) - hf_logprobs(hf, toks)).abs().max()) for i, toks in enumerate(data)]
    moved = max(float((_lp(after, i) - _lp(out, i)).abs().max()) for i in range(3))
    print(f"full-parameter step: max |served - HF+Adam| = {max(deltas):.2e}, moved {moved:.2e}")
    assert moved > 1e-2 and max(deltas) < 1e-4
    # the sampler weights: a sampling client of them == HF loading them (transformers' own renaming)
    path = tc.save_weights_for_sampler("ink2-step1").result(timeout=300).path
    trained = _hf(bases["ink2"], sampler_weights(server, path))
    s = sc.create_sampling_client(model_path=path).result(timeout=120)
    got = torch.tensor(s.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result(timeout=120)[1:]).double()
    assert float((got - hf_logprobs(trained, PROMPT)).abs().max()) < ATOL
    assert float((_lp(after, 0) - hf_logprobs(trained, PROMPT)).abs().max()) < ATOL
    # save_state -> a new client from it (weights and Adam state) computes the same, bit for bit
    state = tc.save_state("ink2-state").result(timeout=300).path
    again = sc.create_training_client_from_state_with_optimizer(state).result(timeout=300)
    assert torch.equal(_lp(again.forward(sdk, "cross_entropy").result(timeout=120)), _lp(after))


# ---------------------------------------------------------------------------- the vision family: image chunks

def _png(w: int, h: int, seed: int = 0) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def _tml_image_chunk(png: bytes):
    """The ``ImageChunk`` tml-renderers makes for one image part (TMLv0 rendering -> tinker chunks)."""
    import base64
    import importlib.util

    from tml_renderers import chat, tokenizers, v0
    from tml_renderers.tinker import token_spans_to_tinker_model_input

    spec = importlib.util.spec_from_file_location("make_tmlv0_golden", REPO / "tests" / "make_tmlv0_golden.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}]
    oa = chat.OpenAIMessage.from_oss_messages(gen.to_tml_messages([{"role": "user", "content": parts}], None))
    spans, _ = v0.Renderer(tokenizers.O200kBaseChatTokenizer()).render_for_completion(oa)
    (image,) = [c for c in token_spans_to_tinker_model_input(spans).chunks if c.type == "image"]
    return image


def _hf_image_inputs(png: bytes) -> dict:
    from ferrule.plugins.inkling2.towers import hf_vision_inputs, image_to_pixel_values

    return hf_vision_inputs([image_to_pixel_values(png, 40)], {})


def test_image_chunks_forward_and_sample_equal_hf(server, bases):
    """An ``ImageChunk`` (made by tml-renderers) in forward / forward_backward / sample of the ``inkling2`` family:
    logprobs == HF ``Inkling2ForConditionalGeneration`` on the same image (pixel values ``[R*C, 40, 40, 3]`` +
    ``image_grid_thw``); its token count == tml-renderers' ``expected_tokens``; another image changes the text after it."""
    image = _tml_image_chunk(_png(64, 48))
    assert image.expected_tokens == 4   # 2 x 2 squares of 40 px
    prompt = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[5, 6, 7]), image,
                                      types.EncodedTextChunk(tokens=[8, 9])])
    ids = [5, 6, 7] + [vf.IMAGE_TOKEN] * 4 + [8, 9]
    hf = Inkling2ForConditionalGeneration.from_pretrained(bases["ink2-vision"], dtype=torch.float32).eval()
    media = _hf_image_inputs(image.data)
    sc = server.client()
    tc = full_parameter_client(server, sc, "ink2-vision")
    targets = ids[1:] + [10]
    datum = types.Datum(model_input=prompt, loss_fn_inputs={"target_tokens": targets, "weights": [1.0] * len(ids)})
    got = _lp(tc.forward([datum], "cross_entropy").result(timeout=120))
    ref = hf_logprobs(hf, ids + [10], **media)
    print(f"image forward: max |served - HF| = {float((got - ref).abs().max()):.2e}")
    assert got.shape == (9,) and float((got - ref).abs().max()) < ATOL
    other = _tml_image_chunk(_png(64, 48, seed=1))
    moved = _lp(tc.forward([types.Datum(model_input=types.ModelInput(chunks=[prompt.chunks[0], other, prompt.chunks[2]]),
                                        loss_fn_inputs=datum.loss_fn_inputs)], "cross_entropy").result(timeout=120))
    assert float((moved - got).abs()[6:].max()) > 1e-3
    fb = tc.forward_backward([datum], "cross_entropy").result(timeout=300)
    assert fb.metrics["loss:sum"] == pytest.approx(-float(got.sum()), rel=1e-5)
    # the base's sampler on the same image prompt: prompt logprobs and sampled logprobs == HF
    sampler = sc.create_sampling_client(base_model="ink2-vision").result(timeout=120)
    res = sampler.sample(prompt, num_samples=2, include_prompt_logprobs=True,
                         sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=5)).result(timeout=120)
    assert len(res.prompt_logprobs) == len(ids)
    assert float((torch.tensor(res.prompt_logprobs[1:]).double() - ref[:len(ids) - 1]).abs().max()) < ATOL
    for seq in res.sequences:
        assert len(seq.tokens) == 4 and vf.IMAGE_TOKEN not in seq.tokens and max(seq.tokens) < vf.TEXT["unpadded_vocab_size"]
        want = hf_logprobs(hf, ids + seq.tokens, **media)[len(ids) - 1:]
        assert float((torch.tensor(seq.logprobs).double() - want).abs().max()) < ATOL


def test_image_token_counts_are_transformers_and_where_tml_renderers_differs(server):
    """The server's count of an image is transformers' ``Inkling2ImageProcessor`` grid, ceil(H / 40) x ceil(W / 40)
    (its ``_preprocess``; the processor itself needs torchvision, absent here). tml-renderers 0.2.1 counts Inkling's
    (v1) grid, ceil(H / 40) x (floor(W / 40) + 1): the same unless W is a multiple of 40, where its
    ``expected_tokens`` is one column more and the server refuses the chunk naming both counts."""
    import math

    from ferrule.serve.media_chunks import MediaPart, decoder

    dec = decoder(server.app.state.bases.get("ink2-vision"), server.app.state.service.limits)
    for w, h in ((64, 48), (41, 39), (1, 1), (120, 51), (81, 41), (40, 40), (80, 41)):
        chunk = _tml_image_chunk(_png(w, h))
        n = dec.image(MediaPart("image", chunk.data, "t", "png")).shape[:2].numel()
        assert n == math.ceil(h / 40) * math.ceil(w / 40), (w, h)
        assert chunk.expected_tokens == math.ceil(h / 40) * (w // 40 + 1), (w, h)
        assert (n == chunk.expected_tokens) == (w % 40 != 0), (w, h)
    sampler = server.client().create_sampling_client(base_model="ink2-vision").result(timeout=120)
    with pytest.raises(tinker.BadRequestError, match="prompt chunk 0: expected_tokens = 2 but this image is 1 tokens"):
        sampler.sample(types.ModelInput(chunks=[_tml_image_chunk(_png(40, 40))]), 1,
                       types.SamplingParams(max_tokens=1)).result(timeout=60)


# ---------------------------------------------------------------------------- the released MXFP8 layout

def test_mxfp8_base_serves_the_dequantized_model(server, bases):
    """A base folder in the released MXFP8 layout: its sampler and a training client compute what HF computes on
    the folder dequantized with transformers' own ``Fp8Dequantize`` (transformers cannot load these expert
    scales on CPU: tests/test_convert_mxfp8.py)."""
    ref_model = _hf(bases["mxfp8-reference"])
    ref = hf_logprobs(ref_model, PROMPT)
    assert float((ref - hf_logprobs(_hf(bases["ink2"]), PROMPT)).abs().max()) > 1e-4   # the quantization shows
    sc = server.client()
    sampler = sc.create_sampling_client(base_model="ink2-mxfp8").result(timeout=120)
    got = torch.tensor(sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result(timeout=120)[1:]).double()
    print(f"mxfp8 sampler: max |served - HF(dequantized)| = {float((got - ref).abs().max()):.2e}")
    assert float((got - ref).abs().max()) < ATOL
    tc = full_parameter_client(server, sc, "ink2-mxfp8")
    lp = _lp(tc.forward([_datum(PROMPT)], "cross_entropy").result(timeout=120))
    print(f"mxfp8 training client: max |served - HF(dequantized)| = {float((lp - ref).abs().max()):.2e}")
    assert float((lp - ref).abs().max()) < ATOL
    # the same folder converted to torch_dist (ferrule convert hf-to-torch-dist), served as a torch_dist base
    td = sc.create_sampling_client(base_model="ink2-mxfp8-td").result(timeout=120)
    got = torch.tensor(td.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result(timeout=120)[1:]).double()
    assert float((got - ref).abs().max()) < ATOL


# ---------------------------------------------------------------------------- LoRA training clients (the SDK's kind)

def _lora_data(name: str) -> tuple[list, list]:
    """``(SDK data, [(token ids, HF media keywords)])``: two text data, plus an image datum for the vision base."""
    texts = [PROMPT, [50, 49, 48, 47, 46, 45, 44, 43, 42, 41, 40]]
    sdk, ref = [_datum(t) for t in texts], [(t, {}) for t in texts]
    if name == "ink2-vision":
        image = _tml_image_chunk(_png(64, 48))
        ids = [5, 6, 7] + [vf.IMAGE_TOKEN] * 4 + [8, 9, 10]
        sdk.append(types.Datum(model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[5, 6, 7]), image,
                                                                    types.EncodedTextChunk(tokens=[8, 9])]),
                               loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}))
        ref.append((ids, _hf_image_inputs(image.data)))
    return sdk, ref


def _hf_cls(name: str):
    return Inkling2ForConditionalGeneration if name == "ink2-vision" else AutoModelForCausalLM


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["ink2", "ink2-loop", "ink2-vision"])
def test_lora_client_gradients_step_sampler_and_state_equal_hf_peft(server, bases, name, tmp_path):
    """``create_lora_training_client`` (SDK defaults: attention, MLP and unembedding switched on) on an Inkling-2
    base: forward == HF; forward_backward's LoRA gradients == HF + PEFT's on the client's initial adapter; after
    optim_step the client's forward == HF + PEFT holding its exported adapter, and its sampler (adapters merged)
    computes the same; save_state / load_state with the optimizer continue bit for bit. The unembedding is not
    adapted (the family refuses its padded lm_head; the server says why in ``unembed_refused``)."""
    from test_lora_inkling2 import _ferrule_grads_in_peft_layout

    from ferrule.lora import hf_adapter_state_dict, peft_config

    peft = pytest.importorskip("peft", reason="peft (the dev extra) is the HF PEFT referee")
    import lora_worker as lw

    sc = server.client()
    tc = sc.create_lora_training_client(base_model=name, rank=4, seed=3).result(timeout=300)
    assert tc.get_info().lora_rank == 4
    backend = server.app.state.bases.get(name)
    engine = backend.engines[tc.model_id]
    assert "lm_head" in (backend.unembed_refused or "") and "output_layer" not in engine.lora.target_modules
    sdk, ref = _lora_data(name)

    def peft_model(adapter_dir):
        base = _hf_cls(name).from_pretrained(bases[name], dtype=torch.float32, attn_implementation="eager")
        return peft.PeftModel.from_pretrained(base, adapter_dir, is_trainable=True).eval()

    def peft_lp(model, grad=False):
        with torch.set_grad_enabled(grad):
            out = []
            for ids, media in ref:
                logits = model(input_ids=torch.tensor([ids]), **media).logits[0]
                lp = torch.log_softmax(logits if grad else logits.double(), -1)
                out.append(lp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0])
            return out

    initial = peft_model(lw.write_peft_dir(tmp_path / "initial", hf_adapter_state_dict(engine), peft_config(engine)))
    before = tc.forward(sdk, "cross_entropy").result(timeout=120)
    base_lp = peft_lp(initial)
    assert max(float((_lp(before, i) - r).abs().max()) for i, r in enumerate(base_lp)) < ATOL
    fb = tc.forward_backward(sdk, "cross_entropy").result(timeout=300)
    assert fb.metrics["loss:sum"] == pytest.approx(-sum(float(r.sum()) for r in base_lp), rel=1e-6)
    got = _ferrule_grads_in_peft_layout(engine)
    (-sum(lp.sum() for lp in peft_lp(initial, grad=True))).backward()
    want = {k.replace(".default", ""): p.grad for k, p in initial.named_parameters() if ".lora_" in k}
    assert set(want) == set(got) and any("mlp.experts" in k for k in want)
    worst = 0.0
    for k, g in want.items():
        if "mlp.experts" in k and ".lora_A." in k:   # ferrule shares A over the experts: its gradient is the sum
            g = g.reshape(-1, 4, g.shape[1]).sum(0).repeat(g.shape[0] // 4, 1)
        worst = max(worst, float((got[k] - g).abs().max()) / max(float(g.abs().max()), 1e-12))
    print(f"{name} LoRA gradients: worst relative |served - HF+PEFT| = {worst:.2e} over {len(want)} tensors")
    assert worst <= (1e-4 if name == "ink2-loop" else 1e-5)   # the loop's bound: tests/test_lora_inkling2.py
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=300)
    after = tc.forward(sdk, "cross_entropy").result(timeout=120)
    trained = peft_model(lw.write_peft_dir(tmp_path / "trained", hf_adapter_state_dict(engine), peft_config(engine)))
    diff = max(float((_lp(after, i) - r).abs().max()) for i, r in enumerate(peft_lp(trained)))
    moved = max(float((_lp(after, i) - _lp(before, i)).abs().max()) for i in range(len(sdk)))
    print(f"{name} LoRA after optim_step: max |served - HF+PEFT| = {diff:.2e}, moved {moved:.2e}")
    assert diff < ATOL and moved > 1e-2
    sampler = tc.save_weights_and_get_sampling_client()
    served = torch.tensor(sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result(timeout=120)[1:]).double()
    assert float((served - _lp(after, 0)).abs().max()) < ATOL
    state = tc.save_state(f"{name}-lora").result(timeout=300).path
    again = sc.create_training_client_from_state_with_optimizer(state).result(timeout=300)
    for client in (tc, again):
        client.forward_backward(sdk, "cross_entropy").result(timeout=300)
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=300)
    a, b = (c.forward(sdk, "cross_entropy").result(timeout=120) for c in (tc, again))
    assert all(torch.equal(_lp(a, i), _lp(b, i)) for i in range(len(sdk)))
