"""The one mapping between our target layer ids and vLLM's (``eagle_aux_hidden_state_layer_ids``).

Ours are transformers' decoder-layer indices: id ``k`` is the residual stream *after* decoder layer ``k``,
``output_hidden_states[k + 1]`` (``model.features.TargetFeatureExtractor``). vLLM's ``extract_hidden_states``
numbers the same streams from the embedding: its ``k`` is transformers' ``hidden_states[k]`` (0: the
embedding output). So **vLLM id = our id + 1**, measured equal within 1e-5 in fp32 (docs/engine.md).

One exception: our last layer (``depth - 1``). Transformers replaces its ``hidden_states[depth]`` by the
final-normed state (and so does our extractor, to match it), while vLLM's ``depth`` is the stream before
the final norm. The two differ, so the mapping refuses that layer instead of feeding the drafter
something else than it would train on in process (the DFlash rule never picks it: it spreads over
``[1, depth - 3]``).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["from_engine_layer_ids", "to_engine_layer_ids"]


def to_engine_layer_ids(ids: Sequence[int], depth: int | None = None) -> list[int]:
    """Our ``target_layer_ids`` as vLLM's ``eagle_aux_hidden_state_layer_ids`` (+1 each). With ``depth``
    (the target's decoder layers) every id is checked to exist and not to be the last one (see the
    module docstring). Raises ValueError saying which id and why."""
    out = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            raise ValueError(f"target layer id {i!r} is not an integer")
        if i < 0:
            raise ValueError(f"target layer id {i} is negative")
        if depth is not None:
            if i >= depth:
                raise ValueError(f"target layer {i} does not exist: the target has {depth} decoder layers "
                                 f"(ids 0-{depth - 1})")
            if i == depth - 1:
                raise ValueError(
                    f"target layer {i} is the target's last layer: transformers gives its final-normed state, "
                    "vLLM the state before the final norm, so engine features would differ from in-process "
                    f"ones; pick layers up to {depth - 2}")
        out.append(i + 1)
    if not out:
        raise ValueError("no target layer ids")
    return out


def from_engine_layer_ids(ids: Sequence[int]) -> list[int]:
    """vLLM's ``eagle_aux_hidden_state_layer_ids`` as our ``target_layer_ids`` (-1 each). vLLM's 0 (the
    embedding output) has no id of ours: ValueError."""
    out = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            raise ValueError(f"vLLM layer id {i!r} is not an integer")
        if i < 1:
            raise ValueError(f"vLLM layer id {i} is the embedding output (or negative): no decoder layer of ours")
        out.append(i - 1)
    return out
