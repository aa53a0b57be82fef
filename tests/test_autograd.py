"""Autograd through the public functions: ``loss.backward()`` reaches q, k, v and the sinks
through the op layer's registered backward (``ops.py``), equal to calling the backward kernels
directly, and ``torch.compile`` traces a training step with no graph break. ``deterministic=True``
reaches the backward's dispatch, and its gradients repeat bit for bit."""

import pytest
import torch

import flashkernel
from flashkernel import reference
from helpers import DEVICE

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _leaves(*shapes, dtype=torch.float32):
    return [torch.randn(*s, dtype=dtype, device=DEVICE, requires_grad=True) for s in shapes]


def _check_grads(got, want, tol):
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert g is not None, f"{name} got no gradient"
        assert not torch.isnan(g).any(), name
        err = (g.double() - w).abs().max().item()
        assert err <= tol * max(1.0, w.abs().max().item()), f"{name}: max error {err:.3e}"


@pytest.mark.parametrize("kwargs", [dict(causal=True), dict(window_size=(5, 2), softcap=10.0), dict(causal=True)],
                         ids=["causal", "window+softcap", "causal-lse"])
def test_backward_matches_float64_autograd(kwargs, request):
    q, k, v = _leaves((2, 13, 4, 32), (2, 17, 2, 32), (2, 17, 2, 32))
    sinks = torch.randn(4, device=DEVICE, requires_grad=True)
    use_lse = request.node.callspec.id == "causal-lse"
    out, lse = flashkernel.flash_attn_func(q, k, v, sinks=sinks, return_lse=True, **kwargs)
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    loss = (out * grad_out).sum() + ((lse * grad_lse).sum() if use_lse else 0)
    got = torch.autograd.grad(loss, (q, k, v, sinks))
    ref = [x.detach().double().requires_grad_(True) for x in (q, k, v, sinks)]
    ref_out, ref_lse = reference.attention(*ref[:3], sinks=ref[3], **kwargs)
    ref_loss = (ref_out * grad_out.double()).sum() + ((ref_lse * grad_lse.double()).sum() if use_lse else 0)
    want = torch.autograd.grad(ref_loss, ref)
    _check_grads(got, want, 2e-4)


def test_varlen_backward_matches_float64_autograd():
    cu = torch.tensor([0, 6, 6, 19], dtype=torch.int32, device=DEVICE)
    q, k, v = _leaves((19, 4, 32), (19, 2, 32), (19, 2, 32))
    out = flashkernel.flash_attn_varlen_func(q, k, v, cu, cu, 13, 13, causal=True)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad((out * grad_out).sum(), (q, k, v))
    ref = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    ref_out, _ = reference.attention_varlen(*ref, cu, cu, causal=True)
    want = torch.autograd.grad((ref_out * grad_out.double()).sum(), ref)
    _check_grads(got, want, 2e-4)


@pytest.mark.parametrize("shapes", [((2, 8, 4, 16), (2, 0, 2, 16)), ((2, 0, 4, 16), (2, 9, 2, 16)),
                                    ((0, 8, 4, 16), (0, 9, 2, 16))], ids=["no keys", "no queries", "no batch"])
def test_calls_with_nothing_to_compute_are_differentiable(shapes):
    """Shapes that launch nothing still give an output autograd recorded: zero gradients for q,
    k and v, and the LSE's gradient for the sinks (every row's LSE is its head's sink)."""
    q_shape, kv_shape = shapes
    q, k, v = _leaves(q_shape, kv_shape, kv_shape)
    sinks = torch.randn(4, device=DEVICE, requires_grad=True)
    out, lse = flashkernel.flash_attn_func(q, k, v, sinks=sinks, return_lse=True)
    assert out.requires_grad and not out.isnan().any()
    grad_lse = torch.randn_like(lse)
    grads = torch.autograd.grad((out * torch.randn_like(out)).sum() + (lse * grad_lse).sum(), (q, k, v, sinks))
    for name, grad, x in zip("qkv", grads, (q, k, v)):
        assert grad.shape == x.shape and not grad.any(), f"d{name}"
    torch.testing.assert_close(grads[3], grad_lse.sum(dim=(0, 2)))


def test_packed_call_without_keys_is_differentiable():
    cu_q = torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE)
    cu_k = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    q, k, v = _leaves((7, 4, 16), (0, 2, 16), (0, 2, 16))
    out = flashkernel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 0)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(g.shape == x.shape and not g.any() for g, x in zip(grads, (q, k, v)))


def test_second_order_gradients_raise():
    """A gradient taken with ``create_graph=True`` cannot be differentiated again: the second
    backward says so, naming the alternatives, instead of PyTorch's note for op authors."""
    q, k, v = _leaves((1, 9, 2, 16), (1, 9, 2, 16), (1, 9, 2, 16))
    out = flashkernel.flash_attn_func(q, k, v, causal=True)
    (dq,) = torch.autograd.grad(out.sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError, match="second-order gradients through flash_attn_func"):
        dq.sum().backward()


