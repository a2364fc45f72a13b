"""Several training hosts on this machine: network namespaces with addresses of their own (10.213.14.0/24 only),
joined by a bridge, each running its own OpenSSH server. They share the filesystem (a shared run.dir for free).

A host can be given its own file at a path every host names alike (`overlays`: bind mounts in the host's own
mount namespace), e.g. a different Python at the recipe's `cluster.python`. Everything is removed in `close`,
also after a failure; namespaces left by a killed test run (same prefix) are removed before new ones are made.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import SSHD, keygen, not_installed

PREFIX = "cmpcl"
SUBNET = "10.213.14"
INTERFACE = "cl0"
"""The name of each host's own interface (inside its namespace), for GLOO_SOCKET_IFNAME."""
UNUSED_ADDRESS = f"{SUBNET}.99"
"""An address of the test subnet that no host has (an unreachable host)."""


def available() -> str | None:
    """Why these hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip"):
        return "the `ip` command (iproute2) is missing"
    if not os.path.exists(SSHD):
        return not_installed("openssh-server")
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def remove_leftovers(prefix: str = PREFIX) -> None:
    """Every namespace, veth and bridge of this prefix (the kernel frees a deleted namespace's links lazily, so
    the host ends of the veth pairs are deleted explicitly)."""
    for line in _ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(prefix):
            _kill_namespace_processes(name)
            _ip("netns", "delete", name, check=False)
    for link in _links(prefix):
        _ip("link", "delete", link, check=False)
    deadline = time.monotonic() + 10
    while _links(prefix) and time.monotonic() < deadline:
        time.sleep(0.1)


def _links(prefix: str) -> list[str]:
    names = [line.split(":")[1].strip().split("@")[0] for line in _ip("-o", "link", "show").stdout.splitlines()]
    return [name for name in names if name.startswith(prefix)]


def _kill_namespace_processes(namespace: str) -> None:
    pids = _ip("netns", "pids", namespace, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError):
            pass


@dataclass
class Host:
    name: str
    """The host's address: what the recipe lists in cluster.hosts."""
    namespace: str
    sshd: subprocess.Popen
    command: tuple[str, ...] = ()
    """How its sshd is started (`restart`)."""


