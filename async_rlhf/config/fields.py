"""The rules a single key obeys, on its field: pydantic models with constraint types, so what a key accepts is
written where the key is. :func:`check_fields` turns the first broken rule into the one-line error the launcher
prints (the key, what it accepts, what it got); rules that span keys stay in ``rules.py`` and ``checks.py``."""

from __future__ import annotations

import typing
from typing import Annotated, Any

from annotated_types import Ge, Gt, Le
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from async_rlhf.config.errors import ConfigError

AtLeastOne = Annotated[int, Field(ge=1)]
"""Counts and sizes: 1 or more."""
Count = Annotated[int, Field(ge=0)]
"""0 or more (0 usually switches the thing off)."""
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
"""Seconds, rates, weights: 0 or more, never NaN."""
AboveZero = Annotated[float, Field(gt=0, allow_inf_nan=False)]
"""Seconds, rates and scales for which 0 (or less) means nothing sensible."""
Probability = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
"""A chance above 0, at most 1."""
Share = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
"""A fraction from 0 to 1, both included."""
Port = Annotated[int, Field(ge=0, le=65535)]
"""A TCP port; 0 picks a free one."""


class Section(BaseModel):
    """One section of the run configuration. Keyword construction checks the given values (pydantic's error);
    fields set afterwards (overrides, tests) are checked together by :func:`check_fields`, which ``validate``
    runs and which reports in one line; an unknown field is refused."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=False)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


def field_info(root: type[BaseModel], dotted: str) -> Any:
    """The pydantic FieldInfo of ``a.b.c`` below ``root``."""
    model: Any = root
    parts = dotted.split(".")
    for part in parts[:-1]:
        model = model.model_fields[part].annotation
    return model.model_fields[parts[-1]]


def choices(dotted: str, root: type[BaseModel] | None = None) -> tuple[str, ...]:
    """The values a choice key accepts (its ``Literal``), e.g. ``choices("train.advantage")``."""
    if root is None:
        from async_rlhf.config.roles import Config

        root = Config
    annotation = field_info(root, dotted).annotation
    if typing.get_origin(annotation) is not typing.Literal:
        raise KeyError(f"{dotted} is not a choice key")
    return typing.get_args(annotation)


def rule_message(key: str, info: Any, value: Any) -> str:
    """The one line for a value that breaks the rule on its field."""
    if typing.get_origin(info.annotation) is typing.Literal:
        return f"{key} must be one of {', '.join(typing.get_args(info.annotation))}; got {value!r}"
    bounds = {type(m): m for m in info.metadata}
    if Le in bounds:  # a port
        return f"{key} must be a TCP port, 0-65535 (0 picks a free one), got {value}"
    if Gt in bounds:
        return f"{key} must be above 0, got {value}"
    if Ge in bounds:
        return (f"{key} must be at least 1, got {value}" if bounds[Ge].ge == 1 else
                f"{key} must be 0 or more, got {value}")
    return f"{key}: {value!r} is not accepted"


def first_error(model: type[BaseModel], exc: ValidationError) -> str:
    err = exc.errors()[0]
    key = ".".join(str(p) for p in err["loc"])
    try:
        info = field_info(model, key)
    except (KeyError, AttributeError):
        return f"{key}: {err['msg']}"
    return rule_message(key, info, err.get("input"))


def check_fields(cfg: BaseModel) -> None:
    """Every field against its rule (pydantic), the first failure as a :class:`ConfigError`."""
    try:
        type(cfg).model_validate(cfg.model_dump())
    except ValidationError as exc:
        raise ConfigError(first_error(type(cfg), exc)) from None
