"""The README's vLLM quickstart, run as written (issue 43, items 1-3).

The fenced block after ``<!-- quickstart-vllm`` in README.md is run by bash with only
these changes, each checked to be there: the tests' tiny model for ``MODEL``, free
ports for 7700 and 8000, and the ``pip install ./client`` line left out
(scripts/e2e.sh installs the client into this venv the same way). vLLM's CPU build and
this venv's ``kvstore`` come first on PATH. The block's own output must show the hit:
the second request loaded from the store (``vllm:kvstore_hit_tokens_total``), not from
vLLM's prefix cache (``vllm:prefix_cache_hits_total`` 0). A misspelt settings key
fails the same serve command within seconds, before the model loads.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARK = "<!-- quickstart-vllm"
PIP_LINE = "/path/to/vllm-venv/bin/pip install ./client"
MODEL_LINE = "MODEL=Qwen/Qwen3-0.6B"


def quickstart() -> str:
    text = (ROOT / "README.md").read_text()
    assert MARK in text, "README.md lost its vLLM quickstart marker"
    block = text[text.index(MARK) :]
    m = re.search(r"```sh\n(.*?)\n```", block, re.S)
    assert m, "no sh block after the quickstart marker"
    return m.group(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prepared(model: str, *, drop_pip: bool = True) -> str:
    """The quickstart with the documented substitutions (each must apply)."""
    script = quickstart()
    for old in (MODEL_LINE, "7700", "8000", PIP_LINE):
        assert old in script, f"the quickstart no longer has {old!r}: update this test"
    script = script.replace(MODEL_LINE, f"MODEL={model}")
    script = script.replace("7700", str(free_port())).replace("8000", str(free_port()))
    if drop_pip:
        script = script.replace(PIP_LINE, ": # the client: installed by scripts/e2e.sh")
    return script


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"
    e.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    return e


def run(script: str, timeout: float) -> tuple[int | None, str, float]:
    """bash -c script in a session of its own; whatever it left running is ended (by
    the session's process group, which only this test's processes are in)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        ["bash", "-c", script], cwd=ROOT, env=env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True, text=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = ""
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(3)
        if proc.returncode is None:
            out += proc.communicate()[0] or ""
    return proc.returncode, out, time.monotonic() - t0


def metric(out: str, name: str) -> float:
    vals = [float(x) for x in re.findall(rf"^vllm:{name}(?:{{[^}}]*}})? (\S+)$", out, re.M)]
    assert vals, f"no vllm:{name} line in the quickstart's output:\n{out[-3000:]}"
    return sum(vals)


def test_the_readme_quickstart_runs_as_written_and_shows_a_store_hit(tiny_model: str) -> None:
    rc, out, secs = run(prepared(tiny_model), timeout=420)
    assert rc == 0, out[-4000:]
    assert out.count('"choices"') == 2, out[-4000:]
    stored = metric(out, "kvstore_stored_blocks_total")
    hit = metric(out, "kvstore_hit_tokens_total")
    assert stored >= 1, out[-3000:]
    # 2,000 tokens: every full block but the last token's (vLLM computes one token)
    assert hit >= 1900, f"the second request did not load from the store: {hit}"
    assert metric(out, "prefix_cache_hits_total") == 0, "vLLM's own cache answered"
    assert re.search(r"2 workers", out), out[-2000:]  # kvstore status
    print(f"quickstart ran in {secs:.0f}s: {stored:.0f} blocks stored, {hit:.0f} tokens hit")


def test_a_misspelt_setting_stops_the_start_before_the_model_loads(tiny_model: str) -> None:
    """The quickstart's serve command with "mastr" for "master": vLLM exits within
    seconds (while it builds its config, before any weight is loaded) with an error
    naming the key and the nearest valid one. Before, the connector saw its settings
    only once the model was loaded and the KV cache sized (~35 s here)."""
    script = prepared(tiny_model)
    serve = re.search(r"^python -m vllm\.entrypoints.*?' &$", script, re.S | re.M)
    assert serve, script
    cmd = serve.group(0).removesuffix(" &").replace('"master":', '"mastr":')
    assert '"mastr":' in cmd
    rc, out, secs = run(f"MODEL={tiny_model}\n{cmd}", timeout=240)
    assert rc not in (0, None), out[-3000:]
    assert "unknown setting(s) ['mastr']" in out and "did you mean 'master'" in out, out[-3000:]
    for loading in ("Loading weights", "Model loading took", "Starting to load model"):
        assert loading not in out, f"the model was loaded before the error: {loading!r}"
    assert secs < 45, f"the error came after {secs:.0f}s"
    print(f"a misspelt setting stopped vLLM after {secs:.1f}s")


@pytest.mark.parametrize("bad", ['"zero_copy": "maybe"', '"timeout_s": "soon"'])
def test_a_bad_value_stops_the_start_too(tiny_model: str, bad: str) -> None:
    """The same early check for a bad value: named with its key."""
    script = prepared(tiny_model)
    serve = re.search(r"^python -m vllm\.entrypoints.*?' &$", script, re.S | re.M)
    assert serve
    cmd = serve.group(0).removesuffix(" &").replace('{"master":', "{" + bad + ', "master":')
    rc, out, secs = run(f"MODEL={tiny_model}\n{cmd}", timeout=240)
    assert rc not in (0, None)
    assert bad.split(":")[0].strip('"') in out and "Loading weights" not in out, out[-3000:]
    assert secs < 45
