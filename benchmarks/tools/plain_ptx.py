"""Compile the plain prefill and decode kernels to PTX for sm_90a, without a GPU, and compare
them with the kernels of another build: the check that a change left the plain path alone.

    git show f66f25c:src/flashkernel/kernels/prefill.py > /tmp/prefill_before.py
    git show f66f25c:src/flashkernel/kernels/decode.py > /tmp/decode_before.py
    PYTHONPATH=src python benchmarks/tools/plain_ptx.py --before-prefill /tmp/prefill_before.py \\
        --before-decode /tmp/decode_before.py [--before-gluon-decode /tmp/gluon_decode_before.py]

Each specialization (bf16, the tuned tile shapes, causal or not, pointer or TMA loads, each
cache layout) is compiled by ``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` with the
argument attributes a real launch gets (pointers and strides 16-divisible). The function bodies
are compared after dropping parameter declarations and loads, debug sections and location
labels, and renaming virtual registers in order of first use: "identical" means the same
instructions in the same order. ``--variants`` also compiles every variant specialization and
reports registers and spills from ptxas (the ``-v`` report of the bundled ptxas); ``--quantized``
the decode and append kernels over float8_e4m3fn and int8 caches (and fails when the append's
round-half-even addition was folded away). The append kernel's plain specialization is compared
too (``--before-decode``).

Both builds' kernels are compiled with the arguments a plain launch passes: the current
kernels take every feature's arguments (inert for a plain call) and strides as tuples, the
kernels of builds before f66f25c's successor had a separate plain entry point with separate
stride arguments; :func:`as_current` maps one argument description onto the other.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not the interpreter

from flashkernel.bench.compile_check import compile_triton, ptxas_report  # noqa: E402


def load_module(path: str, name: str, package: str = "flashkernel.kernels"):
    """A kernel module file loaded as ``<package>.<name>`` (relative imports work)."""
    spec = importlib.util.spec_from_file_location(f"{package}.{name}", path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = package
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def canonical_body(ptx: str) -> list[str]:
    """The instructions of a PTX function body: parameter declarations and loads, debug
    sections and location labels dropped, virtual registers renamed in order of first use."""
    lines, names = [], {}
    for line in ptx.split("\t.section\t.debug")[0].splitlines():
        s = line.strip()
        if (not s or s.startswith(("//", ".loc", ".file", ".param", ".reg", ".visible", ".entry", ")", "("))
                or "ld.param" in s or re.match(r"^\$L__tmp\d+:$", s)):
            continue

        def rename(m):
            names.setdefault(m.group(0), f"{m.group(1)}#{len(names)}")
            return names[m.group(0)]

        lines.append(re.sub(r"(%[a-z]+)(\d+)", rename, s))
    return lines


def resources(ptx: str) -> str:
    report = ptxas_report(ptx, sass=False)
    return f"{report['registers']} regs, {report['spill_stores']} B spilled"


# ---- specializations ------------------------------------------------------------------------------


def prefill_plain_cases():
    for head_dim, (block_m, block_n, warps, stages) in ((64, (128, 64, 8, 3)), (128, (128, 128, 8, 3))):
        for causal in (False, True):
            for tma in (False, True):
                values = dict(Q="*bf16", K="*bf16", V="*bf16", Out="*bf16", Lse="*fp32", qk_scale="fp32",
                              HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
                              CAUSAL=causal, WRITE_LSE=True, USE_TMA=tma, WARP_SPECIALIZE=False,
                              DOT_F32=False, DOT_PRECISION="tf32")
                label = f"prefill d{head_dim} {'causal' if causal else 'full'} {'tma' if tma else 'ptr'}"
                yield label, values, warps, stages


def decode_plain_cases():
    for page in (0, 16, 256):
        for causal in (False, True):
            values = dict(Q="*bf16", K="*bf16", V="*bf16", BlockTable="*i32", SeqLens="*i32", Out="*fp32",
                          Lse="*fp32", qk_scale="fp32", HEAD_DIM=128, BLOCK_D=128, BLOCK_M=16,
                          BLOCK_N=64 if page >= 64 else 128, PAGE_SIZE=page, CAUSAL=causal, WRITE_LSE=True,
                          DOT_F32=False, DOT_PRECISION="tf32",
                          _unit_strides=("stride_sl", "stride_btn", "stride_lt", "stride_ah", "stride_sh"))
            yield f"decode page{page} {'causal' if causal else 'full'}", values, 4, 3


PREFILL_STRIDES = dict(q_strides=3, k_strides=3, v_strides=3, o_strides=3, lse_strides=2, alibi_strides=2)
DECODE_STRIDES = dict(q_strides=3, k_strides=3, v_strides=3, bt_strides=2, o_strides=4, lse_strides=4,
                      alibi_strides=2)
DECODE_UNIT = ("bt_strides[1]", "seqlens_stride", "lse_strides[3]", "alibi_strides[1]", "sink_stride", "start_stride")


def as_current(values: dict, decode: bool) -> dict:
    """A plain launch's arguments for the current one-kernel-per-family signature: the feature
    pointers (ALiBi slopes, sinks, packed offsets, key starts, new keys/values) are the call's q (or lengths) as
    a plain launch passes them, strides are tuples, the features off."""
    current = {**values, **VARIANT_SCALARS, "Slopes": values["Q"], "Sinks": values["Q"],
               "window_left": "i32", "window_right": "i32"}
    for name, n in (DECODE_STRIDES if decode else PREFILL_STRIDES).items():
        current[name] = ("i32",) * n
    if decode:
        current.update(Starts="*i32", seqlens_stride="i32", sink_stride="i32", start_stride="i32", HAS_START=False,
                       KScale=values["Q"], VScale=values["Q"], ks_strides=("i32",) * 3, vs_strides=("i32",) * 3,
                       KV_SCALE=0, KNew=values["Q"], VNew=values["Q"], knew_strides=("i32",) * 3,
                       vnew_strides=("i32",) * 3, APPEND=False, Final=values["Q"], FinalLse=values["Q"],
                       Counters="*i32", final_strides=("i32",) * 3, final_lse_strides=("i32",) * 3,
                       MERGE=False, MERGE_LSE=False, BLOCK_S=1, _unit_strides=DECODE_UNIT)
    else:
        current.update(CuSeqlensQ=values["Q"], CuSeqlensK=values["Q"], sink_stride="i32", num_seqs=1,
                       IS_VARLEN=False, BLOCK_B=1)
    return current


VARIANT_FLAGS = {
    "window": dict(HAS_WINDOW=True), "softcap": dict(HAS_SOFTCAP=True), "alibi": dict(HAS_ALIBI=True),
    "sinks": dict(HAS_SINKS=True), "all": dict(HAS_WINDOW=True, HAS_SOFTCAP=True, HAS_ALIBI=True, HAS_SINKS=True),
}
VARIANT_SCALARS = dict(Slopes="*fp32", Sinks="*fp32", softcap_in="fp32", softcap_out="fp32",
                       HAS_WINDOW=False, HAS_SOFTCAP=False, HAS_ALIBI=False, HAS_SINKS=False)


def variant_cases(prefill, decode):
    for label, values, warps, stages in prefill_plain_cases():
        if "d128" not in label:
            continue
        for name, flags in VARIANT_FLAGS.items():
            v = {**as_current(values, False), **flags, "CuSeqlensQ": "*i32", "CuSeqlensK": "*i32",
                 "Slopes": "*fp32", "Sinks": "*fp32"}
            if flags.get("HAS_WINDOW"):
                v["CAUSAL"] = False
            yield prefill._attention_fwd_kernel, f"{label} +{name}", v, warps, stages
        v = {**as_current(values, False), "CuSeqlensQ": "*i32", "CuSeqlensK": "*i32", "IS_VARLEN": True,
             "BLOCK_B": 64, "num_seqs": "i32"}
        yield prefill._attention_fwd_kernel, f"{label} varlen", v, warps, stages
    for label, values, warps, stages in decode_plain_cases():
        for name, flags in {**VARIANT_FLAGS, "start": dict(HAS_START=True)}.items():
            v = {**as_current(values, True), **flags, "Slopes": "*fp32", "Sinks": "*fp32"}
            if flags.get("HAS_WINDOW"):
                v["CAUSAL"] = False
            yield decode._decode_kernel, f"{label} +{name}", v, warps, stages


def compare(label, fn_after, fn_before, values, warps, stages, decode: bool) -> bool:
    after = compile_triton(fn_after, as_current(values, decode), warps, stages).asm["ptx"]
    before_values = values if "window_left" not in fn_before.arg_names else as_current(values, decode)
    before = compile_triton(fn_before, before_values, warps, stages).asm["ptx"]
    a, b = canonical_body(after), canonical_body(before)
    same = a == b
    detail = "identical" if same else f"DIFFERENT ({sum(1 for _ in difflib.unified_diff(b, a, n=0)) - 2} diff lines)"
    print(f"{label:32s} {len(a):5d} instructions  {detail}  [{resources(after)}]", flush=True)
    return same


def append_plain_cases():
    for page in (0, 16):
        values = dict(KNew="*bf16", VNew="*bf16", K="*bf16", V="*bf16", KScale="*bf16", VScale="*bf16",
                      BlockTable="*i32", SeqLens="*i32", HEAD_DIM=128, BLOCK_D=128, BLOCK_H=8, PAGE_SIZE=page,
                      KV_SCALE=0, _unit_strides=("stride_btn", "stride_sl"))
        yield f"append page{page}", values, 4, 3


def compare_append(label, fn_after, fn_before, values, warps, stages) -> bool:
    """The append kernel's plain specialization in both builds (arguments a build lacks are ignored)."""
    after = compile_triton(fn_after, values, warps, stages).asm["ptx"]
    before = compile_triton(fn_before, values, warps, stages).asm["ptx"]
    a, b = canonical_body(after), canonical_body(before)
    detail = "identical" if a == b else f"DIFFERENT ({sum(1 for _ in difflib.unified_diff(b, a, n=0)) - 2} diff lines)"
    print(f"{label:32s} {len(a):5d} instructions  {detail}  [{resources(after)}]", flush=True)
    return a == b


