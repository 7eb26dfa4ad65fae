"""The library-backed and counted metrics of rlt2t.common.metrics: ROUGE (rouge-score), METEOR (nltk with the
local WordNet), SacreBLEU, distinct-n, lengths and classifier accuracy, against the libraries' own output or
hand computations."""

from __future__ import annotations

import numpy as np
import pytest
import sacrebleu
import torch
from nltk.translate.meteor_score import single_meteor_score
from rouge_score import rouge_scorer
from transformers import BartConfig, BartForSequenceClassification

from rlt2t.common.metrics import ClassifierAccuracy, Meteor, available_metrics, class_index, get_metric
from rlt2t.common.tokenization import load_tokenizer, save_tokenizer
from rlt2t.common.wordnet import nltk_wordnet

HYPS = ["the cat sat on the mat", "a dog ran home", "", "he said hello . hello again", "Running fast"]
REFS = [
    ["the cat is on the mat"],
    ["a hound ran home", "the dog walked home"],
    ["nothing here"],
    ["he said hello", "she said goodbye . hello"],
    ["runs quickly"],
]
NEW = ["rouge1", "rouge2", "rougeL", "rougeLsum", "meteor", "sacrebleu", "distinct_1", "distinct_2", "max_length"]


@pytest.mark.parametrize("rouge_type", ["rouge1", "rouge2", "rougeL", "rougeLsum"])
def test_rouge_equals_rouge_score_best_reference_and_mean(rouge_type):
    scorer = rouge_scorer.RougeScorer([rouge_type])
    expected = [max(scorer.score(r, h)[rouge_type].fmeasure for r in refs) for h, refs in zip(HYPS, REFS, strict=True)]
    metric = get_metric(rouge_type)
    np.testing.assert_allclose(metric.per_sample(HYPS, REFS), expected, rtol=0, atol=1e-12)
    assert metric.corpus(HYPS, REFS) == pytest.approx(np.mean(expected), abs=1e-12)


def test_rouge_by_hand_and_lsum_splits_on_newlines():
    # "the cat sat" vs "the cat ran": 2 of 3 unigrams each way -> F1 = 2/3; bigrams: 1 of 2 -> 1/2.
    assert get_metric("rouge1").per_sample(["the cat sat"], [["the cat ran"]])[0] == pytest.approx(2 / 3)
    assert get_metric("rouge2").per_sample(["the cat sat"], [["the cat ran"]])[0] == pytest.approx(1 / 2)
    # Reordered sentences: one LCS over the whole text is short, the sentence-level union LCS is not.
    hyp, ref = "b c d\na b", "a b\nb c d"
    assert get_metric("rougeLsum").per_sample([hyp], [[ref]])[0] == pytest.approx(1.0)
    assert get_metric("rougeL").per_sample([hyp], [[ref]])[0] < 1.0
    # One-line texts: Lsum equals L (why the seeds' table has Rouge-L == Rouge-Lsum).
    assert get_metric("rougeLsum").corpus(HYPS, REFS) == get_metric("rougeL").corpus(HYPS, REFS)


def test_rouge_whitespace_tokenizer_keeps_other_scripts():
    hyp, ref = ["猫 坐 在 垫子 上"], [["猫 在 垫子 上"]]
    assert get_metric("rouge1").per_sample(hyp, ref)[0] == 0.0  # rouge-score's tokenizer drops non a-z0-9
    assert get_metric("rouge1", tokenize="whitespace").per_sample(hyp, ref)[0] == pytest.approx(2 * 4 / (5 + 4))
    with pytest.raises(ValueError, match="tokenize"):
        get_metric("rouge1", tokenize="spacy")


@pytest.mark.system_package("wordnet-base")
def test_meteor_reproduces_nltk_documented_score():
    """nltk's docstring example (score 0.6944), read with the local WordNet."""
    hyp = "It is a guide to action which ensures that the military always obeys the commands of the party"
    ref = "It is a guide to action that ensures that the military will forever heed Party commands"
    assert round(get_metric("meteor").per_sample([hyp], [[ref]])[0], 4) == 0.6944
    other = "It is the practical guide for the army always to heed the directions of the party"
    assert round(get_metric("meteor").per_sample([hyp], [[other, ref]])[0], 4) == 0.6944  # best reference


