"""Calls across the grading boundary of repository tasks: both sides of it, stdlib only, run as text.

The grader's pytest imports the trusted package with the task's functions replaced by proxies (`boundary.proxied`)
whose body is `crossing.call(module, name, args, kwargs)`: the arguments go, as data, one line on the run's channel
(`CALL {json}`) that the host forwards to the episode's process, which runs `serve`: it calls its own version of the
function and answers one line, the result, the arguments as they are after the call (their mutations) or the
exception's type name and message. Arguments that are functions (a weight function) are called back: the episode's
process asks for them by number, and the grader calls them on data and answers, before the call's own answer comes.

What crosses is JSON with tags, decoded by each side into plain types and its own classes only:
  None, bool, int, float, str, list   as JSON; {"$float": "nan" | "inf" | "-inf"}
  bytes                               {"$bytes": hex}; NotImplemented (a comparison's), Ellipsis {"$const": name}
  tuple, set, frozenset, dict, range  {"$tuple": [...]}, {"$set": [...]}, {"$frozenset": [...]}, {"$dict": [[k, v]...]},
                                      {"$range": [start, stop, step]}
  an iterator (a generator's values)  {"$iter": [...]} (decoded as an iterator over them; an argument's are taken
                                      as the function would take them)
  a networkx graph                    {"$graph": [class, graph attributes, [[node, attributes]...],
                                      [[node, [[neighbour, edge attributes or {key: attributes}]...]]...],
                                      the predecessors' order of a directed graph or null]}
  a function                          {"$callback": number}: a function the grader passes is called back in the
                                      grader; one the episode returns (a decorator's wrapper) stays in the episode's
                                      process, and the grader's proxy for it calls it there across the boundary
  an instance of the project's own class  {"$object": [module, qualname, its builtin base's value or null,
                                      [[attribute, value]...]]}; an enum member {"$enum": [module, qualname, name]}
  a standard library value            {"$value": [name, data]}: datetime's date, time, datetime (with a fixed
                                      offset or none), timedelta; Decimal, Fraction, PurePosixPath and PosixPath, UUID
  a class                             {"$type": [module, qualname]}: a builtin one or a `collections` one
                                      (`factory=dict`), or the project's own
The graph classes are the decoding side's own (`Graph`, `DiGraph`, `MultiGraph`, `MultiDiGraph` of its networkx),
filled in the neighbours' order as sent. An object of the project's package (the package of the called function's
module: a `Version`, a cache, a tuple subclass) crosses as its state: the decoding side makes an instance of its own
copy of that class without running its constructor and sets the attributes (instances of module-level classes only;
a member of an enum is the side's own member). Anything else cannot cross (`NotCrossable`); the grader never
unpickles and never calls an object of the episode's.
"""

import json
import math
import os
import sys
import threading
import unittest

MAX_DEPTH = 200
MAX_ITEMS = 1_000_000
GRAPHS = ("Graph", "DiGraph", "MultiGraph", "MultiDiGraph")
# Exceptions an answer may name, re-raised as the grader's own (besides the trusted package's own exceptions).
BUILTIN_EXCEPTIONS = (
    "ArithmeticError",
    "AssertionError",
    "AttributeError",
    "IndexError",
    "KeyError",
    "LookupError",
    "NotImplementedError",
    "OverflowError",
    "RecursionError",
    "RuntimeError",
    "StopIteration",
    "TypeError",
    "ValueError",
    "ZeroDivisionError",
)


OBJECT_BASES = (tuple, list, dict, set, frozenset, str, int, float)
"""Builtin bases whose value an object of the project's own class carries besides its attributes."""
SHARED_CLASSES = {
    "builtins": (
        *("bool", "bytes", "dict", "float", "frozenset", "int", "list", "object", "set", "str", "tuple", "NoneType"),
        *("map", "filter", "zip", "range", "enumerate", "reversed", "Exception", "BaseException", *BUILTIN_EXCEPTIONS),
    ),
    "collections": ("Counter", "OrderedDict", "defaultdict", "deque"),
}
"""Classes that cross by name (`factory=dict`, `exceptions=(ValueError,)`), besides the project's own."""
_own = [""]
"""The top-level package whose classes cross as their state: the called function's (set per call, on each side)."""


