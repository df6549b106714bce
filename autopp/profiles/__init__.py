"""Device profiles: what a device computes and holds, and how fast its links are.

* :mod:`autopp.profiles.devices`: :class:`DeviceProfile`, the built-in profiles (``PROFILES``),
  registering, saving and loading them, and the link each mesh dim runs over
  (:func:`~autopp.profiles.devices.mesh_links`).
* :mod:`autopp.profiles.collectives`: the α-β price of one collective over n ranks (latency
  per ring step, wire bytes over bandwidth), the one home of that rule.
* :mod:`autopp.profiles.measure`: measuring this machine (matmul rates, collective bandwidth
  and latency) into a profile, cached on disk.
* :mod:`autopp.profiles.lookup`: :func:`get_profile`, a profile by name.
"""

from autopp.profiles.devices import (
    PROFILES,
    DeviceProfile,
    load_profile,
    mesh_links,
    register_profile,
    save_profile,
    with_overrides,
)
from autopp.profiles.lookup import get_profile
from autopp.profiles.measure import measure_profile

__all__ = [
    "PROFILES",
    "DeviceProfile",
    "get_profile",
    "load_profile",
    "measure_profile",
    "mesh_links",
    "register_profile",
    "save_profile",
    "with_overrides",
]
