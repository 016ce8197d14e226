"""A process for a learner's code that holds no answer, owns no score and leaves nothing behind.

The grader (``runner.py``) starts this module for one group of a lab's tasks, on a copy of kvlib
in which those tasks' answers are stubs (``hidden.stubbed_tree``). Where bubblewrap is installed
the process runs in namespaces of its own: an unprivileged user, no network, a read-only view of
the Python installation and that copy of kvlib only (not the real kvlib, the course's solutions or
the grader's files), a private empty ``/tmp``, and its own process tree, which dies with it, in
control groups of its own that bound its processes and memory where the machine allows (``bounds.py``).
Elsewhere it runs as a plain process on the stubbed copy, and the report says grading was not
isolated.

The process reads the learner's statements, then one check request at a time (a task, a check, a
seed), and writes back one JSON line per check: an observation, or why there is none. The grader
checks each reply's shape and compares the observation with its own reference; nothing a reply
says is a score.
"""
from __future__ import annotations

import functools
import importlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from kvlib.course.grading.bounds import Bounds, bounded
from kvlib.course.grading.checks import Observed
from kvlib.course.grading.decisions import DECIDED, decided
from kvlib.course.grading.extract import Statement, load
from kvlib.course.grading.hidden import PACKAGE, stubbed_tree
from kvlib.course.grading.results import CRASHED, FAIL, NOT_IMPLEMENTED, TIMED_OUT

STARTUP_LIMIT_S = 120.0  # importing torch and kvlib, then defining the learner's names
MAX_REPLY_BYTES = 8 * 2**20
MAX_MESSAGE_CHARS = 2000
IN_SANDBOX = "/grading"  # where the stubbed kvlib copy is seen inside an isolated sandbox
NOBODY = 65534  # the sandbox's user and group inside, and outside too where root can hand bubblewrap to them
NOT_ISOLATED = "grading without isolation ({why}): for practice, not for marks"
ROOT_OUTSIDE = ("the sandbox's user is root outside its namespaces ({why}): a submission that broke out of them "
                "would be root on this machine")
NOT_BOUNDED = "a submission's processes and memory are not bounded here ({why}): a fork or memory bomb slows the class"
REPLY_DATA = {"observed": "observation", DECIDED: "decisions"}  # a reply's status -> the key of its data


@dataclass(frozen=True)
class Limits:
    memory_bytes: Optional[int] = 8 * 2**30  # address space of the process running the checks, and of its whole tree
    processes: int = 512  # processes and threads of one sandbox's whole tree, where control groups can be made
    check_scale: float = 1.0  # multiplies every check's own time limit (a slow machine, a loaded class run)
    submission_s: float = 600.0  # wall-clock seconds all of one submission's checks may take, scaled too

    @property
    def budget_s(self) -> float:
        return self.submission_s * self.check_scale


class Crashed(Exception):
    """The sandbox process died, hung or answered something that is not a reply; ``status`` says which."""

    def __init__(self, message: str, status: str = CRASHED):
        super().__init__(message)
        self.status = status


