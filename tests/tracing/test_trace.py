import pytest
import torch

from autopp.tracing.joint import graph_signature, trace_joint


def test_llama_block_joint_graph_ties_params_to_grads(llama_debug):
    block = llama_debug.layers["0"]
    x = torch.empty(2, 16, 256, device="meta")
    j = trace_joint(block, (x, None, None))
    fqns = {n for n, _ in block.named_parameters()}
    assert set(j.params) == fqns
    assert set(j.grads) == fqns  # every parameter's gradient is tied to it
    for fqn, node in j.params.items():
        assert j.grads[fqn].meta["val"].shape == node.meta["val"].shape
    assert 0 in j.inputs and 0 in j.input_grads and 0 in j.tangents and 0 in j.outputs
    ops = {str(n.target) for n in j.gm.graph.nodes if n.op == "call_function"}
    assert "aten.mm.default" in ops
    # attention is traced as portable aten math, not a CPU-only flash kernel
    assert not any("for_cpu" in o for o in ops)


def test_identical_blocks_share_signature(llama_debug):
    x = torch.empty(2, 16, 256, device="meta")
    a = trace_joint(llama_debug.layers["0"], (x, None, None))
    b = trace_joint(llama_debug.layers["1"], (x, None, None))
    assert graph_signature(a) == graph_signature(b)


def test_module_not_on_meta_is_rejected():
    lin = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="meta"):
        trace_joint(lin, (torch.empty(2, 4, device="meta"),))


def test_input_not_on_meta_is_rejected():
    with torch.device("meta"):
        lin = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="meta"):
        trace_joint(lin, (torch.empty(2, 4),))
