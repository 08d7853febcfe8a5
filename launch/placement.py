"""Where the ranks go: one placement group, one bundle per rank, ranks assigned after placement.

- Bundle: ``{"GPU": 1, "CPU": c}`` per rank on CUDA (the CPUs feed the rank's Python step loop;
  the actor asks for exactly its bundle), ``{"CPU": c}`` on CPU.
- Strategy: ``STRICT_PACK`` when one node can hold every bundle (the ranks then share a node:
  the DP step sync takes its shared-memory path and NCCL its NVLink path), else ``PACK``
  (fill nodes in turn, spill to the next).
- Ranks: actors are created per bundle, then asked where they landed; rank order is by node
  (IP, then node id), then by GPU id, then by bundle index (``assign_ranks``), so ranks of one
  node are contiguous
  and follow the GPU numbering whatever order Ray placed the bundles in.

The pure parts (bundle, strategy, rank order) are importable without Ray.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["assign_ranks", "bundle_for", "check_fits", "choose_strategy", "create_placement_group"]


def bundle_for(device: str, cpus_per_rank: float = 1) -> dict[str, float]:
    """The resources of one rank's bundle on ``device`` (``cpu`` or ``cuda``)."""
    if cpus_per_rank <= 0:
        raise ValueError(f"cpus_per_rank must be > 0, got {cpus_per_rank}")
    bundle = {"CPU": float(cpus_per_rank)}
    if device == "cuda":
        bundle["GPU"] = 1.0
    return bundle


def _fits(node: Mapping[str, float], bundle: Mapping[str, float], count: int) -> bool:
    return all(node.get(k, 0.0) >= v * count for k, v in bundle.items())


def choose_strategy(nodes: Sequence[Mapping[str, float]], bundle: Mapping[str, float],
                    world_size: int) -> str:
    """``STRICT_PACK`` when one node's total resources hold ``world_size`` bundles, else
    ``PACK``."""
    return "STRICT_PACK" if any(_fits(n, bundle, world_size) for n in nodes) else "PACK"


def check_fits(nodes: Sequence[Mapping[str, float]], bundle: Mapping[str, float],
               world_size: int) -> None:
    """Raise ValueError when the cluster cannot hold ``world_size`` bundles at all (each bundle
    must fit on one node), naming the need and what the nodes have."""
    per_node = []
    for n in nodes:
        k = min((int(n.get(r, 0.0) // v) for r, v in bundle.items()), default=0)
        per_node.append(k)
    if sum(per_node) < world_size:
        have = "; ".join(
            ", ".join(f"{r}={n.get(r, 0.0):g}" for r in sorted(bundle)) for n in nodes
        ) or "no alive nodes"
        raise ValueError(
            f"the Ray cluster cannot place {world_size} ranks of {dict(bundle)} each "
            f"(room for {sum(per_node)}; nodes have: {have})"
        )


def _ip_key(ip: str) -> tuple[int, Any]:
    try:
        return (0, int(ipaddress.ip_address(ip)))
    except ValueError:
        return (1, ip)


def _gpu_key(gpu_ids: Sequence[str]) -> tuple[int, ...]:
    return tuple(sorted(int(g) for g in gpu_ids if str(g).isdigit()))


def assign_ranks(locations: Sequence[Mapping[str, Any]]) -> list[int]:
    """Rank of each bundle: ``locations[i]`` is where bundle i's actor landed (``node_ip``,
    ``node_id``, ``gpu_ids``). Ordered by node IP, then node id (several nodes can share an IP:
    containers, Ray's test clusters), then GPU ids, then bundle index, so the ranks of one node
    are contiguous. Returns ``ranks`` with ``ranks[i]`` the rank of bundle i (a permutation of
    ``range(len(locations))``)."""
    order = sorted(
        range(len(locations)),
        key=lambda i: (_ip_key(locations[i]["node_ip"]), str(locations[i].get("node_id", "")),
                       _gpu_key(locations[i].get("gpu_ids", ())), i),
    )
    ranks = [0] * len(locations)
    for rank, i in enumerate(order):
        ranks[i] = rank
    return ranks


def create_placement_group(world_size: int, device: str, *, cpus_per_rank: float = 1,
                           timeout_s: float = 60.0) -> Any:
    """Create and wait for the placement group of ``world_size`` ranks; returns it.

    Raises ValueError at once when the cluster can never hold it, TimeoutError when it is not
    ready within ``timeout_s`` (resources held by something else); the group is removed then.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle = bundle_for(device, cpus_per_rank)
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    check_fits(nodes, bundle, world_size)
    strategy = choose_strategy(nodes, bundle, world_size)
    pg = placement_group([dict(bundle) for _ in range(world_size)], strategy=strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise TimeoutError(
            f"placement group of {world_size} x {bundle} ({strategy}) not ready within "
            f"{timeout_s} s: "
            f"available now: {ray.available_resources()}"
        )
    return pg
