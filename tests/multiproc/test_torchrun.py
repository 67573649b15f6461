"""tensorwire under torchrun, unchanged: the launcher's environment is all tw.init() needs."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import tensorwire as tw

SCRIPT = textwrap.dedent('''
    import torch
    import tensorwire as tw

    with tw.init(timeout=30) as comm:
        peer = (comm.rank + 1) % comm.world_size
        src = torch.arange(256, dtype=torch.int64) + 1000 * comm.rank
        dst = torch.full((256,), -1, dtype=torch.int64)
        with comm.register([src, dst]) as reg:
            comm.publish("src", reg.descs[:1])
            comm.read(dst, comm.lookup("src", peer, timeout=10), timeout=10)
            assert torch.equal(dst, torch.arange(256, dtype=torch.int64) + 1000 * peer), dst[:4]
            comm.barrier(timeout=10)
        agent_store = comm._rendezvous.env.agent_store
        print(f"rank {comm.rank}/{comm.world_size} local {comm.local_rank} read rank {peer}: ok "
              f"(agent store: {agent_store})", flush=True)
''')


def test_two_ranks_under_torchrun(tmp_path):
    """`torchrun --nproc-per-node 2 script.py` runs a ring READ with nothing but tw.init()."""
    script = tmp_path / "ring.py"
    script.write_text(SCRIPT)
    port = tw.testing.free_port()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(port), str(script)],
        capture_output=True, text=True, timeout=180,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    # Both ranks are clients of torchrun's own store, as torch.distributed's env:// init would be.
    assert "rank 0/2 local 0 read rank 1: ok (agent store: True)" in output, output[-3000:]
    assert "rank 1/2 local 1 read rank 0: ok (agent store: True)" in output, output[-3000:]
