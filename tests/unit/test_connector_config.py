"""Connector settings and statistics. Pure logic, no engine: these run in ``make test``."""

from __future__ import annotations

import pytest

from kvstore_client.connectors.config import SGLANG_OWN_KEYS, ConnectorConfig
from kvstore_client.connectors.stats import Counters, merge_stats, reduce_stats, stats_empty


def test_config_parsing() -> None:
    with pytest.raises(ValueError, match="master"):
        ConnectorConfig.from_dict({})
    c = ConnectorConfig.from_dict({"master": "h:1", "min_hit_tokens": "64",
                                   "prefill_tokens_per_s": 5000})  # fmt: skip
    assert c.min_hit_tokens == 64 and c.prefill_tokens_per_s == 5000.0
    assert c.lookup_timeout_s == 0.05 and c.load_failure_policy == "recompute"
    assert c.lookup_concurrency == 4 and c.max_pending_load_mb == 1024
    assert ConnectorConfig.from_dict({"kvstore_master": "h:2"}).master == "h:2"
    with pytest.raises(ValueError):
        ConnectorConfig.from_dict({"master": "h:1", "load_failure_policy": "ignore"})


def test_config_rejects_unknown_keys_and_bad_values() -> None:
    """Bug (old code): a misspelt key was ignored and its default used silently."""
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['lookup_timeout'\]") as e:
        ConnectorConfig.from_dict({"master": "h:1", "lookup_timeout": 1})
    assert "lookup_timeout_s" in str(e.value)  # the known keys are listed
    with pytest.raises(ValueError, match="must be a number"):
        ConnectorConfig.from_dict({"master": "h:1", "timeout_s": "soon"})
    with pytest.raises(ValueError, match="must be positive"):
        ConnectorConfig.from_dict({"master": "h:1", "lookup_concurrency": 0})
    # SGLang's own keys in its extra config are allowed where the caller says so
    extra = {"master": "h:1", **dict.fromkeys(SGLANG_OWN_KEYS, "x")}
    with pytest.raises(ValueError):
        ConnectorConfig.from_dict(extra)
    assert ConnectorConfig.from_dict(extra, ignore=SGLANG_OWN_KEYS).master == "h:1"


def test_counters_interval_merge_and_reduce() -> None:
    c = Counters()
    c.add("stored_blocks", 3)
    c.observe("store_seconds", 0.002)
    c.observe("store_seconds", 0.004)
    d = c.take()
    assert d["stored_blocks"] == 3 and c.take()["stored_blocks"] == 0  # a new interval
    m = merge_stats(d, {**Counters().take(), "stored_blocks": 2, "store_seconds": [0.006]})
    assert m["stored_blocks"] == 5 and len(m["store_seconds"]) == 3
    r = reduce_stats(m)
    assert r["stored_blocks"] == 5 and r["store_count"] == 3
    assert r["store_mean_ms"] == 4.0 and r["store_max_ms"] == 6.0
    assert stats_empty(Counters().take()) and not stats_empty(m)


def test_ablation_settings() -> None:
    """save_policy / lookup / load_mode / lookup_inline: defaults, every value, and a clear error
    (naming the setting and its values) for anything else."""
    c = ConnectorConfig.from_dict({"master": "h:1"})
    assert (c.save_policy, c.lookup, c.load_mode) == ("new", "batch", "auto")
    assert c.ablations() == []
    c = ConnectorConfig.from_dict(
        {"master": "h:1", "save_policy": "all", "lookup": "per_block", "load_mode": "sync"}
    )
    assert (c.save_policy, c.lookup, c.load_mode) == ("all", "per_block", "sync")
    assert c.ablations() == ["save_policy=all", "lookup=per_block", "load_mode=sync"]
    assert ConnectorConfig.from_dict({"master": "h:1", "lookup": "prefix"}).lookup == "prefix"
    c = ConnectorConfig.from_dict({"master": "h:1", "lookup_inline": "false"})
    assert c.lookup_inline is False and c.ablations() == ["lookup_inline=false"]
    c = ConnectorConfig.from_dict({"master": "h:1", "hit_past_local": "false"})
    assert c.hit_past_local is False and c.ablations() == ["hit_past_local=false"]
    with pytest.raises(ValueError, match="hit_past_local"):
        ConnectorConfig.from_dict({"master": "h:1", "hit_past_local": "maybe"})
    for key, bad, msg in [
        ("save_policy", "everything", r'save_policy must be "new" or "all", not \'everything\''),
        ("lookup", "batched", r'lookup must be "batch" or "per_block" or "prefix"'),
        (
            "load_mode",
            "blocking",
            r'load_mode must be "auto" or "async" or "sync", not \'blocking\'',
        ),
        ("load_mode", "", "load_mode must be"),
    ]:
        with pytest.raises(ValueError, match=msg):
            ConnectorConfig.from_dict({"master": "h:1", key: bad})
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['load'\]"):
        ConnectorConfig.from_dict({"master": "h:1", "load": "sync"})


def test_every_counter_has_its_prometheus_metric() -> None:
    """Bug (first sync-load engine run): a new counter without a Prometheus metric
    raised KeyError in ``record`` inside the engine."""
    from kvstore_client.connectors.stats import COUNTER_NAMES, TOTALS, record

    for name in COUNTER_NAMES:
        before = TOTALS.peek()[name]
        record("test", None, name, 1)
        assert TOTALS.peek()[name] == before + 1


def test_switches_refuse_words_they_do_not_know() -> None:
    """Issue 25: zero_copy "maybe" was silently False."""
    for key in ("zero_copy", "session_hints", "save_ended"):
        with pytest.raises(ValueError, match=f"{key} must be true or false.*'maybe'"):
            ConnectorConfig.from_dict({"master": "h:1", key: "maybe"})
        with pytest.raises(ValueError, match=key):
            ConnectorConfig.from_dict({"master": "h:1", key: 2})
    for text, want in (("off", False), ("No", False), (" TRUE ", True), (0, False), (True, True)):
        assert ConnectorConfig.from_dict({"master": "h:1", "zero_copy": text}).zero_copy is want


def test_a_sessions_last_turn_is_not_saved_unless_asked() -> None:
    assert ConnectorConfig.from_dict({"master": "h:1"}).save_ended is False
    assert ConnectorConfig.from_dict({"master": "h:1", "save_ended": "on"}).save_ended is True


def test_an_unknown_key_is_named_with_the_nearest_known_one() -> None:
    """Issue 43: a typo names the key and the setting it most likely meant."""
    from kvstore_client.connectors.config import nearest_key

    cases = {
        "mastr": "master",
        "lookup_timeout": "lookup_timeout_s",
        "zero-copy": "zero_copy",
        "timeout": "timeout_s",
        "Load_Mode": "load_mode",
        "stagingmb": "staging_mb",
    }
    known = ConnectorConfig.known_keys()
    for typo, meant in cases.items():
        assert nearest_key(typo, known) == meant, typo
        with pytest.raises(ValueError, match=rf"'{typo}': did you mean '{meant}'\?"):
            ConnectorConfig.from_dict({"master": "h:1", typo: 1})
    assert nearest_key("xyzzy", known) is None
    with pytest.raises(ValueError) as e:
        ConnectorConfig.from_dict({"master": "h:1", "xyzzy": 1})
    assert "did you mean" not in str(e.value) and "known:" in str(e.value)
