"""The rendezvous ports of the multi-rank tests (tests/dist_utils.py ``free_port``): never one the kernel may
hand to another socket in the meantime, never one another test process on the host holds.

A launched run binds its MASTER_PORT tens of seconds after the test chose it (the launcher and every rank
import torch and DeepSpeed first). A port chosen with bind(("", 0)) and freed comes from the ephemeral
range, from which every outgoing connection's source port is drawn as well (gloo opens one per pair of
ranks and group, in every test of every process on the host): the run then fails to bind it, the failure
seen once each in two launcher tests on a loaded machine. No timing is involved in these checks.
"""

from __future__ import annotations

import socket
import subprocess
import sys

from tests.dist_utils import REPO, ephemeral_port_range, free_port, port_lock_path


def test_ports_come_from_outside_the_range_connections_use():
    low, high = ephemeral_port_range()
    # the premise: an outgoing connection takes its source port from [low, high]
    with socket.socket() as server, socket.socket() as client:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        client.connect(server.getsockname())
        assert low <= client.getsockname()[1] <= high
    ports = [free_port() for _ in range(3)]
    assert all(1024 <= p < low for p in ports), f"{ports} overlap the ephemeral range {low}-{high}"
    assert len(set(ports)) == 3, "one process was handed the same port twice"


def test_a_reserved_port_is_locked_for_other_processes():
    port = free_port()
    probe = (
        "import fcntl, os, sys\n"
        f"fd = os.open({port_lock_path(port)!r}, os.O_RDWR)\n"
        "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept OSError:\n    sys.exit(3)\nsys.exit(0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, timeout=60)
    assert proc.returncode == 3, f"another process could take port {port}'s lock while this one holds it"
