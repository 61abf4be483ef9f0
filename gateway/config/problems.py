"""What is wrong, said so that it can be fixed: pydantic's errors and malformed
``FENCEGATE_*`` variables turned into problems that name the key (and the variable it
came from), for ``ConfigError``."""

from __future__ import annotations

import difflib
import json
import types
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from gateway.config.env import ENV_PREFIX
from gateway.config.settings import Settings

_EXAMPLES = {
    ("auth", "worker_tokens"): '["a-worker-token-of-16-or-more-characters"]',
    ("auth", "admin_tokens"): '["an-admin-token-of-16-or-more-characters"]',
    ("upstreams",): '[{"name": "payments", "url": "https://api.example.com"}]',
}


# ``FENCEGATE_*`` variables that are not settings and are never a misspelling of one:
# Kubernetes' service links of a Service named fencegate, the workers', the examples' and
# the deployment's own, the test suite's.
NOT_SETTINGS = ("SERVICE_", "PORT", "TEST_", "FAULTS_")
NOT_SETTINGS_NAMES = frozenset(
    {"WORKER_TOKEN", "ADMIN_TOKEN", "HEALTHCHECK_URL", "URL", "CONTROL_URL", "PROXY_URL"}
)


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """``FENCEGATE_*`` variables that name no setting (pydantic-settings reads only the
    known ones, so a misspelling such as ``FENCEGATE_DATABSE_URL`` was silently unused),
    each with the nearest valid variable when one is near. Warnings, not errors: other
    software sets variables with this prefix too. Never a value: it may be a secret."""
    known = list(Settings.model_fields)
    found = []
    for variable in sorted(environ):
        upper = variable.upper()
        if not upper.startswith(ENV_PREFIX):
            continue
        rest = upper[len(ENV_PREFIX) :]
        if rest.startswith(NOT_SETTINGS) or rest in NOT_SETTINGS_NAMES:
            continue
        top = rest.split("__", 1)[0].lower()
        if top in known:
            continue  # nested ones are checked as settings (``_unknown_setting``)
        message = f"{variable}: not a setting, ignored"
        near = nearest(top, known, cutoff=0.75)
        if near is not None:
            message += f"; did you mean {ENV_PREFIX}{near.upper()}?"
        found.append(message)
    return found


def json_variables(environ: Mapping[str, str]) -> list[str]:
    """A ``FENCEGATE_*`` variable for a list or a table must hold JSON of that shape;
    name the variable and the expected form (never its value: it may be a token)."""
    problems = []
    for variable, raw in environ.items():
        if not variable.upper().startswith(ENV_PREFIX):
            continue
        path = tuple(variable[len(ENV_PREFIX) :].lower().split("__"))
        kind = _json_kind(Settings, path)
        if kind is None:
            continue
        try:
            value = json.loads(raw)
        except ValueError:
            value = None
        if not isinstance(value, list if kind == "list" else dict):
            example = _EXAMPLES.get(path, '["…"]' if kind == "list" else '{"key": "value"}')
            problems.append(
                f"{variable}: must be a JSON {kind}, for example {variable}='{example}'"
            )
    return problems


def _json_kind(model: type[BaseModel], path: tuple[str, ...]) -> str | None:
    """``list`` or ``object`` when ``path`` names a list or table setting of ``model``."""
    field = model.model_fields.get(path[0])
    if field is None:
        return None
    annotation = field.annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _json_kind(annotation, path[1:]) if len(path) > 1 else "object"
    if len(path) > 1:
        return None
    origin = get_origin(annotation)
    if origin is list:
        return "list"
    if origin is dict:
        return "object"
    return None


def describe(error: ValidationError, environ: Mapping[str, str]) -> list[str]:
    problems = []
    for item in error.errors(include_url=False):
        key = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = _unknown_setting(item["loc"], environ)
        problems.append(f"{key}: {message}")
    return problems


def _unknown_setting(loc: tuple[int | str, ...], environ: Mapping[str, str]) -> str:
    """``unknown setting``, with the variable it came from when a ``FENCEGATE_*`` one did
    (pydantic-settings reads the nested ones: ``FENCEGATE_LEASE__MAX_TTL``) and the
    nearest valid name at that level, if one is near."""
    *parents, name = (str(part) for part in loc)
    variable = ENV_PREFIX + "__".join((*parents, name)).upper()
    from_env = any(v.upper() == variable for v in environ)
    message = f"unknown setting (from {variable})" if from_env else "unknown setting"
    near = nearest(name, _known_keys(loc[:-1]))
    if near is None:
        return message
    if from_env:
        variable = ENV_PREFIX + "__".join((*parents, near)).upper()
        return f"{message}; did you mean `{near}` ({variable})?"
    return f"{message}; did you mean `{near}`?"


def nearest(name: str, known: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The known name nearest to ``name`` (difflib's ratio, at least ``cutoff``), if one
    is near: an unknown setting's, an unknown upstream's "did you mean"."""
    near = difflib.get_close_matches(name, list(known), n=1, cutoff=cutoff)
    return near[0] if near else None


def _known_keys(loc: tuple[int | str, ...]) -> list[str]:
    """The setting names of the table at ``loc`` (as pydantic reports locations: list
    indexes, and a tagged union's tag, such as ``lease_sources.0.jwt``)."""
    annotation: Any = Settings
    for part in loc:
        annotation = _inside(annotation, part)
        if annotation is None:
            return []
    model = _model(annotation, None)
    return list(model.model_fields) if model is not None else []


def _model(annotation: Any, tag: str | None) -> type[BaseModel] | None:
    """The model that ``annotation`` stands for (through ``Annotated`` and unions; in a
    union of several, the one whose ``Literal`` field holds ``tag``)."""
    if get_origin(annotation) is Annotated:
        return _model(get_args(annotation)[0], tag)
    if get_origin(annotation) in (Union, types.UnionType):
        members = [m for m in (_model(a, None) for a in get_args(annotation)) if m is not None]
        if len(members) == 1:
            return members[0]
        for member in members:
            for field in member.model_fields.values():
                if get_origin(field.annotation) is Literal and tag in get_args(field.annotation):
                    return member
        return None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _inside(annotation: Any, part: int | str) -> Any:
    """What is at ``part`` of a value of ``annotation``: a model's field, a list's item,
    a table's value, a tagged union's member."""
    if get_origin(annotation) is Annotated:
        return _inside(get_args(annotation)[0], part)
    origin = get_origin(annotation)
    if origin is list and isinstance(part, int):
        return get_args(annotation)[0]
    if origin is dict:
        return get_args(annotation)[1]
    if origin in (Union, types.UnionType):
        members = [m for m in (_model(a, None) for a in get_args(annotation)) if m is not None]
        tagged = _model(annotation, str(part)) if len(members) > 1 else None
        if tagged is not None:
            return tagged
        return _inside(members[0], part) if len(members) == 1 else None
    model = _model(annotation, None)
    if model is None or not isinstance(part, str) or part not in model.model_fields:
        return None
    return model.model_fields[part].annotation
