"""Fixtures of the tracing tests: the fake process group and models on it."""

from tests.harness.fake_world import (  # noqa: F401  (fixtures)
    fake_world,
    llama_debug,
    make_mesh,
    mlp_meta,
    stack_of,
)
