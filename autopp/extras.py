"""Optional dependencies (pyproject's extras): a missing one is an ImportError that names the
extra to install.

What: :func:`require` checks that a module of an extra can be found; :func:`import_extra`
imports it. Why: ``pip install autopp`` installs only the core (torch, torchtitan and the
triton its graph passes import, numpy, highspy); Hugging Face models need transformers
(``autopp[hf]``), the timeline PNG matplotlib (``autopp[plot]``). Invariant: every import of an extra's module in autopp goes through one
of these or follows a call to one, so its failure says which ``pip install`` fixes it.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

EXTRAS: dict[str, tuple[str, ...]] = {
    "hf": ("transformers",),
    "plot": ("matplotlib",),
}
"""Each extra and the top-level modules it provides (as pyproject.toml declares them)."""


def missing_extra_error(extra: str, module: str, for_what: str) -> ImportError:
    """The error for ``module`` missing, naming the extra that installs it."""
    return ImportError(f"{for_what} needs {module}, which is not installed: "
                       f'pip install "autopp[{extra}]"')


def require(extra: str, *, for_what: str) -> None:
    """Raise :func:`missing_extra_error` unless every module of ``extra`` can be imported."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; the extras are {sorted(EXTRAS)}")
    for module in EXTRAS[extra]:
        if importlib.util.find_spec(module) is None:
            raise missing_extra_error(extra, module, for_what)


def import_extra(module: str, extra: str, *, for_what: str) -> ModuleType:
    """``import module``, or :func:`missing_extra_error` when its top-level package is not
    installed (an ImportError from inside an installed package is raised as it is)."""
    top = module.split(".")[0]
    if importlib.util.find_spec(top) is None:
        raise missing_extra_error(extra, top, for_what)
    return importlib.import_module(module)
