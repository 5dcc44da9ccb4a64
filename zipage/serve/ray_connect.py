"""`zipage serve --ray ADDRESS`: join the Ray cluster at ADDRESS, or fail at once.

`ray.init` retries an address where nothing answers for minutes; a server started against the
wrong address must say so in seconds. So the address `ray.init` would dial first (a `ray://`
address's Ray Client server; otherwise the cluster's GCS, which `auto` finds as `ray.init` does)
is tried with one TCP connection first, and an address with nothing listening is a one-line
error naming the flag and the fix.
"""

from __future__ import annotations

import os
import socket

from zipage.errors import ZipageError

LOCAL = "local"  # a new Ray instance on this machine, stopped with the server
PROBE_TIMEOUT_S = 5.0  # a host that drops the connection attempt fails after this
CLIENT_PORT = 10001  # Ray Client's default port (`ray://HOST`)
FIX = ("start a cluster with `ray start --head` (then pass --ray auto on its node), or pass "
       "--ray local for a new local instance")


def connect(address: str, replicas: int) -> None:
    """`ray.init` on the cluster at `address` (`local`: a new instance with room for `replicas`
    engine replicas and the ingress). ZipageError, within seconds, if nothing answers there."""
    import ray

    local = address == LOCAL
    if not local:
        target = _first_dial(address)
        if target is not None:
            _probe(address, *target)
    try:
        ray.init(address=None if local else address, include_dashboard=False,
                 num_cpus=max(os.cpu_count() or 1, replicas + 1) if local else None,
                 logging_level="warning")
    except Exception as error:  # noqa: BLE001 - Ray's own errors for a bad or absent cluster
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ZipageError(f"--ray: cannot connect to the Ray cluster at {address!r}: {reason}; "
                          f"{FIX}") from None


def _first_dial(address: str) -> tuple[str, int] | None:
    """(host, port) that `ray.init(address)` connects to first; None where Ray itself refuses
    the address at once (no port, not a number)."""
    default_port = None
    if address.startswith("ray://"):
        address, default_port = address.removeprefix("ray://").partition("/")[0], CLIENT_PORT
    elif address == "auto":
        from ray._private.services import canonicalize_bootstrap_address_or_die

        try:  # as ray.init finds it: RAY_ADDRESS, else the cluster `ray start` recorded here
            address = canonicalize_bootstrap_address_or_die(address)
        except ConnectionError:
            raise ZipageError(f"--ray: no running Ray cluster found for 'auto' (none started "
                              f"on this node, RAY_ADDRESS unset); {FIX}") from None
    host, _, port = address.rpartition(":")
    if host and port.isdigit():
        return host.strip("[]"), int(port)
    return (address.strip("[]"), default_port) if default_port else None


def _probe(address: str, host: str, port: int) -> None:
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
            return
    except socket.timeout:
        reason = f"no answer within {PROBE_TIMEOUT_S:g} s"
    except OSError as error:
        reason = error.strerror or str(error) or type(error).__name__
    where = address if address == f"{host}:{port}" else f"{address} ({host}:{port})"
    raise ZipageError(f"--ray: nothing answers at {where}: {reason}; {FIX}")
