"""The generation loops: speculative decoding with a DFlash drafter (greedy and sampled), plain greedy.

This follows the DFlash inference contract (z-lab ``dflash_generate``), so that what we measure here is
what a served drafter will achieve:

1. Prefill the target on the prompt with hidden states; its choice (argmax, or a sample) is the first
   new token; the draft context is the features of the prompt tokens.
2. Loop: the block is ``[last token, MASK x (B-1)]`` at absolute positions ``start .. start+B-1``. The
   drafter sees its cached context K/V (positions < start) plus the features of the tokens committed
   last step, and the block; draft slot k predicts the token at position ``start + k``. The target
   verifies the block in one forward and commits a prefix of the drafts plus one token of its own (the
   bonus). The new context is the features of the committed tokens only; both KV caches are cropped
   back to the committed length.

Greedy (``temperature == 0``): the drafts are the drafter's argmax, the accepted prefix is the longest
one equal to the target's argmax, the bonus is the target's argmax after it. The output equals plain
greedy decoding token for token.

Sampled (``temperature > 0``, optional ``top_p`` / ``top_k``; :class:`Sampling`): the standard
speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023). With ``p`` the target's and ``q``
the drafter's distribution after the same temperature / top-k / top-p transform, the drafts are sampled
from ``q``; draft ``x`` is accepted with probability ``min(1, p(x) / q(x))``, in order, until the first
rejection; at a rejection the bonus is sampled from ``norm(max(0, p - q))``, after all drafts were
accepted from ``p`` at the next position. Every emitted token is then distributed exactly as a token
sampled from ``p`` by the target alone (the output is the target's own sampling distribution; the
drafter only changes how many target forwards it takes). Every random draw comes from one seeded
``torch.Generator``, in the order z-lab's ``dflash_generate`` makes them with the global generator:
prefill sample; per step the block's drafts (one multinomial over the B-1 slots), the B-1 uniforms of
the acceptance test, then one multinomial for the bonus (residual or next position). The same seed
therefore gives z-lab's output exactly (``tests/model/test_sampling.py``).

A DFlash 2 drafter (one with a ``candidate_selector``, ours or z-lab's ``DFlash2DraftModel``) proposes
its selector's walk instead (``BlockDrafter.propose``, z-lab's ``propose``): greedy, the best-scoring
path from the block's first token; sampled, one draw per slot in order from ``softmax(scores / T)``
over that slot's candidates (temperature only, no top-p / top-k, as z-lab), and that distribution
(zero outside the candidates) is the ``q`` the acceptance rule and the residual use. The target's
``p`` keeps top-p / top-k. The draws are z-lab's in number and order, so the same seed gives its output.

Batch size 1 only, as in the reference: every sequence accepts a different number of tokens per step,
so a batch would need ragged caches. Evaluation loops over prompts.

The drafter interface is z-lab's ``DFlashDraftModel`` (ours in ``drafter.py`` has the same):
``drafter(position_ids=, noise_embedding=, target_hidden=, attention_mask=None, past_key_values=,
use_cache=True)`` returns the block's final hidden states *already passed through* ``drafter.norm``;
logits are ``drafter.compute_logits(h, lm_head)`` (``lm_head(h)`` times ``output_multiplier``, with
optional soft-capping), or plain ``lm_head(h)`` for a drafter without ``compute_logits``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import nn

from .block_drafter import BlockDrafter, draft_settings, features
from .decoding import cache_kwarg, crop_cache, new_cache, target_device
from .sampling import Sampling, sample_from, sampling_probs, verify_sampled

__all__ = ["SlotDecoder", "SpecResult", "greedy_batched", "greedy_continuations", "greedy_generate", "spec_generate"]


@attrs.define(eq=False)
class SpecResult:
    """Result of one generation (speculative or greedy).

    ``output_ids`` is ``[1, prompt + new]`` (prompt included, as in z-lab's ``dflash_generate``).
    ``accept_lengths[i]`` is how many tokens verify step i committed, bonus included (1..B); the first new
    token comes from the prefill and is in no step. ``target_forwards`` counts the prefill too.
    """

    output_ids: Any
    accept_lengths: list[int]
    target_forwards: int
    drafter_forwards: int
    num_input_tokens: int = 0

    @property
    def new_ids(self) -> list[int]:
        return self.output_ids[0, self.num_input_tokens :].tolist()

    @property
    def num_new_tokens(self) -> int:
        return int(self.output_ids.shape[1]) - self.num_input_tokens

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0


def _as_batch_of_one(input_ids: Any, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(
            f"batch size 1 only (the DFlash inference contract); got input_ids of shape {tuple(ids.shape)}"
        )
    if ids.shape[1] == 0:
        raise ValueError("empty prompt")
    return ids.to(device)


def greedy_continuations(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int] | None = None,
    pad_id: int = 0,
) -> list[tuple[list[int], str]]:
    """Greedy continuations of token-id prompts, batched with left padding (transformers ``generate``).

    Returns, per prompt, the new ids (a stop token that ended the reply included, nothing after it) and
    ``"stop"`` or ``"length"``. With no ``stop_ids`` the reply runs to ``max_new_tokens``: ``generate``
    would otherwise stop at the model's own eos, so an id outside the vocabulary (which argmax never
    returns) stands in for "no stop token".
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if not prompts:
        return []
    stops = sorted({int(t) for t in stop_ids or ()})
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        if not len(p):
            raise ValueError("empty prompt")
        ids[r, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        attn[r, width - len(p) :] = 1
    device = target_device(model)
    vocab = int(model.get_input_embeddings().num_embeddings)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=attn.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stops or [vocab],
            pad_token_id=pad_id,
        )
    results = []
    stop_set = set(stops)
    for row in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stop_set), None)
        results.append((row, "length") if cut is None else (row[: cut + 1], "stop"))
    return results


