"""The embedded CPU default: everything the DFlash recipe needs, built by the project itself.

* :mod:`.corpus`: deterministic templated chat prompts + reference answers, with a held-out split;
* :mod:`.tokenizer`: byte-level BPE trained on that corpus, ChatML chat template;
* :mod:`.train_target`: a small 8-layer Qwen3 target trained on the corpus (shipped under ``assets/target``);
* :mod:`.regenerate`: greedy regeneration of responses by a target (``dflash-flow regenerate``);
* :mod:`.build`: the default dataset (corpus prompts answered by the target), cached.

No module here imports torch or transformers at import time (the CLI's ``--help`` stays fast).
"""

from .build import build_default_dataset, embedded_walk_data, shipped_dataset, write_eval_prompts
from .regenerate import regenerate
from .tokenizer import load_tokenizer
from .train_target import embedded_target_path, train_target

__all__ = ["build_default_dataset", "embedded_target_path", "embedded_walk_data", "load_tokenizer", "regenerate",
           "shipped_dataset", "train_target", "write_eval_prompts"]
