"""The pairs of an offline preference algorithm (``rl.algorithm`` whose unit's data is `preferences`, e.g. DPO):
from preference files, or from samples of the start policy ordered by the reward.

- :func:`file_pairs`: the rank lists, pairs and ratings files of the algorithm's settings section (the formats of
  ``rlt2t.common.preferences``: the annotation app's export, rank-list TSVs); a group of n pairs (a rank list of
  K gives K·(K−1)/2) weighs as much as one pair, each of its pairs 1/n.
- :func:`best_worst_pairs`: one pair per scored group, its best sample over its worst (none on a tie).
- :func:`pairs_file` / :func:`read_pairs_file`: the run's pairs, written once (``{run}/rl/preference_pairs.jsonl``)
  so that a resumed run trains on exactly the same pairs and a user can read what it learned from.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rlt2t.common.algorithms import PreferenceSettings
from rlt2t.common.data import DataError
from rlt2t.common.io import atomic_open
from rlt2t.common.preferences import json_objects, load_preferences
from rlt2t.common.types import PreferencePair, ScoredGroup


def file_pairs(settings: PreferenceSettings, key: str = "") -> list[PreferencePair]:
    """Every ordered pair of the settings' preference files, in file order (empty when it names none); ``key``:
    the settings' section (``rl.dpo``), named with a missing file."""
    groups = load_preferences(settings.rank_lists, settings.pairs, settings.ratings, key=key)
    out = []
    for g in groups:
        weight = 1.0 / len(g.pairs)
        out += [PreferencePair(f"{g.origin}#{i}", g.source, g.candidates[b], g.candidates[w], weight)
                for i, (b, w) in enumerate(g.pairs)]
    return out


def best_worst_pairs(groups: Sequence[ScoredGroup]) -> tuple[list[PreferencePair], int]:
    """(one pair per group: the best sample over the worst by reward, the first of each on ties; the number of
    groups left out because their samples' rewards all tie or their texts do)."""
    pairs, ties = [], 0
    for sg in groups:
        g, rewards = sg.group, sg.rewards
        best = max(range(len(rewards)), key=lambda i: (rewards[i], -i))
        worst = min(range(len(rewards)), key=lambda i: (rewards[i], i))
        chosen, rejected = g.candidates[best].strip(), g.candidates[worst].strip()
        if rewards[best] == rewards[worst] or chosen == rejected or not chosen or not rejected:
            ties += 1
            continue
        pairs.append(PreferencePair(g.example_id, g.source, chosen, rejected))
    return pairs, ties


def pairs_file(run_dir: Path) -> Path:
    return run_dir / "rl" / "preference_pairs.jsonl"


def write_pairs_file(path: Path, pairs: Sequence[PreferencePair]) -> None:
    """The run's pairs as JSONL (``id``, ``source``, ``chosen``, ``rejected``, ``weight``), atomically."""
    with atomic_open(path) as f:
        for p in pairs:
            f.write(json.dumps({"id": p.example_id, "source": p.source, "chosen": p.chosen, "rejected": p.rejected,
                                "weight": p.weight}, ensure_ascii=False) + "\n")


def read_pairs_file(path: Path) -> list[PreferencePair]:
    out = []
    for number, row in json_objects(path, ("id", "source", "chosen", "rejected")):
        weight = row.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise DataError(path, number, "weight", f"must be a positive number, got {weight!r}")
        out.append(PreferencePair(row["id"], row["source"], row["chosen"], row["rejected"], float(weight)))
    return out
