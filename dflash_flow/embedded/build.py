"""The default dataset: corpus prompts, answered by the shipped target (greedy), cached.

``build_default_dataset(out_dir, n_train, n_eval, seed)`` writes into ``out_dir``:

* ``train_prompts.jsonl`` / ``eval_prompts.jsonl``: the corpus prompts (no answers), held-out split
  disjoint from the training one and from the target's own training data;
* ``train.jsonl`` / ``eval.jsonl``: the same prompts with the target's regenerated greedy replies
  (the DFlash recipe: the drafter learns the target's own distribution, not the templates' answers);
* ``manifest.json``: the cache key and build figures.

The cache key hashes every input (sizes, seed, corpus version, target weights and tokenizer, decoding
settings), so a second call with the same inputs returns at once, and a build killed half-way resumes
where regeneration stopped.
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
    """Build (or return the cached) default dataset in ``out_dir``. See the module docstring.

    ``target_path=None`` uses the shipped target (``ensure_target(cache_dir)``). Note the batch size does
    not enter the cache key: greedy replies do not depend on it. ``progress`` is regeneration's callback
    (``embedded.regenerate.ProgressFn``), called for each split in turn; ``check_stop`` is regeneration's
    too (called between batches; it raises to stop, and the next call resumes the build).
    """
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

    # A partial build with the same key resumes (regenerate skips finished ids); any other content in
    # out_dir is from different inputs and is discarded -- when this build wrote it (its manifest or its
    # ".building" marker is there): files of the same names that something else wrote are never deleted.
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

    train, evals = make_split(n_train, n_eval, seed)
    _write_jsonl_atomic(paths["train_prompts"], [
        {"id": f"train-{i:06d}", "family": ex.family, "conversations": ex.conversations(with_answer=False)}
        for i, ex in enumerate(train)
    ])
    _write_jsonl_atomic(paths["eval_prompts"], [
        {"id": f"eval-{i:05d}", "family": ex.family, "conversations": ex.conversations(with_answer=False)}
        for i, ex in enumerate(evals)
    ])

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
    """The regenerated dataset shipped with the package, when it was built from exactly these inputs.

    Regenerating 1024 replies greedily takes minutes on two CPU cores; the shipped copy is what
    ``build_default_dataset`` would write (its manifest records the same cache key), so the first run on a
    fresh machine starts training at once. Any other size, seed or target builds (and caches) its own.
    """
    manifest = SHIPPED_DATASET / "manifest.json"
    if not manifest.is_file():
        return None
    key = dataset_key(n_train, n_eval, seed, Path(target_path), max_new_tokens)
    data = json.loads(manifest.read_text())
    if data.get("key") != key:
        return None
    return DefaultDataset(
        root=SHIPPED_DATASET,
        train_path=SHIPPED_DATASET / "train.jsonl",
        eval_path=SHIPPED_DATASET / "eval.jsonl",
        eval_prompts_path=SHIPPED_DATASET / "eval_prompts.jsonl",
        target_path=Path(target_path),
        key=key,
        manifest=data,
        cached=True,
    )


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
    """The held-out split of the embedded dataset (``eval.jsonl``: corpus prompts with the shipped
    target's greedy replies): the shipped copy, else the one ``EmbeddedChatSource`` builds and caches."""
    from dflash_flow.util import cache_root

    from .train_target import embedded_target_path

    target = embedded_target_path()
    ds = shipped_dataset(1024, 64, 0, target, 448)
    if ds is None:
        ds = build_default_dataset(cache_root() / "embedded-dataset", n_train=1024, n_eval=64, seed=0,
                                   target_path=target, max_new_tokens=448)
    return ds.eval_path
