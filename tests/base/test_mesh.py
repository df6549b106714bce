"""World mesh and stage sub-mesh: sizes checked, names right, large meshes on the fake PG."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from autopp.mesh import check_mesh_sizes


def test_sizes_ok_and_filled():
    assert check_mesh_sizes({"pp": 2, "dp": 2, "tp": 2}, 8) == {"pp": 2, "dp": 2, "tp": 2}
    assert check_mesh_sizes({"pp": 4}, 4) == {"pp": 4, "dp": 1, "tp": 1}


def test_product_mismatch_names_numbers():
    with pytest.raises(ValueError, match=r"pp=2 × dp=2 × tp=2 needs 8 ranks, got 6"):
        check_mesh_sizes({"pp": 2, "dp": 2, "tp": 2}, 6)


def test_unknown_dim():
    with pytest.raises(ValueError, match=r"unknown mesh dim name\(s\) \['cp'\]"):
        check_mesh_sizes({"pp": 2, "cp": 2}, 4)


def test_size_below_one():
    with pytest.raises(ValueError, match=r"at least 1, got dp=0"):
        check_mesh_sizes({"pp": 2, "dp": 0}, 2)


def test_fake_world_large_mesh():
    # The fake process group needs a fresh process (one default group per process).
    code = textwrap.dedent(
        """
        from autopp import build_world_mesh, init_fake_world, stage_sub_mesh
        init_fake_world(256, rank=77)
        mesh = build_world_mesh(pp=4, dp=8, tp=8)
        sub = stage_sub_mesh(mesh)
        assert mesh.mesh_dim_names == ("pp", "dp", "tp"), mesh.mesh_dim_names
        assert tuple(sub.shape) == (8, 8) and sub.mesh_dim_names == ("dp", "tp")
        assert tuple(mesh.get_coordinate()) == (1, 1, 5), mesh.get_coordinate()
        try:
            build_world_mesh(pp=4, dp=8, tp=4)
        except ValueError as e:
            assert "needs 128 ranks, got 256" in str(e), e
        else:
            raise AssertionError("no error")
        print("OK")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
