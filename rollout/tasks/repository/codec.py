"""What crosses the grading boundary of repository tasks, as data: the encoding both sides share (stdlib only; shipped
as text before `crossing.py`'s, which holds the calls and the references).

Each message is JSON with tags, decoded by each side into plain types and its own classes only:
  None, bool, int, float, str, list   as JSON; {"$float": "nan" | "inf" | "-inf"}
  bytes                               {"$bytes": hex}; NotImplemented (a comparison's), Ellipsis {"$const": name}
  tuple, set, frozenset, dict, range  {"$tuple": [...]}, {"$set": [...]}, {"$frozenset": [...]}, {"$dict": [[k, v]...]},
                                      {"$range": [start, stop, step]}
  the same list, dict, set or object  {"$same": number}: the structures of a message are numbered in the order they
  met again (shared, or a cycle)      are met (depth first, a structure before what it holds), like pickle's memo, so
                                      an item and its parent container arrive as one graph, back-references kept
  a structure the grader sent, as the  {"$was": [its number in the call's message, its encoding]} (the episode's answer
  episode's call left it                only): the grader changes its own structure in place (what refers to it, a
                                      test's variable or an item's parent, sees the change)
  an iterator (a generator's values)  {"$iter": [...]} (the episode's results only: decoded as an iterator over them)
  a networkx graph                    {"$graph": [class, graph attributes, [[node, attributes]...],
                                      [[node, [[neighbour, edge attributes or {key: attributes}]...]]...],
                                      the predecessors' order of a directed graph or null]}
  an instance of the project's own class  {"$object": [module, qualname, its builtin base's value or null,
                                      [[attribute, value]...]]}; an enum member {"$enum": [module, qualname, name]}
  a standard library value            {"$value": [name, data]}: datetime's date, time, datetime (with a fixed
                                      offset or none), timedelta; Decimal, Fraction, PurePosixPath and PosixPath, UUID
  a constant of the package           {"$named": [module, name]}: a module's or a class's attribute that is an instance of
                                      the package's class or an `object()` sentinel (tomlkit's `Source.EOF`, a default
                                      argument's `_MISSING`): each side's own, so `is` holds on both
  a function or class of a pure        {"$std": [module, qualname]}: `all`, `str.upper`, `operator.add`, `math.floor`, each
  standard module                     side's own (`PURE_MODULES`, the builtins of `SAFE_BUILTINS`)
  a class                             {"$type": [module, qualname]}: a builtin one or a `collections` one
                                      (`factory=dict`), or the project's own
  anything else                       what the side's `Codec.refer` makes of it (`crossing.py`: {"$ref": number} or
                                      {"$ref": [number, interfaces]}, an object the grader keeps; {"$callback": number},
                                      an object the episode keeps: a function, a translations catalogue),
                                      or `NotCrossable`
The graph classes are the decoding side's own (`Graph`, `DiGraph`, `MultiGraph`, `MultiDiGraph` of its networkx),
filled in the neighbours' order as sent. An object of the project's package (the package of the called function's
module: a `Version`, a cache, a tuple subclass) crosses as its state: the decoding side makes an instance of its own
copy of that class without running its constructor and sets the attributes (instances of module-level classes only;
a member of an enum is the side's own member).
"""

import datetime
import decimal
import json
import math

