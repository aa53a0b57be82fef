"""The op layer (``ops.py``) and the eager fast path (recorded launches, ``kernels/_launch.py``).

CPU (Triton's interpreter): ``torch.library.opcheck`` of each op, ``torch.compile`` with
``fullgraph=True`` (no graph break) equal to eager, dynamic shapes without a recompile per
length, the errors for gradients, the per-sequence key start. GPU: replayed calls are
bit-identical to the full path after any change of shape, dtype, stride, device or variant; a
bad input after many good calls still gets its error; CUDA-graph capture of compiled decode
loops replays correctly as lengths grow.
"""

import pytest
import torch

import flashkernel
from flashkernel import interface, ops, reference
from flashkernel.kernels import _launch
from helpers import DEVICE, assert_output_close, random_qkv

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _cache_inputs(batch=2, capacity=40, kv_heads=2, heads=4, head_dim=32, dtype=torch.float16, seqlen_q=1,
                  lengths=(7, 30)):
    q = torch.randn(batch, seqlen_q, heads, head_dim, dtype=dtype, device=DEVICE)
    k_cache = torch.randn(batch, capacity, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    k = torch.randn(batch, seqlen_q, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v = torch.randn_like(k)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, k, v, seqlens


# ---- torch.library ------------------------------------------------------------------------------


def test_opcheck_fwd():
    """The last case requires grad: opcheck then checks the registered backward too."""
    q, k, v = random_qkv(1, 9, 12, 4, 2, 32, torch.float16)
    leaves = [x.detach().requires_grad_() for x in (q, k, v, torch.randn(4, device=DEVICE))]
    for args in [(q, k, v, None, None, True, 0.2, -1, -1, 0.0, True, "auto", False),
                 (q, k, v, None, torch.randn(4, device=DEVICE), False, 0.2, 3, 0, 5.0, False, "triton", True),
                 (*leaves[:3], None, leaves[3], True, 0.2, -1, -1, 0.0, True, "auto", True)]:
        torch.library.opcheck(torch.ops.flashkernel.fwd.default, args)


@pytest.mark.parametrize("packed", [False, True])
def test_op_called_without_lse_still_differentiates(packed):
    """An op called directly with ``return_lse=False`` while autograd records it: its backward
    recomputes the LSE it needs (a second forward), giving the gradients of a call that returned it."""
    if packed:
        q, k, v = (torch.randn(13, h, 32, dtype=torch.float16, device=DEVICE) for h in (4, 2, 2))
        cu = torch.tensor([0, 5, 13], dtype=torch.int32, device=DEVICE)
        call = lambda q, k, v, lse: torch.ops.flashkernel.varlen_fwd(  # noqa: E731
            q, k, v, cu, cu, 8, 8, None, None, True, 0.2, -1, -1, 0.0, lse, "auto", True)[0]
    else:
        q, k, v = random_qkv(2, 9, 12, 4, 2, 32, torch.float16)
        call = lambda q, k, v, lse: torch.ops.flashkernel.fwd(  # noqa: E731
            q, k, v, None, None, True, 0.2, -1, -1, 0.0, lse, "auto", True)[0]
    dout = torch.randn_like(q)
    grads = {}
    for lse in (True, False):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        call(*leaves, lse).backward(dout)
        grads[lse] = [x.grad for x in leaves]
    for with_lse, without in zip(grads[True], grads[False]):
        assert torch.equal(with_lse, without)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    args = (*leaves, cu, cu, 8, 8, None, None, True, 0.2, -1, -1, 0.0, False, "auto", True) if packed else (
        *leaves, None, None, True, 0.2, -1, -1, 0.0, False, "auto", True)
    torch.library.opcheck(torch.ops.flashkernel.varlen_fwd.default if packed else torch.ops.flashkernel.fwd.default,
                          args)


def test_backward_op_called_by_hand_checks_what_it_reads():
    q, k, v = random_qkv(1, 9, 12, 4, 2, 32, torch.float16)
    out, lse = torch.ops.flashkernel.fwd(q, k, v, None, None, True, 0.2, -1, -1, 0.0, True, "auto", False)
    tail = (None, None, None, None, 0, 0, True, 0.2, -1, -1, 0.0, None, False)
    dq = torch.ops.flashkernel.bwd(torch.randn_like(out), q, k, v, out, lse, *tail)[0]
    assert dq.shape == q.shape
    with pytest.raises(ValueError, match=r"lse has shape \(0,\), expected \(1, 4, 9\).*return_lse=True"):
        torch.ops.flashkernel.bwd(torch.randn_like(out), q, k, v, out, lse.new_empty(0), *tail)
    with pytest.raises(ValueError, match=r"dout has shape \(1, 9, 4, 16\), expected \(1, 9, 4, 32\)"):
        torch.ops.flashkernel.bwd(out[..., :16], q, k, v, out, lse, *tail)
    with pytest.raises(ValueError, match="lse has dtype torch.float16"):
        torch.ops.flashkernel.bwd(torch.randn_like(out), q, k, v, out, lse.half(), *tail)


def test_opcheck_varlen_fwd():
    q, k, v = (torch.randn(13, 4, 32, dtype=torch.float16, device=DEVICE) for _ in range(3))
    cu = torch.tensor([0, 5, 13], dtype=torch.int32, device=DEVICE)
    leaves = [x.detach().requires_grad_() for x in (q, k[:, :2], v[:, :2])]
    for tensors, deterministic in (((q, k[:, :2], v[:, :2]), False), (leaves, True)):
        args = (*tensors, cu, cu, 8, 8, None, None, True, 0.2, -1, -1, 0.0, True, "auto", deterministic)
        torch.library.opcheck(torch.ops.flashkernel.varlen_fwd.default, args)


def test_opcheck_kvcache_fwd_declares_its_mutation():
    q, k_cache, v_cache, k, v, seqlens = _cache_inputs()
    for new in ((k, v), (None, None)):
        args = (q, k_cache, v_cache, *new, seqlens, None, None, None, None, None, None, True, 0.2, -1, -1, 0.0, 0,
                True, "auto")
        torch.library.opcheck(torch.ops.flashkernel.kvcache_fwd.default, args)


@pytest.mark.parametrize("granularity", ["tensor", "token"])
def test_opcheck_kvcache_fwd_over_a_quantized_cache(granularity):
    """The append writes the caches and, per token, the scales: all four declared as mutated. (int8:
    opcheck's schema test multiplies the tensors, which CPU torch does not do for float8.)"""
    q, k_cache, v_cache, k, v, seqlens = _cache_inputs(capacity=24, lengths=(3, 20))
    k8, v8, k_scale, v_scale = flashkernel.quantize_kv(k_cache, v_cache, dtype=torch.int8, granularity=granularity)
    args = (q, k8, v8, k, v, seqlens, None, None, None, None, k_scale, v_scale, True, 0.2, -1, -1, 0.0, 0, True,
            "auto")
    torch.library.opcheck(torch.ops.flashkernel.kvcache_fwd.default, args)


# ---- torch.compile ------------------------------------------------------------------------------


class _Decoder(torch.nn.Module):
    """Two attention-only layers over static caches: append one token, attend."""

    def __init__(self, k_caches, v_caches):
        super().__init__()
        self.k_caches, self.v_caches = k_caches, v_caches

    def forward(self, qs, ks, vs, seqlens):
        outs = []
        for q, k, v, k_cache, v_cache in zip(qs, ks, vs, self.k_caches, self.v_caches):
            outs.append(flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens))
        return torch.stack(outs)


def test_compiled_prefill_has_no_graph_break_and_equals_eager():
    q, k, v = random_qkv(2, 9, 9, 4, 2, 32, torch.float16)

    def f(q, k, v):
        out, lse = flashkernel.flash_attn_func(q * 1.0, k, v, causal=True, return_lse=True)
        packed = flashkernel.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                                    cu, cu, 9, 9, causal=True)
        return out + 1, lse, packed

    cu = torch.tensor([0, 9, 18], dtype=torch.int32, device=DEVICE)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(q, k, v), f(q, k, v)):
        assert torch.equal(got, want)


def test_compiled_decode_appends_like_eager():
    q, k_cache, v_cache, k, v, seqlens = _cache_inputs()
    eager_caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    compiled_caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    qs, ks, vs = (torch.stack([x, x.flip(0)]) for x in (q, k, v))
    eager = _Decoder([c[0] for c in eager_caches], [c[1] for c in eager_caches])
    model = _Decoder([c[0] for c in compiled_caches], [c[1] for c in compiled_caches])
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(qs, ks, vs, seqlens), eager(qs, ks, vs, seqlens))
    for (ke, ve), (kc, vc) in zip(eager_caches, compiled_caches):
        assert torch.equal(ke, kc) and torch.equal(ve, vc)  # the in-place append happened in both


def test_compiled_decode_over_a_quantized_cache_writes_caches_and_scales():
    """The cache op's four mutations (caches and per-token scales) survive functionalization."""
    q, k_cache, v_cache, k, v, seqlens = _cache_inputs(capacity=24, lengths=(3, 20))
    state = flashkernel.quantize_kv(k_cache, v_cache, dtype=torch.int8, granularity="token")
    eager, compiled_state = [x.clone() for x in state], [x.clone() for x in state]

    def step(q, k, v, k_cache, v_cache, k_scale, v_scale):
        return flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens,
                                                   k_scale=k_scale, v_scale=v_scale)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, k, v, *compiled_state), step(q, k, v, *eager))
    for got, want in zip(compiled_state, eager):
        assert torch.equal(got, want)


