"""Calls across the grading boundary of repository tasks: both sides of it, stdlib only, run as text (after
`codec.py`'s text, which encodes what crosses).

The grader's pytest imports the trusted package with the task's functions replaced by proxies (`boundary.proxied`)
whose body is `crossing.call(module, name, args, kwargs)`: the arguments go, as data, one line on the run's channel
(`CALL {json}`) that the host forwards to the episode's process, which runs `serve`: it calls its own version of the
function and answers one line: the result, the arguments as they are after the call (when it changed them) or the
exception's type name and message, and the warnings the call issued (issued again in the grader).

An argument the grader cannot send as data (a function, an object of a test module's class, an `object()`
sentinel, a `random.Random`, an iterator) stays in the grader's process and goes as a reference ({"$ref": number}):
the episode's side gets a `Reference` whose every use (a public attribute read or set, a call, the protocol's
operators: `[]`, `iter`, `len`, `in`, `==`, `hash`, arithmetic...) asks the grader, before the call's own answer
comes, and the grader's object answers on data; what it answers crosses by the same rules (data, or another
reference). A reference the episode gives back is the grader's own object again (identity kept). Only the public
surface crosses (no `_` name), and never a module, a frame, code, a test framework's object (a `TestCase`,
pytest's), nor a function of the interpreter's or the system's (`exec`, `getattr`, `os.system`, `sys.exit`): those
are refused. The other direction is data only: what the episode returns that is not data (a decorator's wrapper, a
`GNUTranslations`) stays in the episode's process ({"$callback": number}) and each call of it or read of its public
attributes from the grader crosses like the task's own call; no object of the episode's ever reaches the grader,
which never unpickles and never runs the episode's code.
"""

import collections.abc
import functools
import json
import operator
import os
import sys
import threading
import types
import unittest
import warnings

if __name__ == "composer.rollout.tasks.repository.crossing":  # imported; shipped, codec.py's text precedes this one
    from composer.rollout.tasks.repository.codec import (
        BUILTIN_EXCEPTIONS,
        SAFE_BUILTINS,
        Codec,
        NotCrossable,
        _attributes,
        _class_path,
        _graph_class,
        _is_own,
        _own,
        _own_class,
        decode,
        dumps,
        encode,
        refill_graph,
        set_attributes,
    )

_BINARY = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "truediv": operator.truediv,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "pow": operator.pow,
    "matmul": operator.matmul,
    "and": operator.and_,
    "or": operator.or_,
    "xor": operator.xor,
    "lshift": operator.lshift,
    "rshift": operator.rshift,
}
_COMPARISONS = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge}
_UNARY = {
    **{"neg": operator.neg, "pos": operator.pos, "abs": abs, "invert": operator.invert, "len": len, "iter": iter},
    **{"next": next, "reversed": reversed, "bool": bool, "hash": hash, "str": str, "repr": repr, "int": int},
    **{"float": float, "index": operator.index},
}
OPERATIONS = {
    **_UNARY,
    **_COMPARISONS,
    **_BINARY,
    **{"r" + name: functools.partial(lambda f, target, other: f(other, target), f) for name, f in _BINARY.items()},
    **{"getitem": operator.getitem, "setitem": operator.setitem, "delitem": operator.delitem, "contains": operator.contains},
    **{"format": format, "call": lambda target, *args, **kwargs: target(*args, **kwargs)},
    **{"getattr": getattr, "setattr": setattr, "delattr": delattr},
    **{"copy": lambda target: __import__("copy").copy(target), "deepcopy": lambda target: __import__("copy").deepcopy(target)},
}
"""What the episode may do with a reference: each runs in the grader on its object, with the episode's data."""
FRAMEWORKS = ("pytest", "_pytest", "pluggy", "unittest", "_composer_crossing")
SYSTEM = (
    *("os", "posix", "sys", "subprocess", "shutil", "importlib", "ctypes", "gc", "signal", "socket", "threading"),
    *("_thread", "multiprocessing", "runpy", "pickle", "_pickle", "marshal", "io", "_io", "code", "pdb", "inspect"),
    *("types", "site", "sysconfig", "atexit", "faulthandler", "tempfile", "builtins"),
)
INTERFACES = ("MutableMapping", "Mapping", "MutableSequence", "Sequence", "MutableSet", "Set")
"""The abstract classes a reference is an instance of in the episode when the grader's object is (a function that
checks `isinstance(data, Mapping)` given a `MappingProxyType`), the more specific first."""