MAX_DEPTH = 200
MAX_ITEMS = 1_000_000
GRAPHS = ("Graph", "DiGraph", "MultiGraph", "MultiDiGraph")
REDUCED_BASES = (datetime.datetime, datetime.date, datetime.time, datetime.timedelta, decimal.Decimal)
"""Value classes a project's class may derive from (tomlkit's `DateTime`): made from what their `__reduce__` gives."""
OBJECT_BASES = (tuple, list, dict, set, frozenset, str, int, float, *REDUCED_BASES)
"""Builtin bases whose value an object of the project's own class carries besides its attributes."""
# Exceptions an answer may name, re-raised as the receiving side's own (the grader also takes the trusted
# package's own exceptions).
BUILTIN_EXCEPTIONS = (
    *("Exception", "ArithmeticError", "AssertionError", "AttributeError", "IndexError", "KeyError", "LookupError"),
    *("NotImplementedError", "OverflowError", "RecursionError", "RuntimeError", "StopIteration", "TypeError"),
    *("ValueError", "ZeroDivisionError", "UnicodeError", "EOFError", "ImportError", "ModuleNotFoundError", "NameError"),
    *("OSError", "FileNotFoundError", "FileExistsError", "IsADirectoryError", "NotADirectoryError", "PermissionError"),
    "TimeoutError",
)
SHARED_CLASSES = {
    "builtins": (
        *("bool", "bytes", "dict", "float", "frozenset", "int", "list", "object", "set", "str", "tuple", "NoneType"),
        *("map", "filter", "zip", "range", "enumerate", "reversed", "BaseException", *BUILTIN_EXCEPTIONS),
    ),
    "collections": ("Counter", "OrderedDict", "defaultdict", "deque"),
}
"""Classes that cross by name (`factory=dict`, `exceptions=(ValueError,)`), besides the project's own."""
SAFE_BUILTINS = (
    *("abs", "all", "any", "ascii", "bin", "bool", "bytes", "callable", "chr", "dict", "divmod", "enumerate", "filter"),
    *("float", "format", "frozenset", "hash", "hex", "id", "int", "isinstance", "issubclass", "iter", "len", "list"),
    *("map", "max", "min", "next", "oct", "ord", "pow", "range", "repr", "reversed", "round", "set", "slice", "sorted"),
    *("str", "sum", "tuple", "zip", "object", "print", "complex", "bytearray"),
)
"""The interpreter's functions and classes that cross by name (`$std`: a key function `len`, a factory `list`), and
that a reference may be: none that reaches names, modules, files or code (`getattr`, `vars`, `open`, `exec`, `type`)."""
PURE_MODULES = (
    *("operator", "_operator", "math", "cmath", "itertools", "functools", "_functools", "collections", "_collections"),
    *("statistics", "decimal", "_decimal", "fractions", "numbers", "string", "heapq", "_heapq", "bisect", "_bisect"),
    *("datetime", "_datetime", "unicodedata", "textwrap"),
)
"""Standard modules of pure computation whose functions and classes cross by name, each side's own (`operator.add`,
`math.floor`): a function can inspect its signature or compare it by identity (toolz's `_is_arity(1, all)`)."""
_own = [""]
"""The top-level package whose classes cross as their state: the called function's (set per call, on each side)."""


def _values():
    """The standard library's value classes that cross as data: name -> (class, to data, from data)."""
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


class Codec:
    """One message's encoding or decoding: its memo (the structures met so far, numbered in the order met), how
    this side stands for what is not data (`refer`: value -> a tag or None; `resolve`: (tag, number, interfaces) ->
    value) and, for an answer to a call, which structures are the call's arguments' (`origin`: the episode's, id ->
    number in the call; `originals`: the grader's, number -> the structure it sent)."""

    def __init__(self, refer=None, resolve=None, origin=None, originals=None):
        self.numbers = {}  # encoding: id -> (number, the structure, kept alive so that its id is not reused)
        self.met = []  # decoding: number -> the structure (None while it is being built)
        self.refer = refer
        self.resolve = resolve
        self.origin = origin or {}
        self.originals = originals or {}

    def sent(self):
        """The structures this message numbered, by number (the grader's `originals` for the answer)."""
        return {number: structure for number, structure in self.numbers.values()}

    def was(self, value, body):
        """`body`, marked as the call's argument structure it is (an answer's encoding)."""
        number = self.origin.get(id(value))
        return body if number is None else {"$was": [number, body]}

    def first(self, value):
        """{"$same": number} when `value` was met before in this message; else None, and it is numbered."""
        seen = self.numbers.get(id(value))
        if seen is not None:
            return {"$same": seen[0]}
        self.numbers[id(value)] = (len(self.numbers), value)
        return None

    def made(self, value):
        self.met.append(value)
        return value


def _graph_class(value):
    kind = type(value)
    if kind.__name__ in GRAPHS and kind.__module__.startswith("networkx.classes."):
        return kind.__name__
    return None


def _is_own(cls):
    return bool(_own[0]) and cls.__module__.partition(".")[0] == _own[0] and "<" not in cls.__qualname__


def _class_path(cls):
    """The name the other side finds `cls` by in its module: its qualname, or the module-level name a factory bound
    it to (`_CacheInfo = namedtuple("CacheInfo", ...)`)."""
    import sys

    module = sys.modules.get(cls.__module__)
    found = module
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    if found is cls or module is None:
        return cls.__qualname__
    return next((name for name, value in sorted(vars(module).items()) if value is cls), cls.__qualname__)