def test_dynamic_lengths_compile_once():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")

    def f(q, k, v):
        return flashkernel.flash_attn_func(q, k, v, causal=True)

    compiled = torch.compile(f, backend=counter, dynamic=True, fullgraph=True)
    frames = []
    for seqlen in (5, 7, 11, 30):
        q, k, v = random_qkv(1, seqlen, seqlen, 2, 2, 32, torch.float16)
        assert torch.equal(compiled(q, k, v), f(q, k, v))
        frames.append(counter.frame_count)
    assert frames[1:] == frames[:1] * 3, frames  # compiled for the first length only


@pytest.mark.parametrize("call", ["func", "varlen", "kvcache"])
def test_compiled_calls_do_not_guard_on_the_c_look_up(call, monkeypatch):
    """A compiled call traces no read of the eager calls' C look-up (``native_quick``), so its
    appearance after the first compile (the first eager call's replay, on a GPU) recompiles nothing."""
    from torch._dynamo.testing import CompileCounterWithBackend

    q, k, v = random_qkv(1, 6, 6, 2, 2, 32, torch.float16)
    cu = torch.tensor([0, 6], dtype=torch.int32, device=q.device)
    lengths = torch.tensor([6], dtype=torch.int32, device=q.device)
    f = {"func": lambda q, k, v: flashkernel.flash_attn_func(q, k, v, causal=True),
         "varlen": lambda q, k, v: flashkernel.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 6, 6, causal=True),
         "kvcache": lambda q, k, v: flashkernel.flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=lengths)}[call]
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    monkeypatch.setattr(interface._EAGER_CALLS, "native_quick", None)
    compiled(q, k, v)
    frames = counter.frame_count
    monkeypatch.setattr(interface._EAGER_CALLS, "native_quick", lambda *args: NotImplemented)
    compiled(q, k, v)
    assert counter.frame_count == frames


# ---- autograd boundary --------------------------------------------------------------------------


def test_forward_mode_ad_is_refused_not_answered_with_a_zero_tangent():
    """The ops have no forward-mode formula; PyTorch would hand back a zero tangent (jvp) or none
    (dual tensors) without a word, so every entry point refuses an input that carries one."""
    import torch.autograd.forward_ad as forward_ad

    q, k, v = random_qkv(1, 6, 6, 4, 2, 32, torch.float16)
    qc, k_cache, v_cache, _, _, seqlens = _cache_inputs()
    cu = torch.tensor([0, 6], dtype=torch.int32, device=DEVICE)
    decode_plan = flashkernel.DecodePlan(qc, k_cache, v_cache, cache_seqlens=seqlens)
    packed = (q[0], k[0], v[0], cu, cu, 6, 6)
    varlen_plan = flashkernel.VarlenPlan(*packed)
    calls = {
        "flash_attn_func": (q, lambda x: flashkernel.flash_attn_func(x, k, v)),
        "flash_attn_varlen_func": (q[0], lambda x: flashkernel.flash_attn_varlen_func(x, *packed[1:])),
        "flash_attn_with_kvcache": (qc, lambda x: flashkernel.flash_attn_with_kvcache(x, k_cache, v_cache,
                                                                                     cache_seqlens=seqlens)),
        "standard_attention": (q, lambda x: flashkernel.standard_attention(x, k, v)),
        "DecodePlan.run": (qc, lambda x: decode_plan.run(x, k_cache, v_cache)),
        "VarlenPlan.run": (q[0], lambda x: varlen_plan.run(x, *packed[1:3])),
    }
    for name, (x, call) in calls.items():
        with pytest.raises(NotImplementedError, match=f"{name} has no forward-mode derivative"):
            torch.func.jvp(call, (x,), (torch.randn_like(x),))
        with forward_ad.dual_level():
            with pytest.raises(NotImplementedError, match=f"{name} has no forward-mode derivative"):
                call(forward_ad.make_dual(x, torch.randn_like(x)))
            assert torch.equal(call(x), call(x))  # inputs without a tangent: as outside a dual level


def test_functorch_reverse_mode_is_refused_with_a_clear_error():
    """torch.func.grad / jacrev cannot run a backward registered with torch.library (PyTorch's own
    error names its internals): the differentiable functions say so and point to torch.autograd;
    vmap, which needs no backward, still runs."""
    q, k, v = random_qkv(1, 6, 6, 4, 2, 32, torch.float16)
    cu = torch.tensor([0, 6], dtype=torch.int32, device=DEVICE)
    calls = {
        "flash_attn_func": (q, lambda x: flashkernel.flash_attn_func(x, k, v).float().sum()),
        "flash_attn_varlen_func": (q[0], lambda x: flashkernel.flash_attn_varlen_func(x, k[0], v[0], cu, cu, 6,
                                                                                     6).float().sum()),
    }
    for name, (x, call) in calls.items():
        for transform in (torch.func.grad, torch.func.jacrev):
            with pytest.raises(NotImplementedError, match=f"{name} does not support torch.func.grad / jacrev / vjp"):
                transform(call)(x)
    # Attention over data inside the transform (nothing it differentiates flows through the call) runs.
    weights = torch.randn(32, 3, device=DEVICE)
    head = lambda w: (flashkernel.flash_attn_func(q * 1, k, v).float()[0, :, 0] @ w).sum()  # noqa: E731
    features = flashkernel.flash_attn_func(q, k, v).float()[0, :, 0]
    assert torch.allclose(torch.func.grad(head)(weights), features.sum(0)[:, None].expand(32, 3))
    batched = torch.func.vmap(lambda x: flashkernel.flash_attn_func(x[None], k, v)[0])(q.expand(2, -1, -1, -1))
    assert torch.equal(batched[1], flashkernel.flash_attn_func(q, k, v)[0])


@pytest.mark.parametrize("fn", ["flash_attn_with_kvcache", "standard_attention"])
def test_gradients_are_refused_where_there_is_no_backward(fn):
    if fn == "flash_attn_with_kvcache":
        q, k_cache, v_cache, _, _, seqlens = _cache_inputs()
        q.requires_grad_(True)
        call = lambda: flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)  # noqa: E731
    else:
        q, k, v = random_qkv(1, 5, 5, 2, 2, 32, torch.float16)
        k.requires_grad_(True)
        call = lambda: flashkernel.standard_attention(q, k, v)  # noqa: E731
    with pytest.raises(RuntimeError, match="has no backward.*requires grad.*torch.no_grad"):
        call()
    with torch.no_grad():
        call()  # fine without gradients


# ---- per-sequence key start ---------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [None, 1, 16])
@pytest.mark.parametrize("append", [False, True])
def test_cache_leftpad_attends_from_each_start(page_size, append):
    lengths, starts = (9, 33, 0, 20), (3, 0, 0, 20)
    batch, heads, kv_heads, head_dim, capacity = 4, 8, 2, 32, 48
    q = torch.randn(batch, 2, heads, head_dim, dtype=torch.float16, device=DEVICE)
    k_cache = torch.randn(batch, capacity, kv_heads, head_dim, dtype=torch.float16, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    block_table = None
    if page_size is not None:
        blocks = capacity // page_size
        perm = torch.randperm(batch * blocks, device=DEVICE).to(torch.int32)
        block_table = perm.view(batch, blocks)
        pages_k = torch.empty(batch * blocks, page_size, kv_heads, head_dim, dtype=torch.float16, device=DEVICE)
        pages_v = torch.empty_like(pages_k)
        pages_k[perm.long()] = k_cache.view(batch * blocks, page_size, kv_heads, head_dim)
        pages_v[perm.long()] = v_cache.view(batch * blocks, page_size, kv_heads, head_dim)
        k_cache, v_cache = pages_k, pages_v
    new = [torch.randn(batch, 2, kv_heads, head_dim, dtype=torch.float16, device=DEVICE) for _ in range(2)] \
        if append else [None, None]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    leftpad = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    want, want_lse = reference.attention_with_kvcache(q, k_cache, v_cache, seqlens, k=new[0], v=new[1],
                                                      block_table=block_table, cache_leftpad=leftpad)
    out, lse = flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, k=new[0], v=new[1], cache_seqlens=seqlens,
                                                   block_table=block_table, cache_leftpad=leftpad, return_lse=True,
                                                   num_splits=2)
    for b in range(batch):
        length = lengths[b] + (2 if append else 0)
        if length - starts[b] == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b])) and torch.isneginf(lse[b]).all()
            continue
        keys = reference.cache_prefix(k_cache, b, length, block_table)[None, starts[b]:]
        values = reference.cache_prefix(v_cache, b, length, block_table)[None, starts[b]:]
        assert_output_close(out[b:b + 1], q[b:b + 1], keys, values, causal=True, lse=lse[b:b + 1])
    assert torch.allclose(lse[torch.isfinite(want_lse)].double(), want_lse[torch.isfinite(want_lse)], atol=1e-4)


def test_cache_leftpad_errors():
    q, k_cache, v_cache, _, _, seqlens = _cache_inputs()
    with pytest.raises(TypeError, match="cache_leftpad has dtype int64; it must be int32"):
        flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                            cache_leftpad=torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match=r"cache_leftpad must have shape \(2,\)"):
        flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                            cache_leftpad=torch.zeros(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"cache_leftpad\[1\] = 31 lies outside \[0, 30\]"):
        flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, validate=True,
                                            cache_leftpad=torch.tensor([0, 31], dtype=torch.int32, device=DEVICE))


