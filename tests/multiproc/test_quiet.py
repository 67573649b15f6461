"""A job prints nothing of NIXL's own when nothing is wrong: its informational lines ("Initialized NIXL agent",
"Backend UCX was instantiated", one pair per rank) go to the ``tensorwire.nixl`` logger at DEBUG; and every
rank's close records its departure (no "peers were not told" warning)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))

JOB = textwrap.dedent('''
    import logging, sys
    import tensorwire as tw
    from tensorwire.testing.data import rank_values, sentinel

    def ring():
        debug = []
        handler = logging.Handler()
        handler.emit = lambda record: debug.append(record.getMessage())
        logging.getLogger("tensorwire.nixl").addHandler(handler)
        logging.getLogger("tensorwire.nixl").setLevel(logging.DEBUG)
        comm = tw.init(timeout=30)
        buf, out = rank_values(comm.rank, 1024), sentinel(1024)
        reg = comm.register([buf, out])
        comm.publish("kv", reg.descs[:1])
        comm.read(out, comm.lookup("kv", (comm.rank + 1) % comm.world_size, timeout=10)[0], timeout=10)
        comm.barrier(timeout=10)
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            comm.close()
        told = not any("peers were not told" in str(w.message) for w in caught)
        return any("Initialized NIXL agent" in line for line in debug) and told

    if __name__ == "__main__":
        sys.path.insert(0, sys.argv[1])
        import quiet_job
        print("debug records:", tw.testing.launch(quiet_job.ring, 4))
''')


def test_a_job_prints_no_nixl_info_lines(tmp_path):
    (tmp_path / "quiet_job.py").write_text(JOB)
    done = subprocess.run([sys.executable, str(tmp_path / "quiet_job.py"), str(tmp_path)], capture_output=True,
                          text=True, timeout=180, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "debug records: [True, True, True, True]" in output, output[-3000:]
    for line in ("NIXL INFO", "Initialized NIXL agent", "Backend UCX was instantiated"):
        assert line not in output, output[-3000:]
    print(f"\nNIXL error lines at shutdown: {output.count('genNotif')} (a closing peer's last message racing an agent "
          "that just went)")