def encode(value, codec=None, depth=0):
    """`value` as tagged JSON (one message: its structures numbered in `codec`)."""
    codec = Codec() if codec is None else codec
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
                return encode(base(value), codec, depth)
        if kind.__name__.startswith(("int", "uint")):
            return int(value)
        if kind.__name__.startswith("float"):
            return encode(float(value), codec, depth)
    if value is NotImplemented or value is Ellipsis:
        return {"$const": "NotImplemented" if value is NotImplemented else "Ellipsis"}
    if kind is bytes:
        return {"$bytes": value.hex()}
    if kind in (list, dict, set):
        same = codec.first(value)
        if same is not None:
            return same
        if kind is dict:
            return codec.was(value, {"$dict": [[encode(k, codec, depth + 1), encode(v, codec, depth + 1)] for k, v in value.items()]})
        items = [encode(v, codec, depth + 1) for v in value]
        return codec.was(value, items if kind is list else {"$set": items})
    if kind in (tuple, frozenset):
        return {"$" + kind.__name__: [encode(v, codec, depth + 1) for v in value]}
    if kind is range:
        return {"$range": [value.start, value.stop, value.step]}
    name = _graph_class(value)
    if name is not None:
        return {"$graph": encode_graph(name, value, codec, depth)}
    value_base = None if kind in _VALUE_NAMES or _is_own(kind) else next((b for b in REDUCED_BASES if isinstance(value, b)), None)
    if kind in _VALUE_NAMES or value_base is not None:
        # (a value class's subclass from outside the package, freezegun's `FakeDatetime`: its value, as the base's)
        plain = value if value_base is None else _base_value(value, value_base)
        name = _VALUE_NAMES[type(plain)]
        return {"$value": [name, VALUES[name][1](plain)]}
    if kind is type or isinstance(value, type):
        if value.__qualname__ in SHARED_CLASSES.get(value.__module__, ()) or _is_own(value):
            return {"$type": [value.__module__, _class_path(value) if _is_own(value) else value.__qualname__]}
    elif (_is_own(kind) or kind is object) and _constants().get(id(value), (None,))[0] is value:
        return {"$named": _constants()[id(value)][1]}
    elif _is_own(kind):
        return encode_object(value, codec, depth)
    named = _std_name(value)
    if named is not None:
        return {"$std": named}
    tag = codec.refer(value) if codec.refer is not None else None
    if tag is not None:
        return tag
    if kind is not type and not isinstance(value, type) and hasattr(value, "__next__") and hasattr(value, "__iter__"):
        # A generator the episode returns: its values (the grader's iterators are passed by reference).
        items = []
        for item in value:
            items.append(encode(item, codec, depth + 1))
            if len(items) > MAX_ITEMS:
                raise NotCrossable(f"an iterator of more than {MAX_ITEMS} values")
        return {"$iter": items}
    if isinstance(value, type):
        raise NotCrossable(f"the class {value.__module__}.{value.__qualname__}")
    raise NotCrossable(f"a {kind.__module__}.{kind.__qualname__}")


def encode_graph(name, value, codec, depth):
    """A graph's data, in the order `fill_graph` reads it (structures are numbered in that order on both sides)."""
    attributes = encode(dict(value.graph), codec, depth + 1)
    nodes = [[encode(n, codec, depth + 1), encode(dict(a), codec, depth + 1)] for n, a in value._node.items()]
    adjacency = [
        [encode(u, codec, depth + 1), [[encode(v, codec, depth + 2), encode(dict(d), codec, depth + 2)] for v, d in nbrs.items()]]
        for u, nbrs in value._adj.items()
    ]
    predecessors = None
    if "Di" in name:
        predecessors = [[encode(v, codec, depth + 1), [encode(u, codec, depth + 1) for u in preds]] for v, preds in value._pred.items()]
    return [name, attributes, nodes, adjacency, predecessors]


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


def encode_object(value, codec, depth):
    kind = type(value)
    import enum

    if isinstance(value, enum.Enum):
        return {"$enum": [kind.__module__, _class_path(kind), value.name]}
    same = codec.first(value)
    if same is not None:
        return same
    base = _base_of(kind)
    carried = encode(_base_value(value, base), codec, depth + 1) if base is not None else None
    attributes = [[name, encode(v, codec, depth + 1)] for name, v in _attributes(value).items()]
    return codec.was(value, {"$object": [kind.__module__, _class_path(kind), carried, attributes]})


