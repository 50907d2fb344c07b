"""Conversations to token ids and loss masks, as the chat reader always made them: rendered with the chat
template, the assistant spans masked, tokenized in batches (the tokenizer's Rust backend called directly
when it gives the same ids and offsets). ``parse.process_chunk`` hands it a chunk's records."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from .chat import (
    ChatTemplateError,
    TemplateInfo,
    parse_conversation,
    probe_template,
    render_chat,
    supervised_spans,
    token_mask,
)
from .reports import DataError, ReadOptions

_TOKENIZE_BATCH = 512


class Collector(Protocol):
    """Where the encoded samples go (``parse.ChunkCollector``): kept ones offered, bad ones reported by line."""

    def bad(self, line: int, kind: str, reason: str) -> None: ...

    def offer(self, line: int, ids: np.ndarray, mask: np.ndarray) -> None: ...


class ChatEncoder:
    """Renders, masks and tokenizes conversations exactly as the chat reader always has, with the
    tokenizer's Rust backend called directly when it is equivalent to the transformers call (checked on
    the first texts it sees), which saves that call's per-token Python objects."""

    def __init__(self, tokenizer: Any, options: ReadOptions, path: str = "input"):
        if not getattr(tokenizer, "is_fast", False):
            raise DataError("chat loss masks need a fast tokenizer (offset mapping); got a slow tokenizer")
        self.tokenizer = tokenizer
        self.template = options.chat_template or getattr(tokenizer, "chat_template", None)
        if not self.template:
            raise DataError(f"{path}: the tokenizer has no chat template and ReadOptions.chat_template is not set")
        self.kwargs = dict(options.template_kwargs)
        try:
            self.info: TemplateInfo = probe_template(tokenizer, chat_template=self.template, template_kwargs=self.kwargs)
        except ChatTemplateError as exc:
            raise DataError(f"chat template unusable for loss masks: {exc}") from exc
        self.vocab = options.vocab_size or len(tokenizer)
        self._backend: Any = None
        self._checked = False

    def _fast_backend(self):
        from tokenizers import Tokenizer

        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        try:
            copy = Tokenizer.from_str(backend.to_str())  # never change the caller's tokenizer
            copy.no_truncation()
            copy.no_padding()
            copy.encode_special_tokens = bool(getattr(self.tokenizer, "split_special_tokens", False))
        except Exception:  # noqa: BLE001 - an older or unusual backend: the transformers call it is
            return None
        return copy

    def _slow(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        enc = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        return [(np.asarray(i, dtype=np.int64), np.asarray(o, dtype=np.int64)) for i, o in
                zip(enc["input_ids"], enc["offset_mapping"], strict=True)]

    def encode(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids int64 [n], offsets int64 [n, 2]) per text."""
        if not self._checked:
            self._checked = True
            backend = self._fast_backend()
            if backend is not None:
                probe = texts[:4]
                fast = [(np.asarray(e.ids, dtype=np.int64), np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2))
                        for e in backend.encode_batch(probe, add_special_tokens=False)]
                slow = self._slow(probe)
                same = all(np.array_equal(a[0], b[0]) and np.array_equal(a[1].reshape(-1, 2), b[1].reshape(-1, 2))
                           for a, b in zip(fast, slow, strict=True))
                self._backend = backend if same else None
        if self._backend is None:
            return self._slow(texts)
        out = []
        chain = itertools.chain.from_iterable
        for e in self._backend.encode_batch(texts, add_special_tokens=False):
            n = len(e.ids)
            out.append((np.array(e.ids, dtype=np.int64),
                        np.fromiter(chain(e.offsets), dtype=np.int64, count=2 * n).reshape(n, 2)))
        return out

    def process(self, records: Iterator[tuple[int, dict]], col: Collector) -> None:
        pending: list[tuple[int, str, list[tuple[int, int]]]] = []

        def flush() -> None:
            if not pending:
                return
            for (line, _text, spans), (ids, offs) in zip(pending, self.encode([p[1] for p in pending]), strict=True):
                mask = token_mask(offs, spans)
                if ids.size and int(ids.max()) >= self.vocab:
                    col.bad(line, "out_of_vocab", f"token id {int(ids.max())} >= vocab size {self.vocab}")
                    continue
                col.offer(line, ids, mask)
            pending.clear()

        for line, obj in records:
            if isinstance(obj, dict) and obj.get("finish_reason") == "error":  # `regenerate` wrote no reply
                col.bad(line, "regenerate_error", f"a row regenerate could not answer ({obj.get('error', 'no reply')}); "
                        "`dflash-flow regenerate --retry-errors` tries it again")
                continue
            msgs, kind, reason = parse_conversation(obj)
            if msgs is None:
                col.bad(line, kind, reason)
                continue
            try:
                text = render_chat(self.tokenizer, msgs, chat_template=self.template, template_kwargs=self.kwargs)
                spans = supervised_spans(text, msgs, self.info)
            except ChatTemplateError as exc:
                col.bad(line, "template", str(exc))
                continue
            if not spans:
                col.bad(line, "no_supervised", "no assistant turn with content: nothing to supervise")
                continue
            pending.append((line, text, spans))
            if len(pending) >= _TOKENIZE_BATCH:
                flush()
        flush()
