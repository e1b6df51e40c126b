"""The tree keeper of `guardrails run`, run for real: it serves GUARDRAILS_METRICS_PORT for the
tree's whole life and leaves nothing of guardrails behind, whatever the command and however it
ends; it holds none of the caller's pipes and is no child of the command.

Each launch gets TMPDIR=tmp_path, so the tree's directory (`guardrails-metrics-*`) is made
there and what is left of it can be checked exactly; the keeper's command line names that
directory, so a keeper left running is found by it too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from tests.processes import ROOT, child_env
from tests.reporting.test_metrics_tree import RUN, free_port, nan_by_rank, run_tree

pytestmark = pytest.mark.slow  # a launch each: seconds

# One guarded call in a Python process of the tree, then what is in the tree's directory.
GUARD = (
    "import os\n"
    "from tests.reporting.tree_workload import guard\n"
    "guard(0)\n"
    "print(sorted(os.listdir(os.environ['GUARDRAILS_METRICS_DIR'])), flush=True)\n"
)


def tree_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return child_env(
        PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path), GUARDRAILS_REPORT_EVERY="1", **extra
    )


def launch(
    tmp_path: Path, *command: str, run: Sequence[str] = RUN, **extra: str
) -> subprocess.CompletedProcess[str]:
    """`run` (`guardrails run --`, or another launcher) COMMAND in a tree of `tmp_path`."""
    return subprocess.run(
        [*run, *command],
        env=tree_env(tmp_path, **extra),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def trees(tmp_path: Path) -> list[Path]:
    """The tree directories made under `tmp_path` that are still there."""
    return sorted(tmp_path.glob("guardrails-metrics-*"))


def naming(tmp_path: Path) -> list[int]:
    """The live processes, other than this one, whose command line names a tree directory
    under `tmp_path` (a keeper's names the directory it keeps)."""
    needle = str(tmp_path / "guardrails-metrics-").encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "cmdline").read_bytes() and running(int(entry.name)):
                found.append(int(entry.name))
    return found


