"""Concurrency and state: threads, streams, devices and CUDA-graph capture at once; the call caches
never replay a launch recorded for another shape, dtype, stride, alignment or device; every path
gives the same bits a hundred times (GPU only: the replays and the launcher exist on CUDA)."""

import threading

import pytest
import torch

import flashkernel
from flashkernel import interface, ops
from flashkernel.kernels import combine, decode, dispatch, prefill
from helpers import DEVICE, ON_GPU

pytestmark = pytest.mark.gpu
HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)


def bits(x):
    """A tensor's bits as integers (NaN equals NaN), or a tuple of them."""
    if isinstance(x, (tuple, list)):
        return tuple(bits(t) for t in x)
    return x.view({2: torch.int16, 4: torch.int32}[x.element_size()]).clone()


def same_bits(a, b) -> bool:
    """Equal bit for bit (tensors, or nested tuples of them)."""
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    return torch.equal(bits(a), bits(b))


def randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


def decode_inputs(batch=3, capacity=704, heads=(8, 2), head_dim=128, page_size=16, dtype=torch.bfloat16):
    """A paged (or contiguous, ``page_size`` 0) cache with every slot written, lengths and queries."""
    if page_size:
        blocks = capacity // page_size
        capacity = blocks * page_size
        k_cache = randn(batch * blocks + 2, page_size, heads[1], head_dim, dtype=dtype)
        table = torch.randperm(batch * blocks + 2, device=DEVICE)[:batch * blocks].view(batch, blocks).int()
    else:
        k_cache, table = randn(batch, capacity, heads[1], head_dim, dtype=dtype), None
    lengths = torch.tensor([capacity - 1, 1, capacity // 3][:batch], dtype=torch.int32, device=DEVICE)
    return dict(q=randn(batch, 1, heads[0], head_dim, dtype=dtype), k_cache=k_cache, v_cache=torch.randn_like(k_cache),
                cache_seqlens=lengths, block_table=table)


def decode_call(inputs, **kwargs):
    args = dict(inputs)
    q, k_cache, v_cache = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    return flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, return_lse=True, **args, **kwargs)


def _packed(lengths):
    return torch.nn.functional.pad(torch.tensor(lengths, device=DEVICE).cumsum(0), (1, 0)).int()


WORKLOADS = ("prefill", "prefill triton", "prefill float32 variants", "varlen", "decode split", "decode auto splits",
             "decode plan", "standard", "decode gluon split")


def workloads(heads=(8, 2)):
    """``name -> zero-argument call`` (the names of ``WORKLOADS``) over fresh inputs: every public
    path, calls that leave the caches alone (each may run any number of times). The Gluon decode
    kernel only on Hopper."""
    q, k, v = randn(2, 300, heads[0], 128), randn(2, 350, heads[1], 128), randn(2, 350, heads[1], 128)
    q32, k32, v32 = randn(1, 90, 4, 40, dtype=torch.float32), randn(1, 70, 2, 40, dtype=torch.float32), randn(
        1, 70, 2, 40, dtype=torch.float32)
    lengths = [70, 0, 130, 5]
    cu = _packed(lengths)
    packed = randn(sum(lengths), heads[0], 64), randn(sum(lengths), heads[1], 64), randn(sum(lengths), heads[1], 64)
    paged, contiguous = decode_inputs(), decode_inputs(page_size=0, heads=(4, 4), head_dim=64, dtype=torch.float16)
    sinks = torch.randn(4, device=DEVICE)
    plan = flashkernel.DecodePlan(paged["q"], paged["k_cache"], paged["v_cache"], cache_seqlens=paged["cache_seqlens"],
                                  block_table=paged["block_table"], num_splits=3, return_lse=True)
    calls = {
        "prefill": lambda: flashkernel.flash_attn_func(q, k, v, causal=True, return_lse=True),
        "prefill triton": lambda: flashkernel.flash_attn_func(q, k, v, causal=True, return_lse=True, backend="triton"),
        "prefill float32 variants": lambda: flashkernel.flash_attn_func(
            q32, k32, v32, causal=True, window_size=(20, 0), softcap=10.0, sinks=sinks, return_lse=True),
        "varlen": lambda: flashkernel.flash_attn_varlen_func(*packed, cu, cu, 130, 130, causal=True, return_lse=True),
        "decode split": lambda: decode_call(paged, num_splits=4),
        "decode auto splits": lambda: decode_call(contiguous),
        "decode plan": lambda: plan.run(paged["q"], paged["k_cache"], paged["v_cache"]),
        "standard": lambda: flashkernel.standard_attention(q[:, :64], k[:, :80], v[:, :80], causal=True,
                                                           return_lse=True),
    }
    if HOPPER:
        calls["decode gluon split"] = lambda: decode_call(paged, num_splits=5, backend="gluon")
    return calls


@pytest.fixture(autouse=True)
def _needs_gpu():
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU")


# ---- threads and streams --------------------------------------------------------------------------


def test_threads_on_one_stream_issue_a_split_decode_one_at_a_time_gpu():
    """Two threads replay one split decode (through Triton's launcher, which releases the GIL) on
    the default stream. Thread A stops between its split kernel and its merge; thread B then
    runs the same call on other inputs. B's split kernel must not overwrite A's partials before
    A's merge reads them: B waits until A's run is issued (it shares the stream's temporaries).
    """
    mine, theirs = decode_inputs(), decode_inputs()
    want_mine, want_theirs = decode_call(mine, num_splits=4), decode_call(theirs, num_splits=4)
    replay = next(r for r in interface._EAGER_CALLS._replays.values() if r)
    replay.native, replay._entry = None, False  # neither the C launcher nor its one-call runs
    (launch, *head), *rest = replay.launches[0]
    paused, resume = threading.Event(), threading.Event()

    def split_kernel_then_wait(*args):
        launch(*args)
        if threading.current_thread().name == "mine":
            paused.set()
            resume.wait(timeout=2.0)  # with the lock, "theirs" cannot run until this returns

    replay.launches = (((split_kernel_then_wait, *head), *rest), *replay.launches[1:])
    results = {}
    thread = threading.Thread(target=lambda: results.update(mine=decode_call(mine, num_splits=4)), name="mine")
    thread.start()
    assert paused.wait(timeout=30)
    other = threading.Thread(target=lambda: results.update(theirs=decode_call(theirs, num_splits=4)))
    other.start()
    other.join(timeout=0.5)
    resume.set()
    thread.join()
    other.join()
    torch.cuda.synchronize()
    assert same_bits(results["mine"], want_mine) and same_bits(results["theirs"], want_theirs)


@pytest.mark.parametrize("streams", ["own", "default"])
def test_two_threads_calling_every_path_at_once_gpu(streams):
    """Two threads run every path 20 times each at once (their own streams, or both on the
    default stream; the same layouts, so they share recorded launches): every result equals,
    bit for bit, the one computed alone beforehand."""
    per_thread = [workloads(), workloads()]
    expected = [{name: bits(call()) for name, call in calls.items()} for calls in per_thread]
    torch.cuda.synchronize()
    failures = []

    def run(calls, want):
        stream = torch.cuda.Stream() if streams == "own" else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            for _ in range(20):
                got = {name: call() for name, call in calls.items()}
                stream.synchronize()
                failures.extend(name for name, value in got.items() if not same_bits(value, want[name]))

    threads = [threading.Thread(target=run, args=(calls, want)) for calls, want in zip(per_thread, expected)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, sorted(set(failures))


def test_graph_capture_beside_eager_calls_in_another_thread_gpu():
    """One thread captures a decode step and a prefill in a CUDA graph (thread-local capture)
    while another keeps calling every path eagerly: the eager results stay exact, and the
    graph's replays equal eager calls of the same backend (the split decode step's up to its
    merge's rounding: eager and captured steps merge their splits in different kernels)."""
    calls = workloads()
    want = {name: bits(call()) for name, call in calls.items()}
    torch.cuda.synchronize()
    stop, failures = threading.Event(), []

    def eager():
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            while not stop.is_set():
                for name, call in calls.items():
                    value = call()
                    stream.synchronize()
                    if not same_bits(value, want[name]):
                        failures.append(name)

    step = decode_inputs()
    q, k, v = randn(1, 200, 8, 128), randn(1, 200, 2, 128), randn(1, 200, 2, 128)

    def captured():
        return decode_call(step, num_splits=3, backend="triton"), flashkernel.flash_attn_func(q, k, v, causal=True)

    captured()  # a first eager call: compiles, records the launches
    thread = threading.Thread(target=eager)
    thread.start()
    side, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        captured()
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            static = captured()
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(5):
        step["q"].copy_(randn(*step["q"].shape))
        q.copy_(randn(*q.shape))
        graph.replay()
        torch.cuda.synchronize()
        (decode_static, prefill_static), (decode_eager, prefill_eager) = static, captured()
        assert same_bits(prefill_static, prefill_eager)
        # A captured split step merges its splits in a combine launch, an eager one in the decode
        # kernel (kernels/decode.py, merges_in_kernel): equal up to the merge's float32 rounding.
        torch.testing.assert_close(decode_static, decode_eager, rtol=0, atol=4e-3)
    stop.set()
    thread.join()
    assert not failures, sorted(set(failures))


@pytest.mark.skipif(not ON_GPU or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_calls_alternating_between_two_devices_gpu():
    """The same layouts on two devices, the current device left at 0: each call runs on its
    tensors' device and equals the result computed there alone."""
    per_device = []
    for index in range(2):
        with torch.cuda.device(index):
            inputs = [x.to(f"cuda:{index}") for x in (randn(1, 100, 4, 64), randn(1, 120, 2, 64), randn(1, 120, 2, 64))]
            per_device.append((inputs, bits(flashkernel.flash_attn_func(*inputs, causal=True))))
    interface._EAGER_CALLS.clear()
    for _ in range(5):
        for index, (inputs, want) in enumerate(per_device):
            out = flashkernel.flash_attn_func(*inputs, causal=True)
            assert out.device.index == index and same_bits(out, want)


# ---- no stale replay ------------------------------------------------------------------------------


def _clear_call_caches():
    interface._EAGER_CALLS.clear()
    ops._OP_CALLS.clear()
    launchers = [prefill._launch_forward, decode._launch_decode, decode._launch_append, combine._launch_combine]
    launchers += [m._launch_kernel for m in (dispatch._gluon_prefill_module(), dispatch._gluon_decode_module()) if m]
    for launcher in launchers:
        launcher.compiled.clear()


def test_no_stale_replay_for_another_shape_dtype_stride_alignment_or_scalar_gpu():
    """Calls that differ from each other in one thing only (a length, the dtype, the strides, the
    base address's alignment, k and v at one address, a scalar), run interleaved three times with
    warm caches: each equals, bit for bit, its result computed with every cache empty."""
    base = randn(2, 130, 4, 72)
    k, v = randn(2, 150, 2, 72), randn(2, 150, 2, 72)
    strided = randn(2, 4, 130, 72).transpose(1, 2)  # other strides, same shape
    flat = randn(base.numel() + 8)
    misaligned = flat[4:4 + base.numel()].view(base.shape)  # same strides, base 8 bytes off 16
    cases = {
        "base": lambda: flashkernel.flash_attn_func(base, k, v, causal=True),
        "shorter q": lambda: flashkernel.flash_attn_func(base[:, :129], k, v, causal=True),
        "shorter k": lambda: flashkernel.flash_attn_func(base, k[:, :149], v[:, :149], causal=True),
        "float16": lambda: flashkernel.flash_attn_func(base.half(), k.half(), v.half(), causal=True),
        "strided q": lambda: flashkernel.flash_attn_func(strided, k, v, causal=True),
        "misaligned q": lambda: flashkernel.flash_attn_func(misaligned, k, v, causal=True),
        "k is v": lambda: flashkernel.flash_attn_func(base, k, k, causal=True),
        "not causal": lambda: flashkernel.flash_attn_func(base, k, v),
        "scale": lambda: flashkernel.flash_attn_func(base, k, v, causal=True, softmax_scale=0.3),
        "window": lambda: flashkernel.flash_attn_func(base, k, v, window_size=(5, 0)),
        "window right": lambda: flashkernel.flash_attn_func(base, k, v, window_size=(5, 1)),
        "with lse": lambda: flashkernel.flash_attn_func(base, k, v, causal=True, return_lse=True),
    }
    paged = decode_inputs(head_dim=64)
    for splits in (1, 2, 7):
        cases[f"decode splits {splits}"] = lambda s=splits: decode_call(paged, num_splits=s)
    cases["decode fewer sequences"] = lambda: decode_call({**paged, "q": paged["q"][:2],
                                                           "cache_seqlens": paged["cache_seqlens"][:2],
                                                           "block_table": paged["block_table"][:2]}, num_splits=2)
    want = {}
    for name, call in cases.items():
        _clear_call_caches()
        want[name] = bits(call())
    for _ in range(3):
        for name, call in cases.items():
            assert same_bits(call(), want[name]), name


def test_plan_refuses_other_layouts_and_replays_only_its_own_gpu():
    """A plan checks every layer's layout: another dtype or strides raise; another alignment takes
    the full path; its replays stay exact."""
    inputs = decode_inputs(head_dim=64)
    q, k_cache, v_cache = inputs["q"], inputs["k_cache"], inputs["v_cache"]
    plan = flashkernel.DecodePlan(q, k_cache, v_cache, cache_seqlens=inputs["cache_seqlens"],
                                  block_table=inputs["block_table"], num_splits=2)
    want = plan.run(q, k_cache, v_cache)
    with pytest.raises(ValueError, match="make a new plan"):
        plan.run(q, k_cache.half(), v_cache)
    transposed = randn(q.shape[0], q.shape[2], 1, q.shape[3]).transpose(1, 2)  # same shape, other strides
    with pytest.raises(ValueError, match="strides"):
        plan.run(transposed, k_cache, v_cache)
    flat = randn(q.numel() + 8)
    shifted = flat[4:4 + q.numel()].view(q.shape)  # 8 bytes off a 16-byte boundary
    shifted.copy_(q)
    torch.testing.assert_close(plan.run(shifted, k_cache, v_cache), want, rtol=0, atol=1e-2)
    for _ in range(3):
        assert same_bits(plan.run(q, k_cache, v_cache), want)


# ---- determinism ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*WORKLOADS, "prefill TMA (4100 keys)", "backward", "combine"])
def test_bitwise_equal_over_100_calls_gpu(name):
    """Every path, split decode and its merge included: 100 calls, one set of bits."""
    if name == "prefill TMA (4100 keys)":
        q, k, v = randn(1, 64, 4, 128), randn(1, 4100, 2, 128), randn(1, 4100, 2, 128)
        call = lambda: flashkernel.flash_attn_func(q, k, v, return_lse=True, backend="triton")  # noqa: E731
    elif name == "backward":
        q, k, v = (randn(2, 200, h, 64).requires_grad_() for h in (4, 2, 2))
        dout = randn(2, 200, 4, 64)

        def call():
            for x in (q, k, v):
                x.grad = None
            flashkernel.flash_attn_func(q, k, v, causal=True, softcap=20.0).backward(dout)
            return q.grad.clone(), k.grad.clone(), v.grad.clone()
    elif name == "combine":
        parts, lse_parts = torch.randn(9, 2, 3, 4, 64, device=DEVICE), torch.randn(9, 2, 4, 3, device=DEVICE)
        out = torch.empty(2, 3, 4, 64, dtype=torch.bfloat16, device=DEVICE)

        def call():
            combine.combine(parts, lse_parts, out, None)
            return out.clone()
    else:
        calls = workloads(heads=(4, 2))
        if name not in calls:
            pytest.skip(f"{name} needs a Hopper GPU")
        call = calls[name]
    first = bits(call())
    for _ in range(99):
        assert same_bits(call(), first)