def test_sinks_in_the_callers_dtype():
    q, k, v = random_qkv(1, 7, 9, 4, 2, 32, torch.float16)
    sinks = torch.randn(4, dtype=torch.float16, device=DEVICE)
    out = flashkernel.flash_attn_func(q, k, v, causal=True, sinks=sinks)
    assert_output_close(out, q, k, v, causal=True, sinks=sinks.float())
    with pytest.raises(TypeError, match="sinks has dtype int32"):
        flashkernel.flash_attn_func(q, k, v, sinks=torch.zeros(4, dtype=torch.int32, device=DEVICE))


# ---- the eager fast path (GPU: recorded launches replay only on CUDA) ----------------------------


def _full_path(fn, *args, **kwargs):
    """``fn`` with nothing recorded: validation, dispatch and launches every time."""
    interface._EAGER_CALLS.clear()
    result = fn(*args, **kwargs)
    interface._EAGER_CALLS.clear()
    return result


@pytest.mark.gpu
def test_replayed_calls_equal_the_full_path_gpu():
    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        for causal in (False, True):
            q, k, v = random_qkv(2, 300, 500, 8, 2, 128, dtype)
            cases.append((flashkernel.flash_attn_func, (q, k, v), dict(causal=causal, return_lse=True)))
            cases.append((flashkernel.flash_attn_func, (q, k, v), dict(causal=causal, softcap=30.0,
                                                                       window_size=(100, 0))))
            cases.append((flashkernel.flash_attn_func, (q[:, :, :, :64], k[..., :64], v[..., :64]), {}))
    cu = torch.tensor([0, 100, 333], dtype=torch.int32, device="cuda")
    qv, kv, vv = (torch.randn(333, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    cases.append((flashkernel.flash_attn_varlen_func, (qv, kv, vv, cu, cu, 233, 233), dict(causal=True)))
    for page in (None, 16):
        q, k_cache, v_cache, k, v, seqlens = _cache_inputs(4, 1024, 8, 32, 128, torch.bfloat16, 1,
                                                           (1000, 0, 17, 513))
        bt = None
        if page:
            k_cache, v_cache = (x.view(-1, page, 8, 128) for x in (k_cache, v_cache))
            bt = torch.randperm(k_cache.shape[0], device="cuda").to(torch.int32).view(4, -1)
        cases.append((flashkernel.flash_attn_with_kvcache, (q, k_cache, v_cache),
                      dict(cache_seqlens=seqlens, block_table=bt, return_lse=True)))
    for fn, args, kwargs in cases:
        want = _full_path(fn, *args, **kwargs)
        for _ in range(3):  # first call records, then replays
            got = fn(*args, **kwargs)
            for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                assert torch.equal(g, w)
        assert len(interface._EAGER_CALLS) >= 1, interface._EAGER_CALLS.last_refusal


def _tma_replay_cases():
    """Calls whose kernels take host TMA descriptors (the Gluon kernels), as (fn, make_inputs,
    kwargs): ``make_inputs()`` gives fresh tensors of one layout at new addresses."""
    cases = []
    for dtype, head_dim, causal in ((torch.bfloat16, 128, True), (torch.float16, 64, False),
                                    (torch.bfloat16, 256, False)):
        cases.append((flashkernel.flash_attn_func,
                      lambda dtype=dtype, head_dim=head_dim: random_qkv(2, 300, 500, 8, 2, head_dim, dtype),
                      dict(causal=causal, return_lse=True, backend="gluon")))

    def paged():
        q, k_cache, v_cache, _, _, seqlens = _cache_inputs(2, 1024, 8, 32, 128, torch.bfloat16, 1, (1000, 517))
        table = torch.randperm(128, device=DEVICE).to(torch.int32).view(2, 64)
        return q, k_cache.view(-1, 16, 8, 128), v_cache.view(-1, 16, 8, 128), seqlens, table

    cases.append((lambda q, k, v, seqlens, table, **kw: flashkernel.flash_attn_with_kvcache(
        q, k, v, cache_seqlens=seqlens, block_table=table, **kw), paged, dict(return_lse=True, backend="gluon")))
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(4))
def test_replays_with_tma_descriptors_go_through_the_c_launcher_bit_identical_gpu(case):
    """A replayed Gluon launch is packed for the C launcher (its descriptors encoded once, their
    addresses replaced per run) and gives the full path's results bit for bit on other tensors."""
    from flashkernel.kernels import _native

    if _native.module() is None:
        pytest.skip("the C launcher cannot be built here")
    fn, make_inputs, kwargs = _tma_replay_cases()[case]
    recorded, other = make_inputs(), make_inputs()
    try:
        want = _full_path(fn, *other, **kwargs)
    except ValueError as error:  # no Gluon kernel for this GPU
        pytest.skip(str(error))
    fn(*recorded, **kwargs)  # records
    (replay,) = [r for r in interface._EAGER_CALLS._replays.values() if r]
    assert replay.native is not None and any(template[3] for template in replay.launches)
    for _ in range(2):
        got = fn(*other, **kwargs)  # replayed at other addresses
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    assert [r for r in interface._EAGER_CALLS._replays.values() if r] == [replay]  # served, not recorded again
    interface._EAGER_CALLS.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("change", ["shape", "dtype", "stride", "variant", "alignment", "lse", "backend"])
def test_a_changed_call_is_not_served_a_stale_replay_gpu(change):
    q, k, v = random_qkv(2, 256, 256, 8, 8, 128, torch.bfloat16)
    kwargs = dict(causal=True)
    flashkernel.flash_attn_func(q, k, v, **kwargs)
    flashkernel.flash_attn_func(q, k, v, **kwargs)
    if change == "shape":
        q, k, v = random_qkv(2, 255, 256, 8, 8, 128, torch.bfloat16)
    elif change == "dtype":
        q, k, v = (x.half() for x in (q, k, v))
    elif change == "stride":
        big = torch.randn(2, 256, 8, 2, 128, dtype=torch.bfloat16, device="cuda")
        q = big[:, :, :, 0]
    elif change == "variant":
        kwargs["softcap"] = 20.0
    elif change == "alignment":  # 2-byte aligned: TMA cannot take it, Triton specializes on it
        q = torch.randn(q.numel() + 1, dtype=torch.bfloat16, device="cuda")[1:].view(q.shape)
    elif change == "lse":
        kwargs["return_lse"] = True
    elif change == "backend":
        kwargs["backend"] = "triton"
    got = flashkernel.flash_attn_func(q, k, v, **kwargs)
    got = got[0] if isinstance(got, tuple) else got
    assert_output_close(got, q, k, v, causal=True, softcap=kwargs.get("softcap", 0.0))


@pytest.mark.gpu
def test_repeated_calls_are_served_without_building_their_key_gpu(monkeypatch):
    """The recent calls answer a call of the same scalars and layouts (``CallCache.quick``) before
    its key is built; a call of another layout, or that wants a gradient, builds its own."""
    built, key = [], interface._key
    monkeypatch.setattr(interface, "_key", lambda *args: built.append(1) or key(*args))
    q, k, v = random_qkv(2, 200, 300, 8, 2, 128, torch.bfloat16)
    want = _full_path(flashkernel.flash_attn_func, q, k, v, causal=True)
    flashkernel.flash_attn_func(*random_qkv(2, 200, 300, 8, 2, 128, torch.bfloat16), causal=True)  # records
    built.clear()
    for _ in range(3):
        assert torch.equal(flashkernel.flash_attn_func(q, k, v, causal=True), want)
    assert not built
    q_grad = q.clone().requires_grad_()
    assert flashkernel.flash_attn_func(q_grad, k, v, causal=True).grad_fn is not None
    assert not built  # autograd's call goes through the op, with no key
    flashkernel.flash_attn_func(q[:, :100], k, v, causal=True)
    assert built


@pytest.mark.gpu
def test_varlen_calls_that_share_their_offsets_or_not_get_their_own_replays_gpu():
    cu = torch.tensor([0, 100, 333], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(333, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    want = _full_path(flashkernel.flash_attn_varlen_func, q, k, v, cu, cu, 233, 233, causal=True)
    for offsets in ((cu, cu), (cu, cu), (cu, cu.clone()), (cu, cu.clone()), (cu, cu), (cu.clone(), cu)):
        assert torch.equal(flashkernel.flash_attn_varlen_func(q, k, v, *offsets, 233, 233, causal=True), want)
    assert len(interface._EAGER_CALLS) == 2


@pytest.mark.gpu
def test_bad_input_after_many_good_calls_still_fails_gpu():
    q, k, v = random_qkv(1, 64, 64, 4, 4, 128, torch.bfloat16)
    for _ in range(20):
        flashkernel.flash_attn_func(q, k, v, causal=True)
    with pytest.raises(TypeError, match="causal must be a bool"):
        flashkernel.flash_attn_func(q, k, v, causal=1)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flashkernel.flash_attn_func(q, k, v, causal=True, deterministic=1)
    with pytest.raises(TypeError, match="must share one dtype"):
        flashkernel.flash_attn_func(q, k.half(), v, causal=True)
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        flashkernel.flash_attn_func(q, k, v, causal=True, softmax_scale=float("nan"))
    q1, k_cache, v_cache, _, _, seqlens = _cache_inputs(2, 64, 4, 4, 128, torch.bfloat16)
    for _ in range(20):
        flashkernel.flash_attn_with_kvcache(q1, k_cache, v_cache, cache_seqlens=seqlens)
    with pytest.raises(TypeError, match="cache_seqlens has dtype int64"):
        flashkernel.flash_attn_with_kvcache(q1, k_cache, v_cache, cache_seqlens=seqlens.long())


@pytest.mark.gpu
def test_replay_on_another_device_or_stream_gpu():
    q, k, v = random_qkv(1, 128, 128, 4, 4, 128, torch.bfloat16)
    want = _full_path(flashkernel.flash_attn_func, q, k, v)
    flashkernel.flash_attn_func(q, k, v)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        got = flashkernel.flash_attn_func(q, k, v)
    stream.synchronize()
    assert torch.equal(got, want)
    if torch.cuda.device_count() > 1:
        q2, k2, v2 = (x.to("cuda:1") for x in (q, k, v))
        assert torch.equal(flashkernel.flash_attn_func(q2, k2, v2).cpu(), want.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("capacity, lengths", [(256, (5, 100)), (2048, (700, 1500))])
def test_compiled_decode_loop_with_cuda_graphs_replays_as_lengths_grow_gpu(capacity, lengths, monkeypatch):
    """Under ``mode="reduce-overhead"``; the second case's eager warm-up steps split the keys and
    merge the splits in the decode kernel, with temporaries kept per stream, which must not come
    from the CUDA graphs' pool (Inductor's ``slow_path_cudagraph_asserts`` checks the pool after
    warm-up: with the temporaries made on the calling thread it raises "Detected 2 tensor(s) in
    the cudagraph pool not tracked as outputs")."""
    torch._dynamo.reset()
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config.triton, "slow_path_cudagraph_asserts", True)
    q, k_cache, v_cache, k, v, seqlens = _cache_inputs(2, capacity, 8, 32, 128, torch.bfloat16, 1, lengths)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    refs = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    model = _Decoder([c[0] for c in caches], [c[1] for c in caches])
    eager = _Decoder([c[0] for c in refs], [c[1] for c in refs])
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    lengths = seqlens.clone()
    for step in range(8):
        qs, ks, vs = (torch.randn(2, *x.shape, dtype=x.dtype, device="cuda") for x in (q, k, v))
        got = compiled(qs, ks, vs, lengths).clone()
        want = eager(qs, ks, vs, lengths)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
        lengths += 1
    for (kc, vc), (kr, vr) in zip(caches, refs):
        assert torch.equal(kc, kr) and torch.equal(vc, vr)


def test_fake_launch_replay_takes_integer_addresses(monkeypatch):
    """The replay passes every tensor as its address and the rest as recorded (no GPU)."""
    calls = []

    class Runner:
        num_ctas, launch_cooperative_grid, launch_pdl = 1, False, False
        global_scratch_size = profile_scratch_size = 0

        def launch(self, *args):
            calls.append(args)

    class Compiled:
        function, packed_metadata, run = "fn", "meta", Runner()

    a, b = torch.empty(8), torch.empty(8)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(_launch, "stream_capturing", lambda: False)
    with _launch.Recorder((a, b)) as rec:
        rec.spoiled = False
        out, scratch = _launch.allocate((4,), torch.float32, "cpu"), _launch.allocate((6,), torch.float32, "cpu")
    rec.add(Compiled(), (3,), (a, 7, b, 0.5, out, scratch[2:]), device=0)
    monkeypatch.setattr(_launch._native, "launch_for", lambda *a: None)
    replay = rec.finish((out, None))
    assert replay is not None
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_raw_stream", lambda device: 99)
    monkeypatch.setattr(_launch._native, "launch_for", lambda *a: None)  # Triton's launcher path
    c, d = torch.empty(8), torch.empty(8)
    out, none = replay.run((c, d))
    assert none is None
    assert out.shape == (4,) and out.dtype == torch.float32
    (args,) = calls
    assert args[:9] == (3, 1, 1, 99, "fn", False, False, None, None)
    assert args[13:17] == (c.data_ptr(), 7, d.data_ptr(), 0.5)
    assert args[17] == out.data_ptr() and args[18] % 4 == 0  # a view 8 bytes into a temporary
    replay.run((c, d), reuse_scratch=True)
    replay.run((c, d), reuse_scratch=True)
    assert calls[-1][18] == calls[-2][18]  # the temporary kept for the stream


def _fake_replay(monkeypatch, values, launcher=None):
    """A replay of one fake launch of ``values`` (tensors: a, b inputs; out allocated), on the CPU."""

    class Runner:
        num_ctas, launch_cooperative_grid, launch_pdl = 1, False, False
        global_scratch_size = profile_scratch_size = 0

        def __init__(self):
            self.calls = []

        def launch(self, *args):
            self.calls.append(args)

    class Compiled:
        function, packed_metadata, run = "fn", "meta", Runner()

    a, b = torch.empty(8), torch.empty(8)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(_launch, "stream_capturing", lambda: False)
    monkeypatch.setattr(_launch._native, "launch_for", lambda *a: None)
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_raw_stream", lambda device: 99)
    with _launch.Recorder((a, b)) as rec:
        rec.spoiled = False
        out, scratch = _launch.allocate((4,), torch.float32, "cpu"), _launch.allocate((6,), torch.float32, "cpu")
    rec.add(Compiled(), (3,), values(a, b, out, scratch), device=0, launcher=launcher)
    return rec.finish((out, None)), Compiled.run.calls


def test_a_replay_with_other_arguments_keeps_its_slots_and_temporaries(monkeypatch):
    replay, calls = _fake_replay(monkeypatch, lambda a, b, out, scratch: (a, 7, (5, 6), b, out, scratch))
    rebound = replay.with_arguments(0, {1: 9, 2: (10, 11)})
    c, d = torch.empty(8), torch.empty(8)
    rebound.run((c, d), reuse_scratch=True)
    replay.run((c, d), reuse_scratch=True)
    new, old = calls
    assert new[13:17] == (c.data_ptr(), 9, (10, 11), d.data_ptr()) and old[13:17] == (c.data_ptr(), 7, (5, 6),
                                                                                       d.data_ptr())
    assert new[18] == old[18]  # one temporary per stream, shared by the two replays
    assert replay.launches[0][1][1] == 7  # the original is unchanged


def test_a_call_cache_family_serves_other_keys_through_rebind(monkeypatch):
    replay, _ = _fake_replay(monkeypatch, lambda a, b, out, scratch: (a, 7, b, out))
    cache = _launch.CallCache()
    inputs = (torch.empty(8), torch.empty(8))
    family = ("base", "detail")
    assert cache.rebound("k2", family, inputs, lambda r: r) is None  # no family replay yet
    assert not cache.has_family("base") and not cache.has_family(["unhashable"])
    monkeypatch.setattr(_launch, "Recorder", lambda inputs: _Returning(replay))
    cache.run("k1", inputs, lambda: (None,), family=family)
    assert cache.has_family("base") and not cache.has_family("detail")
    assert cache.rebound("k2", ("base", "other detail"), inputs, lambda r: r) is None
    seen = []
    out, _ = cache.rebound("k2", family, inputs, lambda r: seen.append(r) or r.with_arguments(0, {1: 8}))
    assert seen == [replay] and out.shape == (4,)
    assert cache.get("k2").launches[0][1][1] == 8 and cache.get("k1") is replay
    assert cache.rebound("k3", family, inputs, lambda r: None) is None and cache.get("k3") is None
    cache.clear()
    assert cache.rebound("k2", family, inputs, lambda r: r) is None and not cache.has_family("base")


class _Returning:
    """A stand-in Recorder whose finish() gives a fixed replay."""

    refusal = None

    def __init__(self, replay):
        self.replay = replay

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def finish(self, outputs):
        return self.replay


def _captured_decode(monkeypatch, length, window, **kwargs):
    """Everything ``decode_forward`` hands to its launch and allocations for a ``[2, length, 2,
    32]`` contiguous cache (passed transposed): ``(decode arguments, grid and options,
    allocations)``, and the caches."""
    from flashkernel.kernels import decode

    seen = {}

    def capture(grid, *args, num_warps, num_stages=None, **named):
        names = decode._decode_kernel.arg_names
        seen["decode"] = list(args + tuple(named[name] for name in names[len(args):]))
        seen["launch"] = (grid, num_warps, num_stages, {k: v for k, v in named.items() if k not in names})

    def allocate(shape, dtype, device, zeroed=False):
        seen.setdefault("allocations", []).append((tuple(shape), dtype, zeroed))
        return torch.empty(shape, dtype=dtype, device=device)

    monkeypatch.setattr(decode, "_launch_decode", capture)
    monkeypatch.setattr(decode, "allocate", allocate)
    q = torch.randn(2, 1, 4, 32, dtype=torch.float16, device=DEVICE)
    k_cache = torch.randn(2, 2, length, 32, dtype=torch.float16, device=DEVICE).transpose(1, 2)
    v_cache = torch.randn_like(k_cache)
    decode.decode_forward(q, k_cache, v_cache, torch.tensor([7, length], dtype=torch.int32, device=DEVICE), None,
                          torch.empty_like(q), None, appended=0, causal=True, softmax_scale=0.2, window_size=window,
                          **kwargs)
    return seen, k_cache, v_cache


@pytest.mark.parametrize("window", [(-1, -1), (5, 0), (100, 0)])
@pytest.mark.parametrize("num_splits", [0, 3])
def test_only_the_length_arguments_follow_a_contiguous_caches_length(monkeypatch, window, num_splits):
    """Two lengths of one cache: ``decode.length_arguments`` is what the decode launch takes at
    ``LENGTH_ARGUMENTS``, and every other argument (the in-kernel merge's included), the grid and
    options and the allocations are the same (what a rebound replay relies on)."""
    from flashkernel.kernels import decode

    variant = decode.Variant.of(True, window, 0.0, None, None)
    q = torch.empty(2, 1, 4, 32, dtype=torch.float16, device=DEVICE)
    tuned = decode.tuning.decode_tuning(q.device if q.is_cuda else None)

    def plan(length):  # a family shares its DecodeLaunch: compare two lengths of one plan
        geometry = decode.CacheGeometry(0, length, 2)
        return decode.plan_decode(q, 2, geometry, variant, num_splits, None, tuned, 0, not q.is_cuda)

    other = next(n for n in range(90, 40, -1) if plan(n) == plan(41))
    first, k1, v1 = _captured_decode(monkeypatch, 41, window, num_splits=num_splits)
    second, k2, v2 = _captured_decode(monkeypatch, other, window, num_splits=num_splits)
    for seen, k_cache, v_cache in ((first, k1, v1), (second, k2, v2)):
        assert tuple(seen["decode"][i] for i in decode._LENGTH_INDICES) == decode.length_arguments(
            k_cache, v_cache, variant, 1)
    for seen in (first, second):
        for i in decode._LENGTH_INDICES:
            seen["decode"][i] = None
    tensors = [i for i, a in enumerate(first["decode"]) if isinstance(a, torch.Tensor)]
    for i in tensors:  # other tensors: the call's own, compared by role rather than address
        assert first["decode"][i].shape == second["decode"][i].shape or i in (1, 2)
        first["decode"][i] = second["decode"][i] = None
    assert first["decode"] == second["decode"]
    assert first["launch"] == second["launch"]
    assert first["decode"][decode._decode_kernel.arg_names.index("MERGE")] == (num_splits > 1)
    assert first.get("allocations") == second.get("allocations")


@pytest.mark.parametrize("sms", [4, 132])
def test_a_contiguous_caches_plan_depends_on_its_capacity_only_by_the_plan_span_step(monkeypatch, sms):
    """``decode.plan_span_step``: every capacity plans the launch of the capacity rounded up to a
    multiple of the step (what the length family's memo of plans relies on), over the shipped
    tuning's rules: batch, group, head dim, dtype, new tokens, windows, quantized caches,
    splits given or not, the interpreter's tile."""
    from flashkernel.kernels import decode

    monkeypatch.setattr(decode, "sm_count", lambda device, interpreted: sms)
    tuned = decode.tuning.decode_tuning(None)
    step = decode.plan_span_step(tuned)
    assert step >= 16
    cases = [(1, 32, 8, 128, torch.bfloat16, 1, (-1, 0), 0, 0, False), (8, 32, 8, 128, torch.float16, 1, (-1, 0), 0, 0, False),
             (64, 16, 8, 256, torch.bfloat16, 1, (4095, 0), 0, 0, False), (2, 8, 8, 64, torch.float32, 3, (-1, -1), 0, 0, False),
             (4, 32, 8, 128, torch.bfloat16, 1, (-1, 0), 1, 0, False), (3, 12, 4, 96, torch.float16, 5, (700, 0), 0, 3, False),
             (32, 64, 8, 128, torch.bfloat16, 1, (-1, 0), 2, 0, False), (2, 4, 2, 32, torch.float16, 1, (-1, 0), 0, 0, True)]
    for batch, heads, kv_heads, head_dim, dtype, seqlen_new, window, kv_scale, num_splits, interpreted in cases:
        q = torch.empty(batch, seqlen_new, heads, head_dim, dtype=dtype)
        variant = decode.Variant.of(True, window, 0.0, None, None)

        def plan(capacity):
            return decode.plan_decode(q, kv_heads, decode.CacheGeometry(0, capacity, batch), variant, num_splits, None,
                                      tuned, kv_scale, interpreted)

        for capacity in range(1, 9000):
            assert plan(capacity) == plan(step * -(-capacity // step)), (batch, heads, head_dim, dtype, capacity)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [{}, dict(window_size=(64, 0), softcap=30.0), dict(num_splits=3, return_lse=True),
                                     dict(causal=False, window_size=(-1, 3)), dict(alibi=True, sinks=True)])
def test_a_growing_contiguous_cache_is_served_by_rebound_replays_bit_identical_gpu(monkeypatch, variant):
    """transformers' dynamic cache: every step a new ``[B, Hkv, S, D]`` cache one key longer,
    passed transposed. Every step's first call is served by the previous length's replay with the
    length arguments rebound (counted), and equals the full path bit for bit, across the
    lengths where Triton's specialization of them and the split count change."""
    from flashkernel.kernels import decode

    rebound = []
    original = decode.rebind_lengths
    monkeypatch.setattr(decode, "rebind_lengths", lambda r, lengths: rebound.append(original(r, lengths)) or
                        rebound[-1])
    interface._EAGER_CALLS.clear()
    batch, heads, kv_heads, head_dim = 2, 32, 8, 128
    variant = dict(variant)
    if variant.pop("alibi", False):
        variant["alibi_slopes"] = torch.rand(batch, heads, device="cuda")
    if variant.pop("sinks", False):
        variant["sinks"] = torch.randn(heads, device="cuda")
    variant.setdefault("causal", True)
    lengths = list(range(40, 80)) + list(range(1000, 1040)) + [4095, 4096, 4097]
    for step, length in enumerate(lengths):
        q = torch.randn(batch, heads, 1, head_dim, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
        k_cache, v_cache = (torch.randn(batch, kv_heads, length, head_dim, dtype=torch.bfloat16,
                                        device="cuda").transpose(1, 2) for _ in range(2))
        spans = torch.tensor([[3, length, length], [0, length - 5, length]], dtype=torch.int32, device="cuda")
        kwargs = dict(cache_seqlens=spans[:, 2], cache_leftpad=spans[:, 0], **variant)
        want = flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, validate=True, **kwargs)  # no replay
        for _ in range(2):  # the step's first call (rebound or recorded), then a replay of its key
            got = flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
            for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                assert torch.equal(g, w), (length, variant)
    served = sum(r is not None for r in rebound)
    assert served >= len(lengths) * 3 // 4, (served, len(lengths))


@pytest.mark.gpu
def test_replays_of_one_length_family_called_in_any_order_launch_their_own_lengths_gpu():
    """Rebound replays share the recorded launches' packed parameters (``Replay.with_arguments``),
    and each run writes its own: lengths called again in any order, after the family's other
    lengths ran, equal the full path bit for bit."""
    interface._EAGER_CALLS.clear()
    batch, heads, kv_heads, head_dim = 2, 16, 4, 64
    lengths = list(range(100, 108))
    for length in lengths + lengths[::-1] + [103, 100, 107, 101, 106, 100]:
        q = torch.randn(batch, heads, 1, head_dim, dtype=torch.float16, device="cuda").transpose(1, 2)
        k_cache, v_cache = (torch.randn(batch, kv_heads, length, head_dim, dtype=torch.float16,
                                        device="cuda").transpose(1, 2) for _ in range(2))
        seqlens = torch.tensor([length, length - 7], dtype=torch.int32, device="cuda")
        want = flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, validate=True)
        got = flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
        assert torch.equal(got, want), length
    replays = [r for r in interface._EAGER_CALLS._replays.values() if r]
    assert len(replays) == len(lengths) and len({id(r.native) for r in replays}) < len(replays)  # shared launches
    interface._EAGER_CALLS.clear()


@pytest.mark.parametrize("rank", [0, 3])
def test_a_cache_of_another_rank_gets_its_error_on_the_eager_path(monkeypatch, rank):
    """The eager path keys the call (and its length family) before validation: a cache that is
    not rank 4 still gets validation's ValueError."""
    monkeypatch.setattr(interface, "_eager", lambda tensors: True)
    q, k_cache, v_cache, _, _, seqlens = _cache_inputs()
    bad = k_cache.reshape(-1)[0] if rank == 0 else k_cache[0]
    with pytest.raises(ValueError, match="must have 4 dimensions"):
        flashkernel.flash_attn_with_kvcache(q, bad, v_cache, cache_seqlens=seqlens)


@pytest.mark.gpu
def test_a_length_family_call_still_gets_the_errors_its_lengths_and_strides_cause_gpu(monkeypatch):
    """Once a call over a contiguous cache is recorded, calls differing from it only in the
    caches' lengths and strides skip the full validation (counted) but not the checks that read
    those: caches of two lengths and a strided head dim are errors before any launch, and the
    next valid length is served and equals the full path."""
    interface._EAGER_CALLS.clear()
    validated = []
    original = interface._validate_kvcache
    monkeypatch.setattr(interface, "_validate_kvcache", lambda *a, **k: validated.append(1) or original(*a, **k))
    batch, heads, kv_heads, head_dim = 2, 8, 2, 64

    def cache(length, step=1):
        full = torch.randn(batch, kv_heads, length, head_dim * step, dtype=torch.float16, device="cuda")
        return full[..., ::step].transpose(1, 2)

    q = torch.randn(batch, 1, heads, head_dim, dtype=torch.float16, device="cuda")
    seqlens = torch.tensor([90, 97], dtype=torch.int32, device="cuda")
    for length in (100, 101):  # recorded, then served by its family
        flashkernel.flash_attn_with_kvcache(q, cache(length), cache(length), cache_seqlens=seqlens)
    validations = len(validated)  # 1 when the second length plans the same launch
    with pytest.raises(ValueError, match="same shape"):
        flashkernel.flash_attn_with_kvcache(q, cache(102), cache(103), cache_seqlens=seqlens)
    with pytest.raises(ValueError, match="stride 2 in its last"):
        flashkernel.flash_attn_with_kvcache(q, cache(104, step=2), cache(104, step=2), cache_seqlens=seqlens)
    assert len(validated) == validations  # the errors came from the family's own checks
    k_cache, v_cache = cache(105), cache(105)
    got = flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    want = flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, validate=True)
    assert torch.equal(got, want)


# ---- plans ------------------------------------------------------------------------------------


def test_decode_plan_runs_each_layer_like_the_function():
    layers = [_cache_inputs(lengths=(7, 30)) for _ in range(3)]
    seqlens = layers[0][5]
    q0, kc0, vc0, k0, v0, _ = layers[0]
    plan = flashkernel.DecodePlan(q0, kc0, vc0, k=k0, v=v0, cache_seqlens=seqlens, return_lse=True, validate=True)
    for q, k_cache, v_cache, k, v, _ in layers:
        k_copy, v_copy = k_cache.clone(), v_cache.clone()
        out, lse = plan.run(q, k_cache, v_cache, k=k, v=v)
        want, want_lse = flashkernel.flash_attn_with_kvcache(q, k_copy, v_copy, k=k, v=v, cache_seqlens=seqlens,
                                                             return_lse=True)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        assert torch.equal(k_cache, k_copy) and torch.equal(v_cache, v_copy)


def test_plan_runs_write_the_callers_output():
    """``out=``: the same values written into the caller's tensor (contiguous, or a strided view
    that the full path fills), which is returned; nothing else of it or of the inputs changes."""
    layers = [_cache_inputs(lengths=(7, 30)) for _ in range(3)]
    q0, kc0, vc0, _, _, seqlens = layers[0]
    plan = flashkernel.DecodePlan(q0, kc0, vc0, cache_seqlens=seqlens, return_lse=True)
    for q, k_cache, v_cache, _, _, _ in layers + layers:
        want, want_lse = flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                             return_lse=True)
        out = torch.full_like(q, float("nan"))
        got, lse = plan.run(q, k_cache, v_cache, out=out)
        assert got is out and torch.equal(out, want) and torch.equal(lse, want_lse)
        wide = torch.full((*q.shape[:-1], 2 * q.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
        got, _ = plan.run(q, k_cache, v_cache, out=wide[..., 1::2])
        assert torch.equal(got, want) and wide[..., ::2].isnan().all()
    cu = torch.tensor([0, 5, 19], dtype=torch.int32, device=DEVICE)
    q, k, v = (torch.randn(19, h, 32, dtype=torch.float16, device=DEVICE) for h in (4, 2, 2))
    plan = flashkernel.VarlenPlan(q, k, v, cu, cu, 14, 14, causal=True)
    out = torch.empty_like(q)
    assert plan.run(q, k, v, out=out) is out
    assert torch.equal(out, flashkernel.flash_attn_varlen_func(q, k, v, cu, cu, 14, 14, causal=True))


def test_plan_runs_refuse_a_bad_output():
    """Each bad ``out`` gets its error, also after a good one (from which the run's quick check
    of the output is made on the GPU)."""
    q, k_cache, v_cache, _, _, seqlens = _cache_inputs(lengths=(7, 30))
    plan = flashkernel.DecodePlan(q, k_cache, v_cache, cache_seqlens=seqlens)
    plan.run(q, k_cache, v_cache, out=torch.empty_like(q))
    with pytest.raises(TypeError, match="out must be a torch.Tensor or None, got list"):
        plan.run(q, k_cache, v_cache, out=[])
    with pytest.raises(ValueError, match=r"out has shape \(2, 1, 4, 32\), dtype torch.float32.*dtype torch.float16"):
        plan.run(q, k_cache, v_cache, out=torch.empty(q.shape, device=DEVICE))
    with pytest.raises(ValueError, match="out has shape"):
        plan.run(q, k_cache, v_cache, out=torch.empty_like(q)[:1])
    with pytest.raises(ValueError, match="out overlaps k_cache"):
        plan.run(q, k_cache, v_cache, out=k_cache.view(-1)[64:64 + q.numel()].view(q.shape))
    with pytest.raises(ValueError, match="out overlaps q"):
        plan.run(q, k_cache, v_cache, out=q)
    with pytest.raises(ValueError, match="several of its elements share an address"):
        plan.run(q, k_cache, v_cache, out=torch.empty(q.shape[-1], dtype=q.dtype, device=DEVICE).expand(q.shape))
    with pytest.raises(ValueError, match="out requires grad"):
        plan.run(q, k_cache, v_cache, out=torch.empty_like(q, requires_grad=True))
    pool = torch.zeros(q.numel(), dtype=torch.float16, device=DEVICE)  # lengths and out in one buffer
    lengths = pool[:4].view(torch.int32)
    lengths.copy_(seqlens)
    kept = flashkernel.DecodePlan(q, k_cache, v_cache, cache_seqlens=lengths)
    kept.run(q, k_cache, v_cache, out=torch.empty_like(q))
    with pytest.raises(ValueError, match="out overlaps cache_seqlens"):
        kept.run(q, k_cache, v_cache, out=pool.view(q.shape))
    assert torch.equal(lengths, seqlens)
    beside = torch.randn(2 * q.numel(), dtype=q.dtype, device=DEVICE)  # one storage, disjoint halves
    q_half, out_half = beside[:q.numel()].view(q.shape), beside[q.numel():].view(q.shape)
    assert torch.equal(plan.run(q_half, k_cache, v_cache, out=out_half),
                       flashkernel.flash_attn_with_kvcache(q_half, k_cache, v_cache, cache_seqlens=seqlens))


def test_plans_refuse_other_layouts_and_grads():
    q, k_cache, v_cache, _, _, seqlens = _cache_inputs()
    plan = flashkernel.DecodePlan(q, k_cache, v_cache, cache_seqlens=seqlens)
    with pytest.raises(ValueError, match=r"k_cache has shape \(2, 41, 2, 32\).*plan was made for shape \(2, 40, 2, 32\)"):
        plan.run(q, torch.randn(2, 41, 2, 32, dtype=torch.float16, device=DEVICE), v_cache)
    with pytest.raises(ValueError, match="k was not given when the plan was made"):
        plan.run(q, k_cache, v_cache, k=q[:, :, :2], v=q[:, :, :2])
    for name in ("q", "k_cache", "v_cache"):  # every tensor of a run, as flash_attn_with_kvcache checks them
        inputs = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
        inputs[name] = inputs[name].clone().requires_grad_(True)
        with pytest.raises(RuntimeError, match=f"DecodePlan.run has no backward, and {name} requires grad"):
            plan.run(**inputs)
    sinks = torch.randn(4, device=DEVICE, requires_grad=True)
    with pytest.raises(RuntimeError, match="DecodePlan has no backward, and sinks requires grad"):
        flashkernel.DecodePlan(q, k_cache, v_cache, cache_seqlens=seqlens, sinks=sinks)
    with torch.no_grad():
        planned = flashkernel.DecodePlan(q, k_cache, v_cache, cache_seqlens=seqlens, sinks=sinks)
        planned.run(q, k_cache, v_cache)
    with pytest.raises(RuntimeError, match="DecodePlan.run has no backward, and sinks requires grad"):
        planned.run(q, k_cache, v_cache)
    empty = flashkernel.DecodePlan(q[:0], k_cache[:0], v_cache[:0], cache_seqlens=seqlens[:0])
    with pytest.raises(RuntimeError, match="DecodePlan.run has no backward, and q requires grad"):
        empty.run(q[:0].clone().requires_grad_(True), k_cache[:0], v_cache[:0])
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(TypeError, match="v_cache must be a torch.Tensor"):
            plan.run(q, k_cache, v_cache.tolist())
        with torch.set_grad_enabled(grad), pytest.raises(TypeError, match="q must be a torch.Tensor"):
            plan.run(q.tolist(), k_cache, v_cache)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 41"):
        flashkernel.DecodePlan(q, k_cache, v_cache, cache_seqlens=seqlens + 11, validate=True)


def test_varlen_plan_runs_each_layer_like_the_function():
    cu = torch.tensor([0, 5, 5, 19], dtype=torch.int32, device=DEVICE)
    layers = [tuple(torch.randn(19, h, 32, dtype=torch.float16, device=DEVICE) for h in (4, 2, 2)) for _ in range(2)]
    plan = flashkernel.VarlenPlan(*layers[0], cu, cu, 14, 14, causal=True, softcap=20.0)
    for q, k, v in layers:
        want = flashkernel.flash_attn_varlen_func(q, k, v, cu, cu, 14, 14, causal=True, softcap=20.0)
        assert torch.equal(plan.run(q, k, v), want)
    with pytest.raises(ValueError, match="make a new plan"):
        plan.run(layers[0][0][:18], layers[0][1], layers[0][2])
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(TypeError, match="k must be a torch.Tensor"):
            plan.run(layers[0][0], layers[0][1].tolist(), layers[0][2])


def test_varlen_plan_refuses_gradients_the_function_would_take():
    """The function records a backward; a plan's run has none, so it refuses rather than return
    an output without ``grad_fn``."""
    cu = torch.tensor([0, 5, 5, 19], dtype=torch.int32, device=DEVICE)
    q, k, v = (torch.randn(19, h, 32, dtype=torch.float16, device=DEVICE) for h in (4, 2, 2))
    plan = flashkernel.VarlenPlan(q, k, v, cu, cu, 14, 14, causal=True)
    plan.run(q, k, v)
    for name in ("q", "k", "v"):
        inputs = {"q": q, "k": k, "v": v}
        inputs[name] = inputs[name].clone().requires_grad_(True)
        with pytest.raises(RuntimeError, match=f"VarlenPlan.run has no backward, and {name} requires grad.*"
                                               "flash_attn_varlen_func"):
            plan.run(**inputs)
        with torch.no_grad():
            plan.run(**inputs)
    sinks = torch.randn(4, device=DEVICE, requires_grad=True)
    with pytest.raises(RuntimeError, match="VarlenPlan has no backward, and sinks requires grad"):
        flashkernel.VarlenPlan(q, k, v, cu, cu, 14, 14, sinks=sinks)
    with torch.no_grad():  # made without gradients, its runs with them are refused still
        planned = flashkernel.VarlenPlan(q, k, v, cu, cu, 14, 14, sinks=sinks)
        planned.run(q, k, v)
    with pytest.raises(RuntimeError, match="VarlenPlan.run has no backward, and sinks requires grad"):
        planned.run(q, k, v)
    empty = flashkernel.VarlenPlan(q[:0], k[:0], v[:0], cu[:1], cu[:1], 0, 0)
    with pytest.raises(RuntimeError, match="VarlenPlan.run has no backward"):
        empty.run(q[:0].clone().requires_grad_(True), k[:0], v[:0])


@pytest.mark.gpu
def test_decode_plan_replays_bit_identical_gpu():
    for page in (None, 16):
        layers = [_cache_inputs(8, 1024, 8, 32, 128, torch.bfloat16, 1, (1000, 0, 17, 513, 3, 64, 65, 999))
                  for _ in range(4)]
        seqlens = layers[0][5]
        bt = None
        if page:
            layers = [(q, kc.view(-1, page, 8, 128), vc.view(-1, page, 8, 128), k, v, s)
                      for q, kc, vc, k, v, s in layers]
            bt = torch.randperm(layers[0][1].shape[0], device="cuda").to(torch.int32).view(8, -1)
        q0, kc0, vc0, k0, v0, _ = layers[0]
        plan = flashkernel.DecodePlan(q0, kc0, vc0, k=k0, v=v0, cache_seqlens=seqlens, block_table=bt)
        for q, k_cache, v_cache, k, v, _ in layers + layers:
            kc, vc = k_cache.clone(), v_cache.clone()
            want = _full_path(flashkernel.flash_attn_with_kvcache, q, kc, vc, k=k, v=v, cache_seqlens=seqlens,
                              block_table=bt)
            out = torch.full_like(q, float("nan"))
            assert torch.equal(plan.run(q, k_cache, v_cache, k=k, v=v, out=out), want)
            assert torch.equal(out, want) and torch.equal(k_cache, kc) and torch.equal(v_cache, vc)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_replays_allocate_through_the_direct_allocator_as_the_full_path_would_gpu(monkeypatch, num_splits):
    """Outputs not poisoned (as users run): replays allocate their outputs and temporaries through
    PyTorch's direct CUDA allocator, and return what the full path returns, in the same layout."""
    monkeypatch.setattr(_launch, "empty", _launch._default_empty)
    direct, shapes = _launch._empty_strided_cuda, []
    monkeypatch.setattr(_launch, "_empty_strided_cuda", lambda *args: shapes.append(args[0]) or direct(*args))
    q, k_cache, v_cache, _, _, seqlens = _cache_inputs(8, 1024, 8, 32, 128, torch.bfloat16, 1,
                                                       (1000, 0, 17, 513, 3, 64, 65, 999))
    args = dict(cache_seqlens=seqlens, num_splits=num_splits, return_lse=True)
    want = _full_path(flashkernel.flash_attn_with_kvcache, q, k_cache, v_cache, **args)
    plan = flashkernel.DecodePlan(q, k_cache, v_cache, **args)
    for got in (flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, **args),  # recorded
                flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, **args),  # replayed
                plan.run(q, k_cache, v_cache), plan.run(q, k_cache, v_cache)):
        for x, y in zip(got, want):
            assert (x.shape, x.stride(), x.dtype, x.device) == (y.shape, y.stride(), y.dtype, y.device)
            assert torch.equal(x, y)
    assert tuple(q.shape) in shapes


