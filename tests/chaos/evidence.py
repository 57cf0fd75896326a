"""What the chaos runs report: per device, where every produced record went."""

from __future__ import annotations


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
