"""The tokenizer of `ostinato make-checkpoint`'s folders (tools/checkpoint.py): a byte-level BPE trained here on a
built-in English text, padded with pronounceable filler tokens to the model's vocabulary size, saved with a ChatML
chat template."""

from __future__ import annotations

import json
from pathlib import Path

BEGIN_OF_TEXT, END_OF_TEXT = "<|begin_of_text|>", "<|end_of_text|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (BEGIN_OF_TEXT, END_OF_TEXT, IM_START, IM_END)  # ids 0..3: the BPE trainer puts them first
TINY_VOCAB_SIZE = 512


# Training text for the tiny BPE. Plain English, so round-trip tests and prompts tokenize into real merges.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small engine can run a large model if it keeps the work
close to the hardware and does not waste time between steps. Every step of decoding reads all the
weights once, writes one new token into the cache, and then hands the result back to the scheduler.

Once upon a time there was a little town by the river. The people of the town grew apples and pears,
and in the autumn they carried their baskets to the market in the square. Children played near the
water while their parents talked about the weather, the price of bread and the news from the city.

Language models predict the next word from the words that came before it. They are trained on a great
amount of text written by people: books, letters, articles, questions and answers. When you ask a
question, the model writes an answer one piece at a time, and each piece depends on everything before.

Good software is tested with care. Write a small example first, check that it works, and then make it
faster. Measure before you change anything, and measure again afterwards, because the numbers often
surprise even the people who wrote the code. Simple things that are correct are better than clever
things that are wrong.

The weather today is sunny with a few clouds in the afternoon. Tomorrow there may be rain in the
morning, so bring an umbrella if you are going out early. The weekend should be warm and dry, which is
good news for anyone who wants to walk in the hills or sit in the garden with a book.

What is the capital of France? Paris is the capital of France, and it is known for its museums, its
food and the long walks along the river. How many days are there in a week? There are seven days in a
week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday. Numbers like 1, 2, 3, 10, 42
and 2024 appear in text too, as do symbols such as (brackets), "quotes", commas, colons; and dashes.
"""

_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def eos_token_ids() -> list[int]:
    return [SPECIAL_TOKENS.index(END_OF_TEXT), SPECIAL_TOKENS.index(IM_END)]


def _filler_tokens(count: int, taken: set[str]) -> list[str]:
    """`count` distinct pseudo-words (" bazo", " kifute", ...) not in `taken`, in byte-level form.

    They pad the BPE vocabulary up to the model's vocab_size: no merge produces them, so encoding never
    yields them, but a random model does, and each then decodes to readable text of a realistic length
    instead of being dropped (which is what `decode` does with ids beyond the vocabulary).
    """
    syllables = [c + v for c in "bdfghklmnprstvz" for v in "aeiou"]  # 75
    words: list[str] = []
    index = 0
    while len(words) < count:
        n, parts = index, []
        while True:  # bijective base-75: every index gives a distinct syllable string
            parts.append(syllables[n % 75])
            n = n // 75 - 1
            if n < 0:
                break
        word = "\u0120" + "".join(parts)  # \u0120 is the byte-level form of a leading space
        if word not in taken:
            words.append(word)
        index += 1
    return words


# Qwen2's pre-tokenizer split (GPT-4 style). Using Qwen's exact pipeline for every family matters: for
# model_type qwen2, transformers 5 rebuilds the tokenizer from vocab + merges with this pipeline whatever
# tokenizer.json says, so any other pipeline would load differently there.
_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)


def build_tokenizer(vocab_size: int = TINY_VOCAB_SIZE, add_bos: bool = True):
    """A byte-level BPE `tokenizers.Tokenizer` with exactly `vocab_size` tokens (special tokens at 0..3).

    Trained on the built-in corpus (deterministic: the trainer breaks ties by pair id), then padded
    with filler tokens up to `vocab_size`. `add_bos` prepends <|begin_of_text|> when encoding, as the
    Llama tokenizers do (Qwen's do not).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, TINY_VOCAB_SIZE), special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.split("\n\n"), trainer)
    vocab = tokenizer.get_vocab()
    if len(vocab) < vocab_size:
        merges = json.loads(tokenizer.to_str())["model"]["merges"]  # [[left, right], ...]
        fillers = _filler_tokens(vocab_size - len(vocab), set(vocab))
        vocab.update({token: len(vocab) + i for i, token in enumerate(fillers)})
        tokenizer.model = models.BPE(vocab=vocab, merges=[tuple(m) for m in merges])
    if add_bos:
        bos_id = SPECIAL_TOKENS.index(BEGIN_OF_TEXT)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BEGIN_OF_TEXT} $A", pair=f"{BEGIN_OF_TEXT} $A {BEGIN_OF_TEXT} $B",
            special_tokens=[(BEGIN_OF_TEXT, bos_id)],
        )
    assert tokenizer.get_vocab_size() == vocab_size, (tokenizer.get_vocab_size(), vocab_size)
    return tokenizer


def write_tokenizer(out_dir: str | Path, vocab_size: int = TINY_VOCAB_SIZE, family: str = "llama",
                    model_max_length: int = 2048) -> None:
    """Write tokenizer.json and tokenizer_config.json (ChatML template) for `family` into `out_dir`.

    Llama and Mistral tokenizers prepend <|begin_of_text|> and their chat template starts with it;
    Qwen2/Qwen3 ones do neither, as with the real models.
    """
    out = Path(out_dir)
    add_bos = family in ("llama", "mistral")
    build_tokenizer(vocab_size, add_bos).save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BEGIN_OF_TEXT,
        "eos_token": END_OF_TEXT,
        "pad_token": END_OF_TEXT,
        "unk_token": None,  # byte-level BPE needs none (and transformers' Qwen2Tokenizer would add one)
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        # Byte-level BPE round-trips text exactly; the "cleanup" would rewrite " ," as ",".
        "clean_up_tokenization_spaces": False,
        # Llama 3's template starts with the BOS token itself (chat prompts are encoded without specials).
        "chat_template": ("{{- bos_token }}" if add_bos else "") + _CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
