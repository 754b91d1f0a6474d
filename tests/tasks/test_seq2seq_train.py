"""Training the encoder-decoder: the reverse task is learned, TSV data and its tokenizer travel in the
checkpoint, every seq2seq config runs, and bad TSV lines are named."""

from pathlib import Path

import pytest
import torch

from vitkit.cli.train import cli_main
from vitkit.data.text import Tokenizer, read_tsv
from vitkit.lit import Seq2SeqModule

from .conftest import ROOT

TINY = ('{"d_model": 32, "num_encoder_layers": 1, "num_decoder_layers": 1, "num_heads": 2, "d_ff": 64, '
        '"share_embeddings": true}')


def _cpu(tmp_path: Path) -> list[str]:
    return ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.strategy", "auto",
            "--trainer.precision", "32-true", "--trainer.default_root_dir", str(tmp_path)]


def _tsv(tmp_path: Path) -> tuple[Path, Path]:
    words = "the cat sat on a mat and dog ran to red blue".split()
    g = torch.Generator().manual_seed(0)
    for name, n in (("train", 64), ("val", 16)):
        lines = []
        for _ in range(n):
            s = [words[i] for i in torch.randint(len(words), (int(torch.randint(2, 6, (1,), generator=g)),),
                                                 generator=g)]
            lines.append(f"{' '.join(s)}\t{' '.join(reversed(s))}")
        (tmp_path / f"{name}.tsv").write_text("\n".join(lines) + "\n")
    return tmp_path / "train.tsv", tmp_path / "val.tsv"


@pytest.mark.slow
def test_reverse_task_is_learned(tmp_path):
    """4 epochs of 94 steps take an untrained model (exact match 0) to reversing most held-out strings. Over
    seeds 0-4 with the native (Zen 4) and the AVX2 kernels, exact match was 0.70-0.97, BLEU 0.87-0.99, token
    accuracy 0.95-1.00 and new strings reversed 37-49 of 50 (at 188 steps an epoch: 0.78-1.00, 0.94-1.00,
    0.97-1.00); the bounds below sit well outside that spread. Without the causal mask in training (the
    decoder sees the token it is to predict) the same run fails them."""
    cli = cli_main(["fit", "--config", str(ROOT / "configs/seq2seq_reverse.yaml"), *_cpu(tmp_path),
                    "--data.num_train", "6000"])
    m = cli.trainer.callback_metrics
    assert m["val/exact_match"] >= 0.5 and m["val/bleu"] >= 0.7 and m["val/token_acc"] >= 0.9, m
    # the checkpoint's own tokenizer decodes new strings, greedy and with a beam
    g = torch.Generator().manual_seed(1)
    words = ["".join("abcdefghij"[i] for i in torch.randint(10, (int(n),), generator=g))
             for n in torch.randint(4, 11, (50,), generator=g)]
    for beam in (1, 4):
        right = sum(cli.model.translate(torch.tensor([cli.datamodule.src_tokenizer.encode(w)]), beam_size=beam)
                    == [w[::-1]] for w in words)
        assert right >= 25, (beam, right)


def test_tsv_data_and_tokenizer_live_in_the_checkpoint(tmp_path):
    train, val = _tsv(tmp_path)
    cli = cli_main(["fit", "--config", str(ROOT / "configs/transformer_base_tsv.yaml"), *_cpu(tmp_path),
                    "--model.model_overrides", TINY, "--data.train_path", str(train), "--data.val_path", str(val),
                    "--data.batch_size", "16", "--data.num_workers", "0", "--trainer.max_steps", "3",
                    "--trainer.val_check_interval", "3", "--model.val_beam_size", "2"])
    assert cli.model.model.cfg.share_embeddings and cli.model.model.cfg.src_vocab_size == 4 + 12
    model = Seq2SeqModule.load_from_checkpoint(tmp_path / "checkpoints" / "last.ckpt")  # no data module needed
    assert model.tgt_tokenizer.vocab == cli.datamodule.tgt_tokenizer.vocab
    src = torch.tensor([cli.datamodule.src_tokenizer.encode("the cat sat")])
    out = model.translate(src, max_len=6)
    assert isinstance(out[0], str) and all(w in model.tgt_tokenizer.vocab for w in out[0].split())


@pytest.mark.slow
def test_seq2seq_test_and_predict(tmp_path):
    """`test` reports the decoding metrics under test/, `predict` returns the decoded text."""
    train, val = _tsv(tmp_path)
    args = ["--config", str(ROOT / "configs/transformer_base_tsv.yaml"), *_cpu(tmp_path), "--model.model_overrides",
            TINY, "--data.train_path", str(train), "--data.val_path", str(val), "--data.batch_size", "16"]
    cli_main(["fit", *args, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2"])
    cli = cli_main(["test", *args, "--ckpt_path", "last"])
    assert {"test/loss", "test/token_acc", "test/exact_match", "test/bleu"} <= set(cli.trainer.callback_metrics)
    cli = cli_main(["predict", *args, "--ckpt_path", "last"])
    texts = [t for batch in cli.trainer.predict_loop.predictions for t in batch]
    assert len(texts) == 16 and all(isinstance(t, str) for t in texts)
    assert all(w in cli.model.tgt_tokenizer.vocab for t in texts for w in t.split())


@pytest.mark.parametrize("name", ["ocr_digits", "seq2seq_reverse"])
def test_fast_dev_run_seq2seq_configs(name, tmp_path):
    cli = cli_main(["fit", "--config", str(ROOT / f"configs/{name}.yaml"), *_cpu(tmp_path),
                    "--trainer.fast_dev_run", "2", "--data.num_train", "64", "--data.num_val", "16",
                    "--data.batch_size", "8"])
    assert cli.trainer.global_step == 2
    assert isinstance(cli.model, Seq2SeqModule)


def test_tokenizer_round_trip_and_unknowns():
    tok = Tokenizer.build(["hello world", "hello there"], level="word")
    ids = tok.encode("hello new world")
    assert tok.decode(ids) == "hello <unk> world"
    assert Tokenizer.from_dict(tok.to_dict()).vocab == tok.vocab
    assert tok.decode([*tok.encode("hello"), 2, *tok.encode("world")]) == "hello"  # stops at EOS


def test_bad_tsv_line_is_named(tmp_path):
    (tmp_path / "bad.tsv").write_text("a b\tb a\nno tab here\n")
    with pytest.raises(ValueError, match=r"bad\.tsv:2: expected 'source<TAB>target', got 1 field"):
        read_tsv(tmp_path / "bad.tsv")


def test_ocr_demo_reports_its_line(tmp_path, capsys):
    from vitkit.demo import main

    line = main(["ocr", *_cpu(tmp_path), "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
                 "--data.num_train", "64", "--data.num_val", "8", "--data.batch_size", "8"])
    assert line in capsys.readouterr().out
    accuracy = line.split("val exact-sequence accuracy ")[1].split()[0]
    best = Path(line.split("checkpoint: ")[1].split(";")[0])
    assert best.parent == tmp_path / "checkpoints" and best.exists()
    ckpt = torch.load(best, weights_only=True)
    score = next(v["best_model_score"] for k, v in ckpt["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert accuracy == f"{float(score):.3f}"  # the line reports what the checkpoint holds
