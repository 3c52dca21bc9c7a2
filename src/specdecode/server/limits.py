"""The server's access and size defaults, in a module free of the server's packages: the
`specdecode` command line reads them to describe `serve`'s flags, and must load where fastapi
and uvicorn are not installed (`pip install specdecode` without the 'serve' extra)."""

from __future__ import annotations

PUBLIC_PATHS = ("/health", "/metrics")  # answered without the key (probes, scrapers)
MAX_BODY_BYTES = 4 << 20  # 4 MiB: a 128k-token prompt as escaped JSON fits with room
