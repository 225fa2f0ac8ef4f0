"""The engine core in its own process, and the asyncio client the API server drives it with.

``protocol``: the msgspec messages on the wire; ``remote_errors``: exceptions that cross it;
``handler``: engine calls behind the messages; ``core_proc``: the core's busy loop;
``client``: the server's side (process lifecycle, output dispatch, utility calls).
"""
