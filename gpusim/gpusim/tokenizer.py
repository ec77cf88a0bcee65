"""A tiny word-level tokenizer, written without the `tokenizers` library.

`write_tokenizer(dir)` saves tokenizer.json (the Hugging Face `tokenizers` JSON format:
WordLevel model, Whitespace pre-tokenizer) and tokenizer_config.json, which transformers'
PreTrainedTokenizerFast loads, so SGLang's benchmark client can use the fixture model
directories. The server reads the same files with `WordTokenizer` to count prompt tokens
and spell out generated ones.

Regenerate the fixtures: python -m gpusim.tokenizer gpusim/gpusim/fixtures/*/
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from pathlib import Path

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
ROLE_WORDS = ["system", "user", "assistant", ":", ".", ",", "?", "!"]
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
VOCAB_SIZE = 4096
# The same split as the `tokenizers` Whitespace pre-tokenizer.
_WHITESPACE_SPLIT = re.compile(r"\w+|[^\w\s]+")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} : {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}"
)


def build_vocab(size: int = VOCAB_SIZE) -> list[str]:
    """Deterministic pronounceable words: special tokens, role words, then syllable pairs."""
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    words = SPECIAL_TOKENS + ROLE_WORDS
    for length in itertools.count(1):
        for combo in itertools.product(syllables, repeat=length):
            words.append("".join(combo))
            if len(words) >= size:
                return words
    raise AssertionError("unreachable")


def tokenizer_json(vocab: list[str]) -> dict[str, object]:
    added = [
        {
            "id": i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {
            "type": "WordLevel",
            "vocab": {tok: i for i, tok in enumerate(vocab)},
            "unk_token": "<unk>",
        },
    }


def tokenizer_config(model_max_length: int) -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": tok,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, tok in enumerate(SPECIAL_TOKENS)
        },
    }


def write_tokenizer(directory: Path, model_max_length: int = 131072) -> None:
    vocab = build_vocab()
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json(vocab), indent=1) + "\n")
    config = tokenizer_config(model_max_length)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


class WordTokenizer:
    """Encode/decode with a WordLevel tokenizer.json (or the built-in vocabulary)."""

    def __init__(self, vocab: list[str]) -> None:
        self.vocab = vocab
        self.ids = {tok: i for i, tok in enumerate(vocab)}
        self.unk_id = self.ids.get("<unk>", 0)
        # Generated text uses ordinary words only: never special or role tokens.
        self.first_word_id = len(SPECIAL_TOKENS) + len(ROLE_WORDS)
        # Plain word characters need no JSON escaping: the streaming path can skip json.dumps.
        self.json_safe = all(w.isascii() and w.isalnum() for w in vocab[self.first_word_id :])

    @classmethod
    def from_dir(cls, directory: str | None) -> WordTokenizer:
        path = Path(directory or "") / "tokenizer.json"
        if directory and path.is_file():
            vocab_map = json.loads(path.read_text())["model"]["vocab"]
            return cls([tok for tok, _ in sorted(vocab_map.items(), key=lambda kv: kv[1])])
        return cls(build_vocab())

    def encode(self, text: str) -> list[int]:
        return [self.ids.get(word, self.unk_id) for word in _WHITESPACE_SPLIT.findall(text)]

    def count(self, text: str) -> int:
        return sum(1 for _ in _WHITESPACE_SPLIT.finditer(text))

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.vocab[i] for i in ids if 0 <= i < len(self.vocab))

    def output_token(self, position: int, seed: int) -> int:
        """The id generated at a position: deterministic, cheap, never special."""
        span = len(self.vocab) - self.first_word_id
        return self.first_word_id + (seed * 7919 + position * 104729) % span


def main(argv: list[str]) -> int:
    for directory in argv:
        config = json.loads((Path(directory) / "config.json").read_text())
        text_config = config.get("text_config", config)
        write_tokenizer(Path(directory), int(text_config.get("max_position_embeddings", 131072)))
        print(f"wrote tokenizer to {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