def _values():
    """The standard library's value classes that cross as data: name -> (class, to data, from data)."""
    import datetime
    import decimal
    import fractions
    import pathlib
    import uuid

    def fixed_offset(value):
        if value.tzinfo is not None and type(value.tzinfo) is not datetime.timezone:
            raise NotCrossable(f"a time zone {type(value.tzinfo).__name__}")
        return value.isoformat()

    return {
        "datetime": (datetime.datetime, fixed_offset, datetime.datetime.fromisoformat),
        "date": (datetime.date, datetime.date.isoformat, datetime.date.fromisoformat),
        "time": (datetime.time, fixed_offset, datetime.time.fromisoformat),
        "timedelta": (
            datetime.timedelta,
            lambda v: [v.days, v.seconds, v.microseconds],
            lambda d: datetime.timedelta(days=d[0], seconds=d[1], microseconds=d[2]),
        ),
        "Decimal": (decimal.Decimal, str, decimal.Decimal),
        "Fraction": (fractions.Fraction, lambda v: [v.numerator, v.denominator], lambda d: fractions.Fraction(d[0], d[1])),
        "PurePosixPath": (pathlib.PurePosixPath, str, pathlib.PurePosixPath),
        "PosixPath": (pathlib.PosixPath, str, pathlib.PosixPath),
        "UUID": (uuid.UUID, str, uuid.UUID),
    }


VALUES = _values()
_VALUE_NAMES = {cls: name for name, (cls, _, _) in VALUES.items()}


class NotCrossable(TypeError):
    """A value that cannot cross the boundary as data."""


def _graph_class(value):
    kind = type(value)
    if kind.__name__ in GRAPHS and kind.__module__.startswith("networkx.classes."):
        return kind.__name__
    return None


def encode(value, callbacks=None, depth=0):
    """`value` as tagged JSON; `callbacks` (a list) takes the functions among the arguments (grader side only)."""
    if depth > MAX_DEPTH:
        raise NotCrossable(f"nesting deeper than {MAX_DEPTH}")
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if kind.__module__ == "numpy":
        for base in (bool, int, float, str):
            if isinstance(value, base) or (base is bool and kind.__name__ == "bool"):
                return encode(base(value), callbacks, depth)
        if kind.__name__.startswith(("int", "uint")):
            return int(value)
        if kind.__name__.startswith("float"):
            return encode(float(value), callbacks, depth)
    if value is NotImplemented or value is Ellipsis:
        return {"$const": "NotImplemented" if value is NotImplemented else "Ellipsis"}
    if kind is bytes:
        return {"$bytes": value.hex()}
    if kind is list:
        return [encode(v, callbacks, depth + 1) for v in value]
    if kind in (tuple, set, frozenset):
        return {"$" + kind.__name__: [encode(v, callbacks, depth + 1) for v in value]}
    if kind is dict:
        return {"$dict": [[encode(k, callbacks, depth + 1), encode(v, callbacks, depth + 1)] for k, v in value.items()]}
    if kind is range:
        return {"$range": [value.start, value.stop, value.step]}
    name = _graph_class(value)
    if name is not None:
        directed = "Di" in name
        adjacency = [[encode(u, callbacks, depth + 1), encode_neighbours(nbrs, callbacks, depth)] for u, nbrs in value._adj.items()]
        predecessors = (
            [[encode(v, callbacks, depth + 1), [encode(u, callbacks, depth + 1) for u in preds]] for v, preds in value._pred.items()]
            if directed
            else None
        )
        nodes = [[encode(n, callbacks, depth + 1), encode(dict(a), callbacks, depth + 1)] for n, a in value._node.items()]
        return {"$graph": [name, encode(dict(value.graph), callbacks, depth + 1), nodes, adjacency, predecessors]}
    if callbacks is not None and kind.__name__ in ("function", "builtin_function_or_method", "method", "partial"):
        callbacks.append(value)
        return {"$callback": len(callbacks) - 1}
    if kind in _VALUE_NAMES:
        name = _VALUE_NAMES[kind]
        return {"$value": [name, VALUES[name][1](value)]}
    if kind is type or isinstance(value, type):
        if value.__qualname__ in SHARED_CLASSES.get(value.__module__, ()) or (
            _own[0] and value.__module__.partition(".")[0] == _own[0] and "<" not in value.__qualname__
        ):
            return {"$type": [value.__module__, value.__qualname__]}
        raise NotCrossable(f"the class {value.__module__}.{value.__qualname__}")
    if _own[0] and kind.__module__.partition(".")[0] == _own[0] and "<" not in kind.__qualname__:
        return encode_object(value, callbacks, depth)
    if hasattr(value, "__next__") and hasattr(value, "__iter__"):
        # A generator's values (an argument is consumed as the function would consume it).
        items = []
        for item in value:
            items.append(encode(item, callbacks, depth + 1))
            if len(items) > MAX_ITEMS:
                raise NotCrossable(f"an iterator of more than {MAX_ITEMS} values")
        return {"$iter": items}
    raise NotCrossable(f"a {kind.__module__}.{kind.__qualname__}")


