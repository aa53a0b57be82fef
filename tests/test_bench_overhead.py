"""The call-cost benchmark (``bench/overhead.py``): its compiled decode loop and the loop's SDPA
twin (transformers' static-cache way) compute the same steps."""

import torch
from helpers import needs_interpreter

from flashkernel.bench import overhead


@needs_interpreter
def test_sdpa_twin_of_the_decode_loop_appends_and_attends_as_flashkernel_does():
    torch.manual_seed(0)
    layers, batch, capacity = 2, 2, 24
    loop = overhead.AttentionOnlyDecoder(batch, capacity, layers, device="cpu", dtype=torch.float16)
    twin = overhead.SdpaStaticCacheDecoder(batch, capacity, layers, device="cpu", dtype=torch.float32)
    twin.k_caches.copy_(loop.k_caches.transpose(2, 3))
    twin.v_caches.copy_(loop.v_caches.transpose(2, 3))
    seqlens = torch.full((batch,), 9, dtype=torch.int32)
    for _ in range(2):
        q, k, v = (torch.randn(layers, batch, 1, heads, overhead.HEAD_DIM, dtype=torch.float16)
                   for heads in (overhead.HEADS, overhead.KV_HEADS, overhead.KV_HEADS))
        out = loop(q, k, v, seqlens)
        expected = twin(q.float(), k.float(), v.float(), seqlens)
        assert out.shape == expected.shape
        torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)
        for mine, theirs in ((loop.k_caches, twin.k_caches), (loop.v_caches, twin.v_caches)):
            assert torch.equal(mine.transpose(2, 3).float(), theirs)  # the new token in the same slot, nothing else
        seqlens += 1
