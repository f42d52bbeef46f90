"""`kvrouter` as the README runs it: three patched vLLM CPU models and one patched SGLang CPU
model behind one OpenAI endpoint, driven by the official `openai` client.

The router is the `kvrouter` console script installed with kvcached-core in the engine venv (the
README's install line). The device holds three engines' declared memory, so the fourth model
starts only after an idle engine stops, and never a busy one. What a user relies on:
- every answer equals what the model's own engine answers directly (greedy, streamed or not);
- an unknown model gets 404 naming the models served; a bad configuration one line;
- an idle engine sleeps (its KV pages unmapped, reserve included) and wakes on the next
  request, and requests that arrive while it wakes all succeed;
- the metrics count requests, starts, wakes, sleeps and evictions; wake latency is recorded;
- on SIGTERM every engine stops and nothing is left: no process, record or budget.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvcached_core.budget import list_budgets
from kvcached_core.limits import scan_records

from .router_setup import SGLANG_ARGS, SGLANG_ENV, VLLM_ARGS, VLLM_ENV
from .vllm_cpu_env import build_tiny_model, engine_env

openai = pytest.importorskip("openai")

GIB = 1 << 30
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
IDLE_SLEEP_S = 2
START_TIMEOUT_S = 300


def readme_router_lines() -> list[str]:
    """The commands of the README's kvrouter block, without their comments."""
    text = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    block = text.split("## Many models behind one endpoint: `kvrouter`", 1)[1]
    block = block.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _status(base: str) -> dict[str, dict[str, Any]]:
    return {row["model"]: row for row in _get(f"{base}/router/status")["models"]}


