"""Blocking list and watch requests, run in threads that the event loop can stop at once.

The ``kubernetes`` client (urllib3) blocks, so each request runs in its own short-lived daemon
thread (:func:`in_thread`) that does I/O and decoding only (:mod:`extproc.kube.wire`) and hands
its results to the loop. Cancelling the awaiting coroutine shuts the open response's socket
(:meth:`Call.abort`), so a read blocked on a quiet watch returns at once and the thread ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import urllib3
from kubernetes import client as k8s_client

from extproc.errors import KubeApiError
from extproc.kube.client import get_stream
from extproc.kube.resources import ResourceType
from extproc.kube.wire import LineSplitter, Oversized, RawObject, WatchEvent, decode_event, decode_page

_T = TypeVar("_T")
_READ_SIZE = 64 * 1024
#: After an abort, how long a thread that already handed over its outcome may take to end.
_JOIN_SECONDS = 0.1

Query = list[tuple[str, str | int | bool]]
#: What a watch hands over, in order: None once the server accepted it, then events (or skips).
Delivery = WatchEvent | Oversized | None


@dataclass(slots=True)
class Call:
    """One blocking request in flight: what stopping it has to close."""

    stopping: threading.Event = field(default_factory=threading.Event)
    response: urllib3.BaseHTTPResponse | None = None

    def abort(self) -> None:
        """From the loop: make a read blocked in the request's thread return now."""
        self.stopping.set()
        response = self.response
        if response is not None:
            with contextlib.suppress(Exception):  # already closed or released: nothing to unblock
                response.shutdown()


async def in_thread(work: Callable[[Call], _T], *, name: str, stop_grace: float) -> _T:
    """Run ``work(call)`` in a daemon thread and return its result on the loop.

    Cancelled, it aborts the call and waits up to ``stop_grace`` seconds for the thread (a request
    still connecting cannot be interrupted; its own timeouts end it), then re-raises.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_T] = loop.create_future()
    call = Call()

    def target() -> None:
        try:
            outcome = functools.partial(_resolve, future, work(call))
        except Exception as exc:  # handed to the awaiting coroutine, which decides
            outcome = functools.partial(_reject, future, exc)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            loop.call_soon_threadsafe(outcome)

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        call.abort()
        await asyncio.wait([future], timeout=stop_grace)
        if future.done():
            future.exception()  # retrieved: the thread's error no longer matters
            thread.join(timeout=_JOIN_SECONDS)  # its last act was handing over the outcome
        raise


def list_all(
    api: k8s_client.ApiClient,
    resource_type: ResourceType,
    namespace: str | None,
    call: Call,
    *,
    page_size: int,
    max_page_bytes: int,
    timeout: tuple[float, float],
) -> tuple[list[RawObject], str]:
    """Every page of a list (``limit`` / ``continue``); the last page's resourceVersion is the list's."""
    items: list[RawObject] = []
    token = ""
    while True:
        query: Query = [("limit", page_size)]
        if token:
            query.append(("continue", token))
        response = _open(api, resource_type, namespace, query, timeout, call)
        page = decode_page(_read_all(response, resource_type, max_page_bytes), resource_type)
        items.extend(page.items)
        token = page.continue_token
        if not token:
            return items, page.resource_version
        if call.stopping.is_set():
            raise KubeApiError(0, f"list {resource_type.name}: stopped")


def watch(
    api: k8s_client.ApiClient,
    resource_type: ResourceType,
    namespace: str | None,
    call: Call,
    deliver: Callable[[Delivery], None],
    *,
    version: str,
    seconds: int,
    max_event_bytes: int,
    timeout: tuple[float, float],
) -> None:
    """Watch from ``version`` for ``seconds`` (server side), handing everything to ``deliver``.

    Returns when the server ends the watch, or after handing over an :class:`Oversized` skip (what
    it hid is lost: only a new list can tell); raises KubeApiError for ERROR events (410 included),
    malformed lines and broken streams, but not for a stream broken by :meth:`Call.abort`.
    """
    query: Query = [
        ("watch", True),
        ("resourceVersion", version),
        ("allowWatchBookmarks", True),
        ("timeoutSeconds", seconds),
    ]
    response = _open(api, resource_type, namespace, query, timeout, call)
    deliver(None)
    splitter = LineSplitter(max_event_bytes)
    try:
        for chunk in _chunks(response):
            for line in splitter.feed(chunk):
                if isinstance(line, Oversized):
                    deliver(line)
                    return  # an event was lost: the caller lists again, so end here
                deliver(decode_event(line, resource_type))
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        if not call.stopping.is_set():
            raise KubeApiError(0, f"watch {resource_type.name}: stream broken: {exc}") from exc
    finally:
        response.close()


def _open(
    api: k8s_client.ApiClient,
    resource_type: ResourceType,
    namespace: str | None,
    query: Query,
    timeout: tuple[float, float],
    call: Call,
) -> urllib3.BaseHTTPResponse:
    path = resource_type.path(namespace)
    if resource_type.label_selector:
        query = [*query, ("labelSelector", resource_type.label_selector)]
    response = get_stream(api, path, query, timeout=timeout)
    call.response = response  # before looking at `stopping`: see Call.abort
    if call.stopping.is_set():
        response.close()
        raise KubeApiError(0, f"GET {path}: stopped")
    return response


def _read_all(response: urllib3.BaseHTTPResponse, resource_type: ResourceType, limit: int) -> bytes:
    body = bytearray()
    try:
        for chunk in _chunks(response):
            body += chunk
            if len(body) > limit:
                raise KubeApiError(0, f"{resource_type.name} list page over {limit} bytes")
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise KubeApiError(0, f"list {resource_type.name}: answer broken: {exc}") from exc
    finally:
        response.close()
    return bytes(body)


def _chunks(response: urllib3.BaseHTTPResponse) -> Iterator[bytes]:
    """Bytes as they arrive: a watch must see each event when it comes, not when a buffer fills."""
    if response.chunked:
        yield from response.read_chunked(decode_content=True)
        return
    while chunk := response.read1(_READ_SIZE):
        yield chunk


def _resolve(future: asyncio.Future[_T], result: _T) -> None:
    if not future.done():
        future.set_result(result)


def _reject(future: asyncio.Future[Any], error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
