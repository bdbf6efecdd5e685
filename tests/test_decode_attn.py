"""Decode attention (ferrule.rollout._decode_attn): the "fp32" formula against a float64 reference
of the same formula on CPU, and on CUDA the fused Triton kernel (rollout_engine.attention: triton) against
that reference, eagerly and inside one compiled + CUDA-graphed function. The CPU tests need no triton.
"""

import dataclasses
import re

import pytest
import torch

from ferrule.rollout._decode_attn import TRITON_ON_CPU, attend, reference

#: (batch, q heads, kv heads, head dim, max_len, attended kv_len): Qwen2-0.5B's 14/2 x 64, MHA, rep 4
SHAPES = [(64, 14, 2, 64, 384, 320), (5, 14, 2, 64, 96, 65), (3, 8, 8, 32, 64, 64), (256, 8, 2, 128, 128, 128),
          (1, 16, 4, 64, 1024, 1000)]
#: head dims below tl.dot's 16 and not a power of two (the kernel pads them): the tiny test models' 8, and 24
SMALL_HEAD_DIMS = [(3, 4, 2, 8, 40, 33), (2, 4, 2, 24, 40, 40)]


def _inputs(b, hq, hkv, d, max_len, kv_len, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, d, generator=g).to(device, dtype)
    k = (2 * torch.randn(b, hkv, max_len, d, generator=g)).to(device, dtype)
    v = torch.randn(b, hkv, max_len, d, generator=g).to(device, dtype)
    allowed = torch.zeros(b, max_len, dtype=torch.bool)
    for r in range(b):  # left padding of r % 7 slots, a hole, and the unfilled tail past kv_len - r % 3
        allowed[r, r % 7:kv_len - r % 3] = True
        allowed[r, (r % 7 + kv_len) // 2] = False
    return q, k, v, allowed.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_formula_matches_float64_reference(dtype):
    q, k, v, allowed = _inputs(4, 4, 2, 16, 40, 33, dtype, "cpu")
    hidden = ~allowed[:, None, None, :33]
    got = attend(q, k, v, allowed, hidden, 33, 0.25, "fp32").view(4, 4, 16)
    want = reference(q, k, v, allowed, 33, 0.25)
    tol = 1e-6 if dtype == torch.float32 else 2 ** -8  # one rounding of the output to bf16
    assert (got.double() - want).abs().max() <= tol * want.abs().max().clamp(min=1)
    if not TRITON_ON_CPU:  # "triton" off CUDA is the fp32 formula, bit for bit
        assert torch.equal(attend(q, k, v, allowed, hidden, 33, 0.25, "triton"), got.view(4, 64))


def _errors(got, formula, want):
    return (got.double() - want).abs().max().item(), (formula.double() - want).abs().max().item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Triton decode attention)")
