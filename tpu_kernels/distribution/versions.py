"""The one grammar of a kernel version's branch: `v<N>`, N a whole number written without leading zeros (`v0`,
`v1`, `v12`; never `v01` or `v+1`). The loader takes a version from exactly these branches and the Hub's pages
list exactly these as versions, so a page never shows a version's commit that `get_kernel(version=N)` would not
load; any other branch (`v01` too) is an ordinary branch to both."""

from __future__ import annotations

import re

VERSION_BRANCH = re.compile(r"v(0|[1-9][0-9]*)")
