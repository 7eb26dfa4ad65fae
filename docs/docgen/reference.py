"""Reference pages from the code: the CLI (argparse), the config keys (the config models), the HTTP API
(each service's OpenAPI document) and the Python API (`rlt2t`'s public names, rendered from their docstrings by
mkdocstrings when the site builds)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from docgen.markdown import Files, code_block, header, table

# -- reference: CLI -----------------------------------------------------------------------------------------

def walk_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and every subcommand parser under it, depth first, in registration order."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to the same parser once
                yield from walk_parsers(sub)


@contextlib.contextmanager
def columns(width: int) -> Iterator[None]:
    """argparse wraps help to $COLUMNS: fix it, so the page does not depend on the terminal."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def render_cli() -> str:
    from rlt2t.cli import build_parser

    lines = [header("rlt2t.cli.build_parser()"), "# Command line", "",
             "Every `rlt2t` command and subcommand with its `--help`. Commands that read the config take "
             "`--config FILE` and `key.path=value` overrides (see [the config reference](config.md)).", ""]
    with columns(102):  # argparse takes 2 off: 100 characters
        for parser in walk_parsers(build_parser()):
            lines += [f"## {parser.prog}", "", *code_block(parser.format_help().rstrip().splitlines())]
    return "\n".join(lines)


# -- reference: config --------------------------------------------------------------------------------------

def type_name(annotation: Any) -> str:
    """A field's type in words: `int`, `str or null`, `list of str`, one of the literal values."""
    from typing import Annotated, Literal, Union, get_args, get_origin

    from pydantic import BaseModel

    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin is Annotated:
        return type_name(args[0])
    if origin is Union or type(annotation).__name__ == "UnionType":
        members = [a for a in args if a is not type(None)]
        if all(isinstance(a, type) and issubclass(a, BaseModel) for a in members):
            return "[reward term](#reward-terms)"
        return " or ".join(type_name(a) for a in args)
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"mapping of {type_name(args[0])} to {type_name(args[1])}"
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def constraints(metadata: list) -> str:
    """The bounds pydantic checks (`≥ 1`, `< 0.5`, at least 1 item)."""
    words = []
    for m in metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                words.append(f"{sign} {getattr(m, attr)}")
        if getattr(m, "min_length", None):
            words.append(f"length ≥ {m.min_length}")
    return ", ".join(words)


def default_text(field: Any) -> str:
    from pydantic_core import PydanticUndefined, to_jsonable_python

    if field.is_required():
        return "required"
    default = field.get_default(call_default_factory=True)
    return "" if default is PydanticUndefined else f"`{json.dumps(to_jsonable_python(default))}`"


def config_tables(model: type, prefix: str, title: str, level: int) -> list[str]:
    """A heading, the model's docstring, a table of its own keys, then a section per nested model."""
    from pydantic import BaseModel

    lines = [f"{'#' * level} {title}", ""]
    if doc := " ".join((model.__doc__ or "").split()):
        lines += [doc, ""]
    rows, nested = [], []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            nested.append((name, ann))
            continue
        kind = type_name(ann) + (f" ({bounds})" if (bounds := constraints(field.metadata)) else "")
        meaning = field.description or ""
        if prefix == "rl." and name == "algorithm":  # the registry's names, not a copy of them
            from rlt2t.common.algorithms import names

            meaning += f" Registered: {', '.join(f'`{n}`' for n in names())}."
        rows.append([f"`{prefix}{name}`", kind, default_text(field), meaning])
    if rows:
        lines += table(["key", "type", "default", "meaning"], rows)
    for name, sub in nested:
        lines += config_tables(sub, f"{prefix}{name}.", f"`{prefix}{name}`", level + 1)
    return lines


