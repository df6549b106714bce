"""Checkpoints survive a job killed at any point of a save (``autopp.checkpoint``).

Each case runs a child process that saves checkpoint A, changes the weights to B and is
killed (``os._exit``, no cleanup runs) at one point of the second save. Whatever the point,
``load(path)`` then reads A (or B, once the switch happened), with one warning naming an
interrupted save; the next save succeeds and removes the leftovers. The layout an older
autopp left when killed between its two renames (no ``<path>``, complete ``.old`` and
``.tmp`` beside it) is named in one line instead of DCP's per-rank tracebacks."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from autopp import checkpoint

CHILD = r"""
import os, shutil, sys
import torch
from torch import nn
import torch.distributed.checkpoint as dcp
from autopp import checkpoint

point, path = sys.argv[1], sys.argv[2]
model = nn.Linear(4, 3)
with torch.no_grad():
    model.weight.fill_(1.0); model.bias.fill_(1.0)
checkpoint.save(path, model)                      # A: complete
with torch.no_grad():
    model.weight.fill_(2.0); model.bias.fill_(2.0)  # B
real_save, real_replace, real_rmtree = dcp.save, os.replace, shutil.rmtree

def die(*a, **k):
    os._exit(17)

def save_then(kill_metadata):
    def run(state, checkpoint_id):
        real_save(state, checkpoint_id=checkpoint_id)
        if kill_metadata:
            os.remove(os.path.join(checkpoint_id, ".metadata"))
        os._exit(17)
    return run

if point == "before_write":
    checkpoint.dcp.save = die
elif point == "data_no_metadata":
    checkpoint.dcp.save = save_then(True)
elif point == "data_no_marker":
    checkpoint.dcp.save = save_then(False)
elif point == "marked_not_switched":
    checkpoint._switch = die
elif point == "link_made_not_renamed":
    os.replace = die
elif point == "switched_not_cleaned":
    shutil.rmtree = die
checkpoint.save(path, model)
os._exit(0)
"""

POINTS = {  # point -> the weights load(path) must read after the kill
    "before_write": 1.0, "data_no_metadata": 1.0, "data_no_marker": 1.0,
    "marked_not_switched": 1.0, "link_made_not_renamed": 1.0, "switched_not_cleaned": 2.0,
}


def _loaded(path: str) -> float:
    model = nn.Linear(4, 3)
    checkpoint.load(path, model)
    assert torch.equal(model.bias, torch.full((3,), model.weight[0, 0].item()))
    return model.weight[0, 0].item()


@pytest.mark.parametrize("point", list(POINTS))
def test_a_save_killed_at_any_point_keeps_the_last_complete_checkpoint(tmp_path, point, caplog):
    path = str(tmp_path / "ckpt")
    child = subprocess.run([sys.executable, "-c", CHILD, point, path], capture_output=True,
                           text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert child.returncode == 17, child.stderr[-2000:]
    with caplog.at_level(logging.WARNING, logger="autopp.checkpoint"):
        assert _loaded(path) == POINTS[point]
    interrupted = [r.getMessage() for r in caplog.records if "interrupted" in r.getMessage()]
    if point in ("data_no_metadata", "data_no_marker", "marked_not_switched",
                 "link_made_not_renamed"):
        assert len(interrupted) == 1 and "ckpt.v2 was not committed" in interrupted[0], interrupted
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(3.0)
        model.bias.fill_(3.0)
    checkpoint.save(path, model)  # the next save: complete, leftovers removed
    assert _loaded(path) == 3.0
    left = sorted(os.listdir(tmp_path))  # the link and the directory it names, nothing else
    assert left == ["ckpt", os.path.basename(os.path.realpath(path))], left


def test_an_incomplete_or_missing_checkpoint_is_named_in_one_line(tmp_path):
    path = str(tmp_path / "ckpt")
    model = nn.Linear(4, 3)
    checkpoint.save(path, model)
    with pytest.raises(ValueError, match=r"ckpt\.v7 is an interrupted save \(not complete\); "
                                         r"the last complete checkpoint is .*ckpt \(-> ckpt\.v1\)"):
        os.makedirs(f"{path}.v7")
        _loaded(f"{path}.v7")
    # what an older autopp left when killed between its two renames
    os.rename(os.path.realpath(path), f"{path}.old")
    os.remove(path)
    os.makedirs(f"{path}.tmp")
    checkpoint.dcp.save({"w": torch.zeros(2)}, checkpoint_id=f"{path}.tmp")
    with pytest.raises(ValueError, match=r"^no checkpoint at .*ckpt: a save was interrupted; "
                                         r"complete checkpoints beside it: .*ckpt\.tmp, "
                                         r".*ckpt\.old \(load one by its path\)$"):
        _loaded(path)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        _loaded(str(tmp_path / "never"))


def test_a_directory_checkpoint_from_before_becomes_a_version(tmp_path):
    """A ``<path>`` that is a real DCP directory (an older autopp's) is moved aside and
    replaced by the link on the next save; both read as before."""
    path = str(tmp_path / "ckpt")
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(5.0)
        model.bias.fill_(5.0)
    checkpoint.dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    assert _loaded(path) == 5.0
    with torch.no_grad():
        model.weight.fill_(6.0)
        model.bias.fill_(6.0)
    checkpoint.save(path, model)
    assert os.path.islink(path) and _loaded(path) == 6.0
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt.v1"]
