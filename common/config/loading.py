"""Loading a config (YAML files, then `key.path=value` overrides), writing it back, and explaining its keys."""

from __future__ import annotations

import logging
import re
import textwrap
from collections.abc import Sequence
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Union, cast, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ValidationError,
)

from rlt2t.common.algorithms import algorithm_sections, names
from rlt2t.common.config.base import ConfigError, _boolean_numbers, did_you_mean
from rlt2t.common.config.rl import RLConfig, _retired_keys
from rlt2t.common.config.root import DERIVED_VALUES, Config

log = logging.getLogger("rlt2t.config")


class _ConfigLoader(yaml.SafeLoader):
    """YAML as configs are written: ``1e-4`` is a number (YAML 1.1 reads a float without a dot as a string),
    and a key given twice in one mapping is an error (YAML keeps the last, silently dropping the first
    block's settings)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                line = key_node.start_mark.line + 1
                raise ConfigError(f"line {line}: key {key!r} given twice in one mapping "
                                  f"(first on line {seen[key]}); merge the two")
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 (a SafeLoader)


def _parse_value(text: str) -> Any:
    """`a.b=value` values are YAML scalars: 3, 0.5, 1e-4, true, null, [1, 2], "text"."""
    try:
        return _yaml(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(keys[: i + 1])}: is a value, cannot set {dotted}")
        node = child
    node[keys[-1]] = value


def _validation_lines(err: ValidationError) -> list[str]:
    """One line per problem pydantic found, each naming its key as the config writes it (an unknown key with the
    nearest known one)."""
    lines = []
    for e in err.errors():
        key = _walk(e["loc"])[0]
        dotted = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ").removeprefix(f"{dotted}: ")  # a check that names its key itself
        if e["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key{_nearest(e['loc'])}")
        elif not key:  # a cross-field check: its message already names the keys
            lines.append(msg)
        else:
            lines.append(f"{key}: {msg} (got {e.get('input')!r})")
    return lines


def _walk(loc: Sequence[int | str]) -> tuple[str, Any]:
    """The key a pydantic error location names, as a config writes it (``reward.terms[0].params``: a list item by
    its index, a term's kind, which pydantic adds to the location, left out), and the type the location ends in
    (None where it cannot be followed)."""
    key, ann = "", cast(Any, Config)
    for part in loc:
        ann = _unwrapped(ann, part)
        origin = get_origin(ann)
        if isinstance(part, int) and origin in (list, tuple):
            key, ann = f"{key}[{part}]", get_args(ann)[0]
            continue
        if origin is dict:
            key, ann = f"{key}.{part}", get_args(ann)[1]
            continue
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            name = str(part)
            key += f".{name}" if key else name
            sub = ann.model_fields[name].annotation if name in ann.model_fields else None
            ann = algorithm_sections(loaded=True).get(name) if sub is None and ann is RLConfig else sub
            continue
        if (member := _tagged_member(ann, part)) is not None:  # the union member pydantic chose by its tag: no key
            ann = member
            continue
        key, ann = f"{key}.{part}" if key else str(part), None
    return key, ann


def _unwrapped(ann: Any, part: int | str) -> Any:
    """``ann`` without Annotated, and an Optional's model (not for a tag, which names a union member)."""
    while get_origin(ann) is Annotated:
        ann = get_args(ann)[0]
    if get_origin(ann) in (Union, UnionType) and _tagged_member(ann, part) is None:
        models = [a for a in get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) == 1:
            return models[0]
    return ann


def _tagged_member(ann: Any, tag: int | str) -> type[BaseModel] | None:
    """The member of the union ``ann`` whose ``kind`` is ``tag`` (a discriminated union's choice), else None."""
    if get_origin(ann) not in (Union, UnionType):
        return None
    for member in get_args(ann):
        if isinstance(member, type) and issubclass(member, BaseModel) and "kind" in member.model_fields \
                and member.model_fields["kind"].default == tag:
            return member
    return None


def _nearest(loc: Sequence[int | str]) -> str:
    """`` (did you mean rl.epochs?)`` for an unknown key at ``loc`` whose spelling is near a known one's, else ''."""
    prefix, model = _walk(loc[:-1])
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return ""
    prefix = f"{prefix}." if prefix else ""
    if model is RLConfig and loc[-1] in names():
        return f" (the {loc[-1]} algorithm has no {prefix}{loc[-1]} section of its own)"
    if model is RLConfig and loc[-1] in algorithm_sections(loaded=True):
        return " (the settings section of a unit of your own: read only when rl.algorithm names that unit)"
    known = list(model.model_fields) + (list(algorithm_sections(loaded=True)) if model is RLConfig else [])
    return did_you_mean(str(loc[-1]), known, prefix=prefix)


def shipped_configs() -> dict[str, Path]:
    """The example configs that ship with rlt2t (``configs/*.yaml`` of the source tree), by name."""
    from importlib.resources import files

    try:
        folder = files("rlt2t.configs")
    except ModuleNotFoundError:
        return {}
    return {Path(str(p)).stem: Path(str(p)) for p in folder.iterdir() if str(p).endswith(".yaml")}


def resolve_config_path(path: str | Path) -> Path:
    """A config file path, or the name of a shipped config (``tiny``, ``feedback``, ...)."""
    p = Path(path)
    if p.is_file():
        return p
    shipped = shipped_configs()
    if p.suffix in ("", ".yaml") and p.parent == Path(".") and p.stem in shipped:
        return shipped[p.stem]
    raise ConfigError(f"config file not found: {p} (shipped configs: {', '.join(sorted(shipped)) or 'none'})")


def load_config(paths: Sequence[str | Path] = (), overrides: Sequence[str] = ()) -> Config:
    """Merge YAML files (later wins; a shipped config may be named: ``tiny``) and ``a.b=value`` overrides onto
    the defaults, then validate."""
    tree: dict[str, Any] = {}
    for path in paths:
        path = resolve_config_path(path)
        try:
            loaded = _yaml(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
        _deep_merge(tree, loaded)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected key.path=value")
        try:
            value = _parse_value(raw)
        except ConfigError as e:
            raise ConfigError(f"override {item!r}: {e}") from None
        _set_dotted(tree, key.strip(), value)
    origin = ", ".join([str(p) for p in paths] + list(overrides)) or "defaults"
    problems = _retired_keys(tree) + _boolean_numbers(tree, Config)
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as e:  # every problem at once, each key named once
        named = [line.split(":", 1)[0] for line in problems]
        problems += [line for line in _validation_lines(e)
                     if not any(n == (k := line.split(":", 1)[0]) or n.startswith(f"{k}.") for n in named)]
    if problems:
        raise ConfigError(f"invalid config ({origin}):\n  " + "\n  ".join(problems))
    for line in cfg.derived:
        if line not in _logged:  # once per process: workers and stages load the same config again
            _logged.add(line)
            log.info("config: %s", line)
    return cfg


_logged: set[str] = set()


def _deep_merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_merge(dst[k], v)
        else:
            dst[k] = v


def config_to_yaml(cfg: Config) -> str:
    """The resolved config as YAML, headed by a comment per value a cross-section rule derived."""
    notes = "".join(f"# derived: {line}\n" for line in cfg.derived)
    return notes + yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def explain_derived(width: int = 100) -> list[str]:
    """The cross-section rules that set a value left unset (DERIVED_VALUES), for `rlt2t config --explain`."""
    lines = ["Values derived when left unset (a loaded config logs each one it applies; `rlt2t config` heads its "
             "output with them):"]
    for key, rule in DERIVED_VALUES:
        lines.extend(textwrap.wrap(f"{key}: {rule}", width=width, initial_indent="  ", subsequent_indent="    "))
    return lines


def explain(model: type[BaseModel] = Config, prefix: str = "", width: int = 100) -> list[str]:
    """Every key with its default and its whole description (wrapped), for `rlt2t config --explain`."""
    lines = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            lines.extend(explain(ann, f"{prefix}{name}.", width))
            continue
        default = field.get_default(call_default_factory=True)
        text = " ".join((field.description or "").split())
        if model is RLConfig and name == "algorithm":
            text += f" Registered: {', '.join(names())}."
        lines.append(f"{prefix}{name} = {default!r}")
        lines.extend(textwrap.wrap(text, width=width, initial_indent="    ", subsequent_indent="    "))
    if model is RLConfig:  # each algorithm's own section, rl.<name>
        for name, settings in algorithm_sections(loaded=True).items():
            lines.extend(explain(settings, f"{prefix}{name}.", width))
    return lines
