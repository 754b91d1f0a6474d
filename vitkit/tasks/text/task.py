"""The encoder-decoder's task as the commands see it (``vitkit.tasks.protocol``): it trains through ``vitkit train``
and decodes through its module's ``translate``."""

from vitkit.tasks.protocol import Task

TASK = Task(
    name="text",
    modules=("vitkit.lit.Seq2SeqModule", "vitkit.tasks.text.seq2seq.Seq2SeqModule"),
    links={"src_vocab_size": "src_vocab_size", "tgt_vocab_size": "tgt_vocab_size", "tokenizers": "tokenizers"},
)
