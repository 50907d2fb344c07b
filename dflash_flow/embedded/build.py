"""The default dataset: corpus prompts, answered by the shipped target (greedy), cached.

``build_default_dataset`` writes ``train_prompts.jsonl`` / ``eval_prompts.jsonl`` (corpus prompts; the held-out
split disjoint from the training one and the target's data), ``train.jsonl`` / ``eval.jsonl`` (with the target's
greedy replies) and ``manifest.json``, keyed by a hash of every input: the same inputs return at once, and a build
killed half-way resumes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash_flow.util import atomic_write_text, config_hash, sha256_file

BUILD_VERSION = "1"


@dataclass
class DefaultDataset:
    root: Path
    train_path: Path  # regenerated conversations (train split)
    eval_path: Path  # regenerated conversations (held-out split)
    eval_prompts_path: Path  # held-out prompts only, e.g. for acceptance-length measurement
    target_path: Path
    key: str
    manifest: dict = field(default_factory=dict)
    cached: bool = False  # True when nothing had to be built


SHIPPED_DATASET = Path(__file__).resolve().parent / "assets" / "dataset"


def _write_jsonl_atomic(path: Path, records: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def dataset_key(n_train: int, n_eval: int, seed: int, target_path: Path, max_new_tokens: int) -> str:
    from .corpus import CORPUS_VERSION

    return config_hash({
        "build": BUILD_VERSION, "corpus": CORPUS_VERSION, "n_train": n_train, "n_eval": n_eval, "seed": seed,
        "max_new_tokens": max_new_tokens,
        "weights": sha256_file(target_path / "model.safetensors"),
        "tokenizer": sha256_file(target_path / "tokenizer.json"),
        "template": (target_path / "chat_template.jinja").read_text()
        if (target_path / "chat_template.jinja").exists() else "",
    }, compact=False)


def _our_manifest(path: Path) -> dict | None:
    """The manifest a build wrote (a JSON object with its "key" and "files"), else None."""
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and isinstance(m.get("key"), str) and isinstance(m.get("files"), dict) else None


def build_default_dataset(out_dir: str | Path, n_train: int = 1024, n_eval: int = 64, seed: int = 0, *,
                          target_path: str | Path | None = None, cache_dir: str | Path | None = None,
                          batch_size: int = 32, max_new_tokens: int = 448, progress=None,
                          num_threads: int | None = None, log=print, check_stop=None) -> DefaultDataset:
    """Build (or return the cached) default dataset in ``out_dir`` (see the module docstring).
    ``target_path=None``: the shipped target. The batch size is not in the key (greedy replies do not depend
    on it). ``progress`` and ``check_stop`` are regeneration's, for each split in turn."""
    from .corpus import make_split
    from .regenerate import regenerate
    from .train_target import ensure_target, load_model_and_tokenizer

    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = Path(target_path) if target_path is not None else ensure_target(cache_dir, log=log)
    key = dataset_key(n_train, n_eval, seed, target, max_new_tokens)
    paths = {
        "train_prompts": out / "train_prompts.jsonl", "eval_prompts": out / "eval_prompts.jsonl",
        "train": out / "train.jsonl", "eval": out / "eval.jsonl",
    }
    manifest_path = out / "manifest.json"
    result = DefaultDataset(root=out, train_path=paths["train"], eval_path=paths["eval"],
                            eval_prompts_path=paths["eval_prompts"], target_path=target, key=key)

    manifest = _our_manifest(manifest_path)
    if manifest is not None and manifest.get("key") == key and all(p.exists() for p in paths.values()):
        result.manifest, result.cached = manifest, True
        return result

    # A partial build with the same key resumes; other content this build wrote (its manifest or ".building"
    # marker is there) is discarded; files of the same names that something else wrote are never deleted.
    building = out / ".building"
    if manifest is None and not building.exists():
        foreign = [p.name for p in list(paths.values()) + [manifest_path] if p.exists()]
        if foreign:
            raise ValueError(f"{out} holds {', '.join(foreign)}, which the embedded dataset build did not write "
                             "(no manifest.json of its own, no .building marker); building there would delete "
                             "them: choose a new or empty dataset_dir")
    if not (building.exists() and building.read_text().strip() == key):
        for p in list(paths.values()) + [manifest_path]:
            p.unlink(missing_ok=True)
        building.write_text(key + "\n")

    for split, examples, width in zip(("train", "eval"), make_split(n_train, n_eval, seed), (6, 5), strict=True):
        _write_jsonl_atomic(paths[f"{split}_prompts"], [
            {"id": f"{split}-{i:0{width}d}", "family": ex.family, "conversations": ex.conversations(with_answer=False)}
            for i, ex in enumerate(examples)])

    model, tokenizer = load_model_and_tokenizer(target)
    figures = {}
    for split in ("eval", "train"):  # eval first: small, and a quick sanity check of the target
        log(f"[dataset] regenerating {split} split with the target ({target.name}) ...")
        s = regenerate(paths[f"{split}_prompts"], target, paths[split], batch_size=batch_size,
                       max_new_tokens=max_new_tokens, resume=True, progress=progress, num_threads=num_threads,
                       model=model, tokenizer=tokenizer, check_stop=check_stop)
        figures[split] = {"records": s.total, "generated_now": s.generated, "new_tokens_now": s.new_tokens,
                          "truncated_now": s.truncated, "empty_now": s.empty, "seconds": round(s.seconds, 1),
                          "tokens_per_s": round(s.tokens_per_s, 1)}
    manifest = {"key": key, "n_train": n_train, "n_eval": n_eval, "seed": seed, "max_new_tokens": max_new_tokens,
                "target": str(target), "build_seconds": round(time.perf_counter() - t0, 1), "regeneration": figures,
                "files": {k: p.name for k, p in paths.items()}}
    atomic_write_text(manifest_path, json.dumps(manifest, indent=2) + "\n")
    building.unlink(missing_ok=True)
    result.manifest = manifest
    return result


