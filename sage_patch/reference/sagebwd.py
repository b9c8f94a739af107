"""SageBwd: an exact PyTorch simulation of 8-bit trainable attention (SageAttention3 paper, section 4,
Algorithms 2 and 3), forward and backward, in two scale layouts (SageBwdConfig):

- groups="token", pv="input" (the default, and what the GPU kernels sage_patch/kernels/sagebwd compute): one INT8
  scale per token for Q, the smoothed K and dO; P~ V in the input dtype; the backward's P and dS quantized per row
  or per column of their (block_q x block_k) tile after the other operand's scale is folded in (SageBwdConfig's
  comment). Quantization multiplies by 127 / amax, as the kernels do, so both round every tie the same way.
- groups="block", pv="int8" (the paper's algorithms, described below).

Forward (Algorithm 2), per (batch, head), FlashAttention blocks of `block_q` query rows and `block_k` keys:
  - K is smoothed by its token mean (per batch and KV head): K_s = K - mean_j K_j. Softmax is invariant to it;
    the LSE is not, so the LSE handed to the caller has tau q_i . mean(K) added back (tau = the softmax scale).
  - Q, K_s and V are INT8 with one scale per block (s = max|X| / 127 over the block's rows and all channels,
    round-to-nearest-even, clamped to [-127, 127]). V is per block, as the paper's psi (not per channel).
  - Online softmax over the KV blocks in fp32. P~_ij = exp(S_ij - m_ij) is INT8 per token (row) with the scale
    s_P = exp(rowmax(S_ij) - m_ij) / 127, both maxima being the ones the online softmax already holds (no extra max
    pass); `p_scale="unit"` uses 1/127 instead (P~ <= 1), for comparison. The row sum l uses the fp32 P~.
  - O_ij = diag(exp(m_i,j-1 - m_ij)) O_i,j-1 + (P^_ij V^_j) s_P s_V, the integer product exact (as an int32 MMA);
    O = O / l, L = m + log l. Saved for the backward: the INT8 Q^, K^ and their block scales (so the backward does
    not quantize them again), V in the input dtype, O as stored in the input dtype, and the LSE of the smoothed
    scores (the one the recomputed scores need).

Backward (Algorithm 3), over the same (block_q x block_k) tiles:
  D = rowsum(dO o O) (fp32, from dO and O in the input dtype); S = (Q^ K^T) s_Q s_K tau from the saved operands;
  P = exp(S - L_s); dV += (P^^T dO^) s_P s_dO with P^ INT8 per tile and dO^ INT8 per block of block_q rows;
  dP = dO V^T with both operands in the input dtype (FP16/BF16 MMA, fp32 accumulation; `dp="int8"` is the paper's
  ablation: dO^ V^^T with INT8 per-block operands); dS = P o (dP - D), INT8 per tile;
  dQ += (dS^ K^) s_dS s_K and dK += (dS^T Q^) s_dS s_Q, then both times tau. dK and dV are summed over the query
  heads of a GQA group (K and V are never repeated in the result).

Why smoothing K adds no gradient term. K_s,j = K_j - (1/N) sum_j' K_j', so the chain rule gives
  dK_j = dK_s,j - (1/N) sum_j' dK_s,j',   with   sum_j' dK_s,j' = tau sum_i (sum_j' dS_ij') q_i.
Every row of dS sums to zero: sum_j dS_ij = sum_j P_ij dP_ij - D_i sum_j P_ij, and
  D_i = dO_i . O_i = dO_i . (sum_j P_ij V_j) = sum_j P_ij (dO_i . V_j) = sum_j P_ij dP_ij,   sum_j P_ij = 1
(an empty row has P = 0, hence dS = 0). So the term through the mean vanishes and dK = dK_s: the gradient flows to K
itself, the mean being a function of K, with nothing to add. Likewise the shift -tau q_i . mean(K) of row i adds
-tau mean(K) sum_j dS_ij = 0 to dQ_i, so dQ = tau dS K_s, which is what the algorithm computes with the smoothed K^.
(The identity holds in exact arithmetic; the quantized dS sums to nearly zero, and the kernel, like this
simulation, returns dK_s.)

Conventions as the other simulations: layout (B, H, S, D); Hq a multiple of Hkv; bool masks, True = attend, a
(B, Skv) key-padding mask or one broadcastable to (B, Hq, Sq, Skv); causal aligned bottom-right (query i sees keys
j <= i + Skv - Sq); a row with no visible key gives O = 0, LSE -inf and zero gradients, never NaN. Inputs are
never modified. Non-finite values (docs/semantics.md) are never hidden: a NaN or Inf in Q, K, V or dO makes the
scales and sums it enters NaN, so every output and gradient row it reaches is non-finite (and some that share its
scale groups or meet it as 0 x NaN in a product, e.g. an empty row's dQ when K or V is non-finite); other batch
entries and heads are untouched, and an empty row's O stays 0. Integer-valued fp32 operands make every INT8
product exact (|sum| < 2^24), like an int32 MMA.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .grouping import Grouping
from .quant import quantize_int, quantize_int_tiles, quantize_int_with_scale

INT8_MAX = 127


@dataclass(frozen=True)
class SageBwdConfig:
    """The kernel parameters the SageBwd simulation follows."""

    # groups="token" (the GPU kernel's layout, sage_patch.kernels.sagebwd): Q, the smoothed K and dO carry one scale
    # per token, V one per channel in each tile of block_k keys; an operand's scale that varies along a product's
    # reduction is folded into the other operand before it is quantized (P s_dO, dS s_Q, dS s_K), which is then
    # quantized per output row or column inside its tile: P~ per row of each block_k tile (the paper's row scale),
    # P s_dO and dS s_Q per key column of each block_q query tile (dV, dK), dS s_K per query row of each block_k
    # tile (dQ). Every scale then factors out of an exact integer product.
    # groups="block" (the paper's Algorithms 2 and 3): Q, K, V, dO one scale per block of block_q / block_k tokens,
    # P and dS one per (block_q x block_k) tile; 32 x 32 is the coarsest that keeps dQ, dK and dV at cosine >= 0.997
    # against float64 at N=4K on structured inputs (64 x 64 gives dQ 0.9931-0.9970).
    groups: str = "token"
    block_q: int = 64         # query rows per tile: token groups: P s_dO / dS s_Q column groups; block: Q, dO scales
    block_k: int = 64         # keys per tile: the online-softmax step, P~ and dS s_K row groups, V's tile; block: K
    smooth_k: bool = True     # subtract K's token mean (per batch and KV head)
    dp: str = "input"         # dO V^T: "input" (operands in the input dtype, fp32 accumulation: the paper) or
                              # "int8" (INT8 per-block operands: the paper's ablation; groups="block" only)
    p_scale: str = "rowmax"   # forward P~ row scale: "rowmax" (exp(rowmax(S_ij) - m_ij) / 127) or "unit" (1/127)
    # forward P~ V: "int8" (P~ INT8 per row of each key tile, V INT8: the paper) or "input" (P~ rounded to the input
    # dtype, V as given, fp32 accumulation). The forward's P~ error reaches every gradient through
    # Delta = rowsum(dO o O): at N=2K on structured inputs dQ's cosine is 0.9972 with INT8 P~ over 64-key tiles,
    # 0.9988 over 32-key tiles, 0.9993 over 16-key tiles.
    pv: str = "input"

    def __post_init__(self):
        if self.groups not in ("token", "block"):
            raise ValueError(f"SageBwdConfig.groups must be 'token' or 'block', got {self.groups!r}")
        for name in ("block_q", "block_k"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"SageBwdConfig.{name} must be a positive int, got {val!r}")
        if self.dp not in ("input", "int8"):
            raise ValueError(f"SageBwdConfig.dp must be 'input' or 'int8', got {self.dp!r}")
        if self.dp == "int8" and self.groups != "block":
            raise ValueError("SageBwdConfig.dp='int8' (the paper's ablation) needs groups='block'")
        if self.pv not in ("int8", "input"):
            raise ValueError(f"SageBwdConfig.pv must be 'int8' or 'input', got {self.pv!r}")
        if self.p_scale not in ("rowmax", "unit"):
            raise ValueError(f"SageBwdConfig.p_scale must be 'rowmax' or 'unit', got {self.p_scale!r}")

    @property
    def token(self) -> bool:
        return self.groups == "token"


# A module-level default (torch.compile reads a global; it cannot build the dataclass inside a graph).
DEFAULT_SAGEBWD_CONFIG = SageBwdConfig()


class SageBwdSaved(NamedTuple):
    """What the forward keeps for the backward."""

    q_int: torch.Tensor          # int8 (B, Hq, Sq, D)
    q_scale: torch.Tensor        # fp32 (B, Hq, ceil(Sq / block_q))
    k_int: torch.Tensor          # int8 (B, Hkv, Skv, D): the smoothed K
    k_scale: torch.Tensor        # fp32 (B, Hkv, ceil(Skv / block_k))
    v: torch.Tensor              # (B, Hkv, Skv, Dv), the input dtype (dP = dO V^T runs on it)
    out: torch.Tensor            # (B, Hq, Sq, Dv), the input dtype: O as the kernel stores it
    lse: torch.Tensor            # fp32 (B, Hq, Sq): LSE of the smoothed scores, -inf on empty rows
    attn_mask: torch.Tensor | None
    is_causal: bool
    scale: float
    config: SageBwdConfig


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def quantize_blocks(x: torch.Tensor, block: int):
    """INT8 with one scale per block of `block` rows (tokens) over all channels. x (..., S, D).
    Returns (integers as fp32, scale (..., ceil(S / block))). block=1 (per token) is quantize_tokens."""
    if block == 1:
        return quantize_tokens(x)
    gid, n = Grouping.per_block(block).ids(x.shape[-2], x.device)
    return quantize_int(x.float(), gid, n, INT8_MAX)


def _int8_by_amax(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """rint(x * (127 / amax)) (0 where amax = 0): the kernels' arithmetic (a multiply by the reciprocal, not a
    division by the scale), so that both land on the same side of every rounding tie."""
    inv = torch.where(amax > 0, INT8_MAX / torch.where(amax > 0, amax, 1.0), 0.0)
    return torch.round(x * inv)


def quantize_tokens(x: torch.Tensor):
    """INT8 with one scale per token (row) over all channels: (integers as fp32, scale (..., S))."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    return _int8_by_amax(x, amax.unsqueeze(-1)), amax / INT8_MAX


