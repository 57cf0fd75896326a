"""Reading a process's /metrics back: used by the live view, tests and benchmarks."""

from __future__ import annotations

import gzip
import urllib.error
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


class Scrape:
    """One scrape of an endpoint, with lookups by metric name and labels."""

    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples
        self._by_name: dict[str, list[Sample]] | None = None
        self._by_device: dict[tuple[str, str], list[Sample]] | None = None

    def _of(self, name: str, device: str | None) -> list[Sample]:
        """The samples of ``name`` (of ``device``'s label, if given), from indexes built at the
        first lookup: a page of a worker holding thousands of devices has tens of thousands
        of samples, and a live view reads a dozen per device."""
        if self._by_name is None or self._by_device is None:
            self._by_name, self._by_device = {}, {}
            for sample in self.samples:
                self._by_name.setdefault(sample.name, []).append(sample)
                for key, value in sample.labels:
                    if key == "device":
                        self._by_device.setdefault((sample.name, value), []).append(sample)
        if device is None:
            return self._by_name.get(name, [])
        return self._by_device.get((name, device), [])

    @classmethod
    def parse(cls, text: str) -> Scrape:
        out = []
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.append(Sample(s.name, tuple(sorted(s.labels.items())), float(s.value)))
        return cls(out)

    def get(self, name: str, default: float = 0.0, **labels: str) -> float:
        """Sum of samples of ``name`` whose labels include ``labels``."""
        want = set(labels.items())
        found = [s.value for s in self._of(name, labels.get("device")) if want <= set(s.labels)]
        return sum(found) if found else default

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``name`` summed per value of ``label``."""
        out: dict[str, float] = {}
        for s in self._of(name, None):
            key = dict(s.labels).get(label)
            if key is not None:
                out[key] = out.get(key, 0.0) + s.value
        return out


def scrape(url: str, timeout_s: float = 2.0) -> Scrape | None:
    """Fetch and parse ``url``; None if the endpoint is not (yet) reachable.

    Asks for gzip, as Prometheus does (a worker's page shrinks about tenfold): in the edge
    testbed every scrape crosses the worker host's link, which may be 1 Mbit/s."""
    request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            body = resp.read()
            if resp.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            return Scrape.parse(body.decode())
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, EOFError):
        return None