def _hazard(value):
    """Why the grader's `value` must not be given to the episode, even as a reference (None when it may)."""
    if isinstance(value, (types.ModuleType, types.FrameType, types.CodeType, types.TracebackType, types.CellType)):
        return f"a {type(value).__name__}"
    owner = getattr(value, "__self__", None) if isinstance(value, (types.MethodType, types.BuiltinMethodType)) else None
    if owner is not None and not isinstance(owner, types.ModuleType):
        return _hazard(owner)  # a bound method is as safe as its object
    classes = value.__mro__ if isinstance(value, type) else type(value).__mro__
    if any(cls.__module__.partition(".")[0] in FRAMEWORKS for cls in classes):
        return f"a {classes[0].__module__}.{classes[0].__qualname__}"
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType, functools.partial)):
        function = value.func if isinstance(value, functools.partial) else value
        module = getattr(function, "__module__", None) or "builtins"
        name = getattr(function, "__qualname__", "")
        system = SYSTEM if not isinstance(value, type) else [m for m in SYSTEM if m != "inspect"]  # (`Parameter.empty`)
        if module.partition(".")[0] in system and not (module == "builtins" and name in SAFE_BUILTINS):
            return f"a {module}.{name}"
    return None


# --- the grader's side --------------------------------------------------------------------------

_link = {}
_lock = threading.RLock()
refusals = {}
"""Why calls could not cross, and how often (the grader's report carries it: a task whose reference needs one is
rejected at build)."""
_held = []
"""The grader's objects given to the episode as references, by number (kept for the session: identity holds)."""
_numbers = {}
_monkeypatches = []
"""A weak set of pytest's `MonkeyPatch` objects, once the grader watches them."""
_episode_objects = {}
"""number -> the grader's stand-in for an object the episode returned (given back to it as it came)."""


def connect(out_fd, in_fd, shared_tmp=None):
    """The grader's ends: lines out on the run's channel, answers in on its call descriptor; `shared_tmp`: the
    directory of pytest's temporary directories, which the episode's process sees at the same path."""
    _link["out"], _link["in"] = out_fd, os.fdopen(in_fd, "rb", buffering=1 << 16)
    if shared_tmp:
        _link["tmp"], _link["opened"] = os.path.join(shared_tmp, "basetemp"), set()
        os.umask(0)  # what the tests write there, the episode's process (another uid) may read and change
    _watch_monkeypatches()


def _open_tmp():
    """pytest makes its temporary directories for its own uid (0700): opened to the episode's process before each
    call (the base and each test's directory; what a test makes inside is open already, under umask 0)."""
    base = _link.get("tmp")
    if base is None or not os.path.isdir(base):
        return
    for path in [base, *(entry.path for entry in os.scandir(base) if entry.is_dir(follow_symlinks=False))]:
        if path in _link["opened"]:
            continue
        try:  # never through a link the episode put in place of a directory
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            os.fchmod(fd, 0o1777 if path == base else 0o777)  # (sticky: the tests' directories stay where pytest put them)
        finally:
            os.close(fd)
        _link["opened"].add(path)


def _watch_monkeypatches():
    """Keep (weakly) each pytest `MonkeyPatch` the tests make: what they patch in the grader's process is patched in
    the episode's during each call (the function reads `platform.mac_ver` or `os.environ` there)."""
    try:
        from _pytest.monkeypatch import MonkeyPatch
    except ImportError:
        return
    if _monkeypatches:
        return
    import weakref

    _monkeypatches.append(weakref.WeakSet())
    made = MonkeyPatch.__init__

    def watched(self, *args, **kwargs):
        made(self, *args, **kwargs)
        _monkeypatches[0].add(self)

    MonkeyPatch.__init__ = watched


