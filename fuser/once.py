"""Values made once per process and key, such as a kernel loaded into a device's context:
looked up without a lock, made under it, so that threads making the same one at once make it
once."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class OncePerKey(Generic[V]):
    def __init__(self) -> None:
        self._made: dict[Hashable, V] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], V]) -> V:
        """The value of `key`, made by make() the first time."""
        found = self._made.get(key)
        if found is None:
            with self._lock:
                found = self._made.get(key)
                if found is None:
                    found = self._made[key] = make()
        return found
