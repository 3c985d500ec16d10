"""Set members of a JSON object in its bytes, without re-serialising the rest.

    set_members(body, data, {"cache_salt": b'"s"', "max_tokens": b"64"}) -> bytes

`body` is a valid JSON document whose top level is an object, `data` that object decoded (it
says which keys are present); each value is the JSON text of the member's new value.

Algorithm: keys `data` does not hold are appended before the closing brace (the common case:
one slice and one join, whatever the body's size). When a key is present, the object is scanned
member by member: a key is a JSON string, a value is skipped whole (a string by one regular
expression match, a container by walking only its strings and brackets, a scalar up to the next
delimiter), so the scan costs one step per top-level member plus one per string or bracket
inside the values it passes. Every occurrence of a replaced key is dropped (a duplicate key too,
so the result has each key once), the other members are kept byte for byte, and the new members
are appended. Keys are compared decoded (an escaped key matches its plain spelling).

`set_nested(body, data, outer, updates)` does the same one level down (`stream_options`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

_WS = re.compile(rb"[ \t\r\n]*")
_STR = re.compile(rb'"(?:[^"\\]|\\.)*"')
_SCALAR = re.compile(rb"[^,}\]\s]+")
_NEST = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')
_QUOTE, _LBRACK, _LBRACE, _RBRACE, _COMMA = b'"'[0], b"["[0], b"{"[0], b"}"[0], b","[0]


def _ws(buf: bytes, i: int) -> int:
    m = _WS.match(buf, i)
    assert m is not None
    return m.end()


def _value_end(buf: bytes, i: int) -> int:
    c = buf[i]
    if c == _QUOTE:
        m = _STR.match(buf, i)
        assert m is not None
        return m.end()
    if c in (_LBRACK, _LBRACE):
        depth = 0
        for m in _NEST.finditer(buf, i):
            t = buf[m.start()]
            if t == _QUOTE:
                continue
            depth += 1 if t in (_LBRACK, _LBRACE) else -1
            if depth == 0:
                return m.end()
        raise ValueError("unbalanced JSON")
    m = _SCALAR.match(buf, i)
    assert m is not None
    return m.end()


def _key(raw: bytes) -> str:
    inner = raw[1:-1]
    if b"\\" in inner:
        key: str = json.loads(raw)
        return key
    return inner.decode("utf-8")


def members(buf: bytes, start: int) -> tuple[list[tuple[str, int, int, int]], int]:
    """(key, member start, value start, value end) of each member of the object at
    `buf[start]` (a `{`), and the index of its closing brace."""
    out: list[tuple[str, int, int, int]] = []
    i = _ws(buf, start + 1)
    if buf[i] == _RBRACE:
        return out, i
    while True:
        m = _STR.match(buf, i)
        if m is None:
            raise ValueError("a member without a key")
        j = _ws(buf, _ws(buf, m.end()) + 1)  # past the colon
        end = _value_end(buf, j)
        out.append((_key(m.group()), i, j, end))
        k = _ws(buf, end)
        if buf[k] == _COMMA:
            i = _ws(buf, k + 1)
            continue
        if buf[k] != _RBRACE:
            raise ValueError("an object without its closing brace")
        return out, k


def _object(buf: bytes, start: int, present: bool, updates: Mapping[str, bytes]) -> bytes:
    """The object at buf[start:] with `updates` set; `present`: some key is already there."""
    adds = b",".join(json.dumps(k).encode() + b":" + v for k, v in updates.items())
    if not present:
        close = buf.rindex(b"}")
        head = buf[start:close].rstrip()
        sep = b"" if head.endswith(b"{") else b","
        return head + sep + adds + b"}"
    found, _ = members(buf, start)
    kept = [buf[ms:ve] for key, ms, _vs, ve in found if key not in updates]
    return b"{" + b",".join([*kept, adds]) + b"}"


def set_members(body: bytes, data: Mapping[str, Any], updates: Mapping[str, bytes]) -> bytes:
    """`body` with each of `updates` set (see the module docstring)."""
    if not updates:
        return body
    start = body.index(b"{")
    return _object(body, start, any(k in data for k in updates), updates)


def set_nested(
    body: bytes,
    data: Mapping[str, Any],
    outer: str,
    updates: Mapping[str, bytes],
    more: Mapping[str, bytes] | None = None,
) -> bytes:
    """`body` with `updates` set inside its object member `outer` (made when absent or not an
    object), and `more` set at the top level."""
    inner = data.get(outer)
    if isinstance(inner, dict):
        found, _ = members(body, body.index(b"{"))
        span = [(vs, ve) for key, _ms, vs, ve in found if key == outer][-1]  # the last wins
        value = _object(body[span[0] : span[1]], 0, any(k in inner for k in updates), updates)
    else:
        adds = b",".join(json.dumps(k).encode() + b":" + v for k, v in updates.items())
        value = b"{" + adds + b"}"
    return set_members(body, data, {**(more or {}), outer: value})


__all__ = ["members", "set_members", "set_nested"]
