"""What an insider, a stray file or another directory could do to stop the embedded directory, each tried for real:
a link or a FIFO where its state file goes, a disk that refuses the mark, two directories on one host and port,
a process with the token opening session after session. Each test asserts that the directory either refuses at
start, at once and saying what is at which path, or keeps serving (a join refused saying why, never a lost
directory, a hang or a lowered mark). Directories are ``tensorwire directory`` processes (or the embedded one in
a process of its own where the test must act inside it); members are real processes.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

import tensorwire as tw
from tensorwire.meeting.directory import Directory, Limits
from tensorwire.meeting.directory_store import DirectoryStore
from tensorwire.testing import free_port
from tensorwire.testing.suite import scaled

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")
TOKEN = b"hardening-token-0123456789abcdef"
LIVENESS_S = 2.0
VICTIM = "a file the directory must never write\n"


def _env(home: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWIRE_")}
    env.update({"PYTHONPATH": os.pathsep.join([SRC, env.get("PYTHONPATH", "")]),
                "TENSORWIRE_LIVENESS_S": str(LIVENESS_S), "TENSORWIRE_JOB_TOKEN": TOKEN.decode()})
    if home is not None:
        env["HOME"] = home
    return env


def _client(host: str, port: int, lease_s: float = 60.0) -> DirectoryStore:
    return DirectoryStore(host, port, token=TOKEN, lease_s=lease_s, connect_s=scaled(30.0),
                          request_s=scaled(30.0))


def _start(port: int, *flags: str, host: str = "127.0.0.1", home: str | None = None,
           preexec_fn=None) -> subprocess.Popen:
    """A ``tensorwire directory`` process that announced itself (it listens)."""
    process = subprocess.Popen([sys.executable, "-m", "tensorwire", "directory", "--host", host, "--port", str(port),
                                "--grace", "0", *flags], env=_env(home), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
    line = process.stdout.readline()
    assert "tensorwire directory at" in line, (line, process.poll(), process.stderr.read()[-3000:]
                                                if process.poll() is not None else "")
    return process


def _refused_at_start(port: int, *flags: str, preexec_fn=None) -> str:
    """stderr of a ``tensorwire directory`` that must exit 1 at once (not hang, not listen)."""
    done = subprocess.run([sys.executable, "-m", "tensorwire", "directory", "--port", str(port), "--grace", "0",
                           *flags], env=_env(), capture_output=True, text=True, timeout=scaled(60.0),
                          preexec_fn=preexec_fn, check=False)
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr[-3000:])
    assert "tensorwire directory at" not in done.stdout
    return done.stderr


def _stop(process: subprocess.Popen) -> str:
    """SIGTERM, then its stderr."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        _, err = process.communicate(timeout=scaled(30.0))
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate(timeout=30)
    return err


# --- the state file -----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_link_at_the_state_path_is_refused_at_start_and_its_target_untouched(tmp_path):
    victim, state = tmp_path / "victim", tmp_path / "directory.rank"
    victim.write_text(VICTIM)
    state.symlink_to(victim)
    err = _refused_at_start(free_port(), "--state", str(state))
    assert str(state) in err and "symbolic link" in err and "rm " in err, err
    assert victim.read_text() == VICTIM


PLANTED = """
import os, sys
from tensorwire.meeting.directory import Directory
state, victim = sys.argv[1], sys.argv[2]
# The temporary names a directory of this process could use: a fixed one and one naming its pid (as it once did).
for name in (state + ".tmp", f"{state}.{os.getpid()}.tmp"):
    os.symlink(victim, name)
with Directory(state=state) as directory:
    pass
print("started")
"""


@pytest.mark.slow
def test_a_link_planted_at_the_temporary_name_is_never_written_through(tmp_path):
    """The state file is written to a temporary name first; a link planted there is removed, not followed: its
    target keeps its bytes and the state file is a regular file holding the mark."""
    victim, state = tmp_path / "victim", tmp_path / "directory.rank"
    victim.write_text(VICTIM)
    done = subprocess.run([sys.executable, "-c", PLANTED, str(state), str(victim)], env=_env(), capture_output=True,
                          text=True, timeout=scaled(60.0), check=False)
    assert victim.read_text() == VICTIM, "the directory wrote through a link at its temporary name"
    assert done.returncode == 0 and "started" in done.stdout, done.stderr[-3000:]
    assert not state.is_symlink() and state.read_text().strip().isdigit()


@pytest.mark.slow
def test_a_fifo_at_the_state_path_fails_the_start_at_once_saying_so(tmp_path):
    """A plain open of a FIFO blocks until a writer comes: the start must fail within its bound instead."""
    state = tmp_path / "directory.rank"
    os.mkfifo(state)
    start = time.monotonic()
    try:
        err = _refused_at_start(free_port(), "--state", str(state))
    except subprocess.TimeoutExpired:
        pytest.fail(f"tensorwire directory hung on a FIFO at its state path for {time.monotonic() - start:.0f}s")
    assert str(state) in err and "FIFO" in err, err