@pytest.mark.gpu
@pytest.mark.parametrize("plan_mode", ["normal", "inference"])
def test_plan_runs_and_repeated_calls_take_the_quick_path_in_either_inference_mode_gpu(monkeypatch, plan_mode):
    """After a run in each inference mode, planned runs (and ``out=``) are served by the guards'
    path (``_Plan._replayed``) without the layout comparison of ``_Plan._run``, whichever mode the
    plan was made in; repeated eager calls likewise without building their key."""
    from flashkernel import plans

    slow, run = [], plans._Plan._run
    monkeypatch.setattr(plans._Plan, "_run", lambda self, *args, **kwargs: slow.append(1) or run(self, *args, **kwargs))
    built, key = [], interface._key
    monkeypatch.setattr(interface, "_key", lambda *args: built.append(1) or key(*args))
    assert _launch._native.module() is not None and _launch._native.checking_module() is not None
    in_python, replay_run = [], _launch.Replay.run  # a replay's runs outside the C launcher's checked calls
    monkeypatch.setattr(_launch.Replay, "run",
                        lambda *args, **kwargs: in_python.append(1) or replay_run(*args, **kwargs))
    native, answered = _launch._native.checking_module(), []

    class CountingRuns:  # the C launcher, counting the planned runs it answers in one call
        def __getattr__(self, name):
            return getattr(native, name)

        def plan_run(self, *args):
            results = native.plan_run(*args)
            answered.extend([1] if results is not None and results is not NotImplemented else [])
            return results

    counting = CountingRuns()
    monkeypatch.setattr(_launch._native, "checking_module", lambda: counting)
    layers = [_cache_inputs(8, 1024, 8, 32, 128, torch.bfloat16, 1, (1000, 0, 17, 513, 3, 64, 65, 999))
              for _ in range(3)]
    q0, kc0, vc0, _, _, seqlens = layers[0]
    with torch.inference_mode(plan_mode == "inference"):
        plan = flashkernel.DecodePlan(q0, kc0, vc0, cache_seqlens=seqlens)
    for mode in (False, True, False, True):
        with torch.inference_mode(mode):
            for q, k_cache, v_cache, _, _, _ in layers:
                want = _full_path(flashkernel.flash_attn_with_kvcache, q, k_cache, v_cache, cache_seqlens=seqlens)
                slow.clear()
                built.clear()
                in_python.clear()
                answered.clear()
                for _ in range(2):
                    assert torch.equal(plan.run(q, k_cache, v_cache), want)
                    out = torch.full_like(q, float("nan"))
                    assert plan.run(q, k_cache, v_cache, out=out) is out and torch.equal(out, want)
                    assert torch.equal(flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens),
                                       want)
            assert not slow and len(built) <= 1  # the last layer's calls: all quick
            # plan.run, with out= too: one C call each; the quick eager calls: checked runs in C
            assert len(answered) == 4 and not in_python


