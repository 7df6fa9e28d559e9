"""A percentile observer with bounded memory, for PT2E activation calibration.

It keeps one fixed-size histogram over the range seen so far. When a batch falls outside that
range, the old counts are re-binned onto the wider range (mass spread uniformly within each old
bin, i.e. linear interpolation of the cumulative counts), so state stays ``bins`` numbers however
many batches are observed. ``calculate_qparams`` takes the ``100 - p`` and ``p`` percentiles as
min/max and hands them to torchao's usual scale/zero-point rule (affine or symmetric).
"""

from __future__ import annotations

import torch
from torchao.quantization.pt2e.observer import UniformQuantizationObserverBase


class PercentileObserver(UniformQuantizationObserverBase):
    """Observe a streaming histogram; choose min/max at ``percentile`` (default 99.99)."""

    histogram: torch.Tensor
    min_val: torch.Tensor
    max_val: torch.Tensor

    def __init__(
        self,
        percentile: float = 99.99,
        bins: int = 2048,
        dtype: torch.dtype = torch.quint8,
        qscheme: torch.qscheme = torch.per_tensor_affine,
        **kwargs: object,
    ) -> None:
        if qscheme not in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            raise NotImplementedError("PercentileObserver is per-tensor only")
        super().__init__(dtype=dtype, qscheme=qscheme, **kwargs)
        self.percentile = float(percentile)
        self.bins = int(bins)
        # float64 counts: exact up to 2**53 values, far past any calibration set
        self.register_buffer("histogram", torch.zeros(self.bins, dtype=torch.float64))
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """Add ``x_orig`` to the histogram (widening its range when needed); return it unchanged."""
        x = x_orig.detach().float().flatten()
        x = x[torch.isfinite(x)]
        if x.numel() == 0:
            return x_orig
        lo, hi = torch.aminmax(x)
        new_lo, new_hi = torch.minimum(lo, self.min_val), torch.maximum(hi, self.max_val)
        if self.histogram.sum() > 0 and (new_lo < self.min_val or new_hi > self.max_val):
            self.histogram.copy_(rebin(self.histogram, self.min_val, self.max_val, new_lo, new_hi))
        self.min_val.copy_(new_lo)
        self.max_val.copy_(new_hi)
        self.histogram += _histc(x, self.bins, new_lo, new_hi)
        return x_orig

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        """Scale and zero point for the range between the two percentiles."""
        if self.histogram.sum() == 0:
            return self._calculate_qparams(self.min_val, self.max_val)
        q = self.percentile / 100.0
        lo = quantile(self.histogram, self.min_val, self.max_val, 1.0 - q)
        hi = quantile(self.histogram, self.min_val, self.max_val, q)
        return self._calculate_qparams(lo.float(), hi.float())

    def extra_repr(self) -> str:
        return (
            f"percentile={self.percentile}, bins={self.bins}, "
            f"min_val={self.min_val}, max_val={self.max_val}"
        )

    def reset_min_max_vals(self) -> None:
        """Forget everything observed."""
        self.histogram.zero_()
        self.min_val.fill_(float("inf"))
        self.max_val.fill_(float("-inf"))


def _edges(lo: torch.Tensor, hi: torch.Tensor, bins: int) -> torch.Tensor:
    return torch.linspace(float(lo), float(hi), bins + 1, dtype=torch.float64)


def _histc(x: torch.Tensor, bins: int, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Counts of ``x`` in ``bins`` equal bins over [lo, hi]; all in bin 0 when lo == hi."""
    if hi <= lo:
        counts = torch.zeros(bins, dtype=torch.float64)
        counts[0] = x.numel()
        return counts
    return torch.histc(x, bins, min=float(lo), max=float(hi)).double()


def _interp(x: torch.Tensor, xp: torch.Tensor, fp: torch.Tensor) -> torch.Tensor:
    """Piecewise-linear interpolation (numpy.interp) for increasing ``xp``, clamped at the ends."""
    i = torch.searchsorted(xp, x, right=True).clamp(1, xp.numel() - 1)
    x0, x1, f0, f1 = xp[i - 1], xp[i], fp[i - 1], fp[i]
    t = ((x - x0) / (x1 - x0).clamp_min(torch.finfo(xp.dtype).tiny)).clamp(0.0, 1.0)
    return f0 + t * (f1 - f0)


def _cdf(histogram: torch.Tensor) -> torch.Tensor:
    return torch.cat([histogram.new_zeros(1), histogram.cumsum(0)])


def rebin(
    histogram: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    new_lo: torch.Tensor,
    new_hi: torch.Tensor,
) -> torch.Tensor:
    """``histogram`` over [lo, hi] re-expressed over the wider [new_lo, new_hi], same bin count."""
    bins = histogram.numel()
    if hi <= lo:  # everything seen so far was one value
        return _histc(lo.reshape(1).float(), bins, new_lo, new_hi) * histogram.sum()
    new_cdf = _interp(_edges(new_lo, new_hi, bins), _edges(lo, hi, bins), _cdf(histogram))
    return new_cdf.diff().clamp_min(0.0)


def quantile(histogram: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, q: float) -> torch.Tensor:
    """The value below which a fraction ``q`` of the histogram's mass lies."""
    if hi <= lo:
        return lo.double()
    cdf = _cdf(histogram) / histogram.sum()
    edges = _edges(lo, hi, histogram.numel())
    # on flat stretches of the cdf searchsorted picks the first edge past q, which is what
    # a quantile wants; clamp in case float rounding leaves cdf[-1] a hair below 1
    value = _interp(torch.tensor([q], dtype=torch.float64), cdf, edges)[0]
    return value.clamp(float(lo), float(hi))