def _attributes(value):
    """An object's attributes: its __dict__ and its __slots__ that are set."""
    found = dict(vars(value)) if hasattr(value, "__dict__") else {}
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__"):
                mangled = f"_{cls.__name__.lstrip('_')}{name}" if name.startswith("__") and not name.endswith("__") else name
                try:
                    found[mangled] = object.__getattribute__(value, mangled)
                except AttributeError:
                    pass
    return found


def encode_object(value, callbacks, depth):
    kind = type(value)
    import enum

    if isinstance(value, enum.Enum):
        return {"$enum": [kind.__module__, kind.__qualname__, value.name]}
    base = next((b for b in kind.__mro__ if b in OBJECT_BASES), None)
    carried = encode(base(value), callbacks, depth + 1) if base is not None else None
    attributes = [[name, encode(v, callbacks, depth + 1)] for name, v in _attributes(value).items()]
    return {"$object": [kind.__module__, kind.__qualname__, carried, attributes]}


def _own_class(module, qualname):
    """This side's class `module.qualname` of the project's package (ValueError for anything else)."""
    import importlib

    if type(module) is not str or type(qualname) is not str or not _own[0] or module.partition(".")[0] != _own[0]:
        raise ValueError(f"not a class of the project's package: {str(module)[:80]}")
    found = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if not isinstance(found, type) or found.__module__.partition(".")[0] != _own[0]:
        raise ValueError(f"not a class of the project's package: {module}.{qualname}"[:120])  # nor one it imports
    return found


def decode_object(body, make_callback, depth):
    """An instance of this side's own class, its constructor not run: the builtin base's value, then the attributes."""
    module, qualname, carried, attributes = body
    cls = _own_class(module, qualname)
    base = next((b for b in cls.__mro__ if b in OBJECT_BASES), None)
    if (carried is None) != (base is None) or type(attributes) is not list:
        raise ValueError("malformed $object")
    if base is None:
        made = object.__new__(cls)
    elif base in (list, dict, set):
        made = base.__new__(cls)
        base.__init__(made, decode(carried, make_callback, depth + 1))
    else:
        made = base.__new__(cls, decode(carried, make_callback, depth + 1))
    set_attributes(made, attributes, make_callback, depth)
    return made


def set_attributes(target, attributes, make_callback, depth):
    for pair in attributes:
        if type(pair) is not list or len(pair) != 2 or type(pair[0]) is not str or pair[0].startswith("__"):
            raise ValueError("malformed $object attributes")  # (no `__class__`, `__dict__`: the state, never the type)
        object.__setattr__(target, pair[0], decode(pair[1], make_callback, depth + 1))


def encode_neighbours(neighbours, callbacks, depth):
    return [[encode(v, callbacks, depth + 2), encode(dict(d), callbacks, depth + 2)] for v, d in neighbours.items()]


