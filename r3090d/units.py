"""Binary byte units, defined once: every MiB and GiB in r3090d is these."""

MIB = 1024**2
GIB = 1024**3