def test_gradients_only_where_asked_and_none_for_alibi():
    q, k, v = _leaves((1, 9, 2, 16), (1, 9, 2, 16), (1, 9, 2, 16))
    slopes = torch.rand(2, device=DEVICE, requires_grad=True)
    k_frozen = k.detach()
    out = flashkernel.flash_attn_func(q, k_frozen, v, alibi_slopes=slopes.detach(), causal=True)
    out.sum().backward()
    assert q.grad is not None and v.grad is not None and k.grad is None
    with torch.no_grad():
        assert flashkernel.flash_attn_func(q, k, v).grad_fn is None
    # Slopes that ask for a gradient are told they get none (the outputs as with fixed slopes).
    with pytest.warns(UserWarning, match="alibi_slopes requires grad, but flashkernel's backward computes no "
                                         "gradient for the slopes"):
        again = flashkernel.flash_attn_func(q, k_frozen, v, alibi_slopes=slopes, causal=True)
    again.sum().backward()
    assert slopes.grad is None and torch.equal(again, out)
    # No warning while torch.compile traces (it cannot trace one): the graph stays whole.
    compiled = torch.compile(lambda x, s: flashkernel.flash_attn_func(x, k_frozen, v, alibi_slopes=s, causal=True),
                             backend="eager", fullgraph=True)
    assert torch.equal(compiled(q, slopes), out)
    cu = torch.tensor([0, 9], dtype=torch.int32, device=DEVICE)
    with pytest.warns(UserWarning, match="alibi_slopes requires grad"):
        flashkernel.flash_attn_varlen_func(q[0], k_frozen[0], v[0], cu, cu, 9, 9, alibi_slopes=slopes, causal=True)


@pytest.mark.parametrize("deterministic", [False, True])
def test_compiled_training_step_has_no_graph_break(deterministic, backward_spy):
    q, k, v = _leaves((1, 9, 2, 16), (1, 9, 2, 16), (1, 9, 2, 16))

    def step(q, k, v):
        out = flashkernel.flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
        return (out.float() ** 2).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    want = torch.autograd.grad(step(q, k, v), (q, k, v))
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert backward_spy == [deterministic] * 2


# ---- deterministic=True -------------------------------------------------------------------------


@pytest.fixture
def backward_spy(monkeypatch):
    """The ``deterministic`` argument of every ``attention_backward`` call, in order. On the GPU
    a call whose layouts and scalars ran before replays the recorded launches without reaching
    ``attention_backward``; the op-level call cache is bypassed so that every call does."""
    from flashkernel import ops
    from flashkernel.kernels import backward

    monkeypatch.setattr(ops, "_cached", lambda name, tensors, scalars, run: run())
    seen = []
    original = backward.attention_backward

    def spy(*args, deterministic=False, **kwargs):
        seen.append(deterministic)
        return original(*args, deterministic=deterministic, **kwargs)

    monkeypatch.setattr(backward, "attention_backward", spy)
    return seen


_CU = (0, 4, 4, 9)


def _dense(q, k, v, **kwargs):
    return flashkernel.flash_attn_func(q, k, v, causal=True, **kwargs)


def _packed(q, k, v, **kwargs):
    cu = torch.tensor(_CU, dtype=torch.int32, device=DEVICE)
    return flashkernel.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 5, 5, causal=True, **kwargs)


@pytest.mark.parametrize("call", [_dense, _packed], ids=["dense", "packed"])
def test_deterministic_reaches_the_backward(call, backward_spy):
    """The call's own flag, or PyTorch's global one, reaches the backward's dispatch (which then
    keeps the Triton kernels); neither is on by default."""
    q, k, v = _leaves((1, 9, 2, 16), (1, 9, 2, 16), (1, 9, 2, 16))
    for kwargs in ({}, dict(deterministic=False), dict(deterministic=True)):
        call(q, k, v, **kwargs).sum().backward()
    torch.use_deterministic_algorithms(True)
    try:
        call(q, k, v).sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)
    assert backward_spy == [False, False, True, True]


@pytest.mark.parametrize("call", [_dense, _packed], ids=["dense", "packed"])
def test_deterministic_gradients_repeat_bit_for_bit(call):
    q, k, v = _leaves((1, 9, 4, 16), (1, 9, 2, 16), (1, 9, 2, 16))
    sinks = torch.randn(4, device=DEVICE, requires_grad=True)
    leaves = (q, k, v, sinks)
    grad_out = torch.randn(9, 4, 16, device=DEVICE)

    def grads(**kwargs):
        out = call(q, k, v, sinks=sinks, **kwargs)
        return torch.autograd.grad((out * grad_out.view_as(out)).sum(), leaves)

    first, again = grads(deterministic=True), grads(deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    _check_grads(first, [g.double() for g in grads()], 2e-4)


@pytest.mark.parametrize("call", [_dense, _packed], ids=["dense", "packed"])
def test_deterministic_must_be_a_bool(call, monkeypatch):
    from flashkernel import interface

    def fail(*args, **kwargs):
        raise AssertionError("kernel launched despite bad input")

    monkeypatch.setattr(interface.dispatch, "prefill", fail)
    monkeypatch.setattr(interface.dispatch, "prefill_varlen", fail)
    q, k, v = _leaves((1, 9, 2, 16), (1, 9, 2, 16), (1, 9, 2, 16))
    for bad, shown in (("yes", "str 'yes'"), (1, "int 1"), (None, "NoneType None")):
        with pytest.raises(TypeError, match=f"deterministic must be a bool, got {shown}"):
            call(q, k, v, deterministic=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_bf16_gpu(dtype):
    q, k, v = _leaves((2, 1000, 8, 128), (2, 1000, 2, 128), (2, 1000, 2, 128), dtype=dtype)
    out = flashkernel.flash_attn_func(q, k, v, causal=True)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad((out * grad_out).sum(), (q, k, v))
    ref = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    ref_out, _ = reference.attention(*ref, causal=True)
    want = torch.autograd.grad((ref_out * grad_out.double()).sum(), ref)
    low = [x.detach().requires_grad_(True) for x in (q, k, v)]
    low_out, _ = reference.attention(*low, causal=True, upcast=False)
    torch_grads = torch.autograd.grad((low_out * grad_out).sum(), low)
    for g, w, t in zip(got, want, torch_grads):
        bound = 2 * (t.double() - w).abs().max().item() + torch.finfo(dtype).eps * w.abs().max().item()
        assert (g.double() - w).abs().max().item() <= bound
