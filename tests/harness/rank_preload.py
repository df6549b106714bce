"""Imported once by the launcher's fork server (:func:`tests.harness.launch.context`), so each
rank starts with what the launches import already loaded: autopp's runtime and planner, and
the transformers families of :mod:`tests.harness.models` where transformers is installed. Each
rank importing them itself cost a second or two of CPU per rank per launch."""

from __future__ import annotations

import importlib

_AUTOPP = ("autopp.pipeline", "autopp.backends.planner", "autopp.plan.make",
           "autopp.lower.apply", "autopp.lower.stage", "autopp.schedules", "autopp.estimate",
           "autopp.graph", "tests.harness.workers.decoder", "tests.harness.parity")

_TRANSFORMERS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM",
                 "MistralForCausalLM", "GemmaForCausalLM", "MixtralForCausalLM",
                 "Qwen2MoeForCausalLM", "GPT2LMHeadModel")

for _name in _AUTOPP:
    importlib.import_module(_name)

try:
    import transformers
except ImportError:  # the hf extra is not installed: its tests skip
    pass
else:
    for _cls in _TRANSFORMERS:
        getattr(transformers, _cls)
    importlib.import_module("transformers.masking_utils")