class Sandbox:
    """The learner's definitions, loaded in a fresh isolated process on kvlib without ``hidden``; ``observe``
    runs one check."""

    def __init__(self, lab: str, statements: list[Statement], hidden: tuple[str, ...], limits: Limits = Limits()):
        self.lab, self.statements, self.tree, self.limits = lab, statements, stubbed_tree(hidden), limits
        self.process: Optional[subprocess.Popen] = None
        self.bounds: Optional[Bounds] = None
        self.startup_error: Optional[str] = None

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def observe(self, task: str, check: str, seed: int, limit_s: float) -> Observed:
        """One check's observation; a crash, a hang or a malformed reply raises :class:`Crashed`."""
        if self.process is None:
            self._start()
        if self.startup_error is not None:
            raise Crashed(self.startup_error)
        self._send({"task": task, "check": check, "seed": seed})
        try:
            return reply_to_observed(self._receive(limit_s))
        except TimeoutError:
            self.close()
            raise Crashed(f"still running after {limit_s:.3g} s; look for a loop that never ends", TIMED_OUT) from None
        except EOFError:
            status = self._exit_status()
            self.close()
            raise Crashed(f"the process running your code ended during this check ({status})") from None
        except ValueError as exc:
            self.close()
            raise Crashed(f"the process running your code sent something that is not a reply ({exc})") from None

    def _exit_status(self) -> str:
        """Why the sandbox's process ended, from its exit status (a shell or bubblewrap gives a signal as 128 + it)."""
        try:
            code = self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return "its output closed; out of memory, or a hard crash"
        signal_number = -code if code < 0 else code - 128 if code > 128 else None
        if signal_number is not None:
            name = signal.Signals(signal_number).name if signal_number in set(signal.Signals) else signal_number
            return f"killed by {name}: out of memory, the process limit, or a hard crash"
        return f"it exited with status {code}: look for os._exit() in your code"

    def close(self) -> None:
        """Kill the process and every process it started (its own session, and its own PID namespace)."""
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.process.kill()
            self.process.wait()
            for stream in (self.process.stdin, self.process.stdout):
                stream.close()
            self.process = None
        if self.bounds is not None:
            self.bounds.close()  # whatever escaped the session is still in the groups
            self.bounds = None

    def _start(self) -> None:
        command, env = sandbox_command(self.tree)
        self.bounds = bounded(self.limits.processes, self.limits.memory_bytes)
        command = self.bounds.command(command) if self.bounds is not None else command
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, env=env, start_new_session=True, cwd="/")
        self._send({"lab": self.lab, "memory_bytes": self.limits.memory_bytes,
                    "statements": [asdict(s) for s in self.statements]})
        try:
            reply = self._receive(STARTUP_LIMIT_S)
        except (TimeoutError, EOFError, ValueError):
            reply = {"error": "your definitions did not finish loading (a loop or a crash at definition time)"}
        self.startup_error = None if reply.get("ready") is True else str(reply.get("error", "no ready reply"))[
            :MAX_MESSAGE_CHARS]

    def _send(self, message: dict) -> None:
        try:
            self.process.stdin.write((json.dumps(message) + "\n").encode())
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the process is gone; the reply that never comes says so

    def _receive(self, limit_s: float) -> dict:
        deadline = time.monotonic() + limit_s
        line = b""
        stdout = self.process.stdout
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([stdout], [], [], max(0.0, left))
            if not ready:
                raise TimeoutError
            chunk = os.read(stdout.fileno(), 1 << 16)
            if not chunk:
                raise EOFError
            line += chunk
            if len(line) > MAX_REPLY_BYTES:
                raise ValueError(f"a reply over {MAX_REPLY_BYTES} bytes")
        if line.count(b"\n") > 1:
            raise ValueError("more than one reply to one request")
        try:
            reply = json.loads(line)
        except RecursionError:
            raise ValueError("a reply nested too deep to read") from None
        if not isinstance(reply, dict):
            raise ValueError("a reply that is not an object")
        return reply


def reply_to_observed(reply: dict) -> Observed:
    """A check's reply, shape-checked: exactly a status, and an observation, decisions or a message."""
    status = reply.get("status")
    if status in REPLY_DATA and set(reply) == {"status", REPLY_DATA[status]}:
        return Observed(status, reply[REPLY_DATA[status]])
    if status in (FAIL, NOT_IMPLEMENTED) and set(reply) == {"status", "message"} and isinstance(reply["message"], str):
        return Observed(status, message=reply["message"][:MAX_MESSAGE_CHARS])
    raise ValueError(f"keys {sorted(reply)}, status {status!r}")


# ---- isolation ----------------------------------------------------------------------------------
# Run by root, bubblewrap builds the sandbox without a user namespace (one made by root maps the sandbox's
# users to root outside it), keeping only what ``setpriv`` needs to hand the process to nobody with every
# capability, inheritable and bounding ones included, gone and no way to gain one back.
ROOT_NAMESPACES = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                   "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
HAND_OVER = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--no-new-privs",
             "--inh-caps=-all", "--bounding-set=-all", "--"]
