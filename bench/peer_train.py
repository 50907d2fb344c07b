"""Training against SpecForge 0.2: the same data, batches, steps, schedule and starting weights; held-out
acceptance of both drafters under z-lab's decoding, and step time.

Optional peer benchmark (SpecForge from its unpacked wheel, as ``bench/peer_step.py`` explains; without it
this prints how to get it and exits 0). One process, one thread of work, so both trainers see the same
machine:

* the embedded DFlash recipe (``pipelines/dflash1.yaml``, overrides with ``--set``) is planned and fed by its own
  stage objects (source, bucketer, interleaver, padder, target forward), batch by batch;
* every batch's target features go to **ours** (the ``DrafterStep`` stage object: ``DrafterTrainer`` with
  our defaults) and to **SpecForge's** ``OnlineDFlashModel`` (sdpa, its own anchor sampling from the global
  RNG seeded once, its default chunking) on a copy of our drafter's starting weights, updated by the
  same optimizer and schedule (``model.optim.build_optimizer``: AdamW, clipping, warmup + cosine with the
  recipe's settings); the two steps alternate in order from batch to batch;
* both trained drafters are loaded into z-lab's ``DFlashDraftModel`` and decode the held-out prompts with
  ``dflash_generate`` (greedy, and at T = 1 with the same seeds); acceptance length = generated tokens per
  draft-and-verify step, over all prompts. Greedy outputs are checked against the target's own.

What differs between the two is only the training step (model code, loss, anchor draws), which is what
the comparison is for. Writes ``bench/results/peer_train.json``.

Usage: python bench/peer_train.py [--set KEY=VALUE ...] [--prompts 16] [--max-new-tokens 64]
       (e.g. ``--set stages.bucketer.epochs=1`` for a short check)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import common
import peer_step
from e2e_bench import stage_objects

EVAL_PROMPTS = common.ROOT / "dflash_flow" / "embedded" / "assets" / "dataset" / "eval.jsonl"
STAGES = ("source", "bucketer", "interleaver", "padder", "target", "drafter")


class SpecForgeTrainer:
    """SpecForge's training step on our optimizer and schedule."""

    def __init__(self, classes, drafter, head, trainer_config, *, gamma: float, mask_id: int, total_steps: int,
                 seed: int):
        import torch

        from dflash_flow.model.optim import build_optimizer

        online_cls, draft_cls = classes
        self.model = draft_cls(drafter.config)
        self.model.load_state_dict(drafter.state_dict())
        self.model.train()
        c = trainer_config
        self.online = online_cls(
            self.model, head.lm_head, head.embed_tokens, mask_id, block_size=drafter.block_size,
            attention_backend="sdpa", num_anchors=c.num_anchors, loss_decay_gamma=gamma,
        )
        self.optimizer, self.schedule = build_optimizer(
            self.model, total_steps=total_steps, lr=c.lr, weight_decay=c.weight_decay,
            max_grad_norm=c.max_grad_norm, warmup_ratio=c.warmup_ratio, min_lr_ratio=c.min_lr_ratio,
        )
        torch.manual_seed(seed)  # SpecForge draws anchors from the global generator

    def train_batch(self, feats) -> float:
        loss_mask = (feats.loss_mask * feats.attention_mask).float()  # SpecForge takes no attention mask
        loss, _acc, _metrics = self.online(feats.input_ids, feats.hidden_states.float(), loss_mask)
        loss.backward()
        self.optimizer.step()
        self.schedule.step()
        return loss.item()