def _where(target):
    """A patched module or module-level class as the episode's process finds it: [module, qualname or ""]."""
    if isinstance(target, types.ModuleType):
        return [target.__name__, ""]
    if isinstance(target, type) and "<" not in target.__qualname__:
        return [target.__module__, target.__qualname__]
    return None


def _patches():
    """The monkeypatches in force that the episode's process can make too: [where, name, deleted, value] (each value
    encoded alone, by the rules of any argument; one that cannot cross is left out: the build sees the difference),
    the environment's patched variables, and the time freezegun has frozen."""
    found, environment = [], {}
    for patch in list(_monkeypatches[0]) if _monkeypatches else ():
        for target, name, _ in patch._setattr:
            where = _where(target)
            try:
                if where is not None and type(name) is str:
                    present = name in vars(target)
                    found.append([where, name, not present, encode(vars(target)[name], _grader_codec(where[0])) if present else None])
            except NotCrossable:
                continue
        for mapping, key, _ in patch._setitem:
            if mapping is os.environ and type(key) is str:
                environment[key] = os.environ.get(key)
    frozen = _frozen_time()
    return {
        **({"patches": found, "environment": environment} if found or environment else {}),
        **({"frozen": frozen} if frozen else {}),
    }


def _frozen_time():
    """A test under freezegun's `freeze_time` (which patches the grader's modules itself, not through pytest's
    monkeypatch): [the frozen time (naive, UTC) as ISO text, the zone offset in seconds], for the episode's process
    to freeze too; None when no time is frozen."""
    api = sys.modules.get("freezegun.api")
    if api is None or not getattr(api, "freeze_factories", None):
        return None
    offset = api.tz_offsets[-1].total_seconds() if getattr(api, "tz_offsets", None) else 0.0
    return [api.get_current_time().isoformat(), offset]


def _exchange(message):
    data = b"CALL " + dumps(message)
    while data:
        data = data[os.write(_link["out"], data) :]
    line = _link["in"].readline()
    if not line.endswith(b"\n"):
        raise RuntimeError("the episode's process ended")
    answer = json.loads(line)
    if type(answer) is not dict:
        raise ValueError("a malformed answer")
    return answer


def _refused(reason):
    refusals[reason] = refusals.get(reason, 0) + 1
    return RuntimeError(f"cannot cross the grading boundary: {reason}")


def _refer(value):
    """The grader's object `value` as a reference the episode may use (NotCrossable for what it must not reach)."""
    for number, returned in _episode_objects.items():
        if returned is value:
            return {"$callback": number}
    reason = _hazard(value)
    if reason is not None:
        raise NotCrossable(reason)
    number = _numbers.get(id(value))
    if number is None:
        number = _numbers[id(value)] = len(_held)
        _held.append(value)
    interfaces = []
    for name in INTERFACES:
        interface = getattr(collections.abc, name)
        if isinstance(value, interface) and not any(issubclass(getattr(collections.abc, i), interface) for i in interfaces):
            interfaces.append(name)
    return {"$ref": [number, interfaces]} if interfaces else {"$ref": number}


def _grader_codec(module, originals=None):
    def resolve(tag, number, interfaces=()):
        if tag == "$callback":
            return _returned(module, number)
        if interfaces or not 0 <= number < len(_held):  # (interfaces: only the grader names them)
            raise ValueError("a reference that was never given")
        return _held[number]

    return Codec(_refer, resolve, originals=originals)


