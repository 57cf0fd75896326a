"""What the chaos runs report: per device, where every produced record went."""

from __future__ import annotations

from rich.table import Table


def device_accounting(cfg, result) -> dict[str, dict]:
    """Per device (sorted): its worker, produced, read, trained, dropped, dead-lettered,
    pending (buffered or in the sink, not acknowledged) and dead-letter messages."""
    devices = {}
    for device, a in sorted(result.accounting.items()):
        devices[device] = {"worker": next(w for w in cfg.worker_names() if device in cfg.devices_of(w)),
                           "produced": result.produced[device], "read": a["records_in"], "trained": a["consumed"],
                           "dropped": a["dropped"], "dead_lettered": a["dead_records"],
                           "pending": a["buffered"] + a["in_sink"], "dlq_messages": a["dead_letter_messages"]}
    return devices


def accounting_table(title: str, devices: dict[str, dict]) -> Table:
    """``device_accounting`` as a table, one row per device."""
    table = Table(title=title)
    for col in ("device", "worker", "produced", "read", "trained", "dropped", "dead-lettered", "pending", "dlq msgs"):
        table.add_column(col, justify="right")
    for device, d in devices.items():
        table.add_row(device, d["worker"], *(str(d[k]) for k in ("produced", "read", "trained", "dropped",
                                                                  "dead_lettered", "pending", "dlq_messages")))
    return table
