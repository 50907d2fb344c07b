"""The embedded CPU default, built by the project itself: a chat corpus, a small Qwen3 target trained on it
(shipped) and regeneration by a target into the default dataset; torch is imported lazily."""

from .regenerate import (
    build_default_dataset,
    embedded_walk_data,
    regenerate,
    shipped_dataset,
    write_eval_prompts,
)
from .train_target import embedded_target_path, load_tokenizer, train_target

__all__ = ["build_default_dataset", "embedded_target_path", "embedded_walk_data", "load_tokenizer", "regenerate",
           "shipped_dataset", "train_target", "write_eval_prompts"]
