"""The tenants file is checked strictly at load (a clear error naming the key, never
a silently different meaning), and the auth module is plain data: the master
imports it without loading any worker module."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.auth import Tenants, token_digest
from kvstore_client.errors import InvalidArgument

ROOT = Path(__file__).resolve().parents[2]


def load(tmp_path: Path, body: str) -> Tenants:
    f = tmp_path / "tenants.yaml"
    f.write_text("tenants:\n" + body)
    return Tenants.load(str(f))


def tenant(name: str, extra: str, token: str | None = None) -> str:
    return f"  - name: {name}\n    token: {token or 'tok-' + name}\n{extra}"


@pytest.mark.parametrize("value", ['"false"', '"true"', "'no'", "1", "0", "yes-please"])
def test_admin_must_be_a_yaml_boolean(tmp_path: Path, value: str) -> None:
    with pytest.raises(InvalidArgument, match=r"tenant 'a': admin must be true or false"):
        load(tmp_path, tenant("a", f"    namespaces: [a]\n    admin: {value}\n"))


def test_admin_booleans_still_work(tmp_path: Path) -> None:
    t = load(tmp_path, tenant("a", "    namespaces: [a]\n    admin: false\n")
             + tenant("ops", "    admin: true\n"))  # fmt: skip
    assert not t.authenticate("tok-a").admin and t.authenticate("tok-ops").admin


@pytest.mark.parametrize("quota", ["0", "-1", "-5MiB", "0GiB", "true", "[1]", "lots"])
def test_quota_must_be_a_positive_size(tmp_path: Path, quota: str) -> None:
    with pytest.raises(InvalidArgument, match=r"tenant 'a': quota"):
        load(tmp_path, tenant("a", f"    namespaces: [a]\n    quota: {quota}\n"))


def test_quota_sizes_and_no_quota(tmp_path: Path) -> None:
    t = load(tmp_path, tenant("a", "    namespaces: [a]\n    quota: 2MiB\n")
             + tenant("b", "    namespaces: [b]\n    quota: 4096\n")
             + tenant("c", "    namespaces: [c]\n"))  # fmt: skip
    assert t.quotas == {"a": 2 << 20, "b": 4096}
    assert t.quota_account("a/x") == "a" and t.quota_account("c") == "c"
    assert t.quota_account("zzz") is None


def test_two_tenants_with_one_token_is_an_error(tmp_path: Path) -> None:
    body = tenant("a", "    namespaces: [a]\n", token="same") + (
        f"  - name: b\n    token_sha256: {token_digest('same')}\n    namespaces: [b]\n"
    )
    with pytest.raises(InvalidArgument, match=r"tenants 'a' and 'b' have the same token"):
        load(tmp_path, body)


@pytest.mark.parametrize(
    ("a", "b"), [("shared", "shared/y"), ("shared/y", "shared"), ("x", "x"), ("p/q", "p/q/r/s")]
)
def test_overlapping_namespaces_between_tenants_name_both(tmp_path: Path, a: str, b: str) -> None:
    body = tenant("one", f"    namespaces: [{a}]\n") + tenant("two", f"    namespaces: [{b}]\n")
    with pytest.raises(InvalidArgument, match="overlap") as e:
        load(tmp_path, body)
    assert "'one'" in str(e.value) and "'two'" in str(e.value)
    assert repr(a) in str(e.value) and repr(b) in str(e.value)


def test_prefix_lookalikes_do_not_overlap(tmp_path: Path) -> None:
    t = load(tmp_path, tenant("one", "    namespaces: [shared, one/x, one/y]\n")
             + tenant("two", "    namespaces: [shared2, sharedy]\n"))  # fmt: skip
    assert t.owner("shared/y") == "one" and t.owner("shared2/z") == "two"


@pytest.mark.parametrize(
    "digest", ["abc", "z" * 64, "0" * 63, "0" * 65, "12", '""', "[1]", "0x" + "0" * 62]
)
def test_token_sha256_must_be_64_hex_digits(tmp_path: Path, digest: str) -> None:
    body = f"  - name: a\n    token_sha256: {digest}\n    namespaces: [a]\n"
    with pytest.raises(InvalidArgument, match=r"tenant 'a': token_sha256 must be 64 hex"):
        load(tmp_path, body)


def test_upper_case_token_sha256_is_normalised_and_authenticates(tmp_path: Path) -> None:
    body = f"  - name: a\n    token_sha256: {token_digest('s3cret').upper()}\n    namespaces: [a]\n"
    assert load(tmp_path, body).authenticate("s3cret").name == "a"


@pytest.mark.parametrize(
    ("extra", "msg"),
    [
        ("    namespaces: a\n", "namespaces must be a list"),
        ("    namespaces: [a, 3]\n", "namespaces must be a list"),
        ("    namespaces: ['bad ns!']\n", "namespaces:"),
        ("    namespaces: []\n", "owns no namespaces"),
    ],
)
def test_namespaces_are_checked(tmp_path: Path, extra: str, msg: str) -> None:
    with pytest.raises(InvalidArgument, match=msg):
        load(tmp_path, tenant("a", extra))


def test_token_forms(tmp_path: Path) -> None:
    both = f"  - name: a\n    token: t\n    token_sha256: {'0' * 64}\n    namespaces: [a]\n"
    with pytest.raises(InvalidArgument, match="not both"):
        load(tmp_path, both)
    with pytest.raises(InvalidArgument, match="token must be a non-empty string"):
        load(tmp_path, "  - name: a\n    token: 12345\n    namespaces: [a]\n")
    with pytest.raises(InvalidArgument, match="needs token"):
        load(tmp_path, "  - name: a\n    namespaces: [a]\n")
    with pytest.raises(InvalidArgument, match="name 'a' is used twice"):
        load(tmp_path, tenant("a", "    namespaces: [a]\n") + tenant("a", "    namespaces: [b]\n",
                                                                      token="t2"))  # fmt: skip


def test_importing_the_master_loads_no_worker_module() -> None:
    code = (
        "import json, sys\n"
        "import kvstore.auth, kvstore.master.server, kvstore.master.guard\n"
        "import kvstore.master.membership, kvstore.master.snapshot, kvstore.master.ha\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('kvstore.worker'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
