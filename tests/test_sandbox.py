"""core.sandbox: every limit proven on the real kernel, no mocks.

CI runs as root, so the drop to uid 65534 is what protects the machine; the bwrap tests need bubblewrap
(`apt-get install bubblewrap`) and fail in CI without it (elsewhere they skip)."""
import errno
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from kimi_papers.core import sandbox as sb
from kimi_papers.core.sandbox import SANDBOX_UID, SandboxUnavailable, live_processes, run_command, run_python

ROOT = Path(__file__).resolve().parents[1]
IS_ROOT = os.geteuid() == 0
needs_bwrap = pytest.mark.skipif(not sb.bwrap_available() and not os.environ.get("CI"),
                                 reason="bubblewrap is not usable here: apt-get install bubblewrap")
needs_root = pytest.mark.skipif(not IS_ROOT, reason="the drop to uid 65534 needs root (CI runs as root)")


PRINT_CWD = "import os\nprint(os.getcwd(), flush=True)\n"  # a program's first line: tells the test its work dir


def _procs_in(text: str) -> list[int]:
    """Live processes of uid 65534 whose command line names `text` (a work dir: the launcher's config holds it).

    Tests run in parallel (xdist), so each test looks only at its own run's processes."""
    return [pid for pid, cmd in live_processes(SANDBOX_UID) if text in cmd]


def _left(text: str, grace: float = 1.0) -> list[int]:
    """The processes of one run still alive after a short grace period (the kernel reaps asynchronously)."""
    until = time.monotonic() + grace
    while (pids := _procs_in(text)) and time.monotonic() < until:
        time.sleep(0.05)
    return pids


@pytest.fixture
def host_dir():
    """A world-writable folder outside /tmp (bwrap hides the host's /tmp) holding a root-owned sentinel."""
    base = Path(tempfile.mkdtemp(prefix="kimi_sandbox_test_", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    base.chmod(0o777)  # no sticky bit: without the read-only mount, any uid could delete the sentinel
    sentinel = base / "sentinel.txt"
    sentinel.write_text("keep me")
    sentinel.chmod(0o644)
    yield base
    subprocess.run(["rm", "-rf", str(base)], check=False)


# ---- results of ordinary programs


@needs_bwrap
def test_print_and_exit_returns_ok_with_output():
    r = run_python("import sys\nprint('hello')\nprint(sys.stdin.read()[::-1])", stdin="abc")
    assert (r.status, r.exit_code, r.signal, r.stdout, r.stderr) == ("ok", 0, None, "hello\ncba\n", "")
    assert not r.stdout_truncated and not r.stderr_truncated and r.isolation == "bwrap"
    assert r.wall_s > 0 and r.cpu_s > 0 and 1 < r.max_rss_mb < 48  # an interpreter's worth


@needs_bwrap
def test_syntax_error_and_exception_return_error_with_traceback():
    r = run_python("def f(:\n    pass\n")
    assert (r.status, r.exit_code) == ("error", 1)
    assert 'main.py", line 1' in r.stderr and "SyntaxError" in r.stderr and "SyntaxError" in r.reason
    r = run_python("def f():\n    return 1 / 0\nf()\n")
    assert (r.status, r.exit_code) == ("error", 1)
    assert r.stderr.startswith("Traceback (most recent call last):") and "ZeroDivisionError" in r.stderr
    assert 'main.py", line 3' in r.stderr and "<string>" not in r.stderr  # the launcher's frame is hidden
    r = run_python("import sys\nsys.exit(3)")
    assert (r.status, r.exit_code) == ("error", 3)


@needs_bwrap
@needs_root
def test_child_runs_as_uid_65534_on_the_host():
    marker = f"probe_{os.getpid()}_{time.monotonic_ns()}"
    code = ("import os, time\nprint(os.getresuid(), os.getresgid(), os.getgroups())\n"
            "print(open('/proc/self/uid_map').read().split())\n"
            "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')][0])\n"
            f"open({marker!r}, 'w').close()\ntime.sleep(1.5)\n")
    seen = {}

    def watch():  # from the host: who owns the file it made, and which uid its processes have
        until = time.monotonic() + 10
        while not seen and time.monotonic() < until:
            for f in Path(tempfile.gettempdir()).glob(f"{sb.WORKDIR_PREFIX}*/{marker}"):
                seen.update(owner=f.stat().st_uid, procs=_procs_in(str(f.parent)))
            time.sleep(0.05)

    probe = threading.Thread(target=watch)
    probe.start()
    r = run_python(code, allow_imports=None)
    probe.join()
    assert r.status == "ok", r
    lines = r.stdout.splitlines()
    assert lines[0] == "(65534, 65534, 65534) (65534, 65534, 65534) []"
    assert lines[1] == "['0', '0', '4294967295']"  # the host's user namespace: uid 65534 is the kernel's uid
    assert int(lines[2], 16) == 0                    # no capabilities left
    assert seen.get("owner") == SANDBOX_UID, seen   # the host sees the file as uid 65534's, not root's
    assert seen.get("procs"), "the host's /proc showed no process of uid 65534 for this run"


# ---- wall clock, CPU, memory, processes


@needs_bwrap
def test_infinite_loop_is_killed_at_its_timeout():
    t0 = time.monotonic()
    r = run_python("print('started')\nwhile True:\n    pass\n", timeout_s=1.0)
    elapsed = time.monotonic() - t0
    assert r.status == "timeout" and r.signal == signal.SIGKILL and "wall-clock" in r.reason
    assert 1.0 <= r.wall_s < 1.5 and elapsed < 2.5, (r.wall_s, elapsed)
    assert r.stdout == "started\n" and r.cpu_s > 0  # output before the kill survives; the loop really ran


@needs_bwrap
def test_cpu_limit_stops_the_program_with_sigxcpu():
    r = run_python("while True:\n    pass\n", cpu_s=1, timeout_s=30)
    assert r.status == "timeout" and r.signal == signal.SIGXCPU and "CPU limit" in r.reason, r
    assert 0.9 <= r.cpu_s < 2.5 and r.wall_s < 30


@needs_bwrap
def test_memory_bomb_fails_safely_with_status_memory():
    t0 = time.monotonic()
    r = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))\n", memory_mb=128)
    assert r.status == "memory" and r.exit_code == sb.MEMORY_EXIT and "MemoryError" in r.stderr, r
    assert r.max_rss_mb < 128 + 8 and time.monotonic() - t0 < 5
    r = run_python("a = bytearray(64 << 20)\na[::4096] = b'x' * len(a[::4096])\n", memory_mb=256)
    assert r.ok and 64 <= r.max_rss_mb < 64 + 32, r  # the code's peak RSS, not this (larger) process's
    r = run_python("x = bytearray(1 << 34)\n", memory_mb=128)
    assert r.status == "memory" and "128 MiB" in r.reason


