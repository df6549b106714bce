"""The suite's one parity metric (README, "How parity is checked"): what "equals
single-process within 1e-5" means for a tensor.

For a tensor ``g`` against its single-process fp32 reference ``r``:

* per tensor, relative: ``‖g − r‖ / max(‖r‖, EPS) ≤ REL`` (Frobenius norms). A tensor whose
  reference norm is below ``EPS`` (a gradient that is almost zero) is held to
  ``‖g − r‖ ≤ REL · EPS`` instead, so near-zero tensors cannot pass on a loose relative
  bound nor fail on rounding noise;
* elementwise, as before: ``|g − r| ≤ ATOL + RTOL · |r|`` (``torch.testing.assert_close``).

Every parity test compares tensors with :func:`assert_parity` (or :func:`assert_all_parity`
for a dict of them), and losses with :func:`assert_loss_parity`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

REL = 1e-5
"""Per-tensor relative bound in fp32."""
EPS = 1e-3
"""Reference norms below this count as this (near-zero tensors: absolute bound REL·EPS)."""
ATOL = 1e-5
"""Elementwise absolute bound (and the losses' absolute bound)."""
RTOL = 1e-4
"""Elementwise relative bound."""


def relative_error(got: torch.Tensor, ref: torch.Tensor, eps: float = EPS) -> float:
    """``‖got − ref‖ / max(‖ref‖, eps)`` in float64."""
    g, r = got.detach().double().cpu(), ref.detach().double().cpu()
    return float(torch.linalg.vector_norm(g - r) / max(float(torch.linalg.vector_norm(r)), eps))


def _elementwise_close(got: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> bool:
    """``torch.testing.assert_close``'s bound, for the common passing case: every element
    finite and within it (anything else goes to ``assert_close`` itself for the verdict)."""
    if got.dtype != ref.dtype or got.device != ref.device:
        return False
    g, r = got.detach(), ref.detach()
    return bool(((g - r).abs() <= atol + rtol * r.abs()).all())


def assert_parity(got: torch.Tensor, ref: torch.Tensor, *, what: str, rel: float = REL,
                  eps: float = EPS, atol: float = ATOL, rtol: float = RTOL) -> float:
    """Raise AssertionError, naming ``what`` and the figures, unless ``got`` matches ``ref``
    by both bounds of the module docstring. Returns the relative error."""
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = relative_error(got, ref, eps)
    if not err <= rel:
        diff = (got.detach().double().cpu() - ref.detach().double().cpu()).abs().max()
        raise AssertionError(
            f"{what}: relative error {err:.3g} > {rel:g} (‖ref‖ = "
            f"{float(torch.linalg.vector_norm(ref.detach().double().cpu())):.3g}, eps {eps:g}; "
            f"max |diff| {float(diff):.3g})")
    if not _elementwise_close(got, ref, atol, rtol):
        torch.testing.assert_close(got, ref, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")
    return err


def assert_all_parity(got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor], *,
                      what: str, **bounds: float) -> dict[str, float]:
    """:func:`assert_parity` for every tensor of ``got`` (each must be in ``ref``); returns
    each name's relative error."""
    missing = sorted(set(got) - set(ref))
    assert not missing, f"{what}: not in the reference: {missing}"
    return {name: assert_parity(g, ref[name], what=f"{what} {name}", **bounds)
            for name, g in got.items()}


def norms(tensors: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Each tensor's norm in float64 (what a rank that ships no tensors returns of them)."""
    return {name: float(torch.linalg.vector_norm(t.detach().double().cpu()))
            for name, t in tensors.items()}


def assert_norm_parity(got: Mapping[str, float], ref: Mapping[str, torch.Tensor], *,
                       what: str, rel: float = REL, eps: float = EPS) -> None:
    """Each norm of ``got`` (:func:`norms`) equals its reference tensor's within
    ``rel · max(‖r‖, eps)``: what :func:`assert_parity`'s per-tensor bound implies for the
    norms (``| ‖g‖ − ‖r‖ | ≤ ‖g − r‖``), checked where only the norms came back."""
    missing = sorted(set(got) - set(ref))
    assert not missing, f"{what}: not in the reference: {missing}"
    for name, n in got.items():
        r = float(torch.linalg.vector_norm(ref[name].detach().double().cpu()))
        assert abs(n - r) <= rel * max(r, eps), (
            f"{what} {name}: norm {n!r} vs reference {r!r} (|diff| {abs(n - r):.3g} > "
            f"{rel:g} x {max(r, eps):.3g})")


def assert_loss_parity(got: float, ref: float, *, what: str, atol: float = ATOL) -> None:
    """A loss (a scalar) equals the reference's within ``atol``."""
    assert abs(got - ref) <= atol, f"{what}: loss {got!r} vs reference {ref!r} (|diff| " \
                                   f"{abs(got - ref):.3g} > {atol:g})"


def assert_w_after_i(log: list[tuple[str, int, int | None]], *, what: str) -> int:
    """From a rank's action log (``Pipeline.action_log``): every W of (stage, microbatch)
    ran after that microbatch's I, as a separate action. Returns how many W ran later than
    right after their I (other compute between): informative; the zero-bubble schedules
    decide that, not autopp."""
    done_i: dict[tuple[int, int | None], int] = {}
    later = 0
    for k, (kind, stage, mb) in enumerate(log):
        if kind == "I":
            done_i[stage, mb] = k
        elif kind == "W":
            assert (stage, mb) in done_i, f"{what}: W of stage {stage} microbatch {mb} " \
                                          f"before its I (log {log})"
            later += any(a[0] in ("F", "B", "I", "W") for a in log[done_i[stage, mb] + 1:k])
    return later
