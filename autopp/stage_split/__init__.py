"""Stage split: which modules of a model go to which pipeline stage, and the stage modules.

A model's body is a sequence of blocks in one ``nn.ModuleList``/``nn.ModuleDict`` (found
automatically), with pre modules before it and post modules after it. A split is a plain
value, ``list[list[str]]`` of module FQNs per stage, stated uniformly by layer count
(``split_uniform``), as FQN lists (``validate_split``) or as a layout string such as
``"Ett|tt|ttL"`` (``parse_layout``); ``resolve_split`` accepts any of them.
``build_stage_module`` copies the meta model into one stage's module, keeping whole-model
FQNs. Example::

    with torch.device("meta"):
        model = cfg.build()
    split = resolve_split(model, "Ett|tt|ttL")       # or 3, or FQN lists
    stage_modules = [build_stage_module(model, fqns) for fqns in split]"""

from autopp.stage_split.build import StageLayers, build_stage_module, model_input_keywords
from autopp.stage_split.layout import ModelLayout, find_layers, inspect_model
from autopp.stage_split.merge import merge_stage_modules
from autopp.stage_split.model_inputs import stages_read_model_inputs
from autopp.stage_split.layout_string import format_layout, parse_layout
from autopp.stage_split.resolve import SplitSpec, resolve_split
from autopp.stage_split.uniform import split_uniform
from autopp.stage_split.validate import check_stage_forwards, validate_split, validate_stage

__all__ = [
    "ModelLayout",
    "SplitSpec",
    "StageLayers",
    "build_stage_module",
    "check_stage_forwards",
    "find_layers",
    "format_layout",
    "inspect_model",
    "merge_stage_modules",
    "model_input_keywords",
    "parse_layout",
    "resolve_split",
    "split_uniform",
    "stages_read_model_inputs",
    "validate_split",
    "validate_stage",
]
