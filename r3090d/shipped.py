"""Files that ship inside the package: the systemd units, the annotated config and the examples.

They live in the checkout under systemd/ and etc/; r3090d/data/ holds links to
them, so a wheel carries copies and an installed r3090d reads them with
importlib.resources, with no checkout at hand.
"""

from __future__ import annotations

import enum
from importlib import resources


class Shipped(enum.Enum):
    """A shipped file, by the name `r3090ctl example` takes; the value is its file name."""

    UNIT = "r3090d.service"
    TEMPLATE_UNIT = "r3090d@.service"
    CONFIG = "r3090d.toml"
    PROMETHEUS_RULES = "prometheus-rules.yml"
    HAPROXY = "haproxy.cfg"

    @property
    def key(self) -> str:
        return self.name.lower().replace("_", "-")


UNITS = (Shipped.UNIT, Shipped.TEMPLATE_UNIT)
# The ExecStart= the shipped units carry: `make install`'s default place.
DEFAULT_EXEC_START = "/opt/r3090d/bin/r3090d"


def text(item: Shipped) -> str:
    return resources.files("r3090d").joinpath("data", item.value).read_text(encoding="utf-8")