def _exception(module, answer, depth=0):
    """The grader's own exception for the episode's: a builtin one of the allow-list, or an exception class of the
    trusted package (named by the episode, or found by name in its top-level namespace and the task's module), never
    one a test runner reads as an outcome (unittest's SkipTest, which pytest reports as a skip); RuntimeError
    otherwise. A class of the package is made with the episode's arguments and attributes, its constructor not run
    (tomlkit's `ParseError(line, col, message)` keeps only its message in `args`)."""
    name, message = str(answer["raise"]), str(answer.get("message", ""))
    if name in BUILTIN_EXCEPTIONS:
        return getattr(__import__("builtins"), name)(message)
    group = answer.get("group")
    if (
        name == "ExceptionGroup"
        and _EXCEPTION_GROUP is not None
        and depth < 2
        and type(group) is list
        and 0 < len(group) <= MAX_GROUP
        and all(type(e) is dict for e in group)
    ):
        return _EXCEPTION_GROUP(message, [_exception(module, {"raise": "RuntimeError", **e}, depth + 1) for e in group])
    try:
        found = _own_class(*answer["class"]) if "class" in answer else None
    except (TypeError, ValueError, ImportError):
        found = None
    for where in (sys.modules.get(module.split(".")[0]), sys.modules.get(module)) if found is None else ():
        found = getattr(where, name, None) if where is not None else None
        if found is not None:
            break
    if not isinstance(found, type) or not issubclass(found, Exception) or issubclass(found, unittest.SkipTest):
        return RuntimeError(f"{name}: {message}")
    state = answer.get("state")
    if type(state) is dict and type(state.get("attributes")) is list:
        codec = _grader_codec(module)
        args = decode(state.get("args"), codec)
        if type(args) is list:
            builtin = next(c for c in found.__mro__ if c.__module__ == "builtins")
            made = builtin.__new__(found)
            made.args = tuple(args)
            set_attributes(made, state["attributes"], codec, 0)
            return made
    try:
        return found(message)
    except Exception:
        return RuntimeError(f"{name}: {message}")


def call(module, qualname, args, kwargs):
    """The episode's `module.qualname(*args, **kwargs)`, run in its process; the arguments' mutations applied here."""
    with _lock:
        previous, _own[0] = _own[0], module.partition(".")[0]
        try:
            _open_tmp()
            return _call(module, qualname, args, kwargs)
        finally:
            _own[0] = previous


def _call(module, qualname, args, kwargs):
    """`call` with its package set: the arguments out, the uses of references answered, the answer decoded."""
    codec = _grader_codec(module)
    try:
        sent = {"args": [encode(a, codec) for a in args], "kwargs": {k: encode(v, codec) for k, v in kwargs.items()}}
    except NotCrossable as e:
        raise _refused(f"argument: {e}") from None
    problems = []  # what the grader's objects raised past `Exception` (a test's `pytest.fail`), refusals
    answer = _exchange({"call": [module, qualname], **sent, **_patches()})
    while "ref" in answer:
        answer = _exchange(_operate(module, answer, problems))
    if problems:
        raise problems[0]  # after the call: the episode cannot keep it from the test
    _warn_again(answer.get("warnings", []))
    if "refused" in answer:
        raise _refused(str(answer["refused"])[:200])
    if "raise" in answer:
        raise _exception(module, answer)
    if "return" not in answer:
        raise ValueError("a malformed answer")
    if "after" in answer:
        return _apply_after(module, args, kwargs, sent, answer, codec.sent())
    return decode(answer["return"], _grader_codec(module, codec.sent()))


MAX_GROUP = 100
"""The most exceptions of an `ExceptionGroup` that cross."""
_EXCEPTION_GROUP = getattr(__import__("builtins"), "ExceptionGroup", None)
"""Python 3.11's; a project's interpreter may be older (then no group crosses: it has none to raise)."""
WARNINGS = (
    *("Warning", "UserWarning", "DeprecationWarning", "PendingDeprecationWarning", "FutureWarning", "RuntimeWarning"),
    *("SyntaxWarning", "ImportWarning", "UnicodeWarning", "BytesWarning", "ResourceWarning", "EncodingWarning"),
)
MAX_WARNINGS = 20


