"""What `python -m gateway` and `python -m worker` share as command lines: flags built from their
config dataclasses (flags.py) and the listening socket bound before serving (listen.py). Not part
of the gateway-worker contract (cachekey/): neither side's requests or keys depend on it.
"""
