"""The harness inside the sandbox: load the model's program and compute what the grader asks, nothing more.

This is the untrusted side. It runs in the sandboxed process, after the program's code may have changed
anything in it (builtins, json, this module), so it decides nothing: it never sees an expected output
or a test, and it never says whether a case passed. It answers requests from the grader (the parent
process) with plain data (`plain_data`), and the grader judges them where the program never ran.
It is loaded once by the fork server (`zygote`) and runs in each forked child; stdlib only.

Requests (JSON lines on the command pipe) and replies (JSON lines on the reply pipe):
  {"op": "load", "program", "entry", "script", "seed"}  ->  {"op": "loaded"[, "error", "exit"]}
        script: run the program as `__main__` instead, -> {"op": "exited", "status"}
  {"op": "call", "id", "args", "kwargs", "seed"}        ->  {"id", "value"} | {"id", "error"[, "non_plain", "exit"]}
        args and kwargs are plain-data encoded; seed (or null) reseeds `random` (and numpy) first
  {"op": "inputs", "id", "generator", "count", "seed"}  ->  {"id", "inputs": [JSON text or null]}
        `count` inputs drawn from the program's generator with random.Random(seed)
  {"op": "exit"}                                          ->  {"op": "bye", "children"}, then the process ends
and, at any time, {"flag", "detail"}: something the program did that a grader should know (best effort:
the program can silence this; nothing here is needed for a correct verdict).
"""

import builtins
import json
import os
import random
import sys
import traceback

import plain_data

# The harness's own references, taken before any program runs.
_dumps, _loads, _write, _exit, _getpid, _vars = json.dumps, json.loads, os.write, os._exit, os.getpid, vars
_WATCHED = {
    builtins: (
        "print",
        "open",
        "exec",
        "eval",
        "compile",
        "__import__",
        "isinstance",
        "type",
        "len",
        "repr",
        "str",
        "int",
        "float",
        "bool",
        "list",
        "dict",
        "tuple",
        "set",
        "getattr",
        "setattr",
        "hasattr",
        "id",
    ),
    json: ("dumps", "loads", "dump", "load"),
    os: ("write", "_exit", "read", "fdopen", "getpid"),
    sys: ("exit",),
    plain_data: ("encode", "decode", "to_jsonable"),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_PATH_EVENTS = {
    "os.remove",
    "os.rename",
    "os.mkdir",
    "os.rmdir",
    "os.chmod",
    "os.chown",
    "os.symlink",
    "os.link",
    "os.truncate",
    "os.utime",
    "shutil.rmtree",
    "shutil.move",
    "shutil.copyfile",
}


def _describe(error: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(error), error)).strip()[-2000:]


class _Channel:
    def __init__(self, cmd_fd: int, reply_fd: int):
        self._cmd = os.fdopen(cmd_fd, "rb")
        self._reply = reply_fd

    def receive(self):
        line = self._cmd.readline()
        return _loads(line) if line else None

    def send(self, message: dict) -> None:
        data = (_dumps(message) + "\n").encode()
        while data:
            data = data[_write(self._reply, data) :]


def _guard(send, plan: dict):
    """Notices (and reports once each) what honest programs do not do: files of the harness or the tests,
    other processes' /proc entries, writes outside the work directory, patched harness functions.
    Closures over references taken before the program runs, so patching a class or module here does not
    silence them (a program that digs into closure cells can: flags are evidence, never the verdict).
    Returns (flag, check_integrity)."""
    writable = tuple(os.path.join(p, "") for p in plan["writable"]) + ("/dev/null", "/dev/shm/")
    protected = tuple(os.path.join(p, "") for p in plan["protected"])
    own_proc = (f"/proc/{_getpid()}/", "/proc/self/", "/proc/thread-self/")
    reported = set()
    snapshot = {(m, n): _vars(m)[n] for m, names in _WATCHED.items() for n in names}
    module = sys.modules[__name__]
    snapshot.update({(module, n): v for n, v in list(globals().items()) if callable(v)})
    for cls in (_Channel, _Harness):
        snapshot.update({(cls, n): v for n, v in _vars(cls).items() if callable(v)})
    isabs, join, normpath, fsdecode, getcwd = os.path.isabs, os.path.join, os.path.normpath, os.fsdecode, os.getcwd

    def flag(name: str, detail: str) -> None:
        if name not in reported:
            reported.add(name)
            send({"flag": name, "detail": detail[:300]})

    def check_integrity() -> None:
        changed = [f"{getattr(m, '__name__', m)}.{n}" for (m, n), v in snapshot.items() if _vars(m).get(n) is not v]
        if changed:
            flag("harness_touched", "patched: " + ", ".join(changed[:8]))

    def resolve(path) -> str | None:
        if isinstance(path, int) or path is None:
            return None
        path = fsdecode(path)
        return normpath(path if isabs(path) else join(getcwd(), path))

    def probe(path: str) -> None:
        if path.startswith(protected) or path + "/" in protected:
            flag("harness_touched", f"accessed {path}")
        elif path.startswith("/proc/") and path[6:7].isdigit() and not path.startswith(own_proc):
            flag("harness_touched", f"read another process: {path}")
        elif path.startswith(tuple(p + n for p in own_proc for n in ("mem", "fd"))):
            flag("harness_touched", f"read {path}")

    def outside(path: str | None) -> bool:
        return path is not None and not (path + "/").startswith(writable)

    def audit(event: str, args: tuple) -> None:
        if event == "open":
            path = resolve(args[0])
            if path is None:
                return
            mode, flags = args[1], args[2]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags > 0 and flags & _WRITE_FLAGS
            )
            if writing and outside(path):
                flag("writes_outside", f"opened {path} for writing")
            probe(path)
        elif event in ("os.listdir", "os.scandir"):
            path = resolve(args[0] if args and args[0] is not None else ".")
            if path:
                probe(path)
        elif event in _PATH_EVENTS:
            for arg in args[:2]:
                path = resolve(arg) if isinstance(arg, (str, bytes, os.PathLike)) else None
                if outside(path):
                    flag("writes_outside", f"{event} {path}")

    sys.addaudithook(audit)
    return flag, check_integrity


