"""The listening sockets of a process tree, and the check that all of them are on loopback
(tests/test_cli_ray_door.py, tests/test_serve_rank_killed.py). Needs psutil."""

from __future__ import annotations

import ipaddress

import psutil

__all__ = ["assert_loopback_only", "ranks_listen", "tree_sockets"]


def _listening(procs) -> set[tuple[str, int, str]]:
    found = set()
    for p in procs:
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    found.add((c.laddr.ip, c.laddr.port, p.name()))
        except psutil.Error:
            pass  # a worker that exited meanwhile
    return found


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return (mapped or addr).is_loopback


def tree_sockets(root: psutil.Process) -> set[tuple[str, int, str]]:
    """Every listening socket of ``root`` and every process under it (Ray's GCS, raylet and
    agents are the driver's children, its workers the raylet's)."""
    return _listening([root, *root.children(recursive=True)])


def ranks_listen(sockets) -> bool:
    return any("RankActor" in name for _, _, name in sockets)


def assert_loopback_only(sockets) -> None:
    wide = sorted(s for s in sockets if not _is_loopback(s[0]))
    assert not wide, f"listening beyond loopback: {wide}"
