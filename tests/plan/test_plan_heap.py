"""autopp.plan.heap.frozen_heap against CPython's collector: what exists on entry is not
collected within, what planning makes is, and everything is collectable again after."""

import gc
import weakref

import pytest

from autopp.plan.heap import frozen_heap


class _Node:
    pass


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_old_cycles_wait_new_cycles_go_and_nesting_unfreezes_once():
    gc.collect()
    old = _Node()
    old.self = old
    old_ref = weakref.ref(old)
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        del old  # garbage now, but it was alive on entry: frozen, not walked
        gc.collect()
        assert old_ref() is not None
        new_ref = _cycle()  # made within: collected as usual
        with frozen_heap():  # nested: no second freeze, no early unfreeze
            pass
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert new_ref() is None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old_ref() is None


def test_unfrozen_after_an_error():
    with pytest.raises(RuntimeError):
        with frozen_heap():
            raise RuntimeError("planning failed")
    assert gc.get_freeze_count() == 0
