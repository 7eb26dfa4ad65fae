"""Reward models: the pairwise loss against a loop reference; both backbones learn a hidden preference;
batching, save/load and resume are exact."""

from __future__ import annotations

import math
import random
import shutil

import pytest
import torch
from transformers import BertConfig, BertModel

from rlt2t.common.checkpoint import latest_complete_checkpoint, read_checkpoint
from rlt2t.common.config import ModelConfig, RewardModelConfig, RunConfig
from rlt2t.common.policy import load_policy
from rlt2t.common.preferences import PreferenceGroup, rank_list_group, split_by_source
from rlt2t.common.reward_model import init_reward_model, load_reward_model
from rlt2t.common.tokenization import load_tokenizer, save_tokenizer
from rlt2t.learner.reward_model import evaluate_groups, pair_tensors, preference_loss, train_reward_model


def hidden_preference(text: str) -> int:
    """The scripted annotator's taste: occurrences of token 7, then shorter."""
    tokens = text.split()
    return 10 * tokens.count("7") - len(tokens)


def preference_groups(n: int, seed: int = 0) -> list[PreferenceGroup]:
    """Rank lists of up to 4 candidates with distinct hidden scores, best first."""
    rng = random.Random(seed)

    def text() -> str:
        return " ".join(str(rng.randrange(60)) for _ in range(rng.randint(2, 8)))

    groups = []
    for i in range(n):
        by_score: dict[int, str] = {}
        # sorted twice: a set's order follows the process's string hashing, and the first of equal scores is kept
        drawn = sorted({text() + " 7" * rng.randint(0, 2) for _ in range(4)})
        for c in sorted(drawn, key=hidden_preference, reverse=True):
            by_score.setdefault(hidden_preference(c), c)
        if len(by_score) >= 2:
            groups.append(rank_list_group(f"{text()} {i}", list(by_score.values())))
    return groups


@pytest.fixture(scope="module")
def data():
    return split_by_source(preference_groups(320), 0.2, seed=0)


@pytest.fixture(scope="module")
def seq2seq_init(tmp_path_factory, ids_tokenizer_dir):
    out = tmp_path_factory.mktemp("policy")
    policy = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=0)
    policy.model.save_pretrained(out)
    save_tokenizer(policy.tokenizer, out)
    return out


@pytest.fixture(scope="module")
def encoder_init(tmp_path_factory, ids_tokenizer_dir):
    """A from-scratch BERT encoder (tiny BertConfig) with the id tokenizer: no pretrained weights involved."""
    out = tmp_path_factory.mktemp("encoder")
    tok = load_tokenizer(ids_tokenizer_dir)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=128, pad_token_id=tok.pad_token_id,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).save_pretrained(out)
    save_tokenizer(tok, out)
    return out


def rm_cfg(**kw) -> RewardModelConfig:
    base = dict(epochs=4, lr=3e-3, warmup_ratio=0.0, dropout=0.0, batch_size=16, max_source_len=16,
                max_candidate_len=16)
    return RewardModelConfig(**{**base, **kw})


def test_loss_equals_a_loop_over_every_ordered_pair_of_each_list():
    torch.manual_seed(0)
    groups = [rank_list_group("a", ["1", "2", "3", "4"]), rank_list_group("b", ["5", "6"]),
              PreferenceGroup("c", ("7", "8", "9"), ((1, 0), (1, 2)))]  # ratings: the middle one is best
    rewards = torch.randn(9, dtype=torch.float64)
    for margin in (0.0, 0.7):
        expected, offset = 0.0, 0
        for g in groups:
            per_list = [-math.log(1 / (1 + math.exp(-(rewards[offset + i] - rewards[offset + j] - margin).item())))
                        for i, j in g.pairs]
            expected += sum(per_list) / len(per_list)  # each list counts once
            offset += len(g.candidates)
        expected /= len(groups)
        better, worse, weight = pair_tensors(groups)
        assert len(better) == 6 + 1 + 2  # 4 choose 2, 2 choose 2, the ratings' 2
        got = preference_loss(rewards, better, worse, weight.double(), margin)
        assert got.item() == pytest.approx(expected, rel=1e-6)  # pair weights are float32


def test_loss_is_stable_for_large_differences():
    rewards = torch.tensor([500.0, -500.0], requires_grad=True)
    one = torch.ones(1)
    assert preference_loss(rewards, torch.tensor([0]), torch.tensor([1]), one).item() == 0.0
    wrong = preference_loss(rewards, torch.tensor([1]), torch.tensor([0]), one)
    assert wrong.item() == pytest.approx(1000.0)
    wrong.backward()
    assert torch.isfinite(rewards.grad).all()


