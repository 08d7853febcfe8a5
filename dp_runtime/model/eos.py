"""The end-of-sequence token ids of a Hugging Face checkpoint directory.

``eos_token_id`` may stand in ``config.json`` and in ``generation_config.json``, as one id or a
list; transformers' ``generate`` stops at the generation config's, which it takes from the
model config when the file is absent. Both are read and their union is kept, so a request
stops where transformers' would whichever file a checkpoint puts it in.
"""

from __future__ import annotations

from pathlib import Path

from dp_runtime.checks import is_int
from dp_runtime.model.hf_config import read_json_object
from dp_runtime.model.model_config import ModelConfigError

__all__ = ["checkpoint_eos_ids"]

_FILES = ("config.json", "generation_config.json")


def checkpoint_eos_ids(model_dir: str | Path) -> tuple[int, ...]:
    """EOS ids of ``model_dir``, in file order, each once; () when neither file names one.
    ModelConfigError naming the file and the value when ``eos_token_id`` is not an id >= 0 or
    a list of them."""
    ids: list[int] = []
    for name in _FILES:
        file = Path(model_dir) / name
        if not file.is_file():
            continue
        value = read_json_object(file).get("eos_token_id")
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        if not all(is_int(v) and v >= 0 for v in values):
            raise ModelConfigError(f"{file}: eos_token_id must be a token id >= 0 or a list of "
                                   f"them, got {value!r}")
        ids.extend(int(v) for v in values)
    return tuple(dict.fromkeys(ids))
