"""The sandbox for model-written code (``rlhfflow.engine.sandbox``) and its security
battery: programs that try to escape, each contained, the sandbox usable after it, the
attempt counted by kind in the tool environment's ``info``. Every attack runs in each
backend that starts here; what a fallback does not claim to stop is not asserted of it
(docs/how-to/sandbox.md). Every attack program bounds itself (a fork bomb stops after
2000 forks) as a second net."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from rlhfflow.engine import sandbox
from rlhfflow.engine.environments import ToolEnvironment
from rlhfflow.engine.sandbox import Sandbox, SandboxSettings, sandbox_uids
from rlhfflow.engine.sandboxprocess import Limits

LIMITS = Limits(cpu_s=1, wall_s=3, memory_mb=256, file_mb=4, processes=16, output_kb=64)
ROOT = os.geteuid() == 0


def _startable(name: str) -> bool:
    try:
        sandbox.pick_backend(name)
    except RuntimeError:
        return False
    return True


BACKENDS = [
    pytest.param("bwrap", marks=pytest.mark.skipif(
        shutil.which("bwrap") is None, reason="bubblewrap is not installed "
                                              "(apt-get install bubblewrap; .ci/run does)")),
    "unshare", "process"]


@pytest.fixture(params=BACKENDS, scope="module")
def box(request):
    if not _startable(request.param):
        pytest.skip(f"the {request.param} sandbox does not start on this machine")
    # no warm processes: every process of a sandbox user after a call is a leak
    made = Sandbox(LIMITS, sandbox.pick_backend(request.param), warm=0)
    yield made
    made.close()


def _sandbox_processes(owner: int | None = None) -> list[int]:
    """Pids of live processes that run as a sandbox user of process ``owner`` (this one
    by default; only its sandboxes do); a zombie is dead, waiting for its parent, the
    machine's init, to reap it."""
    users = sandbox_uids(owner)
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
                uid = int(status.split("\nUid:\t")[1].split()[0])
            except (OSError, IndexError):
                continue
            if uid in users and "\nState:\tZ" not in status:
                pids.append(int(entry.name))
    return pids


def _contained(box: Sandbox, code: str) -> sandbox.Outcome:
    """Run an attack; nothing of it may outlive the call, and the sandbox still works.
    (Warm sandboxes of other tests' tools may be there before and after: not this one's.)"""
    before = set(_sandbox_processes())
    outcome = box.run(code)
    if ROOT:  # a killed process may take a moment to be gone
        for _ in range(100):
            if set(_sandbox_processes()) <= before:
                break
            time.sleep(0.02)
        assert set(_sandbox_processes()) <= before, f"left running after {code[:40]!r}"
    assert box.run("print(6 * 7)").message == "42\n"
    return outcome


@pytest.fixture(scope="module")
def secrets(tmp_path_factory):
    """A secret planted in the user's home and one in a run directory."""
    token = uuid.uuid4().hex
    home = Path.home() / f".rlhfflow-test-secret-{token[:8]}"
    run_dir = tmp_path_factory.mktemp("run") / "answers.jsonl"
    home.write_text(token)
    run_dir.write_text(token)
    yield token, home, run_dir
    home.unlink()


def test_a_program_prints_and_its_failures_come_back_as_messages(box):
    assert box.run("print(sum(range(10)))").message == "45\n"
    failed = box.run("1 / 0")
    assert failed.kind == "exit" and failed.message.startswith("error: exit status 1\n")
    assert failed.message.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "<string>" not in failed.message  # the boot's own frame is left out


def test_reading_secrets_planted_in_the_home_and_the_run_directory(box, secrets):
    token, home, run_dir = secrets
    for path in (home, run_dir):
        outcome = _contained(box, f"print(open({str(path)!r}).read())")
        if box.backend.name == "bwrap" or ROOT:  # hidden, or not the sandbox user's
            assert token not in outcome.stdout and outcome.kind == "exit"
            assert "FileNotFoundError" in outcome.stderr or "PermissionError" in outcome.stderr


def test_writing_outside_the_working_directory(box, tmp_path):
    outside = tmp_path / "planted.txt"
    os.chmod(tmp_path, 0o777)
    code = "\n".join(f"try:\n    open({str(p)!r}, 'w').write('x')\nexcept OSError as e:\n"
                     f"    print(type(e).__name__)" for p in (outside, "/usr/planted.txt"))
    outcome = _contained(box, code + "\nopen('mine.txt', 'w').write('ok')")
    assert not Path("/usr/planted.txt").exists()
    if box.backend.name == "bwrap":
        assert not outside.exists()
    assert outcome.kind == "ok"  # its own working directory is writable


