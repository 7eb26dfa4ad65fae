"""The shared training loop: it learns, checkpoints atomically, and a resumed run is bitwise identical."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from rlt2t.common.checkpoint import complete_checkpoints, latest_complete_checkpoint, read_checkpoint
from rlt2t.common.collate import encode_texts
from rlt2t.common.config import ModelConfig, PretrainConfig, RunConfig, SFTConfig
from rlt2t.common.policy import load_policy
from rlt2t.learner.stages import run_pretrain, run_sft
from rlt2t.learner.trainer import epoch_order


def _task(tok, n=96, seed=0):
    rng = random.Random(seed)
    src = [" ".join(str(rng.randrange(60)) for _ in range(rng.randint(3, 8))) for _ in range(n)]
    tgt = [" ".join(sorted(s.split(), key=int)[:2]) for s in src]
    return encode_texts(tok, src, 32)[0], encode_texts(tok, tgt, 16)[0]


def _run(tmp_path, name, **over):
    return RunConfig(dir=str(tmp_path / name), seed=5, device="cpu", progress=False, log_every=2, **over)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _sft_cfg(**over):
    base = dict(epochs=3, batch_size=16, lr=3e-3, warmup_ratio=0.2, save_every_steps=4, keep_last=50)
    return SFTConfig(**{**base, **over})


def test_epoch_order_is_a_seeded_permutation():
    a = epoch_order(50, 1, 0)
    assert sorted(a) == list(range(50))
    assert a == epoch_order(50, 1, 0) and a != epoch_order(50, 1, 1) and a != epoch_order(50, 2, 0)


def _padded(order, lengths, bs):
    return sum(bs * max(lengths[i] for i in order[b:b + bs]) for b in range(0, len(order), bs))


def test_grouped_epoch_order_pads_less_and_stays_seeded():
    """Grouped by length: still a permutation of (seed, epoch), every batch but the last one full and the
    partial one last, far fewer padding tokens than the random order, and batches not sorted across the epoch."""
    rng = random.Random(0)
    n, bs = 2 * 64 * 4 + 5, 4  # two windows of 64 batches and a remainder of 5: a partial batch of 1
    lengths = [rng.randint(1, 40) for _ in range(n)]
    a = epoch_order(n, 1, 0, batch_size=bs, lengths=lengths)
    assert sorted(a) == list(range(n))
    assert a == epoch_order(n, 1, 0, batch_size=bs, lengths=lengths) and a != epoch_order(n, 1, 1, batch_size=bs,
                                                                                         lengths=lengths)
    plain = epoch_order(n, 1, 0)
    assert plain == epoch_order(n, 1, 0, batch_size=bs)  # no lengths: the random order of earlier versions
    assert _padded(a, lengths, bs) < 0.75 * _padded(plain, lengths, bs)
    batches = [a[b:b + bs] for b in range(0, n, bs)]
    assert len(batches[-1]) == 1 and all(len(b) == bs for b in batches[:-1])
    spans = [max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches[:-1]]
    assert sum(spans) / len(spans) <= 2  # each batch's lengths nearly equal
    firsts = [lengths[b[0]] for b in batches[:-1]]
    assert firsts != sorted(firsts) and firsts != sorted(firsts, reverse=True)  # the batches are shuffled
    with pytest.raises(ValueError, match="3 length keys for 10 examples"):
        epoch_order(10, 1, 0, batch_size=2, lengths=[1, 2, 3])


@pytest.mark.parametrize("group", [True, False])
def test_text_stages_group_batches_by_length(tmp_path, ids_tokenizer_dir, monkeypatch, group):
    """Pretraining and SFT hand the loop their examples' lengths (SFT its sources') when group_by_length is on, and
    nothing when off."""
    import rlt2t.learner.trainer as trainer

    seen: list = []
    real = trainer.epoch_order
    monkeypatch.setattr(trainer, "epoch_order", lambda *a, **kw: seen.append(kw.get("lengths")) or real(*a, **kw))
    policy = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=0)
    src, tgt = _task(policy.tokenizer, n=32)
    run_sft(policy, src, tgt, _sft_cfg(epochs=1, group_by_length=group), _run(tmp_path, "s"), tmp_path / "s")
    run_pretrain(policy, src, PretrainConfig(epochs=1, batch_size=16, group_by_length=group), _run(tmp_path, "p"),
                 tmp_path / "p")
    expected = [[len(s) for s in src]] * 2 if group else [None, None]  # SFT: source lengths; pretraining: texts'
    assert seen == expected


def test_sft_learns_and_writes_logs_and_checkpoints(tmp_path, ids_tokenizer_dir):
    policy = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=0)
    src, tgt = _task(policy.tokenizer)
    run = _run(tmp_path, "a")
    result = run_sft(policy, src, tgt, _sft_cfg(epochs=4, save_every_steps=0), run, tmp_path / "a" / "sft")
    assert result.steps == 4 * 6
    rows = [line for line in (tmp_path / "a" / "logs" / "sft" / "metrics.jsonl").read_text().splitlines()]
    import json

    losses = [json.loads(r)["loss"] for r in rows]
    assert losses[-1] < losses[0] * 0.8, losses
    assert list((tmp_path / "a" / "logs" / "sft" / "tb").iterdir()), "no TensorBoard events"
    names = [i.path.name for i in complete_checkpoints(tmp_path / "a" / "sft" / "checkpoints")]
    assert names[-1] == "epoch-0004"
    assert read_checkpoint(result.checkpoint).meta["epoch"] == 4


@pytest.mark.parametrize("kill_after_checkpoint", ["step-000004", "epoch-0001", "step-000016"])
def test_resume_is_bitwise_identical(tmp_path, ids_tokenizer_dir, kill_after_checkpoint):
    """A run stopped after any checkpoint and resumed ends with exactly the weights of an uninterrupted run."""
    cfg = _sft_cfg(augment_prob=0.15, fgm_epsilon=0.5, rdrop_alpha=1.0)
    mc = ModelConfig(preset="tiny", family="bart", dropout=0.1)

    full = load_policy(mc, ids_tokenizer_dir, seed=0)
    src, tgt = _task(full.tokenizer)
    run_sft(full, src, tgt, cfg, _run(tmp_path, "full"), tmp_path / "full")
    reference = _weights(full.model)

    # "Crash": run the same job, then delete every checkpoint after the chosen one (as if killed there).
    part = load_policy(mc, ids_tokenizer_dir, seed=0)
    run_sft(part, src, tgt, cfg, _run(tmp_path, "part"), tmp_path / "part")
    root = tmp_path / "part" / "checkpoints"
    import shutil

    keep = read_checkpoint(root / kill_after_checkpoint)
    for info in complete_checkpoints(root):
        if info.step > keep.step:
            shutil.rmtree(info.path)
    assert latest_complete_checkpoint(root) == keep.path

    resumed = load_policy(mc, ids_tokenizer_dir, checkpoint=keep.path)
    result = run_sft(resumed, src, tgt, cfg, _run(tmp_path, "part"), tmp_path / "part", resume_from=keep)
    assert result.steps == 18
    after = _weights(resumed.model)
    assert all(torch.equal(reference[k], after[k]) for k in reference), "resumed run diverged"


def test_pretrain_denoising_runs_and_lowers_loss(tmp_path, ids_tokenizer_dir):
    policy = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=0)
    rng = random.Random(1)
    texts = [[10 + rng.randrange(60) for _ in range(rng.randint(5, 20))] for _ in range(64)]
    cfg = PretrainConfig(epochs=3, batch_size=16, lr=3e-3, warmup_ratio=0.1)
    result = run_pretrain(policy, texts, cfg, _run(tmp_path, "p"), tmp_path / "p" / "pretrain")
    assert result.steps == 12
    assert (tmp_path / "p" / "pretrain" / "checkpoints" / "epoch-0003").is_dir()


def test_a_stage_without_a_progress_bar_logs_where_it_is(tmp_path, ids_tokenizer_dir, monkeypatch, caplog):
    """Output to a file (no terminal, no bar): a line now and then with the step, loss, pace and time left; none
    with progress off, and never at the last step (the epoch's own line follows)."""
    import rlt2t.learner.trainer as trainer

    original = trainer.Heartbeat.__init__
    monkeypatch.setattr(trainer.Heartbeat, "__init__",
                        lambda self, stage, total, first: original(self, stage, total, first, every_s=0.0))
    policy = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=0)
    texts = [[10 + i % 50, 11, 12, 13, 14] for i in range(64)]
    cfg = PretrainConfig(epochs=1, batch_size=16, lr=1e-3)
    with caplog.at_level(logging.INFO, logger="rlt2t"):
        run_pretrain(policy, texts, cfg, _run(tmp_path, "p").model_copy(update={"progress": True}),
                     tmp_path / "p" / "pretrain")
    lines = [r.getMessage() for r in caplog.records if " step " in r.getMessage()]
    assert [line.split(" (")[0] for line in lines] == ["pretrain step 2/4"]  # log_every=2; not at the last
    assert lines[0].startswith("pretrain step 2/4 (epoch 1): loss ") and "examples/s, about " in lines[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rlt2t"):
        run_pretrain(policy, texts, cfg, _run(tmp_path, "q"), tmp_path / "q" / "pretrain")
    assert not [r for r in caplog.records if " step " in r.getMessage()]


@pytest.mark.parametrize("objective", ["reconstruct", "span_corruption"])
def test_pretrain_objective_sets_what_the_decoder_writes(tmp_path, ids_tokenizer_dir, monkeypatch, objective):
    import rlt2t.learner.stages as stages

    seen = []

    class Recording(stages.DenoisingDataset):
        def __getitem__(self, index):
            item = super().__getitem__(index)
            seen.append((self.texts[range(len(self.texts))[index]], item["labels"]))
            return item

    monkeypatch.setattr(stages, "DenoisingDataset", Recording)
    policy = load_policy(ModelConfig(preset="tiny", family="bart"), ids_tokenizer_dir, seed=0)
    texts = [[10 + i + j for j in range(12)] for i in range(16)]
    cfg = PretrainConfig(batch_size=8, max_steps=1, lr=1e-3)
    assert PretrainConfig().objective == "span_corruption"  # the default: T5's objective
    run_pretrain(policy, texts, cfg.model_copy(update={"objective": objective}), _run(tmp_path, objective),
                 tmp_path / objective / "pretrain")
    eos = policy.tokenizer.eos_token_id
    assert seen and all((labels == [*text, eos]) == (objective == "reconstruct") for text, labels in seen)


def test_max_steps_and_nan_guard(tmp_path, ids_tokenizer_dir):
    policy = load_policy(ModelConfig(preset="tiny", family="bart"), ids_tokenizer_dir, seed=0)
    src, tgt = _task(policy.tokenizer)
    result = run_sft(policy, src, tgt, _sft_cfg(max_steps=5, save_every_steps=0), _run(tmp_path, "m"), tmp_path / "m")
    assert result.steps == 5
    with pytest.raises(ValueError, match="empty"):
        run_sft(policy, [], [], _sft_cfg(), _run(tmp_path, "e"), tmp_path / "e")


def test_evaluate_hook_keeps_best(tmp_path, ids_tokenizer_dir):
    policy = load_policy(ModelConfig(preset="tiny", family="bart"), ids_tokenizer_dir, seed=0)
    src, tgt = _task(policy.tokenizer)
    scores = iter([0.5, 0.9, 0.1])
    result = run_sft(policy, src, tgt, _sft_cfg(keep_last=1, save_every_steps=0), _run(tmp_path, "b"),
                     tmp_path / "b", evaluate=lambda model: {"monitor": next(scores)})
    root = tmp_path / "b" / "checkpoints"
    names = sorted(p.name for p in root.iterdir())
    assert names == ["epoch-0002", "epoch-0003"], "best (epoch 2) must survive keep_last=1"
    assert read_checkpoint(result.checkpoint).meta["best"]["score"] == 0.9


def test_resuming_with_a_longer_schedule_is_refused_not_run_at_the_floor_rate(tmp_path, ids_tokenizer_dir):
    """A finished stage resumed with more epochs: its restored scheduler keeps the old length, so the extra
    steps would all run at the floor learning rate. Refused, naming the settings."""
    mc = ModelConfig(preset="tiny", family="bart", dropout=0.0)
    policy = load_policy(mc, ids_tokenizer_dir, seed=0)
    src, tgt = _task(policy.tokenizer, n=32)
    run_sft(policy, src, tgt, _sft_cfg(epochs=1, save_every_steps=0), _run(tmp_path, "r"), tmp_path / "r")
    last = read_checkpoint(latest_complete_checkpoint(tmp_path / "r" / "checkpoints"))
    again = load_policy(mc, ids_tokenizer_dir, checkpoint=last.path)
    with pytest.raises(ValueError, match=r"sft: .* schedule of 2 steps, these settings give 4 \(sft.epochs"):
        run_sft(again, src, tgt, _sft_cfg(epochs=2, save_every_steps=0), _run(tmp_path, "r"), tmp_path / "r",
                resume_from=last)


def _scripted(scores):
    """An evaluate hook returning ``scores`` epoch by epoch (the monitor), counting its calls."""
    calls = []

    def evaluate(model):
        calls.append(len(calls))
        return {"monitor": scores[len(calls) - 1]}

    return evaluate, calls


def test_patience_stops_after_epochs_without_a_better_monitor(tmp_path, ids_tokenizer_dir):
    """Best at epoch 2, then two epochs without beating it: with patience 2 the stage stops after epoch 4 of 8,
    and the best checkpoint is the one later stages take."""
    policy = load_policy(ModelConfig(preset="tiny", family="bart"), ids_tokenizer_dir, seed=0)
    src, tgt = _task(policy.tokenizer)
    evaluate, calls = _scripted([0.5, 0.9, 0.9, 0.7, 2.0, 3.0, 4.0, 5.0])
    result = run_sft(policy, src, tgt, _sft_cfg(epochs=8, patience=2, save_every_steps=0), _run(tmp_path, "p"),
                     tmp_path / "p", evaluate=evaluate, monitor_by="rouge_l")
    assert len(calls) == 4 and result.steps == 4 * 6
    meta = read_checkpoint(result.checkpoint).meta
    assert result.checkpoint.name == "epoch-0004" and meta["since_best"] == 2
    assert meta["best"] == {"score": 0.9, "path": str(tmp_path / "p" / "checkpoints" / "epoch-0002"), "by": "rouge_l"}


def test_patience_does_not_count_epochs_its_hook_leaves_out(tmp_path, ids_tokenizer_dir):
    """Epochs 2-3 do not beat epoch 1 but are left out of the count (SFT: collapsed outputs), so with patience 1
    the stage runs on; epoch 5 counts and stops it."""
    policy = load_policy(ModelConfig(preset="tiny", family="bart"), ids_tokenizer_dir, seed=0)
    src, tgt = _task(policy.tokenizer)
    evaluate, calls = _scripted([0.3, 0.2, 0.25, 0.9, 0.5, 1.0])
    result = run_sft(policy, src, tgt, _sft_cfg(epochs=6, patience=1, save_every_steps=0), _run(tmp_path, "c"),
                     tmp_path / "c", evaluate=evaluate, patience_counts=lambda scores: scores["monitor"] > 0.4)
    assert len(calls) == 5 and result.steps == 5 * 6
    assert read_checkpoint(result.checkpoint).meta["since_best"] == 1


def test_patience_zero_or_without_a_monitor_runs_every_epoch(tmp_path, ids_tokenizer_dir, caplog):
    policy = load_policy(ModelConfig(preset="tiny", family="bart"), ids_tokenizer_dir, seed=0)
    src, tgt = _task(policy.tokenizer)
    evaluate, calls = _scripted([0.9, 0.1, 0.1, 0.1])
    with caplog.at_level(logging.INFO, logger="rlt2t"):
        result = run_sft(policy, src, tgt, _sft_cfg(epochs=4, patience=0, save_every_steps=0), _run(tmp_path, "z"),
                         tmp_path / "z", evaluate=evaluate)
    assert len(calls) == 4 and result.steps == 24
    assert result.best.name == "epoch-0001" and result.checkpoint.name == "epoch-0004"
    assert not [r for r in caplog.records if "still improved" in r.getMessage()]
    # Still improving at its last epoch: the log says the stage ended before it converged.
    evaluate, calls = _scripted([0.1, 0.2, 0.3])
    with caplog.at_level(logging.INFO, logger="rlt2t"):
        run_sft(policy, src, tgt, _sft_cfg(epochs=3, patience=0, save_every_steps=0), _run(tmp_path, "i"),
                tmp_path / "i", evaluate=evaluate)
    [note] = [r.getMessage() for r in caplog.records if "still improved" in r.getMessage()]
    assert "at the last of its 3 epochs" in note and "sft.epochs" in note
    # ... unless it reached the best a monitor can be (an accuracy's 1.0: reward models, classifiers)
    from rlt2t.learner.stages import SFTDataset, make_collate, make_sft_step
    from rlt2t.learner.trainer import train_stage

    caplog.clear()
    evaluate, calls = _scripted([0.5, 0.75, 1.0])
    cfg = _sft_cfg(epochs=3, patience=0, save_every_steps=0)
    pairs = SFTDataset(src, tgt, augment_prob=0.0, protected_ids=set(), seed=0)
    with caplog.at_level(logging.INFO, logger="rlt2t"):
        train_stage(stage="sft", cfg=cfg, run=_run(tmp_path, "c1"), model=policy.model, tokenizer=policy.tokenizer,
                    dataset=pairs, collate=make_collate(policy.tokenizer.pad_token_id, policy.model.config),
                    step_fn=make_sft_step(cfg, policy.model), out_dir=tmp_path / "c1", evaluate=evaluate,
                    monitor="monitor", monitor_ceiling=1.0)
    assert len(calls) == 3 and not [r for r in caplog.records if "still improved" in r.getMessage()]
    result = run_sft(policy, src, tgt, _sft_cfg(epochs=4, patience=1, save_every_steps=0), _run(tmp_path, "n"),
                     tmp_path / "n")
    assert result.steps == 24, "no validation: patience cannot apply, every epoch runs"


def test_patience_resumes_where_the_uninterrupted_run_stopped(tmp_path, ids_tokenizer_dir):
    """Killed after epoch 3 (one epoch without improvement): the resumed run counts that epoch, stops after
    epoch 4 as the uninterrupted run did, with its weights; resumed once more it trains nothing."""
    mc = ModelConfig(preset="tiny", family="bart", dropout=0.1)
    scores = [0.5, 0.9, 0.8, 0.7, 2.0, 3.0]
    cfg = _sft_cfg(epochs=6, patience=2, save_every_steps=0, keep_last=10)
    full = load_policy(mc, ids_tokenizer_dir, seed=0)
    src, tgt = _task(full.tokenizer)
    run_sft(full, src, tgt, cfg, _run(tmp_path, "full"), tmp_path / "full", evaluate=_scripted(scores)[0])

    part = load_policy(mc, ids_tokenizer_dir, seed=0)
    run_sft(part, src, tgt, cfg, _run(tmp_path, "part"), tmp_path / "part", evaluate=_scripted(scores)[0])
    root = tmp_path / "part" / "checkpoints"
    import shutil

    shutil.rmtree(root / "epoch-0004")
    keep = read_checkpoint(root / "epoch-0003")
    assert keep.meta["since_best"] == 1
    resumed = load_policy(mc, ids_tokenizer_dir, checkpoint=keep.path)
    evaluate, calls = _scripted(scores[3:])
    result = run_sft(resumed, src, tgt, cfg, _run(tmp_path, "part"), tmp_path / "part", resume_from=keep,
                     evaluate=evaluate)
    assert len(calls) == 1 and result.checkpoint.name == "epoch-0004"
    assert all(torch.equal(v, resumed.model.state_dict()[k]) for k, v in _weights(full.model).items())

    done = read_checkpoint(result.checkpoint)
    again = load_policy(mc, ids_tokenizer_dir, checkpoint=done.path)
    evaluate, calls = _scripted(scores)
    result = run_sft(again, src, tgt, cfg, _run(tmp_path, "part"), tmp_path / "part", resume_from=done,
                     evaluate=evaluate)
    assert calls == [] and result.checkpoint == done.path and result.steps == 24