@pytest.mark.parametrize("shape", SHAPES + SMALL_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_kernel_matches_reference_on_cuda(shape, dtype):
    """Every split count: within the cuBLAS "fp32" formula's own error against float64 (+ half a
    bf16 ulp of the largest output, the output's single rounding), and the same for every split."""
    from ferrule.rollout._decode_attn_triton import decode_attention

    b, hq, hkv, d, max_len, kv_len = shape
    q, k, v, allowed = _inputs(*shape, dtype, "cuda")
    scaling = d ** -0.5
    want = reference(q, k, v, allowed, kv_len, scaling)
    formula = attend(q, k, v, allowed, ~allowed[:, None, None, :kv_len], kv_len, scaling, "fp32").view(b, hq, d)
    slack = (2 ** -9 if dtype == torch.bfloat16 else 1e-6) * want.abs().max().item()
    for splits in (1, 2, 3, 8):
        got = decode_attention(q, k, v, allowed, kv_len, scaling, splits)
        assert got.dtype == dtype and got.shape == (b, hq, d)
        ours, theirs = _errors(got, formula, want)
        assert ours <= theirs + slack, (splits, ours, theirs)


def _rope_ref(x, cos, sin):
    """transformers' apply_rotary_pos_emb in fp32, rounded once to ``x``'s dtype (as inductor's
    fused kernel rounds the step's RoPE); ``x [batch, heads, d]``, ``cos``/``sin [batch, d]``."""
    xf, c, s = x.float(), cos.float()[:, None], sin.float()[:, None]
    half = x.shape[-1] // 2
    return (xf * c + torch.cat((-xf[..., half:], xf[..., :half]), -1) * s).to(x.dtype)


def _rope_inputs(b, hq, hkv, d, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=g).to("cuda", dtype)  # the projection's layout
    q = qkv[:, :hq * d].view(b, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(b, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(b, hkv, d)
    ang = torch.rand(b, d // 2, generator=g) * 100
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
    return q, k, v, cos.to("cuda", dtype), sin.to("cuda", dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Triton decode attention)")
@pytest.mark.parametrize("shape", SHAPES[:3] + SMALL_HEAD_DIMS)
def test_triton_rope_kernel_matches_reference_on_cuda(shape):
    """RoPE + cache write + attention in one kernel: the written key within one bf16 rounding of
    the fp32 RoPE, the value written as is, the output as in the test above."""
    from ferrule.rollout._decode_attn_triton import decode_attention_rope

    b, hq, hkv, d, max_len, kv_len = shape
    _, kc, vc, allowed = _inputs(*shape, torch.bfloat16, "cuda")
    q, k, v, cos, sin = _rope_inputs(b, hq, hkv, d, torch.bfloat16)
    slot = torch.tensor([kv_len - 1 - r % 3 for r in range(b)], device="cuda")
    allowed[torch.arange(b, device="cuda"), slot] = True
    rows = torch.arange(b, device="cuda")
    k_want, v_want = kc.clone(), vc.clone()
    k_want[rows, :, slot] = _rope_ref(k, cos, sin)
    v_want[rows, :, slot] = v
    qr = _rope_ref(q, cos, sin)
    want = reference(qr, k_want, v_want, allowed, kv_len, d ** -0.5)
    formula = attend(qr, k_want, v_want, allowed, ~allowed[:, None, None, :kv_len], kv_len, d ** -0.5,
                     "fp32").view(b, hq, d)
    for splits in (1, 3):
        k_got, v_got = kc.clone(), vc.clone()
        got = decode_attention_rope(q, k, v, cos, sin, slot, k_got, v_got, allowed, kv_len, d ** -0.5, splits)
        torch.testing.assert_close(k_got, k_want, rtol=2 ** -7, atol=1e-6)
        assert torch.equal(v_got, v_want)
        ours, theirs = _errors(got, formula, want)
        assert ours <= theirs + 2 ** -9 * want.abs().max().item(), (splits, ours, theirs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Triton decode attention)")
@torch.inference_mode()
def test_triton_kernel_inside_compiled_graph_on_cuda():
    """In one torch.compile(fullgraph=True) function after an in-place cache write (as the decode
    step has it), with the attended length changing (symbolic after its second value), eager and
    compiled + CUDA-graphed agree bit for bit, and the cache is not copied (written in place)."""
    from ferrule.rollout._decode_attn_triton import decode_attention, decode_attention_rope

    b, hq, hkv, d, max_len = 16, 14, 2, 64, 256
    q, k, v, allowed = _inputs(b, hq, hkv, d, max_len, max_len, torch.bfloat16, "cuda")
    rows = torch.arange(b, device="cuda")

    def step(q, k, v, allowed, slot, kv_len: int):
        k[rows, :, slot] = q[:, :hkv] * 0.5
        return decode_attention(q, k, v, allowed, kv_len, 0.125, 2) * 2

    def step_rope(qkv, k, v, allowed, slot, kv_len: int):
        x = qkv * 1.5  # a buffer of the graph, laid out as the qkv projection's output
        qq, kn, vn = x[:, :hq * d].view(b, hq, d), x[:, hq * d:(hq + hkv) * d].view(b, hkv, d), \
            x[:, (hq + hkv) * d:].view(b, hkv, d)
        # cos / sin are inputs: computed in the graph, inductor's cos may differ from eager's in the last bit
        return decode_attention_rope(qq, kn, vn, cos, sin, slot, k, v, allowed, kv_len, 0.125, 2) * 2

    from torch._inductor.utils import run_and_get_code

    qkv = torch.randn(b, (hq + 2 * hkv) * d, device="cuda").bfloat16()
    cos, sin = qkv[:, :d].float().cos().bfloat16(), qkv[:, :d].float().sin().bfloat16()
    for fn_eager, q in ((step, q), (step_rope, qkv)):
        fn = torch.compile(fn_eager, fullgraph=True, dynamic=None)
        for kv_len in (64, 128, 192):
            slot = torch.full((b,), kv_len - 1, device="cuda")
            k_eager, v_eager = k.clone(), v.clone()
            want = fn_eager(q, k_eager, v_eager, allowed, slot, kv_len)
            k_ptr = k.data_ptr()
            got, codes = run_and_get_code(fn, q, k, v, allowed, slot, kv_len)
            # no cache-sized buffer allocated (a functionalised copy of k or v) in the generated code; the shape
            # also appears in the inputs' assert_size_stride checks, which are not allocations
            copies = [line.strip() for c in codes for line in c.splitlines()
                      if re.search(rf"empty_strided\w*\(\({b}, {hkv}, {max_len}, {d}\)", line)]
            assert not copies, (fn_eager.__name__, kv_len, copies)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fn(q, k, v, allowed, slot, kv_len)
            graph.replay()
            torch.cuda.synchronize()
            assert k.data_ptr() == k_ptr and torch.equal(k, k_eager) and torch.equal(v, v_eager)
            assert torch.equal(got, want) and torch.equal(out, want), (fn_eager, kv_len)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Triton decode attention)")
@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
@pytest.mark.parametrize("attn", ["triton", "triton_rope"])
@torch.inference_mode()
def test_fast_decode_with_triton_attention_on_cuda(monkeypatch, attn, sampling):
    """The engine's fast path (bf16, compiled + CUDA-graphed) with settings.attention triton /
    triton_rope and the chunked sampler (sampler_chunks=128: 4 chunks of this 4096
    vocabulary): its logprobs of its own tokens against an fp32 HF forward are at most 2x those of
    the default fast path ("fp32" matmul formula, one-pass sampler) + 1e-3 (tests/test_gpu.py's criterion)."""
    import copy

    import transformers
    from test_rollout_fast_decode import TINY, _fp32_logprobs

    from ferrule.rollout import SamplingParams
    from ferrule.rollout.embedded import EmbeddedEngine

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(attn_implementation="sdpa", tie_word_embeddings=True, **{**TINY, "vocab_size": 4096})
    model = transformers.Qwen2ForCausalLM(cfg).eval().to("cuda")
    for p in model.parameters():  # non-trivial norms and biases
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    model32 = copy.deepcopy(model).float()
    engine = EmbeddedEngine(model=model.to(torch.bfloat16), fast_decode=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (3, 17, 9, 23, 1, 12)]
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True) if sampling == "greedy" else \
        SamplingParams(temperature=1.0, max_new_tokens=40, seed=3, ignore_eos=True)
    errs = {}
    for kind, chunks in (("fp32", "0"), (attn, "128")):
        # kv_bucket 0: one graph per call, the whole 128-slot cache
        engine.settings = dataclasses.replace(engine.settings, kv_bucket=0, attention=kind, sampler_chunks=int(chunks))
        e = []
        for r in engine.generate(prompts, params):
            ref = _fp32_logprobs(model32, prompts[r.prompt_index], r.token_ids, params.temperature)
            e.append((torch.tensor(r.logprobs, dtype=torch.float64) - ref).abs())
        errs[kind] = torch.cat(e).mean().item()
    print(f"mean |logprob - fp32 forward| ({sampling}): {errs}")
    assert errs[attn] <= 2 * errs["fp32"] + 1e-3 and errs[attn] < 0.02, errs
