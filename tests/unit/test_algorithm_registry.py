"""The algorithms are plug-in units found through one registry (rlt2t.common.algorithms): no code outside the
registry and the units compares algorithm names, every registered name resolves to a unit whose settings and
rules the config applies, and a unit of one's own plugs in by its import path."""

from __future__ import annotations

import ast
import sys
import textwrap
from pathlib import Path

import pytest

from rlt2t.common import algorithms
from rlt2t.common.algorithms import Algorithm, algorithm, names
from rlt2t.common.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "learner", "actors", "services", "rlt2t")
# Where algorithm names may be compared: the registry and the units themselves.
ALLOWED = {REPO / "common" / "algorithms.py", *(REPO / "learner" / "algorithms").glob("*.py")}


def _strings(node: ast.AST) -> set[str]:
    """The string constants of a comparison's operand: a constant, or a tuple/list/set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_strings(e) for e in node.elts)) if node.elts else set()
    return set()


def _mentions_algorithm(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if (isinstance(sub, ast.Name) and "algorithm" in sub.id) or (
                isinstance(sub, ast.Attribute) and "algorithm" in sub.attr):
            return True
    return False


def name_comparisons(source: str, known: set[str]) -> list[int]:
    """Lines comparing an expression about an algorithm (a name or attribute containing "algorithm") with a
    registered algorithm name, by ==, !=, in, not in or a match case."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_strings(o) & known for o in operands) and any(_mentions_algorithm(o) for o in operands):
                lines.append(node.lineno)
        elif isinstance(node, ast.Match) and _mentions_algorithm(node.subject):
            for case in node.cases:
                if any(isinstance(p, ast.MatchValue) and _strings(p.value) & known for p in ast.walk(case.pattern)):
                    lines.append(case.pattern.lineno)
    return lines


def test_no_code_outside_the_registry_and_the_units_compares_algorithm_names():
    known = set(names())
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if path in ALLOWED:
                continue
            found += [f"{path.relative_to(REPO)}:{line}" for line in name_comparisons(path.read_text(), known)]
    assert not found, ("algorithm names compared outside rlt2t.common.algorithms and learner/algorithms/ (ask the "
                       "algorithm's unit instead):\n" + "\n".join(found))


@pytest.mark.parametrize("code", [
    'if cfg.rl.algorithm == "nlpo": pass',
    'x = rl.algorithm in ("ppo", "a2c")',
    'y = "rank" != algorithm',
    'match self.algorithm:\n    case "grpo":\n        pass',
])
def test_the_check_sees_each_form_of_comparison(code):
    assert name_comparisons(code, set(names())) == [1 if "match" not in code else 2]


def test_the_check_leaves_other_uses_of_the_same_words_alone():
    # the annotation app's "rank" action and the eval table's stage names are not algorithm names
    assert name_comparisons('if sub.action == "rank": pass\nz = stage in ("rl", "rank")', set(names())) == []


@pytest.mark.parametrize("name", names())
def test_every_registered_name_is_a_unit_whose_docstring_documents_it(name):
    unit = algorithm(name)
    assert isinstance(unit, Algorithm) and unit.name == name
    assert unit.data in ("pairs", "groups", "preferences")
    assert type(unit).__doc__ and len(type(unit).__doc__.split()) >= 12, "the docs entry is the class docstring"
    cfg = load_config(overrides=[f"rl.algorithm={name}"])
    assert cfg.rl.unit is unit and cfg.rl.rollout_spec.kind == ("pair" if unit.data == "pairs" else "group")


def test_the_derived_settings_come_from_the_units():
    assert load_config(overrides=["rl.algorithm=rank"]).rl.refresh_interval == 0
    assert load_config(overrides=["rl.algorithm=grpo"]).rl.refresh_interval == 1
    assert not load_config(overrides=["rl.algorithm=rank", "rl.kl.coef=0.1"]).rl.uses_kl
    ppo = load_config(overrides=["rl.algorithm=ppo"]).rl
    assert (ppo.optimisation_epochs, ppo.optimisation_minibatches) == (2, 2)
    a2c = load_config(overrides=["rl.algorithm=a2c", "rl.pg.epochs=4"]).rl
    assert (a2c.optimisation_epochs, a2c.optimisation_minibatches) == (1, 1)
    nlpo = load_config(overrides=["rl.algorithm=nlpo", "rl.pg.nlpo_mask_refresh_steps=3"]).rl
    assert nlpo.mask_refresh_steps == 3 and nlpo.rollout_spec.mask_top_p == nlpo.pg.nlpo_top_p
    assert load_config(overrides=["rl.algorithm=ppo"]).rl.mask_refresh_steps == 0
    assert load_config(overrides=["rl.algorithm=scst"]).rl.rollout_spec.greedy_baseline


