"""The α-β price of one collective over one group of ``n`` ranks: the one home of the rule.

A ring or pairwise collective runs in steps, each paying the link's latency α, and the bytes
a rank puts on the wire cross its bandwidth (L = local bytes going in):

    all_reduce      2 (n-1) steps   2 (n-1)/n · L   (reduce-scatter + all-gather)
    reduce_scatter    n-1           (n-1)/n · L
    all_gather        n-1           (n-1) · L
    all_to_all        n-1           (n-1)/n · L     (one exchange per peer)

``time = α · steps + wire / bandwidth``. The cost model (:mod:`autopp.sharding.cost.model`), the
loss's cost, the search's latency share and the profile measurement's fit all use it."""

from __future__ import annotations

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
"""The collectives priced here."""


def _check(kind: str, n: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"no price for collective {kind!r}; one of {KINDS}")
    if n < 1:
        raise ValueError(f"a collective over {n} ranks: the group needs >= 1")


def collective_steps(kind: str, n: int) -> int:
    """Latency-bound steps of ``kind`` over ``n`` ranks (the table above); 0 for n = 1."""
    _check(kind, n)
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


def wire_bytes(kind: str, n: int, local_bytes: float) -> float:
    """Bytes one rank sends for ``kind`` over ``n`` ranks on ``local_bytes`` going in."""
    _check(kind, n)
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "all_gather": n - 1, "all_to_all": (n - 1) / n}[kind]
    return factor * local_bytes


def collective_latency_s(kind: str, n: int, latency: float) -> float:
    """Of :func:`collective_s`, the part that does not grow with the bytes:
    ``latency · steps``."""
    return latency * collective_steps(kind, n)


def collective_s(kind: str, n: int, local_bytes: float, bandwidth: float,
                 latency: float) -> float:
    """Seconds of ``kind`` over ``n`` ranks on one link: ``latency · steps + wire /
    bandwidth``; 0 when ``n`` is 1 (nothing to exchange)."""
    if n == 1:
        _check(kind, n)
        return 0.0
    return collective_latency_s(kind, n, latency) + wire_bytes(kind, n, local_bytes) / bandwidth
