"""The vLLM half of the interop check; runs in the vLLM environment (``interop/check.py`` starts it), never
in ours: it imports vLLM and safetensors, nothing of dflash_flow.

    python interop/vllm_side.py JOB.json OUT.json

``JOB.json``: ``mode`` (``plain``, ``dflash`` or ``dflash2_load``), ``target``, ``drafter``,
``num_speculative_tokens``, ``prompts`` (token ids), ``max_tokens``, ``stop_token_ids``, ``max_model_len``.

* ``plain``: greedy outputs without speculation.
* ``dflash``: vLLM's DFlash speculative decoding (``DFlashQwen3ForCausalLM``), one request at a time so
  each request's drafts are known: outputs, drafts per step, vLLM's spec-decode counters; twice, as vLLM
  ships and with ``DFlashQwen3Model._normalize_context_k`` made per-layer in this process only (the
  installed vLLM is never edited). Also every drafter parameter against the export.
* ``dflash2_load``: a DFlash 2 export through ``DFlash2Qwen3ForCausalLM``'s weight loader, every parameter
  against the export. vLLM's V1 (CPU) runner refuses DFlash 2 drafts at config time; that refusal is
  lifted here so the engine builds and loads the weights, and nothing is decoded.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: hooks apply
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the models are tiny


def per_layer_normalize_context_k(self, all_k):
    """``_normalize_context_k`` with each layer's ``k_norm`` applied to that layer's keys (the grouped CPU
    kernel applies layer 0's to all): the one-kernel-per-layer form of what the model means."""
    import torch
    from vllm import _custom_ops as ops

    out = torch.empty_like(all_k)
    for layer in range(all_k.shape[0]):
        ops.rms_norm(out[layer], all_k[layer].contiguous(), self._k_norm_weights[layer].contiguous(),
                     self._rms_norm_eps)
    return out


SHARED = ("embed_tokens.weight", "lm_head.weight")  # the target's, shared with the drafter after loading
FUSED = {"self_attn.qkv_proj.weight": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj.weight": ("gate_proj", "up_proj")}


def sources(name, export, target):
    """``(source names, value)`` vLLM's parameter ``name`` must hold: the export's tensors (fused ones
    concatenated), or for the embedding and LM head the target's; ``((), None)`` when nothing maps onto it."""
    import torch

    bare = name[len("model."):] if name.startswith("model.") else name
    for suffix, parts in FUSED.items():
        if bare.endswith(suffix):
            head = bare[: -len(suffix)] + suffix.split(".")[0]
            names = [f"{head}.{p}.weight" for p in parts]
            return (names, torch.cat([export[n] for n in names])) if all(n in export for n in names) else ((), None)
    if bare in SHARED:
        for n in (f"model.{bare}", bare, "model.embed_tokens.weight"):  # tied: the embedding
            if n in target:
                return (), target[n]
        return (), None
    for n in (bare, bare.removesuffix(".weight"), bare + ".weight"):
        if n in export:
            return [n], export[n]
    return (), None


def match_parameters(loaded, final, drafter_dir, target_dir):
    """Every parameter of the vLLM drafter against the export. ``loaded``: the parameters as the weight
    loader left them (vLLM's CPU backend repacks linear weights afterwards); ``final``: the model once
    built, whose embedding and LM head are then the target's. Reports the parameters equal, different,
    with no source, and the export tensors no parameter took."""
    import torch
    from safetensors.torch import load_file

    export = load_file(os.path.join(drafter_dir, "model.safetensors"))
    target = load_file(os.path.join(target_dir, "model.safetensors"))
    separate_mask = bool(getattr(final.model, "has_separate_mask_embedding", False))
    equal, different, unmapped, unused_by_design, used = [], [], [], [], set()
    for name, value in loaded.items():
        if name.split(".")[-2:] == ["model", "mask_embedding"] or name == "model.mask_embedding":
            if not separate_mask:  # vLLM's optional mask_embedding.pt override, absent: never read
                unused_by_design.append(name)
                continue
        names, want = sources(name, export, target)
        if name.removeprefix("model.") in SHARED:
            value = final.get_parameter(name).detach()
        used.update(names)
        if want is None:
            unmapped.append(name)
        elif tuple(want.shape) == tuple(value.shape) and torch.equal(value.cpu().float(), want.float()):
            equal.append(name)
        else:
            different.append(name)
    return {"architecture": type(final).__name__, "parameters": len(loaded) - len(unused_by_design),
            "equal": len(equal), "different": different, "unmapped": unmapped,
            "export_tensors": len(export), "export_unused": sorted(set(export) - used),
            "not_in_export_by_design": unused_by_design}


def spec_counters(llm):
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_"):
            key = m.name[len("vllm:spec_decode_"):]
            out[key] = list(m.values) if hasattr(m, "values") else m.value
    return out


def counter_delta(after, before):
    delta = {}
    for k, v in after.items():
        b = before.get(k, [0] * len(v) if isinstance(v, list) else 0)
        delta[k] = [x - y for x, y in zip(v, b, strict=False)] if isinstance(v, list) else v - b
    return delta


def main(job_path: str, out_path: str) -> int:
    with open(job_path) as f:
        job = json.load(f)
    mode = job["mode"]
    from vllm import LLM, SamplingParams
    from vllm.config import VllmConfig
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.models import qwen3_dflash
    from vllm.v1.spec_decode.dflash import DFlashProposer

    loaded = {}
    original_load = qwen3_dflash.DFlashQwen3ForCausalLM.load_weights

    def load_weights(self, weights):  # DFlash 2 inherits it: catches both drafters
        result = original_load(self, weights)
        loaded["model"] = self  # and the parameters before the CPU backend repacks them:
        loaded["state"] = {n: p.detach().clone() for n, p in self.named_parameters()}
        return result

    qwen3_dflash.DFlashQwen3ForCausalLM.load_weights = load_weights
    drafts: list[list[int]] = []
    original_propose = DFlashProposer.propose

    def propose(self, *args, **kwargs):
        out = original_propose(self, *args, **kwargs)
        drafts.append([int(t) for t in out[0].tolist()])  # one request at a time: row 0
        return out

    DFlashProposer.propose = propose
    if mode == "dflash2_load":
        VllmConfig._is_dflash_candidate_draft = lambda self: False  # load only: nothing is decoded

    spec = None
    if mode != "plain":
        spec = {"method": "dflash", "model": job["drafter"], "num_speculative_tokens": job["num_speculative_tokens"]}
    t0 = time.perf_counter()
    llm = LLM(model=job["target"], dtype="float32", enforce_eager=True, max_model_len=job["max_model_len"],
              speculative_config=spec, enable_prefix_caching=False, disable_log_stats=False, seed=0)
    result = {"mode": mode, "vllm": __import__("vllm").__version__, "startup_s": round(time.perf_counter() - t0, 1)}
    if mode != "plain":
        result["weights"] = match_parameters(loaded["state"], loaded["model"], job["drafter"], job["target"])
    if mode == "dflash2_load":
        return write(out_path, result)

    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], stop_token_ids=job["stop_token_ids"])
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]

    def outputs(batch):
        return [[int(t) for t in o.outputs[0].token_ids] for o in batch]

    if mode == "plain":
        t0 = time.perf_counter()
        result["outputs"] = outputs(llm.generate(prompts, params, use_tqdm=False))
        result["decode_s"] = round(time.perf_counter() - t0, 1)
        return write(out_path, result)

    passes = {}
    for name in ("as_shipped", "per_layer_knorm"):
        if name == "per_layer_knorm":
            qwen3_dflash.DFlashQwen3Model._normalize_context_k = per_layer_normalize_context_k
        before = spec_counters(llm)
        outs, steps = [], []
        t0 = time.perf_counter()
        for p in prompts:
            drafts.clear()
            outs += outputs(llm.generate([p], params, use_tqdm=False))
            steps.append(list(drafts))
        passes[name] = {"outputs": outs, "drafts": steps, "counters": counter_delta(spec_counters(llm), before),
                        "decode_s": round(time.perf_counter() - t0, 1)}
    result["passes"] = passes
    return write(out_path, result)


def write(path: str, result: dict) -> int:
    with open(path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python interop/vllm_side.py JOB.json OUT.json")
    sys.exit(main(sys.argv[1], sys.argv[2]))
