"""Stand-in models for the demo, tests and benchmarks: a Llama-architecture model with random
weights and a byte-level BPE tokenizer trained on the given text, saved as a normal checkpoint so
that batchgen loads it through the real `from_pretrained` path. Not a language model: its output is
noise, but noise that exercises every code path (batching, cache, EOS, sampling, chat templates).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|end|>"]

SIZES = {  # name: (hidden, layers, heads, kv_heads, intermediate, vocab)
    "tiny": (64, 2, 4, 2, 128, 512),
    "small": (256, 4, 8, 4, 688, 2048),
    "mid": (512, 6, 8, 4, 1408, 8192),  # about 26M parameters
    "bench": (768, 12, 12, 4, 2048, 8192),  # about 100M parameters
    # real models' shapes (random weights, untied LM head): the sizes users run on CPUs; their tokenizers are built
    # to the real vocabulary size without training (synthetic_tokenizer: BPE training to 152k tokens takes minutes)
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936),  # 630M parameters untied (494M as released, tied)
    "llama-3.2-1b": (2048, 16, 32, 8, 8192, 128256),  # 1.5B parameters untied (1.24B as released, tied)
}
REAL_SHAPES = ("qwen2.5-0.5b", "llama-3.2-1b")


def build_tokenizer(texts: Iterable[str], vocab_size: int, path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # no progress bar: off a terminal (make demo's log) it printed blank lines
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   add_bos_token=True)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def synthetic_tokenizer(vocab_size: int, path: Path):
    """A byte-level BPE tokenizer of exactly `vocab_size` tokens, built in seconds: the 256 byte symbols, the
    special tokens, then letter strings of growing length (aa..zz, aaa..zzz, ...), each merged from its prefix and
    its last letter. Text of letters and spaces tokenizes into chunks of up to the longest length as a real
    vocabulary's words would; what matters for a benchmark is the embedding and LM head size."""
    import itertools

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for symbol in pre_tokenizers.ByteLevel.alphabet():
        vocab.setdefault(symbol, len(vocab))
    merges = []
    letters = "abcdefghijklmnopqrstuvwxyz"
    for length in itertools.count(2):
        for chars in itertools.product(letters, repeat=length):
            if len(vocab) >= vocab_size:
                break
            token = "".join(chars)
            vocab[token] = len(vocab)
            merges.append((token[:-1], token[-1]))
        if len(vocab) >= vocab_size:
            break
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   add_bos_token=True)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def build_model(path: str | Path, texts: Iterable[str], *, size: str = "tiny", seed: int = 0,
                max_position_embeddings: int = 2048, vocab: int | None = None) -> Path:
    """Write a random-weight Llama checkpoint with its tokenizer to `path` and return it. The vocabulary is at most
    the size's (or `vocab`); BPE stops earlier where the texts offer no more merges."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    hidden, layers, heads, kv_heads, inter, size_vocab = SIZES[size]
    if size in REAL_SHAPES:
        synthetic_tokenizer(vocab or size_vocab, path)
    else:
        build_tokenizer(texts, vocab or size_vocab, path)
    tok = AutoTokenizer.from_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=inter, max_position_embeddings=max_position_embeddings,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(path)
    return path


BENCH_WORDS = ("the river town market opened closed with many people after rain sun night lamp bread clock train "
               "harbour music quiet loud green blue small large old new fast slow city field stone road").split()


def cached_model(workdir: Path, size: str, seed: int = 0, vocab: int | None = None) -> Path:
    """A benchmark's random-weight model of `size`, built once under `workdir` (as model-<size>) and reused. With
    `vocab`, a tokenizer of about that many tokens (a real model's order: 32k-150k), trained on pseudo-words as
    well as the benchmark words (which alone offer about 400 tokens)."""
    import random

    model = Path(workdir) / (f"model-{size}" if vocab is None else f"model-{size}-v{vocab}")
    if not (model / "config.json").exists():
        rng = random.Random(seed)
        texts = [" ".join(rng.choice(BENCH_WORDS) for _ in range(200)) for _ in range(200)]
        if vocab is not None:
            letters = "abcdefghijklmnopqrstuvwxyz"
            texts += [" ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(200))
                      for _ in range(vocab // 4)]
        build_model(model, texts, size=size, max_position_embeddings=2048, vocab=vocab)
    return model
