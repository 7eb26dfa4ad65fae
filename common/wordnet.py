"""A natural-language task from WordNet, readable offline: definition modelling.

Each WordNet synset carries a human-written gloss: a definition, usually followed by example sentences
in quotes (``a young person of either sex; "she writes books for children"``). The task: given a word,
its part of speech and one example sentence that uses it, write the definition. Targets are real,
human-written English (lexicographers' definitions), which is what a benchmark on natural language
needs; the source's example sentence gives the context that tells the word's senses apart.

The same directory also feeds METEOR's synonym matching: :func:`nltk_wordnet` opens it with nltk's
own WordNet reader, offline (nltk's downloader is never used).

The data is Debian's ``wordnet-base`` package (WordNet 3.0, ``/usr/share/wordnet/data.{noun,verb,adj,adv}``;
``make system-deps`` installs it). Only synsets with at least one example sentence are used. Texts are
lower-cased and split into word and punctuation tokens joined by single spaces, as coco-caption's
tokenizer does before CIDEr-D, so the whitespace-token metrics count words, not words glued to commas.
Rows are drawn with ``random.Random(seed)``: the same files and arguments give the same bytes.
"""

from __future__ import annotations

import functools
import io
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nltk.data
from nltk.corpus.reader.wordnet import WordNetCorpusReader

from rlt2t.common.data import write_sampled_task

WORDNET_DIRS = ("/usr/share/wordnet", "/usr/share/wordnet/dict", "/usr/local/share/wordnet")
POS_FILES = {"noun": "data.noun", "verb": "data.verb", "adj": "data.adj", "adv": "data.adv"}
_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z]+)?|[^\sa-z0-9]")
_QUOTED = re.compile(r'"([^"]+)"')


@dataclass(frozen=True)
class Synset:
    offset: str
    pos: str
    lemmas: tuple[str, ...]
    definition: str
    examples: tuple[str, ...]


def find_wordnet(path: str | os.PathLike | None = None) -> Path:
    """The WordNet dict directory (``path``, ``$WNHOME``/``$WNSEARCHDIR``, or Debian's), or a clear error."""
    candidates = [path] if path else [os.environ.get("WNSEARCHDIR"), os.environ.get("WNHOME"), *WORDNET_DIRS]
    for c in candidates:
        if c and (Path(c) / "data.noun").is_file():
            return Path(c)
    elsewhere = "pass another WordNet dict directory" if path else "set $WNSEARCHDIR to a WordNet dict directory"
    raise FileNotFoundError(
        "WordNet data not found (looked for data.noun in "
        f"{', '.join(str(c) for c in candidates if c)}); install Debian's wordnet-base "
        f"(`make system-deps`, or `apt-get install wordnet-base`), or {elsewhere}")


def tokenize(text: str) -> str:
    """Lower-case words and punctuation, space-separated (the form CIDEr-D and BLEU count)."""
    return " ".join(_TOKEN.findall(text.lower()))


def read_synsets(wordnet_dir: str | os.PathLike, pos: str) -> Iterator[Synset]:
    """Synsets of one part of speech from ``data.<pos>`` (WordNet's documented ``wndb`` line format)."""
    path = Path(wordnet_dir) / POS_FILES[pos]
    with open(path, encoding="utf-8", errors="replace") as f:
        for line_no, line in enumerate(f, 1):
            if line.startswith("  "):  # the license header
                continue
            fields, _, gloss = line.partition(" | ")
            parts = fields.split()
            try:
                count = int(parts[3], 16)
                lemmas = tuple(parts[4 + 2 * i].replace("_", " ") for i in range(count))
            except (IndexError, ValueError) as e:
                raise ValueError(f"{path}:{line_no}: not a WordNet data line ({e})") from None
            definition, _, rest = gloss.strip().partition('; "')
            examples = tuple(m.strip() for m in _QUOTED.findall('"' + rest)) if rest else ()
            # adjective lemmas may carry a syntactic marker such as "(a)"
            lemmas = tuple(re.sub(r"\([a-z]+\)$", "", lemma) for lemma in lemmas)
            yield Synset(parts[0], pos, lemmas, definition.strip().rstrip(";").strip(), examples)