USER_NAMESPACES = ["--unshare-all", "--cap-drop", "ALL", "--uid", str(NOBODY), "--gid", str(NOBODY)]


@functools.cache
def isolation() -> Optional[str]:
    """None when sandboxes run isolated (bubblewrap works here), else why not."""
    if os.environ.get("KVLIB_GRADING_NO_ISOLATION"):
        return "KVLIB_GRADING_NO_ISOLATION is set"
    if sys.platform != "linux":
        return f"{sys.platform} has no Linux namespaces"
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    if _hands_over():
        return None
    probe = _probe(hand_over=False)
    if probe.returncode != 0:
        return f"bubblewrap cannot make namespaces here: {probe.stderr.strip()[:200]}"
    return None


@functools.cache
def _hands_over() -> bool:
    """Whether this process is root and its sandboxes run as nobody outside them too (``ROOT_NAMESPACES``)."""
    return os.geteuid() == 0 and shutil.which("setpriv") is not None and _probe(hand_over=True).returncode == 0


def _probe(hand_over: bool) -> subprocess.CompletedProcess:
    """A sandbox on an empty tree that lists every folder this Python imports from: it fails where bubblewrap
    cannot make its namespaces, or where the sandbox's user cannot read this Python."""
    listing = "import os, sys; [os.listdir(p) for p in sys.path if os.path.isdir(p)]"
    with tempfile.TemporaryDirectory() as empty:
        os.chmod(empty, 0o755)
        return subprocess.run([*_bwrap_arguments(Path(empty), hand_over), sys.executable, "-c", listing],
                              capture_output=True, text=True)


def root_outside() -> Optional[str]:
    """None unless an isolated sandbox's user is root outside its namespaces; then why it is not nobody."""
    if isolation() is not None or os.geteuid() != 0 or _hands_over():
        return None
    if shutil.which("setpriv") is None:
        return "setpriv is not installed"
    return "a sandbox handed to nobody did not start here"


def sandbox_command(tree: Path) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a sandbox process on ``tree``."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1",
           "MPLCONFIGDIR": "/tmp", "TRITON_CACHE_DIR": "/tmp/triton", "LANG": "C.UTF-8"}
    env.update({k: v for k, v in os.environ.items()
                if k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES",
                         "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")})
    python = [sys.executable, "-s", "-m", "kvlib.course.grading.sandbox"]
    if isolation() is None:
        env["PYTHONPATH"] = IN_SANDBOX
        return [*_bwrap_arguments(tree, _hands_over()), *python], env
    env["PYTHONPATH"] = str(tree)
    env["HOME"] = env["TMPDIR"] = env["MPLCONFIGDIR"] = str(tree)
    env["TRITON_CACHE_DIR"] = str(tree / ".triton")
    return python, env


OWN_MOUNTS = {"/proc": ["--proc"], "/dev": ["--dev"], "/tmp": ["--perms", "1777", "--tmpfs"],
              "/dev/shm": ["--perms", "1777", "--tmpfs"]}  # made for each sandbox, in this order


