"""Shared fixtures: a tiny id tokenizer and tiny BART policy built from config (no hub access)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import uvicorn

from rlt2t.common.config import ModelConfig
from rlt2t.common.policy import load_policy
from rlt2t.common.tokenization import build_ids_tokenizer, save_tokenizer
from rlt2t.services.http import uvicorn_config

# Two cores, many small ops: extra threads only add contention in tests.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


def _wordnet_present() -> bool:
    from rlt2t.common.wordnet import find_wordnet

    try:
        find_wordnet()
    except FileNotFoundError:
        return False
    return True


# The Debian packages some tests need (the Makefile's DEB_PACKAGES) and how to tell each is there. `make test`
# installs the missing ones when it may (as root); elsewhere a test marked `system_package(name)` skips, naming the
# command that installs it: a missing system package never fails a test.
SYSTEM_PACKAGES = {
    "wordnet-base": _wordnet_present,
    "chromium": lambda: os.access(os.environ.get("RLT2T_CHROMIUM", "/usr/bin/chromium"), os.X_OK),
    "postgresql-15": lambda: (Path("/usr/lib/postgresql/15/bin") / "postgres").is_file(),
}


@pytest.fixture
def no_wordnet(monkeypatch, tmp_path) -> Path:
    """This machine as one without Debian's wordnet-base: no $WNSEARCHDIR / $WNHOME, and the default directories
    replaced by an empty one (returned)."""
    import rlt2t.common.wordnet as wordnet

    empty = tmp_path / "no-wordnet"
    empty.mkdir()
    monkeypatch.delenv("WNSEARCHDIR", raising=False)
    monkeypatch.delenv("WNHOME", raising=False)
    monkeypatch.setattr(wordnet, "WORDNET_DIRS", (str(empty),))
    return empty


def pytest_runtest_setup(item) -> None:
    for mark in item.iter_markers("system_package"):
        (name,) = mark.args
        if not SYSTEM_PACKAGES[name]():
            pytest.skip(f"Debian's {name} is not installed; install it with `sudo apt-get install -y "
                        f"--no-install-recommends {name}` (`make test` does it when run as root)")


def pytest_unconfigure(config) -> None:
    """A multiprocessing child a failed test left running is killed: at exit Python joins every non-daemon child,
    so one hung child would keep a finished session, and CI, waiting until its time limit."""
    for child in multiprocessing.active_children():
        child.kill()
        child.join(5)


@pytest.fixture(scope="session")
def ids_tokenizer_dir(tmp_path_factory) -> Path:
    """An integer-id tokenizer: 60 data tokens, 4 sentinels (offset 10, 70 ids in all)."""
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(build_ids_tokenizer(num_data_tokens=60, num_sentinels=4), out)
    return out


@pytest.fixture(scope="session")
def wide_policy_dir(ids_tokenizer_dir, tmp_path_factory):
    """``wide_policy_dir(model_cfg)``: a tiny policy of that config with wide weights (its samples and greedy
    outputs vary from source to source), saved with the tokenizer as a model directory."""

    def make(model_cfg: ModelConfig) -> Path:
        policy = load_policy(model_cfg, ids_tokenizer_dir, seed=0)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for param in policy.model.parameters():
                if param.dim() >= 2:
                    param.copy_(torch.randn(param.shape, generator=gen) * 2.0 / param.shape[-1] ** 0.5)
        out = tmp_path_factory.mktemp(f"init-{model_cfg.family}")
        policy.model.save_pretrained(out)
        policy.tokenizer.save_pretrained(out)
        return out

    return make


@pytest.fixture
def done_stamp(tmp_path) -> str:
    """``STAMP=…`` for make: a stamp newer than pyproject.toml, so the set-up counts as done. (Not the Makefile: a
    fresh clone writes it before pyproject.toml, so make would run the set-up, for real, into the repo's .venv.)"""
    stamp = tmp_path / "stamp"
    stamp.touch()
    return f"STAMP={stamp}"


@pytest.fixture
def tiny_policy(ids_tokenizer_dir):
    return load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=0)


@pytest.fixture(autouse=True, scope="session")
def _quiet_transformers():
    from rlt2t.common.tracking import quiet_transformers

    quiet_transformers()


