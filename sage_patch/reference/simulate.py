"""Exact PyTorch simulations of the quantized precisions ("8b", "4b", "fp4").

Each simulation reproduces a kernel's arithmetic step by step: smoothing, per-group quantization, online softmax
over KV blocks in fp32, quantization of P, and two-level accumulation of P~V. `SimConfig` carries the block sizes
and groupings so a kernel can be compared against the simulation of its OWN layout.

Layout here is always (B, H, S, D); masks are bool, True = attend, broadcastable to (B, H, Sq, Skv).
Inputs are never modified: every step works on fp32 copies.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from .grouping import MMA_K_GROUPING, MMA_Q_GROUPING, Grouping
from .quant import (
    FP8_E4M3_MAX,
    nvfp4_tensor_scale,
    quantize_fp8_per_channel,
    quantize_fp8_sampled_blocks,
    quantize_int,
    quantize_nvfp4,
    round_fp8_e4m3,
    round_mantissa,
    sample_tokens,
)

QUANTIZED = ("8b", "4b", "fp4")


@dataclass(frozen=True)
class SimConfig:
    """The kernel parameters a simulation follows. Defaults: SageAttention2 mma.sync kernels (sm_80/sm_89)."""

    block_k: int = 64                           # KV block: online-softmax step and first accumulation level
    q_group: Grouping = field(default=MMA_Q_GROUPING)   # per-thread Q scale groups (INT8/INT4)
    k_group: Grouping = field(default=MMA_K_GROUPING)   # per-thread K scale groups (INT8/INT4)
    q_smooth_block: int = 128                   # rows per Q-smoothing mean ("4b")
    smooth_k: bool = True                       # subtract mean_over_tokens(K)
    smooth_q: bool | None = None                # None: on for "4b", off otherwise
    pv: str = "fp8"                             # P~V operands: "fp8" (E4M3, sm_89+) or "fp16" (sm_80/86)
    two_level: bool = True                      # per-block P~V accumulator added into an fp32 one
    pv_accum_bits: int | None = None            # mantissa bits of the MMA accumulator (None: fp32)
    pv_chunk: int = 32                          # keys per MMA instruction (k32) for pv_accum_bits
    fp4_block: int = 16                         # NVFP4 microscaling block
    p_scaling: str = "two_level"                # fp4 P~: "two_level" (row scale, then microscale) or "direct"
    row_sum: str = "p"                          # output normaliser: "p" (fp32 sum of p) or "operand" (the sum of
                                                # the quantized P~, as the tensor cores take it); the LSE uses "p"
    stats_sample: int = 0                       # 0: K/V means and V's fp8 scale from all tokens; n: means from n
                                                # evenly spaced tokens (softmax is invariant to K's shift, V's is
                                                # added back), V's scale a sampled per-channel base times a power of
                                                # two per block_k block (quantize_fp8_sampled_blocks)

    @classmethod
    def of(cls, layout) -> "SimConfig":
        """The SimConfig of a kernel's numerics layout given as data (kernels.registry.KernelLayout: fields named
        as here, groupings as (tile, mod, div))."""
        fields = {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)}
        return cls(**{k: Grouping(*v) if k in ("q_group", "k_group") else v for k, v in fields.items()})

    def __post_init__(self):
        if self.block_k < 1 or self.block_k % self.fp4_block and self.block_k % 16:
            raise ValueError(f"block_k must be a positive multiple of 16, got {self.block_k}")
        if self.pv not in ("fp8", "fp16"):
            raise ValueError(f"pv must be 'fp8' or 'fp16', got {self.pv!r}")
        if self.p_scaling not in ("two_level", "direct"):
            raise ValueError(f"p_scaling must be 'two_level' or 'direct', got {self.p_scaling!r}")
        if self.row_sum not in ("p", "operand"):
            raise ValueError(f"row_sum must be 'p' or 'operand', got {self.row_sum!r}")
        if self.stats_sample < 0:
            raise ValueError(f"stats_sample must be >= 0 (0: all tokens), got {self.stats_sample}")


# A module-level default: torch.compile cannot build SimConfig() inside a graph (its Grouping defaults are objects
# dynamo has no source for), but it can read this global.
_DEFAULT_CONFIG = SimConfig()


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _q_smoothing(q: torch.Tensor, block: int) -> torch.Tensor:
    """Per-block mean of Q rows, repeated on each row of its block: (B, H, Sq, D)."""
    sq = q.shape[-2]
    pad = (-sq) % block
    qp = torch.nn.functional.pad(q, (0, 0, 0, pad))
    sums = qp.reshape(*q.shape[:-2], -1, block, q.shape[-1]).sum(-2)
    counts = torch.full((sums.shape[-2],), float(block), device=q.device)
    counts[-1] = block - pad
    means = sums / counts[:, None]
    return means.repeat_interleave(block, dim=-2)[..., :sq, :]


class _Quantized:
    """Q, K, V after smoothing and quantization, dequantized lazily per KV block."""

    def __init__(self, precision, q, k, v, cfg: SimConfig, smooth_v: bool):
        self.precision, self.cfg = precision, cfg
        groups = q.shape[1] // k.shape[1]
        qf, kf, vf = q.float(), k.float(), v.float()
        # the tokens the statistics come from: all, or cfg.stats_sample evenly spaced ones
        idx = sample_tokens(kf.shape[-2], cfg.stats_sample, kf.device) if cfg.stats_sample else None
        pick = (lambda x: x) if idx is None else (lambda x: x.index_select(-2, idx))
        self.lse_shift = None
        if cfg.smooth_k:
            k_mean = pick(kf).mean(dim=-2, keepdim=True)
            kf = kf - k_mean
            # Softmax ignores the per-row shift q.k_mean, the LSE does not: it is added back to the LSE.
            self.lse_shift = (qf @ _expand_kv(k_mean, groups).transpose(-1, -2)).squeeze(-1)
        self.v_mean = None
        if smooth_v:
            v_mean = pick(vf).mean(dim=-2, keepdim=True)
            self.v_mean = _expand_kv(v_mean, groups)
            vf = vf - v_mean
        smooth_q = cfg.smooth_q if cfg.smooth_q is not None else precision == "4b"
        self.q_mean = _q_smoothing(qf, cfg.q_smooth_block) if smooth_q and precision != "fp4" else None
        if self.q_mean is not None:
            qf = qf - self.q_mean
        self.k_smoothed = _expand_kv(kf, groups)  # used for the Delta S correction of Q smoothing

        if precision in ("8b", "4b"):
            qmax = 127 if precision == "8b" else 7
            qg, nqg = cfg.q_group.ids(qf.shape[-2], qf.device)
            kg, nkg = cfg.k_group.ids(kf.shape[-2], kf.device)
            qi, qs = quantize_int(qf, qg, nqg, qmax)
            ki, ks = quantize_int(kf, kg, nkg, qmax)
            # Integer-valued fp32 operands: their products sum exactly (|sum| < 2^24), like an int32 MMA.
            self.q_op = qi
            self.q_scale = qs.gather(-1, qg.expand(*qs.shape[:-1], -1))           # (B, H, Sq)
            self.k_op = _expand_kv(ki, groups)
            self.k_scale = _expand_kv(ks.gather(-1, kg.expand(*ks.shape[:-1], -1)), groups)  # (B, H, Skv)
            if cfg.pv == "fp8" and idx is not None:
                v8, vs = quantize_fp8_sampled_blocks(vf, pick(vf), cfg.block_k)
                self.v_op, self.v_scale = _expand_kv(v8, groups), _expand_kv(vs, groups)
            elif cfg.pv == "fp8":
                v8, vs = quantize_fp8_per_channel(vf)
                self.v_op, self.v_scale = _expand_kv(v8, groups), _expand_kv(vs, groups)
            else:
                self.v_op, self.v_scale = _expand_kv(vf.half().float(), groups), None
        elif precision == "fp4":
            b = cfg.fp4_block
            self.q_op = quantize_nvfp4(qf, b, nvfp4_tensor_scale(qf, (-2, -1)))
            self.k_op = _expand_kv(quantize_nvfp4(kf, b, nvfp4_tensor_scale(kf, (-2, -1))), groups)
            self.q_scale = self.k_scale = None
            vt = vf.transpose(-1, -2)  # P~V reduces over tokens: V's microscaling blocks run along tokens
            vq = quantize_nvfp4(vt, b, nvfp4_tensor_scale(vt, (-2, -1))).transpose(-1, -2)
            self.v_op, self.v_scale = _expand_kv(vq, groups), None
        else:
            raise ValueError(f"precision must be one of {QUANTIZED} here, got {precision!r}")

    def scores(self, j0: int, j1: int, scale: float) -> torch.Tensor:
        s = self.q_op @ self.k_op[..., j0:j1, :].transpose(-1, -2)
        if self.q_scale is not None:
            s = s * self.q_scale.unsqueeze(-1) * self.k_scale[..., None, j0:j1]
        if self.q_mean is not None:  # Delta S = q_mean . gamma(K)^T, in fp32
            s = s + self.q_mean @ self.k_smoothed[..., j0:j1, :].transpose(-1, -2)
        return s * scale

    def pv_block(self, p: torch.Tensor, j0: int, j1: int):
        """The block's P~V product with P~ quantized as the precision prescribes (V's scale applied later), and the
        row sums of that P~ accumulated like the product (a column of ones appended to V), in p's units."""
        cfg, v = self.cfg, self.v_op[..., j0:j1, :]
        if self.precision == "fp4":
            row_scale = None
            if cfg.p_scaling == "two_level":
                row_scale = p.amax(dim=-1, keepdim=True) / (FP8_E4M3_MAX * 6.0)
            op, div, chunked = quantize_nvfp4(p, cfg.fp4_block, row_scale), 1.0, False
        elif cfg.pv == "fp8":
            op, div, chunked = round_fp8_e4m3(p * FP8_E4M3_MAX), FP8_E4M3_MAX, True
        else:
            op, div, chunked = p.half().float(), 1.0, True
        v1 = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)
        out = _chunked_matmul(op, v1, cfg) if chunked else op @ v1
        return out[..., :-1] / div, out[..., -1] / div

    def finish(self, o: torch.Tensor, nonempty: torch.Tensor) -> torch.Tensor:
        if self.v_scale is not None:
            o = o * self.v_scale
        if self.v_mean is not None:
            o = torch.where(nonempty.unsqueeze(-1), o + self.v_mean, o)
        return o


