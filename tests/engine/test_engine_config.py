"""model.engine (engine.config): strict structure with located messages, the checks bounds cannot express, and
the server <-> local path mapping."""

from __future__ import annotations

import pytest

from dflash_flow.engine.config import EngineConfig, engine_config_from


@pytest.mark.parametrize("value, message", [
    ({}, "needs servers .* or launch"),
    ({"servers": ["gpu1:8000"]}, "not an http\\(s\\) URL"),
    ({"servers": ["http://a:1", "http://a:1"]}, "listed twice"),
    ({"launch": {"count": 2, "devices": ["0"]}}, "1 device groups for 2 servers"),
    ({"servers": ["http://a:1"], "features_dir": "rel/dir"}, "absolute path"),
    ({"servers": ["http://a:1"], "spread": "random"}, "spread"),
    ({"servers": ["http://a:1"], "concurrency": 0}, "concurrency"),
    ({"servers": ["http://a:1"], "launch": {"tp": 0}}, "launch.tp"),
    ({"servers": ["http://a:1"], "timeout": 3}, "unknown field 'timeout'.*timeout_s"),
])
def test_bad_engine_sections_are_refused_saying_what_to_change(value, message):
    with pytest.raises(ValueError, match=message):
        engine_config_from(value)


def test_paths_map_between_the_servers_mount_and_ours():
    cfg = EngineConfig(servers=["http://a:1"], features_dir="/mnt/shared/feats",
                       path_map={"/shared": "/mnt/shared", "/shared/special": "/fast"})
    assert cfg.local_path("/shared/feats/x.safetensors") == "/mnt/shared/feats/x.safetensors"
    assert cfg.local_path("/shared/special/y.safetensors") == "/fast/y.safetensors"  # the longest prefix wins
    assert cfg.local_path("/sharedX/z") == "/sharedX/z"  # a prefix is a whole path component
    assert cfg.server_features_dir() == "/shared/feats"
    assert EngineConfig(servers=["http://a:1"]).server_features_dir() == "/dev/shm/dflash-flow-features"