class _Harness:
    def __init__(self, channel: _Channel, plan: dict):
        self.channel = channel
        self.owner = _getpid()
        self.stdout, self.stderr = sys.stdout, sys.stderr
        self.flag, self.check_integrity = _guard(channel.send, plan)
        self.namespace: dict = {}
        self.entry = None

    def after_program(self) -> None:
        """Every return from the program's code: a forked copy leaves, then look for tampering."""
        if _getpid() != self.owner:
            _exit(0)
        for stream in (self.stdout, self.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        self.check_integrity()

    @staticmethod
    def seed(seed) -> None:
        if seed is None:
            return
        random.seed(seed)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed(seed % 2**32)

    def load(self, request: dict) -> dict:
        self.seed(request["seed"])
        if request["script"]:
            return self.script(request["program"])
        self.namespace = {"__name__": "__solution__", "__builtins__": builtins}
        try:
            exec(compile(request["program"], "solution.py", "exec"), self.namespace)
            self.entry = self.namespace[request["entry"]]
        except BaseException as e:
            self.after_program()
            error = f"{request['entry']} is not defined" if isinstance(e, KeyError) else _describe(e)
            return {"op": "loaded", "error": error, "exit": isinstance(e, SystemExit)}
        self.after_program()
        return {"op": "loaded"}

    def script(self, program: str) -> dict:
        """Like `python solution.py`: a traceback goes to stderr and the exit status is 1."""
        status = 0
        try:
            exec(compile(program, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": builtins})
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException as e:
            traceback.print_exception(e.with_traceback(e.__traceback__.tb_next))  # from the program's own frames
            status = 1
        self.after_program()
        return {"op": "exited", "status": status}

    def call(self, request: dict) -> dict:
        reply = {"id": request["id"]}
        self.seed(request["seed"])
        try:
            args, kwargs = plain_data.decode(request["args"]), plain_data.decode(request["kwargs"])
            value = self.entry(*args, **kwargs)
        except BaseException as e:
            self.after_program()
            return {**reply, "error": _describe(e), "exit": isinstance(e, SystemExit)}
        self.after_program()
        try:
            return {**reply, "value": plain_data.encode(value)}
        except plain_data.NotPlain as e:
            return {**reply, "error": f"returned {e}", "non_plain": e.type_name}
        except BaseException as e:
            return {**reply, "error": f"output could not be encoded: {_describe(e)}"}

    def inputs(self, request: dict) -> dict:
        generator = self.namespace.get(request["generator"])
        rng = random.Random(request["seed"])
        drawn = []
        for _ in range(request["count"]):
            try:
                drawn.append(_dumps(generator(rng)))
            except BaseException:
                drawn.append(None)
            self.after_program()
        return {"id": request["id"], "inputs": drawn}


def _live_children() -> int:
    """Processes this one started that are still running (exited ones are reaped first)."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
    count = 0
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/children") as f:
            count += len(f.read().split())
    return count


def serve(cmd_fd: int, reply_fd: int, plan: dict) -> None:
    channel = _Channel(cmd_fd, reply_fd)
    harness = _Harness(channel, plan)
    # Bound now, before any program code: patching the classes later changes none of these.
    receive, send, check_integrity, live_children = channel.receive, channel.send, harness.check_integrity, _live_children
    handlers = {"load": harness.load, "call": harness.call, "inputs": harness.inputs}
    while True:
        request = receive()
        if request is None or request["op"] == "exit":
            try:
                children = live_children()
            except OSError:
                children = 0
            send({"op": "bye", "children": children})
            _exit(0)
        reply = handlers[request["op"]](request)
        check_integrity()
        send(reply)
