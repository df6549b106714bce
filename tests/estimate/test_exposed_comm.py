"""Communication hidden under compute (autopp.estimate.exposed_comm): the two-stream span of a
piece against critical paths worked out by hand (the planned stage's step:
tests/estimate/test_overlap_estimate.py)."""

from __future__ import annotations

from autopp.estimate.exposed_comm import Transfer, piece_time

# a -> b -> c, and c also reads a: a 1 s, b 2 s, c 1 s of compute
ORDER = ["a", "b", "c"]
COMPUTE = {"a": 1.0, "b": 2.0, "c": 1.0}
READS = {"b": ["a"], "c": ["a", "b"]}


def test_a_transfer_skipping_a_node_hides_under_it():
    # a ends at 1; its 1.5 s transfer to c runs 1 -> 2.5 while b runs 1 -> 3; c at 3 -> 4
    t = piece_time(ORDER, COMPUTE, READS, [Transfer("a", "c", 1.5)])
    assert (t.span_s, t.hidden_comm_s, t.exposed_comm_s) == (4.0, 1.5, 0.0)
    # longer than b: 1 -> 4, c waits until 4 and ends at 5 (1 s of 3 exposed)
    t = piece_time(ORDER, COMPUTE, READS, [Transfer("a", "c", 3.0)])
    assert (t.span_s, t.exposed_comm_s) == (5.0, 1.0)
    t = piece_time(ORDER, COMPUTE, READS, [Transfer("a", "c", 1.5)], overlap=False)
    assert (t.span_s, t.exposed_comm_s) == (5.5, 1.5)


def test_a_transfer_into_the_next_node_hides_nothing():
    t = piece_time(ORDER, COMPUTE, READS, [Transfer("a", "b", 1.5)])
    assert t.span_s == 5.5 and t.hidden_comm_s == 0.0


def test_collectives_run_one_at_a_time_in_the_order_they_are_issued():
    # both 1 s from inputs ready at the start: the one into c cannot start before the one
    # into b ends (1 s), so it ends at 2 and hides under b (1 -> 3): c 3 -> 4
    # issued in consumer order: into b 0 -> 1, then into c 1 -> 2; a 0 -> 1, b 1 -> 3,
    # c 3 -> 4: both hidden. Into c made 3 s long: 1 -> 4, c waits: 4 -> 5
    both = [Transfer(None, "c", 1.0), Transfer(None, "b", 1.0)]
    t = piece_time(ORDER, COMPUTE, READS, both)
    assert (t.span_s, t.hidden_comm_s) == (4.0, 2.0)
    t = piece_time(ORDER, COMPUTE, READS, [Transfer(None, "c", 3.0), Transfer(None, "b", 1.0)])
    assert (t.span_s, t.exposed_comm_s) == (5.0, 1.0)
    # a transfer into a whose input is ready: a waits for it (0 -> 2), the rest follow
    t = piece_time(ORDER, COMPUTE, READS, [Transfer("x", "a", 2.0)])
    assert t.span_s == 6.0


def test_an_output_transfer_overlaps_the_compute_after_its_producer():
    # a's result leaves the piece (1.5 s from 1) while b and c run (1 -> 4)
    t = piece_time(ORDER, COMPUTE, READS, [Transfer("a", None, 1.5)])
    assert t.span_s == 4.0
    # c's result can only leave after c: 4 -> 5.5
    t = piece_time(ORDER, COMPUTE, READS, [Transfer("c", None, 1.5)])
    assert t.span_s == 5.5


def test_lead_compute_runs_first():
    t = piece_time(ORDER, COMPUTE, READS, [Transfer(None, "a", 0.5)], lead_s=1.0)
    # the transfer (0 -> 0.5) hides under the 1 s lead; a 1 -> 2, b 2 -> 4, c 4 -> 5
    assert t.span_s == 5.0 and t.compute_s == 5.0