def definition_pairs(wordnet_dir: str | os.PathLike) -> list[dict[str, str]]:
    """One example per synset that has an example sentence: ``source`` = "word ( pos ) : example",
    ``target`` = the definition, both tokenised; ``id`` = ``<pos>-<offset>``."""
    rows = []
    for pos in POS_FILES:
        for s in read_synsets(wordnet_dir, pos):
            if not s.examples or not s.definition:
                continue
            example = s.examples[0]
            # The lemma the example uses, when one does: that is the word being defined.
            word = next((w for w in s.lemmas if w.lower() in example.lower()), s.lemmas[0])
            source, target = tokenize(f"{word} ({pos}): {example}"), tokenize(s.definition)
            if source and target:
                rows.append({"id": f"{pos}-{s.offset}", "source": source, "target": target})
    return rows


def write_wordnet_task(out_dir: str | os.PathLike, size: int, seed: int, valid_fraction: float = 0.05,
                       test_fraction: float = 0.05, wordnet_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """Write ``train``/``valid``/``test`` JSONL of ``size`` rows drawn from :func:`definition_pairs` and a
    ``wordnet_meta.json`` (written last). Returns the paths keyed ``train``, ``valid``, ``test``, ``meta``."""
    source_dir = find_wordnet(wordnet_dir)
    rows = definition_pairs(source_dir)
    if size > len(rows):
        raise ValueError(f"size={size}: WordNet at {source_dir} has only {len(rows)} synsets with examples")
    return write_sampled_task(out_dir, rows, size, seed, valid_fraction, test_fraction, "wordnet_meta.json",
                              {"task": "wordnet-definitions", "source": str(source_dir)})


# WordNet's lexicographer files, numbered as in its lexnames(5WN) manual page: the table has been fixed since
# WordNet 1.5. nltk's reader needs it as a file named `lexnames`, which Debian ships only as that manual page.
LEXNAMES = (
    "adj.all", "adj.pert", "adv.all", "noun.Tops", "noun.act", "noun.animal", "noun.artifact", "noun.attribute",
    "noun.body", "noun.cognition", "noun.communication", "noun.event", "noun.feeling", "noun.food", "noun.group",
    "noun.location", "noun.motive", "noun.object", "noun.person", "noun.phenomenon", "noun.plant",
    "noun.possession", "noun.process", "noun.quantity", "noun.relation", "noun.shape", "noun.state",
    "noun.substance", "noun.time", "verb.body", "verb.change", "verb.cognition", "verb.communication",
    "verb.competition", "verb.consumption", "verb.contact", "verb.creation", "verb.emotion", "verb.motion",
    "verb.perception", "verb.possession", "verb.social", "verb.stative", "verb.weather", "adj.ppl",
)
_SYNTACTIC_CATEGORY = {"noun": 1, "verb": 2, "adj": 3, "adv": 4}


class _WndbReader(WordNetCorpusReader):
    """nltk's WordNet reader over a plain ``wndb`` directory (Debian's layout) rather than nltk's corpus.

    Two differences from nltk's corpus, both handled here: the ``lexnames`` table comes from
    :data:`LEXNAMES` instead of a file, and no mapping to another WordNet version is built (nltk builds one
    for its multilingual OMW data only, by loading its own downloaded corpus).
    """

    def open(self, file: str):
        if file == "lexnames":
            return io.StringIO("".join(f"{i:02d}\t{name}\t{_SYNTACTIC_CATEGORY[name.split('.')[0]]}\n"
                                       for i, name in enumerate(LEXNAMES)))
        return super().open(file)

    def map_wn(self, version: str = "wordnet"):
        return None


@functools.lru_cache(maxsize=4)
def nltk_wordnet(path: str | os.PathLike | None = None) -> WordNetCorpusReader:
    """nltk's WordNet reader over the local WordNet dict directory (found as :func:`find_wordnet` does).

    Offline: the directory is added to ``nltk.data.path`` (nltk reads only data under the roots listed there)
    and read in place; nltk's downloader is never called. Loading takes about a second, so readers are
    cached per directory. Missing data raises FileNotFoundError naming the package that installs it.
    """
    root = find_wordnet(path).resolve()
    if str(root) not in nltk.data.path:
        nltk.data.path.append(str(root))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "multilingual functions are not available": no OMW data, by design
        return _WndbReader(str(root), None)