def _row_scale(scale: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """A per-block scale (..., T) repeated on each of the n rows of its block: (..., n)."""
    return scale.repeat_interleave(block, dim=-1)[..., :n]


def _mask_rows(mask, i0: int, i1: int):
    """Rows i0:i1 of a bool mask broadcastable to (B, H, Sq, Skv) (a size-1 query dim holds for every row)."""
    if mask is None or mask.shape[-2] == 1:
        return mask
    return mask[..., i0:i1, :]


def _tiles(x: torch.Tensor, rows: int, cols: int | None = None) -> torch.Tensor:
    """Zero-pad the last two dims to multiples of (rows, cols) and split them into tiles:
    (..., R, C) -> (..., R/rows, rows, C/cols, cols), or (..., R/rows, rows, C) when cols is None."""
    pr = (-x.shape[-2]) % rows
    pc = 0 if cols is None else (-x.shape[-1]) % cols
    x = torch.nn.functional.pad(x, (0, pc, 0, pr))
    x = x.reshape(*x.shape[:-2], -1, rows, x.shape[-1])
    return x if cols is None else x.reshape(*x.shape[:-1], -1, cols)


def _check(q, k, v, cfg):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (B, H, S, D), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if not isinstance(cfg, SageBwdConfig):
        raise TypeError(f"config must be a SageBwdConfig or None, got {type(cfg).__name__}")


def quantize_tile_channels(x: torch.Tensor, block: int):
    """INT8 with one scale per channel in each block of `block` tokens (groups="token" V). x (..., S, D).
    Returns (integers as fp32 (..., S, D), scale (..., ceil(S / block), D))."""
    s = x.shape[-2]
    xt = _tiles(x.float(), block)                                   # (..., T, block, D), zero rows change no amax
    scale = xt.abs().amax(dim=-2) / INT8_MAX
    q = quantize_int_with_scale(xt, scale.unsqueeze(-2), INT8_MAX)
    return q.flatten(-3, -2)[..., :s, :], scale


def quantize_cols(x: torch.Tensor, block_rows: int):
    """INT8 with one scale per column in each block of `block_rows` rows: x (..., R, C) -> (integers as fp32 in
    tiles (..., ceil(R / block_rows), block_rows, C), scale (..., ceil(R / block_rows), C)). Padded rows are 0."""
    xt = _tiles(x.float(), block_rows)
    amax = xt.abs().amax(dim=-2)
    return _int8_by_amax(xt, amax.unsqueeze(-2)), amax / INT8_MAX


def quantize_rows(x: torch.Tensor, block_cols: int):
    """INT8 with one scale per row in each block of `block_cols` columns: x (..., R, C) -> (integers as fp32 in
    tiles (..., R, ceil(C / block_cols), block_cols), scale (..., R, ceil(C / block_cols))). Padded columns are 0."""
    pad = (-x.shape[-1]) % block_cols
    xt = torch.nn.functional.pad(x.float(), (0, pad)).reshape(*x.shape[:-1], -1, block_cols)
    amax = xt.abs().amax(dim=-1)
    return _int8_by_amax(xt, amax.unsqueeze(-1)), amax / INT8_MAX


def sagebwd_forward(q, k, v, *, is_causal=False, scale=None, attn_mask=None, config=None):
    """The SageBwd training forward. q (B, Hq, Sq, D), k (B, Hkv, Skv, D), v (B, Hkv, Skv, Dv).

    attn_mask: None, a (B, Skv) bool key-padding mask, or bool broadcastable to (B, Hq, Sq, Skv); True = attend.
    Returns (out fp32 (B, Hq, Sq, Dv), lse fp32 (B, Hq, Sq) natural log of the unsmoothed scores (-inf on empty
    rows), saved: SageBwdSaved for sagebwd_backward).
    """
    from ..masks import combined_bool_mask

    cfg = DEFAULT_SAGEBWD_CONFIG if config is None else config
    _check(q, k, v, cfg)
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    groups = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    gq, gk = (1, 1) if cfg.token else (cfg.block_q, cfg.block_k)    # tokens per Q / K scale
    qf, kf = q.float(), k.float()
    k_mean = kf.mean(dim=-2, keepdim=True) if cfg.smooth_k else None
    if k_mean is not None:
        kf = kf - k_mean
    q_int, q_scale = quantize_blocks(qf, gq)
    k_int, k_scale = quantize_blocks(kf, gk)
    # V: per channel in each key tile (token groups; a (B, Hkv, Tk, Dv) scale) or per block (B, Hkv, Tk)
    if cfg.pv == "input":
        v_int, v_scale = v.float(), None
    else:
        v_int, v_scale = quantize_tile_channels(v, cfg.block_k) if cfg.token else quantize_blocks(v, cfg.block_k)
    mask = combined_bool_mask(attn_mask, is_causal, sq, skv, q.device)

    qs_row = _row_scale(q_scale, gq, sq).unsqueeze(-1)                  # (B, Hq, Sq, 1)
    ke, ks_col = _expand_kv(k_int, groups), _row_scale(_expand_kv(k_scale, groups), gk, skv).unsqueeze(-2)
    ve, vse = _expand_kv(v_int, groups), v_scale if v_scale is None else _expand_kv(v_scale, groups)
    shape = (b, hq, sq)
    m = torch.full(shape, -math.inf, device=q.device)
    l = torch.zeros(shape, device=q.device)
    acc = torch.zeros(*shape, v.shape[-1], device=q.device)
    for jb, j0 in enumerate(range(0, skv, cfg.block_k)):
        j1 = min(j0 + cfg.block_k, skv)
        s = (q_int @ ke[..., j0:j1, :].transpose(-1, -2)) * qs_row * ks_col[..., j0:j1] * scale
        if mask is not None:
            s = s.masked_fill(~mask[..., j0:j1], -math.inf)
        rowmax = s.amax(dim=-1)
        m_new = torch.maximum(m, rowmax)
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_safe.unsqueeze(-1))
        alpha = torch.exp(m - m_safe)
        l = l * alpha + p.sum(dim=-1)
        if cfg.pv == "input":
            acc = acc * alpha.unsqueeze(-1) + p.to(v.dtype).float() @ ve[..., j0:j1, :]
            m = m_new
            continue
        # P~'s row maximum in this block is exp(rowmax - m_new): known from the online softmax, no extra pass
        s_p = torch.exp(rowmax - m_safe) / INT8_MAX if cfg.p_scale == "rowmax" else torch.full_like(m, 1 / INT8_MAX)
        p_int = quantize_int_with_scale(p, s_p.unsqueeze(-1), INT8_MAX)
        blk = p_int @ ve[..., j0:j1, :]
        v_fac = vse[..., jb, None, :] if cfg.token else vse[..., jb, None, None]
        acc = acc * alpha.unsqueeze(-1) + blk * s_p.unsqueeze(-1) * v_fac
        m = m_new
    # l == 0 exactly when no key is visible; a NaN from a non-finite input is not 0, so it propagates
    nonempty = l != 0
    out = torch.where(nonempty.unsqueeze(-1), acc / torch.where(nonempty, l, 1.0).unsqueeze(-1), 0.0)
    lse_s = torch.where(nonempty, m + torch.log(torch.where(nonempty, l, 1.0)), -math.inf)
    lse = lse_s
    if k_mean is not None:  # softmax ignores the row shift tau q_i . mean(K); the LSE does not
        lse = lse_s + (qf @ _expand_kv(k_mean, groups).transpose(-1, -2)).squeeze(-1) * scale
    saved = SageBwdSaved(q_int.to(torch.int8), q_scale, k_int.to(torch.int8), k_scale, v, out.to(q.dtype), lse_s,
                         attn_mask, bool(is_causal), scale, cfg)
    return out, lse, saved


