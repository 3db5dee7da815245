"""Tokens routed per expert per MoE layer, as plain values the engine and server pass around. [no torch]

A (token, choice) pair counts once for the expert chosen: a step of T tokens adds T x k to
each sparse layer (k = num_experts_per_tok). Balancedness is vLLM's EPLB figure, per layer:
mean tokens per expert / max tokens per expert (1.0: every expert got the same share; 1/E: one
expert got them all). Under expert parallelism a rank's compute follows its experts' tokens,
so a low balancedness is a rank that the others wait for at the all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertLoad:
    """Cumulative counts since the engine started: layer index -> tokens per expert (all E)."""

    tokens: dict[int, tuple[int, ...]]

    def since(self, earlier: ExpertLoad | None) -> ExpertLoad:
        """The counts added after `earlier` (the log line's interval)."""
        if earlier is None:
            return self
        return ExpertLoad({layer: tuple(a - b for a, b in zip(counts, earlier.tokens.get(layer, (0,) * len(counts))))
                           for layer, counts in self.tokens.items()})

    def total(self, layer: int) -> int:
        return sum(self.tokens[layer])

    def balancedness(self, layer: int) -> float | None:
        """mean / max tokens per expert of `layer`; None before any token reached it."""
        counts = self.tokens[layer]
        peak = max(counts, default=0)
        return sum(counts) / len(counts) / peak if peak else None

    def summary(self) -> str | None:
        """"MoE balancedness 0.83 (worst layer 5: 0.61)" over the layers that saw tokens; None if none did."""
        scored = {layer: b for layer in self.tokens if (b := self.balancedness(layer)) is not None}
        if not scored:
            return None
        worst = min(scored, key=lambda layer: (scored[layer], layer))
        mean = sum(scored.values()) / len(scored)
        return f"MoE balancedness {mean:.2f} (worst layer {worst}: {scored[worst]:.2f})"
