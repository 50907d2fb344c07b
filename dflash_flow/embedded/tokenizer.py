"""A byte-level BPE tokenizer trained on the embedded corpus, with a ChatML chat template.

Byte-level so that every string round-trips; digits split one by one, as a tiny target learns digit-wise
arithmetic far better than multi-digit tokens. The template is Qwen's ChatML; as in Qwen3, ``eos_token`` is
``<|im_end|>``, ``<|endoftext|>`` a document separator (also a stop token), and padding has its own token.
"""

from __future__ import annotations

from pathlib import Path

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
PAD = "<|pad|>"
# Order fixes the ids: pad 0, endoftext 1, im_start 2, im_end 3.
SPECIAL_TOKENS = [PAD, ENDOFTEXT, IM_START, IM_END]

DEFAULT_VOCAB_SIZE = 768

# ChatML. `add_generation_prompt` opens an assistant turn; no default system prompt is injected, so the
# rendered text is exactly what the conversation holds (regeneration and training must render alike).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def train_tokenizer(texts, vocab_size: int = DEFAULT_VOCAB_SIZE):
    """A byte-level BPE trained on ``texts`` as ``PreTrainedTokenizerFast`` (deterministic: ties break by byte
    order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    # All 256 bytes are in the base vocabulary: any input string is encodable.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer)
    return wrap(tok)


def wrap(tok):
    """Wrap a `tokenizers.Tokenizer` with our special tokens and chat template."""
    from transformers import PreTrainedTokenizerFast

    # No cleanup (it would eat spaces before punctuation); left padding: every row ends in the generation prompt.
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token=IM_END, pad_token=PAD, unk_token=None,
                                   additional_special_tokens=[ENDOFTEXT, IM_START], clean_up_tokenization_spaces=False,
                                   padding_side="left", model_max_length=2048)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_default_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, n_texts: int = 4000, seed: int = 0):
    """The project's tokenizer: BPE trained on the *training* side of the embedded corpus."""
    from .corpus import SYSTEM_PROMPTS, corpus_text, make_split

    train, _ = make_split(n_texts, 0, seed)
    texts = list(SYSTEM_PROMPTS) + list(corpus_text(train))
    return train_tokenizer(texts, vocab_size=vocab_size)


def save_tokenizer(tokenizer, path: str | Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    return path


def load_tokenizer(path: str | Path):
    """Load a saved tokenizer offline (no hub lookup)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tok.chat_template is None:  # older saves kept the template only in tokenizer_config.json
        tok.chat_template = CHAT_TEMPLATE
    return tok
