"""Output-length prediction for `predicted_finish`.

Online mode keeps, per (tenant, prompt-length bucket), the last `window` observed output lengths
in a sorted list and predicts their `quantile` (the median by default). Buckets are powers of two
of the prompt length, so a 300-token chat and a 30k-token document never share statistics. Until a
bucket has `min_samples` observations it falls back to the tenant's pooled history, then to the
global history, then to `prior_tokens`. Every prediction is capped by the request's `max_tokens`.

Oracle mode returns the true length: an upper bound for what any predictor can buy.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Window:
    size: int
    order: deque[int] = field(default_factory=deque)
    values: list[int] = field(default_factory=list)

    def add(self, v: int) -> None:
        self.order.append(v)
        bisect.insort(self.values, v)
        if len(self.order) > self.size:
            old = self.order.popleft()
            del self.values[bisect.bisect_left(self.values, old)]

    def quantile(self, q: float) -> int:
        vals = self.values
        return vals[min(len(vals) - 1, int(q * len(vals)))]


class OutputLengthPredictor:
    def __init__(
        self,
        *,
        oracle: bool = False,
        quantile: float = 0.5,
        window: int = 256,
        min_samples: int = 8,
        prior_tokens: int = 256,
    ) -> None:
        if not 0.0 <= quantile <= 1.0:
            raise ValueError("quantile must be in [0, 1]")
        self.oracle = oracle
        self.quantile = quantile
        self.window = window
        self.min_samples = min_samples
        self.prior_tokens = prior_tokens
        self._windows: dict[tuple[str | None, int], _Window] = {}

    @staticmethod
    def bucket(prompt_tokens: int) -> int:
        return max(0, prompt_tokens).bit_length()

    def predict(
        self,
        tenant: str,
        prompt_tokens: int,
        max_tokens: int | None,
        true_output: int | None = None,
    ) -> int:
        if self.oracle and true_output is not None:
            guess = true_output
        else:
            guess = self.prior_tokens
            for key in self._keys(tenant, prompt_tokens):
                w = self._windows.get(key)
                if w is not None and len(w.values) >= self.min_samples:
                    guess = w.quantile(self.quantile)
                    break
        if max_tokens is not None:
            guess = min(guess, max_tokens)
        return max(1, guess)

    def _keys(self, tenant: str, prompt_tokens: int) -> tuple[tuple[str | None, int], ...]:
        # most specific first; the global window's key (None) can never be a tenant's
        return ((tenant, self.bucket(prompt_tokens)), (tenant, -1), (None, -1))

    def observe(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        for key in self._keys(tenant, prompt_tokens):
            w = self._windows.get(key)
            if w is None:
                w = self._windows[key] = _Window(self.window)
            w.add(output_tokens)