@pytest.mark.parametrize("backbone", ["seq2seq", "encoder"])
def test_reward_model_learns_the_hidden_preference(backbone, data, seq2seq_init, encoder_init, tmp_path):
    train, valid = data
    init = seq2seq_init if backbone == "seq2seq" else encoder_init
    cfg = rm_cfg()
    model = init_reward_model(init, max_source_len=16, max_candidate_len=16, dropout=0.0, seed=0)
    assert model.spec.kind == backbone
    before = evaluate_groups(model, valid)["pair_accuracy"]
    run = RunConfig(dir=str(tmp_path), progress=False, log_every=5)
    result = train_reward_model(model, train, valid, cfg, run, tmp_path / "rm")
    after = evaluate_groups(model, valid)
    assert after["pair_accuracy"] >= 0.9 > before, (before, after)
    # The per-epoch held-out accuracy is logged, the curves drawn, the best checkpoint recorded.
    logs = (tmp_path / "logs" / "reward_model" / "metrics.jsonl").read_text().splitlines()
    assert sum('"kind": "valid"' in line for line in logs) == cfg.epochs
    assert (tmp_path / "logs" / "reward_model" / "curves.png").stat().st_size > 0
    assert read_checkpoint(result.checkpoint).meta["best"]["score"] >= after["pair_accuracy"] - 1e-9
    # A saved model scores exactly as the one in memory.
    loaded = load_reward_model(result.checkpoint)
    assert loaded.version == result.steps
    sources = [g.source for g in valid for _ in g.candidates]
    candidates = [c for g in valid for c in g.candidates]
    assert loaded.score(sources, candidates) == pytest.approx(model.score(sources, candidates), abs=1e-6)
    # Given the checkpoint root (a reward term's `path`), the checkpoint of best held-out accuracy is loaded.
    best = read_checkpoint(result.checkpoint).meta["best"]["path"]
    assert load_reward_model(tmp_path / "rm" / "checkpoints").version == read_checkpoint(best).step


@pytest.mark.parametrize("backbone", ["seq2seq", "encoder"])
def test_batched_scores_equal_one_at_a_time(backbone, seq2seq_init, encoder_init):
    model = init_reward_model(seq2seq_init if backbone == "seq2seq" else encoder_init, max_source_len=8,
                              max_candidate_len=6, seed=1)
    torch.nn.init.normal_(model.head.weight) if model.head is not None else None
    sources = ["1 2 3", "1 2 3", "4 5 6 7 8 9 10 11 12 13", "14"]
    candidates = ["7 7", "8", "9 10 11 12 13 14 15 16 17", "20 21 22"]  # long ones are truncated
    batched = model.score(sources, candidates, batch_size=4)
    single = [model.score([s], [c])[0] for s, c in zip(sources, candidates, strict=True)]
    assert batched == pytest.approx(single, abs=1e-5)
    assert len(set(batched.round(6))) == 4
    assert model.training  # score() restores the mode it found


def test_resume_after_a_crash_equals_the_uninterrupted_run(data, seq2seq_init, tmp_path):
    train, valid = data
    cfg = rm_cfg(epochs=2, dropout=0.1, lr=1e-3)  # dropout on: the RNG state must resume too
    run = RunConfig(dir=str(tmp_path / "full"), progress=False, seed=5)
    full = init_reward_model(seq2seq_init, max_source_len=16, max_candidate_len=16, dropout=0.1, seed=5)
    train_reward_model(full, train[:64], valid[:16], cfg, run, tmp_path / "full" / "rm")

    run2 = RunConfig(dir=str(tmp_path / "crash"), progress=False, seed=5)
    first = init_reward_model(seq2seq_init, max_source_len=16, max_candidate_len=16, dropout=0.1, seed=5)
    train_reward_model(first, train[:64], valid[:16], cfg, run2, tmp_path / "crash" / "rm")
    root = tmp_path / "crash" / "rm" / "checkpoints"
    shutil.rmtree(root / "epoch-0002")  # the run died before its last checkpoint
    latest = latest_complete_checkpoint(root)
    resumed = load_reward_model(latest, dropout=0.1).train()
    train_reward_model(resumed, train[:64], valid[:16], cfg, run2, tmp_path / "crash" / "rm",
                       resume_from=read_checkpoint(latest))
    for (name, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
