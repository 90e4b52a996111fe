"""A process that imports torch once and forks fresh training processes on request.

Importing torch with its optimizers (which pull in torch._dynamo) takes several
seconds on the test machines; the resumable-training tests start dozens of
training processes. This process imports everything first, without running a
single tensor operation or starting a thread, and then serves one JSON command
per stdin line, answering one JSON line on stdout:

    {"cmd": "spawn", "target": "train_loop:main", "argv": [...], "log": path}  -> {"pid": n}
    {"cmd": "wait", "pid": n, "timeout": s}   -> {"code": exit status, or null if still running}
    {"cmd": "kill", "pid": n, "signal": 9}    -> {} (the whole process group: DataLoader workers too;
                                                  "group": false signals the process alone)

Each spawned process starts its own session, writes stdout and stderr to `log`,
runs the target with `sys.argv` set, and exits with its status: a new process
that shares nothing with earlier ones but the imported modules.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported

import numpy  # noqa: E402,F401
import torch  # noqa: E402
import torch._dynamo  # noqa: E402  (what the first optimizer would import)
import torch.distributed.checkpoint.state_dict  # noqa: E402
import torch.distributed.fsdp  # noqa: E402
import torch.utils.data  # noqa: E402,F401

import tensormorph.train  # noqa: E402,F401

with contextlib.suppress(ImportError):  # the StatefulDataLoader test reports the missing package itself
    import torchdata.stateful_dataloader  # noqa: F401


def _child(target: str, argv: list[str], log: str) -> None:
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdin.close()
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    code = 0
    try:
        module, function = target.split(":")
        sys.argv = [module, *argv]
        getattr(importlib.import_module(module), function)()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _wait(pid: int, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.01)


def _signal(pid: int, sig: int, group: bool) -> None:
    try:
        if not group:
            raise ProcessLookupError
        os.killpg(pid, sig)
    except ProcessLookupError:  # not yet its own session leader: the process alone
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def main() -> None:
    running: set[int] = set()
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        cmd = request["cmd"]
        if cmd == "spawn":
            pid = os.fork()
            if pid == 0:
                _child(request["target"], request["argv"], request["log"])
            running.add(pid)
            reply = {"pid": pid}
        elif cmd == "wait":
            code = _wait(request["pid"], request["timeout"])
            if code is not None:
                running.discard(request["pid"])
            reply = {"code": code}
        elif cmd == "kill":
            _signal(request["pid"], request.get("signal", signal.SIGKILL), request.get("group", True))
            reply = {}
        else:
            break
        print(json.dumps(reply), flush=True)
    # the test side is gone (finished or failed): no process of ours outlives it
    for pid in running:
        _signal(pid, signal.SIGKILL, True)
        _wait(pid, 30)


if __name__ == "__main__":
    main()