def shipped_dataset(n_train: int, n_eval: int, seed: int, target_path: str | Path, max_new_tokens: int):
    """The regenerated dataset shipped with the package (what ``build_default_dataset`` would write), when it
    was built from exactly these inputs (the same key), else None."""
    manifest = SHIPPED_DATASET / "manifest.json"
    if not manifest.is_file():
        return None
    key = dataset_key(n_train, n_eval, seed, Path(target_path), max_new_tokens)
    data = json.loads(manifest.read_text())
    if data.get("key") != key:
        return None
    return DefaultDataset(SHIPPED_DATASET, SHIPPED_DATASET / "train.jsonl", SHIPPED_DATASET / "eval.jsonl",
                          SHIPPED_DATASET / "eval_prompts.jsonl", Path(target_path), key, data, cached=True)


def write_eval_prompts(path: str | Path, limit: int, seed: int = 0) -> Path:
    """Held-out prompts of the built-in corpus (disjoint from every training prompt)."""
    from .corpus import make_split

    _, evals = make_split(0, limit, seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_jsonl_atomic(path, [
        {"id": f"eval-{i:05d}", "conversations": ex.conversations(with_answer=False)} for i, ex in enumerate(evals)
    ])
    return path


def embedded_walk_data() -> Path:
    """The embedded dataset's held-out ``eval.jsonl``: the shipped copy, else the one built and cached."""
    from dflash_flow.util import cache_root

    from .train_target import embedded_target_path

    target = embedded_target_path()
    ds = shipped_dataset(1024, 64, 0, target, 448)
    if ds is None:
        ds = build_default_dataset(cache_root() / "embedded-dataset", n_train=1024, n_eval=64, seed=0,
                                   target_path=target, max_new_tokens=448)
    return ds.eval_path
