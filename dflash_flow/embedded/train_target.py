"""Train the embedded target: an 8-layer Qwen3 causal LM and byte-level BPE tokenizer on the project's own
chat corpus, shipped (``python -m dflash_flow.embedded.train_target --out dflash_flow/embedded/assets/target``
remakes it); ``ensure_target`` trains the same recipe into a cache when the asset is missing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_flow.util import cache_root, config_hash

ASSET_DIR = Path(__file__).resolve().parent / "assets" / "target"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

# The tokenizer: byte-level BPE (every string round-trips) with digits split one by one (a tiny target learns
# digit-wise arithmetic far better than multi-digit tokens) and Qwen's ChatML template; as in Qwen3, ``eos_token``
# is ``<|im_end|>``, ``<|endoftext|>`` a document separator (also a stop token), and padding has its own token.
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
    """A byte-level BPE trained on ``texts`` as ``PreTrainedTokenizerFast`` with our special tokens and chat
    template (deterministic: ties break by byte order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    # All 256 bytes are in the base vocabulary: any input string is encodable.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer)
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


@dataclass(frozen=True)
class TargetRecipe:
    """Everything that determines the trained weights (hashed for the build cache)."""

    # Model: hidden 128 = 4 query heads x head_dim 32; 2 KV heads (grouped-query, as in Qwen3).
    hidden_size: int = 128
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    max_position_embeddings: int = 1024
    vocab_size: int = 768  # tokenizer BPE size; the model is sized from len(tokenizer)
    # Data
    n_train: int = 8000
    n_eval: int = 200
    corpus_seed: int = 0
    seq_len: int = 512
    # Optimisation
    steps: int = 1000
    batch_size: int = 8
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 30
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 1234

    def key(self) -> str:
        from .corpus import CORPUS_VERSION

        return config_hash({"recipe": asdict(self), "corpus": CORPUS_VERSION}, compact=False)


def _pack(conversations_ids: list[list[int]], seq_len: int) -> list[list[int]]:
    """Whole conversations packed greedily into windows of ``seq_len``, each starting at a conversation start."""
    windows: list[list[int]] = []
    current: list[int] = []
    for ids in conversations_ids:
        ids = ids[:seq_len]
        if len(current) + len(ids) > seq_len:
            windows.append(current)
            current = []
        current = current + ids
    if current:
        windows.append(current)
    return windows


def _render_ids(tokenizer, examples) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template(ex.conversations(), tokenize=False) for ex in examples]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def answer_loss(model, tokenizer, examples, batch_size: int = 16) -> float:
    """Mean cross-entropy (nats/token) on the assistant tokens of ``examples`` (prompt tokens unscored)."""
    import torch

    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(examples), batch_size):
            chunk = examples[i : i + batch_size]
            prompts = [tokenizer.apply_chat_template(ex.conversations(with_answer=False), tokenize=False,
                                                     add_generation_prompt=True) for ex in chunk]
            p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
            f_ids = _render_ids(tokenizer, chunk)
            width = max(len(f) for f in f_ids)
            ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
            labels = torch.full((len(chunk), width), -100, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for r, (p, f) in enumerate(zip(p_ids, f_ids, strict=True)):
                ids[r, : len(f)] = torch.tensor(f)
                mask[r, : len(f)] = 1
                labels[r, len(p) : len(f)] = torch.tensor(f[len(p) :])
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            tgt = labels[:, 1:]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1),
                                                     ignore_index=-100, reduction="sum")
            total += float(loss)
            count += int((tgt != -100).sum())
    return total / max(count, 1)


def train_target(out_dir: str | Path, recipe: TargetRecipe = TargetRecipe(), *, num_threads: int = 1,
                 log_every: int = 25, log=print) -> dict:
    """Train the target with ``recipe`` into ``out_dir``; the training summary (also ``training_info.json``).
    Bit-identical weights for the same recipe, thread count and torch build."""
    import torch

    t_start = time.perf_counter()
    prev_threads, prev_det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    # Same thread count + deterministic kernels -> bit-identical weights run to run.
    torch.set_num_threads(num_threads)
    torch.use_deterministic_algorithms(True)
    try:
        return _train(out_dir, recipe, num_threads, log_every, log, t_start)
    finally:
        torch.set_num_threads(prev_threads)
        torch.use_deterministic_algorithms(prev_det)


