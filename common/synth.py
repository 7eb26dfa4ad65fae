"""A deterministic synthetic "report" task in integer-token form, for the demo, tests and benchmarks.

It mimics the competition's de-identified data (space-separated integer token ids; a description,
an optional clinical field and a diagnosis to generate) and is built so that reinforcement learning
with the task metric has something to gain over maximum likelihood.

The task
--------
Data tokens are ``0 .. num_data_tokens-1`` (default 1894: with the tokenizer's offset of 106 the
model vocabulary is 2000). A fixed layout (independent of the data seed, so every seed draws from
the same task) assigns shuffled ids to disjoint pools:

- filler: most ids, drawn with Zipf-like frequencies: the background noise of a description;
- findings: ``num_findings`` phrases of 2–4 tokens: the head token ``y_c`` of the finding's concept
  (below) plus 1–3 ids of its own, in random order. Diagnoses share words with descriptions, as in
  real reports, so a small model learns the mapping in a few hundred steps and the demo stays short;
  the interesting part is on the target side;
- concepts: each finding maps to one of ``num_concepts`` diagnosis concepts (several findings may share
  a concept, and then its head token). Concept c has nine phrasings: ``A = (a_c,)`` with probability 0.4
  and ``B_j = (x_j, y_c, q)`` for j = 1..8 with probability 0.075 each, where the openers ``x_j`` are
  category tokens shared by groups of concepts and ``q`` a shared qualifier token: the eight B phrasings
  differ in their first token and share the suffix ``y_c q``;
- a connector token joining concepts, a prefix token, and a small pool of clinical tokens.

A description is 6–20 filler tokens with 1–3 distinct findings (probabilities 0.5/0.35/0.15) inserted
at distinct gaps, so two findings are always separated by filler. 30% of the rows have a clinical
field of 1–4 tokens (noise: it does not change the diagnosis). The diagnosis lists the concepts of the
findings (deduplicated) in description order with probability 0.6, otherwise in one of the other
orders; each concept gets an independently sampled phrasing, concepts are joined by the connector,
and with probability 0.2 the whole starts with the prefix token.

Why maximum likelihood and the metric disagree
----------------------------------------------
The most probable diagnosis *string* uses phrasing A everywhere (0.4 beats 0.075 for any B_j), and no
decoding of a perfect maximum-likelihood model finds anything else: greedy decoding sees A's token (0.8 · 0.4
with the prefix's 0.2 taken out) beat the prefix and every opener (0.8 · 0.075) at the first step, and beam
search that divides a hypothesis' log-probability by its length (CTranslate2's default, `length_penalty=1`;
EOS counted) still prefers A per position, log(0.8 · 0.4) / 2 > log(0.8 · 0.075) / 4 for one concept, and on
rows of two and three concepts too (checked exhaustively in the tests; with five B phrasings at 0.12 each,
which this version first had, the length-normalised mode said B for a third of the concepts). But against a
random reference an n-gram metric prefers B: every B_j shares ``y_c q`` with the other seven, so any B earns
partial credit 60% of the time, A only ever matches A (40%). On 1,200 rows the task score of the oracle
mapping said always with A is 0.95, always with B_1 1.41 (1.5x). A policy trained on the metric can learn to
say B; one trained on likelihood cannot, however a perfect one is decoded. A trained model is not perfect:
while it is unsure of a concept its beam search may still say B for some (the openers are shared between
concepts), which narrows RL's lead on that table. (Generator version 2 had two B phrasings at 0.3 each; a
length-normalised beam then found B on the SFT model and collected most of what RL learns.)
Ordering and the prefix add reference noise with the MLE choice also being the metric's choice.

Determinism
-----------
Everything is drawn from ``random.Random`` instances seeded with integers; nothing depends on
``hash()`` or set order. The same arguments give byte-identical files (for a given Python minor
version, whose ``random`` algorithms are fixed). ``GENERATOR_VERSION`` changes whenever the output
for given arguments changes.
"""

from __future__ import annotations

import bisect
import itertools
import os
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, NamedTuple

from rlt2t.common.data import Example, split_examples, write_examples
from rlt2t.common.io import atomic_open, atomic_write_json

