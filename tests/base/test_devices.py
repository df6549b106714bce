"""Device defaults on a machine without GPUs: the mesh's device type follows the process
group's backend, each rank is bound to its LOCAL_RANK's GPU (and a rank on another's GPU is
refused), and the default profile comes from the device's name and memory."""

from __future__ import annotations

import types

import pytest
import torch

from autopp import mesh as mesh_mod
from autopp.profiles.devices import profile_for_device


def test_device_type_follows_the_backend():
    assert mesh_mod.device_type_of_backend("nccl") == "cuda"
    assert mesh_mod.device_type_of_backend("cpu:gloo,cuda:nccl") == "cuda"
    assert mesh_mod.device_type_of_backend("gloo") == "cpu"
    assert mesh_mod.device_type_of_backend("fake") == "cpu"


def _gpus(monkeypatch, n: int, current: int, name: str = "NVIDIA H100 80GB HBM3",
          memory: float = 85e9):
    set_to = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "set_device", set_to.append)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(name=name, total_memory=memory))
    return set_to


def test_each_rank_is_bound_to_its_local_gpu(monkeypatch):
    set_to = _gpus(monkeypatch, 8, current=0)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert mesh_mod.bind_local_device() == torch.device("cuda", 3) and set_to == [3]
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("SLURM_LOCALID", "5")
    assert mesh_mod.bind_local_device() == torch.device("cuda", 5)
    monkeypatch.setenv("SLURM_LOCALID", "9")
    with pytest.raises(RuntimeError, match="local rank 9 but only 8 GPUs"):
        mesh_mod.bind_local_device()
    monkeypatch.delenv("SLURM_LOCALID")
    with pytest.raises(RuntimeError, match="LOCAL_RANK .* is not set"):
        mesh_mod.bind_local_device()


def test_a_rank_on_another_ranks_gpu_is_refused(monkeypatch):
    _gpus(monkeypatch, 8, current=0)  # never set_device: every rank on GPU 0
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setattr(mesh_mod.dist, "get_rank", lambda: 2)
    with pytest.raises(RuntimeError, match=r"rank 2: local rank 2 but CUDA device 0 is current"
                                           r".*torch.cuda.set_device\(2\)"):
        mesh_mod._check_bound_device()
    monkeypatch.setenv("LOCAL_RANK", "0")
    mesh_mod._check_bound_device()  # rank 0 on GPU 0 is right


@pytest.mark.parametrize("name,memory,profile", [
    ("NVIDIA H100 80GB HBM3", 85e9, "H100"), ("NVIDIA H200", 150e9, "H200"),
    ("NVIDIA A100-SXM4-80GB", 85e9, "A100"), ("NVIDIA A100-SXM4-40GB", 42e9, "A100-40GB"),
])
def test_default_profile_from_the_device(monkeypatch, name, memory, profile):
    _gpus(monkeypatch, 1, current=0, name=name, memory=memory)
    assert profile_for_device("cuda") == profile
    assert profile_for_device("cpu") == "CPU"


def test_an_unknown_gpu_asks_for_a_profile(monkeypatch):
    _gpus(monkeypatch, 1, current=0, name="NVIDIA L4", memory=24e9)
    with pytest.raises(ValueError, match=r"no built-in profile for this GPU \(NVIDIA L4, 24 GB\)"
                                         r": pass profile="):
        profile_for_device("cuda")
