"""Which tensors a Hugging Face checkpoint directory holds, and in which safetensors file, read
from its index or the files' headers (no tensor data). Below both ModelConfig (which asks
whether the checkpoint carries its own head) and the weight loader (``weights``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from dp_runtime.model.config_parts import ModelConfigError
from dp_runtime.model.hf_config import read_json_object

__all__ = ["checkpoint_index", "has_weights", "open_shard"]


@contextlib.contextmanager
def open_shard(file: Path):
    """``safe_open`` on ``file``, with safetensors' own errors (truncated file, corrupt header)
    turned into a ModelConfigError naming the file."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(file), "pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise ModelConfigError(f"safetensors file {str(file)!r} is unreadable "
                               f"(truncated or corrupt?): {exc}") from None
    with handle as f:
        yield f


def checkpoint_index(path: str | Path) -> dict[str, Path]:
    """``{tensor name: file}`` of a checkpoint directory (sharded index or a scan of *.safetensors).
    ModelConfigError for a missing directory or shard, or an index that is not valid JSON."""
    root = Path(path)
    if not root.is_dir():
        raise ModelConfigError(f"checkpoint directory {str(root)!r} does not exist")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelConfigError(f"{index} has no \"weight_map\" object")
        files = {name: root / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise ModelConfigError(f"{index.name} names shard {file.name!r}, "
                                       f"which is missing from {str(root)!r}")
        return files
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise ModelConfigError(f"no *.safetensors files in checkpoint directory {str(root)!r}")
    files = {}
    for file in shards:
        with open_shard(file) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                files[name] = file
    return files


def has_weights(path: str | Path) -> bool:
    """Whether ``path`` holds weights at all (an index or a ``*.safetensors`` file): a directory
    with only a config.json (planning a model) has none."""
    root = Path(path)
    return (root / "model.safetensors.index.json").is_file() or any(root.glob("*.safetensors"))
