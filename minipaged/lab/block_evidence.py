"""The blocks behind a difference of two engines (lesson 19): the GPU blocks whose ref count or
holders differ after one step, as evidence next to ``engine_diff.compare``'s first difference.
"""
from __future__ import annotations

SHOWN_BLOCKS = 4  # printed under a difference; the rest counted


def blocks_that_differ(reference: dict, suspect: dict) -> dict[int, tuple[str, str]]:
    """{block number: (the reference's, the suspect's)} for the GPU blocks held differently in
    two recordings' ``blocks`` fields of one step, each as "ref 2, held by request 0 sequence 0,
    request 0 sequence 1"."""
    a, b = _held(reference), _held(suspect)
    free = "ref 0, held by none"
    return {n: (a.get(n, free), b.get(n, free)) for n in sorted(set(a) | set(b))
            if a.get(n, free) != b.get(n, free)}


def _held(fields: dict) -> dict[int, str]:
    holders: dict[int, list[str]] = {}
    for name, (device, table) in fields.get("block_tables", {}).items():
        for number in table if device == "gpu" else ():
            if number >= 0:  # (-1: an entry a sliding window dropped)
                holders.setdefault(number, []).append(name)
    refs = fields.get("gpu_ref_counts", {})
    return {n: f"ref {refs.get(n, 0)}, held by {', '.join(sorted(holders.get(n, []))) or 'none'}"
            for n in set(holders) | set(refs)}