def _metric(base: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and line.split(" ")[0] != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _wait_for(what: str, check: Any, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _write_config(path: Path, port: int, models: list[dict[str, Any]], shm: Path) -> None:
    import yaml

    path.write_text(yaml.safe_dump({
        "listen": f"127.0.0.1:{port}", "log_dir": "logs", "shm_dir": str(shm),
        "idle_sleep_s": IDLE_SLEEP_S, "request_wait_s": 240, "start_timeout_s": START_TIMEOUT_S,
        # Three engines' declared memory: the fourth model needs one of them stopped.
        "devices": [{"name": "cpu", "memory": "3.5GiB"}],
        "models": models}))


def test_router_serves_four_models_and_sleeps_and_wakes_them(
        engine_venv: Path, sglang_python: Path | None, unloadable_packages_hidden: Path,
        tmp_path: Path) -> None:
    if sglang_python is None:
        pytest.skip("no SGLang cell is selected (the router's SGLang model needs one)")

    assert (engine_venv.parent / "kvrouter").exists(), "kvcached-core installed no kvrouter"
    shm = tmp_path / "shm"
    shm.mkdir()
    build_env = engine_env(unloadable_packages_hidden, shm)
    models_dir = tmp_path / "models"
    weights = {name: build_tiny_model(engine_venv, models_dir / name, build_env, seed=seed)
               for seed, name in enumerate(("llama-a", "llama-b", "llama-c"))}
    subprocess.run([str(sglang_python), str(Path(__file__).parents[1] / "sglang" /
                                            "tiny_model.py"), str(models_dir / "sg")],
                   check=True, capture_output=True, timeout=300)
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    vllm_env = {**VLLM_ENV, "PYTHONPATH": str(unloadable_packages_hidden)}
    models: list[dict[str, Any]] = [
        # llama-a ranks lowest: were it idle it would be the first to stop.
        {"name": "llama-a", "engine": "vllm", "python": str(engine_venv),
         "model": str(weights["llama-a"]), "device": "cpu", "memory": "1GiB", "priority": 0,
         "args": [*VLLM_ARGS, "--chat-template", str(template)], "env": vllm_env},
        *({"name": name, "engine": "vllm", "python": str(engine_venv),
           "model": str(weights[name]), "device": "cpu", "memory": "1GiB", "priority": 1,
           "args": VLLM_ARGS, "env": vllm_env} for name in ("llama-b", "llama-c")),
        {"name": "sg", "engine": "sglang", "python": str(sglang_python),
         "model": str(models_dir / "sg"), "device": "cpu", "memory": "1GiB", "priority": 1,
         "args": SGLANG_ARGS, "env": SGLANG_ENV},
    ]
    port = _free_port()
    config = tmp_path / "router.yaml"
    _write_config(config, port, models, shm)
    base = f"http://127.0.0.1:{port}"
    # The user's shell: the engine venv's scripts first on the PATH, in the config's folder.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVCACHED_", "VLLM_", "PYTHON"))}
    env["PATH"] = f"{engine_venv.parent}{os.pathsep}{env.get('PATH', '')}"
    check_line, serve_line = readme_router_lines()
    assert (check_line, serve_line) == ("kvrouter check router.yaml",
                                        "kvrouter serve router.yaml")

    # `kvrouter check` prints the plan; a bad file gets one line and status 2.
    check = subprocess.run(shlex.split(check_line), capture_output=True, text=True, env=env,
                           cwd=tmp_path)
    assert check.returncode == 0, check.stderr
    assert "llama-a: vllm" in check.stdout and "sg: sglang" in check.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(config.read_text().replace("engine: sglang", "engine: sglangx"))
    refused = subprocess.run(["kvrouter", "check", "bad.yaml"], capture_output=True,
                             text=True, env=env, cwd=tmp_path)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip() == ("kvrouter: model 'sg'.engine: must be one of vllm, "
                                      "sglang, got 'sglangx'")

    log = (tmp_path / "router.log").open("w")
    router = subprocess.Popen(shlex.split(serve_line), env=env, cwd=tmp_path, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    pids: dict[str, int] = {}
    try:
        _wait_for("the router", lambda: _reachable(f"{base}/health"), 30)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                               timeout=300)
        assert sorted(m.id for m in client.models.list()) == ["llama-a", "llama-b", "llama-c",
                                                             "sg"]
        with pytest.raises(openai.NotFoundError) as unknown:
            client.completions.create(model="llama-z", prompt="hi", max_tokens=2)
        assert "llama-a, llama-b, llama-c, sg" in str(unknown.value)

        prompts = {"llama-a": "the quick brown fox", "llama-b": "the quick brown fox",
                   "llama-c": "the quick brown fox", "sg": "w1 w2 w3 w4 w5"}

        @contextlib.contextmanager
        def held_awake(name: str) -> Iterator[None]:
            """A request the test sends an engine directly is not one the router counts: on
            a slow host the router would put the engine to sleep under it. The router never
            sleeps an engine with a request of its own in flight, so one streamed request
            through the router is held open meanwhile."""
            hold = client.completions.create(
                model=name, prompt=prompts[name], max_tokens=300, temperature=0, stream=True,
                extra_body={"ignore_eos": True})
            next(iter(hold))  # the engine is awake and the request runs
            try:
                yield
            finally:
                hold.close()

        def ask(name: str, prompt: str, max_tokens: int = 12, *,
                direct_port: int | None = None) -> tuple[str, int]:
            target = client if direct_port is None else openai.OpenAI(
                base_url=f"http://127.0.0.1:{direct_port}/v1", api_key="unused", timeout=300)
            with held_awake(name) if direct_port is not None else contextlib.nullcontext():
                answer = target.completions.create(
                    model=name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                    extra_body={"ignore_eos": True})
            assert answer.usage is not None
            return answer.choices[0].text, answer.usage.completion_tokens

        reference: dict[str, tuple[str, int]] = {}
        # The first request starts each engine; the answer is the engine's own.
        for name in ("llama-a", "llama-b", "llama-c"):
            reference[name] = ask(name, prompts[name])
            row = _status(base)[name]
            assert row["state"] == "awake" and row["pools"] >= 1
            pids[name] = row["pid"]
            assert ask(name, prompts[name], direct_port=row["port"]) == reference[name]
            assert reference[name][1] == 12
        # Three models, three weights: the router sent each request to its own model.
        assert len({reference[n][0] for n in ("llama-a", "llama-b", "llama-c")}) == 3
        assert _metric(base, "kvrouter_kv_budget_bytes", device="cpu") == 0.5 * GIB

        # Chat and streaming go through unchanged.
        chat = client.chat.completions.create(
            model="llama-a", messages=[{"role": "user", "content": "the quick brown fox"}],
            max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        with held_awake("llama-a"):
            direct = openai.OpenAI(
                base_url=f"http://127.0.0.1:{_status(base)['llama-a']['port']}/v1",
                api_key="unused").chat.completions.create(
                model="llama-a", messages=[{"role": "user", "content": "the quick brown fox"}],
                max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        assert chat.choices[0].message.content == direct.choices[0].message.content
        pieces = [c.choices[0].text for c in client.completions.create(
            model="llama-b", prompt=prompts["llama-b"], max_tokens=12, temperature=0,
            stream=True, extra_body={"ignore_eos": True}) if c.choices]
        assert len(pieces) > 1 and "".join(pieces) == reference["llama-b"][0]

        # The device is full. While llama-a (the lowest priority) streams a long answer,
        # SGLang's model arrives: an idle engine stops for it, never the busy one.
        streamed: list[str] = []

        def long_stream() -> None:
            for chunk in client.completions.create(
                    model="llama-a", prompt=prompts["llama-a"], max_tokens=400, temperature=0,
                    stream=True, extra_body={"ignore_eos": True}):
                streamed.extend(c.text for c in chunk.choices)

        stream = threading.Thread(target=long_stream)
        stream.start()
        _wait_for("llama-a to stream", lambda: len(streamed) > 0)
        reference["sg"] = ask("sg", prompts["sg"])
        stream.join(timeout=300)
        rows = _status(base)
        # llama-c is the idle engine used longest ago (llama-b streamed after it).
        assert rows["llama-c"]["state"] == "stopped", rows
        assert rows["llama-a"]["pid"] == pids["llama-a"] and rows["sg"]["state"] == "awake"
        assert len("".join(streamed)) > 0 and not stream.is_alive()
        assert _metric(base, "kvrouter_evictions_total", model="llama-c") == 1
        assert ask("sg", prompts["sg"], direct_port=rows["sg"]["port"]) == reference["sg"]
        assert reference["sg"][1] == 12

        # Idle engines sleep: their KV pages (the prefix cache's and the reserve's) are
        # unmapped; the next requests, eight at once, wake them, and each is answered as the
        # engine answers directly.
        long_prompts = {"llama-b": " ".join(["the quick brown fox jumps over the lazy dog"] * 8),
                        "sg": " ".join(f"w{i}" for i in range(80))}
        for name in ("llama-b", "sg"):
            expected = ask(name, long_prompts[name])
            assert ask(name, long_prompts[name],
                       direct_port=_status(base)[name]["port"]) == expected
            for _cycle in range(2):
                _wait_for(f"{name} to sleep",
                          lambda n=name: _status(base)[n]["state"] == "asleep",
                          IDLE_SLEEP_S + 30)
                asleep = _status(base)[name]
                with ThreadPoolExecutor(8) as pool:
                    answers = list(pool.map(ask, [name] * 8, [long_prompts[name]] * 8))
                assert answers == [expected] * 8
                awake = _status(base)[name]  # the prompt's blocks stay in the prefix cache
                assert asleep["kv_limit_bytes"] == 0 and awake["kv_limit_bytes"] > 0
                assert asleep["kv_mapped_bytes"] == asleep["kv_in_use_bytes"]  # reserve gone
                assert asleep["kv_mapped_bytes"] < awake["kv_mapped_bytes"], (asleep, awake)
                assert asleep["pid"] == awake["pid"]  # asleep, not stopped
        assert _metric(base, "kvrouter_wakes_total", model="llama-b", kind="wake") >= 2
        assert _metric(base, "kvrouter_wakes_total", model="sg", kind="wake") >= 2
        assert _metric(base, "kvrouter_sleeps_total", model="sg", level="kv") >= 2
        assert _metric(base, "kvrouter_wake_seconds_count", kind="wake") >= 4
        assert _metric(base, "kvrouter_requests_total", status="200") >= 40
        assert _metric(base, "kvrouter_requests_total", status="503") == 0
        assert _metric(base, "kvrouter_requests_total", status="502") == 0
        pids.update({name: row["pid"] for name, row in _status(base).items() if row["pid"]})

        # An engine killed while asleep (an OOM killer, an operator's mistake): the router's
        # watcher finds it dead, kills what is left of its process group and removes its
        # pools' records; the next request would start it again (tests/unit/test_router.py).
        dead = _status(base)["llama-b"]["pid"]
        os.killpg(dead, signal.SIGKILL)
        _wait_for("the dead engine to be cleaned up",
                  lambda: _status(base)["llama-b"]["state"] == "stopped", 30)
        assert _metric(base, "kvrouter_engine_deaths_total", model="llama-b") == 1
        assert "exited unasked" in str(_status(base)["llama-b"]["last_error"])
        assert not any(r.owner_pid == dead for r in scan_records(shm)[0])
    finally:
        os.killpg(router.pid, signal.SIGTERM)
        code = router.wait(timeout=120)
        log.close()
    assert code == 0, (tmp_path / "router.log").read_text()[-3000:]
    # Every engine went with the router: no process, no record, no budget.
    for pid in pids.values():
        assert not Path(f"/proc/{pid}").exists()
    records, corrupt = scan_records(shm)
    assert records == [] and corrupt == []
    assert list_budgets(shm) == []


def _reachable(url: str) -> bool:
    try:
        _get(url)
    except OSError:
        return False
    return True


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
