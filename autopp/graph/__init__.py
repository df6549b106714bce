"""Graph-level pipeline-parallel utilities.

Split a stage's joint forward+backward graph into forward / backward / backward-input /
backward-weight / unshard / reduce-grad callables, and run them as stages of torch's
pipeline schedules (including zero-bubble and DualPipeV).
"""

from autopp.graph.aot import from_aot_joint, signature_from_aot_descriptors
from autopp.graph.callables import StageGraphs, ValueLayouts
from autopp.graph.compile import compile_stage_graphs
from autopp.graph.convention import CallingConvention, JointSignature
from autopp.graph.recompute import RECOMPUTE_POLICIES, Recompute
from autopp.graph.split import check_joint_graph, split_joint_graph
from autopp.graph.stage import attach_graph_runtime, check_stage_chain, GraphStage
from autopp.graph.trace import build_stage_graphs, trace_stage, TracedStage

__all__ = [
    "CallingConvention",
    "GraphStage",
    "JointSignature",
    "RECOMPUTE_POLICIES",
    "Recompute",
    "StageGraphs",
    "TracedStage",
    "ValueLayouts",
    "attach_graph_runtime",
    "build_stage_graphs",
    "check_joint_graph",
    "check_stage_chain",
    "signature_from_aot_descriptors",
    "compile_stage_graphs",
    "from_aot_joint",
    "split_joint_graph",
    "trace_stage",
]