def greedy_generate(
    target: nn.Module,
    input_ids: Any,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] | None = None,
) -> SpecResult:
    """Plain greedy decoding of one prompt: one target forward per new token (the prefill gives the
    first). The reference that speculative decoding must reproduce exactly, and the forward count the
    speedup is measured against. Stops after ``max_new_tokens`` or after emitting a stop token (kept)."""
    device = target_device(target)
    ids = _as_batch_of_one(input_ids, device)
    (tokens, _), = greedy_continuations(target, [ids[0].tolist()], max_new_tokens=max_new_tokens, stop_ids=stop_token_ids)
    output = torch.cat([ids, torch.tensor([tokens], device=device)], dim=1)
    return SpecResult(output, [1] * (len(tokens) - 1), len(tokens), 0, ids.shape[1])


@torch.inference_mode()
def spec_generate(
    target: nn.Module,
    drafter: nn.Module,
    input_ids: Any,
    *,
    max_new_tokens: int,
    block_size: int | None = None,
    mask_token_id: int | None = None,
    target_layer_ids: Sequence[int] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
    trace: list[tuple[int, list[int]]] | None = None,
    accepted_drafts: list[int] | None = None,
) -> SpecResult:
    """Speculative decoding of one prompt with a DFlash drafter (see the module docstring).

    ``block_size``, ``mask_token_id`` and ``target_layer_ids`` default to the drafter's own
    (``drafter.block_size`` / ``config.dflash_config``); pass them to override. Greedy by default: the
    output is then identical to :func:`greedy_generate` (lossless) whatever the drafter proposes. With
    ``sampling`` at a temperature > 0 every random draw comes from ``generator`` (a generator on the
    target's device; None: a fresh one seeded 0, so a call is reproducible by default). ``trace``, when
    given, gets one ``(start, drafts)`` per verify step: the position of the block's first token and the
    drafts the target verified (what an engine's drafts are compared against, step by step);
    ``accepted_drafts``, when given, gets each step's accepted drafts as a serving engine counts them
    (not cut at ``max_new_tokens`` or a stop token).
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    sampling = sampling if sampling is not None else Sampling()
    settings = draft_settings(
        drafter, block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=target_layer_ids
    )
    block_size = settings.block_size
    device = target_device(target)
    greedy = sampling.greedy
    if not greedy and generator is None:
        generator = torch.Generator(device=device).manual_seed(0)

    ids = _as_batch_of_one(input_ids, device)
    n_in = ids.shape[1]
    max_length = n_in + max_new_tokens  # final output is at most this long
    stops = torch.tensor(list(stop_token_ids or ()), dtype=torch.long, device=device)

    # One row holding prompt + everything generated; unfilled slots hold the mask token, which is
    # exactly what the block needs past its first slot.
    fill = settings.mask_token_id if settings.mask_token_id is not None else 0
    seq = torch.full((1, max_length + 1), fill, dtype=torch.long, device=device)
    seq[:, :n_in] = ids
    positions = torch.arange(max_length + 1, device=device)[None]

    tgt_cache = new_cache(target.config)
    ck = cache_kwarg(target)
    drafts = BlockDrafter(target, drafter, settings) if block_size > 1 else None

    out = target(
        input_ids=ids,
        position_ids=positions[:, :n_in],
        use_cache=True,
        logits_to_keep=1,
        output_hidden_states=block_size > 1,
        **{ck: tgt_cache},
    )
    target_forwards = 1
    last = out.logits[0, -1:]
    seq[0, n_in] = (
        last.argmax(dim=-1)[0] if greedy else sample_from(sampling_probs(last, sampling), generator)[0]
    )
    # Draft context waiting to enter the drafter's cache: features of tokens < start not yet cached.
    pending_ctx = features(out.hidden_states, settings.layer_ids) if block_size > 1 else None

    start = n_in  # position of the last committed token, which opens the next block
    accept_lengths: list[int] = []
    stopped = bool(stops.numel()) and bool(torch.isin(seq[0, start], stops))
    while start + 1 < max_length and not stopped:
        # Near the end the block shrinks to what is left (as z-lab does): every verified slot may still
        # become output, and the drafter sees the same block the reference would.
        verify = min(block_size, max_length - start)
        block = seq[:, start : start + verify].clone()  # [last token, MASK, ...]
        draft_probs = None
        if verify > 1 and drafts.selects:  # DFlash 2: the selector's walk (and its proposal distribution)
            proposed, draft_probs = drafts.propose(
                block, pending_ctx, start, 0.0 if greedy else sampling.temperature, generator
            )
            block[:, 1:] = proposed.to(device)
            draft_probs = draft_probs.to(device) if draft_probs is not None else None
        elif verify > 1:
            logits = drafts.logits(block, pending_ctx, start).to(device)
            # Slot 0 is the known token; slots 1.. are the proposals for positions start+1 ...
            if greedy:
                block[:, 1:] = logits.argmax(dim=-1)
            else:
                draft_probs = sampling_probs(logits[0], sampling)
                block[0, 1:] = sample_from(draft_probs, generator)

        if trace is not None:
            trace.append((start, block[0, 1:].tolist()))
        out = target(
            input_ids=block,
            position_ids=positions[:, start : start + verify],
            use_cache=True,
            output_hidden_states=verify > 1,
            **{ck: tgt_cache},
        )
        target_forwards += 1
        if greedy:
            posterior = out.logits[0].argmax(dim=-1)  # target's choice after each block slot
            matches = (block[0, 1:] == posterior[:-1]).int()
            accepted = int(matches.cumprod(0).sum())  # longest matching prefix of the drafts
            nxt = posterior[accepted]
        else:
            target_probs = sampling_probs(out.logits[0], sampling)
            q = draft_probs if draft_probs is not None else target_probs[:0]
            accepted, nxt = verify_sampled(block[0, 1:], q, target_probs, generator)
        if accepted_drafts is not None:
            accepted_drafts.append(int(accepted))
        # Commit the accepted drafts and the bonus (the target's token after them).
        seq[0, start + 1 : start + 1 + accepted] = block[0, 1 : 1 + accepted]
        seq[0, start + 1 + accepted] = nxt
        produced = min(accepted + 1, max_length - start - 1)
        if stops.numel():
            hit = torch.isin(seq[0, start + 1 : start + 1 + produced], stops).nonzero()
            if hit.numel():
                produced = int(hit[0, 0]) + 1  # keep the stop token, drop what follows
                stopped = True
        # Tokens start .. start+produced-1 now have verified K/V and features; the new last token
        # (start+produced) has neither yet: it opens the next block.
        crop_cache(tgt_cache, start + produced)
        if verify > 1:
            pending_ctx = features(out.hidden_states, settings.layer_ids)[:, :produced]
        start += produced
        accept_lengths.append(produced)

    output = seq[:, : min(start + 1, max_length)].clone()
    return SpecResult(output, accept_lengths, target_forwards, drafts.calls if drafts else 0, n_in)


# ---------------------------------------------------------------------------------------------------
# Batched greedy decoding for regeneration: many replies at once, each row's numbers its own
# ---------------------------------------------------------------------------------------------------
#
# A batched float computation may round a row differently from the same row alone, and a greedy argmax near
# a tie then flips: measured here (MKL, fp32, AVX2), a CPU ``linear`` over 1-3 rows takes other kernels than
# over 4 or more (a row's result differs between them, not among counts >= 4), and attention over ``n`` keys
# rounds differently from attention over ``n`` keys plus masked padding (SDPA and the plain ops: the q.k
# matmul and the softmax's sum change with the key count). ``SlotDecoder`` therefore computes every row as a
# function of that row alone, whatever else is in the batch:
#
# * the prefill runs per prompt (the model's own forward on that prompt, nothing else in it);
# * a decoding step runs every slot (at least ``MIN_ROWS``, idle slots as stand-ins): the linear layers see
#   the same row count >= 4 whatever the batch size, so one kernel family, rows independent;
# * attention runs over fixed blocks of ``BLOCK`` keys from each row's first token: per block the q.k
#   products, the block's exp-sum and its p.v are computed on fixed shapes (a row's blocks are the same
#   tensors alone or in a batch; keys past its length are masked to an exact 0), and the blocks are combined
#   with ``cumsum``, a sequential scan, so the all-masked blocks a longer neighbour adds contribute exact
#   zeros at the end of the sum.
#
# Rows of a batch are then the one-at-a-time rows bit for bit (``tests/embedded/test_batched_regen.py``),
# though not bit for bit transformers' ``generate`` (other kernels: a reply may differ from it at a near
# tie). Llama-shaped decoders (Llama, Qwen2, Qwen3, Mistral without a sliding window) decode this way;
# others one prompt at a time through ``greedy_continuations`` (``SlotDecoder.supports``).

MIN_ROWS = 4  # a CPU linear over fewer rows takes another kernel
BLOCK = 32  # keys per attention block


@attrs.define(eq=False)
class _Parts:
    """A Llama-shaped decoder's parts, called directly on the decoding step (transformers' own modules)."""

    embed: Any
    layers: Any
    norm: Any
    rotary: Any
    lm_head: Any
    rope: Any  # the modeling module's apply_rotary_pos_emb
    kv_heads: int
    head_dim: int


def _parts(model: nn.Module) -> _Parts | None:
    import sys

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "model_type", None) not in ("llama", "qwen2", "qwen3", "mistral"):
        return None
    base = getattr(model, "model", None)
    need = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, n) for n in need) or getattr(model, "lm_head", None) is None:
        return None
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ["full_attention"]):
        return None
    attn = base.layers[0].self_attn
    if getattr(config, "use_sliding_window", False) or any(
            getattr(layer.self_attn, "sliding_window", None) for layer in base.layers) or (
            config.model_type == "mistral" and getattr(config, "sliding_window", None)):
        return None
    rope = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)
    if rope is None or getattr(config, "final_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None):
        return None
    head_dim = int(attn.head_dim)
    return _Parts(base.embed_tokens, base.layers, base.norm, base.rotary_emb, model.lm_head, rope,
                  int(config.num_key_value_heads), head_dim)


class SlotDecoder:
    """Greedy decoding of many prompts at once in ``slots`` rows (continuous batching: a finished row's slot
    takes the next prompt at once). ``add(key, ids)`` prefills a prompt into a free slot; ``step()`` decodes
    one token for every busy slot and returns the replies that ended: ``(key, new ids, "stop" | "length")``
    as :func:`greedy_continuations` gives them (a stop token that ended the reply included). Each reply is
    what the prompt alone gives (see above); ``supports(model)`` says whether the model decodes this way.
    Busy rows are kept first (a finished row's place is taken by the last one), so a step computes only
    them (at least ``MIN_ROWS``)."""

    def __init__(self, model: nn.Module, *, slots: int, max_new_tokens: int, stop_ids: Sequence[int] = ()):
        if max_new_tokens < 1 or slots < 1:
            raise ValueError("slots and max_new_tokens must be >= 1")
        parts = _parts(model)
        if parts is None:
            raise ValueError("batched decoding needs a Llama-shaped decoder (SlotDecoder.supports)")
        self.model, self.parts = model, parts
        self.slots = int(slots)
        self.rows = max(self.slots, MIN_ROWS)
        self.max_new = int(max_new_tokens)
        self.stops = {int(t) for t in stop_ids}
        self.device = target_device(model)
        self.busy = 0  # rows 0 .. busy-1 are decoding
        self.keys: list[Any] = [None] * self.rows  # the caller's key of each row's prompt
        self.lengths = [0] * self.rows  # tokens in each row's cache
        self.new: list[list[int]] = [[] for _ in range(self.rows)]
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.nblocks = 0
        self.finished: list[tuple[Any, list[int], str]] = []

    @staticmethod
    def supports(model: nn.Module) -> bool:
        return _parts(model) is not None

    @property
    def free(self) -> int:
        return self.slots - self.busy

    def _room(self, tokens: int) -> None:
        """Every layer's cache holds ``tokens`` per row (grown by whole blocks, contents kept)."""
        need = -(-tokens // BLOCK)
        if need <= self.nblocks:
            return
        grow = max(need, 2 * self.nblocks)
        p, dt = self.parts, next(self.model.parameters()).dtype
        shape = (self.rows, p.kv_heads, grow, BLOCK, p.head_dim)
        kv = []
        for i in range(len(p.layers)):
            k, v = torch.zeros(shape, dtype=dt, device=self.device), torch.zeros(shape, dtype=dt, device=self.device)
            if self.kv:
                k[:, :, : self.nblocks], v[:, :, : self.nblocks] = self.kv[i]
            kv.append((k, v))
        self.kv, self.nblocks = kv, grow

    def _ended(self, tokens: list[int]) -> str | None:
        if tokens[-1] in self.stops:
            return "stop"
        return "length" if len(tokens) >= self.max_new else None

    @torch.inference_mode()
    def add(self, key: Any, ids: Sequence[int]) -> None:
        """Prefill ``ids`` (alone: the model's own forward) into a free slot; its first token is chosen."""
        if not self.free:
            raise RuntimeError("no free slot")
        if not len(ids):
            raise ValueError("empty prompt")
        row = self.busy
        ids_t = torch.as_tensor(list(ids), dtype=torch.long, device=self.device)[None]
        cache = new_cache(self.model.config)
        out = self.model(input_ids=ids_t, position_ids=torch.arange(ids_t.shape[1], device=self.device)[None],
                         use_cache=True, logits_to_keep=1, **{cache_kwarg(self.model): cache})
        tokens = [int(out.logits[0, -1].argmax())]
        reason = self._ended(tokens)
        if reason is not None:
            self.finished.append((key, tokens, reason))
            return
        n = ids_t.shape[1]
        self._room(n + self.max_new)
        for (k, v), layer in zip(self.kv, cache.layers, strict=True):
            k[row].view(k.shape[1], -1, k.shape[-1])[:, :n] = layer.keys[0]
            v[row].view(v.shape[1], -1, v.shape[-1])[:, :n] = layer.values[0]
        self.keys[row], self.lengths[row], self.new[row] = key, n, tokens
        self.busy += 1

    def _drop(self, row: int) -> None:
        """Row ``row`` ended: the last busy row takes its place."""
        last = self.busy - 1
        if row != last:
            used = -(-self.lengths[last] // BLOCK)
            for k, v in self.kv:
                k[row, :, :used], v[row, :, :used] = k[last, :, :used], v[last, :, :used]
            self.keys[row], self.lengths[row], self.new[row] = self.keys[last], self.lengths[last], self.new[last]
        self.keys[last], self.lengths[last], self.new[last] = None, 0, []
        self.busy -= 1

    @torch.inference_mode()
    def step(self) -> list[tuple[Any, list[int], str]]:
        """One token for every busy slot; the replies that ended since the last call (prefills included)."""
        if self.busy:
            n, rows = self.busy, max(self.busy, MIN_ROWS)
            # rows past the busy ones stand in (the linear's row count): token 0 at position 0, their own key
            tokens = torch.tensor([[self.new[r][-1]] for r in range(n)] + [[0]] * (rows - n), dtype=torch.long,
                                  device=self.device)
            choice = self._forward(tokens, self.lengths[:n] + [0] * (rows - n)).tolist()
            ended = []
            for r in range(n):
                self.lengths[r] += 1
                self.new[r].append(int(choice[r]))
                reason = self._ended(self.new[r])
                if reason is not None:
                    self.finished.append((self.keys[r], self.new[r], reason))
                    ended.append(r)
            for r in reversed(ended):
                self._drop(r)
        done, self.finished = self.finished, []
        return done

    def _forward(self, tokens: torch.Tensor, at: list[int]) -> torch.Tensor:
        p = self.parts
        rows = tokens.shape[0]
        pos = torch.tensor(at, dtype=torch.long, device=self.device)
        n_keys = pos + 1
        width = -(-int(n_keys.max()) // BLOCK)  # blocks in use
        keep = (torch.arange(width * BLOCK, device=self.device)[None] < n_keys[:, None]).view(rows, 1, width, 1, BLOCK)
        h = p.embed(tokens)
        cos, sin = p.rotary(h, pos[:, None])
        row_idx = torch.arange(rows, device=self.device)
        blk, off = pos // BLOCK, pos % BLOCK
        for layer, (kc, vc) in zip(p.layers, self.kv, strict=True):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(rows, 1, -1, p.head_dim)
            k = attn.k_proj(x).view(rows, 1, -1, p.head_dim)
            v = attn.v_proj(x).view(rows, 1, -1, p.head_dim)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = p.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [rows, heads, 1, d]
            kc[row_idx, :, blk, off] = k[:, :, 0]
            vc[row_idx, :, blk, off] = v[:, 0]
            o = _block_attention(q, kc[:rows, :, :width], vc[:rows, :, :width], keep, attn.scaling)
            h = h + attn.o_proj(o.reshape(rows, 1, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return p.lm_head(p.norm(h))[:, -1].argmax(dim=-1)


def _block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    """One query per row over its keys in blocks: ``q`` ``[rows, heads, 1, d]``, ``k``/``v`` ``[rows, kv heads,
    blocks, BLOCK, d]``, ``keep`` ``[rows, 1, blocks, 1, BLOCK]`` (a row's keys); ``[rows, heads, d]``."""
    rows, heads, _, d = q.shape
    kv_heads = k.shape[1]
    blocks = k.shape[2]
    group = heads // kv_heads
    # query heads grouped by their kv head, one copy per block: a bmm of fixed [group, d] x [d, BLOCK] products
    # (a broadcast matmul would fold the blocks into one wider product, whose rounding depends on the width)
    q = q.reshape(rows, kv_heads, 1, group, d).expand(rows, kv_heads, blocks, group, d)
    s = torch.bmm(q.reshape(-1, group, d), k.reshape(-1, BLOCK, d).transpose(1, 2))
    s = s.view(rows, kv_heads, blocks, group, BLOCK) * scaling
    s = s.masked_fill(~keep, float("-inf"))
    top = s.amax(dim=(-1, -3), keepdim=True)  # the row's max over its keys (exact: masked keys are -inf)
    e = torch.exp(s - top)  # masked keys: exactly 0
    pv = torch.bmm(e.reshape(-1, group, BLOCK), v.reshape(-1, BLOCK, d)).view(rows, kv_heads, blocks, group, d)
    part = torch.cat([pv, e.sum(-1, keepdim=True)], dim=-1)  # per block: p.v and the exp-sum
    total = part.cumsum(dim=2)[:, :, -1]  # a sequential scan over blocks: trailing all-masked blocks add 0
    return (total[..., :d] / total[..., d:]).reshape(rows, heads, d)


def greedy_batched(model: nn.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                   stop_ids: Sequence[int] | None = None, slots: int = 16) -> list[tuple[list[int], str]]:
    """:func:`greedy_continuations`' result for ``prompts`` through :class:`SlotDecoder` (``slots`` rows at
    once, continuous): each row what the prompt alone gives through it, whatever ``slots`` is."""
    dec = SlotDecoder(model, slots=slots, max_new_tokens=max_new_tokens, stop_ids=stop_ids or ())
    out: dict[int, tuple[list[int], str]] = {}
    todo = list(enumerate(prompts))[::-1]
    while todo or dec.busy:
        while todo and dec.free:
            i, ids = todo.pop()
            dec.add(i, ids)
        for i, tokens, reason in dec.step():
            out[i] = (tokens, reason)
    return [out[i] for i in range(len(prompts))]