def _warn_again(warned):
    """The warnings the call issued in the episode's process, issued here (a test's `catch_warnings`, `pytest.warns`,
    `filterwarnings = error` see them): a builtin category or the package's own, by name; anything else is refused."""
    if type(warned) is not list or len(warned) > MAX_WARNINGS:
        raise ValueError("a malformed answer")
    for entry in warned:
        if type(entry) is not list or len(entry) != 2 or not all(type(x) is str for x in entry):
            raise ValueError("a malformed answer")
        name, message = entry
        module, _, qualname = name.rpartition(":")
        if not module and qualname in WARNINGS:
            category = getattr(sys.modules["builtins"], qualname)
        else:
            category = _own_class(module, qualname)  # ValueError unless a class of the package
            if not issubclass(category, Warning):
                raise ValueError(f"not a warning: {name}"[:120])
        warnings.warn(message[:2000], category, stacklevel=4)  # at the test's line that called the function


def _operate(module, request, problems):
    """One use of a reference by the episode, answered by the grader's object."""
    number, op = request.get("ref"), request.get("op")
    if type(number) is not int or not 0 <= number < len(_held) or op not in OPERATIONS:
        raise ValueError("a malformed use of a reference")
    codec = _grader_codec(module)
    args, kwargs = decode(request.get("args"), codec), decode(request.get("kwargs"), codec)
    if type(args) is not list or type(kwargs) is not dict or not all(type(k) is str for k in kwargs):
        raise ValueError("a malformed use of a reference")
    if op.endswith("attr") and (not args or type(args[0]) is not str or args[0].startswith("_")):
        return {"raise": "AttributeError", "message": "only public attributes cross the grading boundary"}
    try:
        result = OPERATIONS[op](_held[number], *args, **kwargs)
    except Exception as e:
        return {"raise": type(e).__name__, "message": str(e)[:2000]}
    except BaseException as e:
        problems.append(e)  # the grader's own object ended the test: raised in the test once the call is over
        return {"raise": "RuntimeError", "message": f"the grader's object raised {type(e).__name__}"}
    try:
        if op in ("getitem", "getattr") and type(result) in (list, dict, set):
            return {"return": _refer(result)}  # a container the object holds: changed in place, not as a copy
        return {"return": encode(result, _grader_codec(module))}
    except NotCrossable as e:
        problems.append(_refused(f"{op} result: {e}"))
        return {"raise": "TypeError", "message": f"cannot cross the grading boundary: {e}"}


def _apply_after(module, args, kwargs, sent, answer, originals):
    """The arguments as the episode's call left them (all of them, then the result: one memo): each structure the
    grader sent (a list, a dict, an object of the package, at any depth) is changed in place as it comes (`$was`),
    so what refers to it (the test's variables, an item's parent) sees the change; a graph is refilled."""
    after = answer["after"]
    if type(after) is not dict or type(after.get("args")) is not list or len(after["args"]) != len(args):
        raise ValueError("malformed arguments after the call")
    if type(after.get("kwargs")) is not dict or set(after["kwargs"]) != set(kwargs):
        raise ValueError("malformed arguments after the call")
    codec = _grader_codec(module, originals)
    values = [decode(a, codec) for a in after["args"]]
    named = {k: decode(after["kwargs"][k], codec) for k in sent["kwargs"]}
    result = decode(answer["return"], codec)
    numbered = {id(structure) for structure in originals.values()}
    for target, value in [*zip(args, values), *((kwargs[k], named[k]) for k in kwargs)]:
        if value is target:
            continue
        if _graph_class(target) is not None:
            refill_graph(target, value)
        elif id(target) in numbered:  # (the episode's copy of a structure sent is always marked as it)
            raise ValueError("malformed arguments after the call")
    return result


class EpisodeObject:
    """The grader's stand-in for what the episode returned that is not data (a decorator's wrapper, humanize's
    `GNUTranslations`): each call crosses to the episode's process, and so does each read of a public attribute
    (`cache_info`, `gettext`); the answers cross as data or as other such objects. It has no other behaviour: it
    compares, hashes and converts as any plain object."""

    __slots__ = ("_module", "_number")

    def __init__(self, module, number):
        self._module, self._number = module, number

    def __call__(self, *args, **kwargs):
        return call(self._module, f"$callback:{self._number}", args, kwargs)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return call(self._module, f"$attribute:{self._number}", (name,), {})