def zlab_acceptance(target, state: dict, config, prompts, *, max_new_tokens: int, stops, temperature: float,
                    greedy_refs: list | None = None) -> dict[str, float]:
    import torch
    from dflash.model import DFlashDraftModel, dflash_generate

    drafter = DFlashDraftModel(config).eval()
    drafter.load_state_dict(state, strict=True)
    produced = steps = 0
    same = 0
    calls = [0]
    # z-lab's statistics need CUDA (return_stats synchronizes it): count the draft-and-verify steps as the
    # drafter's forward calls (one per step) and the tokens they committed as the new tokens after the
    # prefill's first one.
    hook = drafter.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    with torch.no_grad():
        for i, ids in enumerate(prompts):
            torch.manual_seed(1000 + i)  # the same seed per prompt for both drafters
            calls[0] = 0
            got = dflash_generate(
                drafter, target, torch.tensor([ids]), max_new_tokens=max_new_tokens, stop_token_ids=stops,
                temperature=temperature,
            )[0]
            produced += len(got) - len(ids) - 1
            steps += calls[0]
            if greedy_refs is not None:
                want = greedy_refs[i]
                n = min(len(got), len(want))  # the two loops may stop at a stop token differently
                same += int(torch.equal(got[:n], want[:n]))
    hook.remove()
    out = {"tau": round(produced / max(steps, 1), 4), "draft_steps": steps}
    if greedy_refs is not None:
        out["lossless"] = same / len(prompts)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", action="append", default=[], help="pipeline override KEY=VALUE")
    parser.add_argument("--specforge", help="unpacked SpecForge 0.2.0 wheel")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(common.RESULTS / "peer_train.json"))
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from dflash_flow.data.chat import stop_token_ids
    from dflash_flow.embedded import embedded_target_path
    from dflash_flow.model.evaluation import read_prompt_ids
    from dflash_flow.model.generation import greedy_generate
    from dflash_flow.model.target import load_target

    classes, reason = peer_step.import_specforge(args.specforge, fetch=True)
    if classes is None:
        print(f"peer_train: SpecForge is not available: {reason}", file=sys.stderr)
        raise SystemExit(2)
    torch.set_num_threads(args.threads)
    out_dir = common.SCRATCH / "peer_train"
    v = common.embedded_validated(out_dir, "stages.drafter.record_batches=false", *args.set,
                                 pipeline=common.DFLASH1_YAML)
    stages = stage_objects(v, out_dir, STAGES)
    torch.set_num_threads(args.threads)
    source, bucketer, interleaver, padder, target_stage, ours = (stages[n] for n in STAGES)
    trainer = ours._run.trainer
    start_state = {k: t.detach().clone() for k, t in trainer.drafter.state_dict().items()}
    theirs: SpecForgeTrainer | None = None
    times: dict[str, list[float]] = {"ours": [], "specforge": []}
    losses: dict[str, list[float]] = {"ours": [], "specforge": []}
    batches = 0
    t_start = time.perf_counter()
    try:
        for sample in source.produce():
            bucketer.process(sample)
        for epoch in bucketer.finish():
            for planned in interleaver.process(epoch):
                (padded,) = padder.process(planned)
                (feats,) = target_stage.process(padded)
                if theirs is None:
                    trainer.plan(feats.meta.total_batches)
                    theirs = SpecForgeTrainer(
                        classes, _copy_of(trainer.drafter, start_state), trainer.head, trainer.config,
                        gamma=trainer.gamma, mask_id=trainer.drafter.mask_token_id,
                        total_steps=trainer.total_steps, seed=v.graph.seed,
                    )
                order = ("ours", "specforge") if batches % 2 == 0 else ("specforge", "ours")
                for name in order:
                    t0 = time.perf_counter()
                    if name == "ours":
                        reports = ours.process(feats)
                        if reports:
                            losses["ours"].append(reports[0].metrics.get("loss", float("nan")))
                    else:
                        losses["specforge"].append(theirs.train_batch(feats))
                    times[name].append(time.perf_counter() - t0)
                batches += 1
    finally:
        for name in ("source", "bucketer", "interleaver", "padder", "target"):
            stages[name].teardown()
    train_s = time.perf_counter() - t_start

    spec = embedded_target_path()
    tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    target = load_target(spec, dtype=torch.float32)
    prompts = read_prompt_ids(EVAL_PROMPTS, tokenizer, args.prompts)
    stops = stop_token_ids(tokenizer)
    refs = [greedy_generate(target, torch.tensor([p]), max_new_tokens=args.max_new_tokens, stop_token_ids=stops).output_ids[0]
            for p in prompts]
    config = trainer.drafter.config
    trained = {"ours": trainer.drafter.state_dict(), "specforge": theirs.model.state_dict()}
    evals = {}
    for name, state in trained.items():
        evals[name] = {
            "greedy": zlab_acceptance(target, state, config, prompts, max_new_tokens=args.max_new_tokens,
                                      stops=stops, temperature=0.0, greedy_refs=refs),
            "t1": zlab_acceptance(target, state, config, prompts, max_new_tokens=args.max_new_tokens,
                                  stops=stops, temperature=1.0),
        }
    med = {n: statistics.median(t[1:]) if len(t) > 1 else t[0] for n, t in times.items()}
    tail = max(1, len(losses["specforge"]) // 10)
    result = {
        "bench": "peer_train",
        "machine": common.machine(),
        "overrides": args.set,
        "batches": batches,
        "optimizer_steps": trainer.step,
        "train_wall_s": round(train_s, 1),
        "median_step_ms": {n: round(1000 * m, 1) for n, m in med.items()},
        "ours_over_specforge_step": round(med["ours"] / med["specforge"], 3),
        "mean_loss_last_10pct": {n: round(statistics.fmean(x[-tail:]), 4) for n, x in losses.items() if x},
        "heldout_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "zlab_decoding": evals,
        "ours_minus_specforge_tau_greedy": round(evals["ours"]["greedy"]["tau"] - evals["specforge"]["greedy"]["tau"], 4),
        "ours_minus_specforge_tau_t1": round(evals["ours"]["t1"]["tau"] - evals["specforge"]["t1"]["tau"], 4),
    }
    return common.write_result(Path(args.out), result)


def _copy_of(drafter, state):
    twin = copy.deepcopy(drafter)
    twin.load_state_dict(state)
    return twin


if __name__ == "__main__":
    main()
