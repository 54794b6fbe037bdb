"""Plain data across the sandbox's pipes: a JSON encoding that admits only built-in value types.

The candidate's return values cross a process boundary through this codec, so what the checker compares is
always a fresh built-in value: an object with a rigged ``__eq__`` (or a subclass of ``int`` or ``str``) is
refused when encoded, never compared. Types are exact (``type(x) is int``, not ``isinstance``).

Lists are JSON arrays; every other container and the floats JSON lacks are tagged objects:
``{"t": [...]}`` tuple, ``{"s": [...]}`` set, ``{"fs": [...]}`` frozenset, ``{"d": [[k, v], ...]}`` dict
(any plain keys), ``{"b": "hex"}`` bytes, ``{"c": [re, im]}`` complex, ``{"f": "nan" | "inf" | "-inf"}``.
Standard library only: it runs inside the sandbox.
"""

import math

MAX_DEPTH = 100


def encode(value, depth=0):
    """A JSON-serialisable form of ``value``; TypeError if anything in it is not plain data."""
    if depth > MAX_DEPTH:
        raise TypeError("value nested too deeply")
    kind = type(value)
    if value is None or kind is bool or kind is int or kind is str:
        return value
    if kind is float:
        return value if math.isfinite(value) else {"f": repr(value)}
    if kind is list:
        return [encode(v, depth + 1) for v in value]
    if kind is tuple:
        return {"t": [encode(v, depth + 1) for v in value]}
    if kind is set or kind is frozenset:
        return {"s" if kind is set else "fs": [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is complex:
        return {"c": [encode(value.real, depth + 1), encode(value.imag, depth + 1)]}
    raise TypeError(f"not plain data: {kind.__name__}")


def decode(data):
    """The value ``encode`` was given; ValueError on anything ``encode`` cannot have produced."""
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is list:
        return [decode(v) for v in data]
    if type(data) is dict and len(data) == 1:
        ((tag, body),) = data.items()
        if tag == "t":
            return tuple(decode(v) for v in body)
        if tag == "s":
            return {decode(v) for v in body}
        if tag == "fs":
            return frozenset(decode(v) for v in body)
        if tag == "d":
            return {decode(k): decode(v) for k, v in body}
        if tag == "b":
            return bytes.fromhex(body)
        if tag == "c":
            return complex(decode(body[0]), decode(body[1]))
        if tag == "f" and body in ("nan", "inf", "-inf"):
            return float(body)
    raise ValueError(f"not an encoded plain value: {data!r:.80}")