def decode(node, make_callback=None, depth=0):
    """The value `node` encodes, built of plain types and this side's own graph classes; ValueError on any other
    shape."""
    if depth > MAX_DEPTH:
        raise ValueError("nesting too deep")
    kind = type(node)
    if node is None or kind in (bool, int, str, float):
        if kind is float and not math.isfinite(node):
            raise ValueError("a bare non-finite float")
        return node
    if kind is list:
        return [decode(v, make_callback, depth + 1) for v in node]
    if kind is not dict or len(node) != 1:
        raise ValueError(f"not crossable data: {str(node)[:80]}")
    ((tag, body),) = node.items()
    if tag == "$float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "$const" and body in ("NotImplemented", "Ellipsis"):
        return NotImplemented if body == "NotImplemented" else Ellipsis
    if tag == "$bytes" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "$callback" and type(body) is int and make_callback is not None:
        return make_callback(body)
    if type(body) is not list:
        raise ValueError(f"malformed {tag}")
    if tag in ("$tuple", "$set", "$frozenset", "$iter"):
        items = [decode(v, make_callback, depth + 1) for v in body]
        return {"$tuple": tuple, "$set": set, "$frozenset": frozenset, "$iter": iter}[tag](items)
    if tag == "$dict":
        if not all(type(pair) is list and len(pair) == 2 for pair in body):
            raise ValueError("malformed $dict")
        return {decode(k, make_callback, depth + 1): decode(v, make_callback, depth + 1) for k, v in body}
    if tag == "$range" and len(body) == 3 and all(type(v) is int for v in body):
        return range(*body)
    if tag == "$object" and len(body) == 4:
        return decode_object(body, make_callback, depth)
    if tag == "$value" and len(body) == 2 and body[0] in VALUES:
        data = body[1]
        if not (type(data) is str or (type(data) is list and all(type(v) is int for v in data))):
            raise ValueError("malformed $value")
        try:
            return VALUES[body[0]][2](data)
        except (TypeError, ValueError, ArithmeticError) as e:
            raise ValueError(f"malformed $value: {e}") from None
    if tag == "$type" and len(body) == 2:
        if body[0] in SHARED_CLASSES and body[1] in SHARED_CLASSES[body[0]]:
            return type(None) if body[1] == "NoneType" else getattr(__import__(body[0]), body[1])
        return _own_class(*body)
    if tag == "$enum" and len(body) == 3:
        import enum

        cls = _own_class(body[0], body[1])
        if not issubclass(cls, enum.Enum) or type(body[2]) is not str or body[2] not in cls.__members__:
            raise ValueError("malformed $enum")
        return cls[body[2]]
    if tag == "$graph" and len(body) == 5 and body[0] in GRAPHS:
        import networkx

        graph = getattr(networkx, body[0])()
        fill_graph(graph, body, make_callback, depth)
        return graph
    raise ValueError(f"not crossable data: {tag}")


def fill_graph(graph, body, make_callback, depth):
    """Fill an empty graph of this side's class from its data, in the order sent (neighbours' dicts shared between
    the two directions of an edge, as networkx keeps them)."""
    name, attributes, nodes, adjacency, predecessors = body
    multi, directed = name.startswith("Multi"), "Di" in name
    graph.graph.update(decode(attributes, make_callback, depth + 1))
    for item in nodes:
        node, data = decode(item[0], make_callback, depth + 1), decode(item[1], make_callback, depth + 1)
        if type(data) is not dict:
            raise ValueError("malformed node attributes")
        graph._node[node] = graph.node_attr_dict_factory()
        graph._node[node].update(data)
        graph._adj[node] = graph.adjlist_inner_dict_factory()
        if directed:
            graph._pred[node] = graph.adjlist_inner_dict_factory()
    for u_data, neighbours in adjacency:
        u = decode(u_data, make_callback, depth + 1)
        for v_data, d in neighbours:
            v = decode(v_data, make_callback, depth + 1)
            value = decode(d, make_callback, depth + 1)
            if u not in graph._node or v not in graph._node or type(value) is not dict:
                raise ValueError("malformed adjacency")
            if not directed and u in graph._adj.get(v, {}):
                graph._adj[u][v] = graph._adj[v][u]
                continue
            if multi:
                keys = graph.edge_key_dict_factory()
                for key, data in value.items():
                    keys[key] = graph.edge_attr_dict_factory()
                    keys[key].update(data)
                graph._adj[u][v] = keys
            else:
                graph._adj[u][v] = graph.edge_attr_dict_factory()
                graph._adj[u][v].update(value)
    if directed:
        for v_data, preds in predecessors or ():
            v = decode(v_data, make_callback, depth + 1)
            for u_data in preds:
                u = decode(u_data, make_callback, depth + 1)
                graph._pred[v][u] = graph._adj[u][v]


