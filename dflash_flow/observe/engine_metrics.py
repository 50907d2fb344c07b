"""Acceptance as serving engines count it, the check that the engine's count equals ours, and the Prometheus
text a server's ``/metrics`` answers (:func:`fetch_text`, :func:`parse_prometheus`). Stdlib only (and attrs).

Three counts of the same run, always named (they differ on the same decoding):

* **per verify step, vLLM's** (:func:`spec_counters`, :func:`spec_delta`): ``tau = 1 + d(accepted_tokens) /
  d(drafts)``, position ``k``'s rate ``d(accepted_tokens_per_pos{position=k}) / d(drafts)``, summed over
  engines and servers (vLLM counts a draft accepted past ``max_tokens`` or a stop token too);
* **per request** (vLLM's ``--per-request-spec-decode-metrics``, SGLang's ``meta_info``):
  :func:`vllm_request` / :func:`sglang_request`, aggregated by :func:`request_summary` (z-lab's average);
* **per token, SGLang's / SpecForge's**: ``sum(completion_tokens) / sum(spec_verify_ct)``.

:func:`compare` and :func:`mismatch_warning` put an engine's figures beside ours, loudly when they disagree.
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from .store import redact_text, redact_uri, uri_secrets

SPEC_PREFIX = "vllm:spec_decode_"
_COUNTERS = {"num_drafts": "drafts", "num_draft_tokens": "draft_tokens", "num_accepted_tokens": "accepted"}
_PER_POS = "num_accepted_tokens_per_pos"


# ------------------------------------------------------------------------------ Prometheus text


@attrs.frozen
class MetricSample:
    """One sample line: the metric name, its labels (sorted pairs) and value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|(?=}))')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse_prometheus(text: str) -> list[MetricSample]:
    """The samples of a Prometheus text exposition (version 0.0.4, and OpenMetrics' ``# EOF``): comments and
    ``# HELP``/``# TYPE`` lines skipped, label values unescaped, a trailing timestamp ignored. A line that
    is not a sample raises ValueError naming its line number."""
    out: list[MetricSample] = []
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _NAME.match(line)
        if m is None:
            raise ValueError(f"metrics line {no}: not a sample: {line[:80]!r}")
        name, rest = m.group(0), line[m.end():]
        labels: list[tuple[str, str]] = []
        if rest.startswith("{"):
            pos = 1
            while True:
                if rest[pos:].lstrip().startswith("}"):
                    pos += rest[pos:].index("}") + 1
                    break
                lm = _LABEL.match(rest, pos)
                if lm is None:
                    raise ValueError(f"metrics line {no}: malformed labels: {line[:80]!r}")
                value = re.sub(r"\\[\\\"n]", lambda e: _ESCAPES[e.group(0)], lm.group(2))
                labels.append((lm.group(1), value))
                pos = lm.end()
            rest = rest[pos:]
        parts = rest.split()
        if not parts or len(parts) > 2:
            raise ValueError(f"metrics line {no}: expected a value after the name: {line[:80]!r}")
        try:
            value = float(parts[0])  # +Inf, -Inf, NaN too
        except ValueError:
            raise ValueError(f"metrics line {no}: {parts[0]!r} is not a number") from None
        out.append(MetricSample(name, tuple(sorted(labels)), value))
    return out


def fetch_text(url: str, *, timeout_s: float = 10.0) -> str:
    """GET ``url`` as text. Any failure raises OSError with one line naming the URL, credentials redacted."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 - http(s) URLs the user gave
            return r.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        raise OSError(f"GET {redact_uri(url)}: HTTP {exc.code} {exc.reason}") from None
    except (OSError, ValueError) as exc:
        raise OSError(redact_text(f"GET {redact_uri(url)}: {exc}", uri_secrets(url))) from None


# ------------------------------------------------------------------------------------ vLLM counters


@attrs.frozen
class EngineCounters:
    """One engine's spec-decode counters: drafts (verify steps with a draft), draft tokens proposed,
    draft tokens accepted, and accepted per draft position (0-based, as the ``position`` label)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: Mapping[int, float] = attrs.field(factory=dict)


def _base_name(name: str) -> str | None:
    """``num_drafts`` of ``vllm:spec_decode_num_drafts_total`` (or without ``_total``); None for anything
    else, ``_created`` timestamps included."""
    if not name.startswith(SPEC_PREFIX) or name.endswith("_created"):
        return None
    base = name[len(SPEC_PREFIX):]
    return base[: -len("_total")] if base.endswith("_total") else base