@needs_bwrap
def test_fork_bomb_is_bounded_and_leaves_no_processes():
    count = (PRINT_CWD + "import time\nn = 0\nwhile True:\n    try:\n        if os.fork() == 0:\n"
             "            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
             "    except OSError as e:\n        print(n, e.errno)\n        break\n")
    t0 = time.monotonic()
    r = run_python(count, gate=False, max_procs=8)
    work, n, err = r.stdout.split()
    assert r.status == "ok" and int(err) == errno.EAGAIN and 0 <= int(n) < 8, r   # RLIMIT_NPROC binds uid 65534
    assert time.monotonic() - t0 < 10 and not _left(work)  # the 60 s sleepers died with the program
    bomb = PRINT_CWD + "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = run_python(bomb, gate=False, max_procs=16, timeout_s=1.0)
    work = r.stdout.split()[0]
    assert r.status == "timeout" and r.wall_s < 1.5 and sb.WORKDIR_PREFIX in work, r
    assert not _left(work), "sandbox processes outlived the fork bomb"
    assert not Path(work).exists()


@needs_bwrap
def test_the_run_ends_when_the_caller_dies():
    base = Path(tempfile.mkdtemp(prefix="kimi_sandbox_caller_", dir="/tmp"))
    base.chmod(0o755)  # the caller's TMPDIR: its run's work dir, hence its processes, are named by this path
    caller = subprocess.Popen([sys.executable, "-c", "from kimi_papers.core.sandbox import run_python\n"
                               "run_python('import time\\nwhile True: time.sleep(1)', timeout_s=60, gate=False)"],
                              env={**os.environ, "TMPDIR": str(base)})
    try:
        until = time.monotonic() + 10
        while not _procs_in(str(base)) and time.monotonic() < until:
            time.sleep(0.05)
        assert _procs_in(str(base)), "the sandbox never started"
        caller.kill()
        caller.wait()
        assert not _left(str(base), 3.0), "the sandbox outlived its caller"
    finally:
        caller.kill()
        subprocess.run(["rm", "-rf", str(base)], check=False)  # the killed caller could not delete its work dir


@needs_bwrap
def test_a_program_ended_by_a_signal_is_killed():
    r = run_python("import os, signal\nprint('before', flush=True)\nos.kill(os.getpid(), signal.SIGSEGV)\n",
                   gate=False, allow_imports=None)
    assert (r.status, r.signal, r.exit_code, r.stdout) == ("killed", signal.SIGSEGV, None, "before\n"), r
    assert "SIGSEGV" in r.reason