@pytest.mark.system_package("wordnet-base")
def test_meteor_synonyms_come_from_wordnet_by_hand():
    # "a dog ran" vs "a hound ran": WordNet's synset of "dog" lists "hound", so 3 of 3 words match in one chunk:
    # P = R = 1, penalty 0.5 * (1/3)^3 -> 1 - 1/54. Without synonyms only "a", "ran" match (2 chunks):
    # P = R = 2/3, penalty 0.5 * (2/2)^3 -> 1/3.
    meteor = get_metric("meteor")
    assert meteor.per_sample(["a dog ran"], [["a hound ran"]])[0] == pytest.approx(1 - 1 / 54, abs=1e-12)
    assert meteor.per_sample(["a cow ran"], [["a hound ran"]])[0] == pytest.approx(1 / 3, abs=1e-12)
    # The same reader object nltk would use (lower-casing, Porter stems, then synonyms).
    direct = single_meteor_score(["the", "Dogs", "ran"], ["the", "hounds", "ran"], wordnet=nltk_wordnet())
    assert meteor.per_sample(["the hounds ran"], [["the Dogs ran"]])[0] == pytest.approx(direct, abs=1e-15)
    assert meteor.corpus(HYPS, REFS) == pytest.approx(float(np.mean(meteor.per_sample(HYPS, REFS))))


def test_meteor_without_wordnet_data_names_the_package(tmp_path):
    with pytest.raises(FileNotFoundError, match="wordnet-base"):
        Meteor(wordnet_dir=tmp_path)


def test_sacrebleu_is_sacrebleus_default_signature():
    metric = get_metric("sacrebleu")
    streams = [[r[0] for r in REFS], [r[1] if len(r) > 1 else None for r in REFS]]
    assert metric.corpus(HYPS, REFS) == pytest.approx(sacrebleu.corpus_bleu(HYPS, streams).score / 100, abs=1e-12)
    expected = [sacrebleu.sentence_bleu(h, r).score / 100 for h, r in zip(HYPS, REFS, strict=True)]
    np.testing.assert_allclose(metric.per_sample(HYPS, REFS), expected, rtol=0, atol=1e-12)
    # Unlike plain BLEU-4, smoothing gives a short partial match a non-zero score.
    assert metric.per_sample(["the cat sat"], [["the cat ran"]])[0] > 0.0
    assert get_metric("bleu4").per_sample(["the cat sat"], [["the cat ran"]])[0] == 0.0


def test_distinct_n_by_hand():
    hyps = ["a b a b", "a b c", ""]
    refs = [["x"]] * 3
    d1, d2 = get_metric("distinct_1"), get_metric("distinct_2")
    # per sample: unigrams {a,b}/4, {a,b,c}/3; bigrams {ab,ba}/3, {ab,bc}/2; empty -> 0
    np.testing.assert_allclose(d1.per_sample(hyps, refs), [2 / 4, 3 / 3, 0.0])
    np.testing.assert_allclose(d2.per_sample(hyps, refs), [2 / 3, 2 / 2, 0.0])
    # corpus: pooled unigrams {a,b,c} of 7; bigrams {ab,ba,bc} of 5
    assert d1.corpus(hyps, refs) == pytest.approx(3 / 7)
    assert d2.corpus(hyps, refs) == pytest.approx(3 / 5)
    assert d1.corpus([""], [["x"]]) == 0.0


def test_max_length():
    assert get_metric("max_length").corpus(HYPS, REFS) == 6.0
    assert get_metric("mean_length").corpus(HYPS, REFS) == pytest.approx((6 + 4 + 0 + 6 + 2) / 5)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.system_package("wordnet-base")) if n == "meteor"
                                  else n for n in NEW])
def test_new_metrics_are_registered_and_give_float64_per_sample(name):
    assert name in available_metrics()
    scores = get_metric(name).per_sample(HYPS, REFS)
    assert scores.dtype == np.float64 and scores.shape == (len(HYPS),)
    assert get_metric(name).per_sample([], []).shape == (0,)
    with pytest.raises(ValueError, match="differ in length"):
        get_metric(name).per_sample(HYPS, REFS[:-1])


# --- classifier accuracy --------------------------------------------------------------------------------------

LABELS = {0: "inform", 1: "question", 2: "directive"}


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory, ids_tokenizer_dir):
    """A tiny, randomly initialised 3-class BART classifier saved with the id tokenizer."""
    tok = load_tokenizer(ids_tokenizer_dir)
    torch.manual_seed(3)
    config = BartConfig(vocab_size=len(tok), d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                        decoder_start_token_id=tok.eos_token_id, num_labels=3, id2label=LABELS,
                        label2id={v: k for k, v in LABELS.items()})
    out = tmp_path_factory.mktemp("classifier")
    BartForSequenceClassification(config).save_pretrained(out)
    save_tokenizer(tok, out)
    return out


