"""What the RL job asks Ray for when it starts its workers (rlt2t.driver._Job.start), with Ray's pieces faked."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import rlt2t.driver as train
from rlt2t.common.algorithms import rollout_spec_for
from rlt2t.common.config import load_config


class _Stop(Exception):
    pass


def _started_pools(monkeypatch, overrides: list[str]) -> dict[str, dict]:
    """The keyword arguments of each worker pool the job builds (the job stops after the reward pool)."""
    seen: dict[str, dict] = {}

    def pool(cls, n, **kw):
        seen[cls.__name__] = kw
        if cls.__name__ == "RewardWorker":
            raise _Stop
        return SimpleNamespace(shutdown=lambda: None)

    monkeypatch.setattr(train, "LearnerGroup", lambda *a, **k: SimpleNamespace(shutdown=lambda: None))
    monkeypatch.setattr(train, "WorkerPool", pool)
    cfg = load_config(["tiny"], overrides)
    with pytest.raises(_Stop):
        train._Job.start(cfg, rollout_spec_for("grpo", kl=False), start=Path("start"), init=Path("init"),
                         total_steps=1, df=None)
    return seen


def test_rollout_workers_given_a_gpu_sample_on_it(monkeypatch):
    pools = _started_pools(monkeypatch, ["rl.rollout_gpus=0.25", "rl.reward_gpus=0.5"])
    assert pools["RolloutWorker"]["num_gpus"] == 0.25 and pools["RolloutWorker"]["kwargs"]["device"] == "cuda"
    assert pools["RewardWorker"]["num_gpus"] == 0.5
    pools = _started_pools(monkeypatch, [])
    assert pools["RolloutWorker"]["kwargs"]["device"] == "cpu" and pools["RewardWorker"]["num_gpus"] == 0


def test_learned_rewards_on_cuda_need_a_gpu_for_the_reward_workers(monkeypatch):
    monkeypatch.setattr(train, "LearnerGroup", lambda *a, **k: pytest.fail("started before the check"))
    cfg = load_config(["tiny"], ["reward.device=cuda", "reward.terms=[{kind: reward_model, path: rm}]"])
    with pytest.raises(ValueError, match="reward.device=cuda.*rl.reward_gpus"):
        train._Job.start(cfg, rollout_spec_for("grpo", kl=False), start=Path("start"), init=Path("init"),
                         total_steps=1, df=None)
    # metrics alone run on the CPU whatever reward.device says: no GPU needed
    assert _started_pools(monkeypatch, ["reward.device=cuda"])["RewardWorker"]["num_gpus"] == 0


def test_a_resume_with_another_schedule_length_is_refused_before_ray_starts(monkeypatch, tmp_path):
    # The learners restore the scheduler with its old length: more epochs would run at the floor rate, and a
    # larger rl.max_steps made the epoch's plan blame the data. Refused first, naming the settings.
    from rlt2t.common.checkpoint import CheckpointInfo
    from rlt2t.common.data import Example

    monkeypatch.setattr(train, "init_ray", lambda cfg: pytest.fail("Ray started"))
    cfg = load_config(["tiny"], [f"run.dir={tmp_path / 'run'}", "rl.epochs=2", "rl.batch_size=4"])
    examples = [Example(str(i), f"s {i}", f"t {i}") for i in range(8)]
    finished = CheckpointInfo(tmp_path / "epoch-0001", 2, {"epoch": 1, "total_steps": 2})
    with pytest.raises(ValueError, match=r"rl: .*epoch-0001 belongs to a schedule of 2 steps, these settings give 4 "
                                         r"\(rl.epochs, rl.max_steps"):
        train.train(cfg, examples, [], init=tmp_path / "init", resume_from=finished)


def test_a_run_started_from_another_runs_checkpoint_takes_its_tokenizer(tiny_policy, tmp_path):
    # `rlt2t train --init other/sft/checkpoints run.dir=new`: the rollout workers build their model with the run's
    # tokenizer, and eval / export read it later; the one saved with the start checkpoint becomes the run's.
    from rlt2t.common.tokenization import load_tokenizer
    from rlt2t.jobs import _tokenizer_from

    start = tmp_path / "other" / "epoch-0003"
    tiny_policy.model.save_pretrained(start)
    tiny_policy.tokenizer.save_pretrained(start)
    cfg = load_config(["tiny"], [f"run.dir={tmp_path / 'new'}"])
    _tokenizer_from(cfg, start)
    assert load_tokenizer(cfg.tokenizer_dir).get_vocab() == tiny_policy.tokenizer.get_vocab()
    mine = load_config(["tiny"], [f"run.dir={tmp_path / 'mine'}", f"tokenizer.path={tmp_path / 'tok'}"])
    _tokenizer_from(mine, start)  # a tokenizer the config names is the user's to make: left alone
    assert not (tmp_path / "tok").exists()
    pretrained = load_config(["tiny"], [f"run.dir={tmp_path / 'pre'}", f"model.path={start}"])
    _tokenizer_from(pretrained, start)  # model.path's own tokenizer is what its commands read: none is copied
    assert not pretrained.tokenizer_dir.exists()


def test_a_model_directory_without_its_tokenizer_is_refused_unless_tokenizer_path_names_one(tiny_policy, tmp_path):
    """The run's own {run}/tokenizer (built, or copied by an earlier stage) is not a pretrained model's: a directory
    saved without its tokenizer would have trained with it, silently when it has fewer tokens than the model."""
    from rlt2t.common.policy import load_policy
    from rlt2t.jobs import build_tokenizer_job

    bare = tmp_path / "bare"
    tiny_policy.model.save_pretrained(bare)
    run = [f"run.dir={tmp_path / 'run'}"]
    tiny_policy.tokenizer.save_pretrained(tmp_path / "run" / "tokenizer")  # a run tokenizer that would have fitted
    with pytest.raises(ValueError, match=rf"model.path={bare} holds no tokenizer .*\(tokenizer.save_pretrained\("
                                         rf"'{bare}'\)\), or name its directory with tokenizer.path=DIR"):
        load_config(["tiny"], [*run, f"model.path={bare}"])
    tiny_policy.tokenizer.save_pretrained(tmp_path / "tok")
    named = load_config(["tiny"], [*run, f"model.path={bare}", f"tokenizer.path={tmp_path / 'tok'}"])
    assert load_policy(named.model, named.tokenizer_dir).tokenizer.get_vocab() == tiny_policy.tokenizer.get_vocab()
    load_config(["tiny"], [*run, f"model.path={tmp_path / 'not-yet'}"])  # no directory yet: checked on loading
    # A directory with its tokenizer: `tokenizer build` would write one that no command reads, and is refused.
    tiny_policy.tokenizer.save_pretrained(bare)
    own = load_config(["tiny"], [f"run.dir={tmp_path / 'run2'}", f"model.path={bare}"])
    with pytest.raises(ValueError, match=rf"model.path={bare} brings its own tokenizer \({bare}\).*Leave out "
                                         r"`rlt2t tokenizer build`"):
        build_tokenizer_job(own)
    assert not own.tokenizer_dir.exists()


def test_sft_warns_when_a_pretraining_checkpoint_or_its_tokenizer_is_not_what_the_config_names(
        tiny_policy, tmp_path, caplog):
    """SFT starts from the run's pretraining checkpoint, with that checkpoint's tokenizer: a model.path that
    pretraining did not start from, or a run tokenizer rebuilt since, is not what trains; each says so."""
    from rlt2t.common.checkpoint import save_checkpoint
    from rlt2t.common.tokenization import build_ids_tokenizer, save_tokenizer
    from rlt2t.jobs import _stage_start, default_sft_init, save_run_config

    run = tmp_path / "run"
    pretrained = save_checkpoint(run / "pretrain" / "checkpoints", "epoch-0001", model=tiny_policy.model,
                                 tokenizer=tiny_policy.tokenizer, step=3)
    save_tokenizer(tiny_policy.tokenizer, run / "tokenizer")
    cfg = load_config(["tiny"], [f"run.dir={run}"])
    save_run_config(cfg, "pretrain")
    with caplog.at_level("WARNING", logger="rlt2t"):
        assert default_sft_init(cfg) == pretrained
        _stage_start(cfg, "sft", pretrained, resume=False)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]  # the run as pretraining left it

    mine = load_config(["tiny"], [f"run.dir={run}", f"model.path={tmp_path / 'downloaded'}"])
    with caplog.at_level("WARNING", logger="rlt2t"):
        assert default_sft_init(mine) == pretrained
    assert f"not from model.path={tmp_path / 'downloaded'} (pretraining did not start from it)" in caplog.text
    caplog.clear()
    save_run_config(mine, "pretrain")  # pretraining started from model.path: its checkpoint is the one to go on
    with caplog.at_level("WARNING", logger="rlt2t"):
        default_sft_init(mine)
    assert "model.path" not in caplog.text

    save_tokenizer(build_ids_tokenizer(30, 2), run / "tokenizer")  # rebuilt after pretraining
    with caplog.at_level("WARNING", logger="rlt2t"):
        _stage_start(cfg, "sft", pretrained, resume=False)
    assert f"sft: {pretrained} brings its own tokenizer ({len(tiny_policy.tokenizer)} tokens)" in caplog.text
    assert "a different vocabulary" in caplog.text


def test_a_missing_split_names_the_runs_saved_config_that_holds_the_data_paths(tmp_path):
    import os

    from rlt2t.jobs import load_split, save_run_config

    cfg = load_config(["tiny"], [f"run.dir={tmp_path / 'run'}"])
    with pytest.raises(FileNotFoundError, match=r"data.valid: .* does not exist \(point data.train / data.valid"):
        load_split(cfg, "valid")
    (tmp_path / "mine.jsonl").write_text("")
    mine = load_config(["tiny"], [f"run.dir={tmp_path / 'run'}", f"data.valid={tmp_path / 'mine.jsonl'}"])
    save_run_config(mine, "sft")
    save_run_config(mine, "train")
    save_run_config(cfg, "eval")  # this command's own config, saved before it failed: the same missing path
    os.utime(tmp_path / "run" / "config" / "sft.yaml", (2e9, 2e9))
    os.utime(tmp_path / "run" / "config" / "eval.yaml", (3e9, 3e9))  # the newest, but no hint
    with pytest.raises(FileNotFoundError, match=rf"--config {tmp_path / 'run' / 'config' / 'sft.yaml'}\)"):
        load_split(cfg, "valid")  # `rlt2t eval run.dir=...` without the config the run was trained with
    with pytest.raises(FileNotFoundError, match=r"data.test: .*; `rlt2t data import` writes a test split only "
                                                r"with --test-fraction\)"):
        load_split(cfg, "test")  # the README's own-data route imported one file without a test split


def test_a_command_whose_input_settings_differ_from_the_runs_last_other_command_warns_naming_them(tmp_path, caplog):
    import os

    from rlt2t.jobs import save_run_config, unlike_earlier

    run = f"run.dir={tmp_path / 'run'}"
    longer = load_config(["tiny"], [run, "data.max_source_len=96", "tokenizer.vocab_size=500"])
    plain = load_config(["tiny"], [run, "sft.lr=1e-3", "data.train=other.jsonl"])  # neither shapes the inputs
    assert unlike_earlier(plain, "train") == []  # a run's first command
    save_run_config(longer, "sft")
    with caplog.at_level("WARNING", logger="rlt2t.jobs"):
        save_run_config(plain, "train")  # `rlt2t train run.dir=...` without the settings sft ran with
    assert (f"train: data.max_source_len={plain.data.max_source_len} (96 in config/sft.yaml); "
            f"tokenizer.vocab_size={plain.tokenizer.vocab_size} (500 in config/sft.yaml). A command reads only its "
            "own --config files") in caplog.text
    assert (tmp_path / "run" / "config" / "train.yaml").is_file()  # warned, and saved as before
    os.utime(tmp_path / "run" / "config" / "sft.yaml", (1e9, 1e9))  # train's is now the newest other
    assert unlike_earlier(plain, "eval") == [] and unlike_earlier(longer, "eval") != []
    assert unlike_earlier(longer, "train") == []  # a command is not compared with its own earlier run
    (tmp_path / "run" / "config" / "train.yaml").write_text("no_such_section: {}\n")  # another version's
    assert unlike_earlier(longer, "eval") == []


def test_rl_and_continued_sft_without_an_sft_checkpoint_say_what_to_run(tmp_path):
    from rlt2t.jobs import continued_sft_job, make_synthetic_data, rl_job

    cfg = load_config(["tiny"], [f"run.dir={tmp_path / 'run'}", "synth.size=40"])
    missing = r"sft/checkpoints: no complete checkpoint \(run `rlt2t sft` first, or pass --init, init= in Python"
    with pytest.raises(FileNotFoundError, match=missing):
        rl_job(cfg)
    # continued SFT reads its data first: the config rl_job saved has the same missing path, so it is no hint
    with pytest.raises(FileNotFoundError, match=r"data.train: .* does not exist \(point data.train / data.valid"):
        continued_sft_job(cfg)
    make_synthetic_data(cfg)
    with pytest.raises(FileNotFoundError, match=missing):
        continued_sft_job(cfg)


def test_the_reward_monitor_asks_the_next_reward_worker_when_one_is_dead(monkeypatch, caplog):
    """`metric.monitor=reward` in the RL job: a reward worker scores the validation outputs (with their rows'
    fields); a dead one is passed over with a warning; the user's reward error comes out as its own message."""
    from ray.exceptions import RayActorError

    from rlt2t.common.python_rewards import RewardError

    calls = []

    class Worker:
        def __init__(self, outcome):
            self.score_texts = SimpleNamespace(remote=lambda *batch: (calls.append(batch), outcome)[1])

    def get(outcome):
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(train.ray, "get", get)
    job = SimpleNamespace(rewards=SimpleNamespace(actors=[Worker(RayActorError()), Worker([0.5, 1.5])]))
    batch = (["s1", "s2"], ["a", "b"], [("r",), ("q",)], [{"bonus": 1}, {"bonus": 2}])
    with caplog.at_level("WARNING", logger="rlt2t.train"):
        assert train._Job.reward_scores(job, *batch) == [0.5, 1.5]
    assert calls == [(["s1", "s2"], ["a", "b"], [["r"], ["q"]], [{"bonus": 1}, {"bonus": 2}])] * 2
    assert "reward worker 0 is unavailable for the validation monitor" in caplog.text
    job.rewards.actors = [Worker(RayActorError())]
    with pytest.raises(RayActorError):  # none left: the job fails as after any dead worker
        train._Job.reward_scores(job, *batch)
    job.rewards.actors = [Worker(RewardError("reward term python:m:f raised ValueError")), Worker([1.0, 1.0])]
    with pytest.raises(RewardError, match="^reward term python:m:f raised ValueError$"):  # not retried elsewhere
        train._Job.reward_scores(job, *batch)