class LiveServer:
    """uvicorn serving ``app`` on a free loopback port, in a thread; ``url`` once it accepts. With ``sock`` (from
    ``LiveServer.reserve()``), on that socket's port: a port a test hands out before its server exists stays held
    (a port found free and released can be taken by anything else on the machine in the meantime, an xdist
    neighbour's Ray included). With ``serve`` (a ServeConfig), the servers' own uvicorn settings (timeouts)."""

    @staticmethod
    def reserve() -> socket.socket:
        """A socket bound to a free loopback port, not listening yet (connections to it are refused, as to no
        server): its port is this test's until a LiveServer serves on it."""
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        return sock

    @staticmethod
    def url_of(sock: socket.socket) -> str:
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def __init__(self, app, sock: socket.socket | None = None, serve=None) -> None:
        self.sock = sock if sock is not None else self.reserve()
        self.url = self.url_of(self.sock)
        config = (uvicorn_config(app, serve, log_level="warning", lifespan="on") if serve is not None
                  else uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        self.sock.close()


@pytest.fixture
def cli(capsys):
    """``cli(*argv)``: ``rlt2t ARGV`` through ``main`` in this process (no seconds spent importing torch again):
    (exit code, stdout, stderr). --help and usage errors end in argparse's SystemExit: its code."""
    from rlt2t.cli import main

    def run(*argv: str) -> tuple[int, str, str]:
        try:
            code = main(list(argv))
        except SystemExit as e:
            code = int(e.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    return run


def _load_bench_script(name: str):
    """bench/<name>.py as a module (bench/ is not a package; its scripts import their neighbours by name)."""
    import importlib.util
    import sys

    bench = Path(__file__).resolve().parents[1] / "bench"
    spec = importlib.util.spec_from_file_location(f"bench_{name}_under_test", bench / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    sys.path.insert(0, str(bench))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
        sys.path.remove(str(bench))
    return module


@pytest.fixture(scope="session")  # a function: usable from fixtures of any scope
def bench_script():
    """``bench_script(name)``: bench/<name>.py loaded as a module, for testing a benchmark's pure parts."""
    return _load_bench_script


@pytest.fixture(scope="session")  # a class, not a server: usable from fixtures of any scope
def live_server() -> type[LiveServer]:
    """The LiveServer class: `with live_server(app) as s: httpx.get(s.url + ...)`."""
    return LiveServer


# --- Tiny models of every encoder-decoder family, with their real tokenizer classes ----------------------
# Built once per session and saved with save_pretrained, as a downloaded directory would be; tests load them
# back through load_policy (model.path / --checkpoint), the path users take.

FAMILY_WORDS = (
    "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu", "nu", "xi",
    "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi", "omega", "red", "green", "blue", "small",
    "large", "quick", "slow", "river", "stone",
)


def family_texts(n: int = 300, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(FAMILY_WORDS) for _ in range(rng.randint(3, 10))) for _ in range(n)]


def _spm(texts: list[str], **ids) -> bytes:
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=buf, vocab_size=80, model_type="unigram",
                                   minloglevel=2, character_coverage=1.0, hard_vocab_limit=False, **ids)
    return buf.getvalue()


def _pieces(model: bytes) -> list[tuple[str, float]]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model)
    return [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]


def build_family_dir(family: str, out: Path, texts: list[str]) -> Path:
    """A tiny random model of ``family`` and its own tokenizer class, laid out as the hub's checkpoints are."""
    import json

    import transformers as tf

    bart_shape = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                      decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128,
                      dropout=0.0, init_std=0.3)  # large random weights: outputs that depend on the input
    torch.manual_seed(0)
    if family == "bart":
        from rlt2t.common.tokenization import train_subword_tokenizer

        tok = train_subword_tokenizer(texts, vocab_size=400, num_sentinels=8)
        cfg = tf.BartConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                            eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.eos_token_id,
                            forced_eos_token_id=tok.eos_token_id, **bart_shape)
        model = tf.BartForConditionalGeneration(cfg)
    elif family in ("t5", "t5-v1.0"):
        # pad 0, eos 1, unk 2, pieces, then <extra_id_N> counting down from the top (google/t5 layout).
        pieces = _pieces(_spm(texts, pad_id=0, eos_id=1, unk_id=2, bos_id=-1))
        tok = tf.T5Tokenizer(vocab=pieces + [(f"<extra_id_{i}>", 0.0) for i in range(7, -1, -1)], extra_ids=8)
        cfg = tf.T5Config(vocab_size=len(tok), d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2,
                          num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                          dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                          feed_forward_proj="relu" if family == "t5-v1.0" else "gated-gelu",
                          tie_word_embeddings=family == "t5-v1.0")
        model = tf.T5ForConditionalGeneration(cfg)
        if family == "t5":  # Flan-T5: its own lm_head
            model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.shared.weight) * 0.5)
    elif family == "pegasus":
        tok = tf.PegasusTokenizer(vocab=_pieces(_spm(texts, pad_id=0, eos_id=1, unk_id=2, bos_id=-1)), offset=4)
        cfg = tf.PegasusConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                               decoder_start_token_id=tok.pad_token_id, forced_eos_token_id=tok.eos_token_id,
                               scale_embedding=True, **bart_shape)
        model = tf.PegasusForConditionalGeneration(cfg)
    elif family == "mbart":
        tok = tf.MBartTokenizer(vocab=_pieces(_spm(texts, bos_id=0, pad_id=1, eos_id=2, unk_id=3)), src_lang="en_XX",
                                tgt_lang="en_XX")
        cfg = tf.MBartConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                             eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.convert_tokens_to_ids("en_XX"),
                             forced_eos_token_id=tok.eos_token_id, scale_embedding=True, **bart_shape)
        model = tf.MBartForConditionalGeneration(cfg)
    elif family == "marian":
        # opus-mt layout: </s> 0, <unk> 1, pieces, <pad> last; source and target sentencepiece models.
        spm_model = _spm(texts, eos_id=0, unk_id=1, bos_id=-1, pad_id=-1)
        src = out.parent / f"{out.name}-spm"
        src.mkdir(parents=True, exist_ok=True)
        (src / "source.spm").write_bytes(spm_model)
        (src / "target.spm").write_bytes(spm_model)
        vocab = {piece: i for i, (piece, _) in enumerate(_pieces(spm_model))}
        vocab["<pad>"] = len(vocab)
        (src / "vocab.json").write_text(json.dumps(vocab))
        tok = tf.MarianTokenizer(str(src / "source.spm"), str(src / "target.spm"), str(src / "vocab.json"))
        cfg = tf.MarianConfig(vocab_size=len(tok), decoder_vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                              eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.pad_token_id,
                              forced_eos_token_id=tok.eos_token_id, scale_embedding=True, **bart_shape)
        model = tf.MarianMTModel(cfg)
    elif family == "encoder-decoder":
        # A tiny BERT (WordPiece vocabulary over the words) warm-started into an EncoderDecoderModel.
        bert_dir = out.parent / f"{out.name}-bert"
        bert_dir.mkdir(parents=True, exist_ok=True)
        words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(set(FAMILY_WORDS))]
        (bert_dir / "vocab.txt").write_text("\n".join(words) + "\n")
        tok = tf.BertTokenizer(str(bert_dir / "vocab.txt"))
        bert = tf.BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=64, max_position_embeddings=128, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0, pad_token_id=0)
        tf.BertModel(bert).save_pretrained(bert_dir)
        tok.save_pretrained(bert_dir)
        from rlt2t.common.families import warm_start
        from rlt2t.common.tokenization import load_tokenizer

        model = warm_start(bert_dir, load_tokenizer(bert_dir))
        tok = load_tokenizer(bert_dir)
    else:
        raise ValueError(family)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    """family -> a saved tiny model directory with its tokenizer (bart, t5, marian, mbart, pegasus,
    encoder-decoder; t5-v1.0 is the tied, output-scaled T5 layout)."""
    root = tmp_path_factory.mktemp("families")
    texts = family_texts()
    families = ("bart", "t5", "t5-v1.0", "marian", "mbart", "pegasus", "encoder-decoder")
    return {f: build_family_dir(f, root / f, texts) for f in families}