GENERATOR_VERSION = 3
SEPARATOR_TOKEN = "<sep>"
META_FILE = "synth_meta.json"

NUM_OPENERS = 8  # metric phrasings per concept: (opener, y_c, q_c) with one of 8 openers
PHRASING_PROBS = (0.4,) + (0.075,) * NUM_OPENERS  # A (1 token), then B_1..B_8 (3 tokens sharing a 2-token suffix)
IN_ORDER_PROB = 0.6  # concepts listed in description order
PREFIX_PROB = 0.2  # diagnosis starts with the prefix token
CLINICAL_PROB = 0.3  # row has a clinical field
FINDINGS_PER_REPORT_PROBS = (0.5, 0.35, 0.15)  # 1, 2 or 3 findings
FILLER_LEN = (6, 20)
FINDING_LEN = (2, 4)
CLINICAL_LEN = (1, 4)
NUM_CLINICAL_TOKENS = 24
NUM_QUALIFIER_TOKENS = 8
MIN_FILLER_TOKENS = 64
ZIPF_EXPONENT = 1.07
# The token layout is a property of the task, not of a data seed: train and test drawn with
# different seeds must share it.
_LAYOUT_SEED = 1894_2000


@dataclass(frozen=True)
class SynthSpec:
    """The token layout of the synthetic task (see the module docstring)."""

    num_data_tokens: int
    filler: tuple[int, ...]
    filler_cum_weights: tuple[float, ...]
    clinical: tuple[int, ...]
    findings: tuple[tuple[int, ...], ...]  # finding index -> its description phrase
    finding_concept: tuple[int, ...]  # finding index -> concept index
    phrasings: tuple[tuple[tuple[int, ...], ...], ...]  # concept index -> (A, B, C) token tuples
    connector: int
    prefix: int

    @property
    def num_findings(self) -> int:
        return len(self.findings)

    @property
    def num_concepts(self) -> int:
        return len(self.phrasings)

    @cached_property
    def _finding_by_phrase(self) -> dict[tuple[int, ...], int]:
        return {phrase: i for i, phrase in enumerate(self.findings)}

    def find_findings(self, tokens: list[int]) -> list[int]:
        """Finding indices present in a description's token ids, in the order they occur."""
        by_phrase = self._finding_by_phrase
        found = []
        for start in range(len(tokens)):
            for length in range(FINDING_LEN[0], FINDING_LEN[1] + 1):
                hit = by_phrase.get(tuple(tokens[start : start + length]))
                if hit is not None:
                    found.append(hit)
        return found

    def concepts_of(self, findings: list[int]) -> list[int]:
        """The concepts of ``findings``, deduplicated, in first-occurrence order."""
        return list(dict.fromkeys(self.finding_concept[f] for f in findings))


