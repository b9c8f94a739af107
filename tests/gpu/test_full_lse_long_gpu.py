"""The paths ring attention needs that no kernel serves (head dims other than 64/128; key padding) return output and
LSE from one fused pass (sage_patch/full.py): checked at 128K tokens, the length one rank of a ring holds for a
long video. Rows sampled across the sequence are compared with a float64 computation over all keys."""
import math

import pytest
import torch

import sage_patch

pytestmark = pytest.mark.gpu

N = 131072


def _exact_rows(q, k, v, rows, keep, scale):
    """float64 output and LSE of the query rows `rows` against every key kept by `keep` (Skv,) bool."""
    qs = q[:, :, rows].double()
    s = torch.einsum("bhqd,bhkd->bhqk", qs, k.double()) * scale
    s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, dim=-1), v.double()), lse


# head dim 96: full precision's fused pass; 128 with key padding: the 8b kernel (its INT8 scores move the LSE a little)
@pytest.mark.parametrize("d,padded,lse_atol", [(96, False, 2e-3), (96, True, 2e-3), (128, True, 2e-2)])
def test_lse_from_one_pass_at_128k(d, padded, lse_atol):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 2, N, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    keep = torch.ones(1, N, dtype=torch.bool, device="cuda")
    if padded:
        keep[:, N - 3001:] = False   # key padding at the tail, as a padded text sequence has
    out, lse = sage_patch.attention(q, k, v, attn_mask=keep if padded else None, precision="8b", return_lse=True)
    assert out.shape == q.shape and lse.shape == (1, 2, N) and lse.dtype == torch.float32
    rows = torch.linspace(0, N - 1, 64, device="cuda").long()
    ref_out, ref_lse = _exact_rows(q, k, v, rows, keep[0], 1.0 / math.sqrt(d))
    assert torch.allclose(lse[:, :, rows].double(), ref_lse, atol=lse_atol, rtol=0)
    cos = torch.nn.functional.cosine_similarity(out[:, :, rows].double().flatten(), ref_out.flatten(), dim=0)
    assert cos > 0.999
