"""A device profile by name: the built-in ones, registered ones, or this machine measured."""

from __future__ import annotations

from autopp.profiles.devices import (
    MEASURE,
    MEASURED_PREFIX,
    PROFILES,
    DeviceProfile,
    load_profile,
    registered_names,
    registered_profile,
)
from autopp.profiles.measure import measure_profile


def get_profile(profile: str | DeviceProfile) -> DeviceProfile:
    """A profile by name or the profile itself.

    Names: the built-in ``"H100"``, ``"H200"``, ``"A100"``, ``"CPU"``; names registered
    with :func:`register_profile`; ``"measure"``: this machine's measured profile for
    the default world size (read from the cache, measured if absent; see
    :func:`autopp.profiles.measure.measure_profile`); ``"measured-<hash>"``: a measured
    profile stored in :func:`profile_cache_dir`.
    """
    if isinstance(profile, DeviceProfile):
        return profile
    if profile in PROFILES:
        return PROFILES[profile]
    if registered_profile(profile) is not None:
        return registered_profile(profile)
    if profile == MEASURE:
        return measure_profile()
    if isinstance(profile, str) and profile.startswith(MEASURED_PREFIX):
        return load_profile(profile)
    raise ValueError(
        f"unknown device profile {profile!r}; choose one of {sorted(PROFILES)}, "
        f"{MEASURE!r} (measure this machine), a name given to register_profile "
        f"({registered_names()}), or pass a DeviceProfile"
    )


#: Built-in profile of a CUDA device, by a substring of its name; A100s by memory too.
_CUDA_NAMES = (("H200", "H200"), ("H100", "H100"), ("A100", "A100"))


def profile_for_device(device_type: str) -> str:
    """The built-in profile of the device this process runs on: "CPU" for "cpu"; for
    "cuda", the current device by its name and memory (H100, H200, A100 80 GB, A100 40 GB).
    An unknown GPU is an error naming ``profile=``: planning it as an H100 would plan
    another memory size and speed."""
    if device_type == "cpu":
        return "CPU"
    if device_type != "cuda":
        raise ValueError(f"no default device profile for device type {device_type!r}: pass "
                         f"profile= (one of {sorted(PROFILES)} or {MEASURE!r})")
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    for part, name in _CUDA_NAMES:
        if part in props.name:
            if name == "A100" and props.total_memory < 60e9:
                return "A100-40GB"
            return name
    raise ValueError(
        f"no built-in profile for this GPU ({props.name}, {props.total_memory / 1e9:.0f} GB): "
        f"pass profile= (one of {sorted(PROFILES)}, {MEASURE!r} to measure it, or a profile "
        "registered with autopp.profiles.register_profile)")
