"""The RL algorithms as plug-in units, found by name through one registry.

An algorithm is one class (a subclass of :class:`Algorithm`) in one module: its settings section, what it asks
of the rollouts, the settings it derives, the config rules it adds, the objective its learner ranks optimise
and its entry in the docs (the class docstring). The built-in ones live in ``rlt2t/learner/algorithms/``, one
module each, and are listed in :data:`BUILTIN` (one line each); no other code compares algorithm names. A
config names one with ``rl.algorithm``: a registry name, or the ``package.module:Class`` path of a unit of
your own (importable wherever the job runs, as reward plug-ins are).

A unit module imports no torch when it is imported (validating a config must stay instant): what it runs
on tensors imports the learner's code when it runs (``objective``). The registry imports a unit only when
a config names it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlt2t.common.types import RolloutSpec

if TYPE_CHECKING:
    from rlt2t.common.config import Config, RLConfig, RolloutConfig

# name -> "module:Class" of the built-in units (the registry's one line per algorithm)
BUILTIN: dict[str, str] = {
    "rank": "rlt2t.learner.algorithms.rank:Rank",
    "scst": "rlt2t.learner.algorithms.scst:SCST",
    "rloo": "rlt2t.learner.algorithms.rloo:RLOO",
    "grpo": "rlt2t.learner.algorithms.grpo:GRPO",
    "ppo": "rlt2t.learner.algorithms.ppo:PPO",
    "a2c": "rlt2t.learner.algorithms.a2c:A2C",
    "nlpo": "rlt2t.learner.algorithms.nlpo:NLPO",
    "dpo": "rlt2t.learner.algorithms.dpo:DPO",
    "trpo": "rlt2t.learner.algorithms.trpo:TRPO",
}

_loaded: dict[str, Algorithm] = {}


class PreferenceSettings(BaseModel):
    """Where an offline preference algorithm's pairs come from: preference files (the annotation app's export,
    rank lists as the reward-model stage reads them), or, with none given, samples of the start policy ordered
    by the reward (``reward.*``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    rank_lists: list[str] = Field(default_factory=list)
    """Rank-list TSV files: `source<TAB>best<TAB>...<TAB>worst` per line (every ordered pair of a list)."""
    pairs: list[str] = Field(default_factory=list)
    """Pairs JSONL files: `source`, `chosen`, `rejected` per line."""
    ratings: list[str] = Field(default_factory=list)
    """Ratings JSONL files: `source`, `candidate`, `rating` per line (pairs formed within a source)."""
    sampled_candidates: int = Field(6, ge=2)
    """With no file: candidates sampled per training source from the start policy (rollout.temperature, top_k,
    top_p), scored by the reward; the best and the worst form the source's pair (none when they tie)."""


class Algorithm:
    """What every algorithm unit declares. Subclasses set the class attributes and override the hooks they need;
    the defaults are those of a group policy gradient (K samples per source, on-policy, one optimizer step per
    batch, the KL to the reference when rl.kl.coef > 0)."""

    name: ClassVar[str]
    """The registry name (``rl.algorithm``)."""
    data: ClassVar[Literal["pairs", "groups", "preferences"]] = "groups"
    """What the learner trains on: `groups` (K samples per source with their token log-probs) or `pairs` (a
    scored pair of candidates per source), both from the rollouts as it trains; or `preferences`, offline
    :class:`~rlt2t.common.types.PreferencePair` s from files or from samples of the start ordered by the reward
    (its ``settings`` then derive from :class:`PreferenceSettings`)."""
    settings: ClassVar[type[BaseModel] | None] = None
    """The algorithm's own settings section, ``rl.<name>`` (None: it has none)."""
    uses_reference: ClassVar[bool] = True
    """Whether a KL to the frozen reference policy (rl.kl.*) enters its loss or reward."""
    min_samples: ClassVar[int] = 1
    """The fewest rollout.num_samples it works with."""
    learner_reference: ClassVar[bool] = False
    """The learner ranks hold the frozen reference policy and score it themselves (no rollout does)."""
    greedy_baseline: ClassVar[bool] = False
    """The rollouts also decode each source greedily (its reward is the baseline)."""
    masked: ClassVar[bool] = False
    """The rollouts sample inside a masking policy's top-p set (NLPO)."""
    default_refresh_steps: ClassVar[int] = 1
    """rl.refresh_every_steps when left unset (0: once per epoch)."""
    shardable: ClassVar[bool] = True
    """Its learner runs under rl.strategy=fsdp: every pass over the policy goes through the objective's module
    (the root FSDP unit), ranks take the same passes, and the optimizer alone moves the weights."""
    default_lr: ClassVar[float | None] = None
    """rl.lr when left unset (None: the config's own default, the policy gradients')."""
    default_epochs: ClassVar[int] = 1
    """rl.pg.epochs when left at 0."""
    default_minibatches: ClassVar[int] = 1
    """rl.pg.minibatches when left at 0."""

    # -- what the job derives from it --------------------------------------------------------------------------

    def optimisation_epochs(self, rl: RLConfig) -> int:
        """Passes of optimizer steps over each learner batch."""
        return rl.pg.epochs or self.default_epochs

    def optimisation_minibatches(self, rl: RLConfig) -> int:
        """Optimizer steps per pass over a learner batch."""
        return rl.pg.minibatches or self.default_minibatches

    def mask_refresh_steps(self, rl: RLConfig) -> int:
        """Learner steps between refreshes of the masking policy (0: the rollouts sample unmasked)."""
        del rl
        return 0

    def rollout_spec(self, rl: RLConfig) -> RolloutSpec:
        """What the rollout workers return for it (an offline algorithm: the samples its pairs are drawn from)."""
        if self.data == "pairs":
            return RolloutSpec("pair")
        if self.data == "preferences":
            return RolloutSpec("group")
        return RolloutSpec("group", greedy_baseline=self.greedy_baseline, reference=rl.uses_kl)

    def check_rl(self, rl: RLConfig) -> None:
        """Rules on the `rl` section alone (a ValueError naming the key)."""

    def target_use(self, rl: RLConfig) -> str | None:
        """What in its training reads each row's target, said as the setting that asks for it; None when nothing
        does, so that it trains on sources alone (unlabeled rows) with a reward that reads no references. The
        default: the likelihood term of rl.pg.sft_coef."""
        return f"rl.pg.sft_coef={rl.pg.sft_coef:g} (CE on each row's target)" if rl.pg.sft_coef else None

    def check(self, cfg: Config) -> None:
        """Rules across sections (a ValueError naming the keys). The default: K samples enough for it."""
        if cfg.rollout.num_samples < self.min_samples:
            raise ValueError(f"rl.algorithm={cfg.rl.algorithm} needs rollout.num_samples >= {self.min_samples} (K "
                             "samples per source form the baseline)")

    # -- the learner's side ------------------------------------------------------------------------------------

    def objective(self, rl: RLConfig, rollout: RolloutConfig, policy: Any, *, seed: int,
                  reference: Any = None) -> Any:
        """What a learner rank optimises: an object with the learner's objective protocol
        (``rlt2t.learner.learner.Objective``). Runs in the learner process (it may import torch)."""
        raise NotImplementedError(f"algorithm {self.name!r} defines no objective")

    def check_unit(self) -> None:
        """Checked as a config names the unit, before any job starts: a ValueError saying what the class lacks.
        The default: it defines the objective its learner ranks optimise."""
        if type(self).objective is Algorithm.objective:
            raise ValueError("defines no `objective`: subclass rlt2t.learner.algorithms.base.PolicyGradient and "
                             "define `advantages`, or define `objective` (docs/guides/algorithms.md)")

    def __repr__(self) -> str:
        return f"<algorithm {self.name}>"


def _load(path: str, where: str) -> Algorithm:
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        hint = f" (did you mean {path.lower()}?)" if path.lower() in BUILTIN else ""
        raise ValueError(f"{where}: {path!r} is neither a registered algorithm ({', '.join(names())}){hint} nor a "
                         "`package.module:Class` path")
    if module == "__main__":
        raise ValueError(f"{where}: {path!r}: the learner ranks (Ray actors) import the unit by its path, and a "
                         "script's __main__ is not theirs; put the class in a module of its own (my_algorithms.py "
                         f"beside the script) and name it `my_algorithms:{attr}`")
    try:
        imported = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{where}: cannot import {module!r} for {path!r}: {e} (it must be importable where the "
                         "job runs: on the Python path, or shipped with the job's working_dir / py_modules)") from e
    except Exception as e:  # the user's module fails as it imports (a SyntaxError, an error at its top level)
        raise ValueError(f"{where}: importing {module!r} for {path!r} raised {type(e).__name__}: {e}") from e
    cls = getattr(imported, attr, None)
    if cls is None:
        raise ValueError(f"{where}: module {module!r} has no {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise ValueError(f"{where}: {path!r} is not a subclass of rlt2t.common.algorithms.Algorithm")
    try:
        unit = cls()
    except Exception as e:
        raise ValueError(f"{where}: {path!r}() raised {type(e).__name__}: {e} (a unit is built without "
                         "arguments: its settings come from its `settings` section, rl.<name>)") from e
    name = getattr(unit, "name", None)
    if not name or not isinstance(name, str):
        raise ValueError(f"{where}: {path!r} sets no `name` (a string: its settings section is rl.<name>)")
    if name in BUILTIN and BUILTIN[name] != path:
        raise ValueError(f"{where}: {path!r} is named {name!r}, a registered algorithm's name (its section "
                         f"rl.{name} would be taken); choose another `name`")
    try:
        unit.check_unit()
    except ValueError as e:
        raise ValueError(f"{where}: {path!r} {e}") from None
    return unit


def algorithm_sections(chosen: object = None, *, loaded: bool = False) -> dict[str, type[BaseModel]]:
    """The settings sections an `rl` section may hold: each registered algorithm's that has one (``rl.<name>``),
    and the chosen algorithm's when it is a unit of one's own (a path that does not import is left to the
    ``rl.algorithm`` check, as is a ``chosen`` that is no string). ``loaded``: also those of the units of one's
    own this process has loaded (`rlt2t config --explain` lists them; a config is validated without them, so that
    what it accepts does not depend on what was loaded before)."""
    units = [algorithm(n) for n in names()]
    if loaded:
        units += [u for key, u in _loaded.items() if key not in BUILTIN]
    if isinstance(chosen, str) and chosen not in BUILTIN:
        with contextlib.suppress(ValueError):
            units.append(algorithm(chosen))  # last: its section wins over a loaded unit's of the same name
    return {u.name: u.settings for u in units if u.settings is not None}


def names() -> list[str]:
    """The registered algorithm names."""
    return list(BUILTIN)


def algorithm(name: str, where: str = "rl.algorithm") -> Algorithm:
    """The unit ``name`` denotes: a registry name, or a ``package.module:Class`` path (ValueError naming
    ``where`` otherwise). Imported once per process."""
    unit = _loaded.get(name)
    if unit is None:
        unit = _load(BUILTIN.get(name, name), where)
        _loaded[name] = unit
    return unit


def same_algorithm(a: str, b: str) -> bool:
    """Whether two ``rl.algorithm`` values name the same unit (a registered name and its unit's path do)."""
    return BUILTIN.get(a, a) == BUILTIN.get(b, b)


def nan_loss_advice(name: str) -> str:
    """What to change when a learner step's loss is not finite under algorithm ``name``."""
    builtin = name in BUILTIN or name in BUILTIN.values()
    return "lower rl.lr" if builtin else f"lower rl.lr, or check what {name} (a unit of your own) computes"


def rollout_spec_for(name: str, *, kl: bool, mask_top_p: float = 1.0) -> RolloutSpec:
    """What the rollouts of algorithm ``name`` return under the default settings, with the reference's
    log-probs asked for or not (``kl``) and, for a masked algorithm, the mask's top-p: for tools and tests that
    drive rollout workers without a whole config."""
    from rlt2t.common.config import RLConfig

    spec = algorithm(name).rollout_spec(RLConfig(algorithm=name, pg={"nlpo_top_p": mask_top_p}))
    return spec if spec.kind == "pair" else dataclasses.replace(spec, reference=kl)