def render_config(model: type | None = None) -> str:
    from rlt2t.common import config
    from rlt2t.common.algorithms import algorithm_sections

    model = model or config.Config
    lines = [header("rlt2t.common.config"), "# Configuration keys", "",
             "Every key of the config tree with its type, default and meaning (what `rlt2t config --explain` "
             "prints). Defaults are the embedded default run (`make demo`); YAML files (`--config FILE`) "
             "override them and `key.path=value` arguments override the YAML. A default shown for a key that "
             "another key decides (`reward.bleu_weight` follows `metric.bleu_weight` unless set) is the "
             "model's own.", ""]
    for name, field in model.model_fields.items():
        lines += config_tables(field.annotation, f"{name}.", f"`{name}`", 2)
        if field.annotation is config.RLConfig:  # each algorithm's own section
            for algo, settings in algorithm_sections().items():
                lines += config_tables(settings, f"{name}.{algo}.", f"`{name}.{algo}`", 3)
    lines += ["## Reward terms", "",
              "Each entry of `reward.terms` (and of each list in `reward.named`) is one of these, chosen by "
              "`kind`; the reward is Σ weight · term.", ""]
    for term in (config.MetricTerm, config.RewardModelTerm, config.ClassifierTerm, config.HttpTerm, config.PythonTerm):
        kind = term.model_fields["kind"].default
        lines += config_tables(term, "", f"`kind: {kind}`", 3)
    return "\n".join(lines)


# -- reference: HTTP ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class App:
    name: str
    title: str
    command: str


APPS = (App("policy", "Policy server", "rlt2t serve policy"), App("reward", "Reward server", "rlt2t serve reward"),
        App("annotation", "Annotation app", "rlt2t annotate serve"))


def openapi_documents() -> dict[str, dict]:
    """Each app's OpenAPI document, built on the default config with a bearer token configured (so the
    protected routes show it) and no model: the policy server waits for a checkpoint that never comes."""
    from rlt2t.common.config import load_config
    from rlt2t.services import policy_app, reward_app
    from rlt2t.services.annotation import app as annotation_app
    from rlt2t.services.annotation.store import Store

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "token").write_text("documentation\n", encoding="utf-8")
        (Path(tmp) / "checkpoints").mkdir()
        cfg = load_config([], [f"run.dir={tmp}/run", f"serve.token_file={tmp}/token"])
        quiet = logging.getLogger("rlt2t")
        level, quiet.level = quiet.level, logging.ERROR  # "no complete checkpoint yet" is the point here
        try:
            docs = {"policy": policy_app.create_app(cfg, checkpoint_dir=Path(tmp) / "checkpoints").openapi(),
                    "reward": reward_app.create_app(cfg).openapi()}
        finally:
            quiet.level = level
        store = Store.open(f"sqlite:///{tmp}/annotations.db")
        try:
            docs["annotation"] = annotation_app.create_app(cfg, store).openapi()
        finally:
            store.close()
    return docs