def apply_mutation(target, after, make_callback=None):
    """Make the grader's argument `target` what the episode's call left its copy as (lists, dicts, sets and graphs
    are changed in place; nothing else can be)."""
    value = decode(after, make_callback)
    kind = type(target)
    if _graph_class(target) is not None and type(after) is dict and "$graph" in after and after["$graph"][0] == kind.__name__:
        target.clear()
        fill_graph(target, after["$graph"], make_callback, 0)
    elif type(after) is dict and "$object" in after and type(value) is kind:
        # An object of the project's (a method's `self`): its state replaced by the episode's.
        base = next((b for b in kind.__mro__ if b in OBJECT_BASES), None)
        if base in (list, dict, set):
            base.clear(target)
            (base.extend if base is list else base.update)(target, value)
        elif base is not None and base(target) != base(value):
            raise RuntimeError(f"the call changed an immutable {kind.__name__}")
        for name in set(_attributes(target)) - set(_attributes(value)):
            object.__delattr__(target, name)
        for name, attribute in _attributes(value).items():
            object.__setattr__(target, name, attribute)
    elif kind is list and type(value) is list:
        target[:] = value
    elif kind in (dict, set) and type(value) is kind:
        target.clear()
        target.update(value)
    else:
        raise RuntimeError(f"the call changed an argument of type {kind.__name__} into {type(value).__name__}")


# --- the grader's side --------------------------------------------------------------------------

_link = {}
_lock = threading.RLock()
refusals = {}
"""Why calls could not cross, and how often (the grader's report carries it: a task whose reference needs one is
rejected at build)."""


def connect(out_fd, in_fd):
    """The grader's ends: lines out on the run's channel, answers in on its call descriptor."""
    _link["out"], _link["in"] = out_fd, os.fdopen(in_fd, "rb", buffering=1 << 16)


def _exchange(message):
    data = b"CALL " + json.dumps(message, allow_nan=False, separators=(",", ":")).encode() + b"\n"
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


def _exception(module, name, message):
    """The grader's own exception class named `name`: a builtin one of the allow-list, or an exception class of the
    trusted package (its top-level namespace, the task's module), never one a test runner reads as an outcome
    (unittest's SkipTest, which pytest reports as a skip); RuntimeError otherwise."""
    if name in BUILTIN_EXCEPTIONS:
        return getattr(__import__("builtins"), name)(message)
    for where in (sys.modules.get(module.split(".")[0]), sys.modules.get(module)):
        found = getattr(where, name, None) if where is not None else None
        if isinstance(found, type) and issubclass(found, Exception) and not issubclass(found, unittest.SkipTest):
            try:
                return found(message)
            except Exception:
                break
    return RuntimeError(f"{name}: {message}")


def call(module, qualname, args, kwargs):
    """The episode's `module.qualname(*args, **kwargs)`, run in its process; the arguments' mutations applied here."""
    with _lock:
        _own[0] = module.partition(".")[0]
        try:
            return _call(module, qualname, args, kwargs)
        finally:
            _own[0] = ""