def _no_file_writes() -> None:
    """In the directory's process: no write may grow a file (as on a full disk; root writes any folder)."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


@pytest.mark.slow
def test_a_state_folder_it_cannot_write_fails_the_start_saying_what_to_do(tmp_path):
    folder = tmp_path / "state"
    folder.mkdir(mode=0o700)
    state = folder / "directory.rank"
    err = _refused_at_start(free_port(), "--state", str(state), preexec_fn=_no_file_writes)
    assert str(state) in err and "--state" in err, err
    # A folder others may write (where a link could be planted) is refused too, naming the fix.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    err = _refused_at_start(free_port(), "--state", str(shared / "directory.rank"))
    assert "writable by others" in err and "chmod go-w" in err, err


@pytest.mark.slow
def test_a_disk_that_refuses_the_mark_later_refuses_joins_saying_so_and_never_lowers_it(tmp_path, processes):
    """Past its first block of ranks the directory must write a new mark; where the disk refuses (full, made
    read-only since) the join is refused with the reason, typed, and logged; the mark on disk stays; once the disk
    takes writes again joins go on above every rank given."""
    port, state = free_port(), tmp_path / "directory.rank"
    directory = _start(port, "--state", str(state))
    processes.append(directory)
    mark = int(state.read_text())
    member = _client("127.0.0.1", port)
    handed = [member.add("fleet/next_rank", 1) - 1]
    while handed[-1] + 2 <= mark:  # every rank the mark on disk covers
        handed.append(member.add("fleet/next_rank", 1) - 1)
    _, hard = resource.prlimit(directory.pid, resource.RLIMIT_FSIZE)
    resource.prlimit(directory.pid, resource.RLIMIT_FSIZE, (0, hard))  # as a full disk: no file may grow
    refused_since = time.monotonic()
    for _ in range(10):
        with pytest.raises(tw.InvalidArgumentError, match="cannot write its rank counter's mark"):
            member.add("fleet/next_rank", 1)
    seconds_refusing = time.monotonic() - refused_since
    assert int(state.read_text()) == mark, "the mark on disk changed although the disk refused it"
    resource.prlimit(directory.pid, resource.RLIMIT_FSIZE, (hard, hard))
    assert member.add("fleet/next_rank", 1) - 1 > max(handed)
    assert int(state.read_text()) > mark
    member.close()
    err = _stop(directory)
    logged = [line for line in err.splitlines() if "cannot write its rank counter's mark" in line]
    assert 1 <= len(logged) <= 1 + seconds_refusing, err[-3000:]  # once a second at most, with a count


@pytest.mark.slow
def test_two_directories_on_one_port_of_two_addresses_keep_a_state_file_each(tmp_path, processes):
    """127.0.0.1:P and 127.0.0.2:P by default: two files, each naming its address; one file given to both: the
    second is refused at start, so neither lowers the other's mark."""
    port, home = free_port(), str(tmp_path / "home")
    os.mkdir(home)
    for host in ("127.0.0.1", "127.0.0.2"):
        processes.append(_start(port, host=host, home=home))
    folder = os.path.join(home, ".local", "state", "tensorwire")
    assert sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".rank")) == [
        os.path.join(folder, f"directory-{host}-{port}.rank") for host in ("127.0.0.1", "127.0.0.2")]
    assert os.stat(folder).st_mode & 0o777 == 0o700
    marks = {}
    for host in ("127.0.0.1", "127.0.0.2"):
        client = _client(host, port)
        marks[host] = client.add("fleet/next_rank", 1)
        client.close()
    for process in processes:
        _stop(process)
    shared = str(tmp_path / "shared.rank")
    processes.append(_start(free_port(), "--state", shared))
    err = _refused_at_start(free_port(), "--state", shared)
    assert "another directory keeps its mark there" in err and shared in err, err


# --- sessions -----------------------------------------------------------------------------------------------------

INSIDER = """
import os, resource, sys, time
from tensorwire.meeting.directory_store import DirectoryStore
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
port, count, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
token = os.environ["TENSORWIRE_JOB_TOKEN"].encode()
held, failed = [], 0
def wave(n):
    global failed
    for _ in range(n):
        try:
            held.append(DirectoryStore("127.0.0.1", port, token=token, lease_s=600.0, connect_s=0.5, request_s=5.0))
        except Exception:
            failed += 1
wave(count)
open(out + ".ready", "w").write(str(failed))
while not os.path.exists(out + ".go"):
    time.sleep(0.05)
wave(300)
open(out + ".done", "w").write(str(failed))
while not os.path.exists(out + ".stop"):
    time.sleep(0.05)
"""