def test_opening_a_socket(box):
    if box.backend.name == "process":
        pytest.skip("the process fallback does not claim to stop the network")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]
    outcome = _contained(box, f"import socket\ntry:\n    socket.create_connection("
                              f"('127.0.0.1', {port}), 1)\n    print('connected')\n"
                              f"except OSError as e:\n    print('refused', e)")
    assert outcome.stdout.startswith("refused")
    with pytest.raises(socket.timeout):
        server.accept()
    server.close()


def test_reading_secrets_from_the_environment(box, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-123")
    monkeypatch.setenv("HF_TOKEN", "hf-secret-456")
    fresh = Sandbox(LIMITS, box.backend, warm=1)  # its warm process starts now
    try:
        outcome = fresh.run("import os; print(dict(os.environ))")
    finally:
        fresh.close()
    assert "secret" not in outcome.stdout and "WANDB" not in outcome.stdout
    assert outcome.kind == "ok"


FORK_BOMB = """
import os, time
forks = 0
for _ in range(2000):   # the test's own cap
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    forks += 1
print(forks)
"""


def test_a_fork_bomb_is_capped_and_its_processes_killed(box):
    outcome = _contained(box, FORK_BOMB)
    assert outcome.kind == "ok" and int(outcome.stdout) < LIMITS.processes


def test_allocating_far_beyond_the_memory_limit(box):
    outcome = _contained(box, "x = bytearray(8 * 2**30)\nprint(len(x))")
    assert outcome.kind == "memory" and outcome.message.startswith("error: memory limit")


def test_spinning_stops_at_the_cpu_limit(box):
    outcome = _contained(box, "while True:\n    pass")
    assert outcome.kind == "cpu"
    assert outcome.message == "error: CPU time limit (1 s)"


def test_sleeping_forever_stops_at_the_wall_limit(box):
    outcome = _contained(box, "import time\ntime.sleep(3600)")
    assert outcome.kind == "timeout" and outcome.message == "error: timeout after 3 s"


def test_printing_gigabytes_stops_at_the_output_limit(box):
    outcome = _contained(box, "import sys\nchunk = 'x' * 65536\nfor _ in range(16384):\n"
                              "    sys.stdout.write(chunk)")
    assert outcome.kind == "output" and outcome.message.startswith("error: output limit")
    assert len(outcome.stdout) < 4 * (LIMITS.output_kb << 10)


def test_filling_the_disk_stops_at_the_file_limit(box):
    outcome = _contained(box, "with open('big', 'wb') as f:\n"
                              "    for _ in range(64):\n        f.write(b'x' * 2**20)")
    assert outcome.kind == "file_size"


def test_killing_its_parent_and_the_worker(box):
    code = (f"import os, signal\nfor pid in (os.getppid(), {os.getpid()}, -1):\n"
            f"    try:\n        os.kill(pid, signal.SIGKILL)\n"
            f"    except OSError as e:\n        print(pid, type(e).__name__)")
    if box.backend.name == "process" and not ROOT:
        pytest.skip("the process fallback run by a user shares the worker's user")
    _contained(box, code)  # this test's process (the worker) is still here


def test_a_child_left_running_after_the_call_is_killed(box, tmp_path):
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n"
            "    time.sleep(3600)\nprint('parent done')")
    outcome = _contained(box, code)
    assert outcome.kind == "ok" and outcome.stdout == "parent done\n"


# --------------------------------------------------------------------------- as a tool

ATTACKS = {
    "timeout": "import time\ntime.sleep(3600)",
    "cpu": "while True:\n    pass",
    "memory": "x = bytearray(8 * 2**30)",
    "output": "while True:\n    print('x' * 1000)",
    "exit": "raise ValueError('no')",
}


def _call(code: str) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': 'python', 'arguments': {'code': code}})}" \
           "</tool_call>"


def test_the_python_tool_counts_each_kind_of_failure_in_info():
    settings = SandboxSettings(LIMITS, "auto", warm=1)
    env = ToolEnvironment({"python": sandbox.python}, timeout_s=30, sandbox=settings)
    threads = threading.active_count()
    messages, _, done, info = env.step("".join(_call(code) for code in ATTACKS.values())
                                       + _call("print(2 ** 10)"))
    assert not done and messages[-1]["content"] == "1024\n"
    assert info["calls"] == 6 and info["errors"] == 5
    assert {key: info[key] for key in info if key.startswith("errors_")} == \
        {f"errors_{kind}": 1 for kind in ATTACKS}
    assert messages[0]["content"] == "error: timeout after 3 s"
    assert threading.active_count() == threads