@needs_bwrap
def test_file_size_and_open_file_limits():
    r = run_python("open('big', 'wb').write(b'x' * (3 << 20))\n", max_file_mb=1)
    assert r.status == "error" and "File too large" in r.stderr
    r = run_python("fs = [open('f%d' % i, 'w') for i in range(100)]\n", max_open_files=32)
    assert r.status == "error" and "Too many open files" in r.stderr


# ---- filesystem and network


@needs_bwrap
def test_writing_outside_the_work_dir_fails(host_dir):
    targets = [host_dir / "new.txt", Path("/var/tmp/kimi_sandbox_probe.txt"), Path("/etc/kimi_sandbox_probe"),
               ROOT / "kimi_sandbox_probe.txt"]
    code = ("import errno\nfor p in %r:\n    try:\n        open(p, 'w').write('x')\n        print('WROTE', p)\n"
            "    except OSError as e:\n        print(errno.errorcode[e.errno])\n"
            "open('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())\n" % [str(t) for t in targets])
    r = run_python(code, gate=False)
    got = r.stdout.split()
    assert r.status == "ok" and got[-1] == "ok" and len(got) == len(targets) + 1, r
    assert got[:2] == ["EROFS", "EROFS"], got  # world-writable folders: only the read-only mount stops these
    assert set(got[2:-1]) <= {"EROFS", "EACCES"}, got  # EACCES where the checkout is below a closed folder
    assert not any(t.exists() for t in targets)


@needs_bwrap
@needs_root
def test_deleting_a_file_it_does_not_own_fails(host_dir):
    sentinel = host_dir / "sentinel.txt"
    assert sentinel.stat().st_uid == 0
    r = run_python("import os\nos.remove(%r)\n" % str(sentinel), gate=False)
    assert r.status == "error" and "Read-only file system" in r.stderr
    assert sentinel.read_text() == "keep me"
    # without the mount namespace the uid drop alone protects a root-owned folder
    closed = host_dir / "root_only"
    closed.mkdir(mode=0o755)
    (closed / "f").write_text("root's")
    r = run_python("import os\nos.remove(%r)\n" % str(closed / "f"), gate=False, isolation="rlimits")
    assert r.status == "error" and "PermissionError" in r.stderr and (closed / "f").read_text() == "root's"


@needs_bwrap
def test_connecting_to_a_listener_on_localhost_fails():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.settimeout(0.3)
    port = srv.getsockname()[1]
    code = ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', %d), timeout=2)\n    print('CONNECTED')\n"
            "except OSError as e:\n    print(type(e).__name__)\n" % port)
    try:
        r = run_python(code, gate=False, allow_imports=None)
        assert r.status == "ok" and r.stdout == "ConnectionRefusedError\n", r  # its own network namespace
        with pytest.raises(socket.timeout):
            srv.accept()
        # positive control: the same program does reach the listener without a network namespace ...
        r = run_python(code, gate=False, allow_imports=None, isolation="rlimits")
        assert r.stdout == "CONNECTED\n", r
        srv.accept()[0].close()
        # ... which is where the gate stops it
        r = run_python(code, allow_imports=None, isolation="rlimits")
        assert r.stdout == "PermissionError\n", r
    finally:
        srv.close()


# ---- output, the gate, the machine afterwards


@needs_bwrap
def test_output_over_the_cap_is_truncated_and_flagged():
    r = run_python("import sys\nprint('x' * 100_000)\nsys.stderr.write('y' * 50_000)\n", max_output=1000)
    assert r.status == "ok" and r.stdout == "x" * 1000 and r.stderr == "y" * 1000
    assert r.stdout_truncated and r.stderr_truncated
    r = run_python("print('x' * 999)", max_output=1000)
    assert r.stdout == "x" * 999 + "\n" and not r.stdout_truncated


@needs_bwrap
def test_gate_blocks_imports_processes_sockets_and_writes():
    for code, what in [("import os", "import of 'os'"), ("exec('import subprocess')", "import of 'subprocess'"),
                       ("__import__('socket')", "import of 'socket'"), ("import ctypes", "import of 'ctypes'")]:
        r = run_python(code)
        assert r.status == "error" and f"sandbox gate: {what} is not allowed" in r.stderr, (code, r)
    r = run_python("import json, statistics, decimal, random, collections\nprint(json.dumps(statistics.mean([1, 2])))")
    assert r.stdout == "1.5\n", r  # allowed modules may import what they need internally
    for code, what in [("os.system('true')", "os.system"), ("open('/var/tmp/x', 'w')", "writing '/var/tmp/x'"),
                       ("os.remove('/etc/hostname')", "os.remove on '/etc/hostname'"), ("os.fork()", "os.fork"),
                       ("import socket; socket.socket()", "socket.__new__")]:
        r = run_python("import os\n" + code, allow_imports=["os", "socket"], isolation="rlimits")
        assert r.status == "error" and f"sandbox gate: {what}" in r.stderr, (code, r)
    assert run_python("open('inside.txt', 'w').write('ok')", isolation="rlimits").ok