QUANTIZED = {"fp8": "*fp8e4nv", "int8": "*i8"}
SCALES = {"per-head": 1, "per-token": 2}  # KV_SCALE; per tensor compiles as per head (head stride 0)
ROUNDING_CONSTANT = "0f4B000000"  # 2**23, the round-half-even addition of decode._round_half_even


def quantized_cases(decode):
    """The decode kernel over quantized caches (every page layout of the plain cases) and the
    quantizing append kernel."""
    for cache_name, cache in QUANTIZED.items():
        for scale_name, mode in SCALES.items():
            for label, values, warps, stages in decode_plain_cases():
                # V as a launch passes it: int16 words of two entries (decode.value_operand)
                v = {**as_current(values, True), "K": cache, "V": "*i16", "KScale": "*fp32", "VScale": "*fp32",
                     "KV_SCALE": mode}
                yield decode._decode_kernel, f"{label} {cache_name} {scale_name}", v, warps, stages
            for label, values, warps, stages in append_plain_cases():
                v = {**values, "K": cache, "V": cache, "KScale": "*fp32", "VScale": "*fp32", "KV_SCALE": mode}
                yield decode._append_kernel, f"{label} {cache_name} {scale_name}", v, warps, stages


def gluon_decode_ptx(module, page: int, causal: bool) -> str:
    """The Gluon decode kernel of ``module`` (a build's ``kernels/gluon/decode.py``) compiled
    through its own ``launch_args``: bf16, head dim 128, GQA group 4, one new token, 3 splits."""
    import torch

    from flashkernel.bench.compile_check import compile_gluon
    from flashkernel.kernels import tuning

    q = torch.empty(2, 1, 8, 128, dtype=torch.bfloat16)
    if page == 0:
        k_cache, table = torch.empty(2, 512, 2, 128, dtype=torch.bfloat16), None
    else:
        k_cache, table = torch.empty(64, page, 2, 128, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.int32)
    parts, parts_lse = torch.empty(3, 2, 1, 8, 128), torch.empty(3, 2, 8, 1)
    _, args, kwargs = module.launch_args(
        q, k_cache, torch.empty_like(k_cache), torch.zeros(2, dtype=torch.int32), table, parts, parts_lse,
        parts.stride()[:4], parts_lse.stride(), appended=0, capacity=512, num_blocks=k_cache.shape[0], page_size=page,
        num_splits=3, causal=causal, softmax_scale=0.1, config=module.config_for(128, tuning.decode_tuning(None)),
        sms=132)
    return compile_gluon(module._gluon_decode_kernel, args, kwargs, {"num_warps": 4}).asm["ptx"]


