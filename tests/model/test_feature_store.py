"""The feature store on disk (``model.feature_store``): dtypes and fp8 scales, sharded files with a manifest,
random access by sample id, atomic shards, resumed builds, several ranks, the lock, a full disk, damaged and
missing shards, a read-only filesystem, and the identity a store is refused by.

Real files in a temporary directory, real threads and processes; rows from a real tiny target (the
in-process extractor) where values matter, from a seeded function where only the bookkeeping does."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from store_testlib import LAYERS, ThreadComm, can_mount, extractor_compute, make_samples, read_only, tmpfs

from dflash_flow.model.feature_store import (
    CODECS,
    FP8_MAX,
    MANIFEST,
    FeatureStore,
    FeatureStoreError,
    StoreLock,
    StoreMismatch,
    build_store,
    compare_identity,
    estimate_bytes,
    token_digest,
)
from dflash_flow.model.features import TargetFeatureExtractor
from dflash_flow.model.target import load_target

pytestmark = pytest.mark.usefixtures("one_thread")

IDENTITY = {"target": {"config": "c1", "weights": "w1"}, "layer_ids": LAYERS, "tokenizer": "t1",
            "chat_template": "ct1", "template_kwargs": {"enable_thinking": False}}
W = 24


def seeded_row(sid: int, n: int, width: int = W) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(int(sid))) * (1 + sid % 7)


def seeded_compute(calls: list[int] | None = None, fail_after: int | None = None):
    def compute(batch):
        out = []
        for sid, toks in batch:
            if fail_after is not None and calls is not None and calls[0] >= fail_after:
                raise KeyboardInterrupt("killed mid-build")
            if calls is not None:
                calls[0] += 1
            out.append(seeded_row(sid, len(toks)))
        return out

    return compute


def build(root, samples, *, dtype="fp32", identity=IDENTITY, calls=None, **kw):
    kw.setdefault("shard_bytes", 4096)
    kw.setdefault("margin_bytes", 0)
    return build_store(root, identity=identity, dtype=dtype, width=W, samples=samples, compute=seeded_compute(calls),
                       **kw)


@pytest.fixture(scope="module")
def extractor():
    return TargetFeatureExtractor(load_target("tiny-qwen3-8l"), LAYERS)


# -- dtypes ---------------------------------------------------------------------------------------------

def test_each_dtype_stores_its_bytes_per_token_and_reads_back_within_its_precision():
    x = torch.randn(37, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 37)[:, None]
    x[5] = 0  # a zero token keeps scale 1 and stays zero
    for name, c in CODECS.items():
        payload = c.encode(x)
        assert payload.nbytes == c.row_bytes(37, 96) == 37 * c.bytes_per_token(96)
        back = c.decode(payload, 37, 96, torch.float32)
        if name == "fp32":
            assert torch.equal(back, x)
        elif name in ("bf16", "fp16"):
            ref = x.to(c.torch_dtype).float()
            assert torch.equal(back, ref)
        else:  # e4m3: 3 mantissa bits, a scale per token: every value within 1/16 of its token's largest
            amax = x.abs().amax(-1, keepdim=True)
            assert ((back - x).abs() <= amax / 16 + 1e-30).all()
            assert not back[5].any()
            scales = torch.from_numpy(payload[37 * 96 :].copy().view(np.float32))
            assert torch.allclose(scales[amax[:, 0] > 0], (amax[:, 0] / FP8_MAX)[amax[:, 0] > 0])
    assert [CODECS[d].bytes_per_token(4096 * 5) for d in ("fp32", "bf16", "fp16", "fp8")] == [81920, 40960, 40960, 20484]


# -- build, read, resume -----------------------------------------------------------------------------------

def test_a_build_writes_shards_and_a_manifest_and_reads_any_sample_at_random(tmp_path, extractor):
    samples, toks = make_samples(40, first_id=1000)
    calls = [0]
    r = build_store(tmp_path / "s", identity=IDENTITY, dtype="fp32", width=128, samples=samples,
                    compute=extractor_compute(extractor, calls), shard_bytes=20_000, margin_bytes=0)
    assert r.complete and r.samples == 40 and r.computed == 40 == calls[0] and r.reused == 0
    m = json.loads((tmp_path / "s" / MANIFEST).read_text())
    assert len(m["shards"]) > 3 and m["complete"] and m["dtype"] == "fp32" and m["identity"]["layer_ids"] == LAYERS
    assert m["identity"]["tokens"] is not None  # the samples' identity, added by the build
    covered = sorted(i for s in m["shards"] for a, b in s["ids"] for i in range(a, b))
    assert covered == list(range(1000, 1040))
    # No compression: a shard is its rows (plus alignment, index, meta and trailer)
    assert m["bytes"] <= estimate_bytes(r.tokens, 40, 128, "fp32") + 4096 * len(m["shards"])
    assert m["bytes"] >= r.tokens * 128 * 4
    with FeatureStore(tmp_path / "s") as store:
        assert len(store) == 40 and 1000 in store and 999 not in store
        for i in np.random.default_rng(1).permutation(40):
            ids = torch.as_tensor(toks[i], dtype=torch.long)[None]
            alone = extractor(ids, torch.ones_like(ids))[0]
            assert torch.equal(store.row(1000 + int(i)), alone)  # fp32: bit for bit
            out = torch.empty_like(alone)
            assert store.read_into(out, 1000 + int(i), tokens=token_digest(toks[i]))
            assert torch.equal(out, alone)
        with pytest.raises(FeatureStoreError, match="tokens of sample 1003 differ"):
            store.read_into(torch.empty(len(toks[3]), 128), 1003, tokens=token_digest(toks[3][::-1]))


def test_a_build_stopped_midway_resumes_computing_only_what_is_missing_and_equals_an_uninterrupted_one(tmp_path):
    samples, _ = make_samples(30)
    calls = [0]
    with pytest.raises(KeyboardInterrupt, match="finished and kept"):
        build_store(tmp_path / "a", identity=IDENTITY, dtype="bf16", width=W, samples=samples, shard_bytes=1500,
                    margin_bytes=0, compute=seeded_compute(calls, fail_after=17))
    m = json.loads((tmp_path / "a" / MANIFEST).read_text())
    kept = m["samples"]
    assert 0 < kept <= 17 and not m["complete"]  # finished shards recorded; a shard being written is gone
    assert not [p for p in (tmp_path / "a" / "shards").iterdir() if p.name.endswith(".tmp")]
    calls2 = [0]
    r = build(tmp_path / "a", samples, dtype="bf16", calls=calls2, shard_bytes=1500)
    assert r.complete and r.reused == kept and calls2[0] == 30 - kept == r.computed
    build(tmp_path / "b", samples, dtype="bf16", shard_bytes=1500)
    with FeatureStore(tmp_path / "a") as a, FeatureStore(tmp_path / "b") as b:
        for sid in range(30):
            assert torch.equal(a.row(sid), b.row(sid))
    assert build(tmp_path / "a", samples, dtype="bf16", shard_bytes=1500).computed == 0  # done: nothing to do


def test_ranks_write_their_shares_into_one_store_with_one_manifest(tmp_path):
    samples, _ = make_samples(50, seed=3)
    comms = ThreadComm.group(3)
    results, errors = [None] * 3, []

    def rank(r):
        try:
            results[r] = build(tmp_path / "s", samples, comm=comms[r], shard_bytes=3000)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sum(r.computed for r in results[:1]) == 50 and all(r.complete for r in results)
    names = sorted(p.name for p in (tmp_path / "s" / "shards").iterdir())
    assert {n.split("-")[1] for n in names} == {"r00000", "r00001", "r00002"}  # each rank its own names
    assert sorted(p.name for p in (tmp_path / "s" / "ranks").iterdir()) == [f"g0000-r0000{r}.json" for r in range(3)]
    with FeatureStore(tmp_path / "s") as store:
        assert store.sample_ids().tolist() == list(range(50))
        for sid in range(50):
            assert torch.equal(store.row(sid), seeded_row(sid, int(samples.lengths[sid])))


# -- identity ---------------------------------------------------------------------------------------------

def test_a_store_for_another_target_tokenizer_template_or_layers_is_refused_naming_the_field(tmp_path):
    samples, _ = make_samples(6)
    build(tmp_path / "s", samples)
    for change, field in ((("target", {"config": "c1", "weights": "w2"}), "target.weights"),
                          (("target", {"config": "c2", "weights": "w1"}), "target.config"),
                          (("tokenizer", "t2"), "tokenizer"), (("chat_template", "ct2"), "chat_template"),
                          (("template_kwargs", {"enable_thinking": True}), "template_kwargs"),
                          (("layer_ids", [1, 6]), "layer_ids")):
        other = {**IDENTITY, change[0]: change[1]}
        assert [f for f, _, _ in compare_identity(json.loads((tmp_path / "s" / MANIFEST).read_text())["identity"], other)] == [field]
        with pytest.raises(StoreMismatch, match=f"built for another {field} "):
            build(tmp_path / "s", samples, identity=other)
    with pytest.raises(StoreMismatch, match="another dtype"):
        build(tmp_path / "s", samples, dtype="fp8")
    other_data, _ = make_samples(6, seed=9)  # the same ids, other tokens
    with pytest.raises(StoreMismatch, match="another tokens"):
        build(tmp_path / "s", other_data)


# -- faults -----------------------------------------------------------------------------------------------

def test_a_truncated_or_missing_shard_is_named_with_what_to_do_and_the_build_repairs_it(tmp_path):
    samples, _ = make_samples(20)
    build(tmp_path / "s", samples, shard_bytes=2000)
    m = json.loads((tmp_path / "s" / MANIFEST).read_text())
    first, second = (tmp_path / "s" / m["shards"][0]["file"]), (tmp_path / "s" / m["shards"][1]["file"])
    os.truncate(first, first.stat().st_size - 100)
    second_ids = [i for a, b in m["shards"][1]["ids"] for i in range(a, b)]
    first_ids = [i for a, b in m["shards"][0]["ids"] for i in range(a, b)]
    with FeatureStore(tmp_path / "s") as store:  # opens (shards are mapped when read) ...
        assert torch.equal(store.row(second_ids[0]), seeded_row(second_ids[0], int(samples.lengths[second_ids[0]])))
        with pytest.raises(FeatureStoreError, match=rf"{first.name} has \d+ bytes, the manifest says .*features build"):
            store.row(first_ids[0])  # ... and a read of the damaged one names it and what to do
    second.unlink()
    with pytest.raises(FeatureStoreError, match=rf"shard\(s\) shards/{second.name} missing: run `dflash-flow features "
                       "build PIPELINE` again"):
        FeatureStore(tmp_path / "s")
    calls = [0]
    r = build(tmp_path / "s", samples, shard_bytes=2000, calls=calls)
    assert r.complete and calls[0] == len(first_ids) + len(second_ids)
    assert sorted(r.removed) == sorted([m["shards"][0]["file"], m["shards"][1]["file"]])
    with FeatureStore(tmp_path / "s") as store:
        for sid in first_ids + second_ids:
            assert torch.equal(store.row(sid), seeded_row(sid, int(samples.lengths[sid])))


class FullDisk:
    """A write that finds the disk full once ``room`` bytes were written (until space is 'freed')."""

    def __init__(self, room: int):
        self.room, self.written = room, 0

    def __call__(self, f, data) -> None:
        if self.written + len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.written += len(data)
        f.write(data)


def test_a_full_disk_keeps_the_finished_shards_and_the_build_resumes_once_space_is_freed(tmp_path):
    samples, _ = make_samples(30)
    with pytest.raises(FeatureStoreError, match=r"disk of feature store .* is full .* finished and kept; free space"):
        build(tmp_path / "s", samples, shard_bytes=2000, write=FullDisk(9000))
    m = json.loads((tmp_path / "s" / MANIFEST).read_text())
    assert m["samples"] > 0 and not m["complete"]
    assert not [p for p in (tmp_path / "s" / "shards").iterdir() if p.name.startswith(".")]  # no half shard
    calls = [0]
    r = build(tmp_path / "s", samples, shard_bytes=2000, calls=calls)
    assert r.complete and calls[0] == 30 - m["samples"]


@pytest.mark.skipif(not can_mount(), reason="mounting a tmpfs needs root with CAP_SYS_ADMIN (the injected full disk "
                    "above runs everywhere)")
def test_a_real_filesystem_filling_up_during_the_build(tmp_path):
    samples, _ = make_samples(40, lo=20, hi=30)  # about 25 KB of fp32 rows
    with tmpfs(tmp_path / "small", "256k") as mnt:
        filler = mnt / "someone-else.bin"
        base = seeded_compute()

        def compute(batch):  # another process takes the space once the estimate has passed
            if not filler.exists():
                import shutil

                filler.write_bytes(bytes(shutil.disk_usage(mnt).free - 8192))
            return base(batch)

        with pytest.raises(FeatureStoreError, match="is full .* finished and kept; free space"):
            build_store(mnt / "s", identity=IDENTITY, dtype="fp32", width=W, samples=samples, compute=compute,
                        shard_bytes=3000, margin_bytes=0)
        kept = len([p for p in (mnt / "s" / "shards").iterdir() if not p.name.startswith(".")])
        filler.unlink()
        calls = [0]
        r = build(mnt / "s", samples, shard_bytes=3000, calls=calls)
        assert r.complete and r.reused + calls[0] == 40 and (kept == 0 or r.reused > 0)
        with FeatureStore(mnt / "s") as store:
            assert all(torch.equal(store.row(i), seeded_row(i, int(samples.lengths[i]))) for i in range(40))


def test_a_build_that_cannot_fit_is_refused_before_a_byte_is_written_with_both_numbers(tmp_path):
    samples, _ = make_samples(10)
    seen = []
    with pytest.raises(FeatureStoreError, match=r"needs [\d.,]+ [MG]B for 10 samples .* has [\d.,]+ [MG]B free"):
        build(tmp_path / "s", samples, margin_bytes=10**18, on_estimate=lambda *a: seen.append(a))
    need, free, tokens, n = seen[0]
    assert need == estimate_bytes(int(samples.lengths.sum()), 10, W, "fp32") and n == 10 and free > 0
    assert not list((tmp_path / "s" / "shards").iterdir())


HOLDER = """
import sys
from dflash_flow.model.feature_store import StoreLock
lock = StoreLock(sys.argv[1])
lock.acquire(exclusive=True, what="another build")
print("locked", flush=True)
sys.stdin.readline()
lock.release()
"""


def test_two_builders_of_one_store_one_is_refused_or_waits_and_nothing_interleaves(tmp_path):
    samples, _ = make_samples(10)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "s")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(FeatureStoreError, match=rf"locked by another build \(pid {holder.pid} on .*--wait"):
            build(tmp_path / "s", samples)
        waited, result = threading.Event(), []

        def waiting(owner, seconds):
            waited.set()

        t = threading.Thread(target=lambda: result.append(build(tmp_path / "s", samples, wait_s=float("inf"),
                                                                on_wait=waiting)))
        t.start()
        assert waited.wait(60)
        assert not result and not (tmp_path / "s" / MANIFEST).exists()  # nothing written while it waits
        holder.stdin.write("\n")
        holder.stdin.flush()
        t.join(120)
        assert result and result[0].complete
    finally:
        holder.kill()
        holder.wait()


def test_a_store_on_a_read_only_filesystem_is_read(tmp_path):
    samples, _ = make_samples(8)
    build(tmp_path / "s", samples)
    with read_only(tmp_path / "s", tmp_path / "ro") as ro:
        with pytest.raises(OSError) as info:
            (ro / "probe").write_text("x")
        assert info.value.errno in (errno.EROFS, errno.EACCES)
        with FeatureStore(ro) as store:
            for sid in range(8):
                assert torch.equal(store.row(sid), seeded_row(sid, int(samples.lengths[sid])))
        with pytest.raises((FeatureStoreError, OSError)):
            StoreLock(ro).acquire(exclusive=True)


def test_the_features_section_names_what_cannot_work_together():
    from dflash_flow.model.spec import FeaturesConfig

    assert FeaturesConfig().problems() == []
    assert [f for f, _ in FeaturesConfig(mode="offline").problems()] == ["path"]
    assert "features build PIPELINE" in FeaturesConfig(mode="offline").problems()[0][1]
    assert [f for f, _ in FeaturesConfig(mode="online", path="/x").problems()] == ["path"]
    assert FeaturesConfig(mode="hybrid").problems() == []  # RAM only: the cache of today
    with pytest.raises(ValueError):
        FeaturesConfig(dtype="int8")
