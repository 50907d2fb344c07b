"""Speculative-decoding evaluation of an exported drafter against its target, beside an untrained
drafter of the same shape (the baseline that says how much training bought)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_prompt_ids(path: str | Path, tokenizer, limit: int) -> list[list[int]]:
    """Prompts from JSONL (``prompt`` or ``conversations`` up to the last user turn), chat-templated."""
    from dflash_flow.data.chat import prompt_turns

    out: list[list[int]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                turns = prompt_turns(record)
            except (json.JSONDecodeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from None
            ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            out.append([int(i) for i in ids])
            if len(out) >= limit:
                break
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def evaluate_exported(
    *,
    target: Any,
    drafter_path: str | Path,
    prompts_path: str | Path,
    tokenizer_path: str | None = None,
    limit: int = 32,
    max_new_tokens: int = 64,
    baseline: bool = True,
    seed: int = 0,
    device: str = "cpu",
) -> dict[str, dict[str, float]]:
    """``{"trained": metrics, "untrained": metrics}`` (see ``speculative.evaluate_drafter``). ``target`` is
    a model spec as ``model.target.load_target`` takes it (a directory, preset or hub id)."""
    import torch
    from transformers import AutoTokenizer

    from dflash_flow.data.chat import stop_token_ids
    from dflash_flow.model.drafter import DFlashDrafter
    from dflash_flow.model.export import load_drafter
    from dflash_flow.model.speculative import evaluate_drafter
    from dflash_flow.model.target import load_target

    spec = target
    tok_path = tokenizer_path or (spec if isinstance(spec, str) and Path(spec).is_dir() else None)
    if tok_path is None:
        raise ValueError("evaluation needs a tokenizer: pass tokenizer (the target is not a directory)")
    tokenizer = AutoTokenizer.from_pretrained(tok_path, local_files_only=True)
    model = load_target(spec, device=device, dtype=torch.float32)
    drafter = load_drafter(drafter_path, device=device, dtype=torch.float32, target_config=model.config)
    prompts = read_prompt_ids(prompts_path, tokenizer, limit)
    stops = stop_token_ids(tokenizer)
    results = {"trained": evaluate_drafter(model, drafter, prompts, max_new_tokens=max_new_tokens, stop_token_ids=stops)}
    if baseline:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            fresh = DFlashDrafter(drafter.config).to(device=device, dtype=torch.float32)
        results["untrained"] = evaluate_drafter(model, fresh, prompts, max_new_tokens=max_new_tokens, stop_token_ids=stops)
    return results