def running(pid: int) -> bool:
    """Whether `pid` is a process that has not ended (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def soon(condition: Callable[[], bool], within_s: float = 15.0) -> bool:
    """Whether `condition` holds within `within_s` (the keeper cleans up after the command
    ended, so a moment after the caller sees it end)."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def port_answers(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def held_command(tmp_path: Path, port: int) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """`guardrails run -- sh` serving `port`, with every stream a pipe of this process: the
    command prints the tree's server marker, then exits 3 once a line reaches its stdin.
    Yields it and the pid the marker names."""
    script = 'cat "$GUARDRAILS_METRICS_DIR"/guardrails_metrics_*.server; echo; read line; exit 3'
    proc = subprocess.Popen(
        [*RUN, "sh", "-c", script],
        env=tree_env(tmp_path, GUARDRAILS_METRICS_PORT=str(port)),
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip(), "no server marker in the tree's directory when the command started"
        yield proc, int(json.loads(line)["pid"])
    finally:
        if proc.returncode is None:  # the test did not end it
            proc.kill()
            proc.communicate(timeout=60)


# -- nothing left behind ---------------------------------------------------------------------


def test_a_python_command_leaves_no_tree_directory(tmp_path: Path) -> None:
    done = launch(tmp_path, sys.executable, "-c", GUARD)
    assert done.returncode == 0, done.stderr[-4000:]
    assert ".db" in done.stdout  # the guarded call wrote the tree's files
    assert soon(lambda: trees(tmp_path) == []), trees(tmp_path)


def test_a_shell_command_leaves_no_tree_directory(tmp_path: Path) -> None:
    # The command is a shell (an entrypoint script): no Python process of the tree is the
    # launcher's pid.
    done = launch(tmp_path, "sh", "-c", '"$0" -c "$1"', sys.executable, GUARD)
    assert done.returncode == 0, done.stderr[-4000:]
    assert ".db" in done.stdout
    assert soon(lambda: trees(tmp_path) == []), trees(tmp_path)


def test_a_command_killed_by_sigkill_leaves_no_tree_directory(tmp_path: Path) -> None:
    code = GUARD + "import time\ntime.sleep(120)\n"
    proc = subprocess.Popen(
        [*RUN, sys.executable, "-c", code],
        env=tree_env(tmp_path),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert ".db" in proc.stdout.readline()
    proc.kill()  # no exit handler of the command runs
    assert proc.wait(timeout=60) == -signal.SIGKILL
    proc.stdout.close()
    assert soon(lambda: trees(tmp_path) == []), trees(tmp_path)


def test_without_a_pidfd_the_keeper_still_sees_the_command_end(tmp_path: Path) -> None:
    # A kernel before 5.3 (or a seccomp filter): the keeper polls the command's pid instead.
    launcher = (
        "import os, sys\n"
        "del os.pidfd_open\n"
        "from guardrails.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    done = launch(tmp_path, "sh", "-c", "exit 5", run=[sys.executable, "-c", launcher, "run", "--"])
    assert done.returncode == 5, done.stderr[-4000:]
    assert soon(lambda: trees(tmp_path) == []), trees(tmp_path)


def test_a_missing_command_leaves_no_keeper_and_no_directory(tmp_path: Path) -> None:
    done = launch(tmp_path, "guardrails-no-such-command", GUARDRAILS_METRICS_PORT=str(free_port()))
    assert done.returncode == 127
    assert "command not found" in done.stderr
    # At once: the launcher waited for its keeper to end before it returned.
    assert trees(tmp_path) == []
    assert naming(tmp_path) == []


def test_a_port_held_by_another_socket_stops_the_launch_before_anything_runs(
    tmp_path: Path,
) -> None:
    ran = tmp_path / "ran"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = launch(tmp_path, "touch", str(ran), GUARDRAILS_METRICS_PORT=str(port))
    assert done.returncode == 2
    assert f"GUARDRAILS_METRICS_PORT={port}: cannot serve metrics on 127.0.0.1:{port}" in (
        done.stderr
    )
    assert not ran.exists()
    assert trees(tmp_path) == []
    assert naming(tmp_path) == []


# -- the port, for the tree's whole life ----------------------------------------------------


def test_the_port_outlives_the_short_lived_child_that_guarded_first(tmp_path: Path) -> None:
    # The tree's first guarded process is a child that exits before the command scrapes.
    port = free_port()
    result, _done = run_tree("child-first", GUARDRAILS_METRICS_PORT=str(port), TMPDIR=str(tmp_path))
    assert result["exitcodes"] == [0]
    assert nan_by_rank(result["scrape"]) == {"1": 2.0}


def test_the_port_closes_and_the_keeper_ends_when_the_command_ends(tmp_path: Path) -> None:
    port = free_port()
    with held_command(tmp_path, port) as (proc, keeper):
        assert port_answers(port)
        proc.communicate("\n", timeout=60)
        assert proc.returncode == 3
    assert soon(lambda: not port_answers(port))
    assert soon(lambda: not running(keeper))
    assert soon(lambda: trees(tmp_path) == []), trees(tmp_path)


def test_a_launch_inside_a_launched_command_shares_the_enclosing_keepers_port(
    tmp_path: Path,
) -> None:
    # An entrypoint under `guardrails run` whose command is itself a `guardrails run`.
    inner = [*RUN, "sh", "-c", "exit 4"]
    done = launch(tmp_path, *inner, GUARDRAILS_METRICS_PORT=str(free_port()))
    assert done.returncode == 4, done.stderr[-4000:]
    assert soon(lambda: trees(tmp_path) == []), trees(tmp_path)


def test_a_sigterm_to_the_keeper_leaves_the_running_tree_served(tmp_path: Path) -> None:
    # systemd stops a service by signalling every process of its group at once: the keeper
    # outlives the command's shutdown, which may still write its last counts.
    port = free_port()
    with held_command(tmp_path, port) as (proc, keeper):
        os.kill(keeper, signal.SIGTERM)
        time.sleep(0.5)  # a keeper that acted on it would be gone by now
        assert running(keeper)
        assert port_answers(port)
        assert len(trees(tmp_path)) == 1
        proc.communicate("\n", timeout=60)
    assert soon(lambda: trees(tmp_path) == []), trees(tmp_path)


# A host that chooses multiprocess mode after start (SGLang): guardrails' series go to the
# host's directory, which the keeper learns about from the process's announcement.
HOST_DIRECTORY = (
    "import json, os, tempfile\n"
    "os.environ['PROMETHEUS_MULTIPROC_DIR'] = tempfile.mkdtemp(prefix='host-')\n"
    "import prometheus_client\n"
    "from tests.reporting.tree_workload import guard, scrape\n"
    "guard(0)\n"
    "print(json.dumps(scrape(int(os.environ['GUARDRAILS_METRICS_PORT']))))\n"
)


def test_series_in_a_host_directory_chosen_after_start_are_on_the_trees_port(
    tmp_path: Path,
) -> None:
    done = launch(
        tmp_path, sys.executable, "-c", HOST_DIRECTORY, GUARDRAILS_METRICS_PORT=str(free_port())
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert nan_by_rank(json.loads(done.stdout.splitlines()[-1])) == {"0": 1.0}


# -- out of the caller's and the command's way ---------------------------------------------


def test_the_keeper_holds_none_of_the_callers_pipes(tmp_path: Path) -> None:
    with held_command(tmp_path, free_port()) as (proc, keeper):
        streams = (proc.stdin, proc.stdout, proc.stderr)
        ours = {f"pipe:[{os.fstat(s.fileno()).st_ino}]" for s in streams if s is not None}
        assert len(ours) == 3
        fds = Path(f"/proc/{keeper}/fd")
        held = {int(fd.name): os.readlink(fd) for fd in fds.iterdir()}
        assert [held[n] for n in (0, 1, 2)] == ["/dev/null"] * 3
        assert not ours & set(held.values())
        # capture_output's way: the caller's reads end when the command does.
        proc.communicate("\n", timeout=30)
        assert proc.returncode == 3


def test_the_keeper_is_no_child_of_the_command_and_has_a_session_of_its_own(
    tmp_path: Path,
) -> None:
    with held_command(tmp_path, free_port()) as (proc, keeper):
        fields = Path(f"/proc/{keeper}/stat").read_text(encoding="ascii").rpartition(")")[2]
        ppid, session = int(fields.split()[1]), int(fields.split()[3])
        # Not the shell's child (its `wait` and SIGCHLD never see it), not in its session
        # (its process-group and terminal signals never reach it).
        assert ppid != proc.pid
        assert session == keeper
        assert session != os.getsid(proc.pid)
