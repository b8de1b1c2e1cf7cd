"""Request bodies, read by the handler: after the route's role check, and big ones off the event loop.

Every body route reads its body itself, so a caller without the right token is refused before a
byte of the body is parsed (FastAPI parses a declared body before any dependency runs).

FastAPI parses a body on the event loop, in one piece, and builds every item before the service can
count them: 80 MB of small deltas took 48 s and 1.7 GB while every writer's heartbeat waited. These
routes read the raw bytes instead and :func:`parse` them

- in a worker thread when the body is big (small ones inline: a thread hop costs more than they do),
- in one ``json.loads`` when a byte count proves the list is within its limit, else item by item,
  stopping at the limit instead of building what is refused (and giving the event loop its turn
  between items: one long C call would hold the GIL throughout),
- with strict types: ``true`` or ``"1"`` is not a delta.

The body models in ``schemas.py`` stay the contract: they are published in ``/openapi.json`` for these
routes (``openapi.py``) and give every refusal its wording; deltas that plainly match the model are
taken without building a model object for each (a third of the time of 100k deltas). Small bodies
(:func:`model`) are one ``json.loads`` and the model.
"""

from __future__ import annotations

import asyncio
import json
import json.scanner
import re
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from tally_server.domain import validation
from tally_server.domain.validation import CheckedDeltas, CheckedIds, Limits
from tally_server.http_api import schemas as s

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
WithIds = TypeVar("WithIds", s.AreCompletedBody, s.ImportBody, s.DeclareBody)

# Above this a body is parsed in a worker thread. 100k typical deltas are ~13 MB.
OFF_LOOP_BYTES = 256 * 1024

_WHITESPACE = re.compile(r"[ \t\n\r]*")  # what json.decoder skips between tokens
_DECODER = json.JSONDecoder()


class TooMany(Exception):
    """The body's list holds more items than the limit (counting stopped there)."""


async def parse(request: Request, parser: Callable[[bytes], T]) -> T:
    """``parser(body)``, in a worker thread when the body is big."""
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise HTTPException(400, "the client went away before the whole request body arrived") from None
    if len(raw) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(parser, raw)
    return parser(raw)


def load(raw: bytes, *, items: str, limit: int, mark: bytes, marks_per_item: int) -> Any:
    """``json.loads(raw)``, refusing a top-level list member ``items`` of more than ``limit`` entries.

    Every entry holds at least ``marks_per_item`` bytes ``mark`` (``{`` of an object, the two ``"`` of
    a string), so a body with few enough of them is parsed in one go; otherwise the list is parsed
    one entry at a time, up to the limit.

    Raises:
        TooMany: ``items`` has more than ``limit`` entries (the rest is not parsed).
        ValueError: ``raw`` is not JSON (json.JSONDecodeError, UnicodeDecodeError, a number of
            thousands of digits).
    """
    if raw.count(mark) // marks_per_item <= limit:
        return json.loads(raw)
    text = raw.decode(json.detect_encoding(raw), "surrogatepass")
    # One scanner per call: its key memo is not meant to be shared between threads.
    scan: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(_DECODER)  # type: ignore[arg-type]

    def value(pos: int) -> tuple[Any, int]:
        try:
            return scan(text, pos)
        except StopIteration as stop:
            raise json.JSONDecodeError("Expecting value", text, stop.value) from None

    def skip(pos: int) -> int:
        return _WHITESPACE.match(text, pos).end()  # type: ignore[union-attr]

    def listed(pos: int) -> tuple[list[Any], int]:
        found: list[Any] = []
        pos = skip(pos + 1)
        if text.startswith("]", pos):
            return found, pos + 1
        while len(found) < limit:
            item, pos = value(pos)
            found.append(item)
            pos = skip(pos)
            if text.startswith("]", pos):
                return found, pos + 1
            if not text.startswith(",", pos):
                raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
            pos = skip(pos + 1)
        raise TooMany

    def members(pos: int) -> tuple[dict[str, Any], int]:
        found: dict[str, Any] = {}
        pos = skip(pos + 1)
        if text.startswith("}", pos):
            return found, pos + 1
        while True:
            if not text.startswith('"', pos):
                raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, pos)
            key, pos = value(pos)
            pos = skip(pos)
            if not text.startswith(":", pos):
                raise json.JSONDecodeError("Expecting ':' delimiter", text, pos)
            pos = skip(pos + 1)
            found[key], pos = listed(pos) if key == items and text.startswith("[", pos) else value(pos)
            pos = skip(pos)
            if text.startswith("}", pos):
                return found, pos + 1
            if not text.startswith(",", pos):
                raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
            pos = skip(pos + 1)

    start = skip(0)
    body, end = members(start) if text.startswith("{", start) else value(start)
    end = skip(end)
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return body