def _chunked_matmul(p, v, cfg: SimConfig):
    if cfg.pv_accum_bits is None:
        return p @ v
    acc = None
    for c0 in range(0, p.shape[-1], cfg.pv_chunk):
        part = p[..., c0:c0 + cfg.pv_chunk] @ v[..., c0:c0 + cfg.pv_chunk, :]
        acc = part if acc is None else round_mantissa(acc + part, cfg.pv_accum_bits)
    return round_mantissa(acc, cfg.pv_accum_bits)


def simulate(q, k, v, precision, *, is_causal=False, scale=None, attn_mask=None, return_lse=False,
             smooth_v=False, config=None, window_left=-1):
    """Simulate a quantized precision. q (B, Hq, Sq, D), k/v (B, Hkv, Skv, D|Dv), Hq % Hkv == 0.

    config: a SimConfig, a kernel's numerics layout (sage_patch.kernels.reference_config: SimConfig.of), or None
    (the SageAttention2 mma.sync defaults).

    attn_mask: None or bool broadcastable to (B, Hq, Sq, Skv), True = attend. Causal is bottom-right aligned.
    window_left >= 0: key j is hidden from query i when j < i + Skv - Sq - window_left, as the kernels mask it (their
    skipped key blocks are the fully masked ones here, which change nothing: p = 0 and the running max stays).
    Returns out (fp32, (B, Hq, Sq, Dv)) and, with return_lse, the natural-log LSE (fp32, (B, Hq, Sq); -inf on empty rows).
    """
    from ..masks import combined_bool_mask

    cfg = config if isinstance(config, SimConfig) else _DEFAULT_CONFIG if config is None else SimConfig.of(config)
    sq, skv = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    qt = _Quantized(precision, q, k, v, cfg, smooth_v)
    mask = combined_bool_mask(attn_mask, is_causal, sq, skv, q.device, window_left)

    shape = (*q.shape[:-2], sq)
    m = torch.full(shape, -math.inf, device=q.device)
    l = torch.zeros(shape, device=q.device)
    l_op = torch.zeros(shape, device=q.device)  # the same over the quantized P~ (row_sum="operand")
    acc = torch.zeros(*shape, v.shape[-1], device=q.device)
    for j0 in range(0, skv, cfg.block_k):
        j1 = min(j0 + cfg.block_k, skv)
        s = qt.scores(j0, j1, scale)
        if mask is not None:
            s = s.masked_fill(~mask[..., j0:j1], -math.inf)
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_safe.unsqueeze(-1))
        alpha = torch.exp(m - m_safe)
        blk, op_sum = qt.pv_block(p, j0, j1)
        l = l * alpha + p.sum(dim=-1)
        l_op = l_op * alpha + op_sum
        if cfg.two_level or cfg.pv_accum_bits is None:
            acc = acc * alpha.unsqueeze(-1) + blk
        else:  # one narrow accumulator for the whole row: the error two-level accumulation avoids
            acc = round_mantissa(acc * alpha.unsqueeze(-1) + blk, cfg.pv_accum_bits)
        m = m_new
    # l == 0 exactly when no key is visible (the row maximum contributes exp(0) = 1 otherwise); a NaN reached from
    # a non-finite input is not 0, so it propagates instead of becoming an empty (zero) row. The kernels test the same.
    nonempty = l != 0
    norm = l_op if cfg.row_sum == "operand" else l
    out = torch.where(nonempty.unsqueeze(-1), acc / torch.where(nonempty, norm, 1.0).unsqueeze(-1), 0.0)
    out = qt.finish(out, nonempty)
    if not return_lse:
        return out
    lse = m + torch.log(torch.where(nonempty, l, 1.0))
    if qt.lse_shift is not None:
        lse = lse + qt.lse_shift * scale
    lse = torch.where(nonempty, lse, -math.inf)
    return out, lse
