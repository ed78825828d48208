"""A small byte-level BPE tokenizer trained locally on text the package ships (no download)."""

from __future__ import annotations

from importlib import resources

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
CORPUS_FILE = "tiny_corpus.txt"


def corpus_text() -> str:
    """The training text shipped in `engram_ray/data/`."""
    return (resources.files("engram_ray") / "data" / CORPUS_FILE).read_text(encoding="utf-8")


def train_tokenizer(vocab_size: int = 512, text: str | None = None):
    """Byte-level BPE `tokenizers.Tokenizer` with <pad>=0, <s>=1, </s>=2.

    Deterministic: the same text and vocab size give the same merges. Byte-level, so every
    string encodes, and partial UTF-8 byte tokens exist (the compressed map keys them raw).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = (text if text is not None else corpus_text()).splitlines(keepends=True)
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer


def hf_tokenizer_config(model_max_length: int) -> dict:
    """`tokenizer_config.json` for transformers' PreTrainedTokenizerFast (no BOS added)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": PAD_TOKEN, "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
