"""Rotary-embedding tables: the cos|sin rows every backend's rope op reads, built once per model at load
(plain, linear-scaled, Llama 3's and LongRoPE's frequency factors, YaRN)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class YarnParams:
    """YaRN rope scaling as llama.cpp's ``rope_yarn`` and transformers' ``_compute_yarn_parameters`` apply it:
    frequency pair i is ``interp * (1 - mix) + extrap * mix`` with ``interp = extrap / scale`` and ``mix =
    ext_factor * (1 - ramp(i))``, the ramp rising from 0 to 1 between the dims where the original context
    (`original_context`) holds `beta_fast` and `beta_slow` rotations (rounded out to whole dims with `truncate`,
    as llama.cpp always does and transformers does unless told not to)."""

    original_context: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    ext_factor: float = 1.0
    truncate: bool = True

    def frequencies(self, inv_freq: torch.Tensor, dims: int, base: float, scale: float) -> torch.Tensor:
        """The scaled inverse frequencies (float64) of the unscaled `inv_freq` ``[dims / 2]``."""

        def dim_of(rotations: float) -> float:
            return dims * math.log(self.original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dims - 1)
        ramp = ((torch.arange(dims // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
        mix = (1 - ramp) * self.ext_factor
        return inv_freq / scale * (1 - mix) + inv_freq * mix

    def mscale(self, scale: float) -> float:
        """The factor on cos and sin: ``1 + 0.1 ln scale`` (1 without extrapolation)."""
        return 1.0 + 0.1 * math.log(scale) if self.ext_factor != 0 and scale > 1 else 1.0


def rope_cos_sin(
    head_dim: int,
    max_positions: int,
    base: float,
    freq_factors: torch.Tensor | None = None,
    scale: float = 1.0,
    attn_factor: float = 1.0,
    yarn: YarnParams | None = None,
) -> torch.Tensor:
    """The ``[max_positions, head_dim]`` table of cos|sin for NeoX rotary embedding of `head_dim` rotated dims;
    `freq_factors` divides the frequencies (Llama 3's ``rope_freqs``, Phi-3's LongRoPE factors), so does `scale`
    (linear rope scaling, or YaRN's interpolation with `yarn`); `attn_factor` multiplies cos and sin (LongRoPE's
    attention factor; YaRN multiplies it by ``1 + 0.1 ln scale``)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.to(torch.float64)
    if yarn is not None and scale != 1.0:
        inv_freq, attn_factor = yarn.frequencies(inv_freq, head_dim, base, scale), attn_factor * yarn.mscale(scale)
    else:
        inv_freq = inv_freq / scale
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return (torch.cat((angles.cos(), angles.sin()), dim=-1) * attn_factor).float()


def mrope_axes(sections: tuple[int, ...], interleaved: bool = False) -> torch.Tensor:
    """Which position (0 time, 1 row, 2 column) turns each frequency of an M-RoPE head: ``[sum(sections[:3])]``
    int64. In runs (Qwen2-VL: the first `sections[0]` frequencies by time, the next `sections[1]` by row, ...), or
    interleaved (Qwen3-VL, transformers' `apply_interleaved_mrope`: frequency i by row when i % 3 == 1 and
    i < 3 * sections[1], by column when i % 3 == 2 and i < 3 * sections[2], else by time; llama.cpp's IMROPE agrees
    but for the frequencies past 3 * sections[0] that fall to neither, which it turns by a fourth position, 0 for
    text, where transformers turns them by time)."""
    n = sum(sections[:3])
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(sections[:3]))
    i = torch.arange(n)
    axes = torch.zeros(n, dtype=torch.long)
    axes[(i % 3 == 1) & (i < 3 * sections[1])] = 1
    axes[(i % 3 == 2) & (i < 3 * sections[2])] = 2
    return axes


def mrope_rows(table: torch.Tensor, positions: torch.Tensor, axes: torch.Tensor) -> torch.Tensor:
    """Each row's cos|sin row ``[T, R]`` of a ``[max_pos, R]`` table (cos of each frequency | sin of each) for its
    (time, row, column) `positions` ``[3, T]``: each frequency at the position of its axis (`mrope_axes`)."""
    axis = axes.to(table.device).repeat(2)  # [R]: the cos half, then the sin half
    rows = table[positions]  # [3, T, R]
    return rows.gather(0, axis.view(1, 1, -1).expand(1, rows.shape[1], -1))[0].contiguous()