@needs_bwrap
def test_machine_is_unchanged_afterwards(host_dir):
    tmp_probe = Path(tempfile.gettempdir()) / f"kimi_sandbox_probe_{os.getpid()}"
    nasty = (PRINT_CWD + "import time\nfor f in (lambda: os.remove(%r), lambda: open(%r, 'w').write('x')):\n"
             "    try:\n        f()\n    except OSError:\n        pass\n"
             "if os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
             "print('done')\n") % (str(host_dir / "sentinel.txt"), str(tmp_probe))
    r = run_python(nasty, gate=False)
    work, done = r.stdout.split()
    assert r.status == "ok" and done == "done", r
    assert (host_dir / "sentinel.txt").read_text() == "keep me"
    assert not tmp_probe.exists()                          # its /tmp was private
    assert not _left(work), "a sandbox process (the setsid sleeper) is still running"
    assert not Path(work).exists(), "the work dir was left behind"


# ---- refusal, arguments, run_command


def test_refuses_without_bwrap_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no bwrap on PATH
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap") as exc:
        run_python("print(1)")
    assert "\n" not in str(exc.value) and "isolation='rlimits'" in str(exc.value)
    r = run_python("print(1)", isolation="rlimits")  # asked for explicitly: runs
    assert r.status == "ok" and r.stdout == "1\n" and r.isolation == "rlimits"


@pytest.mark.parametrize("kwargs, name", [
    (dict(timeout_s=0), "timeout_s"), (dict(timeout_s=float("inf")), "timeout_s"), (dict(memory_mb=8), "memory_mb"),
    (dict(memory_mb=256.0), "memory_mb"), (dict(cpu_s=-1), "cpu_s"), (dict(max_output=-1), "max_output"),
    (dict(max_procs=True), "max_procs"), (dict(max_open_files=4), "max_open_files"), (dict(isolation="docker"), "isolation"),
    (dict(stdin=3), "stdin"), (dict(files={"../x": "y"}), "files"), (dict(files={"a": 1}), "files"),
    (dict(allow_imports="math"), "allow_imports"), (dict(allow_imports=["os.path"]), "allow_imports"),
    (dict(gate="yes"), "gate"), (dict(hash_seed=-1), "hash_seed"), (dict(python="/nonexistent/python"), "python"),
])
def test_bad_arguments_raise_value_error_naming_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        run_python("print(1)", **kwargs)


def test_bad_code_and_argv_raise_value_error():
    with pytest.raises(ValueError, match="code"):
        run_python(b"print(1)")
    for argv in ("ls -l", [], ["ls", 3], [""]):
        with pytest.raises(ValueError, match="argv"):
            run_command(argv)


@needs_bwrap
def test_run_command_runs_a_program_under_the_same_limits():
    r = run_command(["/bin/sh", "-c", "cat input.txt; id -u; echo oops >&2; exit 4"], files={"input.txt": "hi\n"})
    assert (r.status, r.exit_code, r.stderr) == ("error", 4, "oops\n")
    assert r.stdout.splitlines() == ["hi", str(SANDBOX_UID)]  # as root the kernel's uid; else a user namespace's
    r = run_command(["sleep", "10"], timeout_s=0.5)
    assert r.status == "timeout" and r.wall_s < 1.0
    r = run_command(["no-such-program-here"])
    assert (r.status, r.exit_code) == ("error", 127) and "cannot run" in r.stderr


@needs_root
def test_rlimits_isolation_drops_the_uid_and_keeps_the_limits():
    r = run_python("import os\nprint(os.getresuid())", allow_imports=None, isolation="rlimits")
    assert r.stdout == "(65534, 65534, 65534)\n", r
    r = run_python("while True:\n    pass\n", timeout_s=0.5, isolation="rlimits")
    assert r.status == "timeout" and r.wall_s < 1.0
    r = run_python("x = bytearray(1 << 34)", memory_mb=128, isolation="rlimits")
    assert r.status == "memory"


@needs_bwrap
@pytest.mark.parametrize("seed", [0, 7])
def test_hash_seed_fixes_set_order(seed):
    code = "print(list({'alpha', 'beta', 'gamma', 'delta', 'epsilon', 'zeta', 'eta', 'theta'}))"
    ref = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": str(seed)},
                         capture_output=True, text=True, check=True).stdout  # the reference: the same seed on the host
    assert run_python(code, hash_seed=seed).stdout == ref
