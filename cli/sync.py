"""`composer sync`: push checkpoints as compressed deltas, pull them elsewhere, inspect, verify, collect garbage."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from composer.recipes.errors import UserError
from composer.recipes.schema import SSHSection, SyncSection

app = typer.Typer(help="Distribute weights as lossless compressed deltas to stores and SSH hosts.", no_args_is_help=True)
console = Console(soft_wrap=True)  # result lines hold paths and ids: never break them

ToEndpointOption = typer.Option(None, "--to-endpoint", help="S3-compatible service URL for the destination store, when it is s3://.")
VersionOption = typer.Option(None, "--version", "-v", help="Version id, e.g. v00000012 (default: the newest).")

# The options every command takes to reach its store, declared once (`store_command` adds them).
_STORE_OPTIONS = [
    (
        "store",
        Optional[str],
        typer.Option(
            None,
            "--store",
            help="Store: a directory, ssh://user@host:port/path (user and port optional) or s3://bucket/prefix; default: the recipe's sync.store.",
        ),
    ),
    ("recipe", Optional[Path], typer.Option(None, "--recipe", "-r", help="Recipe whose `sync` and `cluster.ssh` sections to use.")),
    (
        "overrides",
        list[str],
        typer.Option([], "--set", "-s", help="Override a recipe key, e.g. --set sync.codec.chunk_mb=128. Repeatable."),
    ),
    ("ssh_key", Optional[Path], typer.Option(None, "--ssh-key", help="Private key for ssh:// stores (overrides cluster.ssh.key_file).")),
    (
        "known_hosts",
        Optional[Path],
        typer.Option(None, "--known-hosts", help="known_hosts file for ssh:// stores (overrides cluster.ssh.known_hosts)."),
    ),
    (
        "endpoint",
        Optional[str],
        typer.Option(None, "--endpoint", help="S3-compatible service URL for an s3:// --store (overrides sync.endpoint; default AWS)."),
    ),
]


def store_command(command: Callable) -> Callable:
    """A sync command with the store options: it is called with `settings=(SyncSection, SSHSection)` instead."""
    signature = inspect.signature(command, eval_str=True)
    own = [p for name, p in signature.parameters.items() if name != "settings"]
    shared = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind) for name, kind, option in _STORE_OPTIONS
    ]

    @functools.wraps(command)
    def with_settings(**arguments):
        settings = _settings(**{name: arguments.pop(name) for name, _, _ in _STORE_OPTIONS})
        return command(settings=settings, **arguments)

    with_settings.__signature__ = signature.replace(parameters=own + shared)
    with_settings.__annotations__ = {p.name: p.annotation for p in own + shared}
    return with_settings


def _settings(
    store: str | None, recipe: Path | None, overrides: list[str], ssh_key: Path | None, known_hosts: Path | None, endpoint: str | None
) -> tuple[SyncSection, SSHSection]:
    """The sync and SSH settings: from the recipe when given, with command-line flags on top."""
    if recipe is not None:
        from composer.recipes.loader import load_recipe

        loaded = load_recipe(recipe, overrides)
        if loaded.sync is None and store is None:
            raise UserError(f"{recipe}: the recipe has no `sync` section; pass --store")
        sync = loaded.sync or SyncSection(store=store)
        ssh = loaded.cluster.ssh
    elif overrides:
        raise UserError("--set needs --recipe")
    else:
        if store is None:
            raise UserError("pass --store DIR|ssh://host/path, or --recipe with a `sync` section")
        sync, ssh = SyncSection(store=store), SSHSection()
    if store is not None or endpoint is not None:
        from pydantic import ValidationError

        fields = sync.model_dump()
        fields.update({k: v for k, v in (("store", store), ("endpoint", endpoint)) if v is not None})
        if store is not None and endpoint is None and not store.startswith("s3://"):
            fields["endpoint"] = None  # the recipe's endpoint belongs to the recipe's store
        try:
            sync = SyncSection(**fields)
        except ValidationError as e:
            raise UserError("; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())) from None
    updates = {k: str(v) for k, v in (("key_file", ssh_key), ("known_hosts", known_hosts)) if v is not None}
    return sync, ssh.model_copy(update=updates)


def _open_source(sync: SyncSection, ssh: SSHSection, relay_store: str | None, relay_endpoint: str | None):
    """The store a pull reads: the relay copy when one was made, else the sync store."""
    from composer.sync.store import Store

    if relay_store is not None:
        return Store.open(relay_store, ssh, endpoint=relay_endpoint)
    return Store.open(sync.store, ssh, endpoint=sync.endpoint)


Track = Callable[[str, int | None], Callable[[int], None]]


@contextlib.contextmanager
def _progress() -> Iterator[Track]:
    """Yields `track(description, total_bytes)`, which adds a bar and returns its advance(nbytes) callback."""
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:

        def track(description: str, total: int | None) -> Callable[[int], None]:
            task = progress.add_task(description, total=total)
            return lambda nbytes: progress.advance(task, nbytes)

        yield track


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


@app.command()
@store_command
def push(
    checkpoint: Path = typer.Argument(..., help="Safetensors checkpoint directory."),
    anchor_every: int | None = typer.Option(None, "--anchor-every", min=1, help="A full snapshot every N versions."),
    cache: Path | None = typer.Option(
        None, "--cache", help="Base cache: the last pushed version (default ~/.cache/composer/sync/<store>)."
    ),
    settings: tuple[SyncSection, SSHSection] = None,
) -> None:
    """Publish CHECKPOINT as the store's next version (a delta against the newest, or an anchor)."""
    from composer.sync.checkpoint import Checkpoint
    from composer.sync.pusher import push_version

    sync, ssh = settings
    if anchor_every is not None:
        sync = sync.model_copy(update={"anchor_every": anchor_every})
    with Checkpoint(checkpoint) as ck:
        total = ck.nbytes
    with _progress() as track:
        info = push_version(checkpoint, sync, ssh, cache_dir=cache, on_progress=track("encoding", total))
    kind = "anchor" if info.is_anchor else f"delta on {info.parent}"
    density = 100 * info.changed_elements / max(info.total_elements, 1)
    smaller = f"{info.ratio:.1f}x smaller" if info.stored_bytes else "nothing changed"
    console.print(
        f"[green]pushed[/] {info.id} ({kind}): {_gb(info.stored_bytes)} stored for a {_gb(info.full_bytes)} "
        f"checkpoint ({smaller}), {density:.2f}% of elements changed, "
        f"{info.chunks_sent} chunks sent, {info.chunks_skipped} already there, {info.seconds:.1f} s",
        highlight=False,
    )