def _base_of(cls):
    return next((b for b in cls.__mro__ if b in OBJECT_BASES), None)


def _base_value(value, base):
    """An object's builtin base's value, as a plain `base`, read by the base's own methods: a subclass's are the
    project's behaviour (tomlkit's `Array` iterates its booleans as `bool`s, its `DateTime` formats itself)."""
    if base in REDUCED_BASES:
        return base(*base.__reduce__(value)[1])
    if base is dict:
        return dict(dict.items(value))
    if base in (list, tuple, set, frozenset):
        return base(base.__iter__(value))
    return {str: str.__str__, int: int.__int__, float: float.__float__}[base](value)


_constants_found = {}


def _constants():
    """The package's constants, found once per set of loaded modules: id -> (the value, [module, name]) for each
    attribute of its modules and their classes that is an instance of one of its classes (not an enum member, which
    crosses by `$enum`) or a plain `object()` sentinel; the first name found for each."""
    import sys

    key = (_own[0], len(sys.modules))
    if key not in _constants_found:
        found = {}
        for name, module in sorted(sys.modules.items(), key=lambda item: item[0]):
            if module is None or name.partition(".")[0] != _own[0] or not _own[0]:
                continue
            for attribute, value in list(vars(module).items()):
                if isinstance(value, type) and value.__module__ == name and "<" not in value.__qualname__:
                    for inner, held in list(vars(value).items()):
                        if _is_constant(held):
                            found.setdefault(id(held), (held, [name, f"{value.__qualname__}.{inner}"]))
                elif _is_constant(value):
                    found.setdefault(id(value), (value, [name, attribute]))
        _constants_found.clear()
        _constants_found[key] = found
    return _constants_found[key]


def _is_constant(value):
    import enum

    return type(value) is object or (_is_own(type(value)) and not isinstance(value, (type, enum.Enum)))


def _named_constant(module, name):
    """This side's constant `module.name` of the package (ValueError for anything else)."""
    found = _of_package(module, name, "a constant")
    if _constants().get(id(found), (None,))[0] is not found:
        raise ValueError(f"not a constant of the project's package: {module}.{name}"[:120])
    return found


def _std_name(value):
    """[module, qualname] of a function, class or method of `SAFE_BUILTINS` or `PURE_MODULES` by which the other side
    finds its own (`all`, `str.upper`, `operator.add`), else None."""
    owner = getattr(value, "__objclass__", None)
    module = getattr(value, "__module__", None) or getattr(owner, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if type(module) is not str or type(qualname) is not str or not callable(value):
        return None
    try:
        return [module, qualname] if _std(module, qualname) is value else None
    except ValueError:
        return None


def _std(module, qualname):
    """This side's `module.qualname` of `SAFE_BUILTINS` or `PURE_MODULES` (ValueError for anything else)."""
    import importlib

    if type(module) is not str or type(qualname) is not str:
        raise ValueError("malformed $std")
    if not (module in PURE_MODULES or (module == "builtins" and qualname.split(".")[0] in SAFE_BUILTINS)):
        raise ValueError(f"not a function of a pure standard module: {module}.{qualname}"[:120])
    found = importlib.import_module(module)
    for part in qualname.split("."):
        if part.startswith("_"):
            raise ValueError(f"not a public name: {module}.{qualname}"[:120])
        found = getattr(found, part)
    return found


def _of_package(module, name, what):
    """This side's `module.name` (a dotted name; None where a part is missing) of a module of the project's package;
    ValueError naming `what` for any other module."""
    import importlib

    if type(module) is not str or type(name) is not str or not _own[0] or module.partition(".")[0] != _own[0]:
        raise ValueError(f"not {what} of the project's package: {str(module)[:80]}")
    found = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part, None)
    return found


def _own_class(module, qualname):
    """This side's class `module.qualname` of the project's package (ValueError for anything else)."""
    found = _of_package(module, qualname, "a class")
    if not isinstance(found, type) or found.__module__.partition(".")[0] != _own[0]:
        raise ValueError(f"not a class of the project's package: {module}.{qualname}"[:120])  # nor one it imports
    return found