def test_the_units_rules_apply_when_a_config_loads():
    with pytest.raises(ConfigError, match=r"rl.algorithm=grpo needs rollout.num_samples >= 2"):
        load_config(overrides=["rl.algorithm=grpo", "rollout.num_samples=1"])
    with pytest.raises(ConfigError, match="rl.algorithm=nlpo samples with a masking policy"):
        load_config(overrides=["rl.algorithm=nlpo", "rollout.backend=ct2"])
    with pytest.raises(ConfigError, match="rl.pg.sft_coef: rank RL already trains"):
        load_config(overrides=["rl.algorithm=rank", "rl.pg.sft_coef=0.1"])


def test_an_unknown_name_lists_the_registered_ones():
    with pytest.raises(ConfigError, match=r"rl.algorithm.*'gpro'.*grpo") as e:
        load_config(overrides=["rl.algorithm=gpro"])
    assert all(n in str(e.value) for n in names())


def test_a_unit_of_ones_own_plugs_in_by_its_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_algos.py").write_text(textwrap.dedent('''
        from rlt2t.learner.algorithms.grpo import GRPO

        class Greedy(GRPO):
            """GRPO with a stricter rule: at least 4 samples per source (a test unit)."""
            name = "greedy-test"
            min_samples = 4
            default_refresh_steps = 3

        class NotAUnit:
            pass
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(algorithms, "_loaded", {})
    cfg = load_config(overrides=["rl.algorithm=my_algos:Greedy"])
    assert cfg.rl.unit.name == "greedy-test" and cfg.rl.refresh_interval == 3
    with pytest.raises(ConfigError, match="needs rollout.num_samples >= 4"):
        load_config(overrides=["rl.algorithm=my_algos:Greedy", "rollout.num_samples=2"])
    with pytest.raises(ConfigError, match="not a subclass of rlt2t.common.algorithms.Algorithm"):
        load_config(overrides=["rl.algorithm=my_algos:NotAUnit"])
    with pytest.raises(ConfigError, match="has no 'Missing'"):
        load_config(overrides=["rl.algorithm=my_algos:Missing"])
    with pytest.raises(ConfigError, match="cannot import 'no_such_module_xyz'"):
        load_config(overrides=["rl.algorithm=no_such_module_xyz:Unit"])
    sys.modules.pop("my_algos", None)


