"""The typed config tree: YAML preset + ``--set key=value`` overrides, validated up front.

    elastic-ddp train experiments/configs/digits_cnn.yaml --set scaling.max_workers=4

Every field has a description; unknown keys are refused. Validation errors name the
field (``batch.global_batch_size``) and say how to fix it; the CLI turns them into
exit code 2 before any Ray or MLflow work starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from elastic_ddp.config.errors import ConfigError
from elastic_ddp.config.sections import (MAX_RUN_NAME_BYTES, BatchConfig, DataConfig, ModelConfig,  # noqa: F401
                                         OptimConfig, ParallelConfig, RunConfig, ScalingConfig, Section,
                                         TaskConfig, TrainConfig, check_run_name)


class Config(Section):
    """The whole job. ``Config.load(path, overrides)`` is the only constructor callers need."""

    seed: int = Field(0, description="Seeds model init and each epoch's sample order.")
    data: DataConfig
    task: TaskConfig = Field(default_factory=TaskConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _task_named(self) -> "Config":
        if self.task.path is None and self.model.name is None:
            raise ValueError("no task: set task.path ('package.module:Name' or "
                             "'file.py:Name') or model.name (mlp, cnn, gpt)")
        if self.task.path and self.model.name and self.task.path != self.model.name:
            raise ValueError(f"task.path={self.task.path!r} and model.name="
                             f"{self.model.name!r} name two tasks; keep one")
        return self

    @model_validator(mode="after")
    def _per_step_fits(self) -> "Config":
        if self.scaling.fault_tolerance == "per_step":
            if self.parallel.strategy != "ddp" or self.parallel.comm_hook != "none":
                raise ValueError(
                    "scaling.fault_tolerance=per_step replicates the model in every replica "
                    f"(torchft): parallel.strategy={self.parallel.strategy!r} and "
                    f"parallel.comm_hook={self.parallel.comm_hook!r} are not supported with it; "
                    "use strategy ddp without a comm hook, or fault_tolerance restart")
            if self.parallel.sync_batchnorm:
                raise ValueError("scaling.fault_tolerance=per_step: parallel.sync_batchnorm needs "
                                 "one process group over every worker; turn one of them off")
        return self

    @model_validator(mode="after")
    def _batch_fits_world_sizes(self) -> "Config":
        from elastic_ddp.batching import check_batch_config

        check_batch_config(
            global_batch_size=self.batch.global_batch_size,
            micro_batch_size=self.batch.micro_batch_size,
            min_workers=self.scaling.min_workers,
            max_workers=self.scaling.max_workers,
            policy=self.batch.policy,
            partitions=self.partitions,
        )
        return self

    @property
    def partitions(self) -> int:
        """Canonical partitions of the epoch order: 1 under ``data.order: permutation``
        (every rank reads everything), else ``data.partitions`` or its default."""
        from elastic_ddp.batching import default_partitions

        if self.data.order == "permutation":
            return 1
        return self.data.partitions or default_partitions(self.scaling.max_workers)

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str | os.PathLike | None = None, overrides: list[str] | None = None,
             base: dict | None = None) -> "Config":
        """Read a YAML preset, apply ``key.sub=value`` overrides, validate.

        An override's value is typed by the field it sets (``elastic_ddp.config.overrides``):
        the raw text for a string field, true/false for a bool, YAML flow syntax for a
        list or dict, YAML scalars for free-form (``Any``) values.

        Raises:
            ConfigError: unreadable file, bad override syntax, an unknown key or an
                invalid value; the message names the file or the dotted field.
        """
        raw: dict[str, Any] = dict(base or {})
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"config file {p} not found; pass a YAML file such as "
                                  "experiments/configs/digits_cnn.yaml")
            try:
                loaded = yaml.safe_load(p.read_text()) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"{p}: not valid YAML: {e}") from e
            if not isinstance(loaded, dict):
                raise ConfigError(f"{p}: the top level must be a mapping of sections")
            raw = _deep_merge(raw, loaded)
        from elastic_ddp.config.overrides import parse_override  # imports ConfigError from here

        for item in overrides or []:
            # Typed by the target field's annotation (elastic_ddp/config/overrides.py): a str
            # field takes the raw text, a bool only true/false, a list YAML flow syntax.
            _set_dotted(raw, *parse_override(cls, item))
        source = str(path) if path else "<dict>"
        if overrides:
            source += " with --set " + " ".join(overrides)
        return cls.from_dict(raw, source=source)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "<dict>") -> "Config":
        """Validate a plain dict. Raises ConfigError naming the dotted field."""
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            raise ConfigError(_format_validation_error(e, source, cls)) from None
        except ConfigError as e:  # raised by check_batch_config inside a validator
            raise ConfigError(f"{source}: {e}") from None

    def changed_fields(self) -> dict[str, Any]:
        """Dotted keys -> values (JSON-ready, as in ``model_dump(mode="json")``) of the
        fields whose value differs from its default, in declaration order; for logging
        what a run changed. A required field (``data.train_path``) has no default and
        is always listed; a dict or list field is compared and listed whole."""
        return _changed_fields(self, None, "")

    def with_run_name(self, name: str) -> "Config":
        """This config under ``run.name`` ``name``: itself when the name is its own, else a
        copy whose ``run.name`` is validated on assignment (:func:`check_run_name`).

        Raises:
            pydantic.ValidationError: ``name`` cannot name a run.
        """
        if name == self.run.name:
            return self
        out = self.model_copy(deep=True)
        out.run.name = name
        return out

    def to_flat_dict(self) -> dict[str, Any]:
        """Dotted keys -> values, for MLflow params."""
        out: dict[str, Any] = {}

        def walk(prefix: str, obj: Any) -> None:
            if isinstance(obj, dict):
                for k, v in obj.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = obj

        walk("", self.model_dump(mode="json"))
        return out


def _changed_fields(obj: BaseModel, default: BaseModel | None, prefix: str) -> dict[str, Any]:
    # ``default``: the section's default instance (a ``default_factory`` may preset its
    # fields); None where the section itself is required (``data``, the root): then each
    # field's own default counts.
    out: dict[str, Any] = {}
    dumped = obj.model_dump(mode="json")
    for name, field in type(obj).model_fields.items():
        key = f"{prefix}{name}"
        value = getattr(obj, name)
        if default is not None:
            has_default, ref = True, getattr(default, name)
        elif field.is_required():
            has_default, ref = False, None
        else:
            has_default, ref = True, field.get_default(call_default_factory=True)
        if isinstance(value, BaseModel):
            sub_default = ref if isinstance(ref, BaseModel) else None
            out.update(_changed_fields(value, sub_default, key + "."))
        elif not has_default or value != ref:
            out[key] = dumped[name]
    return out


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {key}: {part} is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def _format_validation_error(e: ValidationError, source: str, model: type[BaseModel]) -> str:
    from elastic_ddp.config.overrides import section_at, unknown_key_hint

    lines = [f"{source}: invalid config"]
    for err in e.errors():
        parts = [str(p) for p in err["loc"] if not str(p).startswith("function-")]
        loc = ".".join(parts)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            section = section_at(model, parts[:-1]) if parts else None
            hint = (unknown_key_hint(section, parts[:-1], parts[-1]) if section is not None
                    else "remove it or check the spelling")
            msg = f"unknown key; {hint} (every field: elastic-ddp config --describe)"
        elif err["type"] == "literal_error":
            msg = f"{err.get('input')!r} is not allowed: {msg}"
        # Cross-field errors have no location; their message names the fields itself.
        lines.append(f"  {loc}: {msg}" if loc else f"  {msg}")
    return "\n".join(lines)
