"""Every tool call can be stopped: a call runs in a child process
(``rlhfflow.engine.toolprocess``) that is killed at ``tool_timeout_s`` with what it
started, so a hanging tool leaves no thread and no process behind, however many calls
hang."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

from rlhfflow.engine import toolprocess
from rlhfflow.engine.environments import ToolEnvironment


def flaky(i: int) -> int:
    """Hangs on one call in ten."""
    if i % 10 == 0:
        time.sleep(3600)
    return i * i


def spawns_and_hangs(pid_file: str) -> str:
    child = subprocess.Popen(["sleep", "3600"])
    Path(pid_file).write_text(str(child.pid))
    time.sleep(3600)
    return "never"


def exits() -> str:
    os._exit(3)


def _children() -> list[int]:
    """Live (not zombie) child processes of this process."""
    me, found = str(os.getpid()), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if stat[1] == me and stat[0] != "Z":
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:4]
    except OSError:
        return False


def _call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_threads_and_processes_stay_flat_when_a_tool_hangs_on_one_call_in_ten():
    env = ToolEnvironment({"flaky": flaky}, timeout_s=0.3)
    assert env.call('{"name": "flaky", "arguments": {"i": 1}}') == "1"  # its process starts
    threads, children = threading.active_count(), len(_children())
    hung = 0
    for turn in range(8):
        messages, _, _, info = env.step("".join(_call("flaky", i=turn * 10 + k)
                                                for k in range(10)))
        hung += info.get("errors_timeout", 0)
        assert [m["content"] for m in messages][1:] == \
            [str((turn * 10 + k) ** 2) for k in range(1, 10)]
        assert threading.active_count() == threads
        assert len(_children()) == children and toolprocess.live() == 1
    assert hung == 8


def test_a_tool_past_its_timeout_is_killed_with_the_processes_it_started(tmp_path):
    env = ToolEnvironment({"spawns_and_hangs": spawns_and_hangs}, timeout_s=1)
    pid_file = tmp_path / "pid"
    answer = env.call(json.dumps({"name": "spawns_and_hangs",
                                  "arguments": {"pid_file": str(pid_file)}}))
    assert answer == "error: tool 'spawns_and_hangs' took more than 1 s"
    grandchild = int(pid_file.read_text())
    for _ in range(100):
        if not _alive(grandchild):
            break
        time.sleep(0.02)
    assert not _alive(grandchild)


def test_a_tool_that_ends_its_process_is_an_error_and_the_next_call_runs():
    env = ToolEnvironment({"exits": exits, "flaky": flaky}, timeout_s=5)
    messages, _, _, info = env.step(_call("exits") + _call("flaky", i=3))
    assert [m["content"] for m in messages] == \
        ["error: the tool's process exited with status 3", "9"]
    assert info == {"calls": 2, "errors": 1, "errors_crash": 1}


def test_thread_isolation_still_answers_a_timeout_for_tools_that_share_state():
    seen = []

    def remember(x: int) -> int:  # a closure over this process's list
        seen.append(x)
        return len(seen)

    env = ToolEnvironment({"remember": remember, "flaky": flaky}, timeout_s=0.2,
                          isolation="thread")
    assert env.call('{"name": "remember", "arguments": {"x": 7}}') == "1" and seen == [7]
    assert env.call('{"name": "flaky", "arguments": {"i": 0}}') == \
        "error: tool 'flaky' took more than 0.2 s"
