"""One SSH connection (fabric) to a host, with host keys checked as the recipe says and failures turned into
errors that say what to fix. Used by the ssh launcher, cluster check, remote rollout hosts and SSH stores."""

from __future__ import annotations

import getpass
import os
import select
import socket
import threading

from composer.recipes.errors import UserError
from composer.recipes.schema import SSHSection


class SSHHost:
    def __init__(self, host: str, ssh: SSHSection, user: str | None = None, port: int | None = None):
        import fabric
        import paramiko

        self.host = host
        self.port = port or ssh.port
        self.user = user or ssh.user or getpass.getuser()
        self.where = f"{self.user}@{self.host}:{self.port}"
        key_file = os.path.expanduser(ssh.key_file) if ssh.key_file else None
        if key_file and not os.path.isfile(key_file):
            raise UserError(f"cluster.ssh.key_file: {key_file} does not exist")
        self.conn = fabric.Connection(
            self.host,
            user=self.user,
            port=self.port,
            connect_timeout=15,
            # no key file: the agent and the default keys (fabric fails on key_filename=None)
            connect_kwargs=(
                {"key_filename": key_file, "look_for_keys": False, "allow_agent": False}
                if key_file
                else {"look_for_keys": True, "allow_agent": True}
            ),
        )
        client = self.conn.client
        self._known_hosts: str | None = None
        if ssh.verify_host_key:
            known_hosts = os.path.expanduser(ssh.known_hosts or "~/.ssh/known_hosts")
            if not os.path.isfile(known_hosts):
                raise UserError(
                    f"{self.where}: known_hosts file {known_hosts} does not exist; add the host's key "
                    f"(ssh-keyscan -p {self.port} {self.host} >> {known_hosts}) or set cluster.ssh.known_hosts"
                )
            client.load_host_keys(known_hosts)
            client.set_missing_host_key_policy(paramiko.RejectPolicy())
            self._known_hosts = known_hosts
        else:
            client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
        self._listeners: list[socket.socket] = []
        try:
            self.conn.open()
        except Exception as e:
            self.conn.close()
            raise self.explain(e) from None

    def explain(self, error: Exception) -> Exception:
        """A connection failure as the UserError that says what to fix (anything unexpected stays as is)."""
        import paramiko

        if isinstance(error, paramiko.BadHostKeyException):
            return UserError(
                f"{self.where}: host key does NOT match the one in {self._known_hosts} "
                "(the host was reinstalled, or someone is intercepting the connection)"
            )
        if isinstance(error, paramiko.AuthenticationException):
            return UserError(f"{self.where}: authentication failed ({error}); check cluster.ssh.user and key_file")
        if isinstance(error, paramiko.SSHException) and "known_hosts" in str(error):
            return UserError(
                f"{self.where}: host key is not in {self._known_hosts}; add it "
                f"(ssh-keyscan -p {self.port} {self.host} >> {self._known_hosts}) "
                "or set cluster.ssh.known_hosts"
            )
        if isinstance(error, paramiko.SSHException):
            return UserError(f"{self.where}: SSH failed ({error})")
        if isinstance(error, (OSError, socket.timeout)):
            reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
            return UserError(f"{self.where}: cannot connect ({reason})")
        return error

    def forward(self, remote_port: int) -> int:
        """Forward a new local port to `remote_port` on the host's loopback, until `close`; returns the local port.
        A connection the host refuses (nothing listening yet) is closed here, and the client may retry."""
        listener = socket.create_server(("127.0.0.1", 0))
        self._listeners.append(listener)
        threading.Thread(target=self._accept, args=(listener, remote_port), daemon=True, name=f"forward-{remote_port}").start()
        return listener.getsockname()[1]

    def _accept(self, listener: socket.socket, remote_port: int) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed
            try:
                channel = self.conn.client.get_transport().open_channel("direct-tcpip", ("127.0.0.1", remote_port), client.getpeername())
            except Exception:
                client.close()
                continue
            threading.Thread(target=_pump, args=(client, channel), daemon=True).start()

    def close(self) -> None:
        for listener in self._listeners:
            listener.close()
        self.conn.close()


def _pump(client: socket.socket, channel) -> None:
    """Copy bytes both ways between a local socket and an SSH channel until either side closes."""
    try:
        while True:
            ready, _, _ = select.select([client, channel], [], [])
            source, sink = (client, channel) if client in ready else (channel, client)
            data = source.recv(1 << 16)
            if not data:
                return
            sink.sendall(data)
    except OSError:
        return
    finally:
        channel.close()
        client.close()
