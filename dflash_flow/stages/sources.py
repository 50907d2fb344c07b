"""Sources of training samples: thin wrappers over `data.records`, each emitting one `SampleTable`."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional

import attrs

from dflash_flow.core import Source, StageContext, cfg
from dflash_flow.core.metrics import Counter, Labeled, stage_metric
from dflash_flow.items import SampleTable
from dflash_flow.model.spec import UsesModel, model_of
from dflash_flow.services import services_of
from dflash_flow.util import cache_dir_problem, cache_root

log = logging.getLogger(__name__)


def _paths_ok(_inst, _attr, value) -> None:
    """A file listed twice would silently train twice per epoch: refuse it (weights are a mixture's job)."""
    seen: dict[str, str] = {}
    for p in value or []:
        key = os.path.normpath(os.path.abspath(os.path.expanduser(str(p))))
        if key in seen:
            raise ValueError(f"{p!r} is listed twice (as {seen[key]!r} and {p!r}); each input is read once per "
                             "epoch -- to weight a source, give it its own source stage and a Bucketer mixture weight")
        seen[key] = str(p)


def _cache_dir(value: Optional[str]) -> Optional[Path]:
    if not value:
        return None
    if value == "auto":
        # Shared across runs on purpose: the key covers content, tokenizer, template and options.
        return cache_root() / "tokenized"
    return Path(value).expanduser()


_REGENERATE_KEYS = {"servers", "out_dir", "max_new_tokens", "concurrency", "sampling", "target", "thinking",
                    "timeout_s", "max_attempts", "served_model", "seed", "system_prompt", "api_key_env"}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _api_key_env_problem(value: Any) -> str | None:
    """Why ``regenerate.api_key_env`` is no variable name (never repeating the value: it may be the key itself)."""
    if value is not None and not (isinstance(value, str) and _ENV_NAME.fullmatch(value)):
        return ("'regenerate.api_key_env' names the environment variable that holds the servers' API key (e.g. "
                "OPENAI_API_KEY), never the key itself; this value is no variable name")
    return None


def _regenerate_ok(inst, _attr, value) -> None:
    """ChatSource's ``regenerate``: known keys, at least one server, an out_dir outside the inputs' names."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError("'regenerate' is a mapping: {servers: [URL, ...], out_dir: DIR, ...}")
    unknown = sorted(set(value) - _REGENERATE_KEYS)
    if unknown:
        raise ValueError(f"'regenerate' has unknown keys {unknown}; known: {sorted(_REGENERATE_KEYS)}")
    servers = value.get("servers")
    if not isinstance(servers, list) or not servers or not all(isinstance(u, str) for u in servers):
        raise ValueError("'regenerate.servers' must be a non-empty list of server URLs (e.g. http://host:8000)")
    from dflash_flow.engine.http import ServerPool

    ServerPool(servers, option="'regenerate.servers'")  # each an http(s) URL with a valid port, none twice
    why = _api_key_env_problem(value.get("api_key_env"))
    if why:
        raise ValueError(why)
    if not isinstance(value.get("out_dir"), str) or not value["out_dir"]:
        raise ValueError("'regenerate.out_dir' must name the directory the regenerated replies are written to")
    names = [Path(p).name for p in inst.paths]
    if len(set(names)) != len(names):
        raise ValueError("with 'regenerate', the inputs need distinct file names (each is answered into "
                         "out_dir/<name>)")
    out_dir = Path(value["out_dir"]).expanduser().resolve()
    for p in inst.paths:
        if not str(p).endswith(".jsonl"):
            raise ValueError(f"'regenerate' reads JSONL prompts; {p} is not a .jsonl file")
        if Path(p).expanduser().resolve().parent == out_dir:
            raise ValueError(f"'regenerate.out_dir' {value['out_dir']} holds the input {p}: the answers would be "
                             "written over it; choose another out_dir")


@attrs.define
class SourceMetrics:
    records: Counter = stage_metric("records", "Records read (non-blank lines / rows)")
    samples: Counter = stage_metric("samples", "Samples emitted")
    tokens: Counter = stage_metric("tokens", "Tokens of the emitted samples")
    truncated: Counter = stage_metric("samples", "Samples truncated to max_length")
    dropped_overlong: Counter = stage_metric("samples", "Samples over max_length dropped")
    too_few_supervised: Counter = stage_metric("samples", "Samples with fewer than min_loss_tokens supervised tokens")
    # the name observe.sample.BAD_RECORDS_METRIC reads for the run's data report
    bad_records: Labeled = stage_metric("records", "Unusable records by reason")
    files_from_cache: Counter = stage_metric("files", "Files read from the tokenization cache")


@attrs.define(kw_only=True, eq=False)
class _RecordSource(Source):
    output_type = SampleTable
    stage_metrics = (SourceMetrics,)

    paths: list[str] = attrs.field(
        factory=list, validator=_paths_ok, kw_only=True,
        metadata={"config": True, "doc": "Inputs (JSONL, .jsonl.gz/.bz2/.xz/.zst, Parquet, Arrow, a datasets "
                  "save_to_disk directory), read in this order (sample ids follow it); each at most once."},
    )
    max_length: int = cfg(3072, ge=2, doc="Longest sample in tokens; longer ones are truncated or dropped.")
    overflow: Literal["truncate", "drop"] = cfg("truncate", choices=("truncate", "drop"),
                                                doc="What to do with samples over max_length.")
    on_bad_record: Literal["skip", "fail"] = cfg(
        "skip", choices=("skip", "fail"), doc="skip: count and report bad records (file:line); fail: raise at the first.")
    min_loss_tokens: int = cfg(1, ge=1, doc="Drop samples with fewer supervised tokens (after truncation).")
    max_record_bytes: int = cfg(64 * 2**20, ge=1024, le=2**31, doc="Longest JSONL record (line) in bytes; a longer "
                                "one is a bad record (read in bounded memory).")
    cache_dir: Optional[str] = cfg("auto", result=False, doc="Token store (memory-mapped, shared by the ranks of a "
                                   "node and by runs); 'auto' = $DFLASH_FLOW_CACHE/tokenized or "
                                   "~/.cache/dflash-flow/tokenized; empty or null: off (held in memory).")
    num_workers: Optional[int] = cfg(None, ge=0, le=1024, result=False, doc="Tokenizing processes; null: every core, "
                                     "for inputs of a few MiB or more; 0: in this process.")

    def setup(self, ctx: StageContext) -> None:
        if not self.paths:
            raise ValueError(f"stage '{ctx.name}': no input paths")
        self._ctx = ctx
        self._m = ctx.metrics.declare(SourceMetrics)
        self.report = None

    def _options(self):
        from dflash_flow.data.records import ReadOptions

        return ReadOptions(max_length=self.max_length, overflow=self.overflow, on_bad_record=self.on_bad_record,
                           min_loss_tokens=self.min_loss_tokens, max_record_bytes=self.max_record_bytes,
                           cache_dir=_cache_dir(self.cache_dir), num_workers=self.num_workers, **self._extra_options())

    def data_files(self) -> list[str]:
        return list(self.paths)

    def config_problems(self) -> list[tuple[str, str]]:
        why = cache_dir_problem(self.cache_dir, _cache_dir(self.cache_dir))  # a file there: found in validate
        return [("cache_dir", why)] if why else []

    def longest_item(self) -> int:
        return self.max_length

    def _read(self, path: str, options, **hooks):  # pragma: no cover - overridden
        raise NotImplementedError

    def produce(self):
        from dflash_flow.data.plan import file_table
        from dflash_flow.data.records import LoadReport, ReadCancelled, file_sha256
        from dflash_flow.observe.progress import LoadProgress

        ctx = self._ctx
        options = self._options()
        report = LoadReport(from_cache=True)
        files, digests = [], []
        view = LoadProgress(ctx.name, console=ctx.rank == 0 and ctx.replica == 0, tracker=services_of(ctx).tracker)
        seen: list[tuple] = [()]

        def progress(p) -> None:
            # The watchdog hears of real progress only (while waiting: the builder's, so a hung builder stalls).
            mark = (p.path, p.state, p.records, p.done)
            if mark != seen[0]:
                seen[0] = mark
                ctx.heartbeat()
            ctx.busy_with = f"{'waiting for ' + p.holder + ' to tokenize' if p.state == 'waiting' else 'reading'} {p.path}"
            view.update(p)

        try:
            for path in self.paths:
                try:
                    tf = self._read(path, options, progress=progress, should_stop=ctx.stop_requested.is_set)
                except ReadCancelled:
                    return
                rep = tf.report
                report.merge(rep)
                for counted in ("records", "truncated", "dropped_overlong", "too_few_supervised"):
                    getattr(self._m, counted).inc(getattr(rep, counted))
                for reason, n in rep.bad_by_reason.items():
                    self._m.bad_records.inc(reason, n)
                if rep.from_cache:
                    self._m.files_from_cache.inc()
                if rep.bad or rep.truncated or rep.dropped_overlong or rep.too_few_supervised:
                    log.warning("%s: %s", ctx.name, rep.summary())
                digest = file_sha256(Path(path).expanduser())
                if digest in digests:
                    log.warning("%s: %s has the same content as %s: its samples are trained on twice per epoch",
                                ctx.name, path, self.paths[digests.index(digest)])
                files.append(tf)
                digests.append(digest)
        finally:
            ctx.busy_with = ""
            view.close()
        table = file_table(ctx.name, files, digests=digests)
        self._m.samples.inc(len(table))
        self._m.tokens.inc(table.tokens)
        self.report = report
        if not ctx.stop_requested.is_set():
            yield table


@attrs.define(kw_only=True, eq=False)
class ChatSource(_RecordSource):
    """Reads chat conversations (JSONL, Parquet, Arrow, datasets) and masks assistant tokens via the chat template."""

    @classmethod
    def preload(cls) -> None:
        from transformers import AutoTokenizer  # noqa: F401

        import dflash_flow.data.records  # noqa: F401

    # One home for the tokenizer: model.tokenizer, else the target's directory (model.target).
    moved_fields: ClassVar[dict[str, str]] = {"tokenizer": "model.tokenizer", "target": "model.target"}

    chat_template: Optional[str] = cfg(None, doc="Chat template text, or a path to a .jinja file; null: the "
                                       "tokenizer's own template.")
    template_kwargs: dict[str, Any] = cfg(factory=dict, doc="Extra template variables, e.g. {enable_thinking: false}; "
                                          "must match serving.")

    regenerate: Optional[dict[str, Any]] = attrs.field(
        default=None, validator=_regenerate_ok, kw_only=True,
        metadata={"config": True, "doc": "Regenerate the replies through OpenAI-compatible servers before reading "
                  "(on first use; later runs find them written): {servers: [URL, ...], out_dir: DIR, and optionally "
                  "max_new_tokens, concurrency, sampling (greedy|target), target, thinking, timeout_s, "
                  "max_attempts, served_model, seed, system_prompt, api_key_env}. Each input P (JSONL) is answered "
                  "into OUT_DIR/<name of P>.regen.jsonl and read, in P's order, from OUT_DIR/<name of P>; thinking "
                  "defaults to template_kwargs.enable_thinking. api_key_env names the environment variable holding "
                  "the servers' API key (sent as a Bearer token; default OPENAI_API_KEY when that is set), never the "
                  "key itself; credentials in a server URL (http://user:pw@host) are sent as Basic authentication. "
                  "timeout_s bounds each request as a whole."},
    )
    _tokenizer_dir: str | None = attrs.field(default=None, init=False)  # a subclass's own tokenizer (embedded)

    def config_problems(self) -> list[tuple[str, str]]:
        out = super().config_problems()
        env = (self.regenerate or {}).get("api_key_env")
        if env is not None and _api_key_env_problem(env) is None and not os.environ.get(env):
            out.append(("regenerate", f"regenerate.api_key_env: ${env} is not set in this environment (it holds the "
                                      "servers' API key): export it before the run, or drop api_key_env"))
        return out

    def setup(self, ctx: StageContext) -> None:
        super().setup(ctx)
        path = self._tokenizer_dir or model_of(ctx).tokenizer
        if path is not None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(path)
        elif services_of(ctx).tokenizer is not None:
            self._tokenizer = services_of(ctx).tokenizer
        else:
            raise ValueError(f"stage '{ctx.name}': no tokenizer to render the chats with: set model.target to a "
                             "model directory, or model.tokenizer")
        self._regenerated = self._regenerate_inputs(ctx) if self.regenerate else {}

    def _regenerate_inputs(self, ctx: StageContext) -> dict[str, str]:
        """Each input answered by the servers (resumed), as a file in input order: {input: file to read}."""
        from dflash_flow.embedded.served import regenerate_served
        from dflash_flow.engine.http import api_key_from_env

        r = dict(self.regenerate)
        # From api_key_env's variable (which must be set), else $OPENAI_API_KEY when set, else none.
        api_key = api_key_from_env(r.pop("api_key_env", None), "regenerate.api_key_env")
        out_dir = Path(r.pop("out_dir")).expanduser()
        out_dir.mkdir(parents=True, exist_ok=True)
        if "thinking" not in r and "enable_thinking" in self.template_kwargs:
            r["thinking"] = bool(self.template_kwargs["enable_thinking"])  # the data must match serving
        kw = {"servers": r.pop("servers"), "enable_thinking": r.pop("thinking", None), **r}
        out: dict[str, str] = {}
        for path in self.paths:
            name = Path(path).name
            final, work = out_dir / name, out_dir / f"{name}.regen.jsonl"
            grew = [-1]

            def waiting(work=work, path=path, grew=grew) -> None:  # another process (rank) regenerates it: its progress
                size = work.stat().st_size if work.exists() else 0
                if size != grew[0]:
                    grew[0] = size
                    ctx.heartbeat()
                ctx.busy_with = f"waiting for another process regenerating {path}"

            def progress(done: int, total: int, _tokens: int, path=path) -> None:
                ctx.heartbeat()  # regeneration takes hours: progress, not a stall
                if done == total or done % 1000 == 0:
                    log.info("%s: regenerated %d/%d replies of %s", ctx.name, done, total, path)

            ctx.busy_with = f"regenerating {path} through {len(kw['servers'])} server(s)"

            def busy(what: str, path=path) -> None:  # the watchdog names the server a stall waits on
                ctx.busy_with = f"regenerating {path}: {what}"

            try:
                stats = regenerate_served(Path(path).expanduser(), out=work, ordered_out=final, progress=progress,
                                          log=lambda m: log.warning("%s: %s", ctx.name, m), check_stop=ctx.check_stop,
                                          wait=waiting, api_key=api_key, option="regenerate.servers", busy=busy,
                                          **kw)
            finally:
                ctx.busy_with = ""
            log.info("%s: %s: %d replies (%d now: %s), read from %s", ctx.name, path, stats.total, stats.generated,
                     dict(stats.reasons), final)
            out[path] = str(final)
        return out

    def _extra_options(self) -> dict[str, Any]:
        template = self.chat_template
        if template and "{" not in template and Path(template).expanduser().is_file():
            template = Path(template).expanduser().read_text()
        return {"chat_template": template, "template_kwargs": dict(self.template_kwargs)}

    def _read(self, path: str, options, **hooks):
        from dflash_flow.data.records import read_records

        path = getattr(self, "_regenerated", {}).get(path, path)
        return read_records(path, tokenizer=self._tokenizer, options=options, kind="chat", **hooks)


@attrs.define(kw_only=True, eq=False)
class TokenizedSource(_RecordSource, UsesModel):
    """Reads pre-tokenized samples (input_ids, loss_mask) from JSONL, Parquet, Arrow or datasets directories."""

    @classmethod
    def preload(cls) -> None:
        import dflash_flow.data.records  # noqa: F401

    vocab_size: Optional[int] = cfg(None, ge=1, doc="Reject token ids >= vocab_size (null: no upper check).")

    def _extra_options(self) -> dict[str, Any]:
        return {"vocab_size": self.vocab_size}

    def model_problems(self, spec, devices: list[list[str]]) -> list[tuple[str, str]]:  # noqa: ARG002
        vocab = spec.facts.vocab_size if spec.facts is not None else None
        if self.vocab_size is not None and vocab is not None and self.vocab_size > vocab:
            return [("vocab_size", f"vocab_size {self.vocab_size} admits token ids the target cannot embed: its "
                                   f"vocabulary has {vocab} tokens; use {vocab} (or the data's tokenizer's target)")]
        return []

    def _read(self, path: str, options, **hooks):
        from dflash_flow.data.records import read_records

        return read_records(path, options=options, kind="tokens", **hooks)


@attrs.define(kw_only=True, eq=False)
class EmbeddedChatSource(ChatSource):
    """The built-in chat dataset: corpus prompts answered greedily by the shipped target (cached)."""

    @classmethod
    def preload(cls) -> None:
        super().preload()
        import dflash_flow.embedded.regenerate  # noqa: F401
        import dflash_flow.embedded.train_target  # noqa: F401
        import dflash_flow.model.evaluation  # noqa: F401

    n_train: int = cfg(1024, ge=1, doc="Training conversations to build.")
    n_eval: int = cfg(64, ge=0, doc="Held-out conversations to build beside them.")
    data_seed: int = cfg(0, ge=0, doc="Seed of the prompt generator.")
    max_new_tokens: int = cfg(448, ge=1, doc="Longest regenerated reply.")
    generation_batch_size: int = cfg(32, ge=1, doc="Prompts per regeneration batch.")
    dataset_dir: str = cfg("auto", result=False, doc="Where the dataset is built and cached; 'auto' = CACHE/embedded-dataset.")

    def setup(self, ctx: StageContext) -> None:
        from dflash_flow.embedded import build_default_dataset, embedded_target_path, shipped_dataset
        from dflash_flow.model import MODEL_LOAD_LOCK

        root = cache_root() / "embedded-dataset" if self.dataset_dir == "auto" else Path(self.dataset_dir)
        target = embedded_target_path()
        ds = shipped_dataset(self.n_train, self.n_eval, self.data_seed, target, self.max_new_tokens)
        if ds is None:

            def progress(done: int, total: int, _tokens: int) -> None:
                ctx.heartbeat()  # regeneration takes minutes: it is progress, not a stall
                log.info("%s: regenerated %d/%d replies", ctx.name, done, total)

            # Regeneration loads the target: hold the model lock (other replicas load theirs after).
            with MODEL_LOAD_LOCK, ctx.busy("regenerating the embedded dataset"):
                ds = build_default_dataset(
                    root, n_train=self.n_train, n_eval=self.n_eval, seed=self.data_seed, target_path=target,
                    batch_size=self.generation_batch_size, max_new_tokens=self.max_new_tokens,
                    progress=progress, log=log.info, check_stop=ctx.check_stop,
                )
        self.paths = [str(ds.train_path)]
        self._tokenizer_dir = str(ds.target_path)  # the embedded target's own tokenizer rendered its replies
        super().setup(ctx)