def _rows_per_chunk(b, hq, skv, d, dv, cfg) -> int:
    """Query rows per backward step: a multiple of block_q bounding its temporaries to about 256 MiB."""
    tiles_k = -(-skv // cfg.block_k)
    per_row = b * hq * (8 * skv + tiles_k * max(d, dv) + 2 * skv * max(d, dv) // cfg.block_q) * 4
    return cfg.block_q * max(1, (256 << 20) // max(per_row * cfg.block_q, 1))


def sagebwd_backward(dout, saved: SageBwdSaved):
    """The SageBwd backward. dout (B, Hq, Sq, Dv), taken in the input dtype (as the kernel receives it).
    Returns (dq (B, Hq, Sq, D), dk (B, Hkv, Skv, D), dv (B, Hkv, Skv, Dv)), fp32."""
    from ..masks import combined_bool_mask

    cfg, scale = saved.config, saved.scale
    bq, bk = cfg.block_q, cfg.block_k
    gq, gk = (1, 1) if cfg.token else (bq, bk)
    b, hq, sq, d = saved.q_int.shape
    hkv, skv, dv = saved.v.shape[1], saved.v.shape[2], saved.v.shape[3]
    groups = hq // hkv
    tk = -(-skv // bk)
    dtype = saved.v.dtype
    do = dout.to(dtype).float()
    delta = (do * saved.out.float()).sum(dim=-1)                         # D = rowsum(dO o O), (B, Hq, Sq)
    do_int, do_scale = quantize_blocks(do, gq)                          # per token, or per block of block_q rows
    dos_row = _row_scale(do_scale, gq, sq).unsqueeze(-1)                # (B, Hq, Sq, 1)
    q_int = saved.q_int.float()
    qs_row = _row_scale(saved.q_scale, gq, sq).unsqueeze(-1)
    ke = _expand_kv(saved.k_int.float(), groups)                        # (B, Hq, Skv, D)
    kse = _expand_kv(saved.k_scale, groups)                             # (B, Hq, Tk) or (B, Hq, Skv)
    ks_col = _row_scale(kse, gk, skv)[..., None, :]                     # (B, Hq, 1, Skv)
    if cfg.dp == "input":
        v_op = _expand_kv(saved.v.float(), groups)
    else:
        v_int, v_scale = quantize_blocks(saved.v, bk)
        v_op, vs_col = _expand_kv(v_int, groups), _row_scale(_expand_kv(v_scale, groups), bk, skv)[..., None, :]
    mask = combined_bool_mask(saved.attn_mask, saved.is_causal, sq, skv, saved.q_int.device)
    nonempty = saved.lse != -math.inf
    lse_safe = torch.where(nonempty, saved.lse, 0.0)                    # an empty row's scores are all -inf

    kt = _tiles(ke, bk)                                                 # (B, Hq, Tk, bk, D)
    dq = torch.zeros(b, hq, sq, d, device=q_int.device)
    if cfg.token:
        dk = torch.zeros(b, hq, skv, d, device=q_int.device)
        dvv = torch.zeros(b, hq, skv, dv, device=q_int.device)
    else:
        dk = torch.zeros(b, hq, tk, bk, d, device=q_int.device)
        dvv = torch.zeros(b, hq, tk, bk, dv, device=q_int.device)
    rows = _rows_per_chunk(b, hq, skv, d, dv, cfg)
    for i0 in range(0, sq, rows):
        i1 = min(i0 + rows, sq)
        ib0, ib1 = i0 // bq, -(-i1 // bq)
        s = (q_int[..., i0:i1, :] @ ke.transpose(-1, -2)) * qs_row[..., i0:i1, :] * ks_col * scale
        mrows = _mask_rows(mask, i0, i1)
        if mrows is not None:
            s = s.masked_fill(~mrows, -math.inf)
        p = torch.exp(s - lse_safe[..., i0:i1, None])                   # masked keys and empty rows: exactly 0
        dot = _tiles(do_int[..., i0:i1, :], bq)                         # (B, Hq, tq, bq, Dv)
        qt = _tiles(q_int[..., i0:i1, :], bq)                           # (B, Hq, tq, bq, D)
        if cfg.token:
            # dV_j += sum_i P_ij dO_i: P s_dO (the dO scale folded in) INT8 per key column of each query tile
            p_int, p_sc = quantize_cols(p * dos_row[..., i0:i1, :], bq)  # (B, Hq, tq, bq, Skv), (B, Hq, tq, Skv)
            dvv += (torch.einsum("...tij,...tid->...tjd", p_int, dot) * p_sc[..., None]).sum(dim=-3)
        else:
            p_int, p_scale = quantize_int_tiles(p, bq, bk, INT8_MAX)    # p_scale (B, Hq, tq, Tk)
            pt = _tiles(p_int, bq, bk)                                  # (B, Hq, tq, bq, Tk, bk)
            # dV_j += sum_i (P^_ij^T dO^_i) s_P,ij s_dO,i
            w = p_scale * do_scale[..., ib0:ib1, None]
            dvv += (torch.einsum("...ibjk,...ibd->...ijkd", pt, dot) * w[..., None, None]).sum(dim=-4)
        if cfg.dp == "input":
            dp = do[..., i0:i1, :] @ v_op.transpose(-1, -2)
        else:
            dp = (do_int[..., i0:i1, :] @ v_op.transpose(-1, -2)) * dos_row[..., i0:i1, :] * vs_col
        ds = p * (dp - delta[..., i0:i1, None])
        if cfg.token:
            # dQ_i += sum_j dS_ij K_j: dS s_K INT8 per query row of each key tile
            ds_int, ds_sc = quantize_rows(ds * ks_col, bk)               # (B, Hq, r, Tk, bk), (B, Hq, r, Tk)
            part = torch.einsum("...itk,...tkd->...itd", ds_int, kt) * ds_sc[..., None]
            dq[..., i0:i1, :] = part.sum(dim=-2)
            # dK_j += sum_i dS_ij Q_i: dS s_Q INT8 per key column of each query tile
            ds_int, ds_sc = quantize_cols(ds * qs_row[..., i0:i1, :], bq)
            dk += (torch.einsum("...tij,...tid->...tjd", ds_int, qt) * ds_sc[..., None]).sum(dim=-3)
            continue
        ds_int, ds_scale = quantize_int_tiles(ds, bq, bk, INT8_MAX)
        dst = _tiles(ds_int, bq, bk)                                    # (B, Hq, tq, bq, Tk, bk)
        # dQ_i += sum_j (dS^_ij K^_j) s_dS,ij s_K,j
        w = ds_scale * kse[..., None, :]
        part = torch.einsum("...ibjk,...jkd->...ibjd", dst, kt) * w[..., :, None, :, None]
        dq[..., i0:i1, :] = part.sum(dim=-2).flatten(-3, -2)[..., : i1 - i0, :]
        # dK_j += sum_i (dS^_ij^T Q^_i) s_dS,ij s_Q,i
        w = ds_scale * saved.q_scale[..., ib0:ib1, None]
        dk += (torch.einsum("...ibjk,...ibd->...ijkd", dst, qt) * w[..., None, None]).sum(dim=-4)
    dq = dq * scale
    if not cfg.token:
        dk, dvv = dk.flatten(-3, -2)[..., :skv, :], dvv.flatten(-3, -2)[..., :skv, :]
    dk = (dk * scale).reshape(b, hkv, groups, skv, d).sum(dim=2)
    dvv = dvv.reshape(b, hkv, groups, skv, dv).sum(dim=2)
    return dq, dk, dvv
