"""The sampling a checkpoint recommends: ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
``repetition_penalty`` of its ``generation_config.json`` (Qwen3 ships temperature 0.6, top_p
0.95, top_k 20; some checkpoints a repetition_penalty such as 1.05). A server
gives them to the fields a request leaves unset (vLLM's ``--generation-config auto``, SGLang's
``--sampling-defaults model``): ``Engine.sampling_defaults``.

A missing file, a missing key or a null value: no default for that field. A value outside the
field's limits (``SamplingParams``' own rules, so a default is never one the door refuses) is a
ModelConfigError naming the file, the key, the limit and the value: the server does not start.
``top_k`` -1 (vLLM's and transformers' "off") is read as 0, this runtime's off.

Not read: ``do_sample`` (as vLLM: a checkpoint that ships ``do_sample: false`` beside a
temperature still gets the temperature) and ``max_new_tokens`` (a request's length is OpenAI's
rule).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dp_runtime.checks import is_int
from dp_runtime.model.hf_config import read_json_object
from dp_runtime.model.model_config import ModelConfigError
from dp_runtime.serving.request import SamplingParams

__all__ = ["GENERATION_CONFIG", "SamplingDefaults", "checkpoint_sampling_defaults"]

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class SamplingDefaults:
    """A checkpoint's recommended sampling fields, each None where it recommends nothing
    (every field None: no defaults, e.g. a preset or ``--sampling-defaults none``)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def pick(self, name: str, given: Any, fallback: Any) -> Any:
        """A request's field ``name``: ``given`` where the client set it (not None), else this
        checkpoint's default, else ``fallback`` (OpenAI's)."""
        if given is not None:
            return given
        mine = getattr(self, name)
        return fallback if mine is None else mine

    def items(self) -> dict[str, Any]:
        """The sampling fields that have a default, by name."""
        return {name: value for name, value in asdict(self).items() if value is not None}


def checkpoint_sampling_defaults(model_dir: str | Path) -> SamplingDefaults:
    """The defaults in ``model_dir``'s generation_config.json (module docstring); an empty
    SamplingDefaults when there is no such file. Raises ModelConfigError naming the file, the
    key, the limit and the value for a value the field cannot take, or for a file that is not
    a JSON object."""
    file = Path(model_dir) / GENERATION_CONFIG
    if not file.is_file():
        return SamplingDefaults()
    doc = read_json_object(file)
    found: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = doc.get(name)
        if value is None:
            continue
        if name == "top_k" and is_int(value) and value == -1:
            value = 0
        try:  # the engine's own rule for the field: SamplingParams checks it at construction
            SamplingParams(**{name: value})
        except ValueError as e:  # "top_p must be a finite number in (0, 1], got 1.5"
            raise ModelConfigError(f"{file}: {str(e).removeprefix('SamplingParams.')}") from None
        found[name] = int(value) if name == "top_k" else float(value)
    return SamplingDefaults(**found)