def test_a_model_cannot_pass_its_own_limits_to_the_tool():
    env = ToolEnvironment({"python": sandbox.python}, timeout_s=30,
                          sandbox=SandboxSettings(LIMITS, "auto", warm=0))
    answer = env.call('{"name": "python", "arguments": {"code": "print(1)", '
                      '"limits": {"wall_s": 1000}}}')
    assert answer.startswith("error: TypeError")


def test_code_tests_score_the_fraction_of_tests_passed():
    env = sandbox.CodeTests(warm=0, **{k: getattr(LIMITS, k) for k in ("cpu_s", "wall_s")})
    env.reset({"tests": ["assert square(2) == 4", "assert square(3) == 9",
                         "assert square(-1) == -1"]})
    messages, reward, done, info = env.step("Here:\n```python\ndef square(x):\n"
                                            "    return x * x\n```")
    assert (reward, done, info) == (pytest.approx(2 / 3), True, {"passed": 2, "tests": 3})
    env.reset({"tests": ["assert True"]})
    _, reward, _, info = env.step("```python\nimport time\ntime.sleep(3600)\n```")
    assert reward == 0.0 and info["errors_timeout"] == 1


def test_a_rollout_counts_the_failed_programs_in_its_info_columns(tmp_path):
    import yaml

    from rlhfflow.config.loader import load_pipeline
    from rlhfflow.runtime.stagetest import run_stage_alone

    example = Path(__file__).parents[2] / "examples" / "multiturn"
    data = yaml.safe_load((example / "guess-tiny.yaml").read_text())
    data["data"]["prompts"] = str(example / "prompts.jsonl")
    data["stages"]["rollout"]["params"] = {
        "env": "rlhfflow.engine.sandbox:CodeTests", "max_turns": 1, "max_tokens": 24,
        "env_kwargs": {"cpu_s": 1, "wall_s": 3, "warm": 1},
        "info": ["passed", "tests", "errors_exit", "errors_timeout"], "scores": True}
    path = tmp_path / "dag.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    out = run_stage_alone(load_pipeline(path), "rollout", 0, tmp_path / "out").columns
    # a tiny random model writes no Python that runs: each episode's program failed once
    assert out["info_tests"].sum() == 0 and out["info_errors_timeout"].sum() == 0
    assert ((out["info_errors_exit"] == 1) | (out["env_reward"] == 0)).all()
    assert out["info_errors_exit"].sum() >= 1


def test_sandboxed_steps_on_the_cpu_pool_give_the_steps_in_the_task(chat_lm_dir, tmp_path):
    import concurrent.futures
    import multiprocessing

    from rlhfflow.sdk import StageContext, create_stage
    from tests.conftest import chat_batch, chat_store
    from tests.stages.test_rollout import TEXTS

    store = chat_store(chat_lm_dir)
    batch = chat_batch(store.get("actor").tokenizer, TEXTS, samples=2, secrets=[3, 5, 7])

    def run(executor):
        stage = create_stage("rollout", params={
            "env": "rlhfflow.engine.sandbox:CodeTests", "max_turns": 1, "max_new_tokens": 6,
            "max_tokens": 24, "env_placement": "pool",
            "env_kwargs": {"cpu_s": 1, "wall_s": 3, "warm": 1},
            "info": ["tests", "errors_exit"]}, model="actor")
        ctx = StageContext(iteration=0, seed=0, models=store,
                           settings={"base_dir": str(tmp_path)}, env_executor=executor)
        return stage.run(batch, ctx)

    # spawn: a fresh process, as a pool worker is; its sandboxes are its own
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        shipped = run(pool)
        worker = pool.submit(os.getpid).result()
        assert ROOT is False or _sandbox_processes(worker) != []  # its warm sandboxes
    if ROOT:  # the pool's worker took its warm sandboxes with it when it exited
        for _ in range(100):
            if not _sandbox_processes(worker):
                break
            time.sleep(0.02)
        assert _sandbox_processes(worker) == []
    inline = run(None)
    assert torch.equal(shipped["response_ids"], inline["response_ids"])
    torch.testing.assert_close(shipped["info_errors_exit"], inline["info_errors_exit"])
    assert inline["info_errors_exit"].sum() >= 1  # the tiny model's text is no program