def test_a_reward_whose_bleu_part_cannot_score_short_references_says_so(caplog):
    from rlt2t.common.data import Example
    from rlt2t.jobs import warn_if_bleu_cannot_score

    two_words = [Example(id=str(i), source="1 2", target=f"{i} {i + 1}") for i in range(20)]
    half = two_words[:10] + [Example(id=f"l{i}", source="1", target="1 2 3 4 5") for i in range(10)]

    def warned(cfg, rows) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="rlt2t.jobs"):
            warn_if_bleu_cannot_score(cfg, rows)
        return [r.getMessage() for r in caplog.records]

    (message,) = warned(load_config(), two_words)  # the default reward: the task score, BLEU weight 1/3
    assert "for 100% of the training rows BLEU-4 is 0 whatever the candidate (no reference has 4 tokens)" in message
    assert "(task_score × 1)" in message and "reward.bleu_weight=0" in message
    assert warned(load_config(), half) == []  # the demo's data is like this: BLEU-4 still scores half
    assert warned(load_config(overrides=["reward.bleu_weight=0"]), two_words) == []
    terms = ["reward.terms=[{kind: metric, name: bleu4, weight: 0.5}, {kind: metric, name: cider_d}]"]
    (message,) = warned(load_config(overrides=terms), two_words)
    assert "(bleu4 × 0.5)" in message
    effective = ["reward.terms=[{kind: metric, name: bleu4, params: {smooth_method: exp, effective_order: true}}]"]
    assert warned(load_config(overrides=effective), two_words) == []  # BLEU of the orders a short text has
    # 13a tokenization: "a red cat." is 4 tokens; a longer second reference gives 4-grams too
    punctuated = [Example(id=str(i), source="1", target=f"a red cat{i}.") for i in range(20)]
    several = [Example(id=str(i), source="1", target="a b", references=("a b", "a b c d e")) for i in range(20)]
    assert warned(load_config(), punctuated) == [] and warned(load_config(), several) == []
    assert warned(load_config(overrides=["rl.algorithm=dpo"]), two_words) == []  # trained from preference files