def decode_object(body, codec, depth, target=None):
    """An instance of this side's own class, its constructor not run: the builtin base's value, then the attributes;
    or `target` (the grader's own object, `$was`) given that state in place."""
    module, qualname, carried, attributes = body
    slot = len(codec.met)
    codec.made(target)  # numbered before what it holds; a back-reference to it while unbuilt is refused
    cls = _own_class(module, qualname)
    base = _base_of(cls)
    if (carried is None) != (base is None) or type(attributes) is not list or (target is not None and type(target) is not cls):
        raise ValueError("malformed $object")
    if target is not None:
        _set_state(target, base, decode(carried, codec, depth + 1) if base is not None else None)
        for name in set(_attributes(target)) - {pair[0] for pair in attributes if type(pair) is list and pair}:
            object.__delattr__(target, name)
        set_attributes(target, attributes, codec, depth)
        return target
    if base is None:
        made = codec.met[slot] = object.__new__(cls)
    elif base in (list, dict, set):
        made = codec.met[slot] = base.__new__(cls)
        base.__init__(made, decode(carried, codec, depth + 1))
    else:
        value = decode(carried, codec, depth + 1)
        if type(value) is not base:
            raise ValueError("malformed $object")
        made = codec.met[slot] = base.__new__(cls, *(base.__reduce__(value)[1] if base in REDUCED_BASES else (value,)))
    set_attributes(made, attributes, codec, depth)
    return made


def _set_state(target, base, value):
    """The grader's object's builtin base's value made `value` (decoded): a container's contents replaced by the
    base's own methods; an immutable one's must be what it was."""
    if base is None:
        return
    if base in (list, dict, set) and type(value) is base:
        base.clear(target)
        (base.extend if base is list else base.update)(target, value)
    elif type(value) is not base or _base_value(target, base) != value:
        raise RuntimeError(f"the call changed an immutable {type(target).__name__}")


def decode_into(target, node, codec, depth):
    """The grader's structure `target` made what the episode's call left its copy as (`node`), in place."""
    if type(target) is list and type(node) is list:
        codec.made(target)
        items = [decode(v, codec, depth + 1) for v in node]
        target[:] = items
        return target
    ((tag, body),) = node.items() if type(node) is dict and len(node) == 1 else (("", None),)
    if tag == "$object" and type(body) is list and len(body) == 4:
        return decode_object(body, codec, depth, target)
    if type(body) is not list or tag != {dict: "$dict", set: "$set"}.get(type(target)):
        raise ValueError("malformed $was")
    codec.made(target)
    if tag == "$set":
        items = [decode(v, codec, depth + 1) for v in body]
    elif all(type(item) is list and len(item) == 2 for item in body):
        items = [(decode(k, codec, depth + 1), decode(v, codec, depth + 1)) for k, v in body]
    else:
        raise ValueError("malformed $dict")
    target.clear()
    target.update(items)
    return target


LAYOUT = ("__class__", "__dict__", "__weakref__", "__slots__")
"""Attribute names that are an object's type or layout, never its state."""


def set_attributes(target, attributes, codec, depth):
    """The attributes an object's state names (its `__doc__`, `__wrapped__` or `__signature__` too: toolz's `curry`
    keeps them in its `__dict__`), set without the class's `__setattr__`."""
    for pair in attributes:
        if type(pair) is not list or len(pair) != 2 or type(pair[0]) is not str or pair[0] in LAYOUT:
            raise ValueError("malformed $object attributes")
        object.__setattr__(target, pair[0], decode(pair[1], codec, depth + 1))