def schema_type(schema: dict, app: str) -> str:
    """A JSON schema in words, with links to the named schemas."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{app}-{name.lower()})"
    if "anyOf" in schema:
        return " or ".join(schema_type(s, app) for s in schema["anyOf"])
    if "enum" in schema:
        return "one of " + ", ".join(f"`{v}`" for v in schema["enum"])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"list of {schema_type(schema.get('items', {}), app)}"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"mapping to {schema_type(schema['additionalProperties'], app)}"
    bounds = [f"{word} {int(schema[key]) if float(schema[key]).is_integer() else schema[key]}"
              for key, word in (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"),
                                ("exclusiveMaximum", "<"), ("minLength", "length ≥"), ("maxLength", "length ≤"),
                                ("minItems", "items ≥"), ("maxItems", "items ≤")) if key in schema]
    return str(kind) + (f" ({', '.join(bounds)})" if bounds else "")


def body_schema(content: dict | None, app: str) -> str:
    """What a request or response body is: its schema, by media type."""
    if not content:
        return ""
    return ", ".join(f"{schema_type(c.get('schema', {}), app)} ({media})" if media != "application/json"
                     else schema_type(c.get("schema", {}), app) for media, c in sorted(content.items()))


def route_lines(app: str, path: str, method: str, op: dict) -> list[str]:
    auth = " (bearer token)" if any("HTTPBearer" in s for s in op.get("security", [])) else ""
    lines = [f"### `{method.upper()} {path}`{auth}", ""]
    if op.get("description") or op.get("summary"):
        lines += [" ".join((op.get("description") or op["summary"]).split()), ""]
    params = [[f"`{p['name']}`", p.get("in", ""), schema_type(p.get("schema", {}), app),
               "yes" if p.get("required") else "no", p.get("description", "")] for p in op.get("parameters", [])]
    if params:
        lines += table(["parameter", "in", "type", "required", "meaning"], params)
    if "requestBody" in op:
        lines += [f"Request body: {body_schema(op['requestBody'].get('content'), app)}", ""]
    rows = [[code, body_schema(r.get("content"), app), r.get("description", "")]
            for code, r in sorted(op.get("responses", {}).items())]
    return lines + table(["status", "body", "when"], rows)


def schema_lines(app: str, name: str, schema: dict) -> list[str]:
    lines = [f'<a id="{app}-{name.lower()}"></a>', "", f"#### {name}", ""]
    if schema.get("description"):
        lines += [" ".join(schema["description"].split()), ""]
    required = set(schema.get("required", []))
    rows = [[f"`{field}`", schema_type(s, app), "yes" if field in required else "no",
             f"`{json.dumps(s['default'])}`" if "default" in s else "", s.get("description", "")]
            for field, s in sorted(schema.get("properties", {}).items())]
    if rows:
        lines += table(["field", "type", "required", "default", "meaning"], rows)
    elif schema.get("type"):
        lines += [f"Type: {schema_type(schema, app)}", ""]
    return lines


def render_http(documents: dict[str, dict]) -> str:
    lines = [header("each service's create_app(...).openapi()"), "# HTTP API", "",
             "The routes of the three HTTP services, from their OpenAPI documents (the raw documents: "
             + ", ".join(f"[{a.name}](openapi-{a.name}.json)" for a in APPS) + "). Routes marked *bearer "
             "token* need `Authorization: Bearer <token>` when the server has a token (`serve.token_file` or "
             "`$RLT2T_API_TOKEN`). The annotation app's `/api` routes take an annotator's bearer token "
             "(`rlt2t annotate add-user`) or a browser session (with its CSRF token for writes).", ""]
    for app in APPS:
        doc = documents[app.name]
        lines += [f"## {app.title} (`{app.command}`)", ""]
        ops = [(path, method, op) for path, item in sorted(doc.get("paths", {}).items())
               for method, op in sorted(item.items())]
        lines += table(["method", "path", "summary"],
                       [[m.upper(), f"`{p}`", op.get("summary", "")] for p, m, op in ops])
        for path, method, op in ops:
            lines += route_lines(app.name, path, method, op)
        lines += [f"### {app.title}: schemas", ""]
        for name, schema in sorted(doc.get("components", {}).get("schemas", {}).items()):
            lines += schema_lines(app.name, name, schema)
    return "\n".join(lines)


# -- reference: Python API ----------------------------------------------------------------------------------

def render_api() -> str:
    """One mkdocstrings directive per public name of `rlt2t` (``rlt2t.__all__``, each where it lives): the stage
    functions of ``rlt2t.api`` first, then the rest; the docstrings are the page."""
    import rlt2t
    from rlt2t import api

    lines = [header("rlt2t.__all__"), "# Python API", "",
             "Everything below is importable from `rlt2t` (`import rlt2t` is instant: torch and Ray load when a "
             "function that needs them runs). The command line calls the same functions: `rlt2t train` is "
             "`rlt2t.train(cfg)`, with `cfg` loaded from `--config` files and overrides as "
             "[`load_config`](#rlt2t.api.load_config) loads it. Rewards of your own: "
             "[the rewards guide](../guides/rewards.md#python-functions).", "", "::: rlt2t.api", "    options:",
             "      members:", *(f"        - {name}" for name in api.__all__), ""]
    for name in (n for n in rlt2t.__all__ if n not in api.__all__):
        lines += [f"::: {rlt2t._HOMES[name]}.{name}", "    options:", "      show_root_heading: true",
                  "      members: false" if name == "Config" else "      members_order: source", ""]
    return "\n".join(lines)


# -- reference: RL algorithms -------------------------------------------------------------------------------

def render_algorithms() -> str:
    """One entry per registered algorithm, from its unit (rlt2t.common.algorithms): the class docstring and what
    the unit declares, so a new unit documents itself."""
    import inspect

    from rlt2t.common import algorithms
    from rlt2t.common.config import RLConfig

    lines = [header("rlt2t.common.algorithms", "rlt2t/learner/algorithms/"), "# RL algorithms", "",
             "`rl.algorithm` names one of these (or the `package.module:Class` path of a unit of your own). Each "
             "is one module under `learner/algorithms/` holding its docs entry (below, from its docstring), what "
             "it asks of the rollouts, the settings it derives, its config rules and its objective; "
             "`rlt2t.common.algorithms.BUILTIN` lists them, one line each. The losses are defined in "
             "[the design document](../design.md#policy-gradient-algorithms).", ""]
    rows = []
    for name in algorithms.names():
        unit = algorithms.algorithm(name)
        rows.append([f"[`{name}`](#{name})", unit.data, unit.min_samples, "yes" if unit.uses_reference else "no",
                     unit.default_refresh_steps or "per epoch"])
    lines += table(["algorithm", "learner data", "min rollout.num_samples", "KL to the reference",
                    "weights refreshed every (steps)"], rows)
    for name in algorithms.names():
        unit = algorithms.algorithm(name)
        cls = type(unit)
        lines += ["", f"## {name}", "", f"`{cls.__module__}.{cls.__qualname__}`", "",
                  inspect.cleandoc(cls.__doc__ or "").replace("\n", " "), ""]
        traits = [["learner data", unit.data], ["rollouts", _spec_text(unit)]]
        for attr, label in (("value_head", "value head"), ("clipped", "clipped ratio"),
                            ("kl_in_loss", "KL as a loss term")):
            if hasattr(unit, attr):
                traits.append([label, "yes" if getattr(unit, attr) else "no"])
        rl = RLConfig(algorithm=name)  # rl.pg.epochs / minibatches left at 0: the unit's defaults
        if unit.default_lr is not None:
            traits.append(["rl.lr when unset", f"{unit.default_lr:g}"])
        traits.append(["optimizer steps per batch (defaults)",
                       f"{unit.optimisation_epochs(rl)} epoch(s) x {unit.optimisation_minibatches(rl)} minibatch(es)"])
        lines += table(["", ""], traits)
        if unit.settings is not None:
            lines += [""] + config_tables(unit.settings, f"rl.{name}.", f"`rl.{name}`", 3)
    return "\n".join(lines)


def _spec_text(unit: Any) -> str:
    if unit.data == "pairs":
        return "K candidates and the gold target per source, a pair drawn and scored"
    extras = [what for flag, what in ((unit.greedy_baseline, "a greedy decode per source"),
                                       (unit.masked, "sampled inside the masking policy's top-p set")) if flag]
    return "K samples per source with their token log-probs" + "".join(f"; {e}" for e in extras)


def reference_pages() -> Files:
    documents = openapi_documents()
    files: Files = {"reference/cli.md": render_cli(), "reference/config.md": render_config(),
                    "reference/http.md": render_http(documents), "reference/api.md": render_api(),
                    "reference/algorithms.md": render_algorithms()}
    for name, doc in documents.items():
        files[f"reference/openapi-{name}.json"] = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    return files


