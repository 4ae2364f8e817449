"""llama-server argv building: renamed flags respelled, unknown ones dropped (pure)."""
from __future__ import annotations

from pathlib import Path

from policy.profiles import builtin_profiles
from workers.llama_server.flags import adapt, group_args, server_argv, spelling
from workers.llama_server.lane import Lane, cache_ram_mib, choose_lane

NEW = frozenset({"-m", "--host", "--port", "-np", "-c", "--kv-unified", "--slots", "--no-ui", "-t", "-fa",
                 "--flash-attn", "--metrics", "--cache-ram", "-ub", "--spec-draft-model", "-md",
                 "--spec-draft-n-max"})
OLD = frozenset({"-m", "--host", "--port", "-np", "-c", "-fa", "--metrics", "--model-draft", "-md",
                 "--draft-max", "--no-webui"})


def test_group_args_keeps_negative_values():
    assert group_args(["-fa", "on", "--metrics", "--cache-ram", "-1"]) == [
        ("-fa", ["on"]), ("--metrics", []), ("--cache-ram", ["-1"])]


def test_spelling_follows_the_binary():
    assert spelling("--draft-max", NEW) == "--spec-draft-n-max"
    assert spelling("--spec-draft-n-max", OLD) == "--draft-max"
    assert spelling("--no-ui", OLD) == "--no-webui"
    assert spelling("--bogus", NEW) is None


def test_adapt_drops_unknown_flags_with_their_values():
    assert adapt(["--cache-ram", "-1", "--metrics"], OLD) == ["--metrics"]


def test_server_argv_new_and_old_binaries():
    kw = dict(model="/m.gguf", port=1234, slots=4, kv_tokens=8192, profile_args=["-fa", "on", "--metrics"],
              draft_model="/d.gguf", draft_max=3, extra_args=["--foo"])
    new = server_argv(Path("/bin/ls"), NEW, **kw)
    assert new[0] == "/bin/ls" and new[-1] == "--foo"
    assert " ".join(new).count("--host 127.0.0.1 --port 1234") == 1
    assert "--spec-draft-model /d.gguf --spec-draft-n-max 3" in " ".join(new)
    old = server_argv(Path("/bin/ls"), OLD, **kw)
    assert "--model-draft /d.gguf --draft-max 3" in " ".join(old) and "--kv-unified" not in old


def test_cache_ram_from_the_box_unless_the_profile_or_operator_sets_it():
    kw = dict(model="/m.gguf", port=1, slots=4, kv_tokens=8192, cache_ram_mib=1497)
    assert "--cache-ram 1497 -fa on" in " ".join(server_argv(Path("/bin/ls"), NEW, profile_args=["-fa", "on"], **kw))
    for profile_args, extra in ((["-cram", "0"], []), (["--cache-ram", "-1"], []), ([], ["--cache-ram", "64"])):
        argv = server_argv(Path("/bin/ls"), NEW, profile_args=profile_args, extra_args=extra, **kw)
        assert "1497" not in argv and argv.count("--cache-ram") == 1  # theirs, once
    gib = 1 << 30
    assert cache_ram_mib(2, 1, total_bytes=24 * gib) == 1536  # the 2-core box, two models: 1.5 GiB each
    assert cache_ram_mib(1, 1, total_bytes=8 * gib) == 1024
    assert cache_ram_mib(1, 1, total_bytes=512 * gib) == 8192  # never above llama.cpp's own default
    assert cache_ram_mib(64, 2, total_bytes=gib) == 1  # never 0 (that turns the cache off)


def test_lane_choice_follows_the_speculation_policy(tmp_path):
    """Two processes (with and without the drafter): each request goes by policy.speculation's K."""
    from policy.config import LlamaServerConfig

    gb10 = builtin_profiles()["gb10"]
    spec, plain = (Lane(n, lambda: ["true"], slots=2, block_size=16, log_path=tmp_path / n,
                        cfg=LlamaServerConfig(), sink=None) for n in ("spec", "plain"))
    for lane in (spec, plain):
        lane.process.ready.set()
    lanes = [spec, plain]
    assert choose_lane(lanes, gb10, 2000, None) is spec
    assert choose_lane(lanes, gb10, 12000, None) is spec  # K 2 in the 10,240-14,335 band
    assert choose_lane(lanes, gb10, 20000, None) is plain
    assert choose_lane(lanes, gb10, 2000, 0) is plain  # the request turned speculation off
    assert choose_lane(lanes, gb10, 2000, None, schema=True) is spec
    spec.running = 15  # 16 streams with this one: no drafter wins at any context
    assert choose_lane(lanes, gb10, 2000, None) is plain


def test_profile_args_in_the_config_replace_the_profiles(tmp_path, monkeypatch):
    """workers.llama_server.profile_args takes the place of the device profile's llama_server_args (a flag such as
    --backend-sampling has no negation, so only this takes it out); extra_args still come last; unset: the profile's."""
    from policy.config import LlamaServerConfig
    from workers.llama_server import flags, lane

    monkeypatch.setattr(flags, "supported_flags", lambda binary: NEW | {"--backend-sampling", "--foo"})
    h200 = builtin_profiles()["h200"]
    assert "--backend-sampling" in h200.llama_server_args

    def argv(**cfg) -> list[str]:
        (plain,) = lane.build_lanes(LlamaServerConfig(**cfg), h200, "/m.gguf", Path("/bin/true"), 16, tmp_path, "w",
                                    sink=None)
        return plain.process.argv_for(1234)

    assert "--backend-sampling" in argv()
    replaced = argv(profile_args=["-fa", "on", "--cache-ram", "0"], extra_args=["--foo"])
    assert "--backend-sampling" not in replaced and "-ub" not in replaced and replaced[-1] == "--foo"
    assert " ".join(replaced).count("--cache-ram 0") == 1 and "-np 64" in " ".join(replaced)
    assert "--metrics" not in argv(profile_args=[])