def decode(node, codec=None, depth=0):
    """The value `node` encodes, built of plain types and this side's own classes (`codec.resolve` for references);
    ValueError on any other shape."""
    codec = Codec() if codec is None else codec
    if depth > MAX_DEPTH:
        raise ValueError("nesting too deep")
    kind = type(node)
    if node is None or kind in (bool, int, str, float):
        if kind is float and not math.isfinite(node):
            raise ValueError("a bare non-finite float")
        return node
    if kind is list:
        made = codec.made([])
        made.extend(decode(v, codec, depth + 1) for v in node)
        return made
    if kind is not dict or len(node) != 1:
        raise ValueError(f"not crossable data: {str(node)[:80]}")
    ((tag, body),) = node.items()
    if tag == "$float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "$const" and body in ("NotImplemented", "Ellipsis"):
        return NotImplemented if body == "NotImplemented" else Ellipsis
    if tag == "$bytes" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "$same" and type(body) is int and 0 <= body < len(codec.met) and codec.met[body] is not None:
        return codec.met[body]
    if tag == "$was" and type(body) is list and len(body) == 2 and type(body[0]) is int and body[0] in codec.originals:
        return decode_into(codec.originals[body[0]], body[1], codec, depth)
    if tag in ("$ref", "$callback") and codec.resolve is not None:
        # {"$ref": [number, interfaces]}: the grader's object is a Mapping, a Sequence... (`crossing.INTERFACES`)
        number, interfaces = (body[0], body[1]) if tag == "$ref" and type(body) is list and len(body) == 2 else (body, [])
        if type(number) is int and type(interfaces) is list and all(type(i) is str for i in interfaces):
            return codec.resolve(tag, number, tuple(interfaces))
    if type(body) is not list:
        raise ValueError(f"malformed {tag}")
    if tag in ("$set", "$dict"):
        made = codec.made(set() if tag == "$set" else {})
        for item in body:
            if tag == "$set":
                made.add(decode(item, codec, depth + 1))
            elif type(item) is list and len(item) == 2:
                key = decode(item[0], codec, depth + 1)
                made[key] = decode(item[1], codec, depth + 1)
            else:
                raise ValueError("malformed $dict")
        return made
    if tag in ("$tuple", "$frozenset", "$iter"):
        items = [decode(v, codec, depth + 1) for v in body]
        return {"$tuple": tuple, "$frozenset": frozenset, "$iter": iter}[tag](items)
    if tag == "$range" and len(body) == 3 and all(type(v) is int for v in body):
        return range(*body)
    if tag == "$object" and len(body) == 4:
        return decode_object(body, codec, depth)
    if tag == "$value" and len(body) == 2 and body[0] in VALUES:
        data = body[1]
        if not (type(data) is str or (type(data) is list and all(type(v) is int for v in data))):
            raise ValueError("malformed $value")
        try:
            return VALUES[body[0]][2](data)
        except (TypeError, ValueError, ArithmeticError) as e:
            raise ValueError(f"malformed $value: {e}") from None
    if tag == "$std" and len(body) == 2:
        try:
            return _std(*body)
        except AttributeError:
            raise ValueError(f"malformed $std: {str(body)[:80]}") from None
    if tag == "$named" and len(body) == 2:
        return _named_constant(*body)
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
        fill_graph(graph, body, codec, depth)
        return graph
    raise ValueError(f"not crossable data: {tag}")


def fill_graph(graph, body, codec, depth):
    """Fill an empty graph of this side's class from its data, in the order sent (neighbours' dicts shared between
    the two directions of an edge, as networkx keeps them)."""
    name, attributes, nodes, adjacency, predecessors = body
    multi, directed = name.startswith("Multi"), "Di" in name
    graph.graph.update(decode(attributes, codec, depth + 1))
    for item in nodes:
        node, data = decode(item[0], codec, depth + 1), decode(item[1], codec, depth + 1)
        if type(data) is not dict:
            raise ValueError("malformed node attributes")
        graph._node[node] = graph.node_attr_dict_factory()
        graph._node[node].update(data)
        graph._adj[node] = graph.adjlist_inner_dict_factory()
        if directed:
            graph._pred[node] = graph.adjlist_inner_dict_factory()
    for u_data, neighbours in adjacency:
        u = decode(u_data, codec, depth + 1)
        for v_data, d in neighbours:
            v = decode(v_data, codec, depth + 2)
            value = decode(d, codec, depth + 2)
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
            v = decode(v_data, codec, depth + 1)
            for u_data in preds:
                u = decode(u_data, codec, depth + 1)
                graph._pred[v][u] = graph._adj[u][v]


def refill_graph(target, value):
    """Make the grader's graph `target` what the episode's call left its copy as (`value`, decoded): graphs cross
    as their data, not numbered, so they are refilled in place."""
    if type(value) is not type(target):
        raise RuntimeError(f"the call changed an argument of type {type(target).__name__} into {type(value).__name__}")
    target.clear()
    target.graph.update(value.graph)
    target._node.update(value._node)
    target._adj.update(value._adj)
    if target.is_directed():
        target._pred.update(value._pred)


def dumps(message):
    return json.dumps(message, allow_nan=False, separators=(",", ":")).encode() + b"\n"
