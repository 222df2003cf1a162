"""A tiny, deterministic byte-level BPE tokenizer for tests, trained in well under a second.

End-to-end fixtures put it next to tiny random models (vocab 512), so its vocabulary stays small
(<= `vocab_size`) while still covering every byte, which lets any text round-trip.
"""

from __future__ import annotations

import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]  # ids 0, 1, 2 (the trainer puts them first, in this order)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The capital of France is Paris. Paris is a large city on the river Seine, and France is a country "
    "in Western Europe. Many people visit Paris every year to see the Eiffel Tower and the Louvre.",
    "Once upon a time, there was a little robot who liked to count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10. "
    "It counted the stars at night and the birds in the morning, and it was happy.",
    "The quick brown fox jumps over the lazy dog! Is it true? Yes, it is; the dog did not mind at all.",
    "In 2024, the meeting started at 10:30 and ended at 12:45. There were 42 people, 7 tables and "
    "100 chairs. The report said: \"We need more coffee\" (and more time).",
    "Hello, world! How are you today? I am fine, thank you. What is your name? My name is Ada.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))  # prints 3\n",
    "The weather in London is often rainy, but the weather in Madrid is usually sunny and warm.",
]


def make_tiny_tokenizer(dirpath: str | os.PathLike, vocab_size: int = 400) -> None:
    """Train the tiny tokenizer and `save_pretrained` it (tokenizer.json, config, ChatML template) to `dirpath`.

    `<|endoftext|>` (id 0) is eos, bos and pad; `<|im_start|>` and `<|im_end|>` are extra specials.
    The vocabulary is at most `vocab_size` (>= 256 + 3 for the byte alphabet and specials).
    """
    from transformers import PreTrainedTokenizerFast  # no torch: only the tokenizer classes load

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} to hold every byte, got {vocab_size}.")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte, so no text is ever unknown
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    assert tok.get_vocab_size() <= vocab_size and tok.token_to_id(EOS) == 0
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        bos_token=EOS,
        pad_token=EOS,
        unk_token=None,
        extra_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,  # decode must equal the raw byte-level decode
        model_max_length=1 << 30,
    )
    fast.chat_template = CHATML_TEMPLATE
    os.makedirs(dirpath, exist_ok=True)
    fast.save_pretrained(os.fspath(dirpath))