MEMBER = """
import json, os, sys, time
import tensorwire as tw
comm = tw.init(directory=sys.argv[1], name=sys.argv[2], timeout=float(sys.argv[4]))
with open(sys.argv[3] + ".tmp", "w") as f:
    json.dump({"rank": comm.rank}, f)
os.rename(sys.argv[3] + ".tmp", sys.argv[3])
while not os.path.exists(sys.argv[3] + ".stop"):
    time.sleep(0.05)
comm.close()
"""


def _wait_for(path: str, process: subprocess.Popen, seconds: float) -> str:
    deadline = time.monotonic() + scaled(seconds)
    while not os.path.exists(path):
        if process.poll() is not None:
            raise AssertionError(f"{path}: the process ended first (exit code {process.returncode})")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path}: not there after {scaled(seconds):.0f}s")
        time.sleep(0.05)
    with open(path) as f:
        return f.read()


@pytest.mark.slow
def test_one_insider_opening_every_session_drops_its_own_and_a_member_still_joins(tmp_path, processes):
    """A process with the token opens more sessions than the directory serves (1024), keeps them, and opens 300
    more once a member joined: an honest member joins from the same host all the same, and stays."""
    port = free_port()
    directory = _start(port, "--state", "none")
    processes.append(directory)
    insider_out, member_out = str(tmp_path / "insider"), str(tmp_path / "member.json")
    insider = subprocess.Popen([sys.executable, "-c", INSIDER, str(port), str(Limits().connections + 100),
                                insider_out], env=_env())
    processes.append(insider)
    _wait_for(insider_out + ".ready", insider, 120.0)
    member = subprocess.Popen([sys.executable, "-c", MEMBER, f"tcp://127.0.0.1:{port}", "honest", member_out,
                               str(scaled(30.0))], env=_env(), stderr=subprocess.PIPE, text=True)
    processes.append(member)
    try:
        rank = json.loads(_wait_for(member_out, member, 90.0))["rank"]
    except AssertionError:
        member.kill()
        raise AssertionError(f"the member did not join: {member.communicate(timeout=30)[1][-3000:]}") from None
    open(insider_out + ".go", "w").close()
    refused = int(_wait_for(insider_out + ".done", insider, 60.0))
    assert refused == 0, f"{refused} of the insider's sessions were refused instead of its oldest dropped"
    watcher = _client("127.0.0.1", port)
    assert f"member/{rank}" in watcher.list_prefix("member/"), "the member was dropped for the insider's sessions"
    assert member.poll() is None
    watcher.close()
    open(member_out + ".stop", "w").close()
    assert member.wait(timeout=scaled(60.0)) == 0, member.communicate()[1][-3000:]
    open(insider_out + ".stop", "w").close()
    err = _stop(directory)
    assert "hold no name, the directory's limit per host" in err, err[-3000:]


def test_a_directory_full_of_named_members_turns_a_newcomer_away_saying_so():
    """Only named members fill the directory; a newcomer then gets the reason (typed), not a lost directory, and
    the members stay. Names per host are bounded too."""
    with Directory(token=TOKEN, limits=Limits(connections=4, names_per_host=4)) as directory:
        members = [_client(directory.host, directory.port) for _ in range(4)]
        for i, member in enumerate(members):
            member.compare_set(f"name/m{i}", b"", b"sealed")
        newcomer = _client(directory.host, directory.port)
        with pytest.raises(tw.InvalidArgumentError, match="the directory is full"):
            newcomer.add("fleet/next_rank", 0)
        assert len(members[0].list_prefix("name/")) == 4
        members[3].delete_key("name/m3")  # no longer a member: the oldest session without a name goes for a newcomer
        again = _client(directory.host, directory.port)
        assert again.add("fleet/next_rank", 0) > 0
        assert len(members[0].list_prefix("name/")) == 3
        with pytest.raises(tw.InvalidArgumentError, match="names, the directory's limit per host"):
            for i in range(4, 8):
                again.compare_set(f"name/again{i}", b"", b"sealed")


def test_a_directory_with_a_new_state_file_lets_the_first_members_join_at_once(tmp_path):
    """No rank was ever handed out where the state file is new, so nobody has one to put back: no grace period;
    started again on the same file, the grace holds."""
    from tensorwire.meeting.directory import Directory

    state = str(tmp_path / "state" / "directory.rank")
    with Directory("127.0.0.1", 0, token=None, grace_s=30.0, state=state) as fresh:
        assert fresh.grace_s == 0.0
    with Directory("127.0.0.1", 0, token=None, grace_s=30.0, state=state) as restarted:
        assert restarted.grace_s == 30.0