def spec_counters(text: str) -> dict[str, EngineCounters]:
    """vLLM's spec-decode counters in a ``/metrics`` page, per engine (the key: the engine's labels, e.g.
    ``engine=0,model_name=m``). Empty when the server exposes none (no speculative decoding)."""
    found: dict[str, dict[str, Any]] = {}
    for s in parse_prometheus(text):
        base = _base_name(s.name)
        if base is None or (base not in _COUNTERS and base != _PER_POS):
            continue
        labels = dict(s.labels)
        position = labels.pop("position", None)
        key = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        entry = found.setdefault(key, {"per_position": {}})
        if base == _PER_POS:
            if position is None or not position.isdigit():
                raise ValueError(f"{s.name}: a sample without a numeric 'position' label ({dict(s.labels)})")
            entry["per_position"][int(position)] = entry["per_position"].get(int(position), 0.0) + s.value
        else:
            entry[_COUNTERS[base]] = entry.get(_COUNTERS[base], 0.0) + s.value
    return {k: EngineCounters(**v) for k, v in found.items()}


class CounterReset(ValueError):
    """A counter went down between two scrapes, or an engine's counters vanished: the engine restarted (or
    another server answers at that address) and a delta over the reset would be wrong."""


@attrs.frozen
class SpecDelta:
    """What a workload added to the counters, summed over engines. ``per_position[k]``: accepted drafts at
    position k; ``missing_positions``: per engine, the positions the others report and it does not
    (counted as 0 there)."""

    drafts: float
    draft_tokens: float
    accepted: float
    per_position: tuple[float, ...]
    engines: int
    missing_positions: Mapping[str, tuple[int, ...]] = attrs.field(factory=dict)

    @property
    def tau_per_step(self) -> float | None:
        """vLLM's mean acceptance length, ``1 + accepted / drafts`` (None: no drafts in the window)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None

    @property
    def accept_rate_per_position(self) -> list[float] | None:
        return [p / self.drafts for p in self.per_position] if self.drafts else None

    @property
    def draft_acceptance_rate(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens else None

    def to_json(self) -> dict[str, Any]:
        return {"tau_per_step": self.tau_per_step, "accept_rate_per_position": self.accept_rate_per_position,
                "draft_acceptance_rate": self.draft_acceptance_rate, "drafts": self.drafts,
                "draft_tokens": self.draft_tokens, "accepted": self.accepted, "engines": self.engines,
                **({"missing_positions": {k: list(v) for k, v in self.missing_positions.items()}}
                   if self.missing_positions else {})}


def spec_delta(before: Mapping[str, EngineCounters], after: Mapping[str, EngineCounters]) -> SpecDelta:
    """``after - before`` per engine, summed. Keys are engines (for several servers, prefix each server's
    keys with its name). An engine first seen in ``after`` counts from 0 (it started in the window); one
    that went missing, or any counter that went down, raises :class:`CounterReset` naming the engine."""
    gone = sorted(set(before) - set(after))
    if gone:
        raise CounterReset(f"the spec-decode counters of engine {gone[0]} vanished between the two scrapes "
                           "(the engine restarted?); measure again on a server that stays up")
    positions = sorted({k for c in after.values() for k in c.per_position})
    totals = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0}
    per_pos = [0.0] * (positions[-1] + 1 if positions else 0)
    missing: dict[str, tuple[int, ...]] = {}
    for key, now in sorted(after.items()):
        was = before.get(key, EngineCounters())
        for field in totals:
            a, b = getattr(now, field), getattr(was, field)
            if a < b:
                name = next(n for n, f in _COUNTERS.items() if f == field)
                raise CounterReset(f"engine {key}: {SPEC_PREFIX}{name}_total went down from {b:g} to {a:g} "
                                   "between the two scrapes (the engine restarted); measure again")
            totals[field] += a - b
        if lacking := tuple(k for k in positions if k not in now.per_position):
            missing[key] = lacking
        for k, a in now.per_position.items():
            b = was.per_position.get(k, 0.0)
            if a < b:
                raise CounterReset(f"engine {key}: {SPEC_PREFIX}{_PER_POS}_total{{position={k}}} went down from "
                                   f"{b:g} to {a:g} (the engine restarted); measure again")
            per_pos[k] += a - b
    return SpecDelta(totals["drafts"], totals["draft_tokens"], totals["accepted"], tuple(per_pos), len(after), missing)


# ------------------------------------------------------------------------------- per-request figures


@attrs.frozen
class RequestSpec:
    """One request's speculative decoding as its engine reports it: verify steps, drafts accepted, draft
    tokens proposed, and the histogram of accepted drafts per step (index j: steps that accepted j)."""

    steps: int
    accepted: int
    draft_tokens: int | None = None
    histogram: tuple[int, ...] = ()
    completion_tokens: int | None = None

    @property
    def mean_acceptance(self) -> float:
        """Tokens per verify step, the bonus included (1.0 with no step)."""
        return 1.0 + self.accepted / self.steps if self.steps else 1.0


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
        raise ValueError(f"{what} must be a count, got {value!r}")
    return int(value)


def vllm_request(response: Mapping[str, Any]) -> RequestSpec | None:
    """A vLLM response's ``metrics.speculative_decoding`` (served with ``--per-request-spec-decode-metrics``);
    None when the response has none."""
    spec = ((response.get("metrics") or {}) if isinstance(response.get("metrics"), Mapping) else {}).get(
        "speculative_decoding")
    if not isinstance(spec, Mapping):
        return None
    hist = tuple(_int(c, "acceptance_histogram entry") for c in spec.get("acceptance_histogram") or ())
    steps = _int(spec.get("num_spec_steps", sum(hist)), "num_spec_steps")
    accepted = _int(spec.get("num_accepted_draft_tokens", sum(j * c for j, c in enumerate(hist))),
                    "num_accepted_draft_tokens")
    drafted = spec.get("num_draft_tokens")
    usage = response.get("usage") if isinstance(response.get("usage"), Mapping) else {}
    return RequestSpec(steps, accepted, None if drafted is None else _int(drafted, "num_draft_tokens"), hist,
                       usage.get("completion_tokens"))


def sglang_request(meta_info: Mapping[str, Any]) -> RequestSpec | None:
    """An SGLang ``meta_info``: ``spec_verify_ct`` (verify steps), ``completion_tokens``, and where given
    ``spec_accept_histogram`` and ``spec_accept_token_num`` / ``spec_draft_token_num``. None without
    ``spec_verify_ct`` (no speculative decoding)."""
    if meta_info.get("spec_verify_ct") is None:
        return None
    steps = _int(meta_info["spec_verify_ct"], "spec_verify_ct")
    hist = tuple(_int(c, "spec_accept_histogram entry") for c in meta_info.get("spec_accept_histogram") or ())
    completion = meta_info.get("completion_tokens")
    if meta_info.get("spec_accept_token_num") is not None:
        accepted = _int(meta_info["spec_accept_token_num"], "spec_accept_token_num")
    elif hist:
        accepted = sum(j * c for j, c in enumerate(hist))
    else:  # every verify step commits its accepted drafts and one token; the prefill gives the first
        accepted = max(0, _int(completion or 0, "completion_tokens") - 1 - steps)
    drafted = meta_info.get("spec_draft_token_num")
    return RequestSpec(steps, accepted, None if drafted is None else _int(drafted, "spec_draft_token_num"), hist,
                       None if completion is None else _int(completion, "completion_tokens"))


def rates_from_histogram(hist: Sequence[int], positions: int | None = None) -> list[float] | None:
    """Per-position acceptance rates from a histogram of accepted drafts per step: position k is accepted in
    the steps that accepted more than k drafts. ``positions`` (default: len(hist) - 1) entries."""
    steps = sum(hist)
    if not steps:
        return None
    n = len(hist) - 1 if positions is None else positions
    return [sum(hist[j] for j in range(k + 1, len(hist))) / steps for k in range(n)]


def request_summary(requests: Sequence[RequestSpec]) -> dict[str, Any]:
    """Per-request figures aggregated three ways: ``tau_per_step`` (all steps pooled), ``tau_per_request``
    (the mean of each request's mean; z-lab's), ``tau_per_token`` (SpecForge's ``sum(completion_tokens) /
    sum(verify steps)``, where the engine gives completion tokens), the histogram of accepted drafts and
    the per-position rates it implies."""
    if not requests:
        return {"requests": 0}
    steps = sum(r.steps for r in requests)
    width = max((len(r.histogram) for r in requests), default=0)
    hist = [sum(r.histogram[j] for r in requests if j < len(r.histogram)) for j in range(width)]
    tokens = [r.completion_tokens for r in requests]
    return {
        "requests": len(requests), "steps": steps,
        "tau_per_step": 1.0 + sum(r.accepted for r in requests) / steps if steps else None,
        "tau_per_request": sum(r.mean_acceptance for r in requests) / len(requests),
        "tau_per_token": (sum(tokens) / steps if steps and all(t is not None for t in tokens) else None),
        "histogram_accepted_drafts": hist if width else None,
        "accept_rate_per_position": rates_from_histogram(hist) if width else None,
    }


# ------------------------------------------------------------------------------ engine against ours

#: What usually makes an engine's acceptance differ from the one measured in process (the most common
#: complaint in the peers' trackers: "validation looks great, real acceptance is ~0").
LIKELY_CAUSES = (
    "target layer ids: the engine reads eagle_aux_hidden_state_layer_ids, else target_layer_ids + 1 (vLLM's ids "
    "are transformers' hidden_states indices); a config with both that disagree, or ids off by one",
    "mask token: dflash_config.mask_token_id not the id the drafter trained with",
    "chat template or thinking mismatch: prompts rendered with another template, or enable_thinking on in one "
    "place and off in the other (this check sends the same token ids to both, so it rules this out here)",
    "rope settings: rope_theta / rope_scaling / max_position_embeddings of the drafter's config not the target's",
    "features: the engine's hidden states are not the target's (zero features on hybrid models before vLLM "
    "PR #46301, a quantized or different target checkpoint, another dtype)",
    "an engine kernel: vLLM's CPU build norms every drafter layer's context keys with layer 0's k_norm "
    "(docs/vllm-cpu-dflash-knorm.md); a drafter with several layers drafts differently there",
)


@attrs.frozen
class Comparison:
    """The engine's figures against ours on the same prompts: ``ok`` when tau and every position rate are
    within the tolerances (absolute: tokens per step, and rate)."""

    ok: bool
    ours_tau: float | None
    engine_tau: float | None
    ours_rates: tuple[float, ...]
    engine_rates: tuple[float, ...]
    tau_tolerance: float
    rate_tolerance: float
    problems: tuple[str, ...]

    @property
    def tau_difference(self) -> float | None:
        return None if self.ours_tau is None or self.engine_tau is None else self.engine_tau - self.ours_tau

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "tau_tolerance": self.tau_tolerance, "rate_tolerance": self.rate_tolerance,
                "tau_difference": self.tau_difference,
                "position_differences": [e - o for o, e in zip(self.ours_rates, self.engine_rates, strict=False)],
                "problems": list(self.problems)}


def compare(ours_tau: float | None, ours_rates: Sequence[float], engine_tau: float | None,
            engine_rates: Sequence[float] | None, *, tau_tolerance: float, rate_tolerance: float) -> Comparison:
    """Ours against the engine's, counted the same way (per verify step, every accepted draft counted)."""
    problems: list[str] = []
    engine_rates = list(engine_rates or [])
    if engine_tau is None:
        problems.append("the engine counted no drafts (is the drafter served? is speculative decoding on?)")
    elif ours_tau is not None and abs(engine_tau - ours_tau) > tau_tolerance:
        problems.append(f"tau {engine_tau:.3f} (engine) vs {ours_tau:.3f} (ours): differs by "
                        f"{engine_tau - ours_tau:+.3f}, tolerance {tau_tolerance:g}")
    if engine_tau is not None:
        if len(engine_rates) != len(ours_rates):
            problems.append(f"the engine drafts {len(engine_rates)} positions, ours {len(ours_rates)} "
                            "(num_speculative_tokens must be block_size - 1)")
        for k, (o, e) in enumerate(zip(ours_rates, engine_rates, strict=False)):
            if abs(e - o) > rate_tolerance:
                problems.append(f"position {k + 1}: accepted {e:.3f} (engine) vs {o:.3f} (ours), tolerance {rate_tolerance:g}")
    return Comparison(not problems, ours_tau, engine_tau, tuple(ours_rates), tuple(engine_rates), tau_tolerance,
                      rate_tolerance, tuple(problems))


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def mismatch_warning(suite: str, c: Comparison) -> str:
    """The loud message for a disagreement: what differs, the figures side by side, the likely causes."""
    width = max(len(c.ours_rates), len(c.engine_rates))
    rows = [f"  {'':10} {'tau':>7} " + " ".join(f"{'pos ' + str(k + 1):>7}" for k in range(width)),
            f"  {'ours':10} {_fmt(c.ours_tau):>7} " + " ".join(f"{_fmt(x):>7}" for x in c.ours_rates),
            f"  {'engine':10} {_fmt(c.engine_tau):>7} " + " ".join(f"{_fmt(x):>7}" for x in c.engine_rates)]
    bar = "!" * 100
    return "\n".join([
        bar,
        f"WARNING: {suite}: the serving engine's acceptance is NOT ours on the same prompts",
        *(f"  - {p}" for p in c.problems),
        "figures side by side (tokens per verify step; per-position acceptance rate):",
        *rows,
        "likely causes:",
        *(f"  - {cause}" for cause in LIKELY_CAUSES),
        bar,
    ])


def weak_drafter_note(label: str, tau: float, *, threshold: float = 1.3) -> str | None:
    """The end-of-run verdict when a drafter barely beats plain decoding (tau below ``threshold`` tokens per
    target step), with what usually causes it; None when it does not."""
    if not math.isfinite(tau) or tau >= threshold:
        return None
    return (f"verdict: the {label} drafter barely beats plain decoding (acceptance length {tau:.2f} < {threshold:g} "
            "tokens per target step). Usual causes: too little training data (a useful drafter needs thousands of "
            "conversations), replies that are not the target's own (run `dflash-flow regenerate` first), too few "
            "epochs, or evaluation prompts far from the training data.")


def dumps(obj: Any) -> str:
    """JSON with NaN/inf as null (results files must parse everywhere)."""
    from .record import jsonable

    return json.dumps(jsonable(obj), indent=1, ensure_ascii=False)
