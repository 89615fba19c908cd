"""Keys, bitmaps, block hashing, config parsing and precedence, error mapping."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from kvstore.config import load_config, parse_duration, parse_size
from kvstore_client import errors
from kvstore_client.keys import (
    Keys,
    check_hashes,
    check_namespace,
    from_bitmap,
    leading_run,
    pack_hashes,
    split_hashes,
    to_bitmap,
)
from kvstore_client.prefix import block_hashes


@pytest.mark.parametrize("ns", ["llama3-8b/bf16/b16/tp0of2", "m", "a_b/c.d:e+f=g@h"])
def test_good_namespaces(ns: str) -> None:
    assert check_namespace(ns) == ns


@pytest.mark.parametrize("ns", ["", "/a", "a/", "a//b", "a/../b", "sp ace", "x" * 256, "é", 5])
def test_bad_namespaces(ns: object) -> None:
    with pytest.raises(errors.InvalidArgument):
        check_namespace(ns)


def test_hash_checks_and_packing() -> None:
    check_hashes([b"x" * 16])
    with pytest.raises(errors.InvalidArgument, match="hash 1 must be 16 bytes, got 15 bytes"):
        check_hashes([b"x" * 16, b"x" * 15])
    with pytest.raises(errors.InvalidArgument):
        check_hashes(b"x" * 16)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgument):
        split_hashes(b"x" * 17)
    assert split_hashes(b"a" * 16 + b"b" * 16) == [b"a" * 16, b"b" * 16]


def test_keys_are_checked_once_and_behave_as_the_list() -> None:
    hs = [bytes([i]) * 16 for i in range(40)]
    k = Keys(hs)
    assert len(k) == 40 and list(k) == hs and k[3] == hs[3] and k[-1] == hs[-1]
    assert k[2:5] == hs[2:5] and k.packed == b"".join(hs) == pack_hashes(k)
    check_hashes(k)  # made checked: nothing to do
    assert Keys(k) == k == Keys.frombytes(bytearray(k.packed)) and hash(k) == hash(Keys(hs))
    assert Keys.frombytes(k.packed)[7] == hs[7] and len(Keys()) == 0
    for bad in ([b"x" * 16, b"x" * 15], [b"x" * 16, "x" * 16], b"x" * 32, [bytearray(16)]):
        with pytest.raises(errors.InvalidArgument):
            Keys(bad)  # type: ignore[arg-type]
    for raw in (b"x" * 17, "x" * 16):
        with pytest.raises(errors.InvalidArgument, match="multiple of 16"):
            Keys.frombytes(raw)  # type: ignore[arg-type]


def test_key_of_makes_a_key_from_any_bytes() -> None:
    import xxhash

    from kvstore_client import key_of

    with pytest.raises(errors.InvalidArgument, match=r"16-byte hashes.*key_of"):
        check_hashes([b"ab"])  # the error names the helper
    k = key_of(b"ab")
    check_hashes([k])
    assert k == xxhash.xxh3_128_digest(b"ab") == key_of("ab") == key_of(memoryview(b"ab"))
    assert key_of(b"ab") != key_of(b"ac")
    with pytest.raises(errors.InvalidArgument):
        key_of(12)  # type: ignore[arg-type]


def test_bitmap_roundtrip() -> None:
    flags = [True, False, True, True, False, False, False, True, True]
    assert from_bitmap(to_bitmap(flags), len(flags)) == flags
    assert to_bitmap([True]) == b"\x01"
    assert leading_run(flags) == 1 and leading_run([True, True]) == 2


def test_block_hashes_chain_and_only_full_blocks() -> None:
    toks = list(range(100))
    h = block_hashes(toks, 16)
    assert len(h) == 6 and all(len(x) == 16 for x in h)
    assert block_hashes(toks[:48], 16) == h[:3], "equal prefixes give equal hashes"
    other = block_hashes([1, *toks[1:]], 16)
    assert all(a != b for a, b in zip(h, other, strict=True)), "a change propagates down the chain"
    assert block_hashes(toks, 16, extra=b"lora7") != h


def test_block_hashes_do_not_depend_on_pythonhashseed() -> None:
    code = (
        "import sys; sys.path.insert(0, 'client');"
        "from kvstore_client.prefix import block_hashes;"
        "print(b''.join(block_hashes(list(range(64)), 16)).hex())"
    )
    outs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.check_output([sys.executable, "-c", code], env=env, text=True))
    assert len(outs) == 1


def test_sizes_and_durations() -> None:
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5KiB") == 1536
    assert parse_size("4GB") == 4_000_000_000
    assert parse_size(4096) == 4096
    assert parse_duration("500ms") == 0.5
    assert parse_duration("2m") == 120
    assert parse_duration(3) == 3.0
    for bad in ("lots", "4XB", "-1GiB"):
        with pytest.raises(errors.InvalidArgument):
            parse_size(bad)
    with pytest.raises(errors.InvalidArgument):
        parse_duration("soon")


def test_config_precedence_file_env_flags(tmp_path: Path) -> None:
    f = tmp_path / "kv.yaml"
    f.write_text("worker:\n  dram_size: 2GiB\n  tcp_port: 7000\nmaster:\n  worker_ttl: 20s\n")
    cfg = load_config(str(f), environ={})
    assert cfg.worker.dram_size == 2 << 30 and cfg.master.worker_ttl == 20.0
    env = {"KVSTORE_WORKER_DRAM_SIZE": "3GiB", "KVSTORE_WORKER_TCP_PORT": "7001"}
    cfg = load_config(str(f), environ=env)
    assert cfg.worker.dram_size == 3 << 30 and cfg.worker.tcp_port == 7001
    cfg = load_config(str(f), {"worker": {"dram_size": "4GiB", "tcp_port": None}}, environ=env)
    assert cfg.worker.dram_size == 4 << 30, "flags win"
    assert cfg.worker.tcp_port == 7001, "an unset flag keeps the lower layer"


def test_config_rejects_typos(tmp_path: Path) -> None:
    f = tmp_path / "kv.yaml"
    f.write_text("worker:\n  dram_sise: 2GiB\n")
    with pytest.raises(errors.InvalidArgument, match="unknown worker setting 'dram_sise'"):
        load_config(str(f), environ={})
    with pytest.raises(errors.InvalidArgument, match="unknown worker setting"):
        load_config(None, environ={"KVSTORE_WORKER_NOPE": "1"})


def test_error_mapping_is_one_table() -> None:
    assert errors.to_grpc_code(errors.InvalidArgument("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert errors.to_grpc_code(errors.NotFound("x")) == grpc.StatusCode.NOT_FOUND
    assert errors.to_grpc_code(errors.ResourceExhausted("x")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert errors.to_grpc_code(errors.Unavailable("x")) == grpc.StatusCode.UNAVAILABLE
    assert errors.to_grpc_code(RuntimeError()) == grpc.StatusCode.INTERNAL
    for cls in (errors.InvalidArgument, errors.ResourceExhausted, errors.PermissionDenied):
        assert type(errors.from_code(int(cls.code), "m")) is cls


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"KVSTORE_WORKER_TLS_CLIENT_AUTH": "enabled"}, "worker.tls_client_auth"),
        ({"KVSTORE_WORKER_TLS_CLIENT_AUTH": "y"}, "worker.tls_client_auth"),
        ({"KVSTORE_MASTER_TLS_CLIENT_AUTH": "2"}, "master.tls_client_auth"),
        ({"KVSTORE_WORKER_GRPC_PORT": "99999"}, "worker.grpc_port"),
        ({"KVSTORE_WORKER_TCP_PORT": "65536"}, "worker.tcp_port"),
        ({"KVSTORE_WORKER_TCP_PORT": "-5"}, "worker.tcp_port"),
        ({"KVSTORE_WORKER_UCX_PORT": "-2"}, "worker.ucx_port"),
        ({"KVSTORE_MASTER_PORT": "7.5"}, "master.port"),
        ({"KVSTORE_MASTER_WORKER_TTL": "0"}, "master.worker_ttl"),
        ({"KVSTORE_WORKER_DRAM_LOW": "0.99"}, "worker.dram_low"),
        ({"KVSTORE_WORKER_PROMOTE": "sometimes"}, "worker.promote"),
        ({"KVSTORE_MASTER_REPLICAS": "9"}, "master.replicas"),
    ],
)
def test_config_strict_values_name_the_key(env: dict[str, str], key: str) -> None:
    with pytest.raises(errors.InvalidArgument, match=key.replace(".", r"\.")):
        load_config(None, environ=env)


def test_config_bools_and_ports_accept_what_they_should(tmp_path: Path) -> None:
    for text, want in [("true", True), ("1", True), ("yes", True), ("on", True), ("no", False)]:
        env = {"KVSTORE_WORKER_TLS_CLIENT_AUTH": text}
        assert load_config(None, environ=env).worker.tls_client_auth is want
    cfg = load_config(None, environ={"KVSTORE_WORKER_UCX_PORT": "-1", "KVSTORE_MASTER_PORT": "0"})
    assert cfg.worker.ucx_port == -1 and cfg.master.port == 0
    f = tmp_path / "kv.yaml"
    f.write_text("worker:\n  grpc_port: true\n")
    with pytest.raises(errors.InvalidArgument, match=r"worker\.grpc_port"):
        load_config(str(f), environ={})
    f.write_text("worker:\n  tls_client_auth: 'false'\n  host: [a, b]\n")
    with pytest.raises(errors.InvalidArgument, match=r"worker\.host"):
        load_config(str(f), environ={})


def test_config_pin_mapping_keeps_its_quota(tmp_path: Path) -> None:
    f = tmp_path / "kv.yaml"
    f.write_text("worker:\n  pin:\n    sys: 1GiB\n    tools:\n")
    assert load_config(str(f), environ={}).worker.pin == ["sys=1GiB", "tools"]
    f.write_text("worker:\n  pin:\n    - sys: 2GiB\n    - tools\n")
    assert load_config(str(f), environ={}).worker.pin == ["sys=2GiB", "tools"]
    f.write_text("worker:\n  pin:\n    sys: lots\n")
    with pytest.raises(errors.InvalidArgument, match=r"worker\.pin"):
        load_config(str(f), environ={})
    f.write_text("worker:\n  pin:\n    - 3\n")
    with pytest.raises(errors.InvalidArgument, match=r"worker\.pin"):
        load_config(str(f), environ={})


def test_block_hashes_rejects_text_and_bad_shapes() -> None:
    for bad in ("some text", b"bytes", [[1, 2], [3, 4]], [1.5, 2.5]):
        with pytest.raises(errors.InvalidArgument):
            block_hashes(bad, 16)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgument):
        block_hashes([1, 2], True)
    assert block_hashes([], 16) == []


def test_ring_density_is_a_master_setting_with_bounds() -> None:
    cfg = load_config(None, {"master": {"vnodes_per_gib": 4096}}, environ={})
    assert cfg.master.vnodes_per_gib == 4096
    assert load_config(None, environ={}).master.vnodes_per_gib == 16
    for bad in (0, -1, (1 << 20) + 1):
        with pytest.raises(
            errors.InvalidArgument, match=r"master.vnodes_per_gib \(--vnodes-per-gib\)"
        ):
            load_config(None, {"master": {"vnodes_per_gib": bad}}, environ={})