@pytest.mark.gpu
def test_a_replay_keeps_no_tensor_of_its_calls_alive_gpu():
    import gc
    import weakref

    q, k_cache, v_cache, _, _, seqlens = _cache_inputs(1, 1024, 8, 32, 128, torch.bfloat16, 1, (1000,))
    out = flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)  # records
    refs = [weakref.ref(x) for x in (out, k_cache, q)]
    assert len(interface._EAGER_CALLS) == 1
    del out, k_cache, q
    gc.collect()
    assert all(ref() is None for ref in refs)


def _gluon_decode_calls(monkeypatch, q, k_cache, v_cache) -> list:
    """A list that gets an entry per call of the Gluon decode kernel (skips without one)."""
    from flashkernel.kernels import dispatch

    gluon = dispatch._gluon_decode_module()
    if gluon is None or dispatch.decode_refusal("gluon", q, k_cache, v_cache, None,
                                                dispatch.Variant.of(True)) is not None:
        pytest.skip("no Gluon decode kernel on this GPU")
    calls = []
    attend = gluon.attend
    monkeypatch.setattr(gluon, "attend", lambda *a, **kw: (calls.append(1), attend(*a, **kw))[1])
    return calls


def _replayed_capture(step) -> torch.Tensor:
    """The output of ``step()`` captured in a CUDA graph (after a warm-up call) and replayed."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()
        with torch.cuda.graph(graph, stream=stream):
            out = step()
    graph.replay()
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("capacity, gluon_wanted", [(1024, False), (8192, True)])
def test_appending_paged_steps_under_capture_take_gluon_only_past_the_append_rule_gpu(monkeypatch, capacity,
                                                                                       gluon_wanted):
    """Batch 1 appending under capture: the Triton kernel (its fused append) below 4096 keys of
    batch x capacity, the Gluon kernel (and its separate append) from there; both equal the
    eager step."""
    q, k_cache, v_cache, k, v, seqlens = _cache_inputs(1, capacity, 8, 32, 128, torch.bfloat16, 1, (capacity - 24,))
    calls = _gluon_decode_calls(monkeypatch, q, k_cache, v_cache)
    pages = k_cache.view(-1, 16, 8, 128), v_cache.view(-1, 16, 8, 128)
    table = torch.arange(capacity // 16, dtype=torch.int32, device="cuda").view(1, -1)
    step = lambda: flashkernel.flash_attn_with_kvcache(q, *pages, k=k, v=v, cache_seqlens=seqlens,  # noqa: E731
                                                       block_table=table)
    eager = step()
    out = _replayed_capture(step)
    assert bool(calls) == gluon_wanted
    assert torch.allclose(out.float(), eager.float(), atol=2e-2)


@pytest.mark.gpu
def test_paged_decode_takes_gluon_only_under_graph_capture_gpu(monkeypatch):
    q, k_cache, v_cache, _, _, seqlens = _cache_inputs(1, 1024, 8, 32, 128, torch.bfloat16, 1, (1000,))
    calls = _gluon_decode_calls(monkeypatch, q, k_cache, v_cache)
    pages = k_cache.view(-1, 16, 8, 128), v_cache.view(-1, 16, 8, 128)
    table = torch.arange(64, dtype=torch.int32, device="cuda").view(1, 64)
    step = lambda: flashkernel.flash_attn_with_kvcache(q, *pages, cache_seqlens=seqlens, block_table=table)  # noqa: E731
    eager = step()
    assert calls == []  # eager: the Triton kernel
    out = _replayed_capture(step)
    assert calls and torch.allclose(out.float(), eager.float(), atol=2e-2)


@pytest.mark.parametrize("public", ["with_kvcache", "func", "varlen"])
def test_an_argument_that_is_not_a_tensor_gets_its_error_on_the_eager_path_under_no_grad(monkeypatch, public):
    """Without grad mode the eager path does not look at each argument's type before keying the
    call: an argument that is not a tensor still gets validation's TypeError (it raised an
    AttributeError from the key once)."""
    monkeypatch.setattr(interface, "_eager", lambda tensors: True)
    q, k_cache, v_cache, _, _, seqlens = _cache_inputs()
    name = "k_cache" if public == "with_kvcache" else "k"
    with torch.no_grad(), pytest.raises(TypeError, match=f"^{name} must be a torch.Tensor"):
        if public == "with_kvcache":
            flashkernel.flash_attn_with_kvcache(q, k_cache.tolist(), v_cache, cache_seqlens=seqlens)
        elif public == "func":
            flashkernel.flash_attn_func(q, k_cache.tolist(), v_cache)
        else:
            cu = torch.tensor([0, q.shape[1]], dtype=torch.int32)
            flashkernel.flash_attn_varlen_func(q[0], k_cache[0].tolist(), v_cache[0], cu, cu, q.shape[1], q.shape[1])


@pytest.mark.gpu
def test_repeated_op_calls_are_served_by_their_guard_gpu(monkeypatch):
    """The registered cache op called again with the same scalars and layouts (as a compiled
    model's layers call it) is served by a recent call's guard, without building its key, with
    the full path's results bit for bit. Another layout or scalar is no stale replay."""
    ops._OP_CALLS.clear()
    args = {}
    for split in (1, 4):  # one launch; a split step (merged in the kernel: zeroed counters)
        q, k_cache, v_cache, k, v, seqlens = _cache_inputs(2, 256, 2, 8, 64, torch.float16, 1, (100, 200))
        args[split] = (q, k_cache, v_cache, k, v, seqlens, None, None, None, None, None, None, True, 0.125, -1, -1,
                       0.0, split, True, "auto")
        want = torch.ops.flashkernel.kvcache_fwd(*args[split])  # the full path, recorded
        built = []
        monkeypatch.setattr(ops, "layouts", lambda tensors: built.append(1) or _launch.layouts(tensors))
        for _ in range(3):
            got = torch.ops.flashkernel.kvcache_fwd(*args[split])
            assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert not built  # every repeat found by its guard
        monkeypatch.undo()
    q, k_cache, v_cache, k, v, seqlens, *rest = args[4]
    for changed in ((q[:, :, :4], k_cache[:, :, :1], v_cache[:, :, :1], k[:, :, :1], v[:, :, :1], seqlens, *rest),
                    (q, k_cache, v_cache, k, v, seqlens, *rest[:7], 0.5, *rest[8:])):  # softmax_scale 0.5
        want = ops.kvcache_fwd_impl(*changed)  # validated inputs: the implementation, nothing recorded
        assert all(torch.equal(g, w) for g, w in zip(torch.ops.flashkernel.kvcache_fwd(*changed), want))


def test_only_the_cache_ops_replays_keep_temporaries(monkeypatch):
    """``ops._cached`` asks ``CallCache.quick`` (and a replay found by key) to keep temporaries
    per stream for the cache op only: its are small (split-KV partials, merge counters) and paid
    per layer otherwise; the backward's are large (float32 dQ accumulators)."""
    asked = []

    class Calls:
        def quick(self, probe, tensors, capturing, reuse_scratch=True):
            asked.append((probe[0], reuse_scratch))
            return ("replayed",)

    monkeypatch.setattr(ops, "_OP_CALLS", Calls())
    monkeypatch.setattr(ops, "stream_capturing", lambda: False)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    for name in ("kvcache_fwd", "bwd", "fwd", "varlen_fwd"):
        assert ops._cached(name, (torch.empty(2),), (True, 0.5), lambda: None) == ("replayed",)
    assert asked == [("kvcache_fwd", True), ("bwd", False), ("fwd", False), ("varlen_fwd", False)]


@pytest.mark.gpu
def test_op_calls_under_a_memory_pool_keep_their_temporaries_outside_it_gpu():
    """Cache op calls made while the calling thread's allocations go to a private pool (as while
    ``torch.compile``'s CUDA graphs warm up) keep their replays' temporaries per stream, as eager
    calls do, but made outside the pool (``_launch.allocated_off_thread``); the merge counters of a
    split step merged in the kernel are left at zero, and results equal the unrecorded
    implementation's bit for bit on both streams."""
    ops._OP_CALLS.clear()
    q, k_cache, v_cache, _, _, seqlens = _cache_inputs(2, 256, 2, 8, 64, torch.float16, 1, (100, 200))
    args = (q, k_cache, v_cache, None, None, seqlens, None, None, None, None, None, None, True, 0.125, -1, -1,
            0.0, 4, True, "auto")
    want = ops.kvcache_fwd_impl(*args)  # nothing recorded
    pool, side = torch.cuda.MemPool(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.use_mem_pool(pool):
        for stream in (torch.cuda.current_stream(), side):
            with torch.cuda.stream(stream):
                for _ in range(3):
                    got = torch.ops.flashkernel.kvcache_fwd(*args)
                    assert all(torch.equal(g, w) for g, w in zip(got, want))
    torch.cuda.synchronize()
    del got
    kept = [kept for replay in ops._OP_CALLS._replays.values() for kept in replay._scratch_by_stream.values()]
    assert len(kept) == 2  # one replay, its temporaries on each stream
    segments = [(s["address"], s["total_size"]) for s in pool.snapshot() if s["total_size"]]
    assert segments  # the outputs did come from the pool
    temporaries = [t for buffers in kept for t in buffers if t is not None]
    assert any(t.dtype == torch.int32 for t in temporaries)  # the merge's counters
    for t in temporaries:
        assert not any(start <= t.data_ptr() < start + size for start, size in segments)
        assert t.dtype != torch.int32 or not t.any()
    # Each stream's temporaries come from blocks of that stream (made as if on it).
    stream_of = [(s["address"], s["total_size"], s["stream"]) for s in torch.cuda.memory_snapshot()]
    by_stream = {replay_stream: buffers for replay in ops._OP_CALLS._replays.values()
                 for replay_stream, buffers in replay._scratch_by_stream.items()}
    assert set(by_stream) == {torch.cuda.current_stream().cuda_stream, side.cuda_stream}
    for stream, buffers in by_stream.items():
        for t in buffers:
            if t is not None:
                assert [s for start, size, s in stream_of if start <= t.data_ptr() < start + size] == [stream]


@pytest.mark.gpu
def test_backward_op_replays_keep_no_temporaries_gpu():
    """The registered backward's replays allocate their temporaries per call (float32 dQ
    accumulators among them: kept per shape, they would hold memory a training run with many
    lengths never gets back); results of repeated backwards are equal."""
    ops._OP_CALLS.clear()
    q, k, v = (x.requires_grad_() for x in random_qkv(2, 256, 256, 8, 2, 64, torch.bfloat16))
    grads = []
    for _ in range(3):
        out = flashkernel.flash_attn_func(q, k, v, causal=True)
        grads.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    assert all(torch.equal(a, b) for g in grads[1:] for a, b in zip(g, grads[0]))
    backward = [replay for key, replay in ops._OP_CALLS._replays.items() if key[0] == "bwd" and replay]
    assert backward and all(replay._scratch_by_stream == {} for replay in backward)