def _returned(module, number):
    """The grader's stand-in for the episode's function `number` (one per function: identity holds)."""
    return _episode_objects.setdefault(number, EpisodeObject(module, number))


# --- the episode's side -------------------------------------------------------------------------

_episode = {"proxies": {}, "returned": [], "numbers": {}}
"""The episode's process: its ends of the link, its references to the grader's objects, the functions it gave."""


class Reference:
    """The episode's stand-in for an object the grader keeps: each use crosses back and the grader's object answers."""

    __slots__ = ("_number",)

    def __init__(self, number):
        object.__setattr__(self, "_number", number)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return _ask(self, "getattr", name)

    def __setattr__(self, name, value):
        _ask(self, "setattr", name, value)

    def __delattr__(self, name):
        _ask(self, "delattr", name)

    def __call__(self, *args, **kwargs):
        return _ask(self, "call", *args, **kwargs)

    def __copy__(self):
        return _ask(self, "copy")

    def __deepcopy__(self, memo):
        return _ask(self, "deepcopy")


def _forward(op):
    def use(self, *args):
        return _ask(self, op, *args)

    use.__name__ = f"__{op}__"
    return use


for _op in ("getitem", "setitem", "delitem", "contains", "format", *_UNARY, *_COMPARISONS, *_BINARY, *("r" + b for b in _BINARY)):
    setattr(Reference, f"__{_op}__", _forward(_op))


def _reference_class(interfaces):
    """`Reference`, or a subclass that is also each of `interfaces` (`INTERFACES`), whose public methods (`get`,
    `keys`, `append`) are the grader's object's, not the abstract class's mixins."""
    bases = tuple(getattr(collections.abc, name) for name in interfaces if name in INTERFACES)
    if not bases:
        return Reference
    if bases not in _reference_classes:
        public = {name for base in bases for name in dir(base) if not name.startswith("_")}
        namespace = {name: property(functools.partial(_public_use, name)) for name in public}
        try:
            _reference_classes[bases] = type("Reference", (Reference, *bases), {"__slots__": (), **namespace})
        except TypeError:
            raise ValueError(f"malformed interfaces: {interfaces}"[:120]) from None
    return _reference_classes[bases]


_reference_classes = {}


def _public_use(name, reference):
    return _ask(reference, "getattr", name)


def _episode_codec(origin=None):
    def refer(value):
        if isinstance(value, Reference):
            return {"$ref": object.__getattribute__(value, "_number")}
        if isinstance(value, type) or (hasattr(value, "__next__") and hasattr(value, "__iter__")):
            return None  # a class does not cross; an iterator crosses as its values
        number = _episode["numbers"].get(id(value))
        if number is None:
            number = _episode["numbers"][id(value)] = len(_episode["returned"])
            _episode["returned"].append(value)
        return {"$callback": number}  # it stays here: the grader's stand-in calls it and reads its attributes

    def resolve(tag, number, interfaces=()):
        if tag == "$callback":
            if not 0 <= number < len(_episode["returned"]):
                raise ValueError("a function that was never given")
            return _episode["returned"][number]
        if number not in _episode["proxies"]:
            _episode["proxies"][number] = _reference_class(interfaces)(number)
        return _episode["proxies"][number]

    return Codec(refer, resolve, origin=origin)


def _raised(answer):
    """The grader's exception as the episode's own builtin one of that name (OSError from a patched `os.confstr`)."""
    name, message = str(answer.get("raise")), str(answer.get("message", ""))
    found = getattr(__import__("builtins"), name, None)
    if isinstance(found, type) and issubclass(found, Exception):
        try:
            return found(message)
        except TypeError:
            pass
    return RuntimeError(f"{name}: {message}")