def compare_gluon_decode(before_path: str) -> bool:
    """The Gluon decode kernel's plain specializations (contiguous, pages of 16 and 256, causal or
    not) in this build and in ``before_path``."""
    from flashkernel.kernels.gluon import decode as after

    before = load_module(before_path, "_ptx_before_gluon_decode", "flashkernel.kernels.gluon")
    ok = True
    for page in (0, 16, 256):
        for causal in (False, True):
            a = canonical_body(gluon_decode_ptx(after, page, causal))
            b = canonical_body(gluon_decode_ptx(before, page, causal))
            detail = "identical" if a == b else f"DIFFERENT ({sum(1 for _ in difflib.unified_diff(b, a, n=0)) - 2} diff lines)"
            print(f"{f'gluon decode page{page} ' + ('causal' if causal else 'full'):32s} {len(a):5d} instructions  "
                  f"{detail}", flush=True)
            ok &= a == b
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before-prefill", help="kernels/prefill.py of the build to compare with")
    parser.add_argument("--before-decode", help="kernels/decode.py of the build to compare with")
    parser.add_argument("--before-gluon-decode", help="kernels/gluon/decode.py of the build to compare with")
    parser.add_argument("--variants", action="store_true", help="also compile every variant, report registers")
    parser.add_argument("--quantized", action="store_true",
                        help="also compile the decode and append kernels over float8_e4m3fn / int8 caches: "
                             "registers, spills, and whether the append's rounding survived compilation")
    args = parser.parse_args(argv)
    from flashkernel.kernels import decode, prefill

    ok = True
    if args.before_prefill:
        before = load_module(args.before_prefill, "_ptx_before_prefill")
        for label, values, warps, stages in prefill_plain_cases():
            ok &= compare(label, prefill._attention_fwd_kernel, before._attention_fwd_kernel, values, warps, stages,
                          False)
    if args.before_decode:
        before = load_module(args.before_decode, "_ptx_before_decode")
        for label, values, warps, stages in decode_plain_cases():
            ok &= compare(label, decode._decode_kernel, before._decode_kernel, values, warps, stages, True)
        for label, values, warps, stages in append_plain_cases():
            ok &= compare_append(label, decode._append_kernel, before._append_kernel, values, warps, stages)
    if args.before_gluon_decode:
        ok &= compare_gluon_decode(args.before_gluon_decode)
    if args.variants:
        for fn, label, values, warps, stages in variant_cases(prefill, decode):
            ptx = compile_triton(fn, values, warps, stages).asm["ptx"]
            print(f"{label:40s} {resources(ptx)}", flush=True)
    if args.quantized:
        for fn, label, values, warps, stages in quantized_cases(decode):
            ptx = compile_triton(fn, values, warps, stages).asm["ptx"]
            body = canonical_body(ptx)
            extra = ""
            if fn is decode._append_kernel:
                kept = sum(ROUNDING_CONSTANT in line for line in body) >= 2
                ok &= kept
                extra = "  rounding kept" if kept else "  ROUNDING FOLDED AWAY"
            print(f"{label:40s} {len(body):5d} instructions  [{resources(ptx)}]{extra}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
