"""The edge testbed: hosts as Linux network namespaces on a bridge, shaped links, faults.

``Testbed.for_job(cfg).up()`` builds it, ``down()`` removes it (also from its state file
or by name prefix after a crash: ``down_by_id``); docs/testbed.md has the picture.
"""

from edgestream.deploy.testbed.links import LinkSpec, parse_link
from edgestream.deploy.testbed.system import NeedsRoot, TestbedError
from edgestream.deploy.testbed.testbed import Host, Testbed, down_all, down_by_id, leftovers

__all__ = ["Host", "LinkSpec", "NeedsRoot", "Testbed", "TestbedError", "down_all", "down_by_id", "leftovers", "parse_link"]
