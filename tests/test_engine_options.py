"""engine/options.py: the CLI's engine flags and LLM's keywords come from
one table over EngineConfig's fields, with the dataclasses' defaults."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from trajserve.config import CacheConfig, EngineConfig, SchedulerConfig
from trajserve.engine.options import OPTIONS, add_engine_args, config_from_args, engine_config

# Fields a user does not set from the command line or LLM's keywords (none
# now: the simulator's engine options are rows of the same table).
INTERNAL: set[str] = set()


def _leaf_fields(cls, prefix="") -> set[str]:
    out = set()
    for f in dataclasses.fields(cls):
        if f.name in ("cache", "scheduler"):
            out |= _leaf_fields({"cache": CacheConfig, "scheduler": SchedulerConfig}[f.name], f.name + ".")
        else:
            out.add(prefix + f.name)
    return out


def _parse(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(list(flags))


def test_every_config_field_is_an_option_or_named_internal():
    declared = {o.field for o in OPTIONS}
    assert declared | INTERNAL == _leaf_fields(EngineConfig)
    assert not declared & INTERNAL
    assert len({o.name for o in OPTIONS}) == len({o.flag for o in OPTIONS}) == len(OPTIONS)


def test_defaults_are_the_configs_own_on_both_paths():
    assert config_from_args(_parse()) == engine_config() == EngineConfig()


def test_flags_and_keywords_reach_the_same_fields():
    args = _parse("--kv-host-cache", "4GiB", "--kv-disk-cache", "1e9", "--kv-disk-dir", "/x", "--no-prefix-caching",
                  "--threads", "3", "--max-num-batched-tokens", "256", "--no-cpu-kernels", "--chat-template", "{{ x }}",
                  "--dtype", "bfloat16", "--num-blocks", "77")
    from_cli = config_from_args(args)
    from_api = engine_config(host_cache="4GiB", disk_cache=10**9, disk_cache_dir="/x", enable_prefix_caching=False,
                             num_threads=3, max_num_batched_tokens=256, cpu_kernels=False, chat_template="{{ x }}",
                             dtype="bfloat16", num_blocks=77)
    assert from_cli == from_api
    assert from_api.cache.host_cache_bytes == 4 * 2**30 and from_api.cache.disk_cache_bytes == 10**9
    assert from_api.scheduler.max_prefill_chunk == 256  # unset: the token budget
    assert engine_config(max_prefill_chunk=64).scheduler.max_prefill_chunk == 64


def test_an_unknown_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="unknown engine option host_cahce"):
        engine_config(host_cahce="1GiB")


def test_a_bad_size_names_the_keyword_and_its_flag():
    with pytest.raises(ValueError, match=r"host_cache \(--kv-host-cache\)"):
        engine_config(host_cache="lots")


def test_llm_takes_a_config_or_keywords_not_both():
    from trajserve.llm import LLM

    with pytest.raises(TypeError, match="not both"):
        LLM(config=EngineConfig(), num_blocks=8)


def test_the_chunk_cap_defaults_to_the_budget_on_every_path():
    """One source for the default: a config built directly, from keywords and
    from flags all cap a prefill chunk at the token budget unless told."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for sc in (SchedulerConfig(max_num_batched_tokens=2048),
               engine_config(max_num_batched_tokens=2048).scheduler,
               config_from_args(parser.parse_args(["--max-num-batched-tokens", "2048"])).scheduler):
        assert (sc.max_num_batched_tokens, sc.max_prefill_chunk) == (2048, 2048)
    assert SchedulerConfig(max_num_batched_tokens=2048, max_prefill_chunk=256).max_prefill_chunk == 256


def test_configs_are_frozen_values():
    """What an engine was built with stays what its config says: a live
    scheduler's limits change through Scheduler.reconfigure, not the config."""
    for cfg, field in ((SchedulerConfig(), "max_num_seqs"), (CacheConfig(), "num_blocks"), (EngineConfig(), "dtype")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(cfg, field, 1)
