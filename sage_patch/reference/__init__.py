"""Reference numerics: the ground truth for tests and the path on machines without a supported GPU."""
from .exact import exact_attention
from .grouping import MMA_K_GROUPING, MMA_Q_GROUPING, Grouping
from .quant import (
    quantize_fp8_per_channel,
    quantize_fp8_sampled_blocks,
    quantize_int,
    quantize_int_tiles,
    quantize_int_with_scale,
    quantize_nvfp4,
    round_fp4_e2m1,
    round_fp8_e4m3,
    round_mantissa,
)
from .sagebwd import SageBwdConfig, SageBwdSaved, sagebwd_backward, sagebwd_forward
from .simulate import QUANTIZED, SimConfig, simulate

__all__ = [
    "exact_attention", "simulate", "SimConfig", "Grouping", "MMA_Q_GROUPING", "MMA_K_GROUPING", "QUANTIZED",
    "quantize_int", "quantize_fp8_per_channel", "quantize_fp8_sampled_blocks", "quantize_nvfp4", "round_fp8_e4m3",
    "round_fp4_e2m1", "round_mantissa", "quantize_int_tiles", "quantize_int_with_scale",
    "sagebwd_forward", "sagebwd_backward", "SageBwdConfig", "SageBwdSaved",
]