def _bwrap_arguments(tree: Path, hand_over: bool) -> list[str]:
    """Namespaces and a read-only view of this Python and ``tree`` (seen at /grading), nothing else of the disk;
    with ``hand_over``, built by root and run by nobody (``ROOT_NAMESPACES``), else in user namespaces."""
    # bubblewrap as the grader finds it: the sandbox's command runs with a PATH of the system's folders only
    args = [shutil.which("bwrap") or "bwrap", *(ROOT_NAMESPACES if hand_over else USER_NAMESPACES), "--die-with-parent",
            "--new-session", "--hostname", "sandbox"]
    binds = [(system, system) for system in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc/alternatives",
                                             "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/passwd",
                                             "/etc/group", "/etc/localtime", "/sys") if os.path.exists(system)]
    roots = _python_roots()
    binds += [(root, root) for root in roots]
    real_kvlib = str(PACKAGE)
    if any(real_kvlib == root or real_kvlib.startswith(root.rstrip("/") + "/") for root in roots):
        binds.append((str(tree / "kvlib"), real_kvlib))  # an installed kvlib is seen as the stubbed copy
    binds.append((str(tree), IN_SANDBOX))
    # The sandbox's own mounts first, so a Python bound below one (a virtual environment in /tmp) stays visible.
    for path, mount in OWN_MOUNTS.items():
        args += [*mount, path]
    above = {str(parent) for _, target in binds for parent in Path(target).parents} - {"/", *OWN_MOUNTS}
    for folder in sorted(above):
        args += ["--perms", "0755", "--dir", folder]  # the folders above a bound one: nobody passes through them
    for source, target in binds:
        args += ["--ro-bind", source, target]
    for device in sorted(Path("/dev").glob("nvidia*")):
        args += ["--dev-bind", str(device), str(device)]
    return [*args, "--chdir", "/tmp", "--", *(HAND_OVER if hand_over else [])]


def _python_roots() -> list[str]:
    """The folders this interpreter and its packages live in, outermost first, never kvlib's own checkout
    (where the course's solutions and tests are), nor the working directory, the running script's folder or
    a folder on PYTHONPATH: ``python -m kvlib.cli grade .`` puts the class folder itself on ``sys.path``."""
    candidates = {sys.base_prefix, sys.prefix, os.path.dirname(os.path.realpath(sys.executable))}
    not_python = {os.path.realpath(p) for p in [os.getcwd(), sys.path[0], *os.environ.get("PYTHONPATH", "").split(
        os.pathsep)] if p}
    candidates |= {p for p in sys.path if p and os.path.isabs(p) and os.path.isdir(p)
                   and os.path.realpath(p) not in not_python}
    checkout = PACKAGE.parent
    installed = checkout.name in ("site-packages", "dist-packages")  # a wheel's kvlib: overlaid, see above
    roots = sorted({os.path.realpath(p) for p in candidates} | candidates, key=len)
    kept: list[str] = []
    for root in roots:
        inside_checkout = not installed and (Path(root) == checkout or checkout in Path(root).parents)
        if inside_checkout or root in ("/", "/tmp") or any(root.startswith(k.rstrip("/") + "/") for k in kept):
            continue
        kept.append(root)
    return kept


# ---- the process side ---------------------------------------------------------------------------
def _serve() -> None:
    """Load the learner's code, then answer one check per request with its observation."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the learner's prints, from Python or a C library, must not reach the replies
    sys.stdout = sys.stderr
    setup = json.loads(sys.stdin.readline())
    if setup["memory_bytes"]:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (setup["memory_bytes"], setup["memory_bytes"]))
    lab = importlib.import_module(f"kvlib.course.grading.{setup['lab']}")
    try:
        namespace = load([Statement(**statement) for statement in setup["statements"]]).__dict__
    except BaseException as exc:  # noqa: BLE001 - reported as the reason every check of this submission fails
        replies.write(json.dumps({"error": f"your definitions raise {type(exc).__name__}: {exc} when they run"}) + "\n")
        replies.flush()
        return
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    tasks = {task.name: task for task in lab.TASKS}
    for line in sys.stdin:
        request = json.loads(line)
        task = tasks[request["task"]]
        observed = decided(task, task.named(request["check"]), task.piece(namespace), request["seed"])
        reply = {"status": observed.status, REPLY_DATA[observed.status]: observed.observation} \
            if observed.status in REPLY_DATA else {"status": observed.status, "message": observed.message}
        try:
            text = json.dumps(reply, allow_nan=True)
        except (TypeError, ValueError) as exc:
            text = json.dumps({"status": FAIL, "message": f"the check's observation cannot be sent: {exc}"})
        replies.write(text + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve()
