"""``autopp.graph.overlap``: collectives issued as early as their inputs allow, waits just
before the first use of their value, the collectives' order kept, nothing moved across a
barrier (an in-place write), and the values unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from autopp.graph.overlap import is_barrier, is_collective, is_wait, overlap_collectives

ops = torch.ops._c10d_functional
aten = torch.ops.aten


def check_overlapped(gm: fx.GraphModule) -> tuple[int, int]:
    """Assert ``gm`` is in overlap order: each collective right after its last input (or
    the collective before it, a barrier or the placeholders), each wait right before its
    first user (or a barrier, or the output; other waits may come between). Returns
    (collectives, waits not right after their collective)."""
    gm.graph.lint()
    nodes = list(gm.graph.nodes)
    prev_coll = None
    deferred = 0
    for i, node in enumerate(nodes):
        if is_collective(node):
            before = nodes[i - 1]
            assert (before in node.all_input_nodes or before is prev_coll or is_barrier(before)
                    or before.op == "placeholder"), (node.name, "issued late, after", before.name)
            prev_coll = node
        elif is_wait(node) and node.users:
            after = next(n for n in nodes[i + 1:] if n in node.users or not is_wait(n))
            assert after in node.users or is_barrier(after) or after.op == "output", (
                node.name, "waited early, before", after.name)
            deferred += nodes[i - 1] is not node.args[0]
    return sum(map(is_collective, nodes)), deferred


def collective_order(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if is_collective(n)]


def _traced(a, b, buf):
    y = b + 1                                        # c2's input, ready first
    x = a * 2                                        # c1's input
    h = torch.mm(b, b)                               # unrelated compute
    h = torch.relu(h)
    c1 = ops.all_reduce.default(x, "sum", "0")       # issued late: belongs right after x
    w1 = ops.wait_tensor.default(c1)                 # waited early: belongs before its use
    c2 = ops.all_gather_into_tensor.default(y, 2, "0")  # may not pass c1
    w2 = ops.wait_tensor.default(c2)
    h = h * 3
    u = w1 + h                                       # first use of w1
    aten.copy_.default(buf, h)                       # a barrier: nothing moves across it
    c3 = ops.all_reduce.default(a, "sum", "0")       # its input is a placeholder
    w3 = ops.wait_tensor.default(c3)
    return u, torch.sum(w2), w3 - 1


OVERLAPPED = ["a", "b", "buf", "add", "mul", "all_reduce_default",
              "all_gather_into_tensor_default", "mm", "relu", "mul_1", "wait_tensor_default",
              "add_1", "wait_tensor_default_1", "copy__default", "all_reduce_default_1",
              "sum_1", "wait_tensor_default_2", "sub", "output"]


def test_collectives_issue_early_and_wait_at_first_use(fake_world2):
    gm = fx.symbolic_trace(_traced)
    args = (torch.randn(4, 4), torch.randn(4, 4))
    expect = gm(*args, torch.zeros(4, 4))
    order = collective_order(gm)
    report = overlap_collectives(gm)
    assert (report.collectives, report.hoisted, report.sunk) == (3, 2, 3)
    assert collective_order(gm) == order
    # c1 right after x; c2 after c1 although y is ready earlier; c3 stays after the copy_
    # (a barrier) that w2 stops before; w1 and w3 right before their first uses
    assert [n.name for n in gm.graph.nodes] == OVERLAPPED
    assert check_overlapped(gm) == (3, 3)
    got = gm(*args, torch.zeros(4, 4))
    for g, e in zip(got, expect):
        torch.testing.assert_close(g, e)


def test_the_checker_sees_a_graph_waited_at_once(fake_world2):
    """The traced order (each wait right after its collective) fails the check."""
    gm = fx.symbolic_trace(_traced)
    with pytest.raises(AssertionError, match="issued late|waited early"):
        check_overlapped(gm)


def _unshard(w1, w2, w3):
    g1 = ops.wait_tensor.default(ops.all_gather_into_tensor.default(w1, 2, "0"))  # returned
    g2 = ops.wait_tensor.default(ops.all_gather_into_tensor.default(w2, 2, "0"))
    c2 = g2.to(torch.bfloat16)                       # read in the graph: its wait stays
    g3 = ops.wait_tensor.default(ops.all_gather_into_tensor.default(w3, 2, "0"))
    return g1, c2, g3, g3.t()                        # g3 also read by a view: stays


def test_an_unshard_graph_leaves_only_its_returned_gathers_in_flight(fake_world2):
    """``defer_output_waits``: an output that is a gather's wait, read by nothing else,
    is returned un-waited (its position listed for the caller); waits that the graph reads
    stay; the values, once waited, are the original graph's; the original is unchanged."""
    from autopp.graph.overlap import defer_output_waits

    gm = fx.symbolic_trace(_unshard)
    before = [n.name for n in gm.graph.nodes]
    issued, pending = defer_output_waits(gm)
    assert pending == (0,)
    assert [n.name for n in gm.graph.nodes] == before
    assert sum(map(is_wait, issued.graph.nodes)) == sum(map(is_wait, gm.graph.nodes)) - 1
    ret = next(n for n in issued.graph.nodes if n.op == "output").args[0]
    assert is_collective(ret[0]) and is_wait(ret[1].args[0]) and is_wait(ret[2])
    args = [torch.randn(3, 4) for _ in range(3)]
    got = list(issued(*args))
    got[0] = ops.wait_tensor.default(got[0])
    for g, e in zip(got, gm(*args)):
        torch.testing.assert_close(g, e)
    assert defer_output_waits(fx.symbolic_trace(lambda a: (a * 2,)))[1] == ()
