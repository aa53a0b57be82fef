"""The fast launcher's cache key never maps two launches Triton specializes differently to one
compiled kernel (checked against Triton's own specialization, no GPU needed)."""

import pytest
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.nvidia.compiler import CUDABackend

from flashkernel.kernels import _common, _launch

INTS = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16,
        -(2**31), -(2**31) - 1, -(2**31) - 16, 2**63 - 16, 2**63, 2**64 - 16]


def _tensors():
    base = torch.empty(64, dtype=torch.float32)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.int32):
        flat = base.view(dtype)
        for offset in (0, 1, 2, 4, 8):
            yield flat[offset:]


VALUES = INTS + [1.0, 0.5, 16.0, True, False, None] + list(_tensors())


@pytest.mark.parametrize("specialize", [True, False])
def test_equal_keys_mean_equal_triton_specializations(specialize):
    seen = {}
    for value in VALUES:
        ours = _launch.launch_key([value])
        triton_spec = native_specialize_impl(CUDABackend, value, False, specialize, True)
        seen.setdefault(ours, set()).add(triton_spec)
    clashes = {key: specs for key, specs in seen.items() if len(specs) > 1}
    assert not clashes, f"one launcher key covers several Triton specializations: {clashes}"
    assert len(seen) < len(VALUES)  # aligned tensors of one dtype do share a key


def test_key_separates_what_triton_separates():
    # The test above can fail: Triton does tell these apart, and so must the key.
    t = torch.empty(16, dtype=torch.float16)
    for a, b in [(16, 17), (1, 2), (2**31 - 16, 2**31), (t, t[1:]), (t, t.float()), (1, 1.0), (1, True), (16, 16.0)]:
        assert (native_specialize_impl(CUDABackend, a, False, True, True)
                != native_specialize_impl(CUDABackend, b, False, True, True))
        assert _launch.launch_key([a]) != _launch.launch_key([b])


@pytest.mark.parametrize("specialize", [True, False])
def test_runtime_keys_mean_equal_triton_specializations(specialize):
    """A runtime argument's key (integers by class, not value) still never covers two of
    Triton's specializations, for integers, stride tuples and floats."""
    seen = {}
    values = INTS + [(a, b) for a in (1, 16, 17, 2**31) for b in (0, 1, 32, 33)] + [0.5, 1.0, 1e30, 16.0]
    for value in values:
        ours = _launch.runtime_key(value)
        triton_spec = native_specialize_impl(CUDABackend, value, False, specialize, True)
        seen.setdefault(ours, set()).add(triton_spec)
    clashes = {key: specs for key, specs in seen.items() if len(specs) > 1}
    assert not clashes, f"one runtime key covers several Triton specializations: {clashes}"
    assert _launch.runtime_key(17) == _launch.runtime_key(33)  # new lengths, same compiled kernel
    assert _launch.runtime_key((17, 4096)) == _launch.runtime_key((33, 8192))


def test_launcher_keys_constexprs_by_value_and_runtime_arguments_by_class():
    from triton.runtime.jit import JITFunction

    from flashkernel.kernels import decode

    kernel = decode._decode_kernel
    kernel = JITFunction(kernel.fn) if not hasattr(kernel, "params") else kernel  # the interpreter's wrapper
    keyers, params = _launch.parameter_keys(kernel), kernel.params
    assert len(keyers) == len(params)
    for param, keyer in zip(params, keyers):
        if param.is_constexpr:
            assert keyer(64) != keyer(128)
        else:
            assert keyer(17) == keyer(33) and keyer(16) != keyer(17)


def _descriptors():
    gluon = pytest.importorskip("flashkernel.kernels.gluon.common")
    for dtype in (torch.float16, torch.bfloat16):
        for head_dim in (64, 128):
            base = torch.empty(2, 300, 4, head_dim + 8, dtype=dtype)
            for x in (base[..., :head_dim], base[:, 1:, 1:3, 8:], base[:1, :17, :, :head_dim]):
                for rows in (64, 128):
                    yield gluon.make_descriptor(x, rows)


def test_descriptor_keys_match_triton_specializations():
    # Shapes, strides and base offsets vary under one key (they are encoded per launch); dtype,
    # block shape and layout are what Triton specializes a descriptor on, and the key has them.
    seen, specs = {}, {}
    for desc in _descriptors():
        ours = _launch.launch_key([desc])
        triton_spec = native_specialize_impl(CUDABackend, desc, False, True, True)
        seen.setdefault(ours, set()).add(triton_spec)
        specs.setdefault(triton_spec, set()).add(ours)
    assert all(len(s) == 1 for s in seen.values()), seen
    assert all(len(s) == 1 for s in specs.values()), specs
    assert len(seen) == 8  # 2 dtypes x 2 head dims x 2 block heights


def test_interpreted_kernels_launch_through_triton(monkeypatch):
    calls = []

    class FakeKernel:
        arg_names = ["X", "n", "BLOCK"]

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs)) or "compiled"

    monkeypatch.setattr(_launch, "is_interpreted", lambda kernel: True)
    launcher = _launch.Launcher(FakeKernel())
    assert launcher.interpreted
    for _ in range(2):
        assert launcher((3,), torch.zeros(4), 4, BLOCK=16, num_warps=4) == "compiled"
    assert len(calls) == 2 and calls[0][2] == {"BLOCK": 16, "num_warps": 4}
    assert not launcher.compiled


def test_host_integer_helpers_match_triton():
    import triton
    assert all(_common.next_power_of_2(n) == triton.next_power_of_2(n) for n in range(1, 3000))
    assert all(_common.cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 200) for b in range(1, 40))


class _FakeCompiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self, runs):
        self.runs = runs

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        self.runs.append(args)


