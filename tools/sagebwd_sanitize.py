#!/usr/bin/env python3
"""A few SageBwd training calls for compute-sanitizer, through each training variant this GPU has (the Triton pair;
on sm_90 also sagebwd-hopper, the sm_90a forward and backward, its forward also called directly where the variant
routes it to the Triton one): every kernel of the forward and the backward, with GQA, bottom-right causal, key
padding, odd lengths, D 64 and 128.

    compute-sanitizer --tool memcheck --error-exitcode 9 python tools/sagebwd_sanitize.py     (tools/gpu_check.sh)

--deterministic: under torch.use_deterministic_algorithms(True) (sagebwd-hopper's deterministic mode: its tile
counters and the reversed causal grid), e.g.
    compute-sanitizer --tool racecheck --kernel-name kns=hopper_bwd python tools/sagebwd_sanitize.py --deterministic
"""
import itertools
import sys

import torch

from sage_patch.kernels.sagebwd import _forward
from sage_patch.trainable import sagebwd_attention


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    kernels = ("sagebwd-triton",) + (("sagebwd-hopper",) if torch.cuda.get_device_capability() == (9, 0) else ())
    for kernel, (b, hq, hkv, sq, skv, d, causal, padding) in itertools.product(
            kernels, [(1, 4, 2, 333, 333, 128, True, True), (2, 3, 3, 200, 150, 64, False, False),
                      (1, 2, 1, 70, 129, 64, True, False),
                      # Sq % 16 == 0: the sm_90a backward's TMA loads of whole tiles (5D maps), then a partial tile
                      (1, 4, 2, 1040, 1040, 128, True, False), (2, 4, 2, 256, 256, 64, False, True)]):
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                   for h, s in ((hq, sq), (hkv, skv), (hkv, skv)))
        mask = None
        if padding:
            mask = torch.ones(b, skv, dtype=torch.bool, device="cuda")
            mask[0, -50:] = False
        out = sagebwd_attention(q, k, v, is_causal=causal, scale=None, attn_mask=mask, kernel=kernel)
        out.float().pow(2).mean().backward()
        if kernel == "sagebwd-hopper":  # the sm_90a forward at every shape (hopper.TRITON_FORWARD_BELOW)
            _forward(q.detach(), k.detach(), v.detach(), is_causal=causal, scale=d ** -0.5, key_padding_mask=mask,
                     smooth_k=True, cuda=True)
    torch.cuda.synchronize()
    print(f"sagebwd_sanitize: done ({', '.join(kernels)})")


if __name__ == "__main__":
    if "--deterministic" in sys.argv[1:]:
        torch.use_deterministic_algorithms(True)
    main()
