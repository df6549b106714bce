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
