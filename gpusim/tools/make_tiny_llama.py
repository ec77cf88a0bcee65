"""TEST INFRASTRUCTURE: write a tiny random-weight Llama that the real SGLang 0.5.23 serves on CPU.

    <reference venv>/bin/python gpusim/tools/make_tiny_llama.py DIR [--vocab-size 32000]

Writes DIR/config.json, DIR/model.safetensors, DIR/generation_config.json and a tokenizer
(DIR/tokenizer.json, DIR/tokenizer_config.json, DIR/special_tokens_map.json) made locally with
the `tokenizers` library: a word-level vocabulary of made-up words, so no hub and no download.
The weights are random (seeded, so two runs write the same files): the model generates nonsense,
which is all a test of serving needs (exact token counts come from `ignore_eos`).

Needs torch, transformers, tokenizers and safetensors, i.e. the SGLang reference venv
(scripts/sglang-reference-env.sh) or any venv installed from gpusim/tools/sglang-0.5.23-cpu.lock.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
# A chat template, so /v1/chat/completions works too.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: "
    "{{ message['content'] }} {% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
# Small enough that the real server's weights are a few MB and a CPU prefill is fast.
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
MIN_VOCAB = len(SPECIAL_TOKENS) + 16


def word(index: int) -> str:
    """The made-up word for vocabulary slot `index` (lower-case letters, unique per index)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    out = ""
    n = index
    while True:
        out = letters[n % 26] + out
        n = n // 26 - 1
        if n < 0:
            return out


def build_tokenizer(vocab_size: int, max_length: int) -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for i in range(vocab_size - len(SPECIAL_TOKENS)):
        vocab[word(i)] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Tokens are whole words; with no decoder, decoding joins them with spaces.
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=max_length,
        chat_template=CHAT_TEMPLATE,
    )


def build_model(vocab_size: int, max_length: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=max_length,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=True,
        **SHAPE,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    return model


def write_index(directory: Path) -> None:
    """model.safetensors.index.json: what the project's planner reads (metadata.total_size,
    sglang_fleet/capacity/model_config.py) and a sharded checkpoint has; one shard here."""
    weights = directory / "model.safetensors"
    header_len = int.from_bytes(weights.read_bytes()[:8], "little")
    header = json.loads(weights.read_bytes()[8 : 8 + header_len])
    names = sorted(name for name in header if name != "__metadata__")
    total = sum(header[name]["data_offsets"][1] - header[name]["data_offsets"][0] for name in names)
    index = {"metadata": {"total_size": total}, "weight_map": dict.fromkeys(names, weights.name)}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write(directory: Path, vocab_size: int, max_length: int, seed: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size, max_length)
    if len(tokenizer) != vocab_size:
        raise SystemExit(f"tokenizer has {len(tokenizer)} entries, expected {vocab_size}")
    model = build_model(vocab_size, max_length, seed)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    write_index(directory)
    for path in directory.iterdir():
        path.chmod(0o644)  # readable by the unprivileged user a server runs as
    config = json.loads((directory / "config.json").read_text())
    print(
        f"tiny Llama in {directory}: vocab_size={config['vocab_size']}, "
        f"params={sum(p.numel() for p in model.parameters())}, "
        f"max_position_embeddings={config['max_position_embeddings']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--max-position-embeddings", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.vocab_size < MIN_VOCAB:
        parser.error(f"--vocab-size must be at least {MIN_VOCAB}, got {args.vocab_size}")
    write(args.directory, args.vocab_size, args.max_position_embeddings, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
