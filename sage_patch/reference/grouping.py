"""Quantization groups of tokens, parameterized so the reference simulates exactly a kernel's grouping.

A `Grouping(tile, mod, div)` maps token t to group  (t // tile) * (mod // div) + ((t % tile) % mod) // div.

- mma.sync m16n8 (SageAttention2 on sm_80/89): lane l holds accumulator rows l/4 and l/4+8 and columns
  2*(l%4), 2*(l%4)+1 of every n8 tile. So inside a warp's Q tile, rows with the same r % 8 share a scale
  (Grouping(warp_rows, 8, 1)), and inside a KV block, keys with the same (c % 8) // 2 share one
  (Grouping(block_k, 8, 2)): every thread dequantizes its accumulators with one Q scale and one K scale.
- per_block: Grouping(block, 1, 1); per_token: Grouping(1, 1, 1) (ablations).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Grouping:
    tile: int
    mod: int = 1
    div: int = 1

    def __post_init__(self):
        if self.tile < 1 or self.mod < 1 or self.div < 1 or self.mod % self.div or self.tile % self.mod:
            raise ValueError(f"invalid Grouping {self}: need tile % mod == 0 and mod % div == 0, all >= 1")

    @property
    def per_tile(self) -> int:
        return self.mod // self.div

    def ids(self, n: int, device=None) -> tuple[torch.Tensor, int]:
        """Group id of each of n tokens, and the number of groups."""
        t = torch.arange(n, device=device)
        gid = (t // self.tile) * self.per_tile + ((t % self.tile) % self.mod) // self.div
        n_groups = -(-n // self.tile) * self.per_tile
        return gid, n_groups

    @classmethod
    def per_block(cls, block: int) -> "Grouping":
        return cls(block, 1, 1)

    @classmethod
    def per_token(cls) -> "Grouping":
        return cls(1, 1, 1)


# Defaults: the mma.sync m16n8 layout with 32-row warp tiles and 64-key blocks (SageAttention2, sm_80/sm_89).
MMA_Q_GROUPING = Grouping(32, 8, 1)
MMA_K_GROUPING = Grouping(64, 8, 2)