def test_a_resume_with_another_algorithm_is_refused_naming_the_one_it_was_trained_with(tmp_path):
    """Forgetting `rl.algorithm=mypkg:Mine` on `--resume` would go on with the default GRPO from its weights."""
    import json

    from rlt2t.common.checkpoint import MARKER
    from rlt2t.jobs import rl_job

    ckpt = tmp_path / "run" / "rl" / "checkpoints" / "step-000004"
    ckpt.mkdir(parents=True)
    (ckpt / MARKER).write_text(json.dumps({"name": ckpt.name, "step": 4, "files": {}, "algorithm": "rloo"}))
    cfg = load_config(["tiny"], [f"run.dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match=rf"rl.algorithm=rank, but {ckpt} was trained with rl.algorithm=rloo: resume "
                                         r"with rl.algorithm=rloo, or start a new run.dir from it \(--init"):
        rl_job(cfg, resume=True)
    assert not (tmp_path / "run" / "config").exists()  # refused before the run's saved config was replaced
    # the same unit, however it is spelt, and a checkpoint that records none, pass on (to the missing SFT start)
    for algorithm, recorded in [("rloo", "rloo"), ("rlt2t.learner.algorithms.rloo:RLOO", "rloo"), ("rank", None)]:
        (ckpt / MARKER).write_text(json.dumps({"name": ckpt.name, "step": 4, "files": {}, "algorithm": recorded}))
        same = load_config(["tiny"], [f"run.dir={tmp_path / 'run'}", f"rl.algorithm={algorithm}"])
        with pytest.raises(FileNotFoundError, match=r"sft/checkpoints: no complete checkpoint"):
            rl_job(same, resume=True)


def test_a_failed_rank_says_whether_a_checkpoint_is_there_to_resume_from(monkeypatch, capsys):
    """`rerun with --resume` only when a checkpoint was written; Ray's colour codes left out of the line."""
    from rlt2t import cli
    from rlt2t.common.errors import ResumableFailure

    def fails(checkpoint, checked):
        def job(args):
            e = ResumableFailure("a learner rank failed: \x1b[36mray::Learner.train_step()\x1b[39m ValueError: x")
            e.checkpoint, e.checked = checkpoint, checked
            raise e
        return job

    for checkpoint, checked, said in [(None, True, "no checkpoint was complete yet: rerun with --resume once the cause "
                                                    "is fixed (it starts over)"),
                                      ("run/rl/checkpoints/step-000004", True,
                                       "the newest complete checkpoint (run/rl/checkpoints/step-000004) is kept: "
                                       "rerun with --resume"),
                                      (None, False, "the newest complete checkpoint is kept: rerun with --resume")]:
        monkeypatch.setattr("rlt2t.cmd_data.cmd_config", fails(checkpoint, checked))
        assert cli.main(["config"]) == 1
        err = capsys.readouterr().err
        assert "ray::Learner.train_step() ValueError: x" in err and "\x1b" not in err and said in err, err


def test_a_units_error_in_a_learner_rank_reaches_the_user_as_itself_not_as_a_rank_to_resume(monkeypatch):
    """A wrong advantages shape fails the same way on a resume: a one-line error, not "rerun with --resume"."""
    from ray.exceptions import RayTaskError

    from rlt2t import groups
    from rlt2t.common.errors import UnitError

    def failing(cause):
        def get(refs):
            raise RayTaskError("Learner.train_step", "Traceback ...", cause)
        return get

    monkeypatch.setattr(groups.ray, "get", failing(UnitError("mine:Flat.advantages returned (32,)")))
    with pytest.raises(UnitError, match=r"^mine:Flat.advantages returned \(32,\)$"):
        groups.LearnerGroup._get(None, "ref")
    monkeypatch.setattr(groups.ray, "get", failing(RuntimeError("gloo: connection reset")))
    with pytest.raises(groups.LearnerDied, match="a learner rank failed"):  # e.g. a peer rank died: resumable
        groups.LearnerGroup._get(None, "ref")


def test_building_the_runs_tokenizer_again_keeps_the_same_one_and_replaces_another_only_when_forced(tmp_path):
    """A script run again builds the same tokenizer: kept. Other settings would change the ids the run's models
    and checks were made with: refused, naming the sizes, unless forced."""
    from rlt2t.common.tokenization import load_tokenizer
    from rlt2t.jobs import build_tokenizer_job

    run = [f"run.dir={tmp_path / 'run'}"]
    out = build_tokenizer_job(load_config(["tiny"], [*run, "tokenizer.num_data_tokens=50"]))
    files = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert build_tokenizer_job(load_config(["tiny"], [*run, "tokenizer.num_data_tokens=50"])) == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == files  # not written again
    other = load_config(["tiny"], [*run, "tokenizer.num_data_tokens=60"])
    before = len(load_tokenizer(out))
    with pytest.raises(FileExistsError, match=rf"{out} holds another tokenizer \({before} tokens; these settings build "
                                              rf"{before + 10}\).*pass --force \(force=True\)"):
        build_tokenizer_job(other)
    assert len(load_tokenizer(out)) == before
    build_tokenizer_job(other, force=True)
    assert len(load_tokenizer(out)) == before + 10


def test_a_reward_monitor_with_other_length_limits_than_the_samples_says_so(caplog):
    from rlt2t.jobs import note_monitor_lengths

    caplog.set_level("INFO", logger="rlt2t.jobs")
    note_monitor_lengths(load_config(["tiny"], ["metric.monitor=reward", "rl.algorithm=grpo"]))  # eval 32, samples 24
    assert "eval.max_new_tokens=32 tokens by the reward, the samples RL trains on are up to " \
           "rollout.max_new_tokens=24" in caplog.text
    caplog.clear()
    grpo = ["rl.algorithm=grpo"]
    note_monitor_lengths(load_config(["tiny"], ["metric.monitor=reward", *grpo, "eval.max_new_tokens=24"]))
    note_monitor_lengths(load_config(["tiny"], grpo))  # a metric monitor: the same text, whatever its length
    assert "eval.max_new_tokens" not in caplog.text