@pytest.fixture(scope="session")
def bart_family_dir(tmp_path_factory) -> Path:
    """The tiny BART of :func:`family_dirs` alone, for tests that need one pretrained-like directory."""
    return build_family_dir("bart", tmp_path_factory.mktemp("bart-family") / "bart", family_texts())


# The gloo ranks fork from one server process per test process, which imported torch, transformers and the
# learner once (multiprocessing's forkserver), instead of each spawned rank importing them again (about 5 s of a
# core each, 22 ranks in the unit suite). The server imports but runs nothing, so no thread is forked mid-work.
RANK_PRELOAD = ["torch.distributed", "rlt2t.learner.learner", "rlt2t.learner.stage_ranks", "rlt2t.learner.stages",
                "rlt2t.actors.rollout", "rlt2t.actors.reward"]


def _rank_with_stacks(rank: int, stacks: str, fn, *args) -> None:
    """``fn(rank, *args)``, Python's stacks dumped into ``stacks/<rank>`` on SIGABRT (what a rank that hangs is
    sent at the deadline; a forked rank's stderr is the server's, not the test's)."""
    import faulthandler

    with open(Path(stacks) / str(rank), "w") as dump:
        faulthandler.enable(file=dump)
        fn(rank, *args)


def _run_ranks(fn, args: tuple, nprocs: int = 2, deadline_s: float = 90.0) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes forked from the preloaded server (a gloo world the function
    forms itself), waited for. A rank still running at the deadline has its Python stacks dumped into the
    failure's message and all are killed, so a hang fails here, it does not outlive the session (pytest waits on
    live non-daemon children at exit); a rank that raises fails the test with its traceback."""
    import tempfile

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(RANK_PRELOAD)  # read when the server starts: at the first call
    with tempfile.TemporaryDirectory(prefix="rank-stacks-") as stacks:
        context = mp.start_processes(_rank_with_stacks, args=(stacks, fn, *args), nprocs=nprocs, join=False,
                                     start_method="forkserver")
        try:
            stop = time.monotonic() + deadline_s
            while not context.join(timeout=1.0):
                if time.monotonic() > stop:
                    for process in context.processes:
                        if process.is_alive():
                            os.kill(process.pid, signal.SIGABRT)
                            process.join(5)
                    dumps = "\n".join(f"rank {p.name}:\n{p.read_text()}" for p in sorted(Path(stacks).iterdir()))
                    pytest.fail(f"the {nprocs} gloo ranks did not finish in {deadline_s:.0f} s; their stacks:\n"
                                + dumps)
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join(5)


@pytest.fixture
def run_ranks():
    """``run_ranks(fn, args, nprocs=2, deadline_s=90)``: ``fn(rank, *args)`` on that many processes (``fn`` at
    module level, forming its own process group), waited for with a deadline. The ranks fork from a server
    started at the test process's first call: they have its environment then, not a later test's (pass what a
    rank needs in ``args``)."""
    return _run_ranks
