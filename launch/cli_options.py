"""The options of every command that starts a gang (``run``; ``serve`` too), checked before
anything slow starts: no Ray, no model, no process group until they all hold.

``check_gang_options`` is the one entry: the model, launcher, device, dtype, dp, dispatcher,
ray-address, max-running-requests, chunked-prefill-size, context-len, schedule-policy,
mixed-step-tokens and kv-cache-dtype options (plus the Ray launcher's num-cpus, max-restarts and
hang-timeout), each checked by itself and then together.
It returns a ``CheckedOptions`` holding the RunConfig, the keywords of ``cli_run.execute`` and the
RankSpec checked against the device the ranks will most likely get. Every refusal is a
UsageError (exit 2, one line) naming the option as typed, the rule and the value.

Combinations refused (the runtime would refuse them too, but only after Ray and a model
started, or after a gang restart per try):

- ``--launcher ray`` (the default) where Ray does not import (``pip install 'dp-runtime[ray]'``;
  the base install runs ``--launcher local``);
- ``--dispatcher local`` with more than one rank (it exchanges nothing);
- ``--dispatcher flashinfer`` on CPU, or where the ranks run on this machine and flashinfer does
  not import (the install hint names ``dp-runtime[gpu]``);
- any other rule of ``dp_runtime.choices.resolve_choices`` (all_to_all under CUDA graphs);
- ``--context-len`` over the model's limit (``RankSpec``'s rule, named as the option).

A joined cluster (``--ray-address``, RAY_ADDRESS) may have other machines: what only those can
answer (flashinfer there, their GPUs) is checked again once the cluster is known.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dp_runtime.options import DEFAULTS
from launch.cli_errors import LOG_LEVELS, UsageError, check_choice

if TYPE_CHECKING:
    from dp_runtime.rank_spec import RankSpec
    from launch.run_config import RunConfig

__all__ = ["DEVICES", "LAUNCHERS", "CheckedOptions", "check_choices", "check_gang_options",
           "check_launch", "check_synthetic_fits", "provisional_device", "ranks_run_here"]

LAUNCHERS = ("ray", "local")
DEVICES = ("auto", "cpu", "cuda")
_RAY_ONLY = ("--ray-address", "--num-cpus", "--max-restarts", "--hang-timeout")
INSTALL_GPU = "pip install 'dp-runtime[gpu]'"


@dataclass(frozen=True)
class CheckedOptions:
    """What ``check_gang_options`` accepted: ``cfg`` (the RunConfig), ``launch`` (the keywords
    of ``cli_run.execute``: launcher, device, ray_address, num_cpus, max_restarts,
    hang_timeout_s), and ``spec``, the RankSpec for the device the ranks will most likely get
    (a joined cluster's is known only once connected: ``cfg.spec(cluster_device(...))``)."""

    cfg: RunConfig
    launch: dict[str, Any]
    spec: RankSpec


def check_gang_options(*, model: str = "tiny", launcher: str = "ray", device: str = "auto",
                       dtype: str = DEFAULTS.dtype, dp: int | None = None,
                       dispatcher: str = DEFAULTS.dispatcher, ray_address: str | None = None,
                       max_running_requests: int = DEFAULTS.max_running_requests,
                       chunked_prefill_size: int = DEFAULTS.chunked_prefill_size,
                       context_len: int | None = DEFAULTS.context_len,
                       schedule_policy: str = DEFAULTS.schedule_policy,
                       mixed_step_tokens: int | str = DEFAULTS.mixed_step_tokens,
                       kv_cache_dtype: str = DEFAULTS.kv_cache_dtype,
                       num_cpus: int | None = None, max_restarts: int | None = None,
                       hang_timeout: float | None = None, log_level: str = "warning",
                       ray_address_env: str | None = None, **run_fields: Any) -> CheckedOptions:
    """Check the gang options (module docstring) and return them resolved. ``None`` means "not
    given". ``mixed_step_tokens`` may be the option's text (``"auto"`` or digits).
    ``ray_address_env`` is RAY_ADDRESS (default: read from the environment).
    ``run_fields`` are further RunConfig fields (``requests``, ``prompt_len``, ``seed``, ...).
    Imports torch (the spec reads the model) but starts nothing. Raises UsageError, or the
    ValueError of a model config or RuntimeConfig rule (a user error too: exit 2)."""
    from launch.run_config import RunConfig, parse_mixed_step_tokens

    if ray_address_env is None:
        ray_address_env = os.environ.get("RAY_ADDRESS") or None
    dp, launch = check_launch(launcher=launcher, device=device, dp=dp, ray_address=ray_address,
                              num_cpus=num_cpus, max_restarts=max_restarts,
                              hang_timeout=hang_timeout, log_level=log_level,
                              ray_address_env=ray_address_env)
    if launcher == "ray" and importlib.util.find_spec("ray") is None:
        raise UsageError("--launcher ray (the default) needs Ray, which does not import here: "
                         "pip install 'dp-runtime[ray]', or run one rank with --launcher local")
    cfg = RunConfig(dp=dp, model=model, dispatcher=dispatcher, dtype=dtype,
                    max_running_requests=max_running_requests,
                    chunked_prefill_size=chunked_prefill_size, context_len=context_len,
                    schedule_policy=schedule_policy, kv_cache_dtype=kv_cache_dtype,
                    mixed_step_tokens=parse_mixed_step_tokens(mixed_step_tokens,
                                                              chunked_prefill_size),
                    **run_fields)
    here = ranks_run_here(launcher, ray_address, ray_address_env)
    spec = cfg.spec(provisional_device(launch["device"], here))
    check_choices(spec, here)
    if here:  # CPU ranks on this machine: weights and KV cache in its memory, before loading
        from launch.host_memory import check_host_memory

        check_host_memory(spec, spec.runtime.world_size, model)
    return CheckedOptions(cfg, launch, spec)


def check_launch(*, launcher: str, device: str, dp: int | None, ray_address: str | None = None,
                 num_cpus: int | None = None, max_restarts: int | None = None,
                 hang_timeout: float | None = None, log_level: str = "warning",
                 ray_address_env: str | None = None) -> tuple[int, dict[str, Any]]:
    """Check the launch options by themselves (pure, no imports); returns ``(dp, launch)``,
    launch being the keywords of ``cli_run.execute`` with their defaults filled in.

    Raises UsageError naming the option as typed: an unknown choice, a number out of range, a
    Ray option with ``--launcher local``, ``--num-cpus`` when the run joins an existing cluster
    (it sizes only a private one) or when it cannot hold ``--dp`` ranks of one CPU each.
    """
    check_choice("--launcher", launcher, LAUNCHERS)
    check_choice("--device", device, DEVICES)
    check_choice("--log-level", log_level, LOG_LEVELS)
    if dp is None:
        dp = 1 if launcher == "local" else 2
    if dp < 1:
        raise UsageError(f"--dp must be an integer >= 1, got {dp}")
    if launcher == "local":
        if dp != 1:
            raise UsageError(f"--launcher local runs one rank; got --dp {dp} (use --launcher ray)")
        values = (ray_address, num_cpus, max_restarts, hang_timeout)
        given = [opt for opt, v in zip(_RAY_ONLY, values, strict=True) if v is not None]
        if given:
            raise UsageError(f"{given[0]} applies to --launcher ray; --launcher local runs one "
                             f"rank in this process")
    if num_cpus is not None:
        if num_cpus < 1:
            raise UsageError(f"--num-cpus must be an integer >= 1, got {num_cpus}")
        if ray_address is not None or ray_address_env:
            where = (f"--ray-address {ray_address}" if ray_address is not None
                     else "RAY_ADDRESS (a Ray job)")
            raise UsageError(f"--num-cpus sizes a private local cluster; with {where} the run "
                             f"joins an existing cluster, whose CPUs are its own")
        if num_cpus < dp:
            raise UsageError(f"--num-cpus {num_cpus} cannot hold --dp {dp} ranks of one CPU each")
    if max_restarts is not None and max_restarts < 0:
        raise UsageError(f"--max-restarts must be an integer >= 0, got {max_restarts}")
    if hang_timeout is not None and not (math.isfinite(hang_timeout) and hang_timeout > 0):
        raise UsageError(f"--hang-timeout must be a number of seconds > 0, got {hang_timeout}")
    if ray_address is not None and not ray_address.strip():
        raise UsageError("--ray-address must not be empty (leave it out for a private local "
                         "cluster)")
    launch = dict(launcher=launcher, device=device, ray_address=ray_address, num_cpus=num_cpus,
                  max_restarts=DEFAULTS.max_restarts if max_restarts is None else max_restarts,
                  hang_timeout_s=DEFAULTS.hang_timeout_s if hang_timeout is None else hang_timeout)
    return dp, launch


def ranks_run_here(launcher: str, ray_address: str | None, ray_address_env: str | None) -> bool:
    """Whether every rank runs on this machine: the local launcher, or a private Ray cluster
    (no address given, not inside a Ray job)."""
    return launcher == "local" or (ray_address is None and not ray_address_env)


def provisional_device(device: str, here: bool) -> str:
    """The device to check the spec against before Ray starts: the asked one, else what this
    machine has (a joined cluster's is checked again once known). Raises UsageError for
    ``--device cuda`` where the ranks would run here and torch sees no GPU."""
    import torch

    if device == "cuda" and here and not torch.cuda.is_available():
        raise UsageError("--device cuda, but torch sees no CUDA GPU on this machine (use --device "
                         "cpu or auto)")
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_choices(spec: RankSpec, here: bool) -> None:
    """Refuse what the ranks' choices (``dp_runtime.choices``) would refuse once built: the
    dispatcher for the world size and device, flashinfer where it cannot run. ``here``: the
    ranks run on this machine, so whether flashinfer imports here is theirs to know."""
    from dispatcher.factory import KINDS
    from dp_runtime.choices import resolve_choices

    kind, world, dev = spec.dispatcher, spec.runtime.world_size, spec.runtime.device.type
    facts = KINDS.get(kind)  # None: auto (RankSpec refused any other name)
    if facts is not None and facts.single_rank and world != 1:
        multi = ["auto", *(k for k, cls in KINDS.items() if not cls.single_rank)]
        raise UsageError(f"--dispatcher {kind} runs one rank (it exchanges nothing); got --dp "
                         f"{world} (use {', '.join(multi[:-1])} or {multi[-1]})")
    importable = importlib.util.find_spec("flashinfer") is not None
    if facts is not None and facts.cuda_only and dev != "cuda":
        raise UsageError(f"--dispatcher {kind} runs on CUDA; the ranks get --device {dev}")
    if (facts is not None and facts.package and here
            and importlib.util.find_spec(facts.package) is None):
        raise UsageError(f"--dispatcher {kind} needs {facts.package}, which does not import here: "
                         f"{facts.install_hint}")
    try:
        resolve_choices(dispatcher=kind, use_cuda_graph=spec.use_cuda_graph,
                        attention=spec.attention, world_size=world, device_type=dev,
                        dtype=spec.runtime.dtype, head_dim=spec.model_config().head_dim,
                        capture_sizes=spec.runtime.cuda_graph_bs,
                        flashinfer_dispatch=(False, "not asked before launch"),
                        flashinfer_importable=importable or not here)
    except ValueError as e:
        raise UsageError(f"--dispatcher {kind}: {e}") from None


def check_synthetic_fits(cfg: RunConfig, spec: RankSpec) -> None:
    """Refuse a synthetic workload (no ``--workload``) none of whose requests could run: they
    all have ``--prompt-len`` tokens, so over the context every one would be refused."""
    if cfg.workload is not None:
        return
    need, limit = cfg.prompt_len + cfg.max_new_tokens - 1, spec.context_len
    if need > limit:
        given = "--context-len" if cfg.context_len is not None else "the default context length"
        raise UsageError(f"--prompt-len {cfg.prompt_len} + --max-new-tokens {cfg.max_new_tokens} "
                         f"- 1 = {need} KV tokens exceeds {given} {limit} (the model allows up to "
                         f"{spec.model_config().max_positions} with --context-len)")