def _patch(request, undo):
    """The grader's monkeypatches made in this process for the call; `undo` takes (target, name, value before)."""
    import importlib

    _freeze(request.get("frozen"))
    for (module, qualname), name, deleted, value in request.get("patches", ()):
        target = importlib.import_module(module)
        for part in qualname.split(".") if qualname else ():
            target = getattr(target, part)
        undo.append((target, name, vars(target).get(name, undo)))  # (`undo` itself: it was not there)
        if deleted:
            if name in vars(target):
                delattr(target, name)
        else:
            setattr(target, name, decode(value, _episode_codec()))
    for key, value in request.get("environment", {}).items():
        undo.append((os.environ, key, os.environ.get(key, undo)))
        os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


def _freeze(frozen):
    """The grader's frozen time (`_frozen_time`), or none, in force here for a call: one freezer kept from call to
    call while the moment holds (starting one patches every loaded module; a test file's hundreds of calls would each
    pay it)."""
    held = _episode.get("frozen")
    if held is not None and held[0] == frozen:
        return
    if held is not None:
        held[1].stop()
        _episode["frozen"] = None
    if frozen is not None:
        import datetime

        import freezegun  # the grader's process has it: the project's environment, shared, does too

        moment, offset = frozen
        freezer = freezegun.freeze_time(moment, tz_offset=datetime.timedelta(seconds=offset))
        freezer.start()
        _episode["frozen"] = (frozen, freezer)


def _unpatch(undo):
    for target, name, before in reversed(undo):
        if target is os.environ:
            os.environ.pop(name, None) if before is undo else os.environ.__setitem__(name, before)
        elif before is undo:
            if name in vars(target):
                delattr(target, name)
        else:
            setattr(target, name, before)


def _ask(reference, op, /, *args, **kwargs):
    """A use of the grader's object: asked, and answered (the grader's object may call the task's functions first)."""
    codec = _episode_codec()
    number = object.__getattribute__(reference, "_number")
    _episode["send"]({"ref": number, "op": op, "args": encode(list(args), codec), "kwargs": encode(kwargs, codec)})
    answer = _episode["receive"]()
    while "call" in answer:
        _episode["send"](_answer(answer))
        answer = _episode["receive"]()
    if "raise" in answer:
        raise _raised(answer)
    return decode(answer["return"], _episode_codec())


def _public_attribute(function, name):
    if type(name) is not str or name.startswith("_"):
        raise AttributeError(name)
    return getattr(function, name)


def _answer(request):
    """The episode's answer to one call: its function run on the arguments decoded."""
    previous = _own[0]
    try:
        return _answer_call(request)
    finally:
        _own[0] = previous


def _function(module, parts):
    """The episode's function `parts` of `module`, as the grader's proxy calls it: a method's function (the proxy,
    under the same `classmethod` or `staticmethod`, passes the class itself when it takes one), decorators' wrappers
    taken off (the proxy keeps the grader's)."""
    owner = module
    for part in parts[:-1]:
        owner = getattr(owner, part)
    function = getattr(owner, parts[-1])
    if isinstance(owner, type):
        defined = next((vars(c)[parts[-1]] for c in owner.__mro__ if parts[-1] in vars(c)), None)
        if isinstance(defined, (classmethod, staticmethod)):
            function = defined.__func__
        elif isinstance(defined, property):
            function = defined
    while hasattr(function, "__wrapped__"):
        function = function.__wrapped__
    return function


def _answer_call(request):
    import importlib

    try:
        module, qualname = request["call"]
        _own[0] = module.partition(".")[0]
        if qualname.startswith(("$callback:", "$attribute:")):
            function = _episode["returned"][int(qualname.partition(":")[2])]
            function = function if qualname.startswith("$callback:") else functools.partial(_public_attribute, function)
        else:
            function = _function(importlib.import_module(module), qualname.split("."))
        codec = _episode_codec()
        args = [decode(a, codec) for a in request["args"]]
        kwargs = {k: decode(v, codec) for k, v in request["kwargs"].items()}
        if isinstance(function, property):  # the proxy of a getter passes the object, of a setter the value too
            function = function.fget if len(args) == 1 else function.fset
    except Exception as e:
        return {"raise": type(e).__name__, "message": str(e)[:2000]}
    undo = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the grader's filters decide what each one does there
        # (the decoded structures stay alive in `codec` until the answer is encoded: their ids are not reused)
        origin = {id(structure): number for number, structure in enumerate(codec.met) if structure is not None}
        answer = _run(function, args, kwargs, request, undo, origin)
    if caught:
        answer["warnings"] = [[_warning_name(w.category), str(w.message)[:2000]] for w in caught[:MAX_WARNINGS]]
    return answer


