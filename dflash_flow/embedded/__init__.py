"""The embedded CPU default: everything the DFlash recipe needs, built by the project itself.

* :mod:`.corpus`: deterministic templated chat prompts + reference answers, with a held-out split;
* :mod:`.tokenizer`: byte-level BPE trained on that corpus, ChatML chat template;
* :mod:`.train_target`: a small 8-layer Qwen3 target trained on the corpus (shipped under ``assets/target``);
* :mod:`.regenerate`: greedy regeneration of responses by a target (``dflash-flow regenerate``);
* :mod:`.build`: the default dataset (corpus prompts answered by the target), cached.

No module here imports torch or transformers at import time (the CLI's ``--help`` stays fast).
"""

from .build import (
    DefaultDataset,
    build_default_dataset,
    embedded_walk_data,
    shipped_dataset,
    write_eval_prompts,
)
from .corpus import ChatExample, iter_examples, make_split, split_of
from .regenerate import RegenStats, regenerate
from .tokenizer import (
    CHAT_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    PAD,
    build_default_tokenizer,
    load_tokenizer,
    train_tokenizer,
)
from .train_target import (
    ASSET_DIR,
    TargetRecipe,
    embedded_target_path,
    ensure_target,
    load_model_and_tokenizer,
    train_target,
)

__all__ = [
    "ASSET_DIR",
    "CHAT_TEMPLATE",
    "ENDOFTEXT",
    "IM_END",
    "IM_START",
    "PAD",
    "ChatExample",
    "DefaultDataset",
    "RegenStats",
    "TargetRecipe",
    "build_default_dataset",
    "build_default_tokenizer",
    "embedded_target_path",
    "embedded_walk_data",
    "ensure_target",
    "iter_examples",
    "load_model_and_tokenizer",
    "load_tokenizer",
    "make_split",
    "regenerate",
    "shipped_dataset",
    "split_of",
    "train_target",
    "train_tokenizer",
    "write_eval_prompts",
]