def _json(raw: bytes, load_json: Callable[[bytes], Any]) -> Any:
    """``load_json(raw)``, with JSON that is not valid as the same 400 FastAPI gives its own routes."""
    try:
        return load_json(raw)
    except json.JSONDecodeError as exc:
        problem = {"type": "json_invalid", "loc": ("body", exc.pos), "msg": f"JSON decode error: {exc.msg}"}
    except UnicodeDecodeError as exc:
        problem = {"type": "json_invalid", "loc": ("body", exc.start), "msg": "body is not valid UTF-8"}
    except ValueError:  # json's own refusal, e.g. an integer of thousands of digits
        problem = {"type": "json_invalid", "loc": ("body",), "msg": "JSON holds a number too long to read"}
    except RecursionError:
        problem = {"type": "json_invalid", "loc": ("body",), "msg": "JSON nested too deeply to read"}
    raise RequestValidationError([problem])


def _model(model: type[M], data: Any, *where: str | int) -> M:
    """``data`` as ``model``, or a 400 that names the field (``body.deltas.3.delta``)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = [
            {"type": e["type"], "loc": ("body", *where, *e["loc"]), "msg": e["msg"]} for e in exc.errors()
        ]
        raise RequestValidationError(problems) from None


def deltas(raw: bytes, limits: Limits) -> tuple[CheckedDeltas, s.ApplyDeltasBody]:
    """An ApplyDeltas body as a validated batch of ``(task_id, source_id, delta)`` and the rest.

    The rest is the body's other fields (``batch_seq``, ``ordered``), as a model with no batch.
    """
    try:
        body = _json(
            raw,
            lambda b: load(b, items="deltas", limit=limits.max_deltas_per_call, mark=b"{", marks_per_item=1),
        )
    except TooMany:
        raise validation.too_many_deltas(limits) from None
    columns = body.get("columns") if isinstance(body, dict) else None
    if type(columns) is dict and "deltas" not in body:
        task_ids, source_ids, values = (columns.get(k) for k in ("task_ids", "source_ids", "deltas"))
        if _all(task_ids, str) and _all(source_ids, str) and _all(values, int):
            assert task_ids is not None and source_ids is not None and values is not None
            head = _model(s.ApplyDeltasBody, {**body, "columns": _NO_COLUMNS})  # all but the batch
            return validation.delta_columns(task_ids, source_ids, values, limits), head
    items = body.get("deltas") if isinstance(body, dict) else None
    if not isinstance(items, list):
        whole = _model(s.ApplyDeltasBody, body)
        return validation.deltas(whole.batch(), limits), whole
    head = _model(s.ApplyDeltasBody, {**body, "deltas": []})  # everything but the deltas
    batch: list[tuple[str, str, int]] = []
    for i, item in enumerate(items):
        if type(item) is dict:
            task_id, source_id, delta = item.get("task_id"), item.get("source_id"), item.get("delta")
            if type(task_id) is str and type(source_id) is str and type(delta) is int:
                batch.append((task_id, source_id, delta))
                continue
        # Not plainly valid: the model decides, and words the refusal.
        checked = _model(s.DeltaBody, item, "deltas", i)
        batch.append((checked.task_id, checked.source_id, checked.delta))
    return validation.deltas(batch, limits), head


_NO_COLUMNS: dict[str, list[Any]] = {"task_ids": [], "source_ids": [], "deltas": []}


def _all(values: Any, kind: type) -> bool:
    """Whether ``values`` is a list of exactly ``kind`` items (not a subclass: no bool for int)."""
    return type(values) is list and set(map(type, values)) <= {kind}


def source_ids(model: type[WithIds], raw: bytes, limits: Limits) -> tuple[WithIds, CheckedIds]:
    """A body with a ``source_ids`` list (AreCompleted, import): the body and its validated ids."""
    try:
        data = _json(
            raw,
            lambda b: load(
                b, items="source_ids", limit=limits.max_ids_per_query, mark=b'"', marks_per_item=2
            ),
        )
    except TooMany:
        raise validation.too_many_ids(limits) from None
    body = _model(model, data)
    return body, validation.source_ids(body.source_ids, limits)


def model(schema: type[M], raw: bytes) -> M:
    """A body without a list that can be big (OpenWriter, reset) as ``schema``, or a 400 naming the field."""
    return _model(schema, _json(raw, json.loads))


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` of a route whose JSON body is ``model`` (published by ``openapi.customize``)."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