def _train(out_dir, recipe: TargetRecipe, num_threads: int, log_every: int, log, t_start: float) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    from dflash_flow.data.chat import stop_token_ids

    from .corpus import make_split

    torch.manual_seed(recipe.seed)
    random.seed(recipe.seed)

    tokenizer = build_default_tokenizer(vocab_size=recipe.vocab_size, seed=recipe.corpus_seed)
    train, evals = make_split(recipe.n_train, recipe.n_eval, recipe.corpus_seed)
    windows = _pack(_render_ids(tokenizer, train), recipe.seq_len)
    n_tokens = sum(len(w) for w in windows)
    log(f"[target] {len(train)} conversations -> {len(windows)} windows of <= {recipe.seq_len} "
        f"({n_tokens} tokens, fill {n_tokens / (len(windows) * recipe.seq_len):.0%})")

    model = AutoModelForCausalLM.from_config(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers, num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads, head_dim=recipe.head_dim,
        max_position_embeddings=recipe.max_position_embeddings, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=stop_token_ids(tokenizer), pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa", dtype="float32"))
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[target] Qwen3 {recipe.num_layers} layers, hidden {recipe.hidden_size}: {n_params / 1e6:.2f} M params")

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95), eps=1e-8)
    rng = np.random.default_rng(recipe.seed)
    order: list[int] = []
    pad = tokenizer.pad_token_id
    losses: list[float] = []
    for step in range(recipe.steps):
        ids = _next_batch(windows, order, rng, recipe.batch_size, pad)
        # Windows are right-padded; padded positions are never scored and never attended to by real tokens.
        attn = (ids != pad).long()
        labels = ids.masked_fill(ids == pad, -100)
        for g in opt.param_groups:
            g["lr"] = _lr_at(recipe, step)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
        if log_every and (step % log_every == 0 or step == recipe.steps - 1):
            log(f"[target] step {step:4d}/{recipe.steps} loss {losses[-1]:.4f} lr {_lr_at(recipe, step):.2e} "
                f"({time.perf_counter() - t_start:.0f}s)")
    train_s = time.perf_counter() - t_start

    eval_loss = answer_loss(model, tokenizer, evals)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=stop_token_ids(tokenizer),
                                               pad_token_id=pad, max_new_tokens=512)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    save_tokenizer(tokenizer, out_dir)
    info = {"recipe": asdict(recipe), "recipe_key": recipe.key(), "params": n_params,
            "train_tokens_per_epoch": n_tokens, "final_train_loss": float(np.mean(losses[-20:])),
            "heldout_answer_loss": eval_loss, "heldout_answer_ppl": math.exp(eval_loss),
            "train_seconds": round(train_s, 1), "num_threads": num_threads, "torch": torch.__version__}
    (out_dir / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"[target] done in {train_s:.0f}s: train loss {info['final_train_loss']:.4f}, "
        f"held-out answer loss {eval_loss:.4f} (ppl {math.exp(eval_loss):.2f})")
    return info


def _lr_at(recipe: TargetRecipe, step: int) -> float:
    """Linear warmup, then cosine down to ``min_lr_ratio`` of the peak."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    frac = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def _next_batch(windows: list[list[int]], order: list[int], rng, batch_size: int, pad: int):
    """The next ``batch_size`` windows, right-padded ``[b, width]`` (``order`` refilled by a seeded reshuffle)."""
    import torch

    while len(order) < batch_size:
        order.extend(rng.permutation(len(windows)).tolist())
    batch = [windows[i] for i in order[:batch_size]]
    del order[:batch_size]
    ids = torch.full((len(batch), max(len(w) for w in batch)), pad, dtype=torch.long)
    for r, w in enumerate(batch):
        ids[r, : len(w)] = torch.tensor(w)
    return ids


def is_complete(path: str | Path) -> bool:
    path = Path(path)
    return all((path / f).is_file() for f in _REQUIRED_FILES)


def ensure_target(cache_dir: str | Path | None = None, recipe: TargetRecipe | None = None, *,
                  log=print) -> Path:
    """Path of a ready target: the shipped asset if complete (and trained with an explicit ``recipe``), else
    ``cache_dir/target-<recipe key>``, trained on first use and renamed into place."""
    if is_complete(ASSET_DIR):
        try:
            key = json.loads((ASSET_DIR / "training_info.json").read_text()).get("recipe_key")
        except (OSError, ValueError):
            key = None
        if recipe is None or key == recipe.key():
            return ASSET_DIR
    recipe = recipe or TargetRecipe()
    cache_dir = cache_root() / "embedded-target" if cache_dir is None else cache_dir
    final = Path(cache_dir) / f"target-{recipe.key()}"
    if is_complete(final):
        return final
    tmp = Path(cache_dir) / f".target-{recipe.key()}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"[target] no shipped target; training one into {final} (~15-30 min on 2 CPU cores, once)")
    train_target(tmp, recipe, log=log)
    if is_complete(final):  # a concurrent build won the race: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    return final


def embedded_target_path() -> str:
    """The shipped target's directory (built into the cache on first use when the asset is missing)."""
    return str(ensure_target(log=lambda *_: None))


def load_model_and_tokenizer(path: str | Path, device: str = "cpu"):
    """(model, tokenizer) of a target directory, offline, float32, in eval mode."""
    import torch

    from dflash_flow.model.target import load_target as load_model

    return load_model(path, device=device, dtype=torch.float32), load_tokenizer(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ASSET_DIR), help="output directory (default: the shipped asset)")
    p.add_argument("--steps", type=int, default=TargetRecipe.steps)
    # The thread count changes float reduction order, hence the bits: the shipped asset used 1 thread
    # (which is also the fastest setting on a busy 2-core machine).
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    recipe = TargetRecipe(steps=args.steps)
    out = Path(args.out)
    # Train next to the destination, then swap, so a failed run keeps the previous asset.
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    train_target(tmp, recipe, num_threads=args.threads, log=lambda m: print(m, file=sys.stderr, flush=True))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