@app.command()
@store_command
def pull(
    to: Path = typer.Option(..., "--to", help="Receiver directory: versions/<id>/ and a `current` symlink."),
    version: str | None = VersionOption,
    relay_store: str | None = typer.Option(None, "--relay-store", help="Also copy the chain into this store, to serve this cluster."),
    to_endpoint: str | None = ToEndpointOption,
    in_place: bool = typer.Option(
        False,
        "--in-place",
        help="Patch the current version's files where the new one differs (one copy on disk, for a live engine that reloads only what changed); a full pull when that cannot be done.",
    ),
    settings: tuple[SyncSection, SSHSection] = None,
) -> None:
    """Rebuild a version from its chain, verify it, and make it current in --to atomically."""
    from composer.sync.receiver import pull as pull_version
    from composer.sync.receiver import relay, update_in_place
    from composer.sync.store import Store

    sync, ssh = settings
    with Store.open(sync.store, ssh, endpoint=sync.endpoint) as source:
        target = version or source.head()
        if relay_store is not None:
            with Store.open(relay_store, ssh, create=True, endpoint=to_endpoint) as dest:
                copied = relay(source, dest, target)
            console.print(
                f"relayed {len(copied.versions)} version(s), {_gb(copied.bytes_copied)} into {escape(relay_store)}", highlight=False
            )
    if in_place:
        with _open_source(sync, ssh, relay_store, to_endpoint) as source:
            patched = update_in_place(source, to, target, sync.codec.threads)
        how = (
            "full copy, no usable current version"
            if patched.full
            else f"{len(patched.changed)} tensor(s) patched in place from {patched.started_from}"
        )
        console.print(
            f"[green]pulled[/] {patched.version} into {escape(str(to / 'current'))} ({how}; "
            f"{_gb(patched.fetched_bytes)} downloaded, {patched.seconds:.1f} s)",
            highlight=False,
        )
        return
    with _open_source(sync, ssh, relay_store, to_endpoint) as source:
        total = sum(t.nbytes for t in source.manifest(target).tensors.values()) if target else 0
        with _progress() as track:
            downloads = track("downloading", None) if source.location.startswith("ssh://") else None
            info = pull_version(source, to, target, sync.codec.threads, track("rebuilding", total), downloads)
    if info.already_current:
        console.print(f"{escape(str(to))} is already at {info.version}", highlight=False)
    else:
        console.print(
            f"[green]pulled[/] {info.version} into {escape(str(to / 'current'))} (from {info.started_from}; "
            f"{_gb(info.fetched_bytes)} downloaded, {info.seconds:.1f} s)",
            highlight=False,
        )