def _call(module, qualname, args, kwargs):
    """`call` with its package set: the arguments out, callbacks answered, the answer decoded."""
    callbacks = []
    try:
        sent_args = [encode(a, callbacks) for a in args]
        sent_kwargs = {k: encode(v, callbacks) for k, v in kwargs.items()}
    except NotCrossable as e:
        raise _refused(f"argument: {e}") from None
    answer = _exchange({"call": [module, qualname], "args": sent_args, "kwargs": sent_kwargs})
    while "callback" in answer:
        number = answer["callback"]
        if type(number) is not int or not 0 <= number < len(callbacks):
            raise ValueError("a callback that was not passed")
        try:
            result = callbacks[number](*decode(answer.get("args")), **decode(answer.get("kwargs")))
            reply = {"return": encode(result)}
        except NotCrossable as e:
            raise _refused(f"callback result: {e}") from None
        except Exception as e:
            reply = {"raise": type(e).__name__, "message": str(e)[:2000]}
        answer = _exchange(reply)
    if "refused" in answer:
        raise _refused(str(answer["refused"])[:200])
    if "raise" in answer:
        raise _exception(module, str(answer["raise"]), str(answer.get("message", "")))
    if "return" not in answer:
        raise ValueError("a malformed answer")
    changed = answer.get("changed", {})
    for key, after in changed.items() if type(changed) is dict else ():
        target = args[int(key)] if key.isdigit() and int(key) < len(args) else kwargs.get(key)
        apply_mutation(target, after)
    return decode(answer["return"], lambda number: _returned(module, number))


def _returned(module, number):
    """The grader's proxy for a function the episode returned: each call crosses to the episode's process."""

    def returned(*args, **kwargs):
        return call(module, f"$callback:{number}", args, kwargs)

    return returned


# --- the episode's side -------------------------------------------------------------------------


def serve(in_fd, out_fd):
    """Answer calls until the grader is gone: one line in, one line out (callbacks asked before the answer)."""
    import importlib

    reader = os.fdopen(in_fd, "rb", buffering=1 << 16)

    def send(message):
        data = json.dumps(message, allow_nan=False, separators=(",", ":")).encode() + b"\n"
        while data:
            data = data[os.write(out_fd, data) :]

    def receive():
        line = reader.readline()
        if not line:
            os._exit(0)
        return json.loads(line)

    def make_callback(number):
        def callback(*args, **kwargs):
            send({"callback": number, "args": encode(list(args)), "kwargs": encode(kwargs)})
            answer = receive()
            if "raise" in answer:
                raise RuntimeError(f"{answer['raise']}: {answer.get('message', '')}")
            return decode(answer["return"])

        return callback

    returned = []  # the functions answers returned, by number (the grader calls them by it)
    while True:
        request = receive()
        try:
            module, qualname = request["call"]
            _own[0] = module.partition(".")[0]
            if qualname.startswith("$callback:"):
                function = returned[int(qualname.partition(":")[2])]
            else:
                function = importlib.import_module(module)
                for part in qualname.split("."):
                    function = getattr(function, part)
                while hasattr(function, "__wrapped__"):
                    function = function.__wrapped__
            args = [decode(a, make_callback) for a in request["args"]]
            kwargs = {k: decode(v, make_callback) for k, v in request["kwargs"].items()}
        except Exception as e:
            send({"raise": type(e).__name__, "message": str(e)[:2000]})
            continue
        try:
            result = function(*args, **kwargs)
            answer = {"return": encode(result, returned)}
            changed = {}
            for key, before, now in [
                *((str(i), request["args"][i], a) for i, a in enumerate(args)),
                *((k, request["kwargs"][k], v) for k, v in kwargs.items()),
            ]:
                if type(before) is dict and ("$callback" in before or "$iter" in before):
                    continue  # a callback; an iterator the call consumed
                after = encode(now)
                if after != before:
                    changed[key] = after
            answer["changed"] = changed
        except NotCrossable as e:
            answer = {"refused": f"result: {e}"}
        except BaseException as e:
            answer = {"raise": type(e).__name__, "message": str(e)[:2000]}
        send(answer)


if __name__ == "__main__":
    # python -c <this file> SOURCE_ROOT: the episode's process (descriptors 4 in, 3 out).
    sys.path.insert(0, os.path.realpath(sys.argv[1]))
    del sys.argv[1:]
    serve(4, 3)