def build_spec(num_data_tokens: int = 1894, num_findings: int = 48, num_concepts: int = 32) -> SynthSpec:
    """The fixed token layout for these sizes; raises ValueError naming a bad argument."""
    max_per_report = len(FINDINGS_PER_REPORT_PROBS)
    if num_findings < max_per_report:  # a report draws up to 3 distinct findings
        raise ValueError(f"num_findings must be >= {max_per_report}, got {num_findings}")
    if not 1 <= num_concepts <= num_findings:
        raise ValueError(f"num_concepts must be in [1, num_findings={num_findings}], got {num_concepts}")
    num_categories = max(NUM_OPENERS + 1, num_concepts // 4)  # 9: no concept's openers are all of them
    finding_pool = FINDING_LEN[1] * num_findings
    needed = (
        2
        + NUM_CLINICAL_TOKENS
        + finding_pool
        + 2 * num_concepts
        + num_categories
        + NUM_QUALIFIER_TOKENS
        + MIN_FILLER_TOKENS
    )
    if num_data_tokens < needed:
        raise ValueError(
            f"num_data_tokens must be >= {needed} for {num_findings} findings and "
            f"{num_concepts} concepts, got {num_data_tokens}"
        )

    rng = random.Random(_LAYOUT_SEED)
    ids = list(range(num_data_tokens))
    rng.shuffle(ids)
    pos = 0

    def take(n: int) -> list[int]:
        nonlocal pos
        pos += n
        return ids[pos - n : pos]

    connector, prefix = take(2)
    clinical = take(NUM_CLINICAL_TOKENS)
    pool = take(finding_pool)
    single = take(num_concepts)  # phrasing A: one token per concept
    heads = take(num_concepts)  # y_c: the concept's own token in B and C
    categories = take(num_categories)  # x: shared by a group of concepts
    qualifiers = take(NUM_QUALIFIER_TOKENS)
    filler = ids[pos:]

    # The first num_concepts findings cover every concept once; the rest map anywhere.
    finding_concept = list(range(num_concepts)) + [
        rng.randrange(num_concepts) for _ in range(num_findings - num_concepts)
    ]
    rng.shuffle(finding_concept)

    # A finding mentions its concept's head token y_c plus 1-3 tokens of its own, as real reports share
    # words between findings and diagnosis. The own tokens keep phrases distinct (none inside another).
    findings: list[tuple[int, ...]] = []
    cursor = 0
    for c in finding_concept:
        n = rng.randint(*FINDING_LEN) - 1
        phrase = [heads[c], *pool[cursor : cursor + n]]
        rng.shuffle(phrase)
        findings.append(tuple(phrase))
        cursor += n

    phrasings = []
    for c in range(num_concepts):
        # B_1..B_8 differ in their first token (an opener) and share the suffix `y_c q`: the first decoding
        # step sees A (0.4) beat every opener (0.075), so greedy commits to A, and so does beam search that
        # divides by length (see the module docstring).
        q = rng.choice(qualifiers)
        openers = [categories[(c + j) % num_categories] for j in range(NUM_OPENERS)]
        phrasings.append(((single[c],), *((x, heads[c], q) for x in openers)))

    weights = [1.0 / (rank + 1) ** ZIPF_EXPONENT for rank in range(len(filler))]
    return SynthSpec(
        num_data_tokens=num_data_tokens,
        filler=tuple(filler),
        filler_cum_weights=tuple(itertools.accumulate(weights)),
        clinical=tuple(clinical),
        findings=tuple(findings),
        finding_concept=tuple(finding_concept),
        phrasings=tuple(phrasings),
        connector=connector,
        prefix=prefix,
    )


def _contains(haystack: tuple[int, ...], needle: tuple[int, ...]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


class _Report(NamedTuple):  # a NamedTuple: cheaper to build a million of than a dataclass
    clinical: str  # "" when the row has no clinical field
    description: str
    diagnosis: str
    max_id: int


def _iter_reports(spec: SynthSpec, size: int, seed: int) -> Iterator[_Report]:
    rng = random.Random(seed)
    text = [str(i) for i in range(spec.num_data_tokens)]
    # Orders other than the description's, per concept count, in a fixed (lexicographic) order.
    other_orders = {n: list(itertools.permutations(range(n)))[1:] for n in (2, 3)}
    # Cumulative thresholds without the last (≈1.0) entry: bisect(u) is then the sampled index.
    cum_k = list(itertools.accumulate(FINDINGS_PER_REPORT_PROBS))[:-1]
    cum_phrasing = list(itertools.accumulate(PHRASING_PROBS))[:-1]
    findings = spec.findings
    for _ in range(size):
        desc = rng.choices(spec.filler, cum_weights=spec.filler_cum_weights, k=rng.randint(*FILLER_LEN))
        k = 1 + bisect.bisect(cum_k, rng.random())
        chosen = rng.sample(range(spec.num_findings), k)
        gaps = sorted(rng.sample(range(len(desc) + 1), k))
        # Insert from the back so earlier gap indices stay valid; chosen[i] lands at gaps[i].
        for gap, f in zip(reversed(gaps), reversed(chosen), strict=True):
            desc[gap:gap] = findings[f]

        concepts = spec.concepts_of(chosen)
        if len(concepts) > 1 and rng.random() >= IN_ORDER_PROB:
            concepts = [concepts[i] for i in rng.choice(other_orders[len(concepts)])]
        target = [spec.prefix] if rng.random() < PREFIX_PROB else []
        for i, c in enumerate(concepts):
            if i:
                target.append(spec.connector)
            target.extend(spec.phrasings[c][bisect.bisect(cum_phrasing, rng.random())])

        clinical = (
            rng.choices(spec.clinical, k=rng.randint(*CLINICAL_LEN)) if rng.random() < CLINICAL_PROB else []
        )
        yield _Report(
            clinical=" ".join([text[t] for t in clinical]),
            description=" ".join([text[t] for t in desc]),
            diagnosis=" ".join([text[t] for t in target]),
            max_id=max(max(desc), max(target), max(clinical, default=0)),
        )


def _source(report: _Report) -> str:
    # Same construction as import_competition_csv on a 4-column file, so JSONL and CSV agree.
    if report.clinical:
        return f"{report.clinical} {SEPARATOR_TOKEN} {report.description}"
    return f"{SEPARATOR_TOKEN} {report.description}"


def _check_size_and_seed(size: int, seed: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be an integer >= 1, got {size!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")


def generate_synthetic(
    size: int,
    seed: int,
    *,
    num_data_tokens: int = 1894,
    num_findings: int = 48,
    num_concepts: int = 32,
) -> list[Example]:
    """``size`` synthetic examples with ids ``"0" .. str(size-1)``; the same arguments give the same list.

    ``source`` is ``clinical <sep> description`` (``<sep> description`` without clinical), ``target``
    the diagnosis; every token id is below ``num_data_tokens``.
    """
    _check_size_and_seed(size, seed)
    spec = build_spec(num_data_tokens, num_findings, num_concepts)
    return [
        Example(id=str(i), source=_source(r), target=r.diagnosis)
        for i, r in enumerate(_iter_reports(spec, size, seed))
    ]


def oracle_diagnosis(spec: SynthSpec, source: str, phrasing: int = 0) -> str:
    """The diagnosis of ``source`` with phrasing ``phrasing`` for every concept (0 = A, ``j`` = B_j for
    ``1 <= j <= NUM_OPENERS``), in description order, without the prefix.

    ``phrasing=0`` is the single most probable diagnosis (what greedy decoding and beam search, with or without
    length normalisation, return on a perfect maximum-likelihood model); ``phrasing=1`` is one of the
    suffix-sharing phrasings an n-gram metric prefers.
    """
    count = len(spec.phrasings[0])
    if isinstance(phrasing, bool) or not isinstance(phrasing, int) or not 0 <= phrasing < count:
        raise ValueError(f"phrasing must be an integer in [0, {count - 1}], got {phrasing!r}")
    description = source.split(SEPARATOR_TOKEN)[-1]
    concepts = spec.concepts_of(spec.find_findings([int(t) for t in description.split()]))
    tokens: list[int] = []
    for i, c in enumerate(concepts):
        if i:
            tokens.append(spec.connector)
        tokens.extend(spec.phrasings[c][phrasing])
    return " ".join(map(str, tokens))


def phrasing_usage(spec: SynthSpec, diagnoses: Iterable[str]) -> dict[str, int]:
    """How often ``diagnoses`` (model outputs or targets) say a concept with phrasing A (likelihood's
    choice) or one of B_1..B_5 (the suffix-sharing ones the metric prefers), and how many start with the prefix.

    A concept counts as A when its single token ``a_c`` appears, as B when its head ``y_c`` follows one of the
    concept's openers; a head after any other token counts as ``other``. Returns the counts keyed ``A``, ``B``,
    ``other``, ``prefix`` and ``outputs``.
    """
    single = {p[0][0]: c for c, p in enumerate(spec.phrasings)}
    heads = {p[1][1]: c for c, p in enumerate(spec.phrasings)}
    openers = [{b[0] for b in p[1:]} for p in spec.phrasings]
    counts = dict.fromkeys(("A", "B", "other", "prefix", "outputs"), 0)
    for text in diagnoses:
        tokens = [int(t) for t in text.split() if t.isdigit()]
        counts["outputs"] += 1
        counts["prefix"] += bool(tokens) and tokens[0] == spec.prefix
        for i, t in enumerate(tokens):
            if t in single:
                counts["A"] += 1
            elif t in heads:
                opener = tokens[i - 1] if i else None
                counts["B" if opener in openers[heads[t]] else "other"] += 1
    return counts


def write_synthetic(
    out_dir: str | os.PathLike,
    size: int,
    seed: int,
    valid_fraction: float = 0.05,
    test_fraction: float = 0.05,
    fmt: Literal["jsonl", "csv"] = "jsonl",
    *,
    num_data_tokens: int = 1894,
    num_findings: int = 48,
    num_concepts: int = 32,
) -> dict[str, Path]:
    """Write ``train``/``valid``/``test`` files and ``synth_meta.json`` into ``out_dir``.

    ``fmt="jsonl"`` writes the :mod:`rlt2t.common.data` JSONL format; ``fmt="csv"`` the competition's
    header-less ``report_id,description,diagnosis,clinical`` layout (read it with
    ``import_competition_csv``; it yields the same examples). Rows keep their generation ids; a split
    with a positive fraction has at least one row. Each file is written atomically and the metadata
    last, so a directory with a matching ``synth_meta.json`` holds a complete set. Returns the paths
    keyed ``train``, ``valid``, ``test``, ``meta``. Memory stays small: train rows are streamed.
    """
    _check_size_and_seed(size, seed)
    if fmt not in ("jsonl", "csv"):
        raise ValueError(f"fmt must be 'jsonl' or 'csv', got {fmt!r}")
    for name, frac in (("valid_fraction", valid_fraction), ("test_fraction", test_fraction)):
        if not 0.0 <= frac < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {frac}")
    needed = 1 + (valid_fraction > 0) + (test_fraction > 0)
    if size < needed:
        raise ValueError(f"size must be >= {needed} to hold train, valid and test rows, got {size}")
    spec = build_spec(num_data_tokens, num_findings, num_concepts)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / META_FILE
    meta_path.unlink(missing_ok=True)  # an old meta must not vouch for a half-rewritten set

    # Which split each row goes to: 0 train, 1 valid, 2 test (a bytearray: 1 byte per row).
    _, valid_idx, test_idx = split_examples(range(size), valid_fraction, test_fraction, seed)
    split_of = bytearray(size)
    for i in valid_idx:
        split_of[i] = 1
    for i in test_idx:
        split_of[i] = 2

    paths = {name: out / f"{name}.{fmt}" for name in ("train", "valid", "test")}
    held: tuple[list, list, list] = ([], [], [])  # by split; only valid/test are filled (train streams)
    max_id = 0

    def train_rows(make: Callable[[int, _Report], Any]) -> Iterator[Any]:
        """Generate every row; yield the train rows, park the valid/test ones in ``held``."""
        nonlocal max_id
        for i, report in enumerate(_iter_reports(spec, size, seed)):
            max_id = max(max_id, report.max_id)
            row = make(i, report)
            if split_of[i] == 0:
                yield row
            else:
                held[split_of[i]].append(row)

    if fmt == "jsonl":

        def to_example(i: int, r: _Report) -> Example:
            return Example(id=str(i), source=_source(r), target=r.diagnosis)

        counts = [write_examples(paths["train"], train_rows(to_example))]
        counts += [write_examples(paths[name], held[k]) for k, name in ((1, "valid"), (2, "test"))]
    else:

        def to_csv_line(i: int, r: _Report) -> str:
            # No quoting needed: every field is digits and spaces.
            return f"{i},{r.description},{r.diagnosis},{r.clinical}\n"

        counts = []
        for k, name in enumerate(("train", "valid", "test")):
            rows = train_rows(to_csv_line) if k == 0 else held[k]
            with atomic_open(paths[name]) as f:
                n = 0
                for line in rows:
                    f.write(line)
                    n += 1
            counts.append(n)

    atomic_write_json(
        meta_path,
        {
            "generator": "rlt2t.common.synth",
            "version": GENERATOR_VERSION,
            "size": size,
            "seed": seed,
            "fmt": fmt,
            "valid_fraction": valid_fraction,
            "test_fraction": test_fraction,
            "num_data_tokens": num_data_tokens,
            "num_findings": num_findings,
            "num_concepts": num_concepts,
            "separator_token": SEPARATOR_TOKEN,
            "counts": dict(zip(("train", "valid", "test"), counts, strict=True)),
            "max_token_id": max_id,
            "files": {name: p.name for name, p in paths.items()},
        },
    )
    return {**paths, "meta": meta_path}