class Hosts:
    """`count` hosts at 10.213.14.11, .12, ...; `client_key` and `known_hosts` reach them as root."""

    def __init__(
        self, workdir: Path, count: int, overlays: dict[int, dict[str, str]] | None = None, prefix: str = PREFIX, subnet: str = SUBNET
    ):
        """`prefix` and `subnet` of its own keep a test module's hosts apart from another's running at the same time."""
        self.dir = workdir
        self.hosts: list[Host] = []
        self.prefix, self.subnet = prefix, subnet
        remove_leftovers(prefix)
        try:
            self._make(count, overlays or {})
        except BaseException:
            self.close()
            raise

    def _make(self, count: int, overlays: dict[int, dict[str, str]]) -> None:
        d = self.dir
        host_pub = keygen(d / "host_key")
        client_pub = keygen(d / "client_key")
        (d / "authorized_keys").write_text(client_pub + "\n")
        Path("/run/sshd").mkdir(exist_ok=True)
        bridge = f"{self.prefix}br"
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        known = []
        for index in range(count):
            address, namespace, veth = f"{self.subnet}.{11 + index}", f"{self.prefix}{index}", f"{self.prefix}v{index}"
            _ip("netns", "add", namespace)
            _ip("link", "add", veth, "type", "veth", "peer", "name", INTERFACE, "netns", namespace)
            _ip("link", "set", veth, "master", bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", INTERFACE)
            _ip("-n", namespace, "link", "set", INTERFACE, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            sshd = [
                SSHD,
                "-D",
                "-e",
                "-f",
                "/dev/null",
                "-p",
                "22",
                "-h",
                str(d / "host_key"),
                "-o",
                f"ListenAddress={address}",
                "-o",
                f"AuthorizedKeysFile={d / 'authorized_keys'}",
                "-o",
                f"PidFile={d / f'sshd-{index}.pid'}",
                "-o",
                "StrictModes=no",
                "-o",
                "Subsystem sftp internal-sftp",
                "-o",
                "PermitRootLogin=prohibit-password",
                "-o",
                "MaxSessions=30",
                "-o",
                "MaxStartups=30",
            ]
            mounts = " && ".join(f"mount --bind {shlex.quote(src)} {shlex.quote(dst)}" for dst, src in overlays.get(index, {}).items())
            inner = f"{mounts} && exec {shlex.join(sshd)}" if mounts else f"exec {shlex.join(sshd)}"
            # its own mount namespace, so its bind mounts are seen by its sessions only
            command = ["ip", "netns", "exec", namespace, "unshare", "--mount", "--propagation", "private", "sh", "-c", inner]
            log = open(d / f"sshd-{index}.log", "wb")
            self.hosts.append(Host(address, namespace, subprocess.Popen(command, stderr=log), tuple(command)))
            known.append(f"{address} {' '.join(host_pub.split()[:2])}")
        (d / "known_hosts").write_text("\n".join(known) + "\n")
        for index, host in enumerate(self.hosts):
            self._wait_listening(host, d / f"sshd-{index}.log")

    def _wait_listening(self, host: Host, log: Path) -> None:
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection((host.name, 22), timeout=0.5).close()
                return
            except OSError:
                if time.monotonic() > deadline or host.sshd.poll() is not None:
                    raise RuntimeError(f"sshd on {host.name} did not start: {log.read_text()}") from None
                time.sleep(0.05)

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    @property
    def python(self) -> Path:
        """A Python for `remote_python` that runs this checkout's composer on every host (an SSH session starts in
        the login's home, where `python -m` would import whichever composer is installed)."""
        wrapper = self.dir / "python"
        if not wrapper.exists():
            wrapper.write_text(f'#!/bin/sh\ncd {Path(__file__).resolve().parents[2]} && exec {sys.executable} "$@"\n')
            wrapper.chmod(0o755)
        return wrapper

    @property
    def client_key(self) -> Path:
        return self.dir / "client_key"

    @property
    def known_hosts(self) -> Path:
        return self.dir / "known_hosts"

    def processes(self, pattern: str) -> list[str]:
        """Command lines of the processes in any host's namespace that contain `pattern` (sshd excluded)."""
        found = []
        for host in self.hosts:
            for pid in _ip("netns", "pids", host.namespace, check=False).stdout.split():
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                if pattern in cmdline and "sshd" not in cmdline:
                    found.append(f"{host.name}: {pid} {cmdline}")
        return found

    def pids(self, host: Host, pattern: str) -> list[int]:
        out = []
        for pid in _ip("netns", "pids", host.namespace, check=False).stdout.split():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if pattern in cmdline and "sshd" not in cmdline and not cmdline.startswith(("bash ", "sh ")):
                out.append(int(pid))  # the process itself, not the shell that started it
        return out

    def kill(self, host: Host) -> None:
        """SIGKILL every process of `host` (its sshd, the sessions and what they run): the host is gone."""
        _kill_namespace_processes(host.namespace)

    def restart(self, host: Host) -> None:
        """Start a killed host's sshd again (the same address and host key): the host is back."""
        host.sshd.wait()
        index = self.hosts.index(host)
        log = self.dir / f"sshd-{index}.log"
        with open(log, "ab") as err:
            host.sshd = subprocess.Popen(list(host.command), stderr=err)
        self._wait_listening(host, log)

    def close(self) -> None:
        for host in self.hosts:
            host.sshd.terminate()
        for host in self.hosts:
            try:
                host.sshd.wait(timeout=10)
            except subprocess.TimeoutExpired:
                host.sshd.kill()
        remove_leftovers(self.prefix)