def _warning_name(category):
    """A warning's category as the grader names it: a builtin one by name, the package's own as `module:qualname`
    (another class of warning crosses as UserWarning)."""
    if category.__module__ == "builtins" and category.__qualname__ in WARNINGS:
        return category.__qualname__
    if _is_own(category):
        return f"{category.__module__}:{_class_path(category)}"
    return "UserWarning"


def _run(function, args, kwargs, request, undo, origin):
    try:
        _patch(request, undo)
        result = function(*args, **kwargs)
    except NotCrossable as e:
        return {"refused": f"argument to the grader's object: {e}"}
    except BaseException as e:
        return _raise_answer(e)
    finally:
        _unpatch(undo)
    try:
        plain = _episode_codec()
        after = {"args": [encode(a, plain) for a in args], "kwargs": {k: encode(v, plain) for k, v in kwargs.items()}}
        codec = _episode_codec(origin)  # the arguments' structures marked: the grader changes its own in place
        if after == {"args": request["args"], "kwargs": request["kwargs"]}:
            return {"return": encode(result, codec)}
        after = {"args": [encode(a, codec) for a in args], "kwargs": {k: encode(v, codec) for k, v in kwargs.items()}}
        return {"after": after, "return": encode(result, codec)}  # one memo: the result may hold the arguments
    except NotCrossable as e:
        return {"refused": f"result: {e}"}
    except BaseException as e:
        return {"raise": type(e).__name__, "message": str(e)[:2000]}


def _raise_answer(error, depth=0):
    """The exception the episode's function raised: its type's name and message; for a class of the package, where
    the grader finds it and its arguments and attributes as data (what cannot cross is left out); for an
    `ExceptionGroup` (packaging's metadata validation), its message and its exceptions."""
    if _EXCEPTION_GROUP is not None and type(error) is _EXCEPTION_GROUP and depth < 2:
        return {
            "raise": "ExceptionGroup",
            "message": error.message[:2000],
            "group": [_raise_answer(e, depth + 1) for e in error.exceptions[:MAX_GROUP]],
        }
    answer = {"raise": type(error).__name__, "message": str(error)[:2000]}
    if _is_own(type(error)):
        answer["class"] = [type(error).__module__, _class_path(type(error))]
        try:
            codec = _episode_codec()
            attributes = [[k, encode(v, codec)] for k, v in _attributes(error).items() if not k.startswith("__")]
            answer["state"] = {"args": encode(list(error.args), codec), "attributes": attributes}
        except Exception:
            pass
    return answer


def serve(in_fd, out_fd):
    """Answer calls until the grader is gone: one line in, one line out (uses of references asked before the answer)."""
    reader = os.fdopen(in_fd, "rb", buffering=1 << 16)

    def send(message):
        data = dumps(message)
        while data:
            data = data[os.write(out_fd, data) :]

    def receive():
        line = reader.readline()
        if not line:
            os._exit(0)
        return json.loads(line)

    _episode.update(send=send, receive=receive)
    while True:
        send(_answer(receive()))


if __name__ == "__main__":
    # python -c <codec's text and this file's> SOURCE_ROOT...: the episode's process (descriptors 4 in, 3 out); a
    # root per directory holding one of the project's packages, first on sys.path in their order.
    sys.path[0:0] = [os.path.realpath(root) for root in sys.argv[1:]]
    del sys.argv[1:]
    serve(4, 3)