def test_validating_a_config_imports_no_torch():
    import subprocess

    code = ("import sys; from rlt2t.common.config import load_config; "
            "[load_config(overrides=['rl.algorithm=' + n]) for n in ('rank', 'scst', 'rloo', 'grpo', 'ppo', 'a2c', "
            "'nlpo', 'dpo')]; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_explain_lists_the_registered_algorithms_and_their_sections():
    from rlt2t.common.config import explain

    text = "\n".join(explain())
    assert f"Registered: {', '.join(names())}." in " ".join(text.split())
    for name, settings in algorithms.algorithm_sections().items():
        assert all(f"rl.{name}.{key} = " in text for key in settings.model_fields)


UNITS = textwrap.dedent('''
    from pydantic import BaseModel, ConfigDict, Field

    from rlt2t.common.algorithms import Algorithm
    from rlt2t.learner.algorithms.base import PolicyGradient

    class Bare(Algorithm):
        name = "bare"

    class NoAdvantages(PolicyGradient):
        name = "no-advantages"

    class WrongSignature(PolicyGradient):
        name = "wrong-signature"

        def advantages(self, rewards):
            return rewards

    class AnyKeywords(PolicyGradient):
        name = "any-keywords"

        def advantages(self, rewards, **kw):
            return rewards - rewards.mean(dim=1, keepdim=True)

    class NeedsArguments(PolicyGradient):
        name = "needs-arguments"

        def __init__(self, scale):
            self.scale = scale

    class TakesTRPOsName(AnyKeywords):
        name = "trpo"

    class Loose(BaseModel):  # extra keys allowed, as pydantic's default
        scale: float = 1.0

    class Scaled(AnyKeywords):
        name = "scaled"
        settings = Loose

    class Strict(BaseModel):
        model_config = ConfigDict(extra="forbid")
        alpha: int = 0

    class AlsoScaled(AnyKeywords):  # another unit of the same name, loaded in the same process
        name = "scaled"
        settings = Strict

    class Aliased(BaseModel):
        model_config = ConfigDict(populate_by_name=True)
        lr_scale: float = Field(1.0, alias="lrScale")

    class WithAlias(AnyKeywords):
        name = "aliased"
        settings = Aliased

    class Free(BaseModel):
        model_config = ConfigDict(extra="allow")

    class FreeForm(AnyKeywords):
        name = "free"
        settings = Free

    class NamedKl(AnyKeywords):
        name = "kl"
''')


@pytest.fixture
def user_units(tmp_path, monkeypatch):
    (tmp_path / "user_units.py").write_text(UNITS)
    (tmp_path / "broken_units.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(algorithms, "_loaded", {})
    yield
    for module in ("user_units", "broken_units"):
        sys.modules.pop(module, None)


@pytest.mark.parametrize(("path", "message"), [
    ("user_units:Bare", r"user_units:Bare' defines no `objective`: subclass rlt2t.learner.algorithms.base"),
    ("user_units:NoAdvantages", r"defines no `advantages\(rewards, \*, seq_kl, beta, greedy_rewards, pg, all_sum\)`"),
    ("user_units:WrongSignature", r"has `advantages\(rewards\)`, which the objective cannot call as "
                                  r"advantages\(rewards, \*, seq_kl,.*unexpected keyword argument 'seq_kl'"),
    ("user_units:NeedsArguments", r"NeedsArguments'\(\) raised TypeError: .*scale.*a unit is built without arguments"),
    ("user_units:TakesTRPOsName", r"is named 'trpo', a registered algorithm's name"),
    ("user_units:NamedKl", r"is named 'kl', a key of the rl section \(its settings section rl.kl could not be set\)"),
    ("broken_units:Unit", r"importing 'broken_units' for 'broken_units:Unit' raised RuntimeError: no GPU here"),
    ("__main__:Mine", r"'__main__:Mine': the learner ranks \(Ray actors\) import the unit by its path.*"
                      r"name it `my_algorithms:Mine`"),
])
def test_a_unit_that_cannot_train_is_refused_as_the_config_names_it(user_units, path, message):
    """What the learner would only find after Ray started (a missing method, a signature it cannot call, a class
    in a script's __main__) fails the config, naming rl.algorithm and the unit."""
    with pytest.raises(ConfigError, match=r"rl.algorithm: .*" + message):
        load_config(overrides=[f"rl.algorithm={path}"])


def test_a_unit_whose_advantages_take_any_keywords_loads(user_units):
    assert load_config(overrides=["rl.algorithm=user_units:AnyKeywords"]).rl.unit.name == "any-keywords"


@pytest.mark.parametrize("value", ["user_units:", "[grpo]", "123"])
def test_an_algorithm_that_is_no_string_is_a_config_error(user_units, value):
    """`rl.algorithm=mod:` reads as a mapping in YAML, `[grpo]` as a list: the key's own error, no traceback."""
    with pytest.raises(ConfigError, match=r"rl.algorithm: Input should be a valid string"):
        load_config(overrides=[f"rl.algorithm={value}"])


def test_a_units_own_section_refuses_unknown_keys_and_is_explained(user_units):
    """A settings model that allows extra keys (pydantic's default) would take a typo silently."""
    from rlt2t.common.config import explain

    cfg = load_config(overrides=["rl.algorithm=user_units:Scaled", "rl.scaled.scale=2"])
    assert cfg.rl.section().scale == 2.0
    with pytest.raises(ConfigError, match=r"rl.scaled.scal: unknown key \(did you mean rl.scaled.scale\?\)"):
        load_config(overrides=["rl.algorithm=user_units:Scaled", "rl.scaled.scal=2"])
    assert "rl.scaled.scale = 1.0" in explain()  # once a config has named it (`rlt2t config --explain rl.algorithm=…`)


def test_what_a_config_accepts_does_not_depend_on_the_units_loaded_before(user_units):
    """Only the chosen unit's section is read: another unit loaded earlier (even of the same name) neither adds a
    section to a config that does not choose it nor replaces the chosen one's model."""
    load_config(overrides=["rl.algorithm=user_units:AlsoScaled", "rl.scaled.alpha=3"])
    assert load_config(overrides=["rl.algorithm=user_units:Scaled", "rl.scaled.scale=2"]).rl.section().scale == 2.0
    with pytest.raises(ConfigError, match=r"rl.scaled: unknown key \(the settings section of a unit of your own: "
                                          r"read only when rl.algorithm names that unit\)"):
        load_config(overrides=["rl.algorithm=grpo", "rl.scaled.scale=2"])


def test_a_units_section_takes_its_aliases_and_an_explicit_extra_allow(user_units):
    cfg = load_config(overrides=["rl.algorithm=user_units:WithAlias", "rl.aliased.lrScale=2"])
    assert cfg.rl.section().lr_scale == 2.0
    cfg = load_config(overrides=["rl.algorithm=user_units:FreeForm", "rl.free.anything=1"])
    assert cfg.rl.section().model_extra == {"anything": 1}