@app.command()
@store_command
def relay(
    to_store: str = typer.Option(..., "--to-store", help="Store to copy the chain into."),
    to_endpoint: str | None = ToEndpointOption,
    version: str | None = VersionOption,
    settings: tuple[SyncSection, SSHSection] = None,
) -> None:
    """Copy a version's chain (manifests and chunks) into another store, e.g. one shared by a remote cluster."""
    from composer.sync.receiver import relay as relay_chain
    from composer.sync.store import Store

    sync, ssh = settings
    with (
        Store.open(sync.store, ssh, endpoint=sync.endpoint) as source,
        Store.open(to_store, ssh, create=True, endpoint=to_endpoint) as dest,
    ):
        info = relay_chain(source, dest, version)
    console.print(
        f"[green]relayed[/] {len(info.versions)} version(s), {info.chunks_copied} chunks, {_gb(info.bytes_copied)}", highlight=False
    )


@app.command()
@store_command
def status(
    settings: tuple[SyncSection, SSHSection] = None,
) -> None:
    """List the store's versions: parent, anchor, bytes stored and ratio against the full checkpoint."""
    from composer.sync.manifest import version_seq
    from composer.sync.store import Store

    sync, ssh = settings
    with Store.open(sync.store, ssh, endpoint=sync.endpoint) as source:
        table = Table(title=f"sync store {escape(sync.store)}", box=box.SIMPLE_HEAD)
        for column in ("version", "parent", "anchor"):
            table.add_column(column, no_wrap=True)
        for column in ("changed", "stored", "ratio", "chain"):
            table.add_column(column, justify="right", no_wrap=True)
        total = 0
        for vid in source.versions():
            m = source.manifest(vid)
            stats = m.stats
            total += stats["stored_bytes"]
            changed = 100 * stats["changed_elements"] / max(stats["total_elements"], 1)
            ratio = f"{stats['full_bytes'] / stats['stored_bytes']:.1f}x" if stats["stored_bytes"] else "no change"
            table.add_row(
                vid,
                m.parent or "-",
                "[bold]anchor[/]" if m.is_anchor else m.anchor,
                f"{changed:.2f}%",
                _gb(stats["stored_bytes"]),
                ratio,
                str(m.seq - version_seq(m.anchor)),
            )
    console.print(table)
    console.print(f"{table.row_count} version(s), {_gb(total)} stored", highlight=False)


@app.command()
@store_command
def verify(
    version: str | None = VersionOption,
    settings: tuple[SyncSection, SSHSection] = None,
) -> None:
    """Re-hash every chunk and rebuild every piece in memory, checking each version's hashes."""
    from composer.sync.rebuild import verify as verify_store
    from composer.sync.store import Store

    sync, ssh = settings
    with Store.open(sync.store, ssh, endpoint=sync.endpoint) as source, _progress() as track:
        report = verify_store(source, version, sync.codec.threads, track("verifying", None))
    console.print(
        f"[green]ok[/] {len(report.versions)} version(s): {report.chunks} chunks and {report.pieces} pieces "
        f"({_gb(report.bytes_checked)}) match their hashes",
        highlight=False,
    )


@app.command()
@store_command
def gc(
    keep_anchors: int | None = typer.Option(None, "--keep-anchors", min=1, help="Keep the chains of the newest K anchors."),
    grace_minutes: float = typer.Option(
        60.0, "--grace-minutes", min=0, help="Keep unreferenced chunks younger than this (pushes in flight)."
    ),
    settings: tuple[SyncSection, SSHSection] = None,
) -> None:
    """Delete versions older than the newest K anchors' chains, and chunks no remaining version uses."""
    from composer.sync.store import Store

    sync, ssh = settings
    with Store.open(sync.store, ssh, endpoint=sync.endpoint) as target:
        report = target.gc(keep_anchors or sync.keep_anchors, grace_minutes * 60)
    console.print(
        f"[green]gc[/] deleted {len(report.deleted_versions)} version(s) and {report.deleted_chunks} chunk(s); "
        f"kept {len(report.kept_versions)}",
        highlight=False,
    )
