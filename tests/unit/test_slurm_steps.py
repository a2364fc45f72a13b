"""The parts of SLURM-started sandbox servers that need no cluster: where a server goes (`pick_node`) and the step's
stdio as a channel (`StepChannel`, here around a local `cat`: the channel does not care what runs behind it)."""

from __future__ import annotations

import subprocess
import threading

import pytest

from composer.cluster.slurm_steps import StepChannel, pick_node

NODES = ["n1", "n2", "n3"]


def test_servers_spread_over_the_nodes_in_the_jobs_order():
    placed: dict[str, int] = {}
    for _ in range(4):
        node = pick_node(NODES, set(), placed, None)
        placed[node] = placed.get(node, 0) + 1
    assert placed == {"n1": 2, "n2": 1, "n3": 1}


def test_a_lost_server_goes_to_another_node_and_never_to_a_lost_one():
    # n2's server died: it goes elsewhere even though n2 now has the fewest servers
    assert pick_node(NODES, set(), {"n1": 1, "n3": 1}, previous="n2") == "n1"
    assert pick_node(NODES, {"n1"}, {"n3": 1}, previous="n2") == "n3"
    # the only node left is where it died: back there
    assert pick_node(NODES, {"n1", "n3"}, {}, previous="n2") == "n2"
    assert pick_node(NODES, set(NODES), {}, previous="n2") is None


def test_a_step_channel_carries_bytes_both_ways_and_times_out_when_nothing_comes():
    process = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    channel = StepChannel(process, "n1", "7")
    try:
        channel.settimeout(0.2)
        with pytest.raises(TimeoutError):
            channel.recv(4)
        frame = bytes(range(256)) * 300  # larger than a pipe's buffer: sendall must loop
        got = bytearray()
        sender = threading.Thread(target=channel.sendall, args=(frame,))
        sender.start()
        channel.settimeout(10)
        while len(got) < len(frame):
            got += channel.recv(1 << 16)
        sender.join()
        assert bytes(got) == frame
        assert not channel.exit_status_ready()
        channel.shutdown_write()  # cat sees the end of its input and exits: so does a sandbox server
        assert channel.recv(1) == b""
        process.wait(timeout=10)
        assert channel.exit_status_ready()
    finally:
        channel.close()
    assert channel.where == "SLURM step of job 7 on n1"