TEXTS = [f"{i} {(i * 7) % 50} {(i * 13) % 50}" for i in range(12)]


def _direct_labels(path, texts):
    model = BartForSequenceClassification.from_pretrained(str(path)).eval()
    tok = load_tokenizer(path)
    with torch.no_grad():
        enc = tok(texts, padding=True, return_tensors="pt", return_token_type_ids=False)
        return [LABELS[i] for i in model(**enc).logits.argmax(-1).tolist()]


def test_classifier_labels_match_the_model(classifier_dir):
    metric = ClassifierAccuracy(classifier_dir, batch_size=5)
    predicted = metric.predict(TEXTS)
    assert predicted == _direct_labels(classifier_dir, TEXTS)
    assert len(set(predicted)) > 1, "degenerate fixture: the classifier gives one label for every text"


def test_classifier_accuracy_against_labels_target_and_references(classifier_dir):
    predicted = ClassifierAccuracy(classifier_dir).predict(TEXTS)
    refs = [[t] for t in TEXTS]
    gold = [p if i % 3 else "question" for i, p in enumerate(predicted)]  # every third label replaced
    metric = get_metric("classifier_accuracy", path=classifier_dir, labels=gold)
    expected = np.array([p == g for p, g in zip(predicted, gold, strict=True)], dtype=np.float64)
    np.testing.assert_array_equal(metric.per_sample(TEXTS, refs), expected)
    assert metric.corpus(TEXTS, refs) == pytest.approx(expected.mean())
    # labels by class id
    ids = {v: k for k, v in LABELS.items()}
    assert get_metric("classifier_accuracy", path=classifier_dir, labels=[ids[g] for g in gold]).corpus(
        TEXTS, refs) == pytest.approx(expected.mean())
    # one target class for every output
    target = get_metric("classifier_accuracy", path=classifier_dir, target_label="inform")
    assert target.corpus(TEXTS, refs) == pytest.approx(np.mean([p == "inform" for p in predicted]))
    # no labels: agreement with the classifier's label of the reference (outputs equal to references -> 1)
    agree = get_metric("classifier_accuracy", path=classifier_dir)
    assert agree.corpus(TEXTS, refs) == 1.0
    shifted = [[t] for t in TEXTS[1:] + TEXTS[:1]]
    assert agree.corpus(TEXTS, shifted) == pytest.approx(
        np.mean([a == b for a, b in zip(predicted, predicted[1:] + predicted[:1], strict=True)]))


def test_classifier_bad_input(classifier_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a model directory nor a directory of complete checkpoints"):
        ClassifierAccuracy(tmp_path)
    with pytest.raises(ValueError, match="not a label"):
        ClassifierAccuracy(classifier_dir, target_label="positive")
    with pytest.raises(ValueError, match="classes 0..2"):
        ClassifierAccuracy(classifier_dir, labels=[0, 5])
    with pytest.raises(ValueError, match="2 expected labels for 3"):
        ClassifierAccuracy(classifier_dir, labels=[0, 1]).per_sample(TEXTS[:3], [[t] for t in TEXTS[:3]])


def test_metric_and_reward_read_a_label_by_one_rule(classifier_dir, tmp_path):
    """`"1"` named class 1 for the classifier reward (a string of digits is a class id when no class has that
    name) but was refused by the classifier metric; both now go through one rule, names first."""
    from rlt2t.common.config import ClassifierTerm
    from rlt2t.common.rewards import ClassifierReward

    assert class_index(LABELS, "1", "label", "m") == class_index(LABELS, 1, "label", "m") == 1
    assert class_index(LABELS, "question", "label", "m") == 1
    assert ClassifierAccuracy(classifier_dir, target_label="1").target_label == "question"
    assert ClassifierReward(ClassifierTerm(path=str(classifier_dir), label="1")).label == 1
    named = {0: "2", 1: "1", 2: "0"}  # classes named by digits: the name wins over the id
    assert class_index(named, "0", "label", "m") == 2 and class_index(named, 0, "label", "m") == 0
    with pytest.raises(ValueError, match="classes 0..2"):
        class_index(LABELS, "7", "label", "m")
    with pytest.raises(TypeError, match="label name or class id"):
        class_index(LABELS, True, "label", "m")
