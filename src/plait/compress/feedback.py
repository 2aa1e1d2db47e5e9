"""Error feedback: remember what compression dropped and send it next step.

With residual e (0 at first) and any compressor C with decoder D, each step sends

    m = C(x + e),   then   e <- (x + e) - D(m),

so the error is never lost, only delayed: Σ_t D(m_t) = Σ_t x_t - e_T. This makes
biased compressors (top-k, sign, random-k without rescaling) converge like SGD
(Seide et al. 2014; Stich et al. 2018; Karimireddy et al. 2019). Memory: one
residual the size of each bucket, in the bucket's dtype.

Residuals are keyed by the ``key`` passed to ``compress`` — ``reduce`` passes the
bucket index. A direct ``compress`` call without ``key`` uses the key
``("numel", n)``, so tensors of different sizes never share a residual; pass
``key=`` to keep two same-sized tensors apart.
"""

from __future__ import annotations

import torch

from plait.compress.base import Payload, PayloadCompressor, check_floating


class ErrorFeedback(PayloadCompressor):
    """Wrap a :class:`PayloadCompressor`: compress(x) = inner.compress(x + e), e = (x + e) - D(m)."""

    def __init__(self, compressor: PayloadCompressor):
        if isinstance(compressor, ErrorFeedback):
            raise ValueError(
                f"ErrorFeedback({compressor.describe()}) already has error feedback; "
                f"wrapping it twice would feed each residual back twice. Use it as it is"
            )
        if not isinstance(compressor, PayloadCompressor):
            from plait.compress.powersgd import PowerSGD  # local: only to word the message

            if isinstance(compressor, PowerSGD):
                raise ValueError(
                    f"{compressor.describe()} keeps its own error feedback (Vogels et al. 2019: "
                    f"the residual M - PQ^T is added back before the next power step); "
                    f"use PowerSGD without ErrorFeedback"
                )
            raise ValueError(
                f"ErrorFeedback wraps a PayloadCompressor (TopK, RandomK, Sign, QSGD, FP16, BF16), "
                f"got {compressor!r}"
            )
        if getattr(compressor, "name", "") == "sign" and not getattr(compressor, "scaled", True):
            raise ValueError(
                "ErrorFeedback(Sign()) would carry a residual of x + e - sign(x + e), about -1 per element for "
                "small gradients; error feedback needs the scaled sign (EF-signSGD): use "
                "ErrorFeedback(Sign(scaled=True)) (spec 'sign+ef')")
        self.inner = compressor
        self.name = compressor.name + "+ef"
        self.residuals: dict[object, torch.Tensor] = {}

    def residual(self, key) -> torch.Tensor | None:
        """The residual kept under ``key`` (a bucket index, or ``("numel", n)``), or None."""
        return self.residuals.get(key)

    def reset(self) -> None:
        """Forget every residual (e.g. when the model or the bucketing changes)."""
        self.residuals.clear()

    def payload_layout(self, numel, dtype):
        return self.inner.payload_layout(numel, dtype)

    def compress(self, flat, *, rank=0, step=0, key=None) -> Payload:
        check_floating(self.describe(), flat.dtype)
        flat = flat.detach().reshape(-1)
        slot = ("numel", flat.numel()) if key is None else key
        residual = self.residuals.get(slot)
        if residual is not None and (residual.shape != flat.shape or residual.dtype != flat.dtype):
            raise ValueError(
                f"{self.describe()}: the residual under key {slot!r} holds {residual.numel()} elements of "
                f"{residual.dtype}, but this tensor has {flat.numel()} of {flat.dtype}; pass a distinct key= "
                f"per tensor, or call reset() after re-bucketing"
            )
        corrected = flat.clone() if residual is None else flat + residual
        payload = self.inner.compress(corrected, rank=rank, step=step, key=key)
        # e = (x + e) - D(m); not in place: a payload may share memory with its input
        self.residuals[slot] = corrected - self.inner.decompress(payload)
        return payload

    def decompress(self, payload: Payload) -> torch.Tensor:
        return self.inner.decompress(payload)

    def aggregate(self, payloads: list[Payload]) -> torch.Tensor:
        return self.inner.aggregate(payloads)

    def describe(self) -> str:
        return self.inner.describe() + "+ef"
