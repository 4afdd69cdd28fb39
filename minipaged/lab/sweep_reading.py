"""Lesson 15's reading of a decode sweep: what the measured tokens/s against batch size say, in
sentences that follow the numbers of this run (so they stay true on any machine).

``sweep_reading(batch_sizes, tokens_per_s, ridge_batch, ridge)`` returns the lines the lesson
prints: the gain from B=1 to the best, the gain per doubling, whether the sweep reached a plateau
(claimed only when the last doubling gained little), and where the roofline puts the ridge.
"""
from __future__ import annotations

from minipaged.lab.roofline import saturation_batch

PLATEAU_GAIN = 1.15  # a last doubling that gained less than this (x1.15) ends a plateau


def sweep_reading(batch_sizes: list[int], tokens_per_s: list[float], ridge_batch: int | None,
                  ridge: float) -> list[str]:
    """The lines that read a decode sweep. ``ridge_batch`` is the first batch size whose step is
    past the roofline's ridge (``ridge`` FLOP/B), None when the whole sweep is left of it."""
    if len(batch_sizes) != len(tokens_per_s) or len(batch_sizes) < 2:
        raise ValueError(f"need the same number (at least 2) of batch sizes and tokens/s, got "
                         f"{len(batch_sizes)} and {len(tokens_per_s)}")
    if min(tokens_per_s) <= 0:
        raise ValueError("tokens/s must be positive")
    measured = tokens_per_s
    knee = saturation_batch(batch_sizes, measured)
    growth = ", ".join(f"x{b / a:.2f}" for a, b in zip(measured, measured[1:]))
    lines = [f"tokens/s went from {measured[0]:.0f} at B=1 to {max(measured):.0f} at its best, "
             f"{max(measured) / measured[0]:.1f}x; it reached 90% of its best at B={knee}.",
             f"tokens/s gained per doubling of B: {growth}"]
    last_gain = measured[-1] / measured[-2]
    if knee < batch_sizes[-1] and last_gain < PLATEAU_GAIN:
        lines.append(f"plateau: from B={knee} on, more sequences per step stopped paying on this "
                     f"machine (the last doubling gained x{last_gain:.2f}).")
    else:
        lines.append(f"no plateau in this sweep: the last doubling still gained x{last_gain:.2f}, "
                     f"so the sweep ends (at B={batch_sizes[-1]}) before tokens/s stopped growing "
                     f"on this machine.")
    if ridge_batch:
        lines.append(f"the roofline says: memory-bound below B={ridge_batch}; from B={ridge_batch} "
                     f"on, the step's intensity is past the ridge ({ridge:.1f} FLOP/B) and compute "
                     f"bounds it.")
    else:
        lines.append(f"the roofline says: memory-bound over the whole sweep (even "
                     f"B={batch_sizes[-1]} is left of the ridge).")
    return lines