class _FakeKernel:
    """Stands in for a JITFunction: counts slow-path launches, returns a recording compiled kernel."""
    arg_names = ["X", "n", "scale", "BLOCK"]

    def __init__(self):
        self.slow, self.fast = [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.slow.append((grid, args, kwargs))
            return _FakeCompiled(self.fast)
        return launch


class _FakeDriver:
    class active:
        device = 0

        @classmethod
        def get_current_device(cls):
            return cls.device

        @staticmethod
        def get_current_stream(device):
            return 1234


@pytest.fixture
def fake_launcher(monkeypatch):
    monkeypatch.setattr(_launch, "driver", _FakeDriver)
    monkeypatch.setattr(_launch, "FAST_LAUNCH", True)
    kernel = _FakeKernel()
    launcher = _launch.Launcher(kernel)
    launcher.interpreted = False
    return kernel, launcher


def test_repeat_launch_goes_straight_to_the_compiled_kernel(fake_launcher):
    kernel, launcher = fake_launcher
    x = torch.empty(64, dtype=torch.float16)
    launcher((3, 2), x, 16, 0.5, BLOCK=64, num_warps=4, num_stages=3)
    launcher((5, 2), x, 16, 0.5, BLOCK=64, num_warps=4, num_stages=3)
    assert len(kernel.slow) == 1
    (run,) = kernel.fast
    # grid x, y, z, stream, function, metadata, launch metadata, hooks, then every argument in order
    assert run[:6] == (5, 2, 1, 1234, "fn", "meta")
    assert run[-4:] == (x, 16, 0.5, 64)


@pytest.mark.parametrize("change", ["num_stages", "num_warps", "constexpr", "dtype", "alignment", "int",
                                    "device", "extra_option"])
def test_anything_triton_specializes_on_misses_the_cache(fake_launcher, change):
    kernel, launcher = fake_launcher
    x = torch.empty(64, dtype=torch.float16)
    base = dict(args=(x, 16, 0.5), named=dict(BLOCK=64, num_warps=4, num_stages=3))
    launcher((1,), *base["args"], **base["named"])
    args, named = list(base["args"]), dict(base["named"])
    if change == "num_stages":
        named["num_stages"] = 2
    elif change == "num_warps":
        named["num_warps"] = 8
    elif change == "constexpr":
        named["BLOCK"] = 128
    elif change == "dtype":
        args[0] = torch.empty(64, dtype=torch.bfloat16)
    elif change == "alignment":
        args[0] = x[1:]
    elif change == "int":
        args[1] = 17
    elif change == "device":
        _FakeDriver.active.device = 1
    elif change == "extra_option":
        named["launch_pdl"] = True
    try:
        launcher((1,), *args, **named)
    finally:
        _FakeDriver.active.device = 0
    assert len(kernel.slow) == 2 and not kernel.fast


def test_native_launch_packs_parameters_as_tritons_launcher():
    """Each parameter 8 bytes apart in the kernel's order: pointers (the recorded ones left as
    slots), integers in their C width, fp32 as its bit pattern, tuples flattened, constexprs
    skipped, then Triton's two scratch pointers."""
    import struct

    from flashkernel.kernels import _native

    signature = {"X": "*bf16", "Y": "*fp32", "strides": ("i32", "i64"), "n": "i32", "scale": "fp32",
                 "one": "constexpr", "BLOCK": "constexpr"}
    values = (None, 0x1000, (3, -5), 7, 0.5, 1, 64)
    storage, slots, maps = _native.pack(signature, values, {0: (2, 16)})
    words = [storage[i:i + 8] for i in range(0, len(storage), 8)]
    assert len(words) == 6 + 2 and maps == ()
    assert slots == ((0, 2, 16),)
    assert struct.unpack("<Q", words[1])[0] == 0x1000
    assert struct.unpack("<i", words[2][:4])[0] == 3 and struct.unpack("<q", words[3])[0] == -5
    assert struct.unpack("<i", words[4][:4])[0] == 7 and struct.unpack("<f", words[5][:4])[0] == 0.5
    assert words[6] == words[7] == b"\0" * 8


def test_a_native_launch_repacked_with_other_scalars_equals_a_fresh_pack():
    """``with_values`` (a rebound replay's launch) writes the new scalars, tuple elements
    included and constexpr elements skipped, into a copy of the packed parameters: the same
    bytes as packing the new values from scratch, for the same capsule (the run copies them in);
    anything but a packed scalar declines."""
    from flashkernel.kernels import _native

    signature = {"X": "*bf16", "strides": ("i32", "constexpr", "i64"), "n": "i32", "scale": "fp32",
                 "BLOCK": "constexpr"}
    storage, slots, maps = _native.pack(signature, (None, (3, 1, -5), 7, 0.5, 64), {0: (2, 16)})
    packed = _native.Packed("old", ("fn", 4, 1, 1, 128, 0), storage, slots, maps,
                            _native._packing(tuple(signature.items()))[2])
    again = _native.with_values(packed, {1: (9, 1, 2**40), 2: -4, 3: 0.25})
    want, _, _ = _native.pack(signature, (None, (9, 1, 2**40), -4, 0.25, 64), {0: (2, 16)})
    assert again.storage == want and want != storage
    assert again._replace(storage=storage) == packed  # the same capsule, slots and maps
    assert packed.storage == storage and packed.capsule == "old"  # the original is unchanged
    assert _native.with_values(packed, {0: 5}) is None  # a pointer
    assert _native.with_values(packed, {2: (1, 2)}) is None  # a tuple for a scalar
    assert _native.with_values(packed, {1: (1, 1, "x")}) is None  # not a number
    assert _native.with_values(packed, {1: (9, 1)}) is None and _native.with_values(packed, {1: (9, 1, 2, 3)}) is None
    assert _native.with_values(packed, {3: 1e300}) is None  # no fp32


def test_native_launch_packs_tma_descriptors_as_tritons_launcher():
    """A host TMA descriptor is Triton's launcher's ``CUtensorMap`` parameter (a placeholder
    word the C module points at the encoded map), then its shape as i32 and strides as i64; the
    map is encoded as ``make_tensordesc_arg`` encodes it (dims, box innermost first, outer
    strides in bytes, the driver's element type). Without Triton's metadata: not packed."""
    import struct

    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    from flashkernel.kernels import _native

    # bf16 (Triton's device-side element type 10), a 64-wide box under the 128-byte swizzle (3)
    signature = {"X": "*fp32", "D": "tensordesc<bf16[1, 64, 1, 64], NVMMASharedLayout>", "n": "i32",
                 "BLOCK": "constexpr"}
    shape, strides = [2, 300, 8, 128], [300 * 8 * 128, 8 * 128, 128, 1]
    meta = [{"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [1, 64, 1, 64], "fp4_padded": False}]
    descriptor = (4, shape, strides, "zero", 0x7F0000000000)
    storage, slots, maps = _native.pack(signature, (None, None, 5, 64), {0: (0, 0)}, {1: descriptor}, meta)
    words = [storage[i:i + 8] for i in range(0, len(storage), 8)]
    assert len(words) == 1 + 1 + 4 + 4 + 1 + 2
    assert slots == ((0, 0, 0),)
    assert words[1] == b"\0" * 8  # the map's placeholder
    assert [struct.unpack("<i", w[:4])[0] for w in words[2:6]] == shape
    assert [struct.unpack("<q", w)[0] for w in words[6:10]] == strides
    assert struct.unpack("<i", words[10][:4])[0] == 5
    assert maps == ((1, 4, 0x7F0000000000, TMA_DTYPE_DEVICE_TO_HOST[10], (128, 8, 300, 2),
                     (2 * 128, 2 * 8 * 128, 2 * 300 * 8 * 128), (64, 1, 64, 1), 3, 0),)
    args = (None, None, 5, 64), {0: (0, 0)}
    assert _native.pack(signature, *args, {1: descriptor}, None) is None  # no metadata
    assert _native.pack(signature, *args, {}, meta) is None  # a descriptor not recorded
    assert _native.pack(signature, *args, {1: descriptor}, meta * 2) is None  # metadata of another kernel
    assert _native.pack(signature, *args, {1: descriptor}, [dict(meta[0], fp4_padded=True)]) is None
    in_tuple = {"X": "*fp32", "D": ("tensordesc<bf16[1, 64, 1, 64], NVMMASharedLayout>", "i32"), "n": "i32",
                "BLOCK": "constexpr"}
    assert _native.pack(in_tuple, (None, (None, 1), 5, 64), {0: (0, 0)}, {1: descriptor}, meta) is None
    nan = (4, shape, strides, "nan", 0x7F0000000000)
    assert _native.pack(signature, *args, {1: nan}, meta)[2][0][-1] == 1


def test_call_cache_notes_stay_bounded_without_replays():
    """``CallCache.notes`` (a caller's memo per family base) empties itself at the cache's
    bound even when no replay is ever filed (recording off), and with the replays."""
    from flashkernel.kernels._launch import CallCache

    cache = CallCache(max_entries=4)
    for i in range(10):
        cache.notes[i] = i
        assert len(cache.notes) <= 4
    cache.notes[9] = "again"  # a present key never empties it
    assert cache.notes[9] == "again" and len(cache.notes) == 2
    cache.clear()
    assert not cache.notes


def _layout_variants(q, k, v):
    """Calls of the examples ``(q, k, v, None)``: the same layouts at new addresses, and each
    way a call can differ from them (what :func:`_launch.layouts` tells apart, and more)."""
    def fresh(x):
        return torch.randn_like(x)

    def offset(x):  # the same layout one element further: another alignment
        return torch.randn(x.numel() + 1, dtype=x.dtype)[1:].view(x.shape)

    return {
        "same": (fresh(q), fresh(k), fresh(v), None),
        "the examples": (q, k, v, None),
        "dtype": (q.double(), k, v, None),
        "shape": (fresh(q)[:1], k, v, None),
        "strides": (q, k.transpose(0, 1).contiguous().transpose(0, 1), v, None),
        "alignment": (q, offset(k), v, None),
        "aliased": (q, k, k, None),
        "a tensor for None": (q, k, v, fresh(q)),
        "None for a tensor": (q, None, v, None),
        "grad": (fresh(q).requires_grad_(), k, v, None),
        "not a tensor": (q, k.tolist(), v, None),
        "fewer": (q, k, v),
    }


@pytest.mark.parametrize("variant", list(_layout_variants(*(torch.randn(2, 3, 4) for _ in range(3)))))
def test_a_layout_guard_answers_only_for_the_planned_layouts(variant):
    """``LayoutGuard.addresses`` gives the addresses exactly when the call has the examples' layouts
    (as ``layouts`` compares them, without a gradient); otherwise None, never an error."""
    q, k, v = torch.randn(2, 1, 4, 8), torch.randn(2, 16, 2, 8), torch.randn(2, 16, 2, 8)
    guard = _launch.LayoutGuard.make((q, k, v, None))
    assert guard is not None
    tensors = _layout_variants(q, k, v)[variant]
    addresses = guard.addresses(tensors)
    if variant in ("same", "the examples"):
        assert _launch.layouts(tensors) == _launch.layouts((q, k, v, None))
        assert addresses == [x.data_ptr() for x in tensors[:3]] + [None]
    else:
        assert addresses is None


def test_a_layout_guard_tells_apart_which_arguments_share_an_address():
    """Examples that share an address (one ``cu_seqlens`` for queries and keys) match calls that
    pass one tensor in the same places; calls whose sharing differs are not matched, as ``layouts``
    keys them apart (one address in two views: left to ``layouts``)."""
    x, y, z = (torch.randn(4, 8) for _ in range(3))
    guard = _launch.LayoutGuard.make((x, y, x, None))
    for call in ((x, y, x, None), (y, x, y, None), (z, y, z, None)):
        assert guard.addresses(call) == [call[0].data_ptr(), call[1].data_ptr(), call[0].data_ptr(), None]
        assert _launch.layouts(call) == _launch.layouts((x, y, x, None))
    for call in ((x, y, z, None), (x, x, x, None), (x, y, y, None)):
        assert guard.addresses(call) is None and _launch.layouts(call) != _launch.layouts((x, y, x, None))
    assert guard.addresses((x, y, x.view(4, 8), None)) is None


def test_a_layout_guard_is_not_made_where_it_cannot_stand_in_and_keeps_no_tensor():
    import weakref

    x, y = torch.randn(4, 8), torch.randn(4, 8)
    assert _launch.LayoutGuard.make((x.clone().requires_grad_(), y)) is None
    assert _launch.LayoutGuard.make((None, None)) is None
    assert _launch.LayoutGuard.make((torch.nn.Parameter(x), y)) is None  # a subclass: layouts() keys it
    assert _launch.LayoutGuard.make((x, y, x.view(8, 4))) is None  # one address, two layouts
    assert _launch.LayoutGuard.make((x, y, x.view(torch.int32))) is None
    assert _launch.LayoutGuard.make((x.to_sparse(), y)) is None
    guard, alive = _launch.LayoutGuard.make((x, y)), weakref.ref(x)
    del x
    assert alive() is None and guard.addresses((torch.randn(4, 8), y)) is not None


def test_a_layout_guard_answers_none_for_a_nested_tensor_without_reaching_the_cpp_guards():
    """The C++ guards read a nested tensor's strides, which aborts the process: the guard turns it
    away first (validation then names it)."""
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    guard = _launch.LayoutGuard.make((x, y))
    nested = torch.nested.nested_tensor([torch.randn(3, 4), torch.randn(2, 4)])
    assert guard.addresses((nested, y)) is None and guard.addresses((x, nested)) is None


def test_the_recent_calls_look_up_answers_none_for_arguments_that_are_no_scalars():
    """A probe that holds an array (a bad ``softmax_scale`` or ``window_size``) finds nothing,
    without the error of comparing it: validation names the argument."""
    import numpy as np

    x = torch.randn(4, 8)
    cache = _launch.CallCache()
    cache._recent = [(("fwd", (0.5,), (float,), None), _launch.LayoutGuard.make((x,)), "replay", None)]
    for scalar in (torch.tensor([1.0, 2.0]), np.array([4, 0])):
        assert cache.quick(("fwd", (scalar,), (type(scalar),), None), (x,)) is None
        assert cache.quick(("fwd", (0.5,), (float,), scalar), (x,)) is None


def test_a_decode_loops_replays_are_found_again_after_leaving_the_recent_ones(monkeypatch):
    """A decode loop: each step's layers make one call of a new cache length, recorded in an
    earlier generation and pushed out of the recent replays since. :meth:`CallCache.quick` finds it
    by its probe and leading shapes (the cache's length) and puts it first, so the other layers
    find it at once; a look-up by key (``get_noted``) puts it first too. Each guard is made once
    per inference mode, however often its replay comes back; the guard, not the index, decides."""

    class Replay:
        native = None

        def __init__(self, name):
            self.name = name

        def run(self, inputs, reuse_scratch=False, outputs=None, addresses=None, capturing=None):
            return self.name

    made = []
    make = _launch.LayoutGuard.make
    monkeypatch.setattr(_launch.LayoutGuard, "make", lambda inputs: made.append(inputs[0].shape) or make(inputs))
    cache = _launch.CallCache()
    lengths = range(1, cache.RECENT + 3)
    steps = {length: (torch.randn(1, length), Replay(length)) for length in lengths}
    for length, (x, replay) in steps.items():
        cache._replays[("kv", length)] = replay
        assert cache.get_noted(("kv", length), "probe", (x,)) is replay
        assert cache.quick("probe", (torch.randn(1, length),)) == length
    assert [entry[2].name for entry in cache._recent] == list(lengths)[::-1][:cache.RECENT]
    assert cache.quick("probe", (torch.randn(1, 1),)) == 1  # pushed out, found by its shapes
    assert cache._recent[0][2] is steps[1][1] and len(cache._recent) == cache.RECENT
    recent = list(cache._recent)
    transposed = torch.randn(2, 2).t()[0:1]  # length 2's shape, not its strides; no recent entry
    assert transposed.shape == (1, 2) and cache.quick("probe", (transposed,)) is None
    assert cache.quick("other probe", (torch.randn(1, 2),)) is None
    assert cache._recent == recent  # nothing put first that its guard refused
    nested = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
    for bad in (("not a tensor",), ([1, 2],), (nested,), (torch.randn(1, 2), nested)):
        assert cache.quick("probe", bad) is None
    assert cache.quick(("probe", [0.5]), (torch.randn(1, 2),)) is None  # unhashable: validation names it
    for length in (2, 3):
        x, replay = steps[length]
        assert cache.get_noted(("kv", length), "probe", (x,)) is replay and cache._recent[0][2] is replay
    x, replay = steps[9]  # a recent entry, not the first: moved, not copied
    assert cache.get_noted(("kv", 9), "probe", (x,)) is replay
    assert [entry[2].name for entry in cache._recent] == [9, 3, 2, 1, 10, 8, 7, 6]
    assert made == [(1, length) for length in lengths]  # no guard made twice
    with torch.inference_mode():  # the C++ guards compare dispatch keys under the thread's mode
        assert cache.quick("probe", (torch.randn(1, 1),)) is None
        assert cache.get_noted(("kv", 1), "probe", (torch.randn(1, 1),)) is steps[1][1]
        assert cache.quick("probe", (torch.randn(1, 1),)) == 1
    assert len(made) == len(lengths) + 1 and cache._recent[0][2] is steps[1][1]
    assert len({id(entry) for entry in cache._recent}) == len(cache._recent) == cache.RECENT  # each once
    # Once a guard refuses, only the recent replays of the call's shapes are tried (a guard refuses
    # the others): the first layer of a step pays one refusal, not one per recent replay.
    tried = []
    run = _launch.LayoutGuard.run
    monkeypatch.setattr(_launch.LayoutGuard, "run", lambda self, replay, *a, **k: tried.append(replay.name)
                        or run(self, replay, *a, **k))
    assert [entry[2].name for entry in cache._recent] == [1, 9, 3, 2, 1, 10, 8, 7]  # the first: inference mode's
    assert cache.quick("probe", (torch.randn(1, 7),)) == 7 and tried == [1, 7]
    tried.clear()
    assert cache.quick("probe", (torch.randn(1, 4),)) == 4 and tried == [1, 4]  # the index's, put first
    tried.clear()
    assert cache.quick("probe", (torch.randn(1, 12),)) is None and tried == [4]
    tried.clear()
    assert cache.quick("probe", (transposed,)) is None and tried == [4, 2]  # its shapes, not its strides
    cache.clear()
    assert cache._recent == [] and not cache._entries and not cache._by_shapes


# ---- the C launcher against a stub driver ------------------------------------------------------

_STUB_DRIVER = r"""
#include <stdint.h>
static uint64_t params[64];
static int nparams = 0, launches = 0;
int cuGetErrorString(int err, const char **msg) { *msg = "stub"; return 0; }
int cuCtxGetCurrent(void **ctx) { *ctx = (void *)1; return 0; }
int cuTensorMapEncodeTiled(void *map, int a, unsigned b, void *c, void *d, void *e, void *f, void *g, int h, int i,
                           int j, int k) { return 0; }
int cuTensorMapReplaceAddress(void *map, void *address) { *(void **)map = address; return 0; }
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shared, void *stream, void **kernel_params, void **extra) {
  for (int i = 0; i < nparams; i++) params[i] = *(uint64_t *)kernel_params[i];
  launches++;
  return 0;
}
void stub_expect(int n) { nparams = n; }
int stub_launches(void) { return launches; }
uint64_t stub_param(int i) { return params[i]; }
"""


@pytest.fixture(scope="module")
def stub_native(tmp_path_factory):
    """``_native``'s C module built against a stub CUDA driver that records the parameters of
    each launch (machines without a driver: on one with a GPU the real driver's symbols could be
    the ones bound). Returns ``(module, stub)``, the stub a ``ctypes`` library."""
    import ctypes
    import shutil
    import subprocess
    import sysconfig

    from triton.backends.nvidia import driver as nvidia

    from flashkernel.kernels import _native

    if torch.cuda.is_available() or shutil.which("gcc") is None:
        pytest.skip("needs a C compiler and no CUDA driver")
    where = tmp_path_factory.mktemp("stub")
    (where / "stub.c").write_text(_STUB_DRIVER)
    (where / "launch.c").write_text(_native._SOURCE)
    subprocess.check_call(["gcc", "-shared", "-fPIC", "-o", str(where / "libstubcuda.so"), str(where / "stub.c"),
                           "-Wl,-soname,libstubcuda.so"])
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    subprocess.check_call(["gcc", "-O2", "-shared", "-fPIC", "-o", str(where / f"flashkernel_launch{suffix}"),
                           str(where / "launch.c"), *(f"-I{d}" for d in nvidia.include_dirs),
                           f"-I{sysconfig.get_paths()['include']}", f"-L{where}", "-lstubcuda",
                           f"-Wl,-rpath,{where}"])
    stub = ctypes.CDLL(str(where / "libstubcuda.so"))
    stub.stub_param.restype = ctypes.c_uint64
    import importlib.util
    spec = importlib.util.spec_from_file_location("flashkernel_launch", where / f"flashkernel_launch{suffix}")
    native = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native)
    from torch._C._dynamo.guards import _torchinductor_pyobject_tensor_data_ptr as data_ptr
    x = torch.empty(3)
    assert native.setup(data_ptr, torch.Tensor, x) == x.data_ptr()
    return native, stub


def _one_launch(native, stub, sources):
    """A launch whose parameters are the addresses of ``sources`` (8 bytes past each)."""
    stub.stub_expect(len(sources))
    slots = tuple((param, source, 8) for param, source in enumerate(sources))
    return native.make(1, 1, 1, 1, 128, 0, bytes(8 * len(sources)), slots, ())


def _checked_run(native, stub, guard, tensors, fixed=(), buffers=()):
    """``checked_run`` of one launch taking every address; the addresses it launched with, or None
    (then ``buffers`` were not asked for)."""
    sources = [j for j, x in enumerate((*tensors, *fixed, *buffers)) if x is not None]
    launch, asked = _one_launch(native, stub, sources), []
    before = stub.stub_launches()
    ran = native.checked_run(guard, tuple(tensors), tuple(fixed), lambda *args: asked.append(args) or list(buffers),
                             7, False, (launch,), None)
    assert stub.stub_launches() == before + (ran is not None)
    assert asked == ([(7, False, None)] if ran is not None else []) and (ran is None or ran == list(buffers))
    return [stub.stub_param(i) - 8 for i in range(len(sources))] if ran is not None else None


def _c_guard(native, examples):
    guard = _launch.LayoutGuard.make(examples)
    return native.guard(guard._check, guard._alignments, guard._checked, guard._same,
                        guard._distinct - (None in guard._alignments))


@pytest.mark.parametrize("variant", list(_layout_variants(*(torch.randn(2, 3, 4) for _ in range(3)))))
def test_the_c_launchers_checked_run_answers_as_the_layout_guard(stub_native, variant):
    """``checked_run`` launches exactly when ``LayoutGuard.addresses`` answers, with those addresses
    (then the fixed tensors' and the buffers'), and launches nothing otherwise."""
    native, stub = stub_native
    q, k, v = torch.randn(2, 1, 4, 8), torch.randn(2, 16, 2, 8), torch.randn(2, 16, 2, 8)
    guard = _c_guard(native, (q, k, v, None))
    tensors = _layout_variants(q, k, v)[variant]
    fixed, buffers = (torch.zeros(2, dtype=torch.int32), None), [None, torch.empty(5)]
    launched = _checked_run(native, stub, guard, tensors, fixed, buffers)
    expected = _launch.LayoutGuard.make((q, k, v, None)).addresses(tensors)
    if expected is None:
        assert launched is None
    else:
        assert launched == [a for a in expected if a is not None] + [fixed[0].data_ptr(), buffers[1].data_ptr()]


def test_the_c_launchers_checked_run_tells_apart_shared_addresses_and_nested_tensors(stub_native):
    native, stub = stub_native
    x, y, z = (torch.randn(4, 8) for _ in range(3))
    guard = _c_guard(native, (x, y, x, None))
    for call in ((x, y, x, None), (y, x, y, None), (z, y, z, None)):
        assert _checked_run(native, stub, guard, call) == [call[0].data_ptr(), call[1].data_ptr(),
                                                           call[0].data_ptr()]
    for call in ((x, y, z, None), (x, x, x, None), (x, y, y, None), (x, y, x.view(4, 8), None)):
        assert _checked_run(native, stub, guard, call) is None
    # one tensor and a view of it where the examples had two: only the count of distinct addresses
    # tells them apart (the C++ check passes, the slots hold different objects)
    assert _launch.LayoutGuard.make((x, y))._check(x, x.view(4, 8))
    assert _checked_run(native, stub, _c_guard(native, (x, y)), (x, x.view(4, 8))) is None
    nested = torch.nested.nested_tensor([torch.randn(4, 8), torch.randn(2, 8)])
    assert _checked_run(native, stub, _c_guard(native, (x, y)), (nested, y)) is None
    assert _checked_run(native, stub, _c_guard(native, (x, y)), (x, nested)) is None


def test_the_c_launchers_checked_run_raises_for_what_only_a_bug_passes(stub_native):
    native, stub = stub_native
    x = torch.randn(4, 8)
    guard, launch = _c_guard(native, (x,)), _one_launch(native, stub, [0, 1])
    with pytest.raises(TypeError, match="not a tensor"):
        native.checked_run(guard, (x,), (3,), lambda *args: [], 0, False, (launch,), None)
    with pytest.raises(IndexError, match="missing address"):
        native.checked_run(guard, (x,), (None,), lambda *args: [], 0, False, (launch,), None)
    with pytest.raises(TypeError, match="must return a list"):
        native.checked_run(guard, (x,), (x,), lambda *args: (), 0, False, (launch,), None)

    def out_of_memory(*args):
        raise MemoryError

    with pytest.raises(MemoryError):  # an allocation's error reaches the caller
        native.checked_run(guard, (x,), (x,), out_of_memory, 0, False, (launch,), None)
    with pytest.raises(ValueError, match="incorrect name"):
        native.checked_run(launch, (x,), (), lambda *args: [], 0, False, (launch,), None)  # a launch for the guard


def test_the_c_launchers_checked_run_makes_buffers_from_kept_temporaries_and_makers(stub_native):
    """``checked_run`` given ``(kept, makers)`` instead of a callback (what eager runs keeping
    their temporaries pass): the kept temporaries (the list copied, not changed), then per maker
    ``out`` where it takes it and one is given, else ``make(*args)``, launched with those
    addresses and returned (with ``outputs``, the buffers at those indices); nothing is made for a
    call the guard turns away, and a malformed spec or a maker that raises launches nothing."""
    native, stub = stub_native
    q, k = torch.randn(2, 8), torch.randn(4, 8)
    guard = _c_guard(native, (q, k))
    temp, made = torch.randn(4), []

    def make(*shape):
        made.append(shape)
        return torch.empty(shape)

    kept = [temp, None, None]
    spec = (kept, ((1, True, make, (2, 3)), (2, False, make, (5,))))
    launch = _one_launch(native, stub, [0, 1, 2, 3, 4])
    buffers = native.checked_run(guard, (q, k), (), spec, 7, False, (launch,), None)
    assert kept == [temp, None, None] and buffers[0] is temp and made == [(2, 3), (5,)]
    assert [tuple(b.shape) for b in buffers[1:]] == [(2, 3), (5,)]
    assert [stub.stub_param(i) - 8 for i in range(5)] == [q.data_ptr(), k.data_ptr(),
                                                          *(b.data_ptr() for b in buffers)]
    out_guard = _launch.LayoutGuard.make((torch.empty(2, 3),))
    with_out = native.guard(*[getattr(_launch.LayoutGuard.make((q, k)), name) for name in ("_check", "_alignments",
                                                                                            "_checked", "_same")],
                            2, out_guard._check, 24, (32, 64), ())
    out = torch.empty(2, 3)
    buffers = native.checked_run(with_out, (q, k), (), spec, 7, False, (launch,), None, out)
    assert buffers[1] is out and made[-1] == (5,) and stub.stub_param(3) - 8 == out.data_ptr()
    picked = native.checked_run(guard, (q, k), (), spec, 7, False, (launch,), None, None, (2, None, 0))
    assert picked[1:] == (None, temp) and picked[0].shape == (5,) and stub.stub_param(4) - 8 == picked[0].data_ptr()
    with pytest.raises(IndexError):
        native.checked_run(guard, (q, k), (), spec, 7, False, (launch,), None, None, (3,))
    count, made[:] = stub.stub_launches(), []
    assert native.checked_run(guard, (q, q), (), spec, 7, False, (launch,), None, None, (1,)) is None and not made
    for bad, error in (((kept,), TypeError), ((tuple(kept), ()), TypeError), ((kept, ((1, True, make),)), TypeError),
                       ((kept, ((3, True, make, ()),)), IndexError),
                       ((kept, ((1, False, lambda: 1 / 0, ()),)), ZeroDivisionError)):
        with pytest.raises(error):
            native.checked_run(guard, (q, k), (), bad, 7, False, (launch,), None)
    assert stub.stub_launches() == count


def test_checked_runs_allocate_through_a_replaced_empty(stub_native, monkeypatch):
    """The C launcher's form of a replay's buffers is made again when ``_launch.empty`` is
    replaced (as the tests replace it to poison outputs with NaN) and when it is put back."""
    native, stub = stub_native
    replay, _, _, (q, k, held), guard = _counted_stub_replay(monkeypatch, native, stub)
    before = _launch.empty
    guard.run(replay, (q, k, None), (held,))
    monkeypatch.setattr(_launch, "empty", lambda shape, dtype, device: torch.full(shape, 7.0, dtype=dtype))
    (out,) = guard.run(replay, (q, k, None), (held,))
    assert (out == 7).all()
    monkeypatch.setattr(_launch, "empty", before)
    (out,) = guard.run(replay, (q, k, None), (held,))
    assert not (out == 7).any()


def test_the_c_launchers_checked_run_into_an_output_checks_it_as_a_plan_does(stub_native, monkeypatch):
    """With an output, ``checked_run`` also asks the output's guard, its 16-byte alignment and that
    it overlaps no input (by extent) and no held span; the output is passed to ``buffers_for``."""
    native, stub = stub_native
    monkeypatch.setattr(_launch._native, "checking_module", lambda: native)
    q, k = torch.randn(2, 4, 8), torch.randn(2, 16, 8)
    pool = torch.empty(4 + q.numel())
    held = pool[:4].view(torch.int32)
    out0 = torch.empty_like(q)
    guard, out_guard = _launch.LayoutGuard.make((q, k, None)), _launch.LayoutGuard.make((out0,))
    extents = (q.numel() * 4, k.numel() * 4, None)
    c_guard = guard.native_form((out_guard, q.numel() * 4, extents, ((held.data_ptr(), 16),)))
    launch = _one_launch(native, stub, [0, 1, 3, 4])

    def run(tensors, out):
        asked = []
        ran = native.checked_run(c_guard, tensors, (held,), lambda *args: asked.append(args) or [out], 0, False,
                                 (launch,), None, out)
        assert asked == ([(0, False, out)] if ran is not None else [])
        return ran is not None and [stub.stub_param(i) for i in range(4)] == [
            x.data_ptr() + 8 for x in (*tensors[:2], held, out)]

    assert run((q, k, None), torch.empty_like(q)) and run((torch.randn_like(q), k, None), out0)
    big = torch.empty(2 * q.numel() + 4)
    for bad_out in (k[:, :4], q, torch.empty_like(q, dtype=torch.float64), big[1:q.numel() + 1].view_as(q),
                    torch.empty_like(q).transpose(0, 1).contiguous().transpose(0, 1), pool[:q.numel()].view_as(q)):
        assert not run((q, k, None), bad_out)
    assert run((q, k, None), pool[4:].view_as(q))  # just past the held tensor
    assert not run((q, k, None), torch.empty_like(q).requires_grad_())
    assert not run((q, k, None), torch.nested.nested_tensor([torch.randn(4, 8), torch.randn(2, 8)]))
    before = torch.empty(q.numel() + 4)  # out ending where a held tensor starts: no overlap
    c_guard = guard.native_form((out_guard, q.numel() * 4, extents, ((before[q.numel():].data_ptr(), 16),)))
    assert run((q, k, None), before[:q.numel()].view_as(q))
    assert not run((q, k, None), before[4:].view_as(q))
    inside = torch.empty(k.numel() + q.numel() + 4)  # out just past k's last element: no overlap
    assert run((q, inside[:k.numel()].view_as(k), None), inside[k.numel():-4].view_as(q))
    k_after = inside[q.numel():-4].view_as(k)
    assert run((q, k_after, None), inside[:q.numel()].view_as(q))
    assert not run((q, k_after, None), inside[4:q.numel() + 4].view_as(q))  # its last 16 bytes are k's first
    with pytest.raises(TypeError, match="without an output check"):
        native.checked_run(_c_guard(native, (q, k, None)), (q, k, None), (), lambda *a: [], 0, False, (launch,),
                           None, out0)


def _stub_kvcache_call(monkeypatch, stub_native):
    """A stub replay of a cache call (:func:`_stub_replay`), and that call's ``q, k_cache, v_cache,
    lengths``, its tensors as ``flash_attn_with_kvcache`` files them, its scalars and window."""
    from flashkernel import interface

    native, stub = stub_native
    replay, _ = _stub_replay(monkeypatch, native, stub, [0, 1, 2, 5, 12, 13])
    q, k_cache, v_cache = torch.randn(2, 1, 4, 8), torch.randn(2, 16, 2, 8), torch.randn(2, 16, 2, 8)
    lengths = torch.full((2,), 5, dtype=torch.int32)
    tensors = (q, k_cache, v_cache, None, None, lengths, *[None] * 6)
    return replay, (q, k_cache, v_cache, lengths), tensors, (True, None, 0.0, 0, False, None, "auto"), \
        interface._checks.NO_WINDOW


def test_a_remembered_replay_runs_through_eager_run_at_once(stub_native, monkeypatch):
    """A replay put among the recent ones gets its guard's and its own C forms there: the next
    call of its probe is one ``eager_run``, as for a rebound replay of a decode step's new cache
    length (``with_arguments`` gives it no C entry; its stream's buffers are its recorded one's)."""
    from flashkernel import interface

    stub = stub_native[1]
    replay, _, tensors, scalars, window = _stub_kvcache_call(monkeypatch, stub_native)
    replay.run_checked(_launch.LayoutGuard.make(tensors).native(), tensors)  # the stream's buffers made
    replay._entry = None
    calls = _launch.CallCache()
    calls._remember(interface._probe("kvcache", (*scalars, False), window), tensors, replay)
    assert replay._entry and calls._recent[0][1]._native
    count = stub.stub_launches()
    (out,) = calls.native_quick(calls._recent, "kvcache", scalars, window, tensors, True)
    assert stub.stub_launches() == count + 1 and stub.stub_param(5) - 8 == out.data_ptr()


def test_dense_and_packed_calls_run_a_recent_replay_in_one_c_call(stub_native, monkeypatch):
    """``flash_attn_func`` and ``flash_attn_varlen_func`` also run a recent replay of their probe
    through ``eager_run``, without Python's look-up; ALiBi slopes that want a gradient fail the
    replay's guard (``_recent_run`` answers None: the call takes Python's path, which warns)."""
    from flashkernel import flash_attn_func, flash_attn_varlen_func, interface

    native, stub = stub_native
    window = interface._checks.NO_WINDOW
    calls = _launch.CallCache()
    monkeypatch.setattr(interface, "_EAGER_CALLS", calls)
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    slopes = torch.rand(2)
    dense = (q, k, v, slopes, None)
    replay, _ = _stub_replay(monkeypatch, native, stub, [0, 1, 2, 3, 5, 6])
    calls._remember(interface._probe("fwd", (True, None, 0.0, False, False, "auto"), window), dense, replay)
    replay.run_checked(calls._recent[0][1].native(), dense)  # the stream's buffers made
    cu = torch.tensor([0, 4], dtype=torch.int32)
    packed = (q[0], k[0], v[0], cu, cu, None, None)
    varlen, _ = _stub_replay(monkeypatch, native, stub, [0, 1, 2, 3, 7, 8])
    calls._remember(interface._probe("varlen", (4, 4, True, None, 0.0, False, False, None, "auto"), window), packed,
                    varlen)
    varlen.run_checked(calls._recent[0][1].native(), packed)
    count = stub.stub_launches()
    monkeypatch.setattr(interface, "_lookup", lambda *args, **kwargs: pytest.fail("Python's look-up taken"))
    out = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    assert stub.stub_launches() == count + 1 and stub.stub_param(5) - 8 == out.data_ptr()
    out = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 4, 4, causal=True)
    assert stub.stub_launches() == count + 2 and stub.stub_param(5) - 8 == out.data_ptr()
    wanting = slopes.clone().requires_grad_()
    assert interface._recent_run("fwd", (True, None, 0.0, False, False, "auto"), window,
                                 (q, k, v, wanting, None)) is None
    assert stub.stub_launches() == count + 2


def _stub_replay(monkeypatch, native, stub, sources):
    """A replay (made without a GPU) of one launch taking ``sources``' addresses, whose two
    allocations are a temporary (index 0) and the output (index 1), run through the stub
    driver's C module on "device 0"."""
    import threading

    monkeypatch.setattr(_launch._native, "module", lambda: native)
    monkeypatch.setattr(_launch._native, "checking_module", lambda: native)
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_raw_stream", lambda device: streams[-1])
    monkeypatch.setattr(_launch, "stream_capturing", lambda: False)
    streams = [7]
    replay = object.__new__(_launch.Replay)
    cpu = torch.device("cpu")
    allocations = (((4,), torch.float32, cpu, False, (1,)), ((2, 3), torch.float16, cpu, False, (3, 1)))
    replay.__dict__.update(device=0, num_inputs=3, outputs=(1,), scratch=(0,), _scratch_by_stream={}, _buffer_specs={},
                           _scratch_lock=threading.Lock(), _storages=None, allocations=allocations,
                           native=(_one_launch(native, stub, sources),))
    return replay, streams


def _counted_stub_replay(monkeypatch, native, stub):
    """:func:`_stub_replay` of ``q, k, held, temporary, output`` with every new buffer's shape noted
    in ``allocated``; returns ``(replay, streams, allocated, (q, k, held), guard of (q, k, None))``."""
    replay, streams = _stub_replay(monkeypatch, native, stub, [0, 1, 3, 4, 5])
    allocated, fresh = [], _launch._fresh
    monkeypatch.setattr(_launch, "_fresh", lambda *args: allocated.append(args[0]) or fresh(*args))
    q, k, held = torch.randn(2, 8), torch.randn(4, 8), torch.zeros(3, dtype=torch.int32)
    return replay, streams, allocated, (q, k, held), _launch.LayoutGuard.make((q, k, None))


def test_checked_runs_of_a_replay_keep_temporaries_per_stream_and_allocate_only_what_they_launch(stub_native,
                                                                                                 monkeypatch):
    """``LayoutGuard.run`` over a replay through the C launcher (stub driver): the launch takes the
    inputs', the held tensor's, the kept temporary's and the new output's addresses; the temporary
    is kept per stream (new ones under capture), the output is new per run, and a call the guard
    turns away allocates nothing. Without the C checks, the Python path launches the same."""
    native, stub = stub_native
    replay, streams, allocated, (q, k, held), guard = _counted_stub_replay(monkeypatch, native, stub)

    def launched():
        return [stub.stub_param(i) - 8 for i in range(5)]

    outs, temps = [], []
    for stream in (7, 7, 8, 7):
        streams.append(stream)
        (out,) = guard.run(replay, (torch.randn(2, 8), k, None), (held,))
        assert out.shape == (2, 3) and out.dtype == torch.float16
        outs.append(out)
        temps.append(launched()[3])
        assert launched()[2:] == [held.data_ptr(), temps[-1], out.data_ptr()]
    assert temps[0] == temps[1] == temps[3] != temps[2] and len({o.data_ptr() for o in outs}) == 4
    allocated.clear()
    streams.append(9)  # a stream not seen yet: a call turned away makes and keeps nothing for it
    assert guard.run(replay, (q, q, None), (held,)) is None and not allocated
    assert 9 not in replay._scratch_by_stream and 9 not in replay._buffer_specs
    streams.append(7)
    monkeypatch.setattr(_launch, "stream_capturing", lambda: True)
    guard.run(replay, (q, k, None), (held,))
    assert launched()[3] not in temps  # under capture: a new temporary
    allocated.clear()
    count = stub.stub_launches()
    assert guard.run(replay, (q, q, None), (held,)) is None and not allocated and stub.stub_launches() == count
    monkeypatch.setattr(_launch, "stream_capturing", lambda: False)
    monkeypatch.setattr(_launch._native, "checking_module", lambda: None)
    python_guard = _launch.LayoutGuard.make((q, k, None))
    (out,) = python_guard.run(replay, (q, k, None), (held,))
    assert python_guard._native is None and launched() == [q.data_ptr(), k.data_ptr(), held.data_ptr(), temps[0],
                                                           out.data_ptr()]


def test_checked_runs_without_kept_temporaries_allocate_them_per_run(stub_native, monkeypatch):
    """What the registered ops' replays but the cache op's do (``ops._cached``:
    ``CallCache.quick(..., reuse_scratch=False)``; the backward's temporaries are large): through
    the C launcher (stub driver) and through the Python path, every run allocates its temporary
    and its output anew and the replay keeps none."""
    native, stub = stub_native
    replay, streams, allocated, (q, k, held), guard = _counted_stub_replay(monkeypatch, native, stub)
    count = stub.stub_launches()
    for _ in range(3):
        (out,) = guard.run(replay, (torch.randn(2, 8), k, None), (held,), reuse_scratch=False)
        assert out.shape == (2, 3) and [stub.stub_param(i) - 8 for i in (2, 4)] == [held.data_ptr(), out.data_ptr()]
    assert stub.stub_launches() == count + 3 and allocated == [(4,), (2, 3)] * 3
    assert replay._scratch_by_stream == {}
    # CallCache.quick passes the choice on (no fixed tensors: a replay of the three inputs alone).
    replay3, _ = _stub_replay(monkeypatch, native, stub, [0, 1, 3, 4])  # q, k, temp, out
    calls = _launch.CallCache()
    calls._recent = [("probe", guard, replay3, None)]
    allocated.clear()
    (out,) = calls.quick("probe", (q, k, None), reuse_scratch=False)
    assert allocated == [(4,), (2, 3)] and replay3._scratch_by_stream == {}
    calls.quick("probe", (q, k, None))
    assert list(replay3._scratch_by_stream) == [streams[-1]]  # the default keeps them, per stream
    # The Python path (no C checks) alike.
    monkeypatch.setattr(_launch._native, "checking_module", lambda: None)
    python_guard = _launch.LayoutGuard.make((q, k, None))
    replay4, _ = _stub_replay(monkeypatch, native, stub, [0, 1, 3, 4, 5])
    allocated.clear()
    python_guard.run(replay4, (q, k, None), (held,), reuse_scratch=False)
    assert allocated == [(4,), (2, 3)] and replay4._scratch_by_stream == {}


def test_kept_temporaries_are_made_on_a_helper_thread_on_the_runs_stream(stub_native, monkeypatch):
    """A replay's temporaries kept per stream (the eager calls', the plans' and the registered
    ops' replays: ``CallCache.quick``) are made once per stream on a helper thread
    (``allocated_off_thread``), never on the calling thread, whose allocations PyTorch may be
    routing to a CUDA-graph pool (``torch.compile``'s, while it warms up); zeroed ones come zeroed.
    Through the C launcher (stub driver) and through the Python path; an error on the helper
    thread is raised in the caller's."""
    import threading

    native, stub = stub_native
    replay, streams, allocated, (q, k, held), guard = _counted_stub_replay(monkeypatch, native, stub)
    cpu = torch.device("cpu")
    replay.allocations = (((4,), torch.int32, cpu, True, (1,)), replay.allocations[1])
    made_on, off_thread = [], _launch.allocated_off_thread

    def noting(stream, device, make):
        return off_thread(stream, device, lambda: made_on.append((threading.current_thread(), stream)) or make())

    monkeypatch.setattr(_launch, "allocated_off_thread", noting)
    temps = []
    for stream in (7, 7, 8, 7):
        streams.append(stream)
        (out,) = guard.run(replay, (torch.randn(2, 8), k, None), (held,))
        assert stub.stub_param(4) - 8 == out.data_ptr()
        temps.append(stub.stub_param(3) - 8)
    assert temps[0] == temps[1] == temps[3] != temps[2]
    assert [s for _, s in made_on] == [7, 8] and threading.current_thread() not in [t for t, _ in made_on]
    assert sorted(replay._scratch_by_stream) == [7, 8] and not replay._scratch_by_stream[7][0].any()
    assert allocated == [(4,), (2, 3), (2, 3), (4,), (2, 3), (2, 3)]  # the temporary once per stream
    # CallCache.quick (the registered ops' first look-up) keeps them alike.
    replay3, streams = _stub_replay(monkeypatch, native, stub, [0, 1, 3, 4])  # q, k, temp, out; stream 7
    calls = _launch.CallCache()
    calls._recent = [("probe", guard, replay3, None)]
    calls.quick("probe", (q, k, None))
    assert list(replay3._scratch_by_stream) == [7] and made_on[-1][1] == 7 and len(made_on) == 3
    # The Python path (no C checks) alike.
    monkeypatch.setattr(_launch._native, "checking_module", lambda: None)
    streams.append(9)
    _launch.LayoutGuard.make((q, k, None)).run(replay, (q, k, None), (held,))
    assert [s for _, s in made_on] == [7, 8, 7, 9]
    assert stub.stub_param(3) - 8 == replay._scratch_by_stream[9][0].data_ptr()
    # What goes wrong on the helper thread is raised here.
    monkeypatch.setattr(_launch, "_fresh", lambda *args: (_ for _ in ()).throw(MemoryError("no room")))
    streams.append(10)
    with pytest.raises(MemoryError, match="no room"):
        guard.run(replay, (q, k, None), (held,))


def test_a_replays_checked_run_is_one_c_call_once_its_streams_buffers_exist(stub_native, monkeypatch):
    """``Replay.run_checked`` hands the whole run to the C launcher's ``replay_run`` (the current
    device, stream and capture state are asked there, the temporaries' lock taken there) once the
    stream's buffers exist; where Python has a step to take (another current device, capture, a
    stream not seen yet, a replaced ``empty``) it answers NotImplemented and launches nothing."""
    native, stub = stub_native
    replay, streams, allocated, (q, k, held), guard = _counted_stub_replay(monkeypatch, native, stub)
    c_guard = guard.native()
    guard.run(replay, (q, k, None), (held,))  # Python's path: the first run on stream 7 makes its buffers
    run, state = replay._entry
    assert run is native.replay_run
    monkeypatch.setattr(replay, "_buffer_spec", lambda *args: pytest.fail("Python's path taken"))
    q2 = torch.randn_like(q)
    (out,) = replay.run_checked(c_guard, (q2, k, None), (held,))
    assert [stub.stub_param(i) - 8 for i in (0, 1, 2, 4)] == [q2.data_ptr(), k.data_ptr(), held.data_ptr(),
                                                              out.data_ptr()]
    count, allocated[:] = stub.stub_launches(), []

    def run_with(**globals_):
        with monkeypatch.context() as patched:
            for name, value in globals_.items():
                patched.setattr(_launch, name, value)
            return run(state, c_guard, (q, k, None), (held,), None, None)

    assert run_with(_current_device=lambda: 1) is NotImplemented
    assert run_with(stream_capturing=lambda: True) is NotImplemented
    assert run_with(_raw_stream=lambda device: 8) is NotImplemented
    assert run_with(empty=lambda *args: None) is NotImplemented
    assert run(state, c_guard, (q, q, None), (held,), False, None) is None  # turned away by the guard
    assert stub.stub_launches() == count and not allocated


def test_a_replays_c_run_takes_the_temporaries_lock_and_releases_it_on_an_error(stub_native, monkeypatch):
    native, stub = stub_native
    replay, _, _, (q, k, held), guard = _counted_stub_replay(monkeypatch, native, stub)
    taken = []

    class NotingLock:
        def acquire(self):
            taken.append("acquire")
            return True

        def release(self):
            taken.append("release")

        def __enter__(self):
            self.acquire()

        def __exit__(self, *exc):
            self.release()

    replay._scratch_lock = NotingLock()
    guard.run(replay, (q, k, None), (held,))  # Python's path: makes the buffers (and takes the lock)
    taken.clear()
    guard.run(replay, (q, k, None), (held,))
    assert taken == ["acquire", "release"]

    def no_room(*args):
        raise MemoryError("no room")

    (kept, makers), empty = replay._buffer_specs[7]
    replay._buffer_specs[7] = ((kept, ((1, True, no_room, ()),)), empty)
    taken.clear()
    with pytest.raises(MemoryError, match="no room"):
        guard.run(replay, (q, k, None), (held,))
    assert taken == ["acquire", "release"]


def _stub_plan(monkeypatch, native, stub, **kwargs):
    """A DecodePlan over CPU tensors whose runs replay a stub replay (of q, the caches, the lengths,
    a temporary and the output) through the C launcher, as a plan made on a GPU would."""
    from flashkernel import DecodePlan, plans

    replay, _ = _stub_replay(monkeypatch, native, stub, [0, 1, 2, 7, 12, 13])
    monkeypatch.setattr(plans, "stream_capturing", lambda: False)
    q, k_cache, v_cache = torch.randn(2, 1, 4, 8), torch.randn(2, 16, 2, 8), torch.randn(2, 16, 2, 8)
    plan = DecodePlan(q, k_cache, v_cache, cache_seqlens=torch.full((2,), 5, dtype=torch.int32), **kwargs)
    plan._guards = {torch.is_inference_mode_enabled(): _launch.LayoutGuard.make((q, k_cache, v_cache, *[None] * 4))}
    plan._calls._replays[False] = replay
    return plan, (q, k_cache, v_cache)


def test_a_plans_run_is_one_c_call_after_its_first(stub_native, monkeypatch):
    """After a plan's first run through the C launcher, ``run`` is one call into it (``plan_run``:
    forward AD's level, functorch's, the inference mode and the capture state are asked there),
    into a new output or the caller's, whose version counter it bumps as ``copy_`` would. While
    forward AD or a torch.func transform is active it leaves the run to Python's path, which
    checks them; a plan whose sinks want a gradient never takes it."""
    native, stub = stub_native
    plan, (q, k_cache, v_cache) = _stub_plan(monkeypatch, native, stub)
    plan.run(q, k_cache, v_cache)
    assert plan._fast is native.plan_run
    monkeypatch.setattr(plan, "_replayed", lambda *args: pytest.fail("Python's path taken"))
    q2 = torch.randn_like(q)
    out = plan.run(q2, k_cache, v_cache)
    assert [stub.stub_param(i) - 8 for i in (0, 1, 2, 5)] == [q2.data_ptr(), k_cache.data_ptr(),
                                                              v_cache.data_ptr(), out.data_ptr()]
    tensors = (q, k_cache, v_cache, None, None, None, None)
    with torch.autograd.forward_ad.dual_level():
        assert plan._fast(plan._fast_runs, tensors, plan._fixed, None) is NotImplemented
    monkeypatch.setattr(_launch, "_functorch_level", lambda: 1)
    assert plan._fast(plan._fast_runs, tensors, plan._fixed, None) is NotImplemented
    monkeypatch.undo()

    plan, (q, k_cache, v_cache) = _stub_plan(monkeypatch, native, stub)
    given = torch.empty_like(q)
    plan._out_guards[torch.is_inference_mode_enabled()] = _launch.LayoutGuard.make((given,))
    for _ in range(2):  # Python's path, then the C call alone
        version = given._version
        assert plan.run(q, k_cache, v_cache, out=given) is given and given._version == version + 1
        assert stub.stub_param(5) - 8 == given.data_ptr()
        assert plan._fast_runs[False][False][2] is not None
        monkeypatch.setattr(plan, "_replayed", lambda *args: pytest.fail("Python's path taken"))
    with torch.inference_mode():  # the other mode: a guard of its own, filed by Python's path first
        monkeypatch.undo()
        plan, (q, k_cache, v_cache) = _stub_plan(monkeypatch, native, stub)
        plan.run(q, k_cache, v_cache)
        assert plan._fast_runs[True][False] is not None and plan._fast_runs[False][False] is None
        monkeypatch.setattr(plan, "_replayed", lambda *args: pytest.fail("Python's path taken"))
        out = plan.run(q, k_cache, v_cache)
        assert stub.stub_param(5) - 8 == out.data_ptr()

    with torch.no_grad():
        sinks = torch.zeros(4, requires_grad=True)
        plan, (q, k_cache, v_cache) = _stub_plan(monkeypatch, native, stub, sinks=sinks)
        for _ in range(2):
            plan.run(q, k_cache, v_cache)
        assert plan._fast is None


def test_an_eager_calls_look_up_and_run_are_one_c_call(stub_native, monkeypatch):
    """``eager_run``: the first recent replay filed with the call's probe (name, scalars of the same
    values and types, the capture state, the window) runs through its guard's and its own C form;
    NotImplemented (nothing launched) for another probe, a guard that turns the tensors away, a
    tensor subclass, forward AD or a torch.func transform. ``flash_attn_with_kvcache`` returns what
    it ran without Python's look-up."""
    from flashkernel import flash_attn_with_kvcache, interface

    native, stub = stub_native
    replay, (q, k_cache, v_cache, lengths), tensors, scalars, window = _stub_kvcache_call(monkeypatch, stub_native)
    calls = _launch.CallCache()
    calls._remember(interface._probe("kvcache", (*scalars, False), window), tensors, replay)
    run = calls.native_quick
    assert run is native.eager_run
    replay.run_checked(calls._recent[0][1].native(), tensors)  # the first run on the stream: Python's path
    count = stub.stub_launches()
    (out,) = run(calls._recent, "kvcache", scalars, window, tensors, True)
    assert [stub.stub_param(i) - 8 for i in (0, 1, 2, 3, 5)] == [q.data_ptr(), k_cache.data_ptr(),
                                                                 v_cache.data_ptr(), lengths.data_ptr(), out.data_ptr()]
    for other in (("fwd", scalars, window, tensors), ("kvcache", (False, *scalars[1:]), window, tensors),
                  ("kvcache", (1, *scalars[1:]), window, tensors), ("kvcache", scalars, (-1, -1), tensors),
                  ("kvcache", scalars, window, (q, q, *tensors[2:])),
                  ("kvcache", scalars, window, (torch.nn.Parameter(q, requires_grad=False), *tensors[1:]))):
        assert run(calls._recent, *other, True) is NotImplemented
    with torch.autograd.forward_ad.dual_level():
        assert run(calls._recent, "kvcache", scalars, window, tensors, True) is NotImplemented
    with monkeypatch.context() as patched:
        patched.setattr(_launch, "_functorch_level", lambda: 1)
        assert run(calls._recent, "kvcache", scalars, window, tensors, True) is NotImplemented
    assert stub.stub_launches() == count + 1
    # A replay of the same probe over longer caches, first among the recent ones: its guard turns
    # the call away and the next replay of the probe runs it, as CallCache.quick would.
    longer, _ = _stub_replay(monkeypatch, native, stub, [0, 1, 2, 5, 12, 13])
    longer_tensors = (q, *(torch.randn(2, 32, 2, 8) for _ in range(2)), *tensors[3:])
    calls._remember(calls._recent[0][0], longer_tensors, longer)
    assert calls._recent[0][2] is longer
    calls._recent[0][1].run(longer, longer_tensors)  # its C forms and buffers made: it could run alone
    assert longer._entry and longer._buffer_specs and stub.stub_launches() == count + 2
    (out,) = run(calls._recent, "kvcache", scalars, window, tensors, True)
    assert stub.stub_launches() == count + 3 and stub.stub_param(5) - 8 == out.data_ptr()
    count += 2

    monkeypatch.setattr(interface, "_EAGER_CALLS", calls)
    monkeypatch.setattr(interface, "_lookup", lambda *args, **kwargs: pytest.fail("Python's look-up taken"))
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
    assert stub.stub_launches() == count + 2 and stub.stub_param(5) - 8 == out.data_ptr()
